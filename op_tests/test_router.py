"""``fused_topk_with_score_function`` (TransformerEngine's fused score function + Top-k) forward
and backward against the ``amdqb.ref`` oracle for every kernel backend of ``router_fwd``: scores,
groups, output formats, ties / NaN / inf, dtypes, leading dims, large k; the hip router's own
cases (emulator: both wave sizes, the candidate-overflow path, the library exponential; GPU:
side streams, wide expert counts, the sigmoid's division fast path), its decode form bitwise
against the warp-per-token kernel, the launch planning of both kernel backends; and the oracle
against brute force and hand-computed cases. The QB histogram is tested in test_router_qb.py.

Selection (ids, maps) must be exact; weights agree to fp32 rounding. The oracle is evaluated on the
backend's own activations (its router's ``RouterCall.write_scores``), since ``exp`` may differ by an ulp between PyTorch
and a GPU kernel. Shapes are small on the CPU (Triton's interpreter, the hip emulator) and follow
the seeds (E=896, k=16) on a GPU.
"""

import ctypes
import importlib
import os

import numpy as np
import pytest
import torch

import amdqb
from amdqb import dispatch, ref
from amdqb._arch import amd_wave_size
from amdqb.backends import hip as hip_backend
from amdqb.backends import torch as torch_backend
from amdqb.backends.calls import RouterCall
from amdqb.backends.hip import _spec
from amdqb.backends.hip import router as hip_router
from amdqb.ref.router import qb_cutoff_and_routes, qb_histogram_counts

from conftest import DEVICE, GCN, HAS_GPU, device_config, expect_declined, over_backends, set_config
from hip_emu.backend import emulated_hip_backend
from hip_emu.checks import make_logits, routed_mask
from hip_emu.runtime import compiler as emu_compiler
from router_cases import (
    E_MAIN,
    FORMATS,
    GROUPS,
    K_MAIN,
    T_MAIN,
    adversarial_rows,
    brute_topk,
    check_exactly_k,
    check_hip_router,
    count_decode_launches,
    hip_run_router,
    kernel_scores,
    oracle,
    qb_buffers,
    router_built_with,
    run_router,
    tie_free_logits,
    tol,
)

# NaN / inf inputs are part of the contract; numpy (the CPU interpreter) warns about them.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

# hip's own GPU tests (the emulator runs the small cases)
hip_gpu = pytest.mark.skipif(
    not HAS_GPU, reason="hip kernels at GPU shapes (on the CPU the emulator runs the small cases)"
)


# ----------------------------------------------------------------------------------------------
# every kernel backend: forward
# ----------------------------------------------------------------------------------------------


SCORES = (
    ("sigmoid", False, False),
    ("sigmoid", False, True),
    ("sqrtsoftplus", False, True),
    ("softmax", False, False),
    ("softmax", True, False),
)


def hip_runs_groups(e: int, k: int, score: str) -> bool:
    """Whether hip's amdqb_topk has a row plan for the GROUPS split of E experts (the CPU shape's
    4 groups of 16 do; the GPU shape's 8 groups of 112 do not fit its registers)."""
    from amdqb.backends.calls import RouterCall
    from amdqb.backends.hip.topk import router_plan

    call = RouterCall(e, k, score, num_groups=GROUPS[0], group_topk=GROUPS[1])
    return router_plan(call, device_config()) is not None


@over_backends("router_fwd")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scaling", [None, 1.5])
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("score,pre,bias", SCORES)
def test_router_matches_oracle(backend, score, pre, bias, grouped, scaling, fmt):
    t, e, k = T_MAIN, E_MAIN, K_MAIN
    groups = dict(num_groups=GROUPS[0], group_topk=GROUPS[1]) if grouped else {}
    expect_declined(
        backend,
        "router_fwd",
        backend == "hip" and grouped and not hip_runs_groups(e, k, score),
        num_experts=e,
        topk=k,
        score_function=score,
        **groups,
    )
    z = tie_free_logits(t, e, seed=e + k)
    eb = torch.linspace(-0.3, 0.3, e, device=DEVICE)[torch.randperm(e).to(DEVICE)] if bias else None
    kw = dict(
        use_pre_softmax=pre, scaling_factor=scaling, score_function=score, expert_bias=eb, **groups
    )
    probs, routed, ids = run_router(backend, z, k, fmt, **kw)
    scores = None if score == "softmax" else kernel_scores(backend, z, score)
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


@over_backends("router_fwd")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
def test_router_low_precision_logits(backend, dtype, score):
    t, e, k = T_MAIN, E_MAIN, K_MAIN
    z = (torch.randn(t, e, generator=torch.Generator().manual_seed(3)) * 2).to(dtype).to(DEVICE)
    probs, routed, ids = run_router(backend, z, k, "int32", score_function=score)
    scores = None if score == "softmax" else kernel_scores(backend, z, score)
    p_ref, idx_ref, _ = oracle(z, k, scores=scores, score_function=score)
    assert probs.dtype == dtype
    assert torch.equal(ids, idx_ref)  # low-precision logits tie often: ids still exact
    torch.testing.assert_close(probs.float(), p_ref, **tol(e, dtype))


@over_backends("router_fwd")
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


