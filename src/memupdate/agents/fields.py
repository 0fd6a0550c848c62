"""What agent loops hand downstream, without importing verl.

verl loads ``memupdate.verl_plugin`` at the end of ``import verl``, and the plugin imports every module
that registers with verl. When the first module of a process to import verl is one of ours, that module
is still half-initialised while the plugin runs, so no registration module may import a name from
another one: the names they share (``extra_fields`` keys, request ids) live here, and this module
imports nothing of verl.
"""

from __future__ import annotations

import hashlib
import itertools

#: The trajectory's store delta (memory tools and the memory loop write it; rewards and evaluation read it).
DELTA_KEY = "memory_delta"
#: The memory loop's keys: why the episode ended, the store's growth statistics, the QA phase's answer,
#: the trained role, and the QA turn as a row of its own (two-stage training's QA role).
TERMINATION_KEY = "termination_reason"
STATS_KEY = "memory_stats"
ANSWER_KEY = "qa_answer"
STAGE_KEY = "training_stage"
QA_CONTEXT_KEY = "qa_context_tokens"

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

# Deterministic request ids: a prefix the local backend resets each step, and a per-process counter.
_ids = {"prefix": "", "counter": itertools.count()}


def reset_request_ids(prefix: str) -> None:
    """Restart deterministic request ids (the local backend calls this before each rollout)."""
    _ids["prefix"], _ids["counter"] = prefix, itertools.count()


def next_request_id() -> str:
    """The next deterministic request id: 8 hex digits of a per-process counter (ids sort in the order they
    were made), then a hash of the prefix :func:`reset_request_ids` set and the counter.

    >>> reset_request_ids("seed:0"); a = next_request_id(); reset_request_ids("seed:0")
    >>> next_request_id() == a and a.startswith("00000000") and len(a) == 32
    True
    """
    n = next(_ids["counter"])
    return f"{n:08x}" + hashlib.sha256(f"{_ids['prefix']}:{n}".encode()).hexdigest()[:24]
