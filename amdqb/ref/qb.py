"""Pure-PyTorch oracles of the Quantile Balancing bias updates (Kimi K3 §2.3.3, App. C-D).

Two binnings of the per-expert histogram (``amdqb.ref.router``):

* ``"uniform"`` (K3): ``r = alpha - s`` on B uniform bins of ``[L, U]``; the recovery is the
  ``k/E`` quantile of r, the new bias itself.
* ``"log_margin"``: the biased margin ``d = alpha - u`` (u the selection value) on a symmetric
  log axis around 0 scaled by ``eps = rho * (max b - min b)``; its ``k/E`` quantile is the bias
  change ``delta`` (``b_hat = b + delta``), which shrinks towards 0 at equilibrium, so the
  resolution follows the correction instead of the bias range. The bounds tensor holds
  ``[eps, 1/eps]`` (fp32).

Precision contract:

* histogram counts are summed in int64; the target rank ``n = ceil(m*k/E)`` is computed in integer
  arithmetic, ``q = m*k/E`` and the within-bin interpolation in float64, with ``L, U`` the fp32 bounds
  promoted to float64 and ``w = (U - L) / B``; the result is cast to fp32 once.
* ``m`` is each row's own sum (every row of a router histogram sums to the same token count).
  A row with ``m == 0`` carries no information and recovers the bounds' midpoint.
* centring subtracts the float64 mean of the fp32 values, then casts to fp32.
* the fp64 exact reference (:func:`route_fp64`, :func:`qb_exact_bias_fp64`) is the exception:
  scores, biased scores, cutoff, required biases, quantile and centring are all float64, and so
  is the bias it returns. Ties there (equal float64 ``u``) break by expert id, smaller first.
"""

from __future__ import annotations

import torch

from .ordering import ranked_indices
from .router import activation

LOG_MARGIN_RHO = 1e-4  # eps = rho * bias spread; with B = 64 the axis reaches |d| = 6.55 spreads
LOG_MARGIN_EPS0 = 1e-30  # eps while every bias is equal (spread 0)


