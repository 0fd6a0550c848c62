"""The Snakemake workflow, run the way a user runs it: from a clean copy of the repository."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")


@pytest.fixture()
def workdir(tmp_path, copy_workflow):
    return copy_workflow(tmp_path)


def snakemake(workdir, *args, timeout=600):
    return subprocess.run([SNAKEMAKE, *args], cwd=workdir, capture_output=True, text=True, timeout=timeout)


@pytest.mark.serial
def test_dry_run_of_all_is_fast(workdir):
    # Serial and best of two: beside another test on 2 cores CI once measured 11.7 s for both runs (1.8 s alone).
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
    # The Python side: ruff's lint and its formatter (pyproject.toml [tool.ruff]), over everything Python here.
    ruff = str(Path(sys.executable).parent / "ruff")
    for command in (
        [ruff, "check", "src", "tests", "workflow"],
        [ruff, "format", "--check", "src", "tests", "workflow"],
    ):
        result = subprocess.run(command, cwd=repo_root, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, f"{' '.join(command[1:])}:\n{result.stdout}{result.stderr}"


def leave_a_killed_runs_server(workdir: Path, exp: str) -> tuple[Path, Path]:
    """The registry record and readiness marker of ``exp``'s evaluation qa-base server, as a run killed while it
    served leaves them (its run process is gone)."""
    dead_pid = subprocess.Popen(["true"])
    dead_pid.wait()
    registry = workdir / "logs/serve_model/running"
    registry.mkdir(parents=True)
    marker = workdir / f"results/{exp}/serve/eval/qa-base.ready.json"
    marker.parent.mkdir(parents=True)
    marker.write_text("{}")
    record = registry / f"{exp}-eval-qa-base.json"
    record.write_text(json.dumps({"name": f"{exp}-eval-qa-base", "run_pid": dead_pid.pid, "marker": str(marker)}))
    return record, marker


def test_leftover_servers_are_cleared_by_a_real_run_not_by_reading_the_workflow(
    workdir, shared_data_dir, real_part_missing
):
    """A killed run's server record (its run process gone) is cleared when the next real run starts, never
    when the Snakefile is only read (-n, --lint)."""
    if not shared_data_dir.is_dir():
        real_part_missing("needs ../shared/data as the data mirror")
    record, marker = leave_a_killed_runs_server(workdir, "old")
    assert snakemake(workdir, "-n", "all").returncode == 0
    assert record.is_file() and marker.is_file()
    run = snakemake(workdir, "--cores", "1", "resources/data/locomo10.json")
    assert run.returncode == 0, run.stderr[-3000:]
    assert not record.exists() and not marker.exists()
    assert "stopped the old-eval-qa-base server a killed run left" in run.stdout + run.stderr


def test_a_run_that_planned_on_a_killed_runs_server_stops_with_what_to_do(workdir):
    """The DAG is built while a killed run's marker still exists, so it plans no serve job; the marker is removed
    with its server when the run starts. The consumer then died on Snakemake's "Missing files after 5 seconds"
    (issue 37): the run stops before any job, saying to run again."""
    _, marker = leave_a_killed_runs_server(workdir, "smoke")
    run = snakemake(workdir, "--cores", "1", "results/smoke/eval/report.json")
    assert run.returncode != 0
    output = run.stdout + run.stderr
    assert "a killed run left servers this run planned to use" in output and "run the same command again" in output
    assert not marker.exists() and "rule fetch_data" not in output
    # The next run plans the server again.
    assert (
        "results/smoke/serve/eval/qa-base.ready.json"
        in snakemake(workdir, "-n", "results/smoke/eval/report.json").stdout
    )


def test_a_config_file_yaml_cannot_parse_is_named_with_its_line(workdir):
    """Snakemake's own error said "Config file is not valid JSON or YAML", naming neither (issue 58)."""
    config = workdir / "config" / "config.yaml"
    config.write_text(config.read_text() + "\tbroken: true\n")
    result = snakemake(workdir, "-n", "all", "--cores", "1")
    assert result.returncode != 0
    lines = len(config.read_text().splitlines())
    assert f"config/config.yaml, line {lines}, column 1: not valid YAML" in result.stdout + result.stderr


def test_invalid_config_is_rejected_before_anything_runs(workdir):
    result = snakemake(workdir, "-n", "all", "--cores", "1", "--config", "scale=huge")
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "scale: 'huge' is not one of smoke, full" in output


def dry_run_jobs(output: str) -> list[dict[str, str]]:
    """The jobs `snakemake -n` lists: rule, and each job's indented fields (output, wildcards, resources...)."""
    jobs: list[dict[str, str]] = []
    for line in output.splitlines():
        head = re.match(r"^(?:local)?rule (\w+):$", line)
        if head:
            jobs.append({"rule": head.group(1)})
        elif jobs and (field := re.match(r"^    (\w+): (.*)$", line)):
            jobs[-1][field.group(1)] = field.group(2)
    return jobs


def resources(job: dict[str, str]) -> dict[str, str]:
    # "server=..." holds spaces ("gres=gpu:1 mem_mb=96000"): split on the commas Snakemake puts between resources.
    return dict(item.split("=", 1) for item in job.get("resources", "").split(", ") if "=" in item)


