"""The MemoryUpdate agent loop: the policy edits its trajectory's trial memory store through tools.

It is verl's ``ToolAgentLoop`` (prompt building, generation, hermes tool calls, limits) plus what
MemoryUpdate needs, through verl's extension points only:

- the trial store is opened before the first turn and released after the last, so every trajectory,
  even one without a tool call, hands the reward its store delta and growth statistics
  (``extra_fields["memory_delta"]``, ``["memory_stats"]``);
- the episode ends on verl's limits (response budget, assistant/user turns) or when the model replies
  without a tool call (``DONE`` is the documented way); the reason is recorded in
  ``extra_fields["termination_reason"]``;
- request ids can be made deterministic (``deterministic_ids``) for reproducible in-process runs (evaluation,
  the cold start); they stay unique per process, as trial namespaces (keyed by the whole id) need.

Registered as ``memupdate_agent`` (the rows' ``agent_name``); a run's ``agent_loops.yaml`` wires the same class with the
same arguments for verl's trainer and for the in-process runs (:mod:`memupdate.rollout.loops`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from omegaconf import DictConfig, OmegaConf
from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
from verl.experimental.agent_loop.tool_agent_loop import AgentData, AgentState, ToolAgentLoop
from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

from memupdate.agents.context import LoopContext, process_context
from memupdate.agents.fields import (
    ANSWER_KEY,
    DELTA_KEY,
    QA_CONTEXT_KEY,
    ROLE_KEY,
    STATS_KEY,
    TERMINATION_KEY,
    weight_versions,
)
from memupdate.data.ingestion import is_ingestion_row
from memupdate.names import MEMORY_AGENT
from memupdate.prompts import DEFAULT_PROTOCOL, qa_messages, within_budget
from memupdate.serving.decoding import GREEDY
from memupdate.settings import QA_PHASE_KEYS, ROLES, RewardSettings

logger = logging.getLogger(__name__)
# verl builds a turn-boundary builder for every episode and logs its choice in five lines, one a warning that a
# llama model type falls back to the default builder, which _use_chatml_builder replaces: 1,040 lines in one
# cpu_demo policy evaluation, and nothing a reader can act on.
logging.getLogger("verl.utils.tokenizer.continuous_token_wiring").setLevel(logging.ERROR)

TERMINATION_REASONS = ("done", "no_tool_call", "response_budget", "max_assistant_turns", "max_user_turns")


def qa_settings(reward: Mapping[str, Any] | None) -> dict[str, Any]:
    """The QA phase's retrieval and prompt from the reward's settings (:data:`~memupdate.settings.QA_PHASE_KEYS`
    of ``reward``), each default the reward's own.

    >>> qa_settings({"top_k": 3, "scorer": "reader"})["top_k"], qa_settings(None)["qa_prompt"]
    (3, 'locomo')
    """
    if isinstance(reward, DictConfig):
        reward = OmegaConf.to_container(reward, resolve=True)
    kwargs = {k: v for k, v in (reward or {}).items() if k in QA_PHASE_KEYS and v is not None}
    return {
        "top_k": kwargs.get("top_k", RewardSettings.top_k),
        "context_chars": kwargs.get("context_chars", RewardSettings.context_chars),
        "qa_prompt": kwargs.get("qa_prompt") or DEFAULT_PROTOCOL,
    }


@dataclass
class QAAnswer:
    """The QA phase's turn: its own prompt (the QA prompt with the final store's memories), the answer."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float] | None
    text: str
    seconds: float
    #: The policy versions that sampled it (:func:`~memupdate.agents.fields.weight_versions`).
    versions: dict[str, Any]


