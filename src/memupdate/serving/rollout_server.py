"""The vLLM server process of a verl rollout replica (rollout ``memupdate_vllm``,
:mod:`memupdate.verl_ext.external_vllm`): what it serves, how it starts, and its start before verl's.

- :func:`server_spec` reads what a replica serves from verl's rollout config (the model, the context, the
  serving settings the launcher wrote into ``rollout.custom.memupdate_vllm``), the same way in the launcher
  and in verl's Ray actor;
- :func:`start_server` starts the server's supervisor (``python -m memupdate.serving.launch run``) outside the
  caller's process tree, serving an untied copy of a tied model (:func:`served_folder`);
- :func:`prelaunched_servers`: the launcher starts every replica's server of a one-node run before verl, so
  vLLM's start-up (three processes each importing vllm, about 25 s on CPU) overlaps verl's own (Ray, the
  datasets, the workers: about 50 s); the replica's actor then adopts the running server
  (:func:`adopt_server`) instead of starting one. A server whose record does not match what the actor would
  serve is stopped and replaced, so the overlap never changes what is served.

Nothing here imports verl or Ray: the launcher's process runs this before verl starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import psutil

from memupdate.serving.launch import is_our_supervisor, stop_supervisor, supervisor_argv
from memupdate.serving.vllm_server import API_KEY_ENV, DEV_MODE_ENV
from memupdate.settings import EXTERNAL_ROLLOUT, ServeSettings, build
from memupdate.utils.io import config_positions, write_json_atomic

logger = logging.getLogger(__name__)

#: Where the rollout's settings are in verl's rollout config (``rollout.custom``, its free-form section).
SETTINGS_KEY = EXTERNAL_ROLLOUT
#: The name the served model answers to.
SERVED_NAME = "policy"
#: Safetensors weights and an untied copy of the model's config (see :func:`served_folder`).
WEIGHTS_FILE = "model.safetensors"
#: In a replica's weights folder: the record of a server started before verl (:func:`prelaunched_servers`).
PRELAUNCH_FILE = "server.prelaunch.json"
ADDRESS_FILE = "server.address.json"
LOG_FILE = "server.log"
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)


def _field(config: Any, key: str, default: Any = None) -> Any:
    # verl's actor holds a RolloutConfig dataclass; the launcher reads the resolved YAML, which leaves out
    # fields verl's YAML does not list (their dataclass default is ``default``).
    return config.get(key, default) if isinstance(config, Mapping) else getattr(config, key, default)


def rollout_settings(config: Any) -> tuple[ServeSettings, Path]:
    """``(serving settings, weights_dir)`` from a rollout config's ``custom.memupdate_vllm``."""
    custom = (_field(config, "custom") or {}).get(SETTINGS_KEY)
    if not custom or not custom.get("weights_dir"):
        raise ValueError(
            f"rollout.name={EXTERNAL_ROLLOUT} needs rollout.custom.{SETTINGS_KEY} with serving and weights_dir "
            "(the verl launcher writes them)"
        )
    serving = build(ServeSettings, dict(custom.get("serving") or {}), f"rollout.custom.{SETTINGS_KEY}.serving")
    return serving, Path(custom["weights_dir"])


@dataclasses.dataclass(frozen=True)
class ServerSpec:
    """What replica ``replica_rank``'s server serves and how (:func:`server_spec`)."""

    replica_rank: int
    model_path: Path
    weights_dir: Path
    max_model_len: int
    sleep_mode: bool
    serving: ServeSettings

    @property
    def address_file(self) -> Path:
        return self.weights_dir / ADDRESS_FILE

    @property
    def log_path(self) -> Path:
        return self.weights_dir / LOG_FILE

    def record(self) -> dict[str, Any]:
        """The spec as JSON values (what a prelaunched server is matched on)."""
        return json.loads(json.dumps(dataclasses.asdict(self), default=str))


def replica_size(config: Any) -> int:
    """Trainer ranks per rollout replica: tensor x data x pipeline parallel size (each 1 when unset)."""
    sizes = ("tensor_model_parallel_size", "data_parallel_size", "pipeline_model_parallel_size")
    size = 1
    for key in sizes:
        size *= int(_field(config, key) or 1)
    return size


def server_spec(config: Any, model_path: str | os.PathLike, replica_rank: int) -> ServerSpec:
    """Replica ``replica_rank``'s :class:`ServerSpec` from verl's rollout config: a whole episode of context
    (``max_model_len``, else prompt plus response length), no more than the model's positions reach (vLLM
    refuses a longer context); vLLM's sleep mode when the server shares its accelerator with the trainer."""
    serving, weights_root = rollout_settings(config)
    model_path = Path(model_path)
    max_model_len = int(
        _field(config, "max_model_len") or _field(config, "prompt_length") + _field(config, "response_length")
    )
    positions = config_positions(model_path)
    return ServerSpec(
        replica_rank=replica_rank,
        model_path=model_path,
        weights_dir=weights_root / f"replica{replica_rank}",
        max_model_len=min(max_model_len, int(positions or max_model_len)),
        # verl's RolloutConfig defaults for both: True.
        sleep_mode=bool(_field(config, "enable_sleep_mode", True) and _field(config, "free_cache_engine", True)),
        serving=serving,
    )


