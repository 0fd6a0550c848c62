"""A server's Slurm job seen from outside: its state in the queue, a wait while it is queued, holding and releasing.

A server started with its consumer (``serving.start_with_consumer``) is submitted held by the serve rule and released
by the job that uses it (:func:`memupdate.serving.readiness.read_marker`), so it holds no GPU while that job waits in
the queue; :mod:`memupdate.serving.launch` submits servers and :mod:`memupdate.serving.readiness` waits for a
released one, both through this module.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class ServeError(RuntimeError):
    """The server could not be started or did not become ready."""


def job_status(job_id: str) -> tuple[str, str] | None:
    """(state, reason) of a job as squeue shows it, or None when squeue does not list it (ended, or not yet)."""
    result = subprocess.run(
        ["squeue", "--noheader", "--format=%T %r", f"--jobs={job_id}"], capture_output=True, text=True, check=False
    )
    lines = result.stdout.strip().splitlines()
    if not lines:
        return None
    state, _, reason = lines[0].strip().partition(" ")
    return state, reason.strip() or "None"


def job_state(job_id: str) -> str | None:
    status = job_status(job_id)
    return status[0] if status else None


#: squeue states of a job that has not started: queued, held, requeued, or its nodes still booting.
QUEUED_STATES = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD"})


def wait_until_running(
    job_id: str,
    status: Callable[[], tuple[str, str] | None],
    *,
    queue_timeout_s: float | None = None,
    poll_s: float = 10.0,
    log_every_s: float = 300.0,
    grace_s: float = 5.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> str | None:
    """Wait while the server's job is queued; return its first state past the queue (``RUNNING``, or a final
    one), or None once squeue no longer lists it (it ended unseen; the wait for its address says why).

    The queue is the cluster's, not the server's: a GPU job may wait for hours, and a start-up timeout that
    counted that time cancelled servers that never started. So the start-up timeout starts after this, and
    the queue has its own limit, ``queue_timeout_s`` (None: wait; the serve rule's own job time still
    bounds it). ``status`` gives (state, reason) as squeue does (:func:`_slurm_status`); a job squeue does
    not list within ``grace_s`` of the first poll has left the queue. Logs on each change of state and every
    ``log_every_s`` while it waits.
    """
    start = clock()
    logged_at, logged_state = start, None
    while True:
        current = status()
        waited = clock() - start
        if current is None:
            if waited > grace_s:
                logger.info("Slurm job %s left the queue after %.0f s", job_id, waited)
                return None
            current = ("PENDING", "not listed by squeue yet")
        state, reason = current
        if state not in QUEUED_STATES:
            logger.info("Slurm job %s is %s after %.0f s in the queue", job_id, state, waited)
            return state
        if queue_timeout_s is not None and waited >= queue_timeout_s:
            raise ServeError(
                f"Slurm job {job_id} is still {state} after {waited:.0f} s in the queue (squeue's reason: "
                f"{reason}); serving.queue_timeout_s is {queue_timeout_s:.0f} s. Raise it (null = wait), or ask "
                "for a server the cluster can place sooner (serving.slurm, profiles/slurm/resources.yaml)"
            )
        if state != logged_state or clock() - logged_at >= log_every_s:
            limit = f" of at most {queue_timeout_s:.0f} s" if queue_timeout_s is not None else ""
            logger.info("Slurm job %s is %s (%s) after %.0f s in the queue%s", job_id, state, reason, waited, limit)
            logged_at, logged_state = clock(), state
        sleep(poll_s if queue_timeout_s is None else max(0.0, min(poll_s, queue_timeout_s - waited)))


class SlurmJob:
    """A server's Slurm job, polled like a process (``poll()`` is None while it runs), so a wait on the server
    ends as soon as its job does instead of at the start-up timeout."""

    #: squeue may not list a job in its first seconds; after that, absence means it ended.
    GRACE_S = 5.0

    def __init__(self, job_id: str):
        self.job_id = job_id
        self.returncode: str | None = None
        self._submitted = time.monotonic()

    def poll(self) -> str | None:
        if self.returncode is None and time.monotonic() - self._submitted > self.GRACE_S:
            if job_state(self.job_id) is None:
                self.returncode = f"unknown (Slurm job {self.job_id} has left the queue)"
        return self.returncode


#: squeue's reason for a job submitted held (``sbatch --hold``) or held since by its owner.
HELD_REASONS = frozenset({"JobHeldUser"})


def release(job_id: str) -> bool:
    """Release a held job (``scontrol release``); returns whether it was held. A job already released (by another
    consumer, or a requeue) or running is left as it is; one that left the queue fails the wait that follows."""
    status = job_status(job_id)
    if status is None or status[1] not in HELD_REASONS:
        return False
    try:
        result = subprocess.run(["scontrol", "release", job_id], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise ServeError(
            f"the served model's Slurm job {job_id} waits for its consumer, but scontrol is not on this job's PATH "
            "to release it: run on a node with Slurm's commands, or set serving.start_with_consumer: false"
        ) from None
    if result.returncode != 0 and job_status(job_id) == status:
        raise ServeError(f"scontrol release {job_id} failed: {result.stderr.strip()}")
    logger.info("released the served model's Slurm job %s, held until its consumer started", job_id)
    return True


def cancel(job_id: str) -> None:
    result = subprocess.run(["scancel", job_id], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        logger.error("scancel %s failed: %s", job_id, result.stderr.strip())
