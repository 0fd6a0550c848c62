"""Rows with headroom (memupdate.data.headroom) on conv-26, through the rule's function: the one definition the
rules, the expert and the reports use."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from memupdate.data.headroom import FLAGS_SCHEMA, read_flags, write_headroom_rows
from memupdate.settings import RewardSettings


def write(locomo_rows, held_out_cache, tmp_path, **overrides):
    out = {name: tmp_path / f"headroom.{name}" for name in ("rows.parquet", "flags.parquet", "summary.json")}
    settings = dict(search_top_k=20, top_k=RewardSettings.top_k, context_chars=RewardSettings.context_chars, share=0.5)
    summary = write_headroom_rows(
        locomo_rows["train"],
        locomo_rows["memories"],
        held_out_cache,
        out["rows.parquet"],
        out["flags.parquet"],
        embedding_model="all-MiniLM-L6-v2",
        summary=out["summary.json"],
        **{**settings, **overrides},
    )
    return summary, out


def test_the_mix_holds_every_question_with_headroom_and_as_many_others(locomo_rows, held_out_cache, tmp_path):
    summary, out = write(locomo_rows, held_out_cache, tmp_path)
    rows = pq.read_table(out["rows.parquet"])
    flags = read_flags(out["flags.parquet"])
    everything = pq.read_table(locomo_rows["train"])
    assert rows.schema == everything.schema and len(flags) == everything.num_rows
    assert pq.read_schema(out["flags.parquet"]).remove_metadata() == FLAGS_SCHEMA
    chosen = [info["namespace"] for info in rows.column("extra_info").to_pylist()]
    with_room = [ns for ns, f in flags.items() if f["headroom"]]
    assert set(with_room) <= set(chosen) and len(chosen) == 2 * len(with_room)
    assert all(flags[ns]["selected"] for ns in chosen) and sum(f["selected"] for f in flags.values()) == len(chosen)
    # conv-26 (measured): 28 of its questions have headroom at a top-20 search, their evidence memory below the
    # reader's context (ranks 1-5 within 650 characters: 4 or 5 memories).
    assert len(with_room) == 28 and summary["headroom"] == 28
    assert all(5 <= flags[ns]["evidence_rank"] <= 20 for ns in with_room)
    assert all(f["evidence_rank"] is None for f in flags.values() if not f["headroom"])
    assert json.loads(out["summary.json"].read_text()) == summary


def test_a_search_that_shows_only_what_the_reader_reads_finds_no_headroom(locomo_rows, held_out_cache, tmp_path):
    """The reader always reads the top hit: a search of one shows nothing outside its context. The rule fails,
    naming the setting to widen, and leaves no output behind."""
    with pytest.raises(ValueError, match="no question has headroom .*widen search_top_k"):
        write(locomo_rows, held_out_cache, tmp_path, search_top_k=1)
    assert not list(tmp_path.iterdir())
