"""``python -m memupdate.training.gated_main <gate> <module> [args ...]``: import ``module``, wait for the file
``gate``, then run ``module`` as ``python -m module args`` would, with the environment variables the gate holds.

:mod:`memupdate.training.ray_cluster` starts a ``python -m`` command this way before its Ray cluster is up, so the
command's imports (verl's ``main_ppo``: about 8 s on two busy cores) and the cluster's start (about 10 s) overlap
instead of following one another; the gate holds ``RAY_ADDRESS`` once every node has joined. Rank 0 kills the
command when the cluster fails to start, and the command ends itself if rank 0 is gone (killed outright).

>>> gated_command(["python", "-m", "verl.trainer.main_ppo", "a=1"], "g.json")
['python', '-m', 'memupdate.training.gated_main', 'g.json', 'verl.trainer.main_ppo', 'a=1']
>>> gated_command(["python", "train.py"], "g.json") is None
True
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

MODULE = "memupdate.training.gated_main"
POLL_S = 0.05


def gated_command(command: Sequence[str], gate: str | os.PathLike) -> list[str] | None:
    """``command`` (``<python> -m <module> args``) run through this module's gate; None for another command."""
    if len(command) < 3 or command[1] != "-m":
        return None
    return [command[0], "-m", MODULE, str(gate), *command[2:]]


def open_gate(gate: str | os.PathLike, env: dict[str, str]) -> None:
    """Let the gated command run, with ``env`` over its environment (written atomically: it polls for the file)."""
    gate = Path(gate)
    partial = gate.with_name(f".{gate.name}.partial")
    partial.write_text(json.dumps(env), encoding="utf-8")
    partial.replace(gate)


def _wait(gate: Path, parent: int) -> dict[str, str]:
    while not gate.exists():
        if os.getppid() != parent:
            raise SystemExit(f"{MODULE}: the launcher (pid {parent}) is gone before {gate} was written")
        time.sleep(POLL_S)
    return json.loads(gate.read_text(encoding="utf-8"))


def main(argv: Sequence[str] | None = None) -> None:
    gate, module, *args = sys.argv[1:] if argv is None else argv
    parent = os.getppid()
    importlib.import_module(module)
    os.environ.update(_wait(Path(gate), parent))
    # As `python -m module args`: runpy sets argv[0] to the module's file and runs it again as __main__, its imports
    # the ones just made. It warns that the module is imported already: that is the point.
    sys.argv = [module, *args]
    warnings.filterwarnings("ignore", message=f"'{module}' found in sys.modules", category=RuntimeWarning)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
