"""Bad inputs at every public entry point (``amdqb``'s exports and ``amdqb.compat.te``).

Each case is a call with one bad (or borderline) argument and either the error it must raise -- its
type and a fragment of the message, which names the argument -- or a documented result. After every
rejection the state is checked unchanged: every tensor the call received (inputs and in-place
outputs: counters, histograms, index buffers, biases, bounds) and, for the balancer, all of its
buffers are bitwise equal to before the call. Errors come before any allocation, so sizes that
would allocate absurd memory (``moe_route_rows(ids, 2**31)``) fail at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

import amdqb
from amdqb import ref
from amdqb.compat import te

from conftest import DEVICE, HAS_GPU

E, T = 8, 4


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def _logits(t=T, e=E, dtype=torch.float32, seed=0):
    return torch.randn(t, e, generator=_g(seed)).to(DEVICE, dtype)


def _i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _f32(values):
    return torch.tensor(values, dtype=torch.float32, device=DEVICE)


def _zeros(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype, device=DEVICE)


@dataclass
class Case:
    """``call(**args)``; ``error`` (type, fragment) or ``check(result, args)``; ``extra``: other
    state the call may touch (e.g. a balancer), snapshotted with the tensors of ``args``."""

    name: str
    call: Callable
    args: dict
    error: tuple | None = None
    check: Callable | None = None
    extra: Callable | None = None
    skip: str | None = None
    marks: list = field(default_factory=list)


CASES: list[Case] = []


def bad(name, call, args, exc, fragment, **kw):
    CASES.append(Case(name, call, args, error=(exc, fragment), **kw))


def good(name, call, args, check, **kw):
    CASES.append(Case(name, call, args, check=check, **kw))


# ---------------------------------------------------------------------------------------------
# fused_topk_with_score_function
# ---------------------------------------------------------------------------------------------
def router(**kw):
    args = dict(logits=_logits(), topk=2)
    args.update(kw)
    return args


def qb(**kw):
    args = dict(
        logits=_logits(),
        topk=2,
        expert_bias=_zeros(E),
        qb_histogram=_zeros(E, 10, dtype=torch.int32),
        qb_bin_bounds=_f32([-1.0, 1.0]),
        qb_histogram_mode="two_kernel",
    )
    args.update(kw)
    return args


def margin(**kw):
    args = qb(
        qb_histogram=_zeros(E, 64, dtype=torch.int32),
        qb_bin_bounds=_f32([100.0] * E),
        qb_binning="log_margin",
    )
    args.update(kw)
    return args


def routes_k(k):
    def check(out, args):
        probs, rmap = out
        assert rmap.dtype == torch.bool and torch.all(rmap.sum(-1) == k)
        want, _, want_map = ref.fused_topk_with_score_function(
            args["logits"].cpu(),
            k,
            scaling_factor=None if args.get("scaling_factor") is None else args["scaling_factor"],
        )
        assert torch.equal(rmap.cpu(), want_map)

    return check


R = amdqb.fused_topk_with_score_function
bad("router logits list", R, router(logits=[[1.0] * E]), TypeError, "logits")
bad("router logits fp64", R, router(logits=_logits(dtype=torch.float64)), TypeError, "logits")
bad("router logits int32", R, router(logits=_zeros(T, E, dtype=torch.int32)), TypeError, "logits")
bad("router logits 0-dim", R, router(logits=_f32(1.0)), ValueError, "logits")
bad("router logits E=0", R, router(logits=_zeros(T, 0)), ValueError, "at least one expert")
bad("router topk 0", R, router(topk=0), ValueError, "topk must be >= 1")
bad("router topk > E", R, router(topk=E + 1), ValueError, "topk must be <= 8")
bad("router topk negative", R, router(topk=-3), ValueError, "topk")
bad("router topk float", R, router(topk=2.0), TypeError, "topk must be an int")
bad("router topk bool", R, router(topk=True), TypeError, "topk must be an int")
bad("router topk str", R, router(topk="2"), TypeError, "topk")
bad("router topk None", R, router(topk=None), TypeError, "topk")
bad("router topk numpy bool", R, router(topk=np.bool_(True)), TypeError, "topk")
good("router topk numpy int64", R, router(topk=np.int64(2)), routes_k(2))
good("router topk numpy int32", R, router(topk=np.int32(3)), routes_k(3))
good("router topk numpy uint8", R, router(topk=np.uint8(1)), routes_k(1))
bad("router score fn", R, router(score_function="relu"), ValueError, "score_function")
bad("router score fn None", R, router(score_function=None), ValueError, "score_function")
bad("router num_groups alone", R, router(num_groups=2), ValueError, "group_topk")
bad("router group_topk alone", R, router(group_topk=1), ValueError, "num_groups")
bad("router groups not dividing", R, router(num_groups=3, group_topk=1), ValueError, "num_groups")
bad("router num_groups 0", R, router(num_groups=0, group_topk=1), ValueError, "num_groups")
bad("router num_groups > E", R, router(num_groups=16, group_topk=1), ValueError, "num_groups")
bad("router group_topk > groups", R, router(num_groups=2, group_topk=3), ValueError, "group_topk")
bad("router num_groups float", R, router(num_groups=2.0, group_topk=1), TypeError, "num_groups")
bad("router group_topk bool", R, router(num_groups=2, group_topk=True), TypeError, "group_topk")
bad(
    "router TE group rule",
    R,
    router(num_groups=4, group_topk=3, topk=2),
    ValueError,
    "must divide topk",
)
good(
    "router groups numpy ints",
    R,
    router(num_groups=np.int64(2), group_topk=np.int64(1), topk=2),
    lambda out, a: torch.all(out[1].sum(-1) == 2),
)
bad("router scaling str", R, router(scaling_factor="2"), TypeError, "scaling_factor")
bad("router scaling bool", R, router(scaling_factor=True), TypeError, "scaling_factor")
bad("router scaling nan", R, router(scaling_factor=float("nan")), ValueError, "scaling_factor")
bad("router scaling inf", R, router(scaling_factor=float("inf")), ValueError, "finite")
good("router scaling numpy float", R, router(scaling_factor=np.float32(2.0)), routes_k(2))
bad("router bias shape", R, router(expert_bias=_zeros(E - 1)), ValueError, "expert_bias")
bad("router bias fp16", R, router(expert_bias=_zeros(E, dtype=torch.half)), TypeError, "bias")
bad("router bias list", R, router(expert_bias=[0.0] * E), TypeError, "expert_bias")
bad(
    "router bias strided",
    R,
    router(expert_bias=_zeros(2 * E)[::2]),
    ValueError,
    "expert_bias must be contiguous",
)
bad(
    "router bias with softmax",
    R,
    router(score_function="softmax", expert_bias=_zeros(E)),
    ValueError,
    "expert_bias",
)
bad("router map format str", R, router(routing_map_format="dense"), ValueError, "routing_map")
bad("router map format 2", R, router(routing_map_format=2), ValueError, "routing_map_format")
good(
    "router map format numpy 1",
    R,
    router(routing_map_format=np.int64(1)),
    lambda out, a: out[1].dtype == torch.uint8 and out[1].shape == (T, 1),
)
bad("router pre_softmax str", R, router(use_pre_softmax="yes"), TypeError, "use_pre_softmax")
bad(
    "router indices + bitmap",
    R,
    router(routing_map_format="bitmap_u8", topk_indices=_zeros(T, 2, dtype=torch.int32)),
    ValueError,
    "bitmap_u8",
)
bad(
    "router indices shape",
    R,
    router(topk_indices=_zeros(T, 3, dtype=torch.int32)),
    ValueError,
    "topk_indices",
)
bad("router indices float", R, router(topk_indices=_zeros(T, 2)), TypeError, "topk_indices")
bad(
    "router indices strided",
    R,
    router(topk_indices=_zeros(T, 4, dtype=torch.int32)[:, ::2]),
    ValueError,
    "topk_indices must be contiguous",
)
bad(
    "router indices int16 E>32767",
    R,
    router(logits=_logits(1, 32768), topk_indices=_zeros(1, 2, dtype=torch.int16)),
    ValueError,
    "int16 topk_indices",
)
bad("router selection", R, router(selection="fast"), ValueError, "selection")
bad("router tie_free no bias", R, router(selection="tie_free"), ValueError, "tie_free")
bad("router qb_binning", R, router(qb_binning="log"), ValueError, "qb_binning")
bad("router backend unknown", R, router(backend="cuda"), ValueError, "backend")
bad("router backend int", R, router(backend=3), ValueError, "backend")
bad("router approximate str", R, router(approximate_activation="no"), TypeError, "approximate_act")
bad("router approximate 2", R, router(approximate_activation=2), TypeError, "approximate_act")
bad("router logits meta", R, router(logits=torch.zeros(T, E, device="meta")), ValueError, "meta")
bad("router logits sparse", R, router(logits=torch.zeros(T, E).to_sparse()), TypeError, "dense")
_shared = _zeros(T * E)
bad(
    "router indices overlap logits",
    R,
    router(logits=_shared.view(T, E), topk_indices=_shared[: T * 2].view(torch.int32).view(T, 2)),
    ValueError,
    "topk_indices and logits overlap",
)
_shared = _zeros(E + T * 2)
bad(
    "router indices overlap bias",
    R,
    router(expert_bias=_shared[:E], topk_indices=_shared[E - 1 : E - 1 + T * 2].view(torch.int32).view(T, 2)),  # fmt: skip
    ValueError,
    "topk_indices and expert_bias overlap",
)

# Quantile Balancing arguments (the histogram is an in-place output: it must stay untouched)
bad("qb partial", R, router(qb_histogram=_zeros(E, 10, dtype=torch.int32)), ValueError, "together")
bad("qb softmax", R, qb(score_function="softmax", expert_bias=None), ValueError, "only supports")
bad("qb no bias", R, qb(expert_bias=None), ValueError, "expert_bias")
bad("qb groups", R, qb(num_groups=2, group_topk=1), ValueError, "ungrouped")
bad("qb topk == E", R, qb(topk=E), ValueError, "0 < topk < num_experts")
bad("qb hist int64", R, qb(qb_histogram=_zeros(E, 10, dtype=torch.int64)), TypeError, "qb_hist")
bad("qb hist wrong E", R, qb(qb_histogram=_zeros(E - 1, 10, dtype=torch.int32)), ValueError, "E=8")
bad("qb hist B=1", R, qb(qb_histogram=_zeros(E, 1, dtype=torch.int32)), ValueError, "B >= 2")
bad("qb hist 1-D", R, qb(qb_histogram=_zeros(E, dtype=torch.int32)), ValueError, "qb_histogram")
bad(
    "qb hist strided",
    R,
    qb(qb_histogram=_zeros(10, E, dtype=torch.int32).t()),
    ValueError,
    "qb_histogram must be contiguous",
)
bad("qb bounds shape", R, qb(qb_bin_bounds=_zeros(3)), ValueError, "qb_bin_bounds")
bad("qb bounds fp64", R, qb(qb_bin_bounds=_zeros(2, dtype=torch.float64)), TypeError, "bounds")
bad("qb bounds equal", R, qb(qb_bin_bounds=_f32([1.0, 1.0])), ValueError, "lower < upper")
bad("qb bounds reversed", R, qb(qb_bin_bounds=_f32([1.0, -1.0])), ValueError, "lower < upper")
bad("qb bounds nan", R, qb(qb_bin_bounds=_f32([float("nan"), 1.0])), ValueError, "finite")
bad("qb bounds inf", R, qb(qb_bin_bounds=_f32([-1.0, float("inf")])), ValueError, "finite")
bad("qb mode str", R, qb(qb_histogram_mode="atomic"), ValueError, "qb_histogram_mode")
bad("qb mode 2", R, qb(qb_histogram_mode=2), ValueError, "qb_histogram_mode")
bad("qb mode bool", R, qb(qb_histogram_mode=True), ValueError, "qb_histogram_mode")
good(
    "qb mode numpy 1",
    R,
    qb(qb_histogram_mode=np.int64(1)),
    lambda out, a: torch.all(a["qb_histogram"].sum(1).cpu() == T),
)
bad(
    "qb margin odd B",
    R,
    margin(qb_histogram=_zeros(E, 65, dtype=torch.int32)),
    ValueError,
    "even B",
)
bad(
    "qb margin B=32",
    R,
    margin(qb_histogram=_zeros(E, 32, dtype=torch.int32)),
    ValueError,
    "[64, 256]",
)
bad("qb margin bounds", R, margin(qb_bin_bounds=_f32([0.0] + [1.0] * (E - 1))), ValueError, "> 0")
bad("qb margin bounds [2]", R, margin(qb_bin_bounds=_f32([1.0, 1.0])), ValueError, "qb_bin_bounds")
bad("qb tie_free uniform", R, qb(selection="tie_free"), ValueError, "log_margin")
bad(
    "qb with bad indices",
    R,
    qb(topk_indices=_zeros(T, 5, dtype=torch.int32)),
    ValueError,
    "topk_indices",
)

# ---------------------------------------------------------------------------------------------
# biased_topk
# ---------------------------------------------------------------------------------------------
B = amdqb.biased_topk


def serving(**kw):
    args = dict(logits=_logits(), topk=2)
    args.update(kw)
    return args


def serving_check(k):
    def check(out, args):
        w, ids = out
        want_w, want_ids = ref.biased_topk(args["logits"].cpu(), k, args.get("expert_bias"))
        assert torch.equal(ids.cpu(), want_ids)

    return check


bad("serving E=0", B, serving(logits=_zeros(T, 0)), ValueError, "at least one expert")
bad("serving logits fp64", B, serving(logits=_logits(dtype=torch.float64)), TypeError, "logits")
bad("serving topk 0", B, serving(topk=0), ValueError, "topk")
bad("serving topk > E", B, serving(topk=E + 1), ValueError, "topk must be <= 8")
bad("serving topk bool", B, serving(topk=False), TypeError, "topk")
good("serving topk numpy", B, serving(topk=np.int64(3)), serving_check(3))
bad("serving bias shape", B, serving(expert_bias=_zeros(E + 1)), ValueError, "expert_bias")
bad("serving bias int", B, serving(expert_bias=_zeros(E, dtype=torch.int32)), TypeError, "bias")
bad("serving score fn", B, serving(score_function="tanh"), ValueError, "score_function")
bad("serving renormalize str", B, serving(renormalize="no"), TypeError, "renormalize")
bad("serving scaling nan", B, serving(scaling_factor=float("nan")), ValueError, "scaling_factor")
bad(
    "serving groups too small",
    B,
    serving(num_groups=4, group_topk=1, topk=3),
    ValueError,
    "exceeds",
)
bad(
    "serving biased groups of 1",
    B,
    serving(num_groups=8, group_topk=4, topk=2, expert_bias=_zeros(E)),
    ValueError,
    "at least 2 experts per group",
)
bad("serving backend", B, serving(backend="gpu"), ValueError, "backend")
bad("serving approximate str", B, serving(approximate_activation="yes"), TypeError, "approximate")
bad("serving bias meta", B, serving(expert_bias=torch.zeros(E, device="meta")), ValueError, "meta")

# ---------------------------------------------------------------------------------------------
# TE aux-loss ops
# ---------------------------------------------------------------------------------------------
S = amdqb.fused_compute_score_for_moe_aux_loss


def scores(**kw):
    args = dict(logits=_logits(), topk=2, score_function="softmax")
    args.update(kw)
    return args


bad("scores logits int", S, scores(logits=_zeros(T, E, dtype=torch.int64)), TypeError, "logits")
bad("scores E=0", S, scores(logits=_zeros(T, 0)), ValueError, "at least one expert")
bad("scores topk 0", S, scores(topk=0), ValueError, "topk")
bad("scores topk > E", S, scores(topk=9), ValueError, "topk")
bad("scores score fn", S, scores(score_function="exp"), ValueError, "score_function")
bad("scores map format", S, scores(routing_map_format="dense"), ValueError, "routing_map_format")
bad("scores backend", S, scores(backend="tpu"), ValueError, "backend")
good(
    "scores topk numpy",
    S,
    scores(topk=np.int16(2)),
    lambda out, a: torch.all(out[0].sum(-1) == 2),
)

A = amdqb.fused_moe_aux_loss


def aux(**kw):
    args = dict(
        probs=torch.rand(T, E, generator=_g()).to(DEVICE),
        tokens_per_expert=torch.arange(E, device=DEVICE),
        total_num_tokens=T,
        num_experts=E,
        topk=2,
        coeff=0.01,
    )
    args.update(kw)
    return args


def aux_equals_int_call(out, args):
    want = amdqb.fused_moe_aux_loss(
        args["probs"], args["tokens_per_expert"], T, E, 2, float(args["coeff"])
    )
    assert torch.equal(out, want)


bad("aux probs 1-D", A, aux(probs=_zeros(E)), ValueError, "probs")
bad("aux probs int", A, aux(probs=_zeros(T, E, dtype=torch.int32)), TypeError, "probs")
bad("aux tpe length", A, aux(tokens_per_expert=_zeros(E - 1)), ValueError, "tokens_per_expert")
bad(
    "aux tpe bool",
    A,
    aux(tokens_per_expert=_zeros(E, dtype=torch.bool)),
    TypeError,
    "tokens_per_expert",
)
bad("aux num_experts 0", A, aux(num_experts=0), ValueError, "num_experts")
bad("aux num_experts divide", A, aux(num_experts=3), ValueError, "multiple of num_experts")
bad("aux topk 0", A, aux(topk=0), ValueError, "topk")
bad("aux coeff str", A, aux(coeff="0.1"), TypeError, "coeff")
bad("aux coeff nan", A, aux(coeff=float("nan")), ValueError, "coeff must be finite")
bad("aux total 0", A, aux(total_num_tokens=0), ValueError, "total_num_tokens")
bad("aux total float", A, aux(total_num_tokens=2.5), TypeError, "total_num_tokens")
bad("aux total bool", A, aux(total_num_tokens=True), TypeError, "total_num_tokens")
bad(
    "aux total int32 tensor",
    A,
    aux(total_num_tokens=_i32(T)),
    TypeError,
    "total_num_tokens",
)
bad(
    "aux total 2 elements",
    A,
    aux(total_num_tokens=torch.tensor([T, T], device=DEVICE)),
    ValueError,
    "one-element",
)
bad("aux backend", A, aux(backend="x"), ValueError, "backend")
good("aux total numpy", A, aux(total_num_tokens=np.int64(T)), aux_equals_int_call)
good("aux num_experts numpy", A, aux(num_experts=np.int32(E)), aux_equals_int_call)
good("aux coeff numpy", A, aux(coeff=np.float64(0.01)), aux_equals_int_call)

# ---------------------------------------------------------------------------------------------
# moe_route_rows
# ---------------------------------------------------------------------------------------------
RR = amdqb.moe_route_rows


def route(**kw):
    args = dict(topk_ids=_i32([[0, 1], [2, 3], [4, 5], [6, 7]]), num_experts=E)
    args.update(kw)
    return args


def like_oracle(out, args):
    """Rows (as per-expert sets), counts and the updated counters equal the oracle's."""
    rows, counts = out
    c = args.get("counters")
    c0 = None if c is None else args["_c0"].clone()
    want_rows, want_counts = ref.moe_route_rows(
        args["topk_ids"].cpu(), int(args["num_experts"]), args.get("capacity"), c0
    )
    assert torch.equal(counts.cpu(), want_counts)
    if c is not None:
        assert torch.equal(c.cpu(), c0)
    ids = args["topk_ids"].reshape(-1).cpu().long()
    key = lambda r: torch.sort(ids * 2**33 + r.reshape(-1).cpu().long()).values  # noqa: E731
    assert torch.equal(key(rows), key(want_rows))


