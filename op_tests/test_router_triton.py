"""Router kernels (fused Top-k + QB histogram, backward, biased_topk) against the oracles.

Parametrised over the non-oracle backends of ``router_fwd`` (today: ``triton``; on the CPU its
kernels run under ``TRITON_INTERPRET=1``). Selection (ids, maps, histograms) must be exact; weights
agree to fp32 rounding. The QB histogram is compared bit for bit with ``ref.qb_histogram_counts``
evaluated on the backend's own activations (``score_values``), since ``exp`` may differ by an ulp
between PyTorch and a GPU kernel. Shapes are small on the CPU (the interpreter is slow) and follow
the seeds (E=896, k=16, B=1000, T up to 16384) on a GPU.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch
from conftest import DEVICE, HAS_GPU, kernel_backends

import amdqb
from amdqb import dispatch, ref

# NaN / inf inputs are part of the contract; numpy (the CPU interpreter) warns about them.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

BACKENDS = kernel_backends("router_fwd")
TOPK_BACKENDS = kernel_backends("biased_topk")

# (T, E, k, groups) per device: the interpreter needs small shapes.
if HAS_GPU:
    T_MAIN, E_MAIN, K_MAIN, GROUPS = 1000, 896, 16, (8, 4)
    QB_CASES = [(257, 896, 8, 1000), (4096, 896, 16, 1000), (300, 64, 63, 64)]
else:
    T_MAIN, E_MAIN, K_MAIN, GROUPS = 11, 64, 6, (4, 2)
    QB_CASES = [(9, 64, 4, 50), (7, 40, 39, 16), (5, 300, 16, 1000)]

FORMATS = ("bytemap", "bitmap_u8", "int16", "int32", "int64")
SCORES = (
    ("sigmoid", False, False),
    ("sigmoid", False, True),
    ("sqrtsoftplus", False, True),
    ("softmax", False, False),
    ("softmax", True, False),
)


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def tie_free_logits(t, e, dtype=torch.float32, seed=0, span=6.0):
    """TE-style tie-free logits: a per-token permutation of an arange, plus a per-token offset."""
    g = torch.Generator().manual_seed(seed)
    base = torch.arange(e, dtype=torch.float64) * (span / e) - span / 2
    rows = torch.stack([base[torch.randperm(e, generator=g)] for _ in range(t)])
    rows = rows + torch.rand(t, 1, generator=g, dtype=torch.float64) * 0.1
    return rows.to(dtype).to(DEVICE)


def backend_scores(backend, logits2d, score_function):
    """The backend's own fp32 activations (``score_values``), or a skip."""
    module = importlib.import_module(f"amdqb.backends.{backend}")
    fn = getattr(module, "score_values", None)
    if fn is None:
        fn = getattr(getattr(module, "router", None), "score_values", None)
    if fn is None:
        pytest.skip(f"backend {backend} exposes no score_values")
    return fn(logits2d.contiguous(), score_function)


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


# ----------------------------------------------------------------------------------------------
# non-QB forward
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scaling", [None, 1.5])
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("score,pre,bias", SCORES)
def test_router_matches_oracle(backend, score, pre, bias, grouped, scaling, fmt):
    t, e, k = T_MAIN, E_MAIN, K_MAIN
    z = tie_free_logits(t, e, seed=e + k)
    eb = torch.linspace(-0.3, 0.3, e, device=DEVICE)[torch.randperm(e).to(DEVICE)] if bias else None
    groups = dict(num_groups=GROUPS[0], group_topk=GROUPS[1]) if grouped else {}
    kw = dict(
        use_pre_softmax=pre, scaling_factor=scaling, score_function=score, expert_bias=eb, **groups
    )
    probs, routed, ids = run_router(backend, z, k, fmt, **kw)
    scores = None if score == "softmax" else backend_scores(backend, z, score)
    p_ref, idx_ref, map_ref = oracle(z, k, scores=scores, **kw)
    assert torch.equal(routed, map_ref)
    check_exactly_k(routed, k)
    if ids is not None:
        assert torch.equal(ids, idx_ref)
    assert probs.dtype == z.dtype and probs.shape == z.shape
    torch.testing.assert_close(probs, p_ref, **tol(e))
    if not bias:
        # the oracle on PyTorch's own activations selects the same experts (tie-free input; a
        # random bias can bring two biased scores within an ulp of each other)
        assert torch.equal(oracle(z, k, **kw)[2], routed)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
