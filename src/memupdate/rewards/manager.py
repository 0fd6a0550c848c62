"""verl reward-loop manager for MemoryUpdate, registered as ``memupdate_memory``.

verl 0.9.1 streams each finished trajectory to a reward worker, which calls :meth:`run_single` with a
one-row ``DataProto``: the dataset row (``extra_info`` has the target question, answer, evidence and
category) and ``tool_extra_fields`` (the agent loop's ``extra_fields``: the store delta, the QA phase's
answer). The reward is :func:`memupdate.rewards.memory.memory_reward` on base vs. base + delta for the
memory role, and the answer's F1 for the QA role of two-stage training (``trained_role`` from the
agent loop); all components become ``reward_extra_info`` (logged per sample by verl).
:meth:`MemoryRewardManager.score_batch` scores a whole rollout's trajectories at once (one embedding call).

Settings come from ``reward.custom_reward_function.reward_kwargs`` (verl's own key)::

    memory_environment                      # the run's memory_environment.json, which the tools read too
    trained_role: memory | qa             # the trained role (default memory)
    scorer: answer_recall | evidence_recall | reader | judge
    reader_marker, judge_marker             # readiness markers of the served reader and judge
    qa_prompt: locomo | mem0, qa_max_tokens, reader_metric: locomo_f1 | mem0_f1
    top_k, context_chars, other_questions, efficiency: {...}, qa_pool: [train.parquet, ...]
    answer_metric: mem0_f1 | locomo_f1      # the QA role's reward

``reader`` and ``judge`` ask served models. Their endpoints come from readiness markers, re-probed
(:func:`memupdate.serving.readiness.read_marker`) when the manager starts, so a missing or dead server,
an unknown scorer or a served scorer without a marker fails before the first rollout, not at the first
reward. The reader is the fixed QA model: it asks exactly the QA phase's prompt (``qa_prompt`` over the
``top_k`` memories within ``context_chars``) with the QA phase's answer cap, greedily. In stage 1 the
final store's answer to the target question is the one the QA phase already gave (``qa_answer``), and
the initial store's answer is asked once per question and reused across rollouts. Stage ``qa`` is
rewarded by its own answer; with a served scorer it computes no memory reward (nothing serves a reader
there). The HTTP sessions open in the event loop that scores and close with it (``asyncio.run``'s
shutdown, in process) or by :meth:`MemoryRewardManager.close`; verl's Ray reward workers
have no teardown hook, so theirs close when the worker process ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from verl import DataProto
from verl.experimental.reward_loop.reward_manager import register
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase

from memupdate import metrics
from memupdate.agents.fields import ANSWER_KEY, DELTA_KEY, MEMORY_REWARD, ROLE_KEY
from memupdate.data.ingestion import is_ingestion_row
from memupdate.memory.environment import MemoryEnvironment
from memupdate.memory.manager import manager_for
from memupdate.prompts import PROTOCOLS
from memupdate.rewards.memory import (
    MemoryRewardComputer,
    MemoryRewardConfig,
    RewardRequest,
    baseline_sessions,
    select_questions,
)
from memupdate.rewards.scorers import (
    AnswerRecallScorer,
    EvidenceRecallScorer,
    JudgeScorer,
    QAItem,
    ReaderScorer,
    Scorer,
)
from memupdate.serving.client import Endpoint, OpenAIClient
from memupdate.serving.readiness import read_marker
from memupdate.settings import ROLES, SERVED_ROLES, RewardSettings
from memupdate.utils.io import ROWS_TABLE, read_parquet_columns

logger = logging.getLogger(__name__)

#: The manager's settings: the workflow's ``reward`` section (memupdate.settings.RewardSettings, less the
#: judge's serve name, resolved to its marker) and what a run adds: paths, the trained role, the markers.
SETTINGS = {
    "memory_environment",
    "trained_role",
    "reader_marker",
    "judge_marker",
    "qa_pool",
    "answer_metric",
    *(f.name for f in dataclasses.fields(RewardSettings) if f.name != "judge"),
}
SCORERS = ("answer_recall", "evidence_recall", "reader", "judge")
#: The QA phase's answer cap (``qa_max_tokens``), which the reader shares: it gives the same answers.
DEFAULT_QA_MAX_TOKENS = RewardSettings.qa_max_tokens
#: Each QA protocol's own F1, the reader's metric unless ``reader_metric`` says otherwise.
PROTOCOL_METRIC = {"locomo": "locomo_f1", "mem0": "mem0_f1"}


def answer_score(answer: str | None, item: QAItem, metric: str) -> float:
    """The QA role's score: its answer against the gold answer (0 when it gave none).

    >>> answer_score("7 May 2023", QAItem("q", "7 May 2023", 2), "locomo_f1")
    1.0
    """
    if not answer:
        return 0.0
    if metric == "locomo_f1":
        return metrics.locomo_f1(answer, item.answer, item.category)
    if metric == "mem0_f1":
        return metrics.mem0_f1(answer, item.answer)
    raise ValueError(f"answer_metric must be mem0_f1 or locomo_f1, got {metric!r}")


def check_setting_names(settings: Mapping[str, Any]) -> None:
    """Raise naming every key of ``settings`` the reward manager does not take."""
    unknown = sorted(set(settings) - SETTINGS)
    if unknown:
        raise ValueError(f"unknown reward settings {unknown}; the reward manager takes {sorted(SETTINGS)}")


def reward_settings(config: Any) -> dict[str, Any]:
    """``reward.custom_reward_function.reward_kwargs`` as a plain dict, its names checked."""
    reward = config.get("reward", {}) if hasattr(config, "get") else {}
    custom = (reward.get("custom_reward_function") or {}) if reward else {}
    kwargs = dict(custom.get("reward_kwargs") or {})
    check_setting_names(kwargs)
    return kwargs


def served_endpoints(settings: Mapping[str, Any]) -> dict[str, Endpoint]:
    """The served models the settings' scorer asks, ``{"reader": Endpoint, "judge": Endpoint}``, from their
    readiness markers (re-probed); ``{}`` for an offline scorer, and for the trained role ``qa`` (rewarded by
    its own answer). Raises on an unknown scorer or role, a missing marker setting or file, or a dead server.

    >>> served_endpoints({"scorer": "answer_recall"})
    {}
    """
    scorer = settings.get("scorer") or "answer_recall"
    if scorer not in SCORERS:
        raise ValueError(f"unknown reward scorer {scorer!r}; known: {', '.join(SCORERS)}")
    trained = settings.get("trained_role") or "memory"
    if trained not in ROLES:
        raise ValueError(f"reward setting trained_role must be one of {ROLES}, got {trained!r}")
    if scorer not in SERVED_ROLES or trained == "qa":
        return {}
    endpoints = {}
    for role in SERVED_ROLES[scorer]:
        marker = settings.get(f"{role}_marker")
        if not marker:
            raise ValueError(
                f"reward scorer {scorer!r} needs the setting {role}_marker: the readiness marker of the served "
                f"{role} model (the workflow's train_stage passes its fixed QA role's); none was given"
            )
        endpoints[role] = read_marker(marker)
    return endpoints


def qa_pool(files: list[str]) -> dict[str, list[QAItem]]:
    """Answerable questions per conversation, from LoCoMo row files (for ``other_questions``)."""
    pool: dict[str, list[QAItem]] = defaultdict(list)
    for path in files:
        for info in read_parquet_columns(path, {"extra_info": None}, ROWS_TABLE).column("extra_info").to_pylist():
            if info["answer"]:
                pool[info["sample_id"]].append(
                    QAItem(info["question"], info["answer"], info["category"], tuple(info["evidence"]))
                )
    return dict(pool)


def _item(extra_info: Mapping[str, Any]) -> QAItem:
    answer = extra_info.get("answer")
    if not answer:
        raise ValueError(
            f"row {extra_info.get('namespace')!r} has no gold answer (category {extra_info.get('category')}); "
            "the memory reward needs one: keep category 5 out of training splits"
        )
    return QAItem(extra_info["question"], answer, int(extra_info["category"]), tuple(extra_info.get("evidence") or ()))


async def _close_at_loop_shutdown(manager: MemoryRewardManager):
    """Suspended until closed: ``asyncio.run`` closes unfinished async generators before it closes its
    loop, which closes the manager's sessions without verl having to call anything."""
    try:
        yield
    finally:
        await manager.close()


