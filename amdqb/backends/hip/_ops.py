"""Launchers of the ``hip`` backend's kernel-level ops (signatures of ``amdqb.backends``).

Every launcher takes a runtime ``rt`` (``kernel(device_index, spec, name)``, ``launch(kernel, grid,
block, smem, args)``, ``num_cus(device_index)``, ``smem_budget(device_index)``): the GPU runtime of
``_runtime`` in production, the host emulator of ``op_tests/hip_emu`` in the CPU tests. Scratch
tensors come from torch's caching allocator on the inputs' device (graph-safe); nothing syncs.
"""

from __future__ import annotations

import torch

from . import _spec
from ._spec import arg_f32, arg_i32, arg_i64, arg_ptr

# Limits of this backend (``unsupported`` declines beyond them; the next backend runs the op).
MAX_ROUTER_EXPERTS = 4096  # experts per lane live in registers (spills beyond ~2048)
MAX_SELECT = _spec.ROUTER_CAP  # Top-n with n = k (k + 1 under QB)
MAX_QB_BINS = 12288  # one LDS histogram row of the two-kernel mode within 48 KiB
MAX_DET_EXPERTS = 12288  # deterministic route kernels keep E ints in LDS
MAX_ALIGN_EXPERTS = 4096  # the align rank kernel keeps (warps + 1) * E + DET_TILE ints in LDS
_STATIC_LDS_LIMIT = 48 * 1024  # dynamic + static LDS of a launch without an opt-in

_MAP_KINDS = {"bytemap": 1, "bitmap": 2}
_INDEX_KINDS = {torch.int16: 3, torch.int32: 4, torch.int64: 5}
_QB_MODES = {None: 0, "fused_atomic": 1, "two_kernel": 2}
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _ptr(t) -> object:
    return arg_ptr(None if t is None else t.data_ptr())


def _dev(t: torch.Tensor) -> int:
    return t.device.index if t.device.type == "cuda" else -1


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _id_suffix(topk_ids) -> str:
    """Kernel-name suffix of the route kernels instantiated for the ids' dtype."""
    return "i32" if topk_ids.dtype == torch.int32 else "i64"


# ------------------------------------------------------------------------------------------------
# Route rows
# ------------------------------------------------------------------------------------------------
# Passes 2 and 3 of the deterministic kernels (scan; rank or align rank) may be launched as
# dependents of the pass before (runtime.launch_dependent: NVIDIA's programmatic dependent launch,
# an ordinary launch elsewhere): they start during the previous pass's tail, the rank passes load
# their ids before they wait for the scan. The rank pass only while its tiles fill at most half of
# the CUs: its blocks are then placed while the scan still runs, and with a tile per CU some CUs
# got two (the serial ranking walk doubled). H200, moe_align_block_size E=896 k=16 block 64, rank
# pass dependent / ordinary (bench/results/h200_2026-11-30_s7/call7/tune.md): 9.4 / 11.0 us at
# M=2517 (40 tiles), 15.2 / 11.6 at M=8192 (128 tiles); the scan as a dependent changed nothing
# measurable (histogram + scan 4.95 vs 4.93 us at M=8192).
DET_DEPENDENT_LAUNCH = True


def _det_launch(rt, tiles=None, dev=None):
    """The launch of a scan (``tiles`` None) or rank pass (over ``tiles`` tiles)."""
    if not DET_DEPENDENT_LAUNCH or (tiles is not None and 2 * tiles > rt.num_cus(dev)):
        return rt.launch
    return rt.launch_dependent


