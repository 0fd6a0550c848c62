"""``memupdate bench update``: the actor's update on CPU, with and without gradient checkpointing.

verl's actor on a CPU node splits a step's episodes into micro-batches of at most ``ppo_max_token_len_per_gpu``
tokens (its own ``rearrange_micro_batches``: the fewest balanced parts within the budget, which must hold the
padded episode width), pads each micro-batch to its longest episode (SDPA on CPU takes no packed sequences) and
computes in bfloat16 (FSDP2's mixed precision, verl's default ``param_dtype``). Here the same partition of a group
of episodes of random lengths, the policy model's forward and backward passes (Hugging Face, one rank, no FSDP)
and a policy-gradient-shaped loss (the log-probs of the second half of each episode) are timed for every pair of
gradient checkpointing (on, off) and token budget. Each pair runs in its own process, so that its peak resident
memory is its own, and is timed ``repeats`` times after a warm-up update: its time is the median. The rise of peak
memory over the loaded model is what the update's activations, logits and gradients cost on top of the weights.

What it decides: ``actor_rollout_ref.model.enable_gradient_checkpointing`` and the micro-batch budget of CPU runs
(memupdate/training/verl_config/cpu.yaml, docs/verl-on-cpu.md).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import random
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memupdate.bench.report import format_table, save_report

logger = logging.getLogger(__name__)

DTYPES = ("bfloat16", "float32")


def micro_batches(lengths: Sequence[int], width: int, budget: int) -> list[list[int]]:
    """The episodes (indices into ``lengths``) of each micro-batch verl's ``rearrange_micro_batches`` makes of a
    batch of ``lengths`` tokens padded to ``width``, at ``budget`` tokens per micro-batch.

    >>> sorted(micro_batches([1500, 1200, 1900, 1100], width=2048, budget=2048))
    [[0], [1], [2], [3]]
    >>> sorted(map(sorted, micro_batches([1500, 1200, 1900, 1100], width=2048, budget=8192)))
    [[0, 1, 2, 3]]
    """
    import torch
    from tensordict import TensorDict
    from verl.utils.seqlen_balancing import rearrange_micro_batches

    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    batch = TensorDict({"input_ids": mask.clone(), "attention_mask": mask}, batch_size=[len(lengths)])
    _, indices = rearrange_micro_batches(batch, max_token_len=budget)
    return [list(map(int, part)) for part in indices]


def _one_setting(args: argparse.Namespace) -> None:
    """Child process: time the update of ``args.lengths`` at one checkpointing and budget; print a JSON line."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    lengths = json.loads(args.lengths)
    parts = micro_batches(lengths, args.width, args.budget)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.config.use_cache = False
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    loaded_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    dtype = getattr(torch, args.dtype)
    vocab = model.config.vocab_size
    inputs = [torch.randint(0, vocab, (len(part), max(lengths[i] for i in part))) for part in parts]

    def update() -> None:
        for ids in inputs:
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                logits = model(input_ids=ids).logits
            # verl's log-probs are taken in float32 over the whole vocabulary.
            logprobs = torch.log_softmax(logits.float()[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            (-logprobs[:, ids.shape[1] // 2 :].mean() * len(ids) / len(lengths)).backward()
        model.zero_grad(set_to_none=True)

    update()  # the first update pays one-off costs (allocator growth, kernel selection)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        update()
        times.append(time.perf_counter() - start)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    padded = sum(ids.numel() for ids in inputs)
    sys.stdout.write(
        json.dumps(
            {
                "checkpointing": args.checkpointing,
                "budget": args.budget,
                "micro_batches": [len(part) for part in parts],
                "padded_tokens": padded,
                "seconds": round(statistics.median(times), 3),
                "seconds_per_repeat": [round(t, 3) for t in times],
                "peak_rss_mb": round(peak_mb, 1),
                "rise_mb": round(peak_mb - loaded_mb, 1),
            }
        )
        + "\n"
    )


def run_update_bench(
    model: str | Path,
    *,
    episodes: int = 4,
    min_tokens: int = 1100,
    max_tokens: int = 2000,
    width: int | None = None,
    budgets: Sequence[int] = (2048, 8192),
    dtype: str = "bfloat16",
    repeats: int = 1,
    seed: int = 0,
    output: str | None = None,
) -> dict[str, Any]:
    """Time the update of ``episodes`` episodes of ``min_tokens``-``max_tokens`` tokens (padded to ``width``,
    default ``max_tokens``) for checkpointing on and off at each budget (see the module docstring)."""
    width = width or max_tokens
    if not 0 < min_tokens <= max_tokens <= width:
        raise ValueError(f"need 0 < min_tokens <= max_tokens <= width, got {min_tokens}, {max_tokens}, {width}")
    if too_small := [b for b in budgets if b < width]:
        raise ValueError(
            f"budgets {too_small} are below the padded episode width {width}: verl refuses a budget that cannot hold "
            "one episode (ppo_max_token_len_per_gpu must be at least prompt + response length)"
        )
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    draw = random.Random(seed)
    lengths = [draw.randint(min_tokens, max_tokens) for _ in range(episodes)]
    results = []
    for checkpointing, budget in itertools.product((True, False), budgets):
        argv = [
            sys.executable,
            "-m",
            __name__,
            "--model",
            str(model),
            "--lengths",
            json.dumps(lengths),
            "--width",
            str(width),
            "--budget",
            str(budget),
            "--dtype",
            dtype,
            "--repeats",
            str(repeats),
            "--seed",
            str(seed),
            *(["--checkpointing"] if checkpointing else []),
        ]
        logger.info(
            "update bench: checkpointing %s, %d tokens per micro-batch", "on" if checkpointing else "off", budget
        )
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(
                f"update bench (checkpointing {checkpointing}, budget {budget}) failed ({done.returncode}):\n"
                f"{done.stderr[-3000:]}"
            )
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    report = {
        "model": str(model),
        "dtype": dtype,
        "episode_tokens": lengths,
        "width": width,
        "repeats": repeats,
        "settings": results,
    }
    save_report(report, output)
    return report


def format_update_bench(report: dict[str, Any]) -> str:
    rows = [
        [
            "on" if r["checkpointing"] else "off",
            r["budget"],
            "+".join(map(str, r["micro_batches"])),
            r["padded_tokens"],
            r["seconds"],
            round(r["rise_mb"]),
            round(r["peak_rss_mb"]),
        ]
        for r in report["settings"]
    ]
    table = format_table(
        rows, ["checkpointing", "budget", "episodes per micro-batch", "tokens padded", "update s", "rise MB", "peak MB"]
    )
    tokens = report["episode_tokens"]
    return f"{len(tokens)} episodes of {min(tokens)}-{max(tokens)} tokens ({sum(tokens)}), {report['dtype']}\n{table}"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one setting of `memupdate bench update` (a child process)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--lengths", required=True, help="JSON list of episode lengths in tokens")
    parser.add_argument("--dtype", required=True, choices=DTYPES)
    for name in ("--width", "--budget", "--repeats", "--seed"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--checkpointing", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    _one_setting(args)


if __name__ == "__main__":
    main()