def counted(values, **kw):
    c = _i32(values)
    return route(counters=c, _c0=c.cpu().clone(), **kw)


def _route_call(**kw):
    kw.pop("_c0", None)
    return amdqb.moe_route_rows(**kw)


bad("route ids float", RR, route(topk_ids=_zeros(4, 2)), TypeError, "topk_ids")
bad("route ids int16", RR, route(topk_ids=_zeros(4, 2, dtype=torch.int16)), TypeError, "topk_ids")
bad("route ids 0-dim", RR, route(topk_ids=_i32(1)), ValueError, "topk_ids")
bad("route ids list", RR, route(topk_ids=[[0, 1]]), TypeError, "topk_ids")
bad("route E 0", RR, route(num_experts=0), ValueError, "num_experts")
bad("route E 2**31 (no allocation)", RR, route(num_experts=2**31), ValueError, "num_experts")
bad("route E 2**17", RR, route(num_experts=2**17), ValueError, "num_experts must be <= 65536")
bad("route E bool", RR, route(num_experts=True), TypeError, "num_experts")
bad("route E float", RR, route(num_experts=8.0), TypeError, "num_experts")
good("route E numpy", RR, route(num_experts=np.int64(E)), like_oracle)
bad("route capacity -1", RR, route(capacity=-1), ValueError, "capacity")
bad("route capacity float", RR, route(capacity=2.0), TypeError, "capacity")
bad("route capacity 2**31", RR, route(capacity=2**31), ValueError, "capacity")
bad("route rows overflow", RR, route(num_experts=2**16, capacity=2**16), ValueError, "int32 rows")
good("route capacity numpy", RR, route(capacity=np.int32(1)), like_oracle)
bad("route counters E", RR, route(counters=_zeros(E - 1, dtype=torch.int32)), ValueError, "counte")
bad("route counters int64", RR, route(counters=_zeros(E, dtype=torch.int64)), TypeError, "counte")
bad(
    "route counters strided",
    RR,
    route(counters=_zeros(2 * E, dtype=torch.int32)[::2]),
    ValueError,
    "counters must be contiguous",
)
bad("route impl", RR, route(impl="fast"), ValueError, "impl")
bad("route lds E > 4096", RR, route(num_experts=5000, impl="lds"), ValueError, "4096")
bad("route deterministic str", RR, route(deterministic="yes"), TypeError, "deterministic")
bad("route backend", RR, route(backend="cpu"), ValueError, "backend")
_ids_as_counters = _i32([1, 2, 1, 1, 1, 1, 1, 0])
bad(
    "route counters are the ids",
    RR,
    route(topk_ids=_ids_as_counters, counters=_ids_as_counters),
    ValueError,
    "counters and topk_ids overlap",
)
_shared = _zeros(E + 8, dtype=torch.int32)
bad(
    "route counters overlap expanded ids",
    RR,
    route(topk_ids=_shared[E + 3 : E + 4].expand(4, 2), counters=_shared[4 : 4 + E]),
    ValueError,
    "counters and topk_ids overlap",
)
_shared = _i32([0] * E + [0, 1, 2, 3, 4, 5, 6, 7])  # counters, then the ids: no shared byte
good(
    "route counters beside the ids",
    _route_call,
    route(topk_ids=_shared[E:].view(4, 2), counters=_shared[:E], _c0=torch.zeros(E, dtype=torch.int32)),  # fmt: skip
    like_oracle,
)
bad("route ids meta", RR, route(topk_ids=torch.zeros(4, 2, dtype=torch.int32, device="meta")), ValueError, "meta")  # fmt: skip
good("route negative counters drop", _route_call, counted([-100000] * E), like_oracle)
good("route mixed counters", _route_call, counted([-1, 0, 5, -2, 3, 0, -7, 1]), like_oracle)
good(
    "route counters near int32 max",
    _route_call,
    counted([2**31 - 1, 2**31 - 2, 0, 0, 2**31 - 1, 0, 0, 2**30]),
    like_oracle,
)
good(
    "route negative counters capacity",
    _route_call,
    counted([-1, 0, 1, 2, -5, 0, 0, 0], capacity=2),
    like_oracle,
)
good(
    "route ids out of range",
    RR,
    route(topk_ids=torch.tensor([[-1, 8], [2**40, -(2**40)]], device=DEVICE)),
    lambda out, a: torch.all(out[0] == -1) and torch.all(out[1] == 0),
)

