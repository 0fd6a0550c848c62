"""verl's synchronous GRPO trainer with one change, registered through verl's own trainer registry as
``trainer.v1.trainer_mode: memupdate_sync`` (:data:`~memupdate.settings.FLAT_SKIPPING_TRAINER`): the actor's update
runs only on the groups that have something to teach.

A group (the rollouts of one prompt, one ``uid``) whose rewards are all equal has no advantage: its policy-gradient
term is zero. verl 0.9.1 still runs the actor's forward and backward over every token of it, and when every group of
a step is flat it steps the optimizer too, which then moves the weights by AdamW's momentum and weight decay alone
(and pulls them towards the reference, if the KL loss is on). On a CPU that work is most of a step: 180-200 s of each
``cpu_demo`` step (32 episodes, ~25,000 tokens), 86 s of a one-step MemAgent smoke run. So here:

- a step in which no group has reward spread skips the update (``actor/update_skipped`` 1): the optimizer, its
  schedule and the weights stay as they were;
- a step made of one mini-batch (``ppo_mini_batch_size`` equal to ``data.train_batch_size``, as in the CPU
  experiments) updates on its groups with spread only, topped up with flat groups where the data-parallel ranks need
  a multiple (:func:`~memupdate.verl_ext.flat_groups.rows_to_train`); ``actor/trained_rows`` says how many rows. The
  policy gradient's token mean is then over those groups' tokens: DAPO's dynamic sampling without its refill, and
  what the project's earlier local trainer did. A ``cpu_demo`` update on one group of 8 took 48-50 s, on two 98 s
  (the local trainer's: 43-129 s on its 1-2 groups with spread). A step of several mini-batches keeps every row, so
  that it takes as many optimizer steps as under ``sync``.

A step with an entropy bonus or distillation always updates on every row, and one with the KL loss on every row once
any group has spread: those terms have gradients of their own. verl's trainer mode ``sync`` is unchanged; experiments
choose this one (the CPU experiments do).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from typing import Any

import torch
from omegaconf import open_dict
from verl.trainer.distillation import is_distillation_enabled
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from memupdate.settings import FLAT_SKIPPING_TRAINER
from memupdate.verl_ext.flat_groups import rows_to_train

logger = logging.getLogger(__name__)

SKIPPED_METRIC = "actor/update_skipped"
TRAINED_ROWS_METRIC = "actor/trained_rows"


@register_trainer(FLAT_SKIPPING_TRAINER)
class FlatGroupSkippingTrainer(PPOTrainerSync):
    """:class:`PPOTrainerSync` whose actor update runs on the groups with something to learn (module docstring)."""

    def _update_actor(self, batch: Any, metrics: dict) -> Any:
        if self._has_other_loss_terms():
            metrics.update({SKIPPED_METRIC: 0.0, TRAINED_ROWS_METRIC: float(len(batch))})
            return super()._update_actor(batch, metrics)
        rows = rows_to_train(*self._groups_and_learning(batch), self._row_multiple())
        if not rows:
            logger.info(
                "step %d: every advantage is zero (no group had reward spread): update skipped", self.global_steps
            )
            metrics.update(
                {SKIPPED_METRIC: 1.0, TRAINED_ROWS_METRIC: 0.0, "actor/pg_loss": 0.0, "actor/grad_norm": 0.0}
            )
            return batch
        metrics[SKIPPED_METRIC] = 0.0
        if len(rows) == len(batch) or len(batch) != self._mini_batch_rows() or self._uses_kl_loss():
            metrics[TRAINED_ROWS_METRIC] = float(len(batch))
            return super()._update_actor(batch, metrics)
        logger.info(
            "step %d: the update trains %d of %d rows (the groups with reward spread)",
            self.global_steps,
            len(rows),
            len(batch),
        )
        metrics[TRAINED_ROWS_METRIC] = float(len(rows))
        with self._mini_batch_of(len(rows)):
            super()._update_actor(batch.select_keys([batch.keys[row] for row in rows]), metrics)
        return batch

    def _has_other_loss_terms(self) -> bool:
        actor = self.config.actor_rollout_ref.actor
        return bool(actor.get("entropy_coeff", 0.0)) or is_distillation_enabled(self.config.get("distillation"))

    def _uses_kl_loss(self) -> bool:
        return bool(self.config.actor_rollout_ref.actor.get("use_kl_loss", False))

    @staticmethod
    def _groups_and_learning(batch: Any) -> tuple[list[str], list[bool]]:
        """Each row's group (``uid``) and whether any of its response tokens has a non-zero advantage, read from
        TransferQueue, where verl's trainer keeps the batch (advantages as a nested tensor of each row's tokens)."""
        import transfer_queue as tq

        fetched = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["uid", "advantages"])
        advantages = fetched["advantages"]
        rows = advantages.unbind() if getattr(advantages, "is_nested", False) else list(advantages)
        return [str(uid) for uid in fetched["uid"]], [bool(torch.count_nonzero(row)) for row in rows]

    def _mini_batch_rows(self) -> int:
        """Rows per mini-batch of the update, as verl's ``_update_actor`` counts them."""
        config = self.config.actor_rollout_ref
        return config.actor.ppo_mini_batch_size * config.rollout.n

    def _row_multiple(self) -> int:
        """What the trained rows' number must divide by: a whole number of prompts' worth of rows for verl's
        mini-batch size (prompts x ``rollout.n``), split evenly across the actor's data-parallel ranks (as verl's
        ``_balance_batch`` finds them)."""
        workers = self.actor_rollout_wg
        dp_size = max(workers._dispatch_info.get("actor") or workers._query_dispatch_info("actor")) + 1
        return math.lcm(self.config.actor_rollout_ref.rollout.n, dp_size)

    @contextlib.contextmanager
    def _mini_batch_of(self, rows: int) -> Iterator[None]:
        """verl's ``_update_actor`` with a mini-batch of ``rows``: it reads ``ppo_mini_batch_size`` (in prompts)
        from the config for each update."""
        actor = self.config.actor_rollout_ref.actor
        full = actor.ppo_mini_batch_size
        with open_dict(actor):
            actor.ppo_mini_batch_size = rows // self.config.actor_rollout_ref.rollout.n
        try:
            yield
        finally:
            with open_dict(actor):
                actor.ppo_mini_batch_size = full
