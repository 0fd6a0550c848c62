"""A plan before paying: per job, GPUs, expected wall time, GPU-hours, checkpoint disk and the Slurm time limit.

The figures live in one place, ``profiles/slurm/resources.yaml`` (:mod:`memupdate.cluster`): each row of a rule
and model gives the job's expected wall time with its source, and the limit Slurm gets is derived from it,
expected x ``plan.margin``, capped by the partition's limit (``MEMUPDATE_SLURM_MAX_RUNTIME``, ``plan.max_runtime``,
or what Slurm says of the partition: :func:`cluster_limits`); a job that needs more is asked for the cap and needs
resubmits if it resumes (:func:`resumes`), and is refused otherwise. A served
model's job must outlive its consumers: its limit is its longest consumer's plus ``plan.queue_margin`` (it starts when
its consumer does, ``serving.start_with_consumer``, so the margin covers its start-up). A
previous run's benchmark file (``benchmarks/<rule>/...tsv``, Snakemake's ``s`` column) replaces the estimate,
labelled measured.

A :class:`JobPlanner` (``PLANNER`` in ``rules/common.smk``, given what only the experiments say) plans each job of
a sized rule (:func:`job`, :func:`served`) for the rule's resources, and prints the :class:`Plan` of the jobs a run
would submit once Snakemake has built the DAG, dry run included (:func:`print_after_dag`);
``memupdate plan [targets] --config scale=full`` prints it alone (:func:`plan_targets`).

>>> from memupdate.cluster import Job, Limits
>>> entry = job("train_stage1", Job(gpus_per_node=8, minutes=30, per_step=5), Limits(max_runtime=1440), units=300)
>>> entry.minutes, entry.limit, entry.resubmits, entry.gpu_hours
(1530, 1440, 1, 204.0)
"""

from __future__ import annotations

import csv
import logging
import math
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from functools import cache, cached_property
from pathlib import Path
from typing import Any

from memupdate.cluster import Job, Limits, Table
from memupdate.settings import ConfigError

#: The partition cap the plan's notes assume when none is set (48 h is common; MEMUPDATE_SLURM_MAX_RUNTIME).
REFERENCE_CAP = 48 * 60
MAX_RUNTIME_ENV = "MEMUPDATE_SLURM_MAX_RUNTIME"
MEASURED, ESTIMATED = "measured", "estimated"
#: Rules whose jobs write verl checkpoints (train_stage: every train_stage<N>).
TRAINING = ("train_stage", "train_memagent", "train_sft", "train_memagent_sft")
SERVED_SOURCE = (
    "a served model starts with its consumer and holds its GPU while its consumers run: the longest one's time; its "
    "limit is that one's limit + plan.queue_margin"
)
_ORDER = ("prepare_model", "train_sft", "train_memagent_sft", "train_stage", "train_memagent", "serve_model")


# ------------------------------------------------------------------------------------------- figures


@dataclass(frozen=True)
class Figure:
    """An expected wall time in minutes, measured (a previous run's benchmark) or estimated (the table)."""

    minutes: float
    label: str
    source: str


def measured_minutes(path: str | Path | None) -> float | None:
    """Wall time in minutes from a Snakemake benchmark file (the mean of its ``s`` column); None if absent."""
    if path is None or not Path(path).is_file():
        return None
    with open(path, encoding="utf-8", newline="") as fh:
        seconds = [float(row["s"]) for row in csv.DictReader(fh, delimiter="\t") if row.get("s")]
    return sum(seconds) / len(seconds) / 60 if seconds else None


def figure(row: Job, units: int | None = None, benchmark: str | Path | None = None) -> Figure | None:
    """The job's figure: a previous run's measurement if ``benchmark`` exists, else the row's estimate for
    ``units`` steps or systems; None when the row has neither."""
    seconds = measured_minutes(benchmark)
    if seconds is not None:
        return Figure(seconds, MEASURED, str(benchmark))
    minutes = row.expected(units)
    if minutes is None:
        return None
    return Figure(minutes, ESTIMATED, row.source or "profiles/slurm/resources.yaml (no source given)")


def time_limit(minutes: float, limits: Limits) -> tuple[int, int]:
    """(limit, jobs): expected x margin in whole minutes, or the partition cap and how many jobs of the cap
    that time takes (1 + resubmits; each resumes from the last save, the margin covering the restarts)."""
    return _capped(math.ceil(minutes * limits.margin), limits)


def _capped(needed: int, limits: Limits) -> tuple[int, int]:
    cap = limits.max_runtime
    if cap and needed > cap:
        return cap, math.ceil(needed / cap)
    return needed, 1


