"""The router's Quantile Balancing histogram (``qb_histogram``, ``qb_bin_bounds``,
``qb_histogram_mode``) against the oracle for every kernel backend of ``router_fwd``: the modes
agree bitwise, bin edges, clamping, TE's tie vector, accumulation over microbatches, adversarial
rows, the seeds' shapes and graph replay; the hip histogram pass's own cases (emulator: launch
shapes, long token slices, accumulation; GPU: dtypes, graph replay, the dependent launch on
sm_90) and launch planning; validation of the bin bounds; and the oracle's bin index and histogram
against a Python loop.

``hist[j, bin] += 1`` with ``r = alpha - s_j`` and ``bin = clamp(floor((r - L) * B / (U - L)), 0,
B - 1)``: histograms must equal ``ref.qb_histogram_counts`` evaluated on the backend's own
activations bit for bit, in both modes. Shapes are small on the CPU (Triton's interpreter, the
hip emulator) and follow the seeds (E=896, k=16, B=1000, T up to 16384) on a GPU.
"""

import numpy as np
import pytest
import torch

import amdqb
from amdqb import configs, ref
from amdqb.backends.hip import _runtime
from amdqb.backends.hip import router as hip_router
from amdqb.ref.router import qb_cutoff_and_routes, qb_histogram_counts

from conftest import DEVICE, HAS_GPU, over_backends, set_config
from hip_emu.checks import make_logits
from router_cases import (
    E_MAIN,
    FORMATS,
    K_MAIN,
    adversarial_rows,
    brute_topk,
    check_exactly_k,
    check_hip_router,
    hip_check_qb,
    hip_run_router,
    kernel_scores,
    oracle,
    qb_buffers,
    run_router,
    tol,
)

# NaN / inf inputs are part of the contract; numpy (the CPU interpreter) warns about them.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

# hip's own GPU tests (the emulator runs the small cases)
hip_gpu = pytest.mark.skipif(
    not HAS_GPU, reason="hip kernels at GPU shapes (on the CPU the emulator runs the small cases)"
)

if HAS_GPU:
    QB_CASES = [(257, 896, 8, 1000), (4096, 896, 16, 1000), (300, 64, 63, 64)]
else:
    QB_CASES = [(9, 64, 4, 50), (7, 40, 39, 16), (5, 300, 16, 1000)]


# ----------------------------------------------------------------------------------------------
# every kernel backend
# ----------------------------------------------------------------------------------------------


@over_backends("router_fwd")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", QB_CASES, ids=lambda c: "T{}_E{}_k{}_B{}".format(*c))
def test_qb_histogram_bitwise(backend, case, fmt):
    t, e, k, b = case
    z = torch.randn(t, e, generator=torch.Generator().manual_seed(t + k)).to(DEVICE)
    bias = torch.linspace(-0.2, 0.2, e, device=DEVICE)
    s = kernel_scores(backend, z, "sigmoid")
    idx_ref, alpha, _ = ref.qb_cutoff_and_routes(s, bias, k)
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


@over_backends("router_fwd")
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
        s = kernel_scores(backend, z, "sigmoid")
        _, alpha, _ = ref.qb_cutoff_and_routes(s, bias, k)
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


@over_backends("router_fwd")
@pytest.mark.parametrize("mode", ["fused_atomic", "two_kernel"])
def test_qb_te_tie_and_clamp_vector(backend, warp_router, mode):
    """notes/qb_anchors.md §1.5 (TE's test_qb_topk_plus_one_tie_and_bin_clamping): the tied
    expert 2 is the (k+1)-th and is dropped; bins clamp at both ends; the histogram is the oracle's
    on the backend's own scores."""
    z = torch.tensor(
        [[3, 3, 3, -1, -2, -3, -4, -5], [5, 4, 3, 2, -2, -3, -4, -5]], dtype=torch.float32
    ).to(DEVICE)
    hist = torch.zeros(8, 8, dtype=torch.int32, device=DEVICE)
    bias = torch.zeros(8, device=DEVICE)
    bounds = torch.tensor([-0.05, 0.05], device=DEVICE)
    probs, routed = amdqb.fused_topk_with_score_function(
        z,
        2,
        expert_bias=bias,
        qb_histogram=hist,
        qb_bin_bounds=bounds,
        qb_histogram_mode=mode,
        backend=backend,
    )
    assert routed[0, :3].tolist() == [True, True, False]
    assert routed.sum().item() == 4
    assert hist[:, 0].sum() > 0 and hist[:, -1].sum() > 0
    assert hist.sum().item() == 2 * 8
    s = kernel_scores(backend, z, "sigmoid")
    _, alpha, _ = qb_cutoff_and_routes(s, bias, 2)
    assert torch.equal(hist, qb_histogram_counts(s, alpha, bounds, 8))


