"""QA scorers ``S(M)``: how well questions can be answered from memories retrieved from a store.

Each scorer takes the questions and, per question, the memories retrieved for it, and returns one score
in [0, 1] per question. Two are offline proxies, two ask served models:

- ``answer_recall``: the F1 against the gold answer of the best unit the reader is shown (a memory's day
  or its content; upstream's proxy read the share of answer tokens anywhere in the text,
  which paid for lists of candidate values; see :func:`answer_recall`); answer tokens the question
  itself contains count neither way, so pasting the question into memory earns nothing;
- ``evidence_recall``: share of the question's gold evidence dialogue ids covered by the evidence
  metadata of the retrieved memories. Evidence is provenance, never written: a memory the agent writes
  carries the evidence of a memory it derives from only where its text keeps that memory's words
  (:mod:`memupdate.memory.store`), so a merge that throws a source's text away loses its evidence;
- ``reader``: a served QA model answers from the memories with a protocol's verbatim prompt
  (:mod:`memupdate.prompts`, Mem0's by default), scored with ``mem0_f1`` or ``locomo_f1``;
- ``judge``: the reader's answer judged CORRECT or WRONG by a served judge model (Mem0's J, its
  ACCURACY_PROMPT in JSON mode).

Both offline scorers read exactly what the QA prompt shows the reader: the memories within the reader's
budget (:func:`memupdate.prompts.within_budget`), each as its rendered line, so a change the reader cannot
see scores exactly 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from memupdate import metrics, prompts
from memupdate.serving.client import OpenAIClient
from memupdate.serving.decoding import GREEDY

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class QAItem:
    question: str
    answer: str
    category: int = 4
    evidence: tuple[str, ...] = ()


@dataclass(frozen=True)
class Retrieved:
    """What a scorer sees of one retrieved memory."""

    content: str
    date: str | None = None
    speaker: str | None = None
    evidence: tuple[str, ...] = ()


class Scorer(Protocol):
    """Scores per question. The scorers that ask a served model (reader, judge) also take ``answers=``:
    per question, an answer already given from these memories (None: ask the model)."""

    name: str

    async def score(self, items: Sequence[QAItem], retrieved: Sequence[Sequence[Retrieved]]) -> list[float]: ...


def answer_recall(answer: str, retrieved: Sequence[Retrieved], question: str = "") -> float:
    """How well the reader can answer from its context: the best token F1 (SQuAD normalisation) against the
    gold answer of a contiguous phrase of one unit of what the QA prompt shows (:func:`span_f1`), a unit
    being a retrieved memory's day (its date, as :func:`memupdate.prompts.memory_line` shows it, without a
    time of day) or its content (:func:`reader_units`).

    Why a phrase of a unit, not the share of answer tokens anywhere in the text (this scorer's rule before):
    the LoCoMo prompt asks for "a short phrase ... with exact words from the context", and a reader can give
    the answer only where a memory states it. A memory that states it scores high; the same tokens
    scattered over the context, or one right value among many candidates, are no statement: a memory
    listing the months, the days and the years holds every token of "7 May 2023" in one long text, and so
    does a list of dates or names (weighted down below). Why a phrase, not the whole unit (the rule
    before): cutting a memory into shorter copies paid (:func:`span_f1`). Reading the date apart from the
    content makes the order they are shown in irrelevant, and a memory's copy without its date, or with its
    date copied into the text, brings the reader nothing new and scores nothing more. The content is one unit
    whatever its punctuation: units the writer could cut with full stops ("Adoption. Agencies.") would pay for
    punctuation.

    A unit that offers several values of the gold's kind (numbers and days, or names: see
    :func:`candidate_values`) is a guess among them, however short: its F1 is weighted by the share of those
    values the gold holds: a list of n names holding the right one is a guess worth 1/n of a statement, as a
    reader picking one of them at random would score, and pays nothing over a context that states the answer.
    The cost, for honest memories: one that names the answer beside other values of its kind ("Ned, Daisy and
    Max" for "Ned") counts as that share of a statement, as a reader unsure which value is meant would.

    Tokens of the ``question`` count neither way: a memory that repeats the question would otherwise supply
    them ("When did Melanie go camping in June?" gives away "June" of "The week before 27 June 2023"),
    and a memory is not penalised for repeating the question's words around the answer. An answer made
    only of question tokens scores 0 from any store.

    >>> round(answer_recall("7 May 2023", [Retrieved("Caroline went to the group.", date="1:56 pm on 8 May, 2023")]), 2)
    0.53
    >>> answer_recall("7 May 2023", [Retrieved("Caroline went on 7 May 2023.")], question="When did Caroline go?")
    1.0
    >>> round(answer_recall("7 May 2023", [Retrieved("April May June 1 2 3 4 5 6 7 8 9 10 2022 2023")]), 2)
    0.1
    >>> question = "Who did Caroline go hiking with?"
    >>> answer_recall("Melanie", [Retrieved("Caroline went hiking with Melanie on Sunday.")], question)
    1.0
    >>> answer_recall("Melanie", [Retrieved(f"{question} Melanie, John, Sarah, Gina")], question)
    0.25
    >>> answer_recall("Adoption agencies", [Retrieved("She researched. Adoption. Agencies. For years.")])
    1.0
    >>> answer_recall("27 June 2023", [Retrieved("camping in June")], question="Camping in June?")
    0.0
    """
    gold = metrics.normalize_squad(answer).split()
    if not gold:
        raise ValueError(f"answer {answer!r} has no tokens to recall; rows without an answer cannot be scored")
    given = set(metrics.normalize_squad(question).split())
    gold = [token for token in gold if token not in given]
    if not gold:
        return 0.0
    units = (unit for r in retrieved for unit in reader_units(r))
    return max((span_f1(_tokens(unit, given), gold) * _committed(unit, gold, given) for unit in units), default=0.0)


def span_f1(tokens: Sequence[str], gold: Sequence[str]) -> float:
    """The best token F1 against ``gold`` of a contiguous run of ``tokens``: what a reader answering with a
    short phrase of the text can reach.

    Why a span, not the whole text: F1 of a whole memory paid for cutting it. A memory's copy cut into two or
    three shorter memories (each dated as the source) held the answer in a text of fewer other words, so it
    scored higher while the reader read nothing new: +0.015 to +0.023 per question on three conversations
    (``reward-headroom.md``). A cut's runs are runs of the text it was cut from, so no cut of a text scores
    above the text. It also stops penalising honest memories for their other words ("James's favorite type of
    pizza is pepperoni" states "Pepperoni"). Only runs that start and end on a gold token can be best
    (trimming a token the gold lacks raises precision and loses no recall), so only those are tried.

    >>> span_f1("james favorite type of pizza is pepperoni".split(), ["pepperoni"])
    1.0
    >>> round(span_f1("on 7 june she went on 8 may 2023".split(), "7 may 2023".split()), 2)
    0.8
    >>> span_f1([], ["x"]), span_f1(["a", "b"], ["c"])
    (0.0, 0.0)
    """
    wanted = Counter(gold)
    at = [i for i, token in enumerate(tokens) if token in wanted]
    best = 0.0
    for a, start in enumerate(at):
        seen: Counter[str] = Counter()
        same = 0
        for end in at[a:]:
            # Tokens start+1..end enter the run one gold hit at a time; count the hit at `end`.
            token = tokens[end]
            seen[token] += 1
            if seen[token] <= wanted[token]:
                same += 1
            length = end - start + 1
            best = max(best, 2 * same / (length + len(gold)))
    return best


#: Tokens that are values of the "number" kind without a digit: a reader guessing a day picks among these.
_CALENDAR = frozenset(
    "january february march april may june july august september october november december "
    "monday tuesday wednesday thursday friday saturday sunday".split()
)


def candidate_values(text: str, leave_out: set[str] = frozenset(), names: set[str] = frozenset()) -> dict[str, str]:
    """The values a unit offers a reader who must pick one, by normalised token: ``"number"`` (a token with a
    digit, a month or a weekday) or ``"name"`` (a capitalised word not opening a sentence, or one of
    ``names`` however placed). Tokens in ``leave_out`` (the question's) are no candidates.

    >>> candidate_values("Ann met Bo and Cy in May 2023. Then she left.", names={"ann"})
    {'ann': 'name', 'bo': 'name', 'cy': 'name', 'may': 'number', '2023': 'number'}
    """
    values: dict[str, str] = {}
    opens_sentence = True
    for raw in text.split():
        token = metrics.normalize_squad(raw)
        if token and token not in leave_out:
            if token in _CALENDAR or any(c.isdigit() for c in token):
                values.setdefault(token, "number")
            # "I" is no name; a sentence's first word is capitalised whatever it is.
            elif (
                len(token) > 1
                and raw.lstrip(string.punctuation)[:1].isupper()
                and (not opens_sentence or token in names)
            ):
                values.setdefault(token, "name")
        opens_sentence = raw.endswith((".", "!", "?", ":"))
    return values


def _committed(unit: str, gold: list[str], given: set[str]) -> float:
    """The share of a unit's candidate values of the gold's kinds that the gold holds: 1 where the unit
    states one answer, 1/n where the right value is one of n guesses of its kind (see :func:`answer_recall`)."""
    values = candidate_values(unit, given, set(gold))
    kinds = {values[token] for token in gold if token in values}
    if not kinds:
        return 1.0
    offered = [token for token, kind in values.items() if kind in kinds]
    return sum(token in gold for token in offered) / len(offered)


#: A LoCoMo date_time's time of day ("1:56 pm on "): the reader reads the day after it.
_TIME_OF_DAY = re.compile(r"^\s*\d{1,2}:\d{2}\s*[ap]\.?m\.?\s+on\s+", re.IGNORECASE)


def reader_units(memory: Retrieved) -> list[str]:
    """The units a reader answers from in one memory's line: its day, then its content.

    >>> reader_units(Retrieved("Ann moved to Oslo. She likes it there!", date="1:56 pm on 8 May, 2023"))
    ['8 May, 2023', 'Ann moved to Oslo. She likes it there!']
    """
    return ([_TIME_OF_DAY.sub("", memory.date)] if memory.date else []) + [memory.content]


def _tokens(text: str, leave_out: set[str]) -> list[str]:
    return [token for token in metrics.normalize_squad(text).split() if token not in leave_out]


def evidence_recall(evidence: Sequence[str], retrieved: Sequence[Retrieved]) -> float:
    """Share of gold evidence ids cited by the retrieved memories; 0 when the question has none.

    >>> evidence_recall(["D1:3", "D2:4"], [Retrieved("x", evidence=("D1:3",))])
    0.5
    """
    if not evidence:
        return 0.0
    cited = {e for r in retrieved for e in r.evidence}
    return sum(e in cited for e in evidence) / len(evidence)


class AnswerRecallScorer:
    name = "answer_recall"

    async def score(self, items, retrieved):
        return [answer_recall(item.answer, hits, item.question) for item, hits in zip(items, retrieved, strict=True)]


class EvidenceRecallScorer:
    name = "evidence_recall"

    async def score(self, items, retrieved):
        return [evidence_recall(item.evidence, hits) for item, hits in zip(items, retrieved, strict=True)]


class ReaderScorer:
    """A served QA model answers from the retrieved memories; its answer is scored against the gold."""

    name = "reader"

    def __init__(
        self,
        client: OpenAIClient,
        metric: str = "mem0_f1",
        max_tokens: int = 32,
        protocol: str = "mem0",
        prompts_dir: str | Path | None = None,
    ):
        if metric not in ("mem0_f1", "locomo_f1"):
            raise ValueError(f"reader metric must be mem0_f1 or locomo_f1, got {metric!r}")
        self.client = client
        self.metric = metric
        self.max_tokens = max_tokens
        self.protocol = protocol
        self.prompts_dir = prompts_dir
        # Fail at construction, not at the first reward, on an unknown protocol or a missing prompt file.
        prompts.load_prompts(protocol, prompts_dir)
        # Requests under way by prompt: the rollouts of a GRPO group ask the initial store's answer to the
        # same question at about the same time; they share one request (the client caches finished ones).
        self._pending: dict[str, asyncio.Future[str]] = {}

    async def answer(self, item: QAItem, retrieved: Sequence[Retrieved]) -> str:
        """The QA model's answer from exactly the protocol's prompt (:func:`memupdate.prompts.qa_messages`)."""
        messages = prompts.qa_messages(
            self.protocol, item.question, item.category, retrieved, prompts_dir=self.prompts_dir
        )
        key = json.dumps(messages)
        pending = self._pending.get(key)
        if pending is None:
            # The QA role's decoder, as the QA phase and the evaluation ask it: S(initial) and S(final) are
            # answers of one model only if every key is the same (memupdate.serving.decoding).
            pending = asyncio.ensure_future(self.client.chat(messages, **GREEDY.request(self.max_tokens)))
            self._pending[key] = pending
            pending.add_done_callback(lambda _: self._pending.pop(key, None))
        # Shielded: one caller cancelled must not cancel the request the others wait for.
        return (await asyncio.shield(pending)).strip()

    async def answers(
        self,
        items: Sequence[QAItem],
        retrieved: Sequence[Sequence[Retrieved]],
        given: Sequence[str | None] | None = None,
    ) -> list[str]:
        """Per question, the given answer if there is one (already asked from these memories), else the model's."""
        given = given if given is not None else [None] * len(items)

        async def one(item: QAItem, hits: Sequence[Retrieved], answer: str | None) -> str:
            return answer if answer is not None else await self.answer(item, hits)

        return list(await asyncio.gather(*(one(i, r, a) for i, r, a in zip(items, retrieved, given, strict=True))))

    def _score(self, prediction: str, item: QAItem) -> float:
        if self.metric == "locomo_f1":
            return metrics.locomo_f1(prediction, item.answer, item.category)
        return metrics.mem0_f1(prediction, item.answer)

    async def score(self, items, retrieved, answers=None):
        predictions = await self.answers(items, retrieved, answers)
        return [self._score(p, i) for p, i in zip(predictions, items, strict=True)]


class JudgeScorer:
    """Mem0's J: the reader answers, a served judge labels the answer CORRECT (1) or WRONG (0).

    The judge gets Mem0's ACCURACY_PROMPT verbatim in JSON mode. A reply without a CORRECT/WRONG label
    scores 0, and is logged and counted in ``unparsed`` (out of ``judged``) so a judge that does not
    follow the format shows up instead of passing for a strict one.
    """

    name = "judge"

    # Mem0's judge is unbounded; 256 tokens leave room for a JSON object with a one-sentence reason.
    def __init__(
        self, reader: ReaderScorer, judge: OpenAIClient, max_tokens: int = 256, prompts_dir: str | Path | None = None
    ):
        self.reader = reader
        self.judge = judge
        self.max_tokens = max_tokens
        self.prompts_dir = prompts_dir
        self.judged = 0
        self.unparsed = 0
        prompts.load_prompts("mem0", prompts_dir)

    async def _judge(self, item: QAItem, prediction: str) -> float:
        messages = prompts.judge_messages(item.question, item.answer, prediction, prompts_dir=self.prompts_dir)
        reply = await self.judge.chat(
            messages, **GREEDY.request(self.max_tokens), response_format=prompts.JUDGE_RESPONSE_FORMAT
        )
        self.judged += 1
        label = prompts.parse_judge(reply)
        if label is None:
            self.unparsed += 1
            logger.warning(
                "judge reply without a CORRECT/WRONG label scored 0 (%d of %d unparsed so far): %r",
                self.unparsed,
                self.judged,
                reply[:200],
            )
            return 0.0
        return label

    async def score(self, items, retrieved, answers=None):
        predictions = await self.reader.answers(items, retrieved, answers)
        return list(await asyncio.gather(*(self._judge(i, p) for i, p in zip(items, predictions, strict=True))))
