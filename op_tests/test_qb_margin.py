"""The log_margin binning and its update: the bins of the biased margin on each expert's own axis
(``ref.router.qb_margin_bin_index``) against hand-computed values, the recovery's exact inverse
of the bin edges, the per-expert scale update, the minimum pinning and spread cap, every kernel
backend of ``qb_recover`` / ``qb_step`` against the oracle, the wrapped-count rejection and the
bounded recovery from an absurd state."""

import pytest
import torch

import amdqb
from amdqb import ref
from amdqb.ref import qb as ref_qb
from amdqb.ref.router import margin_fine_keys, qb_margin_bin_index

from conftest import DEVICE, over_backends
from layout_cases import assert_ulp, gen, random_histogram

B = 64
HALF = B // 2


def _bins(d, inv=1.0):
    d = torch.tensor(d, dtype=torch.float32)[:, None]
    return qb_margin_bin_index(d, torch.tensor([inv]), B)[:, 0].tolist()


def test_margin_bins_by_hand():
    """B = 64: 16 fine keys a side of half an octave of y = 1 + |d| inv, then 4-octave keys;
    d == 0 has a bin of its own (32), d > 0 from 33 up, d < 0 from 31 down."""
    assert margin_fine_keys(64) == 16 and margin_fine_keys(256) == 112
    # y = 1 + d: [1, 1.5) key 0, [1.5, 2) key 1, [2, 3) key 2, [3, 4) key 3, ...
    assert _bins([0.0, -0.0, 0.25, 0.5, 1.0, 2.0, 3.0]) == [32, 32, 33, 34, 35, 36, 37]
    assert _bins([-0.25, -0.5, -1.0, -2.0, -3.0]) == [31, 30, 29, 28, 27]
    # the last fine key: y in [2^7 * 1.5, 2^8); the first coarse key: y in [2^8, 2^12)
    assert _bins([2.0**8 - 2.0, 2.0**8 - 1.0, 2.0**12 - 2.0, 2.0**12 - 1.0]) == [48, 49, 49, 50]
    assert _bins([-(2.0**8 - 1.0), -(2.0**12 - 1.0)]) == [15, 14]
    # the outer bins collect everything beyond; NaN counts in bin 0
    assert _bins([3e38, float("inf"), -3e38, -float("inf"), float("nan")]) == [63, 63, 0, 0, 0]
    # the scale: d * inv decides, so inv = 2^10 puts d = 2^-10 where d = 1 was
    assert _bins([2.0**-10, -(2.0**-10)], inv=2.0**10) == _bins([1.0, -1.0])


def test_margin_bins_ascend_with_d():
    d = torch.sort(
        torch.randn(20000, generator=gen(1)) * torch.exp2(torch.randn(20000) * 20)
    ).values
    bins = qb_margin_bin_index(d[:, None], torch.tensor([2.0**30]), B)[:, 0]
    assert bool((bins[1:] >= bins[:-1]).all()) and bins.min() >= 0 and bins.max() <= B - 1
    assert len(set(bins.tolist())) > 50  # the axis spans the draw: most bins are used


@pytest.mark.parametrize("num_bins", [64, 96, 256])
def test_recovery_inverts_the_bin_edges(num_bins):
    """Each key's edge ``d = (y - 1) / inv`` (``y = 2^o (1 + f/2)``, ``o, f`` of its level) lies in
    that key's bin on both sides, the fp32 value below it in the key before, and a quantile that
    falls exactly on the edge's position recovers the edge: the recovery inverts the bins' bit
    arithmetic exactly (keys whose edge and ``1 + d inv`` are fp32 values: y <= 2^24)."""
    half = num_bins // 2
    inv = 2.0**20
    fine = margin_fine_keys(num_bins)
    tested = 0
    for key in range(half - 1):
        level = key if key < fine else fine + (key - fine) * 8
        o, f = divmod(level, 2)
        y = 2.0**o * (1.0 + f / 2.0)
        if y > 2.0**24:
            break
        edge = (y - 1.0) / inv
        up, down = half + 1 + key, half - 1 - key
        if key > 0:
            d = torch.tensor([[edge], [-edge]], dtype=torch.float32)
            assert float(d[0]) == edge
            assert qb_margin_bin_index(d, torch.tensor([inv]), num_bins)[:, 0].tolist() == [
                up,
                down,
            ]
            below = d * (1.0 - 2.0**-10)  # well inside the key before (y rounds in fp32)
            assert qb_margin_bin_index(below, torch.tensor([inv]), num_bins)[:, 0].tolist() == [
                up - 1,
                down + 1,
            ]
        # E = 2, k = 1, one count in each of two neighbouring bins: the quantile position is
        # exactly the boundary between them
        hist = torch.zeros(2, num_bins, dtype=torch.int32)
        hist[0, up - 1 : up + 1] = 1
        hist[1, down : down + 2] = 1
        position, _ = ref_qb.quantile_position(hist, 1)
        assert position.tolist() == [up, down + 1]
        delta = ref_qb.recover_margin_delta(hist, torch.full((2,), inv), 1)
        assert delta.tolist() == [edge, -edge], key
        tested += 1
    assert tested >= 20