@over_backends("router_fwd")
@pytest.mark.parametrize("mode", ["fused_atomic", "two_kernel"])
def test_qb_bin_edges(backend, mode):
    # s in {0, 0.5, 1} exactly (z = -100, 0, 100), biases multiples of 1/4, L=-1, U=1, B=8: every
    # r = alpha - s is a multiple of 1/4, so (r - L) * scale is an exact integer (a bin edge).
    e, k, b = 8, 3, 8
    g = torch.Generator().manual_seed(11)
    z = torch.tensor([-100.0, 0.0, 100.0])[torch.randint(0, 3, (16, e), generator=g)].to(DEVICE)
    s = kernel_scores(backend, z, "sigmoid")
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
    _, alpha, _ = ref.qb_cutoff_and_routes(s, bias, k)
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


@over_backends("router_fwd")
@pytest.mark.parametrize("mode", ["fused_atomic", "two_kernel"])
def test_qb_adversarial_rows(backend, mode):
    e, k, b = E_MAIN, K_MAIN, 64
    z = adversarial_rows(e)
    bias = torch.zeros(e, device=DEVICE)
    bias[::5] = 0.125
    s = kernel_scores(backend, z, "sigmoid")
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
    idx_ref, alpha, _ = ref.qb_cutoff_and_routes(s, bias, k)
    check_exactly_k(routed, k)
    assert torch.equal(ids, idx_ref)
    assert torch.equal(hist, ref.qb_histogram_counts(s, alpha, bounds, b))


@pytest.mark.skipif(not HAS_GPU, reason="seed shapes need a GPU (the interpreter is too slow)")
@over_backends("router_fwd")
@pytest.mark.parametrize("t", [1, 256, 1024, 4096, 8192, 16384])
def test_qb_seed_shapes_two_kernel_equals_fused(backend, t):
    e, k, b = 896, 16, 1000
    z = torch.randn(t, e, device=DEVICE)
    bias = torch.linspace(-0.2, 0.2, e, device=DEVICE)
    bounds = torch.tensor([-1.2, 1.2], device=DEVICE)
    s = kernel_scores(backend, z, "sigmoid")
    _, alpha, _ = ref.qb_cutoff_and_routes(s, bias, k)
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
@over_backends("router_fwd")
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
        s = kernel_scores(backend, z, "sigmoid")
        _, alpha, _ = ref.qb_cutoff_and_routes(s, bias, k)
        assert torch.equal(hist, ref.qb_histogram_counts(s, alpha, bounds, b))
        assert torch.equal(routed, oracle(z, k, scores=s, expert_bias=bias)[2])


# ----------------------------------------------------------------------------------------------
# hip on the emulator and on a GPU
# ----------------------------------------------------------------------------------------------


# T per device (E=896): the emulator's 21 tokens, the GPU's 1, 257 and 4096
QB_MODE_TOKENS = [1, 257, 4096] if HAS_GPU else [21]


