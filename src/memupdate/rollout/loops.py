"""The one translation of a run's settings into verl's agent-loop config (``agent_loops.yaml``), for verl's
trainer (:mod:`memupdate.training.verl_launcher`) and the in-process runs (:mod:`memupdate.rollout.config`)
alike, so that training, the cold start's demonstrations and the evaluations play the same episode.
Imports nothing of verl: the launcher writes a run's files before verl starts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from memupdate.agents.fields import AGENT_LOOPS
from memupdate.settings import QA_PHASE_KEYS, RewardSettings


def agent_loop_entry(agent_name: str, arguments: Mapping[str, Any], *, deterministic_ids: bool) -> dict[str, Any]:
    """One entry of verl's agent-loop config (``agent_loops.yaml``): the loop ``agent_name`` (a key of
    :data:`~memupdate.agents.fields.AGENT_LOOPS`) and its constructor's ``arguments``. verl's trainer
    (:mod:`memupdate.training.verl_launcher`) and the in-process runs (:func:`~memupdate.rollout.config.run_config`)
    both write theirs with it; ``deterministic_ids`` for the in-process runs, whose request ids make them
    reproducible."""
    return {
        "name": agent_name,
        "_target_": AGENT_LOOPS[agent_name],
        "deterministic_ids": deterministic_ids,
        **arguments,
    }


def memory_loop_arguments(
    *,
    trained_role: str,
    fixed_model: Mapping[str, Any] | None,
    qa_phase: bool,
    reward: Mapping[str, Any] | None,
    max_new_tokens: int | None,
    fixed_temperature: float | None = 0.0,
) -> dict[str, Any]:
    """The memory loop's constructor arguments for a run
    (:class:`~memupdate.agents.memory_loop.MemoryUpdateAgentLoop`), for verl's trainer and the in-process runs
    alike: the trained role, the served model playing the other one, whether it plays the QA phase, the QA phase's
    retrieval, prompt and answer cap (the reward's, so that the reader scores the answers it would give itself:
    :data:`~memupdate.settings.QA_PHASE_KEYS` and ``qa_max_tokens``) and the episode's per-turn cap."""
    reward = reward or {}
    return {
        "trained_role": trained_role,
        "qa_phase": qa_phase,
        "fixed_model": dict(fixed_model) if fixed_model else None,
        "fixed_temperature": fixed_temperature,
        "qa": {key: value for key, value in reward.items() if key in QA_PHASE_KEYS},
        "qa_max_tokens": int(reward.get("qa_max_tokens") or RewardSettings.qa_max_tokens),
        "max_new_tokens": max_new_tokens,
    }
