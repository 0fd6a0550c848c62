"""The Snakemake workflow, run the way a user runs it: from a clean copy of the repository."""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

WORKFLOW_PARTS = ["Snakefile", "rules", "workflow", "config", "profiles"]
SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")


@pytest.fixture()
def workdir(tmp_path, repo_root, shared_data_dir):
    """A copy of the workflow with ../shared beside it, as in a fresh clone on CI."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for part in WORKFLOW_PARTS:
        src = repo_root / part
        (shutil.copytree if src.is_dir() else shutil.copy)(src, repo / part)
    if shared_data_dir.is_dir():
        (tmp_path / "shared").mkdir()
        (tmp_path / "shared" / "data").symlink_to(shared_data_dir)
    return repo


def snakemake(workdir, *args, timeout=600):
    return subprocess.run([SNAKEMAKE, *args], cwd=workdir, capture_output=True, text=True, timeout=timeout)


def test_dry_run_of_all_is_fast(workdir):
    # Best of two: a 2-core machine busy with something else can stretch one start-up.
    elapsed = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        result = snakemake(workdir, "-n", "all", "--cores", "1", "--quiet", "rules")
        elapsed = min(elapsed, time.perf_counter() - start)
    assert result.returncode == 0, result.stderr
    assert "preprocess_locomo" in result.stdout + result.stderr
    assert elapsed < 5.0, f"snakemake -n all took {elapsed:.1f} s"


def test_lint_and_format_are_clean(repo_root):
    lint = subprocess.run([SNAKEMAKE, "--lint"], cwd=repo_root, capture_output=True, text=True, timeout=120)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert "Congratulations" in lint.stdout + lint.stderr
    snakefmt = str(Path(sys.executable).parent / "snakefmt")
    files = ["Snakefile", *sorted(str(p.relative_to(repo_root)) for p in (repo_root / "rules").glob("*.smk"))]
    fmt = subprocess.run([snakefmt, "--check", *files], cwd=repo_root, capture_output=True, text=True, timeout=120)
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_invalid_config_is_rejected_before_anything_runs(workdir):
    result = snakemake(workdir, "-n", "all", "--cores", "1", "--config", "scale=huge")
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "'huge' is not one of ['smoke', 'full']" in output


@pytest.mark.slow
def test_locomo_target_builds_on_the_local_profile(workdir, shared_data_dir):
    if not shared_data_dir.is_dir():
        pytest.skip("needs ../shared/data as the data mirror")
    result = snakemake(workdir, "--profile", "profiles/local", "results/data/locomo/train.parquet")
    assert result.returncode == 0, result.stderr[-3000:]
    assert pq.read_metadata(workdir / "results/data/locomo/train.parquet").num_rows == 885
    assert (workdir / "logs/preprocess_locomo.log").read_text().count("rows from") == 3
    assert (workdir / "benchmarks/preprocess_locomo.tsv").is_file()
    assert (workdir / "resources/data/locomo10.json").stat().st_size == 2_805_274
    rerun = snakemake(workdir, "--profile", "profiles/local", "results/data/locomo/train.parquet")
    assert "Nothing to be done" in rerun.stdout + rerun.stderr

    everything = snakemake(workdir, "--profile", "profiles/local", "all")
    assert everything.returncode == 0, everything.stderr[-3000:]
    summary = json.loads((workdir / "results/embeddings/all-MiniLM-L6-v2/memories.summary.json").read_text())
    assert summary["total"] == summary["cache_size"] == 2541 and summary["new"] == 2541
    assert pq.read_metadata(workdir / "results/data/hotpotqa/dev-10.parquet").num_rows == 20
    # Snakemake deletes the cache before a forced rerun; the pool outside it keeps every vector.
    forced = snakemake(workdir, "--profile", "profiles/local", "--forcerun", "embed_memories", "all")
    assert forced.returncode == 0, forced.stderr[-3000:]
    summary = json.loads((workdir / "results/embeddings/all-MiniLM-L6-v2/memories.summary.json").read_text())
    assert summary["new"] == 0 and summary["reused"] == 2541