# ---------------------------------------------------------------------------------------------
# moe_align_block_size
# ---------------------------------------------------------------------------------------------
AL = amdqb.moe_align_block_size


def align(**kw):
    args = dict(topk_ids=_i32([[0, 1], [2, 3]]), block_size=4, num_experts=E)
    args.update(kw)
    return args


def align_like_oracle(out, args):
    want = ref.moe_align_block_size(
        args["topk_ids"].cpu(), int(args["block_size"]), int(args["num_experts"])
    )
    assert all(torch.equal(a.cpu(), b) for a, b in zip(out, want))


bad("align block 0", AL, align(block_size=0), ValueError, "block_size")
bad("align block float", AL, align(block_size=4.0), TypeError, "block_size")
bad("align block 2**31", AL, align(block_size=2**31), ValueError, "block_size")
bad("align padding absurd", AL, align(block_size=2**20, num_experts=1024), ValueError, "padding")
bad("align E 0", AL, align(num_experts=0), ValueError, "num_experts")
bad("align E 2**31", AL, align(num_experts=2**31), ValueError, "num_experts")
bad("align map shape", AL, align(expert_map=_zeros(3, dtype=torch.int32)), ValueError, "expert_map")
bad("align map float", AL, align(expert_map=_zeros(E)), TypeError, "expert_map")
bad("align pad str", AL, align(pad_sorted_ids="x"), TypeError, "pad_sorted_ids")
bad("align ids float", AL, align(topk_ids=_zeros(2, 2)), TypeError, "topk_ids")
bad("align backend", AL, align(backend="vllm"), ValueError, "backend")
good("align block numpy", AL, align(block_size=np.int64(4)), align_like_oracle)
good("align E numpy", AL, align(num_experts=np.int16(E)), align_like_oracle)