@over_backends("router_fwd", only=("hip",))
@pytest.mark.parametrize("t", QB_MODE_TOKENS)
@pytest.mark.parametrize("k", [8, 16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_qb_router_modes_agree_and_match_oracle(backend, warp_router, t, k, fmt):
    """Both histogram modes give the oracle's histogram on the kernel's own scores (so the same
    bits), the oracle's routes in every output format and its probs."""
    e = 896
    logits = make_logits(t, e, "normal", t * 31 + k if HAS_GPU else k).to(DEVICE)
    bias = torch.linspace(-0.2, 0.2, e, device=DEVICE)
    s = kernel_scores("hip", logits, "sigmoid")  # the kernel's scores, for both modes
    h_two = hip_check_qb(backend, logits, k, fmt, bias, "two_kernel", scores=s)
    h_fused = hip_check_qb(backend, logits, k, fmt, bias, "fused_atomic", scores=s)
    assert torch.equal(h_two, h_fused), "two_kernel and fused_atomic histograms differ"


# ----------------------------------------------------------------------------------------------
# hip on the CPU emulator
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@over_backends("router_fwd", emulator=True)
def test_qb_two_kernel_histogram_long_token_slices(backend, warp_router, dtype):
    """Enough tokens per slice for amdqb_qb_hist's unrolled loop and its remainder; E = 33 leaves
    a last expert block with one expert. Histograms equal the oracle's and the fused mode's."""
    e, t = 33, 700
    logits = make_logits(t, e, "normal", 3, dtype)
    bias = torch.linspace(-0.1, 0.1, e)
    s = kernel_scores("hip", logits, "sigmoid")  # the kernel's scores, for both modes
    hists = [
        check_hip_router(backend, logits, 4, "int32", bias=bias, qb_mode=m, num_bins=97, scores=s)
        for m in ("two_kernel", "fused_atomic")
    ]
    assert torch.equal(hists[0], hists[1])


@pytest.mark.parametrize(
    "block,per_cu,epb,vec,dtype",
    [
        (512, 1, 8, 4, torch.float32),
        (1024, 1, 8, 4, torch.bfloat16),
        (1024, 0, 8, 4, torch.float32),
        (1024, 0, 4, 4, torch.float32),
        (128, 8, 8, 4, torch.float32),
        (256, 4, 8, 1, torch.float32),
    ],
)
@pytest.mark.parametrize("misaligned", [False, True])
@over_backends("router_fwd", emulator=True)
def test_qb_two_kernel_histogram_launch_shapes(
    monkeypatch, backend, emu_rt, warp_router, block, per_cu, epb, vec, dtype, misaligned
):
    """The histogram pass gives the oracle's histogram for the launch shapes the tuner sweeps
    (hip.qb_hist.block threads, token slices aimed at hip.qb_hist.blocks_per_cu blocks per CU --
    0: one slice --, hip.qb_hist.max_experts_per_block, hip.qb_hist.vec experts per vector load);
    logits one element off the vector alignment take the scalar loads. E = 20: the last block of 8
    experts holds 4."""
    rt = emu_rt
    values = {
        "hip.qb_hist.block": block,
        "hip.qb_hist.blocks_per_cu": per_cu,
        "hip.qb_hist.max_experts_per_block": epb,
        "hip.qb_hist.vec": vec,
    }
    set_config(monkeypatch, values, torch.device("cpu"))
    chosen = []
    pick = hip_router.qb_hist_vec
    monkeypatch.setattr(hip_router, "qb_hist_vec", lambda *a: chosen.append(pick(*a)) or chosen[-1])
    e, t = 20, 600
    logits = make_logits(t, e, "normal", block, dtype)
    if misaligned:  # the same values at a storage offset of one element
        logits = torch.cat([logits.new_zeros(1), logits.flatten()])[1:].view(t, e)
    bias = torch.linspace(-0.1, 0.1, e)
    check_hip_router(backend, logits, 4, "int32", bias=bias, qb_mode="two_kernel", num_bins=61)
    launches = [x for x in rt.launches if x[0] == "amdqb_qb_hist"]
    assert launches[-1][2] == block
    assert launches[-1][1][0] == -(-e // epb), "expert groups"
    if per_cu == 0:
        assert launches[-1][1][1] == 1, "one token slice"
    assert chosen == [1 if misaligned else vec]


def spread_margin_axes(e: int) -> torch.Tensor:
    """log_margin inverse scales from 2^0 to 2^29 over E experts: with small biases and logits of
    std 4 the margins land in the zero, fine and coarse bins on both sides."""
    return torch.ldexp(torch.ones(e), torch.arange(e) * 30 // e)


@over_backends("router_fwd", emulator=True)
@pytest.mark.parametrize("mode", ["two_kernel", "fused_atomic"])
@pytest.mark.parametrize("e,t", [(20, 300), (22, 130), (896, 37)])
@pytest.mark.parametrize("scales", ["valid", "unchecked"])
def test_log_margin_histogram_on_own_scores(backend, warp_router, mode, e, t, scales):
    """The log_margin histogram of both modes equals the oracle's on the kernel's own scores: the
    fused epilogue's atomics and the two-kernel bin bytes counted by amdqb_qb_hist_bins (4-expert
    vector loads for E = 20 and 896, scalar loads for E = 22, a partial last expert group)."""
    logits = make_logits(t, e, "normal", e + t) * 4
    bias = torch.randn(e, generator=torch.Generator().manual_seed(e)) * 1e-3
    scale = spread_margin_axes(e)
    if scales == "unchecked":  # a trusted producer's garbage: the same bins on every backend
        garbage = torch.tensor([float("nan"), 0.0, -1.0, float("inf"), -float("inf"), 3e38])
        scale[::3] = garbage.repeat(e)[: len(scale[::3])]
        amdqb.mark_qb_bin_bounds_validated(scale)
    hist = torch.zeros(e, 64, dtype=torch.int32)
    kw = dict(expert_bias=bias, qb_histogram=hist, qb_bin_bounds=scale, qb_binning="log_margin")
    amdqb.fused_topk_with_score_function(logits, 8, qb_histogram_mode=mode, backend=backend, **kw)
    s = kernel_scores("hip", logits, "sigmoid")
    want = torch.zeros_like(hist)
    ref.fused_topk_with_score_function(logits, 8, scores=s, **{**kw, "qb_histogram": want})
    assert torch.equal(hist, want)
    assert int(hist.sum()) == t * e


@over_backends("router_fwd", emulator=True, waves=(32, 64))
@pytest.mark.parametrize(
    "e,t,bins,on",
    [(24, 1100, 64, True), (21, 300, 66, True), (21, 300, 66, False), (896, 40, 256, True)],
)
def test_log_margin_fused_counts_in_lds_where_it_fits(
    backend, emu_rt, warp_router, monkeypatch, e, t, bins, on
):
    """fused_atomic log_margin on amdqb_router with hip.router.margin_lds on: the bins at or above
    the cutoff are counted in the block's 8-bit LDS counters where they fit the LDS budget, in
    a grid whose blocks count at most 255 tokens each (T=1100 on the emulator's few CUs needs
    the larger grid); E=896 with B=256 exceeds the budget and, like the config's off switch,
    counts with device atomics. Either way the histogram is two_kernel's and the oracle's
    on the kernel's scores, and adds onto the counts it is given."""
    rt = emu_rt
    set_config(monkeypatch, {"hip.router.margin_lds": on}, torch.device("cpu"))
    logits = make_logits(t, e, "normal", e * t) * 4
    bias = torch.randn(e, generator=torch.Generator().manual_seed(e)) * 1e-3
    scale = spread_margin_axes(e)
    kw = dict(expert_bias=bias, qb_bin_bounds=scale, qb_binning="log_margin")
    hists = {}
    for mode in ("fused_atomic", "two_kernel"):
        hists[mode] = torch.full((e, bins), 3, dtype=torch.int32)
        amdqb.fused_topk_with_score_function(
            logits, 8, qb_histogram=hists[mode], qb_histogram_mode=mode, backend=backend, **kw
        )
        if mode == "fused_atomic":
            name, grid, block, smem = [x for x in rt.launches if x[0] == "amdqb_router"][-1]
    lds = hip_router.margin_lds_bytes(e, bins)
    fits = lds <= rt.smem_budget(0)
    assert fits == (e < 896)
    fits = fits and on
    assert smem == (lds if fits else 0)
    if fits:
        rows = block // hip_router.row_lanes(rt, 0)
        assert -(-t // (grid[0] * rows)) * rows <= hip_router.MARGIN_LDS_MAX_TOKENS
    s = kernel_scores("hip", logits, "sigmoid")
    want = torch.full((e, bins), 3, dtype=torch.int32)
    ref.fused_topk_with_score_function(logits, 8, scores=s, qb_histogram=want, **kw)
    assert torch.equal(hists["fused_atomic"], want)
    assert torch.equal(hists["two_kernel"], want)
    assert int(want.sum()) == t * e + 3 * e * bins


@over_backends("router_fwd", emulator=False, only=("hip",))
@pytest.mark.parametrize("e", [896, 1024, 1280])
def test_log_margin_lds_counts_within_static_and_dynamic_lds(backend, monkeypatch, e):
    """On a GPU the LDS-counted log_margin router's block holds its static LDS (the rows' buffers,
    the bias) beside the dynamic counters: at E = 1280 with B = 64 the counters alone fit the
    48 KiB budget and the sum does not, and the router counts with device atomics instead of
    failing its launch; E = 896 and 1024 fit. Either way the histogram is the oracle's."""
    set_config(monkeypatch, {"hip.router.margin_lds": True})
    t = 700
    logits = make_logits(t, e, "normal", e + t).to(DEVICE) * 4
    bias = (torch.randn(e, generator=torch.Generator().manual_seed(e)) * 1e-3).to(DEVICE)
    scale = spread_margin_axes(e).to(DEVICE)
    hist = torch.zeros(e, 64, dtype=torch.int32, device=DEVICE)
    kw = dict(expert_bias=bias, qb_bin_bounds=scale, qb_binning="log_margin")
    amdqb.fused_topk_with_score_function(
        logits, 8, qb_histogram=hist, qb_histogram_mode="fused_atomic", backend=backend, **kw
    )
    s = kernel_scores("hip", logits, "sigmoid")
    want = torch.zeros_like(hist)
    ref.fused_topk_with_score_function(logits, 8, scores=s, qb_histogram=want, **kw)
    assert torch.equal(hist, want)
    assert int(hist.sum()) == t * e


@over_backends("router_fwd", emulator=True)
def test_qb_two_kernel_histogram_accumulates(backend, emu_rt, warp_router):
    """One token slice per expert group (the default): every bin is flushed by one block, the
    oracle's counts; the histogram accumulates onto the existing counts."""
    rt = emu_rt
    e, t = 20, 300
    logits = make_logits(t, e, "normal", 7, torch.float32)
    bias = torch.linspace(-0.1, 0.1, e)
    once = check_hip_router(
        backend, logits, 4, "int32", bias=bias, qb_mode="two_kernel", num_bins=61
    )
    launches = [x for x in rt.launches if x[0] == "amdqb_qb_hist"]
    assert launches[-1][1][:2] == (3, 1), "3 expert groups, one token slice"
    assert rt.dependent_launches[-1:] == ["amdqb_qb_hist"], "launched as the router's dependent"
    # a second call adds onto the first call's counts
    probs, rmap, kind, hist, bounds = hip_run_router(
        backend, logits, 4, "int32", bias, "two_kernel", num_bins=61, hist=once.clone()
    )
    assert torch.equal(hist, 2 * once)


# ----------------------------------------------------------------------------------------------
# hip on a GPU
# ----------------------------------------------------------------------------------------------


@hip_gpu
@over_backends("router_fwd", only=("hip",))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["two_kernel", "fused_atomic", "auto"])
def test_qb_router_dtypes(backend, dtype, mode):
    e = 896
    logits = make_logits(1000, e, "normal", 7, dtype).to(DEVICE)
    bias = (torch.randn(e, generator=torch.Generator().manual_seed(3)) * 0.05).to(DEVICE)
    hip_check_qb(backend, logits, 16, "bytemap", bias, mode)


@hip_gpu
@over_backends("router_fwd", only=("hip",))
@pytest.mark.parametrize("selection", ["te", "tie_free"])
@pytest.mark.parametrize("on", [True, False])
def test_log_margin_fused_on_the_warp_kernel_gpu(backend, monkeypatch, selection, on):
    """log_margin fused_atomic beyond the decode form's tokens (amdqb_router): with LDS counters
    (hip.router.margin_lds) or device atomics, the oracle's histogram on the kernel's scores and
    the two-kernel mode's, onto the counts it is given; per-expert axes from 2^0 to 2^29."""
    set_config(monkeypatch, {"hip.router.margin_lds": on})
    e, k, t = 896, 16, 2500
    logits = (make_logits(t, e, "normal", 11) * 4).to(DEVICE)
    bias = (torch.randn(e, generator=torch.Generator().manual_seed(5)) * 1e-3).to(DEVICE)
    scale = spread_margin_axes(e).to(DEVICE)
    kw = dict(expert_bias=bias, qb_bin_bounds=scale, qb_binning="log_margin", selection=selection)
    hists = {}
    for mode in ("fused_atomic", "two_kernel"):
        hists[mode] = torch.full((e, 64), 2, dtype=torch.int32, device=DEVICE)
        amdqb.fused_topk_with_score_function(
            logits, k, qb_histogram=hists[mode], qb_histogram_mode=mode, backend=backend, **kw
        )
    s = kernel_scores("hip", logits, "sigmoid").cpu()
    want = torch.full((e, 64), 2, dtype=torch.int32)
    cpu = {n: v.cpu() if torch.is_tensor(v) else v for n, v in kw.items()}
    ref.fused_topk_with_score_function(logits.cpu(), k, scores=s, qb_histogram=want, **cpu)
    assert torch.equal(hists["fused_atomic"].cpu(), want)
    assert torch.equal(hists["two_kernel"].cpu(), want)


@hip_gpu
@over_backends("router_fwd", only=("hip",))
@pytest.mark.parametrize("mode", ["two_kernel", "fused_atomic"])
def test_router_graph_capture_replays(backend, mode):
    e, k, t, b = 896, 16, 1024, 1000
    logits_static = make_logits(t, e, "normal", 0).to(DEVICE)
    bias = torch.linspace(-0.2, 0.2, e, device=DEVICE)
    bounds = torch.stack([bias.min() - 1, bias.max() + 1]).contiguous()
    hist = torch.zeros(e, b, dtype=torch.int32, device=DEVICE)
    kwargs = dict(
        expert_bias=bias,
        qb_histogram=hist,
        qb_bin_bounds=bounds,
        qb_histogram_mode=mode,
        backend=backend,
    )
    amdqb.fused_topk_with_score_function(logits_static, k, **kwargs)  # warm-up + validation
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        probs, rmap = amdqb.fused_topk_with_score_function(logits_static, k, **kwargs)
    for replay in range(4):
        hist.zero_()
        logits = make_logits(t, e, "normal", 10 + replay)
        logits_static.copy_(logits.to(DEVICE))
        graph.replay()
        torch.cuda.synchronize()
        s = kernel_scores("hip", logits_static, "sigmoid").cpu()
        idx_ref, alpha, _ = qb_cutoff_and_routes(s, bias.cpu(), k)
        assert torch.equal(hist.cpu(), qb_histogram_counts(s, alpha, bounds.cpu(), b))
        want = torch.zeros(t, e, dtype=torch.bool).scatter_(1, idx_ref, True)
        assert torch.equal(rmap.cpu(), want)


@hip_gpu
@over_backends("router_fwd", only=("hip",))
def test_qb_histogram_pass_is_a_dependent_launch_on_sm90(monkeypatch, backend):
    """On NVIDIA sm_90+ the histogram pass goes out as a programmatic dependent launch. The runtime
    falls back to ordinary launches for good if the bindings or the driver refuse one; this test
    makes such a fallback visible. The histogram equals the ordinary launch's and the oracle's
    (graph replay: test_router_graph_capture_replays)."""
    tc = _runtime.get_runtime().toolchain
    if tc.name != "nvrtc" or torch.cuda.get_device_capability(DEVICE)[0] < 9:
        pytest.skip("programmatic dependent launch is an NVIDIA sm_90+ feature")
    e, k, t, b = 896, 16, 3000, 1000
    logits = make_logits(t, e, "normal", 4).to(DEVICE)
    bias = torch.linspace(-0.2, 0.2, e, device=DEVICE)
    bounds = torch.stack([bias.min() - 1, bias.max() + 1]).contiguous()
    hists = []
    for dependent in (True, False):
        set_config(monkeypatch, {"hip.qb_hist.dependent_launch": dependent})
        hist = torch.zeros(e, b, dtype=torch.int32, device=DEVICE)
        amdqb.fused_topk_with_score_function(
            logits,
            k,
            expert_bias=bias,
            qb_histogram=hist,
            qb_bin_bounds=bounds,
            qb_histogram_mode="two_kernel",
            backend=backend,
        )
        hists.append(hist.cpu())
    assert tc._pdl not in (None, False), "the dependent launch fell back to cuLaunchKernel"
    assert torch.equal(hists[0], hists[1])
    s = kernel_scores("hip", logits, "sigmoid").cpu()
    _, alpha, _ = qb_cutoff_and_routes(s, bias.cpu(), k)
    assert torch.equal(hists[0], qb_histogram_counts(s, alpha, bounds.cpu(), b))


# ----------------------------------------------------------------------------------------------
# launch planning
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", configs.available())
def test_qb_hist_config_fits_the_budget(arch):
    cfg = configs.load(arch)
    for bins in (2, 1000, 4000, 12288):
        for tokens in (1, 300, 4096):
            epb, slices, per = hip_router.qb_hist_config(896, bins, tokens, 48 * 1024, 132, cfg)
            assert epb * bins * 4 <= 48 * 1024 and epb >= 1
            assert slices * per >= tokens and (slices - 1) * per < tokens
    with pytest.raises(ValueError):
        hip_router.qb_hist_config(896, 13000, 16, 48 * 1024, 132, cfg)


@pytest.mark.parametrize("arch", configs.available())
def test_auto_qb_mode_follows_the_update_threshold(arch):
    """``auto``: the fused mode while T*E <= hip.router.qb_auto_fused_max_updates (its
    ``_moments`` twin with the in-bin moments), two-kernel beyond; without the moments, at the
    seed's E = 896 every size auto sends to the fused mode runs its block-per-token form
    (hip.router.decode_max_tokens_fused)."""
    cfg = configs.load(arch)
    for moments, key in ((False, ""), (True, "_moments")):
        limit = cfg["hip.router.qb_auto_fused_max_updates" + key]
        for e in (64, 896, 4096):
            t = limit // e
            assert hip_router.auto_qb_mode(t, e, cfg, moments) == "fused_atomic"
            assert hip_router.auto_qb_mode(t + 1, e, cfg, moments) == "two_kernel"
            assert hip_router.auto_qb_mode(1, e, cfg, moments) == "fused_atomic"
    assert (
        cfg["hip.router.decode_max_tokens_fused"] * 896
        >= cfg["hip.router.qb_auto_fused_max_updates"]
    )


# ----------------------------------------------------------------------------------------------
# bin bounds validation
# ----------------------------------------------------------------------------------------------


def test_qb_bounds_validation_is_cached_per_version_and_catches_updates():
    e, b = 16, 10
    logits = torch.randn(8, e, device=DEVICE)
    hist = torch.zeros(e, b, dtype=torch.int32, device=DEVICE)
    bounds = torch.tensor([-1.0, 1.0], device=DEVICE)
    bias = torch.zeros(e, device=DEVICE)
    kw = dict(expert_bias=bias, qb_histogram=hist, qb_bin_bounds=bounds)
    amdqb.fused_topk_with_score_function(logits, 2, qb_histogram_mode="two_kernel", **kw)
    assert hist.sum(1).tolist() == [8] * e
    bounds.fill_(0.0)  # in-place update: the next eager call must re-validate and reject
    with pytest.raises(ValueError, match="finite with lower < upper"):
        amdqb.fused_topk_with_score_function(logits, 2, qb_histogram_mode="fused_atomic", **kw)
    bounds.copy_(torch.tensor([-2.0, 2.0]))
    amdqb.fused_topk_with_score_function(logits, 2, qb_histogram_mode="fused_atomic", **kw)
    assert hist.sum().item() == 16 * e
    bounds.fill_(float("nan"))
    amdqb.mark_qb_bin_bounds_validated(bounds)  # trusted producer: no check, no read
    amdqb.fused_topk_with_score_function(logits, 2, qb_histogram_mode="fused_atomic", **kw)


@pytest.mark.parametrize(
    "bad", [[1.0, 1.0], [1.0, -1.0], [float("nan"), 1.0], [-float("inf"), 1.0]]
)
def test_qb_rejects_invalid_bounds(bad):
    e = 8
    with pytest.raises(ValueError, match="finite with lower < upper"):
        amdqb.fused_topk_with_score_function(
            torch.randn(4, e, device=DEVICE),
            2,
            expert_bias=torch.zeros(e, device=DEVICE),
            qb_histogram=torch.zeros(e, 4, dtype=torch.int32, device=DEVICE),
            qb_bin_bounds=torch.tensor(bad, device=DEVICE),
            qb_histogram_mode="two_kernel",
        )


@pytest.mark.skipif(not HAS_GPU, reason="CUDA/HIP graph capture needs a GPU")
def test_capture_rejects_unvalidated_bounds_and_context_survives():
    e = 16
    logits = torch.randn(8, e, device="cuda")
    hist = torch.zeros(e, 10, dtype=torch.int32, device="cuda")
    bounds = torch.tensor([-1.0, 1.0], device="cuda")
    bias = torch.zeros(e, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="graph capture"):
        with torch.cuda.graph(graph):
            amdqb.fused_topk_with_score_function(
                logits,
                2,
                expert_bias=bias,
                qb_histogram=hist,
                qb_bin_bounds=bounds,
                qb_histogram_mode="fused_atomic",
            )
    probs, _ = amdqb.fused_topk_with_score_function(logits, 2)  # context still usable
    torch.cuda.synchronize()
    assert torch.isfinite(probs).all()


# ----------------------------------------------------------------------------------------------
# the oracle
# ----------------------------------------------------------------------------------------------


def test_qb_tie_and_clamp_vector_te():
    """TE's test_qb_topk_plus_one_tie_and_bin_clamping."""
    logits = torch.tensor(
        [[3, 3, 3, -1, -2, -3, -4, -5], [5, 4, 3, 2, -2, -3, -4, -5]], dtype=torch.float32
    )
    hist = torch.zeros(8, 8, dtype=torch.int32)
    _, idx, rmap = ref.fused_topk_with_score_function(
        logits,
        2,
        expert_bias=torch.zeros(8),
        qb_histogram=hist,
        qb_bin_bounds=torch.tensor([-0.05, 0.05]),
    )
    assert rmap[0, :3].tolist() == [True, True, False]  # the tied largest id is dropped
    assert hist[:, 0].sum() > 0 and hist[:, -1].sum() > 0
    assert hist.sum(1).tolist() == [2] * 8


def test_qb_histogram_matches_python_loop():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(37, 11, generator=g)
    bias = torch.linspace(-0.2, 0.2, 11)
    bounds = torch.tensor([bias.min() - 1, bias.max() + 1])
    hist = torch.zeros(11, 50, dtype=torch.int32)
    ref.fused_topk_with_score_function(
        logits, 3, expert_bias=bias, qb_histogram=hist, qb_bin_bounds=bounds
    )
    s = torch.sigmoid(logits).numpy()
    u = s + bias.numpy()
    lo, hi = np.float32(bounds[0]), np.float32(bounds[1])
    scale = np.float32(50) / (hi - lo)
    expected = np.zeros((11, 50), dtype=np.int64)
    for t in range(37):
        alpha = u[t][brute_topk(u[t].tolist(), 4)[3]]
        for j in range(11):
            r = np.float32(alpha) - np.float32(s[t, j])
            b = np.floor(np.float32(r - lo) * scale)
            expected[j, int(min(max(b, 0), 49))] += 1
    assert (hist.numpy() == expected).all()


def test_bin_index_on_exact_edges_and_nan():
    bounds = torch.tensor([-1.0, 1.0])
    r = torch.tensor([-1.0, -0.75, -0.5, 0.0, 0.9999999, 1.0, 5.0, -5.0, float("nan")])
    bins = ref.qb_bin_index(r, bounds, 8)
    assert bins.tolist() == [0, 1, 2, 4, 7, 7, 7, 0, 0]
    below = torch.nextafter(torch.tensor(-0.75), torch.tensor(-1.0))
    assert ref.qb_bin_index(below.reshape(1), bounds, 8).item() == 0


def test_bin_index_fp32_formula_non_power_of_two():
    """Edges of a non power-of-two range: the fp32 formula, not float64 or true division."""
    lo, hi, nb = np.float32(-1.2), np.float32(1.3), 1000
    scale = np.float32(nb) / (hi - lo)
    edges = lo + np.arange(nb, dtype=np.float32) / scale  # values on (or next to) edges
    r = np.concatenate([edges, np.nextafter(edges, np.float32(-2)), np.nextafter(edges, 2)])
    expected = np.clip(np.floor((r.astype(np.float32) - lo) * scale), 0, nb - 1).astype(np.int64)
    got = ref.qb_bin_index(torch.from_numpy(r), torch.tensor([lo, hi]), nb).numpy()
    assert (got == expected).all()