@register(MEMORY_AGENT)
class MemoryUpdateAgentLoop(ToolAgentLoop):
    def __init__(
        self,
        *args,
        done_marker: str = "DONE",
        deterministic_ids: bool = False,
        trained_role: str = "memory",
        qa_phase: bool = False,
        fixed_model: Any = None,
        fixed_temperature: float | None = 0.0,
        qa: Mapping[str, Any] | None = None,
        qa_max_tokens: int = RewardSettings.qa_max_tokens,
        max_new_tokens: int | None = None,
        loop_context: LoopContext | None = None,
        **kwargs,
    ):
        """``trained_role`` says which role the policy plays and which tokens enter the loss: ``memory``
        (edits memory; a QA phase, if any, is answered by ``fixed_model``), ``qa`` (answers from memory
        that ``fixed_model`` edited). ``fixed_model`` is any object with
        verl's ``generate`` (a served model's :class:`~memupdate.serving.token_client.VLLMTokenClient`, or a local
        generator); it decodes as :data:`~memupdate.serving.decoding.GREEDY` at ``fixed_temperature`` (0 by
        default, so a GRPO group varies only in what is trained; None = the rollout's sampling).

        The QA phase is a conversation of its own, never a turn of the memory transcript: the QA prompt
        (``qa``'s ``qa_prompt``, :mod:`memupdate.prompts`) over the final store's top-k memories within the
        text budget (``qa``'s ``top_k`` and ``context_chars``: the reward's, which the run's agent loop entry
        carries; :func:`qa_settings`), exactly what evaluation's
        ``no_update`` system asks from the initial store. Its answer is ``extra_fields["qa_answer"]``; when
        the QA role is trained, the QA turn is the loop's (second) output. ``max_new_tokens`` caps each memory
        turn, the policy's and the served model's alike (the episode's, :class:`~memupdate.settings.EpisodeSettings`;
        None: what is left of the response budget)."""
        super().__init__(*args, **kwargs)
        if trained_role not in ROLES:
            raise ValueError(f"trained_role must be one of {ROLES}, got {trained_role!r}")
        self.trained_role = trained_role
        self.qa_phase = qa_phase or trained_role == "qa"
        fixed_role = "memory" if trained_role == "qa" else ("qa" if self.qa_phase else None)
        if fixed_role is not None and fixed_model is None:
            raise ValueError(
                f"trained_role={trained_role!r} needs fixed_model to play the {fixed_role} role "
                "(a served model: run the serve rule, its readiness marker names the endpoint)"
            )
        self.fixed_role = fixed_role
        # What outlives this trajectory (prompt ids, fixed-model clients, request ids): the worker's.
        self.loop_context = loop_context or process_context()
        # The served role's turns get the policy's per-turn cap (an endpoint's own max_tokens overrides it).
        self.fixed_model = self.loop_context.fixed_client(fixed_model, max_new_tokens or self.response_length)
        self.fixed_temperature = fixed_temperature
        self.qa_max_tokens = int(qa_max_tokens)
        self.max_new_tokens = max_new_tokens
        # The QA phase retrieves as the reward scores: one definition, the reward's settings.
        settings = qa_settings(qa)
        self.qa_top_k, self.qa_context_chars, self.qa_prompt = (
            settings["top_k"],
            settings["context_chars"],
            settings["qa_prompt"],
        )
        # Duck-typed: importing the tool class here would make this module import memupdate.tools, whose
        # import of verl can be the one that loads our plugin (see memupdate.agents.fields).
        memory_tools = [t for t in self.tools.values() if callable(getattr(t, "store_for", None))]
        if not memory_tools:
            raise ValueError(
                "memupdate_agent needs the memory tools: set actor_rollout_ref.rollout.multi_turn.tool_config_path "
                "to the run's tools.yaml (memupdate.tools.config.write_tool_config)"
            )
        self._memory_tool = memory_tools[0]
        self._use_chatml_builder()
        self.done_marker = done_marker
        self.deterministic_ids = deterministic_ids
        self._namespace: str | None = None
        self._request_id: str | None = None

    def _use_chatml_builder(self) -> None:
        """verl picks its turn-boundary handling by ``model_type``; a model of another type that uses a
        ChatML template (SmolLM2 with ours) would get the default builder, which drops the newline
        after ``<|im_end|>`` between turns. ChatML ends turns exactly as Qwen's template does."""
        template = getattr(self.tokenizer, "chat_template", None) or ""
        if "<|im_start|>" not in template or type(self.continuous_token_builder).__name__ != "ContinuousTokenBuilder":
            return
        self.continuous_token_builder = create_continuous_token_builder(
            self.tokenizer,
            hf_model_type=None,
            model_family="qwen",
            chat_template_kwargs=self.apply_chat_template_kwargs,
            mm_processor_kwargs=self.mm_processor_kwargs,
            processor=self.processor,
        )

    def _make_request_id(self, priority: int, full_determinism: bool) -> str:
        if not (self.deterministic_ids or full_determinism):
            return super()._make_request_id(priority, False)
        # verl's own deterministic id ("det-<priority>") is the same for every trajectory of a batch,
        # which would put them all in one trial store; the context's counter keeps them apart.
        return self.loop_context.next_request_id()

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        info = kwargs.get("extra_info") or {}
        qa = None
        try:
            output = await super().run(sampling_params, **kwargs)
            # An ingestion episode has no question to answer: its reward asks the reader itself.
            if self.qa_phase and not is_ingestion_row(info):
                qa = await self._answer(info, sampling_params)
        finally:
            # Released even when the episode failed, so a broken trajectory leaks no store.
            delta, stats = self._export_and_release()
        # Every trajectory carries the same keys, with or without tool calls: verl batches them.
        output.extra_fields[DELTA_KEY] = delta
        output.extra_fields[STATS_KEY] = stats
        output.extra_fields.setdefault(TERMINATION_KEY, "response_budget")
        output.extra_fields[ROLE_KEY] = self.trained_role
        output.extra_fields[ANSWER_KEY] = qa.text if qa else None
        output.extra_fields[QA_CONTEXT_KEY] = len(qa.prompt_ids) if qa else None
        if qa is None or self.trained_role == "memory":
            return output
        # The trained QA row is the QA prompt and its answer, not the tail of the memory transcript.
        metrics = output.metrics.model_copy(
            update={"generate_sequences": output.metrics.generate_sequences + qa.seconds}
        )
        answer = AgentLoopOutput(
            prompt_ids=qa.prompt_ids,
            response_ids=qa.response_ids,
            response_mask=[1] * len(qa.response_ids),
            response_logprobs=qa.logprobs,
            num_turns=2,
            metrics=metrics,
            extra_fields={**output.extra_fields, **qa.versions},
        )
        # Stage qa: the memory transcript is all fixed-role tokens (nothing to train), so only the QA row.
        return answer

    async def ct_build_initial_tokens(
        self, messages, tools=None, images=None, videos=None, audios=None, mm_inputs_out=None
    ):
        if images or videos or audios:
            return await super().ct_build_initial_tokens(messages, tools, images, videos, audios, mm_inputs_out)
        key = [
            getattr(self.tokenizer, "name_or_path", ""),
            getattr(self.tokenizer, "chat_template", None),
            type(self.continuous_token_builder).__name__,
            self.apply_chat_template_kwargs,
            self.rollout_config.prompt_length,
            messages,
            tools,
        ]
        build = super().ct_build_initial_tokens
        return await self.loop_context.prompt_ids(key, lambda: build(messages, tools, mm_inputs_out=mm_inputs_out))

    def _export_and_release(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        if self._namespace is None:
            return None, None
        manager = self._memory_tool.manager
        delta = manager.get(self._namespace).export_delta()
        return delta, manager.release(self._namespace)

    async def _handle_pending_state(self, agent_data: AgentData, sampling_params: dict[str, Any]) -> AgentState:
        store = await self._memory_tool.store_for(agent_data)
        self._namespace, self._request_id = store.namespace, agent_data.request_id
        return await super()._handle_pending_state(agent_data, sampling_params)

    async def _handle_generating_state(
        self, agent_data: AgentData, sampling_params: dict[str, Any], ignore_termination: bool = False
    ) -> AgentState:
        """One memory turn, by the policy or, when the memory role is fixed (stage qa), by the fixed model
        with ``response_mask = 0`` (the role not being trained never enters the loss)."""
        fixed = self.fixed_role == "memory"
        start = len(agent_data.response_mask)
        if self.max_new_tokens is not None:
            sampling_params = {**sampling_params, "max_tokens": int(self.max_new_tokens)}
        policy_server = self.server_manager
        if fixed:
            self.server_manager = self.fixed_model
            sampling_params = self._fixed_sampling(sampling_params)
        # verl's ToolAgentLoop keeps the first reply's extra_fields (the policy version that sampled it, which
        # verl's trainer needs on every row) only while extra_fields is empty, and the memory tools have put
        # the store's namespace there already: it is set aside for that turn (no tool runs during it).
        ours = {} if agent_data.assistant_turns else agent_data.extra_fields.copy()
        for key in ours:
            del agent_data.extra_fields[key]
        try:
            state = await super()._handle_generating_state(agent_data, sampling_params, ignore_termination)
        finally:
            self.server_manager = policy_server
            agent_data.extra_fields.update(ours)
        if fixed:
            agent_data.response_mask[start:] = [0] * (len(agent_data.response_mask) - start)
        if state == AgentState.TERMINATED:
            agent_data.extra_fields[TERMINATION_KEY] = self._why_generation_stopped(agent_data)
        return state

    def _fixed_sampling(self, sampling_params: dict[str, Any]) -> dict[str, Any]:
        """The fixed role's decoder: :data:`~memupdate.serving.decoding.GREEDY` at ``fixed_temperature``,
        whatever top_p, top_k and penalty the trained role samples with, so the QA phase asks the QA model
        exactly as the reader scorer and the evaluation do; None = the rollout's own sampling."""
        if self.fixed_temperature is None:
            return sampling_params
        return {**sampling_params, **replace(GREEDY, temperature=float(self.fixed_temperature)).params()}

    def _chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, **self.apply_chat_template_kwargs
        )
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    async def _answer(self, info: Mapping[str, Any], sampling_params: dict[str, Any]) -> QAAnswer:
        """The QA phase: one fresh user message, the QA prompt over the final store's memories."""
        question = info.get("question")
        if not question:
            raise ValueError("the QA phase needs extra_info.question in the row")
        store = self._memory_tool.manager.get(self._namespace)
        hits = await store.asearch(question, self.qa_top_k)
        memories = within_budget([h.record for h in hits], self.qa_context_chars)
        messages = qa_messages(self.qa_prompt, question, int(info.get("category") or 0), memories, info.get("choices"))
        prompt_ids = await self.loop.run_in_executor(None, self._chat_ids, messages)
        if len(prompt_ids) > self.prompt_length:
            raise ValueError(
                f"the QA prompt of {info.get('namespace')!r} has {len(prompt_ids)} tokens, over rollout.prompt_length "
                f"{self.prompt_length}; raise prompt_length or lower reward.context_chars"
            )
        fixed = self.fixed_role == "qa"
        client = self.fixed_model if fixed else self.server_manager
        params = {
            **(self._fixed_sampling(sampling_params) if fixed else sampling_params),
            "max_tokens": self.qa_max_tokens,
        }
        began = time.perf_counter()
        out = await client.generate(request_id=self._request_id, prompt_ids=prompt_ids, sampling_params=params)
        ids = list(out.token_ids)[: self.qa_max_tokens]
        logprobs = list(out.log_probs)[: len(ids)] if out.log_probs else None
        text = self.tokenizer.decode(ids, skip_special_tokens=True).strip()
        return QAAnswer(prompt_ids, ids, logprobs, text, time.perf_counter() - began, weight_versions(out))

    async def _handle_processing_tools_state(self, agent_data: AgentData) -> AgentState:
        state = await super()._handle_processing_tools_state(agent_data)
        if state == AgentState.TERMINATED:
            agent_data.extra_fields[TERMINATION_KEY] = "response_budget"
        return state

    def _why_generation_stopped(self, agent_data: AgentData) -> str:
        # Same order as ToolAgentLoop's checks: a limit stops the episode before tool calls are parsed.
        if len(agent_data.response_mask) >= self.response_length:
            return "response_budget"
        if self.max_assistant_turns and agent_data.assistant_turns >= self.max_assistant_turns:
            return "max_assistant_turns"
        if self.max_user_turns and agent_data.user_turns >= self.max_user_turns:
            return "max_user_turns"
        text = self.tokenizer.decode(agent_data.response_ids, skip_special_tokens=True)
        return "done" if self.done_marker and self.done_marker in text else "no_tool_call"
