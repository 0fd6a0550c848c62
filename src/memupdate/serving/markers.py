"""A readiness marker's file: its format and how it is read (:mod:`memupdate.serving.readiness` writes and
probes markers; the client re-reads one to find a restarted server, so this module imports neither)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

#: Bumped when the marker's keys change incompatibly; readers reject other versions.
MARKER_FORMAT = 1


def load_marker(path: str | os.PathLike) -> dict[str, Any]:
    """The marker's content, checked for shape, without probing (for reports and for stopping servers)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no readiness marker at {path}: run the serve rule that writes it")
    try:
        marker = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"readiness marker {path} is not valid JSON ({exc}); rerun the serve rule") from exc
    if not isinstance(marker, dict) or marker.get("format") != MARKER_FORMAT:
        raise ValueError(
            f"readiness marker {path} has format {marker.get('format') if isinstance(marker, dict) else None!r}, "
            f"this code reads format {MARKER_FORMAT}; rerun the serve rule"
        )
    # A server held until its consumer starts has no address yet (memupdate.serving.readiness.write_held_marker).
    for key in ("served_model_name",) if marker.get("held_job") else ("endpoint", "served_model_name"):
        if not marker.get(key):
            raise ValueError(f"readiness marker {path} has no {key!r}; rerun the serve rule")
    return marker
