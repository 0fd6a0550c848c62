"""The local and verl backends agree where they can be compared: for identical trajectories, the reward
workers each backend builds (the local one from its run config, verl's from main_ppo's composed config)
give identical rewards; for identical rewards, verl's V1 trainer and the local backend give identical GRPO
advantages (MemoryUpdate's normalised groups and MemAgent's multi-output, unnormalised ones), a group whose
rollouts all got one reward included: both keep it with zero advantages (verl's algorithm.filter_groups, which
would drop and refill it, is off: its refill has no cap in verl 0.9.1)."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from verl import DataProto
from verl.experimental.reward_loop.reward_loop import RewardLoopWorker
from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

from memupdate.agents.fields import ANSWER_KEY, DELTA_KEY, STAGE_KEY
from memupdate.memory.environment import MemoryEnvironment
from memupdate.memory.store import TrialStore
from memupdate.rollout.config import run_config
from memupdate.rollout.workers import FINAL_MASK_KEY, TRAJECTORY_KEY, TURN_INDEX_KEY
from memupdate.tools.config import TOOL_CONFIG
from memupdate.training import verl_launcher as vl
from memupdate.training.local import LocalGRPOTrainer, local_config
from memupdate.training.stages import stage_reward

QUESTION = "When did Caroline go to the LGBTQ support group?"
ANSWERING_MEMORY = "Caroline went to the LGBTQ support group on 7 May 2023."


@pytest.fixture(scope="module")
def workflow(repo_root):
    return yaml.safe_load((repo_root / "config" / "config.yaml").read_text())


@pytest.fixture(scope="module")
def configs(workflow, tiny_models, locomo_rows, memories_parquet, cache_dir, tmp_path_factory):
    """Stage 1 of one experiment on each backend: the local backend's reward-worker config and main_ppo's."""
    root = tmp_path_factory.mktemp("agreement")
    memory = MemoryEnvironment(memories=memories_parquet, embeddings=cache_dir)
    reward = stage_reward(
        {**{k: v for k, v in workflow["reward"].items() if k != "judge"}, "scorer": "answer_recall"},
        "memory",
        None,
        {},
    )
    model = tiny_models / "policy"
    local = local_config(
        workflow["experiments"]["smoke"]["stage1"],
        model_path=str(model),
        train_files=[str(locomo_rows["train"])],
        memory=memory,
        tool_config=str(TOOL_CONFIG),
        run_dir=str(root / "local"),
        reward=reward,
        training_stage="memory",
        qa_phase=False,
        fixed_model=None,
        qa_max_tokens=reward["qa_max_tokens"],
    )
    run = {
        "model_path": model,
        "train_files": locomo_rows["train"],
        "val_files": locomo_rows["test"],
        "tool_config": TOOL_CONFIG,
        "memory": memory,
        "n_gpus_per_node": 1,
        "nnodes": 1,
        "experiment_dir": root / "verl",
        "reward": reward,
    }
    vl.prepare_main_ppo("memory", **run)  # writes the run's memory environment, as before main_ppo starts
    verl = vl.validate_overrides(vl.CONFIG_DIR, vl.CONFIG_NAME, vl.compose_overrides("memory", **run))
    return SimpleNamespace(local=local, local_verl=run_config(local), verl=verl)


@pytest.fixture(scope="module")
def trajectories(locomo_rows, base, embedder):
    """Three finished stage-1 trajectories on one question: no edit, a memory that answers it, a deletion."""
    rows = pq.read_table(locomo_rows["train"], columns=["extra_info"]).column("extra_info").to_pylist()
    (info,) = [r for r in rows if r["question"] == QUESTION]
    answering = TrialStore(base, embedder)
    answering.create(ANSWERING_MEMORY, {"speaker": "Caroline"}, vector=embedder.encode([ANSWERING_MEMORY])[0])
    deleting = TrialStore(base, embedder)
    deleting.delete(0)
    deltas = [TrialStore(base).export_delta(), answering.export_delta(), deleting.export_delta()]
    return [
        DataProto(
            batch=None,
            non_tensor_batch={
                "extra_info": np.array([info], dtype=object),
                "tool_extra_fields": np.array([{DELTA_KEY: d, ANSWER_KEY: None, STAGE_KEY: "memory"}], dtype=object),
            },
        )
        for d in deltas
    ]


def scores(config, trajectories):
    async def main():
        worker = RewardLoopWorker(config)
        return [await worker.compute_score(t) for t in trajectories]

    return asyncio.run(main())


def test_identical_trajectories_get_identical_rewards_on_both_backends(configs, trajectories):
    local, verl = scores(configs.local_verl, trajectories), scores(configs.verl, trajectories)
    assert [s["reward_score"] for s in local] == [s["reward_score"] for s in verl]
    assert [s["reward_extra_info"] for s in local] == [s["reward_extra_info"] for s in verl]
    # Not a vacuous agreement: the answering edit is rewarded, the others are not.
    assert [s["reward_score"] > 0 for s in local] == [False, True, False]


def rows(rewards: list[list[float]], turns: int, response_length: int = 4) -> tuple[DataProto, list[str]]:
    """GRPO groups (one list of trajectory rewards per prompt), each trajectory ``turns`` rows (a multi-output
    trajectory) with its reward on the final row's last token; and verl's TransferQueue keys for them."""
    uids, trajectories, turn_index, final, keys, scores_ = [], [], [], [], [], []
    for g, group in enumerate(rewards):
        for t, reward in enumerate(group):
            for i in range(turns):
                uids.append(f"p{g}")
                trajectories.append(g * 100 + t)
                turn_index.append(i)
                final.append(i == turns - 1)
                keys.append(f"p{g}_{t}_{i}")
                row = [0.0] * response_length
                row[-1] = reward if i == turns - 1 else 0.0
                scores_.append(row)
    batch = DataProto.from_dict(
        tensors={"rm_scores": torch.tensor(scores_), "response_mask": torch.ones(len(keys), response_length)},
        non_tensors={
            "uid": np.array(uids, dtype=object),
            TRAJECTORY_KEY: np.array(trajectories),
            TURN_INDEX_KEY: np.array(turn_index),
            FINAL_MASK_KEY: np.array(final),
        },
    )
    return batch, keys


def verl_advantages(config, batch: DataProto, keys: list[str]) -> torch.Tensor:
    """What verl 0.9.1's V1 trainer computes (PPOTrainer._compute_advantage, trainer_base.py), from its config."""
    data = DataProto(batch=batch.batch.select("response_mask", "rm_scores").clone())
    data.batch["token_level_scores"] = data.batch["rm_scores"]
    data.batch["token_level_rewards"] = data.batch["token_level_scores"]
    data.non_tensor_batch["uid"] = batch.non_tensor_batch["uid"]
    out = compute_advantage_for_multi_trajectories(
        data,
        batch_keys=keys,
        adv_estimator=config.algorithm.adv_estimator,
        gamma=config.algorithm.gamma,
        lam=config.algorithm.lam,
        num_repeat=config.actor_rollout_ref.rollout.n,
        norm_adv_by_std_in_grpo=config.algorithm.get("norm_adv_by_std_in_grpo", True),
        config=config.algorithm,
    )
    return out.batch["advantages"]


