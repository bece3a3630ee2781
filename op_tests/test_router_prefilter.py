"""amdqb_router's prefilter build (``hip.router.prefilter``, router.hip's ``AMDQB_PREFILTER``):
the Top-n selected through the bounded approximate sigmoid first, the candidates' exact keys
after, and the exact keys of the whole row where the approximation cannot decide (candidates past
the buffer, a cutoff that is not finite or beyond 1e30). Its outputs must be the exact build's,
bit for bit, and the oracle's on the kernel's scores.

On the CPU emulator the approximation is perturbed up to 0.95 of a 2^-14 bound (far beyond the
hardware's 2^-19; op_tests/hip_emu/amdqb_emu.h), so that a candidate bound that trusted the
approximation past its error would drop or misorder routes here.
"""

import ctypes

import pytest
import torch

from amdqb.backends.hip import router as hip_router

from conftest import DEVICE, GCN, HAS_GPU, over_backends, set_config
from hip_emu.checks import make_logits
from router_cases import check_hip_router, hip_run_router, kernel_scores

E, T = (896, 600) if HAS_GPU else (257, 19)
K = 16


def _logits(style: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, bias) of one style, CPU."""
    g = torch.Generator().manual_seed(3)
    bias = (torch.randn(E, generator=g) * 0.05).float()
    if style == "close":
        # 40 experts per row within 1e-5 of each other at the top: every one a candidate, their
        # approximate order scrambled by the perturbation, their exact order distinct
        x = torch.randn(T, E, generator=g) - 3.0
        top = torch.stack([torch.randperm(E, generator=g)[:40] for _ in range(T)])
        x.scatter_(1, top, 2.0 + torch.rand(T, 40, generator=g) * 1e-5)
        return x, torch.zeros(E)
    if style == "huge_bias":  # cutoffs past 1e30: the exact keys decide
        bias[: E // 2] = 3e30
        return make_logits(T, E, "normal", 4), bias
    x = make_logits(T, E, style, 5)
    if style in ("ties", "overflow"):
        bias = torch.zeros(E)  # keep the logits' exact ties
    return x, bias


_PREFILTER = ("AMDQB_PREFILTER", "1")
# the warp-per-token kernel at every T, on a GPU too (the decode form has no prefilter build)
_DECODE_OFF = {"hip.router.decode_max_tokens": 0, "hip.router.decode_max_tokens_fused": 0}


@over_backends("router_fwd", waves=(32, 64), gcn=GCN, only=("hip",))
@pytest.mark.parametrize("style", ["normal", "close", "ties", "nan_inf", "overflow", "huge_bias"])
def test_prefilter_build_equals_the_exact_build_bitwise(
    backend, emu_rt, warp_router, monkeypatch, style
):
    """Probs, every routing map, the QB cutoffs' histograms (two-kernel and fused uniform) with
    the prefilter on and off: the same bits, and the oracle's on the kernel's scores."""
    logits, bias = _logits(style)
    if DEVICE != "cpu":
        logits, bias = logits.to(DEVICE), bias.to(DEVICE)
    s = kernel_scores("hip", logits, "sigmoid")
    runs = {}
    for on in (False, True):
        set_config(monkeypatch, {"hip.router.prefilter": on, **_DECODE_OFF})
        out = []
        for fmt in ("bytemap", "bitmap_u8", "int64"):
            probs, m, _, _, _ = hip_run_router(backend, logits, K, fmt, bias=bias)
            out += [probs, m]
        for mode in ("two_kernel", "fused_atomic"):
            out.append(hip_run_router(backend, logits, K, "int32", bias, mode, 64)[3])
        if on:
            check_hip_router(backend, logits, K, "int32", bias=bias, scores=s)
            check_hip_router(
                backend,
                logits,
                K,
                "bitmap_u8",
                bias=bias,
                qb_mode="two_kernel",
                num_bins=64,
                scores=s,
            )
        runs[on] = out
    for a, b in zip(runs[False], runs[True]):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if emu_rt is not None:
        libs = [lib for (spec, _), lib in emu_rt._libs.items() if _PREFILTER in spec.defines]
        assert libs, "the prefilter build did not run"
        if style == "overflow":  # past the candidate buffer: the exact keys decided
            for lib in libs:
                lib.amdqb_emu_overflows.restype = ctypes.c_longlong
            assert sum(lib.amdqb_emu_overflows() for lib in libs) > 0


def test_prefilter_applies_to_the_exact_sigmoid_only():
    """The launcher's rule: the exact sigmoid without the tie-free order or log_margin binning,
    at most 32 experts a lane, and only where the config turns it on."""

    class Rt:  # a runtime with 32-lane rows
        pass

    on = {"hip.router.prefilter": True}
    off = {"hip.router.prefilter": False}
    kw = dict(tie_free=False, approximate=False, margin=False)
    assert hip_router.prefilter_applies(on, Rt(), 0, 896, "sigmoid", **kw)
    assert hip_router.prefilter_applies(on, Rt(), 0, 1024, "sigmoid", **kw)
    assert not hip_router.prefilter_applies(on, Rt(), 0, 1025, "sigmoid", **kw)
    assert not hip_router.prefilter_applies(off, Rt(), 0, 896, "sigmoid", **kw)
    for score in ("softmax", "sqrtsoftplus"):
        assert not hip_router.prefilter_applies(on, Rt(), 0, 896, score, **kw)
    for flag in ("tie_free", "approximate", "margin"):
        assert not hip_router.prefilter_applies(on, Rt(), 0, 896, "sigmoid", **{**kw, flag: True})
