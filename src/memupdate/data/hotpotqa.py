"""HotpotQA: load and validate a HotpotQA file and build MemAgent long-context rows for verl.

MemAgent trains and evaluates its recurrent memory agent on RULER-HotpotQA haystacks, built by
``generate_input_output`` in ``taskutils/memory_data/processing.py`` and ``different_docs_eval.py`` of
BytedTsinghua-SIA/MemAgent (commit 76b7a658988e4ea53d7388a62de6c0ce79084146), which follow
``scripts/data/synthetic/qa.py`` of NVIDIA/RULER (commit c3f5e3b4f87f97e048793bb510a3a6b19a46bf3a):
a haystack starts from *all* paragraphs of the question's own context (its gold paragraphs and their
hard distractors, ten in the distractor setting) and adds paragraphs drawn at random from the pool of
every paragraph of the data file, skipping the question's own; the documents are shuffled. Upstream's
pool is per split because its train and dev haystacks come from separate files; here one file is split
by question id (:func:`question_part`), so with ``test_percent`` each part draws from its own pool and
no train haystack holds a paragraph of a test question, or the reverse. A document is
``"{title}\n{sentences joined with ''}"`` (HotpotQA sentences carry their own leading spaces), and a
context is ``"Document {i}:\n{document}"`` blocks, ``i`` from 1, joined by blank lines.

Differences from upstream: upstream fails (``random.sample`` of a negative count) when ``num_docs`` is
below the size of the question's own context; here such a haystack keeps the gold paragraphs and a random
subset of the question's own distractors (the rule RULER applies to SQuAD's ``more_context``). Pool
paragraphs that share a title with a gold paragraph are skipped (another version of a gold article would
be a second copy of the evidence, not a distractor). Each question has its own ``random.Random`` seeded
from the run seed and the question id (upstream shared one global RNG and shuffled every haystack with
``Random(4)``), so a row does not depend on the other rows or on ``limit``; the pool is sorted, so rows do
not depend on record order either; sizes are arguments, not magic numbers; every record is validated with
an error that names the file, record and field; nested columns are native parquet structs and lists.

Both layouts of the data are accepted: the official HotpotQA JSON (``_id``, ``supporting_facts`` as
``[title, sent_id]`` pairs, ``context`` as ``[title, sentences]`` pairs) and the Hugging Face
``hotpot_qa`` layout (``supporting_facts`` ``{title, sent_id}``, ``context`` ``{title, sentences}``),
whose JSON dumps may lack an id; such records get ``hf-`` plus the first 12 hex digits of the
question's sha256.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
import statistics
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import pyarrow as pa
from tqdm.auto import tqdm

from memupdate.data.fetch import verify_copy
from memupdate.names import MEMAGENT_AGENT
from memupdate.utils.io import (
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

DATA_SOURCE = "hotpotqa"
REWARD_STYLE = "rule"
DERIVED_ID_PREFIX = "hf-"
DERIVED_ID_HEX_DIGITS = 12
DOCUMENT_SEPARATOR = "\n\n"
APPROX_TOKENIZER = "approx:words+punctuation"

# One token per run of word characters and one per other non-space character. Subword tokenizers count
# somewhat more (all-MiniLM-L6-v2's WordPiece: about 9% more on the shared dev file); pass a real
# tokenizer when the budget must hold for a given model.
_TOKEN_RE = re.compile(r"\w+|[^\w\s]")

ROW_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("agent_name", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("context", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.list_(pa.string()))])),
        (
            "extra_info",
            pa.struct(
                [
                    ("index", pa.int64()),
                    ("id", pa.string()),
                    ("question", pa.string()),
                    ("answers", pa.list_(pa.string())),
                    # The supporting facts' sentences: what the cold start's expert keeps in memory.
                    ("supporting_facts", pa.list_(pa.string())),
                    ("num_docs", pa.int64()),
                    ("num_tokens", pa.int64()),
                    ("type", pa.string()),
                    ("level", pa.string()),
                    # The question's part ("train" / "test") whose pool its haystack drew from, or "all".
                    ("part", pa.string()),
                ]
            ),
        ),
        ("num_docs", pa.int64()),
        ("num_tokens", pa.int64()),
    ]
)


class HotpotQAFormatError(ValueError):
    """A HotpotQA record does not have the expected shape; the message names the file, record and field."""


class PoolTooSmallError(ValueError):
    """The paragraph pool has fewer distractors than ``num_docs`` needs for some question."""


class BudgetTooSmallError(ValueError):
    """``max_tokens`` is below every question's own context, so no row keeps to the budget."""


class TokenizerUnavailableError(OSError):
    """The tokenizer named for counting tokens is neither a local folder nor in the Hugging Face cache."""


