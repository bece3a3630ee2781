"""Backend selection, with reasons.

Backends (one folder each under ``amdqb/backends``):

* ``hip``    -- ``hip_src`` kernels compiled at run time (hiprtc via hip-python on ROCm, NVRTC via
  cuda-python on NVIDIA);
* ``triton`` -- portable Triton kernels (NVIDIA and AMD; on the CPU only under ``TRITON_INTERPRET=1``);
* ``torch``  -- the pure-PyTorch oracles of ``amdqb.ref``: always available, CPU and GPU.

Every op asks :func:`select` for the backend of one call, described by its call type (the
router's :class:`~amdqb.backends.calls.RouterCall`) or request (``amdqb.backends.calls``). The
choice walks the op's backend order for the device's architecture family (``backend_order.*`` in
``amdqb/configs/<arch>.json``) and takes the first backend that is available, implements the op,
has not failed to build it on the device and whose capability check for the op
(``LIMITS[op](info, call) -> reason | None``, declared next to the op's launcher) accepts the call;
each backend passed over records why (``amdqb info`` prints it).

* ``backend=`` forces a backend: it runs the op or the op raises, naming why;
* ``AMDQB_BACKEND`` (environment) and ``prefer=`` (a forward's backend, for its backward) are
  preferences: that backend when it can run the call, else the order as without them.

Run-time build failures: the hip backend compiles (hiprtc / NVRTC) and loads its code objects at
the first kernel request of an op on a device. When that fails it raises its ``BuildError``
before anything of the op call has launched; the op then runs on the next backend that can run
the call, with one ``RuntimeWarning`` per (op, cause), and later selections pass the backend over
for that op on that device (:func:`failures`). Nothing is compiled to find this out beforehand.
Under ``torch.compile`` the choice is a trace-time constant: the kernel-level ops receive
:func:`kernel_backend`'s token, the backend's name or ``"<name>><fallback>"`` (hip, and the backend
to run should its build fail), so a graph traced before a failure runs the fallback without
tracing again. A ``backend=`` call gets no fallback: it raises.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import threading
import warnings

import torch
from torch.fx.experimental.symbolic_shapes import guard_scalar

from . import configs, devices
from .backends import OP_NAMES, calls
from .devices import (  # noqa: F401 (re-exported: the dispatcher's view of a device)
    DeviceInfo,
    amd_arch_family,
    amd_wave_size,
    as_device,
    device_info,
)

BACKENDS = ("hip", "triton", "torch")
_ENV = "AMDQB_BACKEND"


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


def preference(op: str, info: DeviceInfo) -> tuple[str, ...]:
    """The backend order of ``op`` on ``info``'s architecture (``amdqb/configs``)."""
    return configs.load(info.arch_family).backend_order(op)


def _checked(name: str, what: str = "backend") -> str:
    if name not in BACKENDS:
        raise ValueError(f"{what} must be one of {BACKENDS}, got {name!r}")
    return name


def _env_backend() -> str | None:
    value = os.environ.get(_ENV, "").strip().lower()
    return _checked(value, _ENV) if value else None


# ------------------------------------------------------------------------------------------------
# Run-time build failures: (op, device, backend) -> cause, remembered for the process.
# ------------------------------------------------------------------------------------------------
_FAILURES: dict[tuple[str, str, str], str] = {}
_WARNED: set[tuple[str, str]] = set()
_LOCK = threading.Lock()


