"""The test suite's own guard: a real part that cannot start fails ``./run.sh tests`` instead of turning its tests
into skips that leave CI green (test audit finding 1; tests/conftest.py ``missing_real_part``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

#: A test that reads a shared data file (tests/conftest.py ``locomo_path``).
NEEDS_SHARED_DATA = "tests/data/test_locomo.py::test_real_file_counts"


@pytest.mark.parametrize(("require", "outcome"), [("1", "1 error"), ("0", "1 skipped")])
def test_a_missing_real_part_fails_where_real_parts_are_required(require, outcome, repo_root: Path):
    env = {**os.environ, "MEMUPDATE_REQUIRE_REAL": require, "MEMUPDATE_SHARED_DATA": "/nowhere"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", NEEDS_SHARED_DATA],
        cwd=repo_root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert outcome in run.stdout, run.stdout[-3000:]
    assert "/nowhere/locomo10.json not found" in run.stdout