def test_router_low_precision_logits(backend, dtype, score):
    t, e, k = T_MAIN, E_MAIN, K_MAIN
    z = (torch.randn(t, e, generator=torch.Generator().manual_seed(3)) * 2).to(dtype).to(DEVICE)
    probs, routed, ids = run_router(backend, z, k, "int32", score_function=score)
    scores = None if score == "softmax" else backend_scores(backend, z, score)
    p_ref, idx_ref, _ = oracle(z, k, scores=scores, score_function=score)
    assert probs.dtype == dtype
    assert torch.equal(ids, idx_ref)  # low-precision logits tie often: ids still exact
    torch.testing.assert_close(probs.float(), p_ref, **tol(e, dtype))


@pytest.mark.parametrize("backend", BACKENDS)
def test_router_leading_dims_and_tiny_t(backend):
    e, k = E_MAIN, K_MAIN
    z = tie_free_logits(6, e).reshape(2, 3, e)
    probs, out = amdqb.fused_topk_with_score_function(z, k, backend=backend)
    assert probs.shape == (2, 3, e) and out.shape == (2, 3, e)
    p_ref, _, m_ref = oracle(z.reshape(-1, e), k)
    assert torch.equal(out.reshape(-1, e), m_ref)
    torch.testing.assert_close(probs.reshape(-1, e), p_ref, **tol(e))
    one = z.reshape(-1, e)[:1]
    probs1, map1 = amdqb.fused_topk_with_score_function(one, k, backend=backend)
    assert torch.equal(map1, oracle(one, k)[2])
    empty = z.reshape(-1, e)[:0]
    probs0, map0 = amdqb.fused_topk_with_score_function(empty, k, backend=backend)
    assert probs0.shape == (0, e) and map0.shape == (0, e)
    buf = torch.empty(0, k, dtype=torch.int32, device=DEVICE)
    assert (
        amdqb.fused_topk_with_score_function(empty, k, topk_indices=buf, backend=backend)[1] is buf
    )


def _adversarial_rows(e):
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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("score", ["sigmoid", "softmax", "sqrtsoftplus"])
def test_router_ties_nan_inf_exact(backend, score):
    e = E_MAIN
    z = _adversarial_rows(e)
    scores = None if score == "softmax" else backend_scores(backend, z, score)
    for k in sorted({1, 2, K_MAIN, e - 1, e}):
        probs, routed, ids = run_router(backend, z, k, "int64", score_function=score)
        _, idx_ref, map_ref = oracle(z, k, scores=scores, score_function=score)
        check_exactly_k(routed, k)
        assert torch.equal(ids, idx_ref), (k, ids, idx_ref)
        assert torch.equal(routed, map_ref)
        assert (probs[~routed] == 0).all()


def _interpreter_module():
    """``triton.runtime.interpreter`` when the Triton kernels run on the CPU interpreter, else a skip."""
    if HAS_GPU or os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("checks the Triton CPU interpreter's view of the kernels (TRITON_INTERPRET=1)")
    interp = importlib.import_module("triton.runtime.interpreter")
    if not hasattr(getattr(interp, "_interpreter", None), "atomic_rmw"):
        pytest.skip("this Triton's interpreter has no _interpreter.atomic_rmw to observe")
    return interp


