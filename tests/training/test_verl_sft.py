"""The demonstration rows verl's SFT trainer reads (memupdate.training.verl_sft): the episode's own tokens,
unpadded, the loss on the policy's tokens only."""

from __future__ import annotations

import pytest
import torch
from verl import DataProto

from memupdate.training.verl_sft import CPU_OVERRIDES, DemonstrationDataset, sft_command, sft_overrides, write_rows

PAD = 0


def episode_rows() -> DataProto:
    """Two rows in the rollout layout: prompts left-padded to 4, responses right-padded to 5; the second
    response holds a tool output (mask 0) between two policy turns."""
    prompts = torch.tensor([[PAD, PAD, 11, 12], [21, 22, 23, 24]])
    responses = torch.tensor([[13, 14, PAD, PAD, PAD], [25, 26, 27, 28, 29]])
    response_mask = torch.tensor([[1, 1, 0, 0, 0], [1, 0, 0, 1, 1]])
    attention_mask = torch.cat([prompts != PAD, torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])], dim=1).long()
    return DataProto.from_single_dict(
        {
            "prompts": prompts,
            "responses": responses,
            "response_mask": response_mask,
            "attention_mask": attention_mask,
            "input_ids": torch.cat([prompts, responses], dim=1),
        }
    )


def test_rows_are_the_episodes_tokens_with_the_loss_on_the_policys_own(tmp_path):
    path = tmp_path / "rows.parquet"
    assert write_rows(episode_rows(), path) == [4, 9]
    dataset = DemonstrationDataset(str(path), tokenizer=None, config={"max_length": 16})
    assert len(dataset) == 2
    first, second = dataset[0], dataset[1]
    assert first["input_ids"].tolist() == [11, 12, 13, 14]
    assert first["loss_mask"].tolist() == [0, 0, 1, 1]
    assert first["position_ids"].tolist() == [0, 1, 2, 3]
    assert second["input_ids"].tolist() == [21, 22, 23, 24, 25, 26, 27, 28, 29]
    assert second["loss_mask"].tolist() == [0, 0, 0, 0, 1, 0, 0, 1, 1]


def test_a_row_longer_than_max_length_is_refused_not_cut(tmp_path):
    path = tmp_path / "rows.parquet"
    write_rows(episode_rows(), path)
    with pytest.raises(ValueError, match=r"row 1: 9 tokens, above data.max_length 8"):
        DemonstrationDataset([str(path)], tokenizer=None, config={"max_length": 8})


def test_the_sft_settings_become_verls_overrides():
    settings = {
        "epochs": 2,
        "batch_size": 8,
        "micro_batch_size": 2,
        "lr": 5e-5,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "seed": 3,
    }
    common = {"settings": settings, "model": "m", "rows": "r.parquet", "run_dir": "run", "max_length": 300}
    gpu = sft_overrides(**common, world_size=4)
    assert {"data.train_batch_size=8", "data.micro_batch_size_per_gpu=2", "trainer.total_epochs=2"} <= set(gpu)
    assert "data.custom_cls.name=DemonstrationDataset" in gpu and "trainer.n_gpus_per_node=4" in gpu
    assert not set(CPU_OVERRIDES) & set(gpu)
    cpu = sft_overrides(**common, world_size=1, device="cpu")
    assert set(CPU_OVERRIDES) <= set(cpu) and "trainer.device=cpu" in cpu
    assert sft_command(gpu, 4)[-len(gpu) - 2 :] == ["-m", "verl.trainer.sft_trainer", *gpu]
    with pytest.raises(ValueError, match="sft.batch_size 8 does not split over 3 ranks"):
        sft_overrides(**common, world_size=3)