def failure_cause(exc: BaseException) -> str:
    """One line naming why a build failed (the error's ``summary`` when it has one)."""
    text = getattr(exc, "summary", None) or next(
        (line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__
    )
    return text if len(text) <= 300 else text[:297] + "..."


def record_failure(op, backend, device, exc, fallback=None) -> str:
    """Remember that ``backend`` cannot build ``op`` on ``device`` (later selections pass it over
    there); warn once per (op, cause) when the op runs on ``fallback`` instead. Returns the
    cause."""
    cause = failure_cause(exc)
    with _LOCK:
        _FAILURES.setdefault((op, device, backend), cause)
        _select.cache_clear()  # the cached choices predate the failure
        warn = fallback is not None and (op, cause) not in _WARNED
        _WARNED.add((op, cause))
    if warn:
        warnings.warn(
            f"amdqb: the {backend} backend cannot build its kernels for {op!r} on {device}: "
            f"{cause}. {op!r} runs on {fallback} on this device from now on "
            "(amdqb.dispatch.report() lists it; `amdqb info --build` shows it).",
            RuntimeWarning,
            stacklevel=3,
        )
    return cause


def failures(device: torch.device | str | None = None) -> list[dict]:
    """The recorded run-time build failures (of ``device``, or all)."""
    key = None if device is None else _device_key(device)
    with _LOCK:
        items = sorted(_FAILURES.items())
    return [
        {"op": op, "device": dev, "backend": name, "cause": cause}
        for (op, dev, name), cause in items
        if key is None or dev == key
    ]


# ------------------------------------------------------------------------------------------------
# Selection
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Choice:
    """The backend of one (op, device, call): what runs, why, which backends were passed over (and
    why), and what runs should ``backend`` fail to build its kernels at run time."""

    op: str
    backend: str
    reason: str
    rejected: tuple[tuple[str, str], ...] = ()
    fallback: str | None = None  # set for a backend that builds at run time, never for backend=

    @property
    def token(self) -> str:
        """What the kernel-level op is given (:func:`implementation`)."""
        return self.backend if self.fallback is None else f"{self.backend}>{self.fallback}"

    @property
    def impl(self):
        return implementation(self.op, self.token)


def _passed_over(name: str, op: str, info: DeviceInfo, call) -> str | None:
    """Why backend ``name`` cannot run ``call`` of ``op`` on ``info``'s device, or None."""
    ok, why = backend_status(name, info)
    if not ok:
        return why
    module = _backend_module(name)
    if op not in module.OPS:
        return f"does not implement {op!r}"
    cause = _FAILURES.get((op, info.device, name))
    if cause is not None:
        return f"failed to build on {info.device}: {cause}"
    check = getattr(module, "LIMITS", {}).get(op)
    return check(info, call) if check is not None else None


@functools.cache
def _select(op: str, device: str, forced, preferred, source: str, call) -> Choice:
    info = devices._device_info_cached(device)
    table = preference(op, info)
    order = (forced,) if forced else table
    if preferred and not forced:
        order = (preferred,) + tuple(n for n in table if n != preferred)
    rejected = []
    for i, name in enumerate(order):
        why = _passed_over(name, op, info, call)
        if why is not None:
            rejected.append((name, why))
            continue
        fallback = None
        if not forced and getattr(_backend_module(name), "BuildError", None) is not None:
            fallback = next(
                (n for n in order[i + 1 :] if _passed_over(n, op, info, call) is None), None
            )
        in_order = f"first available in {info.arch_family} preference"
        if forced:
            how = "forced"
        elif preferred is None:
            how = in_order
        elif name == preferred:
            how = f"{source}={preferred}"
        else:
            how = f"{source}={preferred} cannot run it; {in_order}"
        ok_reason = backend_status(name, info)[1]
        return Choice(op, name, f"{how} ({ok_reason})", tuple(rejected), fallback)
    detail = "; ".join(f"{n}: {w}" for n, w in rejected)
    raise RuntimeError(f"no backend can run {op!r} on {device}: {detail}")


def _device_key(device: torch.device | str) -> str:
    """Cache key of a device: ``cuda`` resolved to the current device index."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return str(dev)


def select(
    op: str,
    device: torch.device | str,
    backend: str | None = None,
    call=None,
    *,
    prefer: str | None = None,
    **features,
) -> Choice:
    """The backend of ``op`` for ``call`` on ``device``.

    ``call``: the op's call type or request (``amdqb.backends.calls``); without one the op's
    default request with ``features`` replacing its fields. ``backend=`` is strict: that backend,
    or a RuntimeError naming why it cannot run the call. ``prefer=`` (a backend or a token): that
    backend when it can run the call, else the order (``AMDQB_BACKEND`` aside); otherwise
    ``AMDQB_BACKEND`` is such a preference.
    """
    if call is None:
        call = calls.request(op, **features)
    elif features:
        raise TypeError("select takes a call or features, not both")
    key = _device_key(device)
    if backend is not None:
        return _select(op, key, _checked(backend), None, "", call)
    if prefer is not None:
        return _select(op, key, None, _checked(prefer.partition(">")[0]), "prefer", call)
    return _select(op, key, None, _env_backend(), _ENV, call)


def kernel_backend(
    op: str,
    device: torch.device | str,
    backend: str | None = None,
    call=None,
    *,
    prefer: str | None = None,
    **features,
) -> str:
    """:func:`select`'s token (:attr:`Choice.token`), as the kernel-level ops take it: a
    trace-time constant under ``torch.compile``."""
    if call is None:
        call = calls.request(op, **features)
    if not torch.compiler.is_compiling():  # eager: the cached choice, nothing rebuilt per call
        return select(op, device, backend, call, prefer=prefer).token
    # numbers specialise with a guard (an int argument of a function compiled with dynamic=True
    # arrives symbolic; the token must be a trace-time constant)
    values = tuple(_specialised(getattr(call, f.name)) for f in dataclasses.fields(call))
    return _token(op, str(torch.device(device)), backend, prefer, type(call), values)


def _specialised(value):
    if isinstance(value, (int, float, torch.SymInt, torch.SymFloat, torch.SymBool)):
        return guard_scalar(value)
    return value


@torch.compiler.assume_constant_result
def _token(op: str, device: str, backend, prefer, call_type, values: tuple) -> str:
    # the call travels as (type, field values): a traced graph passes constants, not dataclasses
    return select(op, device, backend, call_type(*values), prefer=prefer).token


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
    fallback_impl = implementation(op, fallback) if fallback else None

    def run(*args):
        """``primary``; when it raises ``error`` (its kernels cannot be built on the inputs'
        device), the failure is recorded and ``fallback`` runs instead (or the error propagates:
        a ``backend=`` call). A device that failed goes to ``fallback`` directly: the way of graphs
        traced before the failure, whose token stays (eager calls select again)."""
        if _FAILURES:  # empty unless a build failed somewhere: one truth test on the success path
            device = _arg_device(args)
            cause = _FAILURES.get((op, device, name))
            if cause is not None:
                if fallback_impl is None:
                    raise RuntimeError(
                        f"no backend can run {op!r} on {device}: {name}: failed to build on "
                        f"{device}: {cause}"
                    )
                return fallback_impl(*args)
        try:
            return primary(*args)
        except error as exc:
            record_failure(op, name, _arg_device(args), exc, fallback or None)
            if fallback_impl is None:
                raise
            return fallback_impl(*args)

    run.__name__ = run.__qualname__ = f"{name}_{op}_or_{fallback or 'raise'}"
    return run


def _arg_device(args) -> str:
    for a in args:
        if isinstance(a, torch.Tensor):
            return str(a.device)
    return "cpu"


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------
def report(device: torch.device | str | None = None) -> dict:
    """Everything the dispatcher knows, for ``amdqb info``: the device, the backends, every op's
    backend for its default request (why, what it falls back to should its build fail, which
    backends were passed over and why), the AMDQB_BACKEND preference, the recorded build
    failures, the config."""
    info = device_info(device)
    backends = {}
    for name in BACKENDS:
        ok, why = backend_status(name, info)
        backends[name] = {"available": ok, "reason": why}
    try:
        preferred, pref_error = _env_backend(), None
    except ValueError as exc:  # report it rather than fail the report
        preferred, pref_error = None, str(exc)
    ops, follow, fell_back = {}, [], {}
    for op in OP_NAMES:
        call = calls.request(op)
        try:
            choice = _select(op, info.device, None, preferred, _ENV, call)
        except RuntimeError as exc:
            ops[op] = {"backend": None, "reason": str(exc), "fallback": None, "rejected": {}}
            continue
        rejected = dict(choice.rejected)
        ops[op] = {
            "backend": choice.backend,
            "reason": choice.reason,
            "fallback": choice.fallback,
            "rejected": rejected,
            "request": repr(call),
        }
        if preferred is not None:
            if choice.backend == preferred:
                follow.append(op)
            else:
                fell_back[op] = {"backend": choice.backend, "why": rejected.get(preferred, "?")}
    pref = None
    if preferred is not None or pref_error is not None:
        pref = {"backend": preferred, "error": pref_error, "follow": follow, "fell_back": fell_back}
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