@pytest.mark.parametrize("backend", BACKENDS)
def test_router_atomic_pointer_blocks_are_dense(backend, monkeypatch):
    # Triton's interpreter up to 3.8 reads an atomic's pointer block as a dense array, ignoring
    # strides: a broadcast (stride-0) block of one row made it read W pointers out of one and
    # crash (E=64, k >= 23 without QB: one row per program, every column a candidate). The
    # kernels must hand every atomic a computed block; checked here on any Triton version.
    if backend != "triton":
        pytest.skip(f"observes the Triton interpreter; backend {backend} is not Triton")
    interp = _interpreter_module()
    real = interp._interpreter.atomic_rmw
    seen = []

    def spy(op, ptr, val, mask, sem):
        seen.append((ptr.shape, ptr.strides))
        return real(op, ptr, val, mask, sem)

    monkeypatch.setattr(interp._interpreter, "atomic_rmw", spy)
    e = 64
    z = torch.cat([tie_free_logits(3, e, seed=9), _adversarial_rows(e)])
    s = backend_scores(backend, z, "sigmoid")
    bias = torch.linspace(-0.2, 0.2, e, device=DEVICE)
    for k in (20, 23, 24, e):  # the candidate-tile path with and without the tau bound
        _, routed, ids = run_router(backend, z, k, "int32")
        _, idx_ref, map_ref = oracle(z, k, scores=s)
        assert torch.equal(routed, map_ref) and torch.equal(ids, idx_ref), k
        hist, bounds = qb_buffers(e, 16, bias)
        kw = dict(qb_histogram=hist, qb_bin_bounds=bounds, qb_histogram_mode="fused_atomic")
        _, routed, _ = run_router(backend, z, k - 1, expert_bias=bias, **kw)
        idx_ref, alpha = ref.qb_cutoff_and_routes(s, bias, k - 1)
        assert torch.equal(hist, ref.qb_histogram_counts(s, alpha, bounds, 16)), k
    assert seen
    stride0 = [(sh, st) for sh, st in seen if any(n > 1 and d == 0 for n, d in zip(sh, st))]
    assert not stride0, stride0[:3]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["bitmap_u8", "int32"])
