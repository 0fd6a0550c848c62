"""LoCoMo: load and validate ``locomo10.json``, split by conversation, write verl rows and initial memories.

The file is the one released with Maharana et al. (ACL 2024), CC BY-NC 4.0. Facts this module relies on
(``data-models-anchors.md`` §1): 10 conversations, 1,986 QA pairs; categories 1 multi-hop, 2 temporal,
3 open-domain, 4 single-hop, 5 adversarial (``adversarial_answer``, usually no ``answer``); six answers
are ints; six evidence strings are malformed and two evidence ids name turns that do not exist
(``conv-42`` qa[58] ``D10:19``, ``conv-47`` qa[38] ``D4:36``). Malformed strings are repaired where their
meaning is clear; ids that name no turn are dropped from the rows with a warning and counted in the summary,
so no row points at evidence that is not there. Anything that would make the data unusable (a session
without turns, an empty gold answer, a conversation whose memory source gives no memories, bytes that are
not UTF-8) is an error that names the file, the record and the field.

Fixes over the upstream preprocessing (``upstream-systems.md`` §1a, §1h): the split is by conversation
and written in config (not ``random.seed(42)``); namespaces are hashes, so reruns give the same ones
(upstream used ``uuid4``); ``extra_info`` is a native nested parquet column, not a JSON string; initial
memories keep speaker, session, date and evidence.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from memupdate.data.fetch import verify_copy
from memupdate.names import MEMORY_AGENT, MEMORY_TOOLS
from memupdate.utils.io import (
    CONTROL_CHARACTERS,
    ROWS_TABLE,
    DuplicateKeyError,
    TooDeepError,
    atomic_outputs,
    json_loads_strict,
    lone_surrogate,
    read_parquet_columns,
    read_text_utf8,
    sha256_file,
    write_json_atomic,
    write_parquet_atomic,
)

logger = logging.getLogger(__name__)

CATEGORY_NAMES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"}
MEMORY_SOURCES = ("observation", "session_summary", "dialogue")
# The field of a LoCoMo sample that each memory source reads.
_SOURCE_FIELDS = {
    "observation": "observation",
    "session_summary": "session_summary",
    "dialogue": "conversation",
}
DATA_SOURCE_PREFIX = "locomo"

_DIA_ID = re.compile(r"D:?(\d+):(\d+)")
_SESSION_KEY = re.compile(r"session_(\d+)")
#: Longest observation taken as a memory: LoCoMo's run to 180 characters; a longer one is a broken record, not a
#: fact, and would crowd the reader's context.
MAX_FACT_CHARS = 2000

SYSTEM_PROMPT = (
    "You maintain the long-term memory database of a conversational assistant. "
    "The database holds short memories about a long conversation between two people. "
    "Later, another model will answer questions using only the few memories that a search returns, "
    "so the memories must be correct, specific, dated where the conversation gives a date, and easy to retrieve.\n\n"
    "Use the tools to inspect and edit the database: search it, then create, update, merge, split or "
    "delete memories so that the target question, and questions like it, can be answered from it. "
    "Every memory is shown with a short id in brackets, like [3]; use that id to refer to it. "
    "Do not answer the question yourself and do not invent facts that the memories do not support. "
    "When the database is good enough, reply with DONE and no tool call."
)

USER_TEMPLATE = (
    "Memory database: {n_memories} memories from {n_sessions} sessions of a conversation between "
    "{speaker_a} and {speaker_b}, from {first_date} to {last_date}.\n\n"
    "Target question: {question}\n\n"
    "Improve the memory database so that this question can be answered correctly from it."
)


class LocomoFormatError(ValueError):
    """A record of the LoCoMo file does not have the expected shape; the message names where."""


def _where(path: str | Path, sample_id: str | None = None, qa_index: int | None = None) -> str:
    parts = [Path(path).name]
    if sample_id is not None:
        parts.append(f"sample {sample_id!r}")
    if qa_index is not None:
        parts.append(f"qa[{qa_index}]")
    return ", ".join(parts)


def _canonical_dia_id(text: str) -> str:
    match = _DIA_ID.fullmatch(text)
    return f"D{int(match.group(1))}:{int(match.group(2))}"


@dataclass(frozen=True)
class EvidenceParse:
    ids: tuple[str, ...]
    unparsed: tuple[str, ...]
    repaired: tuple[str, ...]


def parse_evidence(items: Iterable[Any]) -> EvidenceParse:
    """Parse LoCoMo evidence strings into canonical dialogue ids ``D<session>:<turn>``.

    Malformed strings seen in the real file are repaired where their meaning is clear and reported
    where it is not:

    >>> parse_evidence(["D8:6; D9:17", "D", "D:11:26", "D9:1 D4:4"])
    EvidenceParse(ids=('D8:6', 'D9:17', 'D11:26', 'D9:1', 'D4:4'), unparsed=('D',), repaired=('D8:6; D9:17', 'D:11:26', 'D9:1 D4:4'))
    """
    ids: list[str] = []
    unparsed: list[str] = []
    repaired: list[str] = []
    for item in items:
        text = str(item).strip()
        tokens = [t for t in re.split(r"[;,\s]+", text) if t]
        parsed_here = 0
        for token in tokens:
            match = _DIA_ID.fullmatch(token)
            if match is None:
                unparsed.append(token)
                continue
            canonical = _canonical_dia_id(token)
            parsed_here += 1
            if canonical not in ids:
                ids.append(canonical)
        if parsed_here and (len(tokens) > 1 or not re.fullmatch(r"D\d+:\d+", text)):
            repaired.append(text)
        if not tokens:
            unparsed.append(text)
    return EvidenceParse(tuple(ids), tuple(unparsed), tuple(repaired))


@dataclass(frozen=True)
class LocomoQA:
    sample_id: str
    qa_index: int
    question: str
    answer: str | None
    adversarial_answer: str | None
    category: int
    evidence: tuple[str, ...]
    evidence_unparsed: tuple[str, ...] = ()
    # Well-formed ids that name no turn of the conversation; dropped from ``evidence``.
    evidence_dangling: tuple[str, ...] = ()

    @property
    def namespace(self) -> str:
        return base_namespace(self.sample_id, self.qa_index, self.question)


@dataclass(frozen=True)
class Turn:
    speaker: str
    dia_id: str
    text: str
    image_caption: str | None = None


@dataclass(frozen=True)
class Session:
    index: int
    date_time: str | None
    turns: tuple[Turn, ...]
    summary: str | None = None
    # speaker -> list of (fact text, evidence ids)
    observations: tuple[tuple[str, tuple[tuple[str, tuple[str, ...]], ...]], ...] = ()


@dataclass(frozen=True)
class LocomoConversation:
    sample_id: str
    speaker_a: str
    speaker_b: str
    sessions: tuple[Session, ...]
    qa: tuple[LocomoQA, ...] = field(repr=False)
    # Observation evidence ids that name no turn, dropped: ``(field path, id)`` pairs.
    observation_evidence_dangling: tuple[tuple[str, str], ...] = ()


def base_namespace(sample_id: str, qa_index: int, question: str) -> str:
    """Stable per-row namespace ``{sample_id}-qa{index}-{8 hex}``; the hex is a hash of all three.

    >>> base_namespace("conv-26", 0, "When did Caroline go to the LGBTQ support group?")
    'conv-26-qa0-ff702917'
    """
    digest = hashlib.sha256(f"{sample_id}\x1f{qa_index}\x1f{question}".encode()).hexdigest()[:8]
    return f"{sample_id}-qa{qa_index}-{digest}"


def _require(obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(obj, dict):
        raise LocomoFormatError(f"{where}: expected an object, got {type(obj).__name__}")
    if key not in obj:
        raise LocomoFormatError(f"{where}: field {key!r} is missing")
    value = obj[key]
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise LocomoFormatError(f"{where}: field {key!r} must be {names}, got {type(value).__name__}")
    return value


def _text(obj: Any, key: str, where: str, *, empty_ok: bool = False) -> str:
    """``obj[key]``, a string that says something (unless ``empty_ok``) and holds no control character."""
    value = _require(obj, key, str, where)
    _check_text(value, key, where, empty_ok=empty_ok)
    return value


def _check_text(value: str, key: str, where: str, *, empty_ok: bool = False) -> None:
    if not empty_ok and not value.strip():
        raise LocomoFormatError(f"{where}: field {key!r} is empty")
    if found := CONTROL_CHARACTERS.search(value):
        raise LocomoFormatError(
            f"{where}: field {key!r} holds the control character {found.group()!r} at {found.start()}"
        )


def _mapping(sample: dict, key: str, where: str) -> dict:
    """``sample[key]``, an object of session entries, or {} if absent."""
    value = sample.get(key) or {}
    if not isinstance(value, dict):
        raise LocomoFormatError(
            f"{where}: field {key!r} must be an object of session entries, got {type(value).__name__}"
        )
    return value


def _parse_qa(raw: Any, path: Path, sample_id: str, index: int) -> LocomoQA:
    where = _where(path, sample_id, index)
    question = _text(raw, "question", where).strip()
    category = raw.get("category")
    if isinstance(category, bool) or not isinstance(category, int) or category not in CATEGORY_NAMES:
        raise LocomoFormatError(f"{where}: field 'category' must be an integer 1..5, got {category!r}")
    answer = raw.get("answer")
    adversarial = raw.get("adversarial_answer")
    if category == 5:
        if adversarial is None:
            raise LocomoFormatError(f"{where}: category 5 needs field 'adversarial_answer'")
    elif answer is None:
        raise LocomoFormatError(f"{where}: field 'answer' is missing (category {category})")
    for name, value in (("answer", answer), ("adversarial_answer", adversarial)):
        # bool is an int to Python; true as a gold answer is a broken record, not the answer "True".
        if value is not None and (isinstance(value, bool) or not isinstance(value, (str, int, float))):
            raise LocomoFormatError(f"{where}: field {name!r} must be a string or number, got {value!r}")
        # JSON's NaN would become the gold answer "nan".
        if isinstance(value, float) and not math.isfinite(value):
            raise LocomoFormatError(f"{where}: field {name!r} must be a finite number, got {value!r}")
        if isinstance(value, str):
            _check_text(value, name, where, empty_ok=True)
    # The answer a category is scored against must say something: an empty gold answer would score every
    # prediction as wrong (or, for category 5, leave nothing to refuse), like a missing one.
    needed = "adversarial_answer" if category == 5 else "answer"
    if not str(adversarial if category == 5 else answer).strip():
        raise LocomoFormatError(f"{where}: field {needed!r} is empty (category {category} is scored against it)")
    evidence_raw = raw.get("evidence", [])
    if not isinstance(evidence_raw, list):
        raise LocomoFormatError(f"{where}: field 'evidence' must be a list, got {evidence_raw!r}")
    evidence = parse_evidence(evidence_raw)
    if evidence.unparsed:
        logger.warning("%s: evidence %s could not be parsed and is dropped", where, list(evidence.unparsed))
    if evidence.repaired:
        logger.info("%s: evidence %s repaired to %s", where, list(evidence.repaired), list(evidence.ids))
    return LocomoQA(
        sample_id=sample_id,
        qa_index=index,
        question=question,
        answer=None if answer is None else str(answer),
        adversarial_answer=None if adversarial is None else str(adversarial),
        category=category,
        evidence=evidence.ids,
        evidence_unparsed=evidence.unparsed,
    )


def _caption(turn: dict, where: str) -> str | None:
    """A turn's image caption (``blip_caption``): text, or absent."""
    caption = turn.get("blip_caption")
    if caption is not None:
        if not isinstance(caption, str):
            raise LocomoFormatError(f"{where}: field 'blip_caption' must be a string, got {type(caption).__name__}")
        _check_text(caption, "blip_caption", where, empty_ok=True)
    return caption