@over_backends("router_fwd")
@pytest.mark.parametrize("score", ["sigmoid", "softmax", "sqrtsoftplus"])
def test_router_ties_nan_inf_exact(backend, score):
    e = E_MAIN
    z = adversarial_rows(e)
    scores = None if score == "softmax" else kernel_scores(backend, z, score)
    cap = device_config()["hip.router.cap"]  # hip selects at most this many experts per token
    for k in sorted({1, 2, K_MAIN, e - 1, e}):
        if expect_declined(
            backend, "router_fwd", backend == "hip" and k > cap, skip=False, num_experts=e, topk=k
        ):
            continue
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


@pytest.mark.parametrize("backend", ["triton"])
def test_router_atomic_pointer_blocks_are_dense(backend, monkeypatch):
    # Triton's interpreter up to 3.8 reads an atomic's pointer block as a dense array, ignoring
    # strides: a broadcast (stride-0) block of one row made it read W pointers out of one and
    # crash (E=64, k >= 23 without QB: one row per program, every column a candidate). The
    # kernels must hand every atomic a computed block; checked here on any Triton version.
    interp = _interpreter_module()
    real = interp._interpreter.atomic_rmw
    seen = []

    def spy(op, ptr, val, mask, sem):
        seen.append((ptr.shape, ptr.strides))
        return real(op, ptr, val, mask, sem)

    monkeypatch.setattr(interp._interpreter, "atomic_rmw", spy)
    e = 64
    z = torch.cat([tie_free_logits(3, e, seed=9), adversarial_rows(e)])
    s = kernel_scores(backend, z, "sigmoid")
    bias = torch.linspace(-0.2, 0.2, e, device=DEVICE)
    for k in (20, 23, 24, e):  # the candidate-tile path with and without the tau bound
        _, routed, ids = run_router(backend, z, k, "int32")
        _, idx_ref, map_ref = oracle(z, k, scores=s)
        assert torch.equal(routed, map_ref) and torch.equal(ids, idx_ref), k
        hist, bounds = qb_buffers(e, 16, bias)
        kw = dict(qb_histogram=hist, qb_bin_bounds=bounds, qb_histogram_mode="fused_atomic")
        _, routed, _ = run_router(backend, z, k - 1, expert_bias=bias, **kw)
        idx_ref, alpha, _ = ref.qb_cutoff_and_routes(s, bias, k - 1)
        assert torch.equal(hist, ref.qb_histogram_counts(s, alpha, bounds, 16)), k
    assert seen
    stride0 = [(sh, st) for sh, st in seen if any(n > 1 and d == 0 for n, d in zip(sh, st))]
    assert not stride0, stride0[:3]