def test_router_large_k_exact_path(backend, fmt):
    # k too large for the compacted tile: exact search (+ sort for the order) on every row.
    t, e = (64, 896) if HAS_GPU else (2, 160)
    z = torch.cat([tie_free_logits(t, e, seed=1), _adversarial_rows(e)])
    s = backend_scores(backend, z, "sigmoid")
    for k in (e // 3, e - 1, e):
        probs, routed, ids = run_router(backend, z, k, fmt)
        p_ref, idx_ref, map_ref = oracle(z, k, scores=s)
        assert torch.equal(routed, map_ref)
        if ids is not None:
            assert torch.equal(ids, idx_ref)
    bias = torch.linspace(-0.1, 0.1, e, device=DEVICE)
    for mode in ("fused_atomic", "two_kernel"):
        hist = torch.zeros(e, 32, dtype=torch.int32, device=DEVICE)
        bounds = torch.tensor([-1.5, 1.5], device=DEVICE)
        kw = dict(qb_histogram=hist, qb_bin_bounds=bounds, qb_histogram_mode=mode)
        probs, routed, ids = run_router(backend, z, e - 1, fmt, expert_bias=bias, **kw)
        idx_ref, alpha = ref.qb_cutoff_and_routes(s, bias, e - 1)
        assert torch.equal(hist, ref.qb_histogram_counts(s, alpha, bounds, 32))
        if ids is not None:
            assert torch.equal(ids, idx_ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_router_grouped_ties(backend):
    # Groups whose sums tie, NaN groups, and every value equal: group order is (sum desc, id asc).
    e, k = E_MAIN, K_MAIN
    ng, gt = GROUPS
    z = _adversarial_rows(e)
    kw = dict(num_groups=ng, group_topk=gt)
    probs, routed, ids = run_router(backend, z, k, "int32", **kw)
    _, idx_ref, _ = oracle(z, k, scores=backend_scores(backend, z, "sigmoid"), **kw)
    check_exactly_k(routed, k)
    assert torch.equal(ids, idx_ref)


# ----------------------------------------------------------------------------------------------
# Quantile Balancing
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", QB_CASES, ids=lambda c: "T{}_E{}_k{}_B{}".format(*c))
def test_qb_histogram_bitwise(backend, case, fmt):
    t, e, k, b = case
    z = torch.randn(t, e, generator=torch.Generator().manual_seed(t + k)).to(DEVICE)
    bias = torch.linspace(-0.2, 0.2, e, device=DEVICE)
    s = backend_scores(backend, z, "sigmoid")
    idx_ref, alpha = ref.qb_cutoff_and_routes(s, bias, k)
    _, bounds = qb_buffers(e, b, bias)
    want = ref.qb_histogram_counts(s, alpha, bounds, b)
    p_ref, _, map_ref = oracle(z, k, scores=s, expert_bias=bias)
    hists = {}
    for mode in ("fused_atomic", "two_kernel", "auto"):
        hist = torch.zeros(e, b, dtype=torch.int32, device=DEVICE)
        probs, routed, ids = run_router(
            backend,
            z,
            k,
            fmt,
            expert_bias=bias,
            qb_histogram=hist,
            qb_bin_bounds=bounds,
            qb_histogram_mode=mode,
        )
        assert torch.equal(hist, want), mode
        assert torch.equal(hist.sum(1), torch.full((e,), t, dtype=torch.int64, device=DEVICE))
        assert torch.equal(routed, map_ref)
        if ids is not None:
            assert torch.equal(ids, idx_ref)
        torch.testing.assert_close(probs, p_ref, **tol(e))
        hists[mode] = hist
    assert torch.equal(hists["two_kernel"], hists["fused_atomic"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["fused_atomic", "two_kernel"])
def test_qb_accumulates_microbatches(backend, mode):
    e, k, b = (64, 8, 1000)
    sizes = (127, 193) if HAS_GPU else (7, 12)
    bias = torch.linspace(-0.3, 0.3, e, device=DEVICE)
    hist, bounds = qb_buffers(e, b, bias)
    hist += 3  # accumulate in place on top of existing counts
    want = torch.full_like(hist, 3)
    for i, t in enumerate(sizes):
        z = torch.randn(t, e, generator=torch.Generator().manual_seed(i)).to(DEVICE)
        s = backend_scores(backend, z, "sigmoid")
        _, alpha = ref.qb_cutoff_and_routes(s, bias, k)
        want += ref.qb_histogram_counts(s, alpha, bounds, b)
        amdqb.fused_topk_with_score_function(
            z,
            k,
            expert_bias=bias,
            qb_histogram=hist,
            qb_bin_bounds=bounds,
            qb_histogram_mode=mode,
            backend=backend,
        )
    assert torch.equal(hist, want)
    assert (hist.sum(1) == 3 * b + sum(sizes)).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["fused_atomic", "two_kernel"])
def test_qb_te_tie_and_clamp_vector(backend, mode):
    # notes/qb_anchors.md §1.5: the tied expert 2 is the (k+1)-th and is dropped; bins clamp.
    z = torch.tensor(
        [[3, 3, 3, -1, -2, -3, -4, -5], [5, 4, 3, 2, -2, -3, -4, -5]], dtype=torch.float32
    ).to(DEVICE)
    hist = torch.zeros(8, 8, dtype=torch.int32, device=DEVICE)
    bounds = torch.tensor([-0.05, 0.05], device=DEVICE)
    probs, routed = amdqb.fused_topk_with_score_function(
        z,
        2,
        expert_bias=torch.zeros(8, device=DEVICE),
        qb_histogram=hist,
        qb_bin_bounds=bounds,
        qb_histogram_mode=mode,
        backend=backend,
    )
    assert routed[0, :3].tolist() == [True, True, False]
    assert routed.sum().item() == 4
    assert hist[:, 0].sum() > 0 and hist[:, -1].sum() > 0
    assert hist.sum().item() == 2 * 8


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["fused_atomic", "two_kernel"])
def test_qb_bin_edges(backend, mode):
    # s in {0, 0.5, 1} exactly (z = -100, 0, 100), biases multiples of 1/4, L=-1, U=1, B=8: every
    # r = alpha - s is a multiple of 1/4, so (r - L) * scale is an exact integer (a bin edge).
    e, k, b = 8, 3, 8
    g = torch.Generator().manual_seed(11)
    z = torch.tensor([-100.0, 0.0, 100.0])[torch.randint(0, 3, (16, e), generator=g)].to(DEVICE)
    s = backend_scores(backend, z, "sigmoid")
    if not torch.isin(s, torch.tensor([0.0, 0.5, 1.0], device=DEVICE)).all():
        pytest.skip("this backend's sigmoid is not exact at 0 / +-100")
    bias = (torch.arange(e, dtype=torch.float32) * 0.25 - 1.0).flip(0).to(DEVICE)
    bounds = torch.tensor([-1.0, 1.0], device=DEVICE)
    hist = torch.zeros(e, b, dtype=torch.int32, device=DEVICE)
    amdqb.fused_topk_with_score_function(
        z,
        k,
        expert_bias=bias,
        qb_histogram=hist,
        qb_bin_bounds=bounds,
        qb_histogram_mode=mode,
        backend=backend,
    )
    _, alpha = ref.qb_cutoff_and_routes(s, bias, k)
    r = alpha[:, None] - s
    steps = (r + 1.0) * 4.0
    assert torch.equal(steps, torch.round(steps))  # really on edges
    bins = steps.clamp(0, b - 1).long()
    want = torch.zeros(e, b, dtype=torch.int32, device=DEVICE)
    want.index_put_(
        (torch.arange(e, device=DEVICE).expand_as(bins), bins),
        torch.ones_like(bins, dtype=torch.int32),
        accumulate=True,
    )
    assert torch.equal(hist, want)
    assert torch.equal(hist, ref.qb_histogram_counts(s, alpha, bounds, b))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["fused_atomic", "two_kernel"])
