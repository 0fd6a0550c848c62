import json
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from memupdate.data.fetch import ChecksumMismatch
from memupdate.data.locomo import (
    CATEGORY_NAMES,
    LocomoFormatError,
    base_namespace,
    initial_memories,
    load_locomo,
    parse_evidence,
    preprocess_locomo,
    select_rows,
)
from memupdate.eval.policy import scorable_rows
from memupdate.utils.io import sha256_file

SPLIT = {
    "train": ["conv-26", "conv-30", "conv-41", "conv-42", "conv-43", "conv-44"],
    "val": ["conv-47"],
    "test": ["conv-48", "conv-49", "conv-50"],
}


def outputs_in(folder):
    return {name: folder / f"{name}.parquet" for name in ["train", "val", "test", "memories"]}


@pytest.fixture(scope="module")
def conversations(locomo_path):
    return load_locomo(locomo_path)


@pytest.fixture(scope="module")
def built(locomo_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("locomo")
    summary = preprocess_locomo(locomo_path, outputs_in(folder), split=SPLIT)
    return folder, summary


def test_real_file_counts(conversations):
    qa = [q for c in conversations for q in c.qa]
    assert len(conversations) == 10
    assert len(qa) == 1986
    assert sum(q.category != 5 for q in qa) == 1540
    assert Counter(q.category for q in qa) == {1: 282, 2: 321, 3: 96, 4: 841, 5: 446}


def test_answers_are_strings_and_category5_is_adversarial(conversations):
    qa = [q for c in conversations for q in c.qa]
    assert all(isinstance(q.answer, str) for q in qa if q.category != 5)
    assert next(q for q in qa if q.sample_id == "conv-26" and q.qa_index == 1).answer == "2022"
    cat5 = [q for q in qa if q.category == 5]
    assert all(q.adversarial_answer for q in cat5)
    # 444 of 446 have no gold answer at all; two carry both fields in the released file.
    assert sum(q.answer is None for q in cat5) == 444


def test_malformed_evidence_is_repaired_or_reported(conversations):
    by_key = {(q.sample_id, q.qa_index): q for c in conversations for q in c.qa}
    assert by_key["conv-26", 37].evidence == ("D8:6", "D9:17")
    assert by_key["conv-43", 18].evidence == ("D1:14", "D2:7", "D4:7", "D5:15", "D11:26", "D20:21", "D26:36")
    assert by_key["conv-49", 38].evidence == ("D22:1", "D22:2", "D9:10", "D9:11")
    assert by_key["conv-42", 88].evidence == ("D1:18", "D1:20")
    assert by_key["conv-42", 88].evidence_unparsed == ("D",)


def test_parse_evidence_shapes():
    assert parse_evidence(["D1:3"]).ids == ("D1:3",)
    assert parse_evidence(["D1:3", "D1:3"]).ids == ("D1:3",)
    parsed = parse_evidence(["D", "X7", ""])
    assert parsed.ids == () and parsed.unparsed == ("D", "X7", "")


def test_namespaces_are_stable_and_unique(conversations):
    namespaces = [q.namespace for c in conversations for q in c.qa]
    assert len(set(namespaces)) == 1986
    q = conversations[0].qa[0]
    assert q.namespace == base_namespace(q.sample_id, q.qa_index, q.question)
    assert q.namespace.startswith("conv-26-qa0-") and len(q.namespace.rsplit("-", 1)[1]) == 8
    assert base_namespace("conv-26", 0, "another question") != q.namespace


def test_split_is_by_conversation_and_drops_category5_from_training(built):
    folder, summary = built
    seen = {}
    for split in ["train", "val", "test"]:
        rows = pq.read_table(folder / f"{split}.parquet").to_pylist()
        samples = {r["extra_info"]["sample_id"] for r in rows}
        assert samples == set(SPLIT[split])
        for sample in samples:
            assert seen.setdefault(sample, split) == split
        categories = {r["extra_info"]["category"] for r in rows}
        assert (5 in categories) == (split == "test")
    # All ten conversations are split, so the rows are the 1,540 answerable questions plus test's category 5.
    total = sum(s["rows"] for s in summary["splits"].values())
    assert total == 1540 + summary["splits"]["test"]["by_category"][5]


def test_rows_have_verl_layout_with_native_nested_columns(built):
    folder, _ = built
    table = pq.read_table(folder / "train.parquet")
    assert table.schema.field("extra_info").type.num_fields > 5  # a struct, not a JSON string
    row = table.slice(0, 1).to_pylist()[0]
    assert row["agent_name"] == "memupdate_agent"
    assert row["data_source"] == "locomo-conv-26"
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert "Target question: When did Caroline go to the LGBTQ support group?" in row["prompt"][1]["content"]
    assert "debug" not in row["prompt"][0]["content"].lower()
    extra = row["extra_info"]
    assert row["reward_model"] == {"style": "memory_delta", "ground_truth": "7 May 2023"}
    assert extra["evidence"] == ["D1:3"] and extra["category"] == 2
    assert extra["category_name"] == CATEGORY_NAMES[2]
    assert extra["tools_kwargs"]["search_memory"]["create_kwargs"] == {
        "sample_id": "conv-26",
        "namespace": extra["namespace"],
    }
    assert table.column("extra_info").combine_chunks().field("index").to_pylist() == list(range(table.num_rows))


def test_initial_memories_table(built, conversations):
    folder, summary = built
    memories = pq.read_table(folder / "memories.parquet").to_pylist()
    assert summary["memories"]["conv-26"] == sum(m["sample_id"] == "conv-26" for m in memories)
    first = memories[0]
    assert first["sample_id"] == "conv-26" and first["memory_id"] == 0 and first["source"] == "observation"
    assert first["speaker"] == "Caroline" and first["session"] == 1
    assert first["date"] == "1:56 pm on 8 May, 2023" and first["evidence"] == ["D1:3"]
    ids = [m["memory_id"] for m in memories if m["sample_id"] == "conv-30"]
    assert ids == list(range(len(ids)))


def test_memory_sources_are_configurable(conversations):
    conv = conversations[0]
    dialogue = initial_memories(conv, ["dialogue"])
    assert len(dialogue) == sum(len(s.turns) for s in conv.sessions)
    assert dialogue[0]["content"].startswith("Caroline: ") and dialogue[0]["evidence"] == ["D1:1"]
    summaries = initial_memories(conv, ["session_summary"])
    assert len(summaries) == len(conv.sessions) and summaries[0]["speaker"] is None
    both = initial_memories(conv, ["observation", "session_summary"])
    assert [m["memory_id"] for m in both] == list(range(len(both)))
    with pytest.raises(ValueError, match="unknown memory sources"):
        initial_memories(conv, ["gossip"])


def test_preprocessing_is_deterministic(locomo_path, tmp_path, built):
    folder, _ = built
    preprocess_locomo(locomo_path, outputs_in(tmp_path), split=SPLIT)
    for name in ["train", "val", "test", "memories"]:
        assert (tmp_path / f"{name}.parquet").read_bytes() == (folder / f"{name}.parquet").read_bytes()


def test_split_errors(locomo_path, tmp_path):
    # A misspelt id is the first job's error (the Snakefile's load reads no data), with the id it is close to.
    with pytest.raises(ValueError, match="'conv-99', which is not in the data; did you mean conv-"):
        preprocess_locomo(locomo_path, outputs_in(tmp_path), split={**SPLIT, "val": ["conv-99"]})
    with pytest.raises(ValueError, match="'conv-26' is listed in both split 'train' and 'test'"):
        preprocess_locomo(locomo_path, outputs_in(tmp_path), split={**SPLIT, "test": ["conv-26"]})
    with pytest.raises(ValueError, match="'conv-47' is listed twice in split 'val'"):
        preprocess_locomo(locomo_path, outputs_in(tmp_path), split={**SPLIT, "val": ["conv-47", "conv-47"]})
    assert not any(tmp_path.iterdir())


def _broken_copy(locomo_path, tmp_path, edit):
    data = json.loads(locomo_path.read_text())[:2]
    edit(data)
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d[1]["qa"][3].pop("answer"), r"broken.json, sample 'conv-30', qa\[3\]: field 'answer' is missing"),
        (lambda d: d[0]["qa"][7].update(category=9), r"sample 'conv-26', qa\[7\]: field 'category' must be an integer"),
        (
            lambda d: d[0]["qa"][2].update(evidence="D1:3"),
            r"sample 'conv-26', qa\[2\]: field 'evidence' must be a list",
        ),
        (lambda d: d[0]["qa"][0].pop("question"), r"sample 'conv-26', qa\[0\]: field 'question' is missing"),
        (lambda d: d[1].pop("sample_id"), r"sample \[1\]: field 'sample_id' is missing"),
        (
            lambda d: d[0]["conversation"]["session_2"][4].pop("dia_id"),
            r"sample 'conv-26', conversation.session_2\[4\]: field 'dia_id' is missing",
        ),
        (
            lambda d: d[0]["qa"][0].update(category=5),
            r"qa\[0\]: category 5 needs field 'adversarial_answer'",
        ),
    ],
)
def test_broken_records_name_the_record(locomo_path, tmp_path, edit, message):
    with pytest.raises(LocomoFormatError, match=message):
        load_locomo(_broken_copy(locomo_path, tmp_path, edit))


