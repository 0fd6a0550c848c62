"""The MemoryUpdate reward: ``r = ΔS * E`` for a gain, ``r = ΔS`` for a loss, with ``ΔS = S(final) - S(initial)``.

``S(M)`` is the QA score of the target question (and optionally of ``k`` other questions of the same
conversation) answered from the top-k memories retrieved from store ``M``, cut to a fixed budget of
``context_chars`` characters of the lines the reader is shown (:func:`memupdate.prompts.within_budget`, the
one function the QA prompt uses too): a store is scored on how much it helps within the same amount of
text, so longer memories cannot buy a higher S, and on exactly the text the reader reads, so a change the
reader cannot see scores exactly 0. ``E`` is the
efficiency factor (:mod:`memupdate.rewards.efficiency`); it scales gains only, unless
``efficiency.apply_to: always`` (upstream's product, under which bloating a store softened a
penalty). The initial store is the conversation's base memories and
the final store is base + the trajectory's delta: two different objects. Upstream scored one store
against itself, so its reward was almost always 0 (``upstream-systems.md`` §1h). A question-agnostic
ingestion episode (:mod:`memupdate.data.ingestion`) is scored the same way on the questions whose evidence
its store has seen, against a named baseline store (:func:`baseline_sessions`).

:func:`memory_reward` scores one trajectory. :class:`MemoryRewardComputer` scores many at once: it
embeds every new memory text and every question of the batch in one call (embedding is the cost that
matters) and reuses question vectors across the GRPO rollouts of one prompt.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from memupdate.memory.embedder import Embedder
from memupdate.memory.store import BaseStore, Hit, TrialStore
from memupdate.prompts import memory_line, within_budget
from memupdate.rewards.efficiency import EfficiencyConfig, apply_efficiency, efficiency_factor
from memupdate.rewards.scorers import QAItem, Retrieved, Scorer
from memupdate.settings import RewardSettings
from memupdate.utils.seeding import seeded_random

logger = logging.getLogger(__name__)


#: Characters of the reader's context S is scored on (each memory as its rendered line, date included):
#: top_k (5) x 130. A LoCoMo observation's line averages 116 characters (p90 148, longest 209); the
#: initial top-5 of a question fits in 650 for 93% of the 1,542 answerable questions of the ten
#: conversations (as 500 characters of content alone did for 91%).
DEFAULT_CONTEXT_CHARS = RewardSettings.context_chars


@dataclass(frozen=True)
class MemoryRewardConfig:
    #: Memories retrieved per question (upstream: 5).
    top_k: int = RewardSettings.top_k
    #: Budget of retrieved text per question: the top_k hits are kept in rank order while their contents
    #: fit (the first always, cut if longer). Also the QA phase's and evaluation's context budget.
    context_chars: int = DEFAULT_CONTEXT_CHARS
    #: Other questions of the same conversation averaged into S, so memory is rewarded for answering
    #: tomorrow's questions too, not only the target one. 0 = the target question only.
    other_questions: int = 0
    efficiency: EfficiencyConfig = field(default_factory=EfficiencyConfig)
    #: Subtracted from the reward of a trajectory that edited the store and gained nothing (ΔS <= 0), so that
    #: stopping is strictly best where nothing is missing: without it an edit the reader cannot tell from the
    #: original ties with stopping, and GRPO learnt to edit as such (docs/cpu-demo.md). 0 = no cost.
    idle_edit_cost: float = 0.0

    def __post_init__(self) -> None:
        if self.top_k < 1 or self.other_questions < 0:
            raise ValueError(f"top_k must be >= 1 and other_questions >= 0, got {self.top_k}, {self.other_questions}")
        if self.idle_edit_cost < 0:
            raise ValueError(f"idle_edit_cost is a cost, >= 0, got {self.idle_edit_cost}")
        if self.context_chars < 1:
            raise ValueError(f"context_chars must be >= 1, got {self.context_chars}")

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> MemoryRewardConfig:
        spec = dict(spec)
        efficiency = EfficiencyConfig(**spec.pop("efficiency", {}))
        return cls(efficiency=efficiency, **spec)

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> MemoryRewardConfig:
        """From a reward section (:class:`~memupdate.settings.RewardSettings`' keys, the scorer's among them): the
        keys that shape the reward of a store delta, those unset taking their defaults.

        >>> MemoryRewardConfig.from_settings({"scorer": "evidence_recall", "top_k": 3, "context_chars": None}).top_k
        3
        """
        keys = ("top_k", "context_chars", "other_questions", "efficiency", "idle_edit_cost")
        return cls.from_dict({k: settings[k] for k in keys if settings.get(k) is not None})


def to_retrieved(hit: Hit) -> Retrieved:
    record = hit.record
    return Retrieved(record.content, date=record.date, speaker=record.speaker, evidence=record.evidence)


def total_chars(store: TrialStore) -> int:
    return sum(len(record.content) for record in store.records())


def retrieve(
    store: TrialStore, query_vectors: np.ndarray, top_k: int, context_chars: int = DEFAULT_CONTEXT_CHARS
) -> list[list[Retrieved]]:
    """Per question, what S reads of ``store``: its top-k memories within the reader's budget."""
    return [within_budget([to_retrieved(h) for h in store.search(v, top_k)], context_chars) for v in query_vectors]