def _tile_slot_bases(rt, topk_ids, num_experts, start, totals, fill=None):
    """Passes 1-2 of the deterministic kernels: per-tile histograms, then each tile's first slot
    per expert (exclusive scan over the tiles from ``start``, or 0; ``totals`` gets the ends).
    ``fill=(buffer, value)``: pass 1 also writes ``value`` over ``buffer``. Returns
    ``(tiles, tile_slots int32 [tiles * E])``."""
    n = topk_ids.numel()
    dev = _dev(topk_ids)
    suffix = _id_suffix(topk_ids)
    e_arg = arg_i32(num_experts)
    tiles = _cdiv(n, _spec.DET_TILE)
    tile_counts = torch.empty(tiles * num_experts, dtype=torch.int32, device=topk_ids.device)
    fill_args = (
        [_ptr(None), arg_i64(0), arg_i32(0)]
        if fill is None
        else [_ptr(fill[0]), arg_i64(fill[0].numel()), arg_i32(fill[1])]
    )
    k = rt.kernel(dev, _spec.ROUTE_MODULE, f"amdqb_route_det_hist_{suffix}")
    rt.launch(
        k,
        tiles,
        256,
        4 * num_experts,
        [_ptr(topk_ids), arg_i64(n), e_arg, _ptr(tile_counts), *fill_args],
    )
    k = rt.kernel(dev, _spec.ROUTE_MODULE, "amdqb_route_det_scan")
    _det_launch(rt)(
        k,
        _cdiv(num_experts, _spec.SCAN_EXPERTS),
        256,
        0,
        [arg_i32(tiles), e_arg, _ptr(tile_counts), _ptr(start), _ptr(totals)],
    )
    return tiles, tile_counts


def route_rows(
    rt, topk_ids, num_experts, capacity, counters, rows_out, counts_out, deterministic, impl
):
    n = topk_ids.numel()
    if n == 0:
        return  # counts_out arrives zero-filled; counters and rows are unchanged / empty
    dev = _dev(topk_ids)
    spec = _spec.ROUTE_MODULE
    suffix = _id_suffix(topk_ids)
    cap = -1 if capacity is None else int(capacity)
    e_arg = arg_i32(num_experts)
    ids, n_arg = _ptr(topk_ids), arg_i64(n)
    lds = impl == "lds" and not deterministic
    # counts: the lds kernel adds them up itself; the others derive them from the counter delta
    before = None if lds else counters.clone()
    if deterministic:
        tiles, tile_counts = _tile_slot_bases(rt, topk_ids, num_experts, counters, counters)
        k = rt.kernel(dev, spec, f"amdqb_route_det_rank_{suffix}")
        _det_launch(rt, tiles, dev)(
            k,
            tiles,
            32,
            4 * num_experts,
            [ids, n_arg, e_arg, arg_i32(cap), _ptr(tile_counts), _ptr(rows_out)],
        )
    elif lds:
        tile = _spec.ROUTE_BLOCK * _spec.ROUTE_ITEMS
        k = rt.kernel(dev, spec, f"amdqb_route_lds_{suffix}")
        rt.launch(
            k,
            _cdiv(n, tile),
            _spec.ROUTE_BLOCK,
            4 * num_experts,
            [ids, n_arg, e_arg, arg_i32(cap), _ptr(counters), _ptr(counts_out), _ptr(rows_out)],
        )
    else:
        grid = min(_cdiv(n, 256), rt.num_cus(dev) * 16)
        k = rt.kernel(dev, spec, f"amdqb_route_atomic_{suffix}")
        rt.launch(
            k, grid, 256, 0, [ids, n_arg, e_arg, arg_i32(cap), _ptr(counters), _ptr(rows_out)]
        )
    if capacity is not None and lds:
        return  # masked lds: rows and counts are complete
    offsets = None
    if capacity is None:
        offsets = torch.empty(num_experts, dtype=torch.int32, device=topk_ids.device)
    k = rt.kernel(dev, spec, "amdqb_route_finalize")
    if offsets is None:  # masked layout: counts only, elementwise over a grid
        grid, block = max(1, _cdiv(num_experts, 256)), 256
    else:  # compact layout: one block scans the counters into offsets
        grid, block = 1, 1024 if num_experts > 4096 else 256
    rt.launch(
        k,
        grid,
        block,
        0,
        [e_arg, arg_i32(cap), _ptr(before), _ptr(counters), _ptr(counts_out), _ptr(offsets)],
    )
    if capacity is None:
        grid = min(_cdiv(n, 256), rt.num_cus(dev) * 16)
        k = rt.kernel(dev, spec, f"amdqb_route_compact_{suffix}")
        rt.launch(
            k, grid, 256, 0, [_ptr(topk_ids), arg_i64(n), e_arg, _ptr(offsets), _ptr(rows_out)]
        )


