"""The plan before paying (memupdate.plan): per job GPUs, wall time, GPU-hours, checkpoint disk and the Slurm time
limit derived from the same figures, for `all --config scale=full`, printed by the dry run and `memupdate plan`."""

import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from memupdate.cluster import Job, Limits
from memupdate.plan import (
    ESTIMATED,
    MEASURED,
    REFERENCE_CAP,
    CapUnknown,
    Plan,
    checkpoint_gb,
    cluster_limits,
    figure,
    job,
    longest_chain,
    model_params,
    pack,
    partition_cap,
    plan_targets,
    saves_kept,
    served,
    time_limit,
    trainer_defaults,
    with_cap,
)
from memupdate.settings import ConfigError

SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")
FULL = ["--config", "scale=full"]
STAGE = Job(gpus_per_node=8, minutes=30, per_step=5, source="README")
BENCHMARK = "s\th:m:s\tmax_rss\n{s}\t0:00:00\t1.0\n"


# ------------------------------------------------------------------------------------------- figures


def test_the_limit_is_the_expected_time_times_the_margin_capped_by_the_partition():
    assert time_limit(1530, Limits()) == (2295, 1)
    assert time_limit(1530, Limits(margin=1.2)) == (1836, 1)
    # MemAgent: 400 steps of 17.5 min on 32 GPUs is 4.9 days; a 48 h partition takes four jobs.
    assert time_limit(30 + 400 * 17.5, Limits(max_runtime=2880)) == (2880, 4)
    assert with_cap(Limits(), "2880").max_runtime == 2880 and with_cap(Limits(), None) == Limits()
    with pytest.raises(ConfigError, match="MEMUPDATE_SLURM_MAX_RUNTIME"):
        with_cap(Limits(), "2 days")


def test_a_job_past_the_cap_that_does_not_resume_is_refused_naming_its_figures():
    with pytest.raises(ConfigError, match=r"prepare_model.*past the partition cap of 48.0 h.*does not resume"):
        job("prepare_model", Job(gpus_per_node=1, minutes=2000, source="a guess"), Limits(max_runtime=2880))
    # Training resumes from its saves, both evaluations from their saved predictions: they are split instead.
    for rule, units in (("train_stage1", 300), ("eval_locomo", 6), ("eval_memagent", 4)):
        row = Job(gpus_per_node=8, minutes=10, per_step=30) if rule.startswith("train") else Job(per_system=900)
        entry = job(rule, row, Limits(max_runtime=2880), units=units)
        assert entry.limit == 2880 and entry.jobs > 1, rule


def test_where_slurm_cannot_say_the_cap_must_be_given(tmp_path):
    """A Slurm run reads the cap from sinfo unless the environment or the table gives it; where sinfo fails, the
    error says what to set (a dry run then warns and plans without a cap: rules/common.smk)."""
    assert cluster_limits(Limits(), {}, "gpu", None) == Limits()
    assert cluster_limits(Limits(), {"MEMUPDATE_SLURM_MAX_RUNTIME": "2880"}, "gpu", "/bin/false").max_runtime == 2880
    assert cluster_limits(Limits(max_runtime=1440), {}, "gpu", "/bin/false").max_runtime == 1440
    with pytest.raises(ConfigError, match=r"cannot read the time limit of gpu from Slurm.*set MEMUPDATE_SLURM_MAX_RUN"):
        cluster_limits(Limits(), {}, "gpu", shutil.which("false"))
    with pytest.raises(ConfigError, match="the default partition"):
        partition_cap("", shutil.which("false"))
    # A bad value in the environment is the user's to fix: not "Slurm cannot say", which a dry run lets pass.
    with pytest.raises(ConfigError, match="expected a time limit in minutes") as bad:
        cluster_limits(Limits(), {"MEMUPDATE_SLURM_MAX_RUNTIME": "2 days"}, "gpu", shutil.which("false"))
    assert not isinstance(bad.value, CapUnknown)


