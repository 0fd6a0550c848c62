"""A verl run's checkpoints (memupdate.training.checkpoints): resumed only by the same run (settings, code, data,
starting model), moved aside otherwise, pruned across resubmits, exported from the last complete save."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from memupdate.training import checkpoints
from memupdate.utils.io import weights_digest


def prepared_run(run_dir, *, lr=1e-6, steps=10, fixed_url="http://n1:8000/v1", commit="a" * 40):
    """What prepare_main_ppo leaves in a run folder, in small: resolved_config.yaml with the run's paths,
    run_info.json whose config digest is that file's sha256, and agent_loops.yaml with a served model."""
    from memupdate.training.tracking import run_info, write_run_info
    from memupdate.utils.io import sha256_file

    run_dir.mkdir(parents=True, exist_ok=True)
    config = {
        "actor_rollout_ref": {"actor": {"optim": {"lr": lr}}, "model": {"path": str(run_dir.parent / "model")}},
        "trainer": {
            "total_training_steps": steps,
            "save_freq": 5,
            "default_local_dir": str(run_dir / "checkpoints"),
            "logger": ["console", "file"],
        },
    }
    (run_dir / "resolved_config.yaml").write_text(yaml.safe_dump(config))
    loops = [{"name": "memupdate_agent", "fixed_model": {"base_url": fixed_url, "model": "exp-stage1"}}]
    (run_dir / "agent_loops.yaml").write_text(yaml.safe_dump(loops))
    record = {"git": {"commit": commit, "dirty": False}, "data_sha256": {"train_files": [{"path": "t", "sha256": "1"}]}}
    write_run_info(run_dir, run_info(sha256_file(run_dir / "resolved_config.yaml"), record, backend="verl"))
    return run_dir


