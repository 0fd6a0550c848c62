"""The memupdate_vllm rollout's server (memupdate.serving.rollout_server): its settings checked, the served folder
of a tied model untied so that an in-place reload replaces the output layer too, and a server started before
verl adopted by the replica that serves the same thing, replaced otherwise, and stopped with its run. (It
serving a training run: tests/training/test_verl_cpu.py; the launcher and verl's actor agreeing on what it
serves: tests/training/test_verl_launcher.py.)"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
import os
import socket
import stat
import time
import urllib.parse

import psutil
import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from memupdate.serving import rollout_server as rs
from memupdate.serving.launch import is_our_supervisor
from memupdate.serving.readiness import ServerNotReady, probe
from memupdate.serving.vllm_server import wait_until_ready


def test_settings_come_from_the_rollout_config_and_are_checked():
    serving = {"dtype": "float32", "max_in_flight": 8}
    config = OmegaConf.create({"custom": {rs.SETTINGS_KEY: {"serving": serving, "weights_dir": "/w"}}})
    serving, weights = rs.rollout_settings(config)
    # max_in_flight: what the replica's client keeps in flight (verl_ext.external_vllm).
    assert serving.dtype == "float32" and serving.max_in_flight == 8 and str(weights) == "/w"
    with pytest.raises(ValueError, match="needs rollout.custom.memupdate_vllm"):
        rs.rollout_settings(OmegaConf.create({"custom": None}))
    bad = OmegaConf.create({"custom": {rs.SETTINGS_KEY: {"serving": {"dtyp": "float32"}, "weights_dir": "/w"}}})
    with pytest.raises(ValueError, match="dtyp"):
        rs.rollout_settings(bad)


def test_a_tied_model_is_served_untied_and_an_untied_one_from_where_it_is(tiny_models, tmp_path):
    policy = tiny_models / "policy"
    assert json.loads((policy / "config.json").read_text())["tie_word_embeddings"] is True
    served = rs.served_folder(policy, tmp_path / "base")
    config = json.loads((served / "config.json").read_text())
    weights = load_file(served / rs.WEIGHTS_FILE)
    assert config["tie_word_embeddings"] is False
    assert torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    assert (served / "tokenizer.json").is_file()
    # Updated weights without lm_head (the trainer's tied parameters) get one again.
    state = {k: v + 1 for k, v in weights.items() if k != "lm_head.weight"}
    step = rs.write_weights(tmp_path / "step000001", state, json.loads((policy / "config.json").read_text()))
    assert torch.equal(load_file(step / rs.WEIGHTS_FILE)["lm_head.weight"], state["model.embed_tokens.weight"])
    assert rs.served_folder(served, tmp_path / "again") == served  # already untied: served in place


@pytest.mark.vllm
@pytest.mark.slow
def test_a_server_started_before_verl_is_adopted_if_it_serves_the_same_and_stops_with_its_run(
    tiny_model_dir, vllm_python, tmp_path, caplog
):
    caplog.set_level(logging.INFO, logger=rs.__name__)
    serving = {"engine": "vllm-cpu", "python": str(vllm_python), "dtype": "float32", "startup_timeout_s": 600}
    rollout = {
        "name": rs.EXTERNAL_ROLLOUT,
        "prompt_length": 512,
        "response_length": 512,
        "free_cache_engine": False,
        "custom": {rs.SETTINGS_KEY: {"serving": serving, "weights_dir": str(tmp_path / "rollout")}},
    }
    resolved = {
        "trainer": {"nnodes": 1, "n_gpus_per_node": 1},
        "actor_rollout_ref": {"rollout": rollout, "model": {"path": str(tiny_model_dir)}},
    }
    with rs.prelaunched_servers(resolved) as [spec]:
        record = json.loads((spec.weights_dir / rs.PRELAUNCH_FILE).read_text())
        adopted = rs.adopt_server(spec)
        assert adopted is not None and adopted.pid == record["supervisor_pid"]
        assert json.loads((spec.weights_dir / rs.PRELAUNCH_FILE).read_text())["adopted_by"] == os.getpid()
        while not spec.address_file.is_file():
            assert adopted.poll() is None, spec.log_path.read_text()
            time.sleep(0.5)
        address = json.loads(spec.address_file.read_text())
        # The supervisor made the server's key and left it where verl's actor reads it, for its owner's eyes only.
        assert stat.S_IMODE(spec.address_file.stat().st_mode) == 0o600
        wait_until_ready(address["base_url"], rs.SERVED_NAME, 600, process=adopted, api_key=address["api_key"])
        with pytest.raises(ServerNotReady, match="returned 401"):
            probe(address["base_url"], rs.SERVED_NAME, completion=False)
        assert_reachable_from_loopback_only(adopted.pid, address["base_url"])
        # A replica that would serve something else (another context length) stops it and starts its own.
        assert rs.adopt_server(dataclasses.replace(spec, max_model_len=spec.max_model_len - 1)) is None
        assert not is_our_supervisor(adopted.pid)
    assert not (spec.weights_dir / rs.PRELAUNCH_FILE).exists()
    assert "was not adopted by verl's actor (it served something else)" in caplog.text

    with rs.prelaunched_servers(resolved) as [spec]:
        pid = json.loads((spec.weights_dir / rs.PRELAUNCH_FILE).read_text())["supervisor_pid"]
        assert is_our_supervisor(pid)
    # The run's end stops it, and with it vLLM.
    assert not is_our_supervisor(pid) and not (spec.weights_dir / rs.PRELAUNCH_FILE).exists()
    assert "(the run ended before it got that far)" in caplog.text


def assert_reachable_from_loopback_only(pid: int, base_url: str) -> None:
    """Every socket the server's processes listen on is bound to loopback, and its port refuses a connection made
    to this machine's other address: its development endpoints (/collective_rpc runs code) face no other host."""
    tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    listening = {c.laddr for p in tree for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    assert listening and all(ipaddress.ip_address(a.ip).is_loopback for a in listening), listening
    port = urllib.parse.urlsplit(base_url).port
    assert port in {a.port for a in listening}, (port, listening)
    others = [
        a.address
        for addresses in psutil.net_if_addrs().values()
        for a in addresses
        if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback
    ]
    assert others, "this machine has no address but loopback to try the server from"
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((others[0], port), timeout=5).close()
