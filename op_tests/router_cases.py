"""Inputs and oracle checks shared by the router tests (test_router.py, test_router_qb.py,
test_biased_topk.py): tie-free and adversarial logits, the public-op calls with their routing map
read back as a bool mask, each backend's own activations, and the hip checks of the router's
outputs (routes, selection order, probs and QB histograms against the oracle evaluated on the
kernel's own scores).

Shapes follow the device: small on the CPU (Triton's interpreter, the hip emulator), the seeds'
(E=896, k=16, B=1000) on a GPU.
"""

import math

import torch

import amdqb
from amdqb import dispatch, ref
from amdqb.backends.calls import RouterCall
from amdqb.backends.hip import _spec
from amdqb.backends.hip import router as hip_router
from amdqb.ref.router import qb_cutoff_and_routes, qb_histogram_counts

from conftest import DEVICE, HAS_GPU
from hip_emu.checks import routed_mask

# (T, E, k, groups) per device: the interpreter needs small shapes.
if HAS_GPU:
    T_MAIN, E_MAIN, K_MAIN, GROUPS = 1000, 896, 16, (8, 4)
else:
    T_MAIN, E_MAIN, K_MAIN, GROUPS = 11, 64, 6, (4, 2)

FORMATS = ("bytemap", "bitmap_u8", "int16", "int32", "int64")


def tie_free_logits(t, e, dtype=torch.float32, seed=0, span=6.0):
    """TE-style tie-free logits: a per-token permutation of an arange, plus a per-token offset."""
    g = torch.Generator().manual_seed(seed)
    base = torch.arange(e, dtype=torch.float64) * (span / e) - span / 2
    rows = torch.stack([base[torch.randperm(e, generator=g)] for _ in range(t)])
    rows = rows + torch.rand(t, 1, generator=g, dtype=torch.float64) * 0.1
    return rows.to(dtype).to(DEVICE)


def kernel_scores(backend, logits2d, score_function="sigmoid", approximate=False):
    """The fp32 scores the backend's own router kernels rank (``RouterCall.write_scores``: softmax
    over all E), bit for bit: the oracle evaluated on them must give the kernels' routes."""
    z = logits2d.contiguous()
    t, e = z.shape
    call = RouterCall(
        e,
        1,
        score_function,
        use_pre_softmax=score_function == "softmax",
        approximate=approximate,
        write_scores=True,
    )
    probs, routed = torch.empty_like(z), torch.empty(t, e, dtype=torch.bool, device=z.device)
    scores = torch.empty(t, e, dtype=torch.float32, device=z.device)
    dispatch._backend_module(backend).OPS["router_fwd"](
        call, z, None, probs, routed, None, None, scores, None
    )
    return scores


def run_router(backend, logits, k, fmt="bytemap", **kw):
    """Public API call; returns (probs, routing map as bool [T,E], ordered ids or None)."""
    e = logits.shape[-1]
    if fmt.startswith("int"):
        buf = torch.full((*logits.shape[:-1], k), -7, dtype=getattr(torch, fmt), device=DEVICE)
        probs, out = amdqb.fused_topk_with_score_function(
            logits, k, topk_indices=buf, backend=backend, **kw
        )
        assert out is buf
        ids = out.long().reshape(-1, k)
        routed = torch.zeros(ids.shape[0], e, dtype=torch.bool, device=DEVICE)
        routed.scatter_(1, ids, True)
        return probs, routed, ids
    probs, out = amdqb.fused_topk_with_score_function(
        logits, k, routing_map_format=fmt, backend=backend, **kw
    )
    if fmt == "bitmap_u8":
        assert out.dtype == torch.uint8 and out.shape[-1] == (e + 7) // 8
        routed = ref.unpack_bitmap(out.reshape(-1, out.shape[-1]), e)
    else:
        assert out.dtype == torch.bool
        routed = out.reshape(-1, e)
    return probs, routed, None


def oracle(logits2d, k, scores=None, **kw):
    probs, idx, routed = ref.fused_topk_with_score_function(logits2d, k, scores=scores, **kw)
    return probs, idx, routed


def tol(e, dtype=torch.float32):
    if dtype == torch.float32:
        return dict(rtol=max(2e-5, 2 * e * 2e-7), atol=max(1e-5, 2 * e * 2e-7))
    return dict(rtol=2e-2, atol=2e-3)


def check_exactly_k(routed, k):
    assert torch.equal(routed.sum(-1), torch.full_like(routed.sum(-1), k))


def qb_buffers(e, b, bias, seed=0):
    hist = torch.zeros(e, b, dtype=torch.int32, device=DEVICE)
    bounds = torch.tensor([bias.min().item() - 1.0, bias.max().item() + 1.0], device=DEVICE)
    return hist, bounds


