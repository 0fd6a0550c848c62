"""MemAgent evaluation: every chunk of a haystack is read unless truncation is asked for (and then it is
recorded), MemAgent's own evaluation style is reported beside ours, and a model in-process and through a
served copy gives the same greedy replies, scores, and a report that recomputes from its predictions."""

from __future__ import annotations

import json
import logging
import math
import re
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from memupdate.eval.memagent import (
    HAYSTACK_NAMES,
    MEMAGENT_STYLE_METRICS,
    METRICS,
    MemAgentEvalSettings,
    haystack_name,
    memagent_length_curve,
    memagent_style_answer,
    memagent_style_scores,
    model_source,
)
from memupdate.serving.readiness import write_marker
from memupdate.settings import build

# hotpot_rows' first three haystacks are 720, 735 and 1444 tiny-model tokens: 3, 3 and 6 chunks of 256.
SETTINGS = {
    "chunk_size": 256,
    "max_memory_tokens": 12,
    "max_final_tokens": 8,
    "prompt_length": 768,
    "batch_size": 3,
    "limit": 3,
}


def predictions(out, name, length, style=""):
    return [json.loads(line) for line in (out / "predictions" / f"{name}-{length}{style}.jsonl").open()]


def haystack_tokens(model_dir, rows, n):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    contexts = pq.read_table(rows, columns=["context"]).column("context").to_pylist()[:n]
    return [len(tokenizer(c, add_special_tokens=False)["input_ids"]) for c in contexts]


def test_training_budget_is_not_an_evaluation_setting():
    with pytest.raises(
        ValueError, match="eval.max_chunks: training's budget.*evaluation reads every chunk.*truncate_chunks"
    ):
        build(MemAgentEvalSettings, {"chunk_size": 256, "max_chunks": 2}, "eval")
    assert build(MemAgentEvalSettings, {}, "eval").truncate_chunks is None


@pytest.mark.slow
def test_evaluation_reads_every_chunk_unless_truncation_is_asked_for(tiny_models, hotpot_rows, tmp_path):
    model = tiny_models / "policy"
    lengths = haystack_tokens(model, hotpot_rows, 3)
    assert max(lengths) > 2 * 256  # longer than the 2-chunk budget below (and than training's 3 x 48)
    # A copy with the same weights (another folder, another manifest) is the same policy: not run again.
    twin = shutil.copytree(model, tmp_path / "twin")
    (twin / "manifest.json").write_text('{"step": 3}')
    # The training run's metrics.jsonl (memupdate.training.tracking.metrics_from_verl): validation before training
    # (step 0, no training reward) and at the last step.
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        json.dumps({"step": 0, "heldout_reward_mean": 0.0})
        + "\n"
        + "".join(json.dumps({"step": s, "reward_mean": s / 4, "num_turns_mean": 3.0}) + "\n" for s in (1, 2))
        + json.dumps({"step": 2, "heldout_reward_mean": 0.5, "heldout_questions": 2})
        + "\n"
    )
    whole = memagent_length_curve(
        {"tiny": model, "twin": twin},
        {"3": hotpot_rows},
        tmp_path / "whole",
        {**SETTINGS, "memagent_style": False},
        training_metrics=metrics,
    )
    assert whole["same_weights"] == {"twin": "tiny"} and whole["results"]["twin"] == whole["results"]["tiny"]
    # Each model against the one before it, on the same questions: a twin differs by nothing.
    [comparison] = whole["comparisons"]
    assert (comparison["a"], comparison["b"], comparison["length"], comparison["n"]) == ("twin", "tiny", "3", 3)
    assert comparison["mean_difference"] == comparison["low"] == comparison["high"] == 0.0
    assert not comparison["excludes_zero"]
    text = (tmp_path / "whole" / "report.md").read_text()
    assert "| twin - tiny | 3 | 3 | +0.0 | [+0.0, +0.0] | no |" in text
    assert "by step: step 0 0.000, step 2 0.500 (2 questions scored)." in text
    assert "![training.png](training.png)" in text
    assert (tmp_path / "whole" / "training.png").stat().st_size > 0
    assert predictions(tmp_path / "whole", "twin", 3) == predictions(tmp_path / "whole", "tiny", 3)
    assert "twin has the weights of tiny" in (tmp_path / "whole" / "report.md").read_text()
    # Examples to read: each question with every model's final memory and reply, as the predictions hold them.
    saved = {p["id"]: p for p in predictions(tmp_path / "whole", "tiny", 3)}
    shown = whole["examples"]["questions"]
    assert whole["examples"]["length"] == "3" and len(shown) == 3
    for example in shown:
        assert set(example["models"]) == {"tiny", "twin"}
        record = saved[example["id"]]
        assert example["models"]["tiny"] == {k: record[k] for k in ("memory", "reply", "exact_match")}
        assert isinstance(record["memory"], str) and record["memory"]
        assert f"**{example['question']}**" in text
    for p, n in zip(predictions(tmp_path / "whole", "tiny", 3), lengths, strict=True):
        assert p["haystack_tokens"] == p["context_tokens"] == n and p["truncated_tokens"] == 0
        assert p["chunks_read"] == p["chunks_total"] == math.ceil(n / 256)
    summary = whole["results"]["tiny"]["3"]
    assert summary["truncated"] == 0.0 and summary["context_tokens"] == summary["haystack_tokens"]
    assert summary["haystack_tokens"] == pytest.approx(np.mean(lengths), abs=1e-4)
    assert "every chunk of each haystack is read" in (tmp_path / "whole" / "report.md").read_text()

    cut = memagent_length_curve(
        {"tiny": model},
        {"3": hotpot_rows},
        tmp_path / "cut",
        {**SETTINGS, "truncate_chunks": 2, "memagent_style": False},
    )
    for p, n in zip(predictions(tmp_path / "cut", "tiny", 3), lengths, strict=True):
        assert p["haystack_tokens"] == n and p["chunks_total"] == math.ceil(n / 256)
        assert p["chunks_read"] == min(2, p["chunks_total"])
        assert p["truncated_tokens"] == max(0, n - 512) and p["context_tokens"] == min(n, 512)
    assert cut["results"]["tiny"]["3"]["truncated"] == pytest.approx(np.mean([n > 512 for n in lengths]), abs=1e-4)
    assert "centre-truncated to 2 chunks" in (tmp_path / "cut" / "report.md").read_text()


