"""hip launcher of the serving top-k: ``amdqb_topk`` (``hip_src/kernels/topk.hip``), one launch
writing every output of a :class:`~amdqb.backends.calls.TopkCall`.

Precision and tie-break contract: ``amdqb.ref.router.biased_topk`` (fp32 scores with torch's bits,
selection by (value descending, expert id ascending), NaN lowest; weights renormalised in the
order of ``routes_sum``).

Row plan (:func:`plan`): a token row is ``lanes`` lanes of a logical warp holding ``slots`` experts
each. Without groups lane ``l`` holds experts ``l + lanes * i``, the fewest lanes (a power of two
<= 32) that keep ``hip.topk.decode_lane_slots`` experts or fewer per lane -- below
``hip.topk.wide_min_tokens`` tokens, where a call's latency is its row's dependent chain -- or
``hip.topk.lane_slots`` from there on (one thread per row for small E, several rows per warp:
in-register work costs less than the cross-lane merges when the GPU is full). Each lane stands
for whole lanes of torch's warp-softmax layout (``min(32, next_pow2(E))`` lanes), so the softmax
sum runs in torch's order. With
groups a lane holds ``slots`` consecutive experts and each group spans ``group_lanes`` whole lanes
(its best two combine over them); the largest power-of-two split of the group that fits 32 lanes.
Configurations without a plan (more than ``hip.topk.max_slots`` experts per lane, k above 32,
groups that do not split into whole lanes) are declined: the router kernels
(``amdqb.backends.hip.router``) run them. From ``hip.topk.rounds_min_tokens`` tokens on the row's
Top-k comes from rounds of a butterfly max instead of merges of the lanes' lists (the same list).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from ... import configs, devices
from .. import _serving
from ..calls import RouterCall, TopkCall
from . import _spec, router
from ._common import cdiv, config, dev

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_NO_PADDING = 2**63 - 1


def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p <<= 1
    return p


@dataclass(frozen=True)
class TopkPlan:
    num_experts: int
    topk: int
    lanes: int  # lanes per token row (a power of two <= 32)
    slots: int  # experts per lane
    contiguous: bool  # lane l holds experts l * slots + i (else l + lanes * i)
    groups: int = 0
    group_lanes: int = 1
    topk_group: int = 0
    group_best: int = 1  # the best entries a group's score sums
    rounds: bool = False  # the row's Top-k by rounds of a butterfly max (else list merges)


def plan(
    num_experts: int,
    topk: int,
    score_function: str,
    num_groups,
    group_topk,
    cfg,
    group_best: int = 1,
    dense: bool = False,
    tokens: int | None = None,
) -> TopkPlan | None:
    """The row plan of amdqb_topk for this configuration, or None (declined). ``group_best``: the
    best entries a group's score sums (vLLM / SGLang: 2 with a bias, 1 without; TE: k /
    group_topk); ``tokens`` (None: unknown) picks the wide rows and the rounds."""
    wide = (
        tokens is not None
        and tokens >= int(cfg["hip.topk.wide_min_tokens"])
        and num_experts >= int(cfg["hip.topk.wide_min_experts"])
    )
    # the key selection (hip.topk.key_select_min_experts) runs on list merges: rounds yield to it
    keys = not dense and num_experts >= int(cfg["hip.topk.key_select_min_experts"])
    rounds = tokens is not None and tokens >= int(cfg["hip.topk.rounds_min_tokens"]) and not keys
    return _row_plan(
        num_experts,
        topk,
        score_function,
        num_groups,
        group_topk,
        cfg,
        group_best,
        dense,
        wide,
        rounds,
    )


@functools.lru_cache(maxsize=1024)  # per call shape and config object (an override is another)
def _row_plan(
    num_experts, topk, score_function, num_groups, group_topk, cfg, group_best, dense, wide, rounds
) -> TopkPlan | None:
    max_slots = int(cfg["hip.topk.max_slots"])
    if topk > min(num_experts, 32):
        return None
    if num_groups is None or num_groups <= 1:
        if dense:  # the strided bit map packs a byte per 8 lanes: torch's lanes
            lanes = min(32, _pow2_at_least(num_experts))
        else:
            per_lane = int(cfg["hip.topk.lane_slots" if wide else "hip.topk.decode_lane_slots"])
            lanes = min(32, _pow2_at_least(cdiv(num_experts, per_lane)))
        slots = cdiv(num_experts, lanes)
        if slots > max_slots:
            return None
        return TopkPlan(num_experts, topk, lanes, slots, False, rounds=rounds and lanes > 1)
    size = num_experts // num_groups
    split = 1  # lanes per group: the largest power of two dividing the group that fits 32 lanes
    while size % (2 * split) == 0 and num_groups * 2 * split <= 32:
        split *= 2
    slots = size // split
    lanes = _pow2_at_least(num_groups * split)
    softmax_lanes = min(32, _pow2_at_least(num_experts))
    if lanes > 32 or slots > max_slots:
        return None
    if score_function == "softmax" and lanes < softmax_lanes:
        return None  # the softmax sum runs over torch's warp-softmax lanes inside the row
    if group_best > min(32, size):
        return None
    return TopkPlan(
        num_experts,
        topk,
        lanes,
        slots,
        True,
        num_groups,
        split,
        int(group_topk),
        group_best,
        rounds and lanes > 1,
    )


class TopkParams(ctypes.Structure):
    """``struct TopkParams`` of topk.hip, field for field."""

    _fields_ = [
        ("logits", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("weights", ctypes.c_void_p),
        ("ids", ctypes.c_void_p),
        ("token_expert_idx", ctypes.c_void_p),
        ("non_padded", ctypes.c_void_p),
        ("probs", ctypes.c_void_p),
        ("map", ctypes.c_void_p),
        ("scores", ctypes.c_void_p),
        ("row_stride", ctypes.c_int64),
        ("tokens", ctypes.c_int64),
        ("non_padded_rows", ctypes.c_int64),
        ("out_k", ctypes.c_int32),
        ("num_shared", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("shared_weight", ctypes.c_float),
        ("shared_div", ctypes.c_float),
        ("flags", ctypes.c_int32),
        ("map_kind", ctypes.c_int32),
        ("pad_", ctypes.c_int32),
    ]


def _address(t) -> int | None:
    return None if t is None else t.data_ptr()


def _launch(rt, cfg, logits, spec, params, lanes: int) -> None:
    tokens = logits.shape[0]
    info = devices.tensor_device_info(logits)
    rows_per_warp = 32 // lanes
    warps = cdiv(tokens, rows_per_warp)
    # The rows go over the CUs first, then fill blocks of up to hip.topk.block threads: at decode
    # sizes a row is one dependent chain, and eight warps in one block share one CU's issue slots
    # (H200, DeepSeek-V3's gate: T=1 3.2 us, T=8 in one block of 8 warps 4.7 us). Blocks are
    # powers of two and whole waves on wave64.
    per_block = _pow2_at_least(cdiv(warps, max(1, info.cu_count)))
    min_warps = max(1, info.wave_size // 32)
    threads = 32 * min(max(per_block, min_warps), int(cfg["hip.topk.block"]) // 32)
    grid = cdiv(tokens, rows_per_warp * (threads // 32))
    rt.launch(rt.kernel(dev(logits), spec, "amdqb_topk"), grid, threads, 0, [params])


def _params(logits, bias, **fields) -> TopkParams:
    values = dict(
        logits=_address(logits),
        bias=_address(bias),
        row_stride=logits.stride(0),
        tokens=logits.shape[0],
        non_padded_rows=_NO_PADDING,
        scale=1.0,
        shared_div=1.0,
    )
    values.update(fields)
    return TopkParams(**values)


def launch(
    rt, call, topk_plan, logits, bias, weights_out, ids_out, tei_out, non_padded, cfg=None
) -> None:
    """amdqb_topk's compact (serving) outputs over ``logits [T, E]`` (``logits.stride(1) == 1``);
    ``cfg``: the logits' device config (looked up when not given)."""
    if logits.shape[0] == 0:
        return
    cfg = config(logits) if cfg is None else cfg
    spec = _spec.topk_module(
        topk_plan,
        _DTYPE_NAMES[logits.dtype],
        None if bias is None else _DTYPE_NAMES[bias.dtype],
        call.score_function,
        cfg,
        approximate=call.approximate,
        input_dtype_math=call.input_dtype_math,
    )
    flags = (1 if call.renormalize else 0) | (2 if ids_out.dtype == torch.int64 else 0)
    if non_padded is not None and non_padded.dtype == torch.int64:
        flags |= 4
    if call.shared_div is not None:
        flags |= 8
    params = _params(
        logits,
        bias,
        weights=_address(weights_out),
        ids=_address(ids_out),
        token_expert_idx=_address(tei_out),
        non_padded=_address(non_padded),
        non_padded_rows=(
            _NO_PADDING if call.non_padded_rows is None else int(call.non_padded_rows)
        ),
        out_k=call.out_k,
        num_shared=call.num_shared,
        scale=1.0 if call.scaling_factor is None else float(call.scaling_factor),
        shared_weight=float(call.shared_weight),
        shared_div=1.0 if call.shared_div is None else float(call.shared_div),
        flags=flags,
    )
    _launch(rt, cfg, logits, spec, params, topk_plan.lanes)


