"""Public API contract: names and signatures, TE-compatible calls, output formats, dispatch overrides
and the backends' declines (with their reasons), custom ops under torch.compile and a table of bad
inputs (each a clear error before any launch). QB bounds validation: test_router_qb.py."""

import inspect
import os
from dataclasses import replace

import pytest
import torch

import amdqb
from amdqb import devices, dispatch, ref
from amdqb.backends import hip as hip_backend
from amdqb.backends.calls import AlignCall, RouterCall, RouteRowsRequest, TopkCall

from conftest import DEVICE, HAS_GPU, backends
from router_cases import kernel_scores


def test_public_signatures_match_spec():
    sig = inspect.signature(amdqb.fused_topk_with_score_function)
    assert list(sig.parameters)[:13] == [
        "logits",
        "topk",
        "use_pre_softmax",
        "num_groups",
        "group_topk",
        "scaling_factor",
        "score_function",
        "expert_bias",
        "routing_map_format",
        "topk_indices",
        "qb_histogram",
        "qb_bin_bounds",
        "qb_histogram_mode",
    ]
    assert list(inspect.signature(amdqb.fused_compute_score_for_moe_aux_loss).parameters)[:4] == [
        "logits",
        "topk",
        "score_function",
        "routing_map_format",
    ]
    assert list(inspect.signature(amdqb.fused_moe_aux_loss).parameters)[:6] == [
        "probs",
        "tokens_per_expert",
        "total_num_tokens",
        "num_experts",
        "topk",
        "coeff",
    ]
    assert list(inspect.signature(amdqb.biased_topk).parameters)[:3] == [
        "logits",
        "topk",
        "expert_bias",
    ]
    assert list(inspect.signature(amdqb.qb_recover_bias).parameters)[:3] == [
        "histogram",
        "bin_bounds",
        "topk",
    ]
    route = inspect.signature(amdqb.moe_route_rows).parameters
    assert route["capacity"].kind is inspect.Parameter.KEYWORD_ONLY
    assert list(inspect.signature(amdqb.moe_align_block_size).parameters)[:5] == [
        "topk_ids",
        "block_size",
        "num_experts",
        "expert_map",
        "pad_sorted_ids",
    ]
    balancer = inspect.signature(amdqb.QuantileBalancer).parameters
    assert list(balancer) == [
        "num_experts",
        "topk",
        "binning",
        "num_bins",
        "selection",
        "moments",
        "ema",
        "process_group",
        "device",
    ]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in list(balancer.values())[2:])
    assert balancer["binning"].default == "log_margin" and balancer["selection"].default is None


ROUTER_BACKENDS = pytest.mark.parametrize(
    "backend", ["torch", *backends("router_fwd")], indirect=True
)