def verl_saves(run_dir, step):
    """A checkpoint as verl 0.9.1's trainer writes it (trainer_base._save_checkpoint, FSDP checkpoint manager)."""
    folder = run_dir / "checkpoints" / f"global_step_{step}"
    (folder / "actor" / "huggingface").mkdir(parents=True)
    for name in ("model", "optim", "extra_state"):
        (folder / "actor" / f"{name}_world_size_1_rank_0.pt").write_bytes(b"shard")
    (folder / "actor" / "huggingface" / "config.json").write_text("{}")
    (folder / "data.pt").write_bytes(b"loader")
    (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").write_text(str(step))
    return folder


def test_a_rerun_of_the_same_verl_run_resumes_from_its_checkpoints(tmp_path, monkeypatch):
    (tmp_path / "checkout").mkdir()
    monkeypatch.chdir(tmp_path / "checkout")
    run_dir = prepared_run(Path("results/exp/stage1").absolute())
    assert checkpoints.guard_verl_checkpoints(run_dir) is None  # a fresh run: the folder records its digest
    saved = verl_saves(run_dir, 5)
    # Killed, resubmitted: prepared again with the same settings, code and data; extending the run (more
    # steps) and a new address of the served model keep it the same run.
    prepared_run(run_dir, steps=20, fixed_url="http://n7:8123/v1")
    assert checkpoints.guard_verl_checkpoints(run_dir) is None
    assert (saved / "actor" / "model_world_size_1_rank_0.pt").is_file()
    assert checkpoints.last_checkpoint(run_dir / "checkpoints") == saved
    # So does a checkout moved elsewhere (its paths are written relative to it).
    (tmp_path / "checkout").rename(tmp_path / "moved")
    monkeypatch.chdir(tmp_path / "moved")
    moved = prepared_run(Path("results/exp/stage1").absolute(), steps=20)
    assert checkpoints.verl_run_digest(moved) == checkpoints.checkpoint_digest(moved / "checkpoints")


def test_checkpoints_of_another_configuration_are_moved_aside_not_resumed(tmp_path, caplog):
    run_dir = prepared_run(tmp_path / "stage1")
    checkpoints.guard_verl_checkpoints(run_dir)
    old = checkpoints.verl_run_digest(run_dir)
    verl_saves(run_dir, 5)
    (run_dir / "tensorboard").mkdir()
    (run_dir / "tracking.jsonl").write_text('{"step": 5, "data": {}}\n')
    prepared_run(run_dir, lr=3e-6)  # a changed setting
    new = checkpoints.verl_run_digest(run_dir)
    assert new != old
    with caplog.at_level("WARNING", logger=checkpoints.__name__):
        moved = checkpoints.guard_verl_checkpoints(run_dir)
    assert moved is not None and moved.name.startswith(f"checkpoints.stale-{old[:12]}-")
    # Moved, never deleted, with the logs of the run they belong to; verl finds an empty folder and starts afresh.
    assert (moved / "global_step_5" / "actor" / "model_world_size_1_rank_0.pt").is_file()
    assert (moved / "latest_checkpointed_iteration.txt").read_text() == "5"
    suffix = moved.name.removeprefix("checkpoints")
    assert (run_dir / f"tensorboard{suffix}").is_dir() and (run_dir / f"tracking.jsonl{suffix}").is_file()
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [checkpoints.RUN_DIGEST_FILE]
    assert checkpoints.checkpoint_digest(run_dir / "checkpoints") == new
    assert old in caplog.text and new in caplog.text and "moved" in caplog.text


def test_a_code_change_moves_checkpoints_aside_and_a_commit_without_one_does_not(tmp_path, monkeypatch):
    """The code is the package the run executes: a commit of a README must not restart a resubmitted run."""
    package = tmp_path / "package"
    package.mkdir()
    (package / "loop.py").write_text("STEPS = 1\n")
    monkeypatch.setattr(checkpoints, "PACKAGE_DIR", package)
    run_dir = prepared_run(tmp_path / "stage1")
    checkpoints.guard_verl_checkpoints(run_dir)
    verl_saves(run_dir, 5)
    prepared_run(run_dir, commit="b" * 40)
    assert checkpoints.guard_verl_checkpoints(run_dir) is None
    # An evaluation fixed between two resubmits: training never runs it (checkpoints.NOT_RUN).
    (package / "eval").mkdir()
    (package / "eval" / "report.py").write_text("ROUND = 1\n")
    prepared_run(run_dir, commit="c" * 40)
    assert checkpoints.guard_verl_checkpoints(run_dir) is None
    (package / "eval" / "report.py").write_text("ROUND = 2\n")
    prepared_run(run_dir, commit="d" * 40)
    assert checkpoints.guard_verl_checkpoints(run_dir) is None
    (package / "loop.py").write_text("STEPS = 2\n")
    prepared_run(run_dir, commit="e" * 40)
    assert checkpoints.guard_verl_checkpoints(run_dir) is not None


def test_what_a_training_run_imports_is_in_its_resume_key(repo_root):
    """The code digest leaves out checkpoints.NOT_RUN: a run's entry points (verl's plugin, loaded by every Ray worker;
    the job's stages and launcher; the rollout server) must import none of it, else a change to it could alter a
    resumed run unseen."""
    entry = "memupdate.verl_plugin, memupdate.training.stages, memupdate.training.verl_launcher, memupdate.serving.rollout_server"
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys, {entry}; print(' '.join(m for m in sys.modules if m.startswith('memupdate')))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert "memupdate.verl_plugin" in out and "memupdate.rewards.manager" in out
    left_out = {f"memupdate.{part.replace('/', '.')}" for part in checkpoints.NOT_RUN}
    imported = [m for m in out if any(m == x or m.startswith(x + ".") for x in left_out)]
    assert not imported, f"a training run imports {imported}: take them out of checkpoints.NOT_RUN"


def test_a_cold_start_retrained_into_the_same_folder_is_another_run(tmp_path):
    """The config names the starting model by path; a cold start retrained there is another model."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "manifest.json").write_text('{"step": 14}')
    run_dir = prepared_run(tmp_path / "stage1")
    checkpoints.guard_verl_checkpoints(run_dir)
    verl_saves(run_dir, 5)
    assert checkpoints.guard_verl_checkpoints(run_dir) is None
    (model / "manifest.json").write_text('{"step": 28}')
    assert checkpoints.guard_verl_checkpoints(run_dir) is not None


def test_checkpoints_without_a_recorded_digest_are_moved_aside(tmp_path):
    run_dir = prepared_run(tmp_path / "stage1")
    verl_saves(run_dir, 5)  # written before runs recorded their digest: whose they are is unknown
    moved = checkpoints.guard_verl_checkpoints(run_dir)
    assert moved.name.startswith("checkpoints.stale-unknown-") and (moved / "global_step_5").is_dir()


def test_the_export_refuses_a_checkpoint_of_another_run(tmp_path):
    run_dir = prepared_run(tmp_path / "stage1")
    checkpoints.guard_verl_checkpoints(run_dir)
    verl_saves(run_dir, 5)
    prepared_run(run_dir, lr=3e-6)  # prepared anew, but verl was not run through guard_verl_checkpoints
    with pytest.raises(RuntimeError, match="refusing to export global_step_5"):
        checkpoints.export_verl_checkpoint(run_dir, "base")
    assert not (run_dir / "ckpt").exists()


def test_the_export_copies_the_model_the_workers_saved_whole(tmp_path):
    """On CPU verl's workers save the model in Hugging Face format with each checkpoint (cpu.yaml's hf_model): the
    export is that folder, with the run's manifest, and no model merger runs (its shards here are not real)."""
    from safetensors.torch import load_file, save_file

    run_dir = prepared_run(tmp_path / "stage1")
    checkpoints.guard_verl_checkpoints(run_dir)
    saved = verl_saves(run_dir, 5) / "actor" / checkpoints.HF_MODEL_DIR
    save_file({"w": torch.ones(2)}, saved / "model.safetensors")
    (saved / "model.safetensors").chmod(0o600)  # as verl's workers write it
    (run_dir / "tracking.jsonl").write_text(json.dumps({"step": 5, "data": {"critic/score/mean": 0.5}}) + "\n")
    old = os.umask(0o022)
    try:
        ckpt = checkpoints.export_verl_checkpoint(run_dir, "base")
    finally:
        os.umask(old)
    assert torch.equal(load_file(ckpt / "model.safetensors")["w"], torch.ones(2))
    # The checkpoint is shared as the user's umask says, not private as the workers wrote it.
    assert {oct(p.stat().st_mode & 0o777) for p in ckpt.iterdir()} == {"0o644"} and oct(
        ckpt.stat().st_mode & 0o777
    ) == "0o755"
    assert (ckpt / "config.json").read_text() == "{}"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["step"] == 5 and manifest["base_model"] == "base" and manifest["git"]["commit"] == "a" * 40
    assert not (run_dir / ".ckpt.tmp").exists()


