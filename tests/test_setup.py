"""run.sh's set-up (the CPU build of torch, whatever index pip would otherwise use) and the GPU install's resolve."""

import concurrent.futures
import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import pytest

from memupdate.preflight import verl_pin

REPO = Path(__file__).resolve().parents[1]


def install_cpu_torch(index: str) -> subprocess.CompletedProcess:
    """run.sh's own function, against this environment (torch is already there: pip only checks), with the CPU
    index at ``index``."""
    venv = Path(sys.executable).parent.parent
    script = (
        'eval "$(sed -n "/^log()/p" run.sh)"; eval "$(sed -n "/^install_cpu_torch()/,/^}/p" run.sh)"; '
        f"TORCH_CPU_INDEX={index}; install_cpu_torch"
    )
    return subprocess.run(
        ["bash", "-c", script],
        cwd=REPO,
        env={**os.environ, "VENV": str(venv)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_torch_set_up_falls_back_to_the_configured_index_when_the_cpu_index_cannot_answer():
    # As on an offline machine: nothing listens there.
    result = install_cpu_torch("http://127.0.0.1:9/whl/cpu")
    assert result.returncode == 0, result.stderr
    assert "http://127.0.0.1:9/whl/cpu is unreachable" in result.stderr
    assert "installed torch 2.13.0+cpu (CPU build)" in result.stderr


def test_torch_set_up_prefers_the_cpu_index_when_it_answers(tmp_path):
    # A stand-in for download.pytorch.org/whl/cpu: a simple index with a torch page.
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "index.html").write_text("<html><body></body></html>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            index = f"http://127.0.0.1:{server.server_address[1]}"
            result = install_cpu_torch(index)
        finally:
            server.shutdown()
    assert result.returncode == 0, result.stderr
    assert f"installing torch==2.13.0 from PyTorch's CPU index {index}" in result.stderr
    assert "installed torch 2.13.0+cpu (CPU build)" in result.stderr


def allowed_pythons() -> list[str]:
    """The minor versions pyproject.toml's requires-python admits (">=3.11,<3.13": 3.11 and 3.12)."""
    spec = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    low, high = re.fullmatch(r">=3\.(\d+),<3\.(\d+)", spec).groups()
    return [f"3.{minor}" for minor in range(int(low), int(high))]


def interpreter(version: str) -> str:
    """A working ``python<version>``: on PATH, else among pyenv's installed versions."""
    candidates = [shutil.which(f"python{version}")]
    if pyenv := shutil.which("pyenv"):
        root = subprocess.run([pyenv, "root"], capture_output=True, text=True).stdout.strip()
        candidates += sorted(str(p) for p in Path(root).glob(f"versions/{version}.*/bin/python{version}"))
    for candidate in filter(None, candidates):
        probe = subprocess.run(
            [candidate, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True
        )
        if probe.returncode == 0 and probe.stdout.strip() == str(tuple(int(v) for v in version.split("."))):
            return candidate
    pytest.fail(f"no Python {version} to resolve the gpu extra with: put python{version} on PATH (tried {candidates})")


def pinned(constraints: Path, package: str) -> str:
    return next(line.split("==")[1] for line in constraints.read_text().splitlines() if line.startswith(f"{package}=="))


def resolve_gpu_extra(version: str, report: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pip", "--python", interpreter(version), "install", "--dry-run", "--ignore-installed",
         "--quiet", "--report", str(report), "-e", f"{REPO}[gpu]"],
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip


@pytest.mark.slow
def test_the_gpu_extra_resolves_on_every_allowed_python(tmp_path):
    """A cluster user's first command, `pip install -e ".[gpu]"`, as a dry run (metadata only, nothing installed) on
    each Python requires-python allows, side by side: it resolves, with verl's vLLM pin, the CUDA torch vLLM needs and
    the Slurm plugin CI's Slurm tests run (constraints/cpu.txt)."""
    versions = allowed_pythons()
    with concurrent.futures.ThreadPoolExecutor(len(versions)) as pool:
        results = dict(
            zip(versions, pool.map(lambda v: resolve_gpu_extra(v, tmp_path / f"{v}.json"), versions), strict=True)
        )
    plugin = "snakemake-executor-plugin-slurm"
    for version, result in results.items():
        assert result.returncode == 0, (version, result.stderr[-3000:])
        report = json.loads((tmp_path / f"{version}.json").read_text())
        chosen = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in report["install"]}
        assert chosen["vllm"] == verl_pin("vllm"), version
        assert chosen["torch"] == "2.11.0", version
        assert chosen[plugin] == pinned(REPO / "constraints" / "cpu.txt", plugin), version
