"""Quantile Balancing updates: ``qb_recover_bias``, ``qb_step_``, ``qb_exact_bias`` and
``QuantileBalancer``, for every kernel backend of ``qb_recover`` / ``qb_step`` against the oracle
(``ref.qb_recover_bias``, ``ref.qb_step_update``; fp32 equal up to one ulp), the oracle against
conformance vectors (Megatron's recovery vector, pooled vs per-microbatch quantiles) and an
independent NumPy recovery, the balancer's buffers, accumulation rules, in-place step and state
dicts, and pooling over ranks with torch.distributed (2 gloo processes).
"""

import os
import socket
import struct

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import amdqb
from amdqb import ref

from conftest import DEVICE, HAS_GPU, over_backends
from layout_cases import assert_ulp, gen, random_histogram

# ----------------------------------------------------------------------------------------------
# kernel backends against the oracle
# ----------------------------------------------------------------------------------------------


@over_backends("qb_step")
def test_qb_recovery_vector(backend):
    hist = torch.tensor([[0, 2, 2, 0], [2, 2, 0, 0]], dtype=torch.int32, device=DEVICE)
    bounds = torch.tensor([-1.0, 1.0], device=DEVICE)
    bhat = amdqb.qb_recover_bias(hist, bounds, 1, backend=backend)
    assert bhat.cpu().tolist() == [0.25, -0.25]
    bias = torch.zeros(2, device=DEVICE)
    amdqb.qb_step_(bias, hist, bounds, 1, backend=backend)
    assert bias.cpu().tolist() == [0.25, -0.25]
    assert bounds.cpu().tolist() == [-1.25, 1.25]


@over_backends("qb_recover")
def test_qb_pooled_vs_mean_vector(backend):
    """notes/qb_anchors.md §2.3: the quantile of the pooled histogram is not the mean of the
    per-microbatch quantiles."""
    mb1 = torch.zeros(2, 10, dtype=torch.int32)
    mb2 = torch.zeros(2, 10, dtype=torch.int32)
    mb1[0, 0], mb1[0, 9], mb1[1, 0] = 3, 1, 4
    mb2[0, 9], mb2[1, 0] = 4, 4
    bounds = torch.tensor([0.0, 10.0], device=DEVICE)
    pooled = amdqb.qb_recover_bias((mb1 + mb2).to(DEVICE), bounds, 1, backend=backend).cpu()
    assert torch.equal(pooled, ref.qb_recover_bias(mb1 + mb2, bounds.cpu(), 1))
    # m=8, q=4: expert 0 -> bin 9, frac 1/5 -> 9.2; expert 1 -> bin 0, frac 1/2 -> 0.5
    assert torch.allclose(pooled, torch.tensor([4.35, -4.35]), atol=1e-6)
    per_mb = [
        amdqb.qb_recover_bias(h.to(DEVICE), bounds, 1, backend=backend).cpu() for h in (mb1, mb2)
    ]
    assert not torch.allclose(pooled, (per_mb[0] + per_mb[1]) / 2, atol=1e-3)


QB_SHAPES = [(2, 2), (2, 3), (7, 1000), (64, 2500), (896 if HAS_GPU else 130, 1000), (5000, 16)]


def test_qb_recover_needs_two_experts():
    # QB's cutoff is the (k+1)-th expert with 1 <= k < E: a one-expert histogram has no quantile
    with pytest.raises(ValueError, match="histogram must be"):
        amdqb.qb_recover_bias(torch.zeros(1, 2, dtype=torch.int32), torch.tensor([-1.0, 1.0]), 1)


@over_backends("qb_recover")
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("shape", QB_SHAPES, ids=str)
def test_qb_recover_random(backend, shape, dtype):
    e, b = shape
    hist = random_histogram(e, b, dtype, seed=e + b)
    bounds = torch.tensor([-1.75, 2.5])
    for topk in sorted({1, max(1, min(e - 1, 6))}):
        got = amdqb.qb_recover_bias(hist.to(DEVICE), bounds.to(DEVICE), topk, backend=backend)
        assert_ulp(got, ref.qb_recover_bias(hist, bounds, topk))