@register(MEMORY_REWARD)
class MemoryRewardManager(RewardManagerBase):
    def __init__(
        self, config, tokenizer, compute_score=None, reward_router_address=None, reward_model_tokenizer=None, **kwargs
    ):
        super().__init__(config, tokenizer, compute_score)
        self.settings = reward_settings(config)
        self.reward_config = MemoryRewardConfig.from_settings(self.settings)
        self.pool = qa_pool(list(self.settings.get("qa_pool") or [])) if self.reward_config.other_questions else {}
        # Built and probed now, so a misconfigured scorer fails before any rollout.
        self._clients = {role: OpenAIClient(endpoint) for role, endpoint in served_endpoints(self.settings).items()}
        self.scorer = self._make_scorer()
        # Read now, so a missing file fails before any rollout; the store itself loads at the first reward.
        self.environment = self._environment() if self.scorer is not None else None
        self._computer: MemoryRewardComputer | None = None
        self._clients_loop: asyncio.AbstractEventLoop | None = None
        self._closer: Any = None
        served = {role: f"{c.endpoint.model} at {c.endpoint.base_url}" for role, c in self._clients.items()}
        logger.info("memory reward: scorer %s %s", self.scorer.name if self.scorer else None, served or "")

    def _environment(self) -> MemoryEnvironment:
        path = self.settings.get("memory_environment")
        if not path:
            raise ValueError(
                "the memupdate_memory reward needs reward_kwargs.memory_environment: the run's "
                "memory_environment.json (memupdate.memory.environment), which its launcher writes"
            )
        return MemoryEnvironment.read(path)

    def _make_scorer(self) -> Scorer | None:
        """The scorer of S(M), or None when this run computes no memory reward (trained role qa, served scorer)."""
        name = self.settings.get("scorer") or "answer_recall"
        if name == "answer_recall":
            return AnswerRecallScorer()
        if name == "evidence_recall":
            return EvidenceRecallScorer()
        if not self._clients:
            return None
        protocol = self.settings.get("qa_prompt") or "locomo"
        if protocol not in PROTOCOLS:
            raise ValueError(f"reward setting qa_prompt must be one of {PROTOCOLS}, got {protocol!r}")
        reader = ReaderScorer(
            self._clients["reader"],
            metric=self.settings.get("reader_metric") or PROTOCOL_METRIC[protocol],
            max_tokens=int(self.settings.get("qa_max_tokens") or DEFAULT_QA_MAX_TOKENS),
            protocol=protocol,
        )
        return reader if name == "reader" else JudgeScorer(reader, self._clients["judge"])

    async def _open_clients(self) -> None:
        """Open the served scorers' sessions in the running loop, once per loop; they close with it."""
        loop = asyncio.get_running_loop()
        if not self._clients or self._clients_loop is loop:
            return
        # Nothing below suspends, so concurrent rewards cannot open a second session.
        self._clients_loop = loop
        for client in self._clients.values():
            await client.__aenter__()
        # Held here: the loop keeps only a weak reference, and a collected generator would close early.
        self._closer = _close_at_loop_shutdown(self)
        await self._closer.__anext__()

    async def close(self) -> None:
        """Close the served scorers' HTTP sessions (idempotent; the next reward reopens them)."""
        for client in self._clients.values():
            await client.close()
        self._clients_loop = None

    async def computer(self) -> MemoryRewardComputer:
        if self._computer is None:
            manager = manager_for(self.environment)
            self._computer = MemoryRewardComputer(
                manager.base,
                manager.embedder,
                self.scorer,
                self.reward_config,
                max_content_chars=self.environment.max_content_chars,
            )
        return self._computer

    async def run_single(self, data: DataProto) -> dict:
        row = data[-1]
        extra_info = row.non_tensor_batch["extra_info"]
        fields = row.non_tensor_batch.get("tool_extra_fields") or {}
        if is_ingestion_row(extra_info):
            (result,) = await self.score([self.request(extra_info, fields)])
            score = result["score"]
            return {"reward_score": score, "reward_extra_info": {**result, "memory_reward": score, "score": score}}
        target = _item(extra_info)
        # Two-stage training: the memory role earns the memory reward, the QA role its answer's score.
        trained = fields.get(ROLE_KEY) or "memory"
        answer = answer_score(fields.get(ANSWER_KEY), target, self.settings.get("answer_metric") or "mem0_f1")
        if self.scorer is None:
            if trained != "qa":
                raise ValueError(
                    f"trajectory of {extra_info.get('namespace')!r} trains the {trained} role, but the reward "
                    f"settings say trained_role {self.settings.get('trained_role')!r}, which asks no served scorer"
                )
            return {"reward_score": answer, "reward_extra_info": {"answer_score": answer, "score": answer}}
        (result,) = await self.score([self.request(extra_info, fields)])
        score = result["score"] if trained == "memory" else answer
        return {
            "reward_score": score,
            "reward_extra_info": {**result, "memory_reward": result["score"], "answer_score": answer, "score": score},
        }

    async def score_batch(self, extra_infos: Sequence[Mapping[str, Any]], batch: DataProto) -> list[dict[str, float]]:
        """The memory reward's components of every trajectory of ``batch`` (one row each, the agent loop's
        fields as columns, as the agent-loop worker returns them) whose rows' ``extra_info`` are
        ``extra_infos`` (a worker that scores leaves them out of its output), as :meth:`run_single` scores
        them one by one, but in one :meth:`score`: a second scorer's view of a scored rollout (the cold
        start's demonstrations, :mod:`memupdate.training.sft`)."""
        extra = batch.non_tensor_batch
        columns = {key: extra[key] for key in (DELTA_KEY, ROLE_KEY, ANSWER_KEY) if key in extra}
        if len(extra_infos) != len(batch):
            raise ValueError(f"need one extra_info per row, got {len(extra_infos)} for {len(batch)} rows")
        requests = [
            self.request(info, {key: column[i] for key, column in columns.items()})
            for i, info in enumerate(extra_infos)
        ]
        return await self.score(requests)

    async def score(self, requests: list[RewardRequest]) -> list[dict[str, float]]:
        """The memory reward of ``requests`` (:meth:`request`), with the scorer's clients open."""
        await self._open_clients()
        computer = await self.computer()
        return await computer.compute(requests)

    def request(self, extra_info: Mapping[str, Any], fields: Mapping[str, Any]) -> RewardRequest:
        """What the memory reward scores of one finished trajectory: its row's ``extra_info`` and the agent
        loop's ``fields`` (the store delta; the trained role and the QA phase's answer)."""
        delta = fields.get(DELTA_KEY)
        if delta is None:
            raise ValueError(
                f"trajectory of {extra_info.get('namespace')!r} carries no '{DELTA_KEY}': run it with the "
                "memupdate_agent loop (or any loop whose tools are memupdate's memory tools)"
            )
        trained = fields.get(ROLE_KEY) or "memory"
        if is_ingestion_row(extra_info):
            return self._ingestion_request(extra_info, trained, delta)
        if self.scorer is None:
            raise ValueError(
                f"trajectory of {extra_info.get('namespace')!r}: these reward settings compute no memory reward "
                f"(trained_role {self.settings.get('trained_role')!r} with a served scorer)"
            )
        target = _item(extra_info)
        items = [target]
        if self.reward_config.other_questions:
            pool = self.pool.get(extra_info["sample_id"], [])
            items = select_questions(target, pool, self.reward_config.other_questions, extra_info["namespace"])
        # The fixed QA model answered the target from the final store in the QA phase, with the reader's
        # prompt: that is S(final)'s answer, not one to ask again.
        answers = None
        if trained == "memory" and self.scorer.name in SERVED_ROLES and fields.get(ANSWER_KEY) is not None:
            answers = [fields[ANSWER_KEY]] + [None] * (len(items) - 1)
        return RewardRequest(extra_info["sample_id"], delta, items, answers)

    def _ingestion_request(self, extra_info: Mapping[str, Any], trained: str, delta: Any) -> RewardRequest:
        """A session's ingestion episode: S on the questions its row carries (their evidence lies in the
        sessions seen), final store against the ``ingestion_baseline`` store."""
        where = f"ingestion row {extra_info.get('namespace')!r}"
        if trained != "memory" or self.scorer is None:
            raise ValueError(f"{where}: an ingestion episode trains the memory role only, not {trained!r}")
        session = int(extra_info["session"])
        if delta.get("sessions") != session:
            raise ValueError(f"{where} is session {session}, but its store saw sessions up to {delta.get('sessions')}")
        items = [_item({**q, "namespace": extra_info.get("namespace")}) for q in extra_info.get("questions") or []]
        if not items:
            raise ValueError(f"{where} has no questions to score it on (its rows keep only sessions that have some)")
        initial = baseline_sessions(session, self.settings.get("ingestion_baseline") or "append")
        return RewardRequest(extra_info["sample_id"], delta, items, initial_sessions=initial)
