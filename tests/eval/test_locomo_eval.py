"""LoCoMo evaluation without servers: question selection, the category-5 choice, resumable predictions,
and a report whose every number is recomputed here from the saved predictions."""

from __future__ import annotations

import asyncio
import json

import pyarrow.parquet as pq
import pytest

from memupdate import metrics
from memupdate.eval import locomo, report
from memupdate.utils.io import invalidate_if_changed


def test_rows_are_drawn_per_conversation_with_a_seed(locomo_rows):
    a = locomo.select_rows(locomo_rows["test"], 3, seed=0)
    b = locomo.select_rows(locomo_rows["test"], 3, seed=0)
    c = locomo.select_rows(locomo_rows["test"], 3, seed=1)
    assert [r["extra_info"]["namespace"] for r in a] == [r["extra_info"]["namespace"] for r in b]
    assert {r["extra_info"]["namespace"] for r in a} != {r["extra_info"]["namespace"] for r in c}
    assert len(a) == 3 and {r["extra_info"]["sample_id"] for r in a} == {"conv-30"}
    assert len(locomo.select_rows(locomo_rows["test"], None, seed=0)) > 3
    # Whole rows: the memory systems' agent loop is named by the row (agent_name), not only prompt and extra_info.
    assert set(a[0]) == set(pq.read_schema(locomo_rows["test"]).names)


def test_category_5_is_asked_as_a_two_way_choice_in_the_prompt_too(locomo_rows):
    rows = [r for r in locomo.select_rows(locomo_rows["test"], None, 0) if r["extra_info"]["category"] == 5]
    asked = locomo.ask_rows(rows, seed=0)
    orders = set()
    for before, after in zip(rows, asked, strict=True):
        info = after["extra_info"]
        # Retrieval and the protocols' prompts start from the dataset's question; the choice travels apart.
        assert info["question"] == before["extra_info"]["question"]
        assert sorted(info["choices"].values()) == sorted(
            [locomo.NOT_MENTIONED, before["extra_info"]["adversarial_answer"]]
        )
        # The memory model sees the question as the QA model will be asked it.
        assert locomo.choice_question(before["extra_info"], 0) in after["prompt"][-1]["content"]
        orders.add(info["choices"]["a"] == locomo.NOT_MENTIONED)
    assert orders == {True, False}  # the order is shuffled per question


