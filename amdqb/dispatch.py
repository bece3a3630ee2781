"""Device/architecture detection and backend selection, with reasons.

Backends (one folder each under ``amdqb/backends``):

* ``hip``    -- ``hip_src`` kernels compiled at run time (hiprtc via hip-python on ROCm, NVRTC via
  cuda-python on NVIDIA);
* ``triton`` -- portable Triton kernels (NVIDIA and AMD; on the CPU only under ``TRITON_INTERPRET=1``);
* ``torch``  -- the pure-PyTorch oracles of ``amdqb.ref``: always available, CPU and GPU.

Every op asks :func:`select` for an implementation. The choice walks the op's backend order of the
device's architecture family (``backend_order.*`` in ``amdqb/configs/<arch>.json``) and takes the
first backend that is available and implements the op; each rejected candidate records why.
``backend=`` (keyword) forces a backend: it runs the op or the op raises. ``AMDQB_BACKEND``
(environment) is a preference: an op that backend cannot run follows its order as without it.

Run-time build failures: the hip backend compiles (hiprtc / NVRTC) and loads its code objects at
the first kernel request of an op on a device. When that fails (unknown target, missing builtin,
driver refusing the code object), the op runs on the next backend of its order instead, with one
``RuntimeWarning`` per (op, cause); the dispatcher remembers the failure, so later selections skip
the backend for that op on that device without compiling again, and :func:`report` (``amdqb
info``) lists it. Nothing is compiled to find this out beforehand. The choice stays a trace-time
constant under ``torch.compile``: the kernel-level ops receive :func:`kernel_backend`'s token
(``"hip>triton"``: hip, and triton should hip fail to build), so a graph traced before a failure
runs the fallback without tracing again. A ``backend=`` call gets no fallback: it raises.
"""

from __future__ import annotations

import functools
import importlib
import os
import threading
import warnings
from dataclasses import dataclass, field

import torch

from . import configs
from ._arch import amd_arch_family, amd_wave_size  # the one rule (setup.py and tools share it)

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


def as_device(device: torch.device | str) -> torch.device:
    """``device`` (a ``torch.device`` or its name) as a ``torch.device``; a ``ValueError`` naming
    it when it is neither or names an unavailable CUDA/ROCm device."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"device must be a torch device or its name, got {device!r}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} is not available (no CUDA/ROCm device)")
    return dev


def device_info(device: torch.device | str | None = None) -> DeviceInfo:
    """Cached :class:`DeviceInfo` of ``device`` (default: the current CUDA device, else the CPU)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = as_device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return _device_info_cached(str(dev))


@functools.cache
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
    """The backend of one (op, device, features): what runs, why, and what runs should it fail."""

    backend: str
    impl: object
    reason: str
    rejected: tuple[tuple[str, str], ...] = ()
    # the next backend that can run the op, should ``backend`` fail to build its kernels at run
    # time (set only for backends that build at run time, and never for a ``backend=`` choice)
    fallback: str | None = None
    token: str = field(default="", compare=False)  # what the kernel-level op is given

    def __post_init__(self):
        if not self.token:
            token = self.backend if self.fallback is None else f"{self.backend}>{self.fallback}"
            object.__setattr__(self, "token", token)


def preference(op: str, info: DeviceInfo) -> tuple[str, ...]:
    """The backend order of ``op`` on ``info``'s architecture (``amdqb/configs``)."""
    return configs.load(info.arch_family).backend_order(op)


_ENV = "AMDQB_BACKEND"


def _env_backend() -> str | None:
    value = os.environ.get(_ENV, "").strip().lower()
    if not value:
        return None
    if value not in BACKENDS:
        raise ValueError(f"{_ENV} must be one of {BACKENDS}, got {value!r}")
    return value


