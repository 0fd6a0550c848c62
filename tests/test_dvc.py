"""DVC round trip on the real pipeline (the tiny three-stage and MemAgent experiments): dvc repro, dvc push, a
fresh clone, dvc pull, a clean dvc status, a change to the memory store that makes the stages importing it
stale (and to unrelated code that makes none), and an edit of the evaluation code that re-runs evaluation
only."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from memupdate.dvc_stages import stage_outs

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

BIN = Path(sys.executable).parent
STAGES = ("data", "embeddings", "models", "stage1", "stage2", "stage3", "eval", "hotpotqa", "memagent", "memagent_eval")
PARTS = ["Snakefile", "rules", "workflow", "config", "profiles", "params.yaml", ".dvcignore", "src", "pyproject.toml"]


def run(cwd, *cmd, timeout=1800):
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"{' '.join(map(str, cmd))} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    )
    return result.stdout + result.stderr


def stages_run(output: str) -> set[str]:
    return set(re.findall(r"Running stage '([\w@.-]+)'", output))


def stale_stages(repo: Path) -> set[str]:
    """The stages `dvc status` reports as changed (each a line "<stage>:")."""
    return set(re.findall(r"^([\w@.-]+):\s*$", run(repo, BIN / "dvc", "status"), re.M))


def appended(repo: Path, path: str) -> set[str]:
    """The stale stages after a comment is appended to ``path``; the file is then restored."""
    file = repo / path
    text = file.read_text()
    file.write_text(text + "# a comment\n")
    try:
        return stale_stages(repo)
    finally:
        file.write_text(text)


@pytest.fixture
def dvc_repo(tmp_path, repo_root, shared_data_dir, vllm_python, monkeypatch):
    """A git + DVC repository holding the workflow, set to the tiny experiment, with a local remote."""
    monkeypatch.setenv("MEMUPDATE_VLLM_ENV", str(vllm_python.parent.parent))
    # dvc and snakemake from this environment, as the stages' commands name them.
    monkeypatch.setenv("PATH", f"{BIN}:{os.environ['PATH']}")
    repo = tmp_path / "repo"
    repo.mkdir()
    for part in PARTS:
        src = repo_root / part
        if src.is_dir():
            shutil.copytree(src, repo / part, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy(src, repo / part)
    (repo / ".dvc").mkdir()
    shutil.copy(repo_root / ".dvc" / "config", repo / ".dvc" / "config")
    shutil.copy(repo_root / ".dvc" / ".gitignore", repo / ".dvc" / ".gitignore")
    shutil.copy(repo_root / ".gitignore", repo / ".gitignore")
    # The stages of the tiny experiments, from the generator as a user would regenerate them.
    run(repo, BIN / "memupdate", "dvc-yaml", "--configfile", "config/experiments/tiny.yaml")
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "data").symlink_to(shared_data_dir)
    store = tmp_path / "store"
    run(repo, "git", "init", "-q")
    run(repo, BIN / "dvc", "remote", "modify", "local", "url", str(store))
    run(repo, "git", "add", "-A")
    run(repo, "git", "-c", "user.name=ci", "-c", "user.email=ci@localhost", "commit", "-qm", "workflow")
    return repo


def test_repro_push_clone_pull_and_only_evaluation_reruns(dvc_repo, tmp_path):
    first = run(dvc_repo, BIN / "dvc", "repro")
    assert stages_run(first) == set(STAGES)
    assert "Nothing to be done" not in first.split("Running stage 'eval'")[1]
    run(dvc_repo, BIN / "dvc", "push")
    run(dvc_repo, "git", "add", "-A")
    run(dvc_repo, "git", "-c", "user.name=ci", "-c", "user.email=ci@localhost", "commit", "-qm", "results")

    clone = tmp_path / "clone"
    run(tmp_path, "git", "clone", "-q", str(dvc_repo), str(clone))
    # The clone shares nothing but the remote: no cache, no results.
    assert not (clone / "results").exists() and not (clone / ".dvc" / "cache").exists()
    run(clone, BIN / "dvc", "pull")
    status = run(clone, BIN / "dvc", "status")
    assert "Data and pipelines are up to date" in status, status
    for path in (
        "results/tiny/stage1/ckpt/model.safetensors",
        "results/tiny/stage2/ckpt/model.safetensors",
        "results/tiny/eval/report.json",
        "results/data/locomo/train.parquet",
        "results/tiny_memagent/memagent/ckpt/model.safetensors",
        "results/tiny_memagent/memagent_eval/report.json",
        "results/data/hotpotqa/dev-10.test.parquet",
    ):
        assert (clone / path).read_bytes() == (dvc_repo / path).read_bytes(), path

    # The DVC stages follow the experiment's list: stage 3 continues stage 1's checkpoint against stage 2's, on its
    # curriculum's rows, which it makes itself.
    stages = yaml.safe_load((clone / "dvc.yaml").read_text())["stages"]
    assert {"results/tiny/stage1/ckpt", "results/tiny/stage2/ckpt"} <= set(stages["stage3"]["deps"])
    assert {"results/tiny/stage3/ckpt", "results/tiny/data/stage3.train.parquet"} <= set(stage_outs(stages["stage3"]))
    assert "--allowed-rules select_stage_rows serve_model train_stage3 vllm_env" in " ".join(
        stages["stage3"]["cmd"].split()
    )

    # A change to the memory store makes every stage importing it stale (training among them); a change to
    # code no stage imports makes none.
    store = "src/memupdate/memory/store.py"
    importing = {name for name, stage in stages.items() if store in stage["deps"]}
    assert {"stage1", "stage2", "stage3"} <= importing, importing
    assert appended(clone, store) == importing
    unrelated = "src/memupdate/bench/report.py"
    assert not any(unrelated in stage["deps"] for stage in stages.values())
    assert appended(clone, unrelated) == set()
    assert "Data and pipelines are up to date" in run(clone, BIN / "dvc", "status")

    # Editing the evaluation code invalidates the evaluation stage and nothing upstream of it.
    script = clone / "workflow" / "scripts" / "eval_locomo.py"
    script.write_text(script.read_text() + "# the report wording changed\n")
    again = run(clone, BIN / "dvc", "repro")
    assert stages_run(again) == {"eval"}, again[-3000:]
    for stage in set(STAGES) - {"eval"}:
        assert f"Stage '{stage}' didn't change, skipping" in again
    assert "Data and pipelines are up to date" in run(clone, BIN / "dvc", "status")
