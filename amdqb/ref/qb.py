"""Pure-PyTorch oracles of the Quantile Balancing bias updates (Kimi K3 §2.3.3, App. C-D).

Two binnings of the per-expert histogram (``amdqb.ref.router``):

* ``"uniform"`` (K3): ``r = alpha - s`` on B uniform bins of ``[L, U]``; the recovery is the
  ``k/E`` quantile of r, the new bias itself; biases are centred on their mean.
* ``"log_margin"``: the biased margin ``d = alpha - u`` (u the selection value) on a log axis
  around 0 of each expert's own scale; its ``k/E`` quantile is the bias change ``delta``
  (``b_hat = b + delta``). The bounds tensor holds the per-expert inverse scales ``inv`` (fp32
  ``[E]``, powers of two), and the step moves each expert's scale to its own last correction
  (:func:`margin_scale_update`), so the resolution follows the correction of that expert, not the
  bias range. Biases are pinned at a median of 0 (fp32 keeps its finest spacing where most
  experts sit, however far a few outliers lie) and held within ``+-BIAS_SPREAD_MAX / 2``.

Precision contract:

* histogram counts are summed in int64; the target rank ``n = ceil(m*k/E)`` is computed in integer
  arithmetic, ``q = m*k/E`` and the within-bin interpolation in float64, with ``L, U`` the fp32 bounds
  promoted to float64 and ``w = (U - L) / B``; the result is cast to fp32 once.
* ``m`` is each row's own sum (every row of a router histogram sums to the same token count).
  A row with ``m == 0`` carries no information: uniform recovers the bounds' midpoint, log_margin
  a change of 0.
* uniform centring subtracts the float64 mean of the fp32 values, then casts to fp32; log_margin
  adds ``delta`` to the bias in float64 (one rounding to fp32), then subtracts the lower median
  (an fp32 element) in float64 and clamps to ``+-BIAS_SPREAD_MAX / 2`` (one rounding; a zero
  result is +0).
* a step whose histogram holds a negative count (an int32 bin that wrapped) commits nothing.
"""

from __future__ import annotations

import torch

from .ordering import ranked_indices
from .router import MARGIN_COARSE_SHIFT, MARGIN_MOMENT_BITS, activation, margin_fine_keys

BIAS_SPREAD_MAX = 4.0  # log_margin: max - min bias (|b| <= 2 about the median); a gap of 1 decides
MARGIN_INV_COLD_EXP = 68  # inv = 2^68 before any step: the axis spans 2^-68 .. 2^0 (|d| < 1)
MARGIN_INV_MIN_EXP = 0  # the coarsest axis: eps = 1 (corrections of the spread cap)
MARGIN_INV_MAX_EXP = 120  # the finest axis: eps = 2^-120
# eps = 2^(floor(log2 s) - 4) for the correction scale s, which shrinks by at most 2^3 a step
# (it grows at once). Chosen over (2, 2), (2, 4), (3, 2) on the suite's shift / favoured /
# mean-drift / drift streams at std 10-20, E=64, seeds 0-1: the only one with every late MaxVio
# within 1.06x of the reference (the others reach 1.08-1.12x) and steps after a shift 3-4.
MARGIN_ZOOM_EXP = 4
MARGIN_DECAY_EXP = 3


def new_histogram(num_experts: int, num_bins: int, moments: bool, device=None) -> torch.Tensor:
    """A zeroed QB histogram: int32 ``[E, B]``, or int64 ``[3, E, B]`` with the in-bin moments
    (the counts, then each bin's sums of ``u`` and ``u^2``: a pair adds up to ``255^2``)."""
    if moments:
        return torch.zeros(3, num_experts, num_bins, dtype=torch.int64, device=device)
    return torch.zeros(num_experts, num_bins, dtype=torch.int32, device=device)


