"""TransformerEngine's router module on amdqb: ``transformer_engine.pytorch.router``'s names,
signatures (positional order included), enums and behaviour, so a TE user switches with one line::

    # from transformer_engine.pytorch.router import fused_topk_with_score_function, ...
    from amdqb.compat.te import fused_topk_with_score_function, ...

Provided: ``fused_topk_with_score_function`` (with Quantile Balancing), ``fused_compute_score_for_
moe_aux_loss``, ``fused_moe_aux_loss``, the enums ``RoutingMapFormat`` (``BYTEMAP`` = 0,
``BITMAP_U8`` = 1) and ``QBHistogramMode`` (``TWO_KERNEL`` = 0, ``FUSED_ATOMIC`` = 1), and
``fused_topk_with_score_function_qb_fwd``, the raw QB forward that TE exposes through its extension
module (``transformer_engine_torch``) and calls from its tests, and ``mark_qb_bin_bounds_validated``
(TE's trusted-producer marker for in-place bounds updates before graph capture).

``routing_map_format`` follows TE's rules: the enum, its int (0 / 1, a NumPy int too) or the lowercase strings
``"bytemap"`` / ``"bitmap_u8"``; another int or string is a ``ValueError``, another type a
``TypeError``. ``qb_histogram_mode`` takes TE's strings and, beyond TE, the enum or its int.
Precision, tie-break and graph-safety contracts are amdqb's (``amdqb.ops.router``,
``amdqb.ops.aux_loss``): fp32 math, selection by (score descending, expert id ascending, NaN
lowest), no host syncs outside the eager QB bounds check.
"""

from __future__ import annotations

import enum
import math
from typing import Optional, Union

import torch

from ..ops import aux_loss as _aux
from ..ops import router as _router
from ..ops._checks import check_enum
from ..ops.router import mark_qb_bin_bounds_validated

__all__ = [
    "QBHistogramMode",
    "RoutingMapFormat",
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
    "fused_topk_with_score_function",
    "fused_topk_with_score_function_qb_fwd",
    "mark_qb_bin_bounds_validated",
]


class RoutingMapFormat(enum.IntEnum):
    """Layout of the routing map (TE's ``NVTERoutingMapFormat``)."""

    BYTEMAP = 0  # bool [..., E]
    BITMAP_U8 = 1  # uint8 [..., ceil(E/8)], bit e % 8 of byte e // 8 (LSB first)


class QBHistogramMode(enum.IntEnum):
    """How the Quantile Balancing histogram is built (TE's ``NVTEQBHistogramMode``)."""

    TWO_KERNEL = 0
    FUSED_ATOMIC = 1


def _validate_routing_map_format(routing_map_format) -> str:
    """TE's coercion of ``routing_map_format`` (``"bytemap"`` / ``"bitmap_u8"``)."""
    return check_enum(
        "routing_map_format", routing_map_format, _router.ROUTING_MAP_FORMATS, strict=True
    )


def _reject_fp64(logits) -> None:
    if isinstance(logits, torch.Tensor) and logits.dtype == torch.float64:
        raise ValueError("logits: float64 is not supported by the fused router (fp32/bf16/fp16)")


def fused_topk_with_score_function(
    logits: torch.Tensor,
    topk: int,
    use_pre_softmax: bool,
    num_groups: Optional[int],
    group_topk: Optional[int],
    scaling_factor: Optional[float],
    score_function: str,
    expert_bias: Optional[torch.Tensor],
    routing_map_format: Union[str, RoutingMapFormat, int] = RoutingMapFormat.BYTEMAP,
    topk_indices: Optional[torch.Tensor] = None,
    qb_histogram: Optional[torch.Tensor] = None,
    qb_bin_bounds: Optional[torch.Tensor] = None,
    qb_histogram_mode: Optional[Union[str, QBHistogramMode, int]] = None,
):
    """TE's fused score function + Top-k router (opt-in QB histogram) on
    :func:`amdqb.fused_topk_with_score_function`; returns ``(probs, routing_output)``."""
    _reject_fp64(logits)
    fmt = _validate_routing_map_format(routing_map_format)
    return _router.fused_topk_with_score_function(
        logits,
        topk,
        use_pre_softmax,
        num_groups,
        group_topk,
        scaling_factor,
        score_function,
        expert_bias,
        fmt,
        topk_indices,
        qb_histogram,
        qb_bin_bounds,
        qb_histogram_mode,
    )


def fused_compute_score_for_moe_aux_loss(
    logits: torch.Tensor,
    topk: int,
    score_function: str,
    routing_map_format: Union[str, RoutingMapFormat, int] = RoutingMapFormat.BYTEMAP,
):
    """TE's scores for the MoE aux loss on :func:`amdqb.fused_compute_score_for_moe_aux_loss`;
    returns ``(routing_map, scores fp32)``."""
    _reject_fp64(logits)
    fmt = _validate_routing_map_format(routing_map_format)
    return _aux.fused_compute_score_for_moe_aux_loss(logits, topk, score_function, fmt)


def fused_moe_aux_loss(
    probs: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_num_tokens: Union[int, torch.Tensor],
    num_experts: int,
    topk: int,
    coeff: float,
) -> torch.Tensor:
    """TE's fused MoE aux loss on :func:`amdqb.fused_moe_aux_loss` (a 0-dim int64 device
    ``total_num_tokens`` is the graph-safe path)."""
    return _aux.fused_moe_aux_loss(
        probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff
    )


def fused_topk_with_score_function_qb_fwd(
    logits: torch.Tensor,
    topk: int,
    scaling_factor: Optional[float],
    expert_bias: torch.Tensor,
    routing_map_format: Union[RoutingMapFormat, int],
    topk_indices: Optional[torch.Tensor],
    histogram: torch.Tensor,
    bin_bounds: torch.Tensor,
    histogram_mode: Union[QBHistogramMode, int, str],
    bin_bounds_validated: bool = False,
):
    """TE's raw QB forward: ``(probs, routing_output, raw_scores, cutoff, histogram)``, no autograd.

    ``raw_scores`` are the fp32 sigmoid scores ``[..., E]`` and ``cutoff`` the fp32 (k+1)-th biased
    score ``[...]`` of every token, both as the router kernel computed them (one pass: the scores it
    ranked, the cutoff it binned); ``histogram`` is accumulated in place and returned. Unless
    ``bin_bounds_validated``, the bounds are read on the host first (a sync, like TE's checked
    entry point) and invalid ones raise a ``RuntimeError``; with it they are trusted unread.
    """
    fmt = _validate_routing_map_format(routing_map_format)
    if (
        not bin_bounds_validated
        and isinstance(bin_bounds, torch.Tensor)
        and bin_bounds.numel() == 2
    ):
        lower, upper = (float(v) for v in bin_bounds.detach().float().cpu().tolist())
        if not (math.isfinite(lower) and math.isfinite(upper) and lower < upper):
            raise RuntimeError(
                f"QB bin_bounds values must be finite with lower < upper, got [{lower}, {upper}]"
            )
    mark_qb_bin_bounds_validated(bin_bounds)
    with torch.no_grad():
        probs, routing_output, raw_scores, cutoff = _router.fused_topk_with_score_function(
            logits,
            topk,
            False,
            None,
            None,
            scaling_factor,
            "sigmoid",
            expert_bias,
            fmt,
            topk_indices,
            histogram,
            bin_bounds,
            histogram_mode,
            return_raw=True,
        )
    return probs, routing_output, raw_scores, cutoff, histogram