def test_a_benchmark_of_a_previous_run_turns_the_estimate_into_a_measurement(tmp_path):
    tsv = tmp_path / "benchmarks/train_stage/exp-stage1.tsv"
    estimated = figure(STAGE, 300, tsv)
    assert (estimated.minutes, estimated.label, estimated.source) == (1530, ESTIMATED, "README")
    tsv.parent.mkdir(parents=True)
    tsv.write_text(BENCHMARK.format(s=36000.0))
    measured = figure(STAGE, 300, tsv)
    assert (measured.minutes, measured.label, measured.source) == (600, MEASURED, str(tsv))
    entry = job("train_stage1", STAGE, Limits(), units=300, benchmark=tsv)
    assert (entry.limit, entry.gpu_hours) == (900, 80)
    # A row without a figure keeps its own explicit limit; none at all leaves the rule's.
    assert job("train_stage1", Job(runtime=30), Limits()).limit == 30
    assert job("prepare_model", Job(), Limits()).limit is None


def test_a_served_model_outlives_its_longest_consumer_by_the_queue_margin():
    stage1 = job("train_stage1", STAGE, Limits(), units=300)
    stage2 = job("train_stage2", STAGE, Limits(), units=100)
    server = served(Job(gpus_per_node=1), [stage1, stage2], Limits(), exp="x", what="train/qa-base")
    assert server.limit == stage1.limit + 30 and server.minutes == stage1.minutes and server.gpu_hours == 25.5
    capped = served(Job(gpus_per_node=1), [stage1], Limits(max_runtime=2310))
    assert (capped.limit, capped.jobs) == (2310, 1)
    assert "capped at 38.5 h" in Plan([stage1, capped], Limits(max_runtime=2310)).render()


def test_checkpoint_disk_is_the_saves_kept_and_the_merged_model():
    memupdate, memagent = trainer_defaults("memupdate"), trainer_defaults("memagent")
    assert memupdate["max_actor_ckpt_to_keep"] == memagent["max_actor_ckpt_to_keep"] == 2
    assert saves_kept({"trainer.total_training_steps": 300}, memupdate) == 2
    assert saves_kept({"trainer.total_training_steps": 300, "trainer.max_actor_ckpt_to_keep": None}, memupdate) == 12
    assert saves_kept({"trainer.total_training_steps": 20}, {"save_freq": 25, "max_actor_ckpt_to_keep": 2}) == 1
    assert model_params("qwen2.5-7b", {"name_or_path": "Qwen/Qwen2.5-7B-Instruct"}) == 7e9
    assert model_params("smollm2-135m") == 1.35e8 and model_params("tiny-random") is None
    # ~91 GB per 7B save, two kept, and the 14 GB bf16 ckpt/.
    assert checkpoint_gb(7e9, 2, Limits()) == pytest.approx(196)
    assert checkpoint_gb(None, 2, Limits()) is None


def test_the_longest_chain_follows_dependencies():
    assert longest_chain({"a": 60, "b": 600, "c": 30}, {"b": ["a"], "c": ["b"]}) == 690
    assert longest_chain({}, {}) == 0


# ------------------------------------------------------------------------------------ the workflow


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, copy_workflow):
    return copy_workflow(tmp_path_factory.mktemp("plan"))


def snakemake(workdir, *args, env=None):
    return subprocess.run([SNAKEMAKE, *args], cwd=workdir, capture_output=True, text=True, timeout=600, env=env)


def dry_run_jobs(output):
    jobs = []
    for line in output.splitlines():
        if head := re.match(r"^(?:local)?rule (\w+):$", line):
            jobs.append({"rule": head.group(1)})
        elif jobs and (found := re.match(r"^    (\w+): (.*)$", line)):
            jobs[-1][found.group(1)] = found.group(2)
    return jobs


def requested(job):
    return dict(item.split("=", 1) for item in job.get("resources", "").split(", ") if "=" in item)


def key(rule, wildcards):
    return rule, wildcards.replace(" ", "")


def entry_key(entry):
    if entry.rule == "serve_model":
        purpose, served_name = entry.what.split("/")
        return "serve_model", f"exp={entry.exp},purpose={purpose},served={served_name}"
    if entry.rule.startswith("train_stage"):
        return entry.rule, f"exp={entry.exp},n={entry.rule.removeprefix('train_stage')}"
    return entry.rule, f"exp={entry.exp}" if entry.exp else f"model={entry.model}"


@pytest.fixture(scope="module")
def full_dry_run(workdir):
    result = snakemake(workdir, "-n", "--profile", "profiles/slurm", "all", *FULL)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def full_plan(workdir):
    return plan_targets(workdir, ["all"], ["scale=full"])


