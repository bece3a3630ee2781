"""Quantile Balancing bias recovery (Kimi K3 App. D), the balancer step and the exact, bin-free
estimate.

Precision notes: counts accumulate in int64; the target rank ``ceil(m*k/E)`` is exact integer
arithmetic; the interpolation runs in float64 with the fp32 bounds promoted; the result and the
centred bias are fp32. ``m`` is each histogram row's own sum, read on the device (no host sync).

Binnings (``amdqb.ref.qb``): ``"uniform"`` recovers the bias from a histogram of
``r = alpha - s`` over the bounds ``[L, U]`` (mean-centred); ``"log_margin"`` recovers the bias
change from a histogram of the biased margin on each expert's axis (the bounds: the per-expert
inverse scales ``[E]``), adds it to the bias the margins were measured against and pins the
median at 0.

The counts are values, never addresses: any histogram (negative counts, counts near the int32
limit, an empty row) is memory-safe. The recovery gives the formula's result on the counts as
given (the bin position is clamped to ``[0, B]``); the step commits nothing from a histogram with
a negative count (an int32 bin that wrapped) and counts it in ``rejected``.

Every tensor argument is required contiguous (read and written through its data pointer on every
backend); outputs may not share memory with each other or with the histogram; every check runs
before the first write, so a call that raises has changed nothing.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import dispatch, ref
from .._library import impl, kernel_op
from ..ref.router import BINNINGS
from ._checks import (
    FLOAT_DTYPES,
    check_backend,
    check_choice,
    check_float,
    check_int,
    check_qb_histogram,
    check_tensor,
)

MAX_BINS = 1 << 20  # histogram bins per expert accepted by the recovery ops


@kernel_op("qb_recover", mutates_args=("out",))
def _qb_recover(
    histogram: torch.Tensor,
    bin_bounds: torch.Tensor,
    topk: int,
    out: torch.Tensor,
    binning: str,
    expert_bias: Optional[torch.Tensor],
    backend: str,
) -> None:
    _validate_bounds_at_run_time(bin_bounds, binning)
    impl("qb_recover", backend)(histogram, bin_bounds, topk, out, binning, expert_bias)


@kernel_op("qb_step", mutates_args=("bias", "bin_bounds", "rejected", "committed"))
def _qb_step(
    bias: torch.Tensor,
    histogram: torch.Tensor,
    bin_bounds: torch.Tensor,
    topk: int,
    ema: float,
    binning: str,
    rejected: Optional[torch.Tensor],
    committed: Optional[torch.Tensor],
    backend: str,
) -> None:
    _validate_bounds_at_run_time(bin_bounds, binning)
    # here, not in qb_step_: a traced graph has no data pointers; the body runs before any write
    check_no_overlap(
        {
            "bias": bias,
            "histogram": histogram,
            "bin_bounds": bin_bounds,
            "rejected": rejected,
            "committed": committed,
        }
    )
    impl("qb_step", backend)(bias, histogram, bin_bounds, topk, ema, binning, rejected, committed)


def _validate_bounds_at_run_time(bin_bounds, binning) -> None:
    """The bounds check of a compiled graph: tracing cannot read the bounds, so the kernel-level
    op checks them when it runs (cached per tensor version; eager calls checked them already)."""
    from .router import validate_qb_bin_bounds

    validate_qb_bin_bounds(bin_bounds, binning, name="bin_bounds")


def _check_not_meta(name, t):
    if t.device.type == "meta":
        raise ValueError(f"{name} is on the meta device: it holds no values to balance with")


def _span(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage, first byte, end byte) of a contiguous tensor's memory."""
    start = t.data_ptr()
    return t.untyped_storage().data_ptr(), start, start + t.numel() * t.element_size()


def check_no_overlap(named: dict) -> None:
    """Raise a ValueError naming both tensors when two of ``named`` share memory."""
    items = [(n, t) for n, t in named.items() if t is not None and t.numel() > 0]
    spans = [(n, _span(t)) for n, t in items]
    for i, (a, (sa, a0, a1)) in enumerate(spans):
        for b, (sb, b0, b1) in spans[i + 1 :]:
            if sa == sb and a0 < b1 and b0 < a1:
                raise ValueError(f"{a} and {b} share memory; pass separate tensors")


def check_histogram(histogram, bin_bounds, topk, binning="uniform") -> int:
    """The histogram, its bounds (validated like the router's: once per tensor version, a host
    read outside graph capture) and ``topk``."""
    from .router import check_qb_bounds_shape, validate_qb_bin_bounds

    check_qb_histogram("histogram", histogram, binning, accumulated=False, max_bins=MAX_BINS)
    _check_not_meta("histogram", histogram)
    num_experts = histogram.shape[-2]
    check_qb_bounds_shape(bin_bounds, binning, num_experts, histogram.device, "bin_bounds")
    topk = check_int("topk", topk, low=1, high=num_experts - 1)
    validate_qb_bin_bounds(bin_bounds, binning, name="bin_bounds")
    return topk


def _request(histogram) -> dict:
    """The QbRequest features of a histogram: its bins, and the in-bin moments of a 3-D one."""
    return {"num_bins": histogram.shape[-1], "moments": histogram.dim() == 3}


def _check_bias(name, bias, histogram):
    return check_tensor(
        name,
        bias,
        dtypes=(torch.float32,),
        shape=(histogram.shape[-2],),
        device=histogram.device,
        contiguous=True,
    )


