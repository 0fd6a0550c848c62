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
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM
from verl import DataProto
from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

from memupdate.agents.context import LoopContext
from memupdate.data.headroom import read_flags
from memupdate.data.locomo import answerable
from memupdate.eval.report import HELDOUT_CURVE, training_steps
from memupdate.eval.stats import paired_by_key, stratified_by_key
from memupdate.memory.cache import EmbeddingCache
from memupdate.memory.embedder import Embedder
from memupdate.memory.environment import MemoryEnvironment
from memupdate.memory.store import BaseStore, TrialStore
from memupdate.names import MANAGE_TOOL
from memupdate.rollout.config import RolloutConfig, run_config
from memupdate.rollout.episodes import COMPONENTS, episode_records
from memupdate.rollout.workers import in_process_workers
from memupdate.serving.hf_generate import HFGenerator
from memupdate.settings import (
    DEFAULT_EMBEDDING_MODEL,
    DEFAULT_MAX_CONTENT_CHARS,
    EpisodeSettings,
    PolicyEvalSettings,
    ServeSettings,
    ToolSettings,
    build,
)
from memupdate.tools.config import TOOL_CONFIG
from memupdate.utils.io import (
    ROWS_TABLE,
    read_parquet_columns,
    sha256_file,
    sha256_text,
    weights_digest,
    write_json_atomic,
    write_text_atomic,
)

logger = logging.getLogger(__name__)

EPISODES = "episodes.jsonl"


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
    out["edits"] = edits_by_kind(records)
    if any("update_ranks" in r for r in records):
        out["updates_by_rank"] = updates_by_rank(records)
    return out


#: Examples of each kind of edit a summary keeps, and the characters of the policy's text each shows.
EXAMPLES, EXAMPLE_CHARS = 5, 600


def edit_kind(record: Mapping[str, Any]) -> str:
    """What an episode did to the store, from its operation counts: ``stop`` (nothing), the one kind of
    operation it made (``update``, ``create``, ``delete``, ``merge``, ``split``), or ``mixed``.

    >>> edit_kind({"ops_updated": 1.0, "ops_created": 0.0}), edit_kind({}), edit_kind({"ops_created": 2, "ops_deleted": 1})
    ('update', 'stop', 'mixed')
    """
    kinds = [kind for kind, key in _OPS.items() if (record.get(key) or 0) > 0]
    return kinds[0] if len(kinds) == 1 else ("stop" if not kinds else "mixed")


_OPS = {
    "update": "ops_updated",
    "create": "ops_created",
    "delete": "ops_deleted",
    "merge": "ops_merged",
    "split": "ops_split",
}