#: The part of every question when the whole file is one split (one pool).
ONE_POOL = "all"


@dataclass(frozen=True)
class Paragraph:
    """One context paragraph: a Wikipedia title and its sentences as HotpotQA splits them."""

    title: str
    sentences: tuple[str, ...]

    @property
    def text(self) -> str:
        return "".join(self.sentences)

    @property
    def key(self) -> tuple[str, str]:
        """Identity in the pool: the same title and text is the same paragraph however it is split."""
        return (self.title, self.text)


@dataclass(frozen=True)
class HotpotExample:
    """One validated HotpotQA question with its supporting facts and its own context paragraphs."""

    id: str
    question: str
    answer: str
    type: str
    level: str
    supporting_facts: tuple[tuple[str, int], ...]
    context: tuple[Paragraph, ...]

    @property
    def gold_titles(self) -> frozenset[str]:
        return frozenset(title for title, _ in self.supporting_facts)

    @property
    def own(self) -> tuple[Paragraph, ...]:
        """The question's own context paragraphs (gold and hard distractors), in context order, without repeats."""
        seen: dict[tuple[str, str], Paragraph] = {}
        for paragraph in self.context:
            seen.setdefault(paragraph.key, paragraph)
        return tuple(seen.values())

    @property
    def gold(self) -> tuple[Paragraph, ...]:
        """Context paragraphs whose title is a supporting-fact title, in context order, without repeats."""
        return tuple(p for p in self.own if p.title in self.gold_titles)

    @property
    def supporting_sentences(self) -> tuple[str, ...]:
        """The text of each supporting fact (its paragraph's sentence), in the order HotpotQA lists them."""
        paragraphs = {p.title: p for p in reversed(self.gold)}
        return tuple(paragraphs[title].sentences[sent_id].strip() for title, sent_id in self.supporting_facts)

    @property
    def hard_distractors(self) -> tuple[Paragraph, ...]:
        """The question's own context paragraphs that are not gold (HotpotQA's retrieved distractors)."""
        return tuple(p for p in self.own if p.title not in self.gold_titles)


def render_document(title: str, text: str) -> str:
    return f"{title}\n{text}"


def render_context(documents: Sequence[str]) -> str:
    return DOCUMENT_SEPARATOR.join(f"Document {i}:\n{doc}" for i, doc in enumerate(documents, start=1))


def approx_token_count(text: str) -> int:
    """Approximate token count: words and punctuation marks (regex ``\\w+|[^\\w\\s]``).

    It needs no tokenizer and is additive over whitespace-separated pieces, so budgets built with it are
    exact for it. Subword tokenizers give somewhat higher counts for English (about 9% higher for
    all-MiniLM-L6-v2's WordPiece on the shared HotpotQA dev file).

    >>> approx_token_count("Document 1:\\nEd Wood (film)\\nEd Wood is a 1994 film.")
    15
    """
    return len(_TOKEN_RE.findall(text))


def derived_id(question: str) -> str:
    """Stable id for a record without one: ``hf-`` and the first 12 hex digits of the question's sha256."""
    digest = hashlib.sha256(question.encode("utf-8")).hexdigest()
    return f"{DERIVED_ID_PREFIX}{digest[:DERIVED_ID_HEX_DIGITS]}"


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


class _Record:
    """Field access for one raw record that raises :class:`HotpotQAFormatError` naming where."""

    def __init__(self, raw: dict, file_name: str, index: int):
        self.raw = raw
        self.file_name = file_name
        self.index = index
        self.id: str | None = None

    def error(self, field: str, message: str) -> HotpotQAFormatError:
        record = f"record {self.index}" + (f" (id {self.id})" if self.id is not None else "")
        return HotpotQAFormatError(f"{self.file_name}: {record}: field {field!r}: {message}")

    def text(self, field: str) -> str:
        if field not in self.raw:
            raise self.error(field, "is missing")
        value = self.raw[field]
        if not isinstance(value, str):
            raise self.error(field, f"expected a string, got {_kind(value)}")
        if not value.strip():
            raise self.error(field, "is empty")
        return value.strip()


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _is_sent_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_supporting_facts(rec: _Record) -> tuple[tuple[str, int], ...]:
    field = "supporting_facts"
    if field not in rec.raw:
        raise rec.error(field, "is missing")
    value = rec.raw[field]
    if isinstance(value, list):
        pairs = []
        for i, fact in enumerate(value):
            if not (isinstance(fact, list) and len(fact) == 2 and isinstance(fact[0], str) and _is_sent_id(fact[1])):
                raise rec.error(field, f"item {i}: expected a [title, sent_id] pair, got {fact!r}")
            pairs.append((fact[0], fact[1]))
    elif isinstance(value, dict):
        titles, sent_ids = value.get("title"), value.get("sent_id")
        if not _is_str_list(titles):
            raise rec.error(field, f"'title' must be a list of strings, got {_kind(titles)}")
        if not (isinstance(sent_ids, list) and all(_is_sent_id(s) for s in sent_ids)):
            raise rec.error(field, f"'sent_id' must be a list of integers, got {sent_ids!r}")
        if len(titles) != len(sent_ids):
            raise rec.error(field, f"{len(titles)} titles but {len(sent_ids)} sent_ids")
        pairs = list(zip(titles, sent_ids, strict=True))
    else:
        raise rec.error(
            field,
            "expected a list of [title, sent_id] pairs (official layout) or an object with 'title' and "
            f"'sent_id' lists (Hugging Face layout), got {_kind(value)}",
        )
    if not pairs:
        raise rec.error(field, "is empty, so the question has no gold paragraph")
    return tuple(pairs)