def test_invalid_json_names_the_file(tmp_path):
    path = tmp_path / "locomo10.json"
    path.write_text("[{")
    with pytest.raises(LocomoFormatError, match="locomo10.json: not valid JSON"):
        load_locomo(path)


def test_json_nested_past_the_parsers_reach_names_the_file(tmp_path):
    """A RecursionError traceback before (issue 58)."""
    path = tmp_path / "locomo10.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(LocomoFormatError, match="locomo10.json: nested deeper than the parser can read"):
        load_locomo(path)


def test_a_lone_surrogate_is_refused_naming_where(locomo_path, tmp_path):
    """JSON lets "\\ud83d" stand alone; Python reads it, and writing it as UTF-8 (parquet) crashed nameless."""
    path = _write_broken(locomo_path, tmp_path, lambda d: None, raw=lambda b: b.replace(b"LGBTQ", b"LGBTQ\\ud83d", 1))
    with pytest.raises(LocomoFormatError, match=r"broken.json, \[0\]\..*: a lone UTF-16 surrogate"):
        load_locomo(path)


def test_a_key_named_twice_is_refused_not_silently_the_last(locomo_path, tmp_path):
    """json.loads keeps the last of two "question" keys: a hand-edited copy would lose the first in silence."""
    text = locomo_path.read_text(encoding="utf-8")
    path = tmp_path / "locomo10.json"
    path.write_text(text.replace('"question": ', '"question": "a", "question": ', 1), encoding="utf-8")
    with pytest.raises(LocomoFormatError, match="locomo10.json: key 'question' appears twice in one object"):
        load_locomo(path)