def test_memagent_style_answer_follows_upstream_extraction():
    # taskutils/memory_eval/utils/__init__.py: after </think>, '*' removed, the last "the answer is", dots stripped.
    assert memagent_style_answer("x. Therefore, the answer is **Ed Wood**.") == "Ed Wood"
    assert memagent_style_answer("the answer is A, so the answer is B.") == "B"
    assert memagent_style_answer("<think>the answer is A</think> Therefore, the answer is B") == "B"
    assert memagent_style_answer(r"\boxed{Paris}") is None
    assert memagent_style_answer(None) is None


def test_memagent_style_scores_use_the_first_gold_answer_and_hotpotqa_f1():
    scores = memagent_style_scores("so the answer is Paris", ["London", "Paris"])
    assert (scores["exact_match"], scores["sub_em"], scores["answered"]) == (0.0, 0.0, 1.0)
    assert memagent_style_scores("so the answer is yes", ["no"])["f1"] == 0.0
    assert memagent_style_scores("so the answer is no, never", ["no"])["f1"] == 0.0  # yes/no only exactly
    assert memagent_style_scores("the answer is the Beatles band", ["Beatles"]) == {
        "pred": "the Beatles band",
        "exact_match": 0.0,
        "sub_em": 1.0,
        "f1": 0.67,
        "answered": 1.0,
    }
    # An answer that normalises to nothing is contained in any gold answer: upstream counts it.
    assert memagent_style_scores("the answer is the", ["Paris"])["sub_em"] == 1.0
    assert memagent_style_scores("the answer is .", ["Paris"])["answered"] == 1.0
    assert memagent_style_scores("the answer is .", ["Paris"])["sub_em"] == 0.0


