"""A memory policy's held-out episodes, scored by the training reward: what a cold start and GRPO must move.

The memory role's episodes (stage 1's loop, tools, lengths and reward) run on held-out rows, ``n``
rollouts per question sampled at the training temperature, against a server of the policy (vLLM, or
in-process HF for tests). Per episode: the reward and its components, whether the model made a
well-formed tool call (the loop parsed one and ran the tool: tool-output tokens follow its reply), how
many, and what it did to the store. Per policy: the mean reward, the well-formed rate, the share of
questions whose group has reward spread (GRPO's signal), and one score per question (the group's mean
reward), which :func:`compare_policies` pairs across policies.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from transformers import AutoModelForCausalLM
from verl import DataProto
from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

from memupdate.agents.context import LoopContext
from memupdate.eval.stats import paired_by_key
from memupdate.memory.environment import MemoryEnvironment
from memupdate.rollout.config import RolloutConfig, run_config
from memupdate.rollout.workers import FINAL_MASK_KEY, TRAJECTORY_KEY, in_process_workers
from memupdate.serving.hf_server import HFGenerateServer
from memupdate.settings import ServeSettings, TrainSettings, build
from memupdate.tools.config import TOOL_CONFIG
from memupdate.utils.io import write_json_atomic, write_text_atomic

logger = logging.getLogger(__name__)

EPISODES = "episodes.jsonl"
#: Reward components the report shows per policy (the reward manager's extras).
COMPONENTS = ("qa_initial", "qa_final", "ops_created", "ops_updated", "ops_deleted", "memories_final")


def episode_records(batch: DataProto, prompts: DataProto, tokenizer: Any) -> list[dict[str, Any]]:
    """One record per episode of ``batch`` (the rollouts of ``prompts``)."""
    final = batch.non_tensor_batch[FINAL_MASK_KEY].astype(bool)
    scores = batch.batch["rm_scores"].sum(-1)
    extra = batch.non_tensor_batch
    out = []
    for i in np.flatnonzero(final):
        mask = batch.batch["response_mask"][i]
        length = int(batch.batch["attention_mask"][i, -mask.size(0) :].sum())
        # The loop appends tool output (mask 0) only after it parsed a call in the model's reply.
        tool_ran = bool((mask[:length] == 0).any())
        policy_text = tokenizer.decode(batch.batch["responses"][i][mask.bool()], skip_special_tokens=False)
        info = prompts.non_tensor_batch["extra_info"][extra[TRAJECTORY_KEY][i]]
        record = {
            "namespace": info["namespace"],
            "question": info["question"],
            "reward": float(scores[i]),
            "well_formed_call": tool_ran,
            "tool_calls": policy_text.count("<tool_call>"),
            "termination": str(extra["termination_reason"][i]),
            "policy_tokens": int(mask.sum()),
            "policy_text": policy_text,
        }
        record.update({k: _plain(extra[k][i]) for k in COMPONENTS if k in extra})
        out.append(record)
    return out


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


def summarize(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per policy: means over episodes, and per question the group's mean reward and whether it has spread.

    >>> s = summarize([{"namespace": "a", "reward": 0.5, "well_formed_call": True, "tool_calls": 2},
    ...                {"namespace": "a", "reward": 0.0, "well_formed_call": True, "tool_calls": 1},
    ...                {"namespace": "b", "reward": 0.0, "well_formed_call": False, "tool_calls": 0}])
    >>> s["reward_mean"], s["well_formed_rate"], s["groups_with_spread"], s["per_question"]["a"]
    (0.1667, 0.6667, 0.5, 0.25)
    """
    groups: dict[str, list[float]] = defaultdict(list)
    for r in records:
        groups[r["namespace"]].append(r["reward"])
    out = {
        "episodes": len(records),
        "questions": len(groups),
        "reward_mean": round(float(np.mean([r["reward"] for r in records])), 4),
        "well_formed_rate": round(float(np.mean([r["well_formed_call"] for r in records])), 4),
        "tool_calls_mean": round(float(np.mean([r["tool_calls"] for r in records])), 4),
        "groups_with_spread": round(float(np.mean([max(g) > min(g) for g in groups.values()])), 4),
        "per_question": {k: float(np.mean(v)) for k, v in sorted(groups.items())},
    }
    for key in COMPONENTS:
        values = [r[key] for r in records if r.get(key) is not None]
        if values:
            out[f"{key}_mean"] = round(float(np.mean(values)), 4)
    return out


async def _episodes(config, server, dataset: RLHFDataset, n: int, tokenizer: Any) -> list[dict[str, Any]]:
    worker = in_process_workers(config, server, loop_context=LoopContext("policy-eval"))
    prompts = DataProto.from_single_dict(collate_fn([dataset[i] for i in range(len(dataset))]))
    prompts.non_tensor_batch["uid"] = np.array([str(i) for i in range(len(dataset))], dtype=object)
    prompts.meta_info["global_steps"] = 0
    repeated = prompts.repeat(repeat_times=n, interleave=True)
    batch = await worker.generate_sequences(repeated)
    return episode_records(batch, repeated, tokenizer)


