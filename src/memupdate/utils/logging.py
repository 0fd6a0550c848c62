"""One logging set-up for the CLI and Snakemake scripts.

The level comes from ``MEMUPDATE_LOG_LEVEL`` (default INFO), as verl does with ``VERL_LOGGING_LEVEL``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def exit_on_sigterm(signum: int, frame: object) -> None:
    """A SIGTERM handler that exits through :class:`SystemExit`, so ``finally`` blocks and context managers run
    (an atomic write removes its temporary file, a launcher stops what it started)."""
    raise SystemExit(128 + signum)


def setup_logging(log_path: str | os.PathLike | None = None, level: str | None = None) -> None:
    """Log to stderr, and also to ``log_path`` (a Snakemake ``log:`` file) when given.

    Uncaught exceptions are logged too, so a failed Snakemake job keeps its traceback in its log. Every job and
    command starts here, so this is also where a SIGTERM (Snakemake stopping its jobs, a Slurm cancel or time
    limit) is made to exit through the cleanups (:func:`exit_on_sigterm`) rather than at once, leaving ``.tmp``
    files behind.
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
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, exit_on_sigterm)
        # A process inherits its parent thread's blocked signals across exec: started from a thread that blocks
        # SIGTERM (Ray's spawner blocks SIGINT so), a job would hold the signal pending and never exit on it.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
