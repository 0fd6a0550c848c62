"""A command run to its end is stopped with SIGTERM, so that it stops what it started, when its caller is."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time

import pytest

from memupdate.utils.system import run_to_end

# Writes "ready" once its handler is in place, then waits; on SIGTERM writes "cleaned up" (a Ray launcher stopping its
# node) and exits.
CHILD = """
import pathlib, signal, sys, time
log = pathlib.Path(sys.argv[1])
def stop(*_):
    log.write_text("cleaned up")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
if sys.argv[2] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
log.write_text("ready")
time.sleep(60)
"""


class Interrupted(Exception):
    """What this test's caller is stopped with (a job's SIGTERM arrives as SystemExit, Ctrl-C as KeyboardInterrupt)."""


@contextlib.contextmanager
def interrupted_when_ready(log):
    """The main thread is interrupted once ``log`` says the command is ready."""

    def interrupt(*_):
        raise Interrupted

    def watch():
        while not (log.is_file() and log.read_text() == "ready"):
            time.sleep(0.05)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGALRM)

    previous = signal.signal(signal.SIGALRM, interrupt)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with pytest.raises(Interrupted):
            yield
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_an_interrupted_caller_lets_the_command_clean_up(tmp_path):
    log = tmp_path / "child.log"
    with interrupted_when_ready(log), (tmp_path / "out.log").open("w") as out:
        run_to_end([sys.executable, "-c", CHILD, str(log), "handle"], {}, out, grace_s=30)
    # subprocess.run would have sent SIGKILL: no clean-up, and whatever the command started left running.
    assert log.read_text() == "cleaned up"


def test_a_command_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    log = tmp_path / "child.log"
    began = time.monotonic()
    with interrupted_when_ready(log), (tmp_path / "out.log").open("w") as out:
        run_to_end([sys.executable, "-c", CHILD, str(log), "ignore"], {}, out, grace_s=1)
    assert log.read_text() == "ready" and time.monotonic() - began < 30


def test_the_exit_code_is_the_commands(tmp_path):
    with (tmp_path / "out.log").open("w") as out:
        assert run_to_end([sys.executable, "-c", "print('hi'); raise SystemExit(3)"], {}, out) == 3
    assert (tmp_path / "out.log").read_text() == "hi\n"