def _parse_sessions(sample: dict, path: Path, sample_id: str) -> tuple[Session, ...]:
    where = _where(path, sample_id)
    conv = _require(sample, "conversation", dict, where)
    observations = _mapping(sample, "observation", where)
    summaries = _mapping(sample, "session_summary", where)
    indices = sorted(int(m.group(1)) for k in conv if (m := _SESSION_KEY.fullmatch(k)))
    if not indices:
        raise LocomoFormatError(f"{where}: field 'conversation' has no session_N entries")
    if indices[0] < 1:
        # Turn ids name sessions from 1 (D1:3); a session 0 is a broken record, not an earlier session.
        raise LocomoFormatError(f"{where}: field 'conversation.session_{indices[0]}': sessions are numbered from 1")
    sessions = []
    seen_turns: dict[str, str] = {}
    for n in indices:
        turns_raw = _require(conv, f"session_{n}", list, f"{where}, conversation")
        if not turns_raw:
            raise LocomoFormatError(f"{where}: field 'conversation.session_{n}' has no turns")
        turns = []
        for t_index, turn in enumerate(turns_raw):
            t_where = f"{where}, conversation.session_{n}[{t_index}]"
            dia_id = _require(turn, "dia_id", str, t_where)
            # Evidence is resolved against these ids, so they must have the one shape evidence can name.
            if _DIA_ID.fullmatch(dia_id) is None:
                raise LocomoFormatError(f"{t_where}: field 'dia_id' must look like D<session>:<turn>, got {dia_id!r}")
            canonical = _canonical_dia_id(dia_id)
            if int(_DIA_ID.fullmatch(dia_id).group(1)) != n:
                raise LocomoFormatError(
                    f"{t_where}: field 'dia_id' {dia_id!r} names session {canonical[1:].split(':')[0]}, not {n}"
                )
            if canonical in seen_turns:
                raise LocomoFormatError(
                    f"{t_where}: field 'dia_id' {dia_id!r} is already the id of {seen_turns[canonical]}"
                )
            seen_turns[canonical] = f"conversation.session_{n}[{t_index}]"
            turns.append(
                Turn(
                    speaker=_text(turn, "speaker", t_where),
                    dia_id=canonical,
                    text=_text(turn, "text", t_where),
                    image_caption=_caption(turn, t_where),
                )
            )
        obs_raw = observations.get(f"session_{n}_observation") or {}
        if not isinstance(obs_raw, dict):
            raise LocomoFormatError(f"{where}: field 'observation.session_{n}_observation' must be an object")
        obs = []
        for speaker, facts in obs_raw.items():
            if not isinstance(facts, list):
                raise LocomoFormatError(
                    f"{where}: field 'observation.session_{n}_observation.{speaker}' must be a list of facts, "
                    f"got {type(facts).__name__}"
                )
            parsed = []
            for f_index, fact in enumerate(facts):
                f_where = f"{where}, observation.session_{n}_observation.{speaker}[{f_index}]"
                if not (isinstance(fact, list) and len(fact) == 2 and isinstance(fact[0], str)):
                    raise LocomoFormatError(f"{f_where}: expected [fact_text, evidence], got {fact!r}")
                # A fact becomes a memory: an empty one would be a memory that says nothing.
                if not fact[0].strip():
                    raise LocomoFormatError(f"{f_where}: the fact's text is empty")
                if len(fact[0]) > MAX_FACT_CHARS:
                    raise LocomoFormatError(
                        f"{f_where}: the fact's text is {len(fact[0]):,} characters, over {MAX_FACT_CHARS:,} (a memory)"
                    )
                _check_text(fact[0], "text", f_where)
                ev = fact[1] if isinstance(fact[1], list) else [fact[1]]
                parsed.append((fact[0].strip(), parse_evidence(ev).ids))
            obs.append((speaker, tuple(parsed)))
        summary = summaries.get(f"session_{n}_summary")
        if summary is not None and not isinstance(summary, str):
            raise LocomoFormatError(
                f"{where}: field 'session_summary.session_{n}_summary' must be a string, got {type(summary).__name__}"
            )
        if summary is not None:
            _check_text(summary, f"session_summary.session_{n}_summary", where, empty_ok=True)
        date_time = conv.get(f"session_{n}_date_time")
        if date_time is not None and not isinstance(date_time, str):
            raise LocomoFormatError(
                f"{where}: field 'conversation.session_{n}_date_time' must be a string (e.g. '1:56 pm on 8 May, "
                f"2023'), got {date_time!r}"
            )
        if date_time is not None:
            _check_text(date_time, f"conversation.session_{n}_date_time", where, empty_ok=True)
        sessions.append(
            Session(
                index=n,
                date_time=date_time,
                turns=tuple(turns),
                summary=summary,
                observations=tuple(obs),
            )
        )
    return tuple(sessions)


