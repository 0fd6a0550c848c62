"""The memupdate_vllm rollout registered with both of verl's rollout registries. (Its server:
tests/serving/test_rollout_server.py; it serving a training run: tests/training/test_verl_cpu.py.)"""

from __future__ import annotations

from verl.workers.rollout.base import get_rollout_class
from verl.workers.rollout.replica import get_rollout_replica_class

from memupdate.verl_ext import external_vllm as ev


def test_registered_with_both_of_verls_rollout_registries():
    assert get_rollout_replica_class(ev.NAME) is ev.ExternalVLLMReplica
    assert get_rollout_class(ev.NAME, "async") is ev.ExternalServerAdapter