# ---------------------------------------------------------------------------------------------
# moe_sort_chunks_and_pad / moe_unpad_and_restore_chunks
# ---------------------------------------------------------------------------------------------
SC = amdqb.moe_sort_chunks_and_pad
UR = amdqb.moe_unpad_and_restore_chunks


def chunks(**kw):
    args = dict(
        inp=torch.randn(6, 4, generator=_g()).to(DEVICE),
        split_sizes=_i32([2, 4]),
        sorted_indices=_i32([1, 0]),
        output_split_sizes=_i32([4, 4]),
        num_out_tokens=8,
    )
    args.update(kw)
    return args


def chunks_like_oracle(out, args):
    a = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    a.pop("backend", None)
    a["num_out_tokens"] = int(a["num_out_tokens"])
    want_out, want_p, want_map = ref.moe_sort_chunks_and_pad(**a)
    assert torch.equal(out[0].cpu(), want_out) and torch.equal(out[2].cpu(), want_map)


bad("chunks indices length", SC, chunks(sorted_indices=_i32([0, 1, 2])), ValueError, "sorted_ind")
bad("chunks out sizes length", SC, chunks(output_split_sizes=_i32([8])), ValueError, "output_split")
bad("chunks num_out too small", SC, chunks(num_out_tokens=5), ValueError, "num_out_tokens")
bad("chunks num_out 2**31", SC, chunks(num_out_tokens=2**31), ValueError, "num_out_tokens")
bad("chunks num_out float", SC, chunks(num_out_tokens=8.0), TypeError, "num_out_tokens")
bad("chunks sizes float", SC, chunks(split_sizes=_f32([2.0, 4.0])), TypeError, "split_sizes")
bad("chunks sizes 2-D", SC, chunks(split_sizes=_i32([[2, 4]])), ValueError, "split_sizes")
bad("chunks sizes empty", SC, chunks(split_sizes=_i32([])), ValueError, "split_sizes")
bad(
    "chunks sizes strided",
    SC,
    chunks(split_sizes=_i32([2, 0, 4, 0])[::2]),
    ValueError,
    "split_sizes must be contiguous",
)
bad("chunks inp 1-D", SC, chunks(inp=_zeros(6)), ValueError, "inp")
bad("chunks inp int", SC, chunks(inp=_zeros(6, 4, dtype=torch.int32)), TypeError, "inp")
bad("chunks probs shape", SC, chunks(probs=_zeros(5)), ValueError, "probs")
bad("chunks probs int", SC, chunks(probs=_zeros(6, dtype=torch.int64)), TypeError, "probs")
bad("chunks backend", SC, chunks(backend="hipblas"), ValueError, "backend")
good("chunks num_out numpy", SC, chunks(num_out_tokens=np.int64(8)), chunks_like_oracle)
good(
    "chunks index out of range -> padding",
    SC,
    chunks(sorted_indices=_i32([7, -1])),
    lambda out, a: torch.all(out[2] == -1) and torch.all(out[0] == 0),
)
good(
    "chunks sizes past the input -> dropped",
    SC,
    chunks(split_sizes=_i32([2, 40]), output_split_sizes=_i32([40, 4]), num_out_tokens=44),
    chunks_like_oracle,
)
good(
    "chunks negative sizes -> zero",
    SC,
    chunks(split_sizes=_i32([-2, 6]), output_split_sizes=_i32([-4, 12]), num_out_tokens=12),
    chunks_like_oracle,
)
good(
    "chunks duplicate index",
    SC,
    chunks(sorted_indices=_i32([0, 0])),
    chunks_like_oracle,
)


