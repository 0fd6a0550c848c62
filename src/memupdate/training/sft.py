"""The cold start before GRPO: supervised fine-tuning on demonstration episodes.

:func:`make_demonstrations` runs the scripted expert of the loop (MemoryUpdate:
:mod:`memupdate.training.demonstrations`, or :mod:`memupdate.training.ingestion_expert` for an ingestion
experiment's session rows; MemAgent: :mod:`memupdate.training.memagent_expert`) through the
in-process agent loop worker on the train rows, so each demonstration is a GRPO rollout's rows (MemAgent:
one per turn): prompt, response, ``response_mask`` (1 on the policy's own tokens; tool outputs and the
prompt 0) and the reward the RL run would give it. The MemoryUpdate experts choose what to merge by LoCoMo
evidence ids the policy never sees, so the demonstrations teach the format and the program's shape
(search, merge what belongs together, stop), not every choice. A MemoryUpdate episode is also scored under
the other offline scorer (:data:`OFFLINE_SCORERS`). :func:`train_sft` keeps the episodes the expert's rule
accepts (MemoryUpdate: :func:`~memupdate.training.demonstrations.keep_episode`, an edit only if it raised
the reward under both offline scorers, and no more episodes without an edit than kept edits,
:func:`~memupdate.training.demonstrations.balance_edits`; MemAgent:
:func:`~memupdate.training.memagent_expert.covers`) and minimises the token-mean negative log-likelihood of
the masked response tokens with verl's SFT trainer on the node's GPUs or CPUs (:mod:`memupdate.training.verl_sft`).

A run writes ``<run>/demonstrations.jsonl`` (one record per episode: question, reward, kept, the
policy's text; MemoryUpdate's also each offline scorer's reward, ``rewards``, and whether it ``edited``), their
summary ``<run>/demonstrations.summary.json``, ``<run>/metrics.jsonl`` (verl's log, per optimiser step), ``<run>/resolved_config.json`` and ``<run>/ckpt`` in the
layout every trainer writes (``manifest.json`` with ``kind: sft``), which stage 1 then starts from.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
from omegaconf import OmegaConf
from tqdm.auto import tqdm
from transformers import AutoTokenizer
from verl import DataProto
from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

from memupdate.agents.context import LoopContext
from memupdate.agents.fields import MEMAGENT_REWARD
from memupdate.data.ingestion import is_ingestion_row
from memupdate.memory.environment import MemoryEnvironment
from memupdate.names import MEMAGENT_AGENT
from memupdate.rewards.manager import MemoryRewardManager, reward_settings
from memupdate.rollout.config import RolloutConfig, run_config
from memupdate.rollout.episodes import episode_records
from memupdate.rollout.workers import FINAL_MASK_KEY, TRAJECTORY_KEY, in_process_workers
from memupdate.settings import (
    DEFAULT_EMBEDDING_MODEL,
    DEFAULT_MAX_CONTENT_CHARS,
    EpisodeSettings,
    MemAgentLoopSettings,
    RewardSettings,
    SFTSettings,
    ToolSettings,
    build,
)
from memupdate.tools.config import TOOL_CONFIG
from memupdate.training.demonstrations import MemoryExpert, balance_edits, edits, expert_rows, keep_episode
from memupdate.training.ingestion_expert import IngestionExpert, merge_chars
from memupdate.training.memagent_expert import NOTHING_YET, MemAgentExpert, covers
from memupdate.training.tracking import run_info, run_record, write_run_info
from memupdate.utils.io import write_json_atomic, write_text_atomic

logger = logging.getLogger(__name__)

DEMONSTRATIONS = "demonstrations.jsonl"
#: What the demonstrations were (:func:`demonstration_summary`), beside them.
DEMONSTRATION_SUMMARY = "demonstrations.summary.json"
#: Rows the expert plays at once (its replies cost nothing; the tools and the reward batch across them).
EPISODES_PER_BATCH = 16


@dataclass(kw_only=True)
class SFTConfig(SFTSettings):
    """The SFT settings, the rollout the demonstrations are episodes of (stage 1's loop, tools, reward and
    lengths) and the memory text cap the expert writes within."""

    rollout: RolloutConfig
    max_content_chars: int
    #: Where verl's SFT trainer (:mod:`memupdate.training.verl_sft`) runs on this node: ``device`` (verl's
    #: ``trainer.device``) with ``world_size`` ranks.
    device: str = "cuda"
    world_size: int = 1

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True, default=str).encode()).hexdigest()[:16]


def _expert(cfg: SFTConfig, tokenizer: Any) -> Any:
    """The scripted expert of the rollout's agent loop, knowing the train rows."""
    rollout = cfg.rollout
    table = [row for path in rollout.train_files for row in pq.read_table(path).to_pylist()]
    if rollout.agent_name == MEMAGENT_AGENT:
        loop = build(MemAgentLoopSettings, rollout.agent, "loop")
        return MemAgentExpert(
            tokenizer, [r["extra_info"] for r in table], loop.max_memory_tokens, loop.max_final_tokens
        )
    ingestion = bool(table) and is_ingestion_row(table[0]["extra_info"])
    tools = SFTSettings.tools(ingestion)
    missing = [name for name in tools if name not in rollout.memory.tools]
    if missing:
        raise ValueError(f"the expert uses {', '.join(tools)}, but the policy is not given {missing}")
    reward = rollout.reward
    top_k, budget = (
        reward.get("top_k", RewardSettings.top_k),
        reward.get("context_chars", RewardSettings.context_chars),
    )
    if ingestion:
        return IngestionExpert(
            tokenizer,
            table,
            rollout.memory.memories,
            max_content_chars=merge_chars(cfg.max_content_chars, top_k, budget),
            max_new_tokens=rollout.turn_tokens,
            max_assistant_turns=rollout.max_assistant_turns,
            search_top_k=cfg.search_top_k,
        )
    return MemoryExpert(
        tokenizer,
        expert_rows(table),
        rollout.memory.memories,
        cfg.max_content_chars,
        rollout.turn_tokens,
        cfg.search_top_k,
        top_k=top_k,
        context_chars=budget,
    )


