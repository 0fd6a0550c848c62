"""Fixtures of the verl extension tests."""

import os
import subprocess
import sys
import textwrap

import pytest


@pytest.fixture(scope="session")
def run_python():
    """``run_python(code, platform="cpu", **env)``: ``code`` in a fresh interpreter with ``VERL_PLATFORM=platform``
    (verl resolves its platform once per process), returning its last stdout line."""

    def run(code: str, platform: str | None = "cpu", **env: str) -> str:
        """Run ``code`` in a fresh interpreter (``VERL_PLATFORM=platform``) and return its last stdout line."""
        child = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}
        if platform:
            child["VERL_PLATFORM"] = platform
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            env={**child, **env},
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip().splitlines()[-1]

    return run
