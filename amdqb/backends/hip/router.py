"""hip launchers of the routers: ``router_fwd`` (TransformerEngine's fused router with its QB
histogram) and ``biased_topk`` (``hip_src/kernels/router.hip``; signatures of ``amdqb.backends``).

Precision and tie-break contract: the one of ``amdqb.ref.router`` -- fp32 math without
contraction, selection by (value descending, expert id ascending) with NaN lowest, the QB cutoff
the (k+1)-th of that order; probs rounded to the logits dtype (nearest even). Both QB histogram
modes give bitwise-identical histograms.

Kernels and when each runs:

* ``amdqb_router`` -- one row per token (a 32-lane logical warp; on wave64 AMD a whole wave), a
  persistent grid of one wave of resident blocks;
* ``amdqb_router_decode`` -- one block per token, for element-wise scores and a Top-n of at most
  ``DECODE_MAX_SELECT`` up to ``hip.router.decode_max_tokens`` tokens (``..._fused`` with the
  fused QB histogram, ``hip.biased_topk.decode_max_tokens`` for ``biased_topk``): the same outputs
  bit for bit;
* ``amdqb_qb_hist`` / ``amdqb_qb_hist_bins`` -- the second kernel of
  ``qb_histogram_mode="two_kernel"`` (uniform / log_margin binning), launched as the router's
  dependent where ``hip.qb_hist.dependent_launch`` says so; ``"fused_atomic"`` with log_margin
  binning counts in ``amdqb_router``'s LDS where the counters fit (``hip.router.margin_lds``,
  :func:`margin_lds_bytes`), with device atomics otherwise;
* ``amdqb_router_scores`` -- the scores the router ranked (``RouterCall.write_scores``), a pass
  of its own after the router, only when asked for.

Launch shapes and thresholds are the ``hip.router.*`` / ``hip.qb_hist.*`` /
``hip.biased_topk.*`` entries of the device's config (``amdqb/configs``); the module's compile-time
constants come from the same entries (``_spec.router_module``).
"""

from __future__ import annotations

import torch

from ... import configs
from ...ref.router import margin_fine_keys
from ..calls import RouterCall
from . import _spec
from ._common import cdiv, config, dev, ptr
from ._spec import arg_i32

# Capability limits (declared in LIMITS below: the dispatcher passes this backend over beyond them).
MAX_ROUTER_EXPERTS = 4096  # experts per lane live in registers (spills beyond ~2048)
MAX_QB_BINS = 12288  # one LDS histogram row of the two-kernel mode within 48 KiB
DECODE_MAX_SELECT = 32  # amdqb_router_decode's Top-n at most (router.hip DEC_CAP: a warp's list)

_MAP_KINDS = {"bytemap": 1, "bitmap": 2}
_INDEX_KINDS = {torch.int16: 3, torch.int32: 4, torch.int64: 5}
_QB_MODES = {None: 0, "fused_atomic": 1, "two_kernel": 2}
_QB_MARGIN_LDS = 3  # router.hip's kQbMarginLds: fused_atomic log_margin counted in LDS
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def max_select(cfg) -> int:
    """The largest Top-n the router selects (n = k, or k + 1 under QB)."""
    return int(cfg["hip.router.cap"])


def router_block(cfg) -> int:
    """Threads per block of amdqb_router / amdqb_router_scores: ``hip.router.warps`` logical
    warps of 32."""
    return 32 * int(cfg["hip.router.warps"])


def row_lanes(rt, device) -> int:
    """Lanes per token row of amdqb_router / amdqb_router_scores: a whole wave64 where the AMD
    branches run on a wave64 target (router.hip's ``RW``), else a 32-lane logical warp."""
    wave = getattr(rt, "amdgcn_wave_size", None)
    return 64 if wave is not None and wave(device) == 64 else 32


def router_rows(rt, cfg, device) -> int:
    """Tokens in flight per block of amdqb_router / amdqb_router_scores."""
    return router_block(cfg) // row_lanes(rt, device)