def test_torn_last_line_is_redone(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"namespace": "a", "prediction": "x"}) + "\n" + '{"namespace": "b", "pred')
    assert list(locomo.read_predictions(path)) == ["a"]
    # The torn line is gone, so the next append starts on a line of its own.
    assert path.read_text().endswith("\n") and path.read_text().count("\n") == 1
    (tmp_path / "bad.jsonl").write_text('{"broken\n' + json.dumps({"namespace": "c"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1 is not valid JSON"):
        locomo.read_predictions(tmp_path / "bad.jsonl")


def test_predictions_of_other_models_are_moved_aside(tmp_path):
    path = tmp_path / "s.jsonl"
    invalidate_if_changed(path, {"models": 1})
    path.write_text(json.dumps({"namespace": "a"}) + "\n")
    invalidate_if_changed(path, {"models": 1})
    assert path.exists()
    invalidate_if_changed(path, {"models": 2})
    assert not path.exists() and (tmp_path / "s.stale.jsonl").exists()


PREDICTIONS = [
    {
        "namespace": "q1",
        "sample_id": "conv-48",
        "category": 1,
        "question": "Which hobbies?",
        "answer": "painting, running",
        "predictions": {"locomo": "running and painting", "mem0": "painting and running"},
        "evidence": ["D1:2"],
        "evidence_recall": 1.0,
        "context_tokens": {"locomo": 120, "mem0": 150},
        "latency_s": 0.5,
        "judge": 1.0,
        "judge_model": "exp-qa-base",
        "termination_reason": "done",
    },
    {
        "namespace": "q2",
        "sample_id": "conv-48",
        "category": 2,
        "question": "When?",
        "answer": "7 May 2023",
        "predictions": {"locomo": "May 2023", "mem0": "in May 2023"},
        "evidence": ["D2:1", "D2:3"],
        "evidence_recall": 0.5,
        "context_tokens": {"locomo": 100, "mem0": 130},
        "latency_s": 1.5,
        "judge": None,
        "judge_unparsed": True,
        "judge_model": "exp-qa-base",
        "termination_reason": "no_tool_call",
    },
    {
        "namespace": "q3",
        "sample_id": "conv-49",
        "category": 5,
        "question": "Snakes?",
        "answer": None,
        "predictions": {"locomo": "(a) Not mentioned in the conversation"},
        "evidence": [],
        "evidence_recall": None,
        "context_tokens": {"locomo": 80},
        "latency_s": 1.0,
        "termination_reason": "done",
    },
    {
        "namespace": "q4",
        "sample_id": "conv-49",
        "category": 4,
        "question": "Where?",
        "answer": "Paris",
        "predictions": {"locomo": None, "mem0": None},
        "evidence": ["D3:1"],
        "evidence_recall": 0.0,
        "context_tokens": {"locomo": 90, "mem0": 110},
        "latency_s": 2.0,
        "judge_model": "exp-qa-base",
        "termination_reason": "response_budget",
    },
]


def test_report_numbers_are_recomputed_from_the_saved_predictions(tmp_path):
    predictions = tmp_path / "predictions" / "stage1+qa_base.jsonl"
    predictions.parent.mkdir()
    predictions.write_text("".join(json.dumps(r) + "\n" for r in PREDICTIONS))
    metrics_file = tmp_path / "metrics.jsonl"
    metrics_file.write_text(
        "".join(
            json.dumps(
                {
                    "step": i,
                    "reward_mean": 0.1 * i,
                    "reward_std": 0.05,
                    "num_turns_mean": 2.0,
                    "memories_final_mean": 300 + i,
                    "termination": {"done": 2},
                }
            )
            + "\n"
            for i in (1, 2)
        )
    )
    out = report.build_report(
        tmp_path,
        {"stage1+qa_base": predictions},
        experiment="exp",
        settings={"top_k": 5},
        judge="exp-qa-base",
        training_metrics={"stage1": metrics_file, "stage2": tmp_path / "absent.jsonl"},
        split="memory_r1",
    )
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved == json.loads(json.dumps(out))
    # Which split the test conversations come from: only runs on the same split compare.
    assert saved["split"] == "memory_r1" and "(the memory_r1 split)" in (tmp_path / "report.md").read_text()
    row = saved["systems"]["stage1+qa_base"]
    # The unanswered question (q4) scores 0 and stays in every mean: all four questions count.
    locomo_f1 = [
        metrics.locomo_f1(r["predictions"]["locomo"], r["answer"] or "", r["category"]) for r in PREDICTIONS[:3]
    ]
    assert row["locomo"] == {"f1": round(sum(locomo_f1) / 4, 4), "n": 4}
    assert locomo_f1[2] == 1.0  # category 5: the model abstained
    mem0 = [r for r in PREDICTIONS[:2]]
    assert row["mem0"]["f1"] == round(sum(metrics.mem0_f1(r["predictions"]["mem0"], r["answer"]) for r in mem0) / 3, 4)
    assert row["mem0"]["bleu1"] == round(sum(metrics.bleu1(r["predictions"]["mem0"], r["answer"]) for r in mem0) / 3, 4)
    # J: q1 correct, q2's reply unparsed (not correct, counted), q4 unanswered (0).
    assert row["mem0"]["j"] == round(1 / 3, 4) and row["mem0"]["n"] == 3 and row["mem0"]["j_unparsed"] == 1
    assert row["per_category"]["2"] == {
        "name": "temporal",
        "n": 1,
        "locomo_f1": round(metrics.locomo_f1("May 2023", "7 May 2023", 2), 4),
        "mem0_f1": round(metrics.mem0_f1("in May 2023", "7 May 2023"), 4),
        "bleu1": round(metrics.bleu1("in May 2023", "7 May 2023"), 4),
        "j": 0.0,
    }
    assert row["per_category"]["4"]["n"] == 1 and row["per_category"]["4"]["locomo_f1"] == 0.0
    assert row["evidence_recall_at_k"] == 0.5
    assert row["latency_s"] == {"p50": 1.25, "p95": 1.925}
    assert (row["questions"], row["answered"], row["unanswered"], row["skipped"]) == (4, 3, 1, 0)
    assert row["context_tokens_mean"] == {"locomo": 97.5, "mem0": round((150 + 130 + 110) / 3, 4)}
    assert row["termination"] == {"done": 2, "no_tool_call": 1, "response_budget": 1}
    assert [s["reward_mean"] for s in saved["training"]["stage1"]] == [0.1, 0.2]
    assert "stage2" not in saved["training"]
    assert saved["plots"] == ["per_category.png", "training.png"]
    # The plots are one folder, the rule's output that Snakemake's report shows (snakemake --report).
    assert sorted(p.name for p in (tmp_path / "figures").iterdir()) == ["per_category.png", "training.png"]
    for name in ("per_category.png", "training.png"):
        assert (tmp_path / "figures" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "report.md").read_text()
    assert "| stage1+qa_base |" in md and "judge: exp-qa-base" in md and "![training.png](figures/training.png)" in md
    assert "question-conditioned" in md and "could not be parsed for 1 questions" in md
    # main table, LoCoMo F1 per category, Mem0 protocol per category (no comparison: one system)
    assert [line.startswith("| --- |") for line in md.splitlines()].count(True) == 3
    assert "## Paired comparisons" not in md
    assert "- stage1: 2 steps; last reward 0.200 (std 0.050); terminations done 2" in md


def test_only_full_context_may_skip_and_it_is_reported_apart(tmp_path):
    """A memory system's missing answer is a 0, never a question left out of its means; full_context's
    too-long questions are left out and its row says it was scored on fewer questions."""
    skipped = dict(PREDICTIONS[3], predictions={"locomo": None, "mem0": None}, skipped="30000 prompt tokens > 4064")
    records = [*PREDICTIONS[:3], skipped]
    paths = {}
    for name in ("no_update", "full_context"):
        paths[name] = tmp_path / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in records))
    out = report.build_report(tmp_path, paths, experiment="exp", settings={"top_k": 5})
    full, memory = out["systems"]["full_context"], out["systems"]["no_update"]
    assert (full["scored"], full["skipped"], full["unanswered"]) == (3, 1, 0)
    assert (memory["scored"], memory["skipped"], memory["unanswered"]) == (4, 0, 1)
    assert memory["locomo"]["f1"] == round(full["locomo"]["f1"] * 3 / 4, 4)
    md = (tmp_path / "report.md").read_text()
    assert "full_context: scored on 3 of 4 questions, not comparable" in md and "no_update: scored on" not in md
    assert full["skip_reasons"] == ["30000 prompt tokens > 4064 (1 question)"]


def test_policies_are_compared_question_by_question_with_an_interval(tmp_path):
    """base, cold start and stage 1 against the untouched store and each other, on the same questions."""
    q4_answered = dict(PREDICTIONS[3], predictions={"locomo": "Paris", "mem0": "Paris"}, judge=1.0)
    answers = {
        "no_update": PREDICTIONS,
        "base+qa_base": PREDICTIONS,
        "sft+qa_base": [*PREDICTIONS[:3], q4_answered],
        "stage1+qa_base": [*PREDICTIONS[:3], q4_answered],
    }
    paths = {}
    for name, records in answers.items():
        paths[name] = tmp_path / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in records))
    out = report.build_report(tmp_path, paths, experiment="exp", settings={"top_k": 5})
    pairs = {(c["system"], c["baseline"]): c for c in out["comparisons"] if c["metric"] == "locomo_f1"}
    assert set(pairs) == {
        ("base+qa_base", "no_update"),
        ("sft+qa_base", "base+qa_base"),
        ("stage1+qa_base", "sft+qa_base"),
        ("stage1+qa_base", "base+qa_base"),
        ("stage1+qa_base", "no_update"),
    }
    # One question of four gained a full point: +0.25, and with four questions the interval reaches 0.
    gained = pairs[("sft+qa_base", "base+qa_base")]
    assert gained["mean_difference"] == 0.25 and gained["n"] == 4 and gained["low"] == 0.0 and gained["high"] > 0
    assert not gained["excludes_zero"]
    same = pairs[("stage1+qa_base", "sft+qa_base")]
    assert (same["mean_difference"], same["low"], same["high"]) == (0.0, 0.0, 0.0)
    # Evidence recall@k is compared too, on the questions with gold evidence (the memories were the same here).
    recall = {(c["system"], c["baseline"]): c for c in out["comparisons"] if c["metric"] == "evidence_recall"}
    assert set(recall) == set(pairs) and all(c["mean_difference"] == 0.0 for c in recall.values())
    md = (tmp_path / "report.md").read_text()
    assert "## Paired comparisons" in md and "| sft+qa_base | base+qa_base | LoCoMo F1 | +25.0 | [+0.0, +" in md
    assert "| sft+qa_base | base+qa_base | evidence recall@k | +0.0 | [+0.0, +0.0] |" in md