@over_backends("router_fwd")
@pytest.mark.parametrize("fmt", ["bitmap_u8", "int32"])
def test_router_large_k_exact_path(backend, fmt):
    # k too large for the compacted tile: exact search (+ sort for the order) on every row.
    t, e = (64, 896) if HAS_GPU else (2, 160)
    z = torch.cat([tie_free_logits(t, e, seed=1), adversarial_rows(e)])
    s = kernel_scores(backend, z, "sigmoid")
    cap = device_config()["hip.router.cap"]  # hip selects at most this many experts per token
    for k in (e // 3, e - 1, e):
        if expect_declined(
            backend, "router_fwd", backend == "hip" and k > cap, skip=False, num_experts=e, topk=k
        ):
            continue
        probs, routed, ids = run_router(backend, z, k, fmt)
        p_ref, idx_ref, map_ref = oracle(z, k, scores=s)
        assert torch.equal(routed, map_ref)
        if ids is not None:
            assert torch.equal(ids, idx_ref)
    bias = torch.linspace(-0.1, 0.1, e, device=DEVICE)
    qb = dict(num_experts=e, topk=e - 1, qb_mode="auto", num_bins=32)
    if expect_declined(backend, "router_fwd", backend == "hip" and e > cap, skip=False, **qb):
        return
    for mode in ("fused_atomic", "two_kernel"):
        hist = torch.zeros(e, 32, dtype=torch.int32, device=DEVICE)
        bounds = torch.tensor([-1.5, 1.5], device=DEVICE)
        kw = dict(qb_histogram=hist, qb_bin_bounds=bounds, qb_histogram_mode=mode)
        probs, routed, ids = run_router(backend, z, e - 1, fmt, expert_bias=bias, **kw)
        idx_ref, alpha, _ = ref.qb_cutoff_and_routes(s, bias, e - 1)
        assert torch.equal(hist, ref.qb_histogram_counts(s, alpha, bounds, 32))
        if ids is not None:
            assert torch.equal(ids, idx_ref)


@over_backends("router_fwd")
def test_router_grouped_ties(backend):
    # Groups whose sums tie, NaN groups, and every value equal: group order is (sum desc, id asc).
    e, k = E_MAIN, K_MAIN
    ng, gt = GROUPS
    expect_declined(
        backend,
        "router_fwd",
        backend == "hip" and not hip_runs_groups(e, k, "sigmoid"),
        num_experts=e,
        topk=k,
        num_groups=ng,
        group_topk=gt,
    )
    z = adversarial_rows(e)
    kw = dict(num_groups=ng, group_topk=gt)
    probs, routed, ids = run_router(backend, z, k, "int32", **kw)
    _, idx_ref, _ = oracle(z, k, scores=kernel_scores(backend, z, "sigmoid"), **kw)
    check_exactly_k(routed, k)
    assert torch.equal(ids, idx_ref)


@over_backends("router_fwd")
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
    call = RouterCall(e, k, map_kind=map_kind, qb_mode="auto", num_bins=100)
    op(call, z, bias, probs, m, hist, bounds, None, None)
    s = kernel_scores(backend, z, "sigmoid")
    idx_ref, alpha, _ = ref.qb_cutoff_and_routes(s, bias, k)
    p_ref, _, map_ref = oracle(z, k, scores=s, expert_bias=bias)
    torch.testing.assert_close(probs, p_ref, **tol(e))
    if map_kind == "bytemap":
        assert torch.equal(m, map_ref)
    elif map_kind == "bitmap":
        assert torch.equal(m, ref.pack_bitmap(map_ref))
    else:
        assert torch.equal(m.long(), idx_ref)
    assert torch.equal(hist, ref.qb_histogram_counts(s, alpha, bounds, 100))


# ----------------------------------------------------------------------------------------------
# every kernel backend: backward
# ----------------------------------------------------------------------------------------------


@over_backends("router_fwd")
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


@over_backends("router_fwd")
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


@over_backends("router_fwd", gcn=GCN)
def test_router_bwd_direct(backend, emu_rt):
    """The backward kernel against the oracle's; on the emulator one amdqb_router_bwd launch (on
    the AMDGCN models: the prelude's AMD row reductions in that kernel)."""
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
        call = RouterCall(e, k, scaling_factor=1.5)
        if emu_rt is not None:
            emu_rt.launches.clear()
        dispatch._backend_module(be).OPS["router_bwd"](call, gp, z, routed, out)
        if emu_rt is not None and be == backend:
            assert [n for n, *_ in emu_rt.launches] == ["amdqb_router_bwd"]
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# hip on the CPU emulator
# ----------------------------------------------------------------------------------------------


def overflows(rt, e=257):
    """Warps that took the candidate-overflow path so far (emulator counter)."""
    lib = rt._library(_spec.router_module(e, "float32", "sigmoid", device_config()))
    lib.amdqb_emu_overflows.restype = ctypes.c_longlong
    return lib.amdqb_emu_overflows()


@over_backends("router_fwd", emulator=True, waves=(32, 64), gcn=GCN)
@pytest.mark.parametrize("style", ["normal", "ties", "nan_inf", "overflow", "zeros"])
def test_router_styles_both_wave_sizes(backend, emu_rt, warp_router, style):
    rt = emu_rt
    e, t = 257, 19
    logits = make_logits(t, e, style, 5)
    bias = (torch.randn(e, generator=torch.Generator().manual_seed(1)) * 0.05).float()
    if style in ("ties", "zeros", "overflow"):
        bias = torch.zeros(e)  # keep the logits' exact ties
    before = overflows(rt)
    s = kernel_scores("hip", logits, "sigmoid")  # the kernel's scores, for every check
    check_hip_router(backend, logits, 16, "int32", bias=bias, scores=s)
    if style == "overflow":
        assert overflows(rt) > before, "the candidate-overflow (exact) path did not run"
    h = [
        check_hip_router(
            backend, logits, 16, "bitmap_u8", bias=bias, qb_mode=m, num_bins=64, scores=s
        )
        for m in ("two_kernel", "fused_atomic")
    ]
    assert torch.equal(h[0], h[1])


@pytest.mark.parametrize("k,qb", [(33, False), (40, True), (63, True), (64, False)])
@over_backends("router_fwd", emulator=True, waves=(64,), gcn=("gfx942",))
def test_router_exact_path_large_k(backend, warp_router, k, qb):
    e = 896
    logits = make_logits(9, e, "ties", k)
    bias = torch.zeros(e)
    check_hip_router(backend, logits, k, "int64", bias=bias, qb_mode="fused_atomic" if qb else None)


@pytest.mark.parametrize("e", [1, 2, 3, 31, 32, 33, 64, 65])
@over_backends("router_fwd", emulator=True)
def test_router_small_expert_counts(backend, warp_router, e):
    logits = make_logits(13, e, "normal", e)
    s = kernel_scores("hip", logits, "sigmoid")  # the kernel's scores, for every check
    cap = hip_router.max_select(device_config())
    for k in sorted({1, max(1, e // 2), min(e, cap)}):
        check_hip_router(backend, logits, k, "bitmap_u8", scores=s)
        if k < e and k + 1 <= cap:
            bias = torch.randn(e) * 0.1
            check_hip_router(
                backend, logits, k, "int16", bias=bias, qb_mode="two_kernel", num_bins=7, scores=s
            )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@over_backends("router_fwd", emulator=True)
def test_router_half_dtypes(backend, warp_router, dtype):
    e = 129
    logits = make_logits(17, e, "normal", 3, dtype)
    bias = torch.randn(e) * 0.05
    s = kernel_scores("hip", logits, "sigmoid")  # the kernel's scores, for both checks
    check_hip_router(backend, logits, 6, "bytemap", bias=bias, scaling=2.5, scores=s)
    check_hip_router(
        backend, logits, 6, "int32", bias=bias, qb_mode="fused_atomic", num_bins=100, scores=s
    )


@pytest.mark.parametrize(
    "score,pre", [("sqrtsoftplus", False), ("softmax", True), ("softmax", False)]
)
@over_backends("router_fwd", emulator=True, gcn=GCN)
def test_router_score_functions_in_selection_order(backend, warp_router, score, pre):
    e = 200
    logits = make_logits(11, e, "normal", 9) * 3
    bias = torch.randn(e) * 0.05 if score == "sqrtsoftplus" else None
    s = kernel_scores("hip", logits, score)  # the kernel's scores, for both k
    for k in (1, 5):
        check_hip_router(
            backend, logits, k, "int32", score=score, bias=bias, pre=pre, scaling=1.5, scores=s
        )


@over_backends("router_fwd", emulator=True, waves=(32, 64))
def test_router_and_qb_with_the_approximate_activation(backend, warp_router):
    """The opt-in approximate activation (e^-z through the hardware 2^x) is a different build
    whose scores lie within 1e-6 of torch.sigmoid; given those scores the router's routes, probs
    and both QB modes' histograms match the oracle, including the fused epilogue's fast bins
    (whose error bound the emulator stresses)."""
    z = make_logits(64, 64, "normal", 1) * 8
    exact = kernel_scores("hip", z, "sigmoid")
    approx = kernel_scores("hip", z, "sigmoid", approximate=True)
    assert not torch.equal(exact, approx)  # 2^(z * log2 e) rounds differently from expf somewhere
    for s in (exact, approx):
        torch.testing.assert_close(s, torch.sigmoid(z), atol=1e-6, rtol=0)
    for e, t, k, style in ((257, 19, 16, "normal"), (896, 6, 8, "nan_inf"), (64, 30, 4, "ties")):
        logits = make_logits(t, e, style, e + k)
        bias = torch.linspace(-0.1, 0.1, e) if style != "ties" else torch.zeros(e)
        s = kernel_scores("hip", logits, "sigmoid", approximate=True)
        kw = dict(bias=bias, scores=s, approximate=True)
        check_hip_router(backend, logits, k, "bytemap", **kw)
        hists = [
            check_hip_router(backend, logits, k, "int32", qb_mode=m, num_bins=97, **kw)
            for m in ("two_kernel", "fused_atomic")
        ]
        assert torch.equal(hists[0], hists[1])


# (score function, use_pre_softmax, selection, QB histogram mode)
_CHUNKED_ROW_CASES = (
    ("sigmoid", False, "te", "fused_atomic"),
    ("softmax", True, "te", None),
    ("sigmoid", False, "tie_free", None),
)


@pytest.mark.emulator
@pytest.mark.skipif(emu_compiler() is None, reason="the hip emulator needs g++ (C++20)")
@pytest.mark.parametrize("score,pre,selection,qb", _CHUNKED_ROW_CASES)
@pytest.mark.parametrize("arch", GCN)
def test_amd_rows_of_several_chunks_are_bitwise_the_32_lane_rows(
    monkeypatch, arch, score, pre, selection, qb
):
    """On AMD a lane holding more than 32 experts loads and activates them 32 slots at a time
    (router.hip CHUNK; 16 at a time for 17 to 32 on wave64 rows): E=1100 on wave32 rows (35
    slots per lane: a chunk of 32 and a partial one), E=1500 on wave64 rows (24: 16 and 8).
    amdqb_router (routes, probs, the fused QB histogram) and
    amdqb_router_scores on the AMDGCN model give the bits of the emulator's 32-lane rows, which
    load every slot at once, and the oracle's routes on those scores."""
    wave = amd_wave_size(arch)
    e, t, k = (1500 if wave == 64 else 1100), 3, 8
    logits = make_logits(t, e, "normal", e) * 3
    bias = torch.linspace(-0.2, 0.2, e) if score == "sigmoid" else None
    num_bins = 37

    def run(rt):
        set_config(
            monkeypatch,
            {"hip.router.decode_max_tokens": 0, "hip.router.decode_max_tokens_fused": 0},
            torch.device("cpu"),
        )
        rt.launches.clear()
        kw = dict(score_function=score, use_pre_softmax=pre, selection=selection)
        if qb is not None:
            kw.update(
                qb_histogram=torch.zeros(e, num_bins, dtype=torch.int32),
                qb_bin_bounds=torch.tensor([-1.5, 1.5]),
                qb_histogram_mode=qb,
            )
        ids = torch.empty(t, k, dtype=torch.int32)
        probs, _ = amdqb.fused_topk_with_score_function(
            logits, k, expert_bias=bias, topk_indices=ids, backend="hip", **kw
        )
        call = RouterCall(e, 1, score, use_pre_softmax=pre, selection=selection, write_scores=True)
        scores = torch.empty(t, e)
        dispatch._backend_module("hip").OPS["router_fwd"](
            call,
            logits,
            None,
            torch.empty_like(logits),
            torch.empty(t, e, dtype=torch.bool),
            None,
            None,
            scores,
            None,
        )
        names = {n for n, *_ in rt.launches}
        assert {"amdqb_router", "amdqb_router_scores"} <= names, names
        return probs, ids, kw.get("qb_histogram"), scores

    with emulated_hip_backend(32) as rt:
        want = run(rt)
    with emulated_hip_backend(wave, arch) as rt:
        assert hip_router.row_lanes(rt, torch.device("cpu")) == min(wave, 64)
        got = run(rt)
    for name, a, b in zip(("probs", "ids", "hist", "scores"), got, want):
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(
                a.view(torch.int32) if a.is_floating_point() else a,
                b.view(torch.int32) if b.is_floating_point() else b,
            ), name
    probs, ids, hist, scores = got
    torch.testing.assert_close(scores, ref.router.activation(logits, score), atol=1e-6, rtol=1e-5)
    if selection == "te":
        _, idx_ref, _ = ref.fused_topk_with_score_function(
            logits,
            k,
            use_pre_softmax=pre,
            score_function=score,
            expert_bias=bias,
            scores=scores if score != "softmax" else None,
        )
        assert torch.equal(ids.long(), idx_ref)
    if hist is not None:
        _, alpha, _ = qb_cutoff_and_routes(scores, bias, k)
        assert torch.equal(hist, qb_histogram_counts(scores, alpha, torch.tensor([-1.5, 1.5]), 37))


# ----------------------------------------------------------------------------------------------
# hip on the emulator and on a GPU
# ----------------------------------------------------------------------------------------------


@over_backends("router_fwd", only=("hip",))
def test_kernel_scores_close_to_torch(backend):
    """The kernel's activations are torch's within 1e-6 + 1e-5 relative."""
    if HAS_GPU:
        logits = (torch.randn(64, 896) * 4).to(DEVICE)
    else:
        logits = make_logits(5, 96, "normal", 0) * 4
    for score in ("sigmoid", "sqrtsoftplus", "softmax"):
        s = kernel_scores("hip", logits, score)
        torch.testing.assert_close(s, ref.router.activation(logits, score), atol=1e-6, rtol=1e-5)


# (E, k, logits dtype, style, [(output, with bias, QB mode)]): the emulator's at 3 tokens (37
# bins), the GPU's at 67 (300 bins)
_EMU_FORMATS = (
    ("bytemap", False, None),
    ("bitmap_u8", True, "fused_atomic"),
    ("int16", True, "two_kernel"),
    ("int32", False, None),
    ("int64", True, None),
)
DECODE_ROUTER_CASES = (
    [
        (896, 16, torch.float32, "ties", (("bytemap", True, "fused_atomic"),)),
        (896, 16, torch.bfloat16, "ties", (("bytemap", True, "two_kernel"),)),
        (300, 31, torch.float32, "ties", (("bytemap", True, "two_kernel"),)),  # nsel 32
        (4096, 8, torch.float16, "ties", (("bytemap", True, "fused_atomic"),)),
    ]
    if HAS_GPU
    else [
        (896, 16, torch.float32, "ties", _EMU_FORMATS),  # nsel 17: merge tree of 32-entry lists
        (300, 8, torch.bfloat16, "nan_inf", _EMU_FORMATS),
        (64, 5, torch.float16, "normal", _EMU_FORMATS),  # one warp
        (1100, 31, torch.float32, "saturated", _EMU_FORMATS),  # nsel 31 / 32: full 32-entry lists
    ]
)


@over_backends("router_fwd", only=("hip",), waves=(32, 64), gcn=GCN)
@pytest.mark.parametrize("e,k,dtype,style,outputs", DECODE_ROUTER_CASES)
def test_router_decode_kernel_is_bitwise_the_warp_kernel(
    monkeypatch, backend, emu_rt, e, k, dtype, style, outputs
):
    """amdqb_router_decode (one block per token) against amdqb_router (one warp per token): the
    same probs bits, routing maps of every format and QB outputs (cutoff-driven histograms of both
    modes), with and without bias; on the emulator over wave32 and wave64."""
    t, seed, num_bins = (67, e, 300) if HAS_GPU else (3, e + k, 37)
    logits = make_logits(t, e, style, seed, dtype).to(DEVICE)
    if HAS_GPU:
        bias = (torch.randint(-2, 3, (e,)) * 0.125).float().to(DEVICE)
    else:
        g = torch.Generator().manual_seed(e)
        bias = (torch.randint(-2, 3, (e,), generator=g) * 0.125).float()
    forms = count_decode_launches(monkeypatch)
    for fmt, with_bias, qb in outputs:
        outs = {}
        for form, limit in (("block", 1 << 30), ("warp", 0)):
            set_config(
                monkeypatch,
                {
                    "hip.router.decode_max_tokens": limit,
                    "hip.router.decode_max_tokens_fused": limit,
                },
                logits.device,
            )
            forms.append(0)
            if emu_rt is not None:
                emu_rt.launches.clear()
            probs, rmap, _, hist, _ = hip_run_router(
                backend,
                logits,
                k,
                fmt,
                bias if with_bias else None,
                qb,
                num_bins,
                scaling_factor=1.5,
            )
            if emu_rt is not None:
                names = [n for n, *_ in emu_rt.launches]
                assert ("amdqb_router_decode" if form == "block" else "amdqb_router") in names, form
            outs[form] = (probs, rmap, hist)
        assert forms[-2:] == [1, 0], "the two forms did not both run"
        (p1, m1, h1), (p2, m2, h2) = outs["block"], outs["warp"]
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        assert torch.equal(p1.view(bits), p2.view(bits)), fmt
        assert torch.equal(m1, m2), fmt
        assert (h1 is None) == (h2 is None) and (h1 is None or torch.equal(h1, h2)), fmt


@over_backends("router_fwd", only=("hip",), gcn=GCN)
def test_router_decode_leaves_a_top_n_beyond_its_lists_to_the_warp_kernel(
    monkeypatch, backend, emu_rt
):
    """A Top-n past amdqb_router_decode's 32-entry lists (k = 32 with QB: n = 33; k = 33) runs on
    amdqb_router even where the decode form is allowed; the oracle's routes either way."""
    t = 67 if HAS_GPU else 3
    logits = make_logits(t, 300, "ties", 7, torch.float32).to(DEVICE)
    set_config(
        monkeypatch,
        {"hip.router.decode_max_tokens": 1 << 30, "hip.router.decode_max_tokens_fused": 1 << 30},
        logits.device,
    )
    bias = (torch.arange(300) % 5 * 0.125).float().to(DEVICE)
    scores = kernel_scores(backend, logits, "sigmoid")  # the selection on the kernel's scores
    forms = count_decode_launches(monkeypatch)
    for k, qb, decode in ((31, "two_kernel", 1), (32, "two_kernel", 0), (33, None, 0)):
        forms.append(0)
        if emu_rt is not None:
            emu_rt.launches.clear()
        probs, rmap, _, _, _ = hip_run_router(backend, logits, k, "bytemap", bias, qb, 37)
        assert forms[-1] == decode, (k, qb)
        if emu_rt is not None:
            names = [n for n, *_ in emu_rt.launches]
            assert ("amdqb_router_decode" in names) == bool(decode), (k, names)
        want_probs, _, want_map = oracle(logits, k, scores=scores, expert_bias=bias)
        assert torch.equal(rmap.bool(), want_map.bool()), k
        torch.testing.assert_close(probs, want_probs, **tol(300))


# ----------------------------------------------------------------------------------------------
# hip on a GPU
# ----------------------------------------------------------------------------------------------


@hip_gpu
@over_backends("router_fwd", only=("hip",))
@pytest.mark.parametrize("style", ["ties", "nan_inf", "overflow", "zeros"])
@pytest.mark.parametrize("k,qb", [(8, False), (16, True), (40, False), (63, True)])
def test_router_ties_and_nan_rows(backend, style, k, qb):
    e = 896
    logits = make_logits(129, e, style, k).to(DEVICE)
    bias = torch.zeros(e, device=DEVICE)
    mode = "fused_atomic" if qb else None
    probs, out, kind, hist, bounds = hip_run_router(
        backend, logits, k, "int32", bias, mode, num_bins=50
    )
    mask = routed_mask(out, kind, e)
    assert torch.all(mask.sum(1) == k), "every token gets exactly k distinct experts"
    s = kernel_scores("hip", logits, "sigmoid").cpu()
    if qb:
        idx_ref, alpha, _ = qb_cutoff_and_routes(s, bias.cpu(), k)
        assert torch.equal(hist.cpu(), qb_histogram_counts(s, alpha, bounds.cpu(), 50))
    else:
        idx_ref = ref.ordering.ranked_indices(s, k)
    assert torch.equal(out.cpu().long(), idx_ref), "tie-break differs from (value desc, id asc)"


@hip_gpu
@over_backends("router_fwd", only=("hip",))
def test_sigmoid_fast_path_is_the_division_bit_for_bit(backend, monkeypatch):
    """The kernels' sigmoid (on NVIDIA with the IEEE division's fast path written out, router.hip
    sigmoid_fast) equals the same module built with the compiler's own division
    (-DAMDQB_DIVISION_ONLY), bit for bit, over random bit patterns (NaN, inf, denormals),
    normal logits and every float of the range where the divisor leaves the fast path (z near
    -87.34, denormal results)."""
    g = torch.Generator().manual_seed(5)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=g, dtype=torch.int64)
    edge = torch.arange(
        torch.tensor(-87.5).view(torch.int32).item(),
        torch.tensor(-87.2).view(torch.int32).item(),
        -1,
        dtype=torch.int64,
    )  # negative floats: the signed bit pattern decreases as the value rises
    z = torch.cat(
        [bits.to(torch.int32).view(torch.float32), torch.randn(1 << 20, generator=g) * 30]
        + [edge.to(torch.int32).view(torch.float32)]
    )
    e = 896
    z = torch.cat([z, torch.zeros((-z.numel()) % e)]).reshape(-1, e).to(DEVICE)
    got = kernel_scores("hip", z, "sigmoid")
    router_built_with(monkeypatch, ("AMDQB_DIVISION_ONLY", "1"))
    want = kernel_scores("hip", z, "sigmoid")
    both_nan = torch.isnan(got) & torch.isnan(want)
    same = (got.view(torch.int32) == want.view(torch.int32)) | both_nan
    assert bool(same.all()), f"{int((~same).sum())} of {z.numel()} scores differ from the division"
    tiny = (want > 0) & (want < 1.1754944e-38)
    assert int(tiny.sum()) > 1000  # the denormal results of the slow path were exercised


@hip_gpu
@over_backends("router_fwd", only=("hip",))
@pytest.mark.parametrize(
    "score,pre",
    [("sigmoid", False), ("sqrtsoftplus", False), ("softmax", True), ("softmax", False)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_score_functions(backend, score, pre, dtype):
    e, t, k = 256, 513, 8
    logits = (make_logits(t, e, "normal", 1) * 2).to(dtype).to(DEVICE)
    bias = None if score == "softmax" else torch.randn(e, device=DEVICE) * 0.05
    probs, rmap = amdqb.fused_topk_with_score_function(
        logits,
        k,
        use_pre_softmax=pre,
        score_function=score,
        expert_bias=bias,
        scaling_factor=1.25,
        backend=backend,
    )
    s = kernel_scores("hip", logits, score).cpu()
    probs_ref, _, map_ref = ref.fused_topk_with_score_function(
        logits.cpu(),
        k,
        use_pre_softmax=pre,
        score_function=score,
        expert_bias=None if bias is None else bias.cpu(),
        scaling_factor=1.25,
        scores=None if score == "softmax" else s,
    )
    assert torch.equal(rmap.cpu(), map_ref)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-3, rtol=1e-2)
    torch.testing.assert_close(probs.float().cpu(), probs_ref.to(dtype).float(), **tol)


@hip_gpu
@over_backends("router_fwd", only=("hip",))
def test_router_on_a_side_stream(backend):
    e, k = 896, 16
    logits = make_logits(300, e, "normal", 2).to(DEVICE)
    bias = torch.linspace(-0.1, 0.1, e, device=DEVICE)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        probs, rmap = amdqb.fused_topk_with_score_function(
            logits, k, expert_bias=bias, backend=backend
        )
    torch.cuda.current_stream().wait_stream(stream)
    s = kernel_scores("hip", logits, "sigmoid").cpu()
    _, _, want = ref.fused_topk_with_score_function(
        logits.cpu(), k, expert_bias=bias.cpu(), scores=s
    )
    assert torch.equal(rmap.cpu(), want)


@hip_gpu
@over_backends("router_fwd", only=("hip",))
def test_router_wide_expert_counts(backend):
    # E in (2048, 4096] runs with register spills; beyond, the dispatcher is told to fall back.
    info = dispatch.device_info(DEVICE)
    assert hip_backend.LIMITS["router_fwd"](info, RouterCall(5000, 8))
    e = 3000
    logits = make_logits(33, e, "normal", e).to(DEVICE)
    probs, rmap = amdqb.fused_topk_with_score_function(logits, 8, backend=backend)
    s = kernel_scores("hip", logits, "sigmoid").cpu()
    want = ref.fused_topk_with_score_function(logits.cpu(), 8, scores=s)[2]
    assert torch.equal(rmap.cpu(), want)


# ----------------------------------------------------------------------------------------------
# launch planning
# ----------------------------------------------------------------------------------------------


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


def test_router_register_cap_at_few_tokens():
    """NVIDIA builds the router for hip.router.few_tokens_min_blocks resident blocks per SM up to
    hip.router.few_tokens tokens when 256 < E <= 1024 (the default build spills there); elsewhere,
    and where minimum blocks do not cap registers (AMD, the emulator), the default build."""

    class Rt:
        caps_registers_by_blocks = True

    def cap(e, tokens, rt=None):
        rt = Rt() if rt is None else rt
        spec = hip_router.router_spec(torch.empty(0, e), "sigmoid", cfg, rt, tokens)
        return int(dict(spec.defines)["AMDQB_ROUTER_MIN_BLOCKS"])

    cfg = device_config()
    few, limit = cfg["hip.router.few_tokens_min_blocks"], cfg["hip.router.few_tokens"]

    def default(e):
        return _spec.router_min_blocks(cfg, e)

    assert cap(896, 1) == few and cap(896, limit) == few
    assert cap(896, limit + 1) == default(896)
    assert cap(256, 64) == default(256) and cap(2048, 64) == default(2048)
    assert cap(896, 64, rt=object()) == default(896)


def test_router_grid_is_one_wave_of_resident_blocks():
    class Rt:
        queries = []

        def num_cus(self, dev):
            return 132

        def blocks_per_cu(self, kernel, block, smem=0):
            self.queries.append((kernel, block, smem))
            return 3

    rt, cfg = Rt(), device_config()
    grid = hip_router._router_grid
    warps = cfg["hip.router.warps"]
    assert grid(rt, cfg, "k", 0, 16384) == 132 * 3  # persistent warps loop over the rest
    assert grid(rt, cfg, "k", 0, 100) == -(-100 // warps)  # one warp a token
    assert grid(rt, cfg, "k", 0, 0) == 1
    assert rt.queries[0] == ("k", hip_router.router_block(cfg), 0)

    class NoQuery:  # e.g. the CPU emulator: two blocks per CU assumed
        def num_cus(self, dev):
            return 4

    assert grid(NoQuery(), cfg, "k", 0, 10**6) == 4 * cfg["hip.fallback_blocks_per_cu"]


# ----------------------------------------------------------------------------------------------
# the oracle against brute force and hand-computed cases
# ----------------------------------------------------------------------------------------------


def test_order_key_is_monotone_and_canonical():
    x = torch.tensor(
        [float("nan"), -float("inf"), -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, float("inf")]
    )
    key = ref.order_key(x)
    assert key[4] == key[5]  # -0.0 == +0.0
    assert key[0] < key[1]  # NaN below -inf
    assert torch.all(key[2:][1:] >= key[2:][:-1])
    assert torch.all(key[1:4][1:] > key[1:4][:-1])


@pytest.mark.parametrize("seed", range(5))
def test_ranked_indices_matches_brute_force_with_ties_and_nan(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (16, 40), generator=g).float()  # many exact ties
    x[x == 3] = float("nan")
    x[x == -3] = -float("inf")
    x[0] = -0.0
    x[1, ::2] = 0.0
    for n in (1, 7, 10, 11, 40):  # the Top-n path (4n <= row) and the sort path
        got = ref.ranked_indices(x, n)
        for row in range(x.shape[0]):
            assert got[row].tolist() == brute_topk(x[row].tolist(), n), n
        # rows of a 3-D input rank independently (the grouped router's per-group order)
        assert torch.equal(ref.ranked_indices(x.reshape(4, 4, 40), n).reshape(16, n), got)


def test_sigmoid_weights_and_bias_only_shifts_selection():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    bias = torch.tensor([10.0, 0.0, 0.0, 0.0])
    probs, idx, rmap = ref.fused_topk_with_score_function(logits, 2, expert_bias=bias)
    assert idx.tolist() == [[0, 3]]  # bias pulls expert 0 in
    s = torch.sigmoid(logits)[0]
    expected = torch.tensor([s[0], 0, 0, s[3]]) / (s[0] + s[3] + 1e-20)
    assert torch.allclose(probs[0], expected)
    assert rmap.tolist() == [[True, False, False, True]]


def test_topk1_weight_is_raw_score_and_scaling_applies():
    logits = torch.tensor([[0.5, -1.0, 2.0]])
    probs, idx, _ = ref.fused_topk_with_score_function(logits, 1, scaling_factor=2.5)
    assert idx.tolist() == [[2]]
    assert torch.allclose(probs[0, 2], torch.sigmoid(torch.tensor(2.0)) * 2.5)


def test_softmax_pre_and_post():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    post, idx, _ = ref.fused_topk_with_score_function(logits, 2, score_function="softmax")
    assert idx.tolist() == [[1, 2]]
    assert torch.allclose(post[0, [1, 2]], torch.softmax(torch.tensor([3.0, 2.0]), 0))
    pre, _, _ = ref.fused_topk_with_score_function(
        logits, 2, use_pre_softmax=True, score_function="softmax"
    )
    assert torch.allclose(pre[0, [1, 2]], torch.softmax(logits[0], 0)[[1, 2]])


def test_grouped_topk_hand_case():
    # 4 groups of 2; group scores (sum of best 1): g0=0.9, g1=0.8, g2=0.95, g3=0.1
    s = torch.tensor([[0.9, 0.1, 0.8, 0.7, 0.2, 0.95, 0.05, 0.1]])
    logits = torch.log(s / (1 - s))
    _, idx, _ = ref.fused_topk_with_score_function(logits, 2, num_groups=4, group_topk=2)
    # best groups g2, g0 -> experts {5, 0} (expert 2 of g1 is excluded despite 0.8 > 0.2)
    assert sorted(idx[0].tolist()) == [0, 5]


def test_bitmap_roundtrip_lsb_first():
    rmap = torch.zeros(2, 11, dtype=torch.bool)
    rmap[0, [0, 9]] = True
    rmap[1, [7, 10]] = True
    packed = ref.pack_bitmap(rmap)
    assert packed.tolist() == [[1, 2], [128, 4]]
    assert torch.equal(ref.unpack_bitmap(packed, 11), rmap)
    npb = np.packbits(rmap.numpy(), axis=-1, bitorder="little")
    assert (packed.numpy() == npb).all()


@pytest.mark.parametrize(
    "score_function,pre,k",
    [("sigmoid", False, 4), ("sigmoid", False, 1), ("sqrtsoftplus", False, 3)]
    + [("softmax", False, 3), ("softmax", True, 3)],
)
def test_explicit_backward_formulas_equal_autograd_of_oracle(score_function, pre, k):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 13, generator=g, dtype=torch.float64).float().requires_grad_()
    grad_out = torch.randn(9, 13, generator=g)
    probs, _, rmap = ref.fused_topk_with_score_function(
        logits, k, use_pre_softmax=pre, score_function=score_function, scaling_factor=1.3
    )
    (probs * grad_out).sum().backward()
    explicit = torch.empty(9, 13)
    call = RouterCall(logits.shape[1], k, score_function, use_pre_softmax=pre, scaling_factor=1.3)
    torch_backend.router_bwd(call, grad_out, logits.detach(), rmap, explicit)
    torch.testing.assert_close(explicit, logits.grad, atol=1e-6, rtol=1e-5)