def load_locomo(path: str | Path) -> list[LocomoConversation]:
    """Load and validate ``locomo10.json``. Errors name the file, sample, QA index and field."""
    path = Path(path)
    try:
        raw = json_loads_strict(read_text_utf8(path, LocomoFormatError), path.name)
    except json.JSONDecodeError as exc:
        raise LocomoFormatError(f"{path.name}: not valid JSON: {exc}") from exc
    except (DuplicateKeyError, TooDeepError) as exc:
        raise LocomoFormatError(str(exc)) from None
    if not isinstance(raw, list):
        raise LocomoFormatError(f"{path.name}: expected a list of samples, got {type(raw).__name__}")
    if (at := lone_surrogate(raw)) is not None:
        raise LocomoFormatError(f"{path.name}, {at}: a lone UTF-16 surrogate (\\ud800-\\udfff escape), not text")
    conversations = []
    seen: set[str] = set()
    for s_index, sample in enumerate(raw):
        sample_id = _require(sample, "sample_id", str, f"{path.name}, sample [{s_index}]")
        if sample_id in seen:
            raise LocomoFormatError(f"{_where(path, sample_id)}: duplicate sample_id")
        seen.add(sample_id)
        where = _where(path, sample_id)
        conv = _require(sample, "conversation", dict, where)
        qa_raw = _require(sample, "qa", list, where)
        conversations.append(
            _drop_dangling_evidence(
                LocomoConversation(
                    sample_id=sample_id,
                    speaker_a=_require(conv, "speaker_a", str, f"{where}, conversation"),
                    speaker_b=_require(conv, "speaker_b", str, f"{where}, conversation"),
                    sessions=_parse_sessions(sample, path, sample_id),
                    qa=tuple(_parse_qa(q, path, sample_id, i) for i, q in enumerate(qa_raw)),
                ),
                path,
            )
        )
    return conversations


