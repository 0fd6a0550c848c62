"""The QA and judge prompts of the two LoCoMo evaluation protocols, verbatim, rendered as upstream fills them.

The texts live in ``prompt_files/<protocol>.yaml`` beside this module (copied byte for byte from upstream, each with its
source repository, path, commit and the sha256 of the upstream string); this module only fills them:

- ``locomo`` (snap-research/LoCoMo ``task_eval/gpt_utils.py``, RAG mode): the retrieved memories, one
  ``"{date}: {content}"`` line each, then two newlines and ``QA_PROMPT`` with the question; category 2
  appends "Use DATE of CONVERSATION to answer with an approximate date.", category 5 asks a two-way
  choice ``(a) ... (b) ...`` with ``QA_PROMPT_CAT_5``;
- ``mem0`` (mem0ai/mem0 ``evaluation/``): the Jinja ``ANSWER_PROMPT`` with each speaker's memories as a
  JSON list of ``"{timestamp}: {memory}"``; the judge is Mem0's ``ACCURACY_PROMPT`` in JSON mode, whatever
  the QA protocol.

Memories are any objects with ``.content``, ``.date`` and ``.speaker`` (store records and the rewards'
``Retrieved`` both are). ``how_upstream_fills`` in each YAML file says how upstream fills its templates.

>>> from memupdate.rewards.scorers import Retrieved
>>> memory = Retrieved("Caroline went to a support group.", date="8 May, 2023", speaker="Caroline")
>>> print(qa_messages("locomo", "When did Caroline go?", 2, [memory])[0]["content"])
8 May, 2023: Caroline went to a support group.
<BLANKLINE>
<BLANKLINE>
Based on the above context, write an answer in the form of a short phrase for the following question. \
Answer with exact words from the context whenever possible.
<BLANKLINE>
Question: When did Caroline go? Use DATE of CONVERSATION to answer with an approximate date. Short answer:
<BLANKLINE>
>>> parse_judge('{"label": "CORRECT"}'), parse_judge('{"label": "WRONG"}'), parse_judge("CORRECT")
(1.0, 0.0, None)
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

logger = logging.getLogger(__name__)

PROTOCOLS = ("locomo", "mem0")
#: The QA prompt of training's QA phase and the reward's reader unless ``reward.qa_prompt`` says otherwise.
DEFAULT_PROTOCOL = "locomo"

#: The verbatim prompt files, shipped with the package (package data).
DEFAULT_PROMPTS_DIR = Path(__file__).resolve().with_name("prompt_files")

#: The templates each protocol's file must hold.
TEMPLATE_KEYS = {
    "locomo": ("qa", "qa_category_5", "category_2_suffix", "category_5_suffix", "conversation_start"),
    "mem0": ("answer", "judge"),
}
SOURCE_KEYS = ("repository", "path", "commit")
MESSAGE_ROLES = ("system", "user")

#: The judge's request format: Mem0's evaluate_llm_judge asks for a JSON object (vLLM's OpenAI server
#: supports it with guided decoding).
JUDGE_RESPONSE_FORMAT = {"type": "json_object"}

_LABELS = {"CORRECT": 1.0, "WRONG": 0.0}

#: A memory as the reader sees it (a store record, a ``Retrieved``): a frozen dataclass with content and date.
M = TypeVar("M")


class PromptFileError(ValueError):
    """A prompt file is missing or malformed; the message names the file and the field."""


@dataclass(frozen=True)
class Template:
    text: str
    source: Mapping[str, Any]


@dataclass(frozen=True)
class Prompts:
    """One protocol's verbatim templates (from :func:`load_prompts`)."""

    protocol: str
    path: Path
    message_role: str
    templates: Mapping[str, Template]

    def text(self, key: str) -> str:
        return self.templates[key].text

    def question(self, question: str, category: int, choices: Mapping[str, str] | None = None) -> str:
        """The question as the protocol asks it: LoCoMo adds its category-2 suffix and category-5 choice
        (get_gpt_answers lines 244-253); Mem0 asks the raw question in every category."""
        category = _category(category)
        if self.protocol == "mem0":
            return question
        if category == 2:
            return question + self.text("category_2_suffix")
        if category == 5:
            if not choices or set(choices) != {"a", "b"}:
                raise ValueError(
                    f"category-5 question {question!r} needs choices {{'a': ..., 'b': ...}} (the answer and "
                    f"'Not mentioned in the conversation' in a drawn order), got {choices!r}"
                )
            # Upstream formats question + suffix together, which breaks on a brace in the question;
            # formatting the suffix alone gives the same text without that failure.
            return question + self.text("category_5_suffix").format(choices["a"], choices["b"])
        return question

    def render_context(
        self, context: str, question: str, category: int, choices: Mapping[str, str] | None = None
    ) -> str:
        """LoCoMo's prompt after any context text (retrieved lines, or the full conversation started by
        ``conversation_start``): ``context + '\\n\\n' + QA_PROMPT.format(question)`` (line 285)."""
        if self.protocol != "locomo":
            raise ValueError(f"render_context is LoCoMo's layout; protocol {self.protocol!r} has its own")
        asked = self.question(question, category, choices)
        template = self.text("qa_category_5" if _category(category) == 5 else "qa")
        return context + "\n\n" + template.format(asked)

    def render_qa(
        self,
        question: str,
        category: int,
        memories: Sequence[Any],
        choices: Mapping[str, str] | None = None,
        speakers: Sequence[str] | None = None,
    ) -> str:
        """The full QA message: ``question`` is the dataset's raw question, ``memories`` the retrieved ones
        in rank order; ``speakers`` (the conversation's speaker_a, speaker_b) is used by Mem0 only."""
        if self.protocol == "locomo":
            # get_rag_context, observation mode: date_time + ': ' + context, joined with '\n'.
            context = "\n".join(memory_line(m) for m in memories)
            return self.render_context(context, question, category, choices)
        names, first, second = split_speakers(memories, speakers)
        # search.py answer_question lines 98-107: one "timestamp: memory" string per memory, each
        # speaker's list as json.dumps(..., indent=4).
        return _jinja(self.text("answer")).render(
            speaker_1_user_id=names[0],
            speaker_2_user_id=names[1],
            speaker_1_memories=json.dumps([memory_line(m) for m in first], indent=4),
            speaker_2_memories=json.dumps([memory_line(m) for m in second], indent=4),
            question=self.question(question, category, choices),
        )