def evaluate_policy(
    *,
    model: str,
    rows: str,
    memories: str,
    embeddings: str,
    out_dir: str,
    stage: Mapping[str, Any],
    reward: Mapping[str, Any],
    n: int = 4,
    questions: int | None = None,
    server: str = "vllm",
    serving: Mapping[str, Any] | None = None,
    embedding_model: str | None = None,
    max_content_chars: int | None = None,
) -> dict[str, Any]:
    """Run and score the memory role's episodes of ``model`` on ``rows`` (the first ``questions`` of them);
    write ``<out_dir>/episodes.jsonl`` and ``<out_dir>/summary.json`` and return the summary."""
    settings = build(TrainSettings, stage, "stage1")
    memory_keys = {"embedding_model": embedding_model, "max_content_chars": max_content_chars}
    memory = MemoryEnvironment(
        memories=memories, embeddings=embeddings, **{k: v for k, v in memory_keys.items() if v is not None}
    )
    scored = scorable_rows(rows, Path(out_dir) / "rows.parquet")
    cfg = RolloutConfig(
        model_path=model,
        train_files=[scored],
        run_dir=out_dir,
        tool_config=str(TOOL_CONFIG),
        memory=memory,
        reward={**reward, "training_stage": "memory"},
        rollout_n=n,
        seed=settings.seed,
        **{k: getattr(settings, k) for k in _EPISODE_KEYS},
    )
    config = run_config(cfg)
    with _policy_server(cfg, server, serving) as (client, tokenizer):
        dataset = RLHFDataset([scored], tokenizer, config.data, max_samples=questions or -1)
        records = asyncio.run(_episodes(config, client, dataset, n, tokenizer))
    out = Path(out_dir)
    write_text_atomic(out / EPISODES, "".join(json.dumps(r) + "\n" for r in records))
    summary = {"model": model, "n": n, "settings": asdict(settings), **summarize(records)}
    write_json_atomic(out / "summary.json", summary)
    return summary


def scorable_rows(rows: str, out: Path) -> str:
    """The rows the memory reward can score (a gold answer: categories 1-4, not the adversarial 5), at ``out``."""
    table = pq.read_table(rows)
    answers = pc.struct_field(table.column("extra_info"), "answer")
    kept = table.filter(pc.fill_null(pc.greater(pc.utf8_length(answers), 0), False))
    if not kept.num_rows:
        raise ValueError(f"{rows}: no row has a gold answer for the memory reward to score")
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(kept, out)
    return str(out)


_EPISODE_KEYS = (
    "temperature",
    "top_p",
    "max_new_tokens",
    "prompt_length",
    "response_length",
    "max_assistant_turns",
    "max_parallel_calls",
    "max_tool_response_length",
)


@contextlib.contextmanager
def _policy_server(cfg: RolloutConfig, server: str, serving: Mapping[str, Any] | None):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
    if server == "hf":
        policy = AutoModelForCausalLM.from_pretrained(cfg.model_path, dtype=torch.float32)
        yield HFGenerateServer(policy, tokenizer, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed), tokenizer
        return
    if server != "vllm":
        raise ValueError(f"server must be vllm or hf, got {server!r}")
    from memupdate.serving.client import Endpoint
    from memupdate.serving.launch import vllm_python
    from memupdate.serving.token_client import VLLMTokenClient
    from memupdate.serving.vllm_server import start_vllm_server

    settings = build(ServeSettings, {"dtype": "float32", **(serving or {})}, "serving")
    with start_vllm_server(
        cfg.model_path,
        served_model_name="policy",
        python=vllm_python(settings),
        dtype=settings.dtype,
        max_model_len=cfg.prompt_length + cfg.response_length,
        log_path=Path(cfg.run_dir) / "server.log",
        extra_args=settings.extra_args,
        env=settings.env,
    ) as process:
        process.wait_until_ready(timeout_s=settings.startup_timeout_s)
        yield VLLMTokenClient(Endpoint(process.base_url, "policy"), max_tokens=cfg.max_new_tokens), tokenizer


def compare_policies(summaries: Mapping[str, Mapping[str, Any]], pairs: Sequence[tuple[str, str]]) -> list[dict]:
    """For each ``(a, b)`` of ``pairs``: a's mean reward minus b's on the same questions, with the paired
    bootstrap 95% interval (:func:`memupdate.eval.stats.paired_by_key`)."""
    return [
        {"a": a, "b": b, **paired_by_key(summaries[a]["per_question"], summaries[b]["per_question"])} for a, b in pairs
    ]