def _drop_dangling_evidence(conv: LocomoConversation, path: Path) -> LocomoConversation:
    """Drop evidence ids that name no turn of the conversation, with a warning per record.

    The released file has two such ids; they are annotation slips, not reasons to refuse the file, but a
    row must not point the evidence-based reward and reports at a turn that does not exist.
    """
    turn_ids = {t.dia_id for s in conv.sessions for t in s.turns}
    qa = []
    for q in conv.qa:
        dangling = tuple(e for e in q.evidence if e not in turn_ids)
        if dangling:
            logger.warning(
                "%s: field 'evidence': %s name no turn of the conversation and are dropped",
                _where(path, conv.sample_id, q.qa_index),
                list(dangling),
            )
            q = replace(q, evidence=tuple(e for e in q.evidence if e in turn_ids), evidence_dangling=dangling)
        qa.append(q)
    sessions = []
    dropped: list[tuple[str, str]] = []
    for session in conv.sessions:
        observations = []
        for speaker, facts in session.observations:
            kept_facts = []
            for f_index, (text, evidence) in enumerate(facts):
                field_path = f"observation.session_{session.index}_observation.{speaker}[{f_index}]"
                for e in evidence:
                    if e not in turn_ids:
                        logger.warning(
                            "%s: field %r: evidence %s names no turn of the conversation and is dropped",
                            _where(path, conv.sample_id),
                            field_path,
                            e,
                        )
                        dropped.append((field_path, e))
                kept_facts.append((text, tuple(e for e in evidence if e in turn_ids)))
            observations.append((speaker, tuple(kept_facts)))
        sessions.append(replace(session, observations=tuple(observations)))
    return replace(conv, sessions=tuple(sessions), qa=tuple(qa), observation_evidence_dangling=tuple(dropped))