@over_backends("qb_step")
@pytest.mark.parametrize("ema", [0.0, 0.1, 0.9])
@pytest.mark.parametrize("shape", [(2, 3), (7, 1000), (896 if HAS_GPU else 130, 1000)], ids=str)
def test_qb_step_random(backend, shape, ema):
    e, b = shape
    hist = random_histogram(e, b, torch.int32, seed=e * 3 + b)
    bounds = torch.tensor([-0.5, 0.75])
    bias = torch.randn(e, generator=gen(e)) * 0.1
    exp_bias, exp_bounds = ref.qb_step_update(bias, hist, bounds, 3 if e > 3 else 1, ema)
    got_bias, got_bounds = bias.to(DEVICE), bounds.to(DEVICE)
    ptr = got_bias.data_ptr()
    amdqb.qb_step_(got_bias, hist.to(DEVICE), got_bounds, 3 if e > 3 else 1, ema, backend=backend)
    assert got_bias.data_ptr() == ptr
    assert_ulp(got_bias, exp_bias)
    assert_ulp(got_bounds, exp_bounds)


@over_backends("qb_step")
@pytest.mark.parametrize("e", [3, 130, 4097], ids=lambda e: f"E{e}")
def test_qb_step_log_margin_median_pin(backend, e):
    """log_margin steps pin the lower median of the mixed biases at 0, bit for bit the oracle's:
    E <= 4096 selects it among register-resident keys, E = 4097 a chunk at a time; ties, a
    signed zero and an outlier far from the rest included."""
    b, k = 64, 2
    hist = random_histogram(e, b, torch.int32, seed=e).to(DEVICE)
    bias = torch.randn(e, generator=gen(e)) * 1e-3
    bias[: e // 3] = bias[0]  # a tie at the median's side
    bias[1] = -0.0
    bias[-1] = -1.5  # an outlier: a minimum pin would move everyone by it
    bounds = ref.qb.margin_scale(bias)
    exp_bias, exp_bounds = ref.qb_step_update(
        bias, hist.cpu(), bounds, k, 0.25, binning="log_margin"
    )
    got_bias, got_bounds = bias.to(DEVICE), bounds.to(DEVICE)
    amdqb.mark_qb_bin_bounds_validated(got_bounds)
    amdqb.qb_step_(got_bias, hist, got_bounds, k, 0.25, binning="log_margin", backend=backend)
    assert torch.equal(got_bias.cpu().view(torch.int32), exp_bias.view(torch.int32))
    assert torch.equal(got_bounds.cpu(), exp_bounds)
    assert (got_bias == 0).any()  # the median itself sits at exactly 0


@over_backends("qb_step")
def test_qb_step_ema_is_float64(backend):
    """ema = 0.1 is not an fp32 value: the mix must use the float64 ema, like the oracle."""
    hist = torch.tensor([[0, 3, 1], [2, 2, 0], [0, 0, 4], [4, 0, 0]], dtype=torch.int32)
    bounds = torch.tensor([-1.0, 1.0])
    bias = torch.tensor([0.3, -0.2, 0.1, -0.2])
    exp_bias, exp_bounds = ref.qb_step_update(bias, hist, bounds, 1, 0.1)
    got, gb = bias.to(DEVICE), bounds.to(DEVICE)
    amdqb.qb_step_(got, hist.to(DEVICE), gb, 1, 0.1, backend=backend)
    assert torch.equal(got.cpu(), exp_bias) and torch.equal(gb.cpu(), exp_bounds)
    assert struct.unpack("<d", struct.pack("<d", 0.1))[0] != float(torch.tensor(0.1))


@over_backends("qb_step")
def test_qb_step_empty_histogram_keeps_bias(backend):
    e = 6
    bias = torch.tensor([0.5, -0.25, 0.0, 1.0, -1.5, 0.25], device=DEVICE)
    old = bias.clone()
    bounds = torch.tensor([-3.0, 3.0], device=DEVICE)
    amdqb.qb_step_(
        bias, torch.zeros(e, 8, dtype=torch.int32, device=DEVICE), bounds, 2, 0.5, backend=backend
    )
    assert torch.equal(bias, old)
    assert bounds.cpu().tolist() == [-2.5, 2.0]


@over_backends("qb_step")
def test_balancer_step_matches_oracle(backend):
    e, k, b = (896, 16, 1000) if HAS_GPU else (32, 4, 64)
    bal = amdqb.QuantileBalancer(e, k, num_bins=b, ema=0.25, device=DEVICE, binning="uniform")
    bal.histogram.copy_(random_histogram(e, b, torch.int32, seed=1).to(DEVICE))
    bal.bias.copy_((torch.randn(e, generator=gen(2)) * 0.01).to(DEVICE))
    exp_bias, exp_bounds = ref.qb_step_update(
        bal.bias.cpu(), bal.histogram.cpu(), bal.bin_bounds.cpu(), k, 0.25
    )
    addresses = (bal.bias.data_ptr(), bal.bin_bounds.data_ptr(), bal.histogram.data_ptr())
    bal.step(backend=backend)
    assert addresses == (bal.bias.data_ptr(), bal.bin_bounds.data_ptr(), bal.histogram.data_ptr())
    assert_ulp(bal.bias, exp_bias)
    assert_ulp(bal.bin_bounds, exp_bounds)
    assert int(bal.histogram.sum()) == 0


# ----------------------------------------------------------------------------------------------
# the oracle: conformance vectors, NumPy, exact recovery, metrics
# ----------------------------------------------------------------------------------------------


def test_megatron_recovery_vector():
    hist = torch.tensor([[0, 2, 2, 0], [2, 2, 0, 0]], dtype=torch.int32)
    bounds = torch.tensor([-1.0, 1.0])
    assert ref.qb_recover_bias(hist, bounds, 1).tolist() == [0.25, -0.25]
    bias, new_bounds = ref.qb_step_update(torch.zeros(2), hist, bounds, 1)
    assert bias.tolist() == [0.25, -0.25]
    assert new_bounds.tolist() == [-1.25, 1.25]


def test_pooled_histogram_is_not_mean_of_microbatch_quantiles():
    mb1 = torch.zeros(2, 10, dtype=torch.int32)
    mb1[0, 0], mb1[0, 9], mb1[1, 0] = 3, 1, 4
    mb2 = torch.zeros(2, 10, dtype=torch.int32)
    mb2[0, 9], mb2[1, 0] = 4, 4
    bounds = torch.tensor([0.0, 10.0])
    pooled = ref.qb_recover_bias(mb1 + mb2, bounds, 1)
    # row 0: q=4 reached in bin 9 (c=3, h=5) -> 9.2; row 1: bin 0 (h=8) -> 0.5; centred
    torch.testing.assert_close(pooled, torch.tensor([4.35, -4.35]))
    mean = (ref.qb_recover_bias(mb1, bounds, 1) + ref.qb_recover_bias(mb2, bounds, 1)) / 2
    assert (pooled - mean).abs().max() > 1.0


def test_recovery_matches_independent_numpy():
    g = np.random.default_rng(0)
    hist = g.integers(0, 5, size=(7, 30)).astype(np.int32)
    hist[3] = 0
    hist[3, 29] = hist[0].sum()  # everything in the last bin
    lo, hi, k = -1.5, 0.75, 2
    e, b = hist.shape
    expected = []
    for row in hist:
        m = int(row.sum())
        q = m * k / e
        n = -(-m * k // e)
        cum = np.cumsum(row)
        beta = int(np.argmax(cum >= n))
        c = int(cum[beta - 1]) if beta else 0
        frac = min(max((q - c) / row[beta], 0.0), 1.0)
        expected.append(np.float32(lo + (beta + frac) * (hi - lo) / b))
    expected = np.array(expected, dtype=np.float32)
    expected = (expected.astype(np.float64) - expected.astype(np.float64).mean()).astype(np.float32)
    got = ref.qb_recover_bias(torch.from_numpy(hist), torch.tensor([lo, hi]), k)
    np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=1e-6)


def test_empty_rows_and_empty_histogram():
    hist = torch.zeros(3, 8, dtype=torch.int32)
    out = ref.recover_uncentred(hist, torch.tensor([-1.0, 3.0]), 1)
    assert out.tolist() == [1.0, 1.0, 1.0]
    bias = torch.tensor([0.1, -0.3, 0.2])
    new_bias, bounds = ref.qb_step_update(bias, hist, torch.tensor([-1.0, 1.0]), 1)
    assert torch.equal(new_bias, bias)  # no tokens: keep the old bias
    torch.testing.assert_close(bounds, torch.tensor([-1.3, 1.2]))


@pytest.mark.parametrize("seed", range(3))
def test_exact_and_histogram_recovery_agree_within_one_bin(seed):
    g = torch.Generator().manual_seed(seed)
    t, e, k, b = 4096, 32, 4, 1000
    logits = torch.randn(t, e, generator=g) + torch.linspace(-1, 1, e)
    bias = torch.randn(e, generator=g) * 0.1
    bounds = torch.tensor([bias.min() - 1, bias.max() + 1])
    hist = torch.zeros(e, b, dtype=torch.int32)
    ref.fused_topk_with_score_function(
        logits, k, expert_bias=bias, qb_histogram=hist, qb_bin_bounds=bounds
    )
    width = float(bounds[1] - bounds[0]) / b
    from_hist = ref.recover_uncentred(hist, bounds, k)
    exact = ref.qb_exact_bias(logits, k, bias)
    # both centred: each uncentred estimate is within one bin, so centred ones within two
    assert (ref.centre(from_hist) - exact).abs().max() <= 2 * width
    assert torch.equal(amdqb.qb_exact_bias(logits, k, bias), exact)


@pytest.mark.parametrize("t,e,k", [(257, 8, 3), (1, 4, 1), (3, 5, 4), (64, 16, 2)])
def test_exact_bias_matches_independent_numpy(t, e, k):
    # The quantile step against numpy's full column sort (midpoint of the n-th and (n+1)-th
    # smallest required bias, NaN last), on half-integer logits (many tied required biases).
    g = torch.Generator().manual_seed(t + e + k)
    logits = torch.round(torch.randn(t, e, generator=g) * 2) / 2
    n = -(-t * k // e)
    if t > 2 * n:
        logits[t - 1, 0] = float("nan")  # its required bias sorts last, past the quantile
    bias = torch.round(torch.randn(e, generator=g) * 4) / 8
    r = ref.required_bias(logits, k, bias).double().numpy()
    r[np.isnan(r)] = np.inf
    srt = np.sort(r, axis=0)
    mid = ((srt[max(n - 1, 0)] + srt[min(n, t - 1)]) / 2).astype(np.float32).astype(np.float64)
    expected = (mid - mid.mean()).astype(np.float32)
    np.testing.assert_array_equal(ref.qb_exact_bias(logits, k, bias).numpy(), expected)


def test_exact_bias_balances_the_batch_it_was_computed_on():
    g = torch.Generator().manual_seed(5)
    t, e, k = 2000, 10, 2
    logits = torch.randn(t, e, generator=g) + torch.linspace(-2, 2, e)
    bias = torch.zeros(e)
    new_bias = ref.qb_exact_bias(logits, k, bias)
    _, _, rmap = ref.fused_topk_with_score_function(logits, k, expert_bias=new_bias)
    load = rmap.sum(0).float()
    # Every expert receives exactly ceil(m k / E) tokens on the batch itself up to ties among
    # the coordinate-wise optimum (the update is one dual coordinate step, not a joint solve).
    before = ref.fused_topk_with_score_function(logits, k, expert_bias=bias)[2].sum(0).float()
    assert float(amdqb.maxvio(load)) < 0.5 * float(amdqb.maxvio(before))


def test_qb_step_ema_and_centring():
    hist = torch.tensor([[0, 2, 2, 0], [2, 2, 0, 0]], dtype=torch.int32)
    old = torch.tensor([1.0, -1.0])
    bias, bounds = ref.qb_step_update(old, hist, torch.tensor([-1.0, 1.0]), 1, ema=0.5)
    torch.testing.assert_close(bias, torch.tensor([0.625, -0.625]))
    torch.testing.assert_close(bounds, torch.tensor([-1.625, 1.625]))
    assert abs(float(bias.double().mean())) < 1e-7


def test_aux_free_update_and_metrics():
    bias = torch.zeros(4)
    amdqb.aux_free_bias_update_(bias, torch.tensor([10.0, 0.0, 5.0, 5.0]), rate=0.01)
    assert bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.0])
    assert float(amdqb.maxvio(torch.tensor([10.0, 0.0, 5.0, 5.0]))) == pytest.approx(1.0)
    assert float(amdqb.maxvio(torch.tensor([3, 3, 3]))) == 0.0
    assert float(amdqb.cv2(torch.tensor([1.0, 1.0]))) == 0.0
    assert float(amdqb.cv2(torch.tensor([2.0, 0.0]))) == pytest.approx(1.0)


