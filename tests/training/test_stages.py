"""One training stage: served-model checks, the Slurm layout, the verl command, the resume guard and the export."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import yaml

from memupdate.memory.environment import MemoryEnvironment
from memupdate.serving.readiness import ServerGone, write_marker
from memupdate.tools.config import TOOL_CONFIG
from memupdate.training import stages

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