def slurm_minutes(text: str) -> int | None:
    """A Slurm time limit as sinfo prints it (``%l``), in whole minutes; None for no limit.

    >>> [slurm_minutes(t) for t in ("2-00:00:00", "48:00:00", "30:00", "1-12", "infinite", "UNLIMITED")]
    [2880, 2880, 30, 2160, None, None]
    """
    text = text.strip()
    if text.lower() in ("infinite", "unlimited"):
        return None
    days, _, clock = text.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if days:
        # days-hours[:minutes[:seconds]]
        hours, minutes = parts[0], (parts[1] if len(parts) > 1 else 0)
        return int(days) * 1440 + hours * 60 + minutes
    # minutes, minutes:seconds or hours:minutes:seconds
    if len(parts) == 3:
        return parts[0] * 60 + parts[1]
    return parts[0]


class CapUnknown(ConfigError):
    """Slurm cannot say the partition's time limit (a dry run plans without one; a run stops)."""


def partition_cap(partition: str, sinfo: str) -> int | None:
    """The time limit of ``partition`` (its default one if ""), from ``sinfo`` (a path), in minutes; None for no
    limit. :class:`CapUnknown`, naming what to set instead, if Slurm cannot say."""
    args = [sinfo, "--noheader", "--format=%P %l"] + (["--partition", partition] if partition else [])
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        out, failure = None, str(err)
    else:
        # sinfo's last line says why (a cluster it cannot reach prints several before "fatal: ...").
        failure = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1] if out.returncode else ""
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()] if out and not failure else []
    if not partition:
        rows = [row for row in rows if row[0].endswith("*")]
    named = partition or "the default partition"
    if not rows:
        raise CapUnknown(
            f"cannot read the time limit of {named} from Slurm ({' '.join(args)}: "
            f"{failure or 'no such partition'}); set {MAX_RUNTIME_ENV} to it in minutes (or plan.max_runtime in "
            "profiles/slurm/resources.yaml), so every job's limit fits it"
        )
    try:
        caps = [slurm_minutes(row[1]) for row in rows]
    except (IndexError, ValueError):
        raise CapUnknown(
            f"cannot read the time limit of {named} from sinfo's {rows!r}; set {MAX_RUNTIME_ENV}"
        ) from None
    known = [cap for cap in caps if cap is not None]
    return min(known) if known else None


def cluster_limits(limits: Limits, env: Mapping[str, str], partition: str, sinfo: str | None) -> Limits:
    """``limits`` with the partition's cap: ``MEMUPDATE_SLURM_MAX_RUNTIME``, else the table's ``max_runtime``, else
    what Slurm says of the partition the jobs go to (``sinfo`` on PATH: a Slurm cluster), else none (a machine
    without Slurm: no job has a time limit)."""
    capped = with_cap(limits, env.get(MAX_RUNTIME_ENV))
    if capped.max_runtime is not None or sinfo is None:
        return capped
    return replace(limits, max_runtime=partition_cap(partition, sinfo))


def with_cap(limits: Limits, value: str | None) -> Limits:
    """``limits`` with the partition cap of ``MEMUPDATE_SLURM_MAX_RUNTIME`` (minutes), when set."""
    if value is None or not value.strip():
        return limits
    try:
        cap = int(value)
        if cap < 1:
            raise ValueError
    except ValueError:
        raise ConfigError(f"{MAX_RUNTIME_ENV}: expected a time limit in minutes, got {value!r}") from None
    return replace(limits, max_runtime=cap)


# ---------------------------------------------------------------------------------- checkpoint disk


_SIZE = re.compile(r"(\d+(?:\.\d+)?)([bm])(?![a-z])", re.IGNORECASE)


def model_params(name: str, spec: Mapping[str, Any] | None = None) -> float | None:
    """Parameters of a model: its spec's ``params``, else the nominal size its hub id or name gives
    (``Qwen/Qwen2.5-7B-Instruct``: 7e9; ``...-135M``: 1.35e8); None when none does.

    >>> model_params("qwen2.5-7b", {"name_or_path": "Qwen/Qwen2.5-7B-Instruct"}), model_params("tiny-random")
    (7000000000.0, None)
    >>> model_params("qwen2.5-7b", {"name_or_path": "Qwen/Qwen2.5-7B-Instruct", "params": 7.62e9})
    7620000000.0
    """
    if (spec or {}).get("params"):
        return float(spec["params"])
    for text in ((spec or {}).get("name_or_path"), name):
        found = _SIZE.findall(str(text or ""))
        if found:
            number, unit = found[-1]
            return float(number) * (1e9 if unit.lower() == "b" else 1e6)
    return None


@cache
def trainer_defaults(kind: str) -> dict[str, Any]:
    """The ``trainer`` section of ``verl_config/grpo_<kind>.yaml`` (memupdate or memagent)."""
    import yaml

    path = Path(__file__).parent / "training" / "verl_config" / f"grpo_{kind}.yaml"
    return dict(yaml.safe_load(path.read_text(encoding="utf-8")).get("trainer") or {})


def training_steps(settings: Mapping[str, Any]) -> int | None:
    """A training stage's steps: verl's ``trainer.total_training_steps``."""
    steps = settings.get("trainer.total_training_steps")
    return int(steps) if steps else None


