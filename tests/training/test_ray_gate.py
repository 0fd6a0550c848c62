"""The gate the launcher starts a `python -m` command through: the module is imported first, and runs as
__main__ only once the launcher gives it the cluster's address."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from memupdate.training.ray_cluster import GATE_MODULE

MODULE = textwrap.dedent(
    """
    import json, os, pathlib, sys
    out = pathlib.Path(os.environ["OUT"])
    with out.open("a") as f:
        f.write(json.dumps({"name": __name__, "argv": sys.argv[1:], "address": os.environ.get("RAY_ADDRESS")}) + "\\n")
    """
)


def gate(tmp_path, stdin: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    (tmp_path / "cmd.py").write_text(MODULE)
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "OUT": str(out)}
    env.pop("RAY_ADDRESS", None)
    run = subprocess.run(
        [sys.executable, "-m", GATE_MODULE, "cmd", "--flag", "x"],
        input=stdin,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return run, [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def test_the_module_runs_as_main_with_its_arguments_once_given_the_address(tmp_path):
    run, records = gate(tmp_path, "10.0.0.1:6379\n")
    assert run.returncode == 0, run.stderr
    assert records == [
        {"name": "cmd", "argv": ["--flag", "x"], "address": None},  # imported before the address came
        {"name": "__main__", "argv": ["--flag", "x"], "address": "10.0.0.1:6379"},
    ]


def test_without_an_address_the_module_is_imported_but_never_run(tmp_path):
    run, records = gate(tmp_path, "")
    assert run.returncode != 0 and "did not run: the Ray cluster it was to run on did not start" in run.stderr
    assert [r["name"] for r in records] == ["cmd"]
