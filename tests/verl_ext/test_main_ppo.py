"""Our main_ppo entry point (memupdate.verl_ext.main_ppo): on CPU runs verl's task runner runs in the driver, with
the variables verl gives its Ray workers; on GPUs verl's own actor. The whole path trains in the reward-rises test
(tests/training/test_verl_cpu.py) and every CPU stage of the workflow."""

import json

import pytest

from memupdate.verl_ext.main_ppo import VERL_TASK_RUNNER, InProcessTaskRunner, task_runner_for


def test_the_task_runner_runs_in_the_driver_on_cpu_only():
    assert task_runner_for("cpu") is InProcessTaskRunner
    assert task_runner_for("cuda") is VERL_TASK_RUNNER and task_runner_for("npu") is VERL_TASK_RUNNER
    # A recipe's own runner (or verl's legacy one) is left as it is.
    other = object()
    assert task_runner_for("cpu", other) is other


@pytest.mark.slow
@pytest.mark.serial
def test_verls_run_ppo_runs_the_runner_here_with_the_jobs_runtime_env(run_python):
    """verl's own run_ppo (its ray.init with the job's runtime_env, then runner.run) drives the in-process runner:
    run executes in the driver's process, with the variables a Ray worker of the job would have."""
    got = run_python(
        """
        import json, os, ray
        from omegaconf import OmegaConf
        from memupdate.verl_ext import main_ppo

        SEEN = []  # filled here only if run ran in this process

        @ray.remote
        class Probe:
            def run(self, config):
                SEEN.extend([os.getpid(), os.environ.get("MEMUPDATE_PROBE"), os.environ.get("TRANSFER_QUEUE_ENABLE")])

        class Here(main_ppo.InProcessTaskRunner):
            runner_class = Probe

        config = OmegaConf.create({
            "actor_rollout_ref": {"rollout": {"full_determinism": False, "seed": 0}, "actor": {"strategy": "fsdp"}},
            "reward": {"reward_model": {"enable": False, "rollout": {"full_determinism": False}}},
            "trainer": {"logger": [], "device": "cpu"},
            "global_profiler": {"tool": None},
            "transfer_queue": {"enable": True},
            "ray_kwargs": {"ray_init": {"num_cpus": 2, "include_dashboard": False,
                                        "runtime_env": {"env_vars": {"MEMUPDATE_PROBE": "seen"}}}},
        })
        main_ppo._VERL_RUN_PPO(config, task_runner_class=Here)
        ray.shutdown()
        print(json.dumps({"seen": SEEN, "driver": os.getpid()}))
        """,
    )
    got = json.loads(got)
    # The config's variables and the one run_ppo adds for TransferQueue, as verl's Ray workers get them.
    assert got["seen"] == [got["driver"], "seen", "1"], got