def _checked(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


# ------------------------------------------------------------------------------------------------
# Run-time build failures. A backend module that builds kernels at run time names the exception
# of a failed build ``BuildError`` (hip: compile, code-object load or function lookup, raised
# before anything of the op call has launched). The dispatcher then remembers (op, device,
# backend), warns once per (op, cause) and runs the op on the choice's ``fallback``.
# ------------------------------------------------------------------------------------------------
_FAILURES: dict[tuple[str, str, str], str] = {}  # (op, device, backend) -> cause
_FAILED_DEVICES: dict[tuple[str, str], set] = {}  # (op, backend) -> devices; read per call
_WARNED: set[tuple[str, str]] = set()
_FAILURE_LOCK = threading.Lock()


def failure_cause(exc: BaseException) -> str:
    """One line naming why a build failed (the error's ``summary`` when it has one)."""
    text = getattr(exc, "summary", None) or next(
        (line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__
    )
    return text if len(text) <= 300 else text[:297] + "..."


def record_failure(
    op: str, backend: str, device: str, exc: BaseException, fallback: str | None = None
) -> str:
    """Remember that ``backend`` cannot build ``op`` on ``device``: later selections skip it
    there. Warns once per (op, cause) when the op falls back to ``fallback``. Returns the cause."""
    cause = failure_cause(exc)
    with _FAILURE_LOCK:
        if (op, device, backend) not in _FAILURES:
            _FAILURES[(op, device, backend)] = cause
            _FAILED_DEVICES.setdefault((op, backend), set()).add(device)
            _select_cached.cache_clear()  # the cached choices predate the failure
        warn = fallback is not None and (op, cause) not in _WARNED
        if warn:
            _WARNED.add((op, cause))
    if warn:
        warnings.warn(
            f"amdqb: the {backend} backend cannot build its kernels for {op!r} on {device}: "
            f"{cause}. {op!r} runs on {fallback} on this device from now on "
            "(amdqb.dispatch.report() lists it; `amdqb info --build` shows it).",
            RuntimeWarning,
            stacklevel=2,
        )
    return cause


def failures(device: torch.device | str | None = None) -> list[dict]:
    """The recorded run-time build failures (of ``device``, or all)."""
    key = None if device is None else _device_key(device)
    with _FAILURE_LOCK:
        items = sorted(_FAILURES.items())
    return [
        {"op": op, "device": dev, "backend": name, "cause": cause}
        for (op, dev, name), cause in items
        if key is None or dev == key
    ]


def _forget_failures() -> None:
    """Forget every recorded failure (tests)."""
    with _FAILURE_LOCK:
        _FAILURES.clear()
        for devices in _FAILED_DEVICES.values():
            devices.clear()  # the guarded implementations hold these sets
        _WARNED.clear()
        _select_cached.cache_clear()


def _failed_reason(device: str, cause: str) -> str:
    return f"failed to build on {device}: {cause}"


def _runnable(name: str, op: str, info: DeviceInfo, device: str, features: tuple):
    """(implementation or None, reason) of backend ``name`` for ``op`` with ``features``."""
    ok, why = backend_status(name, info)
    if not ok:
        return None, why
    module = _backend_module(name)
    impl = getattr(module, "OPS", {}).get(op)
    if impl is None:
        return None, f"does not implement {op!r}"
    cause = _FAILURES.get((op, device, name))
    if cause is not None:
        return None, _failed_reason(device, cause)
    unsupported = getattr(module, "unsupported", None)
    reason = unsupported(op, info, dict(features)) if unsupported else None
    if reason is not None:
        return None, reason
    return impl, why


@functools.cache
def _select_cached(
    op: str,
    device_str: str,
    forced: str | None,
    preferred: str | None,
    features: tuple,
    source: str = _ENV,
) -> Choice:
    """``forced``: that backend or an error. ``preferred`` (from ``source``: AMDQB_BACKEND or a
    ``prefer=``): that backend if it can run the op, else the op's order. Neither: the order."""
    info = _device_info_cached(device_str)
    if forced:
        candidates = (forced,)
    else:
        order = preference(op, info)
        if preferred is not None:
            order = (preferred,) + tuple(name for name in order if name != preferred)
        candidates = order
    rejected: list[tuple[str, str]] = []
    for i, name in enumerate(candidates):
        impl, why = _runnable(name, op, info, device_str, features)
        if impl is None:
            rejected.append((name, why))
            continue
        fallback = None
        if not forced and getattr(_backend_module(name), "BuildError", None) is not None:
            fallback = next(
                (
                    n
                    for n in candidates[i + 1 :]
                    if _runnable(n, op, info, device_str, features)[0] is not None
                ),
                None,
            )
        table = f"first available in {info.arch_family} preference"
        if forced:
            how = "forced"
        elif preferred is None:
            how = table
        elif name == preferred:
            how = f"{source}={preferred}"
        else:
            how = f"{source}={preferred} cannot run it; {table}"
        return Choice(name, impl, f"{how} ({why})", tuple(rejected), fallback)
    detail = "; ".join(f"{n}: {w}" for n, w in rejected)
    raise RuntimeError(f"no backend can run {op!r} on {device_str}: {detail}")


def select(op: str, device: torch.device | str, backend: str | None = None, **features) -> Choice:
    """Implementation of ``op`` for ``device``.

    ``backend=`` is strict: that backend, or RuntimeError naming why it cannot run the op.
    ``AMDQB_BACKEND`` is a preference: the op runs there when that backend can run it (available,
    implements the op, does not decline ``features``, has not failed to build it on ``device``),
    else on the op's order of the device's architecture (``amdqb/configs``), as without it.

    ``features`` (hashable values: sizes, modes) let a backend decline a configuration through its
    ``unsupported(op, info, features) -> reason | None`` hook; the next backend in order is tried.
    """
    key = _device_key(device)
    features = tuple(sorted(features.items()))
    if backend is not None:
        return _select_cached(op, key, _checked(backend), None, features, _ENV)
    return _select_cached(op, key, None, _env_backend(), features, _ENV)


def _device_key(device: torch.device | str) -> str:
    """Cache key of a device: ``cuda`` resolved to the current device index."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return str(dev)


def _choose(op: str, device: str, backend, features: tuple, prefer) -> Choice:
    key = _device_key(device)
    if prefer is not None:
        # the caller's preference (a forward's backend for its backward), AMDQB_BACKEND aside
        preferred = _checked(prefer.partition(">")[0])
        return _select_cached(op, key, None, preferred, features, "prefer")
    if backend is not None:
        return _select_cached(op, key, _checked(backend), None, features, _ENV)
    return _select_cached(op, key, None, _env_backend(), features, _ENV)


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


def kernel_backend(
    op: str,
    device: torch.device | str,
    backend: str | None = None,
    *,
    prefer: str | None = None,
    **features,
) -> str:
    """:func:`backend_name` as the kernel-level ops take it (:func:`implementation`'s ``token``):
    the backend's name, or ``"<name>><fallback>"`` when the backend builds kernels at run time and
    the dispatcher chose it (not ``backend=``) -- should the build fail, the op runs on
    ``fallback``. A trace-time constant under ``torch.compile``."""
    return _kernel_backend(
        op, str(torch.device(device)), backend, tuple(sorted(features.items())), prefer
    )


@torch.compiler.assume_constant_result
def _backend_name(
    op: str, device: str, backend: str | None, features: tuple, prefer: str | None = None
) -> str:
    return _choose(op, device, backend, features, prefer).backend


@torch.compiler.assume_constant_result
def _kernel_backend(
    op: str, device: str, backend: str | None, features: tuple, prefer: str | None = None
) -> str:
    return _choose(op, device, backend, features, prefer).token


# ------------------------------------------------------------------------------------------------
# Implementations by token
# ------------------------------------------------------------------------------------------------
_IMPLS: dict[tuple[str, str], object] = {}


def implementation(op: str, token: str):
    """The callable the kernel-level op ``op`` runs for ``token`` (:func:`kernel_backend`)."""
    fn = _IMPLS.get((op, token))
    if fn is None:
        fn = _IMPLS.setdefault((op, token), _build_implementation(op, token))
    return fn


def _build_implementation(op: str, token: str):
    name, _, fallback = token.partition(">")
    module = _backend_module(_checked(name))
    primary = module.OPS[op]
    error = getattr(module, "BuildError", None)
    if error is None:
        return primary
    return _guarded(
        op,
        name,
        primary,
        error,
        fallback or None,
        implementation(op, fallback) if fallback else None,
    )


def _arg_device(args) -> str:
    for a in args:
        if isinstance(a, torch.Tensor):
            return str(a.device)
    return "cpu"


def _guarded(op, backend, primary, error, fallback_name, fallback):
    """``primary`` that, when it raises ``error`` (its kernels cannot be built on the inputs'
    device), records the failure and runs ``fallback`` instead (or re-raises: a ``backend=``
    call). A failed device goes straight to ``fallback`` afterwards: the way of graphs traced
    before the failure, whose token stays; eager calls select again and never get here."""
    failed = _FAILED_DEVICES.setdefault((op, backend), set())

    def run(*args):
        if failed:  # empty unless this op failed somewhere: one truth test on the success path
            device = _arg_device(args)
            if device in failed:
                if fallback is None:
                    cause = _FAILURES.get((op, device, backend), "?")
                    raise RuntimeError(
                        f"no backend can run {op!r} on {device}: {backend}: "
                        f"{_failed_reason(device, cause)}"
                    )
                return fallback(*args)
        try:
            return primary(*args)
        except error as exc:
            record_failure(op, backend, _arg_device(args), exc, fallback_name)
            if fallback is None:
                raise
            return fallback(*args)

    run.__name__ = run.__qualname__ = f"{backend}_{op}_or_{fallback_name or 'raise'}"
    run.__doc__ = primary.__doc__
    return run


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------
def report(device: torch.device | str | None = None) -> dict:
    """Everything the dispatcher knows, for ``python -m amdqb info``: the device, the backends,
    every op's backend (why, what it falls back to should its build fail, which backends were
    passed over and why), the AMDQB_BACKEND preference, the recorded build failures, the config."""
    info = device_info(device)
    backends = {}
    for name in BACKENDS:
        ok, why = backend_status(name, info)
        backends[name] = {"available": ok, "reason": why}
    try:
        preferred, pref_error = _env_backend(), None
    except ValueError as exc:  # report it rather than fail the report
        preferred, pref_error = None, str(exc)
    from .backends import OP_NAMES

    ops = {}
    follow, fell_back = [], {}
    for op in OP_NAMES:
        try:
            choice = _select_cached(op, info.device, None, preferred, (), _ENV)
        except RuntimeError as exc:
            ops[op] = {"backend": None, "reason": str(exc), "fallback": None, "rejected": {}}
            continue
        rejected = dict(choice.rejected)
        ops[op] = {
            "backend": choice.backend,
            "reason": choice.reason,
            "fallback": choice.fallback,
            "rejected": rejected,
        }
        if preferred is not None:
            if choice.backend == preferred:
                follow.append(op)
            else:
                fell_back[op] = {"backend": choice.backend, "why": rejected.get(preferred, "?")}
    pref = None
    if preferred is not None or pref_error is not None:
        pref = {
            "backend": preferred,
            "error": pref_error,
            "follow": follow,
            "fell_back": fell_back,
        }
    cfg = configs.load(info.arch_family)
    entries = {
        key: {"value": e.value, "provenance": e.provenance, "file": e.source}
        for key, e in cfg.items()
    }
    return {
        "device": info.as_dict(),
        "backends": backends,
        "ops": ops,
        "preference": pref,
        "failures": failures(info.device),
        "config": {"arch": cfg.arch, "entries": entries},
    }