def local_advantages(local_cfg, batch: DataProto) -> torch.Tensor:
    return LocalGRPOTrainer._advantages(SimpleNamespace(cfg=local_cfg), batch)


REWARDS = [[1.0, 0.0, 0.5, 0.25], [0.3, 0.3, 0.3, 0.3], [0.0, 2.0, 0.0, 1.0]]


def test_identical_rewards_get_identical_grpo_advantages_memoryupdate(configs):
    assert configs.local.norm_adv_by_std is True
    batch, keys = rows(REWARDS, turns=1)
    local, verl = local_advantages(configs.local, batch), verl_advantages(configs.verl, batch, keys)
    varied = ~torch.tensor(np.array(batch.non_tensor_batch["uid"]) == "p1")
    torch.testing.assert_close(local, verl)
    assert local[varied].abs().sum() > 0
    # The constant group stays in verl's batch too, and neither backend learns from it.
    assert not configs.verl.algorithm.filter_groups.enable and not local[~varied].any()


def test_identical_rewards_get_identical_grpo_advantages_memagent(tmp_path, workflow, tiny_models, hotpot_rows):
    """MemAgent: multi-output trajectories (every turn gets its trajectory's advantage), not normalised by
    the group's std (Dr.GRPO), on both backends."""
    experiment = workflow["experiments"]["memagent_smoke"]
    settings = {k: v for k, v in experiment["train"].items() if k != "num_docs"}
    local = local_config(
        settings,
        model_path=str(tiny_models / "policy"),
        train_files=[str(hotpot_rows)],
        run_dir=str(tmp_path / "local"),
        agent_name="memagent",
        agent=dict(experiment["loop"]),
        reward_manager="memupdate_memagent",
    )
    overrides = vl.memagent_overrides(
        model_path=tiny_models / "policy",
        train_files=hotpot_rows,
        val_files=hotpot_rows,
        loop=experiment["loop"],
        n_gpus_per_node=1,
        nnodes=1,
        experiment_dir=tmp_path / "verl",
    )
    verl = vl.validate_overrides(vl.CONFIG_DIR, vl.MEMAGENT_CONFIG_NAME, overrides)
    assert dataclasses.asdict(local)["norm_adv_by_std"] is False
    batch, keys = rows(REWARDS, turns=3)
    got, want = local_advantages(local, batch), verl_advantages(verl, batch, keys)
    varied = ~torch.tensor(np.array(batch.non_tensor_batch["uid"]) == "p1")
    torch.testing.assert_close(got[varied], want[varied])
    # Every turn of a trajectory carries the trajectory's advantage.
    per_turn = got[varied][:, -1].reshape(-1, 3)
    assert (per_turn == per_turn[:, :1]).all() and per_turn.abs().sum() > 0
