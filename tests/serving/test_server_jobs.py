"""A served model's Slurm job on a real cluster: where it is placed, how long it may queue, and what happens
when it is preempted and requeued (a new node and port): the supervisor rewrites the readiness marker and
clients that lost the server find it again.

No cluster and no vLLM here: the queue is a sequence of squeue states on a fake clock (the real Slurm tests
are in tests/slurm), and the served model is a small HTTP server that answers like vLLM's OpenAI API, run by
the real supervisor in place of vLLM.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from memupdate.cluster import PLACEMENT_ENV, placement
from memupdate.serving import launch, slurm_jobs
from memupdate.serving.client import Endpoint, EndpointError, OpenAIClient
from memupdate.serving.decoding import GREEDY
from memupdate.serving.readiness import (
    ServerNotReady,
    await_held_server,
    list_models,
    load_marker,
    read_marker,
    write_held_marker,
    write_marker,
)
from memupdate.serving.vllm_server import API_KEY_ENV, new_api_key, server_command
from memupdate.settings import ServeSettings, build
from memupdate.utils.system import free_port

PLACEMENT_FLAGS = ("--partition", "--account", "--qos")


# ---------------------------------------------------------------------------------------- CUDA graphs


@pytest.mark.parametrize(("engine", "cpu"), [("vllm", False), ("vllm-cpu", True)])
def test_gpu_servers_keep_cuda_graphs_and_cpu_servers_skip_the_compile(tmp_path, engine, cpu):
    """A fixed-role server decodes for a whole training stage: without CUDA graphs a GPU server is several times
    slower. On CPU, compiling costs a minute at start-up and gains little."""
    settings = build(ServeSettings, {"engine": engine}, "serving")
    argv = launch.supervisor_argv(
        tmp_path / "m", "qa", tmp_path / "a.json", settings, "python", bind_host="0.0.0.0", watch_pid=None
    )
    assert ("--cpu-engine" in argv) is cpu
    assert launch._parser().parse_args(argv[3:]).cpu_engine is cpu
    command = server_command(
        tmp_path / "m", served_model_name="qa", host="h", port=1, python="p", max_model_len=8, dtype="float32", cpu=cpu
    )
    assert ("--enforce-eager" in command) is cpu


# ---------------------------------------------------------------------------------------- placement


def test_the_server_job_gets_the_partition_account_and_qos_of_the_serve_rules_job(tmp_path):
    command = ["python", "-m", launch.MODULE, "run"]
    # The serve_model job's resources as the Slurm profile resolves them from MEMUPDATE_SLURM_*.
    placed = {"slurm_partition": "gpu", "slurm_account": "proj42", "qos": "long"}
    slurm = launch.with_job_placement({"gres": "gpu:1", "time": 2880}, placed)
    argv = launch.sbatch_argv("memupdate-serve-qa", tmp_path / "s.log", slurm, command)
    assert {"--partition=gpu", "--account=proj42", "--qos=long", "--gres=gpu:1", "--time=2880"} <= set(argv)
    # Unset variables (the profile's empty strings), or no Slurm profile at all: no flag, the cluster's default.
    for resources in ({"slurm_partition": "", "slurm_account": "", "qos": ""}, {}, None):
        argv = launch.sbatch_argv("x", tmp_path / "s.log", launch.with_job_placement({}, resources), command)
        assert not [a for a in argv if a.startswith(PLACEMENT_FLAGS)], argv
    # Set only the partition: only that flag.
    argv = launch.sbatch_argv("x", tmp_path / "s.log", launch.with_job_placement({}, {"slurm_partition": "a"}), command)
    assert [a for a in argv if a.startswith(PLACEMENT_FLAGS)] == ["--partition=a"]
    # serving.slurm's own setting wins (a cluster whose GPUs are in another partition than the CPU jobs).
    assert launch.with_job_placement({"partition": "a100"}, placed)["partition"] == "a100"


def test_a_server_job_is_signalled_before_its_limit_to_hand_over(tmp_path):
    """serving.handover_s before the limit Slurm signals the supervisor (the batch shell itself: exec), which then
    submits its successor; a limit under twice that asks for no signal (Slurm may signal a minute early)."""
    command = ["python", "-m", launch.MODULE, "run", "--model", "m"]
    argv = launch.sbatch_argv("x", tmp_path / "s.log", {"time": 2880}, command, handover_s=1800)
    assert "--signal=B:USR1@1800" in argv and argv[-1] == "--wrap=exec python -m memupdate.serving.launch run --model m"
    assert not [
        a for a in launch.sbatch_argv("x", tmp_path / "s.log", {"time": 50}, command, 1800) if a.startswith("--signal")
    ]
    assert not [
        a for a in launch.sbatch_argv("x", tmp_path / "s.log", {"time": 2880}, command, 0) if a.startswith("--signal")
    ]


def test_the_placement_resources_are_the_ones_the_slurm_profile_sets(repo_root):
    """One definition: the profile reads MEMUPDATE_SLURM_* into these resources for every job, serve_model's
    included, and the server's job takes them from there."""
    profile = yaml.safe_load((repo_root / "profiles/slurm/config.yaml").read_text())
    defaults = profile["default-resources"]
    assert set(launch.PLACEMENT_RESOURCES.values()) == set(PLACEMENT_ENV)
    env = {variable: f"from {variable}" for variable in PLACEMENT_ENV.values()}
    for resource, variable in PLACEMENT_ENV.items():
        # Snakemake evaluates a default resource as a Python expression.
        assert defaults[resource] == f"__import__('memupdate.cluster').cluster.placement('{resource}')"
        assert placement(resource, env) == f"from {variable}"


