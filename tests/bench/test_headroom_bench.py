"""``memupdate bench headroom`` on conv-26: the measurement cpu_demo's search width is chosen from."""

import json

import pyarrow.parquet as pq
import pytest

from memupdate.bench.headroom import PICKS, POLICIES, RelevanceJudge, format_headroom_bench, run_headroom_bench
from memupdate.settings import RewardSettings

pytestmark = pytest.mark.slow

#: cpu_demo's reward sections (the workflow's efficiency with the experiment's scorer): the reader's top 5 within 650.
REWARD = {
    "scorer": "evidence_recall",
    "top_k": RewardSettings.top_k,
    "context_chars": RewardSettings.context_chars,
    "efficiency": {"max_total_memories": None, "apply_to": "positive"},
}


@pytest.fixture(scope="module")
def bench(locomo_rows, held_out_cache, tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "headroom.json"
    result = run_headroom_bench(
        str(locomo_rows["train"]),
        str(locomo_rows["memories"]),
        str(held_out_cache),
        reward=REWARD,
        headroom={"share": 0.5, "seed": 0},
        widths=[10, 6],
        embedding_model="all-MiniLM-L6-v2",
        max_content_chars=300,
        # A random model's judgments: the plumbing, not a measure (docs/cpu-demo.md has SmolLM2's).
        judge_model=str(tiny_models / "policy"),
        output=str(out),
    )
    return result, out


def test_each_width_has_the_rows_the_workflow_selects_and_scores_every_policy(bench, headroom_mix):
    result, out = bench
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    evidence = {s["width"]: s for s in result["widths"]["evidence_recall"]}
    assert sorted(evidence) == [6, 10]
    # The one definition: at width 10 the questions with headroom are the rows rule headroom_rows flags there.
    flags = pq.read_table(headroom_mix("train", 0.5).parent / "flags.parquet").column("headroom").to_pylist()
    assert evidence[10]["headroom"] == sum(flags) > evidence[6]["headroom"] > 0
    assert all(s["mix"] == 2 * s["headroom"] for s in evidence.values())
    for summary in evidence.values():
        assert set(summary["policies"]) == set(POLICIES)
        assert summary["policies"]["stop"] == {"mix": 0.0, "headroom": 0.0, "others": 0.0}
        assert set(summary["picks_evidence"]) == set(PICKS)
        assert all(0 <= share <= 1 for share in summary["picks_evidence"].values()), summary


def test_the_expert_pays_where_memory_can_help_and_a_blind_pick_pays_less(bench):
    result, _ = bench
    for summary in result["widths"]["evidence_recall"]:
        policies = summary["policies"]
        # Bringing the missing evidence into view pays under evidence_recall (conv-26 at a top 20: +0.53).
        assert policies["expert"]["headroom"] > 0.3, summary
        assert policies["expert"]["headroom"] > policies["random below view"]["headroom"], summary
        # Where nothing is missing the expert stops.
        assert policies["expert"]["others"] == 0.0
    wide, narrow = sorted(result["widths"]["evidence_recall"], key=lambda s: -s["width"])
    # Fewer memories below the reader's view to choose from: a blind pick finds the evidence more often.
    assert narrow["policies"]["random below view"]["headroom"] > wide["policies"]["random below view"]["headroom"]
    table = format_headroom_bench(result)
    assert "evidence_recall: mean reward on the mix" in table and "answer_recall" in table
    assert "the pick is the evidence memory" in table and "model below view" in table


def test_the_judges_relevance_is_the_models_own_log_probabilities(tiny_models):
    import torch

    judge = RelevanceJudge(str(tiny_models / "policy"), batch_size=2)
    pairs = [("When did Caroline go?", "Caroline went to a support group on 7 May."), ("Who is Mel?", "Mel paints.")]

    def log_p(context: str, text: str) -> float:
        # One sequence, unpadded: what the batched, padded pass must reproduce.
        c = judge.tokenizer(context, add_special_tokens=False)["input_ids"]
        t = judge.tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([c + t])
        with torch.inference_mode():
            logits = judge.model(input_ids=ids).logits
        return float(torch.log_softmax(logits[0, len(c) - 1 : -1], -1).gather(-1, ids[0, len(c) :, None]).sum())

    expected = [log_p(f"Memory: {m}\nQuestion: ", q) - log_p("Question: ", q) for q, m in pairs]
    assert judge.relevance(pairs) == pytest.approx(expected, abs=1e-4)


def test_no_width_is_refused(locomo_rows, held_out_cache):
    with pytest.raises(ValueError, match="widths must be search depths >= 1"):
        run_headroom_bench(
            str(locomo_rows["train"]),
            str(locomo_rows["memories"]),
            str(held_out_cache),
            reward=REWARD,
            headroom={"share": 0.5},
            widths=[],
            embedding_model="all-MiniLM-L6-v2",
            max_content_chars=300,
        )