# ----------------------------------------------------------------------------------------------
# QuantileBalancer
# ----------------------------------------------------------------------------------------------


def _committed_state(e, binning, seed):
    bias = torch.randn(e, generator=gen(seed)) * 0.01
    bias -= bias.mean()
    if binning == "uniform":
        bounds = torch.stack([bias.min() - 1, bias.max() + 1])
    else:
        bounds = ref.qb.margin_scale(bias)
    return bias, bounds


@over_backends("qb_step")
@pytest.mark.parametrize("binning", ["uniform", "log_margin"])
@pytest.mark.parametrize("poison", ["bias", "bounds", "both", "inverted_bounds"])
def test_qb_step_reads_through_the_committed_state(backend, binning, poison):
    """With ``committed``, non-finite bias entries and invalid bounds are read from it: the
    update of a poisoned state equals the update of the clean one bitwise, and ``committed``
    then holds the state the update left."""
    e, k, b = 12, 3, (200 if binning == "uniform" else 64)
    hist = random_histogram(e, b, torch.int32, seed=5).to(DEVICE)
    bias0, bounds0 = _committed_state(e, binning, seed=6)
    clean_bias, clean_bounds = bias0.clone().to(DEVICE), bounds0.clone().to(DEVICE)
    kw = dict(binning=binning, backend=backend)
    amdqb.qb_step_(clean_bias, hist, clean_bounds, k, 0.25, **kw)

    bias, bounds = bias0.clone(), bounds0.clone()
    if poison in ("bias", "both"):
        bias[[1, 7]] = torch.tensor([float("nan"), -float("inf")])
    if poison in ("bounds", "both"):
        bounds[1] = float("nan")
    if poison == "inverted_bounds":  # finite but invalid for the binning
        bounds = bounds.flip(0).neg() if binning == "log_margin" else bounds.flip(0)
    bias, bounds = bias.to(DEVICE), bounds.to(DEVICE)
    committed = torch.cat([bias0, bounds0]).to(DEVICE)
    rejected = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    amdqb.mark_qb_bin_bounds_validated(bounds)  # the balancer's trust: the kernel guards
    amdqb.qb_step_(bias, hist, bounds, k, 0.25, rejected=rejected, committed=committed, **kw)
    assert torch.equal(bias, clean_bias) and torch.equal(bounds, clean_bounds)
    assert torch.equal(committed, torch.cat([clean_bias, clean_bounds]))
    assert int(rejected) == 0