# ---------------------------------------------------------------------------------------- the queue


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds


def squeue(*states):
    """``status`` for wait_until_running: each call the next (state, reason), or None (not listed)."""
    it = iter(states)
    return lambda: next(it)


PENDING = ("PENDING", "Resources")


def test_queue_time_is_not_start_up_time_and_is_logged_now_and_then(caplog):
    clock = FakeClock()
    # Two hours queued, then the nodes boot, then it runs: far past startup_timeout_s, and no error.
    states = squeue(*itertools.repeat(PENDING, 720), ("CONFIGURING", "None"), ("RUNNING", "None"))
    with caplog.at_level(logging.INFO, logger=slurm_jobs.__name__):
        state = slurm_jobs.wait_until_running("123", states, poll_s=10, log_every_s=300, clock=clock, sleep=clock.sleep)
    assert state == "RUNNING" and clock.now == 7210
    lines = [r.getMessage() for r in caplog.records]
    queued = [line for line in lines if "PENDING (Resources)" in line]
    # Once at first, then every 5 minutes: 24 lines for two hours, not 720.
    assert len(queued) == 24 and queued[0] == "Slurm job 123 is PENDING (Resources) after 0 s in the queue"
    assert any("CONFIGURING" in line for line in lines)
    assert lines[-1] == "Slurm job 123 is RUNNING after 7210 s in the queue"


def test_a_queue_limit_fails_naming_the_job_and_squeues_reason():
    clock = FakeClock()
    states = squeue(*itertools.repeat(("PENDING", "QOSMaxGRESPerUser"), 100))
    with pytest.raises(slurm_jobs.ServeError) as err:
        slurm_jobs.wait_until_running("4711", states, queue_timeout_s=60, poll_s=25, clock=clock, sleep=clock.sleep)
    message = str(err.value)
    assert "Slurm job 4711 is still PENDING after 60 s in the queue" in message
    assert "squeue's reason: QOSMaxGRESPerUser" in message and "serving.queue_timeout_s" in message
    # The last poll is cut to the limit: it fails at 60 s, not at the next 25 s step.
    assert clock.now == 60


def test_a_job_not_listed_yet_is_queued_and_one_that_left_the_queue_is_reported():
    clock = FakeClock()
    # squeue may not list a job in its first seconds.
    assert (
        slurm_jobs.wait_until_running(
            "1", squeue(None, PENDING, ("RUNNING", "None")), poll_s=2, clock=clock, sleep=clock.sleep
        )
        == "RUNNING"
    )
    # A job that failed at once (or was cancelled) before a poll saw it run: the address wait says why.
    clock = FakeClock()
    assert (
        slurm_jobs.wait_until_running(
            "2", squeue(PENDING, None, None, None, None), poll_s=2, grace_s=5, clock=clock, sleep=clock.sleep
        )
        is None
    )
    assert (
        slurm_jobs.wait_until_running("3", squeue(("FAILED", "NonZeroExitCode")), clock=clock, sleep=clock.sleep)
        == "FAILED"
    )


def test_the_new_settings_are_typed_with_their_defaults():
    settings = build(ServeSettings, {}, "serving")
    assert settings.queue_timeout_s is None and settings.reconnect_timeout_s == 1800
    with pytest.raises(ValueError, match="serving.reconnect_timeout_s"):
        build(ServeSettings, {"reconnect_timeout_s": -1}, "serving")


# ---------------------------------------------------------------------------------------- restarts