def restore(**kw):
    args = dict(inp=torch.randn(4, 3, generator=_g()).to(DEVICE), row_map=_i32([1, -1, 0, 2]))
    args["num_tokens"] = 3
    args.update(kw)
    return args


def restore_like_oracle(out, args):
    want = ref.moe_unpad_and_restore_chunks(
        args["inp"].cpu(), args["row_map"].cpu(), int(args["num_tokens"])
    )
    assert torch.equal(out.cpu(), want)


bad("restore map length", UR, restore(row_map=_i32([0, 1, 2])), ValueError, "row_map has 3")
bad("restore map int64", UR, restore(row_map=_zeros(4, dtype=torch.int64)), TypeError, "row_map")
bad("restore map 2-D", UR, restore(row_map=_zeros(4, 1, dtype=torch.int32)), ValueError, "row_map")
bad("restore num_tokens -1", UR, restore(num_tokens=-1), ValueError, "num_tokens")
bad("restore num_tokens 2**31", UR, restore(num_tokens=2**31), ValueError, "num_tokens")
bad("restore num_tokens bool", UR, restore(num_tokens=True), TypeError, "num_tokens")
bad("restore inp 1-D", UR, restore(inp=_zeros(4)), ValueError, "inp")
bad("restore backend", UR, restore(backend="x"), ValueError, "backend")
good("restore num_tokens numpy", UR, restore(num_tokens=np.int32(3)), restore_like_oracle)
good(
    "restore map out of range -> skipped",
    UR,
    restore(row_map=_i32([7, -5, 0, 3])),
    restore_like_oracle,
)

# ---------------------------------------------------------------------------------------------
# QB recovery and step
# ---------------------------------------------------------------------------------------------
QR = amdqb.qb_recover_bias
QS = amdqb.qb_step_


def hist(e=E, b=10):
    return torch.randint(0, 5, (e, b), generator=_g(), dtype=torch.int32).to(DEVICE)


