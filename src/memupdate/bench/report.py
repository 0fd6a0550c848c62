"""Print a benchmark's rows as an aligned table and save everything as JSON."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from memupdate.utils.io import write_json_atomic

logger = logging.getLogger(__name__)


def percentiles_ms(seconds: Sequence[float]) -> dict[str, float]:
    """p50 / p99 / max of durations given in seconds, in milliseconds.

    >>> percentiles_ms([0.001, 0.002, 0.003])["p50_ms"]
    2.0
    """
    values = np.asarray(seconds, dtype=float) * 1000.0
    return {
        "p50_ms": round(float(np.percentile(values, 50)), 4),
        "p99_ms": round(float(np.percentile(values, 99)), 4),
        "max_ms": round(float(values.max()), 4),
        "n": int(values.size),
    }


def format_table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    """
    >>> print(format_table([["search", 0.12]], ["op", "p50 ms"]))
    op      p50 ms
    ------  ------
    search    0.12
    """
    cells = [[str(h) for h in header]] + [[f"{c:.4g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]

    def line(row):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))

    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths), *(line(r) for r in cells[1:])])


def save_report(result: dict[str, Any], path: str | None) -> None:
    if path:
        write_json_atomic(path, result)
        logger.info("wrote %s", path)
