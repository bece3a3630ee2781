"""QB balance under sigmoid saturation, against the fp64 exact oracle; and that oracle itself.

The oracle (``amdqb.ref.qb.route_fp64`` / ``qb_exact_bias_fp64``) routes and takes the exact
``k/E`` quantile of ``r = alpha - s`` in float64. The balance tests run ``amdqb.demo.Stream`` (the
demo's drifting, skewed stream) at E=64, k=4, T=2048 for 80 steps and compare the mean MaxVio of
the last 50 steps of a balancer with that of the oracle on the *same* logits. Each balancer routes
through the real amdqb router (``QuantileBalancer.route`` / ``.step``).

Why these settings and thresholds (measured with exactly this protocol, seeds 0-8; the study in
bench/results/qb_balance_under_saturation has T=4096 and more methods):

* 80 steps, window 50: log_margin QB starts from a bias spread of 0 (axis scale eps_0 = 1e-30) and
  its axis reaches 6.55 spreads, so the spread grows at most ~14x per step and first balances
  after ~20 steps; the window starts at step 30.
* logit std 1: log_margin / fp64 = 0.99-1.00 on every seed. A 10% margin is wide.
* logit std 10: the TE selection ``s + b`` ties in fp32 for a few % of the tokens at the cutoff,
  a floor no quantile removes: exact QB in fp32 is 1.03-1.15x the oracle per seed. log_margin
  (TE selection) is 1.01-1.08x per seed, 1.041x over seeds 0-8 and 1.028x over the tested seeds
  0-2, so its claim is checked on the mean of three seeds, not per seed. The floor depends on
  the shape: at E=256, k=8 the cutoff (the 9th of 256) lies deeper in the saturated tail, 78% of
  the tokens tie and log_margin with TE selection is 8.3x the oracle (the study). With tie-free
  selection the floor is gone: 0.99-1.02x on every seed here, 0.99x at E=256.
* logit std 20: the TE selection ties for ~100% of the tokens and no TE-selection method balances
  at all; tie-free log_margin does, but its 64 log bins (two per octave) resolve the bias change
  to ~40% of its size, and on this drifting stream the change per step is as large as the bias
  spread itself: 0.99-1.48x per seed, 1.13x over seeds 0-8 (1.41x at T=4096, 120 steps). The 10%
  claim does not hold there (seeds 0-2 alone average 1.06x, so a 10% test on them would pass by
  luck); what is asserted is the bound that holds on every measured seed, 2x.
"""

import functools
import statistics

import pytest
import torch

import amdqb
from amdqb import demo
from amdqb.ref import qb as ref_qb

E, K, T = 64, 4, 2048
STEPS, WINDOW = 80, 50
SEEDS = (0, 1, 2)
FP64 = demo.REFERENCE


@functools.cache
def _late_maxvio(std: float, seed: int, names: tuple, device: str) -> dict:
    """Mean MaxVio of the last WINDOW steps of each method on one stream (shared logits)."""
    dev = torch.device(device)
    stream = demo.Stream(T, E, 64, std, seed, dev, num_hot=E // 16)
    methods = demo.build_methods(names, E, K, dev, uniform_bins=1000, margin_bins=64, aux_rate=1e-3)
    series = {m.name: [] for m in methods}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small per-step tensors: extra intra-op threads only cost time
    try:
        with torch.no_grad():
            for _ in range(STEPS):
                logits = stream.next()
                for m in methods:
                    load = m.route(logits).sum(0)
                    m.update(logits, load)
                    series[m.name].append(float(amdqb.maxvio(load)))
    finally:
        torch.set_num_threads(threads)
    return {name: statistics.fmean(v[-WINDOW:]) for name, v in series.items()}


def _ratio(std, seed, name, names, device) -> float:
    late = _late_maxvio(std, seed, names, str(device))
    return late[name] / late[FP64]


# --------------------------------------------------------------------------------------------
# The fp64 oracle.
# --------------------------------------------------------------------------------------------
def test_fp64_routes_match_the_router_where_fp32_is_unambiguous(device):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1024, E, generator=g).to(device)
    bias = (0.02 * torch.randn(E, generator=g)).to(device)
    _, routing_map = amdqb.fused_topk_with_score_function(
        logits, K, score_function="sigmoid", expert_bias=bias
    )
    ref_map, alpha, s = ref_qb.route_fp64(logits, K, bias)
    u = s + bias.double()
    kth = torch.topk(u, K, dim=1).values[:, -1]
    # fp32 s + b is within ~1.2e-7 of the fp64 value: a wider gap fixes the fp32 order too
    clear = (kth - alpha) > 1e-6
    assert clear.float().mean() > 0.99
    assert torch.equal(routing_map[clear], ref_map[clear])
    assert torch.equal(ref_map.sum(1), torch.full_like(ref_map.sum(1), K))