def _parse_context(rec: _Record) -> tuple[Paragraph, ...]:
    field = "context"
    if field not in rec.raw:
        raise rec.error(field, "is missing")
    value = rec.raw[field]
    if isinstance(value, list):
        paragraphs = []
        for i, item in enumerate(value):
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and _is_str_list(item[1])):
                raise rec.error(field, f"item {i}: expected a [title, [sentences...]] pair, got {_kind(item)}")
            paragraphs.append(Paragraph(item[0], tuple(item[1])))
    elif isinstance(value, dict):
        titles, sentences = value.get("title"), value.get("sentences")
        if not _is_str_list(titles):
            raise rec.error(field, f"'title' must be a list of strings, got {_kind(titles)}")
        if not (isinstance(sentences, list) and all(_is_str_list(s) for s in sentences)):
            raise rec.error(field, "'sentences' must be a list of lists of strings")
        if len(titles) != len(sentences):
            raise rec.error(field, f"{len(titles)} titles but {len(sentences)} sentence lists")
        paragraphs = [Paragraph(t, tuple(s)) for t, s in zip(titles, sentences, strict=True)]
    else:
        raise rec.error(
            field,
            "expected a list of [title, sentences] pairs (official layout) or an object with 'title' and "
            f"'sentences' lists (Hugging Face layout), got {_kind(value)}",
        )
    if not paragraphs:
        raise rec.error(field, "is empty")
    for i, paragraph in enumerate(paragraphs):
        # A title heads its document and names it for the supporting facts: an empty one names nothing.
        if not paragraph.title.strip():
            raise rec.error(field, f"item {i}: the paragraph's title is empty")
    return tuple(paragraphs)


def _parse_record(raw: Any, file_name: str, index: int) -> HotpotExample:
    if not isinstance(raw, dict):
        raise HotpotQAFormatError(f"{file_name}: record {index}: expected an object, got {_kind(raw)}")
    rec = _Record(raw, file_name, index)
    # The official layout names its id `_id`; the Hugging Face dataset names it `id`, and JSON dumps
    # of it (like the shared dev file) may have none, so it is derived from the question as written
    # (before stripping), which any other tool can recompute from the raw record.
    id_field = "_id" if "_id" in raw else "id" if "id" in raw else None
    question = rec.text("question")
    rec.id = rec.text(id_field) if id_field is not None else derived_id(raw["question"])
    example = HotpotExample(
        id=rec.id,
        question=question,
        answer=rec.text("answer"),
        type=rec.text("type"),
        level=rec.text("level"),
        supporting_facts=_parse_supporting_facts(rec),
        context=_parse_context(rec),
    )
    missing = sorted(example.gold_titles - {p.title for p in example.context})
    if missing:
        # In the distractor setting every supporting paragraph is in the context; without it the
        # question cannot be answered from the haystack.
        raise rec.error("supporting_facts", f"titles {missing} are not titles of any context paragraph")
    sentence_counts: dict[str, int] = {}
    for paragraph in example.context:
        sentence_counts[paragraph.title] = max(sentence_counts.get(paragraph.title, 0), len(paragraph.sentences))
    for i, (title, sent_id) in enumerate(example.supporting_facts):
        # A supporting fact names one sentence of its paragraph; one that is not there is a broken record.
        if not 0 <= sent_id < sentence_counts[title]:
            raise rec.error(
                "supporting_facts",
                f"item {i}: sent_id {sent_id} is out of range: paragraph {title!r} has "
                f"{sentence_counts[title]} sentences (sent_id 0..{sentence_counts[title] - 1})",
            )
        # The gold sentence is what the memory must keep (the expert's, the report's coverage): blank, it says nothing.
        if not any(
            p.sentences[sent_id].strip() for p in example.context if p.title == title and sent_id < len(p.sentences)
        ):
            raise rec.error("supporting_facts", f"item {i}: sentence {sent_id} of paragraph {title!r} is blank")
    return example


