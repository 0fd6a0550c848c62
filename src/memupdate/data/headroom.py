"""Questions with headroom: where a memory edit can bring the reader evidence it does not read.

For most LoCoMo questions the reader's context (the top ``top_k`` memories of the question's search within
``context_chars``, :func:`memupdate.prompts.within_budget`) already holds a memory citing the gold evidence,
or no memory cites it anywhere; there every edit made without the gold can only lose, and stopping is right.
A question has *headroom* where a memory citing gold evidence the context lacks lies in the question's own
search (its top ``search_top_k``) but outside the context: bringing that memory into view raises
``evidence_recall`` (``reward-headroom.md``: promoted in place, +0.458 on those questions; 17% of conv-26,
conv-30 and conv-47's questions, 21% over ten conversations).

This module is the one definition: :func:`missing_evidence_rank` reads a ranked list of memories (the
search's, as the store ranks it or as the search tool shows it), so the rows' selection
(:func:`write_headroom_rows`), the cold-start expert and the reports agree. It reads the gold evidence ids,
which the policy never sees: they select rows and guide the expert, and never reach a prompt. :func:`key_words`
writes the promotion that brings a memory into a question's view (the question's key words in front of its text),
as the expert and ``memupdate bench headroom`` (:mod:`memupdate.bench.headroom`) play it.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from memupdate.data.locomo import answerable
from memupdate.memory.cache import EmbeddingCache
from memupdate.memory.embedder import Embedder
from memupdate.memory.store import BaseStore, TrialStore, content_words
from memupdate.prompts import within_budget
from memupdate.utils.io import ROWS_TABLE, atomic_outputs, read_parquet_columns
from memupdate.utils.seeding import seeded_random

logger = logging.getLogger(__name__)


class Ranked(Protocol):
    """A memory as the reader is shown it: text, date and the evidence it cites."""

    @property
    def content(self) -> str: ...

    @property
    def date(self) -> str | None: ...

    @property
    def evidence(self) -> Iterable[str]: ...


def missing_evidence_rank(
    ranked: Sequence[Ranked], evidence: Iterable[str], top_k: int, context_chars: int
) -> int | None:
    """The position in ``ranked`` (0-based, in rank order) of the first memory outside the reader's context
    that cites gold ``evidence`` the context does not cite; None where there is none (the context already
    cites all the evidence the list holds, or the list holds none). The context is the leading ``top_k``
    memories within ``context_chars`` (:func:`memupdate.prompts.within_budget`).

    >>> from memupdate.rewards.scorers import Retrieved
    >>> ranked = [Retrieved("a" * 60, evidence=("D1:1",)), Retrieved("b" * 60), Retrieved("c", evidence=("D2:2",))]
    >>> missing_evidence_rank(ranked, ["D2:2"], top_k=2, context_chars=200)
    2
    >>> missing_evidence_rank(ranked, ["D2:2"], top_k=5, context_chars=200) is None  # read already
    True
    >>> missing_evidence_rank(ranked, ["D2:2"], top_k=5, context_chars=100)  # out of the budget
    2
    >>> missing_evidence_rank(ranked, ["D1:1"], top_k=1, context_chars=100) is None  # cited in the context
    True
    """
    wanted = set(evidence)
    context = within_budget(list(ranked[:top_k]), context_chars)
    missing = wanted - {e for memory in context for e in memory.evidence}
    for position in range(len(context), len(ranked)):
        if missing & set(ranked[position].evidence):
            return position
    return None


#: Words that ask rather than name (a question's, beside the common words content_words leaves out).
_ASKING = frozenset("what when where who whom whose which why how does go went".split())


def key_words(question: str, content: str, max_chars: int) -> str | None:
    """The words that promote a memory's ``content`` for ``question``: the question's content words in order, each
    once (those the text already has included), as many as fit in front of the text within ``max_chars``
    (``manage_memory``'s ``keywords``: "<keywords>: <content>"); None where none fits.

    >>> key_words("When did Caroline go to the LGBTQ support group?", "Caroline attended a meeting.", 300)
    'Caroline LGBTQ support group'
    >>> key_words("When did Caroline go to the LGBTQ support group?", "Caroline attended a meeting.", 45)
    'Caroline LGBTQ'
    >>> key_words("When did Caroline go?", "x" * 300, 300) is None
    True
    """
    wanted = content_words(question) - _ASKING
    words = list(dict.fromkeys(w for w in re.findall(r"[^\W_]+", question) if w.casefold() in wanted))
    while words and len(f"{' '.join(words)}: {content}") > max_chars:
        words.pop()
    return " ".join(words) or None


def question_headroom(
    store: TrialStore,
    query_vector: np.ndarray,
    evidence: Sequence[str],
    search_top_k: int,
    top_k: int,
    context_chars: int,
) -> dict[str, Any]:
    """One question's headroom in ``store``: ``headroom`` (bool) and ``evidence_rank``, the 1-based rank in the
    question's top ``search_top_k`` of the memory :func:`missing_evidence_rank` finds (None without one)."""
    ranked = [hit.record for hit in store.search(query_vector, search_top_k)]
    position = missing_evidence_rank(ranked, evidence, top_k, context_chars)
    return {"headroom": position is not None, "evidence_rank": None if position is None else position + 1}


#: The columns of a headroom flags table (one row per question row, in row order).
FLAGS_SCHEMA = pa.schema(
    [
        ("namespace", pa.string()),
        ("sample_id", pa.string()),
        ("category", pa.int64()),
        ("headroom", pa.bool_()),
        ("evidence_rank", pa.int64()),
        ("selected", pa.bool_()),
    ]
)


def headroom_flags(
    rows: pa.Table,
    memories: pa.Table,
    cache: EmbeddingCache,
    embedder: Embedder,
    *,
    search_top_k: int,
    top_k: int,
    context_chars: int,
) -> list[dict[str, Any]]:
    """Per row of ``rows`` (verl's layout), its question's headroom in its conversation's seed store."""
    info = rows.column("extra_info").to_pylist()
    vectors = embedder.encode([i["question"] for i in info]) if info else np.empty((0, embedder.dim), np.float32)
    stores: dict[str, TrialStore] = {}
    flags = []
    for i, vector in zip(info, vectors, strict=True):
        sample_id = i["sample_id"]
        if sample_id not in stores:
            stores[sample_id] = TrialStore(BaseStore.from_table(memories, sample_id, cache))
        found = question_headroom(stores[sample_id], vector, i["evidence"] or (), search_top_k, top_k, context_chars)
        flags.append({"namespace": i["namespace"], "sample_id": sample_id, "category": i["category"], **found})
    return flags


def select_mix(flags: Sequence[dict[str, Any]], share: float, seed: str) -> list[bool]:
    """Which rows a mix of ``share`` headroom questions keeps: every headroom row, and as many of the others,
    drawn reproducibly from ``seed``, as make headroom rows ``share`` of the mix (all of them where they are
    too few). The others are where stopping is right: without them a policy would learn to edit everywhere.

    >>> flags = [{"headroom": h} for h in (True, False, False, False, True, False)]
    >>> select_mix(flags, 0.5, "s").count(True), select_mix(flags, 0.5, "s")[0], select_mix(flags, 1.0, "s")
    (4, True, [True, False, False, False, True, False])
    >>> select_mix(flags, 0.5, "s") == select_mix(flags, 0.5, "s")
    True
    """
    if not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 1], got {share}")
    with_room = [i for i, f in enumerate(flags) if f["headroom"]]
    others = [i for i, f in enumerate(flags) if not f["headroom"]]
    wanted = min(len(others), round(len(with_room) * (1 - share) / share))
    rng = seeded_random(seed)
    keep = set(with_room) | set(rng.sample(others, wanted))
    return [i in keep for i in range(len(flags))]