def saves_kept(settings: Mapping[str, Any], defaults: Mapping[str, Any]) -> int:
    """How many verl saves a stage leaves on disk: ``trainer.max_actor_ckpt_to_keep`` of the saves it makes
    (one every ``save_freq`` steps and the last; all of them when nothing is pruned)."""

    def get(key: str) -> Any:
        return settings.get(f"trainer.{key}", defaults.get(key))

    steps, freq, keep = training_steps(settings), get("save_freq"), get("max_actor_ckpt_to_keep")
    made = math.ceil(steps / freq) if steps and freq and freq > 0 else 1
    return min(made, keep) if keep else made


def checkpoint_gb(params: float | None, saves: int, limits: Limits) -> float | None:
    """Disk of a training job's checkpoints, GB: ``saves`` verl saves and the merged bf16 ``ckpt/``."""
    if params is None:
        return None
    return params * (saves * limits.save_bytes_per_param + limits.merged_bytes_per_param) / 1e9


def memagent_systems(eval_section: Mapping[str, Any]) -> int:
    """MemAgent's evaluation passes: the base and the trained model, each in every style (ours, and
    MemAgent's own when ``memagent_style``), every haystack length in one pass."""
    from memupdate.settings import MemAgentEvalSettings

    default = {f.name: f.default for f in fields(MemAgentEvalSettings)}["memagent_style"]
    return 2 * (2 if eval_section.get("memagent_style", default) else 1)


# ----------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Entry:
    """One job of the plan."""

    rule: str
    row: Job
    figure: Figure | None
    limit: int | None
    jobs: int = 1
    exp: str | None = None
    what: str = ""
    model: str = ""
    disk_gb: float | None = None
    #: A served model's: its consumers (:attr:`name`) and the longest one's limit.
    consumers: tuple[str, ...] = ()
    consumer_limit: int | None = None

    @property
    def name(self) -> str:
        """``train_stage1 of two_stage_7b``, ``serve_model train/qa-base of two_stage_7b``, ``prepare_model of
        qwen2.5-7b``."""
        job = f"{self.rule} {self.what}" if self.what else self.rule
        return f"{job} of {self.exp or self.model}" if self.exp or self.model else job

    @property
    def gpus(self) -> int:
        return self.row.gpus

    @property
    def minutes(self) -> float | None:
        return self.figure.minutes if self.figure else None

    @property
    def hours(self) -> float | None:
        return None if self.figure is None else self.figure.minutes / 60

    @property
    def gpu_hours(self) -> float:
        return self.gpus * (self.hours or 0)

    @property
    def resubmits(self) -> int:
        return self.jobs - 1

    @property
    def table_rule(self) -> str:
        return "train_stage" if re.fullmatch(r"train_stage\d+", self.rule) else self.rule


def job(
    rule: str,
    row: Job,
    limits: Limits,
    *,
    units: int | None = None,
    benchmark: str | Path | None = None,
    disk_gb: float | None = None,
    **about: Any,
) -> Entry:
    """A job's entry: its figure (measured or estimated), the limit derived from it, or the row's own
    explicit ``runtime`` without a figure."""
    found = figure(row, units, benchmark)
    limit, jobs = time_limit(found.minutes, limits) if found else (row.runtime, 1)
    entry = Entry(rule, row, found, limit, jobs, disk_gb=disk_gb, **about)
    if jobs > 1 and not resumes(entry):
        raise ConfigError(
            f"{entry.name}: {found.minutes / 60:,.1f} h expected ({found.label}: {found.source}), "
            f"{found.minutes * limits.margin / 60:,.1f} h with plan.margin {limits.margin:g}, is past the partition "
            f"cap of {limits.max_runtime / 60:,.1f} h, and the job does not resume after a cut: ask for a partition "
            f"with a longer limit ({MAX_RUNTIME_ENV}, MEMUPDATE_SLURM_PARTITION), lower plan.margin in "
            "profiles/slurm/resources.yaml, or evaluate fewer systems or lengths"
        )
    return entry


def resumes(entry: Entry) -> bool:
    """Whether a job cut by its time limit continues where it stopped when rerun: training (verl's saves), the
    LoCoMo evaluation (its saved predictions, question by question) and MemAgent's (pass by pass)."""
    return entry.table_rule in TRAINING or entry.rule in ("eval_locomo", "eval_memagent")


