"""The QB entry points reject what cannot work, before any write: strided and aliasing tensors,
settings that cannot balance, bad state dicts, the same checks under ``torch.compile`` -- each
rejection with a before/after snapshot of every tensor the call could touch, on every backend
that runs the op here. Also the graph-safety of the torch backend's route and step on a GPU."""

import pytest
import torch

import amdqb
from amdqb import ref
from amdqb.ops._checks import INT32_MAX
from amdqb.ref import qb as ref_qb

from conftest import DEVICE, HAS_GPU, available_backends, backends, over_backends
from layout_cases import gen, random_histogram

E, K, B = 8, 2, 64


def _snapshot(*tensors):
    return [t.detach().clone() for t in tensors]


def _bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _unchanged(before, *tensors):
    """Bit for bit (NaN included)."""
    return all(torch.equal(_bits(b), _bits(t)) for b, t in zip(before, tensors))


def _step_args(binning):
    """bias, histogram, bin_bounds, rejected, committed of a valid qb_step_ call."""
    hist = random_histogram(E, B, torch.int32, seed=1).to(DEVICE)
    bias = torch.linspace(0, 0.01, E, device=DEVICE)
    if binning == "log_margin":
        bounds = torch.full((E,), 2.0**20, device=DEVICE)
    else:
        bounds = torch.tensor([-1.0, 1.0], device=DEVICE)
    rejected = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    committed = torch.cat([bias, bounds])
    return bias, hist, bounds, rejected, committed


def _strided(t):
    """The values of ``t`` as every other element of a twice-as-long base (and the base)."""
    base = torch.full((2 * t.numel(),), 777, dtype=t.dtype, device=t.device)
    view = base[::2]
    view.copy_(t.reshape(-1))
    return view.view(t.shape) if t.dim() == 1 else view, base


STEP_CASES = ["bias", "bin_bounds", "committed"]  # rejected has one element: any stride reads it


@over_backends("qb_step", emulator=False)
@pytest.mark.parametrize("binning", ["uniform", "log_margin"])
@pytest.mark.parametrize("which", STEP_CASES)
def test_qb_step_rejects_strided_tensors(backend, binning, which):
    bias, hist, bounds, rejected, committed = _step_args(binning)
    args = dict(bias=bias, bin_bounds=bounds, rejected=rejected, committed=committed)
    args[which], base = _strided(args[which])
    before = _snapshot(hist, base, *args.values())
    with pytest.raises(ValueError, match=f"{which} must be contiguous"):
        amdqb.qb_step_(
            args["bias"], hist, args["bin_bounds"], K, binning=binning,
            rejected=args["rejected"], committed=args["committed"], backend=backend,
        )  # fmt: skip
    assert _unchanged(before, hist, base, *args.values())


@over_backends("qb_step", emulator=False)
def test_qb_step_rejects_a_strided_histogram(backend):
    bias, hist, bounds, rejected, committed = _step_args("uniform")
    strided = torch.zeros(B, E, dtype=torch.int32, device=DEVICE).t()
    strided.copy_(hist)
    before = _snapshot(bias, bounds, strided)
    with pytest.raises(ValueError, match="histogram must be contiguous"):
        amdqb.qb_step_(bias, strided, bounds, K, backend=backend)
    assert _unchanged(before, bias, bounds, strided)


ALIASES = [
    ("committed", "bias"),
    ("committed", "bin_bounds"),
    ("rejected", "committed"),
    ("bias", "histogram"),
    ("bin_bounds", "bias"),
]


def _aliased(first, second, binning):
    """Valid step arguments in which ``first`` shares memory with ``second``."""
    bias, hist, bounds, rejected, committed = _step_args(binning)
    nb = bounds.numel()
    if (first, second) == ("committed", "bias"):
        base = torch.cat([committed, bias])
        bias, committed = base[:E], base[: E + nb]
    elif (first, second) == ("committed", "bin_bounds"):
        base = torch.cat([bias, bounds, bias])
        bounds, committed = base[E : E + nb], base[E : 2 * E + nb]
    elif (first, second) == ("rejected", "committed"):
        rejected = committed[:1].view(torch.int32)
    elif (first, second) == ("bias", "histogram"):
        bias = hist.view(-1)[:E].view(torch.float32)
    else:  # bin_bounds starts on the last bias entry
        base = torch.cat([bias[:-1], bounds])
        bias, bounds = base[:E], base[E - 1 :]
    return dict(
        bias=bias, histogram=hist, bin_bounds=bounds, rejected=rejected, committed=committed
    )