def test_systems_asked_different_questions_are_refused(tmp_path):
    paths = {"no_update": tmp_path / "a.jsonl", "stage1+qa_base": tmp_path / "b.jsonl"}
    paths["no_update"].write_text("".join(json.dumps(r) + "\n" for r in PREDICTIONS))
    paths["stage1+qa_base"].write_text("".join(json.dumps(r) + "\n" for r in PREDICTIONS[:3]))
    with pytest.raises(ValueError, match="different questions"):
        report.build_report(tmp_path, paths, experiment="exp", settings={})


def test_rebuilt_report_takes_settings_and_judge_from_the_predictions(tmp_path):
    folder = tmp_path / "predictions"
    folder.mkdir()
    judged = PREDICTIONS
    for name in ("stage1+qa_base", "no_update"):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in judged))
        (folder / f"{name}.meta.json").write_text(
            json.dumps(
                {"settings": {"top_k": 7, "questions_per_conversation": 2}, "models": {"qa": {"path": "/x/qa-base"}}}
            )
        )
    (folder / "old.stale.jsonl").write_text("")
    out = report.rebuild_report(tmp_path, experiment="exp")
    assert list(out["systems"]) == ["no_update", "stage1+qa_base"]  # the report's fixed order, stale files skipped
    assert out["judge"] == "exp-qa-base" and out["settings"]["top_k"] == 7
    assert "| no_update | – | qa: qa-base |" in (tmp_path / "report.md").read_text()
    # The split's name: given, else the replaced report's.
    assert report.rebuild_report(tmp_path, experiment="exp", split="memory_r1")["split"] == "memory_r1"
    assert report.rebuild_report(tmp_path, experiment="exp")["split"] == "memory_r1"
    (folder / "no_update.jsonl").write_text(json.dumps(dict(PREDICTIONS[0], judge_model="other")) + "\n")
    with pytest.raises(ValueError, match="different judges"):
        report.rebuild_report(tmp_path, experiment="exp")


