"""Slurm resources of the heavy jobs, per rule and per model: ``profiles/slurm/resources.yaml``.

Snakemake profiles set resources per rule only, but a 7B policy needs other GPUs than a 135M one. The table
gives each GPU-sized rule a row per model (keys of ``models`` in config/config.yaml) and a ``default`` row;
the workflow's planner (:class:`memupdate.plan.JobPlanner`) turns a job's row into the resources the Slurm
executor plugin reads (:meth:`Job.snakemake`) or, for ``serve_model``, into the sbatch options of the server's own
job (:meth:`Job.server`). Rows only add
to what a rule asks for itself, so the CPU smoke models need none; a local run ignores ``nodes`` and ``gres``.

A row also holds the job's expected wall time, with its source (``minutes``, ``per_step``, ``per_system``):
the time limit is derived from it, expected x ``plan.margin``, capped by the partition's ``plan.max_runtime``
(:mod:`memupdate.plan` does the arithmetic and prints the plan: GPUs, hours, GPU-hours, checkpoint disk).

>>> table = load_table({"train_stage": {"qwen": {"nodes": 2, "gpus_per_node": 8, "mem_mb": 400000}}}, "t.yaml", ["qwen", "tiny"])
>>> table.job("train_stage", "qwen").snakemake()["gres"], table.job("train_stage", "tiny").snakemake()
('gpu:8', {})
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memupdate.typed_config import ConfigError, Float, Int, Str, build, section, setting
from memupdate.utils.io import yaml_load_strict

#: The table's file, relative to the workflow's root. The config check reads it too: a training job's device
#: follows its row (memupdate.settings).
RESOURCES_FILE = Path("profiles") / "slurm" / "resources.yaml"

#: The environment variables that place every Slurm job, by the Slurm plugin's resource they set
#: (profiles/slurm/config.yaml's default resources read them through :func:`placement`; docs/cluster.md).
#: Unset: the cluster's default.
PLACEMENT_ENV = {
    "slurm_partition": "MEMUPDATE_SLURM_PARTITION",
    "slurm_account": "MEMUPDATE_SLURM_ACCOUNT",
    "qos": "MEMUPDATE_SLURM_QOS",
}


def placement(resource: str, env: Mapping[str, str] = os.environ) -> str:
    """The value of a placing resource (a key of :data:`PLACEMENT_ENV`) from the user's environment; "" if unset.

    >>> placement("slurm_account", {"MEMUPDATE_SLURM_ACCOUNT": "lab"}), placement("qos", {})
    ('lab', '')
    """
    return env.get(PLACEMENT_ENV[resource], "")


#: Rules whose jobs the table sizes: the trainers, the servers and the model download (a 7B checkpoint is
#: loaded and saved again in memory).
RULES = (
    "prepare_model",
    "train_sft",
    "train_memagent_sft",
    "train_stage",
    "train_memagent",
    "serve_model",
    "eval_locomo",
    "eval_memagent",
)
DEFAULT = "default"
#: The table's own settings (not a rule): :class:`Limits`.
LIMITS_KEY = "plan"
#: What a row's per-unit figure counts, by rule: a training step, an evaluated system (LoCoMo: one per
#: memory/QA pairing and baseline; MemAgent: one per model and style, every haystack length).
UNITS = {
    "train_stage": "per_step",
    "train_memagent": "per_step",
    "eval_locomo": "per_system",
    "eval_memagent": "per_system",
}


@section(frozen=True)
class Job:
    """One row: what a job of the rule asks Slurm for when it handles the model."""

    nodes: Int = setting(1, help="nodes of a training job (one Ray node each)", ge=1)
    gpus_per_node: Int = setting(0, help="GPUs on each node (gres gpu:N)", ge=0)
    cpus_per_task: Int | None = setting(None, help="CPUs on each node", ge=1)
    mem_mb: Int | None = setting(None, help="memory on each node, MB", ge=1)
    runtime: Int | None = setting(
        None, help="an explicit wall-clock limit, minutes, for a row without an expected time", ge=1
    )
    minutes: Float | None = setting(
        None, help="expected wall time, minutes: the whole job, or its fixed part with per_step/per_system", ge=0
    )
    per_step: Float | None = setting(None, help="expected minutes per training step (training rules)", ge=0)
    per_system: Float | None = setting(None, help="expected minutes per evaluated system (eval rules)", ge=0)
    source: Str | None = setting(None, help="where the expected times come from")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def planned(self) -> bool:
        """Whether the row gives an expected wall time (the limit is then derived from it)."""
        return any(v is not None for v in (self.minutes, self.per_step, self.per_system))

    def expected(self, units: int | None = None) -> float | None:
        """Expected wall time in minutes: ``minutes`` plus ``units`` steps or systems at the per-unit figure;
        None without a figure, or when a per-unit figure has no count."""
        per = self.per_step if self.per_step is not None else self.per_system
        if not self.planned or (per is not None and units is None):
            return None
        return (self.minutes or 0) + (per or 0) * (units or 0)

    def snakemake(self) -> dict[str, Any]:
        """Resources of the rule's own job, as snakemake-executor-plugin-slurm 2.6 reads them."""
        out: dict[str, Any] = {k: v for k in ("cpus_per_task", "mem_mb", "runtime") if (v := getattr(self, k))}
        if self.gpus_per_node:
            # `gres` with tasks_per_gpu=0, never `gpus=`: the plugin ignores `gpus`, and without
            # tasks_per_gpu=0 it would ask for a task per GPU.
            out.update(gres=f"gpu:{self.gpus_per_node}", tasks_per_gpu=0)
        if self.nodes > 1:
            # One task per node, each starting a Ray node (rank 0 runs the trainer). mpi makes the plugin run
            # the rule in the batch step, so the rule can srun across the nodes itself.
            out.update(nodes=self.nodes, tasks=self.nodes, mpi="srun")
        return out

    def server(self) -> dict[str, Any]:
        """sbatch options of a served model's own job (``serving.slurm`` keys)."""
        out: dict[str, Any] = {
            "time": self.runtime,
            "mem_mb": self.mem_mb,
            "cpus_per_task": self.cpus_per_task,
        }
        if self.gpus_per_node:
            out["gres"] = f"gpu:{self.gpus_per_node}"
        return {k: v for k, v in out.items() if v is not None}