# --------------------------------------------------------------------------- initial memories

MEMORY_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("memory_id", pa.int64()),
        ("content", pa.string()),
        ("speaker", pa.string()),
        ("session", pa.int64()),
        ("date", pa.string()),
        ("evidence", pa.list_(pa.string())),
        ("source", pa.string()),
    ]
)


def initial_memories(conv: LocomoConversation, sources: Sequence[str] = ("observation",)) -> list[dict]:
    """The conversation's seed memories, in a stable order, with ids 0..n-1.

    ``observation``: one memory per generated fact (the LoCoMo paper's RAG database);
    ``session_summary``: one per session summary; ``dialogue``: one per turn, "Speaker: text".
    """
    unknown = [s for s in sources if s not in MEMORY_SOURCES]
    if unknown:
        raise ValueError(f"unknown memory sources {unknown}; choose from {list(MEMORY_SOURCES)}")
    records: list[dict] = []

    def add(content, speaker, session, evidence, source):
        records.append(
            {
                "sample_id": conv.sample_id,
                "memory_id": len(records),
                "content": content,
                "speaker": speaker,
                "session": session.index,
                "date": session.date_time,
                "evidence": list(evidence),
                "source": source,
            }
        )

    for source in sources:
        for session in conv.sessions:
            if source == "observation":
                for speaker, facts in session.observations:
                    for text, evidence in facts:
                        add(text, speaker, session, evidence, source)
            elif source == "session_summary" and session.summary:
                add(session.summary.strip(), None, session, (), source)
            elif source == "dialogue":
                for turn in session.turns:
                    add(turn_line(turn), turn.speaker, session, (turn.dia_id,), source)
    return records


