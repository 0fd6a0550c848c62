"""The ``torch.<device>`` module verl gets from the ``cpu`` platform: :mod:`torch.cpu`, plus a CPU meaning for
each call verl makes on its device module that :mod:`torch.cpu` lacks.

verl calls ``get_torch_device().<name>(...)`` (``verl.utils.device``) as it would ``torch.cuda``: this
module answers what :mod:`torch.cpu` answers (``synchronize``, ``Stream``, ``current_stream``, ...) and
adds the rest: no-ops where the call manages a device allocator or IPC handles the CPU does not have,
the host RNG for the device RNG, host memory for device memory.
``tests/verl_ext/test_cpu_platform.py`` scans verl's sources for every such call and checks this module
answers it, so a call verl adds shows up as a failing test, not as an AttributeError in a Ray worker.

>>> from memupdate.verl_ext import cpu_device
>>> cpu_device.get_device_name(), cpu_device.memory_allocated(), cpu_device.is_available()
('CPU', 0, True)
"""

from __future__ import annotations

import os
from typing import Any

import torch


def __getattr__(name: str) -> Any:
    # Everything torch.cpu has (synchronize, Stream, Event, stream, current_stream, device_count, ...).
    return getattr(torch.cpu, name)


def current_device() -> str:
    """verl hands it to torch wherever a device goes (``module.to(device=get_device_id())``,
    ``torch.device(get_device_id())``), where an integer means accelerator ``n``: the host is ``"cpu"``.
    (Only code paths that need a GPU anyway format it into ``f"{device_name}:{index}"``.)"""
    return "cpu"


def empty_cache() -> None:
    """No device cache: freed host memory goes back to the allocator at once."""


def ipc_collect() -> None:
    """No CUDA IPC handles on CPU."""


def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
    """No device memory pool to cap."""


def memory_allocated(device: Any = None) -> int:
    """Bytes held by a device allocator: none (the numbers verl's own CPU branch reports)."""
    return 0


memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """``(free, total)`` bytes of host memory, as ``torch.cuda.mem_get_info`` gives the device's."""
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def get_device_name(device: Any = None) -> str:
    """The name verl's FLOPs table is searched with (it says ``CPU`` for :mod:`torch.cpu` itself)."""
    return "CPU"


def get_rng_state(device: Any = None) -> torch.Tensor:
    """The device RNG is the host RNG."""
    return torch.get_rng_state()


def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
    torch.set_rng_state(state)


def manual_seed(seed: int) -> None:
    torch.manual_seed(seed)


manual_seed_all = manual_seed
