import json

import pyarrow.parquet as pq
import pytest

from memupdate.data.ingestion import (
    ROW_SCHEMA,
    SYSTEM_PROMPT,
    build_ingestion_rows,
    is_ingestion_row,
    questions_seen,
    reward_questions,
    session_namespace,
)
from memupdate.data.locomo import evidence_session, load_locomo, preprocess_locomo
from memupdate.names import MEMORY_TOOLS

SPLIT = {"train": ["conv-26", "conv-30"], "val": ["conv-47"], "test": ["conv-48"]}


@pytest.fixture(scope="module")
def locomo_files(locomo_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("locomo")
    outputs = {name: folder / f"{name}.parquet" for name in [*SPLIT, "memories"]}
    preprocess_locomo(locomo_path, outputs, split=SPLIT)
    return outputs


@pytest.fixture(scope="module")
def train_rows(locomo_files, tmp_path_factory):
    out = tmp_path_factory.mktemp("ingest") / "train.parquet"
    summary = build_ingestion_rows(
        str(locomo_files["train"]), str(locomo_files["memories"]), str(out), split="train", questions_per_session=6
    )
    return pq.read_table(out), summary


def test_no_prompt_holds_any_question_of_its_conversations(train_rows, locomo_path):
    """The ingestion agent never receives question text: every question of LoCoMo (all categories, all
    conversations) is searched for in every message of every row's prompt."""
    table, _ = train_rows
    questions = [q.question.strip() for c in load_locomo(locomo_path) for q in c.qa]
    assert len(questions) > 1900
    for row in table.to_pylist():
        text = json.dumps(row["prompt"]) + "".join(m["content"] for m in row["prompt"])
        leaked = [q for q in questions if q in text]
        assert not leaked, f"{row['extra_info']['namespace']} shows questions {leaked[:2]}"
        assert row["prompt"][0]["content"] == SYSTEM_PROMPT
        assert "question" not in json.dumps(row["extra_info"]["tools_kwargs"])


def test_a_session_is_rewarded_only_on_questions_whose_evidence_it_has_seen(train_rows, locomo_files):
    table, summary = train_rows
    rows = table.to_pylist()
    assert summary["rows"] == len(rows) and table.schema.equals(ROW_SCHEMA)
    assert {r["extra_info"]["sample_id"] for r in rows} == {"conv-26", "conv-30"}
    qa = [r["extra_info"] for r in pq.read_table(locomo_files["train"]).to_pylist()]
    for row in rows:
        info = row["extra_info"]
        session, chosen = info["session"], info["questions"]
        assert is_ingestion_row(info) and 1 <= len(chosen) <= 6
        for q in chosen:
            assert q["evidence"] and max(evidence_session(e) for e in q["evidence"]) <= session
        # The questions with evidence in the new session come first, while there are any.
        touches = [any(evidence_session(e) == session for e in q["evidence"]) for q in chosen]
        assert touches == sorted(touches, reverse=True)
        # Up to the cap, every question seen so far is among them.
        seen = questions_seen([q for q in qa if q["sample_id"] == info["sample_id"]], session)
        assert len(chosen) == min(6, len(seen))
        assert {q["qa_index"] for q in chosen} <= {q["qa_index"] for q in seen}
        create = info["tools_kwargs"][MEMORY_TOOLS[0]]["create_kwargs"]
        assert create == {"sample_id": info["sample_id"], "namespace": info["namespace"], "sessions": session}
        assert info["namespace"] == session_namespace(info["sample_id"], session)
    # conv-26 has 19 sessions; the first with a question whose evidence lies in it is a row.
    conv26 = [r["extra_info"]["session"] for r in rows if r["extra_info"]["sample_id"] == "conv-26"]
    assert conv26 == sorted(conv26) and conv26[0] == 1 and conv26[-1] == 19


def test_the_prompt_lists_the_new_sessions_memories_as_the_tools_show_them(train_rows, locomo_files):
    table, _ = train_rows
    row = table.to_pylist()[1]
    info = row["extra_info"]
    memories = [
        m
        for m in pq.read_table(locomo_files["memories"]).to_pylist()
        if m["sample_id"] == info["sample_id"] and m["session"] == info["session"]
    ]
    user = row["prompt"][1]["content"]
    assert info["new_memories"] == len(memories) > 0
    for m in memories:
        assert f"[{m['memory_id']}] ({m['speaker']}, session {m['session']}, {m['date']}) {m['content']}" in user
    assert f"Session {info['session']} ({memories[0]['date']}) has just ended" in user


def test_reward_questions_are_seeded_and_capped():
    qs = [{"qa_index": i, "question": f"q{i}", "answer": "a", "evidence": [f"D{1 + i % 3}:1"]} for i in range(12)]
    first = reward_questions(qs, 2, 5, "ns")
    assert first == reward_questions(qs, 2, 5, "ns") and len(first) == 5
    assert all(q["evidence"][0].startswith("D2:") for q in first[:4])
    assert len(reward_questions(qs, 2, None, "ns")) == 8
    assert reward_questions(qs, 0, None, "ns") == []
