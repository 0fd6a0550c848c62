"""The ingestion expert's program (memupdate.training.ingestion_expert), reply by reply on a real session row:
what it searches for, what it merges from what a search shows, and when it stops."""

import json

import pyarrow.parquet as pq
import pytest

from memupdate.data.ingestion import build_ingestion_rows
from memupdate.names import MERGE_TOOL, SEARCH_TOOL
from memupdate.training.demonstrations import DONE, read_memories
from memupdate.training.ingestion_expert import IngestionExpert, merge_targets

#: conv-26's session 10, whose first merge target the expert finds (tests/training/test_sft.py runs it).
SESSION = 10


@pytest.fixture(scope="module")
def session_rows(locomo_rows, tmp_path_factory):
    path = tmp_path_factory.mktemp("ingest") / "ingest.parquet"
    build_ingestion_rows(str(locomo_rows["train"]), str(locomo_rows["memories"]), str(path), split="train")
    return pq.read_table(path).to_pylist()


def expert(session_rows, locomo_rows, turns):
    return IngestionExpert(
        None,
        session_rows,
        str(locomo_rows["memories"]),
        max_content_chars=200,
        max_new_tokens=512,
        max_assistant_turns=turns,
        search_top_k=5,
    )


def call(reply):
    return json.loads(reply.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))


def test_the_expert_searches_with_a_new_memory_and_merges_what_cites_the_evidence(session_rows, locomo_rows):
    row = next(r for r in session_rows if r["extra_info"]["session"] == SESSION)
    memories = read_memories(str(locomo_rows["memories"]))["conv-26"]
    info = row["extra_info"]
    new_ids = [i for i, m in memories.items() if f"D{SESSION}:" in " ".join(m.evidence)]
    query, evidence = merge_targets(info["questions"], SESSION, new_ids, memories)[0]
    citing = sorted(i for i, m in memories.items() if m.evidence & evidence)
    transcript = row["prompt"][0]["content"] + "\n" + row["prompt"][1]["content"]

    player = expert(session_rows, locomo_rows, turns=3)
    search = call(player.reply("r", transcript))
    assert search == {"name": SEARCH_TOOL, "arguments": {"query": memories[query].content, "top_k": 5}}
    assert memories[query].content in row["prompt"][1]["content"]  # the policy has the query in its prompt
    # A search result that shows the memories citing the evidence, among others.
    shown = "".join(f"[{i}] (session {i}) {memories[i].content}\n" for i in [citing[0], 3, *citing[1:]])
    transcript += "<tool_call>...</tool_call>" + shown
    merge = call(player.reply("r", transcript))
    assert merge["name"] == MERGE_TOOL and len(merge["arguments"]["memory_ids"]) >= 2
    assert set(merge["arguments"]["memory_ids"]) <= set(citing)
    assert len(merge["arguments"]["content"]) <= 200
    assert player.reply("r", transcript + "<tool_call>...</tool_call>Merged.") == DONE
    assert player.actions["r"] == [SEARCH_TOOL, MERGE_TOOL, DONE]


def test_a_search_that_shows_one_memory_citing_the_evidence_is_no_reason_to_rewrite_it(session_rows, locomo_rows):
    """One memory is never rewritten (its date metadata already dates it for the reader): the expert goes on
    to its next target, here DONE, its turns spent."""
    row = next(r for r in session_rows if r["extra_info"]["session"] == SESSION)
    memories = read_memories(str(locomo_rows["memories"]))["conv-26"]
    new_ids = [i for i, m in memories.items() if f"D{SESSION}:" in " ".join(m.evidence)]
    query, evidence = merge_targets(row["extra_info"]["questions"], SESSION, new_ids, memories)[0]
    transcript = row["prompt"][0]["content"] + "\n" + row["prompt"][1]["content"]
    player = expert(session_rows, locomo_rows, turns=3)
    assert call(player.reply("r", transcript))["name"] == SEARCH_TOOL
    # The search shows the query's memory, which cites the evidence, and one that does not.
    other = next(i for i, m in memories.items() if not m.evidence & evidence)
    shown = "".join(f"[{i}] (session {SESSION}) {memories[i].content}\n" for i in (query, other))
    transcript += "<tool_call>...</tool_call>" + shown
    assert player.reply("r", transcript) == DONE
    assert player.actions["r"] == [SEARCH_TOOL, DONE]


def test_the_expert_stops_when_its_turns_leave_no_room_for_a_merge(session_rows, locomo_rows):
    row = next(r for r in session_rows if r["extra_info"]["session"] == SESSION)
    transcript = row["prompt"][1]["content"]
    # A search is worth making only with two more replies to come: its merge, then DONE.
    assert expert(session_rows, locomo_rows, turns=2).reply("r", transcript) == DONE
    # A session with nothing to merge (the first: no question spans two memories yet) stops at once.
    first = next(r for r in session_rows if r["extra_info"]["session"] == 1)
    assert expert(session_rows, locomo_rows, turns=5).reply("q", first["prompt"][1]["content"]) == DONE


def test_an_unknown_session_is_named(session_rows, locomo_rows):
    with pytest.raises(ValueError, match="the expert has no row for this prompt"):
        expert(session_rows, locomo_rows, turns=3).reply("r", "Conversation between A and B. Session 3 (x) ...")
