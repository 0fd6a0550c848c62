"""LoCoMo evaluation of (memory model, QA model) pairs on the held-out conversations.

Systems (one predictions file each, ``predictions/<system>.jsonl``):

- ``no_update``: the QA model answers from the top-k of the *initial* memories;
- a memory model + a QA model (``stage1+qa_base``, ``stage1+stage2``, one per training stage): the memory model edits the
  question's trial store with the tools (the training episode itself: verl's ``AgentLoopWorker`` runs the
  ``memupdate_agent`` loop against the served memory model, greedy), then the QA model answers from the
  top-k of the *final* store, through the very code that answers for ``no_update``: the same prompt,
  retrieval and decoding, nothing of the episode's transcript. A memory model that edits nothing
  therefore scores exactly as ``no_update`` does;
- ``full_context``: the QA model reads the whole conversation, when it fits its context; otherwise the
  system is recorded as skipped, with the token count that did not fit.

Every question is answered once per protocol (``protocols``): with LoCoMo's QA prompt (scored with the
official LoCoMo F1, categories 1-5) and with Mem0's ANSWER_PROMPT (Mem0's F1, BLEU-1 and J, categories
1-4), both verbatim (:mod:`memupdate.prompts`). Retrieval is the top-k memories within a fixed text
budget (``context_chars``), as the reward retrieves. Category 5 (adversarial, no gold answer) is asked
as the LoCoMo paper's two-way choice between "Not mentioned in the conversation" and the adversarial
answer, in a seeded order; the official LoCoMo F1 scores it 1 when the model abstains.

The setting is question-conditioned (MemoryUpdate's): the memory model sees the test question while it
edits that question's copy of the store. Mem0, Memory-R1 and the LoCoMo paper build memory without the
questions, so their published numbers are context, not a like-for-like comparison. An ingestion experiment's
memory systems are question-agnostic instead (``ingestion``): each test conversation's store is built session
by session, one episode per session that never sees a question, and every question is answered from the
final store; each prediction records its ``memory_setting``.

Predictions are appended to the JSONL file as each batch finishes; a rerun skips questions already
there (a torn last line from a killed run is dropped and redone). Scores are computed from the
predictions only (:mod:`memupdate.eval.report`), so the report can always be rebuilt from them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from memupdate.agents.fields import DELTA_KEY, STATS_KEY, TERMINATION_KEY
from memupdate.eval.report import MEM0_CATEGORIES, load_jsonl
from memupdate.memory.environment import MemoryEnvironment
from memupdate.memory.manager import manager_for
from memupdate.memory.store import MemoryRecord, TrialStore
from memupdate.prompts import (
    JUDGE_RESPONSE_FORMAT,
    judge_messages,
    judge_prompt_sha256,
    load_prompts,
    memory_line,
    parse_judge,
    qa_messages,
    within_budget,
)
from memupdate.rewards.memory import DEFAULT_CONTEXT_CHARS
from memupdate.serving.client import Endpoint, OpenAIClient
from memupdate.serving.decoding import GREEDY
from memupdate.serving.readiness import load_marker, read_marker, release_held
from memupdate.settings import (
    DEFAULT_EMBEDDING_MODEL,
    DEFAULT_MAX_CONTENT_CHARS,
    EpisodeSettings,
    LocomoEvalSettings,
    ToolSettings,
    build,
    experiment_stages,
    stage_sections,
)
from memupdate.tools.config import TOOL_CONFIG
from memupdate.utils.io import (
    invalidate_if_changed,
    model_fingerprint,
    portable_path,
    read_parquet_columns,
    sha256_file,
    weights_digest,
    write_json_atomic,
    write_text_atomic,
)

logger = logging.getLogger(__name__)

NOT_MENTIONED = "Not mentioned in the conversation"
CHOICE_PROMPT = "{question} Select the correct answer: (a) {first} (b) {second}."


@dataclass
class System:
    """A row of the report: its QA model's readiness marker and, unless it is ``no_update`` or
    ``full_context``, its memory model's marker."""

    name: str
    qa: str
    memory: str | None = None
    kind: str = "memory"  # memory | ingestion | no_update | full_context
    extra: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------- rows


def select_rows(test_file: str | Path, per_conversation: int | None, seed: int) -> list[dict[str, Any]]:
    """The test rows to evaluate: every row, or ``per_conversation`` per conversation drawn with ``seed``
    (always the same questions for the same seed, whatever else changes)."""
    rows = read_parquet_columns(
        test_file, {"prompt": None, "extra_info": None}, "a table of LoCoMo rows", only=False
    ).to_pylist()
    if per_conversation is None:
        return rows
    by_conversation: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_conversation.setdefault(row["extra_info"]["sample_id"], []).append(row)
    chosen = []
    for sample_id in sorted(by_conversation):
        group = by_conversation[sample_id]
        rng = random.Random(f"{seed}:{sample_id}")
        picked = rng.sample(range(len(group)), min(per_conversation, len(group)))
        chosen += [group[i] for i in sorted(picked)]
    return chosen


