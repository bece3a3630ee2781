"""``amdqb.compat.te``: TransformerEngine's router module surface (names, positional order, enums,
their ints and strings, the raw QB forward), and the switch by one import line.

Runs on the default dispatcher choice and, for the aux-loss ops, on every kernel backend
(``AMDQB_BACKEND``), comparing with amdqb's oracles.
"""

from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch

import amdqb
from amdqb import dispatch, ref
from amdqb.backends.calls import RouterCall
from amdqb.compat import te
from amdqb.ref import aux_loss as ref_aux

from conftest import DEVICE, EmulatedHip, backends
from hip_emu.backend import emulated_hip_backend
from router_cases import kernel_scores

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

# torch, and every kernel backend of the router (on the CPU: Triton's interpreter, hip's emulator)
BACKENDS = ["torch"] + backends("router_fwd")

# TE d0067d0 transformer_engine/pytorch/router.py: parameters in order; the ones with defaults.
TE_SIGNATURES = {
    "fused_topk_with_score_function": (
        [
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
        ],
        {
            "routing_map_format",
            "topk_indices",
            "qb_histogram",
            "qb_bin_bounds",
            "qb_histogram_mode",
        },
    ),
    "fused_compute_score_for_moe_aux_loss": (
        ["logits", "topk", "score_function", "routing_map_format"],
        {"routing_map_format"},
    ),
    "fused_moe_aux_loss": (
        ["probs", "tokens_per_expert", "total_num_tokens", "num_experts", "topk", "coeff"],
        set(),
    ),
}


def logits_for(t, e, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    base = torch.arange(e, dtype=torch.float64) * (6.0 / e) - 3.0
    rows = torch.stack([base[torch.randperm(e, generator=g)] for _ in range(t)])
    return (rows + torch.rand(t, 1, generator=g, dtype=torch.float64) * 0.05).to(dtype).to(DEVICE)


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """The backend the TE functions run on: TE's signatures have no backend argument, so it is
    the AMDQB_BACKEND preference (hip: on the CPU emulator)."""
    value = request.param
    if isinstance(value, EmulatedHip):
        with emulated_hip_backend(value.wave):
            monkeypatch.setenv("AMDQB_BACKEND", "hip")
            yield "hip"
    else:
        monkeypatch.setenv("AMDQB_BACKEND", value)
        yield value


# ----------------------------------------------------------------------------------------------
# names, signatures, enums
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(TE_SIGNATURES))
def test_signatures_are_te_positional_order(name):
    params = inspect.signature(getattr(te, name)).parameters
    names, with_default = TE_SIGNATURES[name]
    assert list(params) == names
    assert {
        n for n, p in params.items() if p.default is not inspect.Parameter.empty
    } == with_default
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params.values())


def test_module_surface_and_enums():
    for name in (
        "RoutingMapFormat",
        "QBHistogramMode",
        "fused_topk_with_score_function",
        "fused_compute_score_for_moe_aux_loss",
        "fused_moe_aux_loss",
        "fused_topk_with_score_function_qb_fwd",
        "mark_qb_bin_bounds_validated",
    ):
        assert name in te.__all__ and hasattr(te, name), name
    assert {m.name: int(m) for m in te.RoutingMapFormat} == {"BYTEMAP": 0, "BITMAP_U8": 1}
    assert {m.name: int(m) for m in te.QBHistogramMode} == {"TWO_KERNEL": 0, "FUSED_ATOMIC": 1}
    defaults = inspect.signature(te.fused_topk_with_score_function).parameters
    assert defaults["routing_map_format"].default is te.RoutingMapFormat.BYTEMAP


def test_fp64_logits_rejected_like_te():
    with pytest.raises(ValueError, match="float64"):
        te.fused_topk_with_score_function(
            torch.randn(4, 8, dtype=torch.float64), 2, False, None, None, None, "sigmoid", None
        )


