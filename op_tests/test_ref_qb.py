"""QB bias-update math: conformance vectors, exact vs histogram recovery, the balancer update."""

import numpy as np
import pytest
import torch

import amdqb
from amdqb import ref


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
