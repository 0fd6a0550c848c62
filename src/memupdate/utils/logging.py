"""One logging set-up for the CLI and Snakemake scripts.

The level comes from ``MEMUPDATE_LOG_LEVEL`` (default INFO), as verl does with ``VERL_LOGGING_LEVEL``.
"""

from __future__ import annotations

import logging
import os
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(log_path: str | os.PathLike | None = None, level: str | None = None) -> None:
    """Log to stderr, and also to ``log_path`` (a Snakemake ``log:`` file) when given.

    Uncaught exceptions are logged too, so a failed Snakemake job keeps its traceback in its log.
    """
    level = (level or os.environ.get("MEMUPDATE_LOG_LEVEL", "INFO")).upper()
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_path is not None:
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        handlers.append(logging.FileHandler(log_path, mode="w", encoding="utf-8"))
    logging.basicConfig(level=level, format=FORMAT, handlers=handlers, force=True)

    def _log_uncaught(exc_type, exc, tb):
        logging.getLogger("memupdate").critical("uncaught exception", exc_info=(exc_type, exc, tb))

    sys.excepthook = _log_uncaught