def test_the_export_refuses_a_checkpoint_that_is_not_whole(tmp_path):
    """Issue 58: a shard cut short, or a tracker naming a save that is not there, is never exported (an older step
    was once exported in its place without a word); a whole one carries its weights' digest in the manifest."""
    from safetensors.torch import save_file

    run_dir = prepared_run(tmp_path / "stage1")
    checkpoints.guard_verl_checkpoints(run_dir)
    saved = verl_saves(run_dir, 5) / "actor" / checkpoints.HF_MODEL_DIR
    save_file({"w": torch.ones(64)}, saved / "model.safetensors")
    (run_dir / "tracking.jsonl").write_text(json.dumps({"step": 5, "data": {"critic/score/mean": 0.5}}) + "\n")
    whole = (saved / "model.safetensors").read_bytes()
    (saved / "model.safetensors").write_bytes(whole[:-100])
    with pytest.raises(
        ValueError, match=r"global_step_5 is not a whole model.*model.safetensors: \d+ bytes, its header"
    ):
        checkpoints.export_verl_checkpoint(run_dir, "base")
    assert not (run_dir / "ckpt").exists() and not (run_dir / ".ckpt.tmp").exists()
    (saved / "model.safetensors").write_bytes(whole)
    manifest = json.loads((checkpoints.export_verl_checkpoint(run_dir, "base") / "manifest.json").read_text())
    assert manifest["weights"] == weights_digest(saved)
    (run_dir / "checkpoints" / checkpoints.VERL_TRACKER).write_text("10")
    with pytest.raises(FileNotFoundError, match="names global_step_10, which is not there"):
        checkpoints.export_verl_checkpoint(run_dir, "base")


def test_the_export_takes_the_checkpoint_verl_saved_last(tmp_path):
    saves = tmp_path / "checkpoints"
    verl_saves(tmp_path, 5)
    (saves / "global_step_10" / "actor").mkdir(parents=True)  # a save cut short: the tracker says 5
    assert checkpoints.last_checkpoint(saves) == saves / "global_step_5"
    (saves / "latest_checkpointed_iteration.txt").unlink()
    assert checkpoints.last_checkpoint(saves) == saves / "global_step_10"
    assert checkpoints.last_checkpoint(tmp_path / "none") is None