def load_hotpotqa(path: str | Path) -> list[HotpotExample]:
    """Load and validate a HotpotQA file in the official or the Hugging Face JSON layout.

    Raises :class:`HotpotQAFormatError` (a ``ValueError``) naming the file, the record index, its id
    when known, and the field, for the first malformed record or a repeated id.
    """
    path = Path(path)
    try:
        data = json_loads_strict(read_text_utf8(path, HotpotQAFormatError), path.name)
    except json.JSONDecodeError as exc:
        raise HotpotQAFormatError(f"{path.name}: not valid JSON: {exc}") from exc
    except (DuplicateKeyError, TooDeepError) as exc:
        raise HotpotQAFormatError(str(exc)) from None
    if not isinstance(data, list):
        raise HotpotQAFormatError(f"{path.name}: expected a JSON list of records, got {_kind(data)}")
    if (at := lone_surrogate(data)) is not None:
        raise HotpotQAFormatError(f"{path.name}, {at}: a lone UTF-16 surrogate (\\ud800-\\udfff escape), not text")
    if not data:
        raise HotpotQAFormatError(f"{path.name}: holds no records")
    examples = []
    first_index: dict[str, int] = {}
    for index, raw in enumerate(data):
        example = _parse_record(raw, path.name, index)
        if example.id in first_index:
            # Rows are seeded by id, so two records with one id would silently share their distractors.
            raise HotpotQAFormatError(
                f"{path.name}: record {index} (id {example.id}): field 'id': "
                f"same id as record {first_index[example.id]}"
            )
        first_index[example.id] = index
        examples.append(example)
    types = Counter(e.type for e in examples)
    logger.info("%s: %d questions (%s)", path.name, len(examples), dict(sorted(types.items())))
    return examples


def paragraph_pool(examples: Sequence[HotpotExample]) -> list[tuple[str, str]]:
    """All distinct ``(title, text)`` paragraphs of the file, sorted, so the pool ignores record order."""
    return sorted({p.key for e in examples for p in e.context})


def question_parts(examples: Sequence[HotpotExample], test_percent: int | None) -> dict[str, str]:
    """Each question's part by :func:`question_part` (``"train"`` / ``"test"``), or ``"all"`` when
    ``test_percent`` is None (the file is one split)."""
    if test_percent is None:
        return {e.id: ONE_POOL for e in examples}
    return {e.id: question_part(e.id, test_percent) for e in examples}


def part_pools(examples: Sequence[HotpotExample], parts: dict[str, str]) -> dict[str, list[tuple[str, str]]]:
    """One sorted paragraph pool per part: the paragraphs of that part's questions, without any paragraph
    that a question of another part also has, so no haystack can draw another part's evidence."""
    owners: dict[tuple[str, str], set[str]] = {}
    for e in examples:
        for p in e.context:
            owners.setdefault(p.key, set()).add(parts[e.id])
    pools: dict[str, list[tuple[str, str]]] = {part: [] for part in sorted(set(parts.values()))}
    for key in sorted(owners):
        if len(owners[key]) == 1:
            pools[next(iter(owners[key]))].append(key)
    return pools


def _lazy_permutation(rng: random.Random, n: int) -> Iterator[int]:
    """Yield ``range(n)`` in random order, one at a time.

    Fisher-Yates with a sparse swap table: drawing k items costs O(k), not O(n), which matters because
    each question needs a few hundred distractors from a pool that can hold tens of thousands.
    """
    swapped: dict[int, int] = {}
    for i in range(n):
        j = rng.randrange(i, n)
        yield swapped.get(j, j)
        swapped[j] = swapped.get(i, i)


def question_rng(seed: int, example_id: str) -> random.Random:
    """A question's own RNG, from the run's seed and its id alone (a row depends on no other row)."""
    # A hash, not hash(): Python salts str hashes per process, which would break reproducibility.
    digest = hashlib.sha256(f"{seed}\x1f{example_id}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _check_positive(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive integer or None, got {value!r}")


def _check_arguments(num_docs: int | None, max_tokens: int | None, limit: int | None) -> None:
    if (num_docs is None) == (max_tokens is None):
        raise ValueError(f"set exactly one of num_docs and max_tokens (got {num_docs=}, {max_tokens=})")
    _check_positive("num_docs", num_docs)
    _check_positive("max_tokens", max_tokens)
    _check_positive("limit", limit)


