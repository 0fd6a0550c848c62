"""``memupdate bench memagent``: MemAgent evaluation's cost against context length.

The same model evaluates the same questions with contexts of 1, 2, 4, 8 and 16 chunks (each context is
longer than 16 chunks and centre-truncated to exactly ``k``). Each length runs in its own process, so its
peak resident memory is its own, and is timed ``repeats`` times after a warm-up: its time is the median,
which one slow phase of a shared machine does not move. The recurrent memory keeps every turn's prompt
bounded, so wall time should grow linearly with the number of chunks and peak memory should not grow at all.
Beside each length's wall time, the model's own forwards for the same tokens (prefill and decoding, the in-process
server's clock): per chunk, what the loop costs against a raw generation of what it generated.

Targets: a linear fit of time against chunks with R^2 >= 0.98; peak memory within 10% across lengths.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from memupdate.bench.report import format_table, save_report

logger = logging.getLogger(__name__)

TARGETS = {"r2": 0.98, "peak_memory_spread": 0.10}
#: A model every machine can build offline: tiny random Qwen2 weights with heads vLLM's CPU kernels take.
DEFAULT_MODEL = {"kind": "tiny_random", "seed": 0, "hidden_size": 128, "heads": 2, "kv_heads": 2}


def linear_fit(x: Sequence[float], y: Sequence[float]) -> dict[str, float]:
    """Least-squares line through (x, y) and its R^2.

    >>> linear_fit([1, 2, 4], [3, 5, 9])
    {'slope': 2.0, 'intercept': 1.0, 'r2': 1.0}
    """
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    slope, intercept = np.polyfit(x, y, 1)
    residual = float(((y - (slope * x + intercept)) ** 2).sum())
    total = float(((y - y.mean()) ** 2).sum())
    return {
        "slope": round(float(slope), 6),
        "intercept": round(float(intercept), 6),
        "r2": round(1.0 - residual / total if total else 1.0, 6),
    }


def _one_length(args: argparse.Namespace) -> None:
    """Child process: evaluate ``args.rows`` with at most ``args.chunks`` chunks; print a JSON line."""
    from memupdate.eval.memagent import MemAgentEvalSettings, MemAgentEvaluator

    # Truncation is what sets the length here; our style alone (greedy) keeps the timing deterministic.
    settings = MemAgentEvalSettings(
        chunk_size=args.chunk_size,
        truncate_chunks=args.chunks,
        max_memory_tokens=args.memory_tokens,
        max_final_tokens=args.final_tokens,
        prompt_length=args.prompt_length,
        batch_size=args.batch_size,
        memagent_style=False,
    )
    evaluator = MemAgentEvaluator(args.model, settings, Path(args.work) / f"chunks-{args.chunks}")
    if args.warmup:  # the first requests pay one-off costs (allocator growth, lazy imports)
        evaluator.evaluate(args.rows, label="warm-up")
    times, generation, tokens = [], [], []
    server = evaluator.server
    for _ in range(args.repeats):
        before, forwards, start = server.generated_tokens, server.seconds, time.perf_counter()
        summary = evaluator.evaluate(args.rows, label=f"{args.chunks} chunks")
        times.append(time.perf_counter() - start)
        generation.append(server.seconds - forwards)
        tokens.append(server.generated_tokens - before)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    sys.stdout.write(
        json.dumps(
            {
                # The evaluation's own summary first: its "seconds" is the mean per question, which the
                # length's wall time below replaces.
                **summary,
                "chunks": args.chunks,
                "seconds": round(statistics.median(times), 4),
                "seconds_per_repeat": [round(t, 4) for t in times],
                "generation_seconds": round(statistics.median(generation), 4),
                "peak_rss_mb": round(peak_mb, 1),
                "generated_tokens": tokens[0],
                "generated_tokens_per_repeat": tokens,
            }
        )
        + "\n"
    )


def run_memagent_bench(
    hotpotqa: str | Path,
    *,
    model: str | Path | None = None,
    chunks: Sequence[int] = (1, 2, 4, 8, 16),
    chunk_size: int = 256,
    questions: int = 4,
    memory_tokens: int = 32,
    final_tokens: int = 16,
    repeats: int = 3,
    work_dir: str | Path = "results/bench/memagent",
    output: str | None = "results/bench/memagent.json",
) -> dict[str, Any]:
    """Run every length in a child process (timed ``repeats`` times, the median kept) and fit time and memory
    against chunks."""
    import pyarrow.parquet as pq

    from memupdate.data.hotpotqa import BudgetTooSmallError, preprocess_hotpotqa
    from memupdate.models.prepare import prepare_model

    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    if model is None:
        model = work / "model"
        if not (model / "config.json").exists():
            prepare_model(DEFAULT_MODEL, model)
    # Contexts longer than the longest length, so every length is exactly `k` chunks after truncation.
    need = int(max(chunks) * chunk_size * 1.2)
    rows = work / f"rows-{need}.parquet"
    if not rows.exists():
        try:
            preprocess_hotpotqa(hotpotqa, rows, max_tokens=need, limit=questions, tokenizer=str(model))
        except BudgetTooSmallError:
            # Every question's own two paragraphs are longer than the longest length already (a byte-level
            # tokenizer): they alone make the rows, and truncation cuts each to its k chunks.
            preprocess_hotpotqa(hotpotqa, rows, num_docs=2, limit=questions, tokenizer=str(model))
    # preprocess_hotpotqa counted each context with the model's own tokenizer, as the loop does.
    shortest = min(pq.read_table(rows, columns=["num_tokens"]).column("num_tokens").to_pylist())
    if shortest < max(chunks) * chunk_size:
        raise ValueError(
            f"{rows}: a context has only {shortest} tokens, fewer than {max(chunks)} chunks of {chunk_size}"
        )
    prompt_length = chunk_size + memory_tokens + 512  # the template, the question and the cut marker
    results = []
    for k in chunks:
        argv = [
            sys.executable,
            "-m",
            "memupdate.bench.memagent",
            "--model",
            str(model),
            "--rows",
            str(rows),
            "--chunks",
            str(k),
            "--chunk-size",
            str(chunk_size),
            "--memory-tokens",
            str(memory_tokens),
            "--final-tokens",
            str(final_tokens),
            "--prompt-length",
            str(prompt_length),
            "--work",
            str(work),
            "--batch-size",
            str(questions),
            "--repeats",
            str(repeats),
            "--warmup",
        ]
        logger.info("memagent bench: %d chunks", k)
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"memagent bench at {k} chunks failed ({done.returncode}):\n{done.stderr[-3000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        if result["chunks_read"] != k:
            raise RuntimeError(f"asked for {k} chunks per question, the loop read {result['chunks_read']}")
        results.append(result)
    lengths = [r["chunks"] for r in results]
    fit = linear_fit(lengths, [r["seconds"] for r in results])
    generation = linear_fit(lengths, [r["generation_seconds"] for r in results])
    peaks = [r["peak_rss_mb"] for r in results]
    spread = (max(peaks) - min(peaks)) / min(peaks)
    report = {
        "model": str(model),
        "questions": questions,
        "chunk_size": chunk_size,
        "memory_tokens": memory_tokens,
        "final_tokens": final_tokens,
        "repeats": repeats,
        "lengths": results,
        "time_fit": fit,
        # The same tokens' forwards alone: the loop's cost per chunk beyond them is the slopes' difference.
        "generation_fit": generation,
        "loop_overhead_per_chunk": round(fit["slope"] - generation["slope"], 6),
        "peak_memory_spread": round(spread, 4),
        "targets": TARGETS,
        "pass": {"r2": fit["r2"] >= TARGETS["r2"], "peak_memory_spread": spread <= TARGETS["peak_memory_spread"]},
    }
    save_report(report, output)
    return report


def format_memagent_bench(report: dict[str, Any]) -> str:
    rows = [
        [
            r["chunks"],
            r["chunks"] * report["chunk_size"],
            r["seconds"],
            r["seconds"] / report["questions"],
            r["generation_seconds"],
            r["peak_rss_mb"],
            r["generated_tokens"],
        ]
        for r in report["lengths"]
    ]
    table = format_table(
        rows, ["chunks", "tokens read", "eval s", "s / question", "generation s", "peak RSS MB", "tokens out"]
    )
    fit, generation = report["time_fit"], report["generation_fit"]
    return (
        f"{table}\n\ntime = {fit['slope']:.3f} s/chunk x chunks + {fit['intercept']:.3f} s; R^2 = {fit['r2']:.4f} "
        f"(target >= {TARGETS['r2']}: {'pass' if report['pass']['r2'] else 'FAIL'})\n"
        f"the model's forwards for the same tokens: {generation['slope']:.3f} s/chunk; the loop adds "
        f"{report['loop_overhead_per_chunk']:.3f} s/chunk\n"
        f"peak memory spread {100 * report['peak_memory_spread']:.1f}% "
        f"(target <= {100 * TARGETS['peak_memory_spread']:.0f}%: {'pass' if report['pass']['peak_memory_spread'] else 'FAIL'})"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one length of `memupdate bench memagent` (a child process)")
    for name in ("--model", "--rows", "--work"):
        parser.add_argument(name, required=True)
    for name in (
        "--chunks",
        "--chunk-size",
        "--memory-tokens",
        "--final-tokens",
        "--prompt-length",
        "--batch-size",
        "--repeats",
    ):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--warmup", action="store_true", help="evaluate once before the timed run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    _one_length(args)


if __name__ == "__main__":
    main()
