"""The memupdate_vllm rollout's parts that need no server: registered with both of verl's rollout registries,
its settings checked, and the served folder of a tied model untied so that an in-place reload replaces the
output layer too. (It serving a training run: tests/training/test_verl_cpu.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from verl.workers.rollout.base import get_rollout_class
from verl.workers.rollout.replica import get_rollout_replica_class

from memupdate.verl_ext import external_vllm as ev


def test_registered_with_both_of_verls_rollout_registries():
    assert get_rollout_replica_class(ev.NAME) is ev.ExternalVLLMReplica
    assert get_rollout_class(ev.NAME, "async") is ev.ExternalServerAdapter


def test_settings_come_from_the_rollout_config_and_are_checked():
    config = OmegaConf.create({"custom": {ev.NAME: {"serving": {"dtype": "float32"}, "weights_dir": "/w"}}})
    serving, weights = ev.rollout_settings(config)
    assert serving.dtype == "float32" and str(weights) == "/w"
    with pytest.raises(ValueError, match="needs rollout.custom.memupdate_vllm"):
        ev.rollout_settings(OmegaConf.create({"custom": None}))
    bad = OmegaConf.create({"custom": {ev.NAME: {"serving": {"dtyp": "float32"}, "weights_dir": "/w"}}})
    with pytest.raises(ValueError, match="dtyp"):
        ev.rollout_settings(bad)


def test_a_tied_model_is_served_untied_and_an_untied_one_from_where_it_is(tiny_models, tmp_path):
    policy = tiny_models / "policy"
    assert json.loads((policy / "config.json").read_text())["tie_word_embeddings"] is True
    served = ev.served_folder(policy, tmp_path / "base")
    config = json.loads((served / "config.json").read_text())
    weights = load_file(served / ev.WEIGHTS_FILE)
    assert config["tie_word_embeddings"] is False
    assert torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    assert (served / "tokenizer.json").is_file()
    # Updated weights without lm_head (the trainer's tied parameters) get one again.
    state = {k: v + 1 for k, v in weights.items() if k != "lm_head.weight"}
    step = ev.write_weights(tmp_path / "step000001", state, json.loads((policy / "config.json").read_text()))
    assert torch.equal(load_file(step / ev.WEIGHTS_FILE)["lm_head.weight"], state["model.embed_tokens.weight"])
    assert ev.served_folder(served, tmp_path / "again") == served  # already untied: served in place