def align_warps(num_experts: int) -> int:
    """Logical warps per tile of the align rank kernel: the most (<= 8, a power of two) whose
    per-warp slot rows fit the LDS of a launch without an opt-in."""
    warps = 8
    while warps > 1 and align_smem(num_experts, warps) + 128 > _STATIC_LDS_LIMIT:
        warps //= 2
    return warps


def align_smem(num_experts: int, warps: int) -> int:
    """Dynamic LDS bytes of the align rank kernel: starts, per-warp slots, the tile's experts."""
    return 4 * ((warps + 1) * num_experts + _spec.DET_TILE)


def align_block_size(
    rt, topk_ids, block_size, num_experts, sorted_ids_out, expert_ids_out, num_post_pad_out
):
    n = topk_ids.numel()
    if n == 0:
        sorted_ids_out.fill_(0)  # the sentinel is numel = 0
        expert_ids_out.zero_()
        num_post_pad_out.zero_()
        return
    if num_experts > MAX_ALIGN_EXPERTS:
        raise ValueError(
            f"hip align supports num_experts <= {MAX_ALIGN_EXPERTS}, got {num_experts}"
        )
    dev = _dev(topk_ids)
    spec = _spec.ROUTE_MODULE
    suffix = _id_suffix(topk_ids)
    ids, n_arg, e_arg = _ptr(topk_ids), arg_i64(n), arg_i32(num_experts)
    totals = torch.empty(num_experts, dtype=torch.int32, device=topk_ids.device)
    tiles, tile_counts = _tile_slot_bases(
        rt, topk_ids, num_experts, None, totals, fill=(sorted_ids_out, n)
    )
    warps = align_warps(num_experts)
    k = rt.kernel(dev, spec, f"amdqb_align_rank_{suffix}")
    _det_launch(rt, tiles, dev)(
        k,
        tiles,
        32 * warps,
        align_smem(num_experts, warps),
        [
            ids,
            n_arg,
            e_arg,
            arg_i32(block_size),
            _ptr(tile_counts),
            _ptr(totals),
            _ptr(sorted_ids_out),
            _ptr(expert_ids_out),
            arg_i32(expert_ids_out.numel()),
            _ptr(num_post_pad_out),
        ],
    )


# ------------------------------------------------------------------------------------------------
# Routers
# ------------------------------------------------------------------------------------------------
# The router's register cap at few tokens (NVIDIA; AMD's launch bounds do not cap registers by
# blocks per CU). For 256 < E <= 1024 router.hip asks for 3 resident blocks per SM, which makes
# ptxas spill a few words; up to ROUTER_FEW_TOKENS tokens the grid has little use for a third
# block and the build for 2 blocks (no spill) is faster. H200, E=896 k=16, graph replay, cap 2 /
# cap 3 (bench/results/h200_2026-11-30_s7/call2/tune.md): no QB 7.59 / 7.80 us at T=1024, 15.97 /
# 16.80 at 4096, 34.43 / 34.53 at 8192, 62.54 / 57.99 at 16384; QB two-kernel 12.88 / 13.22,
# 26.78 / 27.39, 52.28 / 51.28, 96.33 / 92.89. Both builds compute the same bits.
ROUTER_FEW_TOKENS = 4096
ROUTER_FEW_TOKENS_MIN_BLOCKS = 2


