"""The ``hip`` backend's kernels executed on the CPU by the host emulator (op_tests/hip_emu).

The hip_src kernels are compiled with g++ against an emulation of the GPU execution model (one
thread per GPU thread, barrier-synchronised 32-lane logical warps, wave32 and wave64 ballots,
per-block poisoned shared memory) and driven by the backend's own launchers
(``amdqb.backends.hip._ops``) with the same ``kernelParams`` arrays the GPU runtimes pass. Results
are compared with the ``amdqb.ref`` oracles: exact for routes, counts and histograms, within a
tolerance for probabilities. This runs in CI without a GPU; it is not a substitute for the GPU
tests in test_hip_backend.py (memory model, real atomics, timing).
"""

import ctypes

import pytest
import torch

from amdqb import ref
from amdqb.backends.hip import _ops, _spec
from amdqb.ref.ordering import order_key
from amdqb.ref.router import qb_cutoff_and_routes, qb_histogram_counts
from hip_emu.checks import check_routes, make_ids, make_logits, routed_mask
from hip_emu.runtime import EmuRuntime, compiler

pytestmark = pytest.mark.skipif(compiler() is None, reason="needs g++ (C++20) for the emulator")

_RUNTIMES = {}


def emu(wave: int = 32) -> EmuRuntime:
    if wave not in _RUNTIMES:
        _RUNTIMES[wave] = EmuRuntime(wave_size=wave, cus=2)
    return _RUNTIMES[wave]


@pytest.fixture(autouse=True)
def _router_tests_run_the_warp_kernel(monkeypatch):
    """The router tests below check amdqb_router (one warp per token) against the oracles at small
    T, where the op would pick its decode form; the decode form is checked bitwise against
    amdqb_router by test_router_decode_kernel_is_bitwise_the_warp_kernel."""
    monkeypatch.setattr(_ops, "ROUTER_DECODE_MAX_TOKENS", 0)
    monkeypatch.setattr(_ops, "ROUTER_DECODE_FUSED_MAX_TOKENS", 0)


# ------------------------------------------------------------------------------------------------
# Prelude scalar helpers
# ------------------------------------------------------------------------------------------------
def _call(fn, x, out):
    fn(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()), ctypes.c_longlong(x.numel()))
    return out


