"""The MemoryUpdate reward: ``r = (S(final) - S(initial)) * E``.

``S(M)`` is the QA score of the target question (and optionally of ``k`` other questions of the same
conversation) answered from the top-k memories retrieved from store ``M``; ``E`` is the efficiency
factor (:mod:`memupdate.rewards.efficiency`). The initial store is the conversation's base memories and
the final store is base + the trajectory's delta: two different objects. Upstream scored one store
against itself, so its reward was almost always 0 (``upstream-systems.md`` §1h).

:func:`memory_reward` scores one trajectory. :class:`MemoryRewardComputer` scores many at once: it
embeds every new memory text and every question of the batch in one call (embedding is the cost that
matters) and reuses question vectors across the GRPO rollouts of one prompt.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import statistics
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from memupdate.memory.embedder import Embedder
from memupdate.memory.store import BaseStore, Hit, TrialStore
from memupdate.rewards.efficiency import EfficiencyConfig, efficiency_factor
from memupdate.rewards.scorers import QAItem, Retrieved, Scorer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryRewardConfig:
    #: Memories retrieved per question (upstream: 5).
    top_k: int = 5
    #: Other questions of the same conversation averaged into S, so memory is rewarded for answering
    #: tomorrow's questions too, not only the target one. 0 = the target question only.
    other_questions: int = 0
    efficiency: EfficiencyConfig = field(default_factory=EfficiencyConfig)

    def __post_init__(self) -> None:
        if self.top_k < 1 or self.other_questions < 0:
            raise ValueError(f"top_k must be >= 1 and other_questions >= 0, got {self.top_k}, {self.other_questions}")

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> MemoryRewardConfig:
        spec = dict(spec)
        efficiency = EfficiencyConfig(**spec.pop("efficiency", {}))
        return cls(efficiency=efficiency, **spec)


def to_retrieved(hit: Hit) -> Retrieved:
    record = hit.record
    return Retrieved(record.content, date=record.date, speaker=record.speaker, evidence=record.evidence)


def total_chars(store: TrialStore) -> int:
    return sum(len(record.content) for record in store.records())


async def score_store(
    store: TrialStore, items: Sequence[QAItem], query_vectors: np.ndarray, scorer: Scorer, top_k: int
) -> list[float]:
    """``S`` per question: the scorer's score of each question against its top-k memories in ``store``."""
    retrieved = [[to_retrieved(h) for h in store.search(vector, top_k)] for vector in query_vectors]
    return await scorer.score(items, retrieved)


async def memory_reward(
    initial: TrialStore,
    final: TrialStore,
    items: Sequence[QAItem],
    query_vectors: np.ndarray,
    scorer: Scorer,
    config: MemoryRewardConfig = MemoryRewardConfig(),
) -> dict[str, float]:
    """The reward of one trajectory and its components. ``items[0]`` is the target question.

    A trajectory that changed nothing scores exactly 0: the two stores retrieve the same memories.
    """
    if initial is final:
        raise ValueError("initial and final must be different stores (upstream's always-zero reward bug)")
    if len(items) != len(query_vectors) or not items:
        raise ValueError(f"need one query vector per question, got {len(items)} items, {len(query_vectors)} vectors")
    before, after = await asyncio.gather(
        score_store(initial, items, query_vectors, scorer, config.top_k),
        score_store(final, items, query_vectors, scorer, config.top_k),
    )
    s_initial, s_final = statistics.fmean(before), statistics.fmean(after)
    factors = efficiency_factor(len(initial), total_chars(initial), len(final), total_chars(final), config.efficiency)
    ops = {f"ops_{name}": float(n) for name, n in final.stats().items() if name not in ("initial_count", "final_count")}
    return {
        "score": (s_final - s_initial) * factors["efficiency"],
        "qa_initial": s_initial,
        "qa_final": s_final,
        "qa_delta": s_final - s_initial,
        "target_initial": before[0],
        "target_final": after[0],
        "n_questions": float(len(items)),
        "memories_initial": float(len(initial)),
        "memories_final": float(len(final)),
        **factors,
        **ops,
    }


def select_questions(target: QAItem, pool: Sequence[QAItem], k: int, seed_key: str) -> list[QAItem]:
    """The target followed by ``k`` other questions of its conversation, chosen reproducibly from
    ``seed_key`` (the row's namespace), so every rollout of a prompt is scored on the same questions.

    >>> qs = [QAItem(f"q{i}", "a") for i in range(5)]
    >>> select_questions(qs[0], qs, 2, "ns") == select_questions(qs[0], qs, 2, "ns")
    True
    """
    others = [q for q in pool if q.question != target.question]
    rng = random.Random(int(hashlib.sha256(seed_key.encode()).hexdigest()[:16], 16))
    return [target, *rng.sample(others, min(k, len(others)))]


@dataclass(frozen=True)
class RewardRequest:
    """One trajectory to score: its conversation, its store delta and the questions for S."""

    sample_id: str
    delta: Mapping[str, Any]
    items: Sequence[QAItem]


class MemoryRewardComputer:
    """Scores batches of trajectories with one embedding call per batch."""

    def __init__(
        self,
        base_for: Callable[[str], BaseStore],
        embedder: Embedder,
        scorer: Scorer,
        config: MemoryRewardConfig = MemoryRewardConfig(),
        query_cache_size: int = 65_536,
    ):
        self.base_for = base_for
        self.embedder = embedder
        self.scorer = scorer
        self.config = config
        self._query_cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._query_cache_size = query_cache_size

    async def _embed(self, texts: Sequence[str]) -> dict[str, np.ndarray]:
        """Vectors for ``texts``; questions are cached across batches, memory texts are not (they are new
        in nearly every trajectory)."""
        unique = list(dict.fromkeys(texts))
        todo = [t for t in unique if t not in self._query_cache]
        vectors = await self.embedder.aencode(todo) if todo else np.empty((0, self.embedder.dim), np.float32)
        found = dict(zip(todo, vectors, strict=True))
        found.update({t: self._query_cache[t] for t in unique if t in self._query_cache})
        return found

    def _remember_queries(self, vectors: Mapping[str, np.ndarray], questions: Sequence[str]) -> None:
        for question in questions:
            self._query_cache[question] = vectors[question]
            self._query_cache.move_to_end(question)
        while len(self._query_cache) > self._query_cache_size:
            self._query_cache.popitem(last=False)

    async def compute(self, requests: Sequence[RewardRequest]) -> list[dict[str, float]]:
        bases = [self.base_for(r.sample_id) for r in requests]
        new_texts = [TrialStore.delta_texts(base, r.delta) for base, r in zip(bases, requests, strict=True)]
        questions = [item.question for r in requests for item in r.items]
        vectors = await self._embed([*questions, *(t for texts in new_texts for t in texts)])
        self._remember_queries(vectors, questions)

        async def one(base: BaseStore, request: RewardRequest, texts: list[str]) -> dict[str, float]:
            final = TrialStore.from_delta_vectors(base, request.delta, [vectors[t] for t in texts])
            queries = np.stack([vectors[item.question] for item in request.items])
            return await memory_reward(TrialStore(base), final, request.items, queries, self.scorer, self.config)

        return list(
            await asyncio.gather(*(one(b, r, t) for b, r, t in zip(bases, requests, new_texts, strict=True)))
        )