class _Builder:
    """Select, shuffle and render the documents of one question: its own context, then pool paragraphs."""

    def __init__(
        self,
        pool: list[tuple[str, str]],
        seed: int,
        num_docs: int | None,
        max_tokens: int | None,
        count_tokens: Callable[[str], int],
    ):
        self.pool = pool
        self.pool_keys = frozenset(pool)
        self.seed = seed
        self.num_docs = num_docs
        self.max_tokens = max_tokens
        self.count = count_tokens
        self.title_counts = Counter(title for title, _ in pool)
        self.doc_tokens: dict[str, int] = {}
        self.separator_tokens = count_tokens(DOCUMENT_SEPARATOR)
        self.pool_exhausted = 0

    def _doc_cost(self, doc: str, position: int) -> int:
        """Tokens that appending ``doc`` as document ``position`` adds (exact for the approximate counter)."""
        if doc not in self.doc_tokens:
            self.doc_tokens[doc] = self.count(doc)
        header = self.count(f"Document {position}:\n")
        return self.separator_tokens + header + self.doc_tokens[doc]

    def _additions(self, rng: random.Random, example: HotpotExample) -> Iterator[str]:
        """Pool paragraphs in random order, without the question's own ones (upstream skips those by
        identity) and without other versions of its gold articles (a second copy of the evidence)."""
        own = {p.key for p in example.own}
        for j in _lazy_permutation(rng, len(self.pool)):
            title, text = self.pool[j]
            if (title, text) not in own and title not in example.gold_titles:
                yield render_document(title, text)

    def _available(self, example: HotpotExample) -> int:
        """How many pool paragraphs :meth:`_additions` can yield for ``example``."""
        gold_titled = sum(self.title_counts[t] for t in example.gold_titles)
        own_in_pool = sum(p.key in self.pool_keys for p in example.hard_distractors)
        return len(self.pool) - gold_titled - own_in_pool

    def context(self, example: HotpotExample) -> tuple[str, int, int]:
        """Return one question's rendered context, its number of documents and its token count."""
        rng = question_rng(self.seed, example.id)
        gold = [render_document(p.title, p.text) for p in example.gold]
        hard = [render_document(p.title, p.text) for p in example.hard_distractors]
        if self.max_tokens is None:
            kept, added = self._take_count(example, rng, gold, hard, self.num_docs)
        else:
            kept, added = (
                gold + hard,
                self._take_budget(gold + hard, self._additions(rng, example), self.max_tokens),
            )
        docs = kept + added
        rng.shuffle(docs)
        context = render_context(docs)
        num_tokens = self.count(context)
        # A real tokenizer is not exactly additive over documents, so drop the latest additions until
        # the exact count fits; with the approximate counter this loop never runs.
        while self.max_tokens is not None and num_tokens > self.max_tokens and added:
            docs.remove(added.pop())
            context = render_context(docs)
            num_tokens = self.count(context)
        return context, len(docs), num_tokens

    def _take_count(
        self, example: HotpotExample, rng: random.Random, gold: list[str], hard: list[str], num_docs: int
    ) -> tuple[list[str], list[str]]:
        """``(kept own documents, added pool documents)`` for ``num_docs`` documents in all."""
        if num_docs < len(gold):
            raise ValueError(f"question {example.id} has {len(gold)} gold paragraphs, more than num_docs={num_docs}")
        if num_docs <= len(gold) + len(hard):
            # Fewer documents than the question's own context: gold plus some of its hard distractors.
            return gold + rng.sample(hard, num_docs - len(gold)), []
        needed = num_docs - len(gold) - len(hard)
        available = self._available(example)
        if available < needed:
            raise PoolTooSmallError(
                f"num_docs={num_docs} needs {needed} pool paragraphs besides the {len(gold) + len(hard)} of "
                f"question {example.id}'s own context, but its pool of {len(self.pool)} unique paragraphs has "
                f"only {available} available (at most num_docs={available + len(gold) + len(hard)}); lower "
                "num_docs or use a larger file"
            )
        return gold + hard, list(islice(self._additions(rng, example), needed))

    def _take_budget(self, own: list[str], candidates: Iterator[str], max_tokens: int) -> list[str]:
        # The question's own context is always kept, even when it alone exceeds the budget.
        used = self.count(render_context(own))
        added: list[str] = []
        for doc in candidates:
            cost = self._doc_cost(doc, len(own) + len(added) + 1)
            if used + cost > max_tokens:
                return added
            added.append(doc)
            used += cost
        self.pool_exhausted += 1
        return added


