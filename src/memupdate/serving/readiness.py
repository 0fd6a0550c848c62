"""Readiness probes and readiness markers for served models.

A *readiness marker* (``results/<exp>/serve/<role>.ready.json``) is the Snakemake output of a serve
rule: it says where a served model answers. It is a promise that held when it was written, not one
that holds forever (the server's job can end, be pre-empted, or the machine can restart), so:

- the writer calls :func:`write_marker` only **after** it has probed the server itself (listed in
  ``GET /v1/models`` *and* a tiny completion succeeded; :func:`memupdate.serving.vllm_server.wait_until_ready`
  does both), and
- every reader goes through :func:`read_marker`, which probes again and fails with a message naming
  the marker, the URL and the fix, instead of the first reward call timing out deep inside a run.

A Slurm server started with its consumer (``serving.start_with_consumer``) is submitted held, and its marker written at
once without an address (:func:`write_held_marker`); the consumer's first :func:`read_marker` (or :func:`release_held`,
for all its servers at once) releases the job and waits until the server, once it answers, has written its address.

A server whose Slurm job is requeued (preempted) comes back on another node and port; its supervisor
then points the marker at the new address (:func:`rewrite_marker`, atomically), and clients that lost the
server re-read it (:class:`memupdate.serving.client.OpenAIClient`) for the marker's ``reconnect_timeout_s``.

The probes use ``urllib`` and are synchronous: they run in serve scripts and before training
starts, where there is no event loop to share.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from memupdate.serving.client import Endpoint, EndpointError
from memupdate.serving.decoding import GREEDY
from memupdate.serving.markers import MARKER_FORMAT, load_marker
from memupdate.serving.slurm_jobs import (
    QUEUED_STATES,
    ServeError,
    SlurmJob,
    cancel,
    job_state,
    job_status,
    release,
    wait_until_running,
)
from memupdate.utils.io import write_json_atomic
from memupdate.utils.system import tail

logger = logging.getLogger(__name__)


class ServerNotReady(EndpointError):
    """A probe failed: the server is not answering, or answers without the expected model."""


class ServerGone(EndpointError):
    """The server a readiness marker points to does not answer any more."""


def _request_json(url: str, payload: dict[str, Any] | None, timeout_s: float, api_key: str | None = None) -> Any:
    data = None if payload is None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=data, headers=headers)
    # A proxy set in the environment must not intercept loopback or cluster-internal probes.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        body = exc.read()[:300].decode(errors="replace")
        raise ServerNotReady(f"{'POST' if data else 'GET'} {url} returned {exc.code}: {body}") from exc
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ServerNotReady(f"{'POST' if data else 'GET'} {url} failed: {reason}") from exc


def get_models(base_url: str, timeout_s: float = 5.0, *, api_key: str | None = None) -> list[dict[str, Any]]:
    """The model cards ``GET {base_url}/models`` returns (vLLM's include ``max_model_len``)."""
    data = _request_json(base_url.rstrip("/") + "/models", None, timeout_s, api_key)
    try:
        cards = list(data["data"])
        if not all(isinstance(card, dict) and "id" in card for card in cards):
            raise TypeError("model card without an id")
        return cards
    except (KeyError, TypeError) as exc:
        raise ServerNotReady(f"GET {base_url}/models: unexpected response {str(data)[:300]}") from exc


def list_models(base_url: str, timeout_s: float = 5.0, *, api_key: str | None = None) -> list[str]:
    """The model ids ``GET {base_url}/models`` lists; raises :class:`ServerNotReady`."""
    return [card["id"] for card in get_models(base_url, timeout_s, api_key=api_key)]


def probe_models(
    base_url: str,
    served_model_name: str,
    timeout_s: float = 5.0,
    *,
    model_path: str | None = None,
    api_key: str | None = None,
) -> None:
    """Raise :class:`ServerNotReady` unless ``served_model_name`` is listed by ``/v1/models`` and, given
    ``model_path``, served from that folder (vLLM's card names it as ``root``): a server another run started on the
    same port under the same name would otherwise answer for a model it does not serve."""
    cards = {card["id"]: card for card in get_models(base_url, timeout_s, api_key=api_key)}
    if served_model_name not in cards:
        raise ServerNotReady(
            f"{base_url} answers but serves {list(cards)}, not {served_model_name!r} (another server on that port?)"
        )
    root = cards[served_model_name].get("root")
    if model_path is not None and root is not None and root != model_path:
        raise ServerNotReady(
            f"{base_url} serves {served_model_name!r} from {root}, not {model_path} (another run's server under "
            "the same name on that port?)"
        )


def probe_completion(
    base_url: str, served_model_name: str, timeout_s: float = 30.0, *, api_key: str | None = None
) -> None:
    """Send one 1-token completion; listing a model does not prove the engine can generate yet."""
    payload = {"model": served_model_name, "prompt": "Hello", **GREEDY.request(1)}
    data = _request_json(base_url.rstrip("/") + "/completions", payload, timeout_s, api_key)
    if not isinstance(data, dict) or not data.get("choices"):
        raise ServerNotReady(f"POST {base_url}/completions: no choices in {str(data)[:300]}")


def probe(
    base_url: str,
    served_model_name: str,
    *,
    completion: bool = True,
    timeout_s: float = 30.0,
    api_key: str | None = None,
) -> None:
    """The full readiness check a marker stands for: the model is listed and (by default) generates."""
    probe_models(base_url, served_model_name, timeout_s=min(timeout_s, 10.0), api_key=api_key)
    if completion:
        probe_completion(base_url, served_model_name, timeout_s=timeout_s, api_key=api_key)


def write_marker(
    path: str | os.PathLike,
    *,
    endpoint: str | Endpoint,
    served_model_name: str,
    pid: int | None = None,
    slurm_job_id: str | None = None,
    model_path: str | os.PathLike | None = None,
    reconnect_timeout_s: float | None = None,
    api_key: str | None = None,
    engine: str | None = None,
) -> dict[str, Any]:
    """Write the readiness marker for a served model at ``path`` (atomically) and return its content.

    Call it only after the server passed :func:`probe` (``wait_until_ready`` does that): this function
    does not probe, it records that a probe succeeded just now (``health_checked_at``). ``endpoint``
    is the OpenAI-compatible root (``http://host:port/v1``) or an :class:`Endpoint`; it must be
    reachable from the consumers, so a server for other nodes records its hostname, not 127.0.0.1.
    ``slurm_job_id`` defaults to ``$SLURM_JOB_ID`` when the writer runs inside a Slurm job, which is
    how a server's job is found and cancelled later. ``reconnect_timeout_s`` (``serving.reconnect_timeout_s``)
    is how long a client that loses this server waits for it to come back (None: it does not wait).
    ``api_key``: the server's key, which its clients send; a marker with a key is readable by its owner only
    (mode 0600), whatever the umask. ``engine`` (``serving.engine``) tells clients whether the server computes on
    this machine's CPU cores (``vllm-cpu``), which servers started beside it share.
    """
    base_url = endpoint.base_url if isinstance(endpoint, Endpoint) else str(endpoint)
    Endpoint(base_url, served_model_name)  # validates URL and name before anything is written
    if slurm_job_id is None:
        slurm_job_id = os.environ.get("SLURM_JOB_ID")
    marker = {
        "format": MARKER_FORMAT,
        "endpoint": base_url,
        "served_model_name": served_model_name,
        "model_path": None if model_path is None else str(Path(model_path).resolve()),
        "host": socket.gethostname(),
        "pid": pid,
        "slurm_job_id": slurm_job_id,
        "health_checked_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "reconnect_timeout_s": reconnect_timeout_s,
        "api_key": api_key,
        "engine": engine,
    }
    write_json_atomic(path, marker, private=api_key is not None)
    logger.info("readiness marker %s: %s serves %r", path, base_url, served_model_name)
    return marker


def write_held_marker(
    path: str | os.PathLike,
    *,
    served_model_name: str,
    slurm_job_id: str,
    model_path: str | os.PathLike,
    reconnect_timeout_s: float | None,
    api_key: str,
    engine: str,
    queue_timeout_s: float | None,
    startup_timeout_s: float,
    log: str | os.PathLike,
) -> dict[str, Any]:
    """The marker of a server submitted held (``sbatch --hold``): no address yet, the job its consumer releases
    (``held_job``), and how long that consumer waits for it (the queue, then its start-up; ``log`` for the reason
    when it fails). The server's supervisor finds the marker there when it starts and points it at itself once it
    answers (:func:`rewrite_marker`), as a requeued server does."""
    marker = {
        "format": MARKER_FORMAT,
        "endpoint": None,
        "served_model_name": served_model_name,
        "model_path": str(Path(model_path).resolve()),
        "host": None,
        "pid": None,
        "slurm_job_id": slurm_job_id,
        "held_job": slurm_job_id,
        "health_checked_at": None,
        "reconnect_timeout_s": reconnect_timeout_s,
        "api_key": api_key,
        "engine": engine,
        "queue_timeout_s": queue_timeout_s,
        "startup_timeout_s": startup_timeout_s,
        "log": str(Path(log).resolve()),
    }
    write_json_atomic(path, marker, private=True)
    logger.info(
        "readiness marker %s: %r waits for its consumer (Slurm job %s, held)", path, served_model_name, slurm_job_id
    )
    return marker


def release_held(paths: list[str | os.PathLike]) -> None:
    """Release the held servers among the markers at ``paths`` (a consumer's first step, so that all of its servers
    queue and start together); :func:`read_marker` then waits for each."""
    for path in paths:
        job = load_marker(path).get("held_job")
        if job:
            release(job)


def await_held_server(path: str | os.PathLike, *, poll_s: float = 2.0) -> dict[str, Any]:
    """Release the held server of the marker at ``path`` if it still is, wait until it answers (its supervisor
    rewrites the marker), and return the marker then. The queue's wait is bounded by the marker's
    ``queue_timeout_s`` (None: this job's own limit), the start-up by its ``startup_timeout_s``; a server that fails
    either, or ends before it answers, is cancelled and raises :class:`ServeError` with its log's last lines."""
    marker = load_marker(path)
    job, name = marker.get("held_job"), marker["served_model_name"]
    if marker.get("endpoint") or not job:
        return marker
    log = marker["log"]
    release(job)
    try:
        wait_until_running(
            job, lambda: job_status(job), queue_timeout_s=marker.get("queue_timeout_s"), grace_s=SlurmJob.GRACE_S
        )
    except ServeError:
        cancel(job)
        raise
    startup_s = marker["startup_timeout_s"]
    start = logged = time.monotonic()
    while True:
        current = load_marker(path)
        if current.get("endpoint"):
            logger.info("%s (Slurm job %s) answers at %s", name, job, current["endpoint"])
            return current
        state = job_state(job)
        if state is None or state not in {"RUNNING", *QUEUED_STATES}:
            raise ServeError(
                f"Slurm job {job} serving {name!r} ({path}) ended ({state or 'left the queue'}) before it answered; "
                f"last lines of {log}:\n{tail(Path(log), 30)}"
            )
        if time.monotonic() - start > startup_s:
            cancel(job)
            raise ServeError(
                f"Slurm job {job} serving {name!r} did not answer within serving.startup_timeout_s ({startup_s:.0f} s) "
                f"of starting; it is cancelled; see {log}"
            )
        if time.monotonic() - logged >= 60:
            logger.info(
                "waiting for %s (Slurm job %s, %s) to answer: %.0f s", name, job, state, time.monotonic() - start
            )
            logged = time.monotonic()
        time.sleep(poll_s)


def rewrite_marker(
    path: str | os.PathLike, *, endpoint: str, pid: int | None = None, api_key: str | None = None
) -> dict[str, Any]:
    """Point the marker at ``path`` at a restarted server's ``endpoint`` (call it after that server passed
    :func:`probe`); returns the new content.

    Keeps what the serve rule recorded (served name, model, engine, reconnect time, and the key unless ``api_key`` is
    given) and records the new address, host, process and check time. The write replaces the file atomically,
    so a client re-reading it sees the old address or the new one, never a partial file. Raises
    :class:`FileNotFoundError` when the marker is gone: its consumers are done, and nothing should point at the
    server any more.
    """
    old = load_marker(path)
    return write_marker(
        path,
        endpoint=endpoint,
        served_model_name=old["served_model_name"],
        pid=pid,
        model_path=old.get("model_path"),
        reconnect_timeout_s=old.get("reconnect_timeout_s"),
        api_key=api_key or old.get("api_key"),
        engine=old.get("engine"),
    )


def read_marker(path: str | os.PathLike, *, timeout_s: float = 10.0, **endpoint_options: Any) -> Endpoint:
    """The :class:`Endpoint` recorded in the marker at ``path``, after checking the server still serves it.

    A server held until its consumer starts is released and waited for first (:func:`await_held_server`). Probes
    ``GET /v1/models`` (cheap; no generation) and raises :class:`ServerGone` naming the marker,
    the URL and the fix when it fails. ``endpoint_options`` (``timeout_s``, ``max_retries``,
    ``api_key_env``) go to the returned :class:`Endpoint`, which keeps the marker's path (a client that
    loses the server re-reads the marker for its new address) and the server's key.
    """
    marker = await_held_server(path)
    base_url, name, key = marker["endpoint"], marker["served_model_name"], marker.get("api_key")
    try:
        probe_models(base_url, name, timeout_s=timeout_s, model_path=marker.get("model_path"), api_key=key)
    except ServerNotReady as exc:
        where = f"pid {marker['pid']}" if marker.get("pid") else f"Slurm job {marker.get('slurm_job_id')}"
        raise ServerGone(
            f"the server recorded in {path} at {base_url} is not answering ({exc}); it was started as "
            f"{where} on {marker.get('host')} and last health-checked at {marker.get('health_checked_at')}: "
            f"rerun the serve rule (e.g. snakemake --forcerun {path})"
        ) from exc
    endpoint_options.setdefault("marker", str(Path(path).resolve()))
    return Endpoint(base_url, name, api_key=key, **endpoint_options)