@over_backends("qb_step")
@pytest.mark.parametrize("binning", ["uniform", "log_margin"])
def test_balancer_recovers_from_outside_writes(backend, binning):
    """A NaN / inf written into the balancer's bias or bounds between route() and step() is
    restored from its last committed state: the step gives the clean balancer's state."""
    e, k = 16, 4
    g = gen(11)
    skew = torch.linspace(-1, 1, e)
    batches = [(torch.randn(256, e, generator=g) + skew).to(DEVICE) for _ in range(4)]
    bal = amdqb.QuantileBalancer(e, k, binning=binning, device=DEVICE)
    clean = amdqb.QuantileBalancer(e, k, binning=binning, device=DEVICE)
    for step, x in enumerate(batches):
        for balancer in (bal, clean):
            balancer.route(x, accumulate=True)
        if step == 1:
            bal.bias[3] = float("nan")
            bal.bias[5] = float("inf")
        if step == 2:
            bal.bin_bounds.fill_(float("nan"))
        for balancer in (bal, clean):
            balancer.step(backend=backend)
        assert torch.equal(bal.bias, clean.bias), step
        assert torch.equal(bal.bin_bounds, clean.bin_bounds), step
    assert bool(torch.isfinite(bal.bias).all()) and int(bal.rejected_steps) == 0
    _, rmap = bal.route(batches[0], accumulate=False)  # routes by the restored, balanced bias
    assert torch.equal(rmap, clean.route(batches[0], accumulate=False)[1])


