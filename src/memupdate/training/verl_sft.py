"""The cold start's fine-tuning: verl's SFT trainer (``verl.trainer.sft_trainer``, its FSDP engine, on GPUs or on
CPU) on the demonstrations :mod:`memupdate.training.sft` makes.

The demonstrations are the agent loop's own token rows (:func:`memupdate.training.sft.make_demonstrations`):
verl's multi-turn dataset would re-tokenise the episode turn by turn from chat messages, which need not give
the tokens the agent loop gave the policy (tool outputs, the chat template's turn joins). So the rows go to
verl as tokens: :func:`write_rows` stores each kept row's ids and loss mask (1 on the policy's own tokens,
0 on the prompt and the tool outputs) in ``<run>/demonstrations.parquet``, and :class:`DemonstrationDataset`
hands them to verl's trainer (its ``data.custom_cls``), unpadded, in the layout of verl's own multi-turn
dataset (``pad_mode: no_padding``). The loss is verl's ``sft_loss``: the token mean over the batch.

One node: :func:`sft_command` runs ``torchrun`` with one rank per GPU of the node (per ``cpu_slot`` on CPU,
``trainer.device: cpu``). :func:`run_verl_sft` runs it and merges the last checkpoint's FSDP
shards into ``<run>/ckpt``, as a main_ppo run's (:func:`memupdate.training.stages.run_verl`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from verl import DataProto

from memupdate.training.verl_launcher import HYDRA_DIR, hydra_value, run_env
from memupdate.utils.io import write_parquet_atomic

ROWS_FILE = "demonstrations.parquet"
TRAINER_LOG = "sft_trainer.log"

#: What a run on CPU changes (``trainer.device: cpu``), as :data:`memupdate.training.verl_launcher.CPU_CONFIG`
#: does for main_ppo: verl's cpu platform (``VERL_PLATFORM=cpu``, set by :func:`sft_command`), FSDP2 (FSDP1
#: pins its shards to a CUDA device), PyTorch's SDPA attention instead of flash-attn, padded attention
#: (unpadded is flash-attn's CUDA kernel), no torch.compile, no data-loader processes, and the model saved in
#: Hugging Face format with the checkpoint (exported by copying it, as main_ppo's on CPU).
CPU_OVERRIDES = (
    "engine.strategy=fsdp2",
    "engine.use_torch_compile=false",
    # As the RL update on CPU (memupdate/training/verl_config/cpu.yaml): recomputing activations costs more than
    # keeping one row's.
    "model.enable_gradient_checkpointing=false",
    "model.use_remove_padding=false",
    "++model.override_config.attn_implementation=sdpa",
    "data.num_workers=0",
    "checkpoint.save_contents=[model,optimizer,extra,hf_model]",
)


def write_rows(data: DataProto, path: str | os.PathLike) -> list[int]:
    """``path``: one parquet row per demonstration row of ``data`` (verl's rollout layout: left-padded
    ``prompts``, right-padded ``responses``, ``attention_mask`` over both, ``response_mask``), with its
    unpadded ``input_ids`` and ``loss_mask``; returns each row's length in tokens."""
    prompts, responses = data.batch["prompts"], data.batch["responses"]
    width = prompts.shape[1]
    attention, response_mask = data.batch["attention_mask"].bool(), data.batch["response_mask"]
    ids, masks = [], []
    for i in range(len(data)):
        prompt = prompts[i][attention[i, :width]]
        present = attention[i, width:]
        response = responses[i][present]
        ids.append(torch.cat([prompt, response]).tolist())
        masks.append([0] * len(prompt) + response_mask[i][present].int().tolist())
    write_parquet_atomic(path, pa.table({"input_ids": ids, "loss_mask": masks}))
    return [len(row) for row in ids]


class DemonstrationDataset(torch.utils.data.Dataset):
    """verl's SFT dataset interface (``data.custom_cls``) over :func:`write_rows`' parquet files: per row
    ``input_ids``, ``position_ids`` and ``loss_mask``, unpadded (``data.pad_mode: no_padding``).

    A row longer than ``data.max_length`` is an error naming it: cutting a demonstration would teach its head
    without its end."""

    def __init__(
        self,
        parquet_files: str | Sequence[str],
        tokenizer: Any,
        config: Mapping[str, Any],
        processor: Any = None,
        max_samples: int = -1,
    ):
        files = [parquet_files] if isinstance(parquet_files, str) else list(parquet_files)
        rows = [row for path in files for row in pq.read_table(path).to_pylist()]
        if max_samples is not None and max_samples > 0:
            rows = rows[:max_samples]
        max_length = int(config.get("max_length", 0) or 0)
        for index, row in enumerate(rows):
            if len(row["input_ids"]) != len(row["loss_mask"]):
                raise ValueError(f"{files}, row {index}: input_ids and loss_mask differ in length")
            if max_length and len(row["input_ids"]) > max_length:
                raise ValueError(
                    f"{files}, row {index}: {len(row['input_ids'])} tokens, above data.max_length {max_length}"
                )
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.rows[index]
        input_ids = torch.tensor(row["input_ids"], dtype=torch.long)
        return {
            "input_ids": input_ids,
            "position_ids": torch.arange(len(input_ids), dtype=torch.long),
            "loss_mask": torch.tensor(row["loss_mask"], dtype=torch.long),
        }


