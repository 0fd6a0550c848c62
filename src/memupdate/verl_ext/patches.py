"""Where verl 0.9.1 assumes an accelerator beyond what a platform answers: the narrowest patches, installed
only in a process that runs on the ``cpu`` platform (anywhere else verl is exactly as shipped).

Each :class:`Patch` names verl's function, its file and line in verl 0.9.1, why it is patched, and the
sha256 of the function's source as verl 0.9.1 ships it. ``tests/verl_ext/test_patches.py`` checks that
hash, so when verl changes a patched function the test fails and the patch is looked at again (it may
no longer be needed). docs/verl-on-cpu.md lists them.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_APPLIED = "__memupdate_patch__"


def on_cpu() -> bool:
    """Whether this process runs verl on the ``cpu`` platform."""
    from verl.plugin.platform import get_platform

    from memupdate.verl_ext.cpu_platform import NAME

    return get_platform().device_name == NAME


@dataclass(frozen=True)
class Patch:
    #: ``module:qualified.name`` of the verl function replaced.
    target: str
    #: Where it is in verl 0.9.1 (``verl/<file>:<line>``).
    where: str
    why: str
    #: sha256 of ``inspect.getsource`` of the original in verl 0.9.1.
    source_sha256: str
    #: Builds the replacement from the original.
    wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
    #: Modules that import the function by name. Those imported after the patch bind the replacement;
    #: one already imported has its binding replaced.
    bound_in: tuple[str, ...] = ()

    def owner(self) -> tuple[Any, str]:
        module, _, qualname = self.target.partition(":")
        owner: Any = importlib.import_module(module)
        *path, name = qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        return owner, name

    def original(self) -> Callable[..., Any]:
        owner, name = self.owner()
        function = getattr(owner, name)
        return getattr(function, _APPLIED, function)

    def source_digest(self) -> str:
        return hashlib.sha256(inspect.getsource(self.original()).encode()).hexdigest()

    def apply(self) -> None:
        owner, name = self.owner()
        if hasattr(getattr(owner, name), _APPLIED):
            return
        original = getattr(owner, name)
        replacement = functools.wraps(original)(self.wrap(original))
        setattr(replacement, _APPLIED, original)
        setattr(owner, name, replacement)
        for module in self.bound_in:
            bound = sys.modules.get(module)
            if bound is not None and getattr(bound, name, None) is original:
                setattr(bound, name, replacement)


def _resource_check(original: Callable[..., Any]) -> Callable[..., Any]:
    def check(self) -> None:
        import ray

        from memupdate.verl_ext.cpu_platform import RAY_RESOURCE

        per_node = ray._private.state.available_resources_per_node()
        available = sum(resources.get(RAY_RESOURCE, 0) for resources in per_node.values())
        required = sum(n for nodes in self.resource_pool_spec.values() for n in nodes)
        if available < required:
            raise ValueError(
                f"Total available {RAY_RESOURCE} {available:g} is less than total desired {required} (verl's "
                f"workers on the cpu platform): start each Ray node with resources={{'{RAY_RESOURCE}': "
                "<workers on the node>}, e.g. ray_kwargs.ray_init.resources"
            )
        return None

    return check


def _process_group(original: Callable[..., Any]) -> Callable[..., Any]:
    def initialize(timeout_second=None, backend=None):
        if backend is None:
            backend = "gloo"
        return original(timeout_second=timeout_second, backend=backend)

    return initialize


def _global_process_group(original: Callable[..., Any]) -> Callable[..., Any]:
    def initialize(timeout_second=36000):
        # The original's body with the backend 'gloo' (it builds its backend string inline).
        import os
        from datetime import timedelta

        import torch.distributed

        torch.distributed.init_process_group(
            backend="gloo",
            timeout=timedelta(seconds=timeout_second),
            init_method=os.environ.get("DIST_INIT_METHOD", None),
        )
        return int(os.environ["LOCAL_RANK"]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    return initialize


def _host_offload(original: Callable[..., Any]) -> Callable[..., Any]:
    def build(self, module):
        # The name is a global of verl's module, read when the policy is built; swapped for this call only.
        namespace = original.__globals__
        policy = namespace["CPUOffloadPolicy"]
        namespace["CPUOffloadPolicy"] = lambda *args, **kwargs: policy(*args, **{**kwargs, "pin_memory": False})
        try:
            return original(self, module)
        finally:
            namespace["CPUOffloadPolicy"] = policy

    return build


PATCHES = (
    Patch(
        target="verl.single_controller.ray.base:ResourcePoolManager._check_resource_available",
        where="verl/single_controller/ray/base.py:226",
        why="counts only the Ray resources GPU and NPU, not the platform's ray_resource_name(), which the "
        "placement groups of the same file already use; on cpu it counts the cpu_slot resource instead",
        source_sha256="b0b46038e25a8f2593556cff9d1ed808de712a8143f89735815d5e164f3d4eaa",
        wrap=_resource_check,
    ),
    Patch(
        target="verl.utils.distributed:initialize_global_process_group_ray",
        where="verl/utils/distributed.py:89",
        why="its default backend 'cpu:gloo,<device>:<collective backend>' names the cpu device twice on the "
        "cpu platform ('cpu:gloo,cpu:gloo'), which torch.distributed rejects; on cpu the default is 'gloo'",
        source_sha256="761a94d1a2e058d31a0ac231c89a142abf5daf822e333bac75e84cafcf7507ac",
        wrap=_process_group,
        bound_in=("verl.workers.engine_workers",),
    ),
    Patch(
        target="verl.utils.distributed:initialize_global_process_group",
        where="verl/utils/distributed.py:63",
        why="the torchrun trainers' (the SFT trainer's) process group: the same 'cpu:gloo,cpu:gloo' backend "
        "string, built inline; on cpu the group is initialised with 'gloo' (setting the device is a no-op there)",
        source_sha256="33a5452c4dde00591e00692a5f967cc7b424a3b7ebd9da7cb23697209ddbd0e1",
        wrap=_global_process_group,
    ),
    Patch(
        target="verl.workers.engine.fsdp.transformer_impl:FSDPEngine._build_fsdp_module",
        where="verl/workers/engine/fsdp/transformer_impl.py:462",
        why="FSDP2 keeps the reference model's shards on the host with CPUOffloadPolicy(pin_memory=True), and "
        "pinning host memory needs an accelerator; on cpu the policy is built with pin_memory=False (the "
        "shards are host memory either way)",
        source_sha256="35b7b539858443e45894da2d9675fb5a1d7b2bbb7c7c8b35605b0746d3179213",
        wrap=_host_offload,
    ),
)


def apply_patches() -> None:
    """Install every patch, in a process on the ``cpu`` platform only."""
    if not on_cpu():
        return
    for patch in PATCHES:
        patch.apply()