def served_folder(model_dir: str | os.PathLike, target: str | os.PathLike) -> Path:
    """``target``: a folder vLLM serves ``model_dir`` from, with an untied output layer when it was tied.

    vLLM's in-place reload keeps the old tensor of a layer the new checkpoint has no weights for, and a tied
    ``lm_head`` has none (it is the embedding): the server would go on scoring with the base model's output
    layer. Serving an untied copy (both tensors, ``tie_word_embeddings: false``) is the same model and
    reloads whole. A model without tied embeddings is served from where it is.
    """
    model_dir, target = Path(model_dir), Path(target)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    if not _tied(config):
        return model_dir
    from safetensors.torch import load_file

    state: dict[str, Any] = {}
    for part in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(part))
    if not state:
        raise FileNotFoundError(f"{model_dir} has no safetensors weights to serve")
    return write_weights(target, state, config, tokenizer_from=model_dir)


def _tied(config: Mapping[str, Any]) -> bool:
    text = config.get("text_config") or {}
    return bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


def _embedding_name(names: Iterable[str]) -> str | None:
    return next((n for n in names if n.endswith("embed_tokens.weight")), None)


def write_weights(
    target: Path, state: dict[str, Any], config: Mapping[str, Any], *, tokenizer_from: Path | None = None
) -> Path:
    """Write ``state`` (HF names) and ``config`` with its output layer untied into ``target``, atomically."""
    from safetensors.torch import save_file

    config = dict(config)
    if _tied(config):
        embedding = _embedding_name(state)
        if "lm_head.weight" not in state and embedding is not None:
            state["lm_head.weight"] = state[embedding]
        config["tie_word_embeddings"] = False
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # safetensors refuses tensors that share memory; each gets its own contiguous copy.
    save_file({k: v.detach().to("cpu").clone().contiguous() for k, v in state.items()}, tmp / WEIGHTS_FILE)
    (tmp / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    for name in _TOKENIZER_FILES if tokenizer_from is not None else ():
        if (tokenizer_from / name).is_file():
            shutil.copy2(tokenizer_from / name, tmp / name)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


#: Starts argv[2:] in a session of its own, output to argv[1], prints its pid and exits: the started process
#: is then nobody's child (Ray kills a worker's children when the worker exits, at the end of every run; that
#: would kill the supervisor and orphan vLLM, whose engine lives in a session of its own).
_DETACH = (
    "import subprocess, sys\n"
    "with open(sys.argv[1], 'w') as log:\n"
    "    child = subprocess.Popen(sys.argv[2:], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,"
    " start_new_session=True)\n"
    "print(child.pid)"
)


class Detached:
    """A supervisor this process did not start, polled as a ``Popen`` is (what ``wait_until_ready`` watches)."""

    returncode = None

    def __init__(self, pid: int):
        self.pid = pid
        self.process = psutil.Process(pid)

    def poll(self) -> int | None:
        try:
            running = self.process.is_running() and self.process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            running = False
        return None if running else -1


def start_server(spec: ServerSpec, *, watch_pid: int, env: Mapping[str, str] | None = None) -> Detached:
    """Start ``spec``'s server under the project's supervisor, which stops vLLM when ``watch_pid`` ends; returns
    the supervisor. The address appears in ``spec.address_file`` once vLLM is started (not yet ready). The server
    has this process's environment with ``env`` over it (the run's, where the launcher starts it before verl)."""
    if not spec.serving.python:
        raise ValueError(
            f"rollout.custom.{SETTINGS_KEY}.serving.python is not set: the launcher resolves the vLLM interpreter"
        )
    spec.weights_dir.mkdir(parents=True, exist_ok=True)
    served = served_folder(spec.model_path, spec.weights_dir / "base")
    spec.address_file.unlink(missing_ok=True)
    settings = dataclasses.replace(spec.serving, max_model_len=spec.max_model_len)
    if spec.sleep_mode:
        settings.extra_args = [*settings.extra_args, "--enable-sleep-mode"]
    argv = supervisor_argv(
        served,
        SERVED_NAME,
        spec.address_file,
        settings,
        settings.python,
        bind_host="127.0.0.1",
        watch_pid=watch_pid,
    )
    started = subprocess.run(
        [sys.executable, "-c", _DETACH, str(spec.log_path), *argv],
        # No key given: the supervisor makes the server's own and records it in the address file for the actor.
        env={
            **{k: v for k, v in os.environ.items() if k != API_KEY_ENV},
            **(env or {}),
            **settings.env,
            **DEV_MODE_ENV,
        },
        capture_output=True,
        text=True,
        check=True,
    )
    return Detached(int(started.stdout))


def adopt_server(spec: ServerSpec) -> Detached | None:
    """The supervisor of a server started for ``spec`` before verl (:func:`prelaunched_servers`), or None: none
    was, it has ended, or it serves something else (then it is stopped, with a warning)."""
    path = spec.weights_dir / PRELAUNCH_FILE
    if not path.is_file():
        return None
    record = json.loads(path.read_text(encoding="utf-8"))
    pid = int(record["supervisor_pid"])
    if not is_our_supervisor(pid):
        return None
    if record.get("spec") != spec.record():
        logger.warning(
            "the server started before verl for replica %d (%s) is not what the replica serves: stopping it and "
            "starting another\nstarted: %s\nwanted: %s",
            spec.replica_rank,
            path,
            record.get("spec"),
            spec.record(),
        )
        stop_supervisor(pid)
        path.unlink(missing_ok=True)
        return None
    logger.info(
        "rollout replica %d: adopting the server started before verl (supervisor pid %d)", spec.replica_rank, pid
    )
    write_json_atomic(path, {**record, "adopted_by": os.getpid()})
    return Detached(pid)


def prelaunch_specs(resolved_config: Mapping[str, Any]) -> list[ServerSpec]:
    """The servers a run can start before verl does (:func:`prelaunched_servers`): every replica's, when the run's
    rollout is :data:`~memupdate.settings.EXTERNAL_ROLLOUT`, on one node (this one), without vLLM's sleep mode
    (a server sharing an accelerator with the trainer starts after it); else none."""
    trainer = resolved_config.get("trainer") or {}
    rollout = ((resolved_config.get("actor_rollout_ref") or {}).get("rollout")) or {}
    model = ((resolved_config.get("actor_rollout_ref") or {}).get("model")) or {}
    if rollout.get("name") != EXTERNAL_ROLLOUT or int(trainer.get("nnodes") or 1) != 1:
        return []
    replicas = max(1, int(trainer.get("n_gpus_per_node") or 1) // replica_size(rollout))
    specs = [server_spec(rollout, model["path"], rank) for rank in range(replicas)]
    return [] if any(spec.sleep_mode for spec in specs) else specs


@contextlib.contextmanager
def prelaunched_servers(
    resolved_config: Mapping[str, Any], env: Mapping[str, str] | None = None
) -> Iterator[list[ServerSpec]]:
    """Start the servers of :func:`prelaunch_specs` for the duration of the block (verl's run), each recorded in
    its replica's :data:`PRELAUNCH_FILE` for verl's actor to adopt (:func:`adopt_server` notes it there); stopped
    when the block ends, saying whether verl used them (and by their supervisor should this process die). They get
    ``env``, the environment verl's run gets (:func:`start_server`). A
    server that fails to start here is left to verl's actor, which starts its own and reports what went wrong."""
    started: list[tuple[ServerSpec, int]] = []
    try:
        for spec in prelaunch_specs(resolved_config):
            (spec.weights_dir / PRELAUNCH_FILE).unlink(missing_ok=True)
            try:
                supervisor = start_server(spec, watch_pid=os.getpid(), env=env)
            except (OSError, ValueError, subprocess.CalledProcessError) as err:
                logger.warning(
                    "could not start replica %d's server before verl (%s): verl's actor starts it",
                    spec.replica_rank,
                    err,
                )
                continue
            started.append((spec, supervisor.pid))
            write_json_atomic(
                spec.weights_dir / PRELAUNCH_FILE, {"supervisor_pid": supervisor.pid, "spec": spec.record()}
            )
            logger.info(
                "started replica %d's rollout server before verl (supervisor pid %d)", spec.replica_rank, supervisor.pid
            )
        yield [spec for spec, _ in started]
    finally:
        for spec, pid in started:
            path = spec.weights_dir / PRELAUNCH_FILE
            if path.is_file() and json.loads(path.read_text(encoding="utf-8")).get("adopted_by"):
                logger.info("replica %d's rollout server, started before verl, served the run", spec.replica_rank)
            else:
                logger.warning(
                    "replica %d's rollout server, started before verl, was not adopted by verl's actor (%s): "
                    "the start-ups did not overlap",
                    spec.replica_rank,
                    "the run ended before it got that far" if path.is_file() else "it served something else",
                )
            stop_supervisor(pid)
            path.unlink(missing_ok=True)