def _offline_scorers(config: Any, tokenizer: Any) -> tuple[str, dict[str, MemoryRewardManager]]:
    """The rollout's own scorer (verl's ``config``) and its memory reward under each other offline scorer
    (:data:`OFFLINE_SCORERS`; its settings otherwise), to score the demonstrations' store deltas again."""
    settings = reward_settings(config)
    own = settings.get("scorer") or "answer_recall"  # the reward manager's default
    if own not in OFFLINE_SCORERS:
        raise ValueError(
            f"the demonstrations are scored by the offline scorers {', '.join(OFFLINE_SCORERS)} (the cold start "
            f"runs before any model is served), but the rollout's reward scores with {own!r}"
        )
    others = {}
    for name in OFFLINE_SCORERS:
        if name != own:
            kwargs = {**settings, "scorer": name}
            others[name] = MemoryRewardManager(
                OmegaConf.create({"reward": {"custom_reward_function": {"reward_kwargs": kwargs}}}), tokenizer
            )
    return own, others


def gain(components: Mapping[str, float]) -> float:
    """What an episode did to a scorer's S (its reward without ``reward.idle_edit_cost``), which the keep rule weighs
    under the other scorers: an edit that leaves one of them flat has not lowered it, whatever the cost charges.

    >>> gain({"score": -0.05, "idle_edit_cost": 0.05}), gain({"score": 0.5, "idle_edit_cost": 0.0}), gain({"score": 0.2})
    (0.0, 0.5, 0.2)
    """
    return components["score"] + components.get("idle_edit_cost", 0.0)


async def _records(
    batch: DataProto,
    prompts: DataProto,
    tokenizer: Any,
    expert: Any,
    scorer: str | None,
    others: Mapping[str, MemoryRewardManager],
) -> list[dict[str, Any]]:
    """A record per episode of ``batch``, in prompt order, with whether it is kept. A MemoryUpdate episode's
    ``reward`` is the rollout's (its ``scorer``'s), and its ``rewards`` are that one and each of ``others``'
    (one batch per scorer); ``edited`` says whether it changed the store. Episodes without an edit are
    balanced against kept edits afterwards, over all batches (:func:`balance_edits`)."""
    trajectories = batch.non_tensor_batch[TRAJECTORY_KEY].astype(int)
    final = np.flatnonzero(batch.non_tensor_batch[FINAL_MASK_KEY].astype(bool))
    if trajectories[final].tolist() != list(range(len(prompts))):
        # SFTTrainer.train indexes the episodes' kept flags by each row's trajectory.
        raise RuntimeError(f"expected one episode per prompt in prompt order, got trajectories {trajectories[final]}")
    if not isinstance(expert, MemAgentExpert):
        records = episode_records(batch, prompts, tokenizer)
        infos = prompts.non_tensor_batch["extra_info"][trajectories[final]]
        rescored = {name: await manager.score_batch(infos, batch[final]) for name, manager in others.items()}
        for i, record in enumerate(records):
            rewards = {scorer: record["reward"], **{name: gain(results[i]) for name, results in rescored.items()}}
            edited = edits(record)
            record.update(rewards=rewards, edited=edited, kept=keep_episode(rewards, edited, scorer))
        return records
    records = []
    for i in final:
        info = prompts.non_tensor_batch["extra_info"][trajectories[i]]
        memory = expert.memories.get(info["question"], NOTHING_YET)
        reward = float(batch.batch["rm_scores"][i].sum())
        covered = covers(memory, info["supporting_facts"])
        records.append(
            {
                "question": info["question"],
                "reward": reward,
                "turns": int((trajectories == trajectories[i]).sum()),
                "memory": memory,
                "covered": covered,
                # The expert boxes the gold answer; a reward that does not credit it would teach nothing sound.
                "kept": covered and reward > 0,
            }
        )
    return records