# ----------------------------------------------------------------------------------------------
# routing_map_format / qb_histogram_mode spellings
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bitmap", [True, False])
def test_routing_map_format_enum_int_and_string_agree(backend, bitmap):
    z = logits_for(12, 20, seed=1)
    spellings = (
        [te.RoutingMapFormat.BITMAP_U8, 1, "bitmap_u8"]
        if bitmap
        else [te.RoutingMapFormat.BYTEMAP, 0, "bytemap"]
    )
    router = [
        te.fused_topk_with_score_function(z, 4, False, None, None, None, "sigmoid", None, f)
        for f in spellings
    ]
    scores = [te.fused_compute_score_for_moe_aux_loss(z, 4, "softmax", f) for f in spellings]
    for probs, rmap in router[1:]:
        assert torch.equal(probs, router[0][0]) and torch.equal(rmap, router[0][1])
    for rmap, s in scores[1:]:
        assert torch.equal(rmap, scores[0][0]) and torch.equal(s, scores[0][1])
    want_dtype = torch.uint8 if bitmap else torch.bool
    assert router[0][1].dtype == want_dtype and scores[0][0].dtype == want_dtype
    if bitmap:
        byte_map, _ = te.fused_compute_score_for_moe_aux_loss(z, 4, "softmax")
        assert torch.equal(scores[0][0], ref.pack_bitmap(byte_map))


@pytest.mark.parametrize(
    "bad,exc", [("BITMAP_U8", ValueError), (2, ValueError), (1.0, TypeError), (True, TypeError)]
)
def test_routing_map_format_rejections_follow_te(bad, exc):
    z = torch.randn(4, 8)
    with pytest.raises(exc, match="routing_map_format"):
        te.fused_compute_score_for_moe_aux_loss(z, 2, "sigmoid", bad)
    with pytest.raises(exc, match="routing_map_format"):
        te.fused_topk_with_score_function(z, 2, False, None, None, None, "sigmoid", None, bad)


def _qb_call(fn, z, bias, mode, num_bins=50):
    hist = torch.zeros(z.shape[-1], num_bins, dtype=torch.int32, device=DEVICE)
    bounds = torch.tensor([-1.2, 1.2], device=DEVICE)
    probs, rmap = fn(
        z, 4, False, None, None, None, "sigmoid", bias, "bytemap", None, hist, bounds, mode
    )
    return probs, rmap, hist


@pytest.mark.parametrize("which", ["two_kernel", "fused_atomic"])
def test_qb_histogram_mode_string_enum_and_int_agree(which):
    z = torch.randn(9, 32, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    bias = torch.linspace(-0.2, 0.2, 32, device=DEVICE)
    enum = te.QBHistogramMode[which.upper()]
    runs = [
        _qb_call(fn, z, bias, mode)
        for fn in (te.fused_topk_with_score_function, amdqb.fused_topk_with_score_function)
        for mode in (which, enum, int(enum))
    ]
    for got in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, runs[0]))
    assert torch.all(runs[0][2].sum(1) == z.shape[0])  # every row gains T counts
    with pytest.raises(ValueError, match="qb_histogram_mode"):
        _qb_call(te.fused_topk_with_score_function, z, bias, 2)
    with pytest.raises(ValueError, match="qb_histogram_mode"):
        _qb_call(te.fused_topk_with_score_function, z, bias, "atomic")


# ----------------------------------------------------------------------------------------------
# positional calls in TE's order equal the core ops and the oracles
# ----------------------------------------------------------------------------------------------
def test_positional_calls_in_te_order(backend):
    z = logits_for(10, 32, seed=2).reshape(5, 2, 32)
    bias = torch.linspace(0.1, -0.1, 32, device=DEVICE)
    probs, rmap = te.fused_topk_with_score_function(
        z, 4, False, None, None, 1.2, "sigmoid", bias, te.RoutingMapFormat.BYTEMAP, None
    )
    want, _, want_map = ref.fused_topk_with_score_function(
        z.reshape(-1, 32), 4, scaling_factor=1.2, expert_bias=bias
    )
    assert probs.shape == z.shape and rmap.shape == z.shape
    torch.testing.assert_close(probs.reshape(-1, 32), want)
    assert torch.equal(rmap.reshape(-1, 32), want_map)

    rmap, scores = te.fused_compute_score_for_moe_aux_loss(z, 4, "sqrtsoftplus", 1)
    want_map, want_scores = ref_aux.compute_scores_for_aux_loss(z, 4, "sqrtsoftplus")
    assert scores.shape == z.shape and rmap.shape == (5, 2, 4)
    torch.testing.assert_close(scores, want_scores, rtol=2e-6, atol=1e-7)
    assert torch.equal(rmap, ref.pack_bitmap(want_map))

    p = torch.rand(20, 64, device=DEVICE)
    tpe = torch.randint(1, 100, (64,), dtype=torch.int32, device=DEVICE)
    for total in (20, torch.tensor(20, device=DEVICE)):
        loss = te.fused_moe_aux_loss(p, tpe, total, 32, 4, 0.01)  # sequence aux loss: 2 x E
        torch.testing.assert_close(loss, ref_aux.moe_aux_loss(p, tpe, 20, 32, 4, 0.01))