def choice_options(info: Mapping[str, Any], seed: int) -> dict[str, str]:
    """The two options of a category-5 question, ``{"a": ..., "b": ...}``, in an order drawn per question.

    >>> sorted(choice_options({"adversarial_answer": "Bo", "namespace": "n"}, 0).values())
    ['Bo', 'Not mentioned in the conversation']
    """
    options = [NOT_MENTIONED, str(info.get("adversarial_answer") or "")]
    random.Random(f"{seed}:{info['namespace']}").shuffle(options)
    return {"a": options[0], "b": options[1]}


def choice_question(info: Mapping[str, Any], seed: int) -> str:
    """Category 5 as the LoCoMo paper asks it: a two-way choice (:func:`choice_options`).

    >>> q = choice_question({"question": "Who?", "adversarial_answer": "Bo", "namespace": "n"}, 0)
    >>> q.startswith("Who? Select the correct answer: (a)") and "Bo" in q and "Not mentioned" in q
    True
    """
    options = choice_options(info, seed)
    return CHOICE_PROMPT.format(question=info["question"], first=options["a"], second=options["b"])


def asked_question(info: Mapping[str, Any], seed: int) -> str:
    return choice_question(info, seed) if int(info["category"]) == 5 else str(info["question"])


def ask_rows(rows: Sequence[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    """Rows whose prompt asks the question as evaluation asks it (category 5: the two-way choice), so the
    memory model edits for the question the QA model will get. ``extra_info`` keeps the dataset's question
    (retrieval and the protocols' prompts start from it) and gains ``choices`` for category 5."""
    asked = []
    for row in rows:
        info = dict(row["extra_info"])
        question = asked_question(info, seed)
        prompt = [
            {**m, "content": m["content"].replace(info["question"], question)} if m["role"] == "user" else m
            for m in row["prompt"]
        ]
        if int(info["category"]) == 5:
            info["choices"] = choice_options(info, seed)
        asked.append({**row, "prompt": prompt, "extra_info": info})
    return asked


# ------------------------------------------------------------------------------------ predictions


def read_predictions(path: str | Path) -> dict[str, dict[str, Any]]:
    """Saved predictions by namespace; a torn last line (a killed run) is dropped and logged."""
    path = Path(path)
    found: dict[str, dict[str, Any]] = {}
    if not path.is_file():
        return found
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                logger.warning("%s: dropping a torn last line (interrupted run); it is redone", path)
                continue
            raise ValueError(f"{path}:{number} is not valid JSON; delete the file to redo this system") from None
        found[record["namespace"]] = record
    if lines and not path.read_text(encoding="utf-8").endswith("\n"):
        # Rewrite without the torn line, so appends start on a line of their own.
        path.write_text("".join(json.dumps(r) + "\n" for r in found.values()), encoding="utf-8")
    return found


def _append(path: Path, records: Sequence[Mapping[str, Any]]) -> None:
    with path.open("a", encoding="utf-8") as fh:
        for record in records:
            fh.write(json.dumps(record) + "\n")
        fh.flush()


def _base_record(row: Mapping[str, Any], system: str, seed: int) -> dict[str, Any]:
    """What every prediction records about its question (``row`` is an asked row, :func:`ask_rows`);
    a category-5 record keeps the two options, so a bare "a"/"b" reply can be scored."""
    info = row["extra_info"]
    record = {
        "system": system,
        "namespace": info["namespace"],
        "sample_id": info["sample_id"],
        "category": int(info["category"]),
        "question": info["question"],
        "answer": info.get("answer"),
        "adversarial_answer": info.get("adversarial_answer"),
        "evidence": list(info.get("evidence") or []),
    }
    if record["category"] == 5:
        record["choices"] = choice_options(info, seed)
    return record


# ----------------------------------------------------------------------------------- evaluation


class LocomoEvaluator:
    def __init__(
        self,
        *,
        test_file: str,
        memory: MemoryEnvironment,
        tool_config: str | Path,
        conversations: str | None,
        out_dir: str,
        settings: LocomoEvalSettings,
        episode: EpisodeSettings | None = None,
    ):
        # Absolute paths, as the run's memory-environment file has them: the memory tools' manager is then this
        # evaluator's own (memupdate.memory.manager.manager_for), which question-agnostic ingestion relies on.
        memory = replace(
            memory, memories=os.path.abspath(memory.memories), embeddings=os.path.abspath(memory.embeddings)
        )
        self.test_file, self.memory, self.tool_config = test_file, memory, str(tool_config)
        self.conversations = conversations
        self.out_dir = Path(out_dir)
        # Unset, evaluation retrieves within the reward's budget (the rule passes reward.context_chars).
        self.settings = settings if settings.context_chars else replace(settings, context_chars=DEFAULT_CONTEXT_CHARS)
        # The memory model's episodes are the experiment's, as it was trained on them (greedy here).
        self.episode = episode or EpisodeSettings()
        self.rows = ask_rows(select_rows(test_file, settings.questions_per_conversation, settings.seed), settings.seed)
        self.manager = manager_for(memory)
        self._tokenizers: dict[str, Any] = {}
        self._digests: dict[Path, str | None] = {}

    def tokenizer(self, marker: str):
        from transformers import AutoTokenizer

        path = load_marker(marker).get("model_path")
        if path not in self._tokenizers:
            self._tokenizers[path] = AutoTokenizer.from_pretrained(path)
        return self._tokenizers[path]

    async def retrieve(self, sample_id: str, question: str, delta: Mapping[str, Any] | None) -> list[MemoryRecord]:
        """The memories the QA model reads: the top-k of the initial store, or of initial + ``delta`` (the
        final store of an episode), within the text budget (:func:`memupdate.prompts.within_budget`)."""
        base = self.manager.base(sample_id)
        texts = TrialStore.delta_texts(base, delta) if delta else []
        # One batched encode for the question and the episode's new memory texts.
        vectors = await self.manager.embedder.aencode([question, *texts])
        store = TrialStore.from_delta_vectors(base, delta, list(vectors[1:])) if delta else TrialStore(base)
        hits = store.search(vectors[0], self.settings.top_k)
        return within_budget([h.record for h in hits], self.settings.context_chars)

    def _retrieval_fields(self, record: dict[str, Any], memories: Sequence[MemoryRecord]) -> dict[str, Any]:
        found = {e for m in memories for e in m.evidence}
        gold = set(record["evidence"])
        return {
            "retrieved_ids": [m.id for m in memories],
            "retrieved_evidence": sorted(found),
            "evidence_recall": len(gold & found) / len(gold) if gold else None,
            "context_chars": sum(len(memory_line(m)) for m in memories),
        }

    def _protocols(self, record: Mapping[str, Any]) -> list[str]:
        """The protocols that ask this question: Mem0's leaves out category 5."""
        return [p for p in self.settings.protocols if p != "mem0" or record["category"] in MEM0_CATEGORIES]

    async def answer(
        self,
        client: OpenAIClient,
        tokenizer: Any,
        record: dict[str, Any],
        memories: Sequence[Any] = (),
        conversation: str | None = None,
        limit: int | None = None,
    ) -> None:
        """The QA model's answers to ``record``'s question from ``memories`` (or the whole ``conversation``),
        one per protocol, greedy: ``predictions``, ``context_tokens`` (the prompt the QA model saw, chat
        template included) and ``latency_s``. Every system answers through this one method. A prompt over
        ``limit`` tokens is not sent: its prediction is None and ``skipped`` says why."""
        asked = self._protocols(record)
        if conversation is not None:
            # The whole conversation in LoCoMo's own prompt; Mem0's answers from memories only.
            asked = [p for p in asked if p == "locomo"]
            prompts = {}
            for p in asked:
                layout = load_prompts(p)
                content = layout.render_context(
                    conversation, record["question"], record["category"], record.get("choices")
                )
                prompts[p] = [{"role": layout.message_role, "content": content}]
        else:
            prompts = {
                p: qa_messages(p, record["question"], record["category"], memories, record.get("choices"))
                for p in asked
            }
        tokens = {p: _chat_tokens(tokenizer, prompt) for p, prompt in prompts.items()}
        over = {p: n for p, n in tokens.items() if limit is not None and n > limit}
        began = time.perf_counter()

        async def one(protocol: str) -> str | None:
            if protocol in over:
                return None
            reply = await client.chat(prompts[protocol], **GREEDY.request(self.settings.qa_max_tokens))
            return reply.strip()

        answers = await asyncio.gather(*(one(p) for p in asked))
        record.update(predictions=dict(zip(asked, answers, strict=True)), context_tokens=tokens)
        record["latency_s"] = record.get("latency_s", 0.0) + time.perf_counter() - began
        if over:
            record["skipped"] = "; ".join(
                f"{p}: {n} prompt tokens > {limit} the QA model can take" for p, n in over.items()
            )

    # ------------------------------------------------------------------ no update / full context

    async def run_no_update(self, system: System, todo: list[dict[str, Any]], path: Path, bar) -> None:
        endpoint = read_marker(system.qa, timeout_s=30.0)
        tokenizer = self.tokenizer(system.qa)
        async with OpenAIClient(endpoint) as client:
            for start in range(0, len(todo), self.settings.batch_size):
                chunk = todo[start : start + self.settings.batch_size]

                async def one(row):
                    record = _base_record(row, system.name, self.settings.seed)
                    memories = await self.retrieve(record["sample_id"], record["question"], None)
                    record.update(self._retrieval_fields(record, memories))
                    await self.answer(client, tokenizer, record, memories)
                    return record

                _append(path, await asyncio.gather(*(one(r) for r in chunk)))
                bar.update(len(chunk))

    async def run_full_context(self, system: System, todo: list[dict[str, Any]], path: Path, bar) -> None:
        from memupdate.data.locomo import load_locomo

        endpoint = read_marker(system.qa, timeout_s=30.0)
        tokenizer = self.tokenizer(system.qa)
        limit = _max_model_len(endpoint) - self.settings.qa_max_tokens
        samples = {c.sample_id: c for c in load_locomo(self.conversations)} if self.conversations else {}
        async with OpenAIClient(endpoint) as client:
            records = []
            for row in todo:
                record = _base_record(row, system.name, self.settings.seed)
                sample = samples.get(record["sample_id"])
                if sample is None:
                    raise ValueError(f"{self.conversations} has no conversation {record['sample_id']!r}")
                conversation = locomo_full_context(sample, load_prompts("locomo").text("conversation_start"))
                await self.answer(client, tokenizer, record, conversation=conversation, limit=limit)
                records.append(record)
                bar.update(1)
            _append(path, records)

    # ------------------------------------------------------------------ memory model + QA model

    async def run_memory_system(self, system: System, todo: list[dict[str, Any]], path: Path, bar) -> None:
        from verl import DataProto
        from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

        qa = read_marker(system.qa, timeout_s=30.0)
        s = self.settings
        run_dir = self.out_dir / "runs" / system.name
        run_dir.mkdir(parents=True, exist_ok=True)
        rows_file = run_dir / "rows.parquet"
        pq.write_table(pa.Table.from_pylist(todo), rows_file)
        # The memory episodes only: the QA model answers below, as it answers for no_update.
        config, worker = self._rollout_worker(system, run_dir, rows_file)
        dataset = RLHFDataset([str(rows_file)], worker.tokenizer, config.data)
        tokenizer = self.tokenizer(system.qa)
        async with OpenAIClient(qa) as client:
            for start in range(0, len(dataset), s.batch_size):
                index = list(range(start, min(start + s.batch_size, len(dataset))))
                batch = DataProto.from_single_dict(collate_fn([dataset[i] for i in index]))
                began = time.perf_counter()
                out = await worker.generate_sequences(batch)
                seconds = time.perf_counter() - began
                extra = out.non_tensor_batch
                timing = out.meta_info.get("metrics") or [{}] * len(index)

                episodes = []
                for j, i in enumerate(index):
                    episode = timing[j] if j < len(timing) else {}
                    record = _base_record(todo[i], system.name, s.seed)
                    record.update(
                        memory_setting="question-conditioned",
                        termination_reason=str(extra[TERMINATION_KEY][j]),
                        memory_stats=_plain(extra[STATS_KEY][j]),
                        # The episode's own time (its generations and tool calls), not the batch's; the
                        # answer's time is added by answer().
                        latency_s=float(episode.get("generate_sequences", 0.0) + episode.get("tool_calls", 0.0))
                        or seconds,
                    )
                    episodes.append((record, extra[DELTA_KEY][j]))

                async def one(record: dict[str, Any], delta: Mapping[str, Any] | None) -> dict[str, Any]:
                    memories = await self.retrieve(record["sample_id"], record["question"], delta)
                    record.update(self._retrieval_fields(record, memories))
                    await self.answer(client, tokenizer, record, memories)
                    return record

                _append(path, await asyncio.gather(*(one(r, d) for r, d in episodes)))
                bar.update(len(index))

    # ------------------------------------------------------------------ question-agnostic: ingestion, then QA

    def _rollout_worker(self, system: System, run_dir: Path, rows_file: Path):
        """The memory model's episodes, run by verl's ``AgentLoopWorker`` against its server, greedy."""
        from memupdate.agents.context import LoopContext
        from memupdate.rollout.config import RolloutConfig, run_config
        from memupdate.rollout.workers import in_process_workers
        from memupdate.serving.token_client import VLLMTokenClient

        s, episode = self.settings, self.episode
        cfg = RolloutConfig(
            model_path=load_marker(system.memory)["model_path"],
            train_files=[str(rows_file)],
            run_dir=str(run_dir),
            tool_config=self.tool_config,
            memory=self.memory,
            rollout_n=1,
            temperature=0.0,
            max_new_tokens=episode.max_new_tokens,
            prompt_length=episode.prompt_length,
            response_length=episode.response_length,
            max_assistant_turns=episode.max_assistant_turns,
            max_parallel_calls=episode.max_parallel_calls,
            max_tool_response_length=episode.max_tool_response_length,
            trained_role="memory",
            qa_phase=False,
            seed=s.seed,
        )
        config = run_config(cfg)
        client = VLLMTokenClient(read_marker(system.memory, timeout_s=30.0), max_tokens=cfg.turn_tokens)
        return config, in_process_workers(config, client, reward=False, loop_context=LoopContext(system.name))

    async def ingest(self, system: System, samples: Sequence[str]) -> tuple[dict[str, TrialStore], dict[str, Any]]:
        """Build each conversation's store the way Mem0, Memory-R1 and the LoCoMo paper do: session by session,
        one episode of the memory model per session (:mod:`memupdate.data.ingestion`: the session's memories
        added to the store the earlier episodes built, never a question), all conversations' k-th sessions in
        one batch. Returns the final stores and a log (per session: memories, operations, seconds)."""
        from verl import DataProto
        from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

        from memupdate.data.ingestion import ROW_SCHEMA, conversation_sessions, session_row, speakers_of

        run_dir = self.out_dir / "runs" / system.name
        (run_dir / "sessions").mkdir(parents=True, exist_ok=True)
        table = pq.read_table(self.memory.memories)
        wanted = set(samples)
        sessions = conversation_sessions([r for r in table.to_pylist() if r["sample_id"] in wanted])
        missing = sorted(wanted - set(sessions))
        if missing:
            raise ValueError(f"{self.memory.memories} has no memories of test conversations {missing}")
        speakers = {sample: speakers_of([r for new in by.values() for r in new]) for sample, by in sessions.items()}
        stores = {
            sample: TrialStore(
                self.manager.base(sample), self.manager.embedder, namespace=f"{sample}-ingest", sessions=0
            )
            for sample in samples
        }
        log: dict[str, Any] = {"conversations": {sample: [] for sample in samples}, "steps": []}
        config = worker = None
        steps = max(len(by) for by in sessions.values())
        began = time.perf_counter()
        with tqdm(
            total=sum(len(by) for by in sessions.values()),
            desc=f"{system.name} ingestion",
            unit="session",
            disable=None,
        ) as bar:
            for k in range(steps):
                rows = []
                for sample in samples:
                    order = list(sessions[sample])
                    if k >= len(order):
                        continue
                    session, new = order[k], sessions[sample][order[k]]
                    row = session_row(
                        sample,
                        session,
                        new,
                        speakers=speakers[sample],
                        n_memories=len(stores[sample]) + len(new),
                        index=len(rows),
                        sessions_total=len(order),
                    )
                    self.manager.start_from(row["extra_info"]["namespace"], stores[sample])
                    rows.append(row)
                rows_file = run_dir / "sessions" / f"step{k + 1}.parquet"
                pq.write_table(pa.Table.from_pylist(rows, schema=ROW_SCHEMA), rows_file)
                if worker is None:
                    config, worker = self._rollout_worker(system, run_dir, rows_file)
                dataset = RLHFDataset([str(rows_file)], worker.tokenizer, config.data)
                if len(dataset) != len(rows):
                    raise ValueError(
                        f"{len(rows) - len(dataset)} of the session rows of step {k + 1} ({rows_file}) are longer than "
                        f"episode.prompt_length {self.episode.prompt_length} tokens: raise it"
                    )
                step_began = time.perf_counter()
                batch = DataProto.from_single_dict(collate_fn([dataset[i] for i in range(len(dataset))]))
                out = await worker.generate_sequences(batch)
                seconds = time.perf_counter() - step_began
                for j, row in enumerate(rows):
                    info = row["extra_info"]
                    namespace = info["namespace"]
                    built = self.manager.started(namespace)
                    if built is None:
                        raise RuntimeError(
                            f"the memory tools of {namespace!r} did not open their store through the evaluator's memory "
                            "manager, so the session would not continue from the earlier ones"
                        )
                    self.manager.start_from(namespace, None)
                    stores[info["sample_id"]] = built
                    log["conversations"][info["sample_id"]].append(
                        {
                            "session": info["session"],
                            "new_memories": info["new_memories"],
                            "memories": len(built),
                            "ops": {
                                op: n for op, n in built.stats().items() if op not in ("initial_count", "final_count")
                            },
                            "termination_reason": str(out.non_tensor_batch[TERMINATION_KEY][j]),
                        }
                    )
                log["steps"].append({"step": k + 1, "episodes": len(rows), "seconds": round(seconds, 3)})
                bar.update(len(rows))
        total = time.perf_counter() - began
        episodes = sum(len(by) for by in sessions.values())
        log.update(
            episodes=episodes,
            seconds=round(total, 3),
            # Wall time per session of one conversation, all conversations' sessions batched together.
            seconds_per_step=round(total / max(1, steps), 3),
            seconds_per_episode=round(total / max(1, episodes), 3),
        )
        write_json_atomic(run_dir / "ingestion.json", log)
        logger.info(
            "%s: ingested %d sessions of %d conversations in %.1f s (%.2f s per session step)",
            system.name,
            episodes,
            len(samples),
            total,
            log["seconds_per_step"],
        )
        return stores, log

    async def run_ingestion_system(self, system: System, todo: list[dict[str, Any]], path: Path, bar) -> None:
        """The question-agnostic system: :meth:`ingest` the test conversations, then the QA model answers every
        question from its conversation's final store, through the code that answers for ``no_update``."""
        samples = sorted({r["extra_info"]["sample_id"] for r in todo})
        stores, log = await self.ingest(system, samples)
        stats = {}
        for sample, sessions in log["conversations"].items():
            ops = {
                op: sum(s["ops"][op] for s in sessions) for op in ("created", "updated", "deleted", "merged", "split")
            }
            # Before: every memory appended as it is (no_update's store); after: what the episodes built.
            appended = sum(s["new_memories"] for s in sessions)
            stats[sample] = {"initial_count": appended, "final_count": len(stores[sample]), **ops}
        qa = read_marker(system.qa, timeout_s=30.0)
        tokenizer = self.tokenizer(system.qa)
        s = self.settings
        async with OpenAIClient(qa) as client:
            for start in range(0, len(todo), s.batch_size):
                chunk = todo[start : start + s.batch_size]
                vectors = await self.manager.embedder.aencode([r["extra_info"]["question"] for r in chunk])

                async def one(row: dict[str, Any], vector) -> dict[str, Any]:
                    record = _base_record(row, system.name, s.seed)
                    hits = stores[record["sample_id"]].search(vector, s.top_k)
                    memories = within_budget([h.record for h in hits], s.context_chars)
                    record.update(self._retrieval_fields(record, memories))
                    record.update(memory_setting="question-agnostic", memory_stats=stats[record["sample_id"]])
                    await self.answer(client, tokenizer, record, memories)
                    return record

                _append(path, await asyncio.gather(*(one(r, v) for r, v in zip(chunk, vectors, strict=True))))
                bar.update(len(chunk))

    # ------------------------------------------------------------------ all systems

    def fingerprint(self, system: System) -> dict[str, Any]:
        """What a system's saved predictions depend on: its models (their manifests and weights) and the settings."""
        models = {}
        for role, marker in (("qa", system.qa), ("memory", system.memory)):
            if marker:
                folder = Path(load_marker(marker)["model_path"])
                # The weights themselves: a checkpoint replaced under the same manifest is another model.
                models[role] = {
                    "path": portable_path(folder),
                    "manifest": model_fingerprint(folder),
                    "weights": self._weights(marker),
                }
        # The judge scores predictions after the fact; changing it re-judges, it does not re-predict.
        settings = {k: v for k, v in asdict(self.settings).items() if k != "judge"}
        return {"kind": system.kind, "models": models, "settings": settings, "test_file": sha256_file(self.test_file)}

    def policy_key(self, system: System) -> tuple[str, str, str] | None:
        """What makes two memory systems one: their kind and the weights of their memory and QA models
        (:func:`weights_digest`: a stage whose every update was skipped, the QA stage too, saves the weights it
        started from); None for a system without a memory model, or one whose weights are not files."""
        if system.memory is None:
            return None
        memory, qa = self._weights(system.memory), self._weights(system.qa)
        return (system.kind, qa, memory) if memory and qa else None

    def _weights(self, marker: str) -> str | None:
        # A full-scale model's digest reads every tensor (GBs): once per model folder, not once per system.
        folder = Path(load_marker(marker)["model_path"])
        if folder not in self._digests:
            self._digests[folder] = weights_digest(folder)
        return self._digests[folder]

    async def run(self, systems: Sequence[System]) -> dict[str, Path]:
        """Predict with each system the questions its predictions file lacks. A memory system whose memory
        and QA models have the weights of one evaluated before it is that system (a stage
        whose every update was skipped saves the weights it started from): its predictions are copied, each
        marked ``same_weights_as``, instead of being made again."""
        predictions = self.out_dir / "predictions"
        predictions.mkdir(parents=True, exist_ok=True)
        paths, policies = {}, {}
        for system in systems:
            path = paths[system.name] = predictions / f"{system.name}.jsonl"
            invalidate_if_changed(path, self.fingerprint(system))
            done = read_predictions(path)
            todo = [r for r in self.rows if r["extra_info"]["namespace"] not in done]
            logger.info("%s: %d of %d questions to predict", system.name, len(todo), len(self.rows))
            key = self.policy_key(system)
            twin = policies.get(key) if key else None
            if key and twin is None:
                policies[key] = system.name
            if not todo:
                continue
            if twin is not None:
                logger.info("%s: the weights of %s; its predictions are copied, not made again", system.name, twin)
                copy_predictions(paths[twin], path, {r["extra_info"]["namespace"] for r in todo}, system.name, twin)
                log = self.out_dir / "runs" / twin / "ingestion.json"
                if log.is_file():
                    (self.out_dir / "runs" / system.name).mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(log, self.out_dir / "runs" / system.name / "ingestion.json")
                continue
            runner = {
                "no_update": self.run_no_update,
                "full_context": self.run_full_context,
                "memory": self.run_memory_system,
                "ingestion": self.run_ingestion_system,
            }[system.kind]
            with tqdm(total=len(todo), desc=system.name, unit="question", disable=None) as bar:
                await runner(system, todo, path, bar)
        return paths


async def judge_predictions(
    path: str | Path, judge: Any, judge_name: str, max_tokens: int = 256, prompts_dir: str | Path | None = None
) -> int:
    """Add Mem0's J to the category 1-4 predictions in ``path`` not yet judged by ``judge_name`` with the
    current judge prompt, rewrite the file atomically, and return how many replies could not be parsed.

    ``judge`` is an :class:`OpenAIClient`; it gets Mem0's ACCURACY_PROMPT verbatim in JSON mode. Each
    judged record gets ``judge`` (1.0 CORRECT, 0.0 WRONG, None when the reply has no such label),
    ``judge_unparsed`` (bool), ``judge_reply`` (the raw reply), ``judge_model`` and ``judge_prompt``
    (sha256 of the judge template, so a changed prompt re-judges). An unparsed reply is never scored.
    """
    records = load_jsonl(path)
    prompt_sha = judge_prompt_sha256(prompts_dir)

    async def one(record):
        prediction = (record.get("predictions") or {}).get("mem0")
        if prediction is None or record["category"] not in MEM0_CATEGORIES:
            return
        if record.get("judge_model") == judge_name and record.get("judge_prompt") == prompt_sha:
            return
        messages = judge_messages(record["question"], record["answer"], prediction, prompts_dir=prompts_dir)
        reply = await judge.chat(messages, **GREEDY.request(max_tokens), response_format=JUDGE_RESPONSE_FORMAT)
        label = parse_judge(reply)
        record.update(
            judge=label,
            judge_unparsed=label is None,
            judge_reply=reply,
            judge_model=judge_name,
            judge_prompt=prompt_sha,
        )

    await asyncio.gather(*(one(r) for r in records))
    write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in records))
    unparsed = sum(bool(r.get("judge_unparsed")) for r in records)
    if unparsed:
        logger.warning("%s: %d judge replies without a CORRECT/WRONG label (judge: None)", path, unparsed)
    return unparsed


