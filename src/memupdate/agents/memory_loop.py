"""The MemoryUpdate agent loop: the policy edits its trajectory's trial memory store through tools.

It is verl's ``ToolAgentLoop`` (prompt building, generation, hermes tool calls, limits) plus what
MemoryUpdate needs, through verl's extension points only:

- the trial store is opened before the first turn and released after the last, so every trajectory,
  even one without a tool call, hands the reward its store delta and growth statistics
  (``extra_fields["memory_delta"]``, ``["memory_stats"]``);
- the episode ends on verl's limits (response budget, assistant/user turns) or when the model replies
  without a tool call (``DONE`` is the documented way); the reason is recorded in
  ``extra_fields["termination_reason"]``;
- request ids can be made deterministic (``deterministic_ids``) for the local backend's reproducible
  runs; their first 8 characters stay unique per process, as trial namespaces need.

Registered as ``memupdate_agent`` (the rows' ``agent_name``); ``config/verl/agent_loops.yaml`` wires the
same class for the verl backend.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf
from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
from verl.experimental.agent_loop.tool_agent_loop import AgentData, AgentState, ToolAgentLoop
from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

from memupdate.serving.client import Endpoint
from memupdate.serving.vllm import GenerationMeter, VLLMTokenClient
from memupdate.tools.memory_tools import DELTA_KEY, MemoryTool, format_record

logger = logging.getLogger(__name__)

TERMINATION_KEY = "termination_reason"
STATS_KEY = "memory_stats"
TERMINATION_REASONS = ("done", "no_tool_call", "response_budget", "max_assistant_turns", "max_user_turns")
ANSWER_KEY = "qa_answer"
STAGE_KEY = "training_stage"
STAGES = ("memory", "qa", "joint")

QA_PROMPT = (
    "The memory database is final. Using only the memories below, answer the question in a few words.\n\n"
    "Memories:\n{memories}\n\nQuestion: {question}"
)

# Initial prompt ids by (template, messages, tools): a GRPO batch holds every prompt n times, and
# rendering the chat template with six tool schemas and tokenising ~2k tokens is the loop's largest
# per-episode CPU cost, on the event loop's executor while other episodes wait. Bounded; oldest out first.
_PROMPT_IDS: OrderedDict[str, tuple[int, ...]] = OrderedDict()
PROMPT_CACHE_SIZE = 1024

# Fixed-model clients by (endpoint, max_tokens); see fixed_client.
_FIXED_CLIENTS: dict[str, GenerationMeter] = {}

# Deterministic request ids: a prefix the local backend resets each step, and a per-process counter.
_ids = {"prefix": "", "counter": itertools.count()}


def reset_request_ids(prefix: str) -> None:
    """Restart deterministic request ids (the local backend calls this before each rollout)."""
    _ids["prefix"], _ids["counter"] = prefix, itertools.count()


def next_request_id() -> str:
    """The next deterministic request id: 8 hex digits of a per-process counter (unique prefixes, as trial
    namespaces need), then a hash of the prefix :func:`reset_request_ids` set and the counter."""
    n = next(_ids["counter"])
    return f"{n:08x}" + hashlib.sha256(f"{_ids['prefix']}:{n}".encode()).hexdigest()[:24]


def fixed_client(spec: Any, max_tokens: int) -> Any:
    """The fixed model's client: an object with verl's ``generate`` is used as is; an endpoint mapping
    (``{base_url, model, ...}``, as agent_loops.yaml gives it) becomes a :class:`VLLMTokenClient` behind a
    :class:`GenerationMeter`. The mapping's ``max_tokens`` caps each of its turns (default ``max_tokens``),
    as the policy's own cap does.

    One client per endpoint and cap in a process, shared by every trajectory: verl builds a loop per
    trajectory, and a client of its own would open an HTTP session and ask the server for its context
    length each time. :func:`fixed_clients` lists them (the local backend reads their meters)."""
    if spec is None or hasattr(spec, "generate"):
        return spec
    if isinstance(spec, DictConfig):
        spec = OmegaConf.to_container(spec, resolve=True)
    if not isinstance(spec, Mapping):
        raise ValueError(f"fixed_model must be an endpoint {{base_url, model}} or a client, got {spec!r}")
    spec = dict(spec)
    max_tokens = int(spec.pop("max_tokens", max_tokens))
    key = json.dumps([spec, max_tokens], sort_keys=True, default=str)
    client = _FIXED_CLIENTS.get(key)
    if client is None:
        client = _FIXED_CLIENTS[key] = GenerationMeter(VLLMTokenClient(Endpoint.from_dict(spec), max_tokens=max_tokens))
    return client


def fixed_clients() -> list[GenerationMeter]:
    """The fixed-model clients this process has made (see :func:`fixed_client`)."""
    return list(_FIXED_CLIENTS.values())


@register("memupdate_agent")
class MemoryUpdateAgentLoop(ToolAgentLoop):
    def __init__(
        self,
        *args,
        done_marker: str = "DONE",
        deterministic_ids: bool = False,
        training_stage: str = "memory",
        qa_phase: bool = False,
        fixed_model: Any = None,
        qa_top_k: int = 5,
        qa_max_tokens: int = 32,
        **kwargs,
    ):
        """``training_stage`` says which role the policy plays and which tokens enter the loss: ``memory``
        (edits memory; a QA phase, if any, is generated by ``fixed_model``), ``qa`` (answers from memory
        that ``fixed_model`` edited) or ``joint`` (both, one policy). The fixed role's tokens get
        ``response_mask = 0``. ``fixed_model`` is any object with verl's ``generate`` (a served model's
        :class:`~memupdate.serving.vllm.VLLMTokenClient`, or a local generator)."""
        super().__init__(*args, **kwargs)
        if training_stage not in STAGES:
            raise ValueError(f"training_stage must be one of {STAGES}, got {training_stage!r}")
        self.training_stage = training_stage
        self.qa_phase = qa_phase or training_stage in ("qa", "joint")
        fixed_role = {"memory": "qa" if self.qa_phase else None, "qa": "memory", "joint": None}[training_stage]
        if fixed_role is not None and fixed_model is None:
            raise ValueError(
                f"training_stage={training_stage!r} needs fixed_model to play the {fixed_role} role "
                "(a served model: run the serve rule, its readiness marker names the endpoint)"
            )
        self.fixed_role = fixed_role
        self.fixed_model = fixed_client(fixed_model, self.response_length)
        self.qa_top_k = qa_top_k
        self.qa_max_tokens = qa_max_tokens
        self._phase = "memory"
        memory_tools = [t for t in self.tools.values() if isinstance(t, MemoryTool)]
        if not memory_tools:
            raise ValueError(
                "memupdate_agent needs the memory tools: set actor_rollout_ref.rollout.multi_turn.tool_config_path "
                "to config/tools/memory_tools.yaml"
            )
        self._memory_tool = memory_tools[0]
        self._use_chatml_builder()
        self.done_marker = done_marker
        self.deterministic_ids = deterministic_ids
        self._namespace: str | None = None

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
        # which would put them all in one trial store; a per-process counter keeps them apart.
        return next_request_id()

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        self._sampling_params = sampling_params
        self._question = (kwargs.get("extra_info") or {}).get("question")
        try:
            output = await super().run(sampling_params, **kwargs)
        finally:
            # Released even when the episode failed, so a broken trajectory leaks no store.
            delta, stats = self._export_and_release()
        # Every trajectory carries the same keys, with or without tool calls: verl batches them.
        output.extra_fields[DELTA_KEY] = delta
        output.extra_fields[STATS_KEY] = stats
        output.extra_fields.setdefault(TERMINATION_KEY, "response_budget")
        output.extra_fields[STAGE_KEY] = self.training_stage
        output.extra_fields.setdefault(ANSWER_KEY, None)
        return output

    async def ct_build_initial_tokens(self, messages, tools=None, images=None, videos=None, audios=None, mm_inputs_out=None):
        if images or videos or audios:
            return await super().ct_build_initial_tokens(messages, tools, images, videos, audios, mm_inputs_out)
        key = hashlib.sha256(json.dumps(
            [getattr(self.tokenizer, "name_or_path", ""), getattr(self.tokenizer, "chat_template", None),
             type(self.continuous_token_builder).__name__, self.apply_chat_template_kwargs,
             self.rollout_config.prompt_length, messages, tools],
            sort_keys=True, default=str,
        ).encode()).hexdigest()  # fmt: skip
        ids = _PROMPT_IDS.get(key)
        if ids is None:
            ids = tuple(await super().ct_build_initial_tokens(messages, tools, mm_inputs_out=mm_inputs_out))
            _PROMPT_IDS[key] = ids
            if len(_PROMPT_IDS) > PROMPT_CACHE_SIZE:
                _PROMPT_IDS.popitem(last=False)
        return list(ids)

    def _export_and_release(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        if self._namespace is None:
            return None, None
        manager = self._memory_tool.manager
        delta = manager.get(self._namespace).export_delta()
        return delta, manager.release(self._namespace)

    async def _handle_pending_state(self, agent_data: AgentData, sampling_params: dict[str, Any]) -> AgentState:
        store = await self._memory_tool.store_for(agent_data)
        self._namespace = store.namespace
        return await super()._handle_pending_state(agent_data, sampling_params)

    async def _generate_turn(
        self, agent_data: AgentData, sampling_params: dict[str, Any], ignore_termination: bool = False
    ) -> AgentState:
        """One assistant turn, by the policy or, for the fixed role, by the fixed model with mask 0."""
        fixed = self.fixed_role == self._phase
        start = len(agent_data.response_mask)
        policy_server = self.server_manager
        if fixed:
            self.server_manager = self.fixed_model
        try:
            state = await super()._handle_generating_state(agent_data, sampling_params, ignore_termination)
        finally:
            self.server_manager = policy_server
        if fixed:
            # The role not being trained never enters the loss (upstream set a flag nothing read).
            agent_data.response_mask[start:] = [0] * (len(agent_data.response_mask) - start)
        return state

    async def _handle_generating_state(
        self, agent_data: AgentData, sampling_params: dict[str, Any], ignore_termination: bool = False
    ) -> AgentState:
        state = await self._generate_turn(agent_data, sampling_params, ignore_termination)
        if state == AgentState.TERMINATED and self._phase == "memory":
            agent_data.extra_fields[TERMINATION_KEY] = self._why_generation_stopped(agent_data)
            if self.qa_phase and len(agent_data.response_mask) < self.response_length:
                await self._answer(agent_data)
        return state

    async def _answer(self, agent_data: AgentData) -> None:
        """The QA phase: a user turn with the top-k memories of the final store (mask 0), then the
        answer (mask 1 if the policy plays the QA role)."""
        if not self._question:
            raise ValueError("the QA phase needs extra_info.question in the row")
        self._phase = "qa"
        store = self._memory_tool.manager.get(self._namespace)
        hits = await store.asearch(self._question, self.qa_top_k)
        memories = "\n".join(format_record(h.record) for h in hits) or "(no memories found)"
        previous = list(agent_data.messages)
        agent_data.messages.append(
            {"role": "user", "content": QA_PROMPT.format(memories=memories, question=self._question)}
        )
        schemas = getattr(agent_data, "_active_tool_schemas", self.tool_schemas)
        merge, mask, logprobs = await self.ct_merge_context_msg(
            previous, agent_data.messages, agent_data.prompt_ids, agent_data.response_mask,
            agent_data.response_logprobs or None, tools=schemas,
        )
        if len(mask) >= self.response_length:
            # No room left to answer: the episode ends unanswered (scored as such) and says why.
            logger.warning("QA prompt does not fit in response_length=%d; raise it", self.response_length)
            agent_data.extra_fields[TERMINATION_KEY] = "response_budget"
            return
        agent_data.prompt_ids, agent_data.response_mask = merge.token_ids, mask
        if agent_data.response_logprobs:
            agent_data.response_logprobs = logprobs or []
        agent_data.user_turns += 1
        params = {**self._sampling_params, "max_tokens": self.qa_max_tokens}
        await self._generate_turn(agent_data, params, ignore_termination=True)
        agent_data.extra_fields[ANSWER_KEY] = self.tokenizer.decode(agent_data.response_ids, skip_special_tokens=True).strip()

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
