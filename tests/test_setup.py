"""run.sh's set-up: the CPU build of torch, whatever index pip would otherwise use."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_torch_set_up_prefers_the_cpu_index_falls_back_quickly_and_says_which_build(tmp_path):
    # run.sh's own function, against this environment (torch is already there: pip only checks), with the CPU
    # index pointed somewhere that cannot answer, as on an offline machine.
    venv = Path(sys.executable).parent.parent
    script = (
        'eval "$(sed -n "/^log()/p" run.sh)"; eval "$(sed -n "/^install_cpu_torch()/,/^}/p" run.sh)"; '
        "TORCH_CPU_INDEX=http://127.0.0.1:9/whl/cpu; install_cpu_torch"
    )
    result = subprocess.run(["bash", "-c", script], cwd=REPO, env={**os.environ, "VENV": str(venv)},
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "http://127.0.0.1:9/whl/cpu is unreachable" in result.stderr
    assert "installed torch 2.13.0+cpu (CPU build)" in result.stderr
