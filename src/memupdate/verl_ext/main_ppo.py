"""``python -m memupdate.verl_ext.main_ppo``: verl's ``main_ppo``, with its task runner in the driver on CPU runs.

verl's ``run_ppo`` runs the trainer's driver loop (``TaskRunnerV1.run``: data, worker groups, the fit loop) in a Ray
actor, so that on a GPU cluster it lands on a node of the cluster rather than beside the head's services. On a
CPU run that actor is one more process importing verl before anything else can start (about 10 s on 2 cores),
while the driver, started through :mod:`memupdate.training.ray_gate`, imported verl beside the starting Ray head.
So on CPU the task runner's ``run`` runs here, in the driver, with the variables verl gives its Ray workers (the
job's ``runtime_env``); GPU runs keep verl's actor. Everything else is verl's ``main``: its config checks,
``run_ppo``'s ``ray.init`` and the trainer. Measured with the reward-rises test (docs/measurements.md): "ready to
fit" 37.6 s after the Ray head's start, against 52.2 s with verl's actor.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray
from verl.trainer import main_ppo as verl_main_ppo

logger = logging.getLogger(__name__)

#: verl's task runner, the Ray actor class its ``main`` hands to ``run_ppo``, and ``run_ppo`` itself.
VERL_TASK_RUNNER = verl_main_ppo.TaskRunnerV1
_VERL_RUN_PPO = verl_main_ppo.run_ppo


class _CalledHere:
    """A method of the in-process runner, called as ``method.remote(...)``: it runs now and returns an object ref of
    its result, which ``run_ppo`` passes to ``ray.get`` as it would an actor call's."""

    def __init__(self, method):
        self._method = method

    def remote(self, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        return ray.put(self._method(*args, **kwargs))


class InProcessTaskRunner:
    """A Ray actor class (``runner_class``, verl's task runner) as ``run_ppo`` drives it, ``cls.remote()`` then
    ``runner.run.remote(config)``, run in this process instead (module docstring)."""

    runner_class = VERL_TASK_RUNNER

    def __init__(self) -> None:
        self._runner = self.runner_class.__ray_metadata__.modified_class()

    @classmethod
    def options(cls, **_: Any) -> type[InProcessTaskRunner]:
        return cls

    @classmethod
    def remote(cls) -> InProcessTaskRunner:
        # What verl's Ray workers get on top of the node's environment: the job's runtime_env variables
        # (TransferQueue's switch, tokenizer and logging settings, the platform and the rollout's settings).
        env_vars = (ray.get_runtime_context().runtime_env or {}).get("env_vars") or {}
        os.environ.update({str(name): str(value) for name, value in env_vars.items()})
        logger.info("verl's task runner runs in the driver (pid %d): a CPU run", os.getpid())
        return cls()

    @property
    def run(self) -> _CalledHere:
        return _CalledHere(self._runner.run)


def task_runner_for(device: str, task_runner_class: Any = VERL_TASK_RUNNER) -> Any:
    """The task runner ``run_ppo`` gets: verl's, run in the driver on the CPU device; on any other as verl runs it.

    >>> task_runner_for("cpu") is InProcessTaskRunner, task_runner_for("cuda") is VERL_TASK_RUNNER
    (True, True)
    """
    return InProcessTaskRunner if device == "cpu" and task_runner_class is VERL_TASK_RUNNER else task_runner_class


def run_ppo(config: Any, task_runner_class: Any) -> None:
    """verl's ``run_ppo`` with the task runner of :func:`task_runner_for`."""
    _VERL_RUN_PPO(config, task_runner_class=task_runner_for(config.trainer.device, task_runner_class))


def main() -> None:
    # verl's main reads run_ppo from its module when it runs: bound there, the runner follows the device.
    verl_main_ppo.run_ppo = run_ppo
    verl_main_ppo.main()


if __name__ == "__main__":
    main()
