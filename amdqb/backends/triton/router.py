"""Triton launchers of the fused Top-k router, its QB histogram, its backward and ``biased_topk``.

Precision and tie-break contract: the one of ``amdqb.ref.router`` (fp32 math, (value desc, id asc)
order through the monotone int32 key, NaN lowest, exactly k distinct experts per token; QB cutoff =
the (k+1)-th of that order, histogram ``clamp(floor((alpha - s - L) * (B / (U - L))), 0, B-1)``
with a correctly rounded ``B / (U - L)``). The selection is exact for every input; weights and
probabilities agree with the oracle to fp32 rounding (the kernels' ``exp`` / division may differ
from PyTorch's by an ulp), and the QB histogram is bitwise the oracle's when the oracle is evaluated
on the kernels' own activations (``RouterCall.write_scores``). ``two_kernel`` and ``fused_atomic`` give
bitwise-identical histograms (same jit helpers, integer counts). With the log_margin in-bin moments
(``RouterCall.qb_moments``, an int64 ``[3, E, B]`` histogram) the router's own pass adds counts and
moments with 64-bit atomics whatever the mode: the counting kernel sees bins, not margins.

Launch knobs are the ``triton.router.*`` entries of ``amdqb/configs`` (per architecture family):

* ``row_elems``: BT * W, the router tile per program (BT rows of W = next_pow2(E) columns); 1024
  gives one row per program at E=896, which keeps row reductions inside 2 warps and ~120 registers
  per thread (Triton 3.6, sm_90);
* ``elems_per_warp`` / ``max_warps``: num_warps = BT * W / elems_per_warp, clamped;
* ``pair_elems``: cap on BT * max(G, CAP)^2, the pairwise-rank tensors of the fast path, and
  ``pairs_per_warp``: at least that many warps for them (register pressure);
* ``tau_groups_min`` / ``max_cap``: the fast path uses G = max(tau_groups_min, next_pow2(R+1))
  strided groups for the lower bound and CAP = next_pow2(1.5 (R+1)) candidate slots (R = k, or
  k-1 without QB); it is used while G and CAP <= max_cap, else the exact path. At E=896, k=16
  (QB) ~1% of random rows overflow CAP=32 and take the exact search (correct, ~5x slower per row);
* ``hist_lds_bytes``: the two_kernel histogram's private (LDS / shared) bytes per program, which
  sets experts per program = largest power of two with next_pow2(EPP * B) * 4 bytes inside it
  (B=1000 -> 8 experts, 32 KiB);
* ``hist_iter_elems`` (private) / ``hist_global_iter_elems`` (global atomics): tokens x experts per
  histogram-kernel iteration; ``hist_tokens_per_prog``: token slice per program (token slices =
  ceil(T / it), at most ``hist_max_slices``); ``hist_warps``;
* ``auto_two_kernel_min_tokens``: ``qb_mode="auto"`` uses two_kernel from this T on, and only where
  ``tl.histogram`` lowers to one shared-memory atomic per element (see below), else fused_atomic;
* ``bwd_row_elems``: backward tile.

``tl.histogram`` has two lowerings: one shared-memory atomic per element (Triton 3.9 on NVIDIA),
or a warp ballot/popcount scheme whose ALU cost grows with the bin count (Triton 3.6 on NVIDIA and
AMD, Triton 3.9 on AMD; checked by compiling for sm_90 / gfx942 with both versions): at 8192 bins
it is ~2000 instructions per element. :func:`lds_histogram_is_per_element` compiles a tiny probe
once per device; where it shows ballots, the two_kernel histogram kernel uses direct global
atomics (identical counts, no private histogram) and ``"auto"`` picks fused_atomic.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton

from ... import configs
from ...devices import device_info
from ...ref.router import MARGIN_MOMENT_BITS, margin_fine_keys
from .. import _serving
from ..calls import SCORE_CODES, RouterCall, TopkCall
from . import _router_kernels as K
from ._common import compile_options, floor_pow2, interpreting, on_device, pow2

MAX_ROW_EXPERTS = 4096  # experts of one router row held in registers (a capability limit)


def _family(device: torch.device) -> str:
    return device_info(device).arch_family


def config(family: str) -> dict:
    """The ``triton.router.*`` entries of ``family`` without their prefix."""
    cfg = configs.load(family)
    prefix = "triton.router."
    return {key[len(prefix) :]: cfg[key] for key in cfg.keys() if key.startswith(prefix)}


def _warps(tile: int, cfg: dict) -> int:
    return max(1, min(cfg["max_warps"], tile // cfg["elems_per_warp"]))


# --------------------------------------------------------------------------------------------
# Plans: every constexpr of a router specialisation, from the problem shape and the config.
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RouterPlan:
    E: int
    K: int
    R: int
    NG: int
    GS: int
    GT: int
    GN: int  # scores per group summed into the group score
    NGP: int
    GSP: int
    W: int
    EP: int
    BT: int
    G: int
    CAP: int
    ID_BITS: int
    FAST: bool
    USE_TAU: bool
    num_warps: int

    def constexprs(self) -> dict:
        names = (
            "E",
            "K",
            "R",
            "NG",
            "GS",
            "GT",
            "GN",
            "NGP",
            "GSP",
            "W",
            "EP",
            "BT",
            "G",
            "CAP",
            "ID_BITS",
        )
        out = {n: getattr(self, n) for n in names}
        out["FAST"] = self.FAST
        out["USE_TAU"] = self.USE_TAU
        return out


@functools.cache
def plan_router(
    E: int, K: int, qb: bool, num_groups, group_topk, family: str, group_scores: int = 0
) -> RouterPlan:
    """Every constexpr of a router specialisation. ``group_scores``: how many of a group's best
    scores make its group score (0: TransformerEngine's ``K // group_topk``)."""
    cfg = config(family)
    EP = max(16, pow2(E))
    if num_groups is not None and num_groups > 1:
        NG, GT = num_groups, group_topk
        GS = E // NG
        GSP = pow2(GS)
        NGP = max(pow2(NG), 16 // GSP if GSP < 16 else 1)
    else:
        NG, GT, GS, GSP, NGP = 1, 1, E, EP, 1
    GN = group_scores or max(1, K // GT)
    W = NGP * GSP
    R = K if qb else K - 1
    CAP = max(16, pow2(math.ceil(1.5 * (R + 1))))
    G = min(W, max(cfg["tau_groups_min"], pow2(R + 1)))
    if W <= CAP and W <= cfg["max_cap"]:
        # Everything is a candidate: no lower bound needed, no overflow possible.
        CAP, G, use_tau, fast = W, W, False, True
    else:
        use_tau = True
        fast = CAP <= min(W, cfg["max_cap"]) and G <= cfg["max_cap"]
    pair = max(G if use_tau else 0, CAP) if fast else 0
    bt = max(1, cfg["row_elems"] // W)
    if pair:
        bt = min(bt, max(1, cfg["pair_elems"] // (pair * pair)))
    BT = floor_pow2(bt)
    warps = max(
        _warps(BT * W, cfg), min(cfg["max_warps"], BT * pair * pair // cfg["pairs_per_warp"])
    )
    id_bits = (E + W - 1).bit_length()
    return RouterPlan(
        E, K, R, NG, GS, GT, GN, NGP, GSP, W, EP, BT, G, CAP, id_bits, fast, use_tau, warps
    )


@dataclass(frozen=True)
class HistPlan:
    EPP: int
    BT: int
    NB: int
    LDS: bool
    tokens_per_prog: int
    slices: int
    num_warps: int


def plan_histogram(E: int, B: int, T: int, family: str, lds_ok: bool) -> HistPlan:
    cfg = config(family)
    budget = cfg["hist_lds_bytes"]
    epp = 1
    while epp < 32 and pow2(2 * epp * B) * 4 <= budget and 2 * epp <= pow2(E):
        epp *= 2
    lds = lds_ok and pow2(epp * B) * 4 <= budget
    if not lds:  # direct global atomics: no private histogram, take a wider expert slice
        epp = min(8, pow2(E))
    # A private histogram amortises its zero/read-back over big token blocks; global atomics
    # gain nothing from them (and big blocks cost layout-conversion scratch).
    iter_elems = cfg["hist_iter_elems"] if lds else cfg["hist_global_iter_elems"]
    bt = max(16, min(1024, iter_elems // epp))
    slices = max(1, min(cfg["hist_max_slices"], -(-T // cfg["hist_tokens_per_prog"])))
    per = -(-T // slices)
    per = -(-per // bt) * bt
    slices = max(1, -(-T // per))
    # NB sizes the private histogram only: the global-atomic form keeps none (a [NB] block of an
    # [epp, B] slice would pass Triton's 2^20-element limit from B = 2^17 on)
    nb = pow2(epp * B) if lds else 1
    return HistPlan(epp, bt, nb, lds, per, slices, cfg["hist_warps"])


# --------------------------------------------------------------------------------------------
# How tl.histogram is lowered here (one compile per device, no device work).
# --------------------------------------------------------------------------------------------
@functools.cache
def _histogram_probe(target) -> bool:
    from triton.compiler import ASTSource

    src = ASTSource(
        fn=K._histogram_probe_kernel,
        signature={"x_ptr": "*i32", "o_ptr": "*i32", "N": "constexpr", "NB": "constexpr"},
        constexprs={"N": 256, "NB": 256},
    )
    compiled = triton.compile(src, target=target, options={"num_warps": 4})
    asm = compiled.asm.get("ptx") or compiled.asm.get("amdgcn") or ""
    # The ballot lowering emits popcounts per owned bin; the per-element one emits none.
    return ("popc" not in asm) and ("bcnt" not in asm)


def lds_histogram_is_per_element(device: torch.device) -> bool:
    """True where ``tl.histogram`` costs one shared-memory atomic per element on ``device``."""
    if device.type != "cuda" or interpreting():
        return True
    try:
        with torch.cuda.device(device):
            target = triton.runtime.driver.active.get_current_target()
        return _histogram_probe(target)
    except Exception:  # pragma: no cover - a probe failure must not break routing
        return False


# --------------------------------------------------------------------------------------------
# Launchers.
# --------------------------------------------------------------------------------------------
def _scratch_per_row(plan: RouterPlan) -> int:
    """int32 scratch per row: candidate keys and ids, a slot counter, the k values by rank."""
    return 2 * plan.CAP + 1 + pow2(plan.K)


def _launch_router(
    logits,
    plan: RouterPlan,
    *,
    score,
    pre,
    renorm,
    bias,
    scaling,
    probs=None,
    map_out=None,
    map_code=0,
    ids=None,
    weights=None,
    qb=0,
    nbins=2,
    hist=None,
    bounds=None,
    cut=None,
    approx=False,
    tie_free=False,
    margin=False,
    moments=False,
    scores=None,
    cutoff=None,
):
    T = logits.shape[0]
    grid = (triton.cdiv(T, plan.BT),)
    dummy = logits
    # Per row: candidate keys and ids (CAP each), a slot counter, then the routes' values by rank.
    scratch = torch.empty(
        grid[0] * plan.BT * _scratch_per_row(plan), dtype=torch.int32, device=logits.device
    )
    bytes_scratch = dummy
    if map_code == 2 and plan.NG > 1:
        bytes_scratch = torch.empty(T * plan.E, dtype=torch.uint8, device=logits.device)
    K._router_fwd_kernel[grid](
        logits,
        bias if bias is not None else dummy,
        probs if probs is not None else dummy,
        map_out if map_out is not None else dummy,
        ids if ids is not None else dummy,
        weights if weights is not None else dummy,
        hist if hist is not None else dummy,
        bounds if bounds is not None else dummy,
        cut if cut is not None else dummy,
        scratch,
        bytes_scratch,
        scores if scores is not None else dummy,
        cutoff if cutoff is not None else dummy,
        T,
        float(1.0 if scaling is None else scaling),
        **plan.constexprs(),
        SCORE=score,
        PRE=bool(pre),
        RENORM=bool(renorm),
        HAS_BIAS=bias is not None,
        QB=qb,
        NBINS=nbins,
        MAP=map_code,
        DENSE=probs is not None,
        COMPACT_W=weights is not None,
        KP=pow2(plan.K),
        APPROX=bool(approx),
        TIE_FREE=bool(tie_free),
        MARGIN=bool(margin),
        FINE=margin_fine_keys(nbins) if margin else 0,
        MOMENTS=bool(moments),
        MBITS=MARGIN_MOMENT_BITS,
        SCORES=scores is not None,
        CUTOFF=cutoff is not None,
        num_warps=plan.num_warps,
        **compile_options(logits.device),
    )


def _resolve_qb_mode(mode: str, T: int, device: torch.device, family: str) -> tuple[str, bool]:
    lds_ok = lds_histogram_is_per_element(device)
    if mode == "auto":
        two = lds_ok and T >= config(family)["auto_two_kernel_min_tokens"]
        mode = "two_kernel" if two else "fused_atomic"
    return mode, lds_ok


def router_fwd(
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
    T, E = logits.shape
    if T == 0:
        return
    family = _family(logits.device)
    plan = plan_router(E, call.topk, call.qb, call.num_groups, call.group_topk, family)
    score = SCORE_CODES[call.score_function]
    if call.map_kind == "bytemap":
        map_kwargs = {"map_out": map_out.view(torch.uint8), "map_code": 1}
    elif call.map_kind == "bitmap":
        map_kwargs = {"map_out": map_out, "map_code": 2}
    else:
        map_kwargs = {"ids": map_out, "map_code": 3}
    common = dict(
        score=score,
        pre=call.use_pre_softmax and score == 2,
        renorm=score != 2 and call.topk > 1,
        bias=expert_bias,
        scaling=call.scaling_factor,
        tie_free=call.selection == "tie_free",
        approx=call.approximate,
        probs=probs_out,
        scores=scores_out,
        **map_kwargs,
    )
    with on_device(logits):
        if not call.qb:
            _launch_router(logits, plan, **common)
            return
        B = call.num_bins
        margin = call.qb_binning == "log_margin"
        qb = dict(nbins=B, hist=qb_histogram, bounds=qb_bin_bounds, margin=margin)
        mode, lds_ok = _resolve_qb_mode(call.qb_mode, T, logits.device, family)
        if call.qb_moments:  # the moments need each pair's margin: the router's own pass counts
            _launch_router(logits, plan, **common, qb=1, cutoff=cutoff_out, moments=True, **qb)
            return
        if mode == "fused_atomic":
            _launch_router(logits, plan, **common, qb=1, cutoff=cutoff_out, **qb)
            return
        # two kernels: the router writes each token's cutoff (uniform) or every bin (log_margin,
        # uint8 [T, E]); the second kernel counts
        if margin:
            cut = torch.empty(T, E, dtype=torch.uint8, device=logits.device)
        elif cutoff_out is not None:
            cut, cutoff_out = cutoff_out, None  # the cutoffs the second kernel reads
        else:
            cut = torch.empty(T, dtype=torch.float32, device=logits.device)
        _launch_router(logits, plan, **common, qb=2, cut=cut, cutoff=cutoff_out, **qb)
        _launch_histogram(
            logits, cut, qb_bin_bounds, qb_histogram, family, lds_ok, margin, call.approximate
        )


def _launch_histogram(logits, cut, bounds, hist, family, lds_ok, from_bins=False, approx=False):
    T, E = logits.shape
    B = hist.shape[1]
    hp = plan_histogram(E, B, T, family, lds_ok)
    grid = (triton.cdiv(E, hp.EPP), hp.slices)
    K._qb_hist_kernel[grid](
        logits,
        cut,
        bounds,
        hist,
        T,
        hp.tokens_per_prog,
        E=E,
        NBINS=B,
        EPP=hp.EPP,
        BT=hp.BT,
        NB=hp.NB,
        LDS=hp.LDS,
        APPROX=bool(approx),
        FROM_BINS=bool(from_bins),
        num_warps=hp.num_warps,
        **compile_options(logits.device),
    )


def biased_topk(call: TopkCall, logits, expert_bias, weights_out, ids_out, tei_out, non_padded):
    T, E = logits.shape
    if T == 0:
        return
    if not logits.is_contiguous():
        logits = logits.contiguous()
    if expert_bias is not None and expert_bias.dtype != torch.float32:
        expert_bias = expert_bias.float()
    # the serving rule: a group's best score, or the sum of its best two with a correction bias
    group_scores = 2 if expert_bias is not None else 1
    family = _family(logits.device)
    plan = plan_router(E, call.topk, False, call.num_groups, call.group_topk, family, group_scores)
    score = SCORE_CODES[call.score_function]
    routed_w, routed_ids = _serving.routed_buffers(call, weights_out, ids_out)
    with on_device(logits):
        _launch_router(
            logits,
            plan,
            score=score,
            pre=score == 2,  # serving form: softmax over all experts, then Top-k
            renorm=bool(call.renormalize),
            bias=expert_bias,
            scaling=call.scaling_factor,
            ids=routed_ids,
            weights=routed_w,
            map_code=3,
            approx=call.approximate,
        )
    _serving.finish(call, E, routed_w, routed_ids, weights_out, ids_out, tei_out, non_padded)


def _bwd_tile(E: int, family: str) -> tuple[int, int, int]:
    cfg = config(family)
    W = max(16, pow2(E))
    bt = max(1, cfg["bwd_row_elems"] // W)
    BT = floor_pow2(bt)
    return W, BT, _warps(BT * W, cfg)


def router_bwd(call: RouterCall, grad_probs, logits, routed, grad_logits_out):
    call.check(logits)
    T, E = logits.shape
    if T == 0:
        return
    W, BT, warps = _bwd_tile(E, _family(logits.device))
    score = SCORE_CODES[call.score_function]
    with on_device(logits):
        K._router_bwd_kernel[(triton.cdiv(T, BT),)](
            grad_probs,
            logits,
            routed.view(torch.uint8),
            grad_logits_out,
            T,
            float(1.0 if call.scaling_factor is None else call.scaling_factor),
            E=E,
            W=W,
            BT=BT,
            SCORE=score,
            PRE=call.use_pre_softmax and score == 2,
            NORM=call.topk > 1,
            num_warps=warps,
            **compile_options(logits.device),
        )


# --------------------------------------------------------------------------------------------
# Capability checks (the dispatcher's: a reason passes this backend over, the next one runs).
# --------------------------------------------------------------------------------------------
def _row_limit(num_experts: int) -> str | None:
    if num_experts > MAX_ROW_EXPERTS:
        return (
            f"E > {MAX_ROW_EXPERTS} (num_experts={num_experts}): the router keeps a whole row in "
            "registers"
        )
    return None


def router_fwd_limits(info, call: RouterCall) -> str | None:
    why = _row_limit(call.num_experts)
    if why is None and call.qb and call.num_experts * call.num_bins >= 2**31:
        why = "E * B >= 2^31 histogram bins (32-bit histogram offsets)"
    if why is None and call.qb_moments and 3 * call.num_experts * call.num_bins >= 2**31:
        why = "3 * E * B >= 2^31 histogram entries (32-bit offsets of the moment planes)"
    return why


def router_bwd_limits(info, call: RouterCall) -> str | None:
    return _row_limit(call.num_experts)


def biased_topk_limits(info, call: TopkCall) -> str | None:
    if call.input_dtype_math:
        return "input_dtype_math (SGLang's fp16 / bf16 arithmetic) is not implemented"
    return _row_limit(call.num_experts)


OPS = {"router_fwd": router_fwd, "router_bwd": router_bwd, "biased_topk": biased_topk}
LIMITS = {
    "router_fwd": router_fwd_limits,
    "router_bwd": router_bwd_limits,
    "biased_topk": biased_topk_limits,
}
