"""Question-agnostic memory building (the Mem0, Memory-R1 and LoCoMo protocol): rows of ingestion episodes.

A conversation arrives session by session. One ingestion row is one session of one conversation: the
episode's store holds the conversation's memories up to that session, the session's own just added (what
the memories table holds for it: observations, turns or summaries, per ``data.locomo.memory_sources``); the
prompt lists those new memories, and the memory agent edits the store with the same tools as in a
question-conditioned episode (Memory-R1's ADD / UPDATE / DELETE / NOOP: leave a new memory as it is,
rewrite an older one with it, merge them, delete a stale or repeated one). **It never sees a question**:
the prompt names the speakers, the session and its memories only.

Training starts each session's episode from a reference store, the memories of every earlier session as
the table has them (what an agent that edits nothing would hold: the ``append`` baseline of
:mod:`memupdate.rewards.memory`); evaluation continues each session from the store its own earlier
episodes built (:meth:`memupdate.eval.locomo.LocomoEvaluator.run_ingestion_system`).

The reward of a session is scored on the conversation's questions whose evidence lies in the sessions
seen so far (every evidence id in sessions 1..s; a question without evidence ids is never used, as where
its answer lies is unknown), at most ``questions_per_session`` of them: first those with evidence in the
new session, then the others, each group in an order seeded by the row. They travel in ``extra_info``,
which the reward reads and no prompt contains.

>>> session_namespace("conv-26", 3)
'conv-26-s3-20e10bfe'
"""

from __future__ import annotations

import hashlib
import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from memupdate.data.locomo import DATA_SOURCE_PREFIX, evidence_session, row_schema
from memupdate.memory.store import MemoryRecord
from memupdate.names import MEMORY_AGENT, MEMORY_TOOLS
from memupdate.prompts import format_record
from memupdate.utils.io import ROWS_TABLE, read_parquet_columns, write_parquet_atomic
from memupdate.utils.seeding import seeded_random

logger = logging.getLogger(__name__)

SYSTEM_PROMPT = (
    "You maintain the long-term memory database of a conversational assistant. "
    "The database holds short memories about a long conversation between two people, which arrives one "
    "session at a time. Later, another model will answer questions about the conversation using only the few "
    "memories that a search returns, so the memories must be correct, current, specific, dated where the "
    "conversation gives a date, free of repeats, and easy to retrieve.\n\n"
    "A session has just ended and its new memories have been added to the database. Use the tools to fit them "
    "in: search for older memories they repeat, update or contradict, then update, merge, split or delete "
    "memories. A new memory you leave alone stays as it is. "
    "Every memory is shown with a short id in brackets, like [3]; use that id to refer to it. "
    "Do not invent facts that the memories do not support. "
    "When the database is good enough, reply with DONE and no tool call."
)

USER_TEMPLATE = (
    "Conversation between {speaker_a} and {speaker_b}. Session {session} ({date}) has just ended; "
    "the database now holds {n_memories} memories from sessions 1 to {session}.\n\n"
    "New memories from session {session}:\n{new_memories}\n\n"
    "Fit the new memories into the database."
)

QUESTION_TYPE = pa.struct(
    [
        ("qa_index", pa.int64()),
        ("question", pa.string()),
        ("answer", pa.string()),
        ("category", pa.int64()),
        ("evidence", pa.list_(pa.string())),
    ]
)

ROW_SCHEMA = row_schema(
    [
        ("index", pa.int64()),
        ("split", pa.string()),
        ("namespace", pa.string()),
        ("sample_id", pa.string()),
        ("session", pa.int64()),
        ("sessions_total", pa.int64()),
        ("new_memories", pa.int64()),
        ("questions", pa.list_(QUESTION_TYPE)),
    ],
    [("sample_id", pa.string()), ("namespace", pa.string()), ("sessions", pa.int64())],
)


def session_namespace(sample_id: str, session: int) -> str:
    """Stable namespace of one session's ingestion episode: ``{sample_id}-s{session}-{8 hex}``."""
    digest = hashlib.sha256(f"{sample_id}\x1fingest\x1f{session}".encode()).hexdigest()[:8]
    return f"{sample_id}-s{session}-{digest}"


