"""LoCoMo as a MemAgent haystack: a conversation read chunk by chunk, its questions answered from the memory.

The long-context variant of MemAgent on LoCoMo (issue 57): the offline HotpotQA file has 100 questions, too few to
tell a few points of exact match from noise, while LoCoMo's ten conversations hold 1,540 questions of categories 1-4.
Its rows have the columns of RULER-HotpotQA's (:data:`memupdate.data.hotpotqa.ROW_SCHEMA`), so the same loop,
expert, reward and evaluation run on them; their ``data_source`` is :data:`DATA_SOURCE` and the report names the
haystack, so its numbers are never mixed with RULER-HotpotQA's.

- **A document** is a window of ``turns_per_window`` consecutive turns of one session, titled with the session and
  its date (``Session 3, 1:56 pm on 8 May, 2023``), one turn a line (:func:`memupdate.data.locomo.turn_line`).
- **A haystack** holds the windows with the question's evidence turns (gold) and windows of the same conversation
  drawn at random (distractors about the same people and topics), ``num_docs`` in all, **in the conversation's
  order**: sessions are dated and told in order, and shuffling them (as RULER shuffles Wikipedia paragraphs) would
  scramble the time the questions ask about.
- **Questions**: categories 1-4 (category 5 is adversarial: no answer) whose gold answer, normalised as the reward
  normalises it (:func:`memupdate.metrics.normalize_squad`), appears in the text of its evidence turns: the reward is
  exact match of the boxed answer, as MemAgent's, and a HotpotQA answer is a span of its supporting facts; an answer
  LoCoMo's annotators computed ("the week before 9 June 2023") or paraphrased could not be earned by reading. A
  question that names its answer ("... a beach or mountains?") is dropped too: a guess between the options would earn
  it unread. The summary counts what each filter dropped, by category.
- **Supporting facts** (the expert's privileged input, never shown to the policy) are the evidence turns' lines.
- **Held out by conversation**: train rows come from the LoCoMo split's train conversations, test rows from its test
  conversations (``data.locomo.split``), so no test conversation is read in training.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from memupdate.data.fetch import verify_copy
from memupdate.data.hotpotqa import (
    APPROX_TOKENIZER,
    REWARD_STYLE,
    ROW_SCHEMA,
    approx_token_count,
    load_token_counter,
    question_rng,
    render_context,
    render_document,
    spread,
)
from memupdate.data.locomo import CATEGORY_NAMES, LocomoConversation, LocomoQA, load_locomo, resolve_split, turn_line
from memupdate.metrics import normalize_squad
from memupdate.names import MEMAGENT_AGENT
from memupdate.utils.io import atomic_outputs, sha256_file, write_json_atomic, write_parquet_atomic

logger = logging.getLogger(__name__)

DATA_SOURCE = "locomo_haystack"
#: Categories with a gold answer (5, adversarial, has none).
ANSWERED_CATEGORIES = (1, 2, 3, 4)
#: The split parts rows are built for: trained on, and held out.
PARTS = ("train", "test")


@dataclass(frozen=True)
class Window:
    """``turns_per_window`` consecutive turns of one session: one document of a haystack."""

    position: int
    title: str
    lines: tuple[str, ...]
    dia_ids: tuple[str, ...]

    @property
    def document(self) -> str:
        return render_document(self.title, "\n".join(self.lines))


@dataclass(frozen=True)
class HaystackQuestion:
    """A question kept for the haystack: its gold windows and the lines of its evidence turns."""

    id: str
    qa: LocomoQA
    gold: tuple[int, ...]
    supporting_facts: tuple[str, ...]


def windows(conv: LocomoConversation, turns_per_window: int) -> list[Window]:
    """The conversation cut into windows of ``turns_per_window`` turns, session by session, in order."""
    if isinstance(turns_per_window, bool) or not isinstance(turns_per_window, int) or turns_per_window < 1:
        raise ValueError(f"turns_per_window must be a positive integer, got {turns_per_window!r}")
    out: list[Window] = []
    for session in conv.sessions:
        date = f", {session.date_time}" if session.date_time else ""
        for start in range(0, len(session.turns), turns_per_window):
            turns = session.turns[start : start + turns_per_window]
            out.append(
                Window(
                    position=len(out),
                    title=f"Session {session.index}{date}",
                    lines=tuple(turn_line(t) for t in turns),
                    dia_ids=tuple(t.dia_id for t in turns),
                )
            )
    return out


def _contains(text: str, answer: str) -> bool:
    """Whether normalised ``answer`` is a run of whole words of normalised ``text``."""
    words = normalize_squad(answer)
    return bool(words) and f" {words} " in f" {normalize_squad(text)} "


def questions(conv: LocomoConversation, conv_windows: Sequence[Window], dropped: Counter) -> list[HaystackQuestion]:
    """The conversation's questions a reader can answer by exact match from its evidence turns; each question
    dropped is counted in ``dropped`` by ``(reason, category name)``."""
    where = {dia_id: w for w in conv_windows for dia_id in w.dia_ids}
    kept = []
    for qa in conv.qa:
        category = CATEGORY_NAMES.get(qa.category, str(qa.category))
        if qa.category not in ANSWERED_CATEGORIES or qa.answer is None:
            dropped["no answer (adversarial)", category] += 1
            continue
        evidence = [e for e in qa.evidence if e in where]
        if not evidence:
            dropped["no evidence turn", category] += 1
            continue
        lines = [where[e].lines[where[e].dia_ids.index(e)] for e in evidence]
        if not _contains("\n".join(lines), str(qa.answer)):
            dropped["answer not in its evidence turns", category] += 1
            continue
        if _contains(qa.question, str(qa.answer)):
            # "Does Evan live close to a beach or mountains?": picking one of the named options earns it unread.
            dropped["answer in the question", category] += 1
            continue
        gold = tuple(sorted({where[e].position for e in evidence}))
        kept.append(HaystackQuestion(f"{conv.sample_id}-qa{qa.qa_index}", qa, gold, tuple(lines)))
    return kept


def build_rows(
    conversations: Sequence[LocomoConversation],
    *,
    num_docs: int,
    turns_per_window: int,
    part: str,
    seed: int = 0,
    count_tokens: Callable[[str], int] | None = None,
) -> tuple[pa.Table, Counter]:
    """One MemAgent row per kept question of ``conversations`` (in verl's ``RLHFDataset`` layout), and the count
    of questions dropped by ``(reason, category)``. A question whose evidence spans more windows than
    ``num_docs`` is dropped too (its haystack could not hold it)."""
    if isinstance(num_docs, bool) or not isinstance(num_docs, int) or num_docs < 1:
        raise ValueError(f"num_docs must be a positive integer, got {num_docs!r}")
    count = count_tokens or approx_token_count
    rows: list[dict[str, Any]] = []
    dropped: Counter = Counter()
    for conv in conversations:
        conv_windows = windows(conv, turns_per_window)
        if num_docs > len(conv_windows):
            raise ValueError(
                f"num_docs={num_docs} is more than the {len(conv_windows)} windows of {turns_per_window} turns of "
                f"conversation {conv.sample_id}; lower num_docs or turns_per_window"
            )
        for question in questions(conv, conv_windows, dropped):
            qa = question.qa
            if len(question.gold) > num_docs:
                dropped[f"evidence in more than {num_docs} windows", CATEGORY_NAMES[qa.category]] += 1
                continue
            rng = question_rng(seed, question.id)
            others = [w.position for w in conv_windows if w.position not in question.gold]
            chosen = sorted([*question.gold, *rng.sample(others, num_docs - len(question.gold))])
            context = render_context([conv_windows[i].document for i in chosen])
            num_tokens = count(context)
            answer = str(qa.answer)
            rows.append(
                {
                    "data_source": DATA_SOURCE,
                    "agent_name": MEMAGENT_AGENT,
                    "prompt": [{"role": "user", "content": qa.question}],
                    "context": context,
                    "reward_model": {"style": REWARD_STYLE, "ground_truth": [answer]},
                    "extra_info": {
                        "index": len(rows),
                        "id": question.id,
                        "question": qa.question,
                        "answers": [answer],
                        "supporting_facts": list(question.supporting_facts),
                        "num_docs": num_docs,
                        "num_tokens": num_tokens,
                        "type": CATEGORY_NAMES[qa.category],
                        # HotpotQA's difficulty level; here the conversation the question is about.
                        "level": conv.sample_id,
                        "part": part,
                    },
                    "num_docs": num_docs,
                    "num_tokens": num_tokens,
                }
            )
    return pa.Table.from_pylist(rows, schema=ROW_SCHEMA), dropped


def preprocess_locomo_haystack(
    input_path: str | Path,
    outputs: dict[str, str | Path],
    summary_path: str | Path,
    *,
    split: dict[str, Sequence[str]],
    num_docs: int,
    turns_per_window: int,
    seed: int = 0,
    tokenizer: str | None = None,
    sha256: str | None = None,
) -> dict[str, Any]:
    """Rows of the split's train and test conversations (``outputs["train"]``, ``outputs["test"]``) and a JSON
    summary: counts kept and dropped by reason and category, token spreads, the arguments and the input's sha256.
    The files appear together or not at all. Returns the summary."""
    missing = [part for part in PARTS if part not in split]
    if missing:
        raise ValueError(f"the LoCoMo split has no {' or '.join(missing)} conversations (data.locomo.splits)")
    verify_copy(input_path, sha256)
    conversations = resolve_split(load_locomo(input_path), {part: split[part] for part in PARTS})
    count_tokens = load_token_counter(tokenizer) if tokenizer is not None else None
    summary: dict[str, Any] = {
        "input": str(input_path),
        "input_sha256": sha256_file(input_path),
        "arguments": {"num_docs": num_docs, "turns_per_window": turns_per_window, "seed": seed, "tokenizer": tokenizer},
        "token_counter": tokenizer if tokenizer is not None else APPROX_TOKENIZER,
        "parts": {},
    }
    with atomic_outputs({**outputs, "summary": summary_path}) as tmp:
        for part in PARTS:
            table, dropped = build_rows(
                conversations[part],
                num_docs=num_docs,
                turns_per_window=turns_per_window,
                part=part,
                seed=seed,
                count_tokens=count_tokens,
            )
            if not table.num_rows:
                raise ValueError(
                    f"{Path(input_path).name}: no {part} question of conversations {split[part]} has its answer in "
                    "its evidence turns"
                )
            write_parquet_atomic(tmp[part], table)
            info = table.column("extra_info").combine_chunks()
            summary["parts"][part] = {
                "conversations": list(split[part]),
                "rows": table.num_rows,
                "rows_by_type": dict(sorted(Counter(info.field("type").to_pylist()).items())),
                "dropped": [
                    {"reason": reason, "category": category, "questions": n}
                    for (reason, category), n in sorted(dropped.items())
                ],
                "num_tokens": spread(table.column("num_tokens").to_pylist()),
                "supporting_fact_tokens": spread(
                    [sum(approx_token_count(f) for f in facts) for facts in info.field("supporting_facts").to_pylist()]
                ),
            }
            logger.info(
                "%s: %d %s rows of %d documents, tokens mean %s (max %s)",
                Path(input_path).name,
                table.num_rows,
                part,
                num_docs,
                summary["parts"][part]["num_tokens"]["mean"],
                summary["parts"][part]["num_tokens"]["max"],
            )
        write_json_atomic(tmp["summary"], summary)
    return summary
