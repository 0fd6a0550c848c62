"""A rollout's configuration: what training, evaluation and the benchmarks run their agent loops with.

A :class:`RolloutConfig` says which model runs which agent loop on which rows, with which tools, memory
environment and reward, sampled how. :func:`run_config` turns it into the files and the verl config the
in-process workers (:mod:`memupdate.rollout.workers`) read: ``<run>/agent_loops.yaml`` (the loop and its
arguments), ``<run>/memory_environment.json`` and ``<run>/tools.yaml`` (the tools, pointed at it).

Evaluation, the cold start's demonstrations, the held-out policy evaluation and the benchmarks run on it; verl's
trainer runs the same agent loops in its own workers (:mod:`memupdate.training.verl_launcher`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import verl
from omegaconf import DictConfig, OmegaConf

from memupdate.agents.fields import AGENT_LOOPS, MEMORY_REWARD
from memupdate.memory.environment import MemoryEnvironment
from memupdate.names import MEMORY_AGENT
from memupdate.rollout.loops import agent_loop_entry, memory_loop_arguments
from memupdate.settings import ROLES, VERL_EPISODE_KEYS, EpisodeSettings
from memupdate.tools.config import write_tool_config
from memupdate.utils.io import write_text_atomic


@dataclass(kw_only=True)
class RolloutConfig:
    """The rows, the model, the agent loop with its tools and reward, and the episode (the experiment's
    :class:`memupdate.settings.EpisodeSettings`: lengths, turns, sampling; its defaults)."""

    model_path: str
    train_files: list[str]
    run_dir: str
    #: The memory tools' template (memupdate.tools.config.TOOL_CONFIG) and the store they edit (MemoryUpdate;
    #: a MemAgent rollout has neither).
    tool_config: str | None = None
    memory: MemoryEnvironment | None = None
    #: The agent loop (a key of memupdate.agents.fields.AGENT_LOOPS), and settings passed to it (MemAgent's
    #: chunk_size, ...).
    agent_name: str = MEMORY_AGENT
    agent: dict[str, Any] = field(default_factory=dict)
    #: Reward manager registered with verl's reward loop, and its settings.
    reward_manager: str = MEMORY_REWARD
    reward: dict[str, Any] = field(default_factory=dict)
    #: Which role is trained (memory | qa); see memupdate.agents.memory_loop.
    trained_role: str = "memory"
    #: Add the QA phase to memory-stage episodes (implied by the qa stage).
    qa_phase: bool = False
    #: The served model playing the other role, ``{base_url, model}`` (from its readiness marker).
    fixed_model: dict[str, Any] | None = None
    #: Rollouts per prompt (evaluation: one; GRPO needs a group).
    rollout_n: int = 1
    temperature: float = EpisodeSettings.temperature
    top_p: float = EpisodeSettings.top_p
    max_new_tokens: int | None = EpisodeSettings.max_new_tokens
    prompt_length: int = EpisodeSettings.prompt_length
    response_length: int = EpisodeSettings.response_length
    max_assistant_turns: int = EpisodeSettings.max_assistant_turns
    max_parallel_calls: int = EpisodeSettings.max_parallel_calls
    max_tool_response_length: int = EpisodeSettings.max_tool_response_length
    seed: int = 0
    #: The served role's decoding temperature (greedy, so a GRPO group varies only in what is trained; None:
    #: the rollout's sampling).
    fixed_temperature: float | None = 0.0

    def __post_init__(self) -> None:
        if self.agent_name not in AGENT_LOOPS:
            raise ValueError(f"unknown agent_name {self.agent_name!r}; known: {sorted(AGENT_LOOPS)}")
        if self.trained_role not in ROLES:
            raise ValueError(f"trained_role must be one of {ROLES}, got {self.trained_role!r}")
        if self.rollout_n < 1:
            raise ValueError(f"rollout_n must be at least 1, got {self.rollout_n}")
        if (self.memory is None) != (self.tool_config is None):
            raise ValueError("the memory tools need both tool_config and memory (a MemAgent rollout has neither)")

    @property
    def turn_tokens(self) -> int:
        """The most tokens one turn may generate: the episode's per-turn cap, else its whole response budget."""
        return self.max_new_tokens or self.response_length