def build_rows(
    examples: Sequence[HotpotExample],
    *,
    num_docs: int | None = None,
    max_tokens: int | None = None,
    seed: int = 0,
    count_tokens: Callable[[str], int] | None = None,
    limit: int | None = None,
    test_percent: int | None = None,
) -> pa.Table:
    """One MemAgent row per question (the first ``limit`` ones), in verl's ``RLHFDataset`` layout.

    Each context holds the question's own context paragraphs plus paragraphs drawn from the pool: either
    ``num_docs`` documents in all, or as many as fit in ``max_tokens`` tokens counted with ``count_tokens``
    (default :func:`approx_token_count`; pass e.g. ``lambda s: len(tok(s).input_ids)`` for a model's
    tokenizer). With ``test_percent`` the questions are parted by :func:`question_part` and each part
    draws from its own pool (:func:`part_pools`); without it the whole file is one pool. Pools always come
    from all of ``examples`` and each question has its own RNG, so a row is the same whatever ``limit`` is.
    Raises :class:`PoolTooSmallError` if a pool cannot supply ``num_docs`` documents.
    """
    _check_arguments(num_docs, max_tokens, limit)
    count = count_tokens or approx_token_count
    parts = question_parts(examples, test_percent)
    pools = part_pools(examples, parts)
    chosen = examples if limit is None else examples[:limit]
    if limit is not None and limit > len(examples):
        logger.warning("limit=%d but the file has only %d questions; using all of them", limit, len(examples))
    builders = {part: _Builder(pool, seed, num_docs, max_tokens, count) for part, pool in pools.items()}
    rows = []
    for index, example in enumerate(tqdm(chosen, desc="hotpotqa rows", unit="question")):
        part = parts[example.id]
        context, n_docs, num_tokens = builders[part].context(example)
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "agent_name": MEMAGENT_AGENT,
                "prompt": [{"role": "user", "content": example.question}],
                "context": context,
                "reward_model": {"style": REWARD_STYLE, "ground_truth": [example.answer]},
                "extra_info": {
                    "index": index,
                    "id": example.id,
                    "question": example.question,
                    "answers": [example.answer],
                    "supporting_facts": list(example.supporting_sentences),
                    "num_docs": n_docs,
                    "num_tokens": num_tokens,
                    "type": example.type,
                    "level": example.level,
                    "part": part,
                },
                "num_docs": n_docs,
                "num_tokens": num_tokens,
            }
        )
    for part, builder in builders.items():
        if builder.pool_exhausted:
            logger.warning(
                "%d %s questions used the whole pool of %d paragraphs and stay below max_tokens=%d",
                builder.pool_exhausted,
                part,
                len(builder.pool),
                max_tokens,
            )
    return pa.Table.from_pylist(rows, schema=ROW_SCHEMA)


def load_token_counter(tokenizer: str) -> Callable[[str], int]:
    """Token counter from a Hugging Face tokenizer name or path, read from local files only.

    Raises :class:`TokenizerUnavailableError` naming the tokenizer when it is neither a local tokenizer
    folder nor a name already in the Hugging Face cache (nothing is downloaded: preprocessing runs on
    compute nodes without network too).
    """
    from transformers import AutoTokenizer  # slow import, only needed when a tokenizer is asked for

    try:
        tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    except (OSError, ValueError) as exc:
        # transformers reports a missing cache entry as a failed hub connection, through a chain of
        # three exceptions; the one thing the user can act on is which tokenizer and where it is looked for.
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TokenizerUnavailableError(
            f"tokenizer {tokenizer!r} could not be loaded: it must be a local folder holding a Hugging Face "
            "tokenizer or the name of one already in the Hugging Face cache (it is never downloaded here); "
            f"transformers said: {reason}"
        ) from None

    def count(text: str) -> int:
        # The context is inserted into a chat prompt, so special tokens are not part of its length;
        # verbose=False silences the warning about texts longer than the model's maximum length.
        return len(tok(text, add_special_tokens=False, verbose=False).input_ids)

    return count


def spread(values: list[int]) -> dict[str, float | int | None]:
    """Mean, min and max of ``values`` for a summary (all None when there are none)."""
    if not values:
        return {"mean": None, "min": None, "max": None}
    return {"mean": round(statistics.fmean(values), 2), "min": min(values), "max": max(values)}


def _check_budget(input_path: str | Path, table: pa.Table, max_tokens: int) -> int:
    """Rows over ``max_tokens`` (their own paragraphs alone exceed it): a warning if some are, an error if all.

    A question's own context is always kept whole, so a budget below it cannot be met; when that holds for
    every row the budget is a mistake (a typo, or a count meant for another tokenizer), not a data quirk.
    """
    info = table.column("extra_info").combine_chunks()
    ids = info.field("id").to_pylist()
    tokens = table.column("num_tokens").to_pylist()
    over = [(n, question) for n, question in zip(tokens, ids, strict=True) if n > max_tokens]
    if over and len(over) == len(tokens):
        n, question = min(over)
        raise BudgetTooSmallError(
            f"{Path(input_path).name}: all {len(tokens)} rows are over max_tokens={max_tokens}: the smallest, "
            f"question {question}, has {n} tokens in field 'context' from its own paragraphs alone, which are "
            f"always kept; set max_tokens to at least {n}"
        )
    if over:
        n, question = max(over)
        logger.warning(
            "%s: %d of %d rows are over max_tokens=%d because their own paragraphs alone exceed it "
            "(the largest: question %s, %d tokens); they are kept whole (rows_over_budget in the summary)",
            Path(input_path).name,
            len(over),
            len(tokens),
            max_tokens,
            question,
            n,
        )
    return len(over)