def turn_line(turn: Turn) -> str:
    """A turn as one line of text, ``"Speaker: text"``, a shared photo's caption in brackets.

    >>> turn_line(Turn("Mel", "D1:2", " Look! ", "a dog on a beach"))
    'Mel: Look! [shares a photo: a dog on a beach]'
    """
    text = turn.text.strip()
    if turn.image_caption:
        text = f"{text} [shares a photo: {turn.image_caption}]"
    return f"{turn.speaker}: {text}"


# --------------------------------------------------------------------------- verl rows


def row_schema(
    extra_info: Sequence[tuple[str, pa.DataType]], create_kwargs: Sequence[tuple[str, pa.DataType]]
) -> pa.Schema:
    """The layout of a memory agent's rows (verl's ``RLHFDataset``): ``extra_info`` holds these fields, then
    ``tools_kwargs``, each memory tool's ``create_kwargs`` with these fields (how its trial store opens)."""
    create = pa.struct(list(create_kwargs))
    tools = pa.struct([(tool, pa.struct([("create_kwargs", create)])) for tool in MEMORY_TOOLS])
    return pa.schema(
        [
            ("data_source", pa.string()),
            ("agent_name", pa.string()),
            ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
            ("extra_info", pa.struct([*extra_info, ("tools_kwargs", tools)])),
        ]
    )


ROW_SCHEMA = row_schema(
    [
        ("index", pa.int64()),
        ("split", pa.string()),
        ("namespace", pa.string()),
        ("sample_id", pa.string()),
        ("qa_index", pa.int64()),
        ("question", pa.string()),
        ("answer", pa.string()),
        ("adversarial_answer", pa.string()),
        ("category", pa.int64()),
        ("category_name", pa.string()),
        ("evidence", pa.list_(pa.string())),
    ],
    [("sample_id", pa.string()), ("namespace", pa.string())],
)


def build_prompt(conv: LocomoConversation, question: str, n_memories: int) -> list[dict[str, str]]:
    """The chat messages of one training or evaluation episode (the same for both)."""
    dates = [s.date_time for s in conv.sessions if s.date_time]
    user = USER_TEMPLATE.format(
        n_memories=n_memories,
        n_sessions=len(conv.sessions),
        speaker_a=conv.speaker_a,
        speaker_b=conv.speaker_b,
        first_date=dates[0] if dates else "an unknown date",
        last_date=dates[-1] if dates else "an unknown date",
        question=question,
    )
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def build_rows(
    conversations: Sequence[LocomoConversation],
    split: str,
    memory_counts: dict[str, int],
    drop_categories: Iterable[int] = (),
) -> pa.Table:
    """One row per QA pair of the given conversations, in verl's ``RLHFDataset`` layout."""
    drop = set(drop_categories)
    rows = []
    for conv in conversations:
        for qa in conv.qa:
            if qa.category in drop:
                continue
            namespace = qa.namespace
            create = {"sample_id": conv.sample_id, "namespace": namespace}
            rows.append(
                {
                    "data_source": f"{DATA_SOURCE_PREFIX}-{conv.sample_id}",
                    "agent_name": MEMORY_AGENT,
                    "prompt": build_prompt(conv, qa.question, memory_counts[conv.sample_id]),
                    "ability": "memory",
                    "reward_model": {"style": "memory_delta", "ground_truth": qa.answer},
                    "extra_info": {
                        "index": len(rows),
                        "split": split,
                        "namespace": namespace,
                        "sample_id": conv.sample_id,
                        "qa_index": qa.qa_index,
                        "question": qa.question,
                        "answer": qa.answer,
                        "adversarial_answer": qa.adversarial_answer,
                        "category": qa.category,
                        "category_name": CATEGORY_NAMES[qa.category],
                        "evidence": list(qa.evidence),
                        "tools_kwargs": {tool: {"create_kwargs": create} for tool in MEMORY_TOOLS},
                    },
                }
            )
    return pa.Table.from_pylist(rows, schema=ROW_SCHEMA)


