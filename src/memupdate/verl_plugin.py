"""Registrations with verl, loaded by ``import verl`` in every process through the ``verl.plugins``
entry point (pyproject.toml), so Ray workers see our agent loops, tools and reward managers without a
patched verl.

verl swallows plugin import errors at DEBUG level, so each registration module is imported here
explicitly and a failure is logged at ERROR before it is re-raised.
"""

from __future__ import annotations

import importlib
import logging

logger = logging.getLogger(__name__)

# Modules whose import registers something with verl (agent loops, reward managers).
REGISTRATION_MODULES: tuple[str, ...] = (
    "memupdate.agents.memory_loop",
    "memupdate.agents.memagent",
    "memupdate.rewards.manager",
    "memupdate.rewards.memagent",
)

for _module in REGISTRATION_MODULES:
    try:
        importlib.import_module(_module)
    except Exception:
        logger.exception("memupdate verl plugin: importing %s failed", _module)
        raise
