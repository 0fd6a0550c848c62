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
- ``most words below view``: promoting the memory below the context that shares most content words with the
  question (a choice by content that needs no model);
- ``model below view`` (with ``judge_model``): promoting the memory below the context that a causal language model,
  the experiment's policy model, finds most relevant: the most pointwise mutual information between the memory and
  the question, ``log p(question | memory) - log p(question)`` (whether the policy's own weights can tell the
  evidence memory from the others, which GRPO needs to beat a blind pick);
- ``expert``: promoting the memory citing the missing evidence where there is one, else stopping (the cold start's
  demonstrations, before the keep rule).

Each width also says how often each pick below the view is the memory citing the missing evidence, on the rows with
headroom (``picks_evidence``). It reads the gold evidence (to flag headroom and to play the expert), as the rows'
selection does; the policy never sees it.
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
from memupdate.memory.store import BaseStore, TrialStore, content_words
from memupdate.prompts import within_budget
from memupdate.rewards.memory import MemoryRewardConfig, memory_reward, to_retrieved
from memupdate.rewards.scorers import AnswerRecallScorer, EvidenceRecallScorer, QAItem
from memupdate.utils.io import ROWS_TABLE, read_parquet_columns

logger = logging.getLogger(__name__)

#: The offline scorers, each the training reward of some experiment (the cold start's keep rule reads both).
SCORERS = {"evidence_recall": EvidenceRecallScorer(), "answer_recall": AnswerRecallScorer()}
#: The scripted policies of the summary, in the order the table shows them (``model below view`` only with a judge).
POLICIES = ("stop", "first below view", "random below view", "most words below view", "model below view", "expert")
#: The policies that pick one memory below the reader's view by their own rule.
PICKS = ("first below view", "random below view", "most words below view", "model below view")


