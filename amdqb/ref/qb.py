"""Pure-PyTorch oracles of the Quantile Balancing bias updates (Kimi K3 §2.3.3, App. C-D).

Precision contract:

* histogram counts are summed in int64; the target rank ``n = ceil(m*k/E)`` is computed in integer
  arithmetic, ``q = m*k/E`` and the within-bin interpolation in float64, with ``L, U`` the fp32 bounds
  promoted to float64 and ``w = (U - L) / B``; the result is cast to fp32 once.
* ``m`` is each row's own sum (every row of a router histogram sums to the same token count).
  A row with ``m == 0`` carries no information and recovers the bounds' midpoint.
* centring subtracts the float64 mean of the fp32 values, then casts to fp32.
"""

from __future__ import annotations

import torch

from .ordering import ranked_indices
from .router import activation


def recover_uncentred(histogram: torch.Tensor, bin_bounds: torch.Tensor, topk: int) -> torch.Tensor:
    """App. D recovery before centring, fp32 ``[E]``."""
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
    lower = bin_bounds[0].double()
    upper = bin_bounds[1].double()
    width = (upper - lower) / b
    bhat = lower + (beta.double() + frac) * width
    bhat = torch.where(m > 0, bhat, (lower + upper) / 2)
    return bhat.float()


def centre(bias: torch.Tensor) -> torch.Tensor:
    """Subtract the mean (float64 accumulation), fp32 result."""
    return (bias.double() - bias.double().mean()).float()


def qb_recover_bias(histogram: torch.Tensor, bin_bounds: torch.Tensor, topk: int) -> torch.Tensor:
    """Centred App. D bias estimate from an int32 ``[E, B]`` histogram and fp32 ``[L, U]`` bounds."""
    return centre(recover_uncentred(histogram, bin_bounds, topk))


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """One balancer step (after the all-reduce): ``(new_bias fp32 [E], new_bounds fp32 [2])``.

    ``new = centre(ema * old + (1 - ema) * recover(hist))``; an empty histogram keeps ``old``.
    Bounds become ``[min(new) - 1, max(new) + 1]``.
    """
    bhat = qb_recover_bias(histogram, bin_bounds, topk)
    mixed = (ema * bias.double() + (1.0 - ema) * bhat.double()).float()
    new = centre(mixed)
    total = histogram.to(torch.int64).sum()
    new = torch.where(total > 0, new, bias.float())
    bounds = torch.stack([new.min() - 1.0, new.max() + 1.0]).float()
    return new, bounds


def aux_free_bias_update(
    bias: torch.Tensor, tokens_per_expert: torch.Tensor, rate: float = 1e-3
) -> torch.Tensor:
    """DeepSeek-V3 aux-loss-free rule: ``b += rate * sign(mean_load - load)`` (fp32)."""
    load = tokens_per_expert.double()
    return (bias.double() + rate * torch.sign(load.mean() - load)).to(bias.dtype)


def maxvio(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """``max(load) / mean(load) - 1`` as a 0-dim fp32 tensor (0 for an empty load)."""
    load = tokens_per_expert.double()
    mean = load.mean()
    return torch.where(mean > 0, load.max() / mean - 1.0, torch.zeros_like(mean)).float()


def cv2(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Squared coefficient of variation of the load shares, ``mean((f - 1/E)^2) / (1/E)^2``."""
    load = tokens_per_expert.double()
    e = load.numel()
    f = load / load.sum().clamp(min=1)
    return (((f - 1.0 / e) ** 2).mean() * e * e).float()
