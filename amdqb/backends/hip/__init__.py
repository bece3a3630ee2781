"""The ``hip`` backend: ``hip_src`` kernels compiled at run time (hiprtc via hip-python on ROCm,
NVRTC via cuda-python on NVIDIA), cached on disk, launched on torch's current stream.

Ops: ``router_fwd`` and ``biased_topk`` (``router.py``), ``route_rows`` and ``align_block_size``
(``layout.py``). Declined through :func:`unsupported` (the dispatcher falls back to triton/torch):
grouped Top-k, more than 4096 experts in a router or an align, Top-n above ``hip.router.cap``
(n = k, or k + 1 under QB), QB with more than 12288 bins. ``router_bwd``, the QB updates and the
chunk ops are left to the other backends.

Build failures: a module is compiled and loaded at the first kernel request of an op on a device
(nothing is compiled at import or by ``availability``). When that fails -- hiprtc rejects the
target or a builtin, the driver refuses the code object, the binding errs -- the runtime raises
:class:`BuildError` before anything of the op call has launched, and the dispatcher runs the op on
the next backend of its order (one warning, remembered per op and device; ``amdqb info`` lists it).
Launch errors are not build failures: they raise.

Precision and tie-break contract: the one of ``amdqb.ref`` (see ``router.py`` and ``layout.py``).
:func:`score_values` returns the fp32 activations exactly as the router kernels compute them.

Verification without a device: every kernel compiles for the AMD targets and for sm_90 (nvcc) and
through NVRTC with the runtime's own flags (op_tests/test_hip_compile.py), and runs on the CPU under
the host emulator of op_tests/hip_emu (wave32 and wave64 logical warps) against the oracles. hiprtc
has not executed anything: no ROCm device exists where this is developed.
"""

from __future__ import annotations

import functools
import inspect

import torch

from ... import configs
from . import layout, router
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


def unsupported(op: str, info, features: dict):
    """Reason this backend declines a configuration, or None."""
    if op == "align_block_size":
        num_experts = int(features.get("num_experts", 0))
        if num_experts > layout.MAX_ALIGN_EXPERTS:
            return f"align with num_experts={num_experts} > {layout.MAX_ALIGN_EXPERTS} (LDS rows)"
        return None
    if op not in ("router_fwd", "biased_topk"):
        return None
    if features.get("grouped"):
        return "grouped Top-k is not implemented"
    num_experts = int(features.get("num_experts", 0))
    if num_experts > router.MAX_ROUTER_EXPERTS:
        return (
            f"num_experts={num_experts} > {router.MAX_ROUTER_EXPERTS} " "(register-resident rows)"
        )
    qb = bool(features.get("qb"))
    n = int(features.get("topk", 0)) + (1 if qb else 0)
    cap = router.max_select(configs.load(info.arch_family))
    if n > cap:
        return f"selecting {n} experts per token > {cap}"
    if qb and int(features.get("num_bins", 0)) > router.MAX_QB_BINS:
        return f"QB num_bins={features.get('num_bins')} > {router.MAX_QB_BINS} (LDS row)"
    return None


def _on_runtime(op):
    """The launcher ``op`` with the process runtime as its first argument (its signature: the
    launcher's without ``rt``)."""

    @functools.wraps(op)
    def call(*args):
        return op(_rt(), *args)

    sig = inspect.signature(op)
    call.__signature__ = sig.replace(parameters=list(sig.parameters.values())[1:])
    return call


router_fwd = _on_runtime(router.router_fwd)
biased_topk = _on_runtime(router.biased_topk)
align_block_size = _on_runtime(layout.align_block_size)


def route_rows(
    topk_ids, num_experts, capacity, counters, rows_out, counts_out, deterministic, impl
):
    if deterministic and num_experts > layout.MAX_DET_EXPERTS:
        # Beyond the LDS budget of the deterministic kernels: the oracle (eager only).
        from ..torch import route_rows as torch_route_rows

        torch_route_rows(
            topk_ids, num_experts, capacity, counters, rows_out, counts_out, deterministic, impl
        )
        return
    layout.route_rows(
        _rt(), topk_ids, num_experts, capacity, counters, rows_out, counts_out, deterministic, impl
    )


def score_values(
    logits2d: torch.Tensor, score_function: str, complement=False, approximate=False
) -> torch.Tensor:
    """fp32 ``[T, E]`` activations exactly as the router kernel computes them (softmax: over E);
    ``complement``: the tie-free selection's ``sigmoid(-z)``; ``approximate``: the opt-in
    approximate activation's."""
    return router.score_values(
        _rt(), logits2d.contiguous(), score_function, complement=complement, approximate=approximate
    )


OPS = {
    "router_fwd": router_fwd,
    "biased_topk": biased_topk,
    "route_rows": route_rows,
    "align_block_size": align_block_size,
}
