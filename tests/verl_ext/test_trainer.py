"""memupdate's trainer mode (memupdate.verl_ext.trainer): registered with verl's trainer registry by the plugin, in
every process, on every platform. That it skips a flat step and leaves the weights as they were is checked where it
runs: the whole-DAG test's tiny MemAgent run (tests/test_workflow.py)."""

import json

from memupdate.settings import FLAT_SKIPPING_TRAINER, TRAINER_MODES, verl_refusals


def test_import_verl_registers_the_trainer_that_skips_flat_steps_beside_verls_own(run_python):
    got = run_python(
        """
        import json, verl
        from verl.trainer.ppo.v1 import PPOTrainerSync, get_trainer_cls
        from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
        ours = get_trainer_cls("memupdate_sync")
        print(json.dumps([ours.__module__, issubclass(ours, PPOTrainerSync), sorted(TRAINER_REGISTRY)]))
        """,
        platform=None,
    )
    assert json.loads(got) == ["memupdate.verl_ext.trainer", True, sorted(TRAINER_MODES)]


def test_a_trainer_mode_verl_does_not_know_fails_when_the_snakefile_loads():
    refusals = verl_refusals({"trainer.v1.trainer_mode": "memupdate_synk"}.get)
    assert refusals == [
        f"trainer.v1.trainer_mode: 'memupdate_synk' is none of {list(TRAINER_MODES)}; did you mean {FLAT_SKIPPING_TRAINER}?"
    ]
    assert verl_refusals({"trainer.v1.trainer_mode": FLAT_SKIPPING_TRAINER}.get) == []