def resolve_split(conversations: Sequence[LocomoConversation], split: dict[str, Sequence[str]]) -> dict:
    """Map split names to conversations; every listed id must exist and appear in one split only."""
    by_id = {c.sample_id: c for c in conversations}
    assigned: dict[str, str] = {}
    resolved = {}
    for name, ids in split.items():
        for sample_id in ids:
            if sample_id not in by_id:
                close = difflib.get_close_matches(sample_id, sorted(by_id), n=1)
                hint = f"; did you mean {close[0]}?" if close else ""
                raise ValueError(
                    f"split {name!r} (data.locomo.splits) lists {sample_id!r}, which is not in the data{hint} "
                    f"(have {', '.join(sorted(by_id))})"
                )
            if sample_id in assigned:
                where = (
                    f"twice in split {name!r}"
                    if assigned[sample_id] == name
                    else (f"in both split {assigned[sample_id]!r} and {name!r}")
                )
                raise ValueError(f"{sample_id!r} is listed {where}; a conversation belongs to one split, once")
            assigned[sample_id] = name
        resolved[name] = [by_id[i] for i in ids]
    unused = sorted(set(by_id) - set(assigned))
    if unused:
        logger.warning("conversations in no split (not used): %s", unused)
    return resolved


def _check_every_source_gives_memories(
    input_path: str | Path,
    resolved: dict[str, list[LocomoConversation]],
    memories: Sequence[dict],
    sources: Sequence[str],
) -> None:
    """Refuse a used conversation for which a configured memory source gives no memory.

    Without this the rows are written and the memory tools fail much later, in training, on an empty
    memories table for that sample.
    """
    given = Counter((m["sample_id"], m["source"]) for m in memories)
    for name, convs in resolved.items():
        for conv in convs:
            for source in sources:
                if not given[conv.sample_id, source]:
                    raise LocomoFormatError(
                        f"{_where(input_path, conv.sample_id)}: memory source {source!r} gives no memories "
                        f"(field {_SOURCE_FIELDS[source]!r} is empty), but split {name!r} uses this conversation; "
                        "fix the file, drop the conversation from the split or choose other memory_sources"
                    )


def preprocess_locomo(
    input_path: str | Path,
    outputs: dict[str, str | Path],
    *,
    split: dict[str, Sequence[str]],
    split_name: str | None = None,
    memory_sources: Sequence[str] = ("observation",),
    drop_categories: dict[str, Sequence[int]] | None = None,
    summary_path: str | Path | None = None,
    sha256: str | None = None,
) -> dict:
    """Write ``{split}.parquet`` rows and ``memories.parquet`` for the configured conversation split.

    ``outputs`` maps each split name and ``"memories"`` to a path. ``drop_categories`` maps a split to
    the categories left out of it (default: category 5 out of ``train`` and ``val``, kept in ``test``
    for the official evaluation). ``split_name`` names the split in the summary (``ours``, ``memory_r1``), so a
    result says which questions it was measured on. ``sha256`` (the file's in config) is checked before anything is
    read (:func:`memupdate.data.fetch.verify_copy`). Returns (and optionally writes) a summary with per-split counts.
    """
    verify_copy(input_path, sha256)
    if drop_categories is None:
        drop_categories = {"train": [5], "val": [5]}
    missing = [name for name in [*split, "memories"] if name not in outputs]
    if missing:
        raise ValueError(f"no output path given for {missing}")
    paths = {name: Path(outputs[name]) for name in [*split, "memories"]}
    if summary_path is not None:
        paths["summary"] = Path(summary_path)
    # All outputs appear together or not at all, and a failed rerun removes the previous run's files.
    with atomic_outputs(paths) as tmp:
        conversations = load_locomo(input_path)
        resolved = resolve_split(conversations, split)
        memories = [m for conv in conversations for m in initial_memories(conv, memory_sources)]
        _check_every_source_gives_memories(input_path, resolved, memories, memory_sources)
        memory_counts = Counter(m["sample_id"] for m in memories)
        write_parquet_atomic(tmp["memories"], pa.Table.from_pylist(memories, schema=MEMORY_SCHEMA))

        qa = [q for c in conversations for q in c.qa]
        summary: dict[str, Any] = {
            "input": str(input_path),
            "input_sha256": sha256_file(input_path),
            "split": split_name,
            "memory_sources": list(memory_sources),
            "memories": dict(sorted(memory_counts.items())),
            "qa_total": len(qa),
            "qa_by_category": dict(sorted(Counter(q.category for q in qa).items())),
            "evidence_unparsed": [
                {"sample_id": q.sample_id, "qa_index": q.qa_index, "tokens": list(q.evidence_unparsed)}
                for q in qa
                if q.evidence_unparsed
            ],
            "evidence_dangling": [
                {"sample_id": q.sample_id, "qa_index": q.qa_index, "ids": list(q.evidence_dangling)}
                for q in qa
                if q.evidence_dangling
            ],
            "observation_evidence_dangling": [
                {"sample_id": c.sample_id, "field": field_path, "id": dia_id}
                for c in conversations
                for field_path, dia_id in c.observation_evidence_dangling
            ],
            "splits": {},
        }
        # The count of every warning about the data, so a changed input file shows in the summary.
        summary["warnings"] = {
            "evidence_unparsed": sum(len(q.evidence_unparsed) for q in qa),
            "evidence_dangling": sum(len(q.evidence_dangling) for q in qa),
            "observation_evidence_dangling": len(summary["observation_evidence_dangling"]),
        }
        for name, convs in resolved.items():
            table = build_rows(convs, name, memory_counts, drop_categories.get(name, ()))
            write_parquet_atomic(tmp[name], table)
            categories = Counter(table.column("extra_info").combine_chunks().field("category").to_pylist())
            summary["splits"][name] = {
                "conversations": [c.sample_id for c in convs],
                "rows": table.num_rows,
                "by_category": dict(sorted(categories.items())),
            }
            logger.info("%s: %d rows from %s", name, table.num_rows, [c.sample_id for c in convs])
        if summary_path is not None:
            write_json_atomic(tmp["summary"], summary)
    return summary