def preprocess_hotpotqa(
    input_path: str | Path,
    output_path: str | Path,
    *,
    num_docs: int | None = None,
    max_tokens: int | None = None,
    seed: int = 0,
    limit: int | None = None,
    tokenizer: str | None = None,
    summary_path: str | Path | None = None,
    test_percent: int | None = None,
    sha256: str | None = None,
) -> dict:
    """Load a HotpotQA file, build MemAgent rows and write them as parquet with a JSON summary.

    The one entry point for the Snakemake script and the CLI. ``test_percent`` gives each part of the
    later :func:`split_rows` its own paragraph pool (None: the file is one split). Both files appear
    together or not at all (a failed run also removes the previous run's); the summary (counts, token and
    document spreads, pool sizes, rows over ``max_tokens``, input sha256, arguments) goes to ``summary_path``,
    by default the output path with its suffix replaced by ``.summary.json``. Returns the summary. Raises
    :class:`BudgetTooSmallError` when every row is over ``max_tokens`` and
    :class:`TokenizerUnavailableError` for a tokenizer that is not available locally. ``sha256`` (the file's in
    config) is checked before anything is read (:func:`memupdate.data.fetch.verify_copy`).
    """
    _check_arguments(num_docs, max_tokens, limit)
    verify_copy(input_path, sha256)
    if summary_path is None:
        summary_path = Path(output_path).with_suffix(".summary.json")
    # Rows and summary appear together or not at all, and a failed rerun removes the previous run's files.
    with atomic_outputs({"rows": output_path, "summary": summary_path}) as tmp:
        examples = load_hotpotqa(input_path)
        count_tokens = load_token_counter(tokenizer) if tokenizer is not None else None
        table = build_rows(
            examples,
            num_docs=num_docs,
            max_tokens=max_tokens,
            seed=seed,
            count_tokens=count_tokens,
            limit=limit,
            test_percent=test_percent,
        )
        tokens = table.column("num_tokens").to_pylist()
        over_budget = _check_budget(input_path, table, max_tokens) if max_tokens is not None else None
        write_parquet_atomic(tmp["rows"], table)

        docs = table.column("num_docs").to_pylist()
        types = Counter(table.column("extra_info").combine_chunks().field("type").to_pylist())
        summary: dict[str, Any] = {
            "input": str(input_path),
            "input_sha256": sha256_file(input_path),
            "output": str(output_path),
            "arguments": {
                "num_docs": num_docs,
                "max_tokens": max_tokens,
                "seed": seed,
                "limit": limit,
                "tokenizer": tokenizer,
                "test_percent": test_percent,
            },
            "token_counter": tokenizer if tokenizer is not None else APPROX_TOKENIZER,
            "questions_in_file": len(examples),
            "pool_paragraphs": len(paragraph_pool(examples)),
            "pool_paragraphs_by_part": {
                part: len(pool) for part, pool in part_pools(examples, question_parts(examples, test_percent)).items()
            },
            "rows": table.num_rows,
            "rows_by_type": dict(sorted(types.items())),
            "rows_over_budget": over_budget,
            "num_tokens": spread(tokens),
            "num_docs": spread(docs),
        }
        write_json_atomic(tmp["summary"], summary)
    logger.info(
        "%s: %d rows, %s-%s documents, tokens mean %s (min %s, max %s) -> %s",
        Path(input_path).name,
        table.num_rows,
        summary["num_docs"]["min"],
        summary["num_docs"]["max"],
        summary["num_tokens"]["mean"],
        summary["num_tokens"]["min"],
        summary["num_tokens"]["max"],
        output_path,
    )
    return summary


def question_part(question_id: str, test_percent: int) -> str:
    """``"test"`` or ``"train"`` for a question, from a hash of its id alone: a question lands in the same part
    at every context length and whatever else is in the file, so no test question is ever trained on.

    >>> question_part("5a8b57f25542995d1e6f1371", 20), question_part("5a8b57f25542995d1e6f1371", 100)
    ('train', 'test')
    """
    if not 0 <= test_percent <= 100:
        raise ValueError(f"test_percent must be within 0-100, got {test_percent!r}")
    return "test" if _bucket(question_id) < test_percent else "train"