def copy_predictions(source: Path, path: Path, namespaces: set[str], system: str, twin: str) -> None:
    """Append to ``path`` the predictions of ``source`` (system ``twin``'s) for ``namespaces``, as system
    ``system``'s, each marked ``same_weights_as: twin``."""
    records = [r for r in read_predictions(source).values() if r["namespace"] in namespaces]
    missing = namespaces - {r["namespace"] for r in records}
    if missing:
        raise RuntimeError(f"{source}: {twin} lacks predictions for {len(missing)} questions to copy to {system}")
    _append(path, [{**r, "system": system, "same_weights_as": twin} for r in records])


def locomo_full_context(conv: Any, start_prompt: str) -> str:
    """The whole conversation as LoCoMo's full-context evaluation lays it out (``get_input_context`` and
    ``get_gpt_answers`` in snap-research/LoCoMo ``task_eval/gpt_utils.py``, commit in
    memupdate/prompt_files/locomo.yaml), without its token budget (a prompt that does not fit is skipped instead):
    ``CONV_START_PROMPT`` with the two speakers, then each session prepended to the ones before it as
    ``DATE: <date>\nCONVERSATION:\n`` and ``<speaker> said, "<text>"\n`` per turn (an image turn adds
    `` and shared <caption>.``), each turn followed by a blank line. Upstream names the speakers in the
    order of a Python set; here speaker_a then speaker_b."""
    query = ""
    for session in conv.sessions:
        query += "\n\n"
        turns = ""
        for turn in session.turns:
            line = turn.speaker + ' said, "' + turn.text + '"' + "\n"
            if turn.image_caption:
                line += f" and shared {turn.image_caption}."
            turns += line + "\n"
        query = "DATE: " + str(session.date_time) + "\n" + "CONVERSATION:\n" + turns + query
    return start_prompt.format(conv.speaker_a, conv.speaker_b) + query