SMALL_SPLIT = {"train": ["conv-26"], "val": [], "test": ["conv-30"]}


def _write_broken(locomo_path, tmp_path, edit, *, raw=None):
    """A two-conversation copy of the real file after ``edit``; ``raw`` replaces the bytes written."""
    path = _broken_copy(locomo_path, tmp_path, edit)
    if raw is not None:
        path.write_bytes(raw(path.read_bytes()))
    return path


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda d: d[0]["conversation"].update(session_3=[]),
            r"broken.json, sample 'conv-26': field 'conversation.session_3' has no turns",
        ),
        (
            lambda d: d[0]["qa"][0].update(answer=""),
            r"broken.json, sample 'conv-26', qa\[0\]: field 'answer' is empty \(category 2",
        ),
        (
            lambda d: d[1]["qa"][5].update(answer="  "),
            r"sample 'conv-30', qa\[5\]: field 'answer' is empty",
        ),
        (
            lambda d: next(q for q in d[0]["qa"] if q["category"] == 5).update(adversarial_answer=""),
            r"sample 'conv-26', qa\[\d+\]: field 'adversarial_answer' is empty \(category 5",
        ),
        (
            lambda d: d[0]["conversation"]["session_1"][2].update(dia_id="turn 3"),
            r"conversation.session_1\[2\]: field 'dia_id' must look like D<session>:<turn>, got 'turn 3'",
        ),
        # What passed in silence or crashed without a name before (issue 37).
        (
            lambda d: d[0]["conversation"]["session_1"][3].update(dia_id="D1:2"),
            r"conversation.session_1\[3\]: field 'dia_id' 'D1:2' is already the id of conversation.session_1\[1\]",
        ),
        (
            lambda d: d[0]["conversation"]["session_2"][0].update(dia_id="D3:1"),
            r"conversation.session_2\[0\]: field 'dia_id' 'D3:1' names session 3, not 2",
        ),
        (
            lambda d: d[0]["observation"]["session_1_observation"]["Caroline"][0].__setitem__(0, "  "),
            r"observation.session_1_observation.Caroline\[0\]: the fact's text is empty",
        ),
        (
            lambda d: d[0]["observation"]["session_1_observation"].update(Caroline=None),
            r"field 'observation.session_1_observation.Caroline' must be a list of facts, got NoneType",
        ),
        (lambda d: d[0]["qa"][0].update(answer=True), r"qa\[0\]: field 'answer' must be a string or number, got True"),
        (
            lambda d: d[0]["session_summary"].update(session_1_summary=["a", "b"]),
            r"field 'session_summary.session_1_summary' must be a string, got list",
        ),
        (
            lambda d: d[0]["conversation"].update(session_1_date_time=20230508),
            r"field 'conversation.session_1_date_time' must be a string .*got 20230508",
        ),
        # What passed in silence or crashed without a name before (issue 58).
        (lambda d: d[0]["qa"][0].update(answer=float("nan")), r"qa\[0\]: field 'answer' must be a finite number"),
        (
            lambda d: d[0]["conversation"]["session_1"][0].update(text="   "),
            r"conversation.session_1\[0\]: field 'text' is empty",
        ),
        (
            lambda d: d[0]["observation"]["session_1_observation"]["Caroline"][0].__setitem__(0, "x" * 100_000),
            r"Caroline\[0\]: the fact's text is 100,000 characters, over 2,000",
        ),
        (
            lambda d: d[0]["qa"][1].update(question="When did\x00 she go?"),
            r"qa\[1\]: field 'question' holds the control character '\\x00' at 8",
        ),
        (
            lambda d: d[0]["conversation"].update(session_2_date_time="1:56 pm on 8 May,\x00 2023"),
            r"field 'conversation.session_2_date_time' holds the control character",
        ),
        (
            lambda d: d[0]["conversation"]["session_1"][1].update(blip_caption={"text": "a dog"}),
            r"conversation.session_1\[1\]: field 'blip_caption' must be a string, got dict",
        ),
        (
            lambda d: d[0]["conversation"]["session_1"][1].update(speaker=""),
            r"conversation.session_1\[1\]: field 'speaker' is empty",
        ),
        (
            lambda d: d[0]["conversation"].update(session_0=d[0]["conversation"]["session_1"]),
            r"field 'conversation.session_0': sessions are numbered from 1",
        ),
        (
            lambda d: d[0].update(session_summary=["a", "b"]),
            r"sample 'conv-26': field 'session_summary' must be an object of session entries, got list",
        ),
        (
            lambda d: d[0].update(observation="none"),
            r"sample 'conv-26': field 'observation' must be an object of session entries, got str",
        ),
    ],
)
def test_unusable_records_are_refused(locomo_path, tmp_path, edit, message):
    with pytest.raises(LocomoFormatError, match=message):
        load_locomo(_broken_copy(locomo_path, tmp_path, edit))