def verl_config(cfg: RolloutConfig, agent_loop_config: Path, tool_config: Path | None, memory: Path | None):
    """verl 0.9.1's full trainer config with ``cfg``'s settings and the run's files (its agent loops, tools and
    memory environment); the in-process workers and the reward loop read it. The episode reaches verl's keys as
    the trainer's does (:data:`~memupdate.settings.VERL_EPISODE_KEYS`)."""
    base = Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml"
    conf = OmegaConf.load(base)
    overrides = {
        **{verl_key: getattr(cfg, name) for name, verl_key in VERL_EPISODE_KEYS.items()},
        "actor_rollout_ref.model.path": cfg.model_path,
        # The worker validates the rollout config; the name only has to be a known backend.
        "actor_rollout_ref.rollout.name": "vllm",
        "actor_rollout_ref.rollout.n": cfg.rollout_n,
        # The generated config's interpolations of data.max_prompt_length and data.max_response_length.
        "actor_rollout_ref.rollout.prompt_length": cfg.prompt_length,
        "actor_rollout_ref.rollout.response_length": cfg.response_length,
        "actor_rollout_ref.rollout.calculate_log_probs": False,
        "actor_rollout_ref.rollout.multi_turn.enable": True,
        "actor_rollout_ref.rollout.multi_turn.format": "hermes",
        "actor_rollout_ref.rollout.multi_turn.tool_config_path": str(tool_config) if tool_config else None,
        "actor_rollout_ref.rollout.agent.agent_loop_config_path": str(agent_loop_config),
        "data.return_raw_chat": True,
        # RLHFDataset draws its max_samples subset with this seed (unseeded by default).
        "data.seed": cfg.seed,
        "reward.reward_manager.source": "register",
        "reward.reward_manager.name": cfg.reward_manager,
        "reward.custom_reward_function.reward_kwargs": {
            **({"memory_environment": str(memory)} if memory else {}),
            **cfg.reward,
        },
    }
    for key, value in overrides.items():
        OmegaConf.update(conf, key, value, force_add=True)
    return conf


def loop_arguments(cfg: RolloutConfig) -> dict[str, Any]:
    """The constructor arguments of ``cfg``'s agent loop: the memory loop's from the rollout's settings
    (:func:`memory_loop_arguments`), then ``cfg.agent`` (MemAgent's budgets, ...)."""
    arguments = {}
    if cfg.agent_name == MEMORY_AGENT:
        arguments = memory_loop_arguments(
            trained_role=cfg.trained_role,
            fixed_model=cfg.fixed_model,
            qa_phase=cfg.qa_phase,
            reward=cfg.reward,
            max_new_tokens=cfg.max_new_tokens,
            fixed_temperature=cfg.fixed_temperature,
        )
    return {**arguments, **cfg.agent}


def run_config(cfg: RolloutConfig) -> DictConfig:
    """Write the run's ``agent_loops.yaml`` and, for the memory tools, its ``memory_environment.json`` and
    ``tools.yaml`` into ``cfg.run_dir``, and return verl's config for the in-process workers."""
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    agent_loops = run_dir / "agent_loops.yaml"
    entry = agent_loop_entry(cfg.agent_name, loop_arguments(cfg), deterministic_ids=True)
    write_text_atomic(agent_loops, OmegaConf.to_yaml([entry]))
    memory = tools = None
    if cfg.memory is not None:
        memory = cfg.memory.write(run_dir)
        tools = write_tool_config(cfg.tool_config, memory, run_dir)
    return verl_config(cfg, agent_loops, tools, memory)