def test_a_bare_letter_reply_to_the_category_5_choice_is_scored_as_its_option():
    record = {
        "predictions": {"locomo": "a"},
        "category": 5,
        "choices": {"a": "Not mentioned in the conversation", "b": "Bo"},
    }
    assert report.score_prediction(record)["locomo_f1"] == 1.0
    assert report.score_prediction(dict(record, predictions={"locomo": "b"}))["locomo_f1"] == 0.0


def test_published_numbers_sit_beside_ours(tmp_path, repo_root):
    predictions = tmp_path / "no_update.jsonl"
    predictions.write_text(json.dumps(PREDICTIONS[0]) + "\n")
    out = report.build_report(
        tmp_path,
        {"no_update": predictions},
        experiment="exp",
        settings={"top_k": 5},
        published=repo_root / "config" / "published_locomo.yaml",
    )
    assert any(r["system"] == "Mem0" and r["j"] == 66.88 for r in out["published"]["mem0"]["rows"])
    assert any(r["system"].startswith("RAG over observations") for r in out["published"]["locomo"]["rows"])
    md = (tmp_path / "report.md").read_text()
    assert "## Beside published numbers" in md and "Not comparable one to one" in md
    assert "judge: none (J not computed)" in md


def test_full_context_is_laid_out_as_locomo_lays_it_out():
    """get_input_context prepends each session to the ones before it, so the newest comes first."""
    from types import SimpleNamespace as NS

    conv = NS(
        speaker_a="Ana",
        speaker_b="Bo",
        sessions=[
            NS(
                date_time="1 May 2023",
                turns=[
                    NS(speaker="Ana", text="Hi", image_caption=None),
                    NS(speaker="Bo", text="Look", image_caption="a cat"),
                ],
            ),
            NS(date_time="2 May 2023", turns=[NS(speaker="Bo", text="Bye", image_caption=None)]),
        ],
    )
    text = locomo.locomo_full_context(conv, "Between {} and {}.\n\n")
    assert text == (
        "Between Ana and Bo.\n\n"
        'DATE: 2 May 2023\nCONVERSATION:\nBo said, "Bye"\n\n'
        'DATE: 1 May 2023\nCONVERSATION:\nAna said, "Hi"\n\nBo said, "Look"\n and shared a cat.\n'
        "\n\n\n\n"
    )


