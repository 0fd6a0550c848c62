"""Atomic writes: an artifact appears whole or not at all, with the mode the user's umask gives (issue 37); the paths it records."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys

import pytest

from memupdate.memory.cache import EmbeddingCache
from memupdate.utils.io import (
    TooDeepError,
    atomic_outputs,
    portable_path,
    write_json_atomic,
    write_text_atomic,
    yaml_load_strict,
)


@pytest.fixture
def group_umask():
    """A shared group's umask (0o002: group-writable), set back afterwards."""
    old = os.umask(0o002)
    yield 0o002
    os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_atomically_written_files_and_folders_get_the_users_umask_not_a_temporary_files_0600(tmp_path, group_umask):
    write_json_atomic(tmp_path / "report.json", {"f1": 0.5})
    write_text_atomic(tmp_path / "report.md", "# report\n")
    with atomic_outputs({"rows": tmp_path / "rows.txt", "summary": tmp_path / "summary.json"}) as tmp:
        tmp["rows"].write_text("a\n")
        tmp["summary"].write_text("{}\n")
    files = ["report.json", "report.md", "rows.txt", "summary.json"]
    assert {name: mode(tmp_path / name) for name in files} == dict.fromkeys(files, 0o664)

    cache = EmbeddingCache(tmp_path / "cache", model_name="m", dim=4).save()
    assert mode(cache) == 0o775
    assert {p.name: mode(p) for p in cache.iterdir()} == {p.name: 0o664 for p in cache.iterdir()}
    assert not list(tmp_path.glob(".*.tmp")), "a temporary file was left"


def test_a_sigterm_during_an_atomic_write_leaves_no_temporary_file(tmp_path):
    """Snakemake stops its jobs, and Slurm cancels them, with SIGTERM: the job exits through its cleanups (issue 37)."""
    script = (
        "import sys, time\n"
        "from memupdate.utils.io import atomic_path\n"
        "from memupdate.utils.logging import setup_logging\n"
        "setup_logging()\n"
        "with atomic_path(sys.argv[1]) as tmp:\n"
        "    tmp.write_text('half')\n"
        "    print('writing', flush=True)\n"
        "    time.sleep(300)\n"
    )
    job = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path / "out.json")], stdout=subprocess.PIPE, text=True
    )
    assert job.stdout.readline() == "writing\n"
    job.send_signal(signal.SIGTERM)
    # Generous: one CI run on its two busy cores (the quick tests on four workers) saw no exit within 30 s.
    assert job.wait(timeout=120) == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []


def test_artifacts_record_paths_inside_the_repository_relative_and_others_as_given(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    (repo / "results" / "models").mkdir(parents=True)
    monkeypatch.chdir(repo)
    assert portable_path(repo / "results" / "models" / "m") == "results/models/m"
    # A sibling whose name starts like the repository's is outside it.
    assert portable_path(tmp_path / "repo-old" / "m") == str(tmp_path / "repo-old" / "m")
    assert portable_path("/scratch/hf/hub/m") == "/scratch/hf/hub/m"


def test_a_model_folder_is_whole_only_with_a_readable_config_and_every_shard_complete(tmp_path):
    """Issue 58: what the export and the servers refuse (memupdate.utils.io.check_whole_model)."""
    import torch
    from safetensors.torch import save_file

    from memupdate.utils.io import check_whole_model

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    for i in (1, 2):
        save_file({f"w{i}": torch.ones(8)}, model / f"model-0000{i}-of-00002.safetensors")
    index = {"weight_map": {"w1": "model-00001-of-00002.safetensors", "w2": "model-00002-of-00002.safetensors"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    check_whole_model(model)
    (model / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="names 1 shard.s. that are not there: model-00002-of-00002.safetensors"):
        check_whole_model(model)
    (model / "model-00002-of-00002.safetensors").write_bytes(b"\x00" * 8)
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors: not a readable safetensors file"):
        check_whole_model(model)
    (model / "config.json").write_text("")
    with pytest.raises(ValueError, match="config.json: not a readable model config"):
        check_whole_model(model)
    # A checkpoint's huggingface/ folder with its config and tokenizer but no weights at all.
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    for shard in model.glob("*.safetensors*"):
        shard.unlink()
    with pytest.raises(ValueError, match=r"model: no weights \(\*.safetensors or \*.bin\)"):
        check_whole_model(model)


def test_yaml_nested_past_the_parsers_reach_names_the_file(tmp_path):
    """A RecursionError traceback before (issue 58): a config file is read with yaml_load_strict."""
    path = tmp_path / "config.yaml"
    path.write_text("a: " + "[" * 5_000 + "]" * 5_000 + "\n")
    with pytest.raises(TooDeepError, match="config.yaml: nested deeper than the parser can read"):
        yaml_load_strict(path)
