"""One training stage: served-model checks, the Slurm layout, the verl command, the resume guard and the export."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from memupdate.memory.environment import MemoryEnvironment
from memupdate.serving.readiness import ServerGone, write_marker
from memupdate.tools.config import TOOL_CONFIG
from memupdate.training import stages
from memupdate.utils.io import weights_digest

SLURM_ENV = {"SLURM_JOB_ID": "42", "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "4"}


@pytest.fixture(scope="module")
def tokenizer_dirs(tiny_models, tmp_path_factory):
    """The tiny model as saved by prepare_model, re-saved (as a checkpoint is), and one with another vocabulary."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("tokenizers")
    resaved = root / "resaved"
    AutoTokenizer.from_pretrained(tiny_models / "policy").save_pretrained(resaved)
    other = root / "other"
    shutil.copytree(tiny_models / "policy", other)
    data = json.loads((other / "tokenizer.json").read_text())
    data["model"]["vocab"] = {f"{token}x": i for token, i in data["model"]["vocab"].items()}
    (other / "tokenizer.json").write_text(json.dumps(data))
    return tiny_models / "policy", resaved, other


def test_same_tokenizer_survives_a_resave(tokenizer_dirs):
    original, resaved, _ = tokenizer_dirs
    # save_pretrained writes None-valued settings as "" : the vocabulary is what must match.
    stages.check_same_tokenizer(original, resaved)


def test_different_tokenizers_are_refused(tokenizer_dirs):
    original, _, other = tokenizer_dirs
    with pytest.raises(ValueError, match="different tokenizers"):
        stages.check_same_tokenizer(original, other)
    # A hub id on a cluster is not a folder here: nothing to compare.
    stages.check_same_tokenizer(original, "Qwen/Qwen2.5-3B")


def test_a_marker_whose_server_is_gone_fails_before_training(tmp_path, tokenizer_dirs):
    marker = tmp_path / "stage1.ready.json"
    # Port 9 (discard) on loopback: nothing serves it.
    write_marker(marker, endpoint="http://127.0.0.1:9/v1", served_model_name="exp-stage1", pid=123)
    with pytest.raises(ServerGone, match="rerun the serve rule"):
        stages.fixed_model_endpoint(marker, tokenizer_dirs[0])
    assert stages.fixed_model_endpoint(None, tokenizer_dirs[0]) is None


def test_slurm_layout():
    assert stages.slurm_layout(SLURM_ENV) == (2, 4)
    assert stages.slurm_layout({"CUDA_VISIBLE_DEVICES": "0,1"}) == (1, 2)
    assert stages.slurm_layout({}) == (1, 0)


@pytest.fixture
def run(tmp_path, repo_root):
    model = tmp_path / "models" / "tiny"
    model.mkdir(parents=True)
    config = yaml.safe_load((repo_root / "config" / "config.yaml").read_text())
    return {
        "model": str(model),
        "train_files": [str(tmp_path / "train.parquet")],
        "memories": str(tmp_path / "memories.parquet"),
        "embeddings": str(tmp_path / "embeddings"),
        "embedding_model": "all-MiniLM-L6-v2",
        "run_dir": str(tmp_path / "results" / "exp" / "stage2"),
        "reward": config["reward"],
        "verl": {"val_files": [str(tmp_path / "val.parquet")]},
    }


def verl_run(run):
    """The run's arguments as verl_commands takes them: the memory paths as one MemoryEnvironment."""
    run = dict(run)
    memory = MemoryEnvironment(
        memories=run.pop("memories"), embeddings=run.pop("embeddings"), embedding_model=run.pop("embedding_model")
    )
    return {**run, "memory": memory, "tool_config": str(TOOL_CONFIG)}