def served(row: Job, consumers: Sequence[Entry], limits: Limits, **about: Any) -> Entry:
    """A served model's job: it holds its GPU as long as its longest consumer runs, and its limit is that
    consumer's limit plus the queue margin (its own start-up, as it starts once its consumer runs; a server started
    at once, the consumer's wait in the queue), capped by the partition's limit. A server is never resubmitted: one
    near its limit hands over to a successor while a consumer needs it, and a rerun starts it again."""
    timed = [c for c in consumers if c.figure is not None and c.limit is not None]
    names = tuple(c.name for c in consumers)
    if not timed:
        return Entry("serve_model", row, None, row.runtime, consumers=names, **about)
    longest = max(timed, key=lambda c: (c.limit or 0, c.minutes or 0))
    limit = max(c.limit or 0 for c in timed) + limits.queue_margin
    if limits.max_runtime:
        limit = min(limit, limits.max_runtime)
    found = Figure(max(c.minutes or 0 for c in timed), longest.figure.label, SERVED_SOURCE)  # type: ignore[union-attr]
    return Entry("serve_model", row, found, limit, consumers=names, consumer_limit=longest.limit, **about)


def longest_chain(minutes: Mapping[Any, float], deps: Mapping[Any, Iterable[Any]]) -> float:
    """The longest path through the jobs, minutes, if each starts as soon as its inputs exist."""
    done: dict[Any, float] = {}

    def finish(node: Any) -> float:
        if node not in done:
            done[node] = 0.0  # a cycle cannot happen in a DAG; this only stops runaway recursion
            done[node] = minutes.get(node, 0.0) + max((finish(d) for d in deps.get(node, ())), default=0.0)
        return done[node]

    return max((finish(n) for n in minutes), default=0.0)


@dataclass
class Plan:
    """The planned jobs of a run, their totals and notes; :meth:`render` is what a dry run prints."""

    entries: list[Entry]
    limits: Limits
    others: int = 0
    chain_minutes: float | None = None
    where: str = "profiles/slurm/resources.yaml"
    notes: list[str] = field(default_factory=list)
    #: Each entry's (by ``id``) nearest planned inputs: the jobs it waits for, for :func:`pack`.
    needs: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.entries = sorted(self.entries, key=_entry_order)

    @property
    def planned(self) -> list[Entry]:
        return [e for e in self.entries if e.figure is not None]

    @property
    def gpu_hours(self) -> float:
        return sum(e.gpu_hours for e in self.entries)

    @property
    def disk_gb(self) -> float:
        return sum(e.disk_gb or 0 for e in self.entries)

    def experiments(self) -> dict[str, list[Entry]]:
        out: dict[str, list[Entry]] = {}
        for entry in self.entries:
            out.setdefault(entry.exp or "-", []).append(entry)
        return out

    def render(self) -> str:
        return render(self)


@dataclass(frozen=True)
class Placed:
    """A job of a :class:`Schedule`: when it starts and ends (minutes from the start), on how many GPUs (its
    servers' included)."""

    entry: Entry
    start: float
    end: float
    gpus: int


@dataclass(frozen=True)
class Schedule:
    """The plan's jobs packed onto a cluster of ``gpus`` GPUs in nodes of ``gpus_per_node`` (:func:`pack`)."""

    gpus: int
    gpus_per_node: int
    placed: list[Placed]

    @property
    def minutes(self) -> float:
        return max((p.end for p in self.placed), default=0.0)

    @property
    def busy(self) -> float:
        """The share of the cluster's GPU time the jobs use."""
        used = sum(p.gpus * (p.end - p.start) for p in self.placed)
        return used / (self.gpus * self.minutes) if self.minutes else 0.0

    def render(self) -> str:
        nodes = self.gpus // self.gpus_per_node
        lines = [
            f"Schedule on {self.gpus} GPUs ({nodes} nodes of {self.gpus_per_node}): {self.minutes / 60:,.0f} h "
            f"({self.minutes / 1440:.1f} days), the GPUs {self.busy:.0%} busy; each job as soon as its inputs exist "
            "and its GPUs are free, the longest remaining chain first, a served model on a GPU of its own beside "
            "each consumer, no queue waits.",
            f"{'job':<48} {'GPUs':>5} {'start (days)':>13} {'end (days)':>11}",
        ]
        for p in sorted(self.placed, key=lambda p: (p.start, p.end)):
            lines.append(f"{p.entry.name:<48} {p.gpus:>5} {p.start / 1440:>13.1f} {p.end / 1440:>11.1f}")
        return "\n".join(lines)