async def make_demonstrations(cfg: SFTConfig, tokenizer: Any) -> tuple[DataProto, list[dict[str, Any]], np.ndarray]:
    """Every train row (up to ``max_rows``) played once by the expert: the rows (verl's layout), a record per
    episode and the episode of each row."""
    rollout = cfg.rollout
    config = run_config(rollout)
    dataset = RLHFDataset(rollout.train_files, tokenizer, config.data, max_samples=cfg.max_rows or -1)
    expert = _expert(cfg, tokenizer)
    memagent = isinstance(expert, MemAgentExpert)
    scorer, others = (None, {}) if memagent else _offline_scorers(config, tokenizer)
    worker = in_process_workers(config, expert, loop_context=LoopContext("sft"))
    parts, records, episodes = [], [], []
    with tqdm(total=len(dataset), desc="demonstrations", unit="episode", disable=None) as bar:
        for start in range(0, len(dataset), EPISODES_PER_BATCH):
            indices = range(start, min(start + EPISODES_PER_BATCH, len(dataset)))
            prompts = DataProto.from_single_dict(collate_fn([dataset[i] for i in indices]))
            prompts.non_tensor_batch["uid"] = np.array([str(i) for i in indices], dtype=object)
            prompts.meta_info["global_steps"] = 0
            batch = await worker.generate_sequences(prompts)
            parts.append(batch)
            # The worker keeps a trajectory's rows together and trajectories in prompt order (n = 1).
            episodes.append(start + batch.non_tensor_batch[TRAJECTORY_KEY].astype(int))
            records.extend(await _records(batch, prompts, tokenizer, expert, scorer, others))
            bar.update(len(indices))
    if not memagent:
        balance_edits(records, cfg.min_rows)
    return DataProto.concat(parts), records, np.concatenate(episodes)


class SFTTrainer:
    def __init__(self, cfg: SFTConfig):
        self.cfg = cfg
        self.run_dir = Path(cfg.rollout.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.rollout.model_path)
        write_json_atomic(self.run_dir / "resolved_config.json", {"memupdate": asdict(cfg)})
        memory = cfg.rollout.memory
        data = {"train_files": cfg.rollout.train_files}
        if memory is not None:
            data.update(memories=memory.memories, embeddings=memory.embeddings)
        self.run_info = run_info(
            cfg.digest(), run_record(data), backend="verl", kind="sft", base_model=cfg.rollout.model_path
        )
        write_run_info(self.run_dir, self.run_info)

    def train(self) -> Path:
        """Make the demonstrations, fine-tune on the kept ones and return ``<run>/ckpt``."""
        start = time.perf_counter()
        batch, records, episodes = asyncio.run(make_demonstrations(self.cfg, self.tokenizer))
        write_text_atomic(self.run_dir / DEMONSTRATIONS, "".join(json.dumps(r) + "\n" for r in records))
        kept = np.array([r["kept"] for r in records], dtype=bool)[episodes]
        memagent = self.cfg.rollout.agent_name == MEMAGENT_AGENT
        summarize = memagent_demonstration_summary if memagent else demonstration_summary
        summary = summarize(records, time.perf_counter() - start)
        write_json_atomic(self.run_dir / DEMONSTRATION_SUMMARY, summary)
        logger.info("demonstrations: %s", json.dumps(summary))
        if not kept.any():
            why = (
                "no trajectory's memory held its question's supporting facts with the boxed answer rewarded"
                if memagent
                else "no edit raised the reward under every offline scorer, and no episode stopped without an edit"
            )
            raise RuntimeError(f"no demonstration was kept ({why}); see {DEMONSTRATIONS}")
        from memupdate.training.verl_sft import run_verl_sft

        return run_verl_sft(
            batch[np.flatnonzero(kept)],
            settings={f.name: getattr(self.cfg, f.name) for f in fields(SFTSettings)},
            model=self.cfg.rollout.model_path,
            run_dir=str(self.run_dir),
            world_size=self.cfg.world_size,
            device=self.cfg.device,
        )