def test_verl_command_spans_the_allocation(run):
    fixed = {"base_url": "http://n1:8000/v1", "model": "exp-stage1"}
    slurm = {**SLURM_ENV, "SLURM_CPUS_PER_TASK": "16"}
    command, env = stages.verl_commands(
        trained_role="qa", settings={"trainer.total_training_steps": 3}, fixed=fixed, env=slurm, **verl_run(run)
    )
    # One task per node, with the allocation's CPUs and GPUs; each starts its Ray node, rank 0 runs main_ppo
    # once both joined.
    assert command[:6] == [
        "srun",
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--cpus-per-task=16",
        "--gres=gpu:4",
    ]
    assert command[6:9] == [sys.executable, "-m", "memupdate.training.ray_cluster"]
    assert command[command.index("--num-gpus") + 1] == "4"
    trainer = command[command.index("--") + 1 :]
    assert trainer[1:3] == ["-m", "memupdate.verl_ext.main_ppo"]
    assert "trainer.nnodes=2" in trainer and "trainer.n_gpus_per_node=4" in trainer
    assert "trainer.total_training_steps=3" in trainer
    # The memory paths travel in a file; the key closes verl's own rollout servers (verl_launcher.run_env).
    assert set(env) == {"TENSORBOARD_DIR", "VERL_FILE_LOGGER_PATH", "VLLM_API_KEY"}
    assert MemoryEnvironment.read(f"{run['run_dir']}/memory_environment.json").memories == run["memories"]
    # prepare_main_ppo validated the config and wrote the run's agent loop with the served memory model.
    loops = yaml.safe_load(open(f"{run['run_dir']}/agent_loops.yaml"))
    assert loops[0]["trained_role"] == "qa" and loops[0]["fixed_model"] == fixed
    # The episode's defaults (memupdate.settings.EpisodeSettings) on verl's keys, its per-turn cap on the loop.
    assert "data.max_prompt_length=2048" in trainer and "data.max_response_length=8192" in trainer
    assert loops[0]["max_new_tokens"] is None


def test_the_episode_reaches_verls_keys_and_the_loop(run):
    episode = {"max_new_tokens": 48, "prompt_length": 1024, "max_assistant_turns": 3, "temperature": 0.7}
    command, _ = stages.verl_commands(
        trained_role="memory", settings={}, fixed=None, env=SLURM_ENV, episode=episode, **verl_run(run)
    )
    trainer = command[command.index("--") + 1 :]
    for override in (
        "data.max_prompt_length=1024",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
        "actor_rollout_ref.rollout.temperature=0.7",
    ):
        assert override in trainer
    assert yaml.safe_load(open(f"{run['run_dir']}/agent_loops.yaml"))[0]["max_new_tokens"] == 48


def test_a_gpu_run_refuses_a_machine_without_gpus(run):
    with pytest.raises(RuntimeError, match="trainer.device cuda but this job has no GPUs"):
        stages.verl_commands(trained_role="memory", settings={}, fixed=None, env={}, **verl_run(run))


def test_a_typo_in_verl_settings_fails_before_anything_runs(run):
    with pytest.raises(ValueError, match="total_training_step"):
        stages.verl_commands(
            trained_role="memory",
            settings={"trainer.total_training_step": 3},
            fixed=None,
            env=SLURM_ENV,
            **verl_run(run),
        )


def test_a_cpu_run_asks_ray_for_cpu_slots_not_gpus(run, tmp_path):
    settings = {"trainer.device": "cpu", "trainer.n_gpus_per_node": 2}
    assert stages.verl_layout(settings, {}) == (1, 2)
    assert stages.verl_layout({"trainer.device": "cpu"}, SLURM_ENV) == (2, 1)
    verl = {**run["verl"], "serving": {"python": sys.executable}}
    command, env = stages.verl_commands(
        trained_role="memory", settings=settings, fixed=None, env={}, **{**verl_run(run), "verl": verl}
    )
    assert json.loads(command[command.index("--resources") + 1]) == {"cpu_slot": 2}
    assert int(command[command.index("--num-cpus") + 1]) > os.cpu_count() and "--num-gpus" not in command
    assert env["VERL_PLATFORM"] == "cpu"
    assert "trainer.n_gpus_per_node=2" in command and "trainer.device='cpu'" in command


