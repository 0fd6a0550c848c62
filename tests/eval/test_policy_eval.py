"""Held-out episodes of a memory policy scored by the training reward (memupdate.eval.policy), and the
paired comparison of policies on the same questions (memupdate.eval.stats)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from memupdate.data.headroom import read_flags
from memupdate.eval.policy import (
    EPISODES,
    annotate_update_ranks,
    compare_policies,
    evaluate_policy,
    policy_report,
    updates_by_rank,
)
from memupdate.memory.cache import EmbeddingCache
from memupdate.memory.store import BaseStore

pytestmark = pytest.mark.slow

EPISODE = {"max_new_tokens": 24, "prompt_length": 4096, "response_length": 256, "max_assistant_turns": 2}


def test_a_policy_is_scored_on_held_out_questions_with_n_rollouts_each(
    tiny_model_dir, locomo_rows, held_out_cache, tmp_path
):
    runs = {}
    for name, seed in (("base", 0), ("again", 0), ("reseeded", 1)):
        runs[name] = evaluate_policy(
            model=str(tiny_model_dir),
            rows=str(locomo_rows["test"]),
            memories=str(locomo_rows["memories"]),
            embeddings=str(held_out_cache),
            out_dir=str(tmp_path / name),
            episode=EPISODE,
            reward={"scorer": "answer_recall", "efficiency": {"max_total_memories": None}},
            n=2,
            questions=3,
            seed=seed,
            server="hf",
        )
    summary = runs["base"]
    # The same weights under the same settings are evaluated once (a stage that skipped every update); other
    # settings are another evaluation.
    assert runs["again"]["same_weights_as"] == "base" and "same_weights_as" not in runs["reseeded"]
    assert (tmp_path / "again" / EPISODES).read_text() == (tmp_path / "base" / EPISODES).read_text()
    assert runs["again"]["evaluation_key"] == summary["evaluation_key"] != runs["reseeded"]["evaluation_key"]
    assert summary["episodes"] == 6 and summary["questions"] == 3 and len(summary["per_question"]) == 3
    records = [json.loads(line) for line in (tmp_path / "base" / EPISODES).read_text().splitlines()]
    assert len(records) == 6 and {r["namespace"] for r in records} == set(summary["per_question"])
    # Only conv-30's (held-out) questions.
    assert all(r["namespace"].startswith("conv-30-") for r in records)
    # A random model makes no well-formed call, so its store is the initial one and every reward is 0.
    assert summary["well_formed_rate"] == 0.0 and summary["reward_mean"] == 0.0
    assert summary["groups_with_spread"] == 0.0
    # The same policy against itself on the same questions: no difference, an interval around 0.
    (comparison,) = compare_policies(runs, [("again", "base")])
    assert comparison["mean_difference"] == 0.0 and not comparison["excludes_zero"] and comparison["n"] == 3

    # The report pairs the policies it has (here stage 1 against base) and plots stage 1's training curve.
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        json.dumps({"step": 0, "heldout_reward_mean": 0.05})
        + "\n"
        + "".join(json.dumps({"step": i, "reward_mean": 0.1 * i, "kl": 0.01}) + "\n" for i in (1, 2))
        + json.dumps({"step": 2, "heldout_reward_mean": 0.25})
        + "\n"
    )
    report = policy_report(
        {"base": tmp_path / "base/summary.json", "stage1": tmp_path / "again/summary.json"},
        metrics,
        tmp_path / "report/report.json",
    )
    assert [(c["a"], c["b"]) for c in report["comparisons"]] == [("stage1", "base")]
    assert json.loads((tmp_path / "report/report.json").read_text()) == report
    assert (tmp_path / "report/training.png").stat().st_size > 0
    markdown = (tmp_path / "report/report.md").read_text()
    assert "| stage1 - base | evaluated | 3 | +0.0000 |" in markdown
    assert "| stage1 (same weights as base: its episodes) | 3 |" in markdown
    # The learning curve's held-out points: verl's validation before training and at step 2.
    assert "by step: step 0 0.0500, step 2 0.2500" in markdown
    # Every episode stopped: the edits by kind say so.
    assert summary["edits"]["stop"]["episodes"] == 6 and set(summary["edits"]) == {"stop"}


def test_policies_scored_on_different_questions_are_not_compared():
    with pytest.raises(ValueError, match="different questions"):
        compare_policies(
            {"a": {"per_question": {"q1": 1.0}}, "b": {"per_question": {"q1": 0.0, "q2": 1.0}}}, [("a", "b")]
        )


def test_a_headroom_mix_is_compared_by_stratum_and_reweighted_to_every_question(tmp_path):
    """The held-out mix over-samples the questions with headroom (half of it, a fifth of the split): the report
    gives each stratum's paired difference and the difference over every question of the split, each stratum
    weighted by its share of the split."""
    flags = {f"h{i}": {"headroom": True} for i in range(4)} | {f"o{i}": {"headroom": False} for i in range(16)}
    evaluated = [*(f"h{i}" for i in range(4)), *(f"o{i}" for i in range(4))]
    stage1 = {"per_question": {q: (0.5 if q.startswith("h") else 0.0) for q in evaluated}}
    sft = {"per_question": dict.fromkeys(evaluated, 0.0)}
    rows = compare_policies({"stage1": stage1, "sft": sft}, [("stage1", "sft")], flags)
    by = {r["questions"]: r for r in rows}
    assert set(by) == {"evaluated", "headroom", "no headroom", "all (reweighted)"}
    assert by["evaluated"]["mean_difference"] == 0.25 and by["evaluated"]["n"] == 8
    assert by["headroom"]["mean_difference"] == 0.5 and by["headroom"]["excludes_zero"]
    assert by["no headroom"]["mean_difference"] == 0.0 and not by["no headroom"]["excludes_zero"]
    # 4 of the split's 20 questions have headroom: 0.2 x 0.5 + 0.8 x 0.
    assert by["all (reweighted)"]["mean_difference"] == pytest.approx(0.1)
    assert by["all (reweighted)"]["strata"] == {"headroom": 4, "no headroom": 4}


def test_each_update_is_placed_in_its_questions_own_search_and_the_evidence_memory_is_named(
    headroom_mix, locomo_rows, held_out_cache, embedder, tmp_path
):
    """What a policy promotes, by position and by content: the rank of each memory an update names in the
    question's own search of the seed store (ranked here by the vectors' dot products), and whether it is the
    memory citing the evidence the reader's context lacks (the headroom flags' ``evidence_rank``)."""
    rows = headroom_mix("test", 1.0)
    flags = read_flags(rows.with_name("flags.parquet"))
    info = pq.read_table(rows).column("extra_info").to_pylist()
    row = next(i for i in info if flags[i["namespace"]]["headroom"])
    memories = pq.read_table(locomo_rows["memories"]).to_pylist()
    ids = [m["memory_id"] for m in memories if m["sample_id"] == row["sample_id"]]
    store = BaseStore.from_table(
        pq.read_table(locomo_rows["memories"]), row["sample_id"], EmbeddingCache.open(held_out_cache)
    )
    scores = store.vectors @ embedder.encode([row["question"]])[0]
    ranked = [store.records[i].id for i in np.argsort(-scores, kind="stable")]
    assert sorted(ranked) == sorted(ids)
    evidence_rank = flags[row["namespace"]]["evidence_rank"]

    def update(memory_id):
        arguments = {"operation": "update", "memory_id": memory_id, "keywords": "x"}
        return f"<tool_call>\n{json.dumps({'name': 'manage_memory', 'arguments': arguments})}\n</tool_call>"

    records = [
        {
            "namespace": row["namespace"],
            "question": row["question"],
            "reward": 0.5,
            "policy_text": update(ranked[evidence_rank - 1]),
        },
        {
            "namespace": row["namespace"],
            "question": row["question"],
            "reward": 0.0,
            "policy_text": update(ranked[0]) + update(10_000),
        },
        {"namespace": row["namespace"], "question": row["question"], "reward": 0.0, "policy_text": "I stop."},
    ]
    annotate_update_ranks(
        records,
        {row["namespace"]: row["sample_id"]},
        locomo_rows["memories"],
        held_out_cache,
        embedder.model_name,
        {ns: f["evidence_rank"] for ns, f in flags.items()},
    )
    assert [r["update_ranks"] for r in records] == [[evidence_rank], [1, None], []]
    assert [r["update_evidence"] for r in records] == [[True], [False, False], []]
    by_rank = updates_by_rank(records)
    assert by_rank[str(evidence_rank)] == {"updates": 1, "reward_mean": 0.5, "evidence": 1, "evidence_reward_mean": 0.5}
    assert by_rank["1"]["evidence"] == 0 and by_rank["1"]["evidence_reward_mean"] is None
    assert by_rank["not in the store"]["updates"] == 1
    assert list(by_rank)[-1] == "not in the store"
    # The report shows the table (a policy's summary carries it).
    summary = {"questions": 1, "episodes": 3, "reward_mean": 0.1667, "well_formed_rate": 0.6667}
    summary |= {"tool_calls_mean": 1.0, "groups_with_spread": 1.0, "per_question": {}, "updates_by_rank": by_rank}
    (tmp_path / "stage1.json").write_text(json.dumps(summary))
    policy_report({"stage1": tmp_path / "stage1.json"}, None, tmp_path / "report.json")
    markdown = (tmp_path / "report.md").read_text()
    assert (
        "| rank | updates | mean reward | of them the memory citing the missing evidence | their mean reward |"
        in markdown
    )
    assert f"| {evidence_rank} | 1 | +0.5000 | 1 | +0.5000 |" in markdown
    assert "| not in the store | 1 | +0.0000 | 0 | - |" in markdown