@over_backends("qb_step", emulator=False)
@pytest.mark.parametrize("binning", ["uniform", "log_margin"])
@pytest.mark.parametrize("first,second", ALIASES)
def test_qb_step_rejects_aliasing(backend, binning, first, second):
    """Two of the step's tensors sharing memory: a ValueError naming both, nothing written."""
    args = _aliased(first, second, binning)
    before = _snapshot(*args.values())
    with pytest.raises(ValueError, match="share memory") as info:
        amdqb.qb_step_(
            args["bias"], args["histogram"], args["bin_bounds"], K, binning=binning,
            rejected=args["rejected"], committed=args["committed"], backend=backend,
        )  # fmt: skip
    assert first in str(info.value) and second in str(info.value)
    assert _unchanged(before, *args.values())


@over_backends("qb_step", emulator=False)
@pytest.mark.parametrize(
    "case",
    ["bias grad", "bounds nan", "margin bounds [2]", "uniform bounds [E]", "meta", "margin B=32"],
)
def test_qb_step_rejections_change_nothing(backend, case):
    binning = "uniform" if case.startswith("uniform") else "log_margin"
    bias, hist, bounds, rejected, committed = _step_args(binning)
    match = {"bias grad": "bias must not require grad", "bounds nan": "bin_bounds"}
    if case == "bias grad":
        bias.requires_grad_(True)
    elif case == "bounds nan":
        bounds[3] = float("nan")
    elif case == "margin bounds [2]":
        bounds = torch.tensor([1.0, 2.0], device=DEVICE)
        committed = torch.zeros(E + 2, device=DEVICE)
        match[case] = "bin_bounds must have shape"
    elif case == "uniform bounds [E]":
        bounds = torch.ones(E, device=DEVICE)
        match[case] = "bin_bounds must have shape"
    elif case == "meta":
        hist = torch.zeros(E, B, dtype=torch.int32, device="meta")
        match[case] = "meta"
    elif case == "margin B=32":
        hist = hist[:, :32].contiguous()
        match[case] = r"\[64, 256\]"
    before = _snapshot(bias, bounds, rejected, committed)
    with pytest.raises(ValueError, match=match[case]):
        amdqb.qb_step_(
            bias, hist, bounds, K, binning=binning, rejected=rejected, committed=committed,
            backend=backend,
        )  # fmt: skip
    assert _unchanged(before, bias, bounds, rejected, committed)


@over_backends("qb_recover", emulator=False)
def test_qb_recover_rejects_strided_bounds(backend):
    _, hist, bounds, _, _ = _step_args("uniform")
    view, base = _strided(bounds)
    with pytest.raises(ValueError, match="bin_bounds must be contiguous"):
        amdqb.qb_recover_bias(hist, view, K, backend=backend)
    assert torch.equal(base[1::2], torch.full((2,), 777.0, device=DEVICE))


def _router_backends():
    return ["torch", *backends("router_fwd")]


@pytest.mark.parametrize("binning", ["uniform", "log_margin"])
def test_router_rejects_strided_bounds_on_every_backend(binning):
    """The same error, before any write, whatever backend would run: a strided ``[-1, 1]`` view
    (the issue's case) or a strided inverse-scale view is never read through a wrong stride."""
    logits = torch.randn(64, E, generator=gen(3)).to(DEVICE)
    bounds = torch.tensor([-1.0, 1.0]) if binning == "uniform" else torch.full((E,), 8.0)
    view, base = _strided(bounds.to(DEVICE))
    for backend in _router_backends():
        if not isinstance(backend, str):
            continue  # the emulated hip parameter: checked by the op before any backend
        hist = torch.zeros(E, B, dtype=torch.int32, device=DEVICE)
        with pytest.raises(ValueError, match="qb_bin_bounds must be contiguous"):
            amdqb.fused_topk_with_score_function(
                logits, K, expert_bias=torch.zeros(E, device=DEVICE), qb_histogram=hist,
                qb_bin_bounds=view, qb_histogram_mode="fused_atomic", qb_binning=binning,
                selection="tie_free" if binning == "log_margin" else "te", backend=backend,
            )  # fmt: skip
        assert int(hist.abs().sum()) == 0
        assert bool((base[1::2] == 777).all())


