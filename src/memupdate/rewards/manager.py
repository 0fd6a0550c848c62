"""verl reward-loop manager for MemoryUpdate, registered as ``memupdate_memory``.

verl 0.9.1 streams each finished trajectory to a reward worker, which calls :meth:`run_single` with a
one-row ``DataProto``: the dataset row (``extra_info`` has the target question, answer, evidence and
category) and ``tool_extra_fields`` (the agent loop's ``extra_fields``: the store delta). The reward
is :func:`memupdate.rewards.memory.memory_reward` on base vs. base + delta for the memory role, and the
answer's F1 for the QA role of two-stage training (``training_stage`` from the agent loop); all
components become ``reward_extra_info`` (logged per sample by verl).

Settings come from ``reward.custom_reward_function.reward_kwargs`` (verl's own key), with the memory
paths falling back to the environment variables the tools read::

    memories, embeddings, embedding_model   # as in config/tools/memory_tools.yaml
    scorer: answer_recall | evidence_recall | reader | judge
    top_k, other_questions, efficiency: {...}, qa_pool: [train.parquet, ...]
    reader: {base_url, model, ...}, reader_metric: mem0_f1 | locomo_f1, judge: {base_url, model, ...}
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import pyarrow.parquet as pq
from verl import DataProto
from verl.experimental.reward_loop.reward_manager import register
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase

from memupdate import metrics
from memupdate.rewards.memory import MemoryRewardComputer, MemoryRewardConfig, RewardRequest, select_questions
from memupdate.rewards.scorers import (
    AnswerRecallScorer,
    EvidenceRecallScorer,
    JudgeScorer,
    QAItem,
    ReaderScorer,
    Scorer,
)
from memupdate.serving.client import Endpoint, OpenAIClient
from memupdate.tools.memory_tools import DELTA_KEY, manager_from_config

logger = logging.getLogger(__name__)

ENV_KEYS = {"memories": "MEMUPDATE_MEMORIES", "embeddings": "MEMUPDATE_EMBEDDINGS", "embedding_model": "MEMUPDATE_EMBEDDING_MODEL"}
SETTINGS = {
    *ENV_KEYS, "scorer", "top_k", "other_questions", "efficiency", "qa_pool", "reader", "reader_metric", "judge",
    "answer_metric",
}


def answer_score(answer: str | None, item: QAItem, metric: str) -> float:
    """The QA role's score: its answer against the gold answer (0 when it gave none).

    >>> answer_score("7 May 2023", QAItem("q", "7 May 2023", 2), "locomo_f1")
    1.0
    """
    if not answer:
        return 0.0
    if metric == "locomo_f1":
        return metrics.locomo_f1(answer, item.answer, item.category)
    if metric == "mem0_f1":
        return metrics.mem0_f1(answer, item.answer)
    raise ValueError(f"answer_metric must be mem0_f1 or locomo_f1, got {metric!r}")


def reward_settings(config: Any) -> dict[str, Any]:
    """``reward.custom_reward_function.reward_kwargs`` as a plain dict, memory paths filled from the env."""
    reward = config.get("reward", {}) if hasattr(config, "get") else {}
    custom = (reward.get("custom_reward_function") or {}) if reward else {}
    kwargs = dict(custom.get("reward_kwargs") or {})
    unknown = set(kwargs) - SETTINGS
    if unknown:
        raise ValueError(f"unknown memupdate reward settings {sorted(unknown)}; allowed: {sorted(SETTINGS)}")
    for key, env in ENV_KEYS.items():
        kwargs.setdefault(key, os.environ.get(env))
    kwargs["embedding_model"] = kwargs["embedding_model"] or "all-MiniLM-L6-v2"
    return kwargs


def qa_pool(files: list[str]) -> dict[str, list[QAItem]]:
    """Answerable questions per conversation, from LoCoMo row files (for ``other_questions``)."""
    pool: dict[str, list[QAItem]] = defaultdict(list)
    for path in files:
        for info in pq.read_table(path, columns=["extra_info"]).column("extra_info").to_pylist():
            if info["answer"]:
                pool[info["sample_id"]].append(
                    QAItem(info["question"], info["answer"], info["category"], tuple(info["evidence"]))
                )
    return dict(pool)


def _item(extra_info: Mapping[str, Any]) -> QAItem:
    answer = extra_info.get("answer")
    if not answer:
        raise ValueError(
            f"row {extra_info.get('namespace')!r} has no gold answer (category {extra_info.get('category')}); "
            "the memory reward needs one: keep category 5 out of training splits"
        )
    return QAItem(extra_info["question"], answer, int(extra_info["category"]), tuple(extra_info.get("evidence") or ()))


@register("memupdate_memory")
class MemoryRewardManager(RewardManagerBase):
    def __init__(self, config, tokenizer, compute_score=None, reward_router_address=None, reward_model_tokenizer=None, **kwargs):
        super().__init__(config, tokenizer, compute_score)
        self.settings = reward_settings(config)
        self.reward_config = MemoryRewardConfig.from_dict(
            {k: self.settings[k] for k in ("top_k", "other_questions", "efficiency") if self.settings.get(k) is not None}
        )
        self.pool = qa_pool(list(self.settings.get("qa_pool") or [])) if self.reward_config.other_questions else {}
        self._computer: MemoryRewardComputer | None = None
        self._clients: list[OpenAIClient] = []

    async def _make_scorer(self) -> Scorer:
        name = self.settings.get("scorer") or "answer_recall"
        if name == "answer_recall":
            return AnswerRecallScorer()
        if name == "evidence_recall":
            return EvidenceRecallScorer()
        if name not in ("reader", "judge"):
            raise ValueError(f"unknown reward scorer {name!r}")
        reader_client = await OpenAIClient(Endpoint.from_dict(dict(self.settings["reader"]))).__aenter__()
        self._clients.append(reader_client)
        reader = ReaderScorer(reader_client, metric=self.settings.get("reader_metric") or "mem0_f1")
        if name == "reader":
            return reader
        judge_client = await OpenAIClient(Endpoint.from_dict(dict(self.settings["judge"]))).__aenter__()
        self._clients.append(judge_client)
        return JudgeScorer(reader, judge_client)

    async def computer(self) -> MemoryRewardComputer:
        if self._computer is None:
            manager = manager_from_config(self.settings)
            self._computer = MemoryRewardComputer(manager.base, manager.embedder, await self._make_scorer(), self.reward_config)
        return self._computer

    async def run_single(self, data: DataProto) -> dict:
        row = data[-1]
        extra_info = row.non_tensor_batch["extra_info"]
        fields = row.non_tensor_batch.get("tool_extra_fields") or {}
        delta = fields.get(DELTA_KEY)
        if delta is None:
            raise ValueError(
                f"trajectory of {extra_info.get('namespace')!r} carries no '{DELTA_KEY}': run it with the "
                "memupdate_agent loop (or any loop whose tools are memupdate's memory tools)"
            )
        target = _item(extra_info)
        items = [target]
        if self.reward_config.other_questions:
            pool = self.pool.get(extra_info["sample_id"], [])
            items = select_questions(target, pool, self.reward_config.other_questions, extra_info["namespace"])
        computer = await self.computer()
        (result,) = await computer.compute([RewardRequest(extra_info["sample_id"], delta, items)])
        # Two-stage training: the memory role earns the memory reward, the QA role its answer's score.
        stage = fields.get("training_stage") or "memory"
        answer = answer_score(fields.get("qa_answer"), target, self.settings.get("answer_metric") or "mem0_f1")
        score = {"memory": result["score"], "qa": answer, "joint": result["score"] + answer}[stage]
        return {"reward_score": score, "reward_extra_info": {**result, "memory_reward": result["score"], "answer_score": answer, "score": score}}
