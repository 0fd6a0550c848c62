"""A real single-machine Slurm cluster for the ``slurm`` tests: started once per session by the project's
own tests/slurm/slurm-up.sh and stopped by slurm-down.sh (by PID files), also when tests fail."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
#: What slurm-up.sh's cluster requires every job to name (it has no default partition, and root's default account
#: may use none), and its partition of one node that tests fill.
PARTITION, ACCOUNT, BUSY_PARTITION = "debug", "ci", "busy"


@pytest.fixture(scope="session")
def slurm_cluster(real_part_missing):
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        real_part_missing("the Slurm tests install and run Slurm from Debian's packages: they need root and apt-get")
    up = subprocess.run(["bash", str(HERE / "slurm-up.sh")], capture_output=True, text=True, timeout=900)
    try:
        assert up.returncode == 0, f"slurm-up.sh failed:\n{up.stdout}\n{up.stderr}"
        yield
    finally:
        subprocess.run(["bash", str(HERE / "slurm-down.sh")], capture_output=True, text=True, timeout=300)


@pytest.fixture(autouse=True)
def placement(monkeypatch) -> dict[str, str]:
    """The user's environment on such a cluster (docs/cluster.md): the profile puts every job, and
    serve_model every server's job, in this partition and account. Returns the names, for jobs a test submits
    itself."""
    monkeypatch.setenv("MEMUPDATE_SLURM_PARTITION", PARTITION)
    monkeypatch.setenv("MEMUPDATE_SLURM_ACCOUNT", ACCOUNT)
    return {"partition": PARTITION, "account": ACCOUNT, "busy": BUSY_PARTITION}


@pytest.fixture
def slurm_workdir(tmp_path, copy_workflow, shared_data_dir):
    """A copy of the workflow with ../shared/data beside it (as in a fresh clone on CI)."""
    return copy_workflow(tmp_path)


@pytest.fixture
def run_name() -> str:
    return f"mu{uuid.uuid4().hex[:8]}"
