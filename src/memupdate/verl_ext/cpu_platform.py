"""verl's ``cpu`` platform: verl 0.9.1 resolves its device through ``verl.plugin.platform``, whose registry
ships ``nvidia``, ``huawei`` and ``amd``; this registers ``cpu`` beside them (``PlatformRegistry.register``).

What it answers:

- device ``cpu`` with :mod:`memupdate.verl_ext.cpu_device` as its ``torch.<device>`` module;
- collectives over ``gloo`` (verl's worker then initialises ``cpu:gloo,cpu:gloo``, one backend), so FSDP
  shards across CPU processes;
- a Ray resource of its own, :data:`RAY_RESOURCE` (``cpu_slot``): verl places each worker on one slot as it
  places it on one GPU (``{"CPU": k, "cpu_slot": 1}`` bundles), and a node offers as many slots as it should
  run workers (``ray start --resources '{"cpu_slot": N}'``, or ``ray_kwargs.ray_init.resources``);
- no-ops for profiling ranges and allocator settings; no IPC, no CUDA runtime;
- verl's FSDP training engines (``fsdp``, ``fsdp2``) for the ``cpu`` device: verl's ``EngineRegistry`` keys an
  engine by device and registers them for ``cuda`` and ``npu`` only (:func:`register_engines`).

It is never auto-detected (``is_platform_available`` is False): on a GPU cluster verl keeps choosing its
own platform exactly as without this plugin, and a run selects ``cpu`` explicitly with ``VERL_PLATFORM=cpu``
in the environment of the driver and of every Ray worker (the verl launcher sets it for
``trainer.device: cpu``).
"""

from __future__ import annotations

import contextlib
from types import ModuleType
from typing import Any

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

from memupdate.verl_ext import cpu_device

#: The platform's name in verl's registry (``VERL_PLATFORM``).
NAME = "cpu"
#: The Ray resource a verl worker takes one of, as it takes one GPU elsewhere.
RAY_RESOURCE = "cpu_slot"
#: Logical CPUs each Ray node of a cpu run offers. verl reserves one per actor (trainer ranks, agent-loop and
#: reward workers, TransferQueue's storage units, its controller, the task runner), most of which wait on the
#: others: with only the cores a node has, the trainer's start-up waits forever for a CPU (seen on 2 cores).
RAY_NUM_CPUS = 32


@PlatformRegistry.register(platform=NAME)
class PlatformCPU(PlatformBase):
    """The host CPU as verl's accelerator (see the module docstring)."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return cpu_device

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Selected only by name (VERL_PLATFORM=cpu): auto-detection must keep verl's own choice.
        return False

    def current_device(self) -> str:
        return cpu_device.current_device()

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        """One host device: nothing to select."""

    def synchronize(self, device_index: int | None = None) -> None:
        """CPU kernels have finished when they return."""

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        """The CUDA caching allocator's settings (expandable segments) mean nothing on the host."""

    def empty_cache(self) -> None:
        cpu_device.empty_cache()

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        # verl records and restores it per worker; on CPU it selects nothing.
        return "CPU_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        """No device profiler."""

    def profiler_stop(self) -> None:
        """No device profiler."""

    def ray_resource_name(self) -> str:
        return RAY_RESOURCE

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def register_engines() -> None:
    """Offer verl's FSDP engines (language and value models) on the ``cpu`` device, through verl's own
    ``EngineRegistry``. Only in a process that runs on this platform: importing the engines pulls in
    verl's whole training stack, which no other process of the workflow needs."""
    from verl.plugin.platform import get_platform

    if get_platform().device_name != NAME:
        return
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    for model_type, engine in (("language_model", FSDPEngineWithLMHead), ("value_model", FSDPEngineWithValueHead)):
        for backend in ("fsdp", "fsdp2"):
            if NAME not in EngineRegistry._engines.get(model_type, {}).get(backend, {}):
                EngineRegistry.register(model_type=model_type, backend=backend, device=NAME)(engine)