def test_router_rejects_a_string_for_approximate_activation():
    logits = torch.randn(4, E, device=DEVICE)
    with pytest.raises(TypeError, match="approximate_activation"):
        amdqb.fused_topk_with_score_function(logits, K, approximate_activation="no")
    with pytest.raises(TypeError, match="approximate_activation"):
        amdqb.biased_topk(logits, K, approximate_activation="no")


@pytest.mark.parametrize("binning", ["uniform", "log_margin"])
def test_compiled_router_validates_bounds_like_eager(binning):
    """Under torch.compile the bounds are checked when the graph runs: NaN bounds raise the
    eager call's ValueError instead of counting every token in bin 0."""
    torch._dynamo.reset()
    logits = torch.randn(32, E, device=DEVICE)
    bias = torch.zeros(E, device=DEVICE)
    hist = torch.zeros(E, B, dtype=torch.int32, device=DEVICE)
    bounds = torch.tensor([-1.0, 1.0]) if binning == "uniform" else torch.full((E,), 8.0)
    bounds = bounds.to(DEVICE)
    bounds[1] = float("nan")
    selection = "tie_free" if binning == "log_margin" else "te"

    def route(x):
        return amdqb.fused_topk_with_score_function(
            x, K, expert_bias=bias, qb_histogram=hist, qb_bin_bounds=bounds,
            qb_histogram_mode="fused_atomic", qb_binning=binning, selection=selection,
        )  # fmt: skip

    with pytest.raises(ValueError, match="qb_bin_bounds") as eager:
        route(logits)
    compiled = torch.compile(route, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception) as traced:
        compiled(logits)
    chain, err = [], traced.value
    while err is not None:  # the ValueError itself, or the one a compile wrapper carries
        chain.append(err)
        err = err.__cause__ or err.__context__
    assert any(isinstance(e, ValueError) and str(e) == str(eager.value) for e in chain), chain
    assert int(hist.sum()) == 0


@pytest.mark.skipif(
    "triton" not in available_backends("router_fwd"), reason="no Triton backend on this machine"
)
def test_uniform_two_kernel_histogram_of_2_18_bins():
    """B = 2^18 uniform bins in two_kernel mode: the global-atomic histogram pass keeps no
    private block (Triton's 2^20-element limit), and counts like the oracle."""
    e, t, b = 2, 8, 1 << 18
    logits = torch.randn(t, e, generator=gen(5)).to(DEVICE)
    bias = torch.zeros(e, device=DEVICE)
    bounds = torch.tensor([-1.0, 1.0], device=DEVICE)
    hist = torch.zeros(e, b, dtype=torch.int32, device=DEVICE)
    amdqb.fused_topk_with_score_function(
        logits, 1, expert_bias=bias, qb_histogram=hist, qb_bin_bounds=bounds,
        qb_histogram_mode="two_kernel", backend="triton",
    )  # fmt: skip
    want = torch.zeros_like(hist)
    ref.fused_topk_with_score_function(
        logits, 1, expert_bias=bias, qb_histogram=want, qb_bin_bounds=bounds
    )
    assert torch.equal(hist, want) and int(hist.sum()) == t * e


# ----------------------------------------------------------------------------------------------
# QuantileBalancer: settings and state
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(num_bins=32), ValueError, "num_bins must be >= 64"),
        (dict(num_bins=66 + 1), ValueError, "num_bins must be even"),
        (dict(process_group="world"), TypeError, "process_group"),
        (dict(device="meta"), ValueError, "device"),
        (dict(binning="uniform", selection="tie_free"), ValueError, "tie_free"),
        (dict(binning="uniform", num_bins=1 << 17), ValueError, "num_bins"),
    ],
)
def test_balancer_settings_that_cannot_work(kwargs, error, match):
    with pytest.raises(error, match=match):
        amdqb.QuantileBalancer(E, K, **kwargs)


