"""Ports, logs and lifetimes of the processes memupdate starts (vLLM servers, Ray nodes, verl's trainers)."""

from __future__ import annotations

import os
import socket
import subprocess
from collections import deque
from collections.abc import Mapping, Sequence
from typing import IO

#: How long a command stopped with SIGTERM gets to stop what it started before it is killed: a Ray cluster's
#: launcher stops its node in up to 60 s (ray_cluster.STOP_TIMEOUT_S), then the process groups its workers left.
STOP_GRACE_S = 150.0


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the OS picks it; another process could still take it before the
    caller binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def tail(path: str | os.PathLike, lines: int = 40) -> str:
    """The last ``lines`` lines of a text file ('' if it cannot be read)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return "".join(deque(fh, maxlen=lines))
    except OSError:
        return ""


def run_to_end(command: Sequence[str], env: Mapping[str, str], out: IO, *, grace_s: float = STOP_GRACE_S) -> int:
    """Run ``command`` (its output into ``out``) and return its exit code. If this process is stopped meanwhile
    (SIGTERM, which memupdate's jobs turn into SystemExit; Ctrl-C), the command gets SIGTERM and ``grace_s`` to stop
    what it started before it is killed: ``subprocess.run`` would SIGKILL it at once, and a Ray cluster's launcher
    killed so leaves its head, workers and rollout server running (13 GB after a cancelled MemAgent run)."""
    child = subprocess.Popen(list(command), env=dict(env), stdout=out, stderr=subprocess.STDOUT)
    try:
        return child.wait()
    finally:
        if child.poll() is None:
            stop_process(child, grace_s)


def stop_process(child: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to ``child``, then SIGKILL if it has not exited within ``grace_s``; returns once it has exited."""
    child.terminate()
    try:
        child.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