def memory_line(memory: Any) -> str:
    """One memory as the reader reads it, in both protocols: LoCoMo's ``date_time + ': ' + context`` line, Mem0's
    ``"{timestamp}: {memory}"`` list item. A memory without a date shows its content alone, not "None: ...".

    >>> from memupdate.rewards.scorers import Retrieved
    >>> memory_line(Retrieved("Ann moved to Oslo.", date="8 May, 2023")), memory_line(Retrieved("Ann moved."))
    ('8 May, 2023: Ann moved to Oslo.', 'Ann moved.')
    """
    return f"{memory.date}: {memory.content}" if memory.date else memory.content


def within_budget(memories: Sequence[M], max_chars: int) -> list[M]:
    """The reader's context: the leading ``memories`` (in rank order) whose lines, as :func:`memory_line`
    renders them (date included), fit in ``max_chars`` characters in total.

    The QA phase, the evaluation and every scorer of the reward call this one function, so S is scored on
    exactly the text the QA prompt shows, and what a memory carries besides its content (its date) counts
    against the same budget as its content. Whole memories are kept until the next one would overflow, so
    one long memory cannot bring more text than several short ones. The first is always kept, cut to fit
    (its content first, then its date), so a non-empty store never yields an empty context. ``memories`` are
    frozen dataclasses with ``content`` and ``date`` (store records, the rewards' ``Retrieved``).

    >>> from memupdate.rewards.scorers import Retrieved
    >>> memories = [Retrieved("a" * 50, date="8 May"), Retrieved("b" * 30), Retrieved("c" * 20)]
    >>> [len(memory_line(m)) for m in within_budget(memories, 100)]
    [57, 30]
    >>> [memory_line(m) for m in within_budget(memories, 12)]
    ['8 May: aaaaa']
    """
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    kept: list[M] = []
    used = 0
    for memory in memories:
        size = len(memory_line(memory))
        if used + size > max_chars:
            if not kept:
                kept.append(_cut(memory, max_chars))
            break
        kept.append(memory)
        used += size
    return kept


def _cut(memory: M, max_chars: int) -> M:
    prefix = len(memory.date) + 2 if memory.date else 0
    if prefix >= max_chars:
        # A date longer than the whole budget: the reader sees the start of the date alone.
        return dataclasses.replace(memory, date=memory.date[: max(1, max_chars - 3)], content=memory.content[:1])
    return dataclasses.replace(memory, content=memory.content[: max_chars - prefix])


#: Characters of a memory's text the memory agent is shown (tool results, an ingestion row's new memories).
MAX_SHOWN_CHARS = 300


