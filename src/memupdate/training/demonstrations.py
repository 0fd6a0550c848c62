"""Demonstration episodes for the cold start: a scripted expert plays the memory agent, through the real
agent loop and tools, on the *train* conversations.

An untrained small model never calls a tool, so every GRPO reward is 0 and nothing is learnt. The field's
answer is a short supervised cold start on demonstrations in the exact format RL samples; here they are
made by :class:`MemoryExpert`, a scripted policy with one privileged input: LoCoMo's evidence ids (which
dialogue turns answer a question) and the seed memories that cite them. Its program, per question, is the
edit that pays where memory can help (``reward-headroom.md``: promoted in place, +0.458 under
``evidence_recall`` on the questions with headroom) and stopping everywhere else:

1. ``search_memory`` with the question as the query, wider than the reader reads (``top_k`` from the
   experiment's ``sft.search_top_k``; the reader reads the reward's ``top_k`` within ``context_chars``);
2. where a memory shown below the reader's context cites gold evidence the context lacks
   (:func:`memupdate.data.headroom.missing_evidence_rank`, the one definition of headroom), ``manage_memory``
   updates the first such memory in place with the question's key words in front of its text (its
   ``keywords`` argument, :func:`~memupdate.data.headroom.key_words`): the text, date and evidence are kept, and the key words bring it
   into the question's search above the memories the reader reads now. The call names the words only, so a
   policy learns a short reply instead of copying a memory's text (a 135M cold start copying it wrote broken
   JSON or other text: 1 update in 160 held-out episodes);
3. reply ``DONE`` (the system prompt's way to stop), straight after the search where nothing is missing.

It never writes the gold answer into memory and names only ids the search showed, but *whether* and *which*
memory it promotes it decides by evidence ids the policy never sees. What the policy can learn is the
program's shape and a good part of the choice: the result sharing the question's words is the evidence
memory far more often than a random one. The expert reads its transcript as a policy does (the question from
the prompt, the ids from the search result) and is served to verl's ``AgentLoopWorker`` like any model
(verl's ``generate``), so the episodes' token ids, response masks (tool outputs and prompts masked) and
rewards are exactly those of a GRPO rollout.

An episode that edits is trained on only if it raises the training reward and lowers no other offline
scorer's (:func:`keep_episode`): each scorer sees one side of what the reader is shown (``answer_recall`` the
text, ``evidence_recall`` the provenance). An episode that stops without an edit teaches when not to edit (its
store is the one it started from, so every scorer gives it exactly 0; an ingestion episode, against the
``append`` baseline); :func:`balance_edits` keeps as many of those as kept edits, and more while the
demonstrations are fewer than ``sft.min_rows`` (the tool format needs that many).
"""

from __future__ import annotations

import json
import logging
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from verl.workers.rollout.replica import TokenOutput

from memupdate.data.headroom import key_words, missing_evidence_rank
from memupdate.names import MANAGE_TOOL, MERGE_TOOL, SEARCH_TOOL
from memupdate.rollout.episodes import COMPONENTS
from memupdate.utils.io import read_parquet_columns

logger = logging.getLogger(__name__)

#: Most memories one merge takes (the tool's limit).
MAX_MERGE = 5
#: The expert's last reply; the system prompt tells the model to stop with it.
DONE = "DONE"

_SPEAKERS = re.compile(r"a conversation between (.+?) and (.+?), from ")
_QUESTION = re.compile(r"Target question: (.+?)\n\nImprove the memory database")
_SHOWN = re.compile(r"^\[(\d+)\]", re.MULTILINE)


@dataclass(frozen=True)
class Memory:
    content: str
    evidence: frozenset[str]
    #: The session's date and time as LoCoMo gives it ("1:56 pm on 8 May, 2023"), or None.
    date: str | None = None

    def dated(self) -> str:
        """The text with its day in front, unless the text already names it.

        >>> Memory("Ann moved to Oslo.", frozenset(), "1:56 pm on 8 May, 2023").dated()
        '8 May, 2023: Ann moved to Oslo.'
        """
        day = self.date.rsplit(" on ", 1)[-1] if self.date else None
        return self.content if not day or day in self.content else f"{day}: {self.content}"