def test_qb_adversarial_rows(backend, mode):
    e, k, b = E_MAIN, K_MAIN, 64
    z = _adversarial_rows(e)
    bias = torch.zeros(e, device=DEVICE)
    bias[::5] = 0.125
    s = backend_scores(backend, z, "sigmoid")
    hist = torch.zeros(e, b, dtype=torch.int32, device=DEVICE)
    bounds = torch.tensor([-1.0, 1.0], device=DEVICE)
    probs, routed, ids = run_router(
        backend,
        z,
        k,
        "int32",
        expert_bias=bias,
        qb_histogram=hist,
        qb_bin_bounds=bounds,
        qb_histogram_mode=mode,
    )
    idx_ref, alpha = ref.qb_cutoff_and_routes(s, bias, k)
    check_exactly_k(routed, k)
    assert torch.equal(ids, idx_ref)
    assert torch.equal(hist, ref.qb_histogram_counts(s, alpha, bounds, b))


@pytest.mark.skipif(not HAS_GPU, reason="seed shapes need a GPU (the interpreter is too slow)")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("t", [1, 256, 1024, 4096, 8192, 16384])
def test_qb_seed_shapes_two_kernel_equals_fused(backend, t):
    e, k, b = 896, 16, 1000
    z = torch.randn(t, e, device=DEVICE)
    bias = torch.linspace(-0.2, 0.2, e, device=DEVICE)
    bounds = torch.tensor([-1.2, 1.2], device=DEVICE)
    s = backend_scores(backend, z, "sigmoid")
    _, alpha = ref.qb_cutoff_and_routes(s, bias, k)
    want = ref.qb_histogram_counts(s, alpha, bounds, b)
    out = {}
    for mode in ("fused_atomic", "two_kernel"):
        hist = torch.zeros(e, b, dtype=torch.int32, device=DEVICE)
        out[mode] = amdqb.fused_topk_with_score_function(
            z,
            k,
            expert_bias=bias,
            qb_histogram=hist,
            qb_bin_bounds=bounds,
            qb_histogram_mode=mode,
            backend=backend,
        )
        assert torch.equal(hist, want), mode
    assert torch.equal(out["fused_atomic"][0], out["two_kernel"][0])
    assert torch.equal(out["fused_atomic"][1], out["two_kernel"][1])


@pytest.mark.skipif(not HAS_GPU, reason="CUDA/HIP graphs need a GPU")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["fused_atomic", "two_kernel"])
def test_qb_graph_replay(backend, mode):
    t, e, k, b = 1024, 896, 16, 1000
    z = torch.randn(t, e, device=DEVICE)
    bias = torch.linspace(-0.2, 0.2, e, device=DEVICE)
    bounds = torch.tensor([-1.2, 1.2], device=DEVICE)
    hist = torch.zeros(e, b, dtype=torch.int32, device=DEVICE)
    kw = dict(
        expert_bias=bias,
        qb_histogram=hist,
        qb_bin_bounds=bounds,
        qb_histogram_mode=mode,
        backend=backend,
    )
    amdqb.fused_topk_with_score_function(z, k, **kw)  # warm-up + bounds validation
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        probs, routed = amdqb.fused_topk_with_score_function(z, k, **kw)
    for seed in range(3):
        z.copy_(
            torch.randn(t, e, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(seed))
        )
        hist.zero_()
        graph.replay()
        torch.cuda.synchronize()
        s = backend_scores(backend, z, "sigmoid")
        _, alpha = ref.qb_cutoff_and_routes(s, bias, k)
        assert torch.equal(hist, ref.qb_histogram_counts(s, alpha, bounds, b))
        assert torch.equal(routed, oracle(z, k, scores=s, expert_bias=bias)[2])