def test_the_plan_of_the_full_scale_lists_every_gpu_job_with_hours_and_disk(full_plan, full_dry_run):
    jobs = {key(j["rule"], j["wildcards"]): j for j in dry_run_jobs(full_dry_run) if "wildcards" in j}
    heavy = {k for k in jobs if re.match(r"train_|serve_model|eval_locomo|eval_memagent|prepare_model", k[0])}
    entries = {entry_key(e): e for e in full_plan.entries}
    assert set(entries) == heavy
    assert sum(k[0] == "serve_model" for k in entries) == 18
    for name, entry in entries.items():
        assert entry.figure is not None and entry.figure.label == ESTIMATED and entry.figure.source, name
        assert entry.hours > 0 and entry.gpu_hours == entry.gpus * entry.hours, name
        if name[0].startswith("train_") or name[0] == "serve_model":
            assert entry.gpus >= 1, name
        if name[0].startswith("train_"):
            # Two saves of 13 bytes a parameter and the merged 2: the model cards' 7.62e9 and 3.09e9 parameters.
            assert entry.disk_gb == pytest.approx(213.36 if entry.model == "qwen2.5-7b" else 86.52), name
        else:
            assert entry.disk_gb is None, name
    memagent = entries["train_memagent", "exp=memagent_7b"]
    assert (memagent.gpus, memagent.minutes) == (32, 30 + 200 * 17.5)
    # The totals add up, and the text says them.
    assert full_plan.gpu_hours == pytest.approx(sum(e.gpu_hours for e in full_plan.entries))
    # 7B: three stages and MemAgent; 3B: three stages.
    assert full_plan.disk_gb == pytest.approx(4 * 213.36 + 3 * 86.52)
    text = full_plan.render()
    total = next(line for line in text.splitlines() if line.startswith("total"))
    assert f"{full_plan.gpu_hours:,.0f}" in total and f"{full_plan.disk_gb:,.0f}" in total
    for exp in ("memupdate_3b", "memupdate_7b", "two_stage_3b", "two_stage_7b", "memagent_7b"):
        subtotal = sum(e.gpu_hours for e in full_plan.entries if e.exp == exp)
        assert re.search(rf"^{exp}\s+subtotal\s+{subtotal:,.0f}\s", text, re.M), exp
    # MemAgent runs for days: the plan says so, and what a 48 h partition makes of it.
    assert "train_memagent of memagent_7b: 59 h (2.5 days) expected" in text
    assert f"under a 48 h partition cap (MEMUPDATE_SLURM_MAX_RUNTIME={REFERENCE_CAP}) 2 jobs, 1 resubmit(s)" in text


def test_the_plan_packs_onto_the_gpus_the_user_has(full_plan):
    """`memupdate plan all --config scale=full --gpus 32`: every job after its inputs, never more GPUs in use than
    there are, MemAgent's four whole nodes at once, and no shorter than the work or the longest chain allows."""
    schedule = pack(full_plan, 32, 8)
    placed = {id(p.entry): p for p in schedule.placed}
    planned = [e for e in full_plan.entries if e.rule != "serve_model"]
    assert set(placed) == {id(e) for e in planned}
    servers = {id(e) for e in full_plan.entries if e.rule == "serve_model"}
    for p in schedule.placed:
        for dep in full_plan.needs[id(p.entry)]:
            if dep not in servers:
                assert placed[dep].end <= p.start, (p.entry.name, placed[dep].entry.name)
    for t in {p.start for p in schedule.placed}:
        assert sum(p.gpus for p in schedule.placed if p.start <= t < p.end) <= 32, t
    memagent = next(p for p in schedule.placed if p.entry.rule == "train_memagent")
    assert memagent.gpus == 32
    assert schedule.minutes >= max(full_plan.chain_minutes, full_plan.gpu_hours * 60 / 32)
    assert f"Schedule on 32 GPUs (4 nodes of 8): {schedule.minutes / 60:,.0f} h" in schedule.render()
    with pytest.raises(ConfigError, match=r"train_memagent of memagent_7b asks for 4 x 8 GPUs.*cannot run on 16 GPUs"):
        pack(full_plan, 16, 8)


