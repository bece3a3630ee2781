"""The log_margin in-bin moments (``QuantileBalancer(E, k, moments=True)``): each fine-key pair's
position inside its bin (``ref.router.qb_margin_in_bin``) against the bits it comes from, the
int64 ``[3, E, B]`` histogram's planes against sums taken one pair at a time, the refined
quantile (``ref.qb.refine_in_bin``) on an atom, on uniform counts and off the fine keys, the
op-level checks, every backend's histogram planes (hip's in each of its router kernels and counting
modes) and step against the oracle, and the balancer's recovery after a sudden shift at saturated
logits."""

import dataclasses

import pytest
import torch

import amdqb
from amdqb import dispatch, ref
from amdqb.backends.calls import QbRequest, RouterCall
from amdqb.backends.hip import router as hip_router
from amdqb.ref import qb as ref_qb
from amdqb.ref.router import (
    MARGIN_MOMENT_BITS,
    margin_fine_keys,
    qb_histogram_counts,
    qb_margin_bin_index,
    qb_margin_in_bin,
)

from conftest import DEVICE, over_backends, set_config
from layout_cases import gen

B = 64
HALF = B // 2
FINE = margin_fine_keys(B)


def _margins(n, seed, scale=2.0**20):
    """Margins over the fine and coarse keys of an axis of inverse scale ``scale``, both signs,
    zeros and a NaN."""
    g = gen(seed)
    d = torch.randn(n, generator=g) * torch.exp2(torch.rand(n, generator=g) * 14 - 2) / scale
    d[:4] = torch.tensor([0.0, -0.0, float("nan"), 3e38])
    return d.float()


def test_in_bin_position_is_the_fraction_bits_of_y():
    inv = torch.tensor([2.0**20])
    d = _margins(4000, 1)
    u = qb_margin_in_bin(d[:, None], inv, B)[:, 0]
    bins = qb_margin_bin_index(d[:, None], inv, B)[:, 0]
    y = 1.0 + d.abs() * inv.float()
    bits = y.view(torch.int32).to(torch.int64)
    level = (bits >> 22) - 254
    on_fine = (level < FINE) & (d != 0) & ~torch.isnan(d)
    # a position exactly where the pair is on a fine key (bins h - F .. h - 1, h + 1 .. h + F)
    assert torch.equal(u >= 0, on_fine)
    assert torch.equal(on_fine, (bins != HALF) & ((bins - HALF).abs() <= FINE) & ~torch.isnan(d))
    top = (bits >> (22 - MARGIN_MOMENT_BITS)) & 255
    want = torch.where(d < 0, 255 - top, top)
    assert torch.equal(u[on_fine], want[on_fine])
    assert int(u.max()) <= 255 and bool((u[~on_fine] == -1).all())


def test_in_bin_position_ascends_with_d_inside_each_bin():
    inv = torch.tensor([2.0**20])
    d = torch.sort(_margins(20000, 2)[4:]).values
    u = qb_margin_in_bin(d[:, None], inv, B)[:, 0]
    bins = qb_margin_bin_index(d[:, None], inv, B)[:, 0]
    same = (bins[1:] == bins[:-1]) & (u[1:] >= 0) & (u[:-1] >= 0)
    assert int(same.sum()) > 10000  # most neighbours share a fine key
    assert bool((u[1:][same] >= u[:-1][same]).all())
    # and each fine bin's positions spread over the bin (both ends reached)
    for b in (HALF - 3, HALF + 3):
        inside = u[bins == b]
        assert int(inside.min()) < 16 and int(inside.max()) > 239, b


def test_histogram_planes_are_the_pairs_sums():
    t, e = 300, 6
    g = gen(3)
    values = torch.rand(t, e, generator=g) * 1e-5
    alpha = torch.rand(t, generator=g) * 1e-5
    scale = torch.exp2(torch.randint(15, 22, (e,), generator=g).float())
    scores = torch.rand(t, e, generator=g)
    plain = qb_histogram_counts(scores, alpha, scale, B, "log_margin", values)
    hist = qb_histogram_counts(scores, alpha, scale, B, "log_margin", values, moments=True)
    assert hist.dtype == torch.int64 and hist.shape == (3, e, B)
    assert torch.equal(hist[0], plain.to(torch.int64))
    margin = alpha[:, None] - values
    bins = qb_margin_bin_index(margin, scale, B)
    u = qb_margin_in_bin(margin, scale, B)
    want = torch.zeros(2, e, B, dtype=torch.int64)
    for i in range(t):
        for j in range(e):
            if u[i, j] >= 0:
                want[0, j, bins[i, j]] += u[i, j]
                want[1, j, bins[i, j]] += u[i, j] * u[i, j]
    assert torch.equal(hist[1:], want)
    assert int(hist[1].sum()) > 0  # the draw puts pairs on the fine keys