def _router_spec(logits, score_function, rt=None, tokens=None):
    spec = _spec.router_module(logits.shape[1], _DTYPE_NAMES[logits.dtype], score_function)
    if (
        tokens is not None
        and tokens <= ROUTER_FEW_TOKENS
        and 256 < logits.shape[1] <= 1024
        and getattr(rt, "caps_registers_by_blocks", False)
        and all(name != "AMDQB_ROUTER_MIN_BLOCKS" for name, _ in spec.defines)  # tuner builds
    ):
        spec = spec.with_defines(("AMDQB_ROUTER_MIN_BLOCKS", str(ROUTER_FEW_TOKENS_MIN_BLOCKS)))
    return spec


def _router_grid(rt, kernel, dev, tokens):
    # Persistent warps: one wave of resident blocks (as many per CU as registers and LDS allow, so
    # no second, partial wave), each warp looping over tokens; runtimes without an occupancy query
    # (the CPU emulator) assume two.
    query = getattr(rt, "blocks_per_cu", None)
    per_cu = _spec.FALLBACK_BLOCKS_PER_CU if query is None else query(kernel, _spec.ROUTER_BLOCK, 0)
    return max(1, min(_cdiv(tokens, _spec.ROUTER_WARPS), rt.num_cus(dev) * per_cu))


# qb_histogram_mode="auto" takes the fused epilogue up to this many (token, expert) bin updates.
AUTO_FUSED_MAX_UPDATES = 512 * 896


def auto_qb_mode(tokens: int, num_experts: int) -> str:
    """``qb_histogram_mode="auto"``: fused atomics while T*E is small, LDS-privatised two-kernel
    histograms beyond. Measured on an H200 (E=896 k=16, graph replay; the fused mode in its
    block-per-token form up to T=1024), fused / two-kernel: 5.1/10.1 us at T=64, 7.2/11.1 at 256,
    10.4/13.8 at 512 (bench/results/h200_2026-11-30_s6/call2/tune.md); with the histogram pass
    as committed, 7.1/8.8 at 256, 16.7/11.7 at 1024, 59.3/23.9 at 4096
    (bench/results/h200_2026-11-30_s7/call6/bench.md); tune decode (call7): 4.7/7.9 at 64,
    6.9/8.8 at 256, 10.2/11.2 at 512, 17.8/11.8 at 1024."""
    return "fused_atomic" if tokens * num_experts <= AUTO_FUSED_MAX_UPDATES else "two_kernel"


def _check_selection(topk: int, nsel: int, num_experts: int) -> None:
    """The kernels' limits (the op validated the arguments; these guard direct calls)."""
    if not 1 <= topk <= nsel <= min(MAX_SELECT, num_experts):
        raise ValueError(
            f"hip router selects 1 <= topk <= n <= min({MAX_SELECT}, E={num_experts}), "
            f"got topk={topk}, n={nsel}"
        )
    if num_experts > MAX_ROUTER_EXPERTS:
        raise ValueError(f"hip router supports E <= {MAX_ROUTER_EXPERTS}, got {num_experts}")


def _launch_router(
    rt,
    logits,
    score_function,
    expert_bias,
    topk,
    nsel,
    normalize,
    softmax_pre,
    scale,
    probs,
    map_out,
    map_kind,
    qb_mode,
    hist,
    bounds,
    num_bins,
    alpha,
    w_out,
    id_out,
    decode_max_tokens=0,
):
    """amdqb_router (one warp per token), or its decode form amdqb_router_decode (one block per
    token) for element-wise scores and at most ``decode_max_tokens`` tokens; same outputs, bit
    for bit. Returns the module spec it launched from (the QB histogram pass comes from it too)."""
    tokens, num_experts = logits.shape
    _check_selection(topk, nsel, num_experts)
    dev = _dev(logits)
    spec = _router_spec(logits, score_function, rt, tokens)
    args = [
        _ptr(logits),
        arg_i32(tokens),
        _ptr(expert_bias),
        arg_i32(topk),
        arg_i32(nsel),
        arg_i32(1 if normalize else 0),
        arg_i32(1 if softmax_pre else 0),
        arg_f32(scale),
        _ptr(probs),
        _ptr(map_out),
        arg_i32(map_kind),
        arg_i32(qb_mode),
        _ptr(hist),
        _ptr(bounds),
        arg_i32(num_bins),
        _ptr(alpha),
        _ptr(w_out),
        _ptr(id_out),
    ]
    if score_function != "softmax" and tokens <= decode_max_tokens:
        k = rt.kernel(dev, spec, "amdqb_router_decode")
        rt.launch(k, tokens, decode_threads(num_experts), 0, args)
    else:
        k = rt.kernel(dev, spec, "amdqb_router")
        rt.launch(k, _router_grid(rt, k, dev, tokens), _spec.ROUTER_BLOCK, 0, args)
    return spec


