"""The backend contract (``amdqb.backends``): every backend's ``router_fwd`` / ``router_bwd`` /
``biased_topk`` / ``align_block_size`` takes exactly ``(call: RouterCall, *ROUTER_FWD_TENSORS)`` /
``(call: RouterCall, *ROUTER_BWD_TENSORS)`` / ``(call: TopkCall, *TOPK_TENSORS)`` /
``(call: AlignCall, *ALIGN_TENSORS)``; and the router honours every field of its call: for each field a
pair of calls that differ in it alone gives the oracle's outputs both times (where the oracle's
two outputs differ, so a backend that ignored the field would fail one of them), or -- for the
fields whose two values must give the same outputs -- the same outputs by a different path.

Backends: torch (the oracle), triton (the interpreter on the CPU) and hip (the host emulator on
the CPU, wave32 and wave64; the device on a GPU), called directly through their ``OPS``.
"""

import contextlib
import dataclasses
import inspect
import typing

import pytest
import torch

from amdqb import dispatch, ref
from amdqb.backends import calls
from amdqb.backends.calls import (
    ALIGN_TENSORS,
    ROUTER_BWD_TENSORS,
    ROUTER_FWD_TENSORS,
    TOPK_TENSORS,
    AlignCall,
    RouterCall,
    TopkCall,
)
from amdqb.ref.router import qb_cutoff_and_routes, sigmoid_complement, unpack_bitmap

from conftest import DEVICE, HAS_GPU, gpu_kernel_names, over_backends
from router_cases import E_MAIN as E
from router_cases import GROUPS
from router_cases import K_MAIN as K
from router_cases import T_MAIN as T

B = 16


@pytest.mark.parametrize(
    "op,tensors,call_type",
    [
        ("router_fwd", ROUTER_FWD_TENSORS, RouterCall),
        ("router_bwd", ROUTER_BWD_TENSORS, RouterCall),
        ("biased_topk", TOPK_TENSORS, TopkCall),
        ("align_block_size", ALIGN_TENSORS, AlignCall),
    ],
)
@pytest.mark.parametrize("backend", dispatch.BACKENDS)
def test_entry_points_take_exactly_the_call_type(op, tensors, call_type, backend):
    fn = dispatch._backend_module(backend).OPS.get(op)
    if fn is None:
        assert backend == "hip" and op == "router_bwd", f"{backend} lacks {op}"
        return
    params = list(inspect.signature(fn).parameters.values())
    assert [p.name for p in params] == ["call", *tensors]
    assert all(p.default is inspect.Parameter.empty for p in params), "no defaults: one ABI"
    target = inspect.unwrap(fn)
    assert typing.get_type_hints(target)["call"] is call_type


def test_call_type_is_frozen_and_checked():
    call = RouterCall(E, K)
    with pytest.raises(dataclasses.FrozenInstanceError):
        call.topk = 3
    assert hash(call) == hash(RouterCall(E, K))
    for bad in (
        dict(score_function="relu"),
        dict(map_kind="dense"),
        dict(qb_mode="atomic", num_bins=B),
        dict(qb_mode="two_kernel"),  # num_bins missing
        dict(num_bins=B),  # without qb_mode
        dict(write_cutoff=True),  # without QB
        dict(num_groups=4),  # without group_topk
        dict(qb_moments=True),  # without QB
        dict(qb_mode="two_kernel", num_bins=B, qb_moments=True),  # uniform binning
    ):
        with pytest.raises(ValueError, match="RouterCall"):
            RouterCall(E, K, **bad)
    assert calls.field_values(call)[:2] == (E, K)


# ------------------------------------------------------------------------------------------------
# every field honoured
# ------------------------------------------------------------------------------------------------
def _inputs(kind):
    g = torch.Generator().manual_seed(7)
    z = torch.randn(T, E, generator=g) * 2
    bias = torch.randn(E, generator=g) * 0.2
    if kind == "saturated":
        # sigmoid saturates at 1.0: fp32 s + b ties every expert whose bias rounds away, the
        # tie-free selection (b - sigmoid(-z)) still ranks them
        z = 20.0 + torch.rand(T, E, generator=g) * 8
        bias = torch.arange(E, dtype=torch.float32) * 1e-9
    return z.to(DEVICE), bias.to(DEVICE)


def _bounds(call):
    if call.qb_binning == "uniform":
        return torch.tensor([-1.5, 1.5], device=DEVICE)
    return torch.logspace(2, 4, call.num_experts, device=DEVICE)  # per-expert inverse scales