def tool_call(name: str, arguments: Mapping[str, Any]) -> str:
    """A reply with one tool call, in the hermes format the loop parses (``multi_turn.format: hermes``).

    >>> tool_call("search_memory", {"query": "Where?"})
    '<tool_call>\\n{"name": "search_memory", "arguments": {"query": "Where?"}}\\n</tool_call>'
    """
    return (
        "<tool_call>\n"
        + json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
        + "\n</tool_call>"
    )


def edit_plan(
    shown: Iterable[int], evidence: Iterable[str], memories: Mapping[int, Memory], max_chars: int
) -> tuple[str, dict[str, Any]] | None:
    """The ingestion expert's edit (:mod:`memupdate.training.ingestion_expert`), as a tool name and its
    arguments, or None: the memories among ``shown`` that cite the ``evidence`` (in the order shown, as many
    as fit in ``max_chars`` once dated and joined) merged, each text after its date unless they share one
    (the merged memory then keeps it as its date); None when fewer than two are found. A single memory is
    never rewritten: its date metadata, which the reader is shown, already dates it.

    >>> mems = {1: Memory("Ann moved to Oslo.", frozenset({"D1:2"}), "8 May, 2023"),
    ...         2: Memory("Ann loves tea.", frozenset()), 3: Memory("Bo came too.", frozenset({"D1:3"}))}
    >>> edit_plan([2, 3, 1], ["D1:2", "D1:3"], mems, 300)
    ('merge_memory', {'memory_ids': [3, 1], 'content': 'Bo came too. 8 May, 2023: Ann moved to Oslo.'})
    >>> edit_plan([2, 1], ["D1:2"], mems, 300) is None  # one memory: left as it is, undated text and all
    True
    >>> edit_plan([2, 3, 1], ["D1:2", "D1:3"], mems, 30) is None  # only one fits in 30 characters
    True
    >>> same_day = {**mems, 3: Memory("Bo came too.", frozenset({"D1:3"}), "8 May, 2023")}
    >>> edit_plan([3, 1], ["D1:2", "D1:3"], same_day, 300)[1]["content"]
    'Bo came too. Ann moved to Oslo.'
    """
    wanted = set(evidence)
    ids, texts = [], []
    for memory_id in dict.fromkeys(shown):
        memory = memories.get(memory_id)
        if memory is None or not memory.evidence & wanted or len(ids) == MAX_MERGE:
            continue
        if len(" ".join([*texts, memory.dated()])) > max_chars:
            continue
        ids.append(memory_id)
        texts.append(memory.dated())
    if len(ids) < 2:
        return None
    if len({memories[i].date for i in ids}) == 1:
        # One day for all: the merged memory keeps it as its date, which the reader is shown.
        texts = [memories[i].content for i in ids]
    return MERGE_TOOL, {"memory_ids": ids, "content": " ".join(texts)}


def read_memories(path: str) -> dict[str, dict[int, Memory]]:
    """The seed memories of the memories table (``preprocess_locomo``'s), per conversation and id."""
    table = read_parquet_columns(
        path, dict.fromkeys(["sample_id", "memory_id", "content", "evidence", "date"]), "a memories table"
    ).to_pylist()
    out: dict[str, dict[int, Memory]] = defaultdict(dict)
    for row in table:
        memory = Memory(row["content"], frozenset(row["evidence"] or ()), row["date"])
        out[row["sample_id"]][int(row["memory_id"])] = memory
    return dict(out)