def test_non_utf8_byte_names_the_file_and_offset(locomo_path, tmp_path):
    # A Latin-1 "é" inside the first question: the error points at its byte, not at a decoder frame.
    path = _write_broken(locomo_path, tmp_path, lambda d: None, raw=lambda b: b.replace(b"LGBTQ", b"LGBTQ\xe9", 1))
    offset = path.read_bytes().index(b"\xe9")
    with pytest.raises(LocomoFormatError, match=rf"broken.json: not UTF-8 at byte {offset} \(b'\\xe9'"):
        load_locomo(path)


def test_evidence_that_names_no_turn_is_dropped_with_a_warning_and_counted(locomo_path, tmp_path, caplog):
    def edit(d):
        d[0]["qa"][0]["evidence"] = ["D1:3", "D99:999", "D0:0"]
        d[0]["observation"]["session_1_observation"]["Caroline"][0][1] = "D1:999"

    path = _broken_copy(locomo_path, tmp_path, edit)
    summary = preprocess_locomo(path, outputs_in(tmp_path), split=SMALL_SPLIT, summary_path=tmp_path / "s.json")
    assert "sample 'conv-26', qa[0]: field 'evidence': ['D99:999', 'D0:0'] name no turn" in caplog.text
    assert "field 'observation.session_1_observation.Caroline[0]': evidence D1:999 names no turn" in caplog.text
    row = pq.read_table(tmp_path / "train.parquet").slice(0, 1).to_pylist()[0]
    assert row["extra_info"]["qa_index"] == 0 and row["extra_info"]["evidence"] == ["D1:3"]
    memory = pq.read_table(tmp_path / "memories.parquet").slice(0, 1).to_pylist()[0]
    assert memory["evidence"] == []
    assert summary["evidence_dangling"][0] == {"sample_id": "conv-26", "qa_index": 0, "ids": ["D99:999", "D0:0"]}
    assert summary["observation_evidence_dangling"] == [
        {"sample_id": "conv-26", "field": "observation.session_1_observation.Caroline[0]", "id": "D1:999"}
    ]
    assert json.loads((tmp_path / "s.json").read_text())["warnings"]["observation_evidence_dangling"] == 1