def test_buffers_initial_state_and_addresses_stable():
    bal = amdqb.QuantileBalancer(16, 4, num_bins=100, device=DEVICE, binning="uniform")
    assert bal.bias.tolist() == [0.0] * 16
    assert bal.bin_bounds.tolist() == [-1.0, 1.0]
    assert bal.histogram.shape == (16, 100) and bal.histogram.dtype == torch.int32
    ptrs = (bal.bias.data_ptr(), bal.bin_bounds.data_ptr(), bal.histogram.data_ptr())
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        bal.route(
            torch.randn(64, 16, generator=g).to(DEVICE) + torch.linspace(-1, 1, 16, device=DEVICE)
        )
        bal.step()
    assert ptrs == (bal.bias.data_ptr(), bal.bin_bounds.data_ptr(), bal.histogram.data_ptr())
    assert int(bal.histogram.sum()) == 0
    lo, hi = bal.bin_bounds.tolist()
    assert lo == pytest.approx(float(bal.bias.min()) - 1) and hi == pytest.approx(
        float(bal.bias.max()) + 1
    )
    assert abs(float(bal.bias.double().mean())) < 1e-6


def test_step_equals_oracle_update():
    g = torch.Generator().manual_seed(1)
    bal = amdqb.QuantileBalancer(12, 3, num_bins=200, ema=0.25, device=DEVICE, binning="uniform")
    bal.bias.copy_(torch.randn(12, generator=g) * 0.1)
    bal.bias.sub_(bal.bias.mean())
    bal.bin_bounds.copy_(torch.stack([bal.bias.min() - 1, bal.bias.max() + 1]))
    logits = torch.randn(300, 12, generator=g).to(DEVICE)
    old_bias = bal.bias.clone()
    bounds_before = bal.bin_bounds.clone()
    bal.route(logits, backend="torch")
    expected_hist = bal.histogram.clone()
    want_bias, want_bounds = ref.qb_step_update(old_bias, expected_hist, bounds_before, 3, 0.25)
    bal.step()
    torch.testing.assert_close(bal.bias, want_bias, atol=1e-6, rtol=0)
    torch.testing.assert_close(bal.bin_bounds, want_bounds, atol=1e-6, rtol=0)


