"""The ``hip`` backend: ``hip_src`` kernels compiled at run time (hiprtc via hip-python on ROCm,
NVRTC via cuda-python on NVIDIA), cached on disk, launched on torch's current stream.

Ops: ``router_fwd`` (``router.py``; grouped: amdqb_topk's dense form, ``topk.py``),
``router_bwd`` (``router_bwd.py``), ``biased_topk`` (``topk.py``: amdqb_topk, or the router
kernels where it has no row plan), ``route_rows`` and ``align_block_size`` (``layout.py``). Capability limits, declared next to each op's launcher (``LIMITS``: the
dispatcher passes the backend over, another runs the call; ``backend="hip"`` raises naming the
limit): grouped Top-k without an amdqb_topk row plan (topk.py; in the TE router also under QB or
the tie-free selection), more than 4096 experts in a router or an align, more than 1024 in the
router's backward, Top-n above ``hip.router.cap`` (n = k, or k + 1 under QB), QB with more than
12288 bins, deterministic routes with more than 12288 experts. The QB updates and the chunk ops
are left to the other backends. Nothing here runs another backend.

Build failures: a module is compiled and loaded at the first kernel request of an op on a device
(nothing is compiled at import or by ``availability``). When that fails -- hiprtc rejects the
target or a builtin, the driver refuses the code object, the binding errs -- the runtime raises
:class:`BuildError` before anything of the op call has launched, and the dispatcher runs the op on
the next backend of its order (one warning, remembered per op and device; ``amdqb info`` lists it).
Launch errors are not build failures: they raise.

Precision and tie-break contract: the one of ``amdqb.ref`` (see ``router.py`` and ``layout.py``).

Verification without a device: every kernel compiles for the AMD targets and for sm_90 (nvcc) and
through NVRTC with the runtime's own flags (op_tests/test_hip_compile.py), and runs on the CPU under
the host emulator of op_tests/hip_emu (wave32 and wave64 logical warps) against the oracles. hiprtc
has not executed anything: no ROCm device exists where this is developed.
"""

from __future__ import annotations

import functools
import inspect

import torch

from ..calls import RouterCall
from . import layout, router, router_bwd, topk
from ._runtime import HipBuildError

BACKEND = "hip"
# a failed kernel build (raised before anything of the op call launched): the dispatcher runs the
# op on its next backend instead
BuildError = HipBuildError


def _rt():
    from ._runtime import get_runtime

    return get_runtime()


def availability(info) -> tuple[bool, str]:
    if info.vendor == "cpu":
        return False, (
            "no GPU: the hip backend compiles hip_src at run time for a ROCm (hiprtc) or NVIDIA "
            "(NVRTC) device"
        )
    if info.vendor == "amd" and torch.version.hip is None:
        return False, "torch is not a ROCm build"
    try:
        rt = _rt()
    except ImportError as exc:
        return False, str(exc)
    except Exception as exc:  # a broken installation must not break dispatch
        return False, f"runtime initialisation failed: {exc}"
    return True, f"{rt.toolchain.compiler_id()} on {info.arch} (wave{info.wave_size})"


def _on_runtime(op):
    """The launcher ``op`` with the process runtime as its first argument (its signature: the
    launcher's without ``rt``)."""

    @functools.wraps(op)
    def call(*args):
        return op(_rt(), *args)

    sig = inspect.signature(op)
    call.__signature__ = sig.replace(parameters=list(sig.parameters.values())[1:])
    return call


LIMITS = {**router.LIMITS, **router_bwd.LIMITS, **layout.LIMITS, **topk.LIMITS}


def router_fwd(
    call: RouterCall,
    logits,
    expert_bias,
    probs_out,
    map_out,
    qb_histogram,
    qb_bin_bounds,
    scores_out,
    cutoff_out,
):
    """amdqb_router (router.py), or for grouped calls amdqb_topk's dense form (topk.py)."""
    launcher = topk.router_fwd_grouped if call.grouped else router.router_fwd
    launcher(
        _rt(),
        call,
        logits,
        expert_bias,
        probs_out,
        map_out,
        qb_histogram,
        qb_bin_bounds,
        scores_out,
        cutoff_out,
    )


biased_topk = _on_runtime(topk.biased_topk)
align_block_size = _on_runtime(layout.align_block_size)


route_rows = _on_runtime(layout.route_rows)


OPS = {
    "router_fwd": router_fwd,
    "router_bwd": _on_runtime(router_bwd.router_bwd),
    "biased_topk": biased_topk,
    "route_rows": route_rows,
    "align_block_size": align_block_size,
}
