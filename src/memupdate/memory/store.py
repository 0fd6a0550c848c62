"""Memory records, the read-only base memories of a conversation, and per-trial overlays on them.

>>> import numpy as np
>>> base = BaseStore("conv-0", [MemoryRecord(0, "Caroline prefers tea", speaker="Caroline", source="observation")],
...                  np.array([[1.0, 0.0]], dtype=np.float32))
>>> trial = TrialStore(base)                  # O(1): nothing of the base is copied
>>> trial.create("Melanie paints", {"speaker": "Melanie"}, vector=np.array([0.0, 1.0]))
1
>>> [(h.id, h.content) for h in trial.search(np.array([0.1, 1.0]), top_k=1)]
[(1, 'Melanie paints')]
>>> trial.delete(0).content, len(trial), len(base)
('Caroline prefers tea', 1, 1)
>>> trial.export_delta()["deleted"]
[0]

Evidence (the dialogue ids a memory rests on) is provenance, not something a writer may claim: a memory
written in a trial gets it only from the memories it derives from, and only where its text keeps theirs
(:func:`keeps`: half of a source's content words). ``create`` gives none; ``update`` keeps the original's
if the new text keeps the old; ``merge`` takes the evidence of each source whose text the merged text
keeps; ``split`` gives a part the source's if the parts together keep the source and the part's words
come from it. Passing ``evidence`` in the metadata of any of them is refused. Otherwise the
``evidence_recall`` reward would pay for citing ids at random, or for a merge that keeps one source's text
and throws the others' away while collecting their evidence.

The model sees memories by their short integer ``id`` (``[3] prefers tea``). Sync methods never run the
embedding model (they take vectors, so a caller can batch); the ``a``-prefixed methods embed text in a
worker thread through the injected :class:`~memupdate.memory.embedder.Embedder`. Scores are cosine
similarities: higher = more similar. The store knows nothing of LLMs or verl.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memupdate.memory.index import VectorIndex, normalize_rows
from memupdate.utils.io import short_repr

if TYPE_CHECKING:
    from memupdate.memory.cache import EmbeddingCache
    from memupdate.memory.embedder import Embedder

logger = logging.getLogger(__name__)

SOURCES = ("observation", "session_summary", "dialogue", "agent")
METADATA_KEYS = ("speaker", "session", "date", "evidence", "source", "type")
FILTER_KEYS = ("speaker", "session", "source", "type")
# int() also reads "٣" (Arabic 3) and "3_0" (30); a number the model writes as text must be plain digits.
_INT_TEXT = re.compile(r"\s*[+-]?[0-9]{1,18}\s*")
DELTA_FORMAT_VERSION = 1
# Characters that render as nothing: a content of only these is empty to a reader.
_INVISIBLE = dict.fromkeys(map(ord, "\u200b\u200c\u200d\u2060\ufeff"))
OPERATIONS = ("create", "update", "delete", "merge", "split")


class MemoryStoreError(Exception):
    """Base class of errors caused by the requested operation (the tool layer words them for the model)."""


class UnknownMemoryId(MemoryStoreError, LookupError):
    """No memory with this id in the store; ``deleted`` tells whether it existed in this trial."""

    def __init__(self, memory_id: int, *, deleted: bool = False):
        self.memory_id = memory_id
        self.deleted = deleted
        super().__init__(f"no memory with id {memory_id}" + (" (it was deleted)" if deleted else ""))

    def __str__(self) -> str:
        # LookupError would otherwise show the repr of the message.
        return str(self.args[0])


class InvalidMemoryOperation(MemoryStoreError, ValueError):
    """The operation's arguments are invalid (empty content, unknown metadata key, merge of one id, ...)."""


class EvidenceNotWritable(InvalidMemoryOperation):
    """A write passed ``evidence``: it comes from the memories a memory derives from, never from the writer."""

    def __init__(self) -> None:
        super().__init__(
            "evidence cannot be set: a memory keeps the evidence of the memories it comes from "
            "(update keeps it, merge and split carry it over, a new memory has none)"
        )