def test_the_briefs_short_paths_build_the_default_experiment(workdir):
    result = snakemake(workdir, "-n", "results/stage2/ckpt", "results/eval/report.json")
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = dry_run_jobs(result.stdout)
    by_rule = {job["rule"]: job for job in jobs}
    # The default experiment of the scale (smoke) is trained and evaluated at its own paths, then linked.
    assert by_rule["train_stage2"]["wildcards"] == "exp=smoke, n=2"
    assert by_rule["eval_locomo"]["output"] == (
        "results/smoke/eval/report.json, results/smoke/eval/report.md, results/smoke/eval/figures"
    )
    assert by_rule["default_checkpoint"]["output"] == "results/stage2/ckpt"
    assert by_rule["default_report"]["output"] == "results/eval/report.json"
    # A named experiment keeps its own path, and no short path is built for it.
    named = snakemake(workdir, "-n", "results/memagent_smoke/memagent/ckpt")
    assert named.returncode == 0 and "default_checkpoint" not in named.stdout, named.stderr[-3000:]
    # The default experiment has no MemAgent run: its short path says so before anything runs.
    missing = snakemake(workdir, "-n", "results/memagent/ckpt")
    assert missing.returncode != 0
    assert (
        "the default experiment 'smoke' (scales.smoke.default_experiment) has no memagent"
        in missing.stdout + missing.stderr
    )


def test_an_experiment_with_a_cold_start_trains_stage1_from_it(workdir):
    """An `sft` section adds the cold start (train_sft) and stage 1 starts from its checkpoint."""
    (workdir / "sft.yaml").write_text("experiments:\n  smoke:\n    sft: {max_rows: 4, epochs: 1}\n")
    result = snakemake(workdir, "-n", "results/smoke/stage1/ckpt", "--configfile", "sft.yaml")
    assert result.returncode == 0, result.stderr[-3000:]
    by_rule = {job["rule"]: job for job in dry_run_jobs(result.stdout)}
    assert by_rule["train_sft"]["output"] == "results/smoke/sft/ckpt"
    assert "results/models/smollm2-135m" in by_rule["train_sft"]["input"]
    assert by_rule["train_stage1"]["input"].startswith("results/smoke/sft/ckpt")
    without = snakemake(workdir, "-n", "results/smoke/stage1/ckpt")
    assert "train_sft" not in without.stdout
    # Settings are checked when the Snakefile loads.
    (workdir / "bad.yaml").write_text("experiments:\n  smoke:\n    sft: {epochs: 0}\n")
    bad = snakemake(workdir, "-n", "results/smoke/stage1/ckpt", "--configfile", "bad.yaml")
    assert bad.returncode != 0 and "experiments.smoke.sft.epochs" in bad.stdout + bad.stderr


def test_iterated_stages_continue_their_roles_against_the_other_roles_latest_checkpoint(workdir):
    """memory -> qa -> memory -> qa: each stage starts from its role's latest checkpoint, the other role is served
    from that role's latest, a curriculum stage trains on its selected rows, and evaluation serves every stage."""
    (workdir / "stages.yaml").write_text(
        "experiments:\n  smoke:\n"
        "    stage3: {trainer.total_training_steps: 1, train_on: {sessions: 8}}\n"
        "    stage4: {trainer.total_training_steps: 1, train_on: {categories: [1, 4]}}\n"
    )
    result = snakemake(workdir, "-n", "results/smoke/eval/report.json", "--configfile", "stages.yaml")
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = dry_run_jobs(result.stdout)
    train = {job["rule"]: job for job in jobs if job["rule"].startswith("train_stage")}
    assert {job["output"] for job in train.values()} == {f"results/smoke/stage{n}/ckpt" for n in (1, 2, 3, 4)}
    marker = "results/smoke/serve/train/{}.ready.json"
    inputs = {rule: job["input"].split(", ") for rule, job in train.items()}
    assert (
        inputs["train_stage1"][0] == "results/models/smollm2-135m"
        and marker.format("qa-base") in inputs["train_stage1"]
    )
    assert (
        inputs["train_stage2"][0] == "results/models/smollm2-135m" and marker.format("stage1") in inputs["train_stage2"]
    )
    assert (
        inputs["train_stage3"][0] == "results/smoke/stage1/ckpt" and marker.format("stage2") in inputs["train_stage3"]
    )
    assert (
        inputs["train_stage4"][0] == "results/smoke/stage2/ckpt" and marker.format("stage3") in inputs["train_stage4"]
    )
    # The reader of memory stage 3's reward is its fixed QA role, stage 2; no stage reads qa-base after it.
    assert marker.format("qa-base") not in inputs["train_stage3"]
    assert "results/smoke/data/stage3.train.parquet" in inputs["train_stage3"]
    assert "results/smoke/data/stage4.train.parquet" in inputs["train_stage4"]
    assert "results/data/locomo/train.parquet" not in inputs["train_stage3"] + inputs["train_stage4"]
    selected = {job["output"] for job in jobs if job["rule"] == "select_stage_rows"}
    assert selected == {"results/smoke/data/stage3.train.parquet", "results/smoke/data/stage4.train.parquet"}
    evaluation = next(job for job in jobs if job["rule"] == "eval_locomo")["input"]
    assert all(f"results/smoke/serve/eval/stage{n}.ready.json" in evaluation for n in (1, 2, 3, 4))
    # The short path of a later stage is the default experiment's too.
    short = snakemake(workdir, "-n", "results/stage4/ckpt", "--configfile", "stages.yaml")
    assert short.returncode == 0 and "results/smoke/stage4/ckpt" in short.stdout, short.stderr[-3000:]