def demonstration_summary(records: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """What the SFT run reports of its demonstrations: how many episodes there are, edit, and are kept
    (``kept_edits``; ``kept_stops``: kept without an edit), ``dropped`` for their reward and
    ``balanced_out`` (:func:`balance_edits`); per scorer, how many edits raised its reward and the kept
    episodes' mean reward (:func:`memagent_demonstration_summary` is a MemAgent cold start's).

    >>> s = demonstration_summary([
    ...     {"kept": True, "edited": True, "rewards": {"answer_recall": 0.5, "evidence_recall": 0.25}},
    ...     {"kept": False, "edited": True, "rewards": {"answer_recall": 0.5, "evidence_recall": -0.5}},
    ...     {"kept": True, "edited": False, "rewards": {"answer_recall": 0.0, "evidence_recall": 0.0}}], 1.0)
    >>> s["kept_reward_mean"], s["edits_raising"]
    ({'answer_recall': 0.25, 'evidence_recall': 0.125}, {'answer_recall': 2, 'evidence_recall': 1})
    >>> [s[k] for k in ("episodes", "edits", "kept", "kept_edits", "kept_stops", "dropped")]
    [3, 2, 2, 1, 1, 1]
    """
    rewards = [r.get("rewards") or {"reward": r["reward"]} for r in records]
    scorers = list(dict.fromkeys(name for by_scorer in rewards for name in by_scorer))
    kept = [by_scorer for r, by_scorer in zip(records, rewards, strict=True) if r["kept"]]
    edited = [by_scorer for r, by_scorer in zip(records, rewards, strict=True) if r.get("edited")]
    return {
        "episodes": len(records),
        "edits": len(edited),
        "kept": len(kept),
        "kept_edits": sum(r["kept"] and bool(r.get("edited")) for r in records),
        "kept_stops": sum(r["kept"] and r.get("edited") is False for r in records),
        "dropped": sum(not r["kept"] and not r.get("balanced_out") for r in records),
        "balanced_out": sum(bool(r.get("balanced_out")) for r in records),
        "edits_raising": {name: sum(by_scorer[name] > 0 for by_scorer in edited) for name in scorers},
        "kept_reward_mean": {
            name: float(np.mean([by_scorer[name] for by_scorer in kept])) if kept else None for name in scorers
        },
        "seconds": round(seconds, 1),
    }


def memagent_demonstration_summary(records: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """What a MemAgent cold start reports of the expert's trajectories: how many there are and are kept, the rows
    (turns) the kept ones give, and why the others were dropped: an unrewarded answer, or a memory without the
    question's supporting facts (:func:`_records`' ``kept``).

    >>> memagent_demonstration_summary([{"kept": True, "reward": 1.0, "turns": 3, "covered": True},
    ...     {"kept": False, "reward": 1.0, "turns": 2, "covered": False}], 2.0)
    {'episodes': 2, 'kept': 1, 'rows': 3, 'dropped_unrewarded': 0, 'dropped_uncovered': 1, 'seconds': 2.0}
    """
    return {
        "episodes": len(records),
        "kept": sum(r["kept"] for r in records),
        "rows": sum(r["turns"] for r in records if r["kept"]),
        "dropped_unrewarded": sum(r["reward"] <= 0 for r in records),
        "dropped_uncovered": sum(r["reward"] > 0 and not r["covered"] for r in records),
        "seconds": round(seconds, 1),
    }


def train_sft(cfg: SFTConfig) -> Path:
    """Make the demonstrations, fine-tune on them and return ``<run>/ckpt``."""
    return SFTTrainer(cfg).train()


def fine_tuner(layout: Mapping[str, Any] | None) -> dict[str, Any]:
    """Where verl's SFT trainer runs (:class:`SFTConfig`'s ``device``, ``world_size``): with the training stage's
    ``layout`` (``trainer.device``, ``trainer.n_gpus_per_node``: one rank per GPU of this node, per CPU slot on CPU).

    >>> fine_tuner({"trainer.device": "cpu"})
    {'device': 'cpu', 'world_size': 1}
    """
    from memupdate.training.stages import verl_layout
    from memupdate.training.verl_launcher import run_device

    layout = dict(layout or {})
    _, world_size = verl_layout(layout)
    return {"device": run_device(layout), "world_size": world_size}


#: The offline scorer demonstrations are rewarded by where training's is served (the cold start runs before any
#: model is served).
DEMONSTRATION_SCORER = "answer_recall"
#: The offline scorers an edit must raise the reward under to be kept (memupdate.rewards.scorers).
OFFLINE_SCORERS = ("answer_recall", "evidence_recall")


def demonstration_scorer(reward: Mapping[str, Any]) -> str:
    """The scorer the demonstrations are rewarded by: training's where it is offline, else
    :data:`DEMONSTRATION_SCORER`.

    >>> demonstration_scorer({"scorer": "evidence_recall"}), demonstration_scorer({"scorer": "reader"})
    ('evidence_recall', 'answer_recall')
    """
    scorer = reward.get("scorer")
    return scorer if scorer in OFFLINE_SCORERS else DEMONSTRATION_SCORER


def cold_start(
    *,
    settings: Mapping[str, Any],
    episode: Mapping[str, Any] | None,
    model: str,
    train_files: list[str],
    memories: str,
    embeddings: str,
    run_dir: str,
    reward: Mapping[str, Any],
    embedding_model: str = DEFAULT_EMBEDDING_MODEL,
    max_content_chars: int = DEFAULT_MAX_CONTENT_CHARS,
    tools: Mapping[str, Any] | None = None,
    layout: Mapping[str, Any] | None = None,
) -> Path:
    """The experiment's ``sft`` run: demonstrations of the experiment's ``episode`` (its
    :class:`~memupdate.settings.EpisodeSettings`, as training plays it), scored by the workflow's ``reward`` with its
    scorer where that is offline (:func:`demonstration_scorer`) and again with the other of :data:`OFFLINE_SCORERS` (a served scorer in
    ``reward``, the reader or judge, is not used: the cold start runs before any model is served), and the
    fine-tuned policy in ``<run_dir>/ckpt``. The expert uses the tools of the experiment's ``tools``
    (:class:`~memupdate.settings.ToolSettings` values), as the policy will. ``layout``: where verl's SFT trainer
    runs (:func:`fine_tuner`)."""
    sft = asdict(build(SFTSettings, settings, "sft"))
    lengths = asdict(build(EpisodeSettings, episode, "episode"))
    # The demonstrations are the expert's program, not samples: the policy's sampling does not shape them.
    for sampling in ("temperature", "top_p"):
        lengths.pop(sampling)
    memory = MemoryEnvironment(
        memories=memories,
        embeddings=embeddings,
        embedding_model=embedding_model,
        max_content_chars=max_content_chars,
        **ToolSettings.environment(tools),
    )
    rollout = RolloutConfig(
        model_path=model,
        train_files=train_files,
        run_dir=run_dir,
        tool_config=str(TOOL_CONFIG),
        memory=memory,
        reward={**reward, "scorer": demonstration_scorer(reward), "trained_role": "memory"},
        seed=sft["seed"],
        **lengths,
    )
    return train_sft(SFTConfig(**sft, rollout=rollout, max_content_chars=max_content_chars, **fine_tuner(layout)))


def cold_start_memagent(
    *,
    settings: Mapping[str, Any],
    loop: Mapping[str, Any],
    model: str,
    train_files: list[str],
    run_dir: str,
    layout: Mapping[str, Any] | None = None,
) -> Path:
    """A MemAgent experiment's ``sft`` run: the expert's trajectories of the ``memagent`` loop (``loop``'s
    budgets, and the turn lengths training derives from them: :meth:`~memupdate.settings.MemAgentLoopSettings.lengths`)
    on ``train_files``, every turn a row, and the fine-tuned policy in ``<run_dir>/ckpt``; ``layout`` as
    :func:`cold_start`'s."""
    sft = asdict(build(SFTSettings, settings, "sft"))
    budgets = build(MemAgentLoopSettings, loop, "loop")
    rollout = RolloutConfig(
        model_path=model,
        train_files=train_files,
        run_dir=run_dir,
        agent_name=MEMAGENT_AGENT,
        agent=budgets.agent(),
        reward_manager=MEMAGENT_REWARD,
        seed=sft["seed"],
        **budgets.lengths(),
    )
    return train_sft(
        SFTConfig(**sft, rollout=rollout, max_content_chars=DEFAULT_MAX_CONTENT_CHARS, **fine_tuner(layout))
    )
