"""The ``local`` training backend: GRPO in one process, on a CPU or one GPU.

verl's trainer needs GPUs and a vLLM/SGLang rollout (``verl-0.9.1.md`` §3), so this backend drives
verl's own pieces directly instead:

1. verl's ``AgentLoopWorker`` runs our agent loop and tools on each prompt ``n`` times, against an HF
   generation server (:class:`~memupdate.serving.hf_server.HFGenerateServer`) holding the policy
   (``rollout: hf``, deterministic), or against a vLLM server of the policy that gets the new weights
   after every update (``rollout: vllm``, :mod:`memupdate.training.vllm_rollout`: batched), and
   streams every finished trajectory to verl's ``RewardLoopWorker`` with our reward manager — both
   in-process, no Ray;
2. verl's ``compute_grpo_outcome_advantage`` turns the rewards into advantages per prompt group;
3. verl's policy loss (``get_policy_loss_fn``), ``kl_penalty`` (low_var_kl against a frozen reference)
   and ``agg_loss`` give the loss; AdamW steps with gradient accumulation over micro-batches.

It writes the layout downstream rules read whichever backend ran: ``<run>/ckpt/`` (HF model, tokenizer,
``manifest.json``), plus ``<run>/checkpoints/step_N/`` (with optimizer state, for resuming),
``<run>/metrics.jsonl`` and ``<run>/resolved_config.json``. Each step's metrics also go to verl's
``Tracking`` (``logger``: console and ``<run>/tensorboard/`` by default), which gets ``<run>/run_info.json``
(commit, config digest, data hashes; :mod:`memupdate.training.tracking`) as the run's config.

A step whose advantages are all zero (every group's rollouts got one reward) has nothing to learn from and
skips the update (:meth:`LocalGRPOTrainer._update`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
import shutil
import time
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer
from verl import DataProto
from verl.trainer.ppo.core_algos import AdvantageEstimator, agg_loss, get_policy_loss_fn, kl_penalty
from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories
from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn
from verl.workers.config import ActorConfig

from memupdate.agents.context import LoopContext
from memupdate.rollout.config import RolloutConfig, run_config
from memupdate.rollout.workers import FINAL_MASK_KEY, TRAJECTORY_KEY, TURN_INDEX_KEY, in_process_workers
from memupdate.serving.hf_server import HFGenerateServer
from memupdate.settings import ServeSettings, TrainSettings, build, check_bounds, clean
from memupdate.training.tracking import (
    PROJECT,
    TENSORBOARD_DIR,
    TRACKING_FILE,
    experiment_name,
    flat_metrics,
    open_tracker,
    run_info,
    run_record,
    write_run_info,
)
from memupdate.training.vllm_rollout import VLLMRollout, exit_on_sigterm
from memupdate.utils.io import write_json_atomic, write_text_atomic

logger = logging.getLogger(__name__)


ROLLOUTS = ("hf", "vllm")


@dataclass(kw_only=True)
class LocalGRPOConfig(TrainSettings, RolloutConfig):
    """Everything a local run depends on; its hash names the run in the checkpoint manifest. The user's
    settings are :class:`memupdate.settings.TrainSettings`' (their one definition, bounds included: a GRPO
    group needs ``rollout_n >= 2``); the rollout's paths and roles are :class:`RolloutConfig`'s."""

    def __post_init__(self) -> None:
        RolloutConfig.__post_init__(self)
        check_bounds(self, "local GRPO config")
        if self.rollout not in ROLLOUTS:
            raise ValueError(f"rollout must be one of {ROLLOUTS}, got {self.rollout!r}")

    def digest(self) -> str:
        """Names the run: everything that shapes a step, but not how many steps (extending a run resumes it)
        nor where its metrics are logged."""
        settings = asdict(self)
        settings.pop("steps"), settings.pop("save_every"), settings.pop("logger")
        # A served model's address changes with every server start, and its marker's path with the checkout;
        # the model it serves is what counts.
        if self.fixed_model:
            settings["fixed_model"] = {k: v for k, v in self.fixed_model.items() if k not in ("base_url", "marker")}
        return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def constant_groups(batch: DataProto) -> np.ndarray:
    """Per row: whether its GRPO group (rows of one ``uid``) has two or more trajectories that all got the
    same reward. A trajectory's reward is its final row's; a group of one keeps verl's advantage (its score)."""
    final = batch.non_tensor_batch[FINAL_MASK_KEY].astype(bool)
    uids = batch.non_tensor_batch["uid"]
    scores = batch.batch["rm_scores"].sum(-1).numpy()
    groups: dict[Any, list[float]] = defaultdict(list)
    for uid, score in zip(uids[final], scores[final], strict=True):
        groups[uid].append(float(score))
    constant = {uid for uid, group in groups.items() if len(group) > 1 and min(group) == max(group)}
    return np.array([uid in constant for uid in uids], dtype=bool)


