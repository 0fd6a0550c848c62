"""The workflow on a real Slurm cluster (tests/slurm/slurm-up.sh): the Slurm profile, multi-node Ray
start-up across two Slurm nodes, and how failures surface."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from memupdate.training.ray_cluster import cluster_command

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")
HERE = Path(__file__).resolve().parent


def jobs_since(start: float, prefix: str) -> list[dict[str, str]]:
    """Accounting records (one per job) of the jobs whose name starts with ``prefix``, submitted after ``start``."""
    fields = ["JobID", "JobName", "State", "AllocTRES", "Comment", "NNodes"]
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(start - 5))
    out = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-S", since, "-o", ",".join(fields)], capture_output=True, text=True, check=True
    )
    rows = [dict(zip(fields, line.split("|"), strict=True)) for line in out.stdout.splitlines() if line]
    return [r for r in rows if r["JobName"].startswith(prefix)]


def default_sigint() -> None:
    """Give a child SIGINT back at its default. A process started in the background by a non-interactive
    shell (``nohup pytest ... &``, some CI runners) inherits SIGINT *ignored*; Python then installs no
    KeyboardInterrupt handler, and Snakemake would sleep through the interrupt these tests send."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def snakemake(workdir, *args, timeout=1500):
    # SIGINT, not TERM, on timeout: it makes the plugin cancel its jobs (TERM can leave them, and hang).
    return subprocess.run(
        ["timeout", "-s", "INT", "-k", "60", str(timeout), SNAKEMAKE, *args],
        cwd=workdir,
        capture_output=True,
        text=True,
        preexec_fn=default_sigint,
    )


SLURM_SERVING = """
serving:
  slurm: {time: 30, mem_mb: 3000, cpus_per_task: 2}
"""


def test_stage1_dag_runs_as_slurm_jobs_asking_for_what_the_profile_says(
    slurm_cluster, slurm_workdir, vllm_python, run_name, monkeypatch
):
    """Data, embeddings, model, a served model (its own sbatch job) and a 2-node training job."""
    monkeypatch.setenv("MEMUPDATE_VLLM_ENV", str(vllm_python.parent.parent))
    (slurm_workdir / "slurm-ci.yaml").write_text(SLURM_SERVING)
    # A cluster user sizes a model's training job in the profile's table; here the tiny model gets the CI
    # cluster's shape: both nodes and their two (fake) GPUs each.
    table = slurm_workdir / "profiles/slurm/resources.yaml"
    rows = yaml.safe_load(table.read_text())
    rows["train_stage"]["tiny-random"] = {"nodes": 2, "gpus_per_node": 2}
    table.write_text(yaml.safe_dump(rows))
    start = time.time()
    # The brief's short path: the default experiment's (tiny's) stage-1 checkpoint, trained on Slurm.
    args = [
        "--profile",
        "profiles/slurm",
        "results/stage1/ckpt",
        "--slurm-init-seconds-before-status-checks",
        "2",
        "--slurm-jobname-prefix",
        run_name,
        "--configfile",
        "config/experiments/tiny.yaml",
        "slurm-ci.yaml",
    ]
    result = snakemake(slurm_workdir, *args)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-5000:]
    jobs = {r["Comment"]: r for r in jobs_since(start, run_name)}
    # The plugin's --comment: rule_<rule>[_wildcards_<values>].
    expected = {
        "rule_preprocess_locomo",
        "rule_embed_memories",
        "rule_prepare_model_wildcards_tiny-random",
        "rule_serve_model_wildcards_tiny_train_qa-base",
        "rule_train_stage1_wildcards_tiny_1",
    }
    assert expected <= set(jobs), sorted(jobs)
    # Downloads run on the submitting machine (compute nodes may have no network): a local rule, no job.
    assert (
        not any(c.startswith("rule_fetch_data") for c in jobs)
        and (slurm_workdir / "resources/data/locomo10.json").is_file()
    )
    assert all(jobs[c]["State"] == "COMPLETED" for c in expected), jobs
    train = jobs["rule_train_stage1_wildcards_tiny_1"]
    # The table's row: 2 nodes, gres gpu:2 on each (4 fake GPUs in all).
    assert train["NNodes"] == "2" and "gres/gpu=4" in train["AllocTRES"], train
    # The served model ran as its own job and ended with the run: it stops itself once its marker is
    # deleted (COMPLETED) or the run's end hook cancels it, whichever comes first.
    servers = jobs_since(start, "memupdate-serve-tiny-qa-base")
    assert len(servers) == 1 and servers[0]["State"].split()[0] in {"COMPLETED", "CANCELLED"}, servers
    assert "stopped the tiny-qa-base server" in log
    manifest = json.loads((slurm_workdir / "results/tiny/stage1/ckpt/manifest.json").read_text())
    assert manifest["step"] == 1
    # Linked on the submitting host (a local rule, no Slurm job for a hard link).
    assert (slurm_workdir / "results/stage1/ckpt/manifest.json").stat().st_ino == (
        slurm_workdir / "results/tiny/stage1/ckpt/manifest.json"
    ).stat().st_ino
    assert not any("default_checkpoint" in c for c in jobs)
    rerun = snakemake(slurm_workdir, *args)
    assert "Nothing to be done" in rerun.stdout + rerun.stderr