# Launch shape of the two-kernel histogram pass: threads per block, the most experts per block
# (one LDS histogram row of B bins each), and blocks per CU the token slices aim for (0: one token
# slice). Every block zeroes and flushes its [experts, B] LDS histogram (one global atomic per
# non-zero bin), so fewer, larger blocks flush less; more blocks keep more loads in flight.
# bench/tune_router_occupancy.py (part qbhist) sweeps them; the defaults are its measurements on the
# H200 (QB two-kernel end to end, E=896 k=16 B=1000, 8 experts per block): one token slice against
# two, 11.7 / 14.1 us at T=1024, 24.0 / 27.0 at 4096, 48.3 / 53.0 at 8192, 85.2 / 91.0 at 16384
# with the pass as committed (bench/results/h200_2026-11-30_s7/call4/tune.md; 512 threads, two
# slices: 11.8 / 24.7 / 49.2 / 86.7); before its register cap was lifted, 14.3 / 15.5, 28.1 /
# 29.6, 53.2 / 52.9, 96.0 / 96.5 (call1); 4 experts per block (224 groups) 13.4 / 30.8 /
# 55.3 / 100.8 against 8: 13.2 / 26.9 / 51.3 / 93.1 (call2); earlier (s6/call2) at T=16384: 256
# threads x 4 blocks per CU x 1 expert per load 124.0, 256x4x4 114.6, 512x2x4 111.6, 1024x1x1
# 111.5, 1024x1x4 108.2, 1024x2x4 115.6 us.
QB_HIST_BLOCK = 1024
QB_HIST_MAX_EXPERTS_PER_BLOCK = 8
QB_HIST_BLOCKS_PER_CU = 0


def qb_hist_config(num_experts: int, num_bins: int, tokens: int, smem_budget: int, cus: int):
    """(experts_per_block, token_slices, tokens_per_slice) of the two-kernel histogram."""
    if num_bins * 4 > smem_budget:
        raise ValueError(f"num_bins={num_bins} does not fit one LDS histogram row")
    epb = QB_HIST_MAX_EXPERTS_PER_BLOCK
    while epb > 1 and epb * num_bins * 4 > smem_budget:
        epb //= 2
    gx = _cdiv(num_experts, epb)
    slices = max(1, min(_cdiv(QB_HIST_BLOCKS_PER_CU * cus, gx), _cdiv(tokens, 256)))
    per = _cdiv(tokens, slices)
    return epb, _cdiv(tokens, per), per


# The histogram pass is launched as the router's dependent (runtime.launch_dependent: NVIDIA's
# programmatic dependent launch, an ordinary launch elsewhere), so that its blocks start and zero
# their LDS histograms while the router's last tokens finish: 11.8 / 24.2 / 85.4 us against 12.7 /
# 25.0 / 85.5 for QB two-kernel at T = 1024 / 4096 / 16384 on the H200 (call4/tune.md).
QB_HIST_DEPENDENT_LAUNCH = True
# Experts per thread of the histogram pass (one vector load of 4 logits) where E, the experts per
# block and the logits' alignment allow it; 1 otherwise.
QB_HIST_VEC = 4