def _float_corpus():
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (400_000,), generator=g, dtype=torch.int64)
    specials = [65504.0, 65519.99, 65520.0, 65520.01, 2.0**-25, 2.0**-25 * 1.0001, 2.0**-24 * 1.5]
    specials += [2.0**-24 * 2.5, 2.0**-14, 2.0**-14 * (1 - 2**-12), -0.0, 0.0, 1e-45, 3.4e38]
    specials += [float("inf"), -float("inf"), float("nan"), -float("nan")]
    all_halves = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    return torch.cat(
        [
            bits.to(torch.int32).view(torch.float32),
            torch.randn(200_000, generator=g) * 1e-5,
            torch.randn(200_000, generator=g) * 3e4,
            torch.randn(50_000, generator=g) * 1e-7,
            all_halves.view(torch.float16).float(),
            all_halves.view(torch.bfloat16).float(),
            torch.tensor(specials),
        ]
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prelude_float_conversions_match_torch_bitwise(dtype):
    lib = emu().converter()
    x = _float_corpus()
    name = "f16" if dtype == torch.float16 else "bf16"
    y = _call(
        getattr(lib, f"amdqb_emu_f32_to_{name}"), x, torch.empty(x.numel(), dtype=torch.int16)
    )
    want = x.to(dtype).view(torch.int16)
    nan = x.isnan()
    assert torch.equal(y[~nan], want[~nan])
    assert y[nan].view(dtype).isnan().all()
    h = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    back = _call(getattr(lib, f"amdqb_emu_{name}_to_f32"), h, torch.empty(65536))
    want = h.view(dtype).float()
    nan = want.isnan()
    assert torch.equal(back.view(torch.int32)[~nan], want.view(torch.int32)[~nan])
    assert back[nan].isnan().all()


def test_prelude_order_key_matches_oracle():
    x = _float_corpus()
    k = _call(emu().converter().amdqb_emu_order_key, x, torch.empty(x.numel(), dtype=torch.int32))
    assert torch.equal(k, order_key(x))


# ------------------------------------------------------------------------------------------------
# Route rows
# ------------------------------------------------------------------------------------------------
ROUTE_EXPERTS = [1, 17, 129, 257, 513, 896, 4096]


@pytest.mark.parametrize("e", ROUTE_EXPERTS)
@pytest.mark.parametrize("impl", ["atomic", "lds"])
def test_route_rows_distributions(e, impl):
    # Emulator-sized calls (<= ~6000 routes); the GPU tests cover both sides of the seed gate.
    rt = emu()
    k = 4
    cases = [("uniform", 1500), ("shared", 300), ("one", 200), ("dropped", 700), ("uniform", 1)]
    for seed, (dist, m) in enumerate(cases):
        ids = make_ids(m, k, e, dist, seed)
        for capacity in (None, max(1, m * k // (2 * e))):
            c0 = torch.randint(0, 3, (e,), dtype=torch.int32)
            counters = c0.clone()
            rows = torch.full_like(ids, -7)
            counts = torch.zeros(e, dtype=torch.int32)  # the op's contract: zero-filled
            _ops.route_rows(rt, ids, e, capacity, counters, rows, counts, False, impl)
            check_routes(ids, e, capacity, c0, rows, counts, counters)


def test_route_finalize_scan_with_a_1024_thread_block():
    """E > 4096 (atomic path): the compact layout's offsets come from a 1024-thread block scan."""
    rt, e = emu(), 5000
    ids = make_ids(900, 4, e, "uniform", 7)
    c0 = torch.randint(0, 2**20, (e,), dtype=torch.int32)  # large counters: the scan must wrap
    for capacity in (None, 3):
        counters = c0.clone()
        rows = torch.full_like(ids, -7)
        counts = torch.zeros(e, dtype=torch.int32)
        _ops.route_rows(rt, ids, e, capacity, counters, rows, counts, False, "atomic")
        check_routes(ids, e, capacity, c0, rows, counts, counters)


@pytest.mark.parametrize("wave", [32, 64])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_route_rows_deterministic_matches_oracle_bitwise(wave, dtype):
    rt = emu(wave)
    for e, m, k, dist in [(7, 800, 3, "dropped"), (896, 300, 8, "shared"), (129, 64, 5, "one")]:
        ids = make_ids(m, k, e, dist, e, dtype)
        for capacity in (None, 9):
            c0 = torch.randint(0, 5, (e,), dtype=torch.int32)
            counters = c0.clone()
            rows = torch.empty(ids.shape, dtype=torch.int32)
            counts = torch.zeros(e, dtype=torch.int32)
            _ops.route_rows(rt, ids, e, capacity, counters, rows, counts, True, "lds")
            check_routes(ids, e, capacity, c0, rows, counts, counters, deterministic=True)
    # the scan goes out as a dependent of the histogram pass (NVIDIA: programmatic launch), the
    # rank pass too while its tiles fill at most half of the CUs (the last case: one tile)
    suffix = "i32" if dtype == torch.int32 else "i64"
    assert rt.dependent_launches[-2:] == ["amdqb_route_det_scan", f"amdqb_route_det_rank_{suffix}"]


def test_route_rows_int64_ids_and_empty():
    rt = emu()
    e = 33
    ids = make_ids(300, 4, e, "dropped", 3, torch.int64)
    for impl in ("atomic", "lds"):
        c0 = torch.zeros(e, dtype=torch.int32)
        counters = c0.clone()
        rows = torch.empty(ids.shape, dtype=torch.int32)
        counts = torch.zeros(e, dtype=torch.int32)
        _ops.route_rows(rt, ids, e, None, counters, rows, counts, False, impl)
        check_routes(ids, e, None, c0, rows, counts, counters)
    empty = torch.empty(0, 4, dtype=torch.int32)
    counters = torch.full((e,), 3, dtype=torch.int32)
    counts = torch.zeros(e, dtype=torch.int32)
    _ops.route_rows(
        rt, empty, e, None, counters, torch.empty(0, 4, dtype=torch.int32), counts, False, "lds"
    )
    assert torch.all(counts == 0) and torch.all(counters == 3)


@pytest.mark.parametrize("wave", [32, 64])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_align_block_size_matches_oracle_bitwise(wave, dtype):
    """moe_align_block_size: sorted ids, expert ids and the padded total equal the oracle's bitwise
    (ascending flat order inside each expert), over tiles that split experts' routes, partial last
    tiles, dropped ids, empty experts, 1..8 warps per tile (E up to 4096) and pad_sorted_ids."""
    from amdqb.ref.layout import align_buffer_sizes

    rt = emu(wave)
    cases = [
        (7, 900, 3, "dropped", 4, False),  # 2 tiles, partial last
        (896, 300, 16, "uniform", 64, False),  # 3 tiles, 8 warps, many empty blocks of rows
        (896, 260, 8, "shared", 16, True),
        (129, 64, 5, "one", 1, False),  # block_size 1: no padding
        (2048, 600, 8, "uniform", 32, True),  # 5 tiles of 4 warps
        (4096, 70, 4, "dropped", 128, False),  # 1 warp per tile, most experts empty
        (33, 1, 1, "uniform", 8, False),  # a single route
        (300, 200, 6, "shared", 12, True),  # a block size that is not a power of two
    ]
    for e, m, k, dist, bs, pad in cases:
        ids = make_ids(m, k, e, dist, e + m, dtype)
        want = ref.moe_align_block_size(ids, bs, e, pad_sorted_ids=pad)
        max_padded, max_blocks = align_buffer_sizes(ids.numel(), e, bs, pad)
        got = (
            torch.full((max_padded,), -7, dtype=torch.int32),
            torch.full((max_blocks,), -7, dtype=torch.int32),
            torch.full((1,), -7, dtype=torch.int32),
        )
        _ops.align_block_size(rt, ids, bs, e, *got)
        for name, g, w in zip(("sorted_ids", "expert_ids", "num_post_pad"), got, want):
            assert torch.equal(g, w), f"{name} differs (E={e}, m={m}, k={k}, {dist}, bs={bs})"
        suffix = "i32" if dtype == torch.int32 else "i64"
        dependent = 2 * -(-ids.numel() // _spec.DET_TILE) <= rt.cus  # rank pass as a dependent
        launched = rt.dependent_launches[-2:] if dependent else rt.dependent_launches[-1:]
        want_launches = ["amdqb_route_det_scan"] + ([f"amdqb_align_rank_{suffix}"] * dependent)
        assert launched == want_launches, (e, m, k)
        rt.dependent_launches.clear()
    assert _ops.align_warps(896) == 8 and _ops.align_warps(2048) == 4
    assert _ops.align_warps(4096) == 1


@pytest.mark.parametrize("num_tiles", [1, 7, 64, 65, 150])
def test_det_scan_over_tile_groups(num_tiles):
    """amdqb_route_det_scan: per-expert exclusive scan over the tiles from start (or 0), totals =
    the end; groups of at most 8 tiles stay in registers (<= 64 tiles), longer groups reload."""
    rt, e = emu(), 45  # two blocks of 32 experts, the second partly empty
    g = torch.Generator().manual_seed(num_tiles)
    counts = torch.randint(0, 50, (num_tiles, e), generator=g, dtype=torch.int32)
    for start in (None, torch.randint(0, 1000, (e,), generator=g, dtype=torch.int32)):
        tile = counts.clone().reshape(-1)
        totals = torch.full((e,), -7, dtype=torch.int32)
        k = rt.kernel(-1, _spec.ROUTE_MODULE, "amdqb_route_det_scan")
        args = [_spec.arg_i32(num_tiles), _spec.arg_i32(e), _ops._ptr(tile), _ops._ptr(start)]
        rt.launch(k, -(-e // _spec.SCAN_EXPERTS), 256, 0, args + [_ops._ptr(totals)])
        base = torch.zeros(e, dtype=torch.int64) if start is None else start.long()
        incl = counts.long().cumsum(0) + base
        assert torch.equal(tile.reshape(num_tiles, e).long(), incl - counts.long())
        assert torch.equal(totals.long(), incl[-1])


def test_route_lds_launch_shape():
    rt = emu()
    rt.launches.clear()
    ids = make_ids(1025, 16, 896, "uniform", 0)
    counters = torch.zeros(896, dtype=torch.int32)
    _ops.route_rows(
        rt, ids, 896, 64, counters, torch.empty_like(ids), torch.zeros_like(counters), False, "lds"
    )
    assert [launch[0] for launch in rt.launches] == ["amdqb_route_lds_i32"]  # masked: one kernel
    name, grid, block, smem = rt.launches[0]
    assert name == "amdqb_route_lds_i32"
    assert grid[0] == -(-ids.numel() // (_spec.ROUTE_BLOCK * _spec.ROUTE_ITEMS))
    assert smem == 4 * 896 and block == _spec.ROUTE_BLOCK


@pytest.mark.parametrize("block,items", [(512, 8), (1024, 4)])
def test_route_lds_other_tiles(monkeypatch, block, items):
    """The tile shapes the tuner sweeps (bench/tune_router_occupancy.py route_tiles) are correct
    builds too: several experts per thread in the reservation loop or fewer, partial last tile."""
    rt = emu()
    module = _spec.ROUTE_MODULE.with_defines(
        ("AMDQB_ROUTE_BLOCK", str(block)), ("AMDQB_ROUTE_ITEMS", str(items))
    )
    monkeypatch.setattr(_spec, "ROUTE_MODULE", module)
    monkeypatch.setattr(_spec, "ROUTE_BLOCK", block)
    monkeypatch.setattr(_spec, "ROUTE_ITEMS", items)
    for e, dist, m in ((896, "uniform", 700), (4096, "dropped", 300), (3, "one", 500)):
        ids = make_ids(m, 16, e, dist, e)
        for capacity in (None, max(1, m * 16 // (2 * e))):
            c0 = torch.randint(0, 3, (e,), dtype=torch.int32)
            counters = c0.clone()
            rows = torch.full_like(ids, -7)
            counts = torch.zeros(e, dtype=torch.int32)
            _ops.route_rows(rt, ids, e, capacity, counters, rows, counts, False, "lds")
            check_routes(ids, e, capacity, c0, rows, counts, counters)


# ------------------------------------------------------------------------------------------------
# Router
# ------------------------------------------------------------------------------------------------
def overflows(rt, e=257):
    """Warps that took the candidate-overflow path so far (emulator counter)."""
    lib = rt._library(_spec.router_module(e, "float32", "sigmoid"))
    lib.amdqb_emu_overflows.restype = ctypes.c_longlong
    return lib.amdqb_emu_overflows()


def alloc_map(t, e, k, fmt):
    if fmt == "bytemap":
        return torch.empty(t, e, dtype=torch.bool), "bytemap"
    if fmt == "bitmap":
        return torch.empty(t, (e + 7) // 8, dtype=torch.uint8), "bitmap"
    dtype = {"idx16": torch.int16, "idx32": torch.int32, "idx64": torch.int64}[fmt]
    return torch.empty(t, k, dtype=dtype), "indices"


def run_router(
    rt,
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
):
    t, e = logits.shape
    probs = torch.full((t, e), 7.0, dtype=logits.dtype)
    map_out, kind = alloc_map(t, e, k, fmt)
    bounds = None
    if qb_mode is not None:
        hist = torch.zeros(e, num_bins, dtype=torch.int32) if hist is None else hist
        bounds = torch.stack([bias.min() - 1, bias.max() + 1]).contiguous()
    _ops.router_fwd(
        rt,
        logits,
        k,
        score,
        pre,
        None,
        None,
        scaling,
        bias,
        probs,
        map_out,
        kind,
        hist,
        bounds,
        qb_mode,
    )
    return probs, map_out, kind, hist, bounds


def check_router(rt, logits, k, fmt="bytemap", score="sigmoid", bias=None, qb_mode=None, **kw):
    t, e = logits.shape
    probs, map_out, kind, hist, bounds = run_router(rt, logits, k, fmt, score, bias, qb_mode, **kw)
    s = _ops.score_values(rt, logits, score)
    scaling = kw.get("scaling")
    if qb_mode is not None:
        idx_ref, alpha = qb_cutoff_and_routes(s, bias, k)
        assert torch.equal(hist, qb_histogram_counts(s, alpha, bounds, hist.shape[1]))
        assert torch.all(hist.sum(1) == t)
        probs_ref, idx_ref2, map_ref = ref.fused_topk_with_score_function(
            logits, k, expert_bias=bias, scores=s, scaling_factor=scaling
        )
        assert torch.equal(idx_ref, idx_ref2)
    else:
        probs_ref, idx_ref, map_ref = ref.fused_topk_with_score_function(
            logits,
            k,
            use_pre_softmax=kw.get("pre", False),
            score_function=score,
            expert_bias=bias,
            scores=s if score != "softmax" else None,
            scaling_factor=scaling,
        )
    mask = routed_mask(map_out, kind, e)
    assert torch.all(mask.sum(1) == k), "every token gets exactly k distinct experts"
    assert torch.equal(mask, map_ref), "routing differs from the oracle"
    if kind == "indices":
        assert torch.equal(map_out.long(), idx_ref), "indices are not in selection order"
    torch.testing.assert_close(
        probs.float(), probs_ref.to(logits.dtype).float(), atol=2e-6, rtol=1e-2, equal_nan=True
    )
    return hist


@pytest.mark.parametrize("fmt", ["bytemap", "bitmap", "idx16", "idx32", "idx64"])
@pytest.mark.parametrize("k", [8, 16])
def test_qb_router_modes_formats(fmt, k):
    rt = emu()
    e, t = 896, 21
    logits = make_logits(t, e, "normal", k)
    bias = torch.linspace(-0.2, 0.2, e)
    hists = [
        check_router(rt, logits, k, fmt, bias=bias, qb_mode=m)
        for m in ("two_kernel", "fused_atomic")
    ]
    assert torch.equal(hists[0], hists[1]), "two_kernel and fused_atomic histograms differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qb_two_kernel_histogram_long_token_slices(dtype):
    """Enough tokens per slice for amdqb_qb_hist's unrolled loop and its remainder; E = 33 leaves
    a last expert block with one expert. Histograms equal the oracle's and the fused mode's."""
    rt = emu()
    e, t = 33, 700
    logits = make_logits(t, e, "normal", 3, dtype)
    bias = torch.linspace(-0.1, 0.1, e)
    hists = [
        check_router(rt, logits, 4, "idx32", bias=bias, qb_mode=m, num_bins=97)
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
def test_qb_two_kernel_histogram_launch_shapes(
    monkeypatch, block, per_cu, epb, vec, dtype, misaligned
):
    """The histogram pass gives the oracle's histogram for the launch shapes the tuner sweeps
    (_ops.QB_HIST_BLOCK threads, token slices aimed at QB_HIST_BLOCKS_PER_CU blocks per CU -- 0:
    one slice --, QB_HIST_MAX_EXPERTS_PER_BLOCK, QB_HIST_VEC experts per vector load); logits one
    element off the vector alignment take the scalar loads. E = 20: the last block of 8 experts
    holds 4."""
    rt = emu()
    monkeypatch.setattr(_ops, "QB_HIST_BLOCK", block)
    monkeypatch.setattr(_ops, "QB_HIST_BLOCKS_PER_CU", per_cu)
    monkeypatch.setattr(_ops, "QB_HIST_MAX_EXPERTS_PER_BLOCK", epb)
    monkeypatch.setattr(_ops, "QB_HIST_VEC", vec)
    chosen = []
    pick = _ops._qb_hist_vec
    monkeypatch.setattr(_ops, "_qb_hist_vec", lambda *a: chosen.append(pick(*a)) or chosen[-1])
    e, t = 20, 600
    logits = make_logits(t, e, "normal", block, dtype)
    if misaligned:  # the same values at a storage offset of one element
        logits = torch.cat([logits.new_zeros(1), logits.flatten()])[1:].view(t, e)
    bias = torch.linspace(-0.1, 0.1, e)
    check_router(rt, logits, 4, "idx32", bias=bias, qb_mode="two_kernel", num_bins=61)
    launches = [x for x in rt.launches if x[0] == "amdqb_qb_hist"]
    assert launches[-1][2] == block
    assert launches[-1][1][0] == -(-e // epb), "expert groups"
    if per_cu == 0:
        assert launches[-1][1][1] == 1, "one token slice"
    assert chosen == [1 if misaligned else vec]


def _router_built_with(monkeypatch, *defines):
    """Every router module (router, scores, histogram kernels) built with extra -D defines."""
    base = _spec.router_module

    def router_module(*args):
        return base(*args).with_defines(*defines)

    monkeypatch.setattr(_spec, "router_module", router_module)


@pytest.mark.parametrize("wave", [32, 64])
def test_router_and_qb_with_the_library_exponential(monkeypatch, wave):
    """The sigmoid's e^-z comes from the hardware 2^x by default (AMDQB_SIGMOID_APPROX_EXP=1);
    built with the library expf instead (=0, the form before session 7, kept for comparisons) the
    router's routes, probs and both QB modes' histograms still match the oracle given the kernel's
    own scores, including the fused epilogue's fast bins (whose error bound the emulator
    stresses). Both forms lie within 1e-6 of torch.sigmoid."""
    rt = emu(wave)
    z = make_logits(64, 64, "normal", 1) * 8
    approx = _ops.score_values(rt, z, "sigmoid")
    _router_built_with(monkeypatch, ("AMDQB_SIGMOID_APPROX_EXP", "0"))
    library = _ops.score_values(rt, z, "sigmoid")
    # the variant is built (2^(z * log2 e) rounds differently from expf somewhere)
    assert not torch.equal(library, approx)
    for s in (approx, library):
        torch.testing.assert_close(s, torch.sigmoid(z), atol=1e-6, rtol=0)
    for e, t, k, style in ((257, 19, 16, "normal"), (896, 6, 8, "nan_inf"), (64, 30, 4, "ties")):
        logits = make_logits(t, e, style, e + k)
        bias = torch.linspace(-0.1, 0.1, e) if style != "ties" else torch.zeros(e)
        check_router(rt, logits, k, "bytemap", bias=bias)
        hists = [
            check_router(rt, logits, k, "idx32", bias=bias, qb_mode=m, num_bins=97)
            for m in ("two_kernel", "fused_atomic")
        ]
        assert torch.equal(hists[0], hists[1])


@pytest.mark.parametrize("reverse", ["1", "0"])
def test_qb_two_kernel_histogram_accumulates(monkeypatch, reverse):
    """One token slice per expert group (the default): every bin is flushed by one block; the
    histogram accumulates onto the existing counts; tokens walked last to first (the default,
    AMDQB_QB_HIST_REVERSE) or first to last give the oracle's counts."""
    rt = emu()
    _router_built_with(monkeypatch, ("AMDQB_QB_HIST_REVERSE", reverse))
    e, t = 20, 300
    logits = make_logits(t, e, "normal", 7, torch.float32)
    bias = torch.linspace(-0.1, 0.1, e)
    once = check_router(rt, logits, 4, "idx32", bias=bias, qb_mode="two_kernel", num_bins=61)
    launches = [x for x in rt.launches if x[0] == "amdqb_qb_hist"]
    assert launches[-1][1][:2] == (3, 1), "3 expert groups, one token slice"
    assert rt.dependent_launches[-1:] == ["amdqb_qb_hist"], "launched as the router's dependent"
    # a second call adds onto the first call's counts
    probs, rmap, kind, hist, bounds = run_router(
        rt, logits, 4, "idx32", "sigmoid", bias, "two_kernel", num_bins=61, hist=once.clone()
    )
    assert torch.equal(hist, 2 * once)


@pytest.mark.parametrize("wave", [32, 64])
@pytest.mark.parametrize("style", ["normal", "ties", "nan_inf", "overflow", "zeros"])
def test_router_styles_both_wave_sizes(wave, style):
    rt = emu(wave)
    e, t = 257, 19
    logits = make_logits(t, e, style, 5)
    bias = (torch.randn(e, generator=torch.Generator().manual_seed(1)) * 0.05).float()
    if style in ("ties", "zeros", "overflow"):
        bias = torch.zeros(e)  # keep the logits' exact ties
    before = overflows(rt)
    check_router(rt, logits, 16, "idx32", bias=bias)
    if style == "overflow":
        assert overflows(rt) > before, "the candidate-overflow (exact) path did not run"
    h = [
        check_router(rt, logits, 16, "bitmap", bias=bias, qb_mode=m, num_bins=64)
        for m in ("two_kernel", "fused_atomic")
    ]
    assert torch.equal(h[0], h[1])


@pytest.mark.parametrize("k,qb", [(33, False), (40, True), (63, True), (64, False)])
def test_router_exact_path_large_k(k, qb):
    rt = emu(64)
    e = 896
    logits = make_logits(9, e, "ties", k)
    bias = torch.zeros(e)
    check_router(rt, logits, k, "idx64", bias=bias, qb_mode="fused_atomic" if qb else None)


@pytest.mark.parametrize("e", [1, 2, 3, 31, 32, 33, 64, 65])
def test_router_small_expert_counts(e):
    rt = emu()
    logits = make_logits(13, e, "normal", e)
    for k in sorted({1, max(1, e // 2), min(e, _ops.MAX_SELECT)}):
        check_router(rt, logits, k, "bitmap")
        if k < e and k + 1 <= _ops.MAX_SELECT:
            bias = torch.randn(e) * 0.1
            check_router(rt, logits, k, "idx16", bias=bias, qb_mode="two_kernel", num_bins=7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_router_half_dtypes(dtype):
    rt = emu()
    e = 129
    logits = make_logits(17, e, "normal", 3, dtype)
    bias = torch.randn(e) * 0.05
    check_router(rt, logits, 6, "bytemap", bias=bias, scaling=2.5)
    check_router(rt, logits, 6, "idx32", bias=bias, qb_mode="fused_atomic", num_bins=100)


@pytest.mark.parametrize(
    "score,pre", [("sqrtsoftplus", False), ("softmax", True), ("softmax", False)]
)
def test_router_score_functions(score, pre):
    rt = emu()
    e = 200
    logits = make_logits(11, e, "normal", 9) * 3
    bias = torch.randn(e) * 0.05 if score == "sqrtsoftplus" else None
    for k in (1, 5):
        check_router(rt, logits, k, "idx32", score=score, bias=bias, pre=pre, scaling=1.5)


def test_qb_histogram_bin_edges_and_clamping():
    # TE's conformance vector: tie at the cutoff drops the largest id; both ends clamp.
    rt = emu()
    logits = torch.tensor(
        [[3, 3, 3, -1, -2, -3, -4, -5], [5, 4, 3, 2, -2, -3, -4, -5]], dtype=torch.float32
    )
    bias = torch.zeros(8)
    for mode in ("two_kernel", "fused_atomic"):
        hist = torch.zeros(8, 8, dtype=torch.int32)
        bounds = torch.tensor([-0.05, 0.05])
        rmap = torch.empty(2, 8, dtype=torch.bool)
        _ops.router_fwd(
            rt,
            logits,
            2,
            "sigmoid",
            False,
            None,
            None,
            None,
            bias,
            torch.empty(2, 8),
            rmap,
            "bytemap",
            hist,
            bounds,
            mode,
        )
        assert rmap[0, :3].tolist() == [True, True, False]
        assert hist[:, 0].sum() > 0 and hist[:, -1].sum() > 0
        s = _ops.score_values(rt, logits, "sigmoid")
        _, alpha = qb_cutoff_and_routes(s, bias, 2)
        assert torch.equal(hist, qb_histogram_counts(s, alpha, bounds, 8))


@pytest.mark.parametrize("score", ["sigmoid", "softmax", "sqrtsoftplus"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_biased_topk(score, renormalize):
    rt = emu()
    e, t, k = 384, 10, 8
    logits = make_logits(t, e, "normal", 4)
    bias = None if score == "softmax" else torch.randn(e) * 0.05
    w = torch.empty(t, k)
    ids = torch.empty(t, k, dtype=torch.int32)
    _ops.biased_topk(rt, logits, k, bias, score, renormalize, 0.5, None, None, w, ids)
    s = _ops.score_values(rt, logits, score)
    sel = s if bias is None else s + bias
    want_ids = ref.ordering.ranked_indices(sel, k).to(torch.int32)
    assert torch.equal(ids, want_ids)
    want_w, _ = ref.biased_topk(logits, k, bias, score, renormalize, 0.5)
    torch.testing.assert_close(w, want_w, atol=1e-6, rtol=1e-4)
    gathered = s.gather(1, ids.long())
    if renormalize:
        gathered = gathered / (gathered.sum(-1, keepdim=True) + 1e-20)
    torch.testing.assert_close(w, gathered * 0.5, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize(
    "e,k,style",
    [
        (64, 8, "ties"),  # one warp: its list is the answer
        (300, 33, "normal"),  # 3 warps, partial last row, n > 32 (exact n-th per warp)
        (300, 4, "nan_inf"),
        (896, 16, "ties"),  # the SPEC shape: 8 warps of 4 experts per thread, 128 padding slots
        (1100, 16, "saturated"),  # 8 warps, 5 experts per thread, partial
    ],
)
@pytest.mark.parametrize("wave", [32, 64])
def test_biased_topk_decode_kernel_is_bitwise_the_warp_kernel(monkeypatch, wave, e, k, style):
    """amdqb_router_decode (one block per token) against amdqb_router's serving form (one warp per
    token): identical ids and identical weight bits, with and without bias and renormalisation,
    on wave32 and wave64 (even warp counts: whole 64-lane waves)."""
    rt = emu(wave)
    t = 3
    logits = make_logits(t, e, style, e + k)
    g = torch.Generator().manual_seed(e)
    for bias in (None, (torch.randint(-2, 3, (e,), generator=g) * 0.25).float()):
        for renorm in (True, False):
            got, want = [], []
            for limit, out in ((1 << 30, got), (0, want)):
                monkeypatch.setattr(_ops, "DECODE_MAX_TOKENS", limit)
                w = torch.full((t, k), -1.0)
                ids = torch.full((t, k), -1, dtype=torch.int32)
                _ops.biased_topk(rt, logits, k, bias, "sigmoid", renorm, 0.75, None, None, w, ids)
                out += [w, ids]
            names = [n for n, *_ in rt.launches[-2:]]
            assert names == ["amdqb_router_decode", "amdqb_router"]
            assert torch.equal(got[1], want[1])
            assert torch.equal(got[0].view(torch.int32), want[0].view(torch.int32))
            sel = _ops.score_values(rt, logits, "sigmoid")
            sel = sel if bias is None else sel + bias
            assert torch.equal(got[1], ref.ordering.ranked_indices(sel, k).to(torch.int32))


@pytest.mark.parametrize("wave", [32, 64])
@pytest.mark.parametrize(
    "e,k,style,dtype",
    [
        (896, 16, "ties", torch.float32),  # nsel 17: merge tree of 32-entry lists
        (300, 8, "nan_inf", torch.bfloat16),
        (64, 5, "normal", torch.float16),  # one warp
        (1100, 33, "saturated", torch.float32),  # nsel 34 > 32: the merge by rank
    ],
)
def test_router_decode_kernel_is_bitwise_the_warp_kernel(monkeypatch, wave, e, k, style, dtype):
    """amdqb_router_decode (one block per token) against amdqb_router (one warp per token): the
    same probs bits, routing maps of every format and QB outputs (cutoff-driven histograms of both
    modes), with and without bias."""
    rt = emu(wave)
    t = 3
    logits = make_logits(t, e, style, e + k, dtype)
    g = torch.Generator().manual_seed(e)
    bias = (torch.randint(-2, 3, (e,), generator=g) * 0.125).float()
    cases = [("bytemap", None, None), ("bitmap", bias, "fused_atomic")]
    cases += [("idx16", bias, "two_kernel"), ("idx32", None, None), ("idx64", bias, None)]
    for fmt, b, qb in cases:
        outs = {}
        for form, limit in (("block", 1 << 30), ("warp", 0)):
            monkeypatch.setattr(_ops, "ROUTER_DECODE_MAX_TOKENS", limit)
            monkeypatch.setattr(_ops, "ROUTER_DECODE_FUSED_MAX_TOKENS", limit)
            rt.launches.clear()
            qb_bias = bias if qb is not None else b
            probs, rmap, _, hist, _ = run_router(
                rt, logits, k, fmt, bias=qb_bias, qb_mode=qb, num_bins=37, scaling=1.5
            )
            names = [n for n, *_ in rt.launches]
            assert ("amdqb_router_decode" if form == "block" else "amdqb_router") in names, form
            outs[form] = (probs, rmap, hist)
        (p1, m1, h1), (p2, m2, h2) = outs["block"], outs["warp"]
        assert torch.equal(
            p1.view(torch.int16 if dtype != torch.float32 else torch.int32),
            p2.view(torch.int16 if dtype != torch.float32 else torch.int32),
        ), fmt
        assert torch.equal(m1, m2), fmt
        assert (h1 is None) == (h2 is None) and (h1 is None or torch.equal(h1, h2)), fmt


def test_score_values_match_torch_closely():
    rt = emu()
    logits = make_logits(5, 96, "normal", 0) * 4
    for score in ("sigmoid", "sqrtsoftplus", "softmax"):
        s = _ops.score_values(rt, logits, score)
        want = ref.router.activation(logits, score)
        torch.testing.assert_close(s, want, atol=1e-6, rtol=1e-5)
