"""Records of a rollout's episodes, one per trajectory: what the held-out policy evaluation
(:mod:`memupdate.eval.policy`) and the cold start's demonstrations (:mod:`memupdate.training.sft`) write."""

from __future__ import annotations

from typing import Any

import numpy as np
from verl import DataProto

from memupdate.rollout.workers import FINAL_MASK_KEY, TRAJECTORY_KEY

#: Reward components kept per episode (the memory reward manager's extras).
COMPONENTS = (
    "qa_initial",
    "qa_final",
    "ops_created",
    "ops_updated",
    "ops_deleted",
    "ops_merged",
    "ops_split",
    "memories_final",
)


def episode_records(batch: DataProto, prompts: DataProto, tokenizer: Any) -> list[dict[str, Any]]:
    """One record per episode of ``batch`` (the rollouts of ``prompts``)."""
    final = batch.non_tensor_batch[FINAL_MASK_KEY].astype(bool)
    scores = batch.batch["rm_scores"].sum(-1)
    extra = batch.non_tensor_batch
    out = []
    for i in np.flatnonzero(final):
        mask = batch.batch["response_mask"][i]
        length = int(batch.batch["attention_mask"][i, -mask.size(0) :].sum())
        # The loop appends tool output (mask 0) only after it parsed a call in the model's reply.
        tool_ran = bool((mask[:length] == 0).any())
        policy_text = tokenizer.decode(batch.batch["responses"][i][mask.bool()], skip_special_tokens=False)
        info = prompts.non_tensor_batch["extra_info"][extra[TRAJECTORY_KEY][i]]
        record = {
            "namespace": info["namespace"],
            # A question episode's question, or an ingestion episode's session (it has no question).
            "question": info.get("question"),
            "session": info.get("session"),
            "reward": float(scores[i]),
            "well_formed_call": tool_ran,
            "tool_calls": policy_text.count("<tool_call>"),
            "termination": str(extra["termination_reason"][i]),
            "policy_tokens": int(mask.sum()),
            "policy_text": policy_text,
        }
        record.update({k: _plain(extra[k][i]) for k in COMPONENTS if k in extra})
        out.append(record)
    return out


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value