def _qb_hist_vec(logits, epb: int) -> int:
    """QB_HIST_VEC where the histogram pass may read 4 experts with one vector load."""
    vec = QB_HIST_VEC
    aligned = logits.data_ptr() % (vec * logits.element_size()) == 0
    return vec if vec > 1 and logits.shape[1] % vec == 0 and epb % vec == 0 and aligned else 1


def router_fwd(
    rt,
    logits,
    topk,
    score_function,
    use_pre_softmax,
    num_groups,
    group_topk,
    scaling_factor,
    expert_bias,
    probs_out,
    map_out,
    map_kind,
    qb_histogram,
    qb_bin_bounds,
    qb_mode,
):
    if num_groups is not None:
        raise NotImplementedError("hip router: grouped Top-k is declined via unsupported()")
    tokens, num_experts = logits.shape
    if tokens == 0:
        return
    qb = qb_histogram is not None
    if qb and score_function != "sigmoid":  # the op refuses it; this guards direct calls
        raise ValueError(f"hip router: QB supports sigmoid only, got {score_function!r}")
    if qb and qb_mode == "auto":
        qb_mode = auto_qb_mode(tokens, num_experts)
    if qb and not qb_bin_bounds.is_contiguous():  # the kernels read bounds[0], bounds[1]
        qb_bin_bounds = qb_bin_bounds.contiguous()
    kind = _INDEX_KINDS[map_out.dtype] if map_kind == "indices" else _MAP_KINDS[map_kind]
    softmax = score_function == "softmax"
    num_bins = qb_histogram.shape[1] if qb else 0
    alpha = None
    if qb and qb_mode == "two_kernel":  # the router's cutoff alpha of every token
        alpha = torch.empty(tokens, dtype=torch.float32, device=logits.device)
    spec = _launch_router(
        rt,
        logits,
        score_function,
        expert_bias,
        topk,
        topk + 1 if qb else topk,
        normalize=(not softmax) and topk > 1,
        softmax_pre=softmax and bool(use_pre_softmax),
        scale=1.0 if scaling_factor is None else scaling_factor,
        probs=probs_out,
        map_out=map_out,
        map_kind=kind,
        qb_mode=_QB_MODES[qb_mode if qb else None],
        hist=qb_histogram,
        bounds=qb_bin_bounds,
        num_bins=num_bins,
        alpha=alpha,
        w_out=None,
        id_out=None,
        decode_max_tokens=(
            ROUTER_DECODE_FUSED_MAX_TOKENS
            if qb_mode == "fused_atomic" and qb
            else ROUTER_DECODE_MAX_TOKENS
        ),
    )
    if alpha is not None:
        dev = _dev(logits)
        epb, slices, per = qb_hist_config(
            num_experts, num_bins, tokens, rt.smem_budget(dev), rt.num_cus(dev)
        )
        k = rt.kernel(dev, spec, "amdqb_qb_hist")
        launch = rt.launch_dependent if QB_HIST_DEPENDENT_LAUNCH else rt.launch
        launch(
            k,
            (_cdiv(num_experts, epb), slices),
            QB_HIST_BLOCK,
            4 * epb * num_bins,
            [
                _ptr(logits),
                arg_i32(tokens),
                _ptr(alpha),
                _ptr(qb_bin_bounds),
                arg_i32(num_bins),
                arg_i32(epb),
                arg_i32(per),
                arg_i32(_qb_hist_vec(logits, epb)),
                _ptr(qb_histogram),
            ],
        )


# Largest token count biased_topk runs with one block per token (amdqb_router_decode); beyond it
# the router's warp-per-token kernel. H200, 2026-11-30 (tune decode sweep,
# bench/results/h200_2026-11-30_s6/call2/tune.md, E=896 k=16, graph replay): block / warp per
# token = 3.9/6.0, 4.1/6.9, 4.5/7.6, 6.4/7.8, 8.7/7.8, 10.2/7.9 us at T = 1, 64, 256, 512, 768,
# 1024. The dedicated biased_topk kernel this one replaced took 3.60 / 3.61 / 3.71 / 4.32 us at
# T = 1 / 8 / 64 / 256 (session 5 bench); the shared kernel 3.84 / 3.88 / 4.01 / 4.36 (session 6
# bench, call5): 0.2-0.3 us more at T <= 64, not yet traced.
DECODE_MAX_TOKENS = 512


