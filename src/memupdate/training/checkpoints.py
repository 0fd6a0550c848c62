"""A verl run's checkpoints: whose they are, whether a rerun resumes from them, and the export of the last one.

A verl run resumes from whatever ``<run>/checkpoints`` holds (``resume_mode: auto``). :func:`guard_verl_checkpoints`
keeps only checkpoints of this very run there, identified by :func:`verl_run_digest` (settings, the code the run
executes, data and starting model), and moves any other aside; :func:`prune_earlier_attempts` bounds what
resubmits leave behind; :func:`export_verl_checkpoint` writes the last save as ``<run>/ckpt`` (HF weights and
``manifest.json``) and refuses a checkpoint of another run. :mod:`memupdate.training.stages` runs them around
verl's trainer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from memupdate.names import MODEL_MANIFEST
from memupdate.training.tracking import data_sha256
from memupdate.utils.io import check_whole_model, sha256_file, share_like_open, weights_digest, write_json_atomic

logger = logging.getLogger(__name__)


def verl_run_record(run_dir: Path) -> dict[str, Any]:
    """Commit, config digest and data sha256s of a verl run, from the ``run_info.json`` its preparation wrote."""
    from memupdate.training.tracking import RUN_INFO

    path = run_dir / RUN_INFO
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: a verl run is prepared by memupdate.training.verl_launcher, which writes it"
        )
    info = json.loads(path.read_text(encoding="utf-8"))
    return {key: info[key] for key in ("git", "config_digest", "data_sha256")}


#: In ``<run>/checkpoints`` (verl's ``trainer.default_local_dir``): the digest of the run its checkpoints belong to.
RUN_DIGEST_FILE = "memupdate_run.json"
#: Where verl's checkpoint manager saves the model's config and tokenizer, and the whole model in Hugging Face format
#: when ``hf_model`` is among its ``save_contents``, inside a checkpoint's shard folder.
HF_MODEL_DIR = "huggingface"
#: verl's record of its last complete save, in the same folder (verl.utils.checkpoint.checkpoint_manager).
VERL_TRACKER = "latest_checkpointed_iteration.txt"
#: What a verl run writes beside its checkpoints, moved aside with them: its logs and validation generations.
RUN_OUTPUTS = ("tensorboard", "tracking.jsonl", "metrics.jsonl", "validation")
#: verl keys that say how far a run goes or how often it saves, validates and logs, not what a step does:
#: extending a run resumes it.
RESUMABLE_KEYS = (
    "trainer.total_training_steps",
    "trainer.total_epochs",
    "trainer.save_freq",
    "trainer.test_freq",
    "trainer.val_before_train",
    "trainer.logger",
    "trainer.max_actor_ckpt_to_keep",
    "trainer.max_critic_ckpt_to_keep",
)


def verl_run_digest(run_dir: Path) -> str:
    """The digest of what determines a verl run, which its checkpoints must share to be resumed or exported:
    sha256 over

    - its settings: ``resolved_config.yaml`` (when ``run_info.json``'s config digest is that file's: main_ppo)
      less :data:`RESUMABLE_KEYS`, with the run files the config names by path (agent loops, tools, memory
      environment); a served model's address and marker are left out (they change with every server start,
      the model they serve is what counts), and the run's folder and the working directory are written as
      ``<run>`` and ``<cwd>`` (a moved checkout is the same run). Without that file (verl's SFT trainer) the
      record's own config digest;
    - the code: the memupdate package the run executes (:func:`code_digest`), not the commit, so a commit that
      changes no code (a README, a config the run does not read) does not restart a run resubmitted after a
      time limit;
    - the data: ``run_info.json``'s data sha256s;
    - the starting model (:func:`model_digest`): the config names it by path, and a retrained cold start keeps it.
    """
    from memupdate.memory.environment import FILE_NAME as MEMORY_ENVIRONMENT_FILE
    from memupdate.tools.config import FILE_NAME as TOOLS_FILE
    from memupdate.training.verl_launcher import AGENT_LOOPS_FILE, RESOLVED_CONFIG

    record = verl_run_record(run_dir)
    prefixes = [(p, "<run>") for p in {os.path.abspath(run_dir), os.path.realpath(run_dir)}]
    prefixes += [(p, "<cwd>") for p in {os.path.abspath(os.getcwd()), os.path.realpath(os.getcwd())}]
    config: Any = record["config_digest"]
    model = None
    resolved = run_dir / RESOLVED_CONFIG
    if resolved.is_file() and sha256_file(resolved) == record["config_digest"]:
        import yaml

        config = yaml.safe_load(resolved.read_text(encoding="utf-8"))
        model = model_digest(str(config["actor_rollout_ref"]["model"]["path"]))
        for key in RESUMABLE_KEYS:
            *parents, leaf = key.split(".")
            node = config
            for part in parents:
                node = node.get(part) if isinstance(node, dict) else None
            if isinstance(node, dict):
                node.pop(leaf, None)
        files = {}
        for name in (AGENT_LOOPS_FILE, TOOLS_FILE, MEMORY_ENVIRONMENT_FILE):
            if (run_dir / name).is_file():
                files[name] = yaml.safe_load((run_dir / name).read_text(encoding="utf-8"))
        for entry in files.get(AGENT_LOOPS_FILE) or []:
            if isinstance(entry, dict) and isinstance(entry.get("fixed_model"), dict):
                entry["fixed_model"] = {
                    k: v for k, v in entry["fixed_model"].items() if k not in ("base_url", "marker")
                }
        config = {"config": config, "files": files}
    data = {
        role: [entry["sha256"] or entry["path"] for entry in entries]
        for role, entries in (record["data_sha256"] or {}).items()
    }
    payload = {"settings": config, "code": code_digest(), "data": data, "model": model}
    text = json.dumps(_portable(payload, prefixes), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


#: The package whose code a verl run executes (our agent loops, tools, rewards and plugins in every Ray worker).
PACKAGE_DIR = Path(__file__).resolve().parents[1]
#: What a training run never executes, relative to :data:`PACKAGE_DIR` (a package folder, or a module without its
#: .py): the evaluations, reports and benchmarks, the command line, the plan and preflight, data preparation, the
#: cold start and the in-process rollouts of the evaluations. A change to them keeps a run's checkpoints: a fix to
#: an evaluation between two resubmits of a multi-day run must not restart it. tests/training/test_checkpoints.py
#: checks that a run's entry points (the verl plugin, the stages, the launcher) import none of them.
NOT_RUN = (
    "bench",
    "cli",
    "data/headroom",
    "data/hotpotqa",
    "dvc_stages",
    "eval",
    "models",
    "plan",
    "preflight",
    # The in-process rollouts; rollout/loops.py writes the trainer's agent loop too.
    "rollout/config",
    "rollout/episodes",
    "rollout/workers",
    "serving/hf_generate",
    "serving/lifecycle",
    "training/demonstrations",
    "training/ingestion_expert",
    "training/memagent_expert",
    "training/sft",
    "training/verl_sft",
    "workflow_dag",
)


def code_digest(root: Path | None = None) -> str:
    """sha256 over the source and packaged configs a training run executes: path and content of every .py, .yaml,
    .jinja and .txt file under ``root`` (default :data:`PACKAGE_DIR`) but those of :data:`NOT_RUN`."""
    root = root or PACKAGE_DIR
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".yaml", ".jinja", ".txt") and p.is_file()):
        relative = path.relative_to(root).as_posix()
        if any(relative.startswith(f"{part}/") or relative == f"{part}.py" for part in NOT_RUN):
            continue
        digest.update(f"{relative}\0{sha256_file(path)}\0".encode())
    return digest.hexdigest()


def model_digest(model: str) -> str:
    """What identifies a run's starting model: a folder's manifest (a prepared model's ``memupdate_model.json``,
    with its source and commit; an exported checkpoint's ``manifest.json``, with its run and step) and
    ``config.json``, else every file of the folder; a hub id as it is. A cold start retrained into the same path is
    another model."""
    path = Path(model)
    if not path.is_dir():
        return model
    named = [path / name for name in (MODEL_MANIFEST, "manifest.json", "config.json") if (path / name).is_file()]
    if len(named) < 2:  # no manifest: the weights themselves
        return data_sha256(path)
    return hashlib.sha256("".join(f"{p.name}\0{sha256_file(p)}\n" for p in named).encode()).hexdigest()


def _portable(value: Any, prefixes: list[tuple[str, str]]) -> Any:
    """``value`` with every string under one of ``prefixes``' folders written with its placeholder instead."""
    if isinstance(value, dict):
        return {key: _portable(item, prefixes) for key, item in value.items()}
    if isinstance(value, list):
        return [_portable(item, prefixes) for item in value]
    if isinstance(value, str):
        # The longest folder first: the run's folder lies inside the working directory.
        for prefix, placeholder in sorted(prefixes, key=lambda p: -len(p[0])):
            if value == prefix or value.startswith(prefix.rstrip("/") + "/"):
                return placeholder + value[len(prefix.rstrip("/")) :]
    return value


def checkpoint_digest(checkpoints: Path) -> str | None:
    """The run digest recorded in a checkpoint folder (None: none recorded, e.g. one written before the record)."""
    path = checkpoints / RUN_DIGEST_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8")).get("run_digest")


def guard_verl_checkpoints(run_dir: Path, digest: str | None = None) -> Path | None:
    """Before verl starts: keep ``<run>/checkpoints`` for verl to resume (``resume_mode: auto``) only if they
    are this run's (its :func:`verl_run_digest`, or ``digest``); otherwise move them aside, with the logs of
    the run they belong to (:data:`RUN_OUTPUTS`), to ``<name>.stale-<their digest, 12 characters>-<time>``:
    never deleted, and verl starts afresh. Then record this run's digest in the folder. Returns the moved
    checkpoint folder, or None."""
    from memupdate.training.verl_launcher import CHECKPOINT_DIR

    digest = digest or verl_run_digest(run_dir)
    checkpoints = run_dir / CHECKPOINT_DIR
    recorded = checkpoint_digest(checkpoints)
    held = checkpoints.is_dir() and any(p.name != RUN_DIGEST_FILE for p in checkpoints.iterdir())
    moved = None
    if held and recorded != digest:
        stamp, n = time.strftime("%Y%m%d-%H%M%S"), 0
        while True:
            suffix = f".stale-{(recorded or 'unknown')[:12]}-{stamp}{f'-{n}' if n else ''}"
            if not any((run_dir / f"{name}{suffix}").exists() for name in (CHECKPOINT_DIR, *RUN_OUTPUTS)):
                break
            n += 1
        names = [name for name in (CHECKPOINT_DIR, *RUN_OUTPUTS) if (run_dir / name).exists()]
        for name in names:
            (run_dir / name).rename(run_dir / f"{name}{suffix}")
        moved = run_dir / f"{CHECKPOINT_DIR}{suffix}"
        logger.warning(
            "%s holds checkpoints of another run (run digest %s; this run's is %s: its settings, code or data "
            "differ): moved %s aside with the suffix %s (nothing deleted) and verl starts afresh",
            checkpoints,
            recorded or f"unknown, no {RUN_DIGEST_FILE}",
            digest,
            ", ".join(names),
            suffix,
        )
    elif held:
        logger.info(
            "%s holds checkpoints of this very run (run digest %s): kept for verl to resume from", checkpoints, digest
        )
    checkpoints.mkdir(parents=True, exist_ok=True)
    write_json_atomic(checkpoints / RUN_DIGEST_FILE, {"run_digest": digest})
    return moved


def prune_earlier_attempts(checkpoints: Path, keep: int | None) -> list[Path]:
    """Before a resumed run: remove the saves an earlier attempt left beyond the newest ``keep - 1`` (its last
    complete save, the one verl resumes from, always stays), and return them. verl 0.9.1 keeps the list of saves it
    prunes in memory, empty at each start, so without this every resubmit of a long run would leave its
    ``trainer.max_actor_ckpt_to_keep`` saves behind for good (MemAgent's three resubmits: about 0.75 TB instead of
    0.2); with it the folder holds at most ``keep`` saves of the running attempt and ``keep - 1`` (at least the
    resume point) of earlier ones. ``keep`` None or below 1 keeps everything, as verl does. Saves after the last
    complete one (cut short) are verl's to overwrite.

    >>> import tempfile; c = Path(tempfile.mkdtemp())
    >>> for step in (25, 50, 75, 100): (c / f"global_step_{step}").mkdir()
    >>> _ = (c / VERL_TRACKER).write_text("75")
    >>> [p.name for p in prune_earlier_attempts(c, keep=2)], sorted(p.name for p in c.glob("global_step_*"))
    (['global_step_25', 'global_step_50'], ['global_step_100', 'global_step_75'])
    """
    last = last_checkpoint(checkpoints)
    if last is None or not keep or keep < 1:
        return []
    step = _step_of(last)
    earlier = sorted((p for p in checkpoints.glob("global_step_*") if _step_of(p) <= step), key=_step_of)
    removed = earlier[: max(0, len(earlier) - max(keep - 1, 1))]
    for save in removed:
        logger.info("removing %s: an earlier attempt's save beyond trainer.max_actor_ckpt_to_keep (%d)", save, keep)
        shutil.rmtree(save)
    return removed


def _step_of(save: Path) -> int:
    return int(save.name.rsplit("_", 1)[1])


def last_checkpoint(checkpoints: Path) -> Path | None:
    """The checkpoint verl saved last: the one its tracker file names (a ``global_step_*`` folder without it
    may be a save cut short), else the highest ``global_step_*``; None without any."""
    tracker = checkpoints / VERL_TRACKER
    if tracker.is_file():
        step = checkpoints / f"global_step_{tracker.read_text().strip()}"
        if not step.is_dir():
            # An older step would be exported as if it were the last, without a word.
            raise FileNotFoundError(
                f"{tracker} names {step.name}, which is not there: the save was removed or cut short; run the stage "
                "again (it resumes from the save that is there)"
            )
        return step
    steps = sorted(checkpoints.glob("global_step_*"), key=_step_of)
    return steps[-1] if steps else None


def export_verl_checkpoint(
    run_dir: Path, base_model: str, *, shards: str | None = "actor", kind: str | None = None
) -> Path:
    """Export the last checkpoint (:func:`last_checkpoint`; main_ppo's shards lie in its ``actor``, the SFT
    trainer's in the folder itself: ``shards=None``) to ``<run_dir>/ckpt``: the whole model its workers saved
    (:data:`HF_MODEL_DIR`, on CPU), else its FSDP shards merged by verl's model merger (HF format + manifest, with the
    run's commit, config digest and data sha256s, and ``kind`` if given), and write ``<run_dir>/metrics.jsonl``
    from verl's log. A checkpoint of another run (:func:`checkpoint_digest` not this run's
    :func:`verl_run_digest`) is refused."""
    checkpoints = run_dir / "checkpoints"
    last = last_checkpoint(checkpoints)
    if last is None:
        raise FileNotFoundError(f"verl wrote no checkpoint under {checkpoints}; see the training log")
    digest, recorded = verl_run_digest(run_dir), checkpoint_digest(checkpoints)
    if recorded != digest:
        raise RuntimeError(
            f"{checkpoints} holds checkpoints of run {recorded or f'unknown (no {RUN_DIGEST_FILE})'}, not of this "
            f"run ({digest}: its settings, code or data differ); refusing to export {last.name} as this run's "
            "checkpoint. Run the stage again: the checkpoints are moved aside and verl trains afresh"
        )
    from memupdate.training.tracking import metrics_from_verl

    record = verl_run_record(run_dir)  # before the merge, which takes minutes
    metrics_from_verl(run_dir)
    final, tmp = run_dir / "ckpt", run_dir / ".ckpt.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shard_dir = last / shards if shards else last
    saved = shard_dir / HF_MODEL_DIR
    if any(saved.glob("*.safetensors")):
        # The workers saved the whole model (verl's `hf_model`, on CPU): the checkpoint as they wrote it.
        shutil.copytree(saved, tmp)
    else:
        merge = [sys.executable, "-m", "verl.model_merger", "merge", "--backend", "fsdp"]
        subprocess.run([*merge, "--local_dir", str(shard_dir), "--target_dir", str(tmp)], check=True)
    # verl's workers write the weights 0600: the exported checkpoint is shared as the user's umask says.
    for path in [tmp, *tmp.rglob("*")]:
        share_like_open(path)
    try:
        check_whole_model(tmp)
    except ValueError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(f"{last} is not a whole model, so it is not exported: {err}") from None
    step = int(last.name.rsplit("_", 1)[1])
    # The weights' own digest: what the evaluations key their saved predictions on (memupdate.utils.io).
    manifest = {
        "backend": "verl",
        **({"kind": kind} if kind else {}),
        "step": step,
        "base_model": base_model,
        "weights": weights_digest(tmp),
    }
    write_json_atomic(tmp / "manifest.json", {**manifest, **record})
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final
