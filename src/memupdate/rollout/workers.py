"""verl's agent-loop and reward-loop workers in one process, without Ray.

verl 0.9.1 runs ``AgentLoopWorker`` and ``RewardLoopWorker`` as Ray actors and hands the agent-loop worker
Ray handles of the reward workers (``handle.compute_score.remote(data)``). Evaluation, the cold
start and the rollout benchmark (each with a :class:`~memupdate.rollout.config.RolloutConfig`) run both
in the calling process instead: the handle below offers
the same call on an in-process worker, and times it.
"""

from __future__ import annotations

import time
from typing import Any

import hydra
import numpy as np
import torch
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopWorker,
    DictConfigWrap,
    ToolListWrap,
    _agent_loop_registry,
)
from verl.experimental.reward_loop.reward_loop import RewardLoopWorker
from verl.utils.rollout_trace import rollout_trace_attr

from memupdate.agents.context import LoopContext


class _Remote:
    """``handle.compute_score.remote(data)`` for an in-process worker (what a Ray handle offers)."""

    def __init__(self, fn):
        self.fn = fn

    async def remote(self, *args, **kwargs):
        return await self.fn(*args, **kwargs)


class InProcessRewardHandle:
    """A reward worker reached as verl reaches a Ray actor; ``timer["reward"]`` accumulates its seconds."""

    def __init__(self, worker: RewardLoopWorker, timer: dict[str, float]):
        async def timed(data):
            start = time.perf_counter()
            try:
                return await worker.compute_score(data)
            finally:
                timer["reward"] += time.perf_counter() - start

        self.compute_score = _Remote(timed)


#: Non-tensor columns the multi-output worker adds: the input row a turn came from, its place in the
#: trajectory, and whether it is the trajectory's last (scored) turn.
TRAJECTORY_KEY, TURN_INDEX_KEY, FINAL_MASK_KEY = "trajectory", "turn_index", "final_mask"


