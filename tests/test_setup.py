"""run.sh's set-up: the CPU build of torch, whatever index pip would otherwise use."""

import functools
import http.server
import os
import subprocess
import sys
import threading
from pathlib import Path

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
