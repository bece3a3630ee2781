"""The ``hip`` backend: ``hip_src`` kernels compiled at run time (hiprtc via hip-python on ROCm,
NVRTC via cuda-python on NVIDIA), cached on disk, launched on torch's current stream.

Ops: ``router_fwd``, ``biased_topk``, ``route_rows``, ``align_block_size``. Declined through
:func:`unsupported` (the dispatcher falls back to triton/torch): grouped Top-k, more than 4096
experts in a router or an align, Top-n above 64 (n = k, or k + 1 under QB), QB with more than 12288
bins. ``router_bwd``, the QB updates and the chunk ops are left to the other backends.

Precision and tie-break contract (same as ``amdqb.ref``): logits are converted to fp32 on load;
activations, biased scores, selection, normalisation, the QB cutoff and histogram arithmetic are
fp32 with fp contraction off; probs are rounded to the logits dtype (nearest even). Selection is
exact: (value descending, expert id ascending), ``-0.0 == +0.0``, NaN below every number; the
activation is the backend's own (``expf``-based sigmoid, not bitwise torch's), which is why
:func:`score_values` exists: evaluated on these scores the oracle gives identical routes and QB
histograms. Both QB histogram modes give bitwise-identical histograms. Route rows: counts exact,
rows a bijection onto each expert's slots; order inside an expert is unspecified (any atomic
interleaving) unless ``deterministic=True`` (ascending flat route index; beyond 12288 experts the
deterministic mode runs the oracle, eager only).

Verification without a device: every kernel compiles for gfx942 / gfx1100 / gfx1201 (clang-19),
sm_90 (nvcc) and through NVRTC with the runtime's own flags (op_tests/test_hip_compile.py), and runs
on the CPU under the host emulator of op_tests/hip_emu (wave32 and wave64 logical warps) against
the oracles (the op tests' ``hip`` parameters on the CPU). On an NVIDIA H200 the NVRTC path ran
the suite's hip tests (all passed or skipped with a reason, 2026-11-29) and the benchmarks. hiprtc has not executed
anything: no ROCm device exists here.
"""

from __future__ import annotations

import functools

import torch

from . import _ops

BACKEND = "hip"


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
        if num_experts > _ops.MAX_ALIGN_EXPERTS:
            return (
                f"hip: align with num_experts={num_experts} > {_ops.MAX_ALIGN_EXPERTS} (LDS rows)"
            )
        return None
    if op not in ("router_fwd", "biased_topk"):
        return None
    if features.get("grouped"):
        return "hip: grouped Top-k is not implemented"
    num_experts = int(features.get("num_experts", 0))
    if num_experts > _ops.MAX_ROUTER_EXPERTS:
        return (
            f"hip: num_experts={num_experts} > {_ops.MAX_ROUTER_EXPERTS} (register-resident rows)"
        )
    qb = bool(features.get("qb"))
    n = int(features.get("topk", 0)) + (1 if qb else 0)
    if n > _ops.MAX_SELECT:
        return f"hip: selecting {n} experts per token > {_ops.MAX_SELECT}"
    if qb and int(features.get("num_bins", 0)) > _ops.MAX_QB_BINS:
        return f"hip: QB num_bins={features.get('num_bins')} > {_ops.MAX_QB_BINS} (LDS row)"
    return None


def _on_runtime(op):
    """The launcher ``_ops.<op>`` with the process runtime as its first argument."""

    @functools.wraps(op)
    def call(*args):
        return op(_rt(), *args)

    return call


router_fwd = _on_runtime(_ops.router_fwd)
biased_topk = _on_runtime(_ops.biased_topk)
align_block_size = _on_runtime(_ops.align_block_size)


def route_rows(
    topk_ids, num_experts, capacity, counters, rows_out, counts_out, deterministic, impl
):
    if deterministic and num_experts > _ops.MAX_DET_EXPERTS:
        # Beyond the LDS budget of the deterministic kernels: the oracle (eager only).
        from ..torch import route_rows as torch_route_rows

        torch_route_rows(
            topk_ids, num_experts, capacity, counters, rows_out, counts_out, deterministic, impl
        )
        return
    _ops.route_rows(
        _rt(), topk_ids, num_experts, capacity, counters, rows_out, counts_out, deterministic, impl
    )


def score_values(logits2d: torch.Tensor, score_function: str) -> torch.Tensor:
    """fp32 ``[T, E]`` activations exactly as the router kernel computes them (softmax: over E)."""
    return _ops.score_values(_rt(), logits2d.contiguous(), score_function)


OPS = {
    "router_fwd": router_fwd,
    "biased_topk": biased_topk,
    "route_rows": route_rows,
    "align_block_size": align_block_size,
}
