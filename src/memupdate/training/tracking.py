"""What a training run records beside its metrics.

verl's trainer logs through its :class:`verl.utils.tracking.Tracking` (``trainer.logger``: console, tensorboard,
file, wandb, mlflow, ...). The offline default needs no account; a tracker's keys (``WANDB_API_KEY``,
``MLFLOW_TRACKING_URI``, ...) come from the user's environment only.

Every run writes ``<run>/run_info.json`` (:func:`run_info`): the git commit of the code (and whether the
checkout had uncommitted changes), the digest of the run's configuration and the sha256 of each data
file, so a curve in a tracker can be traced to the code, the settings and the data that made it. Commit and
digest go into the checkpoint's ``manifest.json``; ``<run>/metrics.jsonl`` (:func:`metrics_from_verl`) is what
the report's training curves and DVC read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from memupdate.utils.io import portable_path, sha256_file, write_json_atomic, write_text_atomic

logger = logging.getLogger(__name__)

PROJECT = "memupdate"
RUN_INFO = "run_info.json"
#: Event files of the run's tensorboard backend, under the run directory.
TENSORBOARD_DIR = "tensorboard"
#: The ``file`` backend's JSON lines, from which ``metrics.jsonl`` is made.
TRACKING_FILE = "tracking.jsonl"

#: The package's checkout: src/memupdate/training/ -> the repository root.
REPO_ROOT = Path(__file__).resolve().parents[3]


def experiment_name(run_dir: str | os.PathLike) -> str:
    """``<experiment>-<stage dir>`` of ``results/<experiment>/<stage>``: one name per run in every tracker.

    >>> experiment_name("results/smoke/stage1")
    'smoke-stage1'
    """
    return "-".join(Path(os.path.abspath(run_dir)).parts[-2:])


def git_state(root: str | os.PathLike = REPO_ROOT) -> dict[str, Any]:
    """``{"commit", "dirty"}`` of the checkout holding the code; ``commit`` is None, with a ``reason``, when
    the code is not a git checkout (an installed wheel) or git is missing. ``dirty`` says the code differs
    from the commit (modified or untracked files), so the commit alone does not reproduce the run."""

    def git(*args: str) -> str:
        # --no-optional-locks: only read; status would otherwise refresh the index of a checkout in use.
        return subprocess.run(
            ["git", "--no-optional-locks", "-C", os.fspath(root), *args],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        changes = git("status", "--porcelain")
    except FileNotFoundError:
        return {"commit": None, "dirty": None, "reason": "git is not installed"}
    except subprocess.CalledProcessError as err:
        why = err.stderr.strip().splitlines()[-1] if err.stderr.strip() else f"git exited with {err.returncode}"
        return {"commit": None, "dirty": None, "reason": f"{root} is not a git checkout ({why})"}
    return {"commit": commit, "dirty": bool(changes.strip())}


def data_sha256(path: str | os.PathLike) -> str:
    """sha256 of a data file; of a folder (an embedding cache), sha256 over its files' relative paths and
    sha256s, in path order."""
    path = Path(path)
    if not path.is_dir():
        return sha256_file(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(f"{file.relative_to(path).as_posix()}\0{sha256_file(file)}\n".encode())
    return digest.hexdigest()


def run_record(data: Mapping[str, str | os.PathLike | Iterable[str | os.PathLike] | None]) -> dict[str, Any]:
    """What made a run besides its settings: ``git`` (:func:`git_state`) and ``data_sha256``, as
    ``{role: [{"path", "sha256"}]}`` for each role given (train files, memories, embeddings; None = not used).
    A path that does not exist here (a verl run prepared away from its data) is recorded with sha256 None."""
    hashes: dict[str, list[dict[str, str | None]]] = {}
    for role, paths in data.items():
        if paths is None:
            continue
        paths = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
        hashes[role] = []
        for path in paths:
            if not os.path.exists(path):
                logger.warning("%s %s does not exist here: its sha256 is not recorded", role, path)
            digest = data_sha256(path) if os.path.exists(path) else None
            hashes[role].append({"path": portable_path(path), "sha256": digest})
    return {"git": git_state(), "data_sha256": hashes}


def run_info(config_digest: str, record: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    """The record of one run (``run_info.json``): :func:`run_record`'s, the digest of its configuration, and
    ``extra`` (backend, base model)."""
    return {**record, "config_digest": config_digest, **extra}


def write_run_info(run_dir: str | os.PathLike, info: Mapping[str, Any]) -> Path:
    path = Path(run_dir) / RUN_INFO
    write_json_atomic(path, dict(info))
    git = info.get("git", {})
    if git.get("commit") is None:
        logger.warning("run %s records no commit: %s", run_dir, git.get("reason"))
    elif git.get("dirty"):
        logger.warning("run %s: the code at %s has uncommitted changes (recorded as dirty)", run_dir, git["commit"])
    return path


#: Our metrics.jsonl keys and verl's names for them (verl.trainer.ppo.metric_utils).
VERL_METRICS = {
    "reward_mean": "critic/score/mean",
    "reward_min": "critic/score/min",
    "reward_max": "critic/score/max",
    "num_turns_mean": "num_turns/mean",
    "response_tokens_mean": "response_length/mean",
    "kl": "actor/kl_loss",
}
#: verl's validation reward at the steps it validates (``trainer.test_freq``, ``val_before_train`` at step 0):
#: ``val-core/<data source>/reward/mean@<n>`` (``_val_metrics_update`` of verl 0.9.1's trainers, v1 trainer_base's too).
HELDOUT_REWARD = re.compile(r"val-core/[^/]+/reward/mean@\d+")


def heldout_reward(data: Mapping[str, Any]) -> float | None:
    """The held-out (validation) rows' mean reward in one verl record, None where the step did not validate. The
    experiments' rows have one data source; were there several, their means would be averaged.

    >>> heldout_reward({"val-core/locomo/reward/mean@1": 0.5, "critic/score/mean": 0.1})
    0.5
    >>> heldout_reward({"critic/score/mean": 0.1}) is None
    True
    """
    values = [value for key, value in data.items() if HELDOUT_REWARD.fullmatch(key)]
    return sum(values) / len(values) if values else None


#: verl's validation generations, one JSONL per validated step (``trainer.validation_data_dir``; the launcher's
#: ``validation/``).
VALIDATION_DIR = "validation"


def validated_questions(dump: Path) -> int:
    """How many questions (sessions) verl's validation scored at a step, from its generations dump: verl averages
    over the trajectories that finished and drops a failed one (a request that timed out) without a word.
    A multi-turn trajectory's rows are keyed ``<uid>_<session>_<turn>``.

    >>> import tempfile; d = Path(tempfile.mkdtemp()) / "0.jsonl"
    >>> _ = d.write_text("".join(json.dumps({"uid": u}) + "\\n" for u in ("a_0_0", "a_0_1", "b_0_0", "c")))
    >>> validated_questions(d)
    3
    """
    sessions = set()
    for line in dump.read_text(encoding="utf-8").splitlines():
        if line.strip():
            key = str(json.loads(line)["uid"])
            parts = key.rsplit("_", 2)
            sessions.add("_".join(parts[:2]) if len(parts) == 3 else key)
    return len(sessions)


def metrics_from_verl(run_dir: str | Path) -> Path:
    """``<run>/metrics.jsonl`` from verl's ``file`` backend (``<run>/tracking.jsonl``): one record per step with our
    names for the metrics the report's training curves read; every verl metric is kept under ``verl``.

    >>> import json, tempfile; run = Path(tempfile.mkdtemp())
    >>> _ = (run / TRACKING_FILE).write_text(json.dumps({"step": 1, "data": {"critic/score/mean": 0.25}}) + "\\n")
    >>> json.loads((metrics_from_verl(run)).read_text())["reward_mean"]
    0.25
    """
    run_dir = Path(run_dir)
    source = run_dir / TRACKING_FILE
    if not source.is_file():
        raise FileNotFoundError(
            f"{source} is missing: verl's `file` logger writes it, so trainer.logger must include file"
        )
    rows = []
    for number, line in enumerate(source.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step, data = record["step"], record["data"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"{source}, line {number}: not a verl file-logger record ({err})") from err
        ours = {key: data[theirs] for key, theirs in VERL_METRICS.items() if theirs in data}
        if (heldout := heldout_reward(data)) is not None:
            ours["heldout_reward_mean"] = heldout
            dump = run_dir / VALIDATION_DIR / f"{step}.jsonl"
            if dump.is_file():
                ours["heldout_questions"] = validated_questions(dump)
        rows.append(json.dumps({"step": step, **ours, "verl": data}))
    target = run_dir / "metrics.jsonl"
    write_text_atomic(target, "".join(row + "\n" for row in rows))
    return target