def test_only_a_multi_node_allocation_sruns_one_ray_node_per_node(tmp_path, monkeypatch):
    monkeypatch.setattr(stages, "allocation_cpus_per_task", lambda job: 12)
    argv = ["python", "-m", "verl.trainer.main_ppo"]
    two = stages.allocation_command(argv, str(tmp_path), 2, 8, {"SLURM_JOB_ID": "7"})
    assert two[:4] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1"]
    # One node: the rule already runs in a job step holding the node's GPUs; a nested srun would wait for them.
    one = stages.allocation_command(argv, str(tmp_path), 1, 8, {"SLURM_JOB_ID": "7"})
    assert one[0] != "srun" and one[-3:] == argv


def test_the_inner_srun_states_the_allocations_cpus_and_gpus(tmp_path, monkeypatch):
    """srun in a batch step does not inherit --cpus-per-task (Slurm 22.05+), and the jobstep plugin strips
    SLURM_* from an mpi rule's environment: the values are stated, from Slurm's record when the variable is gone."""
    argv = ["python", "-m", "verl.trainer.main_ppo"]
    with_env = stages.allocation_command(argv, str(tmp_path), 2, 8, {"SLURM_JOB_ID": "7", "SLURM_CPUS_PER_TASK": "64"})
    assert with_env[4:6] == ["--cpus-per-task=64", "--gres=gpu:8"]
    asked = []
    monkeypatch.setattr(stages, "allocation_cpus_per_task", lambda job: asked.append(job) or 32)
    stripped = stages.allocation_command(argv, str(tmp_path), 4, 8, {"SLURM_JOB_ID": "7"})
    assert stripped[4:6] == ["--cpus-per-task=32", "--gres=gpu:8"] and asked == ["7"]
    # On CPU nodes no GPUs are asked for, and Ray's own --num-cpus (more than the node has) stays.
    cpu = stages.allocation_command(argv, str(tmp_path), 2, 1, {"SLURM_JOB_ID": "7"}, device="cpu")
    assert cpu[4] == "--cpus-per-task=32" and not any(a.startswith("--gres") for a in cpu)
    assert "--num-cpus" in cpu
    # Slurm's record of the job, as scontrol prints it.
    assert stages.cpus_per_task("JobId=7 NumNodes=4 NumCPUs=128 NumTasks=4 CPUs/Task=32 ReqB:S:C:T=0:0:*:*") == 32
    assert stages.cpus_per_task("JobId=7 NumNodes=4") is None


def test_every_node_gives_ray_the_address_of_the_interface_the_user_names(tmp_path):
    argv = ["python", "-m", "verl.trainer.main_ppo"]
    env = {"SLURM_JOB_ID": "7", "SLURM_CPUS_PER_TASK": "8", "MEMUPDATE_NODE_IP_INTERFACE": "ib0"}
    command = stages.allocation_command(argv, str(tmp_path), 2, 4, env)
    assert command[command.index("--node-ip-interface") + 1] == "ib0"
    # Unset: Ray's guess, as before; on GPUs Ray counts Slurm's CPUs itself (no --num-cpus here).
    command = stages.allocation_command(argv, str(tmp_path), 2, 4, {"SLURM_JOB_ID": "7", "SLURM_CPUS_PER_TASK": "8"})
    assert "--node-ip-interface" not in command and "--num-cpus" not in command


# ---------------------------------------------------------------------------- stale checkpoints (verl)


