"""The dispatcher's ``hip`` backend on the CPU emulator (either lane model of ``runtime.py``).

Inside :func:`emulated_hip_backend` the public ops called with ``backend="hip"`` on CPU tensors run
the hip_src kernels through the backend's own entry points (``amdqb.backends.hip.OPS`` and its
launchers) on an :class:`~hip_emu.runtime.EmuRuntime`: the backend reports itself available on the
CPU and its process runtime is the emulator. Outputs the kernels must write in full are poisoned
before every launch (probs 7.0, maps / ids / rows -7, bitmaps 0xA5, byte maps True), so an element
a kernel leaves unwritten shows up in the comparison with the oracle. Devices other than the CPU
keep the real backend's availability.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from amdqb import dispatch
from amdqb.backends import hip as hip_backend

from .runtime import EmuRuntime, compiler

_RUNTIMES: dict[tuple, EmuRuntime] = {}
_ACTIVE: list[EmuRuntime] = []


def runtime(wave: int = 32, arch: str | None = None, fiber_switch: str = "native") -> EmuRuntime:
    """The process-wide emulator runtime of one lane model (its compiled kernels are reused):
    the substitutes on ``wave``-lane waves, or the AMDGCN model of ``arch``; ``fiber_switch``
    (EmuRuntime's) picks how its fibers switch stacks."""
    key = ((wave, None) if arch is None else (None, arch)) + (fiber_switch,)
    if key not in _RUNTIMES:
        _RUNTIMES[key] = EmuRuntime(wave_size=wave, cus=2, arch=arch, fiber_switch=fiber_switch)
    return _RUNTIMES[key]


def active_runtime() -> EmuRuntime | None:
    """The runtime of the innermost :func:`emulated_hip_backend`, or None outside one."""
    return _ACTIVE[-1] if _ACTIVE else None


def _poison(t: torch.Tensor | None) -> None:
    if t is None or t.numel() == 0:
        return
    if t.dtype == torch.bool:
        t.fill_(True)
    elif t.dtype == torch.uint8:
        t.fill_(0xA5)
    elif t.is_floating_point():
        t.fill_(7.0)
    else:
        t.fill_(-7)


def _poisoning(op: str, fn):
    """``fn`` with its fully-written outputs poisoned first (positions of amdqb.backends' API)."""
    outputs = {
        # (call, logits, bias, probs_out, map_out, hist, bounds, scores_out, cutoff_out): the QB
        # histogram accumulates
        "router_fwd": (3, 4, 7, 8),
        "router_bwd": (4,),  # (call, grad_probs, logits, routed, grad_logits_out)
        "biased_topk": (3, 4, 5),  # (call, logits, bias, weights_out, ids_out, tei_out, ...)
        "route_rows": (4,),  # rows_out (counts_out arrives zero-filled, counters are inputs)
        "align_block_size": (3, 4, 5),  # sorted_ids_out, expert_ids_out, num_post_pad_out
    }[op]

    @functools.wraps(fn)
    def call(*args):
        for i in outputs:
            _poison(args[i])
        return fn(*args)

    return call


@contextlib.contextmanager
def emulated_hip_backend(wave: int = 32, arch: str | None = None):
    """Run the ``hip`` backend on the emulator for CPU tensors: the substitutes on ``wave``-lane
    waves, or (``arch``) the AMD branches on the AMDGCN model of that target; yields the
    :class:`EmuRuntime` (its ``launches`` / ``dependent_launches`` record what ran)."""
    if compiler() is None:
        raise RuntimeError("the hip emulator needs g++ (C++20)")
    rt = runtime(wave, arch)
    model = f"AMDGCN model of {arch}" if arch else "substitutes"
    saved_rt, saved_availability = hip_backend._rt, hip_backend.availability
    saved_ops = dict(hip_backend.OPS)

    def availability(info):
        if info.vendor != "cpu":
            return saved_availability(info)
        return True, f"host emulator of op_tests/hip_emu (g++, wave{rt.wave_size}, {model})"

    hip_backend._rt = lambda: rt
    hip_backend.availability = availability
    for op, fn in saved_ops.items():
        hip_backend.OPS[op] = _poisoning(op, fn)
    dispatch._select.cache_clear()
    _ACTIVE.append(rt)
    try:
        yield rt
    finally:
        _ACTIVE.pop()
        hip_backend._rt, hip_backend.availability = saved_rt, saved_availability
        hip_backend.OPS.clear()
        hip_backend.OPS.update(saved_ops)
        dispatch._select.cache_clear()