@pytest.mark.slow
def test_memagent_style_is_reported_beside_ours(tiny_models, hotpot_rows, tmp_path, caplog):
    out = tmp_path / "eval"
    caplog.set_level(logging.INFO, logger="memupdate.eval.memagent")
    report = memagent_length_curve({"tiny": tiny_models / "policy"}, {"3": hotpot_rows}, out, SETTINGS)
    # A rule's log, where the progress bar is off, says when each pass is done and how it scored.
    assert re.search(r"tiny @ 3 \(memagent\): 3 questions in \d+ s; exact_match [\d.]+, sub_em", caplog.text)
    assert report["haystack"] == HAYSTACK_NAMES["hotpotqa"]
    assert f"Haystacks: {HAYSTACK_NAMES['hotpotqa']}." in (out / "report.md").read_text()
    style = report["memagent_style"]
    assert "temperature 0.7 / top-p 0.95" in style["protocol"] and "the answer is" in style["protocol"]
    # MemAgent's style: its final prompt, the memory turns' token limit, and its sampling.
    agent = OmegaConf.load(out / "work" / "tiny" / "memagent" / "agent_loops.yaml")[0]
    assert (agent.final_prompt, agent.max_final_tokens, agent.max_chunks) == ("answer_is", 12, None)
    ours = OmegaConf.load(out / "work" / "tiny" / "ours" / "agent_loops.yaml")[0]
    assert (ours.final_prompt, ours.max_final_tokens) == ("boxed", 8)
    records = predictions(out, "tiny", 3, ".memagent_style")
    assert len(records) == 3 and len(predictions(out, "tiny", 3)) == 3
    for r in records:
        assert {k: r[k] for k in ("pred", *MEMAGENT_STYLE_METRICS)} == memagent_style_scores(r["reply"], r["answers"])
        assert r["truncated_tokens"] == 0
    summary = style["results"]["tiny"]["3"]
    for key in MEMAGENT_STYLE_METRICS:
        assert summary[key] == pytest.approx(np.mean([r[key] for r in records]), abs=1e-4)
    text = (out / "report.md").read_text()
    assert "## Our evaluation" in text and "## MemAgent's own evaluation style" in text
    # Cut by its time limit before one pass was saved, then rerun: the saved pass is not predicted again.
    (out / "predictions" / "tiny-3.jsonl").unlink()
    (out / "report.json").unlink()
    caplog.clear()
    again = memagent_length_curve({"tiny": tiny_models / "policy"}, {"3": hotpot_rows}, out, SETTINGS)
    assert "tiny @ 3 (memagent): 3 predictions saved by a previous run; not predicted again" in caplog.text
    assert re.search(r"tiny @ 3 \(ours\): 3 questions in \d+ s", caplog.text)
    assert again["memagent_style"]["results"] == style["results"] and len(predictions(out, "tiny", 3)) == 3
    # Other settings: the saved passes are moved aside and predicted afresh.
    caplog.clear()
    memagent_length_curve({"tiny": tiny_models / "policy"}, {"3": hotpot_rows}, out, {**SETTINGS, "limit": 2})
    assert "predictions saved by a previous run" not in caplog.text and "moved to" in caplog.text
    assert len(predictions(out, "tiny", 3, ".memagent_style")) == 2


def test_memagent_style_samples_at_upstream_temperature(tiny_models, tmp_path):
    from memupdate.eval.memagent import MemAgentEvaluator

    evaluator = MemAgentEvaluator(tiny_models / "policy", MemAgentEvalSettings(**SETTINGS), tmp_path)
    sampling = {style: evaluator.configs[style].actor_rollout_ref.rollout.val_kwargs for style in ("ours", "memagent")}
    assert (sampling["memagent"].temperature, sampling["memagent"].top_p) == (0.7, 0.95)
    assert sampling["ours"].temperature == 0  # greedy


@pytest.mark.slow
@pytest.mark.vllm
def test_served_and_in_process_evaluation_agree(vllm_server, tiny_model_dir, hotpot_rows, tmp_path):
    """The session's tiny vLLM server (tests/conftest.py) against the same folder evaluated in-process."""
    marker = tmp_path / "serve" / "tiny.ready.json"
    name = vllm_server.served_model_name
    write_marker(
        marker,
        endpoint=vllm_server.base_url,
        served_model_name=name,
        pid=vllm_server.pid,
        model_path=tiny_model_dir,
        api_key=vllm_server.api_key,
    )
    assert model_source(marker)[0] == tiny_model_dir.resolve()
    report = memagent_length_curve(
        {"local": tiny_model_dir, "served": marker},
        {"3": hotpot_rows},
        tmp_path / "eval",
        {**SETTINGS, "memagent_style": False},
    )
    assert report["models"] == {
        "local": {"path": str(tiny_model_dir), "served_as": None},
        "served": {"path": str(tiny_model_dir.resolve()), "served_as": name},
    }
    records = {name: predictions(tmp_path / "eval", name, 3) for name in ("local", "served")}
    # Greedy decoding of one float32 model: the server writes the same memories and answers, chunk by chunk.
    assert [p["reply"] for p in records["served"]] == [p["reply"] for p in records["local"]]
    assert [p["chunks_read"] for p in records["served"]] == [p["chunks_total"] for p in records["local"]]
    for name, rows in records.items():
        summary = report["results"][name]["3"]
        assert summary["n"] == 3
        for key in METRICS:
            assert summary[key] == pytest.approx(np.mean([r[key] for r in rows]), abs=1e-4)
    assert (tmp_path / "eval" / "length_curve.png").is_file()


def test_a_length_curve_across_two_kinds_of_haystack_is_refused_naming_the_files(hotpot_rows, tmp_path):
    table = pq.read_table(hotpot_rows)
    locomo = tmp_path / "locomo.parquet"
    pq.write_table(table.set_column(0, "data_source", pa.array(["locomo_haystack"] * table.num_rows)), locomo)
    assert haystack_name({"4": locomo}) == HAYSTACK_NAMES["locomo_haystack"]
    with pytest.raises(ValueError, match=r"mix them: hotpotqa in 3: .*; locomo_haystack in 8: .*locomo.parquet"):
        haystack_name({"3": hotpot_rows, "8": locomo})