def write_headroom_rows(
    rows: str | Path,
    memories: str | Path,
    embeddings: str | Path,
    out_rows: str | Path,
    out_flags: str | Path,
    *,
    embedding_model: str,
    search_top_k: int,
    top_k: int,
    context_chars: int,
    share: float,
    seed: int = 0,
    summary: str | Path | None = None,
) -> dict[str, Any]:
    """The rows of ``rows`` with a gold answer in a mix of ``share`` headroom questions (:func:`select_mix`) to
    ``out_rows`` (the same layout, in row order), and every such row's flags (:data:`FLAGS_SCHEMA`) to
    ``out_flags``. Returns (and writes to ``summary``) the counts, overall and by conversation."""
    # The questions the memory reward can score: a test split keeps category 5 (no gold answer) for LoCoMo's
    # evaluation, and neither training nor the policy evaluation can play it.
    table = answerable(read_parquet_columns(rows, {"extra_info": None}, ROWS_TABLE, only=False))
    embedder = Embedder(embedding_model)
    cache = EmbeddingCache.open(embeddings, model_name=embedder.model_name, must_exist=True)
    flags = headroom_flags(
        table,
        read_parquet_columns(memories, {"sample_id": None, "content": None}, "a memories table", only=False),
        cache,
        embedder,
        search_top_k=search_top_k,
        top_k=top_k,
        context_chars=context_chars,
    )
    keep = select_mix(flags, share, f"{Path(rows).name}-{seed}")
    if not any(f["headroom"] for f in flags):
        raise ValueError(
            f"{rows}: no question has headroom (gold evidence in its top {search_top_k} but outside the reader's "
            f"top {top_k} within {context_chars} characters): widen search_top_k"
        )
    for f, k in zip(flags, keep, strict=True):
        f["selected"] = k
    counts: dict[str, dict[str, int]] = {}
    for f in flags:
        c = counts.setdefault(f["sample_id"], {"questions": 0, "headroom": 0, "selected": 0})
        c["questions"] += 1
        c["headroom"] += f["headroom"]
        c["selected"] += f["selected"]
    result = {
        "rows": str(rows),
        "questions": len(flags),
        "headroom": sum(f["headroom"] for f in flags),
        "selected": sum(keep),
        "share": share,
        "search_top_k": search_top_k,
        "by_conversation": counts,
    }
    outputs = {"rows": out_rows, "flags": out_flags, **({"summary": summary} if summary is not None else {})}
    with atomic_outputs(outputs) as tmp:
        pq.write_table(table.filter(pa.array(keep)), tmp["rows"])
        pq.write_table(pa.Table.from_pylist(flags, schema=FLAGS_SCHEMA), tmp["flags"])
        if summary is not None:
            tmp["summary"].write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    logger.info(
        "%s: %d of %d questions have headroom; %d rows selected", rows, result["headroom"], len(flags), sum(keep)
    )
    return result


def read_flags(path: str | Path) -> dict[str, dict[str, Any]]:
    """A flags table (:func:`write_headroom_rows`) by namespace."""
    return {row["namespace"]: row for row in pq.read_table(path).to_pylist()}