def format_record(record: Any) -> str:
    """How the memory agent sees a memory (any object with ``id``, ``content``, ``speaker``, ``session``,
    ``date``): its short handle first, then where it comes from.

    >>> from memupdate.memory.store import MemoryRecord
    >>> format_record(MemoryRecord(3, "prefers tea", speaker="Caroline", session=2, date="8 May 2023"))
    '[3] (Caroline, session 2, 8 May 2023) prefers tea'
    """
    details = [d for d in (record.speaker, f"session {record.session}" if record.session else None, record.date) if d]
    content = record.content if len(record.content) <= MAX_SHOWN_CHARS else record.content[:MAX_SHOWN_CHARS] + "..."
    return f"[{record.id}] " + (f"({', '.join(details)}) " if details else "") + content


def _category(category: int) -> int:
    value = int(category)
    if value not in (1, 2, 3, 4, 5):
        raise ValueError(f"LoCoMo category must be 1..5, got {category!r}")
    return value


@functools.lru_cache(maxsize=8)
def _jinja(text: str):
    # Upstream renders with jinja2.Template(ANSWER_PROMPT) (default environment, no autoescape);
    # jinja2 comes with transformers (chat templates).
    from jinja2 import Template as JinjaTemplate

    return JinjaTemplate(text)


def split_speakers(
    memories: Sequence[Any], speakers: Sequence[str] | None = None
) -> tuple[tuple[str, str], list[Any], list[Any]]:
    """Mem0's two-speaker layout from one retrieval: ``(names, first speaker's memories, second's)``.

    Upstream searches each speaker's store separately; here the memories retrieved from the one store are
    split by ``.speaker`` (case-insensitive), keeping rank order. Memories of the second speaker go to
    the second list; all others, the first speaker's and those with no speaker or another one (an
    agent may write any), go to the first list, so nothing retrieved is dropped and the template stays
    verbatim. Without ``speakers`` the names are the first two distinct speakers of the memories in
    rank order (an empty name where fewer are known).

    >>> from memupdate.rewards.scorers import Retrieved
    >>> m = [Retrieved("b1", speaker="Mel"), Retrieved("a1", speaker="Caroline"), Retrieved("x")]
    >>> names, first, second = split_speakers(m, ("Caroline", "Melanie"))
    >>> names, [r.content for r in first], [r.content for r in second]
    (('Caroline', 'Melanie'), ['b1', 'a1', 'x'], [])
    >>> names, first, second = split_speakers(m)
    >>> names, [r.content for r in first], [r.content for r in second]
    (('Mel', 'Caroline'), ['b1', 'x'], ['a1'])
    """
    if speakers is not None:
        if len(speakers) != 2 or not all(isinstance(s, str) and s for s in speakers):
            raise ValueError(f"speakers must be the conversation's two speaker names, got {speakers!r}")
        names = (speakers[0], speakers[1])
    else:
        seen: list[str] = []
        for m in memories:
            if m.speaker and m.speaker.casefold() not in (s.casefold() for s in seen):
                seen.append(m.speaker)
        names = ((seen + ["", ""])[0], (seen + ["", ""])[1])
    second_key = names[1].casefold()
    first: list[Any] = []
    second: list[Any] = []
    for m in memories:
        is_second = bool(second_key) and bool(m.speaker) and m.speaker.casefold() == second_key
        (second if is_second else first).append(m)
    return names, first, second


# ------------------------------------------------------------------------------------------ loading