def test_real_file_quirks_are_counted_in_the_summary(built):
    _, summary = built
    # Two published evidence ids name turns that do not exist; one evidence string is a bare "D".
    assert summary["warnings"] == {"evidence_unparsed": 1, "evidence_dangling": 2, "observation_evidence_dangling": 0}
    assert summary["evidence_dangling"] == [
        {"sample_id": "conv-42", "qa_index": 58, "ids": ["D10:19"]},
        {"sample_id": "conv-47", "qa_index": 38, "ids": ["D4:36"]},
    ]


def test_conversation_without_memories_fails_naming_sample_and_source(locomo_path, tmp_path):
    path = _broken_copy(locomo_path, tmp_path, lambda d: d[1].pop("observation"))
    with pytest.raises(
        LocomoFormatError,
        match=r"broken.json, sample 'conv-30': memory source 'observation' gives no memories .*split 'test'",
    ):
        preprocess_locomo(path, outputs_in(tmp_path / "out"), split=SMALL_SPLIT)
    # Another source still works for the same conversation.
    summary = preprocess_locomo(
        path, outputs_in(tmp_path / "out"), split=SMALL_SPLIT, memory_sources=["session_summary"]
    )
    assert summary["memories"]["conv-30"] == 19


def test_a_copy_replaced_by_hand_after_the_fetch_is_not_preprocessed(locomo_path, tmp_path):
    """The rule passes the sha256 of config/config.yaml: a copy edited since fetch_data verified it is refused."""
    edited = _broken_copy(locomo_path, tmp_path, lambda d: d[0]["qa"][0].update(answer="edited"))
    out = tmp_path / "out"
    with pytest.raises(ChecksumMismatch, match="the copy changed after it was fetched"):
        preprocess_locomo(edited, outputs_in(out), split=SMALL_SPLIT, sha256=sha256_file(locomo_path))
    assert not out.exists() or list(out.iterdir()) == []