def test_balancer_defaults():
    bal = amdqb.QuantileBalancer(E, K)
    assert (bal.binning, bal.selection, bal.num_bins) == ("log_margin", "tie_free", 64)
    assert bal.bin_bounds.tolist() == [2.0**ref_qb.MARGIN_INV_COLD_EXP] * E
    k3 = amdqb.QuantileBalancer(E, K, binning="uniform")
    assert (k3.selection, k3.num_bins, k3.bin_bounds.tolist()) == ("te", 1000, [-1.0, 1.0])


def _balancer(binning="log_margin"):
    bal = amdqb.QuantileBalancer(E, K, binning=binning, device=DEVICE)
    x = (torch.randn(128, E, generator=gen(7)) + torch.linspace(-1, 1, E)).to(DEVICE)
    bal.route(x, accumulate=True)
    bal.step()
    bal.route(x[:16], accumulate=True)  # pending counts
    return bal


def _state_of(bal):
    return [
        bal.bias.clone(),
        bal.bin_bounds.clone(),
        bal.histogram.clone(),
        bal.rejected_steps.clone(),
        bal._committed.clone(),
        bal.ema,
        bal._pending_tokens,
    ]


def _same_state(a, b):
    return all(_unchanged([x], y) if torch.is_tensor(x) else x == y for x, y in zip(a, b))


def test_balancer_route_rejections_change_nothing():
    bal = _balancer()
    before = _state_of(bal)
    x = torch.randn(8, E, device=DEVICE)
    with pytest.raises(TypeError, match="approximate_activation"):
        bal.route(x, accumulate=True, approximate_activation="no")
    bal._pending_tokens = INT32_MAX - 4
    with pytest.raises(ValueError, match="call step"):
        bal.route(x, accumulate=True)
    bal._pending_tokens = before[-1]
    assert _same_state(before, _state_of(bal))


LOAD_CASES = {
    "bias nan": (lambda s: s.update(bias=torch.full((E,), float("nan"))), "finite"),
    "bias meta": (lambda s: s.update(bias=torch.zeros(E, device="meta")), "meta"),
    "bias shape": (lambda s: s.update(bias=torch.zeros(E + 1)), "bias"),
    "bias fp64": (lambda s: s.update(bias=torch.zeros(E, dtype=torch.float64)), "bias"),
    "bounds zero": (lambda s: s["bin_bounds"].__setitem__(2, 0.0), "bin_bounds"),
    "bounds shape": (lambda s: s.update(bin_bounds=torch.ones(E + 3)), "bin_bounds"),
    "bounds meta": (lambda s: s.update(bin_bounds=torch.ones(E, device="meta")), "meta"),
    "selection": (lambda s: s.update(selection="te"), "selection"),
    "num_bins": (lambda s: s.update(num_bins=128), "num_bins"),
}


@pytest.mark.parametrize("case", list(LOAD_CASES))
def test_load_state_dict_rejections_change_nothing(case):
    bal = _balancer()
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in bal.state_dict().items()}
    edit, match = LOAD_CASES[case]
    edit(state)
    before = _state_of(bal)
    with pytest.raises((ValueError, TypeError), match=match):
        bal.load_state_dict(state)
    assert _same_state(before, _state_of(bal))


