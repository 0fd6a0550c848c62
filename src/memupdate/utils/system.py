"""Ports and logs of the processes memupdate starts (vLLM servers, Ray nodes)."""

from __future__ import annotations

import os
import socket
from collections import deque


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