def _chat_tokens(tokenizer: Any, messages: list[dict[str, str]]) -> int:
    """Tokens of ``messages`` with the chat template, as the server counts them."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return len(ids["input_ids"] if isinstance(ids, Mapping) else ids)


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if hasattr(value, "item"):
        return value.item()
    return value


def _max_model_len(endpoint: Endpoint) -> int:
    from memupdate.serving.readiness import get_models

    cards = get_models(endpoint.base_url, api_key=endpoint.api_key)
    lengths = [c.get("max_model_len") for c in cards if c["id"] == endpoint.model]
    if not lengths or not lengths[0]:
        raise ValueError(f"{endpoint.base_url} does not report max_model_len for {endpoint.model!r}")
    return int(lengths[0])


def stage_systems(stages: Sequence[Sequence[str]]) -> list[tuple[str, str, str | None]]:
    """The system after each training stage: (name, memory model, QA model or None for the base one), the
    name ``<memory>+<qa>`` of the latest memory and QA checkpoints at that point.

    >>> stage_systems([("stage1", "memory"), ("stage2", "qa"), ("stage3", "memory")])
    [('stage1+qa_base', 'stage1', None), ('stage1+stage2', 'stage1', 'stage2'), ('stage3+stage2', 'stage3', 'stage2')]
    """
    latest: dict[str, str] = {}
    systems = []
    for name, role in stages:
        latest[role] = name
        if "memory" not in latest:
            raise ValueError(f"stage {name} trains the QA model before any memory stage")
        qa = latest.get("qa")
        systems.append((f"{latest['memory']}+{qa or 'qa_base'}", latest["memory"], qa))
    return systems


def evaluate_locomo(
    *,
    experiment: str,
    test_file: str,
    memories: str,
    embeddings: str,
    conversations: str | None,
    markers: Mapping[str, str],
    embedding_model: str = DEFAULT_EMBEDDING_MODEL,
    tools: Mapping[str, Any] | None = None,
    tool_config: str | Path = TOOL_CONFIG,
    out_dir: str,
    settings: Mapping[str, Any] | None = None,
    episode: Mapping[str, Any] | None = None,
    training_metrics: Mapping[str, str] | None = None,
    published: str | None = None,
    split: str | None = None,
    stages: Sequence[Sequence[str]] | None = None,
    ingestion: bool = False,
) -> dict[str, Any]:
    """The ``eval_locomo`` rule: predict with every system the served models allow, then write the report
    (``split``: the name of the LoCoMo split the test file comes from, stated in the report). The memory models play
    the experiment's ``episode`` (:class:`~memupdate.settings.EpisodeSettings`), greedy.

    ``markers`` maps serve names (``qa-base``, ``base``, ``sft``, ``stage1``, ``stage2``, ...) to readiness
    markers. Systems: ``no_update`` and ``full_context`` (qa-base), ``<policy>+qa_base`` for the untrained
    ``base`` and the cold start ``sft`` if served, and one per training stage (:func:`stage_systems`).
    ``stages``: each stage's (name, role) in order; None: the stages among ``markers``, with their default
    roles (:func:`memupdate.settings.experiment_stages`). ``ingestion``: the memory systems build each test
    conversation's store session by session without the questions (:meth:`LocomoEvaluator.ingest`), then
    answer every question from it; otherwise each question's episode edits its own copy of the store.
    """
    from memupdate.eval.report import build_report

    eval_settings = build(LocomoEvalSettings, settings, "eval")
    episode_settings = build(EpisodeSettings, episode, "episode")
    if "qa-base" not in markers:
        raise ValueError("LoCoMo evaluation needs the base QA model served: markers['qa-base']")
    # Servers held until their consumer runs (Slurm) start together, not one after another as each system waits.
    release_held(list(markers.values()))
    if stages is None:
        stages = [(s.name, s.role) for s in experiment_stages({name: {} for name in stage_sections(markers)})]
    missing = [name for name, _ in stages if name not in markers]
    if missing:
        raise ValueError(f"LoCoMo evaluation of stages {missing}: no served model (markers) for them")
    systems = [System("no_update", markers["qa-base"], kind="no_update")]
    if conversations:
        systems.append(System("full_context", markers["qa-base"], kind="full_context"))
    kind = "ingestion" if ingestion else "memory"
    for policy in ("base", "sft"):
        if policy in markers:
            systems.append(System(f"{policy}+qa_base", markers["qa-base"], memory=markers[policy], kind=kind))
    for name, memory_model, qa_model in stage_systems(stages):
        qa = markers[qa_model] if qa_model else markers["qa-base"]
        systems.append(System(name, qa, memory=markers[memory_model], kind=kind))
    memory = MemoryEnvironment(
        memories=memories,
        embeddings=embeddings,
        embedding_model=embedding_model,
        max_content_chars=eval_settings.max_content_chars or DEFAULT_MAX_CONTENT_CHARS,
        **ToolSettings.environment(tools),
    )
    evaluator = LocomoEvaluator(
        test_file=test_file,
        memory=memory,
        tool_config=tool_config,
        conversations=conversations,
        out_dir=out_dir,
        settings=eval_settings,
        episode=episode_settings,
    )
    judge_name = None

    async def main() -> dict[str, Path]:
        nonlocal judge_name
        paths = await evaluator.run(systems)
        if eval_settings.judge:
            if eval_settings.judge not in markers:
                raise ValueError(f"eval.judge is {eval_settings.judge!r}, which is not served for this run")
            endpoint = read_marker(markers[eval_settings.judge], timeout_s=30.0)
            judge_name = f"{endpoint.model} ({portable_path(load_marker(markers[eval_settings.judge])['model_path'])})"
            async with OpenAIClient(endpoint) as judge:
                for path in paths.values():
                    await judge_predictions(path, judge, judge_name)
        return paths

    paths = asyncio.run(main())
    return build_report(
        out_dir,
        paths,
        experiment=experiment,
        settings=asdict(evaluator.settings),
        judge=judge_name,
        training_metrics=training_metrics,
        published=published,
        split=split,
    )