# ----------------------------------------------------------------------------------------------
# the switch by import: TE code runs unchanged once its import line names amdqb.compat.te
# ----------------------------------------------------------------------------------------------
TE_USER_CODE = """
{import_line} (
    QBHistogramMode,
    RoutingMapFormat,
    fused_compute_score_for_moe_aux_loss,
    fused_moe_aux_loss,
    fused_topk_with_score_function,
)

def moe_router_step(logits, expert_bias, hist, bounds, topk, num_experts, coeff):
    probs, routing_map = fused_topk_with_score_function(
        logits, topk, False, None, None, None, "sigmoid", expert_bias,
        RoutingMapFormat.BITMAP_U8, None, hist, bounds, "fused_atomic",
    )
    aux_map, scores = fused_compute_score_for_moe_aux_loss(logits, topk, "sigmoid")
    tokens = torch.tensor(logits.shape[0], dtype=torch.int64, device=logits.device)
    aux = fused_moe_aux_loss(scores, aux_map.sum(0), tokens, num_experts, topk, coeff)
    return probs, routing_map, aux
"""


@pytest.mark.parametrize("spelling", ["from amdqb.compat.te import", "alias"])
def test_switch_by_import(backend, spelling, monkeypatch):
    if spelling == "alias":  # the unchanged TE import resolving to amdqb.compat.te
        for name in ("transformer_engine", "transformer_engine.pytorch"):
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.router", te)
        import_line = "from transformer_engine.pytorch.router import"
    else:
        import_line = spelling
    scope = {"torch": torch}
    exec(TE_USER_CODE.format(import_line=import_line), scope)
    t, e, k = 16, 32, 4
    z = logits_for(t, e, seed=6).requires_grad_(True)
    bias = torch.linspace(-0.1, 0.1, e, device=DEVICE)
    hist = torch.zeros(e, 40, dtype=torch.int32, device=DEVICE)
    bounds = torch.tensor([-1.1, 1.1], device=DEVICE)
    probs, rmap, aux = scope["moe_router_step"](z, bias, hist, bounds, k, e, 0.01)
    (probs.sum() + aux).backward()
    # against the oracles, written without the compat layer
    zr = z.detach().clone().requires_grad_(True)
    want_hist = torch.zeros_like(hist)
    want_probs, _, want_map = ref.fused_topk_with_score_function(
        zr, k, expert_bias=bias, qb_histogram=want_hist, qb_bin_bounds=bounds
    )
    aux_map, scores = ref_aux.compute_scores_for_aux_loss(zr, k, "sigmoid")
    want_aux = ref_aux.moe_aux_loss(scores, aux_map.sum(0), t, e, k, 0.01)
    (want_probs.sum() + want_aux).backward()
    torch.testing.assert_close(probs, want_probs)
    assert torch.equal(rmap, ref.pack_bitmap(want_map))
    assert torch.equal(hist, want_hist)
    torch.testing.assert_close(aux, want_aux, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(z.grad, zr.grad, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------------------------
# the raw QB forward TE's tests call through its extension module
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", list(te.QBHistogramMode))
def test_raw_qb_forward_tie_drop_and_bin_clamping(backend, mode):
    z = torch.tensor(
        [
            [3.0, 3.0, 3.0, -1.0, -2.0, -3.0, -4.0, -5.0],
            [5.0, 4.0, 3.0, 2.0, -2.0, -3.0, -4.0, -5.0],
        ],
        device=DEVICE,
    )
    bias = torch.zeros(8, device=DEVICE)
    bounds = torch.tensor([-0.05, 0.05], device=DEVICE)
    hist = torch.zeros(8, 8, dtype=torch.int32, device=DEVICE)
    fmt = int(te.RoutingMapFormat.BYTEMAP)
    probs, rmap, raw, cutoff, out_hist = te.fused_topk_with_score_function_qb_fwd(
        z, 2, None, bias, fmt, None, hist, bounds, mode
    )
    assert out_hist is hist
    assert rmap[0, :3].tolist() == [True, True, False]  # the tied (k+1)-th: largest id dropped
    assert hist[:, 0].sum() > 0 and hist[:, -1].sum() > 0  # clamped at both ends
    assert torch.equal(cutoff, raw[:, 2])  # the (k+1)-th of each row, which is sorted
    want_hist = torch.zeros_like(hist)
    want_probs, _, want_map = ref.fused_topk_with_score_function(
        z, 2, expert_bias=bias, qb_histogram=want_hist, qb_bin_bounds=bounds, scores=raw
    )
    torch.testing.assert_close(probs, want_probs)
    assert torch.equal(rmap, want_map) and torch.equal(hist, want_hist)


@pytest.mark.parametrize("mode", list(te.QBHistogramMode))
def test_raw_qb_forward_returns_the_kernels_scores_and_cutoffs(backend, mode):
    """raw_scores are the scores the router kernel ranked (bit for bit; torch's sigmoid within
    an ulp), cutoff the (k+1)-th of raw_scores + bias found by a sort (not by the kernels'
    selection), and the histogram is binned from exactly these cutoffs."""
    t, e, k, b = 13, 48, 5, 40
    g = torch.Generator().manual_seed(11)
    z = (torch.randn(t, e, generator=g) * 2).to(DEVICE)
    bias = (torch.randn(e, generator=g) * 0.3).to(DEVICE)
    bounds = torch.tensor([-1.5, 1.5], device=DEVICE)
    hist = torch.zeros(e, b, dtype=torch.int32, device=DEVICE)
    call = RouterCall(e, k, qb_mode="auto", num_bins=b)
    assert dispatch.select("router_fwd", DEVICE, call=call).backend == backend
    probs, rmap, raw, cutoff, _ = te.fused_topk_with_score_function_qb_fwd(
        z, k, None, bias, 0, None, hist, bounds, mode
    )
    assert raw.dtype == torch.float32 and raw.shape == (t, e) and cutoff.shape == (t,)
    assert torch.equal(raw, kernel_scores(backend, z))
    torch.testing.assert_close(raw, torch.sigmoid(z), rtol=1e-6, atol=0)
    assert torch.equal(cutoff, (raw + bias).sort(dim=1, descending=True).values[:, k])
    assert torch.equal(hist, ref.qb_histogram_counts(raw, cutoff, bounds, b))
    want = ref.fused_topk_with_score_function(z, k, expert_bias=bias, scores=raw)
    assert torch.equal(rmap, want[2])
    torch.testing.assert_close(probs, want[0])


@pytest.mark.parametrize("dense", [False, True])
def test_raw_qb_forward_rejects_bad_bounds_recoverably(dense):
    z = torch.randn(8, 16, device=DEVICE)
    bias = torch.zeros(16, device=DEVICE)
    hist = torch.zeros(16, 32, dtype=torch.int32, device=DEVICE)
    idx = torch.empty(8, 4, dtype=torch.int32, device=DEVICE) if dense else None
    bad = torch.tensor([1.0, 1.0], device=DEVICE)
    with pytest.raises(RuntimeError, match="finite with lower < upper"):
        te.fused_topk_with_score_function_qb_fwd(
            z, 4, None, bias, 0, idx, hist, bad, te.QBHistogramMode.TWO_KERNEL
        )
    assert int(hist.sum()) == 0  # nothing ran
    good = torch.tensor([-1.0, 1.0], device=DEVICE)
    _, out, _, _, _ = te.fused_topk_with_score_function_qb_fwd(
        z, 4, None, bias, 0, idx, hist, good, te.QBHistogramMode.TWO_KERNEL
    )
    assert int(hist.sum()) == 8 * 16
    if dense:
        assert out is idx


def test_top_level_qb_errors_carry_te_phrases():
    z = torch.randn(16, 32, device=DEVICE)
    bias = torch.zeros(32, device=DEVICE)
    hist = torch.zeros(32, 100, dtype=torch.int32, device=DEVICE)
    bounds = torch.tensor([-1.0, 1.0], device=DEVICE)
    with pytest.raises(ValueError, match="provided together"):
        te.fused_topk_with_score_function(
            z, 4, False, None, None, None, "sigmoid", bias, qb_histogram=hist
        )
    with pytest.raises(ValueError, match="only supports"):
        te.fused_topk_with_score_function(
            z,
            4,
            False,
            None,
            None,
            None,
            "softmax",
            bias,
            "bytemap",
            None,
            hist,
            bounds,
            "two_kernel",
        )
    for b in ([1.0, 1.0], [1.0, -1.0], [float("nan"), 1.0]):
        with pytest.raises(ValueError, match="finite with lower < upper"):
            te.fused_topk_with_score_function(
                z,
                4,
                False,
                None,
                None,
                None,
                "sigmoid",
                bias,
                "bytemap",
                None,
                hist,
                torch.tensor(b, device=DEVICE),
                "fused_atomic",
            )