def prepared_run(run_dir, *, lr=1e-6, steps=10, fixed_url="http://n1:8000/v1", commit="a" * 40):
    """What prepare_main_ppo leaves in a run folder, in small: resolved_config.yaml with the run's paths,
    run_info.json whose config digest is that file's sha256, and agent_loops.yaml with a served model."""
    from memupdate.training.tracking import run_info, write_run_info
    from memupdate.utils.io import sha256_file

    run_dir.mkdir(parents=True, exist_ok=True)
    config = {
        "actor_rollout_ref": {"actor": {"optim": {"lr": lr}}, "model": {"path": str(run_dir.parent / "model")}},
        "trainer": {
            "total_training_steps": steps,
            "save_freq": 5,
            "default_local_dir": str(run_dir / "checkpoints"),
            "logger": ["console", "file"],
        },
    }
    (run_dir / "resolved_config.yaml").write_text(yaml.safe_dump(config))
    loops = [{"name": "memupdate_agent", "fixed_model": {"base_url": fixed_url, "model": "exp-stage1"}}]
    (run_dir / "agent_loops.yaml").write_text(yaml.safe_dump(loops))
    record = {"git": {"commit": commit, "dirty": False}, "data_sha256": {"train_files": [{"path": "t", "sha256": "1"}]}}
    write_run_info(run_dir, run_info(sha256_file(run_dir / "resolved_config.yaml"), record, backend="verl"))
    return run_dir


