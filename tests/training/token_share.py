"""A toy reward a random tiny model can learn: the share of the policy's response tokens among the lowest eighth
of the vocabulary (about 1/8 at random, so every GRPO group has spread to learn from).

Its own file, so that verl's reward workers can load it by path (``reward.reward_manager.source: importlib``);
"""

from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase


class TokenShareReward(RewardManagerBase):
    def __init__(self, config, tokenizer, compute_score=None, **kwargs):
        super().__init__(config, tokenizer, compute_score)

    async def run_single(self, data):
        row = data[-1]
        responses = row.batch["responses"]
        length = int(row.batch["attention_mask"][-responses.size(-1) :].sum())
        tokens = responses[:length]
        # The policy's own tokens only: tool responses and the QA phase's prompt are not its choices.
        if "response_mask" in row.batch.keys():
            tokens = tokens[row.batch["response_mask"][:length].bool()]
        share = float((tokens < len(self.tokenizer) // 8).float().mean()) if len(tokens) else 0.0
        return {"reward_score": share, "reward_extra_info": {"share": share}}


class HalfFlatTokenShareReward(TokenShareReward):
    """The token share for about half the prompts, 0 for every rollout of the others (those whose token ids sum to an
    odd number): their groups are flat, so that a trainer that updates only on groups with spread has some to drop in
    most steps."""

    async def run_single(self, data):
        scored = await super().run_single(data)
        row = data[-1]
        prompt = row.batch["prompts"][row.batch["attention_mask"][: row.batch["prompts"].size(-1)].bool()]
        if int(prompt.sum()) % 2:
            return {"reward_score": 0.0, "reward_extra_info": {"share": 0.0}}
        return scored