def quantile_position(histogram: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """App. D's position of the ``k/E`` quantile in bin units, float64 ``[E]`` in ``[0, B]``,
    and each row's count ``m``: ``beta`` = the first bin whose cumulative count reaches
    ``ceil(q)`` (``q = m*k/E``), plus ``clip((q - c) / h, 0, 1)`` with ``c`` the count before it
    and ``h`` its count."""
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
    return beta.double() + frac, m


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


def recover_margin_delta(histogram: torch.Tensor, margin_scale: torch.Tensor, topk: int):
    """The log_margin recovery: the ``k/E`` quantile of each expert's biased margin, i.e. its bias
    change ``delta``, float64 ``[E]`` (0 for an empty row).

    The quantile position ``p`` (:func:`quantile_position`) maps back through the bins of
    ``amdqb.ref.router.qb_margin_bin_index``: key ``kappa = |p - B/2|`` (bin keys ascend away
    from the centre), ``y = 2^o (1 + f)`` with ``o, f`` the integer and fractional parts of
    ``kappa / 2^M`` (the float format's piecewise-linear log2, exact to invert), and
    ``delta = sign(p - B/2) (y - 1) / inv`` with ``inv = margin_scale[1]``, the fp32 multiplier
    the kernels binned with. Interpolation is linear in d inside a bin, as App. D's in r."""
    from .router import margin_octave_bits

    b = histogram.shape[1]
    position, m = quantile_position(histogram, topk)
    offset = position - b // 2
    per_octave = float(1 << margin_octave_bits(b))
    octave = torch.floor(offset.abs() / per_octave)
    y = torch.ldexp(1.0 + (offset.abs() / per_octave - octave), octave.to(torch.int64))
    delta = torch.sign(offset) * (y - 1.0) / margin_scale[1].double()
    return torch.where(m > 0, delta, torch.zeros_like(delta))


def margin_scale(bias: torch.Tensor, rho: float = LOG_MARGIN_RHO) -> torch.Tensor:
    """fp32 ``[eps, 1/eps]`` of the log_margin axis for ``bias``: ``eps = rho * (max - min)``
    (float64, then fp32), ``LOG_MARGIN_EPS0`` for a spread of 0; the reciprocal is of the fp32
    eps."""
    b = bias.double()
    spread = b.max() - b.min()
    eps = torch.where(spread > 0, rho * spread, torch.full_like(spread, LOG_MARGIN_EPS0)).float()
    return torch.stack([eps, (1.0 / eps.double()).float()])


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
    ``[L, U]`` bounds; ``"log_margin"`` with the ``[eps, 1/eps]`` scale and the bias the margins
    were measured against (``b + delta``, the sum in float64)."""
    if binning == "uniform":
        return centre(recover_uncentred(histogram, bin_bounds, topk))
    delta = recover_margin_delta(histogram, bin_bounds, topk)
    return centre((expert_bias.double() + delta).float())


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


def route_fp64(logits: torch.Tensor, topk: int, expert_bias: torch.Tensor):
    """Routes of the fp64 exact reference: ``(routing_map bool [T, E], alpha float64 [T],
    s float64 [T, E])``.

    Everything in float64: ``s = sigmoid(z.double())``, ``u = s + b.double()``, the first k of the
    order (u descending, expert id ascending) are routed and ``alpha`` is the (k+1)-th ``u``. fp64
    resolves ``1 - s`` down to 2^-53, i.e. up to ``z ~ 36.7``; above that ``s == 1`` and saturated
    experts are ordered by their bias, which is the exact order unless those biases are equal.
    Meant for finite logits (a reference for studies and tests, not a router).
    """
    s = torch.sigmoid(logits.double())
    u = s + expert_bias.double()
    # a stable descending sort keeps equal values in ascending id order: smaller id first
    order = torch.sort(u, dim=1, descending=True, stable=True).indices[:, : topk + 1]
    alpha = u.gather(1, order[:, topk : topk + 1]).squeeze(1)
    routing_map = torch.zeros(u.shape, dtype=torch.bool, device=u.device)
    routing_map.scatter_(1, order[:, :topk], True)
    return routing_map, alpha, s


def qb_exact_bias_fp64(
    logits: torch.Tensor, topk: int, expert_bias: torch.Tensor, routes=None
) -> torch.Tensor:
    """Exact QB in float64, centred: the reference that binned and fp32 QB are measured against.

    ``r = alpha - s`` in float64 with ``alpha`` and ``s`` from :func:`route_fp64` (the bias in
    float64 too); per expert the midpoint of the n-th and (n+1)-th smallest r, ``n = ceil(m*k/E)``
    (the largest r for ``n == m``), as :func:`qb_exact_bias`; the float64 mean is subtracted.
    Returns float64 ``[E]``: carry it in float64 into the next :func:`route_fp64`. ``routes``:
    the result of ``route_fp64(logits, topk, expert_bias)`` when the caller already has it.
    """
    _, alpha, s = route_fp64(logits, topk, expert_bias) if routes is None else routes
    r = alpha[:, None] - s
    m, e = r.shape
    if m == 0:
        return torch.zeros(e, dtype=torch.float64, device=r.device)
    n = -(-m * topk // e)
    srt = torch.sort(r, dim=0).values
    bias = (srt[n - 1] + srt[min(n, m - 1)]) / 2
    return bias - bias.mean()


def qb_step_update(
    bias: torch.Tensor,
    histogram: torch.Tensor,
    bin_bounds: torch.Tensor,
    topk: int,
    ema: float = 0.0,
    binning: str = "uniform",
    rho: float = LOG_MARGIN_RHO,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One balancer step (after the all-reduce): ``(new_bias fp32 [E], new_bounds fp32 [2])``.

    ``new = centre(ema * old + (1 - ema) * recover(hist))``; an empty histogram keeps ``old``.
    Uniform bounds become ``[min(new) - 1, max(new) + 1]``; log_margin's ``margin_scale(new)``.
    """
    bhat = qb_recover_bias(histogram, bin_bounds, topk, binning, bias)
    mixed = (ema * bias.double() + (1.0 - ema) * bhat.double()).float()
    new = centre(mixed)
    total = histogram.to(torch.int64).sum()
    new = torch.where(total > 0, new, bias.float())
    if binning == "uniform":
        bounds = torch.stack([new.min() - 1.0, new.max() + 1.0]).float()
    else:
        bounds = margin_scale(new, rho)
    return new, bounds


def bounds_are_valid(bounds: torch.Tensor, binning: str) -> torch.Tensor:
    """0-dim bool: finite bounds the binning accepts (uniform ``L < U``, log_margin both > 0)."""
    finite = torch.isfinite(bounds).all()
    if binning == "uniform":
        return finite & (bounds[0] < bounds[1])
    return finite & (bounds > 0).all()


def step_is_finite(bias: torch.Tensor, bounds: torch.Tensor, binning: str) -> torch.Tensor:
    """0-dim bool: a step's candidate may be committed (a finite bias and valid finite bounds)."""
    return torch.isfinite(bias).all() & bounds_are_valid(bounds, binning)


def restore_committed(
    bias: torch.Tensor, bounds: torch.Tensor, committed: torch.Tensor, binning: str
) -> None:
    """In place: bias entries that are not finite, and bounds invalid for the binning, take the
    values of ``committed`` (``[E + 2]``: the last committed bias, then bounds)."""
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