def verl_saves(run_dir, step):
    """A checkpoint as verl 0.9.1's trainer writes it (trainer_base._save_checkpoint, FSDP checkpoint manager)."""
    folder = run_dir / "checkpoints" / f"global_step_{step}"
    (folder / "actor" / "huggingface").mkdir(parents=True)
    for name in ("model", "optim", "extra_state"):
        (folder / "actor" / f"{name}_world_size_1_rank_0.pt").write_bytes(b"shard")
    (folder / "actor" / "huggingface" / "config.json").write_text("{}")
    (folder / "data.pt").write_bytes(b"loader")
    (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").write_text(str(step))
    return folder


def test_a_rerun_of_the_same_verl_run_resumes_from_its_checkpoints(tmp_path, monkeypatch):
    (tmp_path / "checkout").mkdir()
    monkeypatch.chdir(tmp_path / "checkout")
    run_dir = prepared_run(Path("results/exp/stage1").absolute())
    assert stages.guard_verl_checkpoints(run_dir) is None  # a fresh run: the folder records its digest
    saved = verl_saves(run_dir, 5)
    # Killed, resubmitted: prepared again with the same settings, code and data; extending the run (more
    # steps) and a new address of the served model keep it the same run.
    prepared_run(run_dir, steps=20, fixed_url="http://n7:8123/v1")
    assert stages.guard_verl_checkpoints(run_dir) is None
    assert (saved / "actor" / "model_world_size_1_rank_0.pt").is_file()
    assert stages.last_checkpoint(run_dir / "checkpoints") == saved
    # So does a checkout moved elsewhere (its paths are written relative to it).
    (tmp_path / "checkout").rename(tmp_path / "moved")
    monkeypatch.chdir(tmp_path / "moved")
    moved = prepared_run(Path("results/exp/stage1").absolute(), steps=20)
    assert stages.verl_run_digest(moved) == stages.checkpoint_digest(moved / "checkpoints")


def test_checkpoints_of_another_configuration_are_moved_aside_not_resumed(tmp_path, caplog):
    run_dir = prepared_run(tmp_path / "stage1")
    stages.guard_verl_checkpoints(run_dir)
    old = stages.verl_run_digest(run_dir)
    verl_saves(run_dir, 5)
    (run_dir / "tensorboard").mkdir()
    (run_dir / "tracking.jsonl").write_text('{"step": 5, "data": {}}\n')
    prepared_run(run_dir, lr=3e-6)  # a changed setting
    new = stages.verl_run_digest(run_dir)
    assert new != old
    with caplog.at_level("WARNING", logger=stages.__name__):
        moved = stages.guard_verl_checkpoints(run_dir)
    assert moved is not None and moved.name.startswith(f"checkpoints.stale-{old[:12]}-")
    # Moved, never deleted, with the logs of the run they belong to; verl finds an empty folder and starts afresh.
    assert (moved / "global_step_5" / "actor" / "model_world_size_1_rank_0.pt").is_file()
    assert (moved / "latest_checkpointed_iteration.txt").read_text() == "5"
    suffix = moved.name.removeprefix("checkpoints")
    assert (run_dir / f"tensorboard{suffix}").is_dir() and (run_dir / f"tracking.jsonl{suffix}").is_file()
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [stages.RUN_DIGEST_FILE]
    assert stages.checkpoint_digest(run_dir / "checkpoints") == new
    assert old in caplog.text and new in caplog.text and "moved" in caplog.text


def test_a_code_change_moves_checkpoints_aside_and_a_commit_without_one_does_not(tmp_path, monkeypatch):
    """The code is the package the run executes: a commit of a README must not restart a resubmitted run."""
    package = tmp_path / "package"
    package.mkdir()
    (package / "loop.py").write_text("STEPS = 1\n")
    monkeypatch.setattr(stages, "PACKAGE_DIR", package)
    run_dir = prepared_run(tmp_path / "stage1")
    stages.guard_verl_checkpoints(run_dir)
    verl_saves(run_dir, 5)
    prepared_run(run_dir, commit="b" * 40)
    assert stages.guard_verl_checkpoints(run_dir) is None
    # An evaluation fixed between two resubmits: training never runs it (stages.NOT_RUN).
    (package / "eval").mkdir()
    (package / "eval" / "report.py").write_text("ROUND = 1\n")
    prepared_run(run_dir, commit="c" * 40)
    assert stages.guard_verl_checkpoints(run_dir) is None
    (package / "eval" / "report.py").write_text("ROUND = 2\n")
    prepared_run(run_dir, commit="d" * 40)
    assert stages.guard_verl_checkpoints(run_dir) is None
    (package / "loop.py").write_text("STEPS = 2\n")
    prepared_run(run_dir, commit="e" * 40)
    assert stages.guard_verl_checkpoints(run_dir) is not None


def test_what_a_training_run_imports_is_in_its_resume_key(repo_root):
    """The code digest leaves out stages.NOT_RUN: a run's entry points (verl's plugin, loaded by every Ray worker;
    the job's stages and launcher; the rollout server) must import none of it, else a change to it could alter a
    resumed run unseen."""
    entry = "memupdate.verl_plugin, memupdate.training.stages, memupdate.training.verl_launcher, memupdate.serving.rollout_server"
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys, {entry}; print(' '.join(m for m in sys.modules if m.startswith('memupdate')))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert "memupdate.verl_plugin" in out and "memupdate.rewards.manager" in out
    left_out = {f"memupdate.{part.replace('/', '.')}" for part in stages.NOT_RUN}
    imported = [m for m in out if any(m == x or m.startswith(x + ".") for x in left_out)]
    assert not imported, f"a training run imports {imported}: take them out of stages.NOT_RUN"


def test_a_cold_start_retrained_into_the_same_folder_is_another_run(tmp_path):
    """The config names the starting model by path; a cold start retrained there is another model."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "manifest.json").write_text('{"step": 14}')
    run_dir = prepared_run(tmp_path / "stage1")
    stages.guard_verl_checkpoints(run_dir)
    verl_saves(run_dir, 5)
    assert stages.guard_verl_checkpoints(run_dir) is None
    (model / "manifest.json").write_text('{"step": 28}')
    assert stages.guard_verl_checkpoints(run_dir) is not None


def test_checkpoints_without_a_recorded_digest_are_moved_aside(tmp_path):
    run_dir = prepared_run(tmp_path / "stage1")
    verl_saves(run_dir, 5)  # written before runs recorded their digest: whose they are is unknown
    moved = stages.guard_verl_checkpoints(run_dir)
    assert moved.name.startswith("checkpoints.stale-unknown-") and (moved / "global_step_5").is_dir()


def test_the_export_refuses_a_checkpoint_of_another_run(tmp_path):
    run_dir = prepared_run(tmp_path / "stage1")
    stages.guard_verl_checkpoints(run_dir)
    verl_saves(run_dir, 5)
    prepared_run(run_dir, lr=3e-6)  # prepared anew, but verl was not run through guard_verl_checkpoints
    with pytest.raises(RuntimeError, match="refusing to export global_step_5"):
        stages.export_verl_checkpoint(run_dir, "base")
    assert not (run_dir / "ckpt").exists()


def test_the_export_copies_the_model_the_workers_saved_whole(tmp_path):
    """On CPU verl's workers save the model in Hugging Face format with each checkpoint (cpu.yaml's hf_model): the
    export is that folder, with the run's manifest, and no model merger runs (its shards here are not real)."""
    from safetensors.torch import load_file, save_file

    run_dir = prepared_run(tmp_path / "stage1")
    stages.guard_verl_checkpoints(run_dir)
    saved = verl_saves(run_dir, 5) / "actor" / stages.HF_MODEL_DIR
    save_file({"w": torch.ones(2)}, saved / "model.safetensors")
    (saved / "model.safetensors").chmod(0o600)  # as verl's workers write it
    (run_dir / "tracking.jsonl").write_text(json.dumps({"step": 5, "data": {"critic/score/mean": 0.5}}) + "\n")
    old = os.umask(0o022)
    try:
        ckpt = stages.export_verl_checkpoint(run_dir, "base")
    finally:
        os.umask(old)
    assert torch.equal(load_file(ckpt / "model.safetensors")["w"], torch.ones(2))
    # The checkpoint is shared as the user's umask says, not private as the workers wrote it.
    assert {oct(p.stat().st_mode & 0o777) for p in ckpt.iterdir()} == {"0o644"} and oct(
        ckpt.stat().st_mode & 0o777
    ) == "0o755"
    assert (ckpt / "config.json").read_text() == "{}"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["step"] == 5 and manifest["base_model"] == "base" and manifest["git"]["commit"] == "a" * 40
    assert not (run_dir / ".ckpt.tmp").exists()