class ScriptedExpert:
    """A scripted player of the memory tools, served to verl's ``AgentLoopWorker`` as a model: :meth:`generate`
    replies with :meth:`reply` of the episode's transcript so far, refused when it exceeds the policy's reply
    cap (``max_new_tokens``). It knows the seed memories (``memories_path``), searches with ``search_top_k``
    and writes at most ``max_content_chars``; it counts the tokens it generates, as local training's
    generation server does (its ``seconds`` stay 0: its replies cost nothing)."""

    def __init__(
        self, tokenizer: Any, memories_path: str, *, max_content_chars: int, max_new_tokens: int, search_top_k: int
    ):
        self.tokenizer = tokenizer
        self.memories = read_memories(memories_path)
        self.max_content_chars = max_content_chars
        self.max_new_tokens = max_new_tokens
        self.search_top_k = search_top_k
        #: What the expert did per episode (request id -> actions), for the demonstrations' record.
        self.actions: dict[str, list[str]] = defaultdict(list)
        self.generated_tokens = 0
        self.seconds = 0.0

    def reply(self, request_id: str, transcript: str) -> str:
        raise NotImplementedError

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kwargs: Any
    ) -> TokenOutput:
        transcript = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        text = self.reply(request_id, transcript)
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        if len(ids) > self.max_new_tokens:
            raise ValueError(
                f"the expert's reply has {len(ids)} tokens, over the episode's max_new_tokens ({self.max_new_tokens}): "
                f"a policy capped there could never make this call; raise max_new_tokens. The reply: {text[:200]!r}"
            )
        self.generated_tokens += len(ids)
        return TokenOutput(token_ids=ids, log_probs=None, stop_reason="completed")


class MemoryExpert(ScriptedExpert):
    """The scripted expert, with verl's ``generate``. It finds its question in the prompt (speakers and
    question, as the row's user message states them), so one expert serves a whole batch of rows;
    ``rows`` are the rows' ``extra_info`` with the row's speakers (:func:`expert_rows`). The reader it helps
    reads the top ``top_k`` memories within ``context_chars`` (the reward's settings)."""

    def __init__(
        self,
        tokenizer: Any,
        rows: Iterable[Mapping[str, Any]],
        memories_path: str,
        max_content_chars: int,
        max_new_tokens: int,
        search_top_k: int,
        *,
        top_k: int,
        context_chars: int,
    ):
        super().__init__(
            tokenizer,
            memories_path,
            max_content_chars=max_content_chars,
            max_new_tokens=max_new_tokens,
            search_top_k=search_top_k,
        )
        self.top_k = top_k
        self.context_chars = context_chars
        self.rows: dict[tuple[str, str, str], Mapping[str, Any]] = {}
        for row in rows:
            self.rows.setdefault((row["speaker_a"], row["speaker_b"], row["question"]), row)

    def reply(self, request_id: str, transcript: str) -> str:
        """The next reply of episode ``request_id`` given everything it has seen (``transcript``)."""
        actions = self.actions[request_id]
        row = self._row(transcript)
        if not actions:
            reply = tool_call(SEARCH_TOOL, {"query": row["question"], "top_k": self.search_top_k})
            actions.append(SEARCH_TOOL)
        elif actions[-1] == SEARCH_TOOL:
            # The ids shown by the search, in rank order: the text after the last call (the tool's response).
            shown = [int(i) for i in _SHOWN.findall(transcript.rsplit("</tool_call>", 1)[-1])]
            plan = self.promotion(row, shown)
            reply = DONE if plan is None else tool_call(*plan)
            actions.append(DONE if plan is None else plan[0])
        else:
            reply = DONE
            actions.append(DONE)
        return reply

    def promotion(self, row: Mapping[str, Any], shown: list[int]) -> tuple[str, dict[str, Any]] | None:
        """The edit for ``row`` after a search that showed ``shown``: the update promoting the first memory
        shown below the reader's context that cites evidence the context lacks (module docstring), or None."""
        memories = self.memories.get(row["sample_id"], {})
        ranked = [memories[i] for i in shown if i in memories]
        if len(ranked) != len(shown):
            raise ValueError(f"the search showed ids {shown}, not all seed memories of {row['sample_id']!r}")
        position = missing_evidence_rank(ranked, row["evidence"], self.top_k, self.context_chars)
        if position is None:
            return None
        keywords = key_words(row["question"], ranked[position].content, self.max_content_chars)
        if keywords is None:
            return None
        return MANAGE_TOOL, {"operation": "update", "memory_id": shown[position], "keywords": keywords}

    def _row(self, transcript: str) -> Mapping[str, Any]:
        speakers, question = _SPEAKERS.search(transcript), _QUESTION.search(transcript)
        key = speakers and question and (speakers.group(1), speakers.group(2), question.group(1))
        if not key or key not in self.rows:
            raise ValueError(f"the expert has no row for this prompt (speakers and question {key!r})")
        return self.rows[key]


