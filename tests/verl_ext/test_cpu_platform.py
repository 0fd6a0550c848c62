"""verl's ``cpu`` platform (memupdate.verl_ext): registered by our plugin, selected only by name, and
answering every device call verl makes. verl resolves its platform once per process, so everything that
selects it runs in a child process; this test process keeps verl's own choice."""

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import verl

from memupdate.verl_ext import cpu_device
from memupdate.verl_ext.cpu_platform import RAY_RESOURCE, PlatformCPU


def test_selected_by_name_through_verls_registry(run_python):
    got = run_python(
        """
        import json, verl
        from verl.utils import device
        print(json.dumps([device.get_device_name(), device.get_nccl_backend(), device.get_resource_name(),
                          device.get_torch_device().__name__, device.get_device_id(), device.is_device_available()]))
        """
    )
    assert json.loads(got) == ["cpu", "gloo", RAY_RESOURCE, "memupdate.verl_ext.cpu_device", "cpu", True]


def test_never_auto_detected_so_gpu_clusters_keep_verls_choice(run_python):
    assert PlatformCPU().is_platform_available(use_smi_check=True) is False
    # Without VERL_PLATFORM, verl picks what it picked before the plugin (here, with no GPU: its fallback).
    got = run_python("import verl; from verl.utils import device; print(device.get_device_name())", platform=None)
    assert got == "cuda"


def _device_calls() -> set[str]:
    """Every ``get_torch_device().<name>`` in verl's sources."""
    names = set()
    for path in Path(verl.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "id", None) == "get_torch_device"
            ):
                names.add(node.attr)
    return names


def test_the_device_module_answers_every_call_verl_makes():
    calls = _device_calls()
    assert {"empty_cache", "synchronize", "mem_get_info", "get_rng_state"} <= calls  # the scan sees them
    missing = sorted(name for name in calls if not hasattr(cpu_device, name))
    assert not missing, f"verl calls get_torch_device().{missing} that memupdate.verl_ext.cpu_device lacks"
    free, total = cpu_device.mem_get_info()
    assert 0 < free <= total
    state = cpu_device.get_rng_state()
    cpu_device.manual_seed(3)
    first = cpu_device.get_rng_state()
    cpu_device.set_rng_state(state)
    cpu_device.manual_seed(3)
    assert (first == cpu_device.get_rng_state()).all()


@pytest.mark.slow
@pytest.mark.verl_cpu
def test_verls_worker_process_group_is_gloo_across_two_processes(tmp_path):
    """Two ranks initialise through verl's own worker code path (engine_workers' binding of
    initialize_global_process_group_ray) and all-reduce."""
    code = """
        import os, torch, torch.distributed as dist, verl
        from verl.workers import engine_workers
        engine_workers.initialize_global_process_group_ray()
        t = torch.full((2,), float(dist.get_rank() + 1)); dist.all_reduce(t)
        print(dist.get_backend(), t.tolist())
        """
    from memupdate.utils.system import free_port

    port = str(free_port())
    env = {k: v for k, v in os.environ.items()} | {"VERL_PLATFORM": "cpu", "MASTER_ADDR": "127.0.0.1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)],
            env=env | {"MASTER_PORT": port, "RANK": str(rank), "WORLD_SIZE": "2"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outputs]
    assert [out.strip().splitlines()[-1] for out, _ in outputs] == ["gloo [3.0, 3.0]"] * 2


@pytest.mark.slow
@pytest.mark.verl_cpu
def test_verl_places_workers_on_cpu_slots_and_says_when_there_are_too_few(run_python):
    got = run_python(
        f"""
        import json, ray, verl
        from verl.single_controller.ray.base import ResourcePoolManager
        # verl asks each bundle for max_colocate_count (3) logical CPUs: on CPU they are oversubscribed.
        ray.init(num_cpus=8, resources={{"{RAY_RESOURCE}": 2}}, include_dashboard=False)
        try:
            fits = ResourcePoolManager({{"global_pool": [2]}}, mapping={{}})
            fits.create_resource_pool()
            pgs = fits.resource_pool_dict["global_pool"].get_placement_groups()
            bundles = [b for pg in pgs for b in pg.bundle_specs]
            try:
                ResourcePoolManager({{"global_pool": [3]}}, mapping={{}}).create_resource_pool()
                error = None
            except ValueError as err:
                error = str(err)
            print(json.dumps([bundles, error]))
        finally:
            ray.shutdown()
        """
    )
    bundles, error = json.loads(got)
    assert bundles == [{"CPU": 3.0, RAY_RESOURCE: 1.0}] * 2
    assert error.startswith(f"Total available {RAY_RESOURCE} 0 is less than total desired 3")