def test_fp64_ties_break_by_smaller_id(device):
    logits = torch.zeros(3, 8, device=device)
    routing_map, alpha, _ = ref_qb.route_fp64(logits, 2, torch.zeros(8, device=device))
    assert routing_map[:, :2].all() and not routing_map[:, 2:].any()
    assert torch.equal(alpha, torch.full((3,), 0.5, dtype=torch.float64, device=device))


def test_fp64_exact_bias_is_the_exact_quantile(device):
    g = torch.Generator().manual_seed(1)
    e, k, t = 16, 3, 1000
    logits = (2.0 * torch.randn(t, e, generator=g)).to(device)
    bias = (0.05 * torch.randn(e, generator=g)).double().to(device)
    got = ref_qb.qb_exact_bias_fp64(logits, k, bias)
    assert got.dtype == torch.float64
    _, alpha, s = ref_qb.route_fp64(logits, k, bias)
    r = alpha[:, None] - s
    n = -(-t * k // e)
    lo = torch.kthvalue(r, n, dim=0).values
    hi = torch.kthvalue(r, n + 1, dim=0).values
    mid = (lo + hi) / 2
    torch.testing.assert_close(got, mid - mid.mean(), rtol=0, atol=1e-15)
    # the defining property: where the n-th and (n+1)-th differ, a bias strictly between them
    # gives the expert exactly n tokens (elsewhere the quantile sits on a tie, e.g. the tokens
    # whose (k+1)-th expert is j, all with r = b_j)
    separated = lo < hi
    assert separated.sum() >= e // 4
    counts = (r < mid).sum(0)
    assert torch.equal(counts[separated], torch.full_like(counts, n)[separated])


def test_fp64_resolves_scores_that_fp32_saturates(device):
    """z in [18, 26]: fp32 sigmoid is exactly 1 (above ~16.6), so the fp32 router ties every
    expert (id order routes experts 0 and 1 for every token) and fp32 exact QB returns 0; in
    float64 ``1 - s`` keeps ~1e-8..1e-12, and one oracle step on the batch evens out its loads."""
    g = torch.Generator().manual_seed(2)
    e, k, t = 16, 2, 2048
    logits = 18.0 + 6.0 * torch.rand(t, e, generator=g)
    logits = (logits + torch.linspace(0.0, 2.0, e)).to(device)  # a spread of expert temperatures
    zero = torch.zeros(e, device=device)
    assert bool((torch.sigmoid(logits) == 1.0).all())
    _, fp32_map = amdqb.fused_topk_with_score_function(
        logits, k, score_function="sigmoid", expert_bias=zero
    )
    assert torch.equal(fp32_map.sum(0)[:k], torch.full((k,), t, device=device))
    assert bool((amdqb.qb_exact_bias(logits, k, zero) == 0).all())
    bias = ref_qb.qb_exact_bias_fp64(logits, k, zero)
    before = float(amdqb.maxvio(ref_qb.route_fp64(logits, k, zero)[0].sum(0)))
    after = float(amdqb.maxvio(ref_qb.route_fp64(logits, k, bias)[0].sum(0)))
    # one step from bias 0 moves every cutoff too, so it roughly quarters the imbalance here
    # (seeds 0-3: 1.20-1.38 -> 0.25-0.32); fp32 can do nothing with these scores
    assert before > 0.8 and after < 0.5 * before, (before, after)


# --------------------------------------------------------------------------------------------
# The balance claims (see the module docstring for the numbers behind each threshold).
# --------------------------------------------------------------------------------------------
def test_log_margin_matches_fp64_exact_at_std_1(device):
    names = ("qb_log_margin", FP64)
    assert _ratio(1.0, 0, "qb_log_margin", names, device) < 1.10


def test_log_margin_within_10pct_of_fp64_exact_at_std_10(device):
    names = ("qb_log_margin", "qb_tie_free", FP64)
    ratios = [_ratio(10.0, seed, "qb_log_margin", names, device) for seed in SEEDS]
    assert statistics.fmean(ratios) < 1.10, ratios


def test_tie_free_matches_fp64_exact_at_std_10(device):
    names = ("qb_log_margin", "qb_tie_free", FP64)
    ratios = [_ratio(10.0, seed, "qb_tie_free", names, device) for seed in SEEDS]
    assert max(ratios) < 1.10, ratios


@pytest.mark.parametrize("seed", SEEDS)
def test_tie_free_balances_at_std_20(device, seed):
    names = ("qb_tie_free", FP64)
    ratio = _ratio(20.0, seed, "qb_tie_free", names, device)
    assert ratio < 2.0, ratio