def test_recovery_zero_bin_and_sides():
    inv = torch.full((2,), 4.0)
    hist = torch.zeros(2, B, dtype=torch.int32)
    hist[0, HALF] = 10  # every margin is 0: the quantile is in the zero bin
    hist[1, HALF + 2] = 10  # key 1 above 0: y in [1.5, 2), d in [0.125, 0.25)
    delta = ref_qb.recover_margin_delta(hist, inv, 1)
    assert float(delta[0]) == 0.0
    assert 0.125 <= float(delta[1]) < 0.25
    hist[1] = 0
    hist[1, HALF - 2] = 10  # key 1 below 0
    assert -0.25 < float(ref_qb.recover_margin_delta(hist, inv, 1)[1]) <= -0.125


def test_margin_scale_update_rule():
    """inv = 2^n, n = min(4 - floor(log2 |delta|), floor(log2 inv) + 3) in [0, 120]."""
    inv = torch.tensor([2.0**10, 2.0**10, 2.0**10, 2.0**10, 2.0**118, 2.0**3, 3.0])
    delta = torch.tensor(
        [2.0**-3, 0.0, 2.0**-20, 2.0**-3 * 1.9, 0.0, 64.0, 1.0], dtype=torch.float64
    )
    got = ref_qb.margin_scale_update(inv, delta)
    want = [2.0**7, 2.0**13, 2.0**13, 2.0**7, 2.0**120, 1.0, 2.0**4]
    assert got.tolist() == want and got.dtype == torch.float32


def test_pin_median_and_spread_cap():
    """The lower median moves to 0 (float64 difference, one rounding), every bias stays within
    +-2 (the spread cap of 4), and a zero comes out as +0."""
    absurd = torch.tensor([3e38, -3e38, 1.0, -2.5])  # lower median -2.5
    assert ref_qb.pin_median(absurd).tolist() == [2.0, -2.0, 2.0, 0.0]
    small = torch.tensor([2e-9, 1e-9, 5e-9, 1e-9, 3e-9])
    want = (small.double() - small[0].double()).float()
    assert torch.equal(ref_qb.pin_median(small), want) and float(want[0]) == 0.0
    zeros = ref_qb.pin_median(torch.tensor([-0.0, -0.0, 1.0]))
    assert not torch.signbit(zeros[:2]).any()


def test_pin_median_keeps_the_cluster_resolution():
    """One expert far below a tight cluster (a hot expert at logit std 20): pinning the median
    keeps the cluster's differences of 1e-17 in fp32, where pinning the minimum would put the
    cluster at 1.5e-7 (fp32 spacing 1.4e-14) and merge them."""
    cluster = 1.0e-17 * torch.arange(1, 8, dtype=torch.float64)
    bias = torch.cat([torch.tensor([-1.5e-7], dtype=torch.float64), cluster])
    pinned = ref_qb.pin_median(bias.float())
    gaps = pinned[2:].double() - pinned[1:-1].double()
    assert bool((gaps > 0.5e-17).all()) and float(pinned[3]) == 0.0
    lifted = (bias - bias.min()).float()
    assert lifted[1:].unique().numel() < 7  # the minimum pin would merge the cluster


def _margin_case(e, seed, spread=1e-3):
    g = gen(seed)
    hist = random_histogram(e, B, torch.int32, seed=seed)
    bias = (torch.rand(e, generator=g) * spread).float()
    bias -= bias.min()
    inv = torch.ldexp(torch.ones(e), torch.randint(0, 100, (e,), generator=g))
    return hist, bias, inv


@over_backends("qb_recover")
@pytest.mark.parametrize("e", [2, 7, 130])
def test_margin_recover_matches_oracle(backend, e):
    hist, bias, inv = _margin_case(e, seed=e)
    got = amdqb.qb_recover_bias(
        hist.to(DEVICE),
        inv.to(DEVICE),
        1,
        binning="log_margin",
        expert_bias=bias.to(DEVICE),
        backend=backend,
    )
    assert_ulp(got, ref.qb_recover_bias(hist, inv, 1, "log_margin", bias))