def test_the_export_refuses_a_checkpoint_that_is_not_whole(tmp_path):
    """Issue 58: a shard cut short, or a tracker naming a save that is not there, is never exported (an older step
    was once exported in its place without a word); a whole one carries its weights' digest in the manifest."""
    from safetensors.torch import save_file

    run_dir = prepared_run(tmp_path / "stage1")
    stages.guard_verl_checkpoints(run_dir)
    saved = verl_saves(run_dir, 5) / "actor" / stages.HF_MODEL_DIR
    save_file({"w": torch.ones(64)}, saved / "model.safetensors")
    (run_dir / "tracking.jsonl").write_text(json.dumps({"step": 5, "data": {"critic/score/mean": 0.5}}) + "\n")
    whole = (saved / "model.safetensors").read_bytes()
    (saved / "model.safetensors").write_bytes(whole[:-100])
    with pytest.raises(
        ValueError, match=r"global_step_5 is not a whole model.*model.safetensors: \d+ bytes, its header"
    ):
        stages.export_verl_checkpoint(run_dir, "base")
    assert not (run_dir / "ckpt").exists() and not (run_dir / ".ckpt.tmp").exists()
    (saved / "model.safetensors").write_bytes(whole)
    manifest = json.loads((stages.export_verl_checkpoint(run_dir, "base") / "manifest.json").read_text())
    assert manifest["weights"] == weights_digest(saved)
    (run_dir / "checkpoints" / stages.VERL_TRACKER).write_text("10")
    with pytest.raises(FileNotFoundError, match="names global_step_10, which is not there"):
        stages.export_verl_checkpoint(run_dir, "base")


def test_the_export_takes_the_checkpoint_verl_saved_last(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    verl_saves(tmp_path, 5)
    (checkpoints / "global_step_10" / "actor").mkdir(parents=True)  # a save cut short: the tracker says 5
    assert stages.last_checkpoint(checkpoints) == checkpoints / "global_step_5"
    (checkpoints / "latest_checkpointed_iteration.txt").unlink()
    assert stages.last_checkpoint(checkpoints) == checkpoints / "global_step_10"
    assert stages.last_checkpoint(tmp_path / "none") is None
