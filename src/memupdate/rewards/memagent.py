"""MemAgent's reward: exact match of the boxed final answer, registered with verl as ``memupdate_memagent``.

Upstream (``verl/utils/reward_score/hotpotqa.py``) lower-cased only the last 300 characters, removed every
space before comparing, and logged nothing else. Here the whole reply is searched for its last
``\\boxed{}``, both sides get SQuAD normalisation (case, punctuation, articles, whitespace), and sub-EM and
F1 are logged beside the score so a run shows partial progress the 0/1 reward hides.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from verl import DataProto
from verl.experimental.reward_loop.reward_manager import register
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase

from memupdate import metrics
from memupdate.agents.fields import CHUNKS_KEY, FINAL_KEY, MEMAGENT_REWARD, TRUNCATIONS_KEY
from memupdate.agents.fields import MEMAGENT_ANSWER_KEY as ANSWER_KEY


def memagent_reward(reply: str | None, answers: Sequence[str]) -> dict[str, float]:
    r"""The score (normalised exact match of the last boxed answer against any gold answer) and what is
    logged beside it: sub-EM and SQuAD F1 of the same boxed answer, and whether there was a box at all.

    >>> memagent_reward(r"The band is \boxed{The Beatles}.", ["Beatles"])
    {'score': 1.0, 'exact_match': 1.0, 'sub_em': 1.0, 'f1': 1.0, 'boxed': 1.0}
    >>> memagent_reward("The Beatles", ["Beatles"])["score"]  # no box, no score
    0.0
    """
    if not answers:
        raise ValueError("memagent_reward needs at least one gold answer")
    boxed = metrics.extract_boxed(reply or "")
    if boxed is None:
        return {"score": 0.0, "exact_match": 0.0, "sub_em": 0.0, "f1": 0.0, "boxed": 0.0}
    em = metrics.exact_match(boxed, list(answers))
    return {
        "score": em,
        "exact_match": em,
        "sub_em": metrics.sub_exact_match(boxed, list(answers)),
        "f1": metrics.squad_f1(boxed, list(answers)),
        "boxed": 1.0,
    }


@register(MEMAGENT_REWARD)
class MemAgentRewardManager(RewardManagerBase):
    """Scores a trajectory from its final turn (the last row verl hands over: all turns of a trajectory
    arrive together); memory turns earn nothing of their own and share the final advantage."""

    def __init__(
        self, config, tokenizer, compute_score=None, reward_router_address=None, reward_model_tokenizer=None, **kwargs
    ):
        super().__init__(config, tokenizer, compute_score)

    async def run_single(self, data: DataProto) -> dict[str, Any]:
        row = data[-1]
        fields = row.non_tensor_batch.get("tool_extra_fields") or {}
        if not fields.get(FINAL_KEY):
            raise ValueError(
                "memupdate_memagent scores the final turn of a memagent trajectory, and the last row is not one: "
                "run the rows with agent_name 'memagent'"
            )
        truth = row.non_tensor_batch["reward_model"]["ground_truth"]
        answers = [truth] if isinstance(truth, str) else [str(a) for a in truth]
        result = memagent_reward(fields.get(ANSWER_KEY), answers)
        result.update(chunks=float(fields[CHUNKS_KEY]), memory_truncations=float(fields.get(TRUNCATIONS_KEY) or 0))
        return {"reward_score": result["score"], "reward_extra_info": result}
