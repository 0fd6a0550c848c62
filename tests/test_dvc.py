"""DVC round trip on the real pipeline (the tiny two-stage and MemAgent experiments), as a user versions a run:
`./run.sh pipeline` (tests/conftest.py ``tiny_pipeline``), then `dvc repro`, which adopts what Snakemake built
(runs no job again) and writes dvc.lock; dvc push, a fresh clone, dvc pull, a clean dvc status, a change to the
memory store that makes the stages importing it stale (and to unrelated code that makes none), and an edit of the
evaluation code that re-runs that evaluation only."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from memupdate.dvc_stages import stage_outs

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

BIN = Path(sys.executable).parent
STAGES = ("data", "embeddings", "models", "stage1", "stage2", "eval", "hotpotqa", "memagent", "memagent_eval")
TINY = ("--configfile", "config/experiments/tiny.yaml")


def run(cwd, *cmd, env=None, timeout=1800):
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"{' '.join(map(str, cmd))} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    )
    return result.stdout + result.stderr


def stages_run(output: str) -> set[str]:
    return set(re.findall(r"Running stage '([\w@.-]+)'", output))


def jobs_run(output: str) -> list[str]:
    """The Snakemake jobs a run started (each prints ``rule <name>:`` or ``localrule <name>:``)."""
    return re.findall(r"^(?:local)?rule (\w+):", output, re.M)


def stale_stages(repo: Path, env) -> set[str]:
    """The stages `dvc status` reports as changed (each a line "<stage>:")."""
    return set(re.findall(r"^([\w@.-]+):\s*$", run(repo, BIN / "dvc", "status", env=env), re.M))


def appended(repo: Path, path: str, env) -> set[str]:
    """The stale stages after a comment is appended to ``path``; the file is then restored."""
    file = repo / path
    text = file.read_text()
    file.write_text(text + "# a comment\n")
    try:
        return stale_stages(repo, env)
    finally:
        file.write_text(text)


def files_of(repo: Path, outs: list[str]) -> dict[str, str]:
    """Every file of ``outs``, by its sha256."""
    files = {}
    for out in outs:
        path = repo / out
        for file in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
            files[str(file.relative_to(repo))] = hashlib.sha256(file.read_bytes()).hexdigest()
    return files


@pytest.fixture
def dvc_repo(tiny_pipeline, tmp_path):
    """A copy of the pipeline's run (mtimes and hard links kept: `cp -a`; DVC replaces files it records, which the
    whole-DAG test must not see) made a git + DVC repository, its stages those of the tiny experiments (from the
    generator, as a user regenerates them), with a local remote."""
    assert tiny_pipeline.everything.returncode == 0, tiny_pipeline.everything.stderr[-3000:]
    env, repo = tiny_pipeline.env, tmp_path / "repo"
    run(tmp_path, "cp", "-a", str(tiny_pipeline.repo), str(repo))
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "data").symlink_to((tiny_pipeline.repo.parent / "shared" / "data").resolve())
    run(repo, BIN / "memupdate", "dvc-yaml", "--configfile", "config/experiments/tiny.yaml", env=env)
    run(repo, "git", "init", "-q")
    run(repo, BIN / "dvc", "remote", "modify", "local", "url", str(tmp_path / "store"), env=env)
    run(repo, "git", "add", "-A")
    run(repo, "git", "-c", "user.name=ci", "-c", "user.email=ci@localhost", "commit", "-qm", "workflow")
    return repo


def test_repro_adopts_the_run_then_push_clone_pull_and_only_evaluation_reruns(dvc_repo, tiny_pipeline, tmp_path):
    env = tiny_pipeline.env
    stages = yaml.safe_load((dvc_repo / "dvc.yaml").read_text())["stages"]
    outs = [out for stage in stages.values() for out in stage_outs(stage)]
    before = files_of(dvc_repo, outs)

    # `dvc repro` after `./run.sh pipeline`: every stage runs its command (no dvc.lock yet), whose Snakemake finds
    # nothing to do; DVC records the outputs as they are.
    first = run(dvc_repo, BIN / "dvc", "repro", env=env)
    assert stages_run(first) == set(STAGES)
    assert jobs_run(first) == [], f"dvc repro ran jobs again:\n{first[-3000:]}"
    assert first.count("Nothing to be done") == len(STAGES), first[-3000:]
    lock = yaml.safe_load((dvc_repo / "dvc.lock").read_text())["stages"]
    assert set(lock) == set(STAGES)
    for name, stage in stages.items():
        assert {out["path"] for out in lock[name]["outs"]} == set(stage_outs(stage)), name
    # Every output holds what Snakemake made (DVC copies files back from its cache as it records them: new inodes,
    # the same bytes).
    after = files_of(dvc_repo, outs)
    assert after and after == before
    assert "Data and pipelines are up to date" in run(dvc_repo, BIN / "dvc", "status", env=env)
    assert "Nothing to be done" in run(
        dvc_repo, BIN / "snakemake", "--profile", "profiles/local", "-n", "all", *TINY, env=env
    )

    run(dvc_repo, BIN / "dvc", "push", env=env)
    run(dvc_repo, "git", "add", "-A")
    run(dvc_repo, "git", "-c", "user.name=ci", "-c", "user.email=ci@localhost", "commit", "-qm", "results")

    clone = tmp_path / "clone"
    run(tmp_path, "git", "clone", "-q", str(dvc_repo), str(clone))
    # The clone shares nothing but the remote (and the data mirror beside it): no cache, no results.
    assert not (clone / "results").exists() and not (clone / ".dvc" / "cache").exists()
    run(clone, BIN / "dvc", "pull", env=env)
    status = run(clone, BIN / "dvc", "status", env=env)
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

    # The DVC stages follow the experiment's list: stage 2 trains against stage 1's checkpoint, served, on its
    # curriculum's rows, which it makes itself.
    stages = yaml.safe_load((clone / "dvc.yaml").read_text())["stages"]
    assert "results/tiny/stage1/ckpt" in stages["stage2"]["deps"]
    assert {"results/tiny/stage2/ckpt", "results/tiny/data/stage2.train.parquet"} <= set(stage_outs(stages["stage2"]))
    assert "--allowed-rules select_stage_rows serve_model train_stage2" in " ".join(stages["stage2"]["cmd"].split())

    # A change to the memory store makes every stage importing it stale (training among them); a change to
    # code no stage imports makes none.
    store = "src/memupdate/memory/store.py"
    importing = {name for name, stage in stages.items() if store in stage["deps"]}
    assert {"stage1", "stage2"} <= importing, importing
    assert appended(clone, store, env) == importing
    unrelated = "src/memupdate/bench/report.py"
    assert not any(unrelated in stage["deps"] for stage in stages.values())
    assert appended(clone, unrelated, env) == set()
    assert "Data and pipelines are up to date" in run(clone, BIN / "dvc", "status", env=env)

    # Editing the MemAgent evaluation's code invalidates that evaluation and nothing upstream of it: it is rebuilt
    # from scratch (its folder removed first, its two models served again).
    script = clone / "workflow" / "scripts" / "eval_memagent.py"
    script.write_text(script.read_text() + "# the report wording changed\n")
    again = run(clone, BIN / "dvc", "repro", env=env)
    assert stages_run(again) == {"memagent_eval"}, again[-3000:]
    assert "eval_memagent" in jobs_run(again)
    for stage in set(STAGES) - {"memagent_eval"}:
        assert f"Stage '{stage}' didn't change, skipping" in again
    assert "Data and pipelines are up to date" in run(clone, BIN / "dvc", "status", env=env)
