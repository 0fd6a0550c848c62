"""The preflight (issue 35), on a CPU machine: CUDA, NCCL and flash-attn fail with their fixes, models resolve
offline or name their download, the disk check names the folder and the numbers, and the command, the file run
alone and the Snakemake rule all fail the way a user sees it."""

import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from memupdate.cli import main
from memupdate.preflight import (
    PACKAGED_EMBEDDING,
    Need,
    all_reduce,
    check_cuda,
    check_disk,
    check_driver,
    check_flash_attn,
    check_nccl,
    check_need,
    estimate_need,
    flash_attn_wheel,
    read_config,
    target_needs,
    verl_pin,
)
from memupdate.settings import DEFAULT_EMBEDDING_MODEL

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
PREFLIGHT_PY = Path(__file__).resolve().parents[1] / "src" / "memupdate" / "preflight.py"


@pytest.fixture()
def hf_home(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face home: nothing is cached."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return tmp_path / "hf"


def hf_model(name: str, source: str) -> Need:
    return Need(name=f"model {name}", kind="hf", setting=f"models.{name}.name_or_path", source=source, key=name)


@cpu_only
def test_cuda_and_nccl_fail_on_a_cpu_machine_with_their_fixes():
    cuda, nccl = check_cuda(), check_nccl()
    assert not cuda.ok and torch.__version__ in cuda.detail
    assert "pip install -e '.[gpu]'" in cuda.fix or "GPU node" in cuda.fix
    assert not nccl.ok and "NCCL" in nccl.detail and nccl.fix


def test_the_nccl_checks_all_reduce_runs_one_process_per_rank():
    """The NCCL check's collective, here over gloo on CPU (on a GPU node it runs over NCCL, a rank per GPU)."""
    error, seconds = all_reduce(2, "gloo")
    assert error is None and seconds > 0


@cpu_only
def test_an_all_reduce_whose_ranks_fail_names_each_and_why():
    error, _ = all_reduce(2, "nccl")
    assert error.startswith("rank 0 exited with 1: ") and "; rank 1 exited with 1: " in error, error


#: The wheel verl 0.9.1's flash-attn-cu130torch211 extra names for CPython 3.12 (verl's [tool.uv.sources]), and its
#: CPython 3.11 sibling of the same release.
PREBUILT = "https://github.com/mjun0812/flash-attention-prebuild-wheels/releases/download/v0.9.4/"


@pytest.fixture()
def gpu_torch(monkeypatch):
    """The gpu extra's torch as the checks read it: 2.11.0, a CUDA 13.0 build, on x86_64."""
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed")
def test_a_missing_flash_attn_fails_with_the_prebuilt_wheel_for_this_python_and_torch(gpu_torch):
    check = check_flash_attn()
    assert not check.ok and "not installed" in check.detail and "flash_attention_2" in check.detail
    abi = f"cp3{sys.version_info.minor}"
    assert f"pip install --no-deps {PREBUILT}flash_attn-2.8.3+cu130torch2.11-{abi}-{abi}-linux_x86_64.whl" in check.fix


def test_a_flash_attn_built_for_another_torch_is_named_with_the_wheel_for_this_one(tmp_path, monkeypatch, gpu_torch):
    # What a wheel built for another torch does: the package imports, its CUDA extension does not.
    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text("")
    (tmp_path / "flash_attn_2_cuda.py").write_text(
        "raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi')\n"
    )
    (tmp_path / "flash_attn-2.7.4.dist-info").mkdir()
    (tmp_path / "flash_attn-2.7.4.dist-info" / "METADATA").write_text("Name: flash-attn\nVersion: 2.7.4\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        check = check_flash_attn()
    finally:
        sys.modules.pop("flash_attn", None)
    assert not check.ok and "flash-attn 2.7.4 was built for another torch" in check.detail
    assert "undefined symbol" in check.detail
    assert f"pip install --no-deps --force-reinstall {PREBUILT}flash_attn-2.8.3+cu130torch2.11-cp3" in check.fix


@pytest.mark.parametrize("python", ["3.11", "3.12"])
def test_every_allowed_python_has_a_prebuilt_flash_attn_for_the_gpu_extras_torch(python):
    abi = "cp" + python.replace(".", "")
    wheel = flash_attn_wheel(python, "2.11.0", "13.0", "x86_64")
    assert wheel == f"{PREBUILT}flash_attn-2.8.3+cu130torch2.11-{abi}-{abi}-linux_x86_64.whl"


def test_a_torch_without_a_prebuilt_flash_attn_names_the_compile_route():
    with pytest.raises(LookupError, match=r"torch 2\.9, CUDA 12\.8.*pip install flash-attn==2\.8\.3 --no-build"):
        flash_attn_wheel("3.11", "2.9.1", "12.8", "x86_64")


def fake_nvidia_smi(folder: Path, driver: str, monkeypatch) -> None:
    """An nvidia-smi that reports ``driver`` on two GPUs, first on PATH."""
    smi = folder / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nprintf '{driver}\\n{driver}\\n'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")


@pytest.mark.parametrize(("driver", "ok"), [("575.57.08", False), ("580.65.06", True)])
def test_the_driver_must_support_torchs_cuda(tmp_path, monkeypatch, gpu_torch, driver, ok):
    """torch 2.11.0 from PyPI is a CUDA 13.0 build: a node needs driver R580 or newer."""
    fake_nvidia_smi(tmp_path, driver, monkeypatch)
    check = check_driver()
    assert check.ok is ok and f"driver {driver}" in check.detail and "CUDA 13.0" in check.detail
    assert ok or ("needs driver R580 or newer" in check.detail and "R580+" in check.fix)


@cpu_only
def test_no_driver_is_a_failed_check_with_its_fix(monkeypatch, gpu_torch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    check = check_driver()
    assert not check.ok and "nvidia-smi not found" in check.detail and "GPU node" in check.fix


def test_the_vllm_pin_comes_from_verls_metadata():
    assert verl_pin("vllm") == "0.24.0"
    assert verl_pin("flash-attn") == "2.8.3"


def test_disk_passes_a_tiny_need_and_names_folder_and_numbers_for_an_absurd_one(tmp_path):
    assert check_disk(tmp_path / "results", 1).ok
    check = check_disk(tmp_path / "results", 10**18)
    assert not check.ok
    assert f"GB free on {tmp_path} (for {tmp_path / 'results'})" in check.detail
    assert "need 1000000000.0 GB" in check.detail
    assert "memupdate plan" in check.fix and str(tmp_path / "results") in check.fix


def test_a_local_model_folder_resolves_and_an_uncached_hub_id_names_its_download(tiny_models, hf_home, tmp_path):
    local = check_need(hf_model("mine", str(tiny_models / "policy")), tmp_path / "results")
    assert local.ok, local
    hub = check_need(hf_model("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct"), tmp_path / "results")
    assert not hub.ok and f"not in the hub cache {hf_home / 'hub'}" in hub.detail
    assert f"hf download Qwen/Qwen2.5-7B-Instruct --cache-dir {hf_home / 'hub'}" in hub.fix
    assert "models.qwen2.5-7b.name_or_path" in hub.fix


def test_a_cached_hub_snapshot_resolves_unless_a_part_is_missing(tiny_models, hf_home, tmp_path):
    repo = hf_home / "hub" / "models--org--tiny"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    shutil.copytree(tiny_models / "policy", snapshot)
    assert check_need(hf_model("tiny", "org/tiny"), tmp_path / "results").ok
    for weights in snapshot.glob("*.safetensors"):
        weights.unlink()
    partial = check_need(hf_model("tiny", "org/tiny"), tmp_path / "results")
    assert not partial.ok and "lacks weights" in partial.detail and "hf download org/tiny" in partial.fix
    # A tokenizer needs only its own files.
    tokenizer = Need(name="tokenizer org/tiny", kind="tokenizer", setting="data.hotpotqa.tokenizer", source="org/tiny")
    assert check_need(tokenizer, tmp_path / "results").ok


def test_a_prepared_model_needs_no_hub(hf_home, tmp_path):
    (tmp_path / "results" / "models" / "qwen2.5-7b").mkdir(parents=True)
    (tmp_path / "results" / "models" / "qwen2.5-7b" / "config.json").write_text("{}")
    assert check_need(hf_model("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct"), tmp_path / "results").ok


def test_the_full_scale_needs_both_qwen_models_the_hotpotqa_tokenizer_and_two_7b_saves(repo_root):
    needs = target_needs(read_config(repo_root / "config" / "config.yaml", "full"), ["two_stage_7b", "memagent_7b"])
    assert [n.name for n in needs] == [
        "model qwen2.5-7b",
        "tokenizer Qwen/Qwen2.5-7B-Instruct",
        f"embedding {PACKAGED_EMBEDDING}",
    ]
    need, basis = estimate_need(needs)
    # verl keeps the last two saves of a stage (trainer.max_actor_ckpt_to_keep: 2), about 91 GB each at 7B.
    assert need == 2 * 91_000_000_000 and basis.startswith("estimated")
    assert PACKAGED_EMBEDDING == DEFAULT_EMBEDDING_MODEL


def write_config(path: Path, model: Path) -> Path:
    config = {
        "scale": "one",
        "scales": {"one": {"experiments": ["exp"]}},
        "models": {"local": {"kind": "hf", "name_or_path": str(model)}, "far": {"kind": "hf", "name_or_path": "a/b"}},
        "experiments": {"exp": {"policy": "local", "qa_model": "far"}},
    }
    path.write_text(yaml.safe_dump(config))
    return path


@cpu_only
def test_the_command_prints_the_table_writes_the_report_and_exits_non_zero(tiny_models, hf_home, tmp_path, capsys):
    config = write_config(tmp_path / "config.yaml", tiny_models / "policy")
    report = tmp_path / "out" / "preflight.json"
    args = ["preflight", "--config", str(config), "--results", str(tmp_path), "--need-gb", "0.001"]
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--json", str(report)])
    assert exit_info.value.code == 1
    table = capsys.readouterr().out
    assert table.startswith("check") and "FAIL" in table and "fix: " in table
    written = json.loads(report.read_text())
    status = {c["name"]: c["ok"] for c in written["checks"]}
    assert written["ok"] is False and written["experiments"] == ["exp"]
    assert status["cuda"] is False and status["flash-attn"] is (importlib.util.find_spec("flash_attn") is not None)
    assert status["model local"] and not status["model far"] and status["disk"]
    assert all(c["fix"] for c in written["checks"] if not c["ok"])
    assert not list(report.parent.glob(".*.tmp"))  # written through a temporary file, renamed


@cpu_only
def test_the_file_runs_alone(tiny_models, hf_home, tmp_path):
    config = write_config(tmp_path / "config.yaml", tiny_models / "policy")
    run = subprocess.run(
        [sys.executable, str(PREFLIGHT_PY), "--config", str(config), "--results", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 1, run.stderr[-2000:]
    assert "cuda" in run.stdout and "checks failed" in run.stderr
    assert json.loads((tmp_path / "preflight.json").read_text())["ok"] is False


def dry_run(repo: Path, *args: str) -> subprocess.CompletedProcess:
    snakemake = str(Path(sys.executable).parent / "snakemake")
    run = subprocess.run(
        [snakemake, "-n", "--profile", "profiles/slurm", *args], cwd=repo, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_the_rule_asks_slurm_for_one_gpu_after_the_models_are_downloaded(tmp_path, copy_workflow):
    run = dry_run(copy_workflow(tmp_path), "preflight", "--config", "scale=full")
    assert "rule preflight:" in run.stdout and "output: results/preflight.json" in run.stdout
    assert "gres=gpu:1" in run.stdout and "tasks_per_gpu=0" in run.stdout
    # It checks that every model resolves offline, so it runs once they are in HF_HOME.
    assert "input: results/models/qwen2.5-3b.download.json, results/models/qwen2.5-7b.download.json" in run.stdout


def test_every_gpu_job_waits_for_the_preflight_unless_it_is_switched_off(tmp_path, copy_workflow):
    """A bare node fails in minutes: at the full scale every job that asks Slurm for GPUs (training, the servers'
    own jobs) has the preflight's report as an input; `preflight=false` skips it, and a rehearsal on CPU nodes
    asks for no GPU, so it has none."""
    repo = copy_workflow(tmp_path)
    listing = dry_run(repo, "all", "--config", "scale=full").stdout
    jobs = [block for block in listing.split("\n\n") if "rule " in block and "rule preflight:" not in block]
    # A GPU job, or a server whose own job asks for GPUs (serve_model's `server=` resource).
    gpu = [block for block in jobs if "gres=gpu" in block]
    assert {"train_stage1", "train_stage2", "train_memagent", "serve_model"} <= {
        block.split("rule ")[1].split(":")[0] for block in gpu
    }
    for block in gpu:
        assert "results/preflight.json" in block.split("output:")[0], block
    assert "rule preflight:" in listing
    off = dry_run(repo, "all", "--config", "scale=full", "preflight=false").stdout
    assert "results/preflight.json" not in off and "rule train_stage1:" in off
    rehearsal = dry_run(repo, "results/stage1/ckpt", "--config", "scale=full", "rehearse=true").stdout
    assert "rule train_stage1:" in rehearsal and "preflight" not in rehearsal


@pytest.mark.parametrize("config_name", ["grpo_memupdate.yaml", "grpo_memagent.yaml"])
def test_the_disk_estimate_counts_the_saves_the_verl_configs_keep(repo_root, config_name):
    from memupdate import preflight

    config = yaml.safe_load((repo_root / "src/memupdate/training/verl_config" / config_name).read_text())
    assert config["trainer"]["max_actor_ckpt_to_keep"] == preflight.KEPT_SAVES


def test_the_disk_estimate_counts_bytes_per_parameter_as_the_plan_does(repo_root):
    """The preflight runs as one file with only torch, so it cannot import the plan's figure: this pins the two."""
    from memupdate import preflight

    plan = yaml.safe_load((repo_root / "profiles/slurm/resources.yaml").read_text())["plan"]
    assert plan["save_bytes_per_param"] == preflight.SAVE_BYTES_PER_PARAM