@pytest.mark.verl_cpu
@pytest.mark.vllm
def test_verl_stage1_trains_across_two_slurm_nodes(slurm_cluster, slurm_workdir, vllm_python, run_name, monkeypatch):
    """The cluster path as a user runs it: the brief's command for experiment verl_cpu's stage 1 (verl's
    main_ppo, backend verl) with the profile's row for its model (profiles/slurm/resources.yaml: two CPU
    nodes). The rule's srun starts a Ray node on each; verl places an FSDP rank and a rollout server on each."""
    monkeypatch.setenv("MEMUPDATE_VLLM_ENV", str(vllm_python.parent.parent))
    (slurm_workdir / "slurm-ci.yaml").write_text(SLURM_SERVING)
    start = time.time()
    args = [
        "--profile",
        "profiles/slurm",
        "results/verl_cpu/stage1/ckpt",
        "--slurm-init-seconds-before-status-checks",
        "2",
        "--slurm-jobname-prefix",
        run_name,
        "--configfile",
        "slurm-ci.yaml",
    ]
    result = snakemake(slurm_workdir, *args)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-5000:]
    jobs = {r["Comment"]: r for r in jobs_since(start, run_name)}
    train = jobs["rule_train_stage1_wildcards_verl_cpu_1"]
    assert train["State"] == "COMPLETED" and train["NNodes"] == "2", train
    # Its batch step ran the rule; the srun step (one task per node) ran the Ray nodes and the trainer.
    steps = subprocess.run(
        ["sacct", "-n", "-P", "-j", train["JobID"], "-o", "JobID,NodeList,NTasks,State"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    ray_steps = [s.split("|") for s in steps if s.split("|")[0] == f"{train['JobID']}.0"]
    assert ray_steps and ray_steps[0][1:] == ["n[1-2]", "2", "COMPLETED"], steps
    run_dir = slurm_workdir / "results/verl_cpu/stage1"
    manifest = json.loads((run_dir / "ckpt/manifest.json").read_text())
    assert manifest["backend"] == "verl" and manifest["step"] == 2, manifest
    # Two FSDP ranks (one per node), so two rollout replicas, each with its own vLLM server; each was synced
    # to the weights of the last update.
    replicas = sorted(p.name for p in (run_dir / "rollout").glob("replica*"))
    assert replicas == ["replica0", "replica1"], replicas
    assert all(sorted(p.name for p in (run_dir / "rollout" / r).glob("step*")) == ["step000002"] for r in replicas)
    # The weights moved (verl_cpu's entropy bonus and large step: a random model earns no reward), and each
    # server answered with exactly the trained weights after the last update. The merged checkpoint is in
    # bfloat16 (verl's model merger), the trainer's weights in float32.
    trained = load_file(run_dir / "ckpt" / "model.safetensors")
    base = load_file(slurm_workdir / "results/models/tiny-random-vllm/model.safetensors")
    assert any(not torch.equal(base[name].to(tensor.dtype), tensor) for name, tensor in trained.items())
    for replica in replicas:
        served = load_file(run_dir / "rollout" / replica / "step000002" / "model.safetensors")
        assert all(torch.equal(served[name].to(tensor.dtype), tensor) for name, tensor in trained.items()), replica
    # Each step's time split as verl logs it (README "verl on CPU"), and our loop's episodes: up to two turns.
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(logged) == 2
    assert {"timing_s/gen", "timing_s/update_actor", "timing_s/update_weights"} <= set(logged[-1]["verl"])
    assert 1 <= logged[-1]["num_turns_mean"] <= 2 * 2 + 1
    resolved = yaml.safe_load((run_dir / "resolved_config.yaml").read_text())
    # verl's resource pool asks for one rank on each of two nodes (a bundle per Ray node).
    assert resolved["trainer"]["nnodes"] == 2 and resolved["trainer"]["n_gpus_per_node"] == 1
    assert resolved["trainer"]["device"] == "cpu"
    assert resolved["actor_rollout_ref"]["rollout"]["name"] == "memupdate_vllm"


CHECK = textwrap.dedent(
    """
    import json, os, sys
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray.init(address="auto", logging_level="WARNING")
    nodes = [n for n in ray.nodes() if n["Alive"]]

    @ray.remote(num_cpus=1)
    def where():
        return os.environ.get("SLURMD_NODENAME"), ray.get_runtime_context().get_node_id()

    ran = ray.get([
        where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
        for n in nodes
    ])
    json.dump({"nodes": len(nodes), "gpus": sum(n["Resources"].get("GPU", 0) for n in nodes),
               "ran": sorted(r[0] or "" for r in ran), "ids_match": [r[1] for r in ran] == [n["NodeID"] for n in nodes]},
              open(sys.argv[1], "w"))
    """
)


def test_two_slurm_nodes_join_one_ray_cluster(slurm_cluster, tmp_path):
    """The training launcher's start-up path, minus the GPUs: one task per node, Ray head on the first."""
    temp_root = Path(tempfile.mkdtemp(prefix="mu-ray-", dir="/tmp"))
    result = tmp_path / "result.json"
    (tmp_path / "check.py").write_text(CHECK)
    command = cluster_command(
        [sys.executable, str(tmp_path / "check.py"), str(result)],
        shared_dir=tmp_path / "shared",
        node_ip="127.0.0.1",
        num_cpus=1,
        num_gpus=2,
        object_store_memory=100 * 1024 * 1024,
        temp_root=temp_root,
        timeout=120,
    )
    try:
        run = subprocess.run(
            ["srun", "-N2", "--ntasks-per-node=1", "--gres=gpu:2", "--mem=3000", "-t", "5", *command],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        # Both Slurm nodes joined before the task ran, and a task ran on each (Ray sees the fake GPUs).
        assert json.loads(result.read_text()) == {"nodes": 2, "gpus": 4, "ran": ["n1", "n2"], "ids_match": True}
        stopped = {p.name for p in (tmp_path / "shared").iterdir()}
        assert any(name.endswith(".rank1.stopped") for name in stopped), stopped
    finally:
        shutil.rmtree(temp_root, ignore_errors=True)


@pytest.mark.vllm
def test_a_server_that_dies_in_its_slurm_job_fails_the_serve_rule_at_once(
    slurm_cluster, vllm_python, tiny_model_dir, tmp_path
):
    """The supervisor writes the server's address as soon as vLLM starts; a vLLM that dies after that (a bad
    argument here; a crashing kernel on the day it was seen) ends the job, and the wait must end with it, not
    at the start-up timeout (it once idled 15 minutes)."""
    from memupdate.serving.launch import ServeError, serve_model
    from memupdate.serving.readiness import ServerNotReady

    settings = {
        "launcher": "slurm",
        "python": str(vllm_python),
        "dtype": "float32",
        "startup_timeout_s": 600,
        "extra_args": ["--no-such-vllm-option"],
        "slurm": {"time": 5, "mem_mb": 3000, "cpus_per_task": 1},
    }
    start = time.monotonic()
    with pytest.raises((ServeError, ServerNotReady)) as failure:
        serve_model(
            tiny_model_dir,
            tmp_path / "dead.ready.json",
            served_model_name="dies",
            settings=settings,
            server_log=tmp_path / "logs" / "dies.log",
            registry_dir=tmp_path / "running",
        )
    assert time.monotonic() - start < 120, str(failure.value)
    assert "--no-such-vllm-option" in str(failure.value) and not (tmp_path / "dead.ready.json").exists()


@pytest.fixture
def failures_workdir(tmp_path, repo_root):
    work = tmp_path / "failures"
    shutil.copytree(HERE / "failures", work)
    shutil.copytree(repo_root / "profiles", work / "profiles")
    return work


def test_failing_rule_reports_state_and_log_and_leaves_no_output(slurm_cluster, failures_workdir, run_name):
    result = snakemake(
        failures_workdir,
        "--profile",
        "profiles/slurm",
        "out/fail.txt",
        "--slurm-init-seconds-before-status-checks",
        "2",
        "--slurm-jobname-prefix",
        run_name,
        timeout=300,
    )
    log = result.stdout + result.stderr
    assert result.returncode != 0
    assert "SLURM status is: 'FAILED'" in log, log[-3000:]
    # The Slurm log path is reported, and exists.
    slurm_logs = list((failures_workdir / ".snakemake/slurm_logs/rule_fail").glob("*.log"))
    assert slurm_logs and any(str(p.relative_to(failures_workdir)) in log or p.name in log for p in slurm_logs)
    # The partial output of the failed job was removed: nothing looks complete.
    assert not (failures_workdir / "out/fail.txt").exists()


def test_impossible_request_fails_at_submission_with_slurms_message(slurm_cluster, failures_workdir, run_name):
    start = time.monotonic()
    result = snakemake(
        failures_workdir,
        "--profile",
        "profiles/slurm",
        "out/impossible.txt",
        "--slurm-jobname-prefix",
        run_name,
        timeout=300,
    )
    assert result.returncode != 0
    assert "Requested node configuration is not available" in result.stdout + result.stderr
    assert time.monotonic() - start < 60


# The interrupted run's first status poll comes this long after its executor starts (the plugin's option).
# The SIGINT must land before it: Snakemake's RemoteExecutor takes every job out of `active_jobs` while a
# poll runs (sacct via slurmdbd, `scontrol show config`, `which`; a second or more on a busy machine) and
# cancel() reads that list, so an interrupt during a poll cancels nothing and the job runs on
# (snakemake-interface-executor-plugins 9.4.0, remote.py `_wait_for_jobs`/`cancel`). With a 2 s first poll,
# this test's interrupt (sent ~1-3 s after submission, once sacct shows RUNNING) raced it.
FIRST_POLL_S = 20


def test_sigint_cancels_the_runs_slurm_jobs(slurm_cluster, failures_workdir, run_name):
    start = time.time()
    # faulthandler: if Snakemake hangs after SIGINT, SIGABRT makes it print every thread's stack.
    proc = subprocess.Popen(
        [
            SNAKEMAKE,
            "--profile",
            "profiles/slurm",
            "out/sleeper.txt",
            "--slurm-init-seconds-before-status-checks",
            str(FIRST_POLL_S),
            "--slurm-jobname-prefix",
            run_name,
        ],
        cwd=failures_workdir,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
        preexec_fn=default_sigint,
    )
    # Read the log as it comes: the executor's start (its "SLURM run ID" line) starts the poll clock.
    lines: list[str] = []
    executor_started = threading.Event()
    started_at: list[float] = []

    def read_log():
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("SLURM run ID:") and not executor_started.is_set():
                started_at.append(time.monotonic())
                executor_started.set()

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    try:
        assert executor_started.wait(180), "no Slurm executor started:\n" + "".join(lines)[-3000:]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            running = [j for j in jobs_since(start, run_name) if j["State"] == "RUNNING"]
            if running:
                break
            time.sleep(1)
        assert running, "the sleeper job never started"
        waited = time.monotonic() - started_at[0]
        # Clear failure instead of a flaky one: past this point the interrupt could meet the first poll.
        assert waited < FIRST_POLL_S - 2, f"sleeper RUNNING {waited:.0f} s in: too near the first poll to test"
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            proc.wait(timeout=30)
            reader.join(timeout=10)
            output = "".join(lines)
            pytest.fail(f"Snakemake still running 120 s after SIGINT; its log and stacks:\n{output[-8000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=10)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = {j["State"].split()[0] for j in jobs_since(start, run_name)}
        if states == {"CANCELLED"}:
            break
        time.sleep(1)
    assert states == {"CANCELLED"}, (states, "".join(lines)[-3000:])
    queue = subprocess.run(["squeue", "-h", "-o", "%j"], capture_output=True, text=True, check=True).stdout
    assert run_name not in queue
    assert not (failures_workdir / "out/sleeper.txt").exists()
    assert os.path.isdir(failures_workdir)
