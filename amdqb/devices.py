"""Devices: what the dispatcher and the launchers know about one (vendor, architecture, wave
size, LDS, compute units), and the one parser of a device argument.

The lowest layer above the configs: it imports torch alone, so the backends, the configs'
callers and the dispatcher all read a device here.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch

from . import configs
from ._arch import (  # the one rule (setup.py and tools share it)
    amd_arch_family,
    amd_lds_bytes,
    amd_wave_size,
)


@dataclass(frozen=True)
class DeviceInfo:
    """What the dispatcher knows about one device."""

    device: str  # "cpu", "cuda:0", ...
    vendor: str  # "cpu" | "nvidia" | "amd"
    name: str
    arch: str  # "cpu", "sm_90", "gfx942", "gfx950", "gfx1250", ...
    wave_size: int  # threads that execute in lock step (1 on the CPU)
    lds_bytes: int  # shared memory / LDS per block available to a kernel
    cu_count: int  # SMs / CUs (CPU: logical cores)
    arch_family: str = field(default="")  # key of the preference tables

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@functools.cache
def _device_info_cached(device_str: str) -> DeviceInfo:
    dev = torch.device(device_str)
    if dev.type != "cuda":
        cores = os.cpu_count() or 1
        return DeviceInfo(str(dev), "cpu", "cpu", "cpu", 1, 0, cores, "cpu")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip is not None:
        arch = str(getattr(props, "gcnArchName", "gfx000")).split(":")[0]
        wave = int(getattr(props, "warp_size", 0) or amd_wave_size(arch))
        lds = amd_lds_bytes(arch)
        return DeviceInfo(
            f"cuda:{index}",
            "amd",
            props.name,
            arch,
            wave,
            lds,
            props.multi_processor_count,
            amd_arch_family(arch),
        )
    arch = f"sm_{props.major}{props.minor}"
    lds = int(getattr(props, "shared_memory_per_block_optin", 48 * 1024))
    family = "sm_90" if props.major == 9 else ("sm_100" if props.major >= 10 else "sm_80")
    return DeviceInfo(
        f"cuda:{index}",
        "nvidia",
        props.name,
        arch,
        32,
        lds,
        props.multi_processor_count,
        family,
    )


# Names a user may give for the GPU: ROCm's torch calls its GPUs "cuda" too.
_GPU_ALIASES = ("cuda", "gpu", "hip")


def as_device(device: torch.device | str | None = None, *, name: str = "device") -> torch.device:
    """The one parser of a device argument, for every entry point (the ops' callers, the
    balancer, ``amdqb info / demo / bench --device``): ``None`` (a CUDA/ROCm GPU if any, else the
    CPU), ``"cpu"``, or a GPU as ``"cuda"``, ``"cuda:N"``, ``"gpu"`` / ``"hip"`` (``":N"`` too) or a
    ``torch.device``. Anything else -- another device type (mps, meta, xpu), an unavailable GPU, an
    index past the visible GPUs -- is one ``ValueError`` naming ``name`` and why."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    text = device if isinstance(device, str) else None
    if text is not None:
        kind, sep, index = text.strip().lower().partition(":")
        if kind in _GPU_ALIASES:
            text = f"cuda{sep}{index}"
    try:
        dev = torch.device(text if text is not None else device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(
            f"{name} must be 'cpu', 'cuda', 'cuda:N' (or 'gpu' / 'hip'), got {device!r}"
        ) from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(
            f"{name} {device!r} is not supported: amdqb runs on the CPU or a CUDA/ROCm GPU "
            "('cpu', 'cuda', 'cuda:N')"
        )
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"{name} {device!r} is not available: this torch ({torch.__version__}) sees no "
                "CUDA/ROCm GPU"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"{name} {device!r} is not available: {torch.cuda.device_count()} GPU(s) visible"
            )
    return dev


def device_info(device: torch.device | str | None = None) -> DeviceInfo:
    """Cached :class:`DeviceInfo` of ``device`` (default: the current CUDA device, else the CPU)."""
    dev = as_device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return _device_info_cached(str(dev))


def tensor_device_info(t: torch.Tensor) -> DeviceInfo:
    """:func:`device_info` of a tensor's device (a valid device with its index: no parsing)."""
    return _device_info_cached(str(t.device))


def arch_config(device: torch.device | str | None = None) -> configs.ArchConfig:
    """The config (``amdqb/configs``) of ``device``'s architecture family."""
    return configs.load(device_info(device).arch_family)