@over_backends("qb_step")
@pytest.mark.parametrize("ema", [0.0, 0.3])
@pytest.mark.parametrize("e", [2, 9, 130])
def test_margin_step_matches_oracle(backend, e, ema):
    hist, bias, inv = _margin_case(e, seed=3 * e)
    want_bias, want_inv = ref.qb_step_update(bias, hist, inv, 1, ema, "log_margin")
    got_bias, got_inv = bias.to(DEVICE), inv.to(DEVICE)
    amdqb.qb_step_(
        got_bias, hist.to(DEVICE), got_inv, 1, ema, binning="log_margin", backend=backend
    )
    assert torch.equal(got_bias.cpu(), want_bias) and torch.equal(got_inv.cpu(), want_inv)
    half = ref_qb.BIAS_SPREAD_MAX / 2
    assert float(got_bias.abs().max()) <= half and bool((got_bias == 0).any())
    log2 = torch.log2(got_inv.cpu())
    assert torch.equal(log2, log2.round())  # powers of two


@over_backends("qb_step")
@pytest.mark.parametrize("binning", ["uniform", "log_margin"])
def test_step_rejects_a_wrapped_count(backend, binning):
    """A negative count is an int32 bin that wrapped (more than 2^31 - 1 tokens): the step
    commits nothing, counts the rejection, and leaves committed untouched."""
    e, b = 6, (B if binning == "log_margin" else 40)
    hist = random_histogram(e, b, torch.int32, seed=2)
    hist[3, 5] = -(2**31)
    bias = torch.linspace(0, 0.01, e)
    bounds = torch.full((e,), 2.0**30) if binning == "log_margin" else torch.tensor([-1.0, 1.0])
    bias, bounds, hist = bias.to(DEVICE), bounds.to(DEVICE), hist.to(DEVICE)
    committed = torch.cat([bias, bounds])
    rejected = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    before = [t.clone() for t in (bias, bounds, committed)]
    amdqb.qb_step_(
        bias, hist, bounds, 2, binning=binning, rejected=rejected, committed=committed,
        backend=backend,
    )  # fmt: skip
    assert all(torch.equal(x, y) for x, y in zip(before, (bias, bounds, committed)))
    assert int(rejected) == 1


@over_backends("qb_step")
def test_absurd_state_comes_back_in_bounded_steps(backend):
    """A finite but absurd bias (+-3e38) loaded from a state dict: the first step caps the spread
    at 4, and the balancer is back within 1.5x of a fresh balancer's MaxVio in a few steps."""
    e, k, t = 32, 4, 2048
    g = gen(4)
    skew = torch.linspace(-1.5, 1.5, e)
    batches = [(torch.randn(t, e, generator=g) * 2 + skew).to(DEVICE) for _ in range(12)]
    fresh = amdqb.QuantileBalancer(e, k, device=DEVICE)
    bal = amdqb.QuantileBalancer(e, k, device=DEVICE)
    state = bal.state_dict()
    state["bias"] = torch.where(torch.arange(e) % 2 == 0, 3e38, -3e38).float()
    bal.load_state_dict(state)
    vio = {"fresh": [], "absurd": []}
    for x in batches:
        for name, b in (("fresh", fresh), ("absurd", bal)):
            _, rmap = b.route(x, accumulate=True)
            vio[name].append(float(amdqb.maxvio(rmap.sum(0))))
            b.step(backend=backend)
            assert bool(torch.isfinite(b.bias).all())
    assert float(bal.bias.max() - bal.bias.min()) <= ref_qb.BIAS_SPREAD_MAX
    late = sum(vio["fresh"][-4:]) / 4
    back = next(i for i, v in enumerate(vio["absurd"]) if v <= 1.5 * late)
    # measured: back at step 6 on every backend (the cap, then the axis narrows 8x a step)
    assert back <= 8, vio
    assert int(bal.rejected_steps) == 0


def test_first_steps_balance_a_saturated_stream():
    """From a cold start the default balancer balances a stream whose sigmoid saturates (logit
    std 20) as soon as the float64 exact reference does: its axis starts wide enough for any
    correction (measured: within 1.5x of the reference's level at step 1 or 2, seeds 0-3)."""
    from amdqb.demo import ExactQB64, suite_stream

    e, k, t = 32, 4, 2048
    stream = suite_stream("drift", t, e, 20.0, seed=1)
    bal = amdqb.QuantileBalancer(e, k, device=DEVICE)
    exact = ExactQB64(e, k, DEVICE)
    vio, ref_vio = [], []
    for _ in range(7):
        logits = stream.next().to(DEVICE)
        _, rmap = bal.route(logits, accumulate=True)
        vio.append(float(amdqb.maxvio(rmap.sum(0))))
        bal.step()
        ref_vio.append(float(amdqb.maxvio(exact.route(logits).sum(0))))
        exact.update()
    level = sum(ref_vio[3:]) / 4
    assert vio[0] > 4 * level, (vio, ref_vio)  # unbalanced at bias 0
    assert min(i for i, v in enumerate(vio) if v <= 1.5 * level) <= 2, (vio, ref_vio)
    assert max(vio[3:]) <= 1.5 * max(ref_vio[3:]), (vio, ref_vio)
