"""MemAgent on the local backend: trajectory-level GRPO over multi-turn trajectories, on a tiny random model."""

import asyncio
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from verl.experimental.reward_loop.reward_manager import register
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase

from memupdate.rollout.workers import FINAL_MASK_KEY, TRAJECTORY_KEY, in_process_workers
from memupdate.training.local import LocalGRPOTrainer, train_local


@register("test_final_token_share")
class FinalTokenShare(RewardManagerBase):
    """A toy reward a random model can learn, on the final turn only (the last row of a trajectory): the
    share of its answer's tokens among the lowest eighth of the vocabulary."""

    def __init__(self, config, tokenizer, compute_score=None, **kwargs):
        super().__init__(config, tokenizer, compute_score)

    async def run_single(self, data):
        assert data[-1].non_tensor_batch["tool_extra_fields"]["memagent_final"]
        row = data[-1]
        tokens = row.batch["responses"]
        share = float((tokens < len(self.tokenizer) // 8).float().mean()) if len(tokens) else 0.0
        return {"reward_score": share, "reward_extra_info": {"share": share}}


@pytest.mark.slow
def test_every_turn_of_a_trajectory_gets_its_final_advantage(tmp_path, tiny_models, hotpot_rows, memagent_config):
    trainer = LocalGRPOTrainer(
        memagent_config(tmp_path, tiny_models / "policy", hotpot_rows, reward_manager="test_final_token_share")
    )

    async def rollout():
        worker = in_process_workers(trainer.config, trainer.server, trainer.timer)
        prompts = trainer._prompts()
        batch = await worker.generate_sequences(prompts)
        batch.non_tensor_batch["uid"] = prompts.non_tensor_batch["uid"][batch.non_tensor_batch[TRAJECTORY_KEY]]
        return batch

    batch = asyncio.run(rollout())
    advantages = trainer._advantages(batch)
    mask = batch.batch["response_mask"].bool()
    extra = batch.non_tensor_batch
    final = extra[FINAL_MASK_KEY]
    scores = batch.batch["rm_scores"].sum(-1)
    assert len(batch) > final.sum() == 2 * 3  # more rows than trajectories: one per turn
    for t in np.unique(extra[TRAJECTORY_KEY]):
        rows = np.flatnonzero(extra[TRAJECTORY_KEY] == t)
        values = torch.cat([advantages[r][mask[r]] for r in rows])
        assert torch.allclose(values, values[0].expand_as(values)), values
        # GRPO without std normalisation over the group's final scores, whatever the trajectory lengths.
        group = [r for r in np.flatnonzero(final) if extra["uid"][r] == extra["uid"][rows[0]]]
        expected = scores[rows[-1]] - scores[group].mean()
        assert values[0].item() == pytest.approx(expected.item(), abs=1e-5)
    assert not advantages[~mask].any()


@pytest.mark.slow
def test_local_grpo_learns_through_memory_turns_and_writes_a_checkpoint(
    tmp_path, tiny_models, hotpot_rows, memagent_config
):
    model = tiny_models / "policy"
    cfg = memagent_config(
        tmp_path,
        model,
        hotpot_rows,
        reward_manager="test_final_token_share",
        steps=12,
        lr=3e-2,
        kl_coef=0.0,
        save_every=6,
        rollout_n=4,
    )
    before = load_file(model / "model.safetensors")
    train_local(cfg)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rewards = [m["reward_mean"] for m in lines]
    assert all(m["trajectories"] == 8 and m["rows"] > 8 for m in lines)
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards
    after = load_file(tmp_path / "run" / "ckpt" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.slow
def test_memagent_reward_run_logs_its_components(tmp_path, tiny_models, hotpot_rows, memagent_config):
    metrics = train_local(memagent_config(tmp_path, tiny_models / "policy", hotpot_rows, steps=1))
    assert {"exact_match_mean", "sub_em_mean", "f1_mean", "boxed_mean", "chunks_mean"} <= set(metrics)
    assert metrics["chunks_mean"] == 3.0 and (tmp_path / "run" / "ckpt" / "manifest.json").is_file()