def router_spec(
    logits,
    score_function,
    cfg,
    rt=None,
    tokens=None,
    tie_free=False,
    approximate=False,
    margin_lds=False,
    moments=False,
    prefilter=False,
) -> _spec.ModuleSpec:
    """The router module for these logits. On runtimes whose launch bounds cap registers by
    resident blocks (NVIDIA), up to ``hip.router.few_tokens`` tokens and 256 < E <= 1024 it is the
    build for ``hip.router.few_tokens_min_blocks`` resident blocks (no spill: the grid has little
    use for more). Both builds compute the same bits; so does the ``prefilter`` build
    (:func:`prefilter_applies`)."""
    num_experts = logits.shape[1]
    min_blocks = None
    if (
        tokens is not None
        and tokens <= cfg["hip.router.few_tokens"]
        and 256 < num_experts <= 1024
        and getattr(rt, "caps_registers_by_blocks", False)
    ):
        min_blocks = cfg["hip.router.few_tokens_min_blocks"]
    return _spec.router_module(
        num_experts,
        _DTYPE_NAMES[logits.dtype],
        score_function,
        cfg,
        min_blocks=min_blocks,
        tie_free=tie_free,
        approximate=approximate,
        margin_lds=margin_lds,
        moments=moments,
        prefilter=prefilter,
    )


def prefilter_applies(
    cfg, rt, device, num_experts, score_function, *, tie_free, approximate, margin
) -> bool:
    """Whether amdqb_router takes the prefilter build (``hip.router.prefilter``): the exact
    sigmoid selected through the bounded approximation first, the candidates' exact keys after
    (router.hip's ``AMDQB_PREFILTER``; the same outputs). Not for the tie-free order, the
    approximate activation or log_margin binning (which bins every expert's exact key), and for
    at most 32 experts a lane (one word of slot bits)."""
    return (
        bool(cfg["hip.router.prefilter"])
        and score_function == "sigmoid"
        and not (tie_free or approximate or margin)
        and num_experts <= 32 * row_lanes(rt, device)
    )


def _router_grid(rt, cfg, kernel, device, tokens, smem=0):
    # Persistent warps: one wave of resident blocks (as many per CU as registers and LDS allow, so
    # no second, partial wave), each warp looping over tokens; runtimes without an occupancy query
    # (the CPU emulator) assume hip.fallback_blocks_per_cu.
    query = getattr(rt, "blocks_per_cu", None)
    per_cu = query(kernel, router_block(cfg), smem) if query is not None else None
    per_cu = per_cu or cfg["hip.fallback_blocks_per_cu"]
    rows = router_rows(rt, cfg, device)
    return max(1, min(cdiv(tokens, rows), rt.num_cus(device) * per_cu))


# The 8-bit LDS counters of the log_margin fused mode count at most this many tokens per block.
MARGIN_LDS_MAX_TOKENS = 255


