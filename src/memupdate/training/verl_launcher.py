"""Launcher of the ``verl`` training backend: ``python -m verl.trainer.main_ppo`` on GPU nodes.

``verl_config/grpo_memupdate.yaml`` (shipped with the package, beside this module) is a hydra delta over verl's packaged ``ppo_trainer``; this module adds
what changes per run as hydra overrides (:func:`compose_overrides`), builds the command and the
environment the memory tools read (:func:`build_main_ppo_command`), and checks everything before a job
is submitted (:func:`validate_overrides`): the overrides are composed with hydra's compose API exactly as
``main_ppo`` composes them, so a misspelt key fails here with the key's name, and the rollout and actor
sections are converted to verl's dataclasses, so a wrong value fails too. :func:`prepare_main_ppo` does
all of it and writes the run's files.

Per run, under ``experiment_dir``:

- ``resolved_config.yaml``: the composed, resolved verl config the run uses, but for its record
  (``memupdate_run``: git commit, data sha256s), which verl hands to the trackers as part of the config;
- ``run_info.json``: that record and the config digest, the sha256 of ``resolved_config.yaml``
  (:mod:`memupdate.training.tracking`);
- ``tensorboard/`` (verl's tensorboard backend of ``trainer.logger``; ``tracking.jsonl`` for ``file``);
- ``agent_loops.yaml``: the run's agent loop with its ``trained_role``, ``fixed_model`` and episode settings,
  translated as the in-process runs' (:mod:`memupdate.rollout.loops`; verl passes an agent-loop entry's keys to
  the loop's constructor);
- ``checkpoints/`` (verl's ``trainer.default_local_dir``), ``validation/`` (validation generations),
  ``hydra/`` (main_ppo's hydra output).

A trained role is an override set, not a config file: ``memory`` trains the memory role (two-stage stage 1,
or single-stage MemoryUpdate), ``qa`` trains the QA role while the stage-1 model is served as the fixed
memory model (stage 2). Only the agent loop's arguments differ between them.

The memory tools and the reward manager read the run's ``memory_environment.json``
(:class:`~memupdate.memory.environment.MemoryEnvironment`: memories, embedding cache and model, content
cap), written into the run folder on the shared file system: the tools through the run's ``tools.yaml``
(``multi_turn.tool_config_path``), the reward manager through its ``memory_environment`` setting. verl's
tracking backends read their folders from environment variables (``TENSORBOARD_DIR``,
``VERL_FILE_LOGGER_PATH``: :func:`tracking_env`), forwarded to every Ray worker through
``ray_kwargs.ray_init.runtime_env.env_vars`` (``main_ppo`` merges it over ``get_ppo_ray_runtime_env()``),
so they write into the run.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir, initialize_config_module
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from memupdate.memory.environment import FILE_NAME as MEMORY_ENVIRONMENT_FILE
from memupdate.memory.environment import MemoryEnvironment
from memupdate.names import MEMAGENT_AGENT, MEMORY_AGENT
from memupdate.rollout.loops import agent_loop_entry, memory_loop_arguments
from memupdate.serving.vllm_server import API_KEY_ENV, new_api_key
from memupdate.settings import (
    EXTERNAL_ROLLOUT,
    ROLES,
    VERL_BASE_CONFIG,
    VERL_CONFIG_DIR,
    VERL_CPU_CONFIG,
    EpisodeSettings,
    MemAgentLoopSettings,
    build,
    episode_overrides,
    verl_refusals,
)
from memupdate.tools.config import FILE_NAME as TOOLS_FILE
from memupdate.tools.config import write_tool_config
from memupdate.training.tracking import (
    TENSORBOARD_DIR,
    TRACKING_FILE,
    VALIDATION_DIR,
    experiment_name,
    run_info,
    run_record,
    write_run_info,
)
from memupdate.utils.io import sha256_file, write_text_atomic

logger = logging.getLogger(__name__)

#: The hydra deltas over verl's trainer config: package data, so the launcher
#: works from an installed package as from a checkout.
CONFIG_DIR = VERL_CONFIG_DIR
CONFIG_NAME = VERL_BASE_CONFIG["memupdate"]
#: What a run on CPU nodes changes (``trainer.device: cpu``): flat verl keys, listed in docs/verl-on-cpu.md.
CPU_CONFIG = f"{VERL_CPU_CONFIG}.yaml"
#: verl's platform selector, in the driver's and every Ray worker's environment for ``trainer.device: cpu``.
CPU_ENV = {"VERL_PLATFORM": "cpu"}
#: verl's main_ppo, through our entry point (its task runner in the driver on CPU runs).
MAIN_PPO_MODULE = "memupdate.verl_ext.main_ppo"
#: The actor's token budget per micro-batch (the log-prob passes follow it): on CPU, one row's padded width.
CPU_MICRO_BATCH_TOKENS = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
#: Its settings in the rollout config (memupdate.verl_ext.external_vllm reads them there).
EXTERNAL_ROLLOUT_SETTINGS = "actor_rollout_ref.rollout.custom"
#: The serving settings the external rollout's server and its client take (the rest are about serving rules' jobs;
#: ``env`` reaches the server through the run's environment, never the command line).
_ROLLOUT_SERVER_KEYS = ("engine", "python", "dtype", "startup_timeout_s", "extra_args", "max_in_flight")

# Files and folders of one run, under experiment_dir.
RESOLVED_CONFIG = "resolved_config.yaml"
AGENT_LOOPS_FILE = "agent_loops.yaml"
CHECKPOINT_DIR = "checkpoints"
HYDRA_DIR = "hydra"
#: Top-level key of the run's record (commit, data sha256s) in the config verl gives its trackers.
RUN_RECORD = "memupdate_run"

# Where our reward manager (memupdate_memory) reads its settings; see verl_config/grpo_memupdate.yaml.
REWARD_KWARGS = "reward.custom_reward_function.reward_kwargs"
# main_ppo merges this over verl's own runtime_env, so these variables reach every Ray worker.
RAY_ENV_VARS = "ray_kwargs.ray_init.runtime_env.env_vars"

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_KEY = re.compile(r"^[A-Za-z_][\w-]*$")
_HYDRA_BAD_KEY = re.compile(r"Could not override '([^']+)'")

PathLike = str | os.PathLike


class ConfigValidationError(ValueError):
    """The overrides do not compose into a config verl accepts; the message names the key or section."""


# ----------------------------------------------------------------------------------- overrides


def hydra_value(value: Any) -> str:
    """``value`` in hydra's override grammar: strings are always quoted, so a path, a URL or a model
    name never turns into a number, a bool or null.

    >>> hydra_value("it's")
    "'it\\\\'s'"
    >>> hydra_value({"base_url": "http://h:8000/v1", "top_k": 5, "judge": None})
    "{base_url:'http://h:8000/v1',top_k:5,judge:null}"
    >>> hydra_value([1e-06, True])
    '[1e-06,true]'
    """
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str | os.PathLike):
        text = os.fspath(value)
        # In a quoted hydra string a backslash is literal unless it (or a run of them) precedes a
        # quote or the closing quote, where each must be doubled; the quote itself is escaped.
        text = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, text)
        return "'" + text.replace("'", "\\'") + "'"
    if isinstance(value, Mapping):
        for key in value:
            if not isinstance(key, str) or not _KEY.match(key):
                raise ValueError(f"cannot write the mapping key {key!r} as a hydra override")
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, Sequence):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as a hydra override")


def _flatten(prefix: str, mapping: Mapping[str, Any]) -> list[tuple[str, Any]]:
    items = []
    for key, value in mapping.items():
        if isinstance(value, Mapping) and value:
            items += _flatten(f"{prefix}.{key}", value)
        else:
            items.append((f"{prefix}.{key}", value))
    return items


def _abs(path: PathLike) -> str:
    return os.path.abspath(os.path.expanduser(os.fspath(path)))


def _model_path(model_path: PathLike) -> str:
    """A local checkpoint becomes absolute (Ray workers run elsewhere); a hub id ``org/name`` that
    is not a local folder stays as it is."""
    text = os.fspath(model_path)
    if not os.path.exists(text) and _HUB_ID.match(text):
        logger.info("model %s is not a local path: verl will load it from the Hugging Face hub", text)
        return text
    return _abs(text)


def _files(files: PathLike | Sequence[PathLike]) -> list[str]:
    if isinstance(files, str | os.PathLike):
        return [_abs(files)]
    return [_abs(f) for f in files]


def _fixed_model(role: str, endpoint: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if role not in ROLES:
        raise ValueError(f"unknown training role {role!r}; expected one of {', '.join(ROLES)}")
    if role == "qa" and endpoint is None:
        raise ValueError(
            "role 'qa' trains the QA role against a served memory model: pass fixed_model_endpoint "
            "{base_url, model} (the stage-1 model's readiness marker)"
        )
    if endpoint is None:
        return None
    missing = [k for k in ("base_url", "model") if not endpoint.get(k)]
    if missing:
        raise ValueError(f"fixed_model_endpoint lacks {missing}: it needs base_url and model, got {dict(endpoint)}")
    return dict(endpoint)


def tracking_env(experiment_dir: PathLike) -> dict[str, str]:
    """Where verl's tensorboard and file tracking backends write: inside the run (they read these variables,
    and otherwise write into the working directory of the Ray worker that runs the trainer)."""
    run_dir = Path(_abs(experiment_dir))
    return {"TENSORBOARD_DIR": str(run_dir / TENSORBOARD_DIR), "VERL_FILE_LOGGER_PATH": str(run_dir / TRACKING_FILE)}


def _setting(extra: Mapping[str, Any] | Sequence[str], key: str) -> Any:
    """The value ``extra`` gives ``key`` (None if it does not), from a mapping or override strings."""
    if isinstance(extra, Mapping):
        return extra.get(key)
    for override in extra:
        name, _, value = override.partition("=")
        if name.lstrip("+") == key:
            return value.strip("'\"")
    return None


def run_device(extra: Mapping[str, Any] | Sequence[str]) -> str:
    """``trainer.device`` of a run: ``cpu`` selects verl's cpu platform (:data:`CPU_CONFIG`), else ``cuda``."""
    return str(_setting(extra, "trainer.device") or "cuda")