class RelevanceJudge:
    """A causal language model's relevance of a memory to a question: the pointwise mutual information
    ``log p(question | memory) - log p(question)``, summed over the question's tokens, in nats. The model reads plain
    text ("Memory: ...\nQuestion: ..."), no chat template: the measure is what its weights know of the pair, not how
    it follows an instruction."""

    def __init__(self, model_path: str, batch_size: int = 16):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.batch_size = batch_size

    def relevance(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        """The PMI of each ``(question, memory)`` pair."""
        questions = sorted({q for q, _ in pairs})
        alone = dict(zip(questions, self._log_p([("Question: ", q) for q in questions]), strict=True))
        given = self._log_p([(f"Memory: {memory}\nQuestion: ", q) for q, memory in pairs])
        return [g - alone[q] for (q, _), g in zip(pairs, given, strict=True)]

    def _log_p(self, items: Sequence[tuple[str, str]]) -> list[float]:
        import torch

        encode = self.tokenizer
        pad = encode.pad_token_id if encode.pad_token_id is not None else 0
        out = []
        for start in range(0, len(items), self.batch_size):
            batch = [
                (encode(c, add_special_tokens=False)["input_ids"], encode(t, add_special_tokens=False)["input_ids"])
                for c, t in items[start : start + self.batch_size]
            ]
            seqs = [c + t for c, t in batch]
            width = max(map(len, seqs))
            ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
            mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
            with torch.inference_mode():
                logits = self.model(input_ids=ids, attention_mask=mask).logits
            token_log_p = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
            # The text's tokens only: position k predicts token k + 1.
            out += [
                float(token_log_p[j, len(c) - 1 : len(s) - 1].sum())
                for j, ((c, _), s) in enumerate(zip(batch, seqs, strict=True))
            ]
            if (start // self.batch_size) % 50 == 0:
                logger.info(
                    "bench headroom: judged %d of %d texts", min(start + self.batch_size, len(items)), len(items)
                )
        return out


async def _promotions(
    rows: Sequence[Mapping[str, Any]],
    memories: Any,
    cache: EmbeddingCache,
    embedder: Embedder,
    config: MemoryRewardConfig,
    max_width: int,
    max_content_chars: int,
    judge: RelevanceJudge | None = None,
) -> list[dict[str, Any]]:
    questions = [row["question"] for row in rows]
    vectors = embedder.encode(questions)
    bases: dict[str, BaseStore] = {}
    records, plans, pairs = [], [], []
    for i, (row, vector) in enumerate(zip(rows, vectors, strict=True)):
        sample_id = row["sample_id"]
        if sample_id not in bases:
            bases[sample_id] = BaseStore.from_table(memories, sample_id, cache)
        hits = TrialStore(bases[sample_id]).search(vector, max_width)
        ranked = [hit.record for hit in hits]
        position = missing_evidence_rank(ranked, row["evidence"] or (), config.top_k, config.context_chars)
        # The reader's context: the leading memories within its budget (at most top_k).
        in_view = len(within_budget([to_retrieved(h) for h in hits[: config.top_k]], config.context_chars))
        asked = content_words(row["question"])
        records.append(
            {
                "namespace": row["namespace"],
                "sample_id": sample_id,
                "in_view": in_view,
                "evidence_rank": None if position is None else position + 1,
                "rewards": {name: [0.0] * len(hits) for name in SCORERS},
                "shared_words": [len(asked & content_words(h.record.content)) for h in hits],
            }
        )
        # Only the memories below the reader's view are picked from.
        pairs += [(i, rank, row["question"], hit.record.content) for rank, hit in enumerate(hits) if rank >= in_view]
        for rank, hit in enumerate(hits, 1):
            words = key_words(row["question"], hit.record.content, max_content_chars)
            # No key words fit in front of the text: the expert would not edit it, and neither is it scored here.
            if words is not None:
                plans.append((i, rank, hit.id, f"{words}: {hit.record.content}"))
    if judge is not None:
        for record in records:
            record["model_scores"] = [None] * len(record["shared_words"])
        for (i, rank, *_), score in zip(pairs, judge.relevance([(q, c) for *_, q, c in pairs]), strict=True):
            records[i]["model_scores"][rank] = round(score, 4)
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
    rows with headroom and on the others, under ``scorer``; ``picks_evidence``: how often each pick below the view
    is the memory citing the missing evidence on the rows with headroom (``model below view`` only where the
    records have ``model_scores``).

    >>> recs = [{"in_view": 2, "evidence_rank": 3, "rewards": {"s": [0, 0, 1.0, 0.0]}, "shared_words": [1, 1, 2, 3],
    ...          "model_scores": [0, 0, 1.5, 0.5]},
    ...         {"in_view": 2, "evidence_rank": None, "rewards": {"s": [0, 0, -0.5, 0.0]}, "shared_words": [0, 0, 1, 1],
    ...          "model_scores": [0, 0, 0.1, 0.2]}]
    >>> s = width_summary(recs, 4, share=0.5, seed="x", scorer="s")
    >>> s["headroom"], s["mix"], s["policies"]["expert"]["mix"], s["policies"]["random below view"]["headroom"]
    (1, 2, 0.5, 0.5)
    >>> s["policies"]["first below view"]["others"], width_summary(recs, 2, share=0.5, seed="x", scorer="s")["headroom"]
    (-0.5, 0)
    >>> s["policies"]["most words below view"]["headroom"], s["policies"]["model below view"]["headroom"]
    (0.0, 1.0)
    >>> s["picks_evidence"]
    {'first below view': 1.0, 'random below view': 0.5, 'most words below view': 0.0, 'model below view': 1.0}
    """
    room = [r["evidence_rank"] is not None and r["evidence_rank"] <= width for r in records]
    keep = select_mix([{"headroom": h} for h in room], share, seed) if any(room) else [False] * len(records)
    judged = bool(records) and all("model_scores" in r for r in records)
    policies = [p for p in POLICIES if judged or p != "model below view"]

    def best(scores: Sequence[float], start: int) -> int:
        # The highest score below the view, the higher-ranked memory on a tie.
        below = list(scores[start:width])
        return start + below.index(max(below))

    def row(record: Mapping[str, Any], headroom: bool) -> tuple[dict[str, float], dict[str, float]]:
        own, start = record["rewards"][scorer][:width], record["in_view"]
        below = own[start:]
        if not below:
            return {p: 0.0 for p in policies}, {}
        picks = {"first below view": start, "most words below view": best(record["shared_words"], start)}
        if judged:
            picks["model below view"] = best(record["model_scores"], start)
        rewards = {"stop": 0.0, "random below view": statistics.fmean(below), **{p: own[i] for p, i in picks.items()}}
        rewards["expert"] = own[record["evidence_rank"] - 1] if headroom else 0.0
        hits = {p: float(i + 1 == record["evidence_rank"]) for p, i in picks.items()}
        hits["random below view"] = 1 / len(below)
        return {p: rewards[p] for p in policies}, hits

    per_row = [(h, *row(r, h)) for r, h, k in zip(records, room, keep, strict=True) if k]

    def mean(policy: str, rows: Sequence[tuple[bool, dict[str, float], dict[str, float]]]) -> float | None:
        return round(statistics.fmean(r[policy] for _, r, _ in rows), 4) if rows else None

    with_room = [p for p in per_row if p[0]]
    others = [p for p in per_row if not p[0]]
    return {
        "width": width,
        "headroom": len(with_room),
        "mix": len(per_row),
        "policies": {
            policy: {"mix": mean(policy, per_row), "headroom": mean(policy, with_room), "others": mean(policy, others)}
            for policy in policies
        },
        "picks_evidence": {
            p: round(statistics.fmean(hits[p] for *_, hits in with_room), 4) if with_room else None
            for p in PICKS
            if p in policies
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
    judge_model: str | None = None,
    output: str | None = None,
) -> dict[str, Any]:
    """Score the promotions of every answerable question of ``rows`` (a split as ``preprocess_locomo`` writes it)
    down to the largest of ``widths`` under ``reward`` (a reward section: ``top_k``, ``context_chars``,
    ``efficiency``, ``idle_edit_cost``), and summarise each width's mix (``headroom``: ``share``, ``seed``) under
    both offline scorers; with ``judge_model`` (a causal language model's folder, the experiment's policy), also
    the pick it finds most relevant (:class:`RelevanceJudge`). Writes the result to ``output`` (JSON) when given."""
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
    judge = RelevanceJudge(judge_model) if judge_model else None
    records = asyncio.run(
        _promotions(records_in, table, cache, embedder, config, max(widths), max_content_chars, judge)
    )
    seed = f"{Path(rows).name}-{headroom.get('seed', 0)}"
    result = {
        "rows": str(rows),
        "questions": len(records),
        "judge_model": judge_model,
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
    without in brackets); then how often each pick below the view is the evidence memory."""
    out = [f"{result['rows']}: {result['questions']} questions, share {result['share']} with headroom"]
    if result.get("judge_model"):
        out.append(f"model below view: judged by {result['judge_model']}")
    for scorer, summaries in result["widths"].items():
        policies = [p for p in summaries[0]["policies"] if p != "stop"]
        rows = [
            [
                s["width"],
                s["headroom"],
                s["mix"],
                *(
                    "-"
                    if s["policies"][p]["mix"] is None
                    else f"{s['policies'][p]['mix']:+.3f} ({_or_dash(s['policies'][p]['headroom'])} / "
                    f"{_or_dash(s['policies'][p]['others'])})"
                    for p in policies
                ),
            ]
            for s in summaries
        ]
        out += [
            "",
            f"{scorer}: mean reward on the mix (rows with headroom / others)",
            format_table(rows, ["width", "with headroom", "mix", *policies]),
        ]
    summaries = next(iter(result["widths"].values()))
    picks = list(summaries[0]["picks_evidence"])
    rows = [[s["width"], s["headroom"], *(_share(s["picks_evidence"][p]) for p in picks)] for s in summaries]
    out += [
        "",
        "the pick is the evidence memory, on the rows with headroom",
        format_table(rows, ["width", "rows", *picks]),
    ]
    return "\n".join(out)


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _or_dash(value: float | None) -> str:
    return "-" if value is None else f"{value:+.3f}"
