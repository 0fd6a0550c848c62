"""dvc.yaml from the Snakemake DAG: DVC sees what Snakemake sees.

Each DVC stage runs Snakemake for one expensive artifact with ``--allowed-rules`` (dvc.yaml's header says
why). Its jobs are read from the DAG of ``all`` (plus ``hotpotqa_data``) for the given config files:
the jobs of the stage's root rule (per experiment for the experiment stages) and, upstream of them, the
jobs of its other allowed rules. From those jobs come:

- ``outs``: their declared outputs that are not temp() (served-model readiness markers never are DVC
  outputs), with the folders their params name as written beside them (:data:`OUTPUT_PARAMS`);
- ``deps``: every input not made inside the stage (other stages' outputs, data files); files other
  jobs' params name among those outputs (the training curves evaluation reads); the workflow files
  (Snakefile, the included files that define no rule, such as rules/common.smk, and the files defining
  the stage's rules) and the rules' scripts; every module of the package they import, transitively
  (imports anywhere in a module, dotted module names as strings, modules named in the config files they
  read, the package's entry-point plugins of a library they import) and the package data beside them; the
  config files given and every ``config/`` path the workflow, the jobs' params or those modules name.

``memupdate dvc-yaml`` writes the file; ``memupdate dvc-yaml --check`` fails when the committed one differs.

Each stage's cmd is ``memupdate dvc-run <stage> -- snakemake ...`` (:func:`run_stage`) and its outs are
``persist: true``, so that ``dvc repro`` adopts what Snakemake already built instead of deleting and rebuilding
it. DVC 3 deletes a stage's outs before running its cmd unless they are persistent (``Stage.run`` calls
``remove_outs``, which only unprotects a ``persist`` out), then saves the outs' hashes to dvc.lock and the cache.
:func:`run_stage` does the rest of what DVC would do:

- a stage dvc.lock records that DVC runs again (its deps or outs changed, or ``dvc repro -f``): its outs are
  removed first, as DVC removes them, and Snakemake rebuilds them;
- a stage dvc.lock does not record yet (the first ``dvc repro`` after ``snakemake all``): its outs stay;
  Snakemake runs only the jobs its own rerun triggers find outdated (none after a complete run) and DVC then
  records the outputs as they are.

DVC re-copies a single-file out from its cache after hashing it (``relink`` with the default ``reflink,copy``
cache), which gives the file a new mtime; Snakemake would then see a later stage's input as newer than that
stage's outputs. :func:`run_stage` keeps the mtime Snakemake left on each single-file out and puts it back
before the next stage runs, once the file's content is checked to be the same.
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from memupdate.workflow_dag import load_dag

logger = logging.getLogger(__name__)

PACKAGE = __name__.split(".")[0]
REGENERATE = "memupdate dvc-yaml"
RUN = "memupdate dvc-run"


@dataclass(frozen=True)
class DvcStageKind:
    """A kind of DVC stage: its root rule (whose jobs are the stage's targets) and the rules Snakemake may
    run for it. ``per_experiment``: one stage per experiment (the ``exp`` wildcard of the root jobs). ``name``
    may name other wildcards of the root jobs (``stage{n}``): one stage per value, each experiment's
    training stages in their order."""

    name: str
    root: str  #: the root rule's name, or a pattern of names (train_stage\d+)
    rules: tuple[str, ...]
    per_experiment: bool = False

    def is_root(self, rule: str) -> bool:
        return re.fullmatch(self.root, rule) is not None


STAGE_KINDS = (
    DvcStageKind("data", "preprocess_locomo", ("fetch_data", "preprocess_locomo")),
    DvcStageKind("embeddings", "embed_memories", ("embed_memories",)),
    DvcStageKind("models", "prepare_model", ("prepare_model",)),
    # MemAgent's haystacks: every length of the scale, split into train and test questions.
    DvcStageKind("hotpotqa", "hotpotqa_data", ("fetch_data", "preprocess_hotpotqa", "split_hotpotqa", "hotpotqa_data")),
    DvcStageKind("sft", "train_sft", ("train_sft",), per_experiment=True),
    # One per training stage of an experiment (rules train_stage1, train_stage2, ...).
    DvcStageKind("stage{n}", r"train_stage\d+", ("serve_model", "select_stage_rows"), per_experiment=True),
    DvcStageKind("eval", "eval_locomo", ("serve_model", "eval_locomo"), per_experiment=True),
    DvcStageKind("memagent_sft", "train_memagent_sft", ("train_memagent_sft",), per_experiment=True),
    DvcStageKind("memagent", "train_memagent", ("serve_model", "train_memagent"), per_experiment=True),
    DvcStageKind("memagent_eval", "eval_memagent", ("serve_model", "eval_memagent"), per_experiment=True),
)
# What the DAG is built for: every artifact of the scale, and the haystack target of the hotpotqa stage.
DAG_TARGETS = ("all", "hotpotqa_data")
# Rules that only gather targets; they belong to no stage.
TARGET_RULES = ("all",)

# Job params that name where a job writes besides its declared outputs: the whole folder (None), or these
# files in it. Evaluation writes predictions/ and its report files into out_dir (a stale prediction must go
# with a stale report); training writes its curve beside the checkpoint (its step checkpoints stay out of DVC).
OUTPUT_PARAMS: Mapping[str, tuple[str, ...] | None] = {"out_dir": None, "run_dir": ("metrics.jsonl",)}

CONFIG_DIR = "config"
_MODULE_STRING = re.compile(rf"{PACKAGE}(\.\w+)+")
_CONFIG_STRING = re.compile(rf"{CONFIG_DIR}/[\w./-]+")
# Imports of a workflow file at column 0 run whenever the workflow loads (config checks, resources);
# indented ones sit in run hooks (stopping servers) that make no artifact.
_SMK_IMPORT = re.compile(rf"^(?:from\s+({PACKAGE}[\w.]*)\s+import\s+([\w, ()]+)|import\s+({PACKAGE}[\w.]*))", re.M)
_SMK_CONFIG = re.compile(rf"[\"']({CONFIG_DIR}/[^\"'\s]+)[\"']")


@dataclass
class DvcStage:
    name: str
    targets: list[str]
    rules: list[str]
    outs: set[str] = field(default_factory=set)
    deps: set[str] = field(default_factory=set)
    jobs: list[Any] = field(default_factory=list)


# ------------------------------------------------------------------------------------------- the DAG


def _producers(dag: Any) -> dict[str, Any]:
    """Output file -> the job making it."""
    return {str(f): job for job in dag.jobs for f in job.output}


def _is_temp(job: Any, path: str) -> bool:
    from snakemake.io import is_flagged

    return any(str(f) == path and is_flagged(f, "temp") for f in job.output)


def _strings(value: Any) -> Iterator[str]:
    """Every string in a job's params (nested dicts and lists included)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def _stage_jobs(dag: Any, kind: DvcStageKind) -> dict[tuple[str | None, str], list[Any]]:
    """The jobs of each stage of ``kind`` (keyed by experiment, or None, and the stage's name within it): its
    root jobs and, upstream, the jobs of its allowed rules."""
    roots: dict[tuple[str | None, str], list[Any]] = {}
    for job in dag.jobs:
        if kind.is_root(job.rule.name):
            wildcards = job.wildcards_dict
            key = (wildcards.get("exp") if kind.per_experiment else None, kind.name.format(**wildcards))
            roots.setdefault(key, []).append(job)
    stages = {}
    for key, jobs in roots.items():
        seen = {id(job): job for job in jobs}
        frontier = list(jobs)
        while frontier:
            for upstream in dag.dependencies[frontier.pop()]:
                if upstream.rule.name in kind.rules and id(upstream) not in seen:
                    seen[id(upstream)] = upstream
                    frontier.append(upstream)
        stages[key] = sorted(seen.values(), key=str)
    return stages


# ------------------------------------------------------------------------------------------ the code


@dataclass
class CodeScan:
    """Which modules of the package and which config paths a set of files reaches."""

    root: Path
    modules: set[str] = field(default_factory=set)
    config: set[str] = field(default_factory=set)
    libraries: set[str] = field(default_factory=set)
    data: set[str] = field(default_factory=set)
    _data_files: list[Path] | None = None

    def module_file(self, name: str) -> Path | None:
        base = self.root / "src" / Path(*name.split("."))
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path
        return None

    def resolve(self, dotted: str) -> str | None:
        """The longest module prefix of ``dotted`` (``memupdate.tools.memory_tools.SearchMemoryTool`` names
        memupdate.tools.memory_tools)."""
        parts = dotted.split(".")
        for end in range(len(parts), 0, -1):
            if self.module_file(".".join(parts[:end])):
                return ".".join(parts[:end])
        return None

    def add_module(self, name: str | None) -> None:
        """The module and every package above it (importing a module runs their __init__), with the package
        data of the module's package."""
        while name and name not in self.modules:
            self.modules.add(name)
            path = self.module_file(name)
            self._scan_python(path, name)
            if path is not None:
                for data in sorted(self._package_data(path.parent) - self.data):
                    self.data.add(data)
                    self._scan_yaml(self.root / data)
            name = name.rpartition(".")[0]

    def _package_data(self, package_dir: Path) -> set[str]:
        """The files ``[tool.setuptools.package-data]`` ships whose nearest Python package is ``package_dir``
        (``training/verl_config/*.yaml`` for the modules of memupdate.training): what its modules read
        beside themselves."""
        if self._data_files is None:
            pyproject = tomllib.loads((self.root / "pyproject.toml").read_text())
            globs = pyproject.get("tool", {}).get("setuptools", {}).get("package-data", {}).get(PACKAGE, [])
            base = self.root / "src" / PACKAGE
            self._data_files = sorted({p for pattern in globs for p in base.glob(pattern) if p.is_file()})
        found = set()
        for file in self._data_files:
            owner = file.parent
            while not (owner / "__init__.py").is_file():
                owner = owner.parent
            if owner == package_dir:
                found.add(str(file.relative_to(self.root)))
        return found

    def add_config(self, path: str) -> None:
        if path in self.config or not (self.root / path).exists():
            return
        self.config.add(path)
        files = sorted((self.root / path).rglob("*.y*ml")) if (self.root / path).is_dir() else [self.root / path]
        for file in files:
            self._scan_yaml(file)

    def _scan_yaml(self, file: Path) -> None:
        """The modules a YAML file names as dotted strings (verl loads tool and agent-loop classes by name)."""
        if file.suffix in (".yaml", ".yml"):
            for text in _strings(yaml.safe_load(file.read_text())):
                if _MODULE_STRING.fullmatch(text):
                    self.add_module(self.resolve(text))

    def add_script(self, path: Path) -> None:
        self._scan_python(path, None)

    def add_workflow_file(self, path: Path) -> None:
        """A Snakefile or .smk file (not plain Python): its column-0 imports and the config paths it names."""
        text = path.read_text()
        for match in _SMK_IMPORT.finditer(text):
            module = match.group(1) or match.group(3)
            self.add_module(module)
            for alias in (match.group(2) or "").replace("(", "").replace(")", "").split(","):
                name = alias.split(" as ")[0].strip()
                if name and self.module_file(f"{module}.{name}"):
                    self.add_module(f"{module}.{name}")
        for path_text in _SMK_CONFIG.findall(text):
            self.add_config(path_text)

    def add_entry_points(self) -> None:
        """The package's entry-point plugins of a library the code imports (the library loads them):
        ``[project.entry-points."verl.plugins"]`` counts when any module imports verl."""
        pyproject = tomllib.loads((self.root / "pyproject.toml").read_text())
        for group, entries in pyproject.get("project", {}).get("entry-points", {}).items():
            if group.split(".")[0] in self.libraries:
                for target in entries.values():
                    self.add_module(self.resolve(target.split(":")[0]))

    def _scan_python(self, path: Path | None, module: str | None) -> None:
        if path is None:
            return
        package = module if module and path.name == "__init__.py" else (module or "").rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    self._imported(alias.name)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                self._imported(base)
                for alias in node.names:
                    if base.split(".")[0] == PACKAGE and self.module_file(f"{base}.{alias.name}"):
                        self.add_module(f"{base}.{alias.name}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if _MODULE_STRING.fullmatch(node.value):
                    self.add_module(self.resolve(node.value))
                elif _CONFIG_STRING.fullmatch(node.value):
                    self.add_config(node.value)
            elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
                self._config_path(node)

    def _imported(self, name: str) -> None:
        if name.split(".")[0] == PACKAGE:
            self.add_module(self.resolve(name))
        elif name:
            self.libraries.add(name.split(".")[0])

    def _config_path(self, node: ast.BinOp) -> None:
        """A path joined with ``/`` whose first string part is config (how modules find config/verl from
        ``__file__``): the longest existing path of the string parts from there."""
        operands: list[ast.expr] = []
        while isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            operands.insert(0, node.right)
            node = node.left  # type: ignore[assignment]
        operands.insert(0, node)
        names = [n.value if isinstance(n, ast.Constant) and isinstance(n.value, str) else None for n in operands]
        strings = [i for i, name in enumerate(names) if name is not None]
        if not strings or names[strings[0]] != CONFIG_DIR:
            return
        parts = [CONFIG_DIR]
        for name in names[strings[0] + 1 :]:
            if name is None:
                break
            parts.append(name)
        # The longest existing path: a file, or the folder a module lists itself.
        for end in range(len(parts), 1, -1):
            if (self.root / "/".join(parts[:end])).exists():
                self.add_config("/".join(parts[:end]))
                return

    def files(self) -> set[str]:
        modules = {str(self.module_file(m).relative_to(self.root)) for m in self.modules}  # type: ignore[union-attr]
        return modules | self.config | self.data


# ----------------------------------------------------------------------------------------- the stages


def _natural(name: str) -> list[Any]:
    """Sort key of a name with numbers in it, by their values: stage2 before stage10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _relative(root: Path, path: str | Path) -> str:
    path = Path(path)
    if path.is_absolute() and not path.resolve().is_relative_to(root):
        raise ValueError(f"{path} is outside the repository {root}: DVC tracks files of the repository only")
    return (path.resolve().relative_to(root) if path.is_absolute() else path).as_posix()


def build_stages(workflow: Any, configfiles: Sequence[str]) -> list[DvcStage]:
    """The DVC stages of a loaded workflow (:func:`load_dag`): jobs, targets, rules, outs and deps."""
    root = Path(workflow.basedir).resolve()
    dag = workflow.dag
    producers = _producers(dag)
    rule_files = {rule.name: Path(rule.snakefile) for rule in workflow.rules}
    included = [Path(f.get_path_or_uri(secret_free=False)) for f in workflow.included]
    helpers = [f for f in included if f not in set(rule_files.values()) or f == Path(workflow.main_snakefile)]

    stages: list[DvcStage] = []
    counts: dict[str, int] = {}
    found: list[tuple[DvcStageKind, str | None, str, list[Any]]] = []
    for kind in STAGE_KINDS:
        for (exp, base), jobs in _stage_jobs(dag, kind).items():
            found.append((kind, exp, base, jobs))
            counts[base] = counts.get(base, 0) + 1
    # The shared stages first, then each experiment's stages in the order they run (stage2 before stage10).
    found.sort(key=lambda item: (item[1] is not None, item[1] or "", STAGE_KINDS.index(item[0]), _natural(item[2])))
    for kind, exp, base, jobs in found:
        # The bare name while the scale has one experiment with the stage; <experiment>-<stage> beside others.
        name = base if counts[base] == 1 or exp is None else f"{exp}-{base}"
        roots = [job for job in jobs if kind.is_root(job.rule.name)]
        targets = sorted({str(f) for job in roots for f in job.output} or {kind.root})
        stage = DvcStage(name, targets, sorted({job.rule.name for job in jobs}), jobs=jobs)
        stage.outs = _outs(jobs)
        stages.append(stage)
    _check_coverage(dag, stages)

    outs = {out: stage.name for stage in stages for out in stage.outs}
    for stage in stages:
        stage.deps = _data_deps(stage, producers, outs)
        code = CodeScan(root)
        for path in [*helpers, *{rule_files[rule] for rule in stage.rules}]:
            stage.deps.add(_relative(root, path))
            code.add_workflow_file(path)
        for job in stage.jobs:
            if job.rule.script:
                script = (Path(job.rule.snakefile).parent / job.rule.script).resolve()
                stage.deps.add(_relative(root, script))
                code.add_script(script)
            for text in _strings(dict(job.params)):
                if _CONFIG_STRING.fullmatch(text):
                    code.add_config(text)
        for configfile in [*workflow.configfiles, *configfiles]:
            code.add_config(_relative(root, configfile))
        # A plugin may import more plugins' libraries: repeat until nothing is added.
        size = -1
        while size != len(code.modules):
            size = len(code.modules)
            code.add_entry_points()
        stage.deps |= code.files()
    return stages


def _outs(jobs: Sequence[Any]) -> set[str]:
    outs: set[str] = set()
    folders: set[str] = set()
    for job in jobs:
        params = dict(job.params)
        for key, files in OUTPUT_PARAMS.items():
            if key not in params:
                continue
            if files is None:
                folders.add(str(params[key]))
            else:
                outs.update(f"{params[key]}/{name}" for name in files)
        outs.update(str(f) for f in job.output if not _is_temp(job, str(f)))
    return {o for o in outs if not any(o.startswith(f"{d}/") for d in folders)} | folders


def _data_deps(stage: DvcStage, producers: Mapping[str, Any], outs: Mapping[str, str]) -> set[str]:
    ids = {id(job) for job in stage.jobs}
    deps: set[str] = set()
    for job in stage.jobs:
        for path in map(str, job.input):
            producer = producers.get(path)
            if producer is not None and id(producer) in ids:
                continue
            if producer is not None and _is_temp(producer, path):
                raise ValueError(
                    f"stage {stage.name!r}: {job.rule.name} reads {path}, a temp() output of rule "
                    f"{producer.rule.name}, which the stage does not run: add {producer.rule.name!r} to its "
                    f"rules in memupdate.dvc_stages.STAGE_KINDS"
                )
            deps.add(path)
        # Files a job reads without declaring them (the training curves in evaluation's params).
        deps.update(text for text in _strings(dict(job.params)) if outs.get(text) not in (None, stage.name))
    return deps


def _check_coverage(dag: Any, stages: Sequence[DvcStage]) -> None:
    """Every job of the DAG in exactly one stage: a job in none would never run under dvc repro (its rule is
    allowed nowhere), and two stages would own its outputs."""
    owner: dict[int, str] = {}
    for stage in stages:
        for job in stage.jobs:
            if id(job) in owner:
                raise ValueError(
                    f"job {job} ({job.rule.name}) is in stages {owner[id(job)]!r} and {stage.name!r}: "
                    "fix the rules of memupdate.dvc_stages.STAGE_KINDS"
                )
            owner[id(job)] = stage.name
    missing = sorted({job.rule.name for job in dag.jobs if id(job) not in owner and job.rule.name not in TARGET_RULES})
    if missing:
        raise ValueError(
            f"rules {', '.join(missing)} have jobs in the DAG but no DVC stage runs them: add them to a stage "
            "in memupdate.dvc_stages.STAGE_KINDS"
        )


# ---------------------------------------------------------------------------------------- dvc.yaml

HEADER = """\
# GENERATED by `{command}` from the Snakemake DAG: do not edit; rerun it
# after changing rules/, workflow/scripts/, the package's imports or config (tests/test_dvc_stages.py fails
# while this file is stale).
#
# One DVC stage per expensive artifact; each asks Snakemake for exactly that target with
# --allowed-rules, so Snakemake never re-runs an upstream rule DVC already judged fresh (dvc pull gives
# every file a new mtime, which Snakemake alone would read as "outdated"). DVC decides what is stale
# by content hash; Snakemake executes, locally or on Slurm: `profile` in params.yaml (docs/dvc.md).
# A stage's deps are every input of its jobs, the workflow files and scripts of its rules, the
# package modules they import and the config they read. Served-model readiness markers are temp() and
# never DVC outputs. Run: dvc repro; dvc push; dvc pull.
#
# Each cmd runs Snakemake through `memupdate dvc-run <stage>` and every out is persist: true, so the first
# dvc repro after a Snakemake run adopts what Snakemake holds up to date (it records it in dvc.lock, it does
# not rebuild it); a stage dvc.lock already records is rebuilt from scratch when DVC finds it changed
# (memupdate.dvc_stages.run_stage).
"""


def _scalar(text: str) -> str:
    return text if re.fullmatch(r"[\w./@+${}-]+", text) else yaml.safe_dump(text, default_style='"').strip()


def render(stages: Sequence[DvcStage], configfiles: Sequence[str]) -> str:
    command = " ".join([REGENERATE, *(f"--configfile {f}" for f in configfiles)])
    lines = [HEADER.format(command=command), "vars:", "  - params.yaml", "", "stages:"]
    for stage in stages:
        cmd = [RUN, stage.name, "--", "snakemake --profile ${profile}", *stage.targets, "--allowed-rules"]
        cmd += [*stage.rules, "--configfile", *(configfiles or ["config/config.yaml"])]
        lines += [f"  {stage.name}:", "    cmd: >-", *_wrap(cmd, "      "), "    deps:"]
        lines += [f"      - {_scalar(d)}" for d in sorted(stage.deps)]
        # persist: DVC leaves the outs in place for the cmd, which removes them itself where DVC would (run_stage).
        lines.append("    outs:")
        for out in sorted(stage.outs):
            lines += [f"      - {_scalar(out)}:", "          persist: true"]
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def _wrap(words: Sequence[str], indent: str, width: int = 110) -> list[str]:
    lines, line = [], ""
    for word in words:
        if line and len(indent) + len(line) + 1 + len(word) > width:
            lines.append(indent + line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return [*lines, indent + line]


def generate(root: Path, configfiles: Sequence[str] = ()) -> str:
    """dvc.yaml's text for the workflow in ``root`` with ``configfiles`` merged over config/config.yaml."""
    workflow = load_dag(root, configfiles, DAG_TARGETS)
    stages = build_stages(workflow, configfiles)
    logger.info("%d DVC stages: %s", len(stages), ", ".join(s.name for s in stages))
    return render(stages, configfiles)


def write_or_check(root: Path, output: Path, configfiles: Sequence[str] = (), check: bool = False) -> bool:
    """Write ``output`` (relative to ``root``), or with ``check`` only compare; True when it was current."""
    text = generate(root, configfiles)
    path = output if output.is_absolute() else root / output
    current = path.is_file() and path.read_text() == text
    if check:
        if not current:
            command = " ".join([REGENERATE, *(f"--configfile {f}" for f in configfiles)])
            raise ValueError(f"{path} is not what the Snakemake DAG gives; regenerate it with: {command}")
        logger.info("%s is current", path)
    elif not current:
        path.write_text(text)
        logger.info("wrote %s", path)
    return current


# ------------------------------------------------------------------------------------- a stage's cmd

LOCKFILE = "dvc.lock"
#: The mtimes Snakemake left on each stage's single-file outs (in DVC's own scratch folder, which git ignores).
MTIMES = Path(".dvc") / "tmp" / "snakemake-mtimes"


def stage_outs(stage: Mapping[str, Any]) -> list[str]:
    """The paths of a dvc.yaml stage's outs (an out is a path, or a path mapped to its flags)."""
    return [out if isinstance(out, str) else next(iter(out)) for out in stage.get("outs") or []]


def _locked(root: Path, name: str) -> bool:
    path = root / LOCKFILE
    if not path.is_file():
        return False
    return name in ((yaml.safe_load(path.read_text()) or {}).get("stages") or {})


def _md5(path: Path) -> str:
    digest = hashlib.md5()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _record_mtimes(root: Path, name: str, outs: Sequence[str]) -> None:
    """Keep the size, mtime and md5 of each single-file out, as Snakemake left it. DVC re-copies those files
    from its cache when it commits them (directories' files it leaves in place unless they are hard links, and
    Snakemake reads a directory output's time from its .snakemake_timestamp)."""
    files = {}
    for out in outs:
        path = root / out
        if path.is_file():
            stat = path.stat()
            files[out] = [stat.st_size, stat.st_mtime_ns, _md5(path)]
    record = root / MTIMES / f"{name}.json"
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(files, indent=1, sort_keys=True) + "\n")


def restore_mtimes(root: Path) -> list[str]:
    """Give every recorded single-file out that DVC re-copied since (same size and content, a later mtime) its
    mtime back, so Snakemake does not take it for a newer input of the next stage. Returns those paths."""
    restored = []
    for record in sorted((root / MTIMES).glob("*.json")):
        for out, (size, mtime_ns, md5) in json.loads(record.read_text()).items():
            path = root / out
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            if path.is_file() and stat.st_size == size and stat.st_mtime_ns > mtime_ns and _md5(path) == md5:
                os.utime(path, ns=(stat.st_atime_ns, mtime_ns))
                restored.append(out)
    if restored:
        logger.info("kept Snakemake's mtimes of %d files DVC re-copied from its cache", len(restored))
    return restored


def _mtimes(path: Path) -> Iterator[int]:
    """The mtimes of a file, or of every file in a folder (Snakemake's .snakemake_timestamp included)."""
    if path.is_file():
        yield path.stat().st_mtime_ns
    elif path.is_dir():
        yield from (file.stat().st_mtime_ns for file in path.rglob("*") if file.is_file())


def _newer_code(root: Path, stages: Mapping[str, Any], name: str) -> list[str]:
    """The deps of a stage no stage makes (code, config, rule files) changed after its newest output was
    written: Snakemake does not see an imported module change, so it would keep those outputs."""
    made = {out for stage in stages.values() for out in stage_outs(stage)}
    newest = max((t for out in stage_outs(stages[name]) for t in _mtimes(root / out)), default=None)
    if newest is None:
        return []
    deps = [str(dep) for dep in stages[name].get("deps") or [] if str(dep) not in made]
    return sorted(dep for dep in deps if max(_mtimes(root / dep), default=0) > newest)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def run_stage(name: str, command: Sequence[str], root: Path = Path(".")) -> int:
    """A dvc.yaml stage's cmd: run ``command`` (its snakemake call) and return its exit status.

    dvc.lock records the stage: DVC found its deps or outs changed (or was forced), so its outs are removed
    first, as DVC does for outs that are not persistent, and Snakemake builds them again. dvc.lock does not record
    it: Snakemake keeps every output its rerun triggers find up to date (and rebuilds the rest), and DVC records
    them in dvc.lock as they are: outputs ``snakemake all`` made are adopted, not rebuilt.
    """
    root = Path(root)
    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    if name not in stages:
        raise ValueError(f"no stage {name!r} in {root / 'dvc.yaml'}")
    outs = stage_outs(stages[name])
    restore_mtimes(root)
    if _locked(root, name):
        logger.info("stage %s is in %s and changed: removing its outs, then Snakemake rebuilds them", name, LOCKFILE)
        for out in outs:
            _remove(root / out)
    else:
        logger.info(
            "stage %s is not in %s yet: Snakemake runs what it finds outdated; DVC records the outputs it keeps",
            name,
            LOCKFILE,
        )
        newer = _newer_code(root, stages, name)
        if newer:
            logger.warning(
                "stage %s: %s changed after its outputs were made; Snakemake does not track these, so outputs it "
                "finds up to date are recorded as they are. To rebuild them instead: remove them, then dvc repro %s",
                name,
                ", ".join(newer[:5]) + (f" and {len(newer) - 5} more" if len(newer) > 5 else ""),
                name,
            )
    (root / MTIMES / f"{name}.json").unlink(missing_ok=True)
    process = subprocess.Popen(list(command), cwd=root)
    # Ctrl-C reaches Snakemake too (same process group); it stops its jobs and exits, then so does this.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        code = process.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
    if code == 0:
        _record_mtimes(root, name, outs)
    return code if code >= 0 else 128 - code
