"""The narrow patches of verl (memupdate.verl_ext.patches): installed by the plugin on the cpu platform only,
and pinned to the verl source they were written against."""

import inspect
import json

import pytest
import verl

from memupdate.verl_ext.patches import PATCHES


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.target)
def test_each_patch_wraps_the_verl_source_it_was_written_for(patch):
    assert patch.where.startswith("verl/") and patch.why
    # A changed function fails here: read it again, and drop or rewrite the patch (and its line in docs/verl-on-cpu.md).
    assert patch.source_digest() == patch.source_sha256, (
        f"verl {verl.__version__} changed {patch.target} ({patch.where}) since memupdate patched it"
    )
    line = int(patch.where.rsplit(":", 1)[1])
    source, start = inspect.getsourcelines(patch.original())
    assert start <= line < start + len(source), f"{patch.where} is not inside {patch.target}"


def test_import_verl_on_the_cpu_platform_installs_every_patch_where_verl_binds_it(run_python):
    got = run_python(
        """
        import json, verl
        from memupdate.verl_ext.patches import PATCHES
        from verl.utils import distributed
        from verl.workers import engine_workers
        installed = []
        for patch in PATCHES:
            owner, name = patch.owner()
            installed.append(getattr(getattr(owner, name), "__memupdate_patch__", None) is patch.original())
        bound = engine_workers.initialize_global_process_group_ray is distributed.initialize_global_process_group_ray
        print(json.dumps([installed, bound]))
        """
    )
    assert json.loads(got) == [[True] * len(PATCHES), True]


def test_off_the_cpu_platform_verl_behaves_as_shipped(monkeypatch):
    """This process runs verl's own platform choice: nothing is patched, the resource check counts GPUs."""
    import ray
    from verl.single_controller.ray.base import ResourcePoolManager

    monkeypatch.setattr(ray._private.state, "available_resources_per_node", lambda: {"n": {"CPU": 2.0}})
    with pytest.raises(ValueError, match="Total available GPUs 0 is less than total desired GPUs 1"):
        ResourcePoolManager({"global_pool": [1]}, mapping={})._check_resource_available()
    for patch in PATCHES:
        owner, name = patch.owner()
        assert not hasattr(getattr(owner, name), "__memupdate_patch__"), patch.target
