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
import logging
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
from verl.experimental.agent_loop.tool_agent_loop import AgentData, AgentState, ToolAgentLoop
from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

from memupdate.tools.memory_tools import DELTA_KEY, MemoryTool

logger = logging.getLogger(__name__)

TERMINATION_KEY = "termination_reason"
STATS_KEY = "memory_stats"
TERMINATION_REASONS = ("done", "no_tool_call", "response_budget", "max_assistant_turns", "max_user_turns")

# Deterministic request ids: a prefix the local backend resets each step, and a per-process counter.
_ids = {"prefix": "", "counter": itertools.count()}


def reset_request_ids(prefix: str) -> None:
    """Restart deterministic request ids (the local backend calls this before each rollout)."""
    _ids["prefix"], _ids["counter"] = prefix, itertools.count()


@register("memupdate_agent")
class MemoryUpdateAgentLoop(ToolAgentLoop):
    def __init__(self, *args, done_marker: str = "DONE", deterministic_ids: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
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
        n = next(_ids["counter"])
        return f"{n:08x}" + hashlib.sha256(f"{_ids['prefix']}:{n}".encode()).hexdigest()[:24]

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        try:
            output = await super().run(sampling_params, **kwargs)
        finally:
            # Released even when the episode failed, so a broken trajectory leaks no store.
            delta, stats = self._export_and_release()
        # Every trajectory carries the same keys, with or without tool calls: verl batches them.
        output.extra_fields[DELTA_KEY] = delta
        output.extra_fields[STATS_KEY] = stats
        output.extra_fields.setdefault(TERMINATION_KEY, "response_budget")
        return output

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

    async def _handle_generating_state(
        self, agent_data: AgentData, sampling_params: dict[str, Any], ignore_termination: bool = False
    ) -> AgentState:
        state = await super()._handle_generating_state(agent_data, sampling_params, ignore_termination)
        if state == AgentState.TERMINATED:
            agent_data.extra_fields[TERMINATION_KEY] = self._why_generation_stopped(agent_data)
        return state

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
