"""``memupdate bench headroom``: what scripted memory edits earn on a split's headroom mix, by search width.

The measurement an experiment's search width is chosen from (``headroom.search_top_k`` and its expert's
``sft.search_top_k``; docs/cpu-demo.md): per answerable question of a split, the reward of promoting each memory of
the question's own top ``max_width`` search in place, as the expert does (``manage_memory``'s ``keywords``: the
question's key words in front of the memory's text, :func:`memupdate.data.headroom.key_words`), under both
offline scorers and the experiment's reward settings. Then per width ``W``: the questions with headroom at ``W``
(:mod:`memupdate.data.headroom`), the mix rule ``headroom_rows`` draws from them, and the mean reward on that mix of

- ``stop``: no edit (0 by construction);
- ``first below view``: promoting the first memory below the reader's context (what a policy that learnt only
  where to promote can do);
- ``random below view``: a pick among the memories below the context down to rank ``W``, in expectation (what a
  policy that picks blindly among them earns: the baseline GRPO has to beat);
- ``expert``: promoting the memory citing the missing evidence where there is one, else stopping (the cold start's
  demonstrations, before the keep rule).

It reads the gold evidence (to flag headroom and to play the expert), as the rows' selection does; the policy
never sees it.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from memupdate.bench.report import format_table, save_report
from memupdate.data.headroom import key_words, missing_evidence_rank, select_mix
from memupdate.data.locomo import answerable
from memupdate.memory.cache import EmbeddingCache
from memupdate.memory.embedder import Embedder
from memupdate.memory.store import BaseStore, TrialStore
from memupdate.prompts import within_budget
from memupdate.rewards.memory import MemoryRewardConfig, memory_reward, to_retrieved
from memupdate.rewards.scorers import AnswerRecallScorer, EvidenceRecallScorer, QAItem
from memupdate.utils.io import ROWS_TABLE, read_parquet_columns

logger = logging.getLogger(__name__)

#: The offline scorers, each the training reward of some experiment (the cold start's keep rule reads both).
SCORERS = {"evidence_recall": EvidenceRecallScorer(), "answer_recall": AnswerRecallScorer()}
#: The scripted policies of the summary, in the order the table shows them.
POLICIES = ("stop", "first below view", "random below view", "expert")


async def _promotions(
    rows: Sequence[Mapping[str, Any]],
    memories: Any,
    cache: EmbeddingCache,
    embedder: Embedder,
    config: MemoryRewardConfig,
    max_width: int,
    max_content_chars: int,
) -> list[dict[str, Any]]:
    questions = [row["question"] for row in rows]
    vectors = embedder.encode(questions)
    bases: dict[str, BaseStore] = {}
    records, plans = [], []
    for i, (row, vector) in enumerate(zip(rows, vectors, strict=True)):
        sample_id = row["sample_id"]
        if sample_id not in bases:
            bases[sample_id] = BaseStore.from_table(memories, sample_id, cache)
        hits = TrialStore(bases[sample_id]).search(vector, max_width)
        ranked = [hit.record for hit in hits]
        position = missing_evidence_rank(ranked, row["evidence"] or (), config.top_k, config.context_chars)
        records.append(
            {
                "namespace": row["namespace"],
                "sample_id": sample_id,
                # The reader's context: the leading memories within its budget (at most top_k).
                "in_view": len(within_budget([to_retrieved(h) for h in hits[: config.top_k]], config.context_chars)),
                "evidence_rank": None if position is None else position + 1,
                "rewards": {name: [0.0] * len(hits) for name in SCORERS},
            }
        )
        for rank, hit in enumerate(hits, 1):
            words = key_words(row["question"], hit.record.content, max_content_chars)
            # No key words fit in front of the text: the expert would not edit it, and neither is it scored here.
            if words is not None:
                plans.append((i, rank, hit.id, f"{words}: {hit.record.content}"))
    texts = embedder.encode([text for *_, text in plans]) if plans else []
    for (i, rank, memory_id, text), text_vector in zip(plans, texts, strict=True):
        row, record = rows[i], records[i]
        base = bases[row["sample_id"]]
        final = TrialStore(base)
        final.update(memory_id, text, vector=text_vector)
        item = QAItem(row["question"], str(row.get("answer") or ""), int(row["category"]), tuple(row["evidence"] or ()))
        for name, scorer in SCORERS.items():
            out = await memory_reward(TrialStore(base), final, [item], vectors[i][None], scorer, config)
            record["rewards"][name][rank - 1] = round(out["score"], 6)
    return records


def width_summary(
    records: Sequence[Mapping[str, Any]], width: int, *, share: float, seed: str, scorer: str
) -> dict[str, Any]:
    """The mix of ``share`` questions with headroom at search ``width`` (drawn as rule ``headroom_rows`` draws it,
    :func:`~memupdate.data.headroom.select_mix` with ``seed``) and each scripted policy's mean reward on it, on its
    rows with headroom and on the others, under ``scorer``.

    >>> recs = [{"in_view": 2, "evidence_rank": 3, "rewards": {"s": [0, 0, 1.0, 0.0]}},
    ...         {"in_view": 2, "evidence_rank": None, "rewards": {"s": [0, 0, -0.5, 0.0]}}]
    >>> s = width_summary(recs, 4, share=0.5, seed="x", scorer="s")
    >>> s["headroom"], s["mix"], s["policies"]["expert"]["mix"], s["policies"]["random below view"]["headroom"]
    (1, 2, 0.5, 0.5)
    >>> s["policies"]["first below view"]["others"], width_summary(recs, 2, share=0.5, seed="x", scorer="s")["headroom"]
    (-0.5, 0)
    """
    room = [r["evidence_rank"] is not None and r["evidence_rank"] <= width for r in records]
    keep = select_mix([{"headroom": h} for h in room], share, seed) if any(room) else [False] * len(records)

    def rewards(record: Mapping[str, Any], headroom: bool) -> dict[str, float]:
        own = record["rewards"][scorer][:width]
        below = own[record["in_view"] :]
        return {
            "stop": 0.0,
            "first below view": below[0] if below else 0.0,
            "random below view": statistics.fmean(below) if below else 0.0,
            "expert": own[record["evidence_rank"] - 1] if headroom else 0.0,
        }

    per_row = [(h, rewards(r, h)) for r, h, k in zip(records, room, keep, strict=True) if k]

    def mean(policy: str, rows: Sequence[tuple[bool, dict[str, float]]]) -> float | None:
        return round(statistics.fmean(r[policy] for _, r in rows), 4) if rows else None

    with_room = [p for p in per_row if p[0]]
    others = [p for p in per_row if not p[0]]
    return {
        "width": width,
        "headroom": len(with_room),
        "mix": len(per_row),
        "policies": {
            policy: {"mix": mean(policy, per_row), "headroom": mean(policy, with_room), "others": mean(policy, others)}
            for policy in POLICIES
        },
    }


def experiment_settings(name: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """What ``bench headroom --experiment NAME`` scores with, from the workflow's ``config`` (config/config.yaml,
    its scale merged): the experiment's reward section over the workflow's, its headroom section, and the memory
    tools' embedding model and cap.

    >>> cfg = {"reward": {"top_k": 5, "scorer": "auto"}, "memory": {"embedding_model": "m", "max_content_chars": 300},
    ...        "experiments": {"demo": {"reward": {"scorer": "evidence_recall"}, "headroom": {"search_top_k": 7}}}}
    >>> s = experiment_settings("demo", cfg)
    >>> s["reward"], s["headroom"]["share"], s["max_content_chars"]
    ({'top_k': 5, 'scorer': 'evidence_recall'}, 0.5, 300)
    """
    from dataclasses import asdict

    from memupdate.settings import HeadroomSettings, build

    experiment = (config.get("experiments") or {}).get(name)
    if experiment is None:
        raise ValueError(f"bench headroom: no experiment {name!r} in the workflow config")
    return {
        "reward": {**config["reward"], **experiment.get("reward", {})},
        "headroom": asdict(build(HeadroomSettings, experiment.get("headroom"), f"experiments.{name}.headroom")),
        "embedding_model": config["memory"]["embedding_model"],
        "max_content_chars": config["memory"]["max_content_chars"],
    }


def run_headroom_bench(
    rows: str,
    memories: str,
    embeddings: str,
    *,
    reward: Mapping[str, Any],
    headroom: Mapping[str, Any],
    widths: Sequence[int],
    embedding_model: str,
    max_content_chars: int,
    output: str | None = None,
) -> dict[str, Any]:
    """Score the promotions of every answerable question of ``rows`` (a split as ``preprocess_locomo`` writes it)
    down to the largest of ``widths`` under ``reward`` (a reward section: ``top_k``, ``context_chars``,
    ``efficiency``, ``idle_edit_cost``), and summarise each width's mix (``headroom``: ``share``, ``seed``) under
    both offline scorers. Writes the result to ``output`` (JSON) when given."""
    if not widths or min(widths) < 1:
        raise ValueError(f"bench headroom: widths must be search depths >= 1, got {list(widths)}")
    config = MemoryRewardConfig.from_settings(reward)
    info = answerable(read_parquet_columns(rows, {"extra_info": None}, ROWS_TABLE, only=False))
    records_in = info.column("extra_info").to_pylist()
    if not records_in:
        raise ValueError(f"{rows}: no answerable question to score")
    embedder = Embedder(embedding_model)
    cache = EmbeddingCache.open(embeddings, model_name=embedder.model_name, must_exist=True)
    table = read_parquet_columns(memories, {"sample_id": None, "content": None}, "a memories table", only=False)
    records = asyncio.run(_promotions(records_in, table, cache, embedder, config, max(widths), max_content_chars))
    seed = f"{Path(rows).name}-{headroom.get('seed', 0)}"
    result = {
        "rows": str(rows),
        "questions": len(records),
        "reward": {"top_k": config.top_k, "context_chars": config.context_chars},
        "share": headroom["share"],
        "widths": {
            scorer: [
                width_summary(records, w, share=headroom["share"], seed=seed, scorer=scorer) for w in sorted(widths)
            ]
            for scorer in SCORERS
        },
    }
    logger.info("bench headroom: %d questions of %s scored at widths %s", len(records), rows, sorted(widths))
    save_report(result, output)
    return result


def format_headroom_bench(result: Mapping[str, Any]) -> str:
    """One table per scorer: per width, the mix's size and each policy's mean reward on it (with headroom /
    without in brackets)."""
    out = [f"{result['rows']}: {result['questions']} questions, share {result['share']} with headroom"]
    for scorer, summaries in result["widths"].items():
        rows = [
            [
                s["width"],
                s["headroom"],
                s["mix"],
                *(
                    "-"
                    if s["policies"][p]["mix"] is None
                    else f"{s['policies'][p]['mix']:+.3f} ({s['policies'][p]['headroom']:+.3f} / "
                    f"{_or_dash(s['policies'][p]['others'])})"
                    for p in POLICIES[1:]
                ),
            ]
            for s in summaries
        ]
        out += [
            "",
            f"{scorer}: mean reward on the mix (rows with headroom / others)",
            format_table(rows, ["width", "with headroom", "mix", *POLICIES[1:]]),
        ]
    return "\n".join(out)


def _or_dash(value: float | None) -> str:
    return "-" if value is None else f"{value:+.3f}"