def margin_lds_bytes(num_experts: int, num_bins: int) -> int:
    """Dynamic shared memory of amdqb_router's LDS-counted log_margin histogram: ``ceil(B/2 / 4)``
    planes of E words (router.hip's margin_lds_words)."""
    return 4 * num_experts * (((num_bins // 2) + 3) // 4)


def _margin_lds_grid(grid: int, tokens: int, rows: int) -> int:
    """At least enough blocks that none counts more than MARGIN_LDS_MAX_TOKENS tokens (a block's
    rows take ceil(T / (grid * rows)) tokens each)."""
    per_row = MARGIN_LDS_MAX_TOKENS // rows
    return max(grid, cdiv(tokens, rows * per_row))


def auto_qb_mode(tokens: int, num_experts: int, cfg, moments: bool = False) -> str:
    """``qb_histogram_mode="auto"``: fused atomics while T*E is at most
    ``hip.router.qb_auto_fused_max_updates`` (``..._moments`` with the in-bin moments, whose
    two-kernel form moves a second byte per pair), LDS-privatised two-kernel histograms beyond."""
    if moments:
        limit = cfg["hip.router.qb_auto_fused_max_updates_moments"]
    else:
        limit = cfg["hip.router.qb_auto_fused_max_updates"]
    return "fused_atomic" if tokens * num_experts <= limit else "two_kernel"


def _check_selection(topk: int, nsel: int, num_experts: int, cfg) -> None:
    """The kernels' limits (the op validated the arguments; these guard direct calls)."""
    cap = max_select(cfg)
    if not 1 <= topk <= nsel <= min(cap, num_experts):
        raise ValueError(
            f"hip router selects 1 <= topk <= n <= min({cap}, E={num_experts}), "
            f"got topk={topk}, n={nsel}"
        )
    if num_experts > MAX_ROUTER_EXPERTS:
        raise ValueError(f"hip router supports E <= {MAX_ROUTER_EXPERTS}, got {num_experts}")


def decode_threads(num_experts: int, cfg) -> int:
    """Block size of amdqb_router_decode: ceil(E / hip.router.decode_epw) logical warps, rounded
    up to an even count (whole waves on wave64 targets), at most 8 (router.hip derives the same
    from AMDQB_DECODE_EPW)."""
    warps = cdiv(num_experts, cfg["hip.router.decode_epw"])
    if warps > 1:
        warps += warps & 1
    return 32 * min(8, warps)


def _addr(t) -> int | None:
    return None if t is None else t.data_ptr()


def _launch_router(
    rt,
    cfg,
    logits,
    score_function,
    *,
    bias=None,
    topk,
    nsel,
    normalize,
    softmax_pre,
    scale,
    probs=None,
    map_out=None,
    map_kind=0,
    qb_mode=0,
    hist=None,
    bounds=None,
    num_bins=0,
    alpha=None,
    w_out=None,
    id_out=None,
    margin=False,
    moments=False,
    bins_out=None,
    decode_max_tokens=0,
    tie_free=False,
    approximate=False,
):
    """amdqb_router (one warp per token), or its decode form amdqb_router_decode (one block per
    token) for element-wise scores, a Top-n of at most ``DECODE_MAX_SELECT`` and at most
    ``decode_max_tokens`` tokens; same outputs, bit for bit. Both take one
    :class:`~._spec.RouterParams` by value. Returns the module spec it launched from (the QB
    histogram pass comes from it too)."""
    tokens, num_experts = logits.shape
    _check_selection(topk, nsel, num_experts, cfg)
    device = dev(logits)
    decode = (
        score_function != "softmax" and tokens <= decode_max_tokens and nsel <= DECODE_MAX_SELECT
    )
    # log_margin fused on amdqb_router: the bins at or above the cutoff counted in the block's LDS
    smem = margin_lds_bytes(num_experts, num_bins) if margin and qb_mode == 1 else 0
    margin_lds = (
        not decode and smem > 0 and cfg["hip.router.margin_lds"] and smem <= rt.smem_budget(device)
    )
    prefilter = not decode and prefilter_applies(
        cfg,
        rt,
        device,
        num_experts,
        score_function,
        tie_free=tie_free,
        approximate=approximate,
        margin=margin,
    )
    spec = router_spec(
        logits,
        score_function,
        cfg,
        rt,
        tokens,
        tie_free,
        approximate,
        margin_lds,
        moments,
        prefilter,
    )
    if margin_lds and smem > rt.dynamic_smem_budget(rt.kernel(device, spec, "amdqb_router")):
        # with the build's static LDS (the rows' buffers, the bias) the block would exceed the
        # budget: device atomics
        margin_lds = False
        spec = router_spec(
            logits, score_function, cfg, rt, tokens, tie_free, approximate, False, moments
        )
    params = _spec.RouterParams.of(
        logits=_addr(logits),
        bias=_addr(bias),
        probs=_addr(probs),
        map=_addr(map_out),
        hist=_addr(hist),
        bounds=_addr(bounds),
        alpha_out=_addr(alpha),
        w_out=_addr(w_out),
        id_out=_addr(id_out),
        bins_out=_addr(bins_out),
        num_tokens=tokens,
        topk=topk,
        nsel=nsel,
        normalize=1 if normalize else 0,
        softmax_pre=1 if softmax_pre else 0,
        map_kind=map_kind,
        qb_mode=qb_mode,
        num_bins=num_bins,
        qb_binning=1 if margin else 0,
        margin_fine=margin_fine_keys(num_bins) if margin else 0,
        scale=scale,
    )
    if decode:
        k = rt.kernel(device, spec, "amdqb_router_decode")
        rt.launch(k, tokens, decode_threads(num_experts, cfg), 0, [params])
    elif margin_lds:
        k = rt.kernel(device, spec, "amdqb_router")
        params.qb_mode = _QB_MARGIN_LDS
        grid = _router_grid(rt, cfg, k, device, tokens, smem)
        grid = _margin_lds_grid(grid, tokens, router_rows(rt, cfg, device))
        rt.launch(k, grid, router_block(cfg), smem, [params])
    else:
        k = rt.kernel(device, spec, "amdqb_router")
        rt.launch(k, _router_grid(rt, cfg, k, device, tokens), router_block(cfg), 0, [params])
    return spec


def qb_hist_config(
    num_experts: int, num_bins: int, tokens: int, smem_budget: int, cus: int, cfg
) -> tuple[int, int, int]:
    """(experts_per_block, token_slices, tokens_per_slice) of the two-kernel histogram pass.
    Every block zeroes and flushes its [experts, B] LDS histogram (one global atomic per non-zero
    bin), so fewer, larger blocks flush less; more blocks keep more loads in flight."""
    if num_bins * 4 > smem_budget:
        raise ValueError(f"num_bins={num_bins} does not fit one LDS histogram row")
    epb = cfg["hip.qb_hist.max_experts_per_block"]
    while epb > 1 and epb * num_bins * 4 > smem_budget:
        epb //= 2
    gx = cdiv(num_experts, epb)
    slices = max(1, min(cdiv(cfg["hip.qb_hist.blocks_per_cu"] * cus, gx), cdiv(tokens, 256)))
    per = cdiv(tokens, slices)
    return epb, cdiv(tokens, per), per


def qb_hist_vec(logits, epb: int, cfg) -> int:
    """``hip.qb_hist.vec`` (4) where the histogram pass may read 4 experts with one vector load:
    E and the experts per block multiples of it and the logits aligned to it; 1 otherwise."""
    vec = cfg["hip.qb_hist.vec"]
    aligned = logits.data_ptr() % (vec * logits.element_size()) == 0
    return vec if vec > 1 and logits.shape[1] % vec == 0 and epb % vec == 0 and aligned else 1


def router_fwd(
    rt,
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
    call.check_forward(logits, qb_histogram)
    if call.grouped:
        raise NotImplementedError("hip router: grouped Top-k is a declared capability limit")
    tokens, num_experts = logits.shape
    if tokens == 0:
        return
    cfg = config(logits)
    qb = call.qb
    if qb and call.score_function != "sigmoid":  # the op refuses it; this guards direct calls
        raise ValueError(f"hip router: QB supports sigmoid only, got {call.score_function!r}")
    qb_mode = call.qb_mode
    if qb_mode == "auto":
        qb_mode = auto_qb_mode(tokens, num_experts, cfg, call.qb_moments)
    if call.map_kind == "indices":
        kind = _INDEX_KINDS[map_out.dtype]
    else:
        kind = _MAP_KINDS[call.map_kind]
    softmax = call.score_function == "softmax"
    num_bins = call.num_bins
    margin = qb and call.qb_binning == "log_margin"
    alpha, bins = cutoff_out, None
    if qb and qb_mode == "two_kernel":
        if margin:  # the router's bin of every (token, expert) (and, with moments, its position)
            planes = 2 if call.qb_moments else 1
            bins = torch.empty(planes, tokens, num_experts, dtype=torch.uint8, device=logits.device)
        elif alpha is None:  # the router's cutoff alpha of every token
            alpha = torch.empty(tokens, dtype=torch.float32, device=logits.device)
    fused = qb and qb_mode == "fused_atomic"
    softmax_pre = 1 if softmax and call.use_pre_softmax else 0
    spec = _launch_router(
        rt,
        cfg,
        logits,
        call.score_function,
        bias=expert_bias,
        topk=call.topk,
        nsel=call.num_selected,
        normalize=(not softmax) and call.topk > 1,
        softmax_pre=softmax_pre,
        scale=1.0 if call.scaling_factor is None else call.scaling_factor,
        probs=probs_out,
        map_out=map_out,
        map_kind=kind,
        qb_mode=_QB_MODES[qb_mode if qb else None],
        hist=qb_histogram,
        bounds=qb_bin_bounds,
        num_bins=num_bins,
        alpha=alpha,
        margin=margin,
        moments=call.qb_moments,
        bins_out=bins,
        decode_max_tokens=cfg[
            "hip.router.decode_max_tokens_fused" if fused else "hip.router.decode_max_tokens"
        ],
        tie_free=call.selection == "tie_free",
        approximate=call.approximate,
    )
    if scores_out is not None:
        k = rt.kernel(dev(logits), spec, "amdqb_router_scores")
        rt.launch(
            k,
            _router_grid(rt, cfg, k, dev(logits), tokens),
            router_block(cfg),
            0,
            [ptr(logits), arg_i32(tokens), ptr(scores_out), arg_i32(softmax_pre)],
        )
    if bins is not None:
        _count_margin_bins(rt, cfg, spec, bins, num_bins, qb_histogram, call.qb_moments)
    elif qb and qb_mode == "two_kernel":
        device = dev(logits)
        epb, slices, per = qb_hist_config(
            num_experts, num_bins, tokens, rt.smem_budget(device), rt.num_cus(device), cfg
        )
        k = rt.kernel(device, spec, "amdqb_qb_hist")
        launch = rt.launch_dependent if cfg["hip.qb_hist.dependent_launch"] else rt.launch
        launch(
            k,
            (cdiv(num_experts, epb), slices),
            cfg["hip.qb_hist.block"],
            4 * epb * num_bins,
            [
                ptr(logits),
                arg_i32(tokens),
                ptr(alpha),
                ptr(qb_bin_bounds),
                arg_i32(num_bins),
                arg_i32(epb),
                arg_i32(per),
                arg_i32(qb_hist_vec(logits, epb, cfg)),
                ptr(qb_histogram),
            ],
        )


# Tokens per slice of amdqb_qb_hist_bins with the in-bin moments: its int32 LDS sums of u * u
# (at most 255^2 a pair) stay below 2^31.
MOMENTS_MAX_SLICE = 32768


def _count_margin_bins(rt, cfg, spec, bins, num_bins, hist, moments=False):
    """The second kernel of the log_margin two-kernel mode: amdqb_qb_hist_bins over the router's
    bin bytes (``bins`` ``[1, T, E]``; ``[2, T, E]`` with the positions of the in-bin moments),
    expert groups of ``hip.qb_hist.margin_experts_per_block`` and token slices aimed at
    ``hip.qb_hist.margin_blocks_per_cu`` blocks per CU."""
    _, tokens, num_experts = bins.shape
    device = dev(bins)
    epb = cfg["hip.qb_hist.margin_experts_per_block"]
    # the kernel pads each expert's LDS row by one int (bank spread); 3 planes with the moments
    row = (num_bins + 1) * (3 if moments else 1)
    while epb > 1 and epb * row * 4 > rt.smem_budget(device):
        epb //= 2
    groups = cdiv(num_experts, epb)
    slices = max(
        1,
        min(
            cdiv(cfg["hip.qb_hist.margin_blocks_per_cu"] * rt.num_cus(device), groups),
            cdiv(tokens, 64),
        ),
    )
    if moments:
        slices = max(slices, cdiv(tokens, MOMENTS_MAX_SLICE))
    per = cdiv(tokens, slices)
    vec = 4 if num_experts % 4 == 0 and epb % 4 == 0 else 1
    k = rt.kernel(device, spec, "amdqb_qb_hist_bins")
    launch = rt.launch_dependent if cfg["hip.qb_hist.dependent_launch"] else rt.launch
    launch(
        k,
        (groups, cdiv(tokens, per)),
        cfg["hip.qb_hist.block"],
        4 * epb * row,
        [
            ptr(bins),
            arg_i32(tokens),
            arg_i32(num_bins),
            arg_i32(epb),
            arg_i32(per),
            arg_i32(vec),
            ptr(hist),
        ],
    )


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
    approximate=False,
):
    if num_groups is not None:
        raise NotImplementedError("hip biased_topk: grouped Top-k is a declared capability limit")
    if logits.shape[0] == 0:
        return
    cfg = config(logits)
    _launch_router(
        rt,
        cfg,
        logits,
        score_function,
        bias=expert_bias,
        topk=topk,
        nsel=topk,
        normalize=bool(renormalize),
        softmax_pre=True,  # serving softmax: over all experts, then Top-k
        scale=1.0 if scaling_factor is None else scaling_factor,
        w_out=weights_out,
        id_out=ids_out,
        decode_max_tokens=cfg["hip.biased_topk.decode_max_tokens"],
        approximate=approximate,
    )


# ------------------------------------------------------------------------------------------------
# Capability checks (the dispatcher's: a reason passes this backend over, the next one runs)
# ------------------------------------------------------------------------------------------------
def topk_limits(info, num_experts: int, grouped: bool, num_selected: int) -> str | None:
    """The router kernels' limits (biased_topk's fallback in topk.py shares them)."""
    if grouped:
        return "grouped Top-k is not implemented"
    if num_experts > MAX_ROUTER_EXPERTS:
        return f"num_experts={num_experts} > {MAX_ROUTER_EXPERTS} (register-resident rows)"
    cap = max_select(configs.load(info.arch_family))
    if num_selected > cap:
        return f"selecting {num_selected} experts per token > {cap}"
    return None


def router_fwd_limits(info, call: RouterCall) -> str | None:
    why = topk_limits(info, call.num_experts, call.grouped, call.num_selected)
    if why is None and call.qb and call.num_bins > MAX_QB_BINS:
        why = f"QB num_bins={call.num_bins} > {MAX_QB_BINS} (LDS row)"
    return why


LIMITS = {"router_fwd": router_fwd_limits}