def test_no_grad_and_eval_do_not_accumulate_unless_asked():
    bal = amdqb.QuantileBalancer(8, 2, num_bins=10, device=DEVICE, binning="uniform")
    logits = torch.randn(5, 8, device=DEVICE)
    with torch.no_grad():
        bal.route(logits)
    assert int(bal.histogram.sum()) == 0
    with torch.no_grad():
        bal.route(logits, accumulate=True)
    assert bal.histogram.sum(1).tolist() == [5] * 8
    bal.route(logits)  # grad enabled: training-mode default accumulates
    assert bal.histogram.sum(1).tolist() == [10] * 8


def test_microbatches_of_different_sizes_accumulate_like_one_batch():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(320, 64, generator=g).to(DEVICE)
    one = amdqb.QuantileBalancer(64, 8, device=DEVICE, binning="uniform")
    one.route(logits, accumulate=True)
    split = amdqb.QuantileBalancer(64, 8, device=DEVICE, binning="uniform")
    split.route(logits[:127], accumulate=True)
    split.route(logits[127:], accumulate=True)
    assert torch.equal(one.histogram, split.histogram)


def test_state_dict_roundtrip_keeps_addresses():
    a = amdqb.QuantileBalancer(8, 2, num_bins=10, ema=0.5, device=DEVICE, binning="uniform")
    a.bias.copy_(torch.linspace(-0.1, 0.1, 8))
    a.bin_bounds.copy_(torch.tensor([-1.1, 1.1]))
    b = amdqb.QuantileBalancer(8, 2, num_bins=10, device=DEVICE, binning="uniform")
    ptr = b.bias.data_ptr()
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.bias, b.bias) and torch.equal(a.bin_bounds, b.bin_bounds)
    assert b.ema == 0.5 and b.bias.data_ptr() == ptr
    with pytest.raises(ValueError, match="num_bins"):
        amdqb.QuantileBalancer(8, 2, num_bins=11, binning="uniform").load_state_dict(a.state_dict())