FAKE_VLLM = """#!{python}
# Stands in for `python -m vllm.entrypoints.openai.api_server ...`: lists the served model and answers
# completions and chat with the port it serves on; as vLLM, it refuses /v1 requests without VLLM_API_KEY's key.
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

args = sys.argv[1:]
port, name = int(args[args.index("--port") + 1]), args[args.index("--served-model-name") + 1]


class Handler(BaseHTTPRequestHandler):
    def send(self, body, status=200):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def refused(self):
        if self.headers.get("Authorization") != "Bearer " + os.environ["VLLM_API_KEY"]:
            self.send({{"error": "Unauthorized"}}, 401)
            return True
        return False

    def do_GET(self):
        if not self.refused():
            self.send({{"data": [{{"id": name, "max_model_len": 2048}}]}})

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.refused():
            return
        text = f"port {{port}}"
        self.send({{"choices": [{{"text": text, "message": {{"role": "assistant", "content": text}}}}]}})

    def log_message(self, *args):
        pass


ThreadingHTTPServer((args[args.index("--host") + 1], port), Handler).serve_forever()
"""


@pytest.fixture
def fake_vllm(tmp_path):
    path = tmp_path / "fake-vllm-python"
    path.write_text(FAKE_VLLM.format(python=sys.executable))
    path.chmod(0o755)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return path, model


def start_supervisor(python: Path, model: Path, marker: Path, tmp_path: Path, api_key: str) -> subprocess.Popen:
    """What the server's Slurm job runs, here on loopback; started again, it is the requeued job, whose environment
    (the server's key with it) Slurm keeps."""
    argv = [sys.executable, "-m", launch.MODULE, "run", "--model", str(model), "--served-model-name", "qa"]
    argv += ["--address-file", str(tmp_path / "qa.address.json"), "--python", str(python), "--marker", str(marker)]
    with (tmp_path / "qa.supervisor.log").open("a") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, API_KEY_ENV: api_key})


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        process.wait(timeout=60)


def test_a_client_finds_a_requeued_server_through_its_rewritten_marker(fake_vllm, tmp_path):
    """The server's job was preempted: its marker still names the old port, where nothing answers. A request
    made now waits; the requeued job's supervisor starts the server on a new port and rewrites the marker
    once it answers, and the request is answered there, as are the ones after it."""
    python, model = fake_vllm
    marker = tmp_path / "serve" / "qa.ready.json"
    gone = f"http://127.0.0.1:{free_port()}/v1"
    key = new_api_key()
    written = write_marker(
        marker, endpoint=gone, served_model_name="qa", model_path=model, reconnect_timeout_s=120, api_key=key
    )
    messages = [{"role": "user", "content": "who serves?"}]

    async def main():
        # The client was given the address only: it takes the key from the marker it re-reads.
        async with OpenAIClient(Endpoint(gone, "qa", max_retries=1, marker=str(marker))) as client:
            waiting = asyncio.create_task(client.chat(messages, **GREEDY.request(8)))
            await asyncio.sleep(1.0)
            assert not waiting.done()
            supervisor = start_supervisor(python, model, marker, tmp_path, key)
            try:
                first = await asyncio.wait_for(waiting, 60)
                second = await client.chat([{"role": "user", "content": "again"}], **GREEDY.request(8))
            except BaseException:
                stop(supervisor)
                raise
            return first, second, client.endpoint, supervisor

    start = time.monotonic()
    first, second, endpoint, supervisor = asyncio.run(main())
    try:
        address = json.loads((tmp_path / "qa.address.json").read_text())
        port = address["base_url"].rsplit(":", 1)[1].split("/")[0]
        assert first == second == f"port {port}" and endpoint.base_url == address["base_url"] != gone
        rewritten = load_marker(marker)
        assert rewritten["endpoint"] == address["base_url"] and rewritten["pid"] == supervisor.pid
        # What the serve rule recorded is kept; the marker holds the key (the supervisor was given it, so its address
        # file does not) and is its owner's alone.
        assert (rewritten["model_path"], rewritten["reconnect_timeout_s"]) == (written["model_path"], 120)
        assert rewritten["api_key"] == key and "api_key" not in address
        assert stat.S_IMODE(marker.stat().st_mode) == 0o600
        # A consumer starting now reads the new address and the key, and keeps the marker for the next restart.
        endpoint = read_marker(marker)
        assert endpoint == Endpoint(address["base_url"], "qa", marker=str(marker.resolve()), api_key=key)
        assert key not in repr(endpoint) and key not in (tmp_path / "qa.supervisor.log").read_text()
        # Without the key the server answers nothing.
        with pytest.raises(ServerNotReady, match="401"):
            list_models(address["base_url"])
        assert time.monotonic() - start < 45
        # Its consumers done, Snakemake deletes the marker (temp()): the supervisor stops the server.
        marker.unlink()
        assert supervisor.wait(timeout=30) == 0
    finally:
        stop(supervisor)


