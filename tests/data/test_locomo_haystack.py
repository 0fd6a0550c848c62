"""LoCoMo as MemAgent haystacks (memupdate.data.locomo_haystack), on the real locomo10.json: every kept question is
earned by reading its evidence and by nothing else, its haystack holds that evidence in the conversation's order,
and the test conversations are never trained on."""

from __future__ import annotations

import json
import re

import pyarrow.parquet as pq
import pytest

from memupdate.data.locomo import load_locomo
from memupdate.data.locomo_haystack import DATA_SOURCE, build_rows, preprocess_locomo_haystack, windows
from memupdate.metrics import normalize_squad

SPLIT = {
    "train": ["conv-26", "conv-30", "conv-41", "conv-42", "conv-43", "conv-44"],
    "val": ["conv-47"],
    "test": ["conv-48", "conv-49", "conv-50"],
}
SESSION = re.compile(r"^Session (\d+)", re.MULTILINE)


def words_in(text: str, answer: str) -> bool:
    return f" {normalize_squad(answer)} " in f" {normalize_squad(text)} "


@pytest.fixture(scope="module")
def conversations(locomo_path):
    return load_locomo(locomo_path)


@pytest.fixture(scope="module")
def built(locomo_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("locomo_haystack")
    outputs = {part: out / f"4.{part}.parquet" for part in ("train", "test")}
    summary = preprocess_locomo_haystack(
        locomo_path, outputs, out / "4.summary.json", split=SPLIT, num_docs=4, turns_per_window=4
    )
    rows = {part: pq.read_table(path).to_pylist() for part, path in outputs.items()}
    return summary, rows, out


def test_every_kept_answer_is_in_its_evidence_and_in_its_haystack_never_in_its_question(built):
    summary, rows, _ = built
    assert {part: len(r) for part, r in rows.items()} == {p: summary["parts"][p]["rows"] for p in rows}
    # Three times the offline HotpotQA file's 52 held-out questions.
    assert len(rows["test"]) >= 150, len(rows["test"])
    for row in rows["train"] + rows["test"]:
        answer = row["reward_model"]["ground_truth"][0]
        facts = row["extra_info"]["supporting_facts"]
        assert row["data_source"] == DATA_SOURCE and row["extra_info"]["answers"] == [answer]
        assert words_in("\n".join(facts), answer), row["extra_info"]["id"]
        assert not words_in(row["extra_info"]["question"], answer), row["extra_info"]["id"]
        # The expert keeps these lines in memory: each must be a line the policy reads.
        assert all(f"\n{fact}\n" in f"\n{row['context']}\n" for fact in facts), row["extra_info"]["id"]
        assert row["num_docs"] == row["context"].count("Document ") == 4


def test_documents_keep_the_conversations_order(built):
    _, rows, _ = built
    for row in rows["test"]:
        sessions = [int(n) for n in SESSION.findall(row["context"])]
        assert sessions == sorted(sessions), (row["extra_info"]["id"], sessions)


def test_test_conversations_are_never_trained_on(built):
    summary, rows, _ = built
    held_out = {row["extra_info"]["level"] for row in rows["test"]}
    trained = {row["extra_info"]["level"] for row in rows["train"]}
    assert held_out == set(SPLIT["test"]) and trained <= set(SPLIT["train"]) and not held_out & trained
    assert summary["parts"]["test"]["conversations"] == SPLIT["test"]


def test_every_question_is_kept_or_counted_with_its_reason(built, conversations):
    summary, _, _ = built
    for part, info in summary["parts"].items():
        asked = sum(len(c.qa) for c in conversations if c.sample_id in SPLIT[part])
        assert info["rows"] + sum(d["questions"] for d in info["dropped"]) == asked, part
        reasons = {d["reason"] for d in info["dropped"]}
        assert "answer not in its evidence turns" in reasons and "no answer (adversarial)" in reasons
    # The test conversations name an answer in three questions (two of them "a beach or mountains?").
    dropped = summary["parts"]["test"]["dropped"]
    assert sum(d["questions"] for d in dropped if d["reason"] == "answer in the question") == 3


def test_rows_depend_on_the_seed_and_question_alone(built, conversations):
    _, rows, _ = built
    tests = [c for c in conversations if c.sample_id in SPLIT["test"]]
    again, _ = build_rows(tests, num_docs=4, turns_per_window=4, part="test")
    assert again.to_pylist() == rows["test"]
    alone, _ = build_rows(tests[1:2], num_docs=4, turns_per_window=4, part="test")
    by_id = {row["extra_info"]["id"]: row for row in rows["test"]}
    assert all(by_id[row["extra_info"]["id"]]["context"] == row["context"] for row in alone.to_pylist())
    other, _ = build_rows(tests, num_docs=4, turns_per_window=4, part="test", seed=1)
    # Another seed draws other distractors around the same evidence.
    changed = [a["context"] != b["context"] for a, b in zip(rows["test"], other.to_pylist(), strict=True)]
    assert any(changed)
    assert all(f in row["context"] for row in other.to_pylist() for f in row["extra_info"]["supporting_facts"])


def test_windows_cut_each_session_apart_and_title_it_with_its_date(conversations):
    conv = conversations[0]
    cut = windows(conv, 4)
    assert sum(len(w.lines) for w in cut) == sum(len(s.turns) for s in conv.sessions)
    assert [w.position for w in cut] == list(range(len(cut)))
    first = conv.sessions[0]
    assert cut[0].title == f"Session {first.index}, {first.date_time}"
    assert cut[0].document.splitlines()[1].startswith(f"{first.turns[0].speaker}: ")
    with pytest.raises(ValueError, match="turns_per_window must be a positive integer"):
        windows(conv, 0)


def test_a_haystack_longer_than_a_conversation_names_it(conversations):
    conv = conversations[0]
    with pytest.raises(ValueError, match=rf"num_docs=1000 is more than the \d+ windows .* {conv.sample_id}"):
        build_rows([conv], num_docs=1000, turns_per_window=4, part="train")


def test_a_split_without_test_conversations_is_refused_before_anything_is_written(locomo_path, tmp_path):
    outputs = {part: tmp_path / f"{part}.parquet" for part in ("train", "test")}
    with pytest.raises(ValueError, match="no test conversations"):
        preprocess_locomo_haystack(
            locomo_path, outputs, tmp_path / "s.json", split={"train": ["conv-26"]}, num_docs=4, turns_per_window=4
        )
    assert not list(tmp_path.iterdir())


def test_the_summary_counts_the_memory_each_question_needs(built):
    summary, _, out = built
    written = json.loads((out / "4.summary.json").read_text())
    assert written == json.loads(json.dumps(summary))
    facts = written["parts"]["test"]["supporting_fact_tokens"]
    assert 0 < facts["mean"] <= facts["max"]