def test_balancing_reduces_maxvio_on_a_skewed_stream():
    g = torch.Generator().manual_seed(3)
    e, k = 32, 4
    skew = torch.linspace(-2, 2, e)
    bal = amdqb.QuantileBalancer(e, k, device=DEVICE, binning="uniform")
    first = last = None
    for step in range(12):
        logits = (torch.randn(2048, e, generator=g) + skew).to(DEVICE)
        _, rmap = bal.route(logits)
        vio = float(amdqb.maxvio(rmap.sum(0)))
        first = vio if step == 0 else first
        last = vio
        bal.step()
    assert first > 1.0 and last < 0.25 * first


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# bins per binning in the pooling test: K3's uniform histogram and the balancer's default
POOL_BINS = {"uniform": 500, "log_margin": 64}


def _rank_main(rank, world, port, logits, binning, result_dir):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        bal = amdqb.QuantileBalancer(
            logits.shape[1], 4, binning=binning, num_bins=POOL_BINS[binning]
        )
        shard = logits.chunk(world)[rank]
        bal.route(shard, accumulate=True)
        pooled = bal.histogram.clone()
        dist.all_reduce(pooled)
        bal.step()
        torch.save(
            {"pooled": pooled, "bias": bal.bias, "bounds": bal.bin_bounds},
            os.path.join(result_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("binning", sorted(POOL_BINS))
def test_two_process_gloo_pooled_histogram_equals_single_process(tmp_path, binning):
    """Two ranks sum their histograms in step(): each ends with the bias and bounds of one process
    that routed the whole batch (the pooled quantile, not a mean of per-rank quantiles)."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(400, 24, generator=g) + torch.linspace(-1, 1, 24)
    args = (2, _free_port(), logits, binning, str(tmp_path))
    mp.spawn(_rank_main, args=args, nprocs=2, join=True)
    single = amdqb.QuantileBalancer(24, 4, binning=binning, num_bins=POOL_BINS[binning])
    single.route(logits, accumulate=True)
    hist = single.histogram.clone()
    single.step()
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for res in results:
        assert torch.equal(res["pooled"], hist)
        assert torch.equal(res["bias"], single.bias)
        assert torch.equal(res["bounds"], single.bin_bounds)