@pytest.mark.parametrize("torn", ["middle", "last"])
def test_report_refuses_a_torn_predictions_line_naming_file_and_line(tmp_path, torn):
    """``eval locomo`` redoes a torn last line on resume; the report must never drop a question silently."""
    lines = [json.dumps(r) for r in PREDICTIONS]
    number = 2 if torn == "middle" else len(lines) + 1
    lines.insert(number - 1, lines[0][:20])
    path = tmp_path / "no_update.jsonl"
    path.write_text("\n".join(lines))
    with pytest.raises(report.JSONLError, match=rf"no_update.jsonl:{number}: not valid JSON"):
        report.build_report(tmp_path / "out", {"no_update": path}, experiment="exp", settings={})
    assert not (tmp_path / "out" / "report.json").exists()


def test_a_question_agnostic_system_is_labelled_and_its_ingestion_timed(tmp_path, repo_root):
    paths = {"no_update": tmp_path / "no_update.jsonl", "stage1+qa_base": tmp_path / "ingest.jsonl"}
    paths["no_update"].write_text("".join(json.dumps(r) + "\n" for r in PREDICTIONS))
    agnostic = [dict(r, memory_setting="question-agnostic") for r in PREDICTIONS]
    paths["stage1+qa_base"].write_text("".join(json.dumps(r) + "\n" for r in agnostic))
    log = {
        "conversations": {
            "conv-48": [
                {"session": 1, "new_memories": 5, "memories": 5, "termination_reason": "no_tool_call"},
                {"session": 2, "new_memories": 4, "memories": 7, "termination_reason": "done"},
            ],
            "conv-49": [{"session": 1, "new_memories": 3, "memories": 2, "termination_reason": "done"}],
        },
        "episodes": 3,
        "seconds": 6.0,
        "seconds_per_step": 3.0,
        "seconds_per_episode": 2.0,
    }
    (tmp_path / "runs" / "stage1+qa_base").mkdir(parents=True)
    (tmp_path / "runs" / "stage1+qa_base" / "ingestion.json").write_text(json.dumps(log))
    published = repo_root / "config" / "published_locomo.yaml"
    out = report.build_report(tmp_path, paths, experiment="exp", settings={}, published=published)
    row = out["systems"]["stage1+qa_base"]
    assert row["memory_setting"] == "question-agnostic" and out["systems"]["no_update"]["memory_setting"] is None
    # Its episodes are the sessions: how they ended is the ingestion's, not the questions'.
    assert row["termination"] == {"done": 2, "no_tool_call": 1}
    assert row["ingestion"] == {
        "episodes": 3,
        "termination": {"done": 2, "no_tool_call": 1},
        "seconds": 6.0,
        "seconds_per_step": 3.0,
        "seconds_per_episode": 2.0,
        "appended": 12,
        "built": 9,
    }
    md = (tmp_path / "report.md").read_text()
    # Beside the published numbers too, the setting named is the one the systems were evaluated in.
    assert "## Beside published numbers" in md and md.count("Setting: question-agnostic (Mem0's") == 2
    assert "Setting: question-conditioned" not in md
    assert "| stage1+qa_base | agnostic |" in md and "| stage1+qa_base | 3 | 6.0 | 3.00 | 12 | 9 |" in md


def test_training_curves_leave_out_the_validation_verl_logs_before_training(tmp_path):
    """verl logs its validation before training as step 0 with no training reward: not a point of the curve."""
    metrics = tmp_path / "metrics.jsonl"
    rows = [
        {"step": 0, "verl": {"val-core/locomo-conv-47/reward/mean@1": 0.1}},
        {"step": 1, "reward_mean": 0.25, "num_turns_mean": 2.0, "verl": {}},
    ]
    metrics.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (curve,) = report.training_curves({"stage1": metrics}).values()
    assert [(point["step"], point["reward_mean"]) for point in curve] == [(1, 0.25)]