def context_sizes(retrieved: Sequence[Sequence[Retrieved]]) -> list[int]:
    """Characters of the reader's context (the memories' lines), per question."""
    return [sum(len(memory_line(r)) for r in hits) for hits in retrieved]


def written_lengths(store: TrialStore) -> dict[str, float]:
    """Count and length in characters (max, mean) of the memories the trajectory wrote under new ids.

    >>> import numpy as np
    >>> from memupdate.memory.store import BaseStore
    >>> trial = TrialStore(BaseStore("s", [], np.empty((0, 2), np.float32)))
    >>> written_lengths(trial)
    {'created_count': 0.0, 'created_chars_max': 0.0, 'created_chars_mean': 0.0}
    >>> _ = trial.create("Ana keeps bees", vector=np.array([1.0, 0.0]))
    >>> written_lengths(trial)["created_chars_max"]
    14.0
    """
    lengths = [len(record.content) for record in store.created()]
    return {
        "created_count": float(len(lengths)),
        "created_chars_max": float(max(lengths, default=0)),
        "created_chars_mean": statistics.fmean(lengths) if lengths else 0.0,
    }


async def memory_reward(
    initial: TrialStore,
    final: TrialStore,
    items: Sequence[QAItem],
    query_vectors: np.ndarray,
    scorer: Scorer,
    config: MemoryRewardConfig = MemoryRewardConfig(),
    answers: Sequence[str | None] | None = None,
) -> dict[str, float]:
    """The reward of one trajectory and its components. ``items[0]`` is the target question.

    ``answers`` are answers already given from the final store, per question (None: the scorer asks), for
    the scorers that ask a served model (reader, judge): two-stage training's QA phase answered the
    target there with the reader's model and prompt.

    A question whose retrieved memories are the same in both stores keeps its initial score: the QA model
    would see the same prompt, so it is neither asked again nor scored on a second sample of the same
    answer. A trajectory that changed nothing therefore scores exactly 0; one that edited and gained nothing
    pays ``config.idle_edit_cost`` besides any loss. Besides S and E, the components
    log what the trajectory wrote (``created_*``: count and length of its new memories) and how much text
    S was scored on (``context_chars_*``: mean per question).
    """
    if initial is final:
        raise ValueError("initial and final must be different stores (upstream's always-zero reward bug)")
    if len(items) != len(query_vectors) or not items:
        raise ValueError(f"need one query vector per question, got {len(items)} items, {len(query_vectors)} vectors")
    if answers is not None and len(answers) != len(items):
        raise ValueError(f"need one answer (or None) per question, got {len(answers)} for {len(items)} questions")
    seen_before = retrieve(initial, query_vectors, config.top_k, config.context_chars)
    seen_after = retrieve(final, query_vectors, config.top_k, config.context_chars)
    before = await scorer.score(items, seen_before)
    after = list(before)
    changed = [i for i, (old, new) in enumerate(zip(seen_before, seen_after, strict=True)) if old != new]
    if changed:
        given = {} if answers is None else {"answers": [answers[i] for i in changed]}
        scores = await scorer.score([items[i] for i in changed], [seen_after[i] for i in changed], **given)
        for i, score in zip(changed, scores, strict=True):
            after[i] = score
    chars_before, chars_after = context_sizes(seen_before), context_sizes(seen_after)
    s_initial, s_final = statistics.fmean(before), statistics.fmean(after)
    factors = efficiency_factor(len(initial), total_chars(initial), len(final), total_chars(final), config.efficiency)
    ops = {f"ops_{name}": float(n) for name, n in final.stats().items() if name not in ("initial_count", "final_count")}
    idle_edit = sum(ops.values()) > 0 and s_final <= s_initial
    cost = config.idle_edit_cost if idle_edit else 0.0
    return {
        "score": apply_efficiency(s_final - s_initial, factors["efficiency"], config.efficiency) - cost,
        "idle_edit_cost": cost,
        "qa_initial": s_initial,
        "qa_final": s_final,
        "qa_delta": s_final - s_initial,
        "target_initial": before[0],
        "target_final": after[0],
        "n_questions": float(len(items)),
        "memories_initial": float(len(initial)),
        "memories_final": float(len(final)),
        "context_chars_initial": statistics.fmean(chars_before),
        "context_chars_final": statistics.fmean(chars_after),
        **written_lengths(final),
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
    rng = seeded_random(seed_key)
    return [target, *rng.sample(others, min(k, len(others)))]


#: An ingestion session's baselines (``reward.ingestion_baseline``): the sessions the initial store has seen.
INGESTION_BASELINES = {"append": 0, "before": 1}


def baseline_sessions(session: int, baseline: str) -> int:
    """The sessions S(initial) sees for an ingestion episode of ``session``: ``append``, the reference store
    the episode started from (every memory up to ``session``, as the table has them: an episode that edits
    nothing scores 0, so only edits that beat adding the memories as they are pay); ``before``, the store
    before the session (its memories count as gain, so adding them unedited pays).

    >>> baseline_sessions(5, "append"), baseline_sessions(5, "before")
    (5, 4)
    """
    if baseline not in INGESTION_BASELINES:
        raise ValueError(f"ingestion baseline must be one of {sorted(INGESTION_BASELINES)}, got {baseline!r}")
    return session - INGESTION_BASELINES[baseline]


@dataclass(frozen=True)
class RewardRequest:
    """One trajectory to score: its conversation, its store delta, the questions for S and any answers
    already given from the final store (see :func:`memory_reward`). ``initial_sessions`` limits the initial
    store to the conversation's memories up to that session (an ingestion episode's baseline,
    :func:`baseline_sessions`); None: all of them."""

    sample_id: str
    delta: Mapping[str, Any]
    items: Sequence[QAItem]
    answers: Sequence[str | None] | None = None
    initial_sessions: int | None = None


class MemoryRewardComputer:
    """Scores batches of trajectories with one embedding call per batch."""

    def __init__(
        self,
        base_for: Callable[[str], BaseStore],
        embedder: Embedder,
        scorer: Scorer,
        config: MemoryRewardConfig = MemoryRewardConfig(),
        query_cache_size: int = 65_536,
        max_content_chars: int | None = None,
    ):
        self.base_for = base_for
        # The memory tools' cap (memory.max_content_chars): a delta's text beyond it was not written by them.
        self.max_content_chars = max_content_chars
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
        new_texts = [
            TrialStore.delta_texts(base, r.delta, self.max_content_chars)
            for base, r in zip(bases, requests, strict=True)
        ]
        questions = [item.question for r in requests for item in r.items]
        vectors = await self._embed([*questions, *(t for texts in new_texts for t in texts)])
        self._remember_queries(vectors, questions)

        async def one(base: BaseStore, request: RewardRequest, texts: list[str]) -> dict[str, float]:
            final = TrialStore.from_delta_vectors(base, request.delta, [vectors[t] for t in texts])
            queries = np.stack([vectors[item.question] for item in request.items])
            initial = TrialStore(base, sessions=request.initial_sessions)
            return await memory_reward(
                initial, final, request.items, queries, self.scorer, self.config, request.answers
            )

        return list(await asyncio.gather(*(one(b, r, t) for b, r, t in zip(bases, requests, new_texts, strict=True))))