class MultiOutputAgentLoopWorker(AgentLoopWorker):
    """verl's ``AgentLoopWorker`` for loops whose trajectory is several conversations (MemAgent returns one
    :class:`AgentLoopOutput` per turn). verl 0.9.1's V1 trainer takes such lists through its TransferQueue
    worker; this worker gives the in-process paths (evaluation, the cold start, benchmark) the same: each
    turn becomes a row, scored once from the whole trajectory (the reward sees every turn, the final one
    last) with that score copied to every turn, as the V1 worker does. Rows carry ``trajectory`` (the
    input row), ``turn_index`` and ``final_mask``. A loop returning a single output gives exactly the rows
    ``AgentLoopWorker`` would, plus those three columns.

    It also takes two per-trajectory costs off the event loop, where they delay every other episode's
    requests (``memupdate bench rollout`` measures the loop against the raw server): verl builds each
    trajectory's agent loop with ``hydra.utils.instantiate`` (about 8 ms of OmegaConf merging and copying
    per episode, for the same resolved constructor every time), and pads every output with
    ``tokenizer.pad`` (a generic Python path). Here the constructor is resolved once per agent name, and
    padding is two tensor writes with the same result.

    The worker owns the :class:`~memupdate.agents.context.LoopContext` its loops share (prompt ids,
    fixed-model clients, request ids), so its owner reads it and it goes with the worker."""

    def __init__(self, *args, loop_context: LoopContext | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.loop_context = loop_context or LoopContext()
        self._agent_loop_factories: dict[str, Any] = {}

    def _new_agent_loop(self, agent_name: str) -> Any:
        """A fresh agent loop for one trajectory, built as verl builds it, from a constructor resolved once."""
        factory = self._agent_loop_factories.get(agent_name)
        if factory is None:
            if agent_name not in _agent_loop_registry:
                raise ValueError(
                    f"agent loop {agent_name!r} is not registered; registered: {sorted(_agent_loop_registry)}"
                )
            factory = hydra.utils.instantiate(
                config=_agent_loop_registry[agent_name],
                _partial_=True,
                trainer_config=DictConfigWrap(config=self.config),
                server_manager=self.llm_client,
                tokenizer=self.tokenizer,
                processor=self.processor,
                hf_model_type=self.hf_model_type,
                dataset_cls=self.dataset_cls,
                data_config=DictConfigWrap(self.config.data),
                tools=ToolListWrap(self.tools),
                loop_context=self.loop_context,
            )
            self._agent_loop_factories[agent_name] = factory
        return factory()

    async def _run_agent_loop(self, sampling_params, trajectory, *, agent_name, trace=True, **kwargs):
        with rollout_trace_attr(
            step=trajectory["step"],
            sample_index=trajectory["sample_index"],
            rollout_n=trajectory["rollout_n"],
            validate=trajectory["validate"],
            name="agent_loop",
            trace=trace,
        ):
            output = await self._new_agent_loop(agent_name).run(sampling_params, **kwargs)
            return await self._agent_loop_postprocess(output, trajectory["validate"], **kwargs)

    def _pad_token_ids(
        self, tokens: list[int], *, max_length: int, padding_side: str, return_attention_mask: bool
    ) -> dict[str, torch.Tensor]:
        """``tokens`` padded to ``(1, max_length)`` on ``padding_side``, as verl's ``tokenizer.pad`` call does
        (a longer list is kept whole, not truncated)."""
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        length = max(max_length, len(tokens))
        ids = torch.full((1, length), pad_id, dtype=torch.long)
        mask = torch.zeros((1, length), dtype=torch.long)
        if tokens:
            span = slice(length - len(tokens), length) if padding_side == "left" else slice(0, len(tokens))
            ids[0, span] = torch.tensor(tokens, dtype=torch.long)
            mask[0, span] = 1
        return {"input_ids": ids, "attention_mask": mask} if return_attention_mask else {"input_ids": ids}

    async def _agent_loop_postprocess(self, output, validate, **kwargs):
        if not isinstance(output, list):
            return await super()._agent_loop_postprocess(output, validate, **kwargs)
        if not output:
            raise ValueError(f"agent loop {kwargs.get('agent_name')!r} returned no output for one row")
        await self._compute_score(output, kwargs=kwargs)
        final = output[-1]
        for turn in output[:-1]:
            turn.reward_score = final.reward_score
            turn.extra_fields["reward_extra_info"] = final.extra_fields.get("reward_extra_info", {})
        return [
            await super(MultiOutputAgentLoopWorker, self)._agent_loop_postprocess(o, validate, **kwargs) for o in output
        ]

    def _postprocess(self, inputs, input_non_tensor_batch=None, validate=False):
        groups = [item if isinstance(item, list) else [item] for item in inputs]
        rows = [turn for group in groups for turn in group]
        trajectory = np.array([i for i, group in enumerate(groups) for _ in group], dtype=np.int64)
        turn_index = np.array([j for group in groups for j in range(len(group))], dtype=np.int64)
        final = np.array([j == len(group) - 1 for group in groups for j in range(len(group))], dtype=bool)
        if input_non_tensor_batch:
            input_non_tensor_batch = {k: v[trajectory] for k, v in input_non_tensor_batch.items()}
        out = super()._postprocess(rows, input_non_tensor_batch=input_non_tensor_batch, validate=validate)
        out.non_tensor_batch.update({TRAJECTORY_KEY: trajectory, TURN_INDEX_KEY: turn_index, FINAL_MASK_KEY: final})
        return out


def in_process_workers(
    config: Any,
    llm_client: Any,
    timer: dict[str, float] | None = None,
    *,
    reward: bool = True,
    loop_context: LoopContext | None = None,
) -> MultiOutputAgentLoopWorker:
    """An ``AgentLoopWorker`` for ``config`` that generates with ``llm_client`` (anything with verl's
    ``generate``: the HF server, a :class:`~memupdate.serving.token_client.VLLMTokenClient`) and scores with an
    in-process ``RewardLoopWorker``. Pass ``timer`` (a dict with a ``"reward"`` key) to time the reward;
    ``reward=False`` runs the episodes only (evaluation scores its own way, and asks questions without a
    gold answer, which the training reward refuses). ``loop_context`` is what its loops share (a new one by
    default; name it when several workers of one process make deterministic request ids)."""
    handles = None
    if reward:
        timer = timer if timer is not None else {"reward": 0.0}
        timer.setdefault("reward", 0.0)
        handles = [InProcessRewardHandle(RewardLoopWorker(config), timer)]
    return MultiOutputAgentLoopWorker(
        config, llm_client=llm_client, reward_loop_worker_handles=handles, loop_context=loop_context
    )
