"""``python -m memupdate.training.ray_gate MODULE ARGS...``: import ``MODULE``, wait for the Ray cluster's
address on standard input, then run ``MODULE`` as ``__main__`` with ``ARGS`` and ``RAY_ADDRESS`` set.

The launcher (:mod:`memupdate.training.ray_cluster`) starts a ``python -m`` command this way beside the Ray
head, so that the command's imports run while the head starts instead of after it: verl's main_ppo spends
about 10 s importing on a 2-core machine, the head about 11 s starting. Running the module again as
``__main__`` (:func:`runpy.run_module`) costs little: what it imports is imported by then.
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(f"usage: python -m {__spec__.name} MODULE [ARGS...]")
    module = sys.argv[1]
    # What the module sees of its command line, at import and when it runs, is what `python -m` would give it.
    sys.argv = [module, *sys.argv[2:]]
    importlib.import_module(module)
    address = sys.stdin.readline().strip()
    if not address:
        # The pipe closed without an address: the launcher died before its cluster was up (its log says why).
        sys.exit(f"{module} did not run: the Ray cluster it was to run on did not start")
    os.environ["RAY_ADDRESS"] = address
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