def test_a_held_servers_marker_has_no_address_until_its_released_supervisor_answers(fake_vllm, tmp_path):
    """A Slurm server started with its consumer (serving.start_with_consumer) is submitted held and its marker written
    at once, without an address: the consumer is submitted next, and the server holds nothing while that one queues.
    Released, the job's supervisor finds the marker and writes its address once the server answers; from then on
    the marker reads as any other. A marker without an address that is not a held server's is refused."""
    python, model = fake_vllm
    marker = tmp_path / "serve" / "qa.ready.json"
    key = new_api_key()
    held = write_held_marker(
        marker,
        served_model_name="qa",
        slurm_job_id="77",
        model_path=model,
        reconnect_timeout_s=60,
        api_key=key,
        engine="vllm",
        queue_timeout_s=None,
        startup_timeout_s=60,
        log=tmp_path / "qa.supervisor.log",
    )
    assert load_marker(marker) == held and held["endpoint"] is None and held["held_job"] == "77"
    assert stat.S_IMODE(marker.stat().st_mode) == 0o600
    supervisor = start_supervisor(python, model, marker, tmp_path, key)
    try:
        deadline = time.monotonic() + 60
        while load_marker(marker)["endpoint"] is None and time.monotonic() < deadline:
            time.sleep(0.5)
        ready = load_marker(marker)
        assert ready["endpoint"] and "held_job" not in ready, ready
        assert (ready["model_path"], ready["api_key"], ready["reconnect_timeout_s"]) == (held["model_path"], key, 60)
        # Answering, it is neither released nor waited for again.
        assert await_held_server(marker) == ready
        assert list_models(read_marker(marker).base_url, api_key=key) == ["qa"]
        assert "released by its consumer, the server answers" in (tmp_path / "qa.supervisor.log").read_text()
    finally:
        stop(supervisor)
    marker.write_text(json.dumps({**held, "held_job": None}))
    with pytest.raises(ValueError, match="has no 'endpoint'"):
        load_marker(marker)


def test_a_client_gives_up_after_the_markers_reconnect_time_naming_marker_and_address(tmp_path):
    marker = tmp_path / "qa.ready.json"
    gone = f"http://127.0.0.1:{free_port()}/v1"
    write_marker(marker, endpoint=gone, served_model_name="qa", reconnect_timeout_s=2)

    async def main(endpoint):
        async with OpenAIClient(endpoint) as client:
            with pytest.raises(EndpointError) as err:
                await client.chat([{"role": "user", "content": "q"}], **GREEDY.request(8))
        return str(err.value)

    start = time.monotonic()
    message = asyncio.run(main(Endpoint(gone, "qa", max_retries=0, marker=str(marker))))
    assert 2 <= time.monotonic() - start < 10
    assert f"from readiness marker {marker}" in message and f"last address tried {gone}" in message
    assert "ClientConnectorError" in message
    # A marker that is gone (the run stopped the server) ends the wait at once, naming it.
    marker.unlink()
    start = time.monotonic()
    message = asyncio.run(main(Endpoint(gone, "qa", max_retries=0, marker=str(marker))))
    assert f"no readiness marker at {marker}" in message and gone in message and time.monotonic() - start < 2
    # Without a marker, nothing to re-read: the bounded retries only.
    message = asyncio.run(main(Endpoint(gone, "qa", max_retries=0)))
    assert "failed after 1 attempts" in message


def test_an_endpoint_mapping_carries_its_marker_and_the_key_stays_in_it(tmp_path):
    """The fixed model reaches verl's agent loops as a mapping (training.stages.fixed_model_endpoint), which is
    written into the run's agent-loop config: the server's key is read from the marker, never carried by it."""
    marker = tmp_path / "m.ready.json"
    write_marker(marker, endpoint="http://n1:8000/v1", served_model_name="m", api_key="k3y")
    spec = {"base_url": "http://n1:8000/v1", "model": "m", "marker": str(marker)}
    endpoint = Endpoint.from_dict(spec)
    assert endpoint.marker == str(marker) and endpoint.headers() == {"Authorization": "Bearer k3y"}
    with pytest.raises(ValueError, match="api_key_env"):
        Endpoint.from_dict({**spec, "api_key": "k3y"})
    with pytest.raises(FileNotFoundError, match="no readiness marker"):
        Endpoint.from_dict({**spec, "marker": str(tmp_path / "gone.json")})