def _bucket(key: str) -> int:
    """A question's bucket, 0-99, from a hash of ``key`` (its id, or a salted id) alone."""
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 100


def _write_parts(
    rows: str | Path,
    outputs: dict[str, str | Path],
    part_of: Callable[[str], str],
    setting: str,
    advice: str,
    check: Callable[[Any, list[str], list[str]], None] | None = None,
) -> dict[str, int]:
    """Write the rows of ``rows`` into ``outputs[part]`` by ``part_of(question id)`` and return each part's row
    count. Every part must be non-empty (the error names ``setting``, then gives ``advice``); ``check(extra_info,
    ids, parts)`` may refuse the rows before anything is written."""
    counts = {}
    # The parts appear together or not at all, and a failed rerun removes the previous run's files.
    with atomic_outputs(dict(outputs)) as tmp:
        table = read_parquet_columns(rows, {"extra_info": None}, ROWS_TABLE, only=False)
        info = table.column("extra_info").combine_chunks()
        ids = info.field("id").to_pylist()
        parts = [part_of(i) for i in ids]
        if check is not None:
            check(info, ids, parts)
        for part in outputs:
            counts[part] = parts.count(part)
            if not counts[part]:
                raise ValueError(f"{rows}: no {part} rows with {setting} among {len(ids)} questions; {advice}")
            write_parquet_atomic(tmp[part], table.filter(pa.array([p == part for p in parts])))
    return counts


def split_rows(rows: str | Path, outputs: dict[str, str | Path], test_percent: int) -> dict[str, int]:
    """Write the rows of ``rows`` (from :func:`preprocess_hotpotqa` with the same ``test_percent``) into
    ``outputs["train"]`` and ``outputs["test"]`` by :func:`question_part`; returns the row count of each (both
    must be non-empty). Rows whose haystack drew from another part's pool (built with one pool, or with
    another ``test_percent``) are refused: their distractors would leak paragraphs across the split."""

    def same_pools(info: Any, ids: list[str], parts: list[str]) -> None:
        built = info.field("part").to_pylist() if "part" in {f.name for f in info.type} else [None] * len(ids)
        for index, (question, part, pool) in enumerate(zip(ids, parts, built, strict=True)):
            if pool != part:
                raise ValueError(
                    f"{rows}: row {index} (id {question}): field 'extra_info.part' is {pool!r}, but with "
                    f"test_percent={test_percent} the question is in {part!r}; rebuild the rows with "
                    f"preprocess_hotpotqa(..., test_percent={test_percent}) so each part draws from its own pool"
                )

    counts = _write_parts(
        rows,
        {part: outputs[part] for part in ("train", "test")},
        lambda question: question_part(question, test_percent),
        f"test_percent={test_percent}",
        "use more questions (scales.<scale>.hotpotqa_limit) or another test_percent",
        check=same_pools,
    )
    logger.info("%s: %d train / %d test questions", rows, counts["train"], counts["test"])
    return counts


def cold_start_part(question_id: str, sft_percent: int) -> str:
    """``"sft"`` or ``"grpo"`` for a train question: whether a MemAgent cold start learns from it or GRPO trains on
    it (``sft.questions_percent``). A hash of the id as :func:`question_part`'s, salted: with the same hash the
    train questions (buckets above ``test_percent``) would all fall in one part.

    >>> [cold_start_part(f"q{i}", 50) for i in range(4)]
    ['grpo', 'grpo', 'sft', 'grpo']
    """
    if not 0 < sft_percent < 100:
        raise ValueError(f"sft_percent must be within 1-99, got {sft_percent!r}")
    return "sft" if _bucket(f"cold-start:{question_id}") < sft_percent else "grpo"


def split_cold_start(rows: str | Path, outputs: dict[str, str | Path], sft_percent: int) -> dict[str, int]:
    """Write the train rows of ``rows`` into ``outputs["sft"]`` (the cold start's questions) and ``outputs["grpo"]``
    (GRPO's) by :func:`cold_start_part`; returns the row count of each (both must be non-empty). GRPO then trains on
    questions the cold start never saw: on its own questions a cold start answers what it memorised (memagent_demo:
    train reward 0.68-0.81 at GRPO's first step, 0.13-0.20 held out), and GRPO learns little beyond recall."""
    counts = _write_parts(
        rows,
        {part: outputs[part] for part in ("sft", "grpo")},
        lambda question: cold_start_part(question, sft_percent),
        f"sft.questions_percent={sft_percent}",
        "use more questions or another questions_percent",
    )
    logger.info("%s: %d questions for the cold start / %d for GRPO", rows, counts["sft"], counts["grpo"])
    return counts