def _hist(call, device):
    """The call's zeroed QB histogram: int32 [E, B], or int64 [3, E, B] with the moments."""
    if not call.qb:
        return None
    if call.qb_moments:
        return torch.zeros(3, E, call.num_bins, dtype=torch.int64, device=device)
    return torch.zeros(E, call.num_bins, dtype=torch.int32, device=device)


def _run(fn, call, z, bias):
    """One direct call with poisoned outputs; the routing map read back as a bool mask."""
    probs = torch.full((T, E), 7.0, device=DEVICE)
    if call.map_kind == "bytemap":
        map_out = torch.ones(T, E, dtype=torch.bool, device=DEVICE)
    elif call.map_kind == "bitmap":
        map_out = torch.full((T, (E + 7) // 8), 0xA5, dtype=torch.uint8, device=DEVICE)
    else:
        map_out = torch.full((T, call.topk), -7, dtype=torch.int32, device=DEVICE)
    hist = _hist(call, DEVICE)
    bounds = _bounds(call) if call.qb else None
    scores = torch.full((T, E), 7.0, device=DEVICE) if call.write_scores else None
    cutoff = torch.full((T,), 7.0, device=DEVICE) if call.write_cutoff else None
    bias = bias if call.score_function != "softmax" else None
    fn(call, z, bias, probs, map_out, hist, bounds, scores, cutoff)
    if call.map_kind == "bitmap":
        mask = unpack_bitmap(map_out, E)
    elif call.map_kind == "indices":
        mask = torch.zeros(T, E, dtype=torch.bool, device=DEVICE).scatter_(1, map_out.long(), True)
    else:
        mask = map_out
    ids = map_out.long() if call.map_kind == "indices" else None
    return dict(
        probs=probs, map=mask, ids=ids, hist=hist, scores=scores, cutoff=cutoff, raw=map_out
    )


def _torch_fwd():
    return dispatch._backend_module("torch").OPS["router_fwd"]


def _expected(call, z, bias, s):
    """The oracle's outputs of ``call`` with its activations replaced by ``s`` (a kernel's own:
    they may differ from torch's by an ulp), so that routes, histograms and cutoffs compare
    exactly."""
    zc = z.cpu().float()
    elementwise = call.score_function != "softmax"
    b = bias.cpu() if elementwise else None
    comp = sigmoid_complement(zc) if call.selection == "tie_free" else None
    hist = _hist(call, "cpu")
    probs, idx, routed = ref.fused_topk_with_score_function(
        zc,
        call.topk,
        use_pre_softmax=call.use_pre_softmax,
        num_groups=call.num_groups,
        group_topk=call.group_topk,
        scaling_factor=call.scaling_factor,
        score_function=call.score_function,
        expert_bias=b,
        qb_histogram=hist,
        qb_bin_bounds=_bounds(call).cpu() if call.qb else None,
        scores=s.cpu() if elementwise else None,
        selection=call.selection,
        qb_binning=call.qb_binning,
        complements=comp,
    )
    cutoff = None
    if call.write_cutoff:
        cutoff = qb_cutoff_and_routes(s.cpu(), b, call.topk, call.selection, comp)[1]
    return dict(probs=probs, map=routed, ids=idx, hist=hist, cutoff=cutoff)


def _differ(a, b):
    return any(
        (x is None) != (y is None) or (x is not None and not torch.equal(x, y))
        for x, y in (
            (a[k], b[k]) for k in ("probs", "map", "ids", "hist", "scores", "cutoff", "raw")
        )
    )


BASE = RouterCall(E, K, "sigmoid")
SOFTMAX = RouterCall(E, K, "softmax")
QB = RouterCall(E, K, "sigmoid", qb_mode="fused_atomic", num_bins=B)
QB2 = dataclasses.replace(QB, qb_mode="two_kernel")
MARGIN = dataclasses.replace(QB, selection="tie_free", qb_binning="log_margin")
MARGIN64 = dataclasses.replace(MARGIN, num_bins=64)  # 16 fine keys a side: moments to sum
_r = dataclasses.replace
# (fields, base call, variant, inputs): the two calls differ in those fields alone
VARIANTS = [
    ("topk", BASE, _r(BASE, topk=K + 1), "random"),
    ("score_function", BASE, _r(BASE, score_function="sqrtsoftplus"), "random"),
    ("use_pre_softmax", SOFTMAX, _r(SOFTMAX, use_pre_softmax=True), "random"),
    ("num_groups/group_topk", BASE, _r(BASE, num_groups=GROUPS[0], group_topk=GROUPS[1]), "random"),
    ("scaling_factor", BASE, _r(BASE, scaling_factor=2.5), "random"),
    ("map_kind", BASE, _r(BASE, map_kind="indices"), "random"),
    ("map_kind", BASE, _r(BASE, map_kind="bitmap"), "random"),
    ("selection", BASE, _r(BASE, selection="tie_free"), "saturated"),
    ("qb_mode/num_bins", BASE, QB, "random"),
    ("qb_binning", QB, _r(QB, qb_binning="log_margin"), "random"),
    ("num_bins", QB, _r(QB, num_bins=2 * B), "random"),
    ("write_scores", BASE, _r(BASE, write_scores=True), "random"),
    (
        "write_scores",
        _r(SOFTMAX, use_pre_softmax=True),
        _r(SOFTMAX, use_pre_softmax=True, write_scores=True),
        "random",
    ),
    ("write_cutoff", QB, _r(QB, write_cutoff=True), "random"),
    ("write_cutoff", QB2, _r(QB2, write_cutoff=True), "random"),
    ("write_cutoff", MARGIN, _r(MARGIN, write_cutoff=True), "saturated"),
    ("qb_moments", MARGIN64, _r(MARGIN64, qb_moments=True), "saturated"),
]


def test_variants_cover_every_field():
    covered = set()
    for fields, base, variant, _ in VARIANTS:
        diff = {
            f.name
            for f in dataclasses.fields(RouterCall)
            if getattr(base, f.name) != getattr(variant, f.name)
        }
        assert diff == set(fields.split("/")), (fields, diff)
        covered |= diff
    # num_experts is the logits' shape and approximate an opt-in away from the oracle: each has
    # its own test below
    assert {f.name for f in dataclasses.fields(RouterCall)} - covered == {
        "num_experts",
        "approximate",
    }


def _hip_plan(call):
    """hip's amdqb_topk row plan of a grouped router call (None: hip declines it)."""
    from amdqb.backends.hip.topk import router_plan

    from conftest import device_config

    return router_plan(call, device_config())


@over_backends("router_fwd", waves=(32, 64))
@pytest.mark.parametrize("case", VARIANTS, ids=[f"{v[0]}-{i}" for i, v in enumerate(VARIANTS)])
def test_every_field_is_honoured(backend, case):
    fields, base, variant, kind = case
    fn = dispatch._backend_module(backend).OPS["router_fwd"]
    z, bias = _inputs(kind)
    if backend == "hip" and variant.grouped and _hip_plan(variant) is None:
        # a declared capability limit: the dispatcher never sends these grouped calls to hip
        assert dispatch._backend_module("hip").LIMITS["router_fwd"](
            dispatch.device_info(DEVICE), variant
        )
        with pytest.raises(ValueError, match="row plan"):
            _run(fn, variant, z, bias)
        return
    oracle = [_run(_torch_fwd(), c, z, bias) for c in (base, variant)]
    assert _differ(*oracle), f"{fields}: the pair of calls does not tell whether it is honoured"
    for call in (base, variant):
        got = _run(fn, call, z, bias)
        own = got["scores"]
        if own is None:
            own = _run(fn, _r(call, write_scores=True), z, bias)["scores"]
        want_scores = _run(_torch_fwd(), _r(call, write_scores=True), z, bias)["scores"]
        torch.testing.assert_close(own, want_scores, rtol=1e-6, atol=1e-7)
        want = _expected(call, z, bias, own)
        what = f"{fields} in {call}"
        assert torch.equal(got["map"].cpu(), want["map"]), f"routes: {what}"
        if call.map_kind == "indices":
            assert torch.equal(got["ids"].cpu(), want["ids"]), f"selection order: {what}"
        torch.testing.assert_close(got["probs"].cpu(), want["probs"], rtol=1e-5, atol=1e-6)
        for key in ("hist", "cutoff"):
            x, y = got[key], want[key]
            assert (x is None) == (y is None) and (
                x is None or torch.equal(x.cpu(), y)
            ), f"{key}: {what}"


@over_backends("router_fwd", waves=(32,))
def test_qb_modes_are_honoured_and_agree(backend, monkeypatch):
    """two_kernel, fused_atomic and auto give identical histograms (the contract), by different
    launches: the hip emulator's records and the Triton launcher's histogram pass tell them
    apart."""
    from amdqb.backends.triton import router as triton_router

    second_pass = []
    launch = triton_router._launch_histogram
    monkeypatch.setattr(
        triton_router, "_launch_histogram", lambda *a, **k: second_pass.append(1) or launch(*a, **k)
    )
    fn = dispatch._backend_module(backend).OPS["router_fwd"]
    z, bias = _inputs("random")
    hists = {}
    from hip_emu.backend import active_runtime

    for mode in ("two_kernel", "fused_atomic"):
        rt = active_runtime()
        before = len(rt.launches) if rt else 0
        second_pass.clear()
        profiled = backend == "hip" and rt is None
        with gpu_kernel_names() if profiled else contextlib.nullcontext([]) as gpu_names:
            hists[mode] = _run(fn, _r(QB, qb_mode=mode), z, bias)["hist"]
        names = [n for n, *_ in rt.launches[before:]] if rt else gpu_names
        two = bool(second_pass) or "amdqb_qb_hist" in names
        assert two == (mode == "two_kernel"), (mode, names, second_pass)
    assert torch.equal(hists["two_kernel"], hists["fused_atomic"])


@over_backends("router_fwd", waves=(32,))
def test_approximate_is_honoured(backend):
    """The opt-in approximate exponential changes the kernels' activations (the emulator models a
    2^-14 error; a GPU's hardware 2^x differs by a few 2^-22); the oracle ignores it (exact).
    Triton's CPU interpreter has one exponential (numpy's) for both: nothing to tell there."""
    if backend == "triton" and not HAS_GPU:
        pytest.skip("Triton's interpreter computes tl.exp and the library exp alike (numpy)")
    fn = dispatch._backend_module(backend).OPS["router_fwd"]
    z, bias = _inputs("random")
    exact = _run(fn, _r(BASE, write_scores=True), z, bias)["scores"]
    approx = _run(fn, _r(BASE, write_scores=True, approximate=True), z, bias)["scores"]
    assert not torch.equal(exact, approx)
    torch.testing.assert_close(approx, exact, rtol=0, atol=2e-4)
    oracle = [
        _run(_torch_fwd(), _r(BASE, write_scores=True, approximate=a), z, bias) for a in (0, 1)
    ]
    assert torch.equal(oracle[0]["scores"], oracle[1]["scores"])


@over_backends("router_fwd", waves=(32,))
def test_num_experts_and_num_bins_must_match_the_tensors(backend):
    fn = dispatch._backend_module(backend).OPS["router_fwd"]
    z, bias = _inputs("random")
    with pytest.raises(ValueError, match="num_experts"):
        _run(fn, _r(BASE, num_experts=E + 1), z, bias)
    hist = torch.zeros(E, B + 1, dtype=torch.int32, device=DEVICE)
    probs, m = torch.empty(T, E, device=DEVICE), torch.empty(T, E, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="num_bins"):
        fn(QB, z, bias, probs, m, hist, _bounds(QB), None, None)


@over_backends("router_fwd", waves=(32,))
def test_backward_honours_its_fields(backend):
    """router_bwd reads topk, score_function, use_pre_softmax and scaling_factor: each variant
    gives the oracle's gradient (every backend has a backward; where one declines a call, the
    op runs another's: test_router.py)."""
    fn = dispatch._backend_module(backend).OPS.get("router_bwd")
    if fn is None:
        pytest.skip(f"the {backend} backend has no router backward (the op uses another's)")
    z, _ = _inputs("random")
    g = torch.randn(T, E, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    torch_bwd = dispatch._backend_module("torch").OPS["router_bwd"]
    grads = {}
    for call in (
        BASE,
        _r(BASE, topk=1),
        _r(BASE, score_function="sqrtsoftplus"),
        SOFTMAX,
        _r(SOFTMAX, use_pre_softmax=True),
        _r(BASE, scaling_factor=3.0),
    ):
        routed = ref.fused_topk_with_score_function(
            z, call.topk, call.use_pre_softmax, score_function=call.score_function
        )[2]
        got, want = (torch.full((T, E), 7.0, device=DEVICE) for _ in range(2))
        fn(call, g, z, routed, got)
        torch_bwd(call, g, z, routed, want)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        grads[call] = want
    values = list(grads.values())
    assert all(not torch.equal(a, b) for i, a in enumerate(values) for b in values[i + 1 :])