def _atom_histogram(d0, inv, n_atom, n_rest, e=4):
    """Per expert: ``n_rest`` margins far below (coarse keys, d < 0) and an atom of ``n_atom``
    margins at ``d0`` (on a fine key), as int64 [3, e, B] through the reference."""
    d = torch.cat([torch.full((n_rest,), -1e3 / inv), torch.full((n_atom,), d0)]).float()
    margin = d[:, None].expand(-1, e).contiguous()
    scale = torch.full((e,), inv)
    alpha = torch.zeros(d.numel())
    return qb_histogram_counts(
        torch.zeros_like(margin), alpha, scale, B, "log_margin", -margin, moments=True
    )


@pytest.mark.parametrize("d0", [2.7e-6, 5.3e-6, 1.4e-5, -3.9e-6])
def test_an_atom_is_recovered_at_its_margin(d0):
    """Every pair of the quantile's bin at one margin: the moments place the correction at the
    atom to 1/256 of the bin, where App. D's interpolation inside the bin is off by up to a
    bin (41% of |d|)."""
    inv = 2.0**20
    e, topk = 4, 1
    # the k/E quantile (1 of 4 experts: a quarter of the pairs) falls inside the atom
    hist = _atom_histogram(d0, inv, n_atom=300, n_rest=40, e=e)
    scale = torch.full((e,), inv)
    refined = ref_qb.recover_margin_delta(hist, scale, topk)
    linear = ref_qb.recover_margin_delta(hist[0], scale, topk)
    rel = ((refined - d0).abs() / abs(d0)).max().item()
    assert rel < 0.41 / 256 * 2, (refined, d0)
    assert ((linear - d0).abs() / abs(d0)).min().item() > 20 * rel


def test_uniform_counts_keep_the_interpolation():
    """Pairs spread evenly over the quantile's bin: the refined fraction is App. D's within the
    positions' 8-bit resolution, on both sides of the zero bin."""
    inv = 2.0**20
    e = 2
    for sign in (1.0, -1.0):
        # margins evenly over the fine key [y in 2^4 * [1.5, 2)] = d in [23, 31) / inv
        n = 4096
        d = sign * (23.0 + 8.0 * (torch.arange(n).double() + 0.5) / n) / inv
        margin = d.float()[:, None].expand(-1, e).contiguous()
        scale = torch.full((e,), inv)
        hist = qb_histogram_counts(
            torch.zeros_like(margin),
            torch.zeros(n),
            scale,
            B,
            "log_margin",
            -margin,
            moments=True,
        )
        position, _ = ref_qb.quantile_position(hist[0], 1)  # q = n / 2: the middle
        refined, _ = ref_qb.refine_in_bin(hist, 1)
        assert torch.allclose(refined, position, atol=4 / 256), (sign, refined, position)


def test_off_the_fine_keys_nothing_changes():
    """A quantile on a coarse key, in the zero bin or in an empty row: the refined position is
    App. D's."""
    g = gen(5)
    counts = torch.randint(0, 50, (6, B), generator=g)
    counts[:, HALF - FINE : HALF + FINE + 1] = 0  # every fine key empty: the quantile is coarse
    counts[5] = 0
    hist = torch.stack([counts, counts * 100, counts * 20000]).to(torch.int64)
    position, _ = ref_qb.quantile_position(hist[0], 2)
    assert torch.equal(ref_qb.refine_in_bin(hist, 2)[0], position)
    zero_bin = torch.zeros(3, 2, B, dtype=torch.int64)
    zero_bin[0, :, HALF] = 10
    position, _ = ref_qb.quantile_position(zero_bin[0], 1)
    assert torch.equal(ref_qb.refine_in_bin(zero_bin, 1)[0], position)


