"""verl's synchronous GRPO trainer with one change, registered through verl's own trainer registry as
``trainer.v1.trainer_mode: memupdate_sync`` (:data:`~memupdate.settings.FLAT_SKIPPING_TRAINER`): a step whose
advantages are all zero skips the actor's update.

Such a step has nothing to learn: no group had reward spread, so the policy-gradient term is zero, yet verl 0.9.1
still runs the actor's forward and backward over every token and steps the optimizer, which then moves the weights by
AdamW's momentum and weight decay alone (and pulls them towards the reference, if the KL loss is on). On a CPU that
update takes minutes (86 s of a one-step MemAgent smoke run; ~240 s of each ``cpu_demo`` step, all ten of which were
flat). The project's earlier local trainer skipped these steps the same way; DAPO's dynamic sampling
(``algorithm.filter_groups``) would drop such groups and refill the batch, but verl 0.9.1 refills without a cap.

A skipped step logs ``actor/update_skipped`` 1 (0 on the others) and leaves the optimizer, its schedule and the
weights as they were. A step with an entropy bonus or distillation is never skipped: those terms have gradients of
their own. verl's trainer mode ``sync`` is unchanged; experiments choose this one (the CPU experiments do).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from verl.trainer.distillation import is_distillation_enabled
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from memupdate.settings import FLAT_SKIPPING_TRAINER

logger = logging.getLogger(__name__)

SKIPPED_METRIC = "actor/update_skipped"


@register_trainer(FLAT_SKIPPING_TRAINER)
class FlatStepSkippingTrainer(PPOTrainerSync):
    """:class:`PPOTrainerSync` whose actor update is skipped in a step with nothing to learn (module docstring)."""

    def _update_actor(self, batch: Any, metrics: dict) -> Any:
        if self._has_other_loss_terms() or self._learns_something(batch):
            metrics[SKIPPED_METRIC] = 0.0
            return super()._update_actor(batch, metrics)
        logger.info("step %d: every advantage is zero (no group had reward spread): update skipped", self.global_steps)
        metrics.update({SKIPPED_METRIC: 1.0, "actor/pg_loss": 0.0, "actor/grad_norm": 0.0})
        return batch

    def _has_other_loss_terms(self) -> bool:
        actor = self.config.actor_rollout_ref.actor
        return bool(actor.get("entropy_coeff", 0.0)) or is_distillation_enabled(self.config.get("distillation"))

    @staticmethod
    def _learns_something(batch: Any) -> bool:
        """Whether any response token of ``batch`` (in TransferQueue, as verl's trainer keeps it) has a non-zero
        advantage."""
        import transfer_queue as tq

        fetched = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["advantages"])
        advantages = fetched["advantages"]
        # verl stores them as a nested tensor of each row's response tokens.
        rows = advantages.unbind() if getattr(advantages, "is_nested", False) else [advantages]
        return any(bool(torch.count_nonzero(row)) for row in rows)
