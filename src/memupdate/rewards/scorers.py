"""QA scorers ``S(M)``: how well questions can be answered from memories retrieved from a store.

Each scorer takes the questions and, per question, the memories retrieved for it, and returns one score
in [0, 1] per question. Two are offline proxies, two ask served models:

- ``answer_recall``: share of the gold answer's tokens found in the retrieved text (upstream's proxy,
  now computed on the right stores; it can be gamed by writing answer-like tokens into memory);
- ``evidence_recall``: share of the question's gold evidence dialogue ids covered by the evidence
  metadata of the retrieved memories (cannot be gamed by text, but agent-written memories only count
  when they cite evidence);
- ``reader``: a served QA model answers from the memories with a Mem0-style prompt, scored with
  ``mem0_f1`` or ``locomo_f1``;
- ``judge``: the reader's answer judged CORRECT or WRONG by a served judge model (Mem0's J).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from memupdate import metrics
from memupdate.serving.client import OpenAIClient

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
    name: str

    async def score(self, items: Sequence[QAItem], retrieved: Sequence[Sequence[Retrieved]]) -> list[float]: ...


def answer_recall(answer: str, retrieved: Sequence[Retrieved]) -> float:
    """Share of the answer's normalised tokens (SQuAD normalisation) present in the retrieved text.

    >>> answer_recall("7 May 2023", [Retrieved("Caroline went on 7 May"), Retrieved("in 2023")])
    1.0
    >>> answer_recall("painting, running", [Retrieved("she likes running")])
    0.5
    """
    gold = metrics.normalize_squad(answer).split()
    if not gold:
        raise ValueError(f"answer {answer!r} has no tokens to recall; rows without an answer cannot be scored")
    seen = set(metrics.normalize_squad(" ".join(r.content for r in retrieved)).split())
    return sum(token in seen for token in gold) / len(gold)


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
        return [answer_recall(item.answer, hits) for item, hits in zip(items, retrieved, strict=True)]


class EvidenceRecallScorer:
    name = "evidence_recall"

    async def score(self, items, retrieved):
        return [evidence_recall(item.evidence, hits) for item, hits in zip(items, retrieved, strict=True)]


# Mem0's answer prompt (evaluation/prompts.py ANSWER_PROMPT), shortened; the reader sees only memories.
READER_PROMPT = """You are an intelligent memory assistant tasked with retrieving accurate information from conversation memories.

Answer the question using only the memories below. Memories carry timestamps; if a memory uses a relative time ("last year", "two months ago"), convert it to a date using the memory's timestamp. If the memories contradict each other, prefer the most recent one. Answer in fewer than 5-6 words.

Memories:
{memories}

Question: {question}
Answer:"""

# Mem0's judge prompt (evaluation/metrics/llm_judge.py ACCURACY_PROMPT), shortened.
JUDGE_PROMPT = """Your task is to label an answer to a question as 'CORRECT' or 'WRONG'. You will be given a question, a gold (ground truth) answer and a generated answer. Be generous with grading: as long as the generated answer touches on the same topic as the gold answer, count it as CORRECT. For time questions, a generated answer that refers to the same date or time period as the gold answer is CORRECT even in another format.

Question: {question}
Gold answer: {answer}
Generated answer: {prediction}

Return JSON with one key, "label", whose value is "CORRECT" or "WRONG"."""


def format_memories(retrieved: Sequence[Retrieved]) -> str:
    """One line per memory, with its date and speaker when known."""
    if not retrieved:
        return "(no memories found)"
    lines = []
    for r in retrieved:
        parts = (f"[{r.date}]" if r.date else None, f"{r.speaker}:" if r.speaker else None, r.content)
        lines.append("- " + " ".join(p for p in parts if p))
    return "\n".join(lines)


def parse_judge_label(text: str) -> float:
    """1.0 for CORRECT, 0.0 for WRONG: the JSON ``label`` if the reply is JSON, else the last bare label.

    >>> parse_judge_label('{"label": "CORRECT"}'), parse_judge_label("reasoning... so: WRONG")
    (1.0, 0.0)
    """
    try:
        data = json.loads(text)
        label = str(data.get("label", "")) if isinstance(data, dict) else ""
    except json.JSONDecodeError:
        label = ""
    if label.upper() not in ("CORRECT", "WRONG"):
        found = re.findall(r"\b(CORRECT|WRONG)\b", text, re.IGNORECASE)
        if not found:
            raise ValueError(f"judge reply has no CORRECT/WRONG label: {text[:200]!r}")
        label = found[-1]
    return 1.0 if label.upper() == "CORRECT" else 0.0


class ReaderScorer:
    """A served QA model answers from the retrieved memories; its answer is scored against the gold."""

    name = "reader"

    def __init__(self, client: OpenAIClient, metric: str = "mem0_f1", max_tokens: int = 32):
        if metric not in ("mem0_f1", "locomo_f1"):
            raise ValueError(f"reader metric must be mem0_f1 or locomo_f1, got {metric!r}")
        self.client = client
        self.metric = metric
        self.max_tokens = max_tokens

    async def answer(self, item: QAItem, retrieved: Sequence[Retrieved]) -> str:
        prompt = READER_PROMPT.format(memories=format_memories(retrieved), question=item.question)
        messages = [{"role": "user", "content": prompt}]
        return (await self.client.chat(messages, temperature=0.0, max_tokens=self.max_tokens)).strip()

    def _score(self, prediction: str, item: QAItem) -> float:
        if self.metric == "locomo_f1":
            return metrics.locomo_f1(prediction, item.answer, item.category)
        return metrics.mem0_f1(prediction, item.answer)

    async def score(self, items, retrieved):
        answers = await asyncio.gather(*(self.answer(i, r) for i, r in zip(items, retrieved, strict=True)))
        return [self._score(a, i) for a, i in zip(answers, items, strict=True)]


class JudgeScorer:
    """Mem0's J: the reader answers, a served judge labels the answer CORRECT (1) or WRONG (0)."""

    name = "judge"

    def __init__(self, reader: ReaderScorer, judge: OpenAIClient, max_tokens: int = 64):
        self.reader = reader
        self.judge = judge
        self.max_tokens = max_tokens

    async def _judge(self, item: QAItem, hits: Sequence[Retrieved]) -> float:
        prediction = await self.reader.answer(item, hits)
        prompt = JUDGE_PROMPT.format(question=item.question, answer=item.answer, prediction=prediction)
        reply = await self.judge.chat(
            [{"role": "user", "content": prompt}], temperature=0.0, max_tokens=self.max_tokens
        )
        return parse_judge_label(reply)

    async def score(self, items, retrieved):
        return list(await asyncio.gather(*(self._judge(i, r) for i, r in zip(items, retrieved, strict=True))))