def load_prompts(protocol: str, prompts_dir: str | Path | None = None) -> Prompts:
    """The verbatim templates of ``protocol`` from ``<prompts_dir>/<protocol>.yaml`` (cached per file)."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown prompt protocol {protocol!r}; expected one of {PROTOCOLS}")
    folder = Path(prompts_dir) if prompts_dir is not None else DEFAULT_PROMPTS_DIR
    return _load((folder / f"{protocol}.yaml").resolve(), protocol)


@functools.lru_cache(maxsize=16)
def _load(path: Path, protocol: str) -> Prompts:
    if not path.is_file():
        raise PromptFileError(
            f"prompt file {path} for protocol {protocol!r} does not exist; the package ships them in "
            f"{DEFAULT_PROMPTS_DIR} (pass prompts_dir= for another folder)"
        )
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise PromptFileError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict) or data.get("protocol") != protocol:
        raise PromptFileError(f"{path}: field 'protocol' must be {protocol!r}")
    role = data.get("message_role")
    if role not in MESSAGE_ROLES:
        raise PromptFileError(f"{path}: field 'message_role' must be one of {MESSAGE_ROLES}, got {role!r}")
    raw = data.get("templates")
    if not isinstance(raw, dict):
        raise PromptFileError(f"{path}: field 'templates' must be a mapping")
    templates = {}
    for key in TEMPLATE_KEYS[protocol]:
        entry = raw.get(key)
        where = f"{path}: templates.{key}"
        if not isinstance(entry, dict) or not isinstance(entry.get("text"), str):
            raise PromptFileError(f"{where}: missing, or without a string 'text'")
        source = entry.get("source")
        if not isinstance(source, dict) or not all(source.get(k) for k in SOURCE_KEYS):
            raise PromptFileError(f"{where}.source must name {', '.join(SOURCE_KEYS)}")
        # The hash of the upstream string guards the copy: re-indenting a block scalar or stripping
        # trailing whitespace changes the text without any visible sign.
        digest = hashlib.sha256(entry["text"].encode("utf-8")).hexdigest()
        if digest != entry.get("sha256"):
            raise PromptFileError(
                f"{where}.text no longer matches its sha256 {entry.get('sha256')!r} (got {digest}): the "
                "verbatim text was edited; restore it from the upstream source named there"
            )
        templates[key] = Template(entry["text"], dict(source))
    logger.debug("loaded %s prompts from %s", protocol, path)
    return Prompts(protocol, path, role, templates)


# ----------------------------------------------------------------------------------- entry points


def qa_messages(
    protocol: str,
    question: str,
    category: int,
    memories: Sequence[Any],
    choices: Mapping[str, str] | None = None,
    *,
    speakers: Sequence[str] | None = None,
    prompts_dir: str | Path | None = None,
) -> list[dict[str, str]]:
    """The one chat message the QA model gets under ``protocol``, in the file's ``message_role``: the full
    QA prompt (:meth:`Prompts.render_qa`)."""
    prompts = load_prompts(protocol, prompts_dir)
    content = prompts.render_qa(question, category, memories, choices, speakers)
    return [{"role": prompts.message_role, "content": content}]


def render_judge(question: str, gold: str, generated: str, *, prompts_dir: str | Path | None = None) -> str:
    """Mem0's ACCURACY_PROMPT filled as evaluate_llm_judge fills it."""
    text = load_prompts("mem0", prompts_dir).text("judge")
    return text.format(question=question, gold_answer=gold, generated_answer=generated)


def judge_messages(
    question: str, gold: str, generated: str, *, prompts_dir: str | Path | None = None
) -> list[dict[str, str]]:
    """The judge request's messages: the filled ACCURACY_PROMPT as one user message, as upstream sends it."""
    return [{"role": "user", "content": render_judge(question, gold, generated, prompts_dir=prompts_dir)}]


def judge_prompt_sha256(prompts_dir: str | Path | None = None) -> str:
    """The hash of the judge template, recorded with each judgment so a changed prompt re-judges."""
    return hashlib.sha256(load_prompts("mem0", prompts_dir).text("judge").encode("utf-8")).hexdigest()


def extract_json(text: str) -> str:
    """The JSON part of a reply, as Mem0's ``mem0.memory.utils.extract_json``: a fenced block's content,
    else the first ``{`` to the last ``}``, else the stripped text.

    >>> extract_json('Sure.\\n```json\\n{"label": "WRONG"}\\n```'), extract_json('so {"label": "CORRECT"}.')
    ('{"label": "WRONG"}', '{"label": "CORRECT"}')
    """
    text = text.strip()
    match = re.search(r"```(?:json)?\s*(.*?)\s*```", text, re.DOTALL)
    if match:
        return match.group(1)
    start, end = text.find("{"), text.rfind("}")
    if start != -1 and end > start:
        return text[start : end + 1]
    return text


def parse_judge(reply: str) -> float | None:
    """1.0 for CORRECT, 0.0 for WRONG, None when the reply has no such label.

    Mem0 reads ``json.loads(extract_json(reply))["label"]`` and scores anything but "CORRECT" as 0, and
    fails on a reply without JSON; here both cases are None, so the caller counts them instead of
    scoring them silently.

    >>> parse_judge('```json\\n{"label": "WRONG"}\\n```'), parse_judge('{"label": "maybe"}'), parse_judge("[1]")
    (0.0, None, None)
    """
    try:
        data = json.loads(extract_json(reply))
    except json.JSONDecodeError:
        return None
    label = data.get("label") if isinstance(data, dict) else None
    return _LABELS.get(label) if isinstance(label, str) else None