def test_a_failed_rerun_leaves_none_of_the_previous_outputs(locomo_path, tmp_path):
    good = _broken_copy(locomo_path, tmp_path, lambda d: None)
    out = tmp_path / "out"
    preprocess_locomo(good, outputs_in(out), split=SMALL_SPLIT, summary_path=out / "summary.json")
    assert sorted(p.name for p in out.iterdir()) == [
        "memories.parquet",
        "summary.json",
        "test.parquet",
        "train.parquet",
        "val.parquet",
    ]
    bad = _broken_copy(locomo_path, tmp_path, lambda d: d[1]["qa"][0].update(answer=""))
    with pytest.raises(LocomoFormatError, match="field 'answer' is empty"):
        preprocess_locomo(bad, outputs_in(out), split=SMALL_SPLIT, summary_path=out / "summary.json")
    assert list(out.iterdir()) == []


def test_the_memory_r1_split_gives_its_published_question_counts(locomo_path, tmp_path):
    """Memory-R1: 152 / 81 / 1,307 questions of categories 1-4 (conversation 1 / 2 / 3-10)."""
    config = yaml.safe_load((Path(__file__).resolve().parents[2] / "config/config.yaml").read_text())
    split = config["data"]["locomo"]["splits"]["memory_r1"]
    summary = preprocess_locomo(locomo_path, outputs_in(tmp_path), split=split, split_name="memory_r1")
    assert summary["split"] == "memory_r1"
    counts = {part: sum(n for c, n in s["by_category"].items() if int(c) <= 4) for part, s in summary["splits"].items()}
    assert counts == {"train": 152, "val": 81, "test": 1307}


def test_a_stage_trains_on_the_questions_its_train_on_selects(locomo_rows, tmp_path):
    """train_on: categories, and the questions whose evidence lies in the first N sessions (a curriculum)."""
    rows = locomo_rows["train"]
    every = pq.read_table(rows).column("extra_info").combine_chunks()
    out = tmp_path / "stage3.parquet"
    summary = select_rows(rows, out, categories=[1, 4], sessions=5)
    kept = pq.read_table(out)
    info = kept.column("extra_info").combine_chunks()
    assert set(info.field("category").to_pylist()) <= {1, 4}
    sessions = [max(int(e[1:].split(":")[0]) for e in ids) for ids in info.field("evidence").to_pylist()]
    assert sessions and max(sessions) <= 5
    assert summary["kept"] == kept.num_rows and summary["kept"] + summary["left_out"] == len(every)
    # Exactly the rows that qualify: of categories 1 and 4, with evidence, all of it in sessions 1-5.
    expected = [
        ns
        for ns, c, ids in zip(
            every.field("namespace").to_pylist(),
            every.field("category").to_pylist(),
            every.field("evidence").to_pylist(),
            strict=True,
        )
        if c in (1, 4) and ids and max(int(e[1:].split(":")[0]) for e in ids) <= 5
    ]
    assert info.field("namespace").to_pylist() == expected
    # The rows keep every column, as training reads them.
    assert kept.schema == pq.read_schema(rows)
    with pytest.raises(ValueError, match="experiments.x.stage3.train_on .* leaves none of the"):
        select_rows(rows, tmp_path / "none.parquet", categories=[5], where="experiments.x.stage3.train_on")
    assert not (tmp_path / "none.parquet").exists()


@pytest.mark.parametrize("read", [lambda rows, out: select_rows(rows, out), scorable_rows])
def test_a_rows_file_without_its_records_is_named(tmp_path, read):
    """A parquet of other columns stopped with pyarrow's KeyError or ArrowInvalid, naming no file (issue 58)."""
    import pyarrow as pa

    rows = tmp_path / "train.parquet"
    pq.write_table(pa.table({"question": ["When?"]}), rows)
    with pytest.raises(ValueError, match=r"train.parquet is not a rows table .*: no column 'extra_info' \(columns: "):
        read(rows, tmp_path / "out.parquet")