def _optional_str(key: str, value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise InvalidMemoryOperation(f"{key} must be a string or null, got {value!r}")


def _optional_int(key: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or (isinstance(value, str) and not _INT_TEXT.fullmatch(value)):
        shown = short_repr(value)
        raise InvalidMemoryOperation(f"{key} must be an integer or null, got {shown}")
    try:
        # Tool arguments come from model-written JSON, where "3" and 3.0 both mean session 3.
        as_int = int(value)
    except (TypeError, ValueError):
        raise InvalidMemoryOperation(f"{key} must be an integer or null, got {value!r}") from None
    if as_int != float(value):
        raise InvalidMemoryOperation(f"{key} must be an integer or null, got {value!r}")
    return as_int


def _count(key: str, value: Any) -> int:
    """An id or a count read from a delta: an integer of 0 or more, written as one (not "٣", not -2).

    >>> _count("ops.create", "٣")
    Traceback (most recent call last):
    ...
    memupdate.memory.store.InvalidMemoryOperation: ops.create must be an integer or null, got '٣'
    """
    number = _optional_int(key, value)
    if number is None or number < 0:
        raise InvalidMemoryOperation(f"{key} must be an integer of 0 or more, got {value!r}")
    return number


@dataclass(frozen=True)
class MemoryRecord:
    """One memory. Fields are validated and normalised (evidence becomes a tuple).

    >>> MemoryRecord(3, "prefers tea", evidence=["D1:3"], session="1").metadata
    {'speaker': None, 'session': 1, 'date': None, 'evidence': ['D1:3'], 'source': 'agent', 'type': None}
    """

    id: int
    content: str
    speaker: str | None = None
    session: int | None = None
    date: str | None = None
    evidence: tuple[str, ...] = ()
    source: str = "agent"
    type: str | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise in place once, at construction
        set_(self, "id", _optional_int("id", self.id))
        if self.id is None or self.id < 0:
            raise InvalidMemoryOperation(f"id must be an integer of 0 or more, got {self.id!r}")
        # Zero-width characters alone render as nothing; a NUL ends the text in C readers (and the tokenizer's).
        if not isinstance(self.content, str) or not self.content.translate(_INVISIBLE).strip():
            raise InvalidMemoryOperation("content must be a non-empty string with visible text")
        if "\x00" in self.content:
            raise InvalidMemoryOperation("content must not contain NUL characters")
        set_(self, "content", self.content.strip())
        set_(self, "speaker", _optional_str("speaker", self.speaker))
        set_(self, "session", _optional_int("session", self.session))
        if self.session is not None and self.session < 0:
            raise InvalidMemoryOperation(f"session must be 0 or more, got {self.session}")
        set_(self, "date", _optional_str("date", self.date))
        set_(self, "type", _optional_str("type", self.type))
        evidence = self.evidence
        if evidence is None:
            evidence = ()
        elif isinstance(evidence, str):
            evidence = (evidence,)
        elif not isinstance(evidence, Iterable) or not all(isinstance(e, str) for e in evidence):
            raise InvalidMemoryOperation(f"evidence must be a list of strings, got {evidence!r}")
        set_(self, "evidence", tuple(evidence))
        if self.source not in SOURCES:
            raise InvalidMemoryOperation(f"source must be one of {list(SOURCES)}, got {self.source!r}")

    @property
    def metadata(self) -> dict[str, Any]:
        """Everything but id and content, JSON-ready."""
        return {
            "speaker": self.speaker,
            "session": self.session,
            "date": self.date,
            "evidence": list(self.evidence),
            "source": self.source,
            "type": self.type,
        }

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "content": self.content, **self.metadata}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MemoryRecord:
        unknown = set(data) - {"id", "content", *METADATA_KEYS}
        if unknown:
            raise InvalidMemoryOperation(f"unknown memory fields {sorted(unknown)}")
        return cls(**data)

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> MemoryRecord:
        """The record of a memories-table row (``memory_id``, ``content``, metadata columns; a seed memory's
        source is ``observation`` unless the row says otherwise)."""
        return cls(
            id=row["memory_id"],
            content=row["content"],
            speaker=row.get("speaker"),
            session=row.get("session"),
            date=row.get("date"),
            evidence=tuple(row.get("evidence") or ()),
            source=row.get("source") or "observation",
            type=row.get("type"),
        )

    def with_changes(self, content: str | None = None, metadata: Mapping[str, Any] | None = None) -> MemoryRecord:
        """A copy with new content and/or some metadata keys replaced (validated)."""
        changes = dict(_check_metadata_keys(metadata))
        if content is not None:
            changes["content"] = content
        return dataclasses.replace(self, **changes)


_WORD = re.compile(r"[^\W_]+")
#: Words too common to show that one text keeps another's content.
_STOPWORDS = frozenset(
    "a an and are as at be been by did do for from had has have he her his i in is it its of on or our she so "
    "that the their them they this to was we were with you".split()
)
#: Share of a source's content words a text must hold to keep that source (and so its evidence).
KEEP_SHARE = 0.5


def content_words(text: str) -> frozenset[str]:
    """The words of ``text`` that carry its content: lower-cased, without the most common function words.

    >>> sorted(content_words("Caroline went to the LGBTQ support group."))
    ['caroline', 'group', 'lgbtq', 'support', 'went']
    """
    return frozenset(w for w in _WORD.findall(text.casefold()) if w not in _STOPWORDS)


def keeps(source: str, text: str) -> bool:
    """Whether ``text`` keeps ``source``'s content: at least :data:`KEEP_SHARE` of its content words.

    Word overlap, not meaning: a faithful rewrite, a dated copy or a merge that holds a source's sentence
    keeps it; a text that drops most of a source's words does not carry its facts to the reader, so it
    does not carry its evidence either.

    >>> keeps("Ann moved to Oslo in May.", "8 May, 2023: Ann moved to Oslo in May. Bo came too.")
    True
    >>> keeps("Ann moved to Oslo in May.", "Bo came too.")
    False
    """
    words = content_words(source)
    if not words:
        return source.casefold().strip() in text.casefold()
    return len(words & content_words(text)) >= KEEP_SHARE * len(words)


def _writable_metadata(metadata: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """``metadata`` of a trial write, checked: known keys, and no ``evidence`` (see the module docstring)."""
    metadata = _check_metadata_keys(metadata)
    if "evidence" in metadata:
        raise EvidenceNotWritable()
    return metadata


def _check_metadata_keys(metadata: Mapping[str, Any] | None) -> Mapping[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidMemoryOperation(f"metadata must be an object, got {metadata!r}")
    unknown = set(metadata) - set(METADATA_KEYS)
    if unknown:
        raise InvalidMemoryOperation(f"unknown metadata keys {sorted(unknown)}; allowed: {list(METADATA_KEYS)}")
    return metadata


@dataclass(frozen=True)
class Hit:
    """A search result: the record and its cosine similarity to the query (higher = more similar)."""

    id: int
    score: float
    record: MemoryRecord

    @property
    def content(self) -> str:
        return self.record.content

    @property
    def metadata(self) -> dict[str, Any]:
        return self.record.metadata

    def to_dict(self) -> dict[str, Any]:
        return {"score": self.score, **self.record.to_dict()}


# ---------------------------------------------------------------------------------------------- filters


def _filter_value(key: str, value: Any) -> Any:
    if key == "session":
        return _optional_int(key, value)
    # Models write "caroline" as often as "Caroline": string filters ignore case and outer spaces.
    return str(value).strip().casefold()


def normalize_filters(filters: Mapping[str, Any] | None) -> dict[str, frozenset]:
    """``{key: value or list of values}`` → ``{key: frozenset(normalised values)}``; empty/None values are dropped.

    >>> normalize_filters({"speaker": "Caroline", "session": [1, "2"], "source": None})
    {'speaker': frozenset({'caroline'}), 'session': frozenset({1, 2})}
    """
    if not filters:
        return {}
    unknown = set(filters) - set(FILTER_KEYS)
    if unknown:
        raise InvalidMemoryOperation(f"unknown filter keys {sorted(unknown)}; allowed: {list(FILTER_KEYS)}")
    out = {}
    for key in FILTER_KEYS:
        value = filters.get(key)
        if value is None:
            continue
        values = value if isinstance(value, list | tuple | set | frozenset) else [value]
        normalised = frozenset(_filter_value(key, v) for v in values if v is not None)
        if normalised:
            out[key] = normalised
    return out


def _record_filter_values(record: MemoryRecord) -> dict[str, Any]:
    return {
        key: (None if getattr(record, key) is None else _filter_value(key, getattr(record, key))) for key in FILTER_KEYS
    }


def _matches(record: MemoryRecord, filters: Mapping[str, frozenset]) -> bool:
    values = _record_filter_values(record)
    return all(values[key] in allowed for key, allowed in filters.items())


def _as_query(vector: Any, dim: int) -> np.ndarray:
    if isinstance(vector, str):
        raise TypeError("sync search takes a query vector; use asearch() to search by text")
    q = normalize_rows(vector)
    if q.shape != (1, dim):
        raise ValueError(f"expected one query vector of dim {dim}, got shape {np.shape(vector)}")
    return q


def _as_vectors(vectors: Any, n: int, dim: int) -> np.ndarray:
    if vectors is None:
        raise ValueError("sync store methods need precomputed vectors; use the async a*() methods to embed text")
    x = normalize_rows(vectors)
    if x.shape != (n, dim):
        raise ValueError(f"expected {n} vector(s) of dim {dim}, got shape {np.shape(vectors)}")
    return x


# ---------------------------------------------------------------------------------------------- base


class BaseStore:
    """The read-only initial memories of one conversation: records, their vectors and a :class:`VectorIndex`.

    Built once per worker (from the memories table and the embedding cache, no embedding) and shared by
    every trial of that conversation.
    """

    def __init__(self, sample_id: str, records: Sequence[MemoryRecord], vectors: np.ndarray):
        order = sorted(range(len(records)), key=lambda i: records[i].id)
        self.sample_id = sample_id
        self.records: tuple[MemoryRecord, ...] = tuple(records[i] for i in order)
        ids = [r.id for r in self.records]
        if len(set(ids)) != len(ids):
            raise ValueError(f"sample {sample_id!r}: memory ids are not unique")
        if any(i < 0 for i in ids):
            raise ValueError(f"sample {sample_id!r}: memory ids must be >= 0")
        vectors = np.asarray(vectors)
        if vectors.ndim != 2 or len(vectors) != len(records):
            raise ValueError(f"sample {sample_id!r}: {len(records)} records but vectors of shape {vectors.shape}")
        self.vectors = normalize_rows(vectors)[order] if len(records) else normalize_rows(vectors)
        self.vectors.setflags(write=False)
        self.dim = self.vectors.shape[1]
        self.max_id = max(ids, default=-1)
        self._row = {id_: row for row, id_ in enumerate(ids)}
        self.index = VectorIndex.from_vectors(ids, self.vectors)
        # Filter postings: key → normalised value → rows, so a filtered search is a few array unions.
        postings: dict[str, dict[Any, list[int]]] = {key: {} for key in FILTER_KEYS}
        for row, record in enumerate(self.records):
            for key, value in _record_filter_values(record).items():
                postings[key].setdefault(value, []).append(row)
        self._postings = {
            key: {value: np.array(rows, dtype=np.int64) for value, rows in by_value.items()}
            for key, by_value in postings.items()
        }
        self._later: dict[int, frozenset[int]] = {}

    @classmethod
    def from_rows(cls, sample_id: str, rows: Iterable[Mapping[str, Any]], cache: EmbeddingCache) -> BaseStore:
        """Records from memories-table rows (``memory_id``, ``content``, metadata columns), vectors from ``cache``."""
        records = [MemoryRecord.from_row(row) for row in rows]
        vectors = cache.get([r.content for r in records]) if records else np.empty((0, cache.dim), np.float32)
        return cls(sample_id, records, vectors)

    @classmethod
    def from_table(cls, table: pa.Table, sample_id: str, cache: EmbeddingCache) -> BaseStore:
        """The memories of ``sample_id`` in a memories table; raises ``LookupError`` if it has none."""
        rows = table.filter(pc.equal(table["sample_id"], sample_id)).to_pylist()
        if not rows:
            raise LookupError(f"the memories table has no rows for sample_id {sample_id!r}")
        return cls.from_rows(sample_id, rows, cache)

    def __len__(self) -> int:
        return len(self.records)

    def __contains__(self, memory_id: object) -> bool:
        return memory_id in self._row

    def __repr__(self) -> str:
        return f"BaseStore({self.sample_id!r}, {len(self)} memories, dim={self.dim})"

    def get(self, memory_id: int) -> MemoryRecord:
        try:
            return self.records[self._row[memory_id]]
        except KeyError:
            raise UnknownMemoryId(memory_id) from None

    def vector(self, memory_id: int) -> np.ndarray:
        if memory_id not in self._row:
            raise UnknownMemoryId(memory_id)
        return self.vectors[self._row[memory_id]]

    def row(self, memory_id: int) -> int:
        return self._row[memory_id]

    def ids_after(self, session: int | None) -> frozenset[int]:
        """Ids of the memories of sessions after ``session`` (none for ``None``), which a store that has
        seen the conversation up to ``session`` does not hold yet. Memories without a session are never
        later than any session."""
        if session is None:
            return frozenset()
        later = self._later.get(session)
        if later is None:
            later = self._later[session] = frozenset(
                r.id for r in self.records if r.session is not None and r.session > session
            )
        return later

    def filter_mask(self, filters: Mapping[str, frozenset]) -> np.ndarray:
        """Boolean mask over rows matching normalised ``filters`` (see :func:`normalize_filters`)."""
        mask = np.ones(len(self), dtype=bool)
        for key, allowed in filters.items():
            key_mask = np.zeros(len(self), dtype=bool)
            for value in allowed:
                rows = self._postings[key].get(value)
                if rows is not None:
                    key_mask[rows] = True
            mask &= key_mask
        return mask


# ---------------------------------------------------------------------------------------------- trial


class TrialStore:
    """One trajectory's view: a :class:`BaseStore` plus this trial's creates, updates and deletes.

    Creating one costs O(1): it references the base and holds only its own changes. New ids continue
    after the base's largest id (max + 1, + 2, ...), so they are the same in every replay of the same
    operations. Deleted ids are never reused.
    """

    def __init__(
        self,
        base: BaseStore,
        embedder: Embedder | None = None,
        *,
        namespace: str | None = None,
        sessions: int | None = None,
    ):
        """``sessions``: the store has seen the conversation up to this session (question-agnostic
        ingestion): the base memories of later sessions are not in it. ``None``: the whole base."""
        self.base = base
        self.embedder = embedder
        self.namespace = namespace
        self.sessions = _optional_int("sessions", sessions)
        if self.sessions is not None and self.sessions < 0:
            raise ValueError(f"sessions must be >= 0 or None, got {sessions!r}")
        # Base ids the store has not seen yet: hidden like deleted ones, but not deletions of the trial.
        self._later = base.ids_after(self.sessions)
        self._initial_count = len(base) - len(self._later)
        self._overlay: dict[int, MemoryRecord] = {}  # created and updated records, current version
        self._overlay_vectors: dict[int, np.ndarray] = {}
        self._deleted: set[int] = set()
        self._next_id = base.max_id + 1
        self._ops = dict.fromkeys(OPERATIONS, 0)

    def __repr__(self) -> str:
        return (
            f"TrialStore({self.namespace or self.base.sample_id!r}, {len(self)} memories, "
            f"{len(self._overlay)} changed, {len(self._deleted)} deleted)"
        )

    # ------------------------------------------------------------------ reading

    def __len__(self) -> int:
        deleted_base = sum(1 for i in self._deleted if i in self.base)
        created_alive = sum(1 for i in self._overlay if i not in self.base)
        return len(self.base) - len(self._later) - deleted_base + created_alive

    def __contains__(self, memory_id: object) -> bool:
        if memory_id in self._deleted:
            return False
        return memory_id in self._overlay or (memory_id in self.base and memory_id not in self._later)

    @property
    def next_id(self) -> int:
        return self._next_id

    def get(self, memory_id: int) -> MemoryRecord:
        """The current record; raises :class:`UnknownMemoryId` for ids never seen or deleted."""
        if memory_id in self._deleted:
            raise UnknownMemoryId(memory_id, deleted=True)
        if memory_id in self._overlay:
            return self._overlay[memory_id]
        if memory_id in self._later:
            raise UnknownMemoryId(memory_id)
        return self.base.get(memory_id)

    def vector(self, memory_id: int) -> np.ndarray:
        self.get(memory_id)
        if memory_id in self._overlay_vectors:
            return self._overlay_vectors[memory_id]
        return self.base.vector(memory_id)

    def _hidden_base_ids(self) -> set[int]:
        return {i for i in (*self._deleted, *self._overlay) if i in self.base} | self._later

    def created(self) -> list[MemoryRecord]:
        """The memories this trial wrote under new ids (create, merge, split) and still holds, by id."""
        return [self._overlay[i] for i in sorted(self._overlay) if i not in self.base]

    def records(self, filters: Mapping[str, Any] | None = None) -> list[MemoryRecord]:
        """All current records matching ``filters``, by id."""
        f = normalize_filters(filters)
        hidden = self._hidden_base_ids()
        mask = self.base.filter_mask(f)
        out = [r for r, keep in zip(self.base.records, mask, strict=True) if keep and r.id not in hidden]
        out += [r for r in self._overlay.values() if _matches(r, f)]
        return sorted(out, key=lambda r: r.id)

    def search(self, query_vector: np.ndarray, top_k: int = 5, filters: Mapping[str, Any] | None = None) -> list[Hit]:
        """The ``top_k`` current records most similar to the query, best first (ties by id).

        ``filters`` maps ``speaker``/``session``/``source``/``type`` to a value or a list of accepted
        values; string comparisons ignore case.
        """
        if top_k < 0:
            raise InvalidMemoryOperation(f"top_k must be >= 0, got {top_k}")
        q = _as_query(query_vector, self.base.dim)
        f = normalize_filters(filters)
        hidden = self._hidden_base_ids()
        candidates: list[tuple[float, int, MemoryRecord]] = []
        if not f:
            # Over-fetch by the number of hidden base ids, so that dropping them still leaves top_k.
            ids, scores = self.base.index.search(q, top_k + len(hidden))
            for id_, score in zip(ids[0].tolist(), scores[0].tolist(), strict=True):
                if id_ not in hidden:
                    candidates.append((score, id_, self.base.get(id_)))
        else:
            # A conversation has a few hundred memories: a masked matrix product is exact and cheap.
            mask = self.base.filter_mask(f)
            for id_ in hidden:
                mask[self.base.row(id_)] = False
            rows = np.flatnonzero(mask)
            scores = self.base.vectors[rows] @ q[0]
            for j in np.argsort(-scores, kind="stable")[:top_k].tolist():
                record = self.base.records[rows[j]]
                candidates.append((float(scores[j]), record.id, record))
        for id_, record in self._overlay.items():
            if _matches(record, f):
                candidates.append((float(self._overlay_vectors[id_] @ q[0]), id_, record))
        candidates.sort(key=lambda c: (-c[0], c[1]))
        return [Hit(id_, score, record) for score, id_, record in candidates[:top_k]]

    # ------------------------------------------------------------------ writing (sync, precomputed vectors)

    def _put(self, record: MemoryRecord, vector: np.ndarray) -> None:
        self._overlay[record.id] = record
        self._overlay_vectors[record.id] = vector

    def _remove(self, memory_id: int) -> None:
        self._overlay.pop(memory_id, None)
        self._overlay_vectors.pop(memory_id, None)
        self._deleted.add(memory_id)

    def _new_record(
        self, content: str, metadata: Mapping[str, Any] | None, defaults: Mapping[str, Any]
    ) -> MemoryRecord:
        return MemoryRecord(self._next_id, content, **{**defaults, **_writable_metadata(metadata)})

    def create(self, content: str, metadata: Mapping[str, Any] | None = None, *, vector: np.ndarray) -> int:
        """Add a memory (``source`` defaults to ``"agent"``); returns its new id."""
        record = self._new_record(content, metadata, {"source": "agent"})
        vec = _as_vectors(vector, 1, self.base.dim)[0]
        self._next_id += 1
        self._put(record, vec)
        self._ops["create"] += 1
        return record.id

    def update(
        self,
        memory_id: int,
        content: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        *,
        vector: np.ndarray | None = None,
    ) -> MemoryRecord:
        """Replace the content and/or some metadata of a memory, keeping its id; returns the new record.

        The memory keeps its evidence if the new content keeps the old (:func:`keeps`), and gets its seed
        evidence back with its seed text. A new content needs its ``vector``. An update that restores a base memory exactly drops it from
        the overlay.
        """
        current = self.get(memory_id)
        if content is None and not metadata:
            raise InvalidMemoryOperation("an update needs new content or metadata")
        _writable_metadata(metadata)
        record = current.with_changes(content, metadata)
        if memory_id in self.base and record.content == self.base.get(memory_id).content:
            record = dataclasses.replace(record, evidence=self.base.get(memory_id).evidence)
        elif not keeps(current.content, record.content):
            record = dataclasses.replace(record, evidence=())
        if record.content != current.content:
            vec = _as_vectors(vector, 1, self.base.dim)[0]
        else:
            vec = self.vector(memory_id)
        if memory_id in self.base and record == self.base.get(memory_id):
            self._overlay.pop(memory_id, None)
            self._overlay_vectors.pop(memory_id, None)
        else:
            self._put(record, vec)
        self._ops["update"] += 1
        return record

    def delete(self, memory_id: int) -> MemoryRecord:
        """Remove a memory; returns the removed record. Its id is not reused."""
        record = self.get(memory_id)
        self._remove(memory_id)
        self._ops["delete"] += 1
        return record

    def _check_merge(self, memory_ids: Sequence[int]) -> list[MemoryRecord]:
        ids = list(memory_ids)
        if len(ids) < 2 or len(set(ids)) != len(ids):
            raise InvalidMemoryOperation(f"merge needs at least two distinct memory ids, got {ids}")
        return [self.get(i) for i in ids]

    def merge(
        self,
        memory_ids: Sequence[int],
        content: str,
        metadata: Mapping[str, Any] | None = None,
        *,
        vector: np.ndarray,
    ) -> int:
        """Replace several memories by one new memory; returns its id.

        The new memory has the evidence of each memory whose text ``content`` keeps (:func:`keeps`), and the
        speaker, session, date and type they share (``None`` where they differ); ``metadata`` overrides any
        of these but the evidence.
        """
        originals = self._check_merge(memory_ids)

        def shared(key: str) -> Any:
            values = {getattr(r, key) for r in originals}
            return values.pop() if len(values) == 1 else None

        evidence = tuple(dict.fromkeys(e for r in originals if keeps(r.content, content) for e in r.evidence))
        defaults = {key: shared(key) for key in ("speaker", "session", "date", "type")}
        record = self._new_record(content, metadata, {**defaults, "evidence": evidence, "source": "agent"})
        vec = _as_vectors(vector, 1, self.base.dim)[0]
        self._next_id += 1
        self._put(record, vec)
        for r in originals:
            self._remove(r.id)
        self._ops["merge"] += 1
        return record.id

    def _check_split(self, memory_id: int, parts: Sequence[str]) -> MemoryRecord:
        if isinstance(parts, str) or len(parts) < 2:
            raise InvalidMemoryOperation("split needs at least two parts")
        if not all(isinstance(p, str) and p.strip() for p in parts):
            raise InvalidMemoryOperation("every part of a split must be a non-empty string")
        return self.get(memory_id)

    def split(
        self,
        memory_id: int,
        parts: Sequence[str],
        metadata: Mapping[str, Any] | None = None,
        *,
        vectors: np.ndarray,
    ) -> list[int]:
        """Replace one memory by several; each part keeps the original's metadata (``source="agent"``)
        unless ``metadata`` overrides it. A part has the original's evidence if the parts together keep the
        original's text and the part's own words come from it (:func:`keeps` both ways); the evidence is
        never the writer's to set. Returns the new ids, in the order of ``parts``."""
        original = self._check_split(memory_id, parts)
        defaults = {**original.metadata, "source": "agent"}
        kept = keeps(original.content, " ".join(parts))
        records = [
            MemoryRecord(
                self._next_id + i,
                part,
                **{
                    **defaults,
                    **_writable_metadata(metadata),
                    "evidence": original.evidence if kept and keeps(part, original.content) else (),
                },
            )
            for i, part in enumerate(parts)
        ]
        vecs = _as_vectors(vectors, len(parts), self.base.dim)
        self._next_id += len(records)
        for record, vec in zip(records, vecs, strict=True):
            self._put(record, vec)
        self._remove(original.id)
        self._ops["split"] += 1
        return [r.id for r in records]

    # ------------------------------------------------------------------ async: embed in a thread, then apply

    async def _aembed(self, texts: Sequence[str]) -> np.ndarray:
        if self.embedder is None:
            raise RuntimeError("this TrialStore has no embedder: pass one, or call the sync methods with vectors")
        return await self.embedder.aencode(list(texts))

    async def asearch(
        self, query: str | np.ndarray, top_k: int = 5, filters: Mapping[str, Any] | None = None
    ) -> list[Hit]:
        """:meth:`search` by text (embedded in a thread) or by vector."""
        if isinstance(query, str):
            if not query.strip():
                raise InvalidMemoryOperation("the search query is empty")
            normalize_filters(filters)  # fail before embedding
            query = (await self._aembed([query]))[0]
        return self.search(query, top_k, filters)

    async def acreate(self, content: str, metadata: Mapping[str, Any] | None = None) -> int:
        self._new_record(content, metadata, {"source": "agent"})  # validate before paying for embedding
        (vector,) = await self._aembed([content])
        return self.create(content, metadata, vector=vector)

    async def aupdate(
        self, memory_id: int, content: str | None = None, metadata: Mapping[str, Any] | None = None
    ) -> MemoryRecord:
        current = self.get(memory_id)
        _writable_metadata(metadata)  # fail before paying for embedding
        vector = None
        if content is not None and current.with_changes(content).content != current.content:
            (vector,) = await self._aembed([content])
        # Re-checked by update(): another coroutine may have deleted the id while we embedded.
        return self.update(memory_id, content, metadata, vector=vector)

    async def amerge(self, memory_ids: Sequence[int], content: str, metadata: Mapping[str, Any] | None = None) -> int:
        self._check_merge(memory_ids)
        self._new_record(content, metadata, {})
        (vector,) = await self._aembed([content])
        return self.merge(memory_ids, content, metadata, vector=vector)

    async def asplit(
        self, memory_id: int, parts: Sequence[str], metadata: Mapping[str, Any] | None = None
    ) -> list[int]:
        self._check_split(memory_id, parts)
        _writable_metadata(metadata)  # fail before paying for embedding
        vectors = await self._aembed(parts)
        return self.split(memory_id, parts, metadata, vectors=vectors)

    # ------------------------------------------------------------------ statistics and deltas

    def fork(self, *, namespace: str | None = None, sessions: int | None = None) -> TrialStore:
        """A new trial that starts where this one stands, with its operation counts at zero, and
        ``sessions`` (>= this store's) seen: the next session of a question-agnostic ingestion continues
        from the store the previous sessions built, the new session's base memories added to it.

        Costs O(changes): the base and the vectors are shared, the overlay is copied.
        """
        if sessions is None:
            sessions = self.sessions
        elif self.sessions is None or sessions < self.sessions:
            seen = "every session" if self.sessions is None else f"sessions up to {self.sessions}"
            raise ValueError(f"a fork sees at least what its store has seen ({seen}), got sessions={sessions}")
        trial = TrialStore(self.base, self.embedder, namespace=namespace or self.namespace, sessions=sessions)
        trial._overlay = dict(self._overlay)
        trial._overlay_vectors = dict(self._overlay_vectors)
        trial._deleted = set(self._deleted)
        trial._next_id = self._next_id
        trial._initial_count = len(trial)
        return trial

    def stats(self) -> dict[str, int]:
        """Growth statistics: counts before/after and the number of each operation applied."""
        return {
            "initial_count": self._initial_count,
            "final_count": len(self),
            "created": self._ops["create"],
            "updated": self._ops["update"],
            "deleted": self._ops["delete"],
            "merged": self._ops["merge"],
            "split": self._ops["split"],
        }

    def export_delta(self) -> dict[str, Any]:
        """This trial's changes as a small JSON-serialisable dict (records without vectors).

        >>> TrialStore(BaseStore("s", [], np.empty((0, 2), np.float32))).export_delta()["created"]
        []
        """
        return {
            "format_version": DELTA_FORMAT_VERSION,
            "sample_id": self.base.sample_id,
            "namespace": self.namespace,
            "sessions": self.sessions,
            "next_id": self._next_id,
            "created": [record.to_dict() for record in self.created()],
            "updated": [self._overlay[i].to_dict() for i in sorted(self._overlay) if i in self.base],
            "deleted": sorted(self._deleted),
            "ops": dict(self._ops),
        }

    @staticmethod
    def _delta_records(base: BaseStore, delta: Mapping[str, Any]) -> list[MemoryRecord]:
        if delta.get("format_version") != DELTA_FORMAT_VERSION:
            raise ValueError(f"unsupported delta format_version {delta.get('format_version')!r}")
        if delta.get("sample_id") != base.sample_id:
            raise ValueError(f"delta of sample {delta.get('sample_id')!r} applied to base {base.sample_id!r}")
        return [MemoryRecord.from_dict(d) for d in [*delta["created"], *delta["updated"]]]

    @staticmethod
    def _keeps_base_text(base: BaseStore, record: MemoryRecord) -> bool:
        # Metadata-only updates keep the base text, whose vector is already known.
        return record.id in base and base.get(record.id).content == record.content

    @staticmethod
    def _check_provenance(base: BaseStore, records: Sequence[MemoryRecord], deleted: set[int]) -> None:
        """A delta's evidence must be what the trial's operations give: an updated base memory keeps its
        own, a new memory's comes from base memories the trial removed (merge and split delete their
        sources). The reward reads evidence from the delta, so a forged one is refused here."""
        removed = {e for i in deleted if i in base for e in base.get(i).evidence}
        for record in records:
            allowed = set(base.get(record.id).evidence) if record.id in base else removed
            claimed = set(record.evidence) - allowed
            if claimed:
                raise ValueError(
                    f"delta for base {base.sample_id!r}: memory {record.id} cites evidence {sorted(claimed)} that "
                    "no memory it derives from has (evidence is provenance, never written)"
                )

    @classmethod
    def delta_texts(cls, base: BaseStore, delta: Mapping[str, Any], max_chars: int | None = None) -> list[str]:
        """The texts of ``delta`` that need embedding to rebuild it, in the order
        :meth:`from_delta_vectors` expects their vectors (so a caller can embed many deltas in one batch).
        ``max_chars``: the longest text the delta's writer can write; a longer one is refused."""
        records = [r for r in cls._delta_records(base, delta) if not cls._keeps_base_text(base, r)]
        for record in records:
            if max_chars is not None and len(record.content) > max_chars:
                raise ValueError(
                    f"delta for base {base.sample_id!r}: memory {record.id} has {len(record.content):,} characters, "
                    f"more than the {max_chars} its writer may write (a delta not made by the memory tools?)"
                )
        return [r.content for r in records]

    @classmethod
    def from_delta_vectors(
        cls,
        base: BaseStore,
        delta: Mapping[str, Any],
        vectors: np.ndarray | Sequence[np.ndarray],
        embedder: Embedder | None = None,
    ) -> TrialStore:
        """Rebuild the trial that exported ``delta``, given the vectors of :meth:`delta_texts`.

        ``embedder`` is only kept for the rebuilt store's own async methods.
        """
        records = cls._delta_records(base, delta)
        n_texts = sum(not cls._keeps_base_text(base, r) for r in records)
        matrix = _as_vectors(vectors, n_texts, base.dim) if n_texts else np.empty((0, base.dim), np.float32)
        next_id = _count("next_id", delta["next_id"])
        created = {_count("created id", d["id"]) for d in delta["created"]}
        updated = {_count("updated id", d["id"]) for d in delta["updated"]}
        deleted = {_count("deleted id", i) for i in delta["deleted"]}
        new_range = range(base.max_id + 1, next_id)
        if (
            next_id <= base.max_id
            or not all(i in new_range for i in created)
            or not all(i in base for i in updated)
            or not all(i in base or i in new_range for i in deleted)
            or (created | updated) & deleted
        ):
            raise ValueError(
                f"inconsistent delta for base {base.sample_id!r} (ids 0..{base.max_id}), next_id {next_id}: "
                "created ids must be new, updated ids must be base ids, and deleted ids neither"
            )
        cls._check_provenance(base, records, deleted)
        trial = cls(base, embedder, namespace=delta.get("namespace"), sessions=delta.get("sessions"))
        unseen = sorted((updated | deleted) & trial._later)
        if unseen:
            raise ValueError(
                f"delta for base {base.sample_id!r} up to session {trial.sessions} changes memories {unseen} "
                "of later sessions, which that store has not seen"
            )
        rows = iter(matrix)
        for record in records:
            trial._put(record, base.vector(record.id) if cls._keeps_base_text(base, record) else next(rows))
        trial._deleted = deleted
        trial._next_id = next_id
        ops = delta.get("ops", {})
        if unknown := sorted(set(ops) - set(OPERATIONS)):
            raise InvalidMemoryOperation(f"delta for base {base.sample_id!r}: unknown operations {unknown} in ops")
        trial._ops = {op: _count(f"ops.{op}", ops.get(op, 0)) for op in OPERATIONS}
        # The counts say whether an episode edited (the idle-edit cost reads them): changes without one are forged.
        if (created or updated or deleted) and not any(trial._ops.values()):
            raise InvalidMemoryOperation(
                f"delta for base {base.sample_id!r} changes memories {sorted(created | updated | deleted)[:5]} but "
                "counts no operation"
            )
        return trial

    @classmethod
    def from_delta(cls, base: BaseStore, delta: Mapping[str, Any], embedder: Embedder | None = None) -> TrialStore:
        """Rebuild the trial that exported ``delta``: one batched (blocking) encode of its new texts.

        From a coroutine use :meth:`afrom_delta`; to rebuild many deltas with one encode, use
        :meth:`delta_texts` and :meth:`from_delta_vectors`.
        """
        texts = cls.delta_texts(base, delta)
        if texts and embedder is None:
            raise ValueError(f"the delta has {len(texts)} new texts: an embedder is needed to rebuild it")
        vectors = embedder.encode(texts) if texts else ()
        return cls.from_delta_vectors(base, delta, vectors, embedder)

    @classmethod
    async def afrom_delta(
        cls, base: BaseStore, delta: Mapping[str, Any], embedder: Embedder | None = None
    ) -> TrialStore:
        """:meth:`from_delta`, embedding in a worker thread."""
        texts = cls.delta_texts(base, delta)
        if texts and embedder is None:
            raise ValueError(f"the delta has {len(texts)} new texts: an embedder is needed to rebuild it")
        vectors = await embedder.aencode(texts) if texts else ()
        return cls.from_delta_vectors(base, delta, vectors, embedder)