def test_a_policy_with_the_weights_of_one_evaluated_before_takes_its_predictions(tmp_path, locomo_rows, held_out_cache):
    """A stage whose every update was skipped saves the weights it started from: its memory system is the
    earlier one and is not run again (no server is reachable here), also when its QA model is another file
    with the QA model's weights (a skipped QA stage); another policy's or QA model's weights are not."""
    from memupdate.memory.environment import MemoryEnvironment
    from memupdate.serving.markers import MARKER_FORMAT
    from memupdate.settings import LocomoEvalSettings

    markers = {}
    import torch
    from safetensors.torch import save_file

    models = (
        ("qa-base", 0.0, 0),
        ("stage2", 0.0, 1),
        ("qa-x", 3.0, 1),
        ("sft", 1.0, 0),
        ("stage1", 1.0, 10),
        ("x", 2.0, 1),
    )
    for name, weight, step in models:
        folder = tmp_path / "models" / name
        folder.mkdir(parents=True)
        save_file({"w": torch.full((2,), weight)}, folder / "model.safetensors", metadata={"step": str(step)})
        (folder / "manifest.json").write_text(json.dumps({"step": step}))
        markers[name] = tmp_path / f"{name}.ready.json"
        marker = {"format": MARKER_FORMAT, "endpoint": "http://127.0.0.1:9", "served_model_name": name}
        markers[name].write_text(json.dumps({**marker, "model_path": str(folder)}))

    def make_evaluator():
        return locomo.LocomoEvaluator(
            test_file=str(locomo_rows["test"]),
            memory=MemoryEnvironment(memories=str(locomo_rows["memories"]), embeddings=str(held_out_cache)),
            tool_config="unused.yaml",
            conversations=None,
            out_dir=str(tmp_path / "eval"),
            settings=LocomoEvalSettings(questions_per_conversation=3),
        )

    evaluator = make_evaluator()
    sft, stage1, other = (
        locomo.System(f"{name}+qa_base", str(markers["qa-base"]), memory=str(markers[name]))
        for name in ("sft", "stage1", "x")
    )
    assert evaluator.policy_key(sft) == evaluator.policy_key(stage1) != evaluator.policy_key(other)
    stage2, qa_x = (
        locomo.System(f"stage1+{qa}", str(markers[qa]), memory=str(markers["stage1"])) for qa in ("stage2", "qa-x")
    )
    assert evaluator.policy_key(stage2) == evaluator.policy_key(sft) != evaluator.policy_key(qa_x)
    made = tmp_path / "eval" / "predictions" / "sft+qa_base.jsonl"
    made.parent.mkdir(parents=True)
    rows = [{"namespace": r["extra_info"]["namespace"], "system": sft.name, "answer": "x"} for r in evaluator.rows]
    made.write_text("".join(json.dumps(r) + "\n" for r in rows))

    paths = asyncio.run(evaluator.run([sft, stage1]))

    copied = locomo.read_predictions(paths["stage1+qa_base"])
    assert len(copied) == 3 and sorted(copied) == sorted(r["namespace"] for r in rows)
    assert {(r["system"], r["same_weights_as"], r["answer"]) for r in copied.values()} == {
        ("stage1+qa_base", "sft+qa_base", "x")
    }
    assert "same_weights_as" not in next(iter(locomo.read_predictions(made).values()))
    # Weights replaced under the same manifest (issue 58): another model, so its saved predictions are not reused.
    before = make_evaluator().fingerprint(other)
    save_file({"w": torch.full((2,), 9.0)}, tmp_path / "models" / "x" / "model.safetensors", metadata={"step": "1"})
    after = make_evaluator().fingerprint(other)
    assert after["models"]["memory"]["manifest"] == before["models"]["memory"]["manifest"] and after != before


def test_the_report_says_which_policy_had_the_same_weights(tmp_path):
    paths = {}
    for name, extra in (("sft+qa_base", {}), ("stage1+qa_base", {"same_weights_as": "sft+qa_base"})):
        paths[name] = tmp_path / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps({**r, **extra}) + "\n" for r in PREDICTIONS))
    out = report.build_report(tmp_path, paths, experiment="exp", settings={"top_k": 5})
    assert out["systems"]["stage1+qa_base"]["same_weights_as"] == "sft+qa_base"
    assert "same_weights_as" not in out["systems"]["sft+qa_base"]
    assert "(the weights of sft+qa_base: its predictions)" in (tmp_path / "report.md").read_text()
