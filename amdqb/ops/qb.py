"""Quantile Balancing bias recovery (Kimi K3 App. D) and the exact, bin-free estimate.

Precision notes: counts accumulate in int64; the target rank ``ceil(m*k/E)`` is exact integer
arithmetic; the interpolation runs in float64 with the fp32 bounds promoted; the result and the
centred bias are fp32. ``m`` is each histogram row's own sum, read on the device (no host sync).
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import dispatch, ref
from .._library import impl, kernel_op
from ._checks import FLOAT_DTYPES, check_float, check_int, check_tensor


@kernel_op("qb_recover", mutates_args=("out",))
def _qb_recover(
    histogram: torch.Tensor, bin_bounds: torch.Tensor, topk: int, out: torch.Tensor, backend: str
) -> None:
    impl("qb_recover", backend)(histogram, bin_bounds, topk, out)


@kernel_op("qb_step", mutates_args=("bias", "bin_bounds"))
def _qb_step(
    bias: torch.Tensor,
    histogram: torch.Tensor,
    bin_bounds: torch.Tensor,
    topk: int,
    ema: float,
    backend: str,
) -> None:
    impl("qb_step", backend)(bias, histogram, bin_bounds, topk, ema)


def check_histogram(histogram, bin_bounds, topk) -> None:
    check_tensor("histogram", histogram, dtypes=(torch.int32, torch.int64), dim=2, contiguous=True)
    num_experts, num_bins = histogram.shape
    if num_experts < 1 or num_bins < 2:
        raise ValueError(f"histogram must be [E >= 1, B >= 2], got {tuple(histogram.shape)}")
    check_tensor(
        "bin_bounds", bin_bounds, dtypes=(torch.float32,), shape=(2,), device=histogram.device
    )
    check_int("topk", topk, low=1, high=max(num_experts - 1, 1))


def qb_recover_bias(
    histogram: torch.Tensor,
    bin_bounds: torch.Tensor,
    topk: int,
    *,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Centred App. D bias estimate, fp32 ``[E]``.

    For each expert row: ``m`` = the row's sum, ``q = m*k/E``, ``beta`` = first bin whose cumulative
    count reaches ``ceil(q)``, ``c`` = the count before it, ``h`` = its count, ``w = (U-L)/B``;
    ``bhat = L + (beta + clip((q-c)/h, 0, 1)) * w``; then the mean is subtracted. A row with no
    counts recovers ``(L+U)/2``.
    """
    check_histogram(histogram, bin_bounds, topk)
    chosen_backend = dispatch.backend_name(
        "qb_recover", histogram.device, backend, num_bins=histogram.shape[1]
    )
    out = torch.empty(histogram.shape[0], dtype=torch.float32, device=histogram.device)
    _qb_recover(histogram, bin_bounds, topk, out, chosen_backend)
    return out


def qb_step_(
    bias: torch.Tensor,
    histogram: torch.Tensor,
    bin_bounds: torch.Tensor,
    topk: int,
    ema: float = 0.0,
    *,
    backend: Optional[str] = None,
) -> None:
    """In-place balancer update after the all-reduce (no host sync, graph-capturable).

    ``bias <- centre(ema*bias + (1-ema)*recover(histogram))`` (unchanged when the histogram is
    empty); ``bin_bounds <- [min(bias) - 1, max(bias) + 1]``. The histogram is not zeroed here.
    """
    check_histogram(histogram, bin_bounds, topk)
    check_tensor(
        "bias",
        bias,
        dtypes=(torch.float32,),
        shape=(histogram.shape[0],),
        device=histogram.device,
        contiguous=True,
    )
    ema = check_float("ema", ema)
    if not 0.0 <= ema < 1.0:
        raise ValueError(f"ema must be in [0, 1), got {ema}")
    chosen_backend = dispatch.backend_name(
        "qb_step", histogram.device, backend, num_bins=histogram.shape[1]
    )
    _qb_step(bias, histogram, bin_bounds, topk, ema, chosen_backend)


def qb_exact_bias(logits: torch.Tensor, topk: int, expert_bias: torch.Tensor) -> torch.Tensor:
    """Exact ``Quantile_{k/E}`` of each expert's required bias ``r = alpha - s`` (no bins), centred.

    The estimate is the midpoint between the ``ceil(m*k/E)``-th and the next smallest required
    bias of the expert: every bias strictly between them routes exactly that many tokens. Runs as
    PyTorch ops on the logits' device (a column sort; an analysis and demo tool, not a hot path).
    """
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, min_dim=1)
    num_experts = logits.shape[-1]
    check_int("topk", topk, low=1, high=max(num_experts - 1, 1))
    check_tensor(
        "expert_bias",
        expert_bias,
        dtypes=(torch.float32,),
        shape=(num_experts,),
        device=logits.device,
    )
    return ref.qb_exact_bias(logits.reshape(-1, num_experts), topk, expert_bias)