def pack(plan: Plan, gpus: int, gpus_per_node: int) -> Schedule:
    """The plan's jobs on ``gpus`` GPUs in nodes of ``gpus_per_node``: list scheduling, each job started as soon as
    its inputs are done and its GPUs are free, the one on the longest remaining chain first (a later, smaller job
    backfills where a larger one waits). A served model holds a GPU of its own while each consumer runs, so a
    consumer asks for its GPUs and its servers' together; a multi-node job takes whole nodes. ConfigError if a job
    can never fit.

    >>> from memupdate.cluster import Job, Limits
    >>> big = job("train_memagent", Job(nodes=4, gpus_per_node=8, minutes=600), Limits())
    >>> small = job("train_stage1", Job(gpus_per_node=8, minutes=300), Limits())
    >>> p = Plan([big, small], Limits(), needs={id(big): [], id(small): []})
    >>> [(e.entry.rule, e.start, e.end) for e in pack(p, 32, 8).placed]
    [('train_memagent', 0.0, 600.0), ('train_stage1', 600.0, 900.0)]
    >>> [(e.entry.rule, e.start) for e in pack(p, 40, 8).placed]
    [('train_stage1', 0.0), ('train_memagent', 0.0)]
    """
    if gpus < 1 or gpus_per_node < 1 or gpus % gpus_per_node:
        raise ConfigError(f"a cluster of {gpus} GPUs in nodes of {gpus_per_node}: need whole nodes of >= 1 GPU")
    by_id = {id(e): e for e in plan.entries}
    servers = {key for key, e in by_id.items() if e.rule == "serve_model"}

    def inputs(key: int) -> set[int]:
        # A server is placed with its consumers: its own inputs become theirs.
        out: set[int] = set()
        for dep in plan.needs.get(key, []):
            out |= inputs(dep) if dep in servers else {dep}
        return out

    jobs = [key for key in by_id if key not in servers]
    waits = {key: inputs(key) for key in jobs}
    served = {key: [d for d in plan.needs.get(key, []) if d in servers] for key in jobs}
    minutes = {key: by_id[key].minutes or 0.0 for key in jobs}
    later: dict[int, list[int]] = {key: [] for key in jobs}
    for key, deps in waits.items():
        for dep in deps:
            later[dep].append(key)

    @cache
    def chain(key: int) -> float:
        return minutes[key] + max((chain(k) for k in later[key]), default=0.0)

    free = [gpus_per_node] * (gpus // gpus_per_node)

    def take(key: int) -> list[tuple[int, int]] | None:
        """Where the job and its servers go (node, GPUs), first fit, or None if they do not fit now."""
        row, trial, taken = by_id[key].row, list(free), []
        if row.gpus:
            if row.nodes > 1 or row.gpus_per_node == gpus_per_node:
                whole = [n for n, f in enumerate(trial) if f == gpus_per_node][: row.nodes]
                if len(whole) < row.nodes:
                    return None
                taken += [(n, row.gpus_per_node) for n in whole]
            else:
                node = next((n for n, f in enumerate(trial) if f >= row.gpus_per_node), None)
                if node is None:
                    return None
                taken.append((node, row.gpus_per_node))
            for n, g in taken:
                trial[n] -= g
        for server in served[key]:
            need = by_id[server].row.gpus_per_node or 0
            node = next((n for n, f in enumerate(trial) if f >= need), None) if need else -1
            if node is None:
                return None
            if need:
                trial[node] -= need
                taken.append((node, need))
        return taken

    for key in jobs:
        row = by_id[key].row
        asked = row.gpus + sum(by_id[s].row.gpus for s in served[key])
        if row.nodes * gpus_per_node > gpus or row.gpus_per_node > gpus_per_node or asked > gpus:
            raise ConfigError(
                f"{by_id[key].name} asks for {row.nodes} x {row.gpus_per_node} GPUs and its servers for "
                f"{asked - row.gpus}: it cannot run on {gpus} GPUs in nodes of {gpus_per_node}"
            )

    def reservation(key: int) -> float:
        """When the job would fit if nothing else started: the running jobs' ends, in order, until it does."""
        saved = list(free)
        try:
            for end, _, where in sorted(running, key=lambda r: r[0]):
                for node, g in where:
                    free[node] += g
                if take(key) is not None:
                    return end
            return math.inf
        finally:
            free[:] = saved

    done: dict[int, float] = {}
    running: list[tuple[float, int, list[tuple[int, int]]]] = []
    placed: list[Placed] = []
    now = 0.0
    started: set[int] = set()
    while len(done) < len(jobs):
        ready = sorted((k for k in jobs if k not in started and waits[k] <= done.keys()), key=lambda k: -chain(k))
        reserved = math.inf
        for key in ready:
            where = take(key)
            if where is None:
                # The first job that waits for GPUs holds them from when they free up (Slurm's backfill): a later
                # job starts before it only if it ends by then, so small jobs cannot starve a multi-node one.
                reserved = min(reserved, reservation(key))
                continue
            if now + minutes[key] > reserved:
                continue
            for node, g in where:
                free[node] -= g
            end = now + minutes[key]
            started.add(key)
            running.append((end, key, where))
            placed.append(Placed(by_id[key], now, end, sum(g for _, g in where)))
        if not running:
            raise ConfigError("no job can start: the plan's dependencies or sizes are inconsistent")
        # Every job that ends at the next end time, before anything starts again.
        running.sort(key=lambda r: r[0])
        now = running[0][0]
        while running and running[0][0] == now:
            _, key, where = running.pop(0)
            done[key] = now
            for node, g in where:
                free[node] += g
    return Schedule(gpus, gpus_per_node, sorted(placed, key=lambda p: (p.start, p.end)))


def _entry_order(entry: Entry) -> tuple[Any, ...]:
    rule = entry.table_rule
    rank = _ORDER.index(rule) if rule in _ORDER else len(_ORDER)
    return (entry.exp is not None, entry.exp or "", rank, entry.rule, entry.what, entry.model)


def _hours(minutes: float | None) -> str:
    return "-" if minutes is None else f"{minutes / 60:.1f}"


def _gpus(row: Job) -> str:
    if not row.gpus:
        return "-"
    return f"{row.nodes}x{row.gpus_per_node}" if row.nodes > 1 else str(row.gpus)


def _gb(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def render(plan: Plan) -> str:
    """The plan as a table: a line per job (grouped by experiment, with subtotals), the totals, the figures'
    sources and the notes (resubmits, jobs past a common partition cap)."""
    limits = plan.limits
    cap = f"partition cap {_hours(limits.max_runtime)} h" if limits.max_runtime else "no partition cap"
    lines = [
        f"Plan of the GPU-sized jobs (figures: {plan.where}; limit = expected x {limits.margin:g}, {cap}; "
        f"a served model's limit = its longest consumer's + {_hours(limits.queue_margin)} h):"
    ]
    header = ("experiment", "job", "model", "GPUs", "wall h", "GPU-h", "limit h", "resub", "disk GB", "figure")
    rows: list[tuple[str, ...]] = [header]
    sources: dict[str, int] = {}
    for exp, entries in plan.experiments().items():
        for e in entries:
            label = "-"
            if e.figure is not None:
                number = sources.setdefault(e.figure.source, len(sources) + 1)
                label = f"{e.figure.label} [{number}]"
            name = e.rule if not e.what else f"{e.rule} {e.what}"
            rows.append(
                (
                    exp,
                    name,
                    e.model or "-",
                    _gpus(e.row),
                    _hours(e.minutes),
                    f"{e.gpu_hours:,.0f}",
                    _hours(e.limit),
                    str(e.resubmits) if e.resubmits else "",
                    _gb(e.disk_gb),
                    label,
                )
            )
        if len(entries) > 1:
            gpu_h = sum(e.gpu_hours for e in entries)
            disk = sum(e.disk_gb or 0 for e in entries)
            rows.append((exp, "subtotal", "", "", "", f"{gpu_h:,.0f}", "", "", _gb(disk), ""))
    total = f"{len(plan.entries)} jobs" + (f" (+{plan.others} other jobs, not planned)" if plan.others else "")
    rows.append(("total", total, "", "", "", f"{plan.gpu_hours:,.0f}", "", "", _gb(plan.disk_gb), ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    numeric = {3, 4, 5, 6, 7, 8}
    for r in rows:
        cells = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    if plan.chain_minutes:
        lines.append(
            f"Longest chain of jobs: {plan.chain_minutes / 60:,.0f} h ({plan.chain_minutes / 1440:.1f} days), "
            "if every job starts as soon as its inputs exist."
        )
    lines.append("Figures:")
    lines.extend(f"  [{n}] {source}" for source, n in sources.items())
    notes = [*plan.notes, *_notes(plan)]
    if notes:
        lines.append("Notes:")
        lines.extend(f"  - {note}" for note in notes)
    return "\n".join(lines)


def _notes(plan: Plan) -> list[str]:
    limits, cap, notes = plan.limits, plan.limits.max_runtime, []
    short: dict[int, list[str]] = {}
    for e in plan.entries:
        if e.figure is None or e.limit is None:
            if e.gpus:
                notes.append(f"{e.name}: no expected time in {plan.where}; its limit is the row's own runtime")
            continue
        expected = f"{e.figure.minutes / 60:,.0f} h ({e.figure.minutes / 1440:.1f} days) expected"
        if e.rule == "serve_model":
            if cap and e.consumer_limit and e.consumer_limit + limits.queue_margin > cap:
                short.setdefault(max(cap - e.consumer_limit, 0), []).append(e.name)
            continue
        if e.resubmits:
            notes.append(
                f"{e.name}: {expected}, {e.figure.minutes * limits.margin / 60:,.0f} h with the margin, past the "
                f"partition cap of {_hours(cap)} h: {e.jobs} jobs, {e.resubmits} resubmit(s). {_resume(e)}"
            )
        elif not cap and e.limit > REFERENCE_CAP:
            jobs = math.ceil(e.limit / REFERENCE_CAP)
            notes.append(
                f"{e.name}: {expected}, limit {_hours(e.limit)} h; under a 48 h partition cap "
                f"({MAX_RUNTIME_ENV}={REFERENCE_CAP}) {jobs} jobs, {jobs - 1} resubmit(s). {_resume(e)}"
            )
    for spare, names in sorted(short.items()):
        notes.append(
            f"{len(names)} served model(s) capped at {_hours(cap)} h outlive their consumer's limit by "
            f"{_hours(spare)} h, not plan.queue_margin's {_hours(limits.queue_margin)} h: each hands over to a "
            f"successor job before its limit while its consumer still runs ({', '.join(names)})."
        )
    return notes


def _resume(entry: Entry) -> str:
    if entry.table_rule in TRAINING:
        return "Rerun the same snakemake command after each cut (or pass --retries): verl resumes from its last save."
    if entry.rule == "eval_locomo":
        return "Rerun the same snakemake command after each cut: it completes only the missing predictions."
    if entry.rule == "eval_memagent":
        return (
            "Rerun the same snakemake command after each cut: it runs only the passes (model, style, length) it had "
            "not finished; they run side by side, so the longest haystacks finish last."
        )
    return "It does not resume (each pass is predicted again): raise the cap or make the job fit."


# ---------------------------------------------------------------------------------- from Snakemake


def submits_to_slurm(workflow: Any) -> bool:
    """Whether the run submits its jobs to Slurm (profiles/slurm names slurm_partition among its default resources)."""
    defaults = workflow.resource_settings.default_resources
    return defaults is not None and "slurm_partition" in defaults.keys()


#: A table name of resources.yaml and a job's wildcards, to what only the workflow knows about that job.
JobQuestion = Callable[[str, Any], Any]


class JobPlanner:
    """The plan of a workflow's sized jobs, as Snakemake builds them (rules/common.smk makes one): each job's row
    of profiles/slurm/resources.yaml for the model it handles, its figure and time limit (:func:`job`,
    :func:`served`), kept per table name and wildcards, and the plan of a whole DAG (:meth:`plan`). A rule's
    ``resources:`` come from :meth:`resources`, which records the function giving the model its job handles.

    What only the workflow's experiments say comes in as functions of a table name and a job's wildcards:
    ``units`` (what a per-unit figure counts), ``disk`` (a training job's checkpoint GB; also given the model),
    ``consumers`` (a served model's readers, as (table name, wildcards) pairs) and ``benchmark`` (the job's
    benchmark file, where a previous run's time is measured)."""

    def __init__(
        self,
        workflow: Any,
        table: Table,
        logger: logging.Logger,
        *,
        units: JobQuestion,
        disk: Callable[[str, Any, str], float | None],
        consumers: JobQuestion,
        benchmark: JobQuestion,
    ) -> None:
        self.workflow, self.table, self.logger = workflow, table, logger
        self.units, self.disk, self.consumers, self.benchmark = units, disk, consumers, benchmark
        #: The model a sized rule's job handles, by table name (:meth:`resources` records each).
        self.model_of: dict[str, Callable[[Any], str]] = {}
        self._entries: dict[tuple[str, tuple[tuple[str, str], ...]], Entry] = {}

    @cached_property
    def limits(self) -> Limits:
        """The table's limits with the partition's cap, read once the run's executor is known (while the DAG is
        built). A run that submits to Slurm reads the cap from Slurm if neither MEMUPDATE_SLURM_MAX_RUNTIME nor
        plan.max_runtime gives it; where Slurm cannot say, a dry run warns and plans without one, a real run
        stops before submitting anything."""
        from snakemake_interface_executor_plugins.settings import ExecMode

        from memupdate.cluster import placement

        asks = submits_to_slurm(self.workflow) and self.workflow.exec_mode == ExecMode.DEFAULT
        try:
            sinfo = shutil.which("sinfo") if asks else None
            return cluster_limits(self.table.limits, os.environ, placement("slurm_partition"), sinfo)
        except CapUnknown as err:
            if not self.workflow.dryrun:
                raise
            self.logger.warning(f"{err}; this dry run plans without a cap")
            return self.table.limits

    def resources(
        self, sized: str, model_of: Callable[[Any], str], extra_mb: Callable[[Any], int], **own: Any
    ) -> dict[str, Any]:
        """A rule's resources: its own (``own``), raised to the row of its table ``sized`` for the model its job
        handles (``model_of(wildcards)``); Snakemake drops a resource whose value is None. A row with an expected
        time sets ``runtime`` to the plan's limit (expected x margin, capped). ``mem_mb`` adds ``extra_mb(input)``,
        the memory the job's servers hold on this machine while it runs."""
        self.model_of[sized] = model_of

        def resource(key: str) -> Callable[[Any], Any]:
            return lambda wildcards: self.row(sized, wildcards).snakemake().get(key, own.get(key))

        def mem_mb(wildcards: Any, input: Any) -> int | None:
            planned = resource("mem_mb")(wildcards)
            return None if planned is None else planned + extra_mb(input)

        keys = {"nodes", "tasks", "gres", "tasks_per_gpu", "mpi", "cpus_per_task", *own}
        return {key: mem_mb if key == "mem_mb" else resource(key) for key in sorted(keys)}

    def row(self, sized: str, wildcards: Any) -> Job:
        """The job's row with its time limit from the plan, if the row has a figure."""
        entry = self.entry(sized, wildcards)
        return entry.row if entry.figure is None else replace(entry.row, runtime=entry.limit)

    def entry(self, sized: str, wildcards: Any) -> Entry:
        """The :class:`Entry` of a job of the table ``sized``: its figure (a previous run's benchmark, else the
        row's estimate), limit, GPUs and checkpoint disk."""
        key = (sized, tuple(sorted(dict(wildcards.items()).items())))
        if key not in self._entries:
            self._entries[key] = self._plan(sized, wildcards)
        return self._entries[key]

    def _plan(self, sized: str, wildcards: Any) -> Entry:
        model = self.model_of[sized](wildcards)
        row = self.table.job(sized, model)
        exp = wildcards.get("exp")
        if sized == "serve_model":
            readers = [self.entry(rule, w) for rule, w in self.consumers(sized, wildcards)]
            what = f"{wildcards.purpose}/{wildcards.served}"
            return served(row, readers, self.limits, exp=exp, what=what, model=model)
        name = f"train_stage{wildcards.n}" if sized == "train_stage" else sized
        return job(
            name,
            row,
            self.limits,
            units=self.units(sized, wildcards),
            benchmark=self.benchmark(name, wildcards),
            disk_gb=self.disk(sized, wildcards, model),
            exp=exp,
            model=model,
        )

    def plan(self, dag: Any, always: bool = False) -> Plan | None:
        """The :class:`Plan` of the jobs ``dag`` would run; None when none has an expected time (the smoke
        scale), unless ``always``."""
        # A dry run has "finished" its jobs by the time it reports them.
        jobs = list(dag.needrun_jobs(exclude_finished=False))
        entries = {}
        for one in jobs:
            name = one.rule.name
            sized = "train_stage" if name.startswith("train_stage") else name
            if sized in self.model_of:
                entries[one] = self.entry(sized, one.wildcards)
        if not always and not any(e.figure for e in entries.values()):
            return None
        # A server is ready in minutes: its consumer, not the server, lies on the chain.
        minutes = {one: (e.minutes or 0) if e.rule != "serve_model" else 0 for one, e in entries.items()}
        deps = {one: list(dag.dependencies[one]) for one in jobs}
        chain = longest_chain(minutes, deps)

        def planned_inputs(one: Any, seen: set[Any]) -> list[Any]:
            """The nearest planned jobs ``one`` waits for, through unplanned ones (data, models' downloads)."""
            found = []
            for dep in deps.get(one, []):
                if dep not in seen:
                    seen.add(dep)
                    found += [dep] if dep in entries else planned_inputs(dep, seen)
            return found

        needs = {id(e): [id(entries[d]) for d in planned_inputs(one, set())] for one, e in entries.items()}
        return Plan(list(entries.values()), self.limits, len(jobs) - len(entries), chain, needs=needs)

    def print_after_dag(self) -> None:
        """Log the plan once Snakemake has built the DAG (:func:`print_after_dag`), in a run from this machine
        only: jobs on the cluster read the Snakefile too, and print nothing."""
        from snakemake_interface_executor_plugins.settings import ExecMode

        if self.workflow.exec_mode == ExecMode.DEFAULT:
            print_after_dag(self.workflow, self.logger, self.plan)


def print_after_dag(workflow: Any, logger: logging.Logger, make_plan: Callable[[Any], Plan | None]) -> None:
    """Log the plan of ``workflow``'s DAG once Snakemake has built it, in a dry run too: when it reports the
    jobs' statistics (its ``run_info`` event; in a dry run the second one, after the job list, unless
    ``--quiet`` stops it after the first). Nothing is written; Snakemake's jobs on the cluster never print it."""
    from snakemake.settings.enums import Quietness
    from snakemake_interface_logger_plugins.common import LogEvent

    class PlanPrinter(logging.Handler):
        seen = 0

        def emit(self, record: logging.LogRecord) -> None:
            if getattr(record, "event", None) != LogEvent.RUN_INFO:
                return
            self.seen += 1
            # Snakemake's own test: a dry run with --quiet ends after the first report.
            stops = workflow.output_settings.quiet == {Quietness.RULES, Quietness.PROGRESS}
            last = 2 if workflow.dryrun and not stops else 1
            if self.seen != last:
                return
            plan = make_plan(workflow.dag)
            if plan is not None:
                logger.info(plan.render())

    logger.addHandler(PlanPrinter(level=logging.INFO))


def plan_targets(
    root: Path,
    targets: Sequence[str],
    config: Sequence[str] = (),
    configfiles: Sequence[str] = (),
    forceall: bool = False,
) -> Plan:
    """The plan of the jobs ``snakemake -n <targets> --config ...`` would run (every job with ``forceall``),
    from the workflow's own planner (``PLANNER``, rules/common.smk)."""
    from memupdate.workflow_dag import load_dag

    workflow = load_dag(root, configfiles, targets, config=config, forceall=forceall)
    return workflow.globals["PLANNER"].plan(workflow.dag, always=True)