# ----------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k", [1, K_MAIN])
@pytest.mark.parametrize("scaling", [None, 2.0])
@pytest.mark.parametrize(
    "score,pre",
    [("sigmoid", False), ("sqrtsoftplus", False), ("softmax", False), ("softmax", True)],
)
def test_router_backward(backend, score, pre, scaling, k):
    t, e = T_MAIN, E_MAIN
    z0 = tie_free_logits(t, e, seed=21)
    z0[0, :3] = 25.0  # sqrtsoftplus x > 20 branch
    g = torch.randn(t, e, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    grads = []
    for be in (backend, "torch"):
        z = z0.clone().requires_grad_(True)
        probs, _ = amdqb.fused_topk_with_score_function(
            z, k, use_pre_softmax=pre, scaling_factor=scaling, score_function=score, backend=be
        )
        probs.backward(g)
        grads.append(z.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)
    # TE's formulas equal autograd of the oracle
    z = z0.clone().requires_grad_(True)
    p_ref, _, _ = ref.fused_topk_with_score_function(
        z, k, use_pre_softmax=pre, scaling_factor=scaling, score_function=score
    )
    p_ref.backward(g)
    torch.testing.assert_close(grads[0], z.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_router_backward_low_precision(backend, dtype):
    t, e, k = T_MAIN, E_MAIN, K_MAIN
    z0 = tie_free_logits(t, e, dtype=dtype, seed=4)
    grads = []
    for be in (backend, "torch"):
        z = z0.clone().requires_grad_(True)
        probs, _ = amdqb.fused_topk_with_score_function(z, k, backend=be)
        probs.float().sum().backward()
        grads.append(z.grad)
    assert grads[0].dtype == dtype
    torch.testing.assert_close(grads[0].float(), grads[1].float(), rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_router_bwd_direct(backend):
    if "router_bwd" not in dispatch._backend_module(backend).OPS:
        # the op falls back to another backend's backward (test_router_backward covers that path)
        pytest.skip(f"the {backend} backend has no router backward kernel")
    t, e, k = T_MAIN, E_MAIN, K_MAIN
    z = tie_free_logits(t, e, seed=8)
    routed = oracle(z, k)[2]
    gp = torch.randn(t, e, generator=torch.Generator().manual_seed(9)).to(DEVICE).half()
    outs = []
    for be in (backend, "torch"):
        out = torch.full((t, e), float("nan"), device=DEVICE)
        dispatch._backend_module(be).OPS["router_bwd"](gp, z, routed, k, "sigmoid", False, 1.5, out)
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# direct kernel-level calls and the serving form
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("map_kind", ["bytemap", "bitmap", "indices"])
def test_router_fwd_direct(backend, map_kind):
    t, e, k = T_MAIN, E_MAIN, K_MAIN
    z = tie_free_logits(t, e, seed=13)
    bias = torch.linspace(-0.2, 0.2, e, device=DEVICE)
    probs = torch.full((t, e), float("nan"), device=DEVICE)
    if map_kind == "bytemap":
        m = torch.ones(t, e, dtype=torch.bool, device=DEVICE)
    elif map_kind == "bitmap":
        m = torch.full((t, (e + 7) // 8), 255, dtype=torch.uint8, device=DEVICE)
    else:
        m = torch.full((t, k), -1, dtype=torch.int32, device=DEVICE)
    hist = torch.zeros(e, 100, dtype=torch.int32, device=DEVICE)
    bounds = torch.tensor([-1.25, 1.25], device=DEVICE)
    op = dispatch._backend_module(backend).OPS["router_fwd"]
    op(z, k, "sigmoid", False, None, None, None, bias, probs, m, map_kind, hist, bounds, "auto")
    s = backend_scores(backend, z, "sigmoid")
    idx_ref, alpha = ref.qb_cutoff_and_routes(s, bias, k)
    p_ref, _, map_ref = oracle(z, k, scores=s, expert_bias=bias)
    torch.testing.assert_close(probs, p_ref, **tol(e))
    if map_kind == "bytemap":
        assert torch.equal(m, map_ref)
    elif map_kind == "bitmap":
        assert torch.equal(m, ref.pack_bitmap(map_ref))
    else:
        assert torch.equal(m.long(), idx_ref)
    assert torch.equal(hist, ref.qb_histogram_counts(s, alpha, bounds, 100))


@pytest.mark.parametrize("backend", TOPK_BACKENDS)
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize(
    "score,bias", [("sigmoid", True), ("sqrtsoftplus", False), ("softmax", False)]
)
def test_biased_topk(backend, score, bias, grouped, renormalize):
    t, e, k = T_MAIN, E_MAIN, K_MAIN
    z = tie_free_logits(t, e, seed=17)
    eb = torch.linspace(0.3, -0.3, e, device=DEVICE) if bias else None
    groups = dict(num_groups=GROUPS[0], group_topk=GROUPS[1]) if grouped else {}
    kw = dict(score_function=score, renormalize=renormalize, scaling_factor=2.5, **groups)
    w, ids = amdqb.biased_topk(z, k, eb, backend=backend, **kw)
    w_ref, ids_ref = ref.biased_topk(z, k, eb, **kw)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, **tol(e))


@pytest.mark.parametrize("backend", TOPK_BACKENDS)
def test_biased_topk_shapes_and_ties(backend):
    e = E_MAIN
    z = _adversarial_rows(e)
    for k in (1, e):
        w, ids = amdqb.biased_topk(z, k, backend=backend)
        s = backend_scores(backend, z, "sigmoid")
        assert torch.equal(ids.long(), ref.ranked_indices(s, k))
    x = tie_free_logits(6, e).reshape(2, 3, e)
    w, ids = amdqb.biased_topk(x, 4, backend=backend)
    assert w.shape == (2, 3, 4) and ids.shape == (2, 3, 4)
    w0, ids0 = amdqb.biased_topk(x.reshape(-1, e)[:0], 4, backend=backend)
    assert w0.shape == (0, 4) and ids0.shape == (0, 4)
    # direct call of the kernel-level op
    wo = torch.full((6, 4), float("nan"), device=DEVICE)
    io = torch.full((6, 4), -1, dtype=torch.int32, device=DEVICE)
    op = dispatch._backend_module(backend).OPS["biased_topk"]
    op(x.reshape(-1, e), 4, None, "sigmoid", True, None, None, None, wo, io)
    assert torch.equal(io, ids.reshape(-1, 4))
    torch.testing.assert_close(wo, w.reshape(-1, 4))


# ----------------------------------------------------------------------------------------------
# dispatcher hooks
# ----------------------------------------------------------------------------------------------
def test_triton_declines_large_expert_counts():
    from amdqb.backends.triton import router

    info = dispatch.device_info(DEVICE)
    reason = router.UNSUPPORTED["router_fwd"](info, {"num_experts": 5000, "qb": False})
    assert reason and "E > 4096" in reason
    assert router.UNSUPPORTED["biased_topk"](info, {"num_experts": 5000})
    assert (
        router.UNSUPPORTED["router_fwd"](info, {"num_experts": 4096, "qb": True, "num_bins": 1000})
        is None
    )
    assert router.UNSUPPORTED["router_fwd"](
        info, {"num_experts": 4096, "qb": True, "num_bins": 2**20}
    )


def test_triton_plans_are_sane():
    from amdqb.backends.triton import router

    for e in (1, 7, 64, 896, 4096):
        for k in sorted({1, 2, 16, e // 2 or 1, e}):
            for qb in (False, True):
                if qb and not 0 < k < e:
                    continue
                plan = router.plan_router(e, k, qb, None, None, "default")
                assert plan.W >= max(16, e) and plan.W & (plan.W - 1) == 0
                assert plan.BT >= 1 and plan.num_warps >= 1
                if plan.FAST:
                    assert plan.CAP >= plan.R + 1 and plan.CAP <= plan.W
    hp = router.plan_histogram(896, 1000, 16384, "default", lds_ok=True)
    assert hp.LDS and hp.NB * 4 <= router.config("default")["hist_lds_bytes"]
    assert hp.slices * hp.tokens_per_prog >= 16384