def response_log_probs(model, batch: DataProto, grad: bool, temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities of the response tokens under ``model`` sampled at ``temperature`` ([B,
    response_length]): the rollout drew tokens from ``softmax(logits / temperature)``, so that is the
    policy being optimised (verl's actor divides its logits the same way)."""
    if temperature <= 0:
        raise ValueError(f"log-probs need a positive sampling temperature, got {temperature}")
    input_ids, attention = batch.batch["input_ids"], batch.batch["attention_mask"]
    positions, responses = batch.batch["position_ids"], batch.batch["responses"]
    # Prompts are left-padded to the configured prompt length and responses right-padded to the response
    # length: skip the columns no row uses (often most of an episode's budget; their log-probs are 0).
    used = attention.any(dim=0).nonzero()
    first, last = int(used.min()), int(used.max()) + 1
    unused = attention.size(1) - last
    input_ids, attention, positions = input_ids[:, first:last], attention[:, first:last], positions[..., first:last]
    responses = responses[:, : responses.size(1) - unused]
    with torch.set_grad_enabled(grad):
        # Only the response positions need logits: keeping them alone saves a [B, T, vocab] tensor.
        logits = model(
            input_ids=input_ids, attention_mask=attention, position_ids=positions, logits_to_keep=responses.size(1) + 1
        ).logits
        logits = logits[:, :-1].float() / temperature
        log_probs = torch.log_softmax(logits, dim=-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
        return torch.nn.functional.pad(log_probs, (0, unused))


class LocalGRPOTrainer:
    def __init__(self, cfg: LocalGRPOConfig):
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        start = self._latest_checkpoint()
        weights = start or Path(cfg.model_path)
        self.policy = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)
        self.reference = None
        if cfg.kl_coef:
            self.reference = AutoModelForCausalLM.from_pretrained(cfg.model_path, dtype=torch.float32).eval()
            self.reference.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.step = 0
        if start is not None:
            self.optimizer.load_state_dict(torch.load(start / "optimizer.pt", weights_only=True))
            self.step = json.loads((start / "trainer_state.json").read_text())["step"]
            logger.info("resuming from %s (step %d)", start, self.step)
        self._trim_metrics()

        self.config = run_config(cfg)
        write_json_atomic(
            self.run_dir / "resolved_config.json",
            {"memupdate": asdict(cfg), "verl": OmegaConf.to_container(self.config, resolve=True)},
        )
        memory = cfg.memory
        data = {
            "train_files": cfg.train_files,
            **({"memories": memory.memories, "embeddings": memory.embeddings} if memory else {}),
        }
        self.run_info = run_info(cfg.digest(), run_record(data), backend="local", base_model=cfg.model_path)
        write_run_info(self.run_dir, self.run_info)
        # rollout: vllm starts its server when training starts (train()), not for a trainer only inspected.
        self.rollout: VLLMRollout | None = None
        self.server = HFGenerateServer(self.policy, self.tokenizer, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed)
        self.timer: dict[str, float] = {"reward": 0.0}
        self.dataset = RLHFDataset(cfg.train_files, self.tokenizer, self.config.data, max_samples=cfg.max_rows or -1)
        self.actor_config = ActorConfig(
            strategy="fsdp",
            clip_ratio=cfg.clip_ratio,
            ppo_mini_batch_size=cfg.prompts_per_step,
            ppo_micro_batch_size_per_gpu=cfg.micro_batch_size,
            rollout_n=cfg.rollout_n,
        )
        self.policy_loss = get_policy_loss_fn("vanilla")

    # ------------------------------------------------------------------ checkpoints

    def _latest_checkpoint(self) -> Path | None:
        """The checkpoint to resume from: the latest one of an unfinished run of this very configuration.

        Anything else in the run directory (another configuration, or a finished run whose output was
        deleted because code or inputs changed) moves to ``superseded/<digest>-step<N>/``: continuing
        it would mix two runs.
        """
        steps = sorted((self.run_dir / "checkpoints").glob("step_*"))
        if not steps:
            return None
        state = json.loads((steps[-1] / "trainer_state.json").read_text())
        digest = state.get("config_digest")
        if digest == self.cfg.digest() and state["step"] < self.cfg.steps:
            return steps[-1]
        # A finished run asked for again (its checkpoint was deleted because code or inputs changed) is
        # trained anew, not "resumed" into a copy of the old result.
        why = "another configuration" if digest != self.cfg.digest() else "a finished run"
        target = self.run_dir / "superseded" / f"{digest}-step{state['step']}"
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True, exist_ok=True)
        for name in ("checkpoints", "metrics.jsonl", TENSORBOARD_DIR, TRACKING_FILE):
            if (self.run_dir / name).exists():
                (self.run_dir / name).rename(target / name)
        logger.warning(
            "%s holds %s (digest %s, this one %s); moved it to %s and starting afresh",
            self.run_dir,
            why,
            digest,
            self.cfg.digest(),
            target,
        )
        return None

    def _trim_metrics(self) -> None:
        """Keep the metrics of the steps the resumed checkpoint holds: a killed run may have logged steps
        after its last checkpoint (they are trained again) and torn its last line mid-write."""
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return
        kept = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                break  # a torn line can only be the last one written
            if record.get("step", 0) <= self.step:
                kept.append(line)
        write_text_atomic(path, "".join(f"{line}\n" for line in kept))

    def _save(self, metrics: dict[str, Any]) -> Path:
        target = self.run_dir / "checkpoints" / f"step_{self.step:06d}"
        tmp = target.with_name(f".{target.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.policy.save_pretrained(tmp)
        self.tokenizer.save_pretrained(tmp)
        torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
        (tmp / "trainer_state.json").write_text(
            json.dumps({"step": self.step, "config_digest": self.cfg.digest(), "metrics": metrics}, indent=2)
        )
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        return target

    def manifest(self, metrics: dict[str, Any]) -> dict[str, Any]:
        return {
            "backend": "local",
            "step": self.step,
            "config_digest": self.cfg.digest(),
            "git": self.run_info["git"],
            "data_sha256": self.run_info["data_sha256"],
            "base_model": self.cfg.model_path,
            "metrics": metrics,
        }

    def export(self, metrics: dict[str, Any]) -> Path:
        """``<run>/ckpt``: the latest checkpoint plus its manifest, placed atomically."""
        source = self._save(metrics)
        final = self.run_dir / "ckpt"
        tmp = final.with_name(".ckpt.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(source, tmp)
        write_json_atomic(tmp / "manifest.json", self.manifest(metrics))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        return final

    # ------------------------------------------------------------------ one step

    def _prompts(self) -> DataProto:
        rng = random.Random(f"{self.cfg.seed}:{self.step}")
        indices = rng.sample(range(len(self.dataset)), min(self.cfg.prompts_per_step, len(self.dataset)))
        batch = DataProto.from_single_dict(collate_fn([self.dataset[i] for i in indices]))
        batch.non_tensor_batch["uid"] = np.array([f"{self.step}-{i}" for i in indices], dtype=object)
        batch = batch.repeat(repeat_times=self.cfg.rollout_n, interleave=True)
        batch.meta_info["global_steps"] = self.step
        return batch

    def _advantages(self, batch: DataProto) -> torch.Tensor:
        """GRPO per trajectory, given to every row of it: verl's V1 function for multi-output trajectories,
        fed the ``{uid}_{trajectory}_{turn}`` keys its TransferQueue rows carry. Only each trajectory's final
        row enters the group statistics, so a trajectory counts once however many turns it has."""
        extra = batch.non_tensor_batch
        keys = [
            f"{u}_{t}_{i}" for u, t, i in zip(extra["uid"], extra[TRAJECTORY_KEY], extra[TURN_INDEX_KEY], strict=True)
        ]
        data = DataProto(batch=batch.batch.select("response_mask").clone(), non_tensor_batch={"uid": extra["uid"]})
        data.batch["token_level_rewards"] = batch.batch["rm_scores"]
        data = compute_advantage_for_multi_trajectories(
            data, keys, AdvantageEstimator.GRPO, norm_adv_by_std_in_grpo=self.cfg.norm_adv_by_std
        )
        advantages = data.batch["advantages"]
        # A group whose rollouts all got one reward has no advantage; verl's float32 group mean of equal
        # scores can miss the score by an ulp, which division by the (near-zero) std turns into advantages
        # up to ~0.06 of either sign. Zeroed, so such a group teaches nothing, as GRPO means.
        advantages[torch.from_numpy(constant_groups(batch))] = 0.0
        return advantages

    def _update(self, batch: DataProto) -> dict[str, Any]:
        """One policy-gradient step on ``batch``; skipped (no reference forward, no backward, no optimizer
        step) when no token has a non-zero advantage: the policy-gradient term is zero, and the KL term alone
        would only pull the policy back towards the reference with nothing learnt. DAPO's dynamic sampling
        (verl's algorithm.filter_groups, on in verl_config/; an option in MemAgent's fork) drops such
        zero-variance groups from a batch entirely; a step made only of them is dropped here. AdamW would
        otherwise still move the weights by its momentum."""
        mask = batch.batch["response_mask"].float()
        batch.batch["advantages"] = self._advantages(batch)
        skipped = None
        if not mask.any():
            skipped = "no trained tokens in any trajectory"
            # Unlike a batch without reward spread, this points at budgets (e.g. the served role used them all).
            logger.warning("step %d: %s; the update is skipped", self.step + 1, skipped)
        elif not batch.batch["advantages"][mask.bool()].any():
            skipped = "all advantages are zero"
            logger.info("step %d: %s; the update is skipped", self.step + 1, skipped)
        if skipped:
            return {
                "pg_loss": 0.0,
                # Not measured (no reference forward): the policy may well differ from the reference.
                **({"kl": None} if self.cfg.kl_coef else {}),
                "grad_norm": 0.0,
                "update_skipped": skipped,
                **({"rows_filtered": 0} if self.cfg.filter_groups else {}),
            }
        filtered = {}
        if self.cfg.filter_groups:
            kept = np.flatnonzero(~constant_groups(batch))
            filtered = {"rows_filtered": len(batch) - len(kept)}
            batch = batch[kept]
            mask = batch.batch["response_mask"].float()
        if self.cfg.kl_coef:
            ref = [
                response_log_probs(self.reference, mb, False, self.cfg.temperature)
                for mb in batch.split(self.cfg.micro_batch_size)
            ]
            batch.batch["ref_log_prob"] = torch.cat(ref)
        total_tokens = mask.sum().clamp(min=1)
        self.policy.train()
        self.optimizer.zero_grad(set_to_none=True)
        stats = Counter(pg_loss=0.0, **({"kl": 0.0} if self.cfg.kl_coef else {}))
        for mb in batch.split(self.cfg.micro_batch_size):
            mb_mask = mb.batch["response_mask"].float()
            if not mb_mask.any():
                # No trained token (e.g. the served role used the whole budget): a token-mean over
                # nothing is 0/0, and the gradient is zero anyway.
                continue
            log_prob = response_log_probs(self.policy, mb, True, self.cfg.temperature)
            # One on-policy update per rollout: the behaviour policy is the current one, so its
            # log-probs are these, detached (saves a forward pass per step).
            pg_loss, _ = self.policy_loss(
                log_prob.detach(), log_prob, mb.batch["advantages"], mb_mask, "token-mean", self.actor_config
            )
            loss = pg_loss
            if self.cfg.kl_coef:
                kl_loss = agg_loss(kl_penalty(log_prob, mb.batch["ref_log_prob"], "low_var_kl"), mb_mask, "token-mean")
                loss = loss + self.cfg.kl_coef * kl_loss
                stats["kl"] += kl_loss.item() * (mb_mask.sum() / total_tokens).item()
            share = mb_mask.sum() / total_tokens  # token-mean over the whole batch, not per micro-batch
            (loss * share).backward()
            stats["pg_loss"] += pg_loss.item() * share.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.cfg.max_grad_norm)
        self.optimizer.step()
        return {**stats, "grad_norm": float(grad_norm), "update_skipped": None, **filtered}

    def _start_vllm_rollout(self) -> VLLMRollout:
        cfg = self.cfg
        # The policy trains in float32; a server in bfloat16 would sample from a visibly different model.
        settings = build(ServeSettings, {"dtype": "float32", **cfg.rollout_server}, "rollout_server")
        # A whole episode, as far as the model's positions reach (vLLM refuses a longer context).
        context = cfg.prompt_length + cfg.response_length
        context = min(context, getattr(self.policy.config, "max_position_embeddings", None) or context)
        return VLLMRollout(
            self.policy,
            self.tokenizer,
            self.run_dir,
            settings=settings,
            step=self.step,
            max_model_len=context,
            max_new_tokens=cfg.max_new_tokens,
        )

    def train(self) -> dict[str, Any]:
        # One event loop for the whole run: the embedder's request queue and HTTP clients belong to it.
        if self.cfg.rollout != "vllm" or self.step >= self.cfg.steps:
            return asyncio.run(self._train())
        with exit_on_sigterm():
            self.rollout = self._start_vllm_rollout()
            self.server = self.rollout.client
            try:
                return asyncio.run(self._train())
            finally:
                self.rollout.stop()
                self.rollout = None

    async def _train(self) -> dict[str, Any]:
        cfg = self.cfg
        # Named: the HF server seeds each request by its id, so a rerun's ids must be the same.
        worker = in_process_workers(self.config, self.server, self.timer, loop_context=LoopContext("train"))
        metrics: dict[str, Any] = {}
        metrics_path = self.run_dir / "metrics.jsonl"
        # verl's Tracking has no resume: a resumed run logs from its checkpoint's step on.
        tracker = open_tracker(cfg.logger, self.run_dir, self._tracker_config(), resume_step=self.step)
        try:
            with tqdm(total=cfg.steps, initial=self.step, desc="local GRPO", unit="step", disable=None) as bar:
                while self.step < cfg.steps:
                    self.timer["reward"] = 0.0
                    tokens_before, generation_before = self.server.generated_tokens, self.server.seconds
                    fixed_before = worker.loop_context.fixed_seconds()
                    start = time.perf_counter()
                    worker.loop_context.reset_request_ids(f"{cfg.seed}:{self.step}")
                    prompts = self._prompts()
                    batch = await worker.generate_sequences(prompts)
                    # The worker returns rollouts in prompt order (a trajectory's turns together) but not the
                    # grouping key.
                    batch.non_tensor_batch["uid"] = prompts.non_tensor_batch["uid"][
                        batch.non_tensor_batch[TRAJECTORY_KEY]
                    ]
                    rollout_seconds = time.perf_counter() - start
                    start = time.perf_counter()
                    update = self._update(batch)
                    update_seconds = time.perf_counter() - start
                    self.step += 1
                    # The next rollout samples from the updated policy.
                    sync = self.rollout is not None and self.step < cfg.steps
                    sync_seconds = self.rollout.load(self.policy, self.step) if sync else 0.0
                    metrics = self._metrics(
                        batch,
                        update,
                        rollout_seconds,
                        update_seconds,
                        self.server.generated_tokens - tokens_before,
                        self.server.seconds - generation_before,
                        worker.loop_context.fixed_seconds() - fixed_before,
                        sync_seconds,
                    )
                    with metrics_path.open("a") as fh:
                        fh.write(json.dumps(metrics) + "\n")
                    # The skip reason is text; trackers plot numbers.
                    tracked = {**flat_metrics(metrics), "update_skipped": float(metrics["update_skipped"] is not None)}
                    tracker.log(tracked, step=self.step)
                    bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}")
                    bar.update(1)
                    if self.step % cfg.save_every == 0 and self.step < cfg.steps:
                        self._save(metrics)
        finally:
            tracker.finish()
        self.export(metrics)
        return metrics

    def _tracker_config(self) -> dict[str, Any]:
        """The run's record for the trackers' config (hyperparameters); verl's wandb reads ``trainer``."""
        trainer = {
            "project_name": PROJECT,
            "experiment_name": experiment_name(self.run_dir),
            "logger": list(self.cfg.logger),
        }
        return {"trainer": trainer, "run_info": self.run_info, "memupdate": asdict(self.cfg)}

    def _metrics(self, batch, update, rollout_s, update_s, tokens, generation_s, fixed_s, sync_s) -> dict[str, Any]:
        rows = batch.batch["rm_scores"].size(0)
        # Per trajectory: its final row (a MemAgent trajectory has one row per turn, all with its score).
        final = batch.non_tensor_batch[FINAL_MASK_KEY]
        scores = batch.batch["rm_scores"].sum(-1).numpy()[final]
        extra = {k: v[final] for k, v in batch.non_tensor_batch.items() if len(v) == rows}
        reasons = Counter(str(r) for r in extra.get("termination_reason", []) if r is not None)
        out = {
            "step": self.step,
            "trajectories": int(final.sum()),
            "rows": rows,
            "reward_mean": float(scores.mean()),
            "reward_std": float(scores.std()),
            "reward_min": float(scores.min()),
            "reward_max": float(scores.max()),
            "response_tokens_mean": float(batch.batch["response_mask"].sum(-1).float().mean()),
            "num_turns_mean": float(np.mean(extra["__num_turns__"])) if "__num_turns__" in extra else None,
            "termination": dict(reasons),
            "generated_tokens": tokens,
            # Seconds in flight: the policy's requests, the served fixed role's (two-stage), the reward. The
            # rest of the rollout is tools, prompts and the worker's own work. Policy and fixed-model turns
            # of different trajectories can overlap, which makes that rest a lower bound.
            "seconds": {
                "rollout": round(rollout_s, 3),
                "generation": round(generation_s, 3),
                "fixed_model": round(fixed_s, 3),
                "reward": round(self.timer["reward"], 3),
                "tools_and_other": round(max(0.0, rollout_s - generation_s - fixed_s - self.timer["reward"]), 3),
                "update": round(update_s, 3),
                "weight_sync": round(sync_s, 3),
            },
            **update,
        }
        # The created memories' lengths and the retrieved context sizes show whether a rise in reward came
        # with longer memories or more retrieved text (the budget and the cap bound both).
        for key in (
            "qa_initial",
            "qa_final",
            "n_questions",
            "efficiency",
            "memories_final",
            "ops_created",
            "ops_updated",
            "ops_deleted",
            "ops_merged",
            "ops_split",
            "created_count",
            "created_chars_max",
            "created_chars_mean",
            "context_chars_initial",
            "context_chars_final",
            "exact_match",
            "sub_em",
            "f1",
            "boxed",
            "chunks",
            "memory_truncations",
        ):
            if key in extra:
                out[f"{key}_mean"] = float(np.mean(extra[key].astype(float)))
        return out


def train_local(cfg: LocalGRPOConfig) -> dict[str, Any]:
    """Run (or resume) a local GRPO run; returns the last step's metrics."""
    return LocalGRPOTrainer(cfg).train()


def local_config(settings: Mapping[str, Any], path: str = "settings", **paths: Any) -> LocalGRPOConfig:
    """A :class:`LocalGRPOConfig` from the user's settings (checked as :class:`TrainSettings`, each error
    naming ``path.key``) and the run's paths and roles."""
    return LocalGRPOConfig(**clean(TrainSettings, settings, path), **paths)