def test_the_slurm_limits_are_the_plans_figures_times_the_margin(full_plan, full_dry_run):
    entries = {entry_key(e): e for e in full_plan.entries}
    checked = set()
    for j in dry_run_jobs(full_dry_run):
        name = key(j["rule"], j.get("wildcards", ""))
        if name not in entries:
            continue
        checked.add(name)
        entry, asked = entries[name], requested(j)
        if entry.rule == "serve_model":
            consumers = [e for e in full_plan.entries if e.name in entry.consumers]
            assert consumers, name
            assert entry.limit == max(c.limit for c in consumers) + 30, name
            assert f"time={entry.limit}" in asked["server"], name
            continue
        assert int(asked["runtime"]) == entry.limit == math.ceil(entry.minutes * 1.5), name
        if entry.rule.startswith("eval_"):
            # The evaluations' limits come from their estimates (hours at this scale), not the rules' 120 min.
            assert int(asked["runtime"]) >= entry.minutes > 120, name
    assert checked == set(entries)


def test_the_dry_run_prints_the_plan_after_its_jobs(full_dry_run):
    plan = full_dry_run.index("Plan of the GPU-sized jobs")
    assert plan > full_dry_run.rindex("\nrule ") and "This was a dry-run" in full_dry_run[plan:]
    assert re.search(
        r"^memagent_7b\s+train_memagent\s+qwen2.5-7b\s+4x8\s+58.8\s+1,883\s+88.2\s+213", full_dry_run, re.M
    )


def test_memupdate_plan_prints_the_plan_of_a_target(workdir):
    result = subprocess.run(
        [str(Path(sys.executable).parent / "memupdate"), "plan", "results/two_stage_7b/eval/report.json", *FULL],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("two_stage_7b")]
    assert rows == ["train_stage1", "train_stage2", *["serve_model"] * 5, "eval_locomo", "subtotal"]


def test_a_measured_run_and_a_partition_cap_change_the_plan_and_the_limits(workdir, monkeypatch, tmp_path):
    measured = tmp_path / "repo"
    shutil.copytree(workdir, measured, symlinks=True)
    tsv = measured / "benchmarks/train_stage/two_stage_7b-stage1.tsv"
    tsv.parent.mkdir(parents=True)
    tsv.write_text(BENCHMARK.format(s=36000.0))
    monkeypatch.setenv("MEMUPDATE_SLURM_MAX_RUNTIME", "2880")
    plan = plan_targets(measured, ["all"], ["scale=full"])
    entries = {entry_key(e): e for e in plan.entries}
    stage1 = entries["train_stage1", "exp=two_stage_7b,n=1"]
    assert (stage1.figure.label, stage1.minutes, stage1.limit) == (MEASURED, 600, 900)
    assert entries["serve_model", "exp=two_stage_7b,purpose=train,served=qa-base"].limit == 900 + 30
    memagent = entries["train_memagent", "exp=memagent_7b"]
    assert (memagent.limit, memagent.jobs) == (2880, 2)
    assert "1 resubmit(s)" in plan.render()
    # The jobs ask Slurm for the same limits (the profile's cap from the environment, as in a user's shell).
    result = snakemake(measured, "-n", "--profile", "profiles/slurm", "all", *FULL)
    assert result.returncode == 0, result.stderr[-3000:]
    asked = {key(j["rule"], j.get("wildcards", "")): requested(j) for j in dry_run_jobs(result.stdout)}
    assert asked["train_stage1", "exp=two_stage_7b,n=1"]["runtime"] == "900"
    assert asked["train_memagent", "exp=memagent_7b"]["runtime"] == "2880"
    assert re.search(
        r"^two_stage_7b\s+train_stage1\s+qwen2.5-7b\s+8\s+10.0\s+80\s+15.0\s+213\s+measured", result.stdout, re.M
    )


def test_the_smoke_scale_keeps_its_limits_and_prints_no_plan(workdir):
    result = snakemake(workdir, "-n", "--profile", "profiles/slurm", "all")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Plan of the GPU-sized jobs" not in result.stdout + result.stderr
    for j in dry_run_jobs(result.stdout):
        if j["rule"] in ("eval_locomo", "eval_memagent"):
            assert requested(j)["runtime"] == "120", j