def expert_rows(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The expert's view of training rows (verl's layout: ``prompt``, ``extra_info``): what it may know of
    each (question, evidence, conversation) keyed as its prompt shows them."""
    out = []
    for row in rows:
        user = next(m["content"] for m in row["prompt"] if m["role"] == "user")
        speakers = _SPEAKERS.search(user)
        if speakers is None:
            raise ValueError(f"row {row['extra_info'].get('namespace')!r}: its user message names no speakers")
        info = row["extra_info"]
        out.append(
            {
                "speaker_a": speakers.group(1),
                "speaker_b": speakers.group(2),
                "question": info["question"],
                "evidence": list(info["evidence"] or ()),
                "sample_id": info["sample_id"],
            }
        )
    return out


def keep_episode(rewards: Mapping[str, float], edited: bool, trained: str) -> bool:
    """Whether an episode is trained on, from its reward under each offline scorer (``rewards``), whether it
    ``edited`` the store (:func:`edits`) and the scorer training rewards with (``trained``): an edit only if it
    raised the training reward and lowered no other (module docstring); an episode without an edit always, for
    :func:`balance_edits` to weigh against the kept edits.

    >>> both = {"answer_recall": 0.0, "evidence_recall": 0.25}
    >>> keep_episode(both, True, "evidence_recall"), keep_episode(both, True, "answer_recall")
    (True, False)
    >>> keep_episode({**both, "answer_recall": -0.1}, True, "evidence_recall")
    False
    >>> keep_episode({"answer_recall": 0.0, "evidence_recall": 0.0}, False, "evidence_recall")
    True
    """
    if trained not in rewards:
        raise ValueError(f"no reward under the training scorer {trained!r} (have {sorted(rewards)})")
    return not edited or (rewards[trained] > 0 and all(reward >= 0 for reward in rewards.values()))


def edits(record: Mapping[str, Any]) -> bool:
    """Whether an episode's record (:func:`memupdate.rollout.episodes.episode_records`) shows an edit: any of
    the reward's operation counts (``ops_created``, ``ops_merged``, ...) above 0.

    >>> edits({"ops_created": 0.0, "ops_merged": 1.0}), edits({"ops_created": 0.0})
    (True, False)
    """
    return any(record.get(key, 0) > 0 for key in COMPONENTS if key.startswith("ops_"))


def balance_edits(records: list[dict[str, Any]], min_rows: int) -> list[dict[str, Any]]:
    """Keep as many kept episodes that edit nothing (stops) as kept episodes that edit, the first in row order,
    and more stops while the kept rows are fewer than ``min_rows``. Most episodes end without an edit (nothing
    to merge, or the search did not show it); kept all, they would teach the policy to stop without editing.
    But every row teaches the tool format (a search, read, and a stop or an edit), which is what an untrained
    model lacks, and a cold start of a few rows teaches nothing: ``cpu_demo``'s 62 stops made 99-100% of the
    cold-start policy's calls well-formed. The rule has no cliff: with no kept edit, ``min_rows`` stops; with
    one, the edit and ``min_rows - 1`` stops; with ``min_rows / 2`` or more, as many stops as edits. The others
    are marked ``kept: False``, ``balanced_out: True``, in place; returns ``records``.

    >>> def rs():
    ...     return [{"kept": True, "ops_merged": 0}, {"kept": True, "ops_merged": 1}, {"kept": True, "ops_merged": 0}]
    >>> [r["kept"] for r in balance_edits(rs(), min_rows=2)]
    [True, True, False]
    >>> [r["kept"] for r in balance_edits(rs(), min_rows=3)]
    [True, True, True]
    >>> [r["kept"] for r in balance_edits([{"kept": True, "ops_merged": 0}, {"kept": False, "ops_merged": 1}], 1)]
    [True, False]
    """
    kept_edits = sum(r["kept"] and edits(r) for r in records)
    room = max(kept_edits, min_rows - kept_edits)
    if kept_edits == 0:
        logger.warning(
            "no edit raised the training reward without lowering another scorer's: the cold start keeps up to %d "
            "episodes that search and stop, and teaches the tool format only",
            room,
        )
    for record in records:
        if record["kept"] and not edits(record):
            if room == 0:
                record.update(kept=False, balanced_out=True)
            else:
                room -= 1
    return records