def is_ingestion_row(extra_info: Mapping[str, Any]) -> bool:
    """Whether a row's ``extra_info`` is an ingestion episode's (a session) rather than a question's."""
    return extra_info.get("session") is not None and "question" not in extra_info


def questions_seen(questions: Sequence[Mapping[str, Any]], session: int) -> list[dict[str, Any]]:
    """The questions (``extra_info`` of LoCoMo rows) whose every evidence id lies in sessions 1..``session``,
    with an answer; those without evidence ids are left out.

    >>> qs = [{"question": "a", "answer": "x", "evidence": ["D1:2"]}, {"question": "b", "answer": "y",
    ...       "evidence": ["D1:1", "D3:4"]}, {"question": "c", "answer": "z", "evidence": []}]
    >>> [q["question"] for q in questions_seen(qs, 2)]
    ['a']
    """
    return [
        dict(q)
        for q in questions
        if q.get("answer") and q.get("evidence") and max(evidence_session(e) for e in q["evidence"]) <= session
    ]


def reward_questions(
    questions: Sequence[Mapping[str, Any]], session: int, limit: int | None, seed_key: str
) -> list[dict[str, Any]]:
    """The questions a session's reward is scored on (module docstring): seen so far, those with evidence in
    ``session`` first, at most ``limit`` (None: all), in an order seeded by ``seed_key``."""
    seen = questions_seen(questions, session)
    rng = seeded_random(seed_key)
    new = [q for q in seen if any(evidence_session(e) == session for e in q["evidence"])]
    old = [q for q in seen if not any(evidence_session(e) == session for e in q["evidence"])]
    rng.shuffle(new)
    rng.shuffle(old)
    chosen = new + old
    return chosen if limit is None else chosen[:limit]


def build_prompt(
    speakers: Sequence[str], session: int, date: str | None, new_memories: Sequence[Any], n_memories: int
) -> list[dict[str, str]]:
    """The chat messages of one session's ingestion episode (training and evaluation alike).

    ``new_memories`` are records (``id``, ``content``, ``speaker``, ``session``, ``date``) shown as the tools
    show memories; ``n_memories`` is the store's size with them.
    """
    a, b = (list(speakers) + ["one speaker", "the other"])[:2]
    user = USER_TEMPLATE.format(
        speaker_a=a,
        speaker_b=b,
        session=session,
        date=date or "unknown date",
        n_memories=n_memories,
        new_memories="\n".join(format_record(m) for m in new_memories),
    )
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def session_row(
    sample_id: str,
    session: int,
    new: Sequence[Mapping[str, Any]],
    *,
    speakers: Sequence[str],
    n_memories: int,
    questions: Sequence[Mapping[str, Any]] = (),
    split: str = "test",
    index: int = 0,
    sessions_total: int | None = None,
) -> dict[str, Any]:
    """The row of one session's ingestion episode: ``new`` are its memories-table rows, ``n_memories`` the
    size of the store they were added to (with them), ``questions`` those its reward is scored on."""
    namespace = session_namespace(sample_id, session)
    create = {"sample_id": sample_id, "namespace": namespace, "sessions": session}
    return {
        "data_source": f"{DATA_SOURCE_PREFIX}-ingest-{sample_id}",
        "agent_name": MEMORY_AGENT,
        "prompt": build_prompt(
            speakers, session, new[0].get("date"), [MemoryRecord.from_row(r) for r in new], n_memories
        ),
        "ability": "memory",
        "reward_model": {"style": "ingestion", "ground_truth": ""},
        "extra_info": {
            "index": index,
            "split": split,
            "namespace": namespace,
            "sample_id": sample_id,
            "session": session,
            "sessions_total": sessions_total,
            "new_memories": len(new),
            "questions": [
                {
                    "qa_index": q["qa_index"],
                    "question": q["question"],
                    "answer": q["answer"],
                    "category": q["category"],
                    "evidence": list(q["evidence"]),
                }
                for q in questions
            ],
            "tools_kwargs": {tool: {"create_kwargs": create} for tool in MEMORY_TOOLS},
        },
    }