def test_load_state_dict_uniform_absurd_span_is_refused():
    bal = _balancer("uniform")
    state = bal.state_dict()
    state["bias"] = torch.tensor([3e38, -3e38] * (E // 2))
    before = _state_of(bal)
    with pytest.raises(ValueError, match="would not be finite"):
        bal.load_state_dict(state)
    assert _same_state(before, _state_of(bal))


def test_load_state_dict_copies_values():
    """A bias that requires grad is copied by value (the balancer's own stays a plain buffer);
    the buffers keep their addresses; the committed copy follows."""
    bal = _balancer()
    state = bal.state_dict()
    state["bias"] = (torch.rand(E) * 1e-3).requires_grad_(True)
    ptrs = (bal.bias.data_ptr(), bal.bin_bounds.data_ptr(), bal._committed.data_ptr())
    bal.load_state_dict(state)
    assert not bal.bias.requires_grad and torch.equal(bal.bias.cpu(), state["bias"].detach())
    assert ptrs == (bal.bias.data_ptr(), bal.bin_bounds.data_ptr(), bal._committed.data_ptr())
    assert torch.equal(bal._committed, torch.cat([bal.bias, bal.bin_bounds]))
    assert int(bal.histogram.sum()) == 0 and bal._pending_tokens == 0


def test_load_state_dict_of_the_global_axis_restarts_it_wide():
    """A log_margin state saved with the earlier global ``[eps, 1/eps]`` bounds keeps its bias
    and starts the per-expert axes from the cold start."""
    bal = _balancer()
    state = bal.state_dict()
    state["bin_bounds"] = torch.tensor([1e-8, 1e8])
    bal.load_state_dict(state)
    assert bal.bin_bounds.tolist() == [2.0**ref_qb.MARGIN_INV_COLD_EXP] * E
    assert torch.equal(bal.bias.cpu(), state["bias"].cpu())


def test_maxvio_of_a_nan_load_is_nan_and_exact_bias_of_nan_logits_raises():
    assert torch.isnan(amdqb.maxvio(torch.tensor([float("nan"), 1.0, 2.0])))
    with pytest.raises(ValueError, match="NaN"):
        amdqb.qb_exact_bias(torch.full((16, E), float("nan")), K, torch.zeros(E))


# ----------------------------------------------------------------------------------------------
# graph safety on a GPU
# ----------------------------------------------------------------------------------------------
@pytest.mark.skipif(not HAS_GPU, reason="host syncs and graph capture need a CUDA/ROCm device")
@pytest.mark.parametrize("backend", ["torch", None])
def test_route_and_step_have_no_host_sync_and_replay(backend):
    """The default balancer's route + step on the torch backend (the fallback) and on the
    dispatcher's choice: no host sync (sync debug mode "error") and a CUDA graph of both replays
    like the eager sequence."""
    e, k, t = 64, 4, 512
    g = gen(9)
    xs = [(torch.randn(t, e, generator=g) + torch.linspace(-1, 1, e)).cuda() for _ in range(4)]
    eager = amdqb.QuantileBalancer(e, k, device="cuda")
    graphed = amdqb.QuantileBalancer(e, k, device="cuda")
    static = xs[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, then restore the state
        graphed.route(static, accumulate=True, backend=backend)
        graphed.step(backend=backend)
    torch.cuda.current_stream().wait_stream(side)
    graphed.load_state_dict(eager.state_dict())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed.route(static, accumulate=True, backend=backend)
            graphed.step(backend=backend)
        for x in xs:
            static.copy_(x)
            graph.replay()
            eager.route(x, accumulate=True, backend=backend)
            eager.step(backend=backend)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.equal(graphed.bias, eager.bias)
    assert torch.equal(graphed.bin_bounds, eager.bin_bounds)


@pytest.mark.skipif(not HAS_GPU, reason="graph capture needs a CUDA/ROCm device")
def test_capture_counts_tokens_against_the_int32_bound():
    """The per-capture bound: route() inside a capture counts its tokens on the host like an
    eager call, so a captured sequence that would pass 2^31 - 1 tokens before its step is
    refused at capture; a captured step resets the count."""
    e, k, t = 64, 4, 256
    bal = amdqb.QuantileBalancer(e, k, device="cuda")
    x = torch.randn(t, e, device="cuda")
    bal.route(x, accumulate=True)  # warm-up (kernel builds) outside the capture
    bal.step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bal.route(x, accumulate=True)
        assert bal._pending_tokens == t
        bal.step()
        assert bal._pending_tokens == 0
    bal._pending_tokens = INT32_MAX - t // 2
    before = _state_of(bal)
    with pytest.raises(ValueError, match="call step"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            bal.route(x, accumulate=True)
    assert _same_state(before, _state_of(bal))
