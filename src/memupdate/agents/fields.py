"""What agent loops hand downstream, without importing verl.

verl loads ``memupdate.verl_plugin`` at the end of ``import verl``, and the plugin imports every module
that registers with verl. When the first module of a process to import verl is one of ours, that module
is still half-initialised while the plugin runs, so no registration module may import a name from
another one: the names they share (``extra_fields`` keys, the agent loops' classes, the reward managers'
names) live here, and this module
imports nothing of verl.
"""

from __future__ import annotations

from typing import Any

from memupdate.names import MEMAGENT_AGENT, MEMORY_AGENT

#: Where each agent loop's class lives (verl's agent-loop config ``_target_``), by the name rows carry.
AGENT_LOOPS = {
    MEMORY_AGENT: "memupdate.agents.memory_loop.MemoryUpdateAgentLoop",
    MEMAGENT_AGENT: "memupdate.agents.memagent.MemAgentLoop",
}

#: The reward managers, by the name verl's reward-loop registry knows them (``reward.reward_manager.name``).
MEMORY_REWARD, MEMAGENT_REWARD = "memupdate_memory", "memupdate_memagent"

#: The trajectory's store delta (memory tools and the memory loop write it; rewards and evaluation read it).
DELTA_KEY = "memory_delta"
#: The memory loop's keys: why the episode ended, the store's growth statistics, the QA phase's answer,
#: the trained role, and the QA turn as a row of its own (two-stage training's QA role).
TERMINATION_KEY = "termination_reason"
STATS_KEY = "memory_stats"
ANSWER_KEY = "qa_answer"
ROLE_KEY = "trained_role"
QA_CONTEXT_KEY = "qa_context_tokens"

#: The policy versions (training steps) whose weights sampled a row: verl's server client puts them in each reply's
#: ``extra_fields`` and verl's V1 trainer needs them on every row (its staleness metrics).
WEIGHT_VERSION_KEYS = ("min_global_steps", "max_global_steps")


def weight_versions(*replies: Any) -> dict[str, Any]:
    """The oldest and newest policy version among ``replies`` (verl ``TokenOutput`` objects); None where a
    reply carries none (a server that is not verl's, e.g. evaluation's or the fixed model's).

    >>> from types import SimpleNamespace as R
    >>> weight_versions(R(extra_fields={"min_global_steps": 3, "max_global_steps": 3}),
    ...                 R(extra_fields={"min_global_steps": 4, "max_global_steps": 5}))
    {'min_global_steps': 3, 'max_global_steps': 5}
    >>> weight_versions(R(extra_fields={}))
    {'min_global_steps': None, 'max_global_steps': None}
    """
    lows = [r.extra_fields.get("min_global_steps") for r in replies]
    highs = [r.extra_fields.get("max_global_steps") for r in replies]
    lows, highs = [v for v in lows if v is not None], [v for v in highs if v is not None]
    return {"min_global_steps": min(lows) if lows else None, "max_global_steps": max(highs) if highs else None}


#: MemAgent's keys, carried by every turn (verl batches rows by key).
TURN_KEY, FINAL_KEY, CHUNKS_KEY = "memagent_turn", "memagent_final", "memagent_chunks"
MEMAGENT_ANSWER_KEY, TRUNCATIONS_KEY, CONTEXT_KEY = (
    "memagent_answer",
    "memagent_memory_truncations",
    "memagent_context_tokens",
)
#: How much of the haystack a trajectory read: its chunks before any truncation and the tokens centre
#: truncation dropped (0 unless ``max_chunks`` cut it).
CHUNKS_TOTAL_KEY, TRUNCATED_TOKENS_KEY = "memagent_chunks_total", "memagent_truncated_tokens"
#: The memory the final turn answered from (on the final row; None on the others): what evaluation shows.
MEMAGENT_MEMORY_KEY = "memagent_memory"
