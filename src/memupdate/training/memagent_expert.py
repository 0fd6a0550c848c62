"""Demonstration episodes of the MemAgent loop for the cold start: a scripted expert reads a HotpotQA
haystack chunk by chunk, as the policy will, on the *train* questions.

Its one privileged input is HotpotQA's supporting facts (the sentences that answer the question) and the
gold answer. Its program, per trajectory:

1. each memory turn: the memory so far, plus the section's supporting sentences (a sentence cut by the
   chunk boundaries is kept as the parts the sections show, joined in memory); until one is found the
   memory says :data:`NOTHING_YET`;
2. the final turn: the gold answer in ``\\boxed{}``.

Like :class:`memupdate.training.demonstrations.MemoryExpert` it reads its prompts as the policy does (the
question, memory and section from the loop's prompt) and is served to verl's ``AgentLoopWorker`` as a
model, so every turn's tokens are exactly a GRPO rollout's. A trajectory is kept (:func:`covers`) only when
its final memory holds the supporting facts: a boxed answer the memory does not support would teach the
policy to guess.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from verl.workers.rollout.replica import TokenOutput

from memupdate.agents.memagent import NO_MEMORY

#: The memory before any supporting sentence was seen (the policy must still write one).
NOTHING_YET = "Nothing relevant yet."
#: The shortest piece of a sentence cut by a chunk boundary worth keeping (characters).
MIN_PIECE = 12
#: Share of a supporting sentence's words the final memory must hold for the trajectory to be kept.
COVERAGE = 0.8

_FIELD = {name: re.compile(rf"<{name}>\n(.*?)\n</{name}>", re.DOTALL) for name in ("problem", "memory", "section")}
_WORD = re.compile(r"\w+")


def pieces(section: str, sentences: Iterable[str]) -> list[tuple[str, str]]:
    """The parts of ``sentences`` that ``section`` shows, in section order, each with its sentence: whole
    sentences, and a sentence cut by the chunk boundaries (its tail at the section's start, its head at the
    end, or its middle when the section lies inside it) if at least :data:`MIN_PIECE` characters show.

    >>> facts = ["Ann was born in 1990.", "Eve lived in Paris.", "Bob is tall."]
    >>> [p for p, _ in pieces("ed in Paris. Bob is tall. Ann was bo", facts)]
    ['ed in Paris.', 'Bob is tall.']
    >>> [p for p, _ in pieces("Eve lived in Paris. Ann was born in", facts)]
    ['Eve lived in Paris.', 'Ann was born in']
    >>> pieces("was born i", ["Ann was born in 1990, in a very long sentence."])  # too short to be worth it
    []
    """
    found: dict[int, tuple[str, str]] = {}
    # A chunk may start or end inside a multi-byte character, which decodes as U+FFFD.
    text = section.strip().strip("\ufffd").strip()
    for sentence in sentences:
        if sentence in text:
            found[text.index(sentence)] = (sentence, sentence)
        elif len(text) >= MIN_PIECE and text in sentence:
            found[0] = (text, sentence)
        else:
            head = next((n for n in range(len(sentence) - 1, MIN_PIECE - 1, -1) if text.endswith(sentence[:n])), 0)
            if head:
                found[len(text) - head] = (sentence[:head], sentence)
            tail = next((n for n in range(len(sentence) - 1, MIN_PIECE - 1, -1) if text.startswith(sentence[-n:])), 0)
            if tail:
                found[0] = (sentence[-tail:], sentence)
    return [found[k] for k in sorted(found)]


def extend(memory: str, additions: Iterable[tuple[str, str]]) -> str:
    """``memory`` with each new (piece, sentence) of :func:`pieces` added: straight after the part of its
    sentence that the memory ends with (the halves of a cut sentence meet), else after a space.

    >>> extend("Ann was bo", [("rn in 1990.", "Ann was born in 1990."), ("Bob is tall.", "Bob is tall.")])
    'Ann was born in 1990. Bob is tall.'
    """
    for piece, sentence in additions:
        if piece in memory:
            continue
        before = sentence[: sentence.find(piece)]
        memory = memory + piece if before and memory.endswith(before) else " ".join(filter(None, [memory, piece]))
    return memory


def covers(memory: str, sentences: Iterable[str]) -> bool:
    """Whether ``memory`` holds (at least :data:`COVERAGE` of the words of) every supporting sentence.

    >>> covers("Ann was born in 1990. Eve lived", ["Ann was born in 1990.", "Eve lived in Paris."])
    False
    >>> covers("Ann was born in 1990. Eve lived in Paris", ["Ann was born in 1990.", "Eve lived in Paris."])
    True
    """
    held = set(_WORD.findall(memory.lower()))
    for sentence in sentences:
        words = _WORD.findall(sentence.lower())
        if words and sum(w in held for w in words) < COVERAGE * len(words):
            return False
    return True


class MemAgentExpert:
    """The scripted MemAgent policy, with verl's ``generate``. ``rows`` are the train rows' ``extra_info``
    (question, answers, supporting_facts); it finds each prompt's row by its question."""

    def __init__(
        self, tokenizer: Any, rows: Iterable[Mapping[str, Any]], max_memory_tokens: int, max_final_tokens: int
    ):
        self.tokenizer = tokenizer
        self.max_memory_tokens = max_memory_tokens
        self.max_final_tokens = max_final_tokens
        self.rows: dict[str, Mapping[str, Any]] = {}
        for row in rows:
            if not row.get("supporting_facts"):
                raise ValueError(
                    f"row {row.get('index')!r} (id {row.get('id')!r}): extra_info.supporting_facts is empty; "
                    "rebuild the rows with `memupdate preprocess hotpotqa`"
                )
            self.rows.setdefault(row["question"], row)
        #: The last memory written for each question (one episode each): what :func:`covers` judges.
        self.memories: dict[str, str] = {}

    def reply(self, prompt: str) -> tuple[str, int]:
        """The reply to one turn's ``prompt`` and its token cap."""
        problem = _FIELD["problem"].search(prompt)
        row = problem and self.rows.get(problem.group(1))
        if row is None:
            raise ValueError(f"the expert has no row for the question {problem and problem.group(1)!r}")
        section = _FIELD["section"].search(prompt)
        if section is None:
            return f"\\boxed{{{row['answers'][0]}}}", self.max_final_tokens
        memory = _FIELD["memory"].search(prompt).group(1).strip()
        memory = "" if memory in (NO_MEMORY, NOTHING_YET) else memory
        self.memories[row["question"]] = (
            extend(memory, pieces(section.group(1), row["supporting_facts"])) or NOTHING_YET
        )
        return self.memories[row["question"]], self.max_memory_tokens

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kwargs: Any
    ) -> TokenOutput:
        text, cap = self.reply(self.tokenizer.decode(prompt_ids, skip_special_tokens=True))
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        if len(ids) > cap:
            raise ValueError(
                f"the expert's reply has {len(ids)} tokens, over the loop's cap of {cap} (max_memory_tokens / "
                f"max_final_tokens): a policy capped there could never write it; raise the cap. The reply: "
                f"{text[:200]!r}"
            )
        return TokenOutput(token_ids=ids, log_probs=None, stop_reason="completed")