def recover(**kw):
    args = dict(histogram=hist(), bin_bounds=_f32([-1.0, 1.0]), topk=2)
    args.update(kw)
    return args


def step(**kw):
    args = dict(bias=_zeros(E), histogram=hist(), bin_bounds=_f32([-1.0, 1.0]), topk=2)
    args.update(kw)
    return args


bad("recover hist 1-D", QR, recover(histogram=_zeros(E, dtype=torch.int32)), ValueError, "histog")
bad("recover hist float", QR, recover(histogram=_zeros(E, 10)), TypeError, "histogram")
bad("recover hist E=1", QR, recover(histogram=hist(1, 10), topk=1), ValueError, "E >= 2")
bad("recover hist B=1", QR, recover(histogram=hist(E, 1)), ValueError, "2 <= B")
bad(
    "recover hist B too large",
    QR,
    recover(histogram=_zeros(2, (1 << 20) + 1, dtype=torch.int32), topk=1),
    ValueError,
    "B <= 1048576",
)
bad(
    "recover hist strided",
    QR,
    recover(histogram=hist(10, E).t()),
    ValueError,
    "histogram must be contiguous",
)
bad("recover bounds reversed", QR, recover(bin_bounds=_f32([1.0, -1.0])), ValueError, "bin_bou")
bad("recover bounds nan", QR, recover(bin_bounds=_f32([float("nan"), 1.0])), ValueError, "finite")
bad("recover bounds inf", QR, recover(bin_bounds=_f32([-float("inf"), 1.0])), ValueError, "finite")
bad("recover bounds shape", QR, recover(bin_bounds=_f32([1.0])), ValueError, "bin_bounds")
bad("recover topk 0", QR, recover(topk=0), ValueError, "topk")
bad("recover topk == E", QR, recover(topk=E), ValueError, "topk must be <= 7")
bad("recover topk float", QR, recover(topk=1.5), TypeError, "topk")
bad("recover binning", QR, recover(binning="log"), ValueError, "binning")
bad(
    "recover margin no bias",
    QR,
    recover(binning="log_margin", histogram=hist(E, 64), bin_bounds=_f32([10.0] * E)),
    ValueError,
    "expert_bias",
)
bad(
    "recover margin odd B",
    QR,
    recover(binning="log_margin", histogram=hist(E, 65), bin_bounds=_f32([10.0] * E)),
    ValueError,
    "even B",
)
bad("recover backend", QR, recover(backend="x"), ValueError, "backend")
good(
    "recover topk numpy",
    QR,
    recover(topk=np.int64(2)),
    lambda out, a: torch.equal(
        out.cpu(), ref.qb_recover_bias(a["histogram"].cpu(), a["bin_bounds"].cpu(), 2)
    ),
)
bad("step ema 1", QS, step(ema=1.0), ValueError, "ema")
bad("step ema negative", QS, step(ema=-0.1), ValueError, "ema")
bad("step ema nan", QS, step(ema=float("nan")), ValueError, "ema")
bad("step ema str", QS, step(ema="0.5"), TypeError, "ema")
bad("step bias shape", QS, step(bias=_zeros(E + 1)), ValueError, "bias")
bad("step bias fp16", QS, step(bias=_zeros(E, dtype=torch.half)), TypeError, "bias")
bad("step rejected dtype", QS, step(rejected=_zeros(1)), TypeError, "rejected")
bad("step rejected shape", QS, step(rejected=_zeros(2, dtype=torch.int32)), ValueError, "rejected")
bad("step bounds invalid", QS, step(bin_bounds=_f32([2.0, 2.0])), ValueError, "bin_bounds")
bad("step backend", QS, step(backend="x"), ValueError, "backend")

QE = amdqb.qb_exact_bias
bad(
    "exact E=1",
    QE,
    dict(logits=_logits(4, 1), topk=1, expert_bias=_zeros(1)),
    ValueError,
    "at least 2 experts",
)
bad("exact topk 0", QE, dict(logits=_logits(), topk=0, expert_bias=_zeros(E)), ValueError, "topk")
bad("exact topk E", QE, dict(logits=_logits(), topk=E, expert_bias=_zeros(E)), ValueError, "topk")
bad(
    "exact bias shape",
    QE,
    dict(logits=_logits(), topk=2, expert_bias=_zeros(3)),
    ValueError,
    "expert_bias",
)
bad(
    "exact logits int",
    QE,
    dict(logits=_zeros(T, E, dtype=torch.int32), topk=2, expert_bias=_zeros(E)),
    TypeError,
    "logits",
)

# ---------------------------------------------------------------------------------------------
# QuantileBalancer
# ---------------------------------------------------------------------------------------------
QB = amdqb.QuantileBalancer
bad("balancer E 1", QB, dict(num_experts=1, topk=1), ValueError, "num_experts")
bad("balancer E 2**17", QB, dict(num_experts=2**17, topk=2), ValueError, "num_experts")
bad("balancer E float", QB, dict(num_experts=8.0, topk=2), TypeError, "num_experts")
bad("balancer topk 0", QB, dict(num_experts=E, topk=0), ValueError, "topk")
bad("balancer topk E", QB, dict(num_experts=E, topk=E), ValueError, "topk")
bad("balancer binning", QB, dict(num_experts=E, topk=2, binning="log"), ValueError, "binning")
bad("balancer selection", QB, dict(num_experts=E, topk=2, selection="x"), ValueError, "selection")
bad(
    "balancer tie_free uniform",
    QB,
    dict(num_experts=E, topk=2, binning="uniform", selection="tie_free"),
    ValueError,
    "log_margin",
)
bad("balancer bins 1", QB, dict(num_experts=E, topk=2, num_bins=1), ValueError, "num_bins")
bad("balancer bins odd", QB, dict(num_experts=E, topk=2, num_bins=65), ValueError, "even")
bad("balancer bins 62", QB, dict(num_experts=E, topk=2, num_bins=62), ValueError, ">= 64")
bad("balancer bins > 256", QB, dict(num_experts=E, topk=2, num_bins=300), ValueError, "num_bins")
bad(
    "balancer histogram absurd",
    QB,
    dict(num_experts=2**16, topk=2, binning="uniform", num_bins=2**16),
    ValueError,
    "histogram counts",
)
bad("balancer ema 1", QB, dict(num_experts=E, topk=2, ema=1.0), ValueError, "ema")
bad("balancer ema nan", QB, dict(num_experts=E, topk=2, ema=float("nan")), ValueError, "ema")
bad("balancer device", QB, dict(num_experts=E, topk=2, device="tpu:0"), ValueError, "device")
bad(
    "balancer device cuda",
    QB,
    dict(num_experts=E, topk=2, device="cuda"),
    ValueError,
    "not available",
    skip="a GPU is present" if HAS_GPU else None,
)
good(
    "balancer numpy ints",
    QB,
    dict(num_experts=np.int64(E), topk=np.int32(2), num_bins=np.int64(64), device=DEVICE),
    lambda bal, a: bal.histogram.shape == (3, E, 64) and isinstance(bal.topk, int),
)


