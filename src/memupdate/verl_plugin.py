"""Registrations with verl, loaded by ``import verl`` in every process through the ``verl.plugins``
entry point (pyproject.toml), so Ray workers see our agent loops, tools, reward managers and the ``cpu``
platform without a forked verl; then the narrow patches of :mod:`memupdate.verl_ext.patches` (inert
unless the ``cpu`` platform is selected) and, on that platform, verl's FSDP engines for the ``cpu`` device.

verl swallows plugin import errors at DEBUG level, so each registration module is imported here
explicitly and a failure is logged at ERROR before it is re-raised.
"""

from __future__ import annotations

import importlib
import logging

from memupdate.verl_ext.cpu_platform import register_engines
from memupdate.verl_ext.patches import apply_patches

logger = logging.getLogger(__name__)

# Modules whose import registers something with verl (agent loops, reward managers, the cpu platform, the
# memupdate_vllm rollout, the memupdate_sync trainer).
REGISTRATION_MODULES: tuple[str, ...] = (
    "memupdate.verl_ext.cpu_platform",
    "memupdate.verl_ext.external_vllm",
    "memupdate.agents.memory_loop",
    "memupdate.agents.memagent",
    "memupdate.rewards.manager",
    "memupdate.rewards.memagent",
    "memupdate.verl_ext.trainer",
)

for _module in REGISTRATION_MODULES:
    try:
        importlib.import_module(_module)
    except Exception:
        logger.exception("memupdate verl plugin: importing %s failed", _module)
        raise

apply_patches()
register_engines()