def adversarial_rows(e):
    rows = [
        torch.zeros(e),  # all equal
        torch.full((e,), float("nan")),  # all NaN
        torch.where(torch.arange(e) % 3 == 0, float("nan"), 0.25),  # NaN among ties
        torch.full((e,), float("inf")),
        torch.full((e,), -float("inf")),
        torch.where(torch.arange(e) % 2 == 0, float("inf"), -float("inf")),
        torch.where(torch.arange(e) < e // 2, -0.0, 0.0),  # -0.0 == +0.0
        torch.round(torch.randn(e, generator=torch.Generator().manual_seed(5))),  # many ties
        torch.cat([torch.full((e - 3,), 1.0), torch.tensor([float("nan"), 2.0, -float("inf")])]),
    ]
    return torch.stack(rows).to(DEVICE)


# ----------------------------------------------------------------------------------------------
# the hip router's checks (the emulator's and the GPU's)
# ----------------------------------------------------------------------------------------------


def hip_run_router(
    backend, logits, k, fmt="bytemap", bias=None, qb_mode=None, num_bins=1000, hist=None, **kw
):
    """The public router with ``backend``, output ``fmt`` (a routing map format or an index dtype
    name) and, with ``qb_mode``, a QB histogram (``hist`` or zeros) over bounds [min(bias) - 1,
    max(bias) + 1]. Returns (probs, output, map kind, hist, bounds)."""
    t, e = logits.shape
    extra = {}
    if fmt.startswith("int"):
        extra["topk_indices"] = torch.empty(t, k, dtype=getattr(torch, fmt), device=logits.device)
    else:
        extra["routing_map_format"] = fmt
    bounds = None
    if qb_mode is not None:
        if hist is None:
            hist = torch.zeros(e, num_bins, dtype=torch.int32, device=logits.device)
        bounds = torch.stack([bias.min() - 1, bias.max() + 1]).contiguous()
        extra.update(qb_histogram=hist, qb_bin_bounds=bounds, qb_histogram_mode=qb_mode)
    probs, out = amdqb.fused_topk_with_score_function(
        logits, k, expert_bias=bias, backend=backend, **extra, **kw
    )
    kind = "indices" if fmt.startswith("int") else ("bitmap" if fmt == "bitmap_u8" else "bytemap")
    return probs, out, kind, hist, bounds


def check_hip_router(
    backend,
    logits,
    k,
    fmt="bytemap",
    score="sigmoid",
    bias=None,
    qb_mode=None,
    num_bins=1000,
    pre=False,
    scaling=None,
    hist=None,
    scores=None,
    approximate=False,
    probs_tol=None,
):
    """One hip router call against the oracle on the kernel's own scores (``scores``: those of
    ``logits`` already computed), compared on the CPU: exactly k experts, the oracle's routes (in
    selection order for indices), probs (2e-6 + 1e-2 relative; ``probs_tol``: (atol, rtol) checked
    as well), and under QB the histogram; returns the histogram (on the logits' device)."""
    t, e = logits.shape
    probs, map_out, kind, hist, bounds = hip_run_router(
        backend,
        logits,
        k,
        fmt,
        bias,
        qb_mode,
        num_bins,
        hist,
        score_function=score,
        use_pre_softmax=pre,
        scaling_factor=scaling,
        **({"approximate_activation": True} if approximate else {}),
    )
    s = (kernel_scores("hip", logits, score) if scores is None else scores).cpu()
    z = logits.cpu()
    b = None if bias is None else bias.cpu()
    if qb_mode is not None:
        idx_ref, alpha, _ = qb_cutoff_and_routes(s, b, k)
        assert torch.equal(hist.cpu(), qb_histogram_counts(s, alpha, bounds.cpu(), hist.shape[1]))
        assert torch.all(hist.sum(1).cpu() == t)
        probs_ref, idx_ref2, map_ref = ref.fused_topk_with_score_function(
            z, k, expert_bias=b, scores=s, scaling_factor=scaling
        )
        assert torch.equal(idx_ref, idx_ref2)
    else:
        probs_ref, idx_ref, map_ref = ref.fused_topk_with_score_function(
            z,
            k,
            use_pre_softmax=pre,
            score_function=score,
            expert_bias=b,
            scores=s if score != "softmax" else None,
            scaling_factor=scaling,
        )
    mask = routed_mask(map_out, kind, e)
    assert torch.all(mask.sum(1) == k), "every token gets exactly k distinct experts"
    assert torch.equal(mask, map_ref), "routing differs from the oracle"
    if kind == "indices":
        assert torch.equal(map_out.cpu().long(), idx_ref), "indices are not in selection order"
    got, want = probs.cpu().float(), probs_ref.to(z.dtype).float()
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-2, equal_nan=True)
    if probs_tol is not None:
        atol, rtol = probs_tol
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    return hist


def hip_check_qb(backend, logits, k, fmt, bias, mode, num_bins=1000, scores=None):
    """One QB router call against the oracle on the kernel's own scores (``scores``: those of
    ``logits`` already computed): the histogram (and T counts per expert), exactly k experts, the
    routes (in selection order for indices), probs (fp32: 1e-6 + 1e-5 relative; halves: 1e-3 +
    1e-2); returns the histogram on the CPU."""
    tol = (1e-6, 1e-5) if logits.dtype == torch.float32 else (1e-3, 1e-2)
    hist = check_hip_router(
        backend,
        logits,
        k,
        fmt,
        bias=bias,
        qb_mode=mode,
        num_bins=num_bins,
        scores=scores,
        probs_tol=tol,
    )
    return hist.cpu()


def count_decode_launches(monkeypatch):
    """A list whose last entry counts the launches of the decode form (its block size comes from
    decode_threads); the caller appends a 0 to start each count."""
    forms = [0]
    threads = hip_router.decode_threads

    def counted(num_experts, cfg):
        forms[-1] += 1
        return threads(num_experts, cfg)

    monkeypatch.setattr(hip_router, "decode_threads", counted)
    return forms


def brute_topk(values: list[float], n: int) -> list[int]:
    """Selection order written out: value desc, id asc, NaN last, -0.0 == +0.0."""

    def sort_key(i):
        v = values[i]
        return (1, 0.0, i) if math.isnan(v) else (0, -v, i)

    return sorted(range(len(values)), key=sort_key)[:n]


def router_built_with(monkeypatch, *defines):
    """Every router module (router, scores, histogram kernels) built with extra -D defines."""
    base = _spec.router_module

    def router_module(*args, **kw):
        return base(*args, **kw).with_defines(*defines)

    monkeypatch.setattr(_spec, "router_module", router_module)