def run_env(
    experiment_dir: PathLike,
    extra: Mapping[str, Any] | Sequence[str] = (),
    rollout_server: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """The environment ``main_ppo`` runs with: the trackers' folders, verl's platform on CPU, and the rollout
    server's ``serving.env`` with the :data:`EXTERNAL_ROLLOUT` rollout (its values, a token say, reach the server
    through the environment the Ray workers inherit, never through the command line).

    With verl's own rollout (GPU runs), a fresh ``VLLM_API_KEY`` that no client is given: verl's vLLM servers
    answer HTTP on their node's address (``vllm_async_server.py``, ``build_app``), and vLLM's ``build_app`` takes
    the key from the environment the Ray workers inherit, so their ``/v1`` refuses every client on the cluster's
    network. verl itself reaches them through Ray, not HTTP."""
    if uses_external_rollout(extra):
        server_env = dict((rollout_server or {}).get("env") or {})
    else:
        server_env = {API_KEY_ENV: new_api_key()}
    return {**server_env, **tracking_env(experiment_dir), **(CPU_ENV if run_device(extra) == "cpu" else {})}


def uses_external_rollout(extra: Mapping[str, Any] | Sequence[str]) -> bool:
    """Whether the run's rollout is :data:`EXTERNAL_ROLLOUT` (set, or the CPU default)."""
    name = _setting(extra, "actor_rollout_ref.rollout.name")
    return name == EXTERNAL_ROLLOUT or (name is None and run_device(extra) == "cpu")


def device_overrides(
    extra: Mapping[str, Any] | Sequence[str],
    experiment_dir: PathLike,
    rollout_server: Mapping[str, Any] | None,
    config_dir: PathLike = CONFIG_DIR,
    row_tokens: int | None = None,
) -> list[str]:
    """What the device and the rollout add: on CPU the keys of :data:`CPU_CONFIG`, a micro-batch of one row
    (``row_tokens``, a row's padded width: prompt + response length, where the caller knows it) and verl's
    platform in every Ray worker; with the :data:`EXTERNAL_ROLLOUT` rollout, its server's settings
    (``rollout_server``: the ``serving`` keys with the vLLM interpreter resolved) and where the weights go
    (``<run>/rollout``).

    >>> [o for o in device_overrides({"trainer.device": "cpu"}, "/run", {"python": "/v/bin/python"}, row_tokens=2048)
    ...  if "ppo_max_token_len" in o or "gradient_checkpointing" in o]
    ['actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048', 'actor_rollout_ref.model.enable_gradient_checkpointing=false']
    """
    overrides: list[str] = []
    cpu = run_device(extra) == "cpu"
    if cpu:
        values = OmegaConf.to_container(OmegaConf.load(Path(config_dir) / CPU_CONFIG))
        if row_tokens is not None:
            # Each row its own micro-batch, unpadded (memupdate bench update: without gradient checkpointing, an
            # update of SmolLM2 on one row per micro-batch is the fastest and holds half the memory of four rows
            # padded to the longest). verl refuses a budget below the padded width.
            values[CPU_MICRO_BATCH_TOKENS] = int(row_tokens)
        overrides += [f"{key}={hydra_value(value)}" for key, value in values.items()]
        overrides += [f"++{RAY_ENV_VARS}.{name}={hydra_value(value)}" for name, value in CPU_ENV.items()]
    if uses_external_rollout(extra):
        if rollout_server is None:
            raise ValueError(
                f"rollout {EXTERNAL_ROLLOUT} serves the policy from a vLLM server: pass rollout_server (the serving "
                "settings, with python the vLLM interpreter)"
            )
        serving = {key: rollout_server[key] for key in _ROLLOUT_SERVER_KEYS if key in rollout_server}
        if not serving.get("python"):
            raise ValueError(f"rollout {EXTERNAL_ROLLOUT}: rollout_server.python (the vLLM interpreter) is not set")
        custom = {EXTERNAL_ROLLOUT: {"serving": serving, "weights_dir": _abs(Path(experiment_dir) / "rollout")}}
        # A field of verl's RolloutConfig its YAML leaves out: added (++).
        overrides.append(f"++{EXTERNAL_ROLLOUT_SETTINGS}={hydra_value(custom)}")
    return overrides


def run_overrides(
    model_path: PathLike,
    train_files: PathLike | Sequence[PathLike],
    val_files: PathLike | Sequence[PathLike],
    n_gpus_per_node: int,
    nnodes: int,
    experiment_dir: PathLike,
    data: Mapping[str, PathLike | None] | None = None,
) -> list[str]:
    """The overrides every run has: model, data, layout, and where the run's files go (all absolute, since
    Ray workers on other nodes do not share the driver's working directory); the trackers' folders; and
    the run's record (:func:`memupdate.training.tracking.run_record` of the train files and ``data``), which
    verl's trackers get with the config."""
    run_dir = Path(_abs(experiment_dir))
    data = {"train_files": _files(train_files), **{k: _abs(v) if v else None for k, v in (data or {}).items()}}
    overrides = [
        f"actor_rollout_ref.model.path={hydra_value(_model_path(model_path))}",
        f"data.train_files={hydra_value(_files(train_files))}",
        f"data.val_files={hydra_value(_files(val_files))}",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={hydra_value(run_dir / AGENT_LOOPS_FILE)}",
        f"trainer.n_gpus_per_node={int(n_gpus_per_node)}",
        f"trainer.nnodes={int(nnodes)}",
        # "<experiment>-<stage dir>": tells runs apart in trackers and rollout traces.
        f"trainer.experiment_name={hydra_value(experiment_name(run_dir))}",
        f"trainer.default_local_dir={hydra_value(run_dir / CHECKPOINT_DIR)}",
        f"trainer.validation_data_dir={hydra_value(run_dir / VALIDATION_DIR)}",
        # main_ppo is a @hydra.main app; without this it writes outputs/<date>/ into the working dir.
        f"hydra.run.dir={hydra_value(run_dir / HYDRA_DIR)}",
        # Not a verl key: added, and given to the trackers with the rest of the config.
        f"++{RUN_RECORD}={hydra_value(run_record(data))}",
    ]
    return overrides + [
        f"++{RAY_ENV_VARS}.{name}={hydra_value(value)}" for name, value in tracking_env(run_dir).items()
    ]


def _extra_overrides(extra: Mapping[str, Any] | Sequence[str]) -> list[str]:
    """The stage settings as overrides. A ``trainer.logger`` without ``file`` is refused: the run's metrics.jsonl
    (the report's training curves, a DVC out) is made from that backend's log. Settings that give
    ``trainer.total_training_steps`` without ``trainer.total_epochs`` get as many epochs as steps: verl stops at
    whichever cap comes first, and the base configs' epochs (10 in grpo_memupdate.yaml) would end a 300-step stage
    of our split's 27 steps an epoch at step 270, unsaved; an epoch holds at least one step, so this cap never
    binds.

    >>> _extra_overrides({"trainer.total_training_steps": 300})
    ['trainer.total_training_steps=300', 'trainer.total_epochs=300']
    """
    if not isinstance(extra, Mapping):
        return list(extra)
    logger_setting = extra.get("trainer.logger")
    if logger_setting is not None and "file" not in logger_setting:
        raise ValueError(
            f"trainer.logger {list(logger_setting)}: trainer.logger must include file (the run's metrics.jsonl "
            "is made from it); add it beside your trackers"
        )
    overrides = [f"{key}={hydra_value(value)}" for key, value in extra.items()]
    steps = extra.get("trainer.total_training_steps")
    if steps is not None and "trainer.total_epochs" not in extra:
        overrides.append(f"trainer.total_epochs={int(steps)}")
    return overrides


def unreachable_steps(config: DictConfig, rows: int) -> str | None:
    """Why a composed run would stop before ``trainer.total_training_steps`` on ``rows`` training rows (verl 0.9.1
    stops at ``total_epochs`` epochs of ``rows // data.train_batch_size`` steps, ``data.train_max_samples`` rows at
    most, with no final save or validation), or None.

    >>> config = OmegaConf.create({"trainer": {"total_training_steps": 300, "total_epochs": 10},
    ...                            "data": {"train_batch_size": 32, "train_max_samples": -1}})
    >>> unreachable_steps(config, 885)
    'trainer.total_training_steps is 300, but verl stops after 270: 10 epochs (trainer.total_epochs) of 27 steps (885 training rows // data.train_batch_size 32); raise trainer.total_epochs to at least 12, or leave it unset (it then follows the steps)'
    >>> unreachable_steps(config, 1024) is None
    True
    """
    steps = config.trainer.get("total_training_steps")
    if steps is None:
        return None
    cap = config.data.get("train_max_samples")
    used = min(rows, cap) if cap is not None and cap > 0 else rows
    per_epoch = used // config.data.train_batch_size
    if per_epoch == 0:
        return (
            f"{used} training rows make no step of data.train_batch_size {config.data.train_batch_size}: "
            "verl would train nothing"
        )
    epochs = config.trainer.total_epochs
    if steps <= per_epoch * epochs:
        return None
    return (
        f"trainer.total_training_steps is {steps}, but verl stops after {per_epoch * epochs}: {epochs} epochs "
        f"(trainer.total_epochs) of {per_epoch} steps ({used} training rows // data.train_batch_size "
        f"{config.data.train_batch_size}); raise trainer.total_epochs to at least {math.ceil(steps / per_epoch)}, "
        "or leave it unset (it then follows the steps)"
    )


def refuse_unreachable_steps(config: Mapping[str, Any]) -> None:
    """Raise :class:`ConfigValidationError` where a resolved run's training files (``data.train_files``) hold too
    few rows for its steps (:func:`unreachable_steps`): checked by the job, once the rows exist."""
    import pyarrow.parquet as pq

    files = config["data"]["train_files"]
    files = [files] if isinstance(files, str) else list(files)
    rows = sum(pq.read_metadata(path).num_rows for path in files)
    problem = unreachable_steps(OmegaConf.create(dict(config)), rows)
    if problem:
        raise ConfigValidationError(f"{', '.join(files)}: {problem}")


@dataclass(frozen=True, kw_only=True)
class VerlRun:
    """What every ``main_ppo`` run is given: its starting model, rows, layout and folder, the experiment's verl keys and
    its own rollout server's settings."""

    model_path: PathLike
    train_files: PathLike | Sequence[PathLike]
    val_files: PathLike | Sequence[PathLike]
    n_gpus_per_node: int
    nnodes: int
    experiment_dir: PathLike
    #: The experiment's verl keys: a mapping of config keys to values, or override strings.
    extra: Mapping[str, Any] | Sequence[str] = ()
    #: The serving settings of the run's own vLLM rollout server (``memupdate_vllm``).
    rollout_server: Mapping[str, Any] | None = None


@dataclass(frozen=True, kw_only=True)
class MainPPORun(VerlRun):
    """One ``main_ppo`` run of a MemoryUpdate stage, as :func:`compose_overrides` turns it into hydra overrides and
    :func:`prepare_main_ppo` into the run's files (:func:`memupdate.training.stages.verl_commands` makes one)."""

    tool_config: PathLike
    memory: MemoryEnvironment
    #: The served model playing the role that is not trained, ``{base_url, model, ...}``.
    fixed_model_endpoint: Mapping[str, Any] | None = None
    #: Our reward manager's settings (:func:`memupdate.training.stages.stage_reward`).
    reward: Mapping[str, Any] | None = None
    #: The experiment's episode (:class:`~memupdate.settings.EpisodeSettings`).
    episode: Mapping[str, Any] | None = None


def compose_overrides(role: str, run: MainPPORun) -> list[str]:
    """Hydra overrides for ``main_ppo --config-name grpo_memupdate`` for one ``run``.

    ``role`` is a training role (``memory`` or ``qa``); it and ``fixed_model_endpoint``
    go into the run's ``agent_loops.yaml``, ``memory`` into its ``memory_environment.json`` and ``tool_config``'s
    tools into its ``tools.yaml`` (all written by :func:`prepare_main_ppo`). ``reward`` holds our
    reward manager's settings (:func:`memupdate.training.stages.stage_reward`: scorer, the served scorers'
    readiness markers, top_k, other_questions, efficiency, ...); they reach the manager in every reward
    worker as ``reward.custom_reward_function.reward_kwargs``, and the QA phase's retrieval and prompt
    (:data:`~memupdate.settings.QA_PHASE_KEYS`) reach the agent loop through ``agent_loops.yaml``. ``episode`` is the experiment's (:class:`~memupdate.settings.EpisodeSettings`, on verl's keys:
    :func:`~memupdate.settings.episode_overrides`). ``extra`` is either a mapping of config keys to values, or override strings passed
    as they are (e.g. ``"trainer.total_epochs=1"``); :func:`device_overrides` come before it (with
    ``rollout_server`` for the external vLLM rollout). Every path becomes absolute, since Ray workers on
    other nodes do not share the driver's working directory.
    """
    n_gpus_per_node, nnodes, extra, memory = run.n_gpus_per_node, run.nnodes, run.extra, run.memory
    _fixed_model(role, run.fixed_model_endpoint)
    if n_gpus_per_node < 1 or nnodes < 1:
        raise ValueError(f"need n_gpus_per_node >= 1 and nnodes >= 1, got {n_gpus_per_node}, {nnodes}")
    data = {"memories": memory.memories, "embeddings": memory.embeddings}
    overrides = run_overrides(
        run.model_path, run.train_files, run.val_files, n_gpus_per_node, nnodes, run.experiment_dir, data
    )
    run_dir = Path(_abs(run.experiment_dir))
    overrides.append(f"actor_rollout_ref.rollout.multi_turn.tool_config_path={hydra_value(run_dir / TOOLS_FILE)}")
    # The reward settings are our manager's own namespace, not verl's schema, so they are added or
    # replaced (++) leaf by leaf; the manager rejects an unknown setting when it starts. The served
    # scorers' readiness markers are read by reward workers on every node: absolute paths.
    reward = {k: _abs(v) if k.endswith("_marker") and v else v for k, v in (run.reward or {}).items()}
    reward["memory_environment"] = str(run_dir / MEMORY_ENVIRONMENT_FILE)
    overrides += [f"++{key}={hydra_value(value)}" for key, value in _flatten(REWARD_KWARGS, reward)]
    lengths = episode_overrides(run.episode)
    overrides += [f"{key}={hydra_value(value)}" for key, value in lengths.items()]
    row_tokens = lengths["data.max_prompt_length"] + lengths["data.max_response_length"]
    overrides += device_overrides(extra, run_dir, run.rollout_server, row_tokens=row_tokens)
    return overrides + _extra_overrides(extra)


def main_ppo_argv(
    overrides: Sequence[str],
    *,
    python: str = sys.executable,
    config_dir: PathLike = CONFIG_DIR,
    config_name: str = CONFIG_NAME,
) -> list[str]:
    return [
        python,
        "-m",
        MAIN_PPO_MODULE,
        "--config-path",
        _abs(config_dir),
        "--config-name",
        config_name,
        *overrides,
    ]


def build_main_ppo_command(
    role: str, run: MainPPORun, *, python: str = sys.executable, config_dir: PathLike = CONFIG_DIR
) -> tuple[list[str], dict[str, str]]:
    """``(argv, env)`` for one run, writing nothing (:func:`prepare_main_ppo` writes the run's files too).

    ``env`` holds the trackers' folders and the platform (:func:`run_env`): run ``argv`` with
    ``{**os.environ, **env}``.
    """
    argv = main_ppo_argv(compose_overrides(role, run), python=python, config_dir=config_dir)
    return argv, run_env(run.experiment_dir, run.extra, run.rollout_server)


# ---------------------------------------------------------------------------------- validation


def _compose(config_dir: PathLike, config_name: str, overrides: Sequence[str]) -> DictConfig:
    with initialize_config_dir(config_dir=_abs(config_dir), version_base=None):
        return compose(config_name=config_name, overrides=list(overrides))


def _leaf_keys(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, DictConfig) and len(node):
        return [k for key, child in node.items_ex(resolve=False) for k in _leaf_keys(child, f"{prefix}{key}.")]
    return [prefix.rstrip(".")]


def _defines(config: DictConfig, key: str) -> bool:
    # keys(), not `in`: a DictConfig hides keys whose value is still ??? (e.g. rollout.name) from `in`.
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(config, parent) if parent else config
    return isinstance(node, DictConfig) and leaf in node.keys()


def _check_delta(config_dir: PathLike, config_name: str) -> None:
    """Every key the delta file sets must exist in verl's ``ppo_trainer``: hydra lets a primary config
    add keys, so a misspelt key in the file itself would otherwise be silently ignored by verl."""
    path = Path(config_dir) / f"{config_name}.yaml"
    delta = OmegaConf.load(path)
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        base = compose(config_name="ppo_trainer")
    unknown = [
        key
        for key in _leaf_keys(delta)
        if key.split(".")[0] not in ("defaults", "hydra")
        and not key.startswith(REWARD_KWARGS + ".")
        and not _defines(base, key)
    ]
    if unknown:
        raise ConfigValidationError(f"{path} sets keys verl's ppo_trainer does not define: {', '.join(unknown)}")


def _unknown_key_hint(config_dir: PathLike, config_name: str, key: str) -> str:
    """If ``key`` is not in the config (without overrides), say so with the closest sibling keys."""
    parent, _, leaf = key.rpartition(".")
    base = _compose(config_dir, config_name, [])
    siblings = OmegaConf.select(base, parent) if parent else base
    if not isinstance(siblings, DictConfig) or _defines(base, key):
        return ""
    matches = difflib.get_close_matches(leaf, [str(k) for k in siblings.keys()], n=3)
    prefix = f"{parent}." if parent else ""
    suggestion = f"; did you mean {' or '.join(prefix + m for m in matches)}?" if matches else ""
    return f" (verl defines no such key{suggestion})"


def _to_dataclass(config: DictConfig, section: str) -> Any:
    from verl.utils.config import omega_conf_to_dataclass

    node = OmegaConf.select(config, section)
    try:
        return omega_conf_to_dataclass(node)
    except Exception as err:  # any failure of verl's own checks means main_ppo would fail the same way
        target = node.get("_target_", "its dataclass") if isinstance(node, DictConfig) else "its dataclass"
        raise ConfigValidationError(f"{section} does not convert to verl's {target}: {err}") from err


def validate_overrides(config_dir: PathLike, config_name: str, overrides: Sequence[str]) -> DictConfig:
    """Compose ``config_name`` from ``config_dir`` with ``overrides`` as ``main_ppo`` does, then run
    verl's own checks; return the composed config or raise :class:`ConfigValidationError`.

    Hydra's struct mode rejects an override of a key verl does not define (prefix it with ``+`` to add
    one on purpose), and every key the delta file itself sets must exist in verl's config. The rollout
    and actor sections are converted to verl's dataclasses (which reject e.g. ``rollout.mode=sync``),
    and ``verl.utils.config.validate_config`` checks batch sizes against the GPU count as main_ppo does
    before starting Ray. verl is imported here, not at module import, because it pulls in torch.
    """
    _check_delta(config_dir, config_name)
    try:
        config = _compose(config_dir, config_name, overrides)
    except (HydraException, OmegaConfBaseException) as err:
        bad = _HYDRA_BAD_KEY.search(str(err))
        hint = _unknown_key_hint(config_dir, config_name, bad.group(1)) if bad else ""
        if hint:
            message = f"key '{bad.group(1)}'{hint}; a key verl does not define needs a '+' prefix"
        else:
            message = f"key '{bad.group(1)}'" if bad else "the overrides"
        raise ConfigValidationError(f"verl config {config_name} rejects {message}.\n{err}") from err

    try:
        OmegaConf.resolve(config)
    except OmegaConfBaseException as err:
        raise ConfigValidationError(f"verl config {config_name} has an interpolation that fails: {err}") from err

    _to_dataclass(config, "actor_rollout_ref.rollout")
    _to_dataclass(config, "actor_rollout_ref.actor")

    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    try:
        validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    except (AssertionError, ValueError) as err:
        raise ConfigValidationError(f"verl's validate_config rejects {config_name}: {err}") from err
    _refuse_what_verl_accepts(config, config_name)
    return config


def _refuse_what_verl_accepts(config: DictConfig, config_name: str) -> None:
    """Settings verl 0.9.1 accepts that would hang, crash or silently change a GPU run, refused with the fix
    (:func:`memupdate.settings.verl_refusals`; the Snakefile refuses them in a stage's settings already)."""
    problems = verl_refusals(lambda key: OmegaConf.select(config, key))
    if problems:
        raise ConfigValidationError(f"verl config {config_name}: " + "; ".join(problems))


# ----------------------------------------------------------------------------------- run files


def write_resolved_config(path: PathLike, config: DictConfig) -> Path:
    """Write the composed verl config with every interpolation resolved (atomically)."""
    path = Path(path)
    write_text_atomic(path, OmegaConf.to_yaml(config, resolve=True))
    return path


def write_run_files(run_dir: Path, config: DictConfig, base_model: PathLike) -> dict[str, Any]:
    """``resolved_config.yaml`` without the run's record, and ``run_info.json``: the record with the config's
    digest (the file's sha256: the record holds the commit, which is not a setting). Returns the run info."""
    config = config.copy()
    with open_dict(config):
        record = OmegaConf.to_container(config.pop(RUN_RECORD))
    digest = sha256_file(write_resolved_config(run_dir / RESOLVED_CONFIG, config))
    info = run_info(digest, record, backend="verl", base_model=os.fspath(base_model))
    write_run_info(run_dir, info)
    return info


def write_agent_loop_config(
    path: PathLike,
    trained_role: str,
    fixed_model: Mapping[str, Any] | None = None,
    *,
    reward: Mapping[str, Any] | None = None,
    max_new_tokens: int | None = None,
) -> Path:
    """Write the run's agent-loop list: ``memupdate_agent`` with ``trained_role``, the served ``fixed_model``, the
    reward's QA-phase settings and the episode's per-turn cap ``max_new_tokens``, translated as the in-process
    runs translate theirs (:func:`memupdate.rollout.config.memory_loop_arguments`; verl hands the entry's keys to
    the loop's constructor). A run with a fixed model plays the QA phase: a memory stage is given one only where
    its scorer reads the served QA model's answers (the workflow's stage inputs), and those answers are then the
    loop's, which the reward scores instead of asking the reader again."""
    fixed = _fixed_model(trained_role, fixed_model)
    arguments = memory_loop_arguments(
        trained_role=trained_role,
        fixed_model=fixed,
        qa_phase=fixed is not None,
        reward=reward,
        max_new_tokens=max_new_tokens,
    )
    entry = agent_loop_entry(MEMORY_AGENT, arguments, deterministic_ids=False)
    header = f"# Written for this run by {__name__}.\n"
    path = Path(path)
    write_text_atomic(path, header + OmegaConf.to_yaml([entry]))
    return path


def prepare_main_ppo(
    role: str, run: MainPPORun, *, python: str = sys.executable, config_dir: PathLike = CONFIG_DIR
) -> tuple[list[str], dict[str, str]]:
    """Everything before the exec: compose and validate the config, write the run's ``agent_loops.yaml``,
    ``memory_environment.json``, ``tools.yaml`` and ``resolved_config.yaml``, and return ``(argv, env)``.

    Nothing is written when validation fails.
    """
    overrides = compose_overrides(role, run)
    config = validate_overrides(config_dir, CONFIG_NAME, overrides)
    run_dir = Path(_abs(run.experiment_dir))
    write_agent_loop_config(
        run_dir / AGENT_LOOPS_FILE,
        role,
        run.fixed_model_endpoint,
        reward=run.reward,
        max_new_tokens=build(EpisodeSettings, run.episode, "episode").max_new_tokens,
    )
    write_tool_config(run.tool_config, run.memory.write(run_dir), run_dir)
    write_run_files(run_dir, config, run.model_path)
    logger.info("verl run prepared in %s (role %s, %d overrides)", run_dir, role, len(overrides))
    return (
        main_ppo_argv(overrides, python=python, config_dir=config_dir),
        run_env(run_dir, run.extra, run.rollout_server),
    )


MEMAGENT_CONFIG_NAME = VERL_BASE_CONFIG["memagent"]


@dataclass(frozen=True, kw_only=True)
class MemAgentRun(VerlRun):
    """One ``main_ppo`` run of MemAgent, as :func:`memagent_overrides` turns it into hydra overrides and
    :func:`prepare_memagent_ppo` into the run's files (:func:`memupdate.training.stages.train_memagent` makes one)."""

    #: The loop's budgets (:class:`~memupdate.settings.MemAgentLoopSettings`).
    loop: Mapping[str, Any]


def memagent_overrides(run: MemAgentRun) -> list[str]:
    """Hydra overrides for ``main_ppo --config-name grpo_memagent``: paths, layout, and the turn budgets the
    loop's ``loop`` settings imply (a turn's prompt holds a chunk and a memory; a reply is at most a memory or
    the answer), so verl pads to what the loop produces."""
    # The loop's settings as the loop itself takes them: an unknown or ill-typed key fails here, named.
    budgets = build(MemAgentLoopSettings, run.loop, "loop")
    n_gpus_per_node, nnodes = run.n_gpus_per_node, run.nnodes
    if n_gpus_per_node < 1 or nnodes < 1:
        raise ValueError(f"need n_gpus_per_node >= 1 and nnodes >= 1, got {n_gpus_per_node}, {nnodes}")
    overrides = run_overrides(
        run.model_path, run.train_files, run.val_files, n_gpus_per_node, nnodes, run.experiment_dir
    )
    row_tokens = None
    if run.loop:
        lengths = budgets.lengths()
        overrides += [
            f"actor_rollout_ref.rollout.response_length={lengths['response_length']}",
            f"data.max_response_length={lengths['response_length']}",
            f"actor_rollout_ref.rollout.prompt_length={lengths['prompt_length']}",
        ]
        row_tokens = lengths["prompt_length"] + lengths["response_length"]
    overrides += device_overrides(run.extra, run.experiment_dir, run.rollout_server, row_tokens=row_tokens)
    return overrides + _extra_overrides(run.extra)


def memagent_mini_batch(config: DictConfig, loop: Mapping[str, Any]) -> str:
    """The override that states MemAgent's mini-batch in verl's V1 unit. The config gives it in questions
    (upstream's 128 / 8: 16 updates per step); verl counts rows (``ppo_mini_batch_size * n``), and each turn of a
    trajectory is a row: up to ``max_chunks`` memory updates and the answer. Multiplied by that, capped at the
    batch, a step makes at most as many updates as the config says instead of up to ``max_chunks + 1`` times
    as many.

    >>> memagent_mini_batch(OmegaConf.create({"data": {"train_batch_size": 128},
    ...     "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 8}}}), {"max_chunks": 8})
    'actor_rollout_ref.actor.ppo_mini_batch_size=72'
    """
    rows = build(MemAgentLoopSettings, loop, "loop").max_chunks + 1
    questions = config.actor_rollout_ref.actor.ppo_mini_batch_size
    return f"actor_rollout_ref.actor.ppo_mini_batch_size={min(questions * rows, config.data.train_batch_size)}"


def prepare_memagent_ppo(
    run: MemAgentRun, *, python: str = sys.executable, config_dir: PathLike = CONFIG_DIR
) -> tuple[list[str], dict[str, str]]:
    """Compose and validate ``grpo_memagent`` with :func:`memagent_overrides`, write the run's ``agent_loops.yaml``
    (the ``memagent`` loop with ``run.loop``'s budgets) and ``resolved_config.yaml``, and return ``main_ppo``'s
    ``(argv, env)``. Nothing is written when validation fails."""
    overrides = memagent_overrides(run)
    loop = run.loop
    # Validated twice: the mini-batch in rows needs the composed mini-batch in questions, and the result is checked.
    overrides.append(memagent_mini_batch(validate_overrides(config_dir, MEMAGENT_CONFIG_NAME, overrides), loop))
    config = validate_overrides(config_dir, MEMAGENT_CONFIG_NAME, overrides)
    run_dir = Path(_abs(run.experiment_dir))
    entry = agent_loop_entry(MEMAGENT_AGENT, build(MemAgentLoopSettings, loop, "loop").agent(), deterministic_ids=False)
    header = f"# Written for this run by {__name__}.\n"
    write_text_atomic(run_dir / AGENT_LOOPS_FILE, header + OmegaConf.to_yaml([entry]))
    write_run_files(run_dir, config, run.model_path)
    argv = main_ppo_argv(overrides, python=python, config_dir=config_dir, config_name=MEMAGENT_CONFIG_NAME)
    return argv, run_env(run_dir, run.extra, run.rollout_server)