def _balancer():
    bal = amdqb.QuantileBalancer(E, 2, device=DEVICE)
    g = _g(3)
    bal.route(torch.randn(32, E, generator=g).to(DEVICE), accumulate=True)
    bal.step()
    bal.route(torch.randn(16, E, generator=g).to(DEVICE), accumulate=True)  # pending counts
    return bal


def _balancer_state(bal):
    return {
        "bias": bal.bias,
        "bin_bounds": bal.bin_bounds,
        "histogram": bal.histogram,
        "rejected_steps": bal.rejected_steps,
        "committed": bal._committed,
        "pending": bal._pending_tokens,
        "ema": bal.ema,
    }


BAL = _balancer()


def _route(**kw):
    return BAL.route(**kw)


def _step(**kw):
    return BAL.step(**kw)


def _load(**kw):
    return BAL.load_state_dict(kw["state"])


def _state(**kw):
    state = BAL.state_dict()
    state.update(kw)
    return {"state": state}


balancer_state = lambda: _balancer_state(BAL)  # noqa: E731
bad(
    "bal.route wrong width",
    _route,
    dict(logits=_logits(T, E + 1)),
    ValueError,
    "logits must have num_experts=8",
    extra=balancer_state,
)
bad("bal.route not a tensor", _route, dict(logits=[1.0]), TypeError, "logits", extra=balancer_state)
bad(
    "bal.route accumulate str",
    _route,
    dict(logits=_logits(), accumulate="y"),
    TypeError,
    "accumulate",
    extra=balancer_state,
)
bad(
    "bal.route mode",
    _route,
    dict(logits=_logits(), accumulate=True, histogram_mode="x"),
    ValueError,
    "qb_histogram_mode",
    extra=balancer_state,
)
bad(
    "bal.route logits fp64",
    _route,
    dict(logits=_logits(dtype=torch.float64), accumulate=True),
    TypeError,
    "logits",
    extra=balancer_state,
)
bad(
    "bal.route backend",
    _route,
    dict(logits=_logits(), accumulate=True, backend="x"),
    ValueError,
    "backend",
    extra=balancer_state,
)
bad("bal.step backend", _step, dict(backend="x"), ValueError, "backend", extra=balancer_state)
bad("bal.load not a dict", _load, {"state": [1]}, TypeError, "dict", extra=balancer_state)
bad(
    "bal.load missing key",
    _load,
    {"state": {"bias": _zeros(E)}},
    ValueError,
    "missing",
    extra=balancer_state,
)
bad("bal.load ema 5", _load, _state(ema=5.0), ValueError, "ema", extra=balancer_state)
bad(
    "bal.load bias nan",
    _load,
    _state(bias=_f32([float("nan")] * E)),
    ValueError,
    "finite",
    extra=balancer_state,
)
bad(
    "bal.load bias shape",
    _load,
    _state(bias=_zeros(E + 1)),
    ValueError,
    "bias",
    extra=balancer_state,
)
bad(
    "bal.load bounds",
    _load,
    _state(bin_bounds=_f32([1.0] * (E - 1) + [-1.0])),
    ValueError,
    "bin_bounds",
    extra=balancer_state,
)
bad("bal.load topk", _load, _state(topk=3), ValueError, "topk=3", extra=balancer_state)
bad(
    "bal.load binning",
    _load,
    _state(binning="uniform"),
    ValueError,
    "binning",
    extra=balancer_state,
)

# ---------------------------------------------------------------------------------------------
# Baseline update, load metrics, the bounds marker, device_info
# ---------------------------------------------------------------------------------------------
AF = amdqb.aux_free_bias_update_
bad("aux_free bias int", AF, dict(bias=_zeros(E, dtype=torch.int32), tokens_per_expert=_zeros(E)), TypeError, "bias")  # fmt: skip
bad("aux_free tpe shape", AF, dict(bias=_zeros(E), tokens_per_expert=_zeros(E - 1)), ValueError, "tokens_per_expert")  # fmt: skip
bad("aux_free tpe bool", AF, dict(bias=_zeros(E), tokens_per_expert=_zeros(E, dtype=torch.bool)), TypeError, "tokens_per_expert")  # fmt: skip
bad("aux_free rate nan", AF, dict(bias=_zeros(E), tokens_per_expert=_zeros(E), rate=float("nan")), ValueError, "rate")  # fmt: skip
bad("aux_free rate str", AF, dict(bias=_zeros(E), tokens_per_expert=_zeros(E), rate="1"), TypeError, "rate")  # fmt: skip
_shared = _zeros(E + 2)
bad("aux_free bias overlaps tpe", AF, dict(bias=_shared[:E], tokens_per_expert=_shared[2:]), ValueError, "bias and tokens_per_expert overlap")  # fmt: skip

MV, CV = amdqb.maxvio, amdqb.cv2
zero = lambda out, a: out.shape == () and float(out) == 0.0  # noqa: E731
good("maxvio empty", MV, dict(tokens_per_expert=_zeros(0)), zero)
good("maxvio no tokens", MV, dict(tokens_per_expert=_zeros(E, dtype=torch.int64)), zero)
good("cv2 empty", CV, dict(tokens_per_expert=_zeros(0, dtype=torch.int32)), zero)
good("maxvio balanced", MV, dict(tokens_per_expert=torch.full((E,), 3, device=DEVICE)), zero)
bad("maxvio 2-D", MV, dict(tokens_per_expert=_zeros(2, E)), ValueError, "tokens_per_expert")
bad("maxvio list", MV, dict(tokens_per_expert=[1, 2]), TypeError, "tokens_per_expert")
bad("cv2 bool", CV, dict(tokens_per_expert=_zeros(E, dtype=torch.bool)), TypeError, "tokens_per")
nan = lambda out, a: out.shape == () and bool(torch.isnan(out))  # noqa: E731
good("maxvio nan load", MV, dict(tokens_per_expert=_f32([float("nan"), 1.0, 2.0])), nan)
good("maxvio inf load", MV, dict(tokens_per_expert=_f32([float("inf"), 1.0, 2.0])), nan)
good("cv2 nan load", CV, dict(tokens_per_expert=_f32([float("nan"), 1.0, 2.0])), nan)