def test_op_checks_name_the_histogram():
    e, k = 16, 2
    logits = torch.randn(8, e)
    bias = torch.zeros(e)
    scale = ref_qb.initial_margin_scale(e)
    call = dict(selection="tie_free", qb_binning="log_margin", expert_bias=bias)
    for bad, error, match in (
        (torch.zeros(3, e, B, dtype=torch.int32), TypeError, "int64"),
        (torch.zeros(e, B, dtype=torch.int64), TypeError, "int32"),
        (torch.zeros(4, e, B, dtype=torch.int64), ValueError, r"\[3, E, B\]"),
    ):
        with pytest.raises(error, match=match):
            amdqb.fused_topk_with_score_function(
                logits, k, qb_histogram=bad, qb_bin_bounds=scale, qb_histogram_mode="auto", **call
            )
    uniform = torch.zeros(3, e, 100, dtype=torch.int64)
    with pytest.raises(ValueError, match="log_margin"):
        amdqb.fused_topk_with_score_function(
            logits,
            k,
            expert_bias=bias,
            qb_histogram=uniform,
            qb_bin_bounds=torch.tensor([-1.0, 1.0]),
            qb_histogram_mode="auto",
        )
    with pytest.raises(ValueError, match="log_margin"):
        amdqb.qb_step_(bias.clone(), uniform, torch.tensor([-1.0, 1.0]), k, binning="uniform")
    with pytest.raises(ValueError, match="moments"):
        amdqb.QuantileBalancer(e, k, binning="uniform", moments=True)


def test_no_backend_declines_the_moments():
    info = dispatch.device_info(torch.device("cpu"))
    call = RouterCall(
        64, 4, qb_mode="auto", qb_binning="log_margin", selection="tie_free", num_bins=B
    )
    moments = dataclasses.replace(call, qb_moments=True)
    for backend in dispatch.BACKENDS:
        limits = getattr(dispatch._backend_module(backend), "LIMITS", {})
        check = limits.get("router_fwd", lambda info, call: None)
        assert check(info, call) is None, backend
        assert check(info, moments) is None, backend
        for op in ("qb_step", "qb_recover"):  # the recovery is every backend's
            qb = limits.get(op, lambda info, request: None)
            assert qb(info, QbRequest(num_bins=B, moments=True)) is None, (backend, op)


# hip's router kernels and counting modes: the decode form (one block per token), the warp kernel
# with device atomics, and the warp kernel counting the bins at or above the cutoff in LDS (the
# fused mode; the two-kernel mode's router writes bins and positions for amdqb_qb_hist_bins)
_WARP = {"hip.router.decode_max_tokens": 0, "hip.router.decode_max_tokens_fused": 0}
_HIP_KERNELS = {
    "decode": {},
    "warp": {**_WARP, "hip.router.margin_lds": False},
    "warp_lds": {**_WARP, "hip.router.margin_lds": True},
}


