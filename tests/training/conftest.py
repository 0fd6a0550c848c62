"""Shared pieces of the local-backend tests: a toy reward a tiny random model can learn, and run configs."""

import pytest
from verl.experimental.reward_loop.reward_manager import register
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase

from memupdate.memory.environment import MemoryEnvironment
from memupdate.tools.config import TOOL_CONFIG
from memupdate.training.local import LocalGRPOConfig


@register("test_token_share")
class TokenShareReward(RewardManagerBase):
    """A toy reward a random tiny model can learn: the share of response tokens among the lowest eighth
    of the vocabulary (about 1/8 at random, so every GRPO group has spread to learn from)."""

    def __init__(self, config, tokenizer, compute_score=None, **kwargs):
        super().__init__(config, tokenizer, compute_score)

    async def run_single(self, data):
        row = data[-1]
        length = int(row.batch["attention_mask"][-row.batch["responses"].size(-1) :].sum())
        tokens = row.batch["responses"][:length]
        share = float((tokens < len(self.tokenizer) // 8).float().mean()) if length else 0.0
        return {"reward_score": share, "reward_extra_info": {"share": share}}


#: The reward of HalfConstantReward's constant groups.
HALF_CONSTANT_REWARD = 0.5


@register("test_half_constant")
class HalfConstantReward(TokenShareReward):
    """The token share, except a constant for questions of even length: some groups have reward spread, some
    none."""

    async def run_single(self, data):
        if len(data[-1].non_tensor_batch["extra_info"]["question"]) % 2 == 0:
            return {"reward_score": HALF_CONSTANT_REWARD, "reward_extra_info": {"share": 0.0}}
        return await super().run_single(data)


@pytest.fixture(scope="module")
def tiny_model(tiny_models):
    return tiny_models / "policy"


@pytest.fixture()
def grpo_config(tmp_path, locomo_rows, cache_dir):
    """``grpo_config(model, run_dir=..., **settings)``: a small MemoryUpdate run on conv-26's rows."""

    def make(model, run_dir=None, **overrides) -> LocalGRPOConfig:
        base = dict(
            model_path=str(model),
            train_files=[str(locomo_rows["train"])],
            run_dir=str(run_dir or tmp_path / "run"),
            tool_config=str(TOOL_CONFIG),
            memory=MemoryEnvironment(memories=locomo_rows["memories"], embeddings=cache_dir),
            prompts_per_step=2,
            rollout_n=4,
            max_new_tokens=16,
            prompt_length=4096,
            response_length=128,
            max_assistant_turns=2,
            max_rows=8,
            reward={"efficiency": {"max_total_memories": None}},
        )
        return LocalGRPOConfig(**{**base, **overrides})

    return make
