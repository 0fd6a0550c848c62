"""`dvc repro` after a Snakemake run adopts what Snakemake built: it records it in dvc.lock and rebuilds nothing.

A small workflow with the project's rule names (so the project's generator makes its DVC stages: data, hotpotqa,
stage1, eval) stands in for the real one, whose run takes minutes. Every job appends its rule's name to
work.log; a data file over Snakemake's 1 MB checksum limit feeds the later stages, as a real run's data does
(DVC re-copies single-file outs from its cache when it commits them, which moves their mtimes)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from memupdate.dvc_stages import stage_outs

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent

SNAKEFILE = """\
configfile: "config/config.yaml"

EXP = config["experiment"]


rule all:
    input:
        f"results/{EXP}/eval/report.json",
        "results/data/hotpotqa.txt",


rule fetch_data:
    output:
        "resources/data/raw.txt",
    shell:
        "echo {rule} >> work.log; head -c 1500000 /dev/zero | tr '\\\\0' r > {output}"


rule preprocess_locomo:
    input:
        "resources/data/raw.txt",
    output:
        big="results/data/memories.txt",
        small="results/data/summary.json",
    shell:
        "echo {rule} >> work.log; tr r m < {input} > {output.big}; echo '{{\\"rows\\": 1}}' > {output.small}"


rule preprocess_hotpotqa:
    output:
        "results/data/hotpotqa.txt",
    shell:
        "echo {rule} >> work.log; echo haystack > {output}"


rule hotpotqa_data:
    input:
        "results/data/hotpotqa.txt",


rule serve_model:
    output:
        temp("results/{exp}/served-stage{n}.ready"),
    shell:
        "echo {rule} >> work.log; touch {output}"


rule train_stage1:
    input:
        memories="results/data/memories.txt",
        summary="results/data/summary.json",
        served="results/{exp}/served-stage{n}.ready",
    output:
        ckpt=directory("results/{exp}/stage{n}/ckpt"),
        metrics="results/{exp}/stage{n}/metrics.jsonl",
    wildcard_constraints:
        n="1",
    shell:
        "echo {rule} >> work.log; mkdir -p {output.ckpt}; head -c 1000 {input.memories} > {output.ckpt}/w.bin;"
        " echo '{{\\"step\\": 1}}' > {output.metrics}"


include: "rules/eval.smk"
"""

EVAL_RULES = """\
rule eval_locomo:
    input:
        ckpt="results/{exp}/stage1/ckpt",
        memories="results/data/memories.txt",
    output:
        "results/{exp}/eval/report.json",
    shell:
        "echo {rule} >> work.log; echo '{{\\"f1\\": 0.5}}' > {output}"
"""


def run(cwd: Path, *cmd: str | Path, timeout: int = 600) -> str:
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"{' '.join(map(str, cmd))} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result.stdout + result.stderr


def work(repo: Path) -> list[str]:
    """The rules that ran, in order."""
    return (repo / "work.log").read_text().split()


def out_files(repo: Path, stages: dict) -> dict[str, tuple[int, int]]:
    """Every file of every stage's outs: (inode, mtime)."""
    files = {}
    for stage in stages.values():
        for out in stage_outs(stage):
            path = repo / out
            for file in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
                stat = file.stat()
                files[str(file.relative_to(repo))] = (stat.st_ino, stat.st_mtime_ns)
    return files


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A git + DVC repository with the small workflow, its dvc.yaml made by `memupdate dvc-yaml`."""
    # memupdate, snakemake and dvc from this environment, as the stages' commands name them.
    monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{os.environ['PATH']}")
    repo = tmp_path / "repo"
    for path, text in {
        "Snakefile": SNAKEFILE,
        "rules/eval.smk": EVAL_RULES,
        "config/config.yaml": "experiment: toy\n",
        "profiles/local/config.yaml": "cores: 1\n",
        "params.yaml": "profile: profiles/local\n",
        "pyproject.toml": '[project]\nname = "toy"\n',
        ".gitignore": ".snakemake/\nwork.log\n",
    }.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    run(repo, BIN / "memupdate", "dvc-yaml")
    run(repo, "git", "init", "-q")
    run(repo, BIN / "dvc", "init", "-q")
    return repo


def test_dvc_repro_after_snakemake_adopts_its_outputs_and_rebuilds_a_changed_stage(repo):
    stages = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]
    assert set(stages) == {"data", "hotpotqa", "stage1", "eval"}

    # The user's `./run.sh pipeline`: Snakemake builds everything.
    run(repo, BIN / "snakemake", "--profile", "profiles/local", "all")
    built = work(repo)
    assert sorted(built) == sorted(
        ["fetch_data", "preprocess_locomo", "preprocess_hotpotqa", "serve_model", "train_stage1", "eval_locomo"]
    )
    before = out_files(repo, stages)

    # Then `dvc repro`: every stage runs its command (no dvc.lock yet), which finds nothing to do; DVC records
    # the outputs as they are.
    first = run(repo, BIN / "dvc", "repro")
    assert set(re.findall(r"Running stage '([\w@.-]+)'", first)) == set(stages)
    assert work(repo) == built, f"dvc repro ran jobs again:\n{first[-3000:]}"
    assert "changed after its outputs were made" not in first
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    assert set(lock) == set(stages)
    for name, stage in stages.items():
        assert {out["path"] for out in lock[name]["outs"]} == set(stage_outs(stage)), name
        assert all(out["md5"] for out in lock[name]["outs"]), name
    # The files Snakemake made are the ones recorded: the checkpoint was not deleted and made again (DVC
    # re-copies a single-file out from its cache, a new inode, but leaves a directory's files in place).
    after = out_files(repo, stages)
    assert after.keys() == before.keys()
    assert after["results/toy/stage1/ckpt/w.bin"] == before["results/toy/stage1/ckpt/w.bin"]
    assert "Data and pipelines are up to date" in run(repo, BIN / "dvc", "status")
    # Snakemake still finds everything up to date: the data DVC re-copied from its cache kept Snakemake's mtimes.
    assert "Nothing to be done" in run(repo, BIN / "snakemake", "--profile", "profiles/local", "-n", "all")
    assert {f: t for f, (_, t) in after.items() if f.startswith("results/data/")} == {
        f: t for f, (_, t) in before.items() if f.startswith("results/data/")
    }

    # A stage dvc.lock records is rebuilt when its deps change, even where Snakemake alone would see nothing
    # to do (a comment in the rule file): its outs are removed first, as DVC removes them.
    (repo / "rules" / "eval.smk").write_text(EVAL_RULES + "# the report's wording changed\n")
    again = run(repo, BIN / "dvc", "repro")
    assert set(re.findall(r"Running stage '([\w@.-]+)'", again)) == {"eval"}
    assert work(repo) == [*built, "eval_locomo"]
    assert "Data and pipelines are up to date" in run(repo, BIN / "dvc", "status")