def sft_overrides(
    *,
    settings: Mapping[str, Any],
    model: str,
    rows: str,
    run_dir: str,
    max_length: int,
    world_size: int,
    device: str = "cuda",
) -> list[str]:
    """The hydra overrides of ``verl.trainer.sft_trainer`` for an ``sft`` section
    (:class:`~memupdate.settings.SFTSettings` values): its batch (in rows, global), micro-batch (per rank),
    epochs, AdamW settings and seed; the model, the demonstration rows and the run's folders.

    >>> o = sft_overrides(settings={"epochs": 2, "batch_size": 8, "micro_batch_size": 2, "lr": 5e-5,
    ...                             "weight_decay": 0.0, "max_grad_norm": 1.0, "seed": 0},
    ...                   model="m", rows="r.parquet", run_dir="/run", max_length=2048, world_size=2)
    >>> [x for x in o if x.startswith(("data.train_batch_size", "optim.lr=", "trainer.total_epochs"))]
    ['data.train_batch_size=8', 'optim.lr=5e-05', 'trainer.total_epochs=2']
    """
    batch = int(settings["batch_size"])
    if batch % world_size:
        raise ValueError(f"sft.batch_size {batch} does not split over {world_size} ranks")
    overrides = [
        f"model.path={model}",
        f"data.train_files={rows}",
        "data.custom_cls.path=pkg://memupdate.training.verl_sft",
        f"data.custom_cls.name={DemonstrationDataset.__name__}",
        "data.pad_mode=no_padding",
        f"data.max_length={max_length}",
        # On CPU one row per micro-batch, unpadded, its activations kept (CPU_OVERRIDES; memupdate bench update).
        f"data.max_token_len_per_gpu={max_length if device == 'cpu' else max(max_length, 8192)}",
        f"data.train_batch_size={batch}",
        f"data.micro_batch_size_per_gpu={int(settings['micro_batch_size'])}",
        f"optim.lr={settings['lr']}",
        f"optim.weight_decay={settings['weight_decay']}",
        f"optim.clip_grad={settings['max_grad_norm']}",
        f"trainer.total_epochs={int(settings['epochs'])}",
        f"trainer.seed={int(settings['seed'])}",
        f"engine.seed={int(settings['seed'])}",
        f"trainer.default_local_dir={Path(run_dir).resolve() / 'checkpoints'}",
        # The ckpt is the merged last checkpoint; a fresh run, never another run's leftovers.
        "trainer.resume_mode=disable",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.logger=[console,file,tensorboard]",
        "trainer.project_name=memupdate",
        f"trainer.experiment_name={Path(run_dir).resolve().parent.name}-sft",
        f"trainer.n_gpus_per_node={world_size}",
        f"trainer.device={device}",
        # hydra's own output (the composed config, its log) inside the run, not in the working directory.
        f"hydra.run.dir={hydra_value(Path(run_dir).resolve() / HYDRA_DIR)}",
    ]
    if device == "cpu":
        overrides += CPU_OVERRIDES
    return overrides


def sft_command(overrides: Sequence[str], world_size: int) -> list[str]:
    """``torchrun`` of verl's SFT trainer on this node, one rank per GPU (per CPU slot)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={world_size}",
        "-m",
        "verl.trainer.sft_trainer",
        *overrides,
    ]


def run_verl_sft(
    data: DataProto,
    *,
    settings: Mapping[str, Any],
    model: str,
    run_dir: str,
    world_size: int,
    device: str = "cuda",
) -> Path:
    """Fine-tune ``model`` on the demonstration rows ``data`` with verl's SFT trainer; its output in
    ``<run>/sft_trainer.log``, the merged last checkpoint in ``<run>/ckpt``."""
    from memupdate.training.stages import run_verl

    run = Path(run_dir)
    rows = run / ROWS_FILE
    lengths = write_rows(data, rows)
    batch = int(settings["batch_size"])
    if len(lengths) < batch:
        raise ValueError(
            f"{len(lengths)} demonstration rows, fewer than sft.batch_size {batch}: verl drops the last batch"
        )
    overrides = sft_overrides(
        settings=settings,
        model=model,
        rows=str(rows.resolve()),
        run_dir=str(run),
        max_length=max(lengths),
        world_size=world_size,
        device=device,
    )
    # The trackers' folders inside the run, and verl's cpu platform on CPU: as for main_ppo.
    environment = run_env(run, {"trainer.device": device})
    return run_verl(
        sft_command(overrides, world_size), environment, str(run), model, log_name=TRAINER_LOG, shards=None, kind="sft"
    )