def quantile_position(histogram: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """App. D's position of the ``k/E`` quantile in bin units, float64 ``[E]`` in ``[0, B]``,
    and each row's count ``m``: ``beta`` = the first bin whose cumulative count reaches
    ``ceil(q)`` (``q = m*k/E``), plus ``clip((q - c) / h, 0, 1)`` with ``c`` the count before it
    and ``h`` its count."""
    beta, frac, m = quantile_bin(histogram, topk)
    return beta.double() + frac, m


def quantile_bin(histogram: torch.Tensor, topk: int):
    """``(beta int64 [E], frac float64 [E], m int64 [E])`` of :func:`quantile_position`: the
    quantile's bin and the fraction inside it (1 where the quantile is the bin's last count)."""
    e, b = histogram.shape
    counts = histogram.to(torch.int64)
    cum = torch.cumsum(counts, dim=1)
    m = cum[:, -1]
    target = (m * topk + e - 1) // e  # ceil(m*k/E), exact
    q = (m * topk).double() / e
    beta = torch.searchsorted(cum, target[:, None], right=False).squeeze(1).clamp(max=b - 1)
    before = torch.where(beta > 0, cum.gather(1, (beta - 1).clamp(min=0)[:, None]).squeeze(1), 0)
    h = counts.gather(1, beta[:, None]).squeeze(1)
    frac = torch.where(h > 0, (q - before.double()) / h.clamp(min=1).double(), 0.0).clamp(0.0, 1.0)
    return beta, frac, m


def recover_uncentred(histogram: torch.Tensor, bin_bounds: torch.Tensor, topk: int) -> torch.Tensor:
    """App. D recovery of the uniform binning before centring, fp32 ``[E]``."""
    b = histogram.shape[1]
    position, m = quantile_position(histogram, topk)
    lower = bin_bounds[0].double()
    upper = bin_bounds[1].double()
    width = (upper - lower) / b
    bhat = lower + position * width
    bhat = torch.where(m > 0, bhat, (lower + upper) / 2)
    return bhat.float()


def refine_in_bin(histogram: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantile_position` of the counts of ``histogram`` (int64 ``[3, E, B]``,
    :func:`amdqb.ref.router.qb_histogram_counts` with ``moments``) with its fraction inside a
    fine-key bin taken from that bin's in-bin moments: ``(position float64 [E], m)``.

    With ``h`` the bin's count, ``f`` the fraction App. D interpolates (the share of the bin
    below the quantile), ``S1`` and ``S2`` the bin's sums of ``u`` and ``u^2``,
    ``mu = (S1 / h + 1/2) / 256`` the mean in-bin position and
    ``var = max(S2 / h - (S1 / h)^2, 0) / 256^2`` its variance, the fraction is
    ``clip(mu + (f - 1/2) * 2 sqrt(3 var), 0, 1)``: the quantile of a uniform distribution with
    the bin's own mean and variance. Uniform counts give ``f`` back; an atom (every pair of the
    bin at one margin, as at saturated logits, where an expert's margins sit at the other
    experts' bias gaps) gives its position. Bins that are not fine keys, and empty ones, keep
    ``f``."""
    beta, frac, m = quantile_bin(histogram[0], topk)
    # the quantile bin's count and sums (exact int64, then float64)
    h, s1, s2 = histogram.gather(2, beta.expand(3, -1)[:, :, None]).squeeze(2).to(torch.float64)
    b = histogram.shape[-1]
    half, fine = b // 2, margin_fine_keys(b)
    n = h.clamp(min=1.0)
    mean = s1 / n
    second = s2 / n
    unit = float(1 << MARGIN_MOMENT_BITS)
    mu = (mean + 0.5) / unit
    var = (second - mean * mean).clamp(min=0.0) / (unit * unit)
    refined = (mu + (frac - 0.5) * 2.0 * torch.sqrt(3.0 * var)).clamp(0.0, 1.0)
    on_fine = ((beta >= half - fine) & (beta < half)) | ((beta > half) & (beta <= half + fine))
    on_fine = on_fine & (h > 0)
    return beta.double() + torch.where(on_fine, refined, frac), m


def recover_margin_delta(histogram: torch.Tensor, margin_scale: torch.Tensor, topk: int):
    """The log_margin recovery: the ``k/E`` quantile of each expert's biased margin, i.e. its bias
    change ``delta``, float64 ``[E]`` (0 for an empty row).

    The quantile position ``p`` (:func:`quantile_position`) maps back through the bins of
    ``amdqb.ref.router.qb_margin_bin_index`` (``h = B/2``): ``p`` in the zero bin ``[h, h + 1)``
    is ``delta = 0``; above it ``kappa = p - h - 1``, below ``kappa = h - p`` (key positions,
    ascending away from 0). The half-octave level is ``lam = kappa`` on the F fine keys and
    ``F + 8 (kappa - F)`` on the coarse ones, ``y = 2^o (1 + f)`` with ``o, f`` the integer and
    fractional parts of ``lam / 2`` (the float format's piecewise-linear log2, exact to invert),
    and ``|delta| = (y - 1) / inv_j``. Interpolation is linear in the level inside a bin (linear
    in d on the fine keys), as App. D's in r. A ``[3, E, B]`` histogram (counts and in-bin
    moments) places the quantile inside a fine-key bin by :func:`refine_in_bin`."""
    b = histogram.shape[-1]
    half = b // 2
    fine = margin_fine_keys(b)
    if histogram.dim() == 3:
        position, m = refine_in_bin(histogram, topk)
    else:
        position, m = quantile_position(histogram, topk)
    offset = position - half
    up = offset >= 1.0
    kappa = torch.where(up, offset - 1.0, -offset).clamp(min=0.0)
    level = torch.where(
        kappa < fine, kappa, fine + (kappa - fine) * float(1 << MARGIN_COARSE_SHIFT)
    )
    octave = torch.floor(level / 2.0)
    y = torch.ldexp(1.0 + (level / 2.0 - octave), octave.to(torch.int64))
    magnitude = (y - 1.0) / margin_scale.double()
    delta = torch.where(up, magnitude, torch.where(offset >= 0, 0.0, -magnitude))
    return torch.where(m > 0, delta, torch.zeros_like(delta))


def initial_margin_scale(num_experts: int, device=None) -> torch.Tensor:
    """The log_margin axis before any step: fp32 ``[E]`` of ``2^68`` (the fine keys at 2^-68,
    the coarse ones up to |d| = 1, any correction a fresh router can need)."""
    return torch.full((num_experts,), 2.0**MARGIN_INV_COLD_EXP, dtype=torch.float32, device=device)


def margin_scale_update(margin_scale: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """The next per-expert axis: fp32 ``[E]`` powers of two ``inv = 2^n``.

    With ``e = floor(log2 inv)`` the old exponent and ``t = floor(log2 |delta|)`` (exact, from
    the float64 exponent; ``delta = 0`` counts as no bound), ``n = min(4 - t, e + 3)`` clamped to
    ``[0, 120]``: the axis scale ``2^-n`` moves to 4-5 octaves below the correction just made
    (a larger correction widens it at once, a smaller one narrows it by at most 8x a step)."""
    e = torch.frexp(margin_scale.double()).exponent.to(torch.int64) - 1
    t = torch.frexp(delta.double().abs()).exponent.to(torch.int64) - 1
    wider = torch.where(delta != 0, MARGIN_ZOOM_EXP - t, torch.full_like(t, MARGIN_INV_MAX_EXP))
    n = torch.minimum(wider, e + MARGIN_DECAY_EXP).clamp(MARGIN_INV_MIN_EXP, MARGIN_INV_MAX_EXP)
    return torch.ldexp(torch.ones_like(delta, dtype=torch.float64), n).float()


def margin_scale(bias: torch.Tensor) -> torch.Tensor:
    """The log_margin bounds a fresh balancer starts from for ``bias`` (fp32 ``[E]``):
    :func:`initial_margin_scale` on the bias's device."""
    return initial_margin_scale(bias.numel(), bias.device)


def lower_median(values: torch.Tensor) -> torch.Tensor:
    """0-dim: the ``(E - 1) // 2``-th smallest of ``values`` ``[E]`` (0-based; the lower of the
    two middle values for an even E, ``torch.median``'s), an element of ``values``."""
    return values.median()


def pin_median(bias: torch.Tensor) -> torch.Tensor:
    """``clamp(b - median(b), -BIAS_SPREAD_MAX / 2, BIAS_SPREAD_MAX / 2)`` in float64 with the
    lower median (:func:`lower_median`), one rounding to fp32, zeros as +0: the log_margin
    centring. Most experts sit near the median, so their biases are small and fp32 keeps the
    fine spacing their corrections need (pinning the minimum put them at the distance of the
    lowest outlier: at logit std 20, one hot expert 1.5e-7 below the rest left the others with an
    fp32 spacing of 1e-14 where their corrections were 1e-17). The clamp bounds the recovery
    from an absurd state; scores lie in ``[0, 1]``, so a gap above 1 already decides every
    comparison."""
    b = bias.double()
    half = BIAS_SPREAD_MAX / 2
    return ((b - lower_median(b)) + 0.0).clamp(-half, half).float()


def centre(bias: torch.Tensor) -> torch.Tensor:
    """Subtract the mean (float64 accumulation), fp32 result."""
    return (bias.double() - bias.double().mean()).float()


def qb_recover_bias(
    histogram: torch.Tensor,
    bin_bounds: torch.Tensor,
    topk: int,
    binning: str = "uniform",
    expert_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Centred App. D bias estimate from an int32 ``[E, B]`` histogram: ``"uniform"`` with fp32
    ``[L, U]`` bounds, mean-centred; ``"log_margin"`` with the per-expert inverse scales ``[E]``
    and the bias the margins were measured against: ``b + delta`` (float64, one rounding),
    pinned at a median of 0 (:func:`pin_median`)."""
    if binning == "uniform":
        return centre(recover_uncentred(histogram, bin_bounds, topk))
    delta = recover_margin_delta(histogram, bin_bounds, topk)
    return pin_median((expert_bias.double() + delta).float())


def required_bias(logits: torch.Tensor, topk: int, expert_bias: torch.Tensor) -> torch.Tensor:
    """fp32 ``r = alpha - s`` ``[T, E]`` with alpha the (k+1)-th biased score of each token."""
    s = activation(logits.float(), "sigmoid")
    biased = s + expert_bias.float()
    cut = ranked_indices(biased, topk + 1)[:, topk : topk + 1]
    alpha = biased.gather(1, cut)
    return alpha - s


def qb_exact_bias(logits: torch.Tensor, topk: int, expert_bias: torch.Tensor) -> torch.Tensor:
    """Exact, bin-free ``Quantile_{k/E}`` of each expert's required bias, centred.

    With ``n = ceil(m*k/E)`` and the column sorted ascending (NaN last), the estimate is the midpoint
    of the n-th and (n+1)-th smallest required biases: every bias strictly between them gives the
    expert exactly n tokens (``s + b > alpha``). For ``n == m`` it is the largest value.
    """
    r = required_bias(logits, topk, expert_bias)
    m, e = r.shape
    if m == 0:
        return torch.zeros(e, dtype=torch.float32, device=r.device)
    n = -(-m * topk // e)
    # The n+1 smallest of each column, ascending (values only: ties cannot change them).
    srt = torch.topk(
        torch.nan_to_num(r.double(), nan=float("inf")), min(n + 1, m), dim=0, largest=False
    ).values
    lo = srt[max(n - 1, 0)]
    hi = srt[min(n, m - 1)]
    return centre(((lo + hi) / 2).float())


def qb_step_update(
    bias: torch.Tensor,
    histogram: torch.Tensor,
    bin_bounds: torch.Tensor,
    topk: int,
    ema: float = 0.0,
    binning: str = "uniform",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One balancer step (after the all-reduce): ``(new_bias fp32 [E], new_bounds fp32)``.

    Uniform: ``new = centre(ema * old + (1 - ema) * centre(recover(hist)))``, bounds
    ``[min(new) - 1, max(new) + 1]``. log_margin: ``t = fp32(old + delta)``,
    ``new = pin_median(fp32(ema * old + (1 - ema) * t))``, bounds
    ``margin_scale_update(bounds, delta)``; a ``[3, E, B]`` log_margin histogram carries the
    in-bin moments (:func:`recover_margin_delta`). An empty histogram keeps both.
    """
    total = (histogram[0] if histogram.dim() == 3 else histogram).to(torch.int64).sum()
    if binning == "uniform":
        bhat = centre(recover_uncentred(histogram, bin_bounds, topk))
        mixed = (ema * bias.double() + (1.0 - ema) * bhat.double()).float()
        new = torch.where(total > 0, centre(mixed), bias.float())
        return new, torch.stack([new.min() - 1.0, new.max() + 1.0]).float()
    delta = recover_margin_delta(histogram, bin_bounds, topk)
    moved = (bias.double() + delta).float()
    mixed = (ema * bias.double() + (1.0 - ema) * moved.double()).float()
    new = torch.where(total > 0, pin_median(mixed), bias.float())
    scale = torch.where(total > 0, margin_scale_update(bin_bounds, delta), bin_bounds.float())
    return new, scale


def bounds_are_valid(bounds: torch.Tensor, binning: str) -> torch.Tensor:
    """Bounds the binning accepts: uniform ``[L, U]`` finite with ``L < U`` (a 0-dim bool);
    log_margin, per entry: finite and ``> 0`` (bool ``[E]``)."""
    if binning == "uniform":
        return torch.isfinite(bounds).all() & (bounds[0] < bounds[1])
    return torch.isfinite(bounds) & (bounds > 0)


def step_commits(
    bias: torch.Tensor, bounds: torch.Tensor, histogram: torch.Tensor, binning: str
) -> torch.Tensor:
    """0-dim bool: a step's candidate may be committed -- a finite bias, valid bounds and a
    histogram with no negative count (a negative int32 count is a bin that wrapped)."""
    return (
        torch.isfinite(bias).all()
        & bounds_are_valid(bounds, binning).all()
        & (histogram >= 0).all()
    )


def restore_committed(
    bias: torch.Tensor, bounds: torch.Tensor, committed: torch.Tensor, binning: str
) -> None:
    """In place: bias entries that are not finite, and bounds invalid for the binning (uniform:
    both entries; log_margin: per entry), take the values of ``committed`` (the last committed
    bias, then bounds)."""
    e = bias.numel()
    torch.where(torch.isfinite(bias), bias, committed[:e], out=bias)
    torch.where(bounds_are_valid(bounds, binning), bounds, committed[e:], out=bounds)


def aux_free_bias_update(
    bias: torch.Tensor, tokens_per_expert: torch.Tensor, rate: float = 1e-3
) -> torch.Tensor:
    """DeepSeek-V3 aux-loss-free rule: ``b += rate * sign(mean_load - load)`` (fp32)."""
    load = tokens_per_expert.double()
    return (bias.double() + rate * torch.sign(load.mean() - load)).to(bias.dtype)


def maxvio(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """``max(load) / mean(load) - 1`` as a 0-dim fp32 tensor (0 for an empty load or a load
    with no tokens; NaN when a load is NaN or infinite, never a balance it does not show)."""
    load = tokens_per_expert.double()
    if load.numel() == 0:  # a shape, known on the host: no sync
        return torch.zeros((), dtype=torch.float32, device=load.device)
    mean = load.mean()
    vio = torch.where(mean > 0, load.max() / mean - 1.0, torch.zeros_like(mean))
    return torch.where(torch.isfinite(mean), vio, torch.full_like(mean, float("nan"))).float()


def cv2(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Squared coefficient of variation of the load shares, ``mean((f - 1/E)^2) / (1/E)^2``
    (0 for an empty load)."""
    load = tokens_per_expert.double()
    e = load.numel()
    if e == 0:
        return torch.zeros((), dtype=torch.float32, device=load.device)
    f = load / load.sum().clamp(min=1)
    return (((f - 1.0 / e) ** 2).mean() * e * e).float()
