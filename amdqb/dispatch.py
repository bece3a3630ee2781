"""Device/architecture detection and backend selection, with reasons.

Backends (one folder each under ``amdqb/backends``):

* ``hip``    -- ``hip_src`` kernels compiled at run time (hiprtc via hip-python on ROCm, NVRTC via
  cuda-python on NVIDIA);
* ``triton`` -- portable Triton kernels (NVIDIA and AMD; on the CPU only under ``TRITON_INTERPRET=1``);
* ``torch``  -- the pure-PyTorch oracles of ``amdqb.ref``: always available, CPU and GPU.

Every op asks :func:`select` for an implementation. The choice walks the op's backend order of the
device's architecture family (``backend_order.*`` in ``amdqb/configs/<arch>.json``) and takes the
first backend that is available and implements the op; each rejected candidate records why.
``AMDQB_BACKEND`` (environment) and ``backend=`` (keyword) force a backend.
"""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass, field

import torch

from . import configs

BACKENDS = ("hip", "triton", "torch")


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


# LDS per workgroup by AMD architecture (bytes). gfx950 raised LDS to 160 KiB; gfx1250 has 320 KiB
# per WGP of which a workgroup may use 160 KiB in CU mode; RDNA parts and gfx90a/942 have 64 KiB.
_AMD_LDS = {"gfx950": 160 * 1024, "gfx1250": 160 * 1024}
_AMD_DEFAULT_LDS = 64 * 1024


def amd_wave_size(arch: str) -> int:
    """CDNA (gfx9xx) runs wave64, RDNA and gfx12xx wave32."""
    return 64 if arch.startswith("gfx9") else 32


def amd_arch_family(arch: str) -> str:
    if arch in ("gfx942", "gfx950", "gfx1250"):
        return arch
    if arch.startswith("gfx9"):
        return "cdna"
    return "rdna"


@functools.lru_cache(maxsize=None)
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
        lds = _AMD_LDS.get(arch, _AMD_DEFAULT_LDS)
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


def device_info(device: torch.device | str | None = None) -> DeviceInfo:
    """Cached :class:`DeviceInfo` of ``device`` (default: the current CUDA device, else the CPU)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"device must be a torch device or its name, got {device!r}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} is not available (no CUDA/ROCm device)")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return _device_info_cached(str(dev))


@functools.lru_cache(maxsize=None)
def _backend_module(name: str):
    return importlib.import_module(f"amdqb.backends.{name}")


def backend_status(name: str, info: DeviceInfo) -> tuple[bool, str]:
    """(available, reason) of backend ``name`` on ``info``'s device."""
    if name not in BACKENDS:
        return False, f"unknown backend {name!r}; choose from {BACKENDS}"
    try:
        module = _backend_module(name)
    except ImportError as exc:  # a backend's optional dependency is missing
        return False, f"import failed: {exc}"
    return module.availability(info)


@dataclass(frozen=True)
class Choice:
    backend: str
    impl: object
    reason: str
    rejected: tuple[tuple[str, str], ...] = ()


def preference(op: str, info: DeviceInfo) -> tuple[str, ...]:
    """The backend order of ``op`` on ``info``'s architecture (``amdqb/configs``)."""
    return configs.load(info.arch_family).backend_order(op)


def _env_backend() -> str | None:
    value = os.environ.get("AMDQB_BACKEND", "").strip().lower()
    return value or None


@functools.lru_cache(maxsize=None)
def _select_cached(op: str, device_str: str, forced: str | None, features: tuple) -> Choice:
    info = _device_info_cached(device_str)
    rejected: list[tuple[str, str]] = []
    candidates = (forced,) if forced else preference(op, info)
    for name in candidates:
        ok, why = backend_status(name, info)
        if ok:
            module = _backend_module(name)
            impl = getattr(module, "OPS", {}).get(op)
            if impl is None:
                why = f"does not implement {op!r}"
            else:
                unsupported = getattr(module, "unsupported", None)
                reason = unsupported(op, info, dict(features)) if unsupported else None
                if reason is None:
                    how = (
                        "forced" if forced else f"first available in {info.arch_family} preference"
                    )
                    return Choice(name, impl, f"{how} ({why})", tuple(rejected))
                why = reason
        rejected.append((name, why))
    detail = "; ".join(f"{n}: {w}" for n, w in rejected)
    raise RuntimeError(f"no backend can run {op!r} on {device_str}: {detail}")


def select(op: str, device: torch.device | str, backend: str | None = None, **features) -> Choice:
    """Implementation of ``op`` for ``device``: ``backend=`` beats ``AMDQB_BACKEND`` beats tables.

    ``features`` (hashable values: sizes, modes) let a backend decline a configuration through its
    ``unsupported(op, info, features) -> reason | None`` hook; the next backend in order is tried.
    """
    forced = backend or _env_backend()
    if forced is not None and forced not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {forced!r}")
    return _select_cached(op, _device_key(device), forced, tuple(sorted(features.items())))


def _device_key(device: torch.device | str) -> str:
    """Cache key of a device: ``cuda`` resolved to the current device index."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return str(dev)


def report(device: torch.device | str | None = None) -> dict:
    """Everything the dispatcher knows, for ``python -m amdqb info``."""
    info = device_info(device)
    backends = {}
    for name in BACKENDS:
        ok, why = backend_status(name, info)
        backends[name] = {"available": ok, "reason": why}
    ops = {}
    from .backends import OP_NAMES

    for op in OP_NAMES:
        try:
            choice = select(op, info.device)
            ops[op] = {"backend": choice.backend, "reason": choice.reason}
        except RuntimeError as exc:
            ops[op] = {"backend": None, "reason": str(exc)}
    cfg = configs.load(info.arch_family)
    entries = {
        key: {"value": e.value, "provenance": e.provenance, "file": e.source}
        for key, e in cfg.items()
    }
    return {
        "device": info.as_dict(),
        "backends": backends,
        "ops": ops,
        "config": {"arch": cfg.arch, "entries": entries},
    }


def backend_name(
    op: str,
    device: torch.device | str,
    backend: str | None = None,
    *,
    prefer: str | None = None,
    **features,
) -> str:
    """Name of the backend :func:`select` picks; a trace-time constant under ``torch.compile``.

    ``prefer``: that backend if it can run ``op`` with ``features``, else the preference table
    (``AMDQB_BACKEND`` aside) -- how a backward follows its forward's backend when that backend has
    a backward kernel, and falls back to the dispatcher's choice when it has none (hip).
    """
    return _backend_name(
        op, str(torch.device(device)), backend, tuple(sorted(features.items())), prefer
    )


@torch.compiler.assume_constant_result
def _backend_name(
    op: str, device: str, backend: str | None, features: tuple, prefer: str | None = None
) -> str:
    if prefer is not None:
        try:
            return select(op, device, prefer, **dict(features)).backend
        except RuntimeError:
            return _select_cached(op, _device_key(device), None, features).backend
    return select(op, device, backend, **dict(features)).backend