@section(frozen=True)
class Limits:
    """The table's ``plan`` section: how time limits follow from expected times, and the checkpoint sizes."""

    margin: Float = setting(1.5, help="time limit = expected wall time x margin", ge=1)
    queue_margin: Int = setting(
        30,
        help="minutes a served model's job outlives its longest consumer's limit: its start-up, for a server started "
        "with its consumer (serving.start_with_consumer); the consumer's wait in the queue, for one started at once",
        ge=0,
    )
    max_runtime: Int | None = setting(
        None,
        help="the partition's longest time limit, minutes (MEMUPDATE_SLURM_MAX_RUNTIME overrides); a longer job "
        "is asked for this and needs resubmits",
        ge=1,
    )
    save_bytes_per_param: Float = setting(
        13, help="bytes per parameter of one verl save (fp32 weights + Adam state, sharded)", ge=0
    )
    merged_bytes_per_param: Float = setting(2, help="bytes per parameter of the merged bf16 ckpt/", ge=0)


@dataclass(frozen=True)
class Table:
    rows: Mapping[str, Mapping[str, Job]]
    limits: Limits = Limits()

    def job(self, rule: str, model: str) -> Job:
        rows = self.rows.get(rule, {})
        return rows.get(model) or rows.get(DEFAULT) or Job()


def load_table(data: Any, path: str | Path, models: Iterable[str]) -> Table:
    """The table from its parsed YAML; every problem (unknown rule, model or key, a bad value) is reported
    at once, naming the file and the key."""
    if data is None:
        return Table({})
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping of rule -> model -> resources, got {type(data).__name__}")
    known = {*models, DEFAULT}
    errors, rows, limits = [], {}, Limits()
    for rule, per_model in data.items():
        if rule == LIMITS_KEY:
            try:
                limits = build(Limits, per_model, f"{path}: {LIMITS_KEY}")
            except ConfigError as err:
                errors.extend(str(err).splitlines())
            continue
        if rule not in RULES:
            errors.append(f"{path}: {rule}: not a rule the table sizes ({', '.join(RULES)})")
            continue
        if not isinstance(per_model, Mapping):
            errors.append(f"{path}: {rule}: expected a mapping of model -> resources")
            continue
        rows[rule] = {}
        for model, row in per_model.items():
            if model not in known:
                errors.append(
                    f"{path}: {rule}.{model}: not a model of config/config.yaml (have {', '.join(sorted(known))})"
                )
                continue
            try:
                job = rows[rule][model] = build(Job, row, f"{path}: {rule}.{model}")
            except ConfigError as err:
                errors.extend(str(err).splitlines())
                continue
            errors.extend(_figure_errors(job, rule, f"{path}: {rule}.{model}"))
    if errors:
        raise ConfigError("invalid Slurm resource table:\n  " + "\n  ".join(errors))
    return Table(rows, limits)


def _figure_errors(job: Job, rule: str, where: str) -> list[str]:
    """A row's time is either an expected figure (the limit derived) or an explicit runtime, and a per-unit
    figure must be the rule's unit."""
    errors = []
    if job.runtime is not None and job.planned:
        errors.append(f"{where}: runtime is derived from the expected time (minutes/per_step/per_system); give one")
    for key in ("per_step", "per_system"):
        if getattr(job, key) is not None and UNITS.get(rule) != key:
            unit = UNITS.get(rule)
            errors.append(f"{where}.{key}: {rule} counts {unit.removeprefix('per_') + 's' if unit else 'no units'}")
    return errors


def read_table(path: str | Path, models: Iterable[str]) -> Table:
    """:func:`load_table` of the YAML file at ``path``; no file, no rows (every rule asks for its own). YAML that
    does not parse or names a key twice is a :class:`ConfigError` naming the file and line."""
    path = Path(path)
    if not path.is_file():
        return Table({})
    try:
        data = yaml_load_strict(path)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return load_table(data, path, models)