def qb_recover_bias(
    histogram: torch.Tensor,
    bin_bounds: torch.Tensor,
    topk: int,
    *,
    binning: str = "uniform",
    expert_bias: Optional[torch.Tensor] = None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Centred App. D bias estimate, fp32 ``[E]``.

    For each expert row: ``m`` = the row's sum, ``q = m*k/E``, ``beta`` = first bin whose cumulative
    count reaches ``ceil(q)``, ``c`` = the count before it, ``h`` = its count; the quantile sits at
    ``beta + clip((q-c)/h, 0, 1)`` bins. ``"uniform"``: ``bhat = L + position * (U-L)/B`` (a row
    with no counts recovers ``(L+U)/2``), then the mean is subtracted. ``"log_margin"``:
    ``bhat = expert_bias + delta`` with the position mapped back to a margin on the expert's axis
    (``bin_bounds``: the inverse scales ``[E]``; ``expert_bias`` required: the bias the histogram
    was routed with), then the lower median is subtracted and the result held within
    ``+-2`` (``amdqb.ref.qb.pin_median``).
    """
    check_choice("binning", binning, BINNINGS)
    topk = check_histogram(histogram, bin_bounds, topk, binning)
    if binning == "log_margin":
        if expert_bias is None:
            raise ValueError("binning='log_margin' needs expert_bias (the bias of the histogram)")
        _check_bias("expert_bias", expert_bias, histogram)
    check_backend(backend)
    chosen_backend = dispatch.kernel_backend(
        "qb_recover", histogram.device, backend, **_request(histogram)
    )
    out = torch.empty(histogram.shape[-2], dtype=torch.float32, device=histogram.device)
    bias = expert_bias if binning == "log_margin" else None
    _qb_recover(histogram, bin_bounds, topk, out, binning, bias, chosen_backend)
    return out


def qb_step_(
    bias: torch.Tensor,
    histogram: torch.Tensor,
    bin_bounds: torch.Tensor,
    topk: int,
    ema: float = 0.0,
    *,
    binning: str = "uniform",
    rejected: Optional[torch.Tensor] = None,
    committed: Optional[torch.Tensor] = None,
    backend: Optional[str] = None,
) -> None:
    """In-place balancer update after the all-reduce (no host sync, graph-capturable).

    Uniform: ``bias <- centre(ema*bias + (1-ema)*recover(histogram))``, bounds
    ``<- [min(bias) - 1, max(bias) + 1]``. log_margin: ``bias <- pin_median(ema*bias +
    (1-ema)*(bias + delta))`` and each expert's inverse scale moves to its own correction
    (``amdqb.ref.qb.margin_scale_update``). An empty histogram changes nothing. The update
    commits only a finite bias, valid bounds and a histogram without a negative count;
    otherwise both keep their values and ``rejected`` (int32 ``[1]``, optional) gains one.
    ``committed`` (fp32 ``[E + len(bin_bounds)]``, optional): the last committed bias and bounds;
    a bias entry that is not finite, or bounds invalid for the binning, are read from it instead
    (so an outside write cannot poison the update), and the state the update leaves is written
    back to it. The histogram is not zeroed here.
    """
    check_choice("binning", binning, BINNINGS)
    topk = check_histogram(histogram, bin_bounds, topk, binning)
    _check_bias("bias", bias, histogram)
    if bias.requires_grad:
        raise ValueError("bias must not require grad: qb_step_ writes it in place")
    ema = check_float("ema", ema)
    if not 0.0 <= ema < 1.0:
        raise ValueError(f"ema must be in [0, 1), got {ema}")
    if rejected is not None:
        check_tensor(
            "rejected",
            rejected,
            dtypes=(torch.int32,),
            shape=(1,),
            device=histogram.device,
            contiguous=True,
        )
    if committed is not None:
        check_tensor(
            "committed",
            committed,
            dtypes=(torch.float32,),
            shape=(histogram.shape[-2] + bin_bounds.numel(),),
            device=histogram.device,
            contiguous=True,
        )
    for name, t in (("bin_bounds", bin_bounds), ("rejected", rejected), ("committed", committed)):
        if t is not None and t.requires_grad:
            raise ValueError(f"{name} must not require grad: qb_step_ writes it in place")
    check_backend(backend)
    chosen_backend = dispatch.kernel_backend(
        "qb_step", histogram.device, backend, **_request(histogram)
    )
    _qb_step(bias, histogram, bin_bounds, topk, ema, binning, rejected, committed, chosen_backend)


def qb_exact_bias(logits: torch.Tensor, topk: int, expert_bias: torch.Tensor) -> torch.Tensor:
    """Exact ``Quantile_{k/E}`` of each expert's required bias ``r = alpha - s`` (no bins), centred.

    The estimate is the midpoint between the ``ceil(m*k/E)``-th and the next smallest required
    bias of the expert: every bias strictly between them routes exactly that many tokens. Runs as
    PyTorch ops on the logits' device (a column sort and a host read that rejects NaN logits: an
    analysis and demo tool, not a hot path).
    """
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, min_dim=1)
    _check_not_meta("logits", logits)
    num_experts = logits.shape[-1]
    if num_experts < 2:
        raise ValueError(f"logits must have at least 2 experts (last dim), got {num_experts}")
    topk = check_int("topk", topk, low=1, high=num_experts - 1)
    check_tensor(
        "expert_bias",
        expert_bias,
        dtypes=(torch.float32,),
        shape=(num_experts,),
        device=logits.device,
    )
    if bool(torch.isnan(logits).any()):
        raise ValueError("qb_exact_bias needs logits without NaN (a NaN has no quantile)")
    if not bool(torch.isfinite(expert_bias).all()):
        raise ValueError("qb_exact_bias needs a finite expert_bias")
    return ref.qb_exact_bias(logits.reshape(-1, num_experts), topk, expert_bias)