def biased_topk(rt, call: TopkCall, logits, expert_bias, weights_out, ids_out, tei_out, non_padded):
    """amdqb_topk (every output in one launch) where it has a row plan, else the router kernels
    (ungrouped; the remaining outputs filled around them)."""
    tokens, num_experts = logits.shape
    if num_experts != call.num_experts:
        raise ValueError(
            f"TopkCall.num_experts={call.num_experts} but the logits have {num_experts} experts"
        )
    if tokens == 0:
        return
    cfg = config(logits)
    row_plan = plan(
        num_experts,
        call.topk,
        call.score_function,
        call.num_groups,
        call.group_topk,
        cfg,
        2 if expert_bias is not None else 1,  # vLLM / SGLang: a group's best two with a bias
        tokens=tokens,
    )
    if row_plan is not None:
        launch(
            rt, call, row_plan, logits, expert_bias, weights_out, ids_out, tei_out, non_padded, cfg
        )
        return
    if call.grouped:  # the dispatcher passes hip over (biased_topk_limits); direct calls
        raise ValueError("hip biased_topk: grouped Top-k without an amdqb_topk row plan")
    if not logits.is_contiguous():
        logits = logits.contiguous()
    if expert_bias is not None and expert_bias.dtype != torch.float32:
        expert_bias = expert_bias.float()
    routed_w, routed_ids = _serving.routed_buffers(call, weights_out, ids_out)
    router.biased_topk(
        rt,
        logits,
        call.topk,
        expert_bias,
        call.score_function,
        call.renormalize,
        call.scaling_factor,
        None,
        None,
        routed_w,
        routed_ids,
        call.approximate,
    )
    _serving.finish(
        call, num_experts, routed_w, routed_ids, weights_out, ids_out, tei_out, non_padded
    )