def edits_by_kind(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per kind of edit (:func:`edit_kind`): how many episodes made it, their mean reward, and the first
    :data:`EXAMPLES` of them (question, reward, the policy's own text), so a reader sees what a policy does.

    >>> e = edits_by_kind([{"question": "q", "reward": 0.5, "ops_updated": 1, "policy_text": "x"}, {"reward": 0.0}])
    >>> e["update"]["episodes"], e["update"]["reward_mean"], e["stop"]["examples"][0]["reward"]
    (1, 0.5, 0.0)
    """
    out: dict[str, Any] = {}
    for record in records:
        kind = out.setdefault(edit_kind(record), {"episodes": 0, "rewards": [], "examples": []})
        kind["episodes"] += 1
        kind["rewards"].append(record["reward"])
        if len(kind["examples"]) < EXAMPLES:
            text = record.get("policy_text") or ""
            kind["examples"].append(
                {"question": record.get("question"), "reward": record["reward"], "policy_text": text[:EXAMPLE_CHARS]}
            )
    for kind in out.values():
        kind["reward_mean"] = round(float(np.mean(kind.pop("rewards"))), 4)
    return dict(sorted(out.items()))


_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def updated_ids(policy_text: str) -> list[int]:
    """The memory ids the ``manage_memory`` updates in ``policy_text`` name, in order: the calls parsed as verl's
    hermes parser parses them (JSON between ``<tool_call>`` tags); a call that does not parse names nothing.

    >>> updated_ids('<tool_call>\\n{"name": "manage_memory", "arguments": {"operation": "update", "memory_id": "7", '
    ...             '"keywords": "x"}}\\n</tool_call> <tool_call>{"name": "search_memory"}</tool_call> <tool_call>{</tool_call>')
    [7]
    """
    ids = []
    for call in _TOOL_CALL.findall(policy_text):
        try:
            parsed = json.loads(call)
            arguments = parsed["arguments"]
            if parsed["name"] == MANAGE_TOOL and arguments.get("operation") == "update":
                ids.append(int(arguments["memory_id"]))
        except (ValueError, TypeError, KeyError, AttributeError):
            continue
    return ids


def annotate_update_ranks(
    records: Sequence[dict[str, Any]],
    sample_ids: Mapping[str, str],
    memories: str | Path,
    embeddings: str | Path,
    embedding_model: str,
    evidence_ranks: Mapping[str, int | None] | None = None,
) -> None:
    """Give each record ``update_ranks``: for each memory its updates name (:func:`updated_ids`), the memory's
    1-based rank in its question's own search of its conversation's seed store (the search whose top the reader
    reads; None for an id the store lacks), and, given the held-out split's ``evidence_ranks`` (the headroom flags'
    ``evidence_rank`` by namespace), ``update_evidence``: whether each names the memory citing the evidence the
    reader's context lacks. What a policy promotes, by position and by content (docs/cpu-demo.md)."""
    named = {id(r): updated_ids(r.get("policy_text") or "") for r in records}
    edited = [r for r in records if named[id(r)]]
    for record in records:
        record["update_ranks"] = []
        if evidence_ranks is not None:
            record["update_evidence"] = []
    if not edited:
        return
    embedder = Embedder(embedding_model)
    cache = EmbeddingCache.open(embeddings, model_name=embedder.model_name, must_exist=True)
    table = read_parquet_columns(memories, {"sample_id": None, "content": None}, "a memories table", only=False)
    questions = sorted({r["question"] for r in edited})
    vectors = dict(zip(questions, embedder.encode(questions), strict=True))
    stores: dict[str, TrialStore] = {}
    for record in edited:
        sample_id = sample_ids[record["namespace"]]
        if sample_id not in stores:
            stores[sample_id] = TrialStore(BaseStore.from_table(table, sample_id, cache))
        store = stores[sample_id]
        order = {
            hit.record.id: rank for rank, hit in enumerate(store.search(vectors[record["question"]], len(store)), 1)
        }
        record["update_ranks"] = [order.get(i) for i in named[id(record)]]
        if evidence_ranks is not None:
            wanted = evidence_ranks.get(record["namespace"])
            record["update_evidence"] = [wanted is not None and rank == wanted for rank in record["update_ranks"]]


def updates_by_rank(records: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per rank (:func:`annotate_update_ranks`) of an updated memory in its question's own search: how many updates
    named a memory there, their episodes' mean reward, and (where known) how many named the evidence memory and
    their episodes' mean reward (whether the policy's edit pays when it picks the right memory).

    >>> by = updates_by_rank([{"reward": 0.5, "update_ranks": [6], "update_evidence": [True]},
    ...                       {"reward": 0.0, "update_ranks": [7, None]}, {"reward": 0.0}])
    >>> by["6"], by["7"]["updates"], by["not in the store"]["reward_mean"]
    ({'updates': 1, 'reward_mean': 0.5, 'evidence': 1, 'evidence_reward_mean': 0.5}, 1, 0.0)
    >>> by["7"]["evidence_reward_mean"] is None
    True
    """
    rewards: dict[int | None, list[float]] = defaultdict(list)
    evidence: dict[int | None, list[float]] = defaultdict(list)
    for record in records:
        ranks = record.get("update_ranks", ())
        for rank, cites in zip(ranks, record.get("update_evidence") or [False] * len(ranks), strict=True):
            rewards[rank].append(record["reward"])
            if cites:
                evidence[rank].append(record["reward"])
    known = any("update_evidence" in r for r in records)
    out = {}
    for rank in sorted(rewards, key=lambda r: (r is None, r or 0)):
        row = {"updates": len(rewards[rank]), "reward_mean": round(float(np.mean(rewards[rank])), 4)}
        if known:
            row["evidence"] = len(evidence[rank])
            row["evidence_reward_mean"] = round(float(np.mean(evidence[rank])), 4) if evidence[rank] else None
        out["not in the store" if rank is None else str(rank)] = row
    return out


async def _episodes(
    config, server, dataset: RLHFDataset, n: int, tokenizer: Any, batch_size: int
) -> list[dict[str, Any]]:
    """``n`` episodes of every row, about ``batch_size`` in flight at a time (whole groups): a CPU server given
    every episode at once queues requests past the client's timeout."""
    worker = in_process_workers(config, server, loop_context=LoopContext("policy-eval"))
    per_batch = max(1, batch_size // n)
    records = []
    with tqdm(total=len(dataset) * n, desc="policy episodes", unit="episode", disable=None) as bar:
        for start in range(0, len(dataset), per_batch):
            indices = range(start, min(start + per_batch, len(dataset)))
            prompts = DataProto.from_single_dict(collate_fn([dataset[i] for i in indices]))
            prompts.non_tensor_batch["uid"] = np.array([str(i) for i in indices], dtype=object)
            prompts.meta_info["global_steps"] = 0
            repeated = prompts.repeat(repeat_times=n, interleave=True)
            batch = await worker.generate_sequences(repeated)
            records += episode_records(batch, repeated, tokenizer)
            bar.update(len(repeated))
    return records


def evaluate_policy(
    *,
    model: str,
    rows: str,
    memories: str,
    embeddings: str,
    out_dir: str,
    episode: Mapping[str, Any] | None,
    reward: Mapping[str, Any],
    n: int = 4,
    questions: int | None = None,
    batch_size: int = PolicyEvalSettings.batch_size,
    seed: int = PolicyEvalSettings.seed,
    server: str = "vllm",
    serving: Mapping[str, Any] | None = None,
    embedding_model: str = DEFAULT_EMBEDDING_MODEL,
    max_content_chars: int = DEFAULT_MAX_CONTENT_CHARS,
    tools: Mapping[str, Any] | None = None,
    flags: str | None = None,
) -> dict[str, Any]:
    """Run and score the memory role's episodes of ``model`` on ``rows`` (the experiment's ``episode``: its
    :class:`~memupdate.settings.EpisodeSettings`, sampled as training samples; ``questions`` of them, drawn with
    ``seed``), ``n`` each (about ``batch_size`` in flight at a time), against a vLLM server of the policy
    (``serving`` settings) or in process (``server="hf"``);
    write ``<out_dir>/episodes.jsonl`` and ``<out_dir>/summary.json`` and return the summary. Each update is placed
    in its question's own search (:func:`annotate_update_ranks`; given the split's headroom ``flags``, whether it
    named the memory citing the missing evidence)."""
    settings = build(EpisodeSettings, episode, "episode")
    memory = MemoryEnvironment(
        memories=memories,
        embeddings=embeddings,
        embedding_model=embedding_model,
        max_content_chars=max_content_chars,
        **ToolSettings.environment(tools),
    )
    scored = scorable_rows(rows, Path(out_dir) / "rows.parquet")
    cfg = RolloutConfig(
        model_path=model,
        train_files=[scored],
        run_dir=out_dir,
        tool_config=str(TOOL_CONFIG),
        memory=memory,
        reward={**reward, "trained_role": "memory"},
        rollout_n=n,
        seed=seed,
        **asdict(settings),
    )
    out = Path(out_dir)
    key = evaluation_key(
        model,
        scored,
        {
            "episode": asdict(settings),
            "reward": reward,
            "n": n,
            "questions": questions,
            "seed": seed,
            "server": server,
            "serving": serving,
            # The memory environment as resolved (model, cap, tools), and the base store by its content.
            "memory": {**asdict(memory), "memories": sha256_file(memories)},
        },
    )
    twin = evaluated_twin(out, key)
    if twin is not None:
        # A stage whose every update was skipped saved the weights it started from: its episodes are that policy's.
        logger.info("%s has the weights of %s, evaluated with these settings: its episodes are reused", model, twin)
        records = [json.loads(line) for line in (twin / EPISODES).read_text(encoding="utf-8").splitlines()]
    else:
        config = run_config(cfg)
        with _policy_server(cfg, server, serving) as (client, tokenizer):
            dataset = RLHFDataset([scored], tokenizer, config.data, max_samples=questions or -1)
            records = asyncio.run(_episodes(config, client, dataset, n, tokenizer, batch_size))
    info = read_parquet_columns(scored, {"extra_info": None}, ROWS_TABLE).column("extra_info").to_pylist()
    annotate_update_ranks(
        records,
        {i["namespace"]: i["sample_id"] for i in info},
        memories,
        embeddings,
        embedding_model,
        {ns: f["evidence_rank"] for ns, f in read_flags(flags).items()} if flags else None,
    )
    write_text_atomic(out / EPISODES, "".join(json.dumps(r) + "\n" for r in records))
    summary = {
        "model": model,
        "n": n,
        "episode": asdict(settings),
        "evaluation_key": key,
        **({"same_weights_as": twin.name} if twin is not None else {}),
        **summarize(records),
    }
    write_json_atomic(out / "summary.json", summary)
    return summary


#: The files besides the weights that decide what a policy generates from the same prompt.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def evaluation_key(model: str, rows: str, settings: Mapping[str, Any]) -> str | None:
    """What a policy's held-out episodes depend on, hashed: its weights (:func:`weights_digest`, by tensor), its
    tokenizer and chat template, the rows and the evaluation's ``settings``. None for a model without weight files,
    which is never matched."""
    weights = weights_digest(Path(model))
    if weights is None:
        return None
    tokenizer = {name: sha256_file(Path(model, name)) for name in TOKENIZER_FILES if Path(model, name).is_file()}
    what = {"weights": weights, "tokenizer": tokenizer, "rows": sha256_file(rows), "settings": settings}
    return sha256_text(json.dumps(what, sort_keys=True, default=str))


def evaluated_twin(out: Path, key: str | None) -> Path | None:
    """A sibling of ``out`` (another policy of the same experiment) already evaluated under ``key``: the same
    weights, rows and settings, whose episodes can stand for this policy's; None if there is none."""
    if key is None or not out.parent.is_dir():
        return None
    for summary in sorted(out.parent.glob("*/summary.json")):
        folder = summary.parent
        if folder.resolve() == out.resolve() or not (folder / EPISODES).is_file():
            continue
        try:
            done = json.loads(summary.read_text(encoding="utf-8"))
        except ValueError:
            continue
        if done.get("evaluation_key") == key and "same_weights_as" not in done:
            return folder
    return None


def scorable_rows(rows: str, out: Path) -> str:
    """The rows the memory reward can score (a gold answer: categories 1-4, not the adversarial 5), at ``out``."""
    kept = answerable(read_parquet_columns(rows, {"extra_info": None}, ROWS_TABLE, only=False))
    if not kept.num_rows:
        raise ValueError(f"{rows}: no row has a gold answer for the memory reward to score")
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(kept, out)
    return str(out)


@contextlib.contextmanager
def _policy_server(cfg: RolloutConfig, server: str, serving: Mapping[str, Any] | None):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
    if server == "hf":
        policy = AutoModelForCausalLM.from_pretrained(cfg.model_path, dtype=torch.float32)
        yield HFGenerator(policy, tokenizer, max_new_tokens=cfg.turn_tokens, seed=cfg.seed), tokenizer
        return
    if server != "vllm":
        raise ValueError(f"server must be vllm or hf, got {server!r}")
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
        cpu=settings.engine == "vllm-cpu",
    ) as process:
        process.wait_until_ready(timeout_s=settings.startup_timeout_s)
        yield VLLMTokenClient(process.endpoint, max_tokens=cfg.turn_tokens), tokenizer


def compare_policies(
    summaries: Mapping[str, Mapping[str, Any]],
    pairs: Sequence[tuple[str, str]],
    flags: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[dict]:
    """For each ``(a, b)`` of ``pairs``: a's mean reward minus b's on the same questions, with the paired
    bootstrap 95% interval (:func:`memupdate.eval.stats.paired_by_key`). Given the split's headroom ``flags``
    (:func:`memupdate.data.headroom.read_flags`, every question of the split), also on the questions with
    headroom alone, on the others alone, and over every question of the split: the two strata's differences
    weighted by their shares of the split (:func:`memupdate.eval.stats.stratified_by_key`)."""
    out = []
    for a, b in pairs:
        scores_a, scores_b = summaries[a]["per_question"], summaries[b]["per_question"]
        out.append({"a": a, "b": b, "questions": "evaluated", **paired_by_key(scores_a, scores_b)})
        if flags is None:
            continue
        stratum = {ns: HEADROOM if flags[ns]["headroom"] else NO_HEADROOM for ns in scores_a}
        for name in (HEADROOM, NO_HEADROOM):
            keys = [ns for ns in scores_a if stratum[ns] == name]
            if keys:
                only_a, only_b = ({k: s[k] for k in keys} for s in (scores_a, scores_b))
                out.append({"a": a, "b": b, "questions": name, **paired_by_key(only_a, only_b)})
        share = float(np.mean([f["headroom"] for f in flags.values()]))
        weights = {HEADROOM: share, NO_HEADROOM: 1 - share}
        present = set(stratum.values())
        if present == set(weights):
            result = stratified_by_key(scores_a, scores_b, stratum, weights)
            out.append({"a": a, "b": b, "questions": "all (reweighted)", **result})
    return out


#: The strata of a headroom mix.
HEADROOM, NO_HEADROOM = "headroom", "no headroom"


#: The comparisons the report makes, later policy first; pairs with a policy the experiment lacks are left out.
PAIRS = (("stage1", "sft"), ("stage1", "base"), ("sft", "base"))


def policy_report(
    summaries: Mapping[str, str | Path],
    training_metrics: str | Path | None,
    out: str | Path,
    flags: str | Path | None = None,
) -> dict:
    """``<out>`` (report.json) with ``report.md`` and, given stage 1's ``metrics.jsonl``, ``training.png``
    beside it: each policy's held-out summary, its edits by kind, and the paired comparisons of :data:`PAIRS`
    (by stratum too, given the held-out split's headroom ``flags``: :func:`compare_policies`)."""
    loaded = {name: json.loads(Path(path).read_text(encoding="utf-8")) for name, path in summaries.items()}
    pairs = [(a, b) for a, b in PAIRS if a in loaded and b in loaded]
    report = {
        "policies": {name: {k: v for k, v in s.items() if k != "per_question"} for name, s in loaded.items()},
        "comparisons": compare_policies(loaded, pairs, read_flags(flags) if flags else None),
    }
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if training_metrics and Path(training_metrics).is_file():
        report["training"] = training_steps(training_metrics, out.with_name("training.png"))
    write_json_atomic(out, report)
    write_text_atomic(out.with_name("report.md"), _markdown(report))
    return report


def _markdown(report: Mapping[str, Any]) -> str:
    lines = [
        "# Memory policies on held-out questions",
        "",
        "| policy | questions | episodes | reward | well-formed calls | tool calls | groups with spread |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, s in report["policies"].items():
        lines.append(
            f"| {name}{f' (same weights as {twin}: its episodes)' if (twin := s.get('same_weights_as')) else ''} "
            f"| {s['questions']} | {s['episodes']} | {s['reward_mean']:.4f} | {s['well_formed_rate']:.0%} "
            f"| {s['tool_calls_mean']:.2f} | {s['groups_with_spread']:.0%} |"
        )
    if report["comparisons"]:
        lines += [
            "",
            "| comparison | questions | n | mean reward difference | 95% interval (paired bootstrap) | beyond noise |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for c in report["comparisons"]:
            lines.append(
                f"| {c['a']} - {c['b']} | {c.get('questions', 'evaluated')} | {c['n']} | {c['mean_difference']:+.4f} "
                f"| [{c['low']:+.4f}, {c['high']:+.4f}] | {'yes' if c['excludes_zero'] else 'no'} |"
            )
    for name, s in report["policies"].items():
        if not s.get("edits"):
            continue
        lines += ["", f"## {name}: edits by kind", "", "| kind | episodes | mean reward |", "| --- | --- | --- |"]
        lines += [f"| {kind} | {e['episodes']} | {e['reward_mean']:+.4f} |" for kind, e in s["edits"].items()]
        for kind, e in s["edits"].items():
            if kind == "stop":
                continue
            lines += ["", f"{name}, {kind} (first {len(e['examples'])}):", ""]
            for x in e["examples"]:
                text = " ".join(x["policy_text"].split())
                lines.append(f"- {x['question']} (reward {x['reward']:+.3f}): `{text[:300]}`")
    for name, s in report["policies"].items():
        if not s.get("updates_by_rank"):
            continue
        evidence = all("evidence" in row for row in s["updates_by_rank"].values())
        lines += [
            "",
            f"## {name}: updates by the rank of the memory updated, in the question's own search",
            "",
            "| rank | updates | mean reward |"
            + (" of them the memory citing the missing evidence | their mean reward |" if evidence else ""),
            "| --- | --- | --- |" + (" --- | --- |" if evidence else ""),
        ]
        lines += [
            f"| {rank} | {row['updates']} | {row['reward_mean']:+.4f} |"
            + (f" {row['evidence']} | {_signed(row.get('evidence_reward_mean'))} |" if evidence else "")
            for rank, row in s["updates_by_rank"].items()
        ]
    if "training" in report:
        heldout = [s for s in report["training"] if s.get(HELDOUT_CURVE) is not None]
        if heldout:
            lines += [
                "",
                "Stage 1's held-out reward (verl's validation rows, decoded with its val_kwargs) by step: "
                + ", ".join(f"step {s['step']} {s[HELDOUT_CURVE]:.4f}" for s in heldout),
            ]
        lines += ["", "![stage-1 training](training.png)"]
    return "\n".join(lines) + "\n"


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.4f}"