def evidence_session(dia_id: str) -> int:
    """The session a canonical evidence id lies in.

    >>> evidence_session("D12:3")
    12
    """
    return int(_DIA_ID.fullmatch(dia_id).group(1))


def answerable(table: pa.Table) -> pa.Table:
    """The rows of ``table`` (verl's layout) with a gold answer: those the memory reward can score (categories
    1-4; the adversarial category 5 has none)."""
    answers = pc.struct_field(table.column("extra_info"), "answer")
    return table.filter(pc.fill_null(pc.greater(pc.utf8_length(answers), 0), False))


def select_rows(
    rows: str | Path,
    output: str | Path,
    *,
    categories: Sequence[int] | None = None,
    sessions: int | None = None,
    where: str = "train_on",
) -> dict[str, Any]:
    """Write the rows of ``rows`` a stage trains on (:class:`memupdate.settings.TrainOn`): those of
    ``categories`` (None: all) whose evidence lies in the first ``sessions`` sessions of their
    conversation (None: anywhere; a row without evidence ids is left out, as where its answer lies is
    unknown). Returns the counts kept and left out, by category; ``where`` names the setting in errors."""
    table = read_parquet_columns(rows, {"extra_info": None}, ROWS_TABLE, only=False)
    info = table.column("extra_info").combine_chunks()
    row_categories = info.field("category").to_pylist()
    evidence = info.field("evidence").to_pylist()
    keep = []
    for category, ids in zip(row_categories, evidence, strict=True):
        ok = categories is None or category in categories
        if sessions is not None:
            ok = ok and bool(ids) and max(evidence_session(i) for i in ids) <= sessions
        keep.append(ok)
    selected = table.filter(pa.array(keep))
    if selected.num_rows == 0:
        raise ValueError(
            f"{where} (categories {categories}, sessions {sessions}) leaves none of the {table.num_rows} rows "
            f"of {rows}: widen it"
        )
    write_parquet_atomic(output, selected)
    summary = {
        "rows": str(rows),
        "categories": list(categories) if categories is not None else None,
        "sessions": sessions,
        "kept": selected.num_rows,
        "left_out": table.num_rows - selected.num_rows,
        "kept_by_category": dict(sorted(Counter(c for c, k in zip(row_categories, keep, strict=True) if k).items())),
    }
    logger.info("%s: kept %d of %d rows of %s", where, summary["kept"], table.num_rows, rows)
    return summary