# The same for the router (probs / routing maps / the QB cutoff). H200, 2026-11-30 (tune decode
# sweep, bench/results/h200_2026-11-30_s6/call{1,2}/tune.md, E=896 k=16, probs + byte map): block /
# warp per token = 4.3/7.6, 4.7/7.7, 6.8/8.3, 11.1/8.5, 19.5/10.8 us at T = 64, 256, 512, 1024,
# 2048 (call2; call1 agrees within 0.3 us).
ROUTER_DECODE_MAX_TOKENS = 512
# With the fused QB histogram (global atomics for every (token, expert)), whose atomics a block
# per token spreads over more warps (call2/tune.md): 5.1/12.3, 7.2/12.8, 10.4/14.9, 16.4/20.8,
# 30.4/35.9, 55.0/68.2 us at T = 64 ... 4096. auto_qb_mode leaves the fused mode before this
# (the two-kernel mode is faster from T=1024 on); an explicit fused request keeps the faster form.
ROUTER_DECODE_FUSED_MAX_TOKENS = 1024

# Experts per warp of amdqb_router_decode (AMDQB_DECODE_EPW). H200, 2026-11-29 (tune decode sweep,
# bench/results/h200_2026-11-29_s5/call6/tune.md, E=896 k=16): 7 warps (EPW 128) / 8 (EPW 64) /
# 4 (EPW 256) = 3.59 / 3.56 / 3.62 us at T=1, 4.32 / 4.33 / 4.12 us at T=256.
DECODE_EPW = 128


def decode_threads(num_experts: int) -> int:
    """Block size of amdqb_router_decode: ceil(E / DECODE_EPW) logical warps, rounded up to an even
    count (whole waves on wave64 targets), at most 8."""
    warps = _cdiv(num_experts, DECODE_EPW)
    if warps > 1:
        warps += warps & 1
    return 32 * min(8, warps)


def biased_topk(
    rt,
    logits,
    topk,
    expert_bias,
    score_function,
    renormalize,
    scaling_factor,
    num_groups,
    group_topk,
    weights_out,
    ids_out,
):
    if num_groups is not None:
        raise NotImplementedError("hip biased_topk: grouped Top-k is declined via unsupported()")
    if logits.shape[0] == 0:
        return
    _launch_router(
        rt,
        logits,
        score_function,
        expert_bias,
        topk,
        topk,
        normalize=bool(renormalize),
        softmax_pre=True,  # serving softmax: over all experts, then Top-k
        scale=1.0 if scaling_factor is None else scaling_factor,
        probs=None,
        map_out=None,
        map_kind=0,
        qb_mode=0,
        hist=None,
        bounds=None,
        num_bins=0,
        alpha=None,
        w_out=weights_out,
        id_out=ids_out,
        decode_max_tokens=DECODE_MAX_TOKENS,
    )


def score_values(rt, logits2d, score_function, extra_defines=()):
    """fp32 ``[T, E]`` scores exactly as the router kernel computes them (softmax: over E).
    ``extra_defines``: more ``(name, value)`` compile-time constants (tests build variants)."""
    tokens = logits2d.shape[0]
    out = torch.empty(logits2d.shape, dtype=torch.float32, device=logits2d.device)
    if tokens:
        dev = _dev(logits2d)
        spec = _router_spec(logits2d, score_function).with_defines(*extra_defines)
        k = rt.kernel(dev, spec, "amdqb_scores")
        rt.launch(
            k,
            _router_grid(rt, k, dev, tokens),
            _spec.ROUTER_BLOCK,
            0,
            [_ptr(logits2d), arg_i32(tokens), _ptr(out)],
        )
    return out
