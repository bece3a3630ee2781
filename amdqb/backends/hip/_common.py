"""Helpers shared by the hip launchers (``router.py``, ``layout.py``).

Every launcher takes a runtime ``rt`` (``kernel(device_index, spec, name)``, ``launch(kernel, grid,
block, smem, args)``, ``launch_dependent(...)``, ``num_cus(device_index)``,
``smem_budget(device_index)``, ``dynamic_smem_budget(kernel)`` (the budget less the kernel's static
shared memory), optionally ``blocks_per_cu(kernel, block, smem)``): the GPU runtime
of ``_runtime`` in production, the host emulator of ``op_tests/hip_emu`` in the CPU tests. Scratch
tensors come from torch's caching allocator on the inputs' device (graph-safe); nothing syncs.
"""

from __future__ import annotations

import torch

from ... import configs
from ...devices import tensor_device_info
from ._spec import arg_ptr

_STATIC_LDS_LIMIT = 48 * 1024  # dynamic + static LDS of a launch without an opt-in


def ptr(t) -> object:
    """A tensor's device pointer as a kernel argument (NULL for None)."""
    return arg_ptr(None if t is None else t.data_ptr())


def dev(t: torch.Tensor) -> int:
    """The runtime's device index of ``t`` (-1: a CPU tensor, the emulator's)."""
    return t.device.index if t.device.type == "cuda" else -1


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def config(t: torch.Tensor):
    """The architecture config (``amdqb/configs``) of ``t``'s device."""
    return configs.load(tensor_device_info(t).arch_family)