def conversation_sessions(memories: Sequence[Mapping[str, Any]]) -> dict[str, dict[int, list[Mapping[str, Any]]]]:
    """The memories-table rows of each conversation by session, both in order."""
    out: dict[str, dict[int, list[Mapping[str, Any]]]] = {}
    for row in memories:
        if row.get("session") is None:
            raise ValueError(f"memory {row['memory_id']} of {row['sample_id']!r} has no session: ingestion needs one")
        out.setdefault(row["sample_id"], {}).setdefault(int(row["session"]), []).append(row)
    return {sample: dict(sorted(by_session.items())) for sample, by_session in out.items()}


def speakers_of(memories: Sequence[Mapping[str, Any]]) -> list[str]:
    """The conversation's speakers in the order they first appear in its memories."""
    return list(dict.fromkeys(r["speaker"] for r in memories if r.get("speaker")))


def session_rows(
    memories: Sequence[Mapping[str, Any]],
    questions: Sequence[Mapping[str, Any]],
    split: str,
    *,
    questions_per_session: int | None = None,
) -> list[dict[str, Any]]:
    """The training rows: one per (conversation, session) of the memories-table rows ``memories`` that has a
    question to score it on, in conversation then session order, each starting from every earlier memory.
    ``questions`` are LoCoMo rows' ``extra_info`` (their conversations' questions, for the reward)."""
    asked: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for q in questions:
        asked[q["sample_id"]].append(q)
    rows: list[dict[str, Any]] = []
    for sample_id, by_session in conversation_sessions(memories).items():
        everything = [r for new in by_session.values() for r in new]
        seen = 0
        for session, new in by_session.items():
            seen += len(new)
            chosen = reward_questions(
                asked[sample_id], session, questions_per_session, session_namespace(sample_id, session)
            )
            if not chosen:
                continue
            rows.append(
                session_row(
                    sample_id,
                    session,
                    new,
                    speakers=speakers_of(everything),
                    n_memories=seen,
                    questions=chosen,
                    split=split,
                    index=len(rows),
                    sessions_total=len(by_session),
                )
            )
    return rows


def build_ingestion_rows(
    qa_rows: str,
    memories: str,
    output: str,
    *,
    split: str,
    questions_per_session: int | None = None,
) -> dict[str, Any]:
    """Write the ingestion rows of the conversations of ``qa_rows`` (a LoCoMo split's parquet) from the
    ``memories`` table; returns counts. Every session with a question to score it on gets a row."""
    questions = [r["extra_info"] for r in read_parquet_columns(qa_rows, {"extra_info": None}, ROWS_TABLE).to_pylist()]
    samples = {q["sample_id"] for q in questions}
    table = read_parquet_columns(memories, {"sample_id": None}, "a memories table", only=False)
    kept = [r for r in table.to_pylist() if r["sample_id"] in samples]
    rows = session_rows(kept, questions, split, questions_per_session=questions_per_session)
    if not rows:
        raise ValueError(f"{qa_rows}: no session of its conversations has a question whose evidence it holds")
    write_parquet_atomic(output, pa.Table.from_pylist(rows, schema=ROW_SCHEMA))
    summary = {
        "rows": len(rows),
        "conversations": sorted(samples),
        "questions_per_row": [len(r["extra_info"]["questions"]) for r in rows],
    }
    logger.info("%s: %d ingestion rows from %d conversations", output, len(rows), len(samples))
    return summary


def select_sessions(rows: str, output: str, *, sessions: int | None = None, where: str = "train_on") -> dict[str, Any]:
    """Write the ingestion rows of ``rows`` of sessions 1..``sessions`` (a curriculum stage's ``train_on``;
    None: all); returns the counts kept and left out. ``where`` names the setting in errors."""
    table = read_parquet_columns(rows, {"extra_info": None}, ROWS_TABLE, only=False)
    session = table.column("extra_info").combine_chunks().field("session").to_pylist()
    keep = [sessions is None or s <= sessions for s in session]
    selected = table.filter(pa.array(keep))
    if selected.num_rows == 0:
        raise ValueError(f"{where} (sessions {sessions}) leaves none of the {table.num_rows} rows of {rows}: widen it")
    write_parquet_atomic(output, selected)
    logger.info("%s: kept %d of %d session rows of %s", where, selected.num_rows, table.num_rows, rows)
    return {
        "rows": rows,
        "sessions": sessions,
        "kept": selected.num_rows,
        "left_out": table.num_rows - selected.num_rows,
    }