@over_backends("router_fwd", waves=(32, 64), gcn=("gfx942",))
@pytest.mark.parametrize("kernel", sorted(_HIP_KERNELS))
def test_router_planes_match_the_oracle(backend, kernel, monkeypatch, emu_rt):
    """Counts and moments of every backend, bitwise the oracle's on the backend's own scores, on
    axes where many pairs fall on the fine keys; both QB modes (Triton's always count in the
    router's pass, hip's two-kernel mode in its counting kernel), hip in each of its kernels and
    counting modes."""
    if backend != "hip" and kernel != "decode":
        pytest.skip("hip's kernel variants: one run of every other backend")
    if backend == "hip":
        set_config(monkeypatch, _HIP_KERNELS[kernel])
        if kernel == "warp":  # slices of at most 16 tokens: the bound of the int32 LDS sums
            monkeypatch.setattr(hip_router, "MOMENTS_MAX_SLICE", 16)
    # E=45 on the warp kernel: the counting kernel's one-byte reads (vec 1), else 4 at once
    e, k, t = 45 if kernel == "warp" else 48, 4, 200
    g = gen(8)
    logits = (torch.randn(t, e, generator=g) * 12).to(DEVICE)
    bias = (torch.randn(e, generator=g) * 1e-6).to(DEVICE)
    scale = torch.exp2(torch.randint(8, 24, (e,), generator=g).float()).to(DEVICE)
    fn = dispatch._backend_module(backend).OPS["router_fwd"]
    for mode in ("fused_atomic", "two_kernel"):
        call = RouterCall(
            e, k, qb_mode=mode, qb_binning="log_margin", selection="tie_free", num_bins=B,
            qb_moments=True, write_scores=True,
        )  # fmt: skip
        hist = torch.zeros(3, e, B, dtype=torch.int64, device=DEVICE)
        scores = torch.empty(t, e, device=DEVICE)
        probs = torch.empty(t, e, device=DEVICE)
        routed = torch.empty(t, e, dtype=torch.bool, device=DEVICE)
        fn(call, logits, bias, probs, routed, hist, scale, scores, None)
        if emu_rt is not None:  # the kernel the variant names ran, in the counting mode it names
            routers = ("amdqb_router", "amdqb_router_decode")
            name, _, _, smem = [x for x in emu_rt.launches if x[0] in routers][-1]
            assert name == ("amdqb_router_decode" if kernel == "decode" else "amdqb_router")
            lds = kernel == "warp_lds" and mode == "fused_atomic"
            assert (smem > 0) == lds, (kernel, mode, smem)
            counted, grid = emu_rt.launches[-1][:2]  # the last: after amdqb_router_scores
            assert (counted == "amdqb_qb_hist_bins") == (mode == "two_kernel"), (kernel, mode)
            if counted == "amdqb_qb_hist_bins" and kernel == "warp":
                assert grid[1] >= -(-t // 16), grid
        want = torch.zeros(3, e, B, dtype=torch.int64)
        ref.fused_topk_with_score_function(
            logits.cpu(), k, expert_bias=bias.cpu(), qb_histogram=want,
            qb_bin_bounds=scale.cpu(), scores=scores.cpu(), selection="tie_free",
            qb_binning="log_margin",
        )  # fmt: skip
        assert int(want[1].sum()) > 0, "the draw puts pairs on the fine keys"
        assert torch.equal(hist.cpu(), want), (backend, mode)


@over_backends("qb_step", waves=(32,))
def test_step_matches_the_oracle(backend):
    """The balancer step on a moments histogram, every backend against the oracle, bitwise;
    histograms whose quantile lands inside fine-key bins, on their last count, in empty rows."""
    e, k = 40, 3
    g = gen(9)
    counts = torch.randint(0, 30, (e, B), generator=g)
    counts[:, HALF] = torch.randint(0, 3, (e,), generator=g)
    counts[4:, : HALF - FINE] = 0  # most rows on the fine keys alone: the quantile on one
    counts[4:, HALF + FINE + 1 :] = 0
    counts[3] = 0  # an empty row
    counts[5] = 0  # the quantile on the last count of a bin: q = 40 * 3 / 40 = 3
    counts[5, HALF - 3], counts[5, HALF + 3] = 3, 37
    s1 = counts * torch.randint(0, 256, (e, B), generator=g)
    s2 = counts * torch.randint(0, 256 * 256, (e, B), generator=g)
    hist = torch.stack([counts, s1, s2]).to(torch.int64)
    scale = torch.exp2(torch.randint(30, 40, (e,), generator=g).float())
    bias0 = torch.randn(e, generator=g) * 1e-4
    want_bias, want_scale = ref_qb.qb_step_update(bias0, hist, scale, k, 0.0, "log_margin")
    bias = bias0.clone().to(DEVICE)
    bounds = scale.clone().to(DEVICE)
    rejected = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    amdqb.qb_step_(
        bias, hist.to(DEVICE), bounds, k, binning="log_margin", rejected=rejected, backend=backend
    )
    assert int(rejected) == 0
    assert torch.equal(bias.cpu(), want_bias) and torch.equal(bounds.cpu(), want_scale), backend
    plain_bias, _ = ref_qb.qb_step_update(bias0, hist[0], scale, k, 0.0, "log_margin")
    assert not torch.equal(plain_bias, want_bias)  # the moments moved the quantile


def test_balancer_routes_and_steps_with_moments():
    e, k = 32, 4
    bal = amdqb.QuantileBalancer(e, k, moments=True)
    assert bal.histogram.shape == (3, e, B) and bal.histogram.dtype == torch.int64
    logits = torch.randn(256, e, generator=gen(6)) * 20
    for _ in range(2):  # the cold axis puts the first corrections on the coarse keys
        bal.route(logits, accumulate=True)
        assert int(bal.histogram[0].sum()) == 256 * e
        before = bal.bias.clone()
        moments = int(bal.histogram[1].sum())
        bal.step()
        assert int(bal.histogram.abs().sum()) == 0 and not torch.equal(bal.bias, before)
    assert moments > 0  # the second step's margins sit on the fine keys of the zoomed axes


def test_moments_recover_a_shift_sooner():
    """E=64, k=4, logit std 20, the suite's shift stream: one step after the shift the balancer
    without the moments peaks at 1.20 MaxVio, the default (with them) at 0.76 (the fp64 exact
    reference: 0.50); both end at the reference's late MaxVio."""
    from amdqb.demo import suite_case

    cell = suite_case("shift", 64, 4, 4096, 20.0, 60, names=("qb_no_moments", "qb_default"))
    m = cell["metrics"]
    assert m["qb_default"]["recovery_peak"] < 0.8 * m["qb_no_moments"]["recovery_peak"], m
    assert m["qb_default"]["first_hit_after_shift"] <= 3
    assert m["qb_default"]["late_ratio"] <= 1.10
