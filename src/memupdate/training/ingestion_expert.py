"""Demonstration episodes of question-agnostic ingestion for the cold start: a scripted expert fits a
session's new memories into the store, on the *train* conversations.

An untrained small model never calls a tool in an ingestion episode either, so GRPO has nothing to learn
from. The expert shows it one program and its tool format. Its one privileged input is LoCoMo's
evidence ids of the questions the session's reward is scored on (``extra_info.questions``, which no prompt
contains): they say which memories belong together, hence which new memory to search with and what to
merge. The policy never sees them, so it cannot learn every step from what it sees; what it can learn is
the format and the program's shape (search with a new memory, merge what belongs together, stop). Per
session:

1. for each question whose evidence lies partly in the new session and is cited by two or more memories
   (:func:`merge_targets`), ``search_memory`` with the text of the new memory that cites it, a query the
   policy has in its prompt;
2. the shown memories that cite that evidence are merged into one, each text after its date
   (:func:`memupdate.training.demonstrations.edit_plan`; a merged memory spanning sessions has no date of
   its own, so the texts carry them), as many as fit in two memories' share of the reward's retrieval
   budget (:func:`merge_chars`): the reader then finds what a question about several sessions needs in one
   memory, and the merged memory does not crowd others out of the budget (measured under the previous
   reward on our split's 156 train sessions: at the tool's 300 characters, 14 of the 32 merging episodes
   lowered answer_recall; at 200, 5 of 19);
3. ``DONE`` when no target is left or the episode's turns would run out.

A search that shows fewer than two of them is followed by the next target's search (a single memory is
not rewritten: the reader already sees its date). The expert writes nothing but the memories' own texts
and dates, shows the policy no question, and reads its transcript as the policy does (the session from the
prompt, the ids from the search result).

The demonstrations are kept as the question expert's are (:mod:`memupdate.training.demonstrations`): an
episode that merges only if it raises the reward under both offline scorers
(:func:`~memupdate.training.demonstrations.keep_episode`), and, as most sessions end without a merge
(nothing to merge, or the search did not show it), no more episodes without an edit than kept merges
(:func:`~memupdate.training.demonstrations.balance_edits`), so the cold start teaches both the edit and
when not to make one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from memupdate.data.locomo import evidence_session
from memupdate.names import MERGE_TOOL, SEARCH_TOOL
from memupdate.training.demonstrations import DONE, Memory, ScriptedExpert, edit_plan, tool_call

_SESSION = re.compile(r"Conversation between (.+?) and (.+?)\. Session (\d+) \(")
_NEW = re.compile(r"New memories from session \d+:\n(.*?)\n\nFit the new memories", re.DOTALL)
_SHOWN = re.compile(r"^\[(\d+)\]", re.MULTILINE)


def merge_targets(
    questions: Iterable[Mapping[str, Any]], session: int, new_ids: Sequence[int], memories: Mapping[int, Memory]
) -> list[tuple[int, frozenset[str]]]:
    """What the expert tries to merge in a session's episode: per question with evidence in ``session``
    whose evidence two or more of ``memories`` cite, the first of the session's new memories (``new_ids``)
    that cites it (the search query) and the evidence; each set of memories once, in question order.

    >>> mems = {1: Memory("Ann moved to Oslo.", frozenset({"D1:2"})), 7: Memory("Ann left Oslo.", frozenset({"D3:1"})),
    ...         8: Memory("Ann likes tea.", frozenset({"D3:2"}))}
    >>> qs = [{"evidence": ["D1:2", "D3:1"]}, {"evidence": ["D3:2"]}, {"evidence": ["D3:1", "D1:2"]}]
    >>> [(q, sorted(e)) for q, e in merge_targets(qs, 3, [7, 8], mems)]  # 2nd: one memory; 3rd: the 1st again
    [(7, ['D1:2', 'D3:1'])]
    >>> merge_targets([{"evidence": ["D1:2", "D2:5"]}], 3, [7, 8], mems)  # no evidence in session 3
    []
    """
    targets, seen = [], set()
    for question in questions:
        evidence = frozenset(question["evidence"])
        if not any(evidence_session(e) == session for e in evidence):
            continue
        citing = frozenset(i for i, m in memories.items() if m.evidence & evidence)
        query = next((i for i in new_ids if i in citing), None)
        if query is None or len(citing) < 2 or citing in seen:
            continue
        seen.add(citing)
        targets.append((query, evidence))
    return targets


def merge_chars(max_content_chars: int, top_k: int, context_chars: int) -> int:
    """The longest text the expert merges into: two memories' share of the retrieval budget
    (``context_chars`` over ``top_k`` results), within the tools' cap.

    >>> merge_chars(300, 5, 500)
    200
    """
    return min(max_content_chars, 2 * context_chars // top_k)


@dataclass
class _Episode:
    #: The seed memories of the session's conversation, by id.
    memories: Mapping[int, Memory]
    targets: list[tuple[int, frozenset[str]]]
    #: The current target's evidence while its search result is awaited.
    searching: frozenset[str] | None = None
    #: Memories merged away in this episode (a later target does not name them again).
    merged: set[int] = field(default_factory=set)
    replies: int = 0


class IngestionExpert(ScriptedExpert):
    """The scripted ingestion expert, with verl's ``generate``. It finds its session in the prompt
    (speakers and session number, as the row's user message states them), so one expert serves a batch of
    rows; ``rows`` are the rows in verl's layout (``prompt``, ``extra_info``). ``max_assistant_turns`` is the
    episode's turn limit; ``settings`` are :class:`~memupdate.training.demonstrations.ScriptedExpert`'s."""

    def __init__(
        self,
        tokenizer: Any,
        rows: Iterable[Mapping[str, Any]],
        memories_path: str,
        *,
        max_assistant_turns: int,
        **settings: Any,
    ):
        super().__init__(tokenizer, memories_path, **settings)
        self.max_assistant_turns = max_assistant_turns
        self.rows: dict[tuple[str, str, int], Mapping[str, Any]] = {}
        for row in rows:
            user = next(m["content"] for m in row["prompt"] if m["role"] == "user")
            key = _SESSION.search(user)
            if key is None:
                raise ValueError(f"row {row['extra_info'].get('namespace')!r}: its user message names no session")
            self.rows[(key.group(1), key.group(2), int(key.group(3)))] = row["extra_info"]
        self.episodes: dict[str, _Episode] = {}

    def reply(self, request_id: str, transcript: str) -> str:
        """The next reply of episode ``request_id`` given everything it has seen (``transcript``)."""
        episode = self.episodes.get(request_id) or self._start(request_id, transcript)
        memories = episode.memories
        reply, action = DONE, DONE
        if episode.searching is not None:
            shown = [int(i) for i in _SHOWN.findall(transcript.rsplit("</tool_call>", 1)[-1])]
            alive = {i: m for i, m in memories.items() if i not in episode.merged}
            plan = edit_plan(shown, episode.searching, alive, self.max_content_chars)
            episode.searching = None
            if plan is not None:
                episode.merged.update(plan[1]["memory_ids"])
                reply, action = tool_call(*plan), MERGE_TOOL
        # A search needs two more replies (its merge, then DONE); the last turn is kept for DONE.
        while action == DONE and episode.targets and episode.replies + 3 <= self.max_assistant_turns:
            query, evidence = episode.targets.pop(0)
            if query in episode.merged:
                continue
            episode.searching = evidence
            reply = tool_call(SEARCH_TOOL, {"query": memories[query].content, "top_k": self.search_top_k})
            action = SEARCH_TOOL
        episode.replies += 1
        self.actions[request_id].append(action)
        return reply

    def _start(self, request_id: str, transcript: str) -> _Episode:
        row = self._row(transcript)
        new = _NEW.search(transcript)
        new_ids = [int(i) for i in _SHOWN.findall(new.group(1))] if new else []
        memories = self.memories.get(row["sample_id"], {})
        episode = _Episode(memories, merge_targets(row["questions"], row["session"], new_ids, memories))
        self.episodes[request_id] = episode
        return episode

    def _row(self, transcript: str) -> Mapping[str, Any]:
        found = _SESSION.search(transcript)
        key = found and (found.group(1), found.group(2), int(found.group(3)))
        if not key or key not in self.rows:
            raise ValueError(f"the expert has no row for this prompt (speakers and session {key!r})")
        return self.rows[key]