@ROUTER_BACKENDS
def test_te_positional_call_and_leading_dims(backend):
    logits = torch.randn(128, 2, 32, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    bias = torch.linspace(-0.1, 0.1, 32, device=DEVICE)
    probs, rmap = amdqb.fused_topk_with_score_function(
        logits, 4, False, None, None, 1.2, "sigmoid", bias, backend=backend
    )
    assert probs.shape == (128, 2, 32) and rmap.shape == (128, 2, 32)
    assert rmap.dtype == torch.bool and torch.all(rmap.sum(-1) == 4)
    flat = logits.reshape(-1, 32)
    expected, _, want_map = ref.fused_topk_with_score_function(
        flat, 4, scaling_factor=1.2, expert_bias=bias, scores=kernel_scores(backend, flat)
    )
    assert torch.equal(rmap.reshape(-1, 32), want_map)
    torch.testing.assert_close(probs.reshape(-1, 32), expected)


@ROUTER_BACKENDS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_output_formats_agree(backend, dtype):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(17, 20, generator=g).to(DEVICE, dtype)
    probs, rmap = amdqb.fused_topk_with_score_function(logits, 3, backend=backend)
    assert probs.dtype == dtype
    want = ref.fused_topk_with_score_function(logits, 3, scores=kernel_scores(backend, logits))[2]
    assert torch.equal(rmap, want)
    _, bitmap = amdqb.fused_topk_with_score_function(
        logits, 3, routing_map_format="bitmap_u8", backend=backend
    )
    assert bitmap.dtype == torch.uint8 and bitmap.shape == (17, 3)
    assert torch.equal(ref.unpack_bitmap(bitmap, 20), rmap)
    for idx_dtype in (torch.int16, torch.int32, torch.int64):
        buf = torch.empty(17, 3, dtype=idx_dtype, device=DEVICE)
        _, out = amdqb.fused_topk_with_score_function(logits, 3, topk_indices=buf, backend=backend)
        assert out is buf
        mask = torch.zeros_like(rmap).scatter_(1, buf.long(), True)
        assert torch.equal(mask, rmap)


def test_dispatch_overrides_and_reasons(monkeypatch):
    choice = dispatch.select("router_fwd", DEVICE, "torch")
    assert choice.backend == "torch" and "forced" in choice.reason
    monkeypatch.setenv("AMDQB_BACKEND", "torch")
    assert dispatch.select("route_rows", DEVICE).backend == "torch"
    with pytest.raises(ValueError, match="backend must be one of"):
        dispatch.select("route_rows", DEVICE, "cuda")
    report = dispatch.report("cpu")
    assert report["backends"]["torch"]["available"]
    assert set(report["ops"]) == set(amdqb.backends.OP_NAMES)
    for op in report["ops"].values():
        assert op["reason"]


def test_unavailable_forced_backend_explains_why():
    if HAS_GPU:
        pytest.skip("every backend may be available on a GPU")
    with pytest.raises(RuntimeError, match="hip"):
        amdqb.fused_topk_with_score_function(torch.randn(2, 8), 2, backend="hip")


def test_hip_declines_with_reasons():
    info = dispatch.device_info("cpu")
    limits = hip_backend.LIMITS
    qb = RouterCall(896, 16, qb_mode="auto", num_bins=1000)
    assert limits["router_fwd"](info, qb) is None
    assert "grouped" in limits["router_fwd"](info, replace(qb, num_groups=8, group_topk=4))
    assert "num_experts" in limits["biased_topk"](info, TopkCall(5000, 8))
    # grouped: amdqb_topk's row plan (DeepSeek-V3's 8 groups of 32), none for 4 groups of 85
    assert limits["biased_topk"](info, TopkCall(256, 8, num_groups=8, group_topk=4)) is None
    assert "row plan" in limits["biased_topk"](info, TopkCall(340, 8, num_groups=4, group_topk=2))
    assert "65" in limits["router_fwd"](info, replace(qb, topk=64))  # k + 1 under QB
    assert limits["router_fwd"](info, RouterCall(896, 64)) is None
    assert "num_bins" in limits["router_fwd"](info, replace(qb, num_bins=20000))
    big = RouteRowsRequest(num_experts=10**6, impl="atomic")
    assert limits["route_rows"](info, big) is None
    assert "deterministic" in limits["route_rows"](info, replace(big, deterministic=True))
    assert "align" in limits["align_block_size"](info, AlignCall(5000, 64))


def test_triton_declines_large_expert_counts():
    from amdqb.backends.triton import router

    info = dispatch.device_info(DEVICE)
    reason = router.LIMITS["router_fwd"](info, RouterCall(5000, 8))
    assert reason and "E > 4096" in reason
    assert router.LIMITS["biased_topk"](info, TopkCall(5000, 8))
    qb = RouterCall(4096, 8, qb_mode="auto", num_bins=1000)
    assert router.LIMITS["router_fwd"](info, qb) is None
    assert router.LIMITS["router_fwd"](info, replace(qb, num_bins=2**20))


def test_capability_limits_are_declared_per_op():
    """Every backend's capability checks are keyed by ops it implements, each a typed check of
    the op's call or request (``amdqb.backends.calls``)."""
    import typing

    from amdqb.backends import calls

    for name in dispatch.BACKENDS:
        module = dispatch._backend_module(name)
        for op, check in getattr(module, "LIMITS", {}).items():
            assert op in module.OPS, (name, op)
            hints = typing.get_type_hints(check)
            arg = list(inspect.signature(check).parameters)[1]
            assert hints[arg] is type(calls.DEFAULT_REQUESTS[op]), (name, op)
            assert check(dispatch.device_info("cpu"), calls.request(op)) is None, (name, op)


def test_amd_arch_helpers():
    assert dispatch.amd_wave_size("gfx942") == 64
    assert dispatch.amd_wave_size("gfx1250") == 32
    assert dispatch.amd_arch_family("gfx90a") == "cdna"
    assert dispatch.amd_arch_family("gfx1201") == "rdna"
    from amdqb._arch import amd_lds_bytes

    assert amd_lds_bytes("gfx950:sramecc+") == amd_lds_bytes("gfx1250") == 160 * 1024
    assert amd_lds_bytes("gfx942") == amd_lds_bytes("gfx1100") == 64 * 1024


def test_route_gate_matches_aiter_formula():
    from amdqb import configs
    from amdqb.ops.layout import lds_route_threshold, route_impl

    gfx1250, sm_90 = configs.load("gfx1250"), configs.load("sm_90")
    for e in (1, 256, 257, 512, 513, 896, 1024, 2048, 4096):
        s = -(-e // 256)
        assert lds_route_threshold(e, gfx1250) == 256 * s * max(4, 2 * s)
    assert lds_route_threshold(896, gfx1250) == 512 * 16  # Kimi-K3: M >= 512 at k=16
    info = dispatch.DeviceInfo("cuda:0", "amd", "x", "gfx1250", 32, 1 << 17, 256, "gfx1250")
    assert route_impl(info, 512 * 16, 896)[0] == "lds"
    assert route_impl(info, 511 * 16, 896)[0] == "atomic"
    assert route_impl(info, 10**6, 4097)[0] == "atomic"
    # sm_90 records its own measurement: lds ahead from the first route (no crossover measured)
    h200 = dispatch.DeviceInfo("cuda:0", "nvidia", "H200", "sm_90", 32, 1 << 16, 132, "sm_90")
    assert lds_route_threshold(896, sm_90) == 0
    assert route_impl(h200, 1, 896)[0] == "lds"
    assert route_impl(h200, 10**6, 4097)[0] == "atomic"
    # an architecture nobody measured takes aiter's gate
    other = dispatch.DeviceInfo("cuda:0", "amd", "x", "gfx942", 64, 1 << 16, 304, "cdna")
    assert route_impl(other, 511 * 16, 896)[0] == "atomic"


def _router(**kw):
    args = dict(logits=torch.randn(4, 8), topk=2)
    args.update(kw)
    return lambda: amdqb.fused_topk_with_score_function(**args)


def _qb(**kw):
    args = dict(
        logits=torch.randn(4, 8),
        topk=2,
        expert_bias=torch.zeros(8),
        qb_histogram=torch.zeros(8, 10, dtype=torch.int32),
        qb_bin_bounds=torch.tensor([-1.0, 1.0]),
        qb_histogram_mode="two_kernel",
    )
    args.update(kw)
    return lambda: amdqb.fused_topk_with_score_function(**args)


def _route(**kw):
    args = dict(topk_ids=torch.zeros(4, 2, dtype=torch.int32), num_experts=8)
    args.update(kw)
    ids, e = args.pop("topk_ids"), args.pop("num_experts")
    return lambda: amdqb.moe_route_rows(ids, e, **args)


def _chunks(**kw):
    args = dict(
        inp=torch.randn(6, 4),
        split_sizes=torch.tensor([2, 4]),
        sorted_indices=torch.tensor([1, 0]),
        output_split_sizes=torch.tensor([4, 4]),
        num_out_tokens=8,
    )
    args.update(kw)
    return lambda: amdqb.moe_sort_chunks_and_pad(**args)


BAD_INPUTS = [
    ("logits not a tensor", _router(logits=[[1.0, 2.0]]), TypeError, "logits"),
    ("logits fp64", _router(logits=torch.randn(4, 8, dtype=torch.float64)), TypeError, "logits"),
    ("logits int", _router(logits=torch.ones(4, 8, dtype=torch.int32)), TypeError, "logits"),
    ("topk zero", _router(topk=0), ValueError, "topk"),
    ("topk > E", _router(topk=9), ValueError, "topk"),
    ("topk float", _router(topk=2.0), TypeError, "topk"),
    ("bad score fn", _router(score_function="relu"), ValueError, "score_function"),
    ("groups alone", _router(num_groups=2), ValueError, "group_topk"),
    ("groups not dividing", _router(num_groups=3, group_topk=1), ValueError, "num_groups"),
    ("bias wrong shape", _router(expert_bias=torch.zeros(7)), ValueError, "expert_bias"),
    ("bias fp16", _router(expert_bias=torch.zeros(8, dtype=torch.half)), TypeError, "expert_bias"),
    (
        "bias with softmax",
        _router(score_function="softmax", expert_bias=torch.zeros(8)),
        ValueError,
        "expert_bias",
    ),
    ("bad map format", _router(routing_map_format="dense"), ValueError, "routing_map_format"),
    (
        "indices + bitmap",
        _router(routing_map_format="bitmap_u8", topk_indices=torch.empty(4, 2, dtype=torch.int32)),
        ValueError,
        "bitmap_u8",
    ),
    (
        "indices wrong shape",
        _router(topk_indices=torch.empty(4, 3, dtype=torch.int32)),
        ValueError,
        "topk_indices",
    ),
    ("indices float", _router(topk_indices=torch.empty(4, 2)), TypeError, "topk_indices"),
    (
        "qb partial",
        _router(qb_histogram=torch.zeros(8, 10, dtype=torch.int32)),
        ValueError,
        "must be provided together",
    ),
    ("qb softmax", _qb(score_function="softmax", expert_bias=None), ValueError, "only supports"),
    ("qb no bias", _qb(expert_bias=None), ValueError, "expert_bias"),
    ("qb groups", _qb(num_groups=2, group_topk=1), ValueError, "only supports"),
    ("qb k == E", _qb(topk=8), ValueError, "only supports 0 < topk < num_experts"),
    (
        "qb hist int64",
        _qb(qb_histogram=torch.zeros(8, 10, dtype=torch.int64)),
        TypeError,
        "qb_histogram",
    ),
    (
        "qb hist wrong E",
        _qb(qb_histogram=torch.zeros(7, 10, dtype=torch.int32)),
        ValueError,
        "qb_histogram",
    ),
    ("qb B <= 1", _qb(qb_histogram=torch.zeros(8, 1, dtype=torch.int32)), ValueError, "B >= 2"),
    ("qb bounds shape", _qb(qb_bin_bounds=torch.zeros(3)), ValueError, "qb_bin_bounds"),
    ("qb bad mode", _qb(qb_histogram_mode="atomic"), ValueError, "qb_histogram_mode"),
    ("route ids float", _route(topk_ids=torch.zeros(4, 2)), TypeError, "topk_ids"),
    ("route E zero", _route(num_experts=0), ValueError, "num_experts"),
    (
        "route counters wrong E",
        _route(counters=torch.zeros(7, dtype=torch.int32)),
        ValueError,
        "counters",
    ),
    (
        "route counters int64",
        _route(counters=torch.zeros(8, dtype=torch.int64)),
        TypeError,
        "counters",
    ),
    ("route bad impl", _route(impl="fast"), ValueError, "impl"),
    ("route lds E too big", _route(num_experts=5000, impl="lds"), ValueError, "4096"),
    ("route capacity negative", _route(capacity=-1), ValueError, "capacity"),
    ("route rows overflow", _route(num_experts=2**16, capacity=2**16), ValueError, "int32"),
    (
        "align block zero",
        lambda: amdqb.moe_align_block_size(torch.zeros(2, 2, dtype=torch.int32), 0, 4),
        ValueError,
        "block_size",
    ),
    (
        "align bad map",
        lambda: amdqb.moe_align_block_size(
            torch.zeros(2, 2, dtype=torch.int32), 4, 4, expert_map=torch.zeros(3, dtype=torch.int32)
        ),
        ValueError,
        "expert_map",
    ),
    (
        "chunks sizes mismatch",
        _chunks(sorted_indices=torch.tensor([0, 1, 2])),
        ValueError,
        "sorted_indices",
    ),
    ("chunks num_out too small", _chunks(num_out_tokens=5), ValueError, "num_out_tokens"),
    ("chunks float meta", _chunks(split_sizes=torch.tensor([2.0, 4.0])), TypeError, "split_sizes"),
    ("chunks 1-D input", _chunks(inp=torch.randn(6)), ValueError, "inp"),
    ("chunks probs shape", _chunks(probs=torch.rand(5)), ValueError, "probs"),
    (
        "restore row_map length",
        lambda: amdqb.moe_unpad_and_restore_chunks(
            torch.randn(4, 2), torch.zeros(3, dtype=torch.int32), 4
        ),
        ValueError,
        "row_map",
    ),
    (
        "recover hist 1-D",
        lambda: amdqb.qb_recover_bias(
            torch.zeros(8, dtype=torch.int32), torch.tensor([-1.0, 1.0]), 1
        ),
        ValueError,
        "histogram",
    ),
    (
        "recover topk >= E",
        lambda: amdqb.qb_recover_bias(
            torch.zeros(4, 8, dtype=torch.int32), torch.tensor([-1.0, 1.0]), 4
        ),
        ValueError,
        "topk",
    ),
    ("balancer ema 1", lambda: amdqb.QuantileBalancer(8, 2, ema=1.0), ValueError, "ema"),
    ("balancer bins 1", lambda: amdqb.QuantileBalancer(8, 2, num_bins=1), ValueError, "num_bins"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_raises_clear_error(case):
    _, call, exc, phrase = case
    with pytest.raises(exc, match=phrase):
        call()


def test_bad_input_table_is_large_enough():
    assert len(BAD_INPUTS) >= 25


@pytest.mark.skipif(not HAS_GPU, reason="device mismatch needs a GPU")
def test_device_mismatch_names_the_argument():
    with pytest.raises(ValueError, match="expert_bias"):
        amdqb.fused_topk_with_score_function(
            torch.randn(4, 8, device="cuda"), 2, expert_bias=torch.zeros(8)
        )


def test_custom_ops_registered_for_compile():
    names = ("router_fwd", "router_bwd", "biased_topk", "route_rows", "chunk_copy")
    names += ("aux_scores_fwd", "aux_scores_bwd", "aux_loss_fwd", "aux_loss_bwd")
    for name in names:
        assert hasattr(torch.ops.amdqb, name), name


@ROUTER_BACKENDS
def test_router_compiles_without_graph_breaks(backend):
    torch._dynamo.reset()
    logits = torch.randn(16, 32, device=DEVICE)
    bias = torch.linspace(-0.1, 0.1, 32, device=DEVICE)

    def route(x):
        probs, rmap = amdqb.fused_topk_with_score_function(x, 4, expert_bias=bias, backend=backend)
        return probs * 2, rmap

    compiled = torch.compile(route, fullgraph=True, backend="aot_eager")
    got = compiled(logits)
    want = route(logits)
    torch.testing.assert_close(got[0], want[0])
    assert torch.equal(got[1], want[1])
    oracle = ref.fused_topk_with_score_function(logits, 4, expert_bias=bias)
    torch.testing.assert_close(got[0], 2 * oracle[0], rtol=1e-5, atol=1e-6)


def test_router_custom_op_schema_is_the_call_type_flat():
    """Under torch.compile the router ops carry the tensors, then RouterCall's fields in order,
    then the backend token: the schema is generated from the call type, never written out."""
    import dataclasses

    from amdqb.backends.calls import ROUTER_BWD_TENSORS, ROUTER_FWD_TENSORS, RouterCall

    fields = [f.name for f in dataclasses.fields(RouterCall)]
    for op, tensors in (("router_fwd", ROUTER_FWD_TENSORS), ("router_bwd", ROUTER_BWD_TENSORS)):
        schema = getattr(torch.ops.amdqb, op).default._schema
        assert [a.name for a in schema.arguments] == [*tensors, *fields, "backend"]


@ROUTER_BACKENDS
def test_router_with_qb_indices_and_backward_compiles(backend):
    """A QB router call writing caller-owned indices, and its backward, in one fullgraph
    compile: the call type reaches the backend through the flat custom op unchanged."""
    torch._dynamo.reset()
    e, k, t = 32, 4, 16
    bias = torch.linspace(-0.1, 0.1, e, device=DEVICE)
    z = torch.randn(t, e, device=DEVICE)
    outs = []
    for compiled in (False, True):
        hist = torch.zeros(e, 10, dtype=torch.int32, device=DEVICE)
        bounds = amdqb.mark_qb_bin_bounds_validated(torch.tensor([-1.0, 1.0], device=DEVICE))
        idx = torch.empty(t, k, dtype=torch.int32, device=DEVICE)
        x = z.clone().requires_grad_(True)

        def route(x, idx=idx, hist=hist, bounds=bounds):
            probs, ids = amdqb.fused_topk_with_score_function(
                x,
                k,
                expert_bias=bias,
                topk_indices=idx,
                qb_histogram=hist,
                qb_bin_bounds=bounds,
                qb_histogram_mode="two_kernel",
                backend=backend,
            )
            return probs * 2, ids

        fn = torch.compile(route, fullgraph=True, backend="aot_eager") if compiled else route
        probs, ids = fn(x)
        probs.sum().backward()
        outs.append((probs.detach(), ids.clone(), hist.clone(), x.grad))
    for got, want in zip(outs[1], outs[0]):
        assert torch.equal(got, want)
    assert int(outs[1][2].sum()) == t * e


def test_route_rows_and_align_compile_without_graph_breaks():
    torch._dynamo.reset()
    ids = torch.randint(0, 8, (16, 2), dtype=torch.int32, device=DEVICE)
    for capacity in (None, 4):

        def route(x, capacity=capacity):
            return amdqb.moe_route_rows(x, 8, capacity=capacity)

        got = torch.compile(route, fullgraph=True, backend="aot_eager")(ids)
        want = route(ids)
        assert torch.equal(got[1], want[1])  # counts; rows are a per-expert bijection
        for e in range(8):
            assert torch.equal(got[0][ids == e].sort().values, want[0][ids == e].sort().values)

    def align(x):
        return amdqb.moe_align_block_size(x, 4, 8)

    got = torch.compile(align, fullgraph=True, backend="aot_eager")(ids)
    assert all(torch.equal(a, b) for a, b in zip(got, align(ids)))


def test_env_is_not_leaking_interpreter_into_gpu_runs():
    if HAS_GPU:
        assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def test_backward_backend_follows_forward_or_falls_back(monkeypatch):
    """The router's backward uses the forward's backend when it has a backward kernel; a backend
    without one (or unavailable here) falls back to the table, also when AMDQB_BACKEND forces it."""
    dev = DEVICE
    call = RouterCall(8, 2)
    assert dispatch.select("router_bwd", dev, call=call, prefer="torch").backend == "torch"
    table = dispatch.select("router_bwd", dev, call=call).backend
    monkeypatch.setenv("AMDQB_BACKEND", "hip")
    got = dispatch.select("router_bwd", dev, call=call, prefer="hip").backend
    info = devices.device_info(dev)
    hip_runs_it = dispatch._passed_over("hip", "router_bwd", info, call) is None
    assert got == ("hip" if hip_runs_it else table)
    assert "router_bwd" in dispatch._backend_module(got).OPS
    z = torch.randn(5, 8, device=dev, requires_grad=True)
    probs, _ = amdqb.fused_topk_with_score_function(z, 2, backend="torch")
    probs.sum().backward()
    assert z.grad is not None and torch.isfinite(z.grad).all()


@pytest.mark.skipif(HAS_GPU, reason="runs the hip backend on the CPU emulator")
def test_no_backend_runs_another_inside_it():
    """hip's deterministic routes keep E counters in LDS: beyond MAX_DET_EXPERTS the dispatcher
    passes hip over (the next backend runs the call), and backend="hip" raises naming the limit
    -- nothing inside the hip backend quietly runs the torch oracle."""
    from amdqb.backends.hip import layout as hip_layout

    from hip_emu.backend import emulated_hip_backend

    e = hip_layout.MAX_DET_EXPERTS + 1
    ids = torch.randint(0, e, (8, 2), dtype=torch.int32)
    with emulated_hip_backend():
        assert dispatch.select("route_rows", "cpu", "hip", num_experts=64).backend == "hip"
        choice = dispatch.select(
            "route_rows", "cpu", prefer="hip", num_experts=e, impl="atomic", deterministic=True
        )
        assert choice.backend != "hip" and "deterministic" in dict(choice.rejected)["hip"]
        with pytest.raises(RuntimeError, match=f"hip: deterministic routes with num_experts={e}"):
            amdqb.moe_route_rows(ids, e, deterministic=True, backend="hip")
        rows, counts = amdqb.moe_route_rows(ids, e, deterministic=True)
    want_rows, want_counts = ref.moe_route_rows(ids, e)
    assert torch.equal(rows, want_rows) and torch.equal(counts, want_counts)


def test_one_device_parser_for_every_entry_point():
    """``amdqb.devices.as_device``: the CPU, a GPU by any of its names, and one ValueError naming
    the argument for anything else -- the ops' callers, the balancer and the command line share
    it (test_cli.py checks the commands)."""
    from amdqb.devices import as_device

    assert as_device("cpu") == torch.device("cpu") == as_device(torch.device("cpu"))
    assert as_device(None) == torch.device("cuda" if HAS_GPU else "cpu")
    for bad in ("mps", "meta", "xpu:0", "tpu", "cuda:x", 3.5):
        with pytest.raises(ValueError, match=r"device"):
            as_device(bad)
        with pytest.raises(ValueError, match="device"):
            amdqb.QuantileBalancer(8, 2, device=bad)
    with pytest.raises(ValueError, match="--device 'mps' is not supported"):
        as_device("mps", name="--device")
    for gpu in ("cuda", "gpu", "hip", "GPU:0", "hip:0"):
        if HAS_GPU:
            assert as_device(gpu).type == "cuda"
        else:
            with pytest.raises(ValueError, match="sees no CUDA/ROCm GPU"):
                as_device(gpu)
            with pytest.raises(ValueError, match="sees no CUDA/ROCm GPU"):
                amdqb.QuantileBalancer(8, 2, device=gpu)