def test_a_memagent_experiment_with_a_cold_start_trains_from_it(workdir):
    """MemAgent's cold start has its own rule (the expert's trajectories of HotpotQA rows) at the same path."""
    (workdir / "sft.yaml").write_text("experiments:\n  memagent_smoke:\n    sft: {max_rows: 4, epochs: 1}\n")
    result = snakemake(workdir, "-n", "results/memagent_smoke/memagent/ckpt", "--configfile", "sft.yaml")
    assert result.returncode == 0, result.stderr[-3000:]
    by_rule = {job["rule"]: job for job in dry_run_jobs(result.stdout)}
    assert "train_sft" not in by_rule
    assert by_rule["train_memagent_sft"]["output"] == "results/memagent_smoke/sft/ckpt"
    assert "results/data/hotpotqa/" in by_rule["train_memagent_sft"]["input"]
    assert by_rule["train_memagent"]["input"].startswith("results/memagent_smoke/sft/ckpt")
    assert "split_memagent_train" not in by_rule
    # With questions_percent, the cold start and GRPO play disjoint shares of the train questions.
    (workdir / "share.yaml").write_text("experiments:\n  memagent_smoke:\n    sft: {questions_percent: 50}\n")
    shared = snakemake(workdir, "-n", "results/memagent_smoke/memagent/ckpt", "--configfile", "share.yaml")
    assert shared.returncode == 0, shared.stderr[-3000:]
    by_rule = {job["rule"]: job for job in dry_run_jobs(shared.stdout)}
    assert by_rule["split_memagent_train"]["input"].endswith(".train.parquet")
    assert "results/memagent_smoke/data/sft.parquet" in by_rule["train_memagent_sft"]["input"]
    train_inputs = by_rule["train_memagent"]["input"].split(", ")
    assert "results/memagent_smoke/data/grpo.parquet" in train_inputs
    assert not any(path.endswith(".train.parquet") or "sft.parquet" in path for path in train_inputs)
    # Its settings are checked when the Snakefile loads.
    (workdir / "bad.yaml").write_text("experiments:\n  memagent_smoke:\n    sft: {batch_size: 0}\n")
    bad = snakemake(workdir, "-n", "results/memagent_smoke/memagent/ckpt", "--configfile", "bad.yaml")
    assert bad.returncode != 0 and "experiments.memagent_smoke.sft.batch_size" in bad.stdout + bad.stderr


def test_memagent_on_locomo_reads_conversation_haystacks_held_out_by_conversation(workdir):
    """haystack: locomo swaps the rows, and only the rows: the cold start, GRPO, its validation and the evaluation
    read LoCoMo's conversations as haystacks, trained on the train conversations, evaluated on the test ones."""
    result = snakemake(workdir, "-n", "results/memagent_locomo/memagent_eval/report.json")
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = dry_run_jobs(result.stdout)
    by_rule = {job["rule"]: job for job in jobs}
    built = sorted(job["output"] for job in jobs if job["rule"] == "preprocess_locomo_haystack")
    assert len(built) == 2 and all(out.startswith("results/data/locomo_haystack/") for out in built), built
    assert not any(job["rule"] in ("preprocess_hotpotqa", "split_hotpotqa") for job in jobs)
    assert by_rule["split_memagent_train"]["input"] == "results/data/locomo_haystack/4.train.parquet"
    train_inputs = by_rule["train_memagent"]["input"].split(", ")
    assert "results/data/locomo_haystack/4.test.parquet" in train_inputs  # verl's held-out validation
    assert "results/memagent_locomo/data/grpo.parquet" in train_inputs
    eval_inputs = by_rule["eval_memagent"]["input"].split(", ")
    assert {p for p in eval_inputs if p.endswith(".parquet")} == {
        "results/data/locomo_haystack/4.test.parquet",
        "results/data/locomo_haystack/8.test.parquet",
    }


