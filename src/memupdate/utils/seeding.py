"""Random draws that depend on a name, not on the process: the same key gives the same draw on every run and
every worker (Python's ``hash`` of a string changes between processes)."""

from __future__ import annotations

import hashlib
import random


def seeded_random(key: str) -> random.Random:
    """A generator seeded by the sha256 of ``key``.

    >>> seeded_random("conv-26-qa0").random() == seeded_random("conv-26-qa0").random()
    True
    """
    return random.Random(int(hashlib.sha256(key.encode()).hexdigest()[:16], 16))