def biased_topk_limits(info, call: TopkCall) -> str | None:
    """amdqb_topk's row plan, else the router kernels' limits (which do no groups)."""
    cfg = configs.load(info.arch_family)
    args = (call.num_experts, call.topk, call.score_function, call.num_groups, call.group_topk)
    if plan(*args, cfg) is not None:
        return None
    if call.input_dtype_math:
        return "input_dtype_math without an amdqb_topk row plan"
    if call.grouped:
        return (
            f"grouped Top-k of {call.num_groups} groups over E={call.num_experts}, k={call.topk}: "
            "no amdqb_topk row plan (groups must split into whole lanes of at most "
            "hip.topk.max_slots experts)"
        )
    return router.topk_limits(info, call.num_experts, False, call.topk)


_MAP_CODES = {"bytemap": 1, "bitmap": 2}
_INDEX_CODES = {torch.int16: 3, torch.int32: 4, torch.int64: 5}


def router_plan(call: RouterCall, cfg) -> TopkPlan | None:
    """amdqb_topk's row plan of a grouped TransformerEngine router call (groups ranked by the sum
    of their best k / group_topk scores), or None: no QB, TE's selection."""
    if not call.grouped or call.qb or call.selection != "te":
        return None
    return plan(
        call.num_experts,
        call.topk,
        call.score_function,
        call.num_groups,
        call.group_topk,
        cfg,
        call.topk // call.group_topk,
        dense=True,
    )


def router_fwd_grouped(
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
    """The grouped TransformerEngine router in one amdqb_topk launch (its dense form): probs, the
    routing map and the ranked scores."""
    call.check_forward(logits, qb_histogram)
    tokens = logits.shape[0]
    if tokens == 0:
        return
    cfg = config(logits)
    row_plan = router_plan(call, cfg)
    if row_plan is None:  # the dispatcher passes hip over (router_fwd_limits); direct calls
        raise ValueError(f"hip router: no amdqb_topk row plan for the grouped call {call}")
    if not logits.is_contiguous():
        logits = logits.contiguous()
    spec = _spec.topk_module(
        row_plan,
        _DTYPE_NAMES[logits.dtype],
        None if expert_bias is None else _DTYPE_NAMES[expert_bias.dtype],
        call.score_function,
        cfg,
        approximate=call.approximate,
        dense=True,
    )
    softmax = call.score_function == "softmax"
    flags = (1 if not softmax and call.topk > 1 else 0) | (
        16 if softmax and not call.use_pre_softmax else 0
    )
    map_kind = _MAP_CODES.get(call.map_kind) or _INDEX_CODES[map_out.dtype]
    params = _params(
        logits,
        expert_bias,
        probs=_address(probs_out),
        map=_address(map_out),
        scores=_address(scores_out),
        map_kind=map_kind,
        out_k=call.topk,
        scale=1.0 if call.scaling_factor is None else float(call.scaling_factor),
        flags=flags,
    )
    _launch(rt, cfg, logits, spec, params, row_plan.lanes)


def router_fwd_limits(info, call: RouterCall) -> str | None:
    """Grouped calls: amdqb_topk's row plan; the others: the router kernels' limits."""
    if not call.grouped:
        return router.router_fwd_limits(info, call)
    if router_plan(call, configs.load(info.arch_family)) is not None:
        return None
    return (
        f"grouped Top-k of {call.num_groups} groups over E={call.num_experts}, k={call.topk}"
        f"{' under QB' if call.qb else ''}: no amdqb_topk row plan (TE's selection, no QB, "
        "groups that split into whole lanes of at most hip.topk.max_slots experts)"
    )


LIMITS = {"biased_topk": biased_topk_limits, "router_fwd": router_fwd_limits}