def test_a_verl_experiments_cold_start_is_a_gpu_job_on_the_slurm_profile(workdir):
    """The cold start is verl's SFT trainer on one node, sized by profiles/slurm/resources.yaml."""
    (workdir / "sft.yaml").write_text(
        "experiments:\n  memupdate_7b:\n    sft: {epochs: 1}\n  memagent_7b:\n    sft: {epochs: 1}\n"
    )
    targets = ["results/memupdate_7b/stage1/ckpt", "results/memagent_7b/memagent/ckpt"]
    result = snakemake(
        workdir, "-n", "--profile", "profiles/slurm", *targets, "--config", "scale=full", "--configfile", "sft.yaml"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = {(job["rule"], job.get("wildcards")): job for job in dry_run_jobs(result.stdout)}
    for rule, exp, after in (
        ("train_sft", "memupdate_7b", ("train_stage1", "exp=memupdate_7b, n=1")),
        ("train_memagent_sft", "memagent_7b", ("train_memagent", "exp=memagent_7b")),
    ):
        sft = jobs[(rule, f"exp={exp}")]
        assert sft["output"] == f"results/{exp}/sft/ckpt"
        asked = resources(sft)
        assert asked["gres"] == "gpu:8" and "nodes" not in asked, sft  # one node: no srun across nodes
        assert jobs[after]["input"].startswith(f"results/{exp}/sft/ckpt")


def test_policy_evaluation_compares_base_cold_start_and_stage1_on_held_out_questions(workdir):
    (workdir / "policies.yaml").write_text(
        "reward: {scorer: answer_recall}\n"
        "experiments:\n  smoke:\n    sft: {max_rows: 4}\n    policy_eval: {n: 2, questions: 5}\n"
    )
    result = snakemake(workdir, "-n", "results/smoke/policy_eval/report.json", "--configfile", "policies.yaml")
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = dry_run_jobs(result.stdout)
    evals = {job["output"]: job for job in jobs if job["rule"] == "eval_policy"}
    assert set(evals) == {f"results/smoke/policy_eval/{p}/summary.json" for p in ("base", "sft", "stage1")}
    # Held-out rows: the validation conversation(s), the same for every policy.
    assert all("results/data/locomo/val.parquet" in job["input"] for job in evals.values())
    assert evals["results/smoke/policy_eval/sft/summary.json"]["input"].startswith("results/smoke/sft/ckpt")
    assert any(job["rule"] == "policy_report" for job in jobs)
    # A served reward scorer cannot compare policies offline: refused before anything runs.
    (workdir / "served.yaml").write_text("experiments:\n  smoke:\n    policy_eval: {n: 2}\n")
    served = snakemake(workdir, "-n", "results/smoke/policy_eval/report.json", "--configfile", "served.yaml")
    assert served.returncode != 0 and "scores with the training reward offline" in served.stdout + served.stderr


def test_the_cpu_demo_is_one_command_from_data_to_both_reports(workdir):
    """Issue 19's demonstration: cold start, stage 1 through the vLLM rollout, the three policies on held-out
    questions, and the LoCoMo evaluation of untrained, cold-start and trained memory policies."""
    targets = ("results/cpu_demo/policy_eval/report.json", "results/cpu_demo/eval/report.json")
    result = snakemake(workdir, "-n", *targets)
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = dry_run_jobs(result.stdout)
    rules = {job["rule"] for job in jobs}
    assert {"train_sft", "train_stage1", "eval_policy", "policy_report", "eval_locomo"} <= rules
    served = {job["output"] for job in jobs if job["rule"] == "serve_model"}
    # The evaluation serves every memory policy; stage 1's offline reward serves nothing while training.
    assert served == {f"results/cpu_demo/serve/eval/{m}.ready.json" for m in ("qa-base", "base", "sft", "stage1")}
    stage1 = next(job for job in jobs if job["rule"] == "train_stage1")
    assert stage1["output"] == "results/cpu_demo/stage1/ckpt"
    assert stage1["input"].startswith("results/cpu_demo/sft/ckpt") and "serve/" not in stage1["input"]
    # Every stage plays the headroom mix: the cold start and stage 1 the train split's, the policies the test
    # split's, and the report reads the test split's flags for its strata.
    mixes = {job["output"].split(", ")[0] for job in jobs if job["rule"] == "headroom_rows"}
    assert mixes == {f"results/cpu_demo/data/headroom.{part}.parquet" for part in ("train", "val", "test")}
    sft = next(job for job in jobs if job["rule"] == "train_sft")
    assert "results/cpu_demo/data/headroom.train.parquet" in sft["input"]
    assert "results/cpu_demo/data/headroom.train.parquet" in stage1["input"]
    evals = [job for job in jobs if job["rule"] == "eval_policy"]
    assert evals and all("results/cpu_demo/data/headroom.test.parquet" in job["input"] for job in evals)
    report = next(job for job in jobs if job["rule"] == "policy_report")
    assert "results/cpu_demo/data/headroom.test.flags.parquet" in report["input"]


def test_an_ingestion_experiments_cold_start_plays_its_sessions(workdir):
    """cpu_ingest: the ingestion expert's demonstrations are of the train sessions (not the questions), stage 1
    starts from them, and the evaluation ingests with every memory policy."""
    result = snakemake(workdir, "-n", "results/cpu_ingest/eval/report.json")
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = dry_run_jobs(result.stdout)
    sft = next(job for job in jobs if job["rule"] == "train_sft")
    assert "results/cpu_ingest/data/ingest.train.parquet" in sft["input"]
    assert "results/data/locomo/train.parquet" not in sft["input"]
    stage1 = next(job for job in jobs if job["rule"] == "train_stage1")
    assert stage1["input"].startswith("results/cpu_ingest/sft/ckpt")
    served = {job["output"] for job in jobs if job["rule"] == "serve_model"}
    assert served == {f"results/cpu_ingest/serve/eval/{m}.ready.json" for m in ("qa-base", "base", "sft", "stage1")}


def test_evaluation_servers_wait_for_the_checkpoints_they_evaluate(workdir):
    """The base QA model exists long before training ends; its evaluation server must not idle through it."""
    result = snakemake(workdir, "-n", "results/smoke/serve/eval/qa-base.ready.json")
    assert result.returncode == 0, result.stderr[-3000:]
    rules = [job["rule"] for job in dry_run_jobs(result.stdout)]
    assert {"train_stage1", "train_stage2"} <= set(rules) and rules[-1] == "serve_model"
    # A training server waits for nothing but its model.
    train = snakemake(workdir, "-n", "results/smoke/serve/train/qa-base.ready.json")
    assert not {"train_stage1", "train_stage2"} & {job["rule"] for job in dry_run_jobs(train.stdout)}


def test_the_vllm_cpu_environment_is_no_artifact_of_the_dag(workdir):
    """The run builds it when it starts (memupdate.serving.lifecycle ``start_run``): a marker remade by a later run would be an
    updated input of every job that read it, and Snakemake would retrain finished stages (tested after a real run
    in test_the_whole_dag_on_the_local_profile)."""
    result = snakemake(workdir, "-n", "results/smoke/serve/train/qa-base.ready.json")
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = {job["rule"]: job for job in dry_run_jobs(result.stdout)}
    assert "serve_model" in jobs and "vllm" not in jobs["serve_model"]["input"]
    assert not any("vllm" in job["rule"] for job in jobs.values())


def test_the_full_scale_on_the_slurm_profile_asks_for_gpus(workdir, monkeypatch):
    """`snakemake -n --profile profiles/slurm all --config scale=full`: every paper-scale experiment, each GPU job
    with its request from profiles/slurm/resources.yaml, every job and every server's own job in the partition and
    account of the user's environment."""
    monkeypatch.setenv("MEMUPDATE_SLURM_PARTITION", "gpu")
    monkeypatch.setenv("MEMUPDATE_SLURM_ACCOUNT", "lab")
    result = snakemake(workdir, "-n", "--profile", "profiles/slurm", "all", "--config", "scale=full")
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = dry_run_jobs(result.stdout)
    submitted = [job for job in jobs if job["rule"] not in ("fetch_data", "download_model")]
    assert submitted and all(
        (resources(job)["slurm_partition"], resources(job)["slurm_account"]) == ("gpu", "lab") for job in submitted
    )
    servers = [resources(job)["server"].split() for job in jobs if job["rule"] == "serve_model"]
    assert servers and all({"partition=gpu", "account=lab"} <= set(server) for server in servers)
    trained = {(job["rule"], job["wildcards"]) for job in jobs if job["rule"].startswith("train_")}
    assert trained == {
        *(("train_stage1", f"exp={e}, n=1") for e in ("memupdate_3b", "memupdate_7b", "two_stage_3b", "two_stage_7b")),
        ("train_stage2", "exp=two_stage_3b, n=2"),
        ("train_stage2", "exp=two_stage_7b, n=2"),
        ("train_memagent", "exp=memagent_7b"),
    }
    for job in jobs:
        asked = resources(job)
        if job["rule"].startswith("train_"):
            assert asked["gres"] in ("gpu:4", "gpu:8") and asked["tasks_per_gpu"] == "0", job
        if job["rule"] == "train_memagent":
            # MemAgent's 7B run spans nodes: one task (Ray node) per node, the rule in the batch step.
            assert (asked["nodes"], asked["tasks"], asked["mpi"]) == ("4", "4", "srun"), job
        if job["rule"] == "serve_model":
            assert "gres=gpu:1" in asked["server"], job
    assert {job["rule"] for job in jobs} >= {"prepare_model", "preprocess_hotpotqa", "eval_locomo", "eval_memagent"}
    # The whole HotpotQA dev file, at MemAgent's lengths.
    haystacks = {job["output"] for job in jobs if job["rule"] == "preprocess_hotpotqa"}
    assert {f"results/data/hotpotqa/dev-{n}.parquet" for n in (50, 100, 200, 400, 800)} <= {
        o.split(", ")[0] for o in haystacks
    }


TINY = ["--configfile", "config/experiments/tiny.yaml"]


def _supervisors(workdir: Path) -> list[psutil.Process]:
    """Server supervisors started from this scratch workflow that are still running."""
    alive = []
    for proc in psutil.process_iter(["cmdline", "cwd"]):
        try:
            if "memupdate.serving.launch" in " ".join(proc.info["cmdline"] or []) and proc.info["cwd"] == str(workdir):
                alive.append(proc)
        except psutil.Error:
            continue
    return alive


def check_question_agnostic_ingestion(workdir: Path) -> None:
    """The tiny_ingest experiment's artifacts: trained on its first 4 sessions' episodes, evaluated by building
    each test conversation's store session by session, and never shown a question."""
    exp = workdir / "results/tiny_ingest"
    rows = pq.read_table(exp / "data/stage1.train.parquet").column("extra_info").combine_chunks()
    assert set(rows.field("session").to_pylist()) == {1, 2, 3, 4}
    loops = (exp / "stage1/agent_loops.yaml").read_text()
    assert "trained_role: memory" in loops and "model: tiny_ingest-qa-base" in loops
    # Each session is rewarded on the questions whose evidence it has seen by then, which its row carries.
    assert all(rows.field("questions").to_pylist())
    (step,) = [json.loads(line) for line in (exp / "stage1/metrics.jsonl").open()]
    assert step["step"] == 1 and "reward_mean" in step
    report = json.loads((exp / "eval/report.json").read_text())
    assert set(report["systems"]) == {"no_update", "full_context", "stage1+qa_base"}
    system = report["systems"]["stage1+qa_base"]
    assert system["memory_setting"] == "question-agnostic" and system["unanswered"] == 0
    # Every session of the three test conversations was one episode, in session order.
    memories = pq.read_table(workdir / "results/data/locomo/memories.parquet").to_pylist()
    tests = set(report["conversations"])
    sessions = {(m["sample_id"], m["session"]) for m in memories if m["sample_id"] in tests}
    log = json.loads((exp / "eval/runs/stage1+qa_base/ingestion.json").read_text())
    assert system["ingestion"]["episodes"] == log["episodes"] == len(sessions) > 60
    for sample, done in log["conversations"].items():
        assert [s["session"] for s in done] == sorted(s for c, s in sessions if c == sample)
    md = (exp / "eval/report.md").read_text()
    assert "Setting: question-agnostic" in md and "## Ingestion" in md and "| stage1+qa_base | agnostic |" in md
    # The prompts of the evaluation's episodes hold no question of LoCoMo.
    questions = [
        q
        for part in ("train", "val", "test")
        for q in pq.read_table(workdir / f"results/data/locomo/{part}.parquet")
        .column("extra_info")
        .combine_chunks()
        .field("question")
        .to_pylist()
    ]
    for step_rows in (exp / "eval/runs/stage1+qa_base/sessions").glob("step*.parquet"):
        for prompt in pq.read_table(step_rows).column("prompt").to_pylist():
            text = "".join(m["content"] for m in prompt)
            assert not [q for q in questions if q in text], step_rows


def served_the_trained_weights(run_dir) -> bool:
    """Whether the policy's rollout server, after the run's last update, held exactly the exported weights (on CPU
    the checkpoint is the workers' own save of the model; in the checkpoint's dtype)."""
    trained = load_file(run_dir / "ckpt" / "model.safetensors")
    (served_dir,) = sorted((run_dir / "rollout").glob("replica0/step*"))
    served = load_file(served_dir / "model.safetensors")
    return all(torch.equal(served[name].to(tensor.dtype), tensor) for name, tensor in trained.items())


@pytest.mark.slow
@pytest.mark.vllm
def test_the_whole_dag_on_the_local_profile(tiny_pipeline):
    """Data, embeddings, models, served models, two training stages (memory, then QA on a curriculum's rows; a
    third and fourth are checked as a plan only, in
    test_iterated_stages_continue_their_roles_against_the_other_roles_latest_checkpoint) and the evaluation, from a
    clean copy (tests/conftest.py ``tiny_pipeline``); the tiny experiment stands in for SmolLM2 (same rules, same
    code paths, minutes instead of a quarter hour)."""
    workdir = tiny_pipeline.repo
    result = tiny_pipeline.data
    assert result.returncode == 0, result.stderr[-3000:]
    assert pq.read_metadata(workdir / "results/data/locomo/train.parquet").num_rows == 885
    assert (workdir / "logs/preprocess_locomo.log").read_text().count("rows from") == 3
    assert (workdir / "benchmarks/preprocess_locomo.tsv").is_file()
    assert (workdir / "resources/data/locomo10.json").stat().st_size == 2_805_274
    rerun = tiny_pipeline.data_again
    assert "Nothing to be done" in rerun.stdout + rerun.stderr

    # `all` and the default experiment's short paths (the product brief's `snakemake results/stage2/ckpt`).
    everything = tiny_pipeline.everything
    assert everything.returncode == 0, everything.stderr[-5000:]
    log = everything.stdout + everything.stderr
    summary = json.loads((workdir / "results/embeddings/all-MiniLM-L6-v2/memories.summary.json").read_text())
    assert summary["total"] == summary["cache_size"] == 2541 and summary["new"] == 2541
    assert pq.read_metadata(workdir / "results/data/hotpotqa/dev-10.parquet").num_rows == 5
    # Every stage trained and exported a loadable checkpoint, each from its role's base model (both tiny-random).
    for stage, base in {"stage1": "results/models/tiny-random", "stage2": "results/models/tiny-random"}.items():
        ckpt = workdir / "results/tiny" / stage / "ckpt"
        manifest = json.loads((ckpt / "manifest.json").read_text())
        assert manifest["step"] == 1 and manifest["base_model"] == base
        # One step of verl's trainer (docs/verl-on-cpu.md), its rollouts served by the policy's own vLLM server.
        (step,) = [json.loads(line) for line in (workdir / "results/tiny" / stage / "metrics.jsonl").open()]
        assert step["step"] == 1 and step["verl"]["timing_s/gen"] > 0 and step["verl"]["timing_s/update_actor"] > 0
        assert manifest["backend"] == "verl" and served_the_trained_weights(workdir / "results/tiny" / stage)
        # Its rollout server started beside verl's start-up, and verl's replica served with it.
        assert "started before verl, served the run" in (workdir / f"logs/train_stage/tiny-{stage}.log").read_text()
        assert AutoModelForCausalLM.from_pretrained(ckpt).num_parameters() > 0
    # Each stage's fixed role was a served model, the other role's latest checkpoint: stage 1 the base QA model,
    # stage 2 the stage-1 model.
    loops = {s: (workdir / "results/tiny" / s / "agent_loops.yaml").read_text() for s in ("stage1", "stage2")}
    assert "trained_role: memory" in loops["stage1"] and "model: tiny-qa-base" in loops["stage1"]
    assert "trained_role: qa" in loops["stage2"] and "model: tiny-stage1" in loops["stage2"]
    # Stage 2 trained on its curriculum's rows only: questions whose evidence lies in the first 8 sessions.
    rows = pq.read_table(workdir / "results/tiny/data/stage2.train.parquet").column("extra_info").combine_chunks()
    assert 0 < len(rows) < 885
    assert all(max(int(e[1:].split(":")[0]) for e in ids) <= 8 for ids in rows.field("evidence").to_pylist())
    # The evaluation rule reported every system, one per stage, from predictions saved beside the report.
    report = json.loads((workdir / "results/tiny/eval/report.json").read_text())
    stages = ["stage1+qa_base", "stage1+stage2"]
    assert set(report["systems"]) == {"no_update", "full_context", *stages}
    # The rows in that order, a stage's after the one before it (report.json's keys are sorted; report.md is not).
    md = (workdir / "results/tiny/eval/report.md").read_text()
    rows = [md.index(f"\n| {name} |") for name in ("no_update", "full_context", *stages)]
    assert rows == sorted(rows)
    compared = {(c["system"], c["baseline"]) for c in report["comparisons"]}
    assert ("stage1+stage2", "stage1+qa_base") in compared
    assert set(report["training"]) == {"stage1", "stage2"}
    assert report["questions"] == 6 and report["judge"].startswith("tiny-eval-qa-base")
    # LoCoMo conversations (13k-25k tokens) do not fit the tiny model's 8k context: skipped, with why.
    assert report["systems"]["full_context"]["skipped"] == 6
    # Every other system answered every question; a memory system whose policy edited nothing was asked
    # exactly what no_update was asked, and (greedy) answered the same, question for question.
    saved = {
        name: {
            r["namespace"]: r for r in map(json.loads, (workdir / f"results/tiny/eval/predictions/{name}.jsonl").open())
        }
        for name in ("no_update", "stage1+qa_base")
    }
    assert all(report["systems"][name]["unanswered"] == 0 for name in ("no_update", *stages))
    unedited = [
        ns
        for ns, r in saved["stage1+qa_base"].items()
        if r["memory_stats"]["final_count"] == r["memory_stats"]["initial_count"]
        and not any(r["memory_stats"].get(k) for k in ("created", "updated", "deleted", "merged", "split"))
    ]
    assert unedited, "the tiny random memory model was expected to edit nothing"
    for ns in unedited:
        ours, baseline = saved["stage1+qa_base"][ns], saved["no_update"][ns]
        assert ours["predictions"] == baseline["predictions"] and ours["context_tokens"] == baseline["context_tokens"]
        assert ours["retrieved_ids"] == baseline["retrieved_ids"]
    for name in ("figures/per_category.png", "figures/training.png", "report.md"):
        assert (workdir / "results/tiny/eval" / name).is_file()
    # Snakemake's report of the run: the evaluations' tables and figures, each under its experiment.
    page = tiny_pipeline.snakemake("--profile", "profiles/local", "all", *TINY, "--report", "results/report.html")
    assert page.returncode == 0, page.stderr[-3000:]
    html = (workdir / "results/report.html").read_text()
    assert all(
        text in html for text in ("LoCoMo evaluation", "MemAgent evaluation", "per_category.png", "tiny_memagent")
    )
    # The short paths are the default experiment's (tiny) artifacts, stored once: the same inodes.
    for short_path, source in (
        ("results/stage2/ckpt/model.safetensors", "results/tiny/stage2/ckpt/model.safetensors"),
        ("results/eval/report.json", "results/tiny/eval/report.json"),
    ):
        assert (workdir / short_path).stat().st_ino == (workdir / source).stat().st_ino, short_path
    assert AutoModelForCausalLM.from_pretrained(workdir / "results/stage1/ckpt").num_parameters() > 0
    # MemAgent: trained on the train questions only, evaluated (base and trained) on the held-out ones.
    parts = {
        part: pq.read_table(workdir / f"results/data/hotpotqa/dev-10.{part}.parquet")
        .column("extra_info")
        .combine_chunks()
        .field("id")
        .to_pylist()
        for part in ("train", "test")
    }
    assert len(parts["train"]) + len(parts["test"]) == 5 and not set(parts["train"]) & set(parts["test"])
    run = workdir / "results/tiny_memagent/memagent"
    assert json.loads((run / "ckpt" / "manifest.json").read_text())["step"] == 1
    (step,) = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    assert step["step"] == 1 and step["verl"]["timing_s/update_actor"] > 0 and served_the_trained_weights(run)
    # Its step was flat (the random model boxes no exact answer), and its trainer (trainer.v1.trainer_mode:
    # memupdate_sync) skipped the update: the weights are the base model's. The tiny stages ran verl's own.
    assert step["reward_max"] == 0.0 and step["verl"]["actor/update_skipped"] == 1.0
    trained, base = (
        load_file(run / "ckpt/model.safetensors"),
        load_file(workdir / "results/models/tiny-random/model.safetensors"),
    )
    assert all(torch.equal(base[name].to(tensor.dtype), tensor) for name, tensor in trained.items())
    stage1 = [json.loads(line) for line in (workdir / "results/tiny/stage1/metrics.jsonl").open()]
    assert "actor/update_skipped" not in stage1[0]["verl"] and "actor/pg_loss" in stage1[0]["verl"]
    curve = json.loads((workdir / "results/tiny_memagent/memagent_eval/report.json").read_text())
    assert set(curve["results"]) == {"base", "trained"} and curve["results"]["trained"]["10"]["n"] == 2
    assert (workdir / "results/tiny_memagent/memagent_eval/length_curve.png").is_file()
    # Both MemAgent models were served for the evaluation: the base policy and the trained checkpoint, recorded
    # by their paths in the repository (a report holds no machine's folders).
    assert curve["models"] == {
        "base": {"path": "results/models/tiny-random", "served_as": "tiny_memagent-eval-base"},
        "trained": {"path": "results/tiny_memagent/memagent/ckpt", "served_as": "tiny_memagent-eval-memagent"},
    }
    assert str(workdir) not in (workdir / "results/tiny/eval/report.json").read_text()
    check_question_agnostic_ingestion(workdir)
    # Servers were stopped when the run ended; their markers (temp) are gone with them.
    for served in ("qa-base", "stage1", "eval-qa-base", "eval-stage1", "eval-stage2"):
        assert f"stopped the tiny-{served} server" in log
    for served in ("qa-base", "eval-qa-base", "eval-stage1"):
        assert f"stopped the tiny_ingest-{served} server" in log
    for served in ("eval-base", "eval-memagent"):
        assert f"stopped the tiny_memagent-{served} server" in log
    assert not list((workdir / "results/tiny/serve").rglob("*.json"))
    assert not list((workdir / "results/tiny_memagent/serve").rglob("*.json"))
    assert not list((workdir / "logs/serve_model/running").glob("*.json"))
    assert not _supervisors(workdir)

    start = time.perf_counter()
    noop = tiny_pipeline.snakemake("--profile", "profiles/local", "all", *TINY)
    noop_seconds = time.perf_counter() - start
    assert "Nothing to be done" in noop.stdout + noop.stderr
    assert noop_seconds < 10, f"a no-op rerun took {noop_seconds:.1f} s"
    # A later run that needs servers again (the evaluation, redone) serves and evaluates, and retrains nothing:
    # the vllm-cpu environment is built at the run's start, not remade as an input of every finished stage.
    again = tiny_pipeline.snakemake("-n", "results/tiny/eval/report.json", "--forcerun", "eval_locomo", *TINY)
    assert again.returncode == 0, again.stderr[-3000:]
    assert {job["rule"] for job in dry_run_jobs(again.stdout)} == {"serve_model", "eval_locomo"}, again.stdout[-3000:]

    # Snakemake deletes the cache before a forced rerun; the pool outside it keeps every vector.
    embeddings = "results/embeddings/all-MiniLM-L6-v2/memories"
    forced = tiny_pipeline.snakemake("--profile", "profiles/local", "--forcerun", "embed_memories", "--", embeddings)
    assert forced.returncode == 0, forced.stderr[-3000:]
    summary = json.loads((workdir / "results/embeddings/all-MiniLM-L6-v2/memories.summary.json").read_text())
    assert summary["new"] == 0 and summary["reused"] == 2541
    # The forced cache is newer than what was built from it: touched, the run is whole again for any later reader
    # of the session's pipeline (tests/test_dvc.py adopts a copy of it, whichever of the two runs first).
    touched = tiny_pipeline.snakemake("--profile", "profiles/local", "--touch", "all", *TINY)
    assert touched.returncode == 0, touched.stderr[-3000:]


def test_a_job_counts_the_memory_of_the_servers_it_reads_on_this_machine(workdir, monkeypatch):
    """A serve job ends once its server answers, and the server lives on beside its consumers: on the run's own
    machine each job counts the servers it reads (serving.local_mem_mb each), so Snakemake does not run a training
    job beside an evaluation and their four servers on 24 GB (Ray's memory monitor killed such a pipeline's stage 2).
    On Slurm each server is a job of its own."""
    (workdir / "servers.yaml").write_text("serving:\n  local_mem_mb: 2500\n")
    targets = ("results/smoke/stage2/ckpt", "results/smoke/eval/report.json", "--configfile", "servers.yaml")

    def mem_mb(jobs):
        return {
            (job["rule"], job.get("wildcards", "")): (
                int(resources(job)["mem_mb"]),
                job["input"].count(".ready.json") if "input" in job else 0,
            )
            for job in jobs
        }

    local = snakemake(workdir, "-n", "--profile", "profiles/local", *targets)
    assert local.returncode == 0, local.stderr[-3000:]
    planned = mem_mb(dry_run_jobs(local.stdout))
    own = {"train_stage1": 14000, "train_stage2": 14000, "eval_locomo": 6000}
    for (rule, _), (memory, servers) in planned.items():
        if rule in own:
            assert servers >= 1 and memory == own[rule] + 2500 * servers, (rule, memory, servers)
        if rule == "serve_model":
            assert memory == 2500
    monkeypatch.setenv("MEMUPDATE_SLURM_PARTITION", "cpu")
    slurm = snakemake(workdir, "-n", "--profile", "profiles/slurm", *targets)
    assert slurm.returncode == 0, slurm.stderr[-3000:]
    submitted = mem_mb(dry_run_jobs(slurm.stdout))
    assert all(submitted[key][0] == own[key[0]] for key in submitted if key[0] in own)
    assert all(submitted[key][0] != 2500 for key in submitted if key[0] == "serve_model")
