"""verl's agent-loop and reward-loop workers in one process, without Ray.

verl 0.9.1 runs ``AgentLoopWorker`` and ``RewardLoopWorker`` as Ray actors and hands the agent-loop worker
Ray handles of the reward workers (``handle.compute_score.remote(data)``). The local backend, the
evaluation and the rollout benchmark run both in the calling process instead: the handle below offers
the same call on an in-process worker, and times it.
"""

from __future__ import annotations

import time
from typing import Any

from omegaconf import DictConfig
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
from verl.experimental.reward_loop.reward_loop import RewardLoopWorker


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


def in_process_workers(
    config: Any, llm_client: Any, timer: dict[str, float] | None = None, *, reward: bool = True
) -> AgentLoopWorker:
    """An ``AgentLoopWorker`` for ``config`` that generates with ``llm_client`` (anything with verl's
    ``generate``: the HF server, a :class:`~memupdate.serving.vllm.VLLMTokenClient`) and scores with an
    in-process ``RewardLoopWorker``. Pass ``timer`` (a dict with a ``"reward"`` key) to time the reward;
    ``reward=False`` runs the episodes only (evaluation scores its own way, and asks questions without a
    gold answer, which the training reward refuses)."""
    if not reward:
        return AgentLoopWorker(config, llm_client=llm_client, reward_loop_worker_handles=None)
    timer = timer if timer is not None else {"reward": 0.0}
    timer.setdefault("reward", 0.0)
    scorer = RewardLoopWorker(config)
    return AgentLoopWorker(
        config, llm_client=llm_client, reward_loop_worker_handles=[InProcessRewardHandle(scorer, timer)]
    )


#: Prompt budget for LoCoMo rows: the system prompt with six tool schemas is ~2.2k tokens with the tiny
#: tokenizer. A vLLM server for these episodes needs ``max_model_len >= LOOP_PROMPT_LENGTH + response_length``.
LOOP_PROMPT_LENGTH = 3072
LOOP_MAX_MODEL_LEN = 4096


def vllm_loop_config(
    model_dir: str, train_file: str, memories: str, embeddings: str, run_dir: str, *,
    rollout_n: int, max_assistant_turns: int, response_length: int = 768,
) -> DictConfig:
    """verl's config for our MemoryUpdate loop on ``train_file`` rows against a vLLM server of
    ``model_dir``, with the training reward (no memory-count cap, so a short episode is not penalised for
    the base store's size). Like :func:`~memupdate.training.local.run_config`, it writes
    ``run_dir/agent_loops.yaml`` and sets the ``MEMUPDATE_*`` variables the tools YAML reads."""
    from memupdate.training.local import LocalGRPOConfig, run_config  # local.py imports this module

    if LOOP_PROMPT_LENGTH + response_length > LOOP_MAX_MODEL_LEN:
        raise ValueError(
            f"response_length {response_length} + prompt {LOOP_PROMPT_LENGTH} exceeds the server's {LOOP_MAX_MODEL_LEN}"
        )
    return run_config(LocalGRPOConfig(
        model_path=str(model_dir), train_files=[str(train_file)], run_dir=str(run_dir),
        tool_config="config/tools/memory_tools.yaml", memories=str(memories), embeddings=str(embeddings),
        rollout_n=rollout_n, prompt_length=LOOP_PROMPT_LENGTH, response_length=response_length,
        max_assistant_turns=max_assistant_turns, reward={"efficiency": {"max_total_memories": None}},
    ))