MK = amdqb.mark_qb_bin_bounds_validated
bad("mark bounds shape", MK, dict(bin_bounds=_zeros(2, 2)), ValueError, "bin_bounds")
bad("mark bounds fp64", MK, dict(bin_bounds=_zeros(2, dtype=torch.float64)), TypeError, "bin_b")

DI = amdqb.device_info
bad("device_info bad name", DI, dict(device="tpu:0"), ValueError, "device")
bad("device_info bad type", DI, dict(device=3.5), ValueError, "device")
bad(
    "device_info cuda without GPU",
    DI,
    dict(device="cuda"),
    ValueError,
    "not available",
    skip="a GPU is present" if HAS_GPU else None,
)
good("device_info cpu", DI, dict(device="cpu"), lambda out, a: out.vendor == "cpu")

# ---------------------------------------------------------------------------------------------
# amdqb.compat.te
# ---------------------------------------------------------------------------------------------
TR = te.fused_topk_with_score_function


def te_router(**kw):
    args = dict(
        logits=_logits(),
        topk=2,
        use_pre_softmax=False,
        num_groups=None,
        group_topk=None,
        scaling_factor=None,
        score_function="sigmoid",
        expert_bias=None,
    )
    args.update(kw)
    return args


bad("te map format bool", TR, te_router(routing_map_format=True), TypeError, "routing_map_format")
bad("te map format 3", TR, te_router(routing_map_format=3), ValueError, "routing_map_format")
bad("te map format upper", TR, te_router(routing_map_format="BYTEMAP"), ValueError, "lowercase")
bad("te map format float", TR, te_router(routing_map_format=1.5), TypeError, "routing_map_format")
bad("te logits fp64", TR, te_router(logits=_logits(dtype=torch.float64)), ValueError, "logits")
bad("te topk 0", TR, te_router(topk=0), ValueError, "topk")
bad("te qb bad mode", TR, te_router(**{k: v for k, v in qb(qb_histogram_mode="x").items() if k != "logits"}), ValueError, "qb_histogram_mode")  # fmt: skip
good(
    "te map format numpy 1",
    TR,
    te_router(routing_map_format=np.int64(1)),
    lambda out, a: out[1].dtype == torch.uint8,
)
good(
    "te map format enum",
    TR,
    te_router(routing_map_format=te.RoutingMapFormat.BITMAP_U8),
    lambda out, a: out[1].dtype == torch.uint8,
)
QF = te.fused_topk_with_score_function_qb_fwd


def te_qb(**kw):
    args = dict(
        logits=_logits(),
        topk=2,
        scaling_factor=None,
        expert_bias=_zeros(E),
        routing_map_format=0,
        topk_indices=None,
        histogram=_zeros(E, 10, dtype=torch.int32),
        bin_bounds=_f32([-1.0, 1.0]),
        histogram_mode=te.QBHistogramMode.TWO_KERNEL,
    )
    args.update(kw)
    return args


bad("te qb_fwd bounds", QF, te_qb(bin_bounds=_f32([1.0, 0.0])), RuntimeError, "lower < upper")
bad("te qb_fwd mode", QF, te_qb(histogram_mode=5), ValueError, "qb_histogram_mode")
bad("te qb_fwd hist", QF, te_qb(histogram=_zeros(E, 10)), TypeError, "qb_histogram")
TA = te.fused_moe_aux_loss
bad("te aux coeff nan", TA, aux(coeff=float("nan")), ValueError, "coeff")
bad("te aux num_experts 0", TA, aux(num_experts=0), ValueError, "num_experts")
TS = te.fused_compute_score_for_moe_aux_loss
bad("te scores map 1.5", TS, scores(routing_map_format=1.5), TypeError, "routing_map_format")
bad("te scores fp64", TS, scores(logits=_logits(dtype=torch.float64)), ValueError, "logits")


# ---------------------------------------------------------------------------------------------
# The runner: error + message, state bitwise unchanged; or the documented result.
# ---------------------------------------------------------------------------------------------
def _tensors(obj, path="args"):
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{path}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{path}[{i}]")


def _bytes(t):
    """A tensor's values as bytes (a sparse tensor's dense values; a meta tensor holds none)."""
    if t.is_meta:
        return torch.zeros(0, dtype=torch.uint8)
    if t.layout != torch.strided:
        t = t.to_dense()
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def _snapshot(case):
    state = {"args": case.args, "extra": case.extra() if case.extra else {}}
    tensors = {p: (t, _bytes(t)) for p, t in _tensors(state)}
    scalars = {k: v for k, v in state["extra"].items() if not isinstance(v, torch.Tensor)}
    return tensors, scalars


def _assert_unchanged(case, before):
    tensors, scalars = before
    for path, (t, data) in tensors.items():
        now = _bytes(t)
        assert now.shape == data.shape and torch.equal(now, data), f"{path} changed"
    if case.extra:
        now = case.extra()
        for key, value in scalars.items():
            assert now[key] == value, f"{key} changed: {value} -> {now[key]}"


def _call(case):
    args = dict(case.args)
    return case.call(**args)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(case):
    if case.skip:
        pytest.skip(case.skip)
    before = _snapshot(case)
    if case.error is not None:
        exc, fragment = case.error
        with pytest.raises(exc) as info:
            _call(case)
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"
        _assert_unchanged(case, before)
    else:
        result = _call(case)
        ok = case.check(result, case.args)
        assert ok is None or bool(ok), f"documented result does not hold: {result!r}"


def test_table_size():
    rejections = sum(c.error is not None for c in CASES)
    assert len(CASES) >= 150 and rejections >= 120, (len(CASES), rejections)
    assert len({c.name for c in CASES}) == len(CASES), "case names must be unique"
