"""Fused Top-k routers: TransformerEngine's ``fused_topk_with_score_function`` (with opt-in Quantile
Balancing) and the serving form ``biased_topk``.

Precision notes: logits are read in their dtype and converted to fp32; activations, biased scores,
selection, normalisation, the QB cutoff and all histogram arithmetic are fp32; only ``probs`` is
written in the logits dtype. ``expert_bias`` changes which experts are selected, never the weights.

Tie-break contract: experts are ranked by (biased score descending, expert id ascending); NaN ranks
below every number; every token gets exactly k distinct experts. Under QB the cutoff is the
(k+1)-th expert of that order, so on a tie at the cutoff the largest id is the one dropped.

The QB histogram ``qb_histogram[j, bin] += 1`` uses ``r = alpha - s_j``, ``scale = fp32(B) / (U-L)``
and ``bin = clamp(floor((r - L) * scale), 0, B - 1)`` (NaN ``r`` -> bin 0) for the uniform binning,
the biased margin on expert j's own log axis for log_margin (``amdqb.ref.router``): every row gains
exactly T counts per call, and both histogram modes give bitwise-identical counts. The counts are
int32 and are not read back: a caller's histogram within T of ``2**31 - 1`` wraps (the
``QuantileBalancer`` refuses such batches, and its step rejects a histogram with a wrapped,
negative count).

Bounds are validated on every path -- eager and ``torch.compile`` alike -- once per tensor
version (a host read outside graph capture); bounds a trusted producer marked validated
(:func:`mark_qb_bin_bounds_validated`) are used unread: any values are memory-safe -- the bins
are clamped before the integer conversion, and a NaN position (NaN or infinite bounds, bias or
logits) counts in bin 0 -- so every histogram row still gains exactly T counts inside its
``[E, B]`` buffer.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from .. import dispatch
from .._library import call_op
from ..backends.calls import (
    BINNINGS,
    QB_MODES,
    ROUTER_BWD_TENSORS,
    ROUTER_FWD_TENSORS,
    SCORE_FUNCTIONS,
    SELECTIONS,
    TOPK_TENSORS,
    RouterCall,
    TopkCall,
)
from ..ref.router import unpack_bitmap
from ._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_backend,
    check_bool,
    check_choice,
    check_enum,
    check_float,
    check_groups,
    check_int,
    check_no_overlap,
    check_qb_histogram,
    check_tensor,
    static_int,
)

ROUTING_MAP_FORMATS = ("bytemap", "bitmap_u8")
_VALIDATED_ATTR = "_amdqb_qb_bounds_validated_version"


# --------------------------------------------------------------------------------------------
# QB bin bounds: eager validation cached per tensor version, and the trusted-producer marker.
# --------------------------------------------------------------------------------------------
def mark_qb_bin_bounds_validated(bin_bounds: torch.Tensor) -> torch.Tensor:
    """Record that ``bin_bounds`` at its current version holds valid bounds (uniform: finite
    ``lower < upper``; log_margin: finite positive inverse scales).

    For a trusted in-place producer (``QuantileBalancer.step``): it reads nothing and never syncs,
    so it may run during CUDA/HIP graph capture right after the producer's update is dispatched on
    the same stream. Graph replays then trust the bounds behind the captured pointer.
    """
    check_tensor("bin_bounds", bin_bounds, dtypes=(torch.float32,), dim=1)
    setattr(bin_bounds, _VALIDATED_ATTR, bin_bounds._version)
    return bin_bounds


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def validate_qb_bin_bounds(
    bin_bounds: torch.Tensor, binning: str = "uniform", name: str = "qb_bin_bounds"
) -> None:
    """Check the bounds once per tensor version (a host read, allowed only outside capture):
    uniform ``[L, U]`` finite with ``L < U``; log_margin ``[E]`` finite and positive.

    While tracing for ``torch.compile`` nothing can be read; the kernel-level op runs this check
    again when the compiled graph executes it (:func:`_router_fwd`), so both paths reject the
    same bounds."""
    if torch.compiler.is_compiling():
        return
    if getattr(bin_bounds, _VALIDATED_ATTR, None) == bin_bounds._version:
        return
    if _capturing(bin_bounds.device):
        raise ValueError(
            f"{name} must be validated by an eager router call (or marked with "
            "amdqb.mark_qb_bin_bounds_validated after a trusted in-place update) before CUDA/HIP "
            "graph capture; its current version was never validated"
        )
    check_qb_bounds_values(bin_bounds.detach().cpu().tolist(), binning, name)
    setattr(bin_bounds, _VALIDATED_ATTR, bin_bounds._version)


def check_qb_bounds_values(values, binning: str, name="qb_bin_bounds"):
    """The value rule of QB bounds (host floats): the router's and the recovery ops' check.
    Uniform ``[lower, upper]``: finite, ``lower < upper``; log_margin: every inverse scale
    finite and ``> 0``."""
    if binning == "uniform":
        lower, upper = values
        if not (math.isfinite(lower) and math.isfinite(upper) and lower < upper):
            raise ValueError(f"{name} must be finite with lower < upper, got [{lower}, {upper}]")
        return
    bad = [(i, v) for i, v in enumerate(values) if not (math.isfinite(v) and v > 0)]
    if bad:
        i, v = bad[0]
        raise ValueError(
            f"{name} of the log_margin binning holds per-expert inverse scales, each finite and "
            f"> 0; entry {i} is {v} ({len(bad)} invalid)"
        )


def check_qb_bounds_shape(bin_bounds, binning: str, num_experts: int, device, name: str):
    """fp32, contiguous, on ``device``: ``[2]`` (uniform ``[L, U]``) or ``[E]`` (log_margin's
    per-expert inverse scales)."""
    shape = (2,) if binning == "uniform" else (num_experts,)
    check_tensor(
        name, bin_bounds, dtypes=(torch.float32,), shape=shape, device=device, contiguous=True
    )


# --------------------------------------------------------------------------------------------
# Kernel-level ops (custom ops under torch.compile, direct calls in eager mode).
# --------------------------------------------------------------------------------------------
def _check_compiled_router(call: RouterCall, *tensors) -> None:
    """Runs when a compiled graph executes the op, where the tracing-time check could not read
    the bounds."""
    bounds = tensors[ROUTER_FWD_TENSORS.index("qb_bin_bounds")]
    if bounds is not None:
        validate_qb_bin_bounds(bounds, call.qb_binning)


_router_fwd = call_op(
    "router_fwd",
    RouterCall,
    ROUTER_FWD_TENSORS,
    mutates_args=("probs_out", "map_out", "qb_histogram", "scores_out", "cutoff_out"),
    compiled_check=_check_compiled_router,
)
_router_bwd = call_op(
    "router_bwd", RouterCall, ROUTER_BWD_TENSORS, mutates_args=("grad_logits_out",)
)


# The serving top-k: every output of the peers' fused gates from one call (TopkCall).
_biased_topk = call_op(
    "biased_topk", TopkCall, TOPK_TENSORS, mutates_args=("weights_out", "ids_out", "tei_out")
)


def _routed_mask(map_out: torch.Tensor, map_kind: str, num_experts: int) -> torch.Tensor:
    if map_kind == "bytemap":
        return map_out
    if map_kind == "bitmap":
        return unpack_bitmap(map_out, num_experts)
    mask = torch.zeros(map_out.shape[0], num_experts, dtype=torch.bool, device=map_out.device)
    return mask.scatter_(1, map_out.long(), True)


class _Backends(NamedTuple):
    """The kernel backends (dispatch tokens) of a router call's forward and backward."""

    forward: str
    backward: str


class _QbInputs(NamedTuple):
    """The router's tensors that are not differentiated: the bias and the bin bounds are read,
    the histogram accumulated."""

    bias: Optional[torch.Tensor]
    histogram: Optional[torch.Tensor]
    bounds: Optional[torch.Tensor]


class _RouterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits2d, call, backends: _Backends, user_indices, inputs: _QbInputs):
        probs, map_out = _alloc_outputs(logits2d, call, user_indices)
        _router_fwd(
            call,
            logits2d,
            inputs.bias,
            probs,
            map_out,
            inputs.histogram,
            inputs.bounds,
            None,
            None,
            backend=backends.forward,
        )
        ctx.save_for_backward(logits2d, map_out)
        ctx.call = call
        ctx.bwd_backend = backends.backward
        if user_indices is not None:
            ctx.mark_dirty(user_indices)
            map_out = user_indices
        ctx.mark_non_differentiable(map_out)
        return probs, map_out

    @staticmethod
    def backward(ctx, grad_probs, _grad_map):
        logits2d, map_out = ctx.saved_tensors
        call = ctx.call
        routed = _routed_mask(map_out, call.map_kind, call.num_experts)
        grad = torch.empty(logits2d.shape, dtype=torch.float32, device=logits2d.device)
        _router_bwd(call, grad_probs.contiguous(), logits2d, routed, grad, backend=ctx.bwd_backend)
        return grad.to(logits2d.dtype), None, None, None, None


def _alloc_outputs(logits2d, call: RouterCall, user_indices):
    tokens, num_experts = logits2d.shape
    probs = torch.empty_like(logits2d)
    if call.map_kind == "indices":
        return probs, user_indices.view(tokens, call.topk)
    if call.map_kind == "bitmap":
        nbytes = (num_experts + 7) // 8
        return probs, torch.empty(tokens, nbytes, dtype=torch.uint8, device=logits2d.device)
    return probs, torch.empty(tokens, num_experts, dtype=torch.bool, device=logits2d.device)


def _map_format(routing_map_format) -> str:
    """``routing_map_format`` from a string, TE's ``RoutingMapFormat`` or its int (0 / 1)."""
    return check_enum("routing_map_format", routing_map_format, ROUTING_MAP_FORMATS)


def _qb_mode(qb_histogram_mode) -> str:
    """``qb_histogram_mode`` from a string, TE's ``QBHistogramMode`` or its int (0 / 1)."""
    return check_enum("qb_histogram_mode", qb_histogram_mode, QB_MODES, ints=QB_MODES[:2])


def fused_topk_with_score_function(
    logits: torch.Tensor,
    topk: int,
    use_pre_softmax: bool = False,
    num_groups: Optional[int] = None,
    group_topk: Optional[int] = None,
    scaling_factor: Optional[float] = None,
    score_function: str = "sigmoid",
    expert_bias: Optional[torch.Tensor] = None,
    routing_map_format="bytemap",
    topk_indices: Optional[torch.Tensor] = None,
    qb_histogram: Optional[torch.Tensor] = None,
    qb_bin_bounds: Optional[torch.Tensor] = None,
    qb_histogram_mode: Optional[str] = None,
    *,
    selection: str = "te",
    qb_binning: str = "uniform",
    approximate_activation: bool = False,
    backend: Optional[str] = None,
    return_raw: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Fused score function + Top-k (+ opt-in QB histogram), TransformerEngine-compatible.

    Args:
        logits: ``[..., E]`` fp32/bf16/fp16 router logits (any leading dims).
        topk: experts per token, ``1 <= topk <= E`` (``0 < topk < E`` under QB).
        use_pre_softmax: softmax only: softmax over all experts, then Top-k (else Top-k of the
            logits, then softmax over the k selected). Ignored by other score functions.
        num_groups, group_topk: grouped Top-k (DeepSeek-V3): keep the ``group_topk`` groups whose
            best ``topk // group_topk`` scores sum highest, then Top-k inside them.
        scaling_factor: multiplies the final weights.
        score_function: ``"sigmoid"``, ``"softmax"`` or ``"sqrtsoftplus"``.
        expert_bias: fp32 ``[E]`` added to the scores for selection only (sigmoid/sqrtsoftplus).
        routing_map_format: ``"bytemap"`` (bool ``[..., E]``) or ``"bitmap_u8"`` (uint8
            ``[..., ceil(E/8)]``, bit ``e % 8`` of byte ``e // 8``).
        topk_indices: caller-owned ``[..., topk]`` int16/int32/int64 buffer; when given it is
            filled in place (selection order) and returned instead of a routing map. Contiguous,
            sharing no memory with the other tensor arguments.
        qb_histogram: int32 ``[E, B]``, accumulated in place (QB); int64 ``[3, E, B]`` with
            ``qb_binning="log_margin"`` also accumulates each bin's in-bin moments (planes 1
            and 2, ``docs/qb_binning.md``).
        qb_bin_bounds: fp32 device tensor (QB), contiguous: ``[L, U]`` (uniform) or the
            per-expert inverse scales ``[E]`` (log_margin).
        qb_histogram_mode: ``"two_kernel"``, ``"fused_atomic"`` or ``"auto"`` (QB); TE's
            ``QBHistogramMode`` or its int (0 / 1) also work.
        selection: ``"te"`` ranks by ``s + b`` (TE's routes); ``"tie_free"`` (sigmoid with a bias)
            by ``b - sigmoid(-z)``, the same order in exact arithmetic without the ties and
            roundings of fp32 ``s + b`` once the sigmoid saturates (routes may then differ from
            TE's). Beyond TE's signature.
        qb_binning: ``"uniform"`` (K3, TE's: ``r = alpha - s`` on B bins of ``[L, U]``) or
            ``"log_margin"`` (the biased margin ``d = alpha - u`` on each expert's own log axis;
            the bounds tensor holds the inverse scales ``[E]``, ``64 <= B <= 256`` bins, even).
            Beyond TE's signature; ``amdqb.QuantileBalancer`` owns the matching update.
        approximate_activation: opt-in speed over exactness for the kernel backends: e^-z through
            the hardware 2^x (a few 2^-22 from the true sigmoid) instead of the library exp, so
            scores, routes and histograms are no longer torch's / TE's bits (the oracles stay
            exact). Off by default.
        backend: force ``"hip"``, ``"triton"`` or ``"torch"`` (default: the dispatcher's choice).
        return_raw: also return the fp32 scores the kernel ranked ``[..., E]`` (before the bias;
            softmax: over E with ``use_pre_softmax``, else the logits) and, under QB, each token's
            cutoff ``[...]`` (the (k+1)-th selection value; None without QB), both from the one
            kernel pass -- TE's raw QB forward. No autograd: call it with gradients off. Beyond
            TE's signature.

    Returns:
        ``(probs, routing_output)``: ``probs [..., E]`` in the logits dtype, zero off the selected
        experts; ``routing_output`` as chosen by ``routing_map_format`` / ``topk_indices``. With
        ``return_raw``: ``(probs, routing_output, scores, cutoff)``.
    """
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, min_dim=1)
    num_experts = static_int(logits.shape[-1])  # a kernel constant, also under dynamic shapes
    if num_experts < 1:
        raise ValueError("logits must have at least one expert (last dim >= 1)")
    device = logits.device
    topk = static_int(check_int("topk", topk, low=1, high=num_experts))
    use_pre_softmax = check_bool("use_pre_softmax", use_pre_softmax)
    approximate_activation = check_bool("approximate_activation", approximate_activation)
    check_choice("score_function", score_function, SCORE_FUNCTIONS)
    num_groups, group_topk = check_groups(num_groups, group_topk, topk, num_experts)
    if scaling_factor is not None:
        scaling_factor = check_float("scaling_factor", scaling_factor, finite=True)
    map_format = _map_format(routing_map_format)
    check_backend(backend)
    raw = check_bool("return_raw", return_raw)
    if raw and torch.is_grad_enabled() and logits.requires_grad:
        raise ValueError("return_raw has no autograd: call it with gradients off (torch.no_grad)")
    check_choice("selection", selection, SELECTIONS)
    check_choice("qb_binning", qb_binning, BINNINGS)
    if selection == "tie_free" and (score_function != "sigmoid" or expert_bias is None):
        raise ValueError(
            "selection='tie_free' only supports score_function='sigmoid' with expert_bias"
        )
    if expert_bias is not None:
        if score_function == "softmax":
            raise ValueError("expert_bias only supports the sigmoid and sqrtsoftplus scores")
        check_tensor(
            "expert_bias",
            expert_bias,
            dtypes=(torch.float32,),
            shape=(num_experts,),
            device=device,
            contiguous=True,
        )

    qb_given = [a is not None for a in (qb_histogram, qb_bin_bounds, qb_histogram_mode)]
    use_qb = all(qb_given)
    if any(qb_given) and not use_qb:
        raise ValueError(
            "qb_histogram, qb_bin_bounds and qb_histogram_mode must be provided together"
        )
    if use_qb:
        if score_function != "sigmoid":
            raise ValueError("Quantile Balancing only supports score_function='sigmoid'")
        if expert_bias is None:
            raise ValueError("Quantile Balancing requires expert_bias (fp32 [E])")
        if num_groups is not None:
            raise ValueError("Quantile Balancing only supports ungrouped Top-k (num_groups=None)")
        if not 0 < topk < num_experts:
            raise ValueError(
                f"Quantile Balancing only supports 0 < topk < num_experts, got topk={topk}, "
                f"num_experts={num_experts}"
            )
        qb_histogram_mode = _qb_mode(qb_histogram_mode)
        check_qb_histogram(
            "qb_histogram", qb_histogram, qb_binning, accumulated=True, num_experts=num_experts,
            device=device,
        )  # fmt: skip
        if selection == "tie_free" and qb_binning != "log_margin":
            raise ValueError("selection='tie_free' under QB needs qb_binning='log_margin'")
        check_qb_bounds_shape(qb_bin_bounds, qb_binning, num_experts, device, "qb_bin_bounds")
        validate_qb_bin_bounds(qb_bin_bounds, qb_binning)

    lead = logits.shape[:-1]
    if topk_indices is not None:
        if map_format == "bitmap_u8":
            raise ValueError("topk_indices (dense indices) cannot be combined with bitmap_u8")
        check_tensor(
            "topk_indices",
            topk_indices,
            dtypes=INDEX_DTYPES,
            shape=(*lead, topk),
            device=device,
            contiguous=True,
        )
        if topk_indices.dtype == torch.int16 and num_experts > 32767:
            raise ValueError("int16 topk_indices require num_experts <= 32767")
        map_kind = "indices"
    else:
        map_kind = "bitmap" if map_format == "bitmap_u8" else "bytemap"
    check_no_overlap(
        {"topk_indices": topk_indices, "qb_histogram": qb_histogram},
        {"logits": logits, "expert_bias": expert_bias, "qb_bin_bounds": qb_bin_bounds},
    )
    logits2d = logits.reshape(-1, num_experts)
    if not logits2d.is_contiguous():
        logits2d = logits2d.contiguous()

    call = RouterCall(
        num_experts=num_experts,
        topk=topk,
        score_function=score_function,
        use_pre_softmax=bool(use_pre_softmax),
        num_groups=num_groups,
        group_topk=group_topk,
        scaling_factor=scaling_factor,
        map_kind=map_kind,
        selection=selection,
        approximate=bool(approximate_activation),
        qb_mode=qb_histogram_mode if use_qb else None,
        qb_binning=qb_binning if use_qb else "uniform",
        num_bins=static_int(qb_histogram.shape[-1]) if use_qb else 0,
        qb_moments=use_qb and qb_histogram.dim() == 3,
        write_scores=raw,
        write_cutoff=raw and use_qb,
    )
    if not use_qb:
        qb_histogram = qb_bin_bounds = None
    chosen_backend = dispatch.kernel_backend("router_fwd", device, backend, call)
    scores = cutoff = None
    if raw:
        scores = torch.empty(logits2d.shape, dtype=torch.float32, device=device)
        if use_qb:
            cutoff = torch.empty(logits2d.shape[0], dtype=torch.float32, device=device)
    if torch.is_grad_enabled() and logits.requires_grad:
        # the backward runs on the forward's backend when that backend can run it
        bwd_backend = dispatch.kernel_backend(
            "router_bwd", device, call=call, prefer=chosen_backend
        )
        probs, map_out = _RouterFunction.apply(
            logits2d,
            call,
            _Backends(chosen_backend, bwd_backend),
            topk_indices,
            _QbInputs(expert_bias, qb_histogram, qb_bin_bounds),
        )
    else:
        probs, map_out = _alloc_outputs(logits2d, call, topk_indices)
        _router_fwd(
            call,
            logits2d,
            expert_bias,
            probs,
            map_out,
            qb_histogram,
            qb_bin_bounds,
            scores,
            cutoff,
            backend=chosen_backend,
        )
    probs = probs.view(*lead, num_experts)
    out = topk_indices if map_kind == "indices" else map_out.view(*lead, map_out.shape[-1])
    if raw:
        cutoff = None if cutoff is None else cutoff.view(lead)
        return probs, out, scores.view(*lead, num_experts), cutoff
    return probs, out


def biased_topk(
    logits: torch.Tensor,
    topk: int,
    expert_bias: Optional[torch.Tensor] = None,
    *,
    score_function: str = "sigmoid",
    renormalize: bool = True,
    scaling_factor: Optional[float] = None,
    num_groups: Optional[int] = None,
    group_topk: Optional[int] = None,
    approximate_activation: bool = False,
    backend: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Serving-form router with vLLM's and SGLang's semantics (``fused_topk``,
    ``fused_topk_bias``, ``grouped_topk``, ``biased_grouped_topk``).

    Args:
        logits: ``[..., E]`` fp32/bf16/fp16 (converted to fp32; all math is fp32).
        topk: experts per token (``1 <= topk <= E``).
        expert_bias: optional fp32 ``[E]`` correction bias (DeepSeek's
            ``e_score_correction_bias``): added to the scores for selection only, never to the
            weights. Any score function.
        score_function: ``"sigmoid"``, ``"softmax"`` (over all experts, then Top-k) or
            ``"sqrtsoftplus"``.
        renormalize: divide the k weights by their sum (``+ 1e-20``).
        scaling_factor: multiplies the weights last (vLLM's ``routed_scaling_factor``).
        num_groups, group_topk: grouped Top-k (vLLM's ``num_expert_group`` / ``topk_group``):
            keep the ``group_topk`` groups with the best group score -- the best biased score of
            the group, or with a bias the sum of its best two -- then Top-k inside them.
            ``group_topk`` need not divide ``topk``; the chosen groups must hold ``topk`` experts.
        approximate_activation: the opt-in approximate exponential of the kernel backends (see
            :func:`fused_topk_with_score_function`); off by default.

    Returns:
        ``(topk_weights fp32 [..., k], topk_ids int32 [..., k])``, ids in selection order (biased
        score descending, expert id ascending).
    """
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, min_dim=1)
    num_experts = static_int(logits.shape[-1])  # a kernel constant, also under dynamic shapes
    if num_experts < 1:
        raise ValueError("logits must have at least one expert (last dim >= 1)")
    if expert_bias is not None:
        check_tensor("expert_bias", expert_bias, dtypes=(torch.float32,))
    lead = logits.shape[:-1]
    weights, ids, _ = serving_topk(
        logits.reshape(-1, logits.shape[-1]) if logits.dim() != 2 else logits,
        topk,
        expert_bias,
        score_function=score_function,
        renormalize=renormalize,
        scaling_factor=scaling_factor,
        num_groups=num_groups,
        group_topk=group_topk,
        approximate_activation=approximate_activation,
        backend=backend,
    )
    return weights.view(*lead, topk), ids.view(*lead, topk)


def serving_topk(
    logits: torch.Tensor,
    topk: int,
    expert_bias: Optional[torch.Tensor] = None,
    *,
    score_function: str = "sigmoid",
    renormalize: bool = True,
    scaling_factor: Optional[float] = None,
    num_groups: Optional[int] = None,
    group_topk: Optional[int] = None,
    approximate_activation: bool = False,
    num_shared: int = 0,
    shared_weight: float = 0.0,
    shared_div: Optional[float] = None,
    non_padded=None,
    token_expert_indices: bool = False,
    ids_dtype: torch.dtype = torch.int32,
    input_dtype_math: bool = False,
    backend: Optional[str] = None,
    names: tuple[str, str] = ("logits", "expert_bias"),
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The serving top-k with every output of the peers' fused gates, in one kernel launch on the
    hip backend (:class:`amdqb.backends.calls.TopkCall`): ``(weights fp32 [T, topk + num_shared],
    ids [T, topk + num_shared] in ids_dtype, token_expert_indices int32 [T, topk] or None)``.

    ``logits [T, E]`` may have strided rows (its experts contiguous); ``expert_bias`` may be
    fp32, fp16 or bf16 (read in its dtype, converted to fp32). ``num_shared`` / ``shared_weight``
    / ``shared_div``: SGLang's fused shared experts (``shared_div`` needs ``renormalize=False``
    and no scaling factor); ``non_padded``: an int or a device int32 / int64 scalar, rows at or
    past it get ids -1. ``input_dtype_math`` (sigmoid, fp16 / bf16 logits): SGLang's
    ``moe_fused_gate`` arithmetic in the logits' dtype (hip and torch backends). ``names``: the
    caller's names of the logits and the bias, for errors.
    """
    logits_name, bias_name = names
    check_tensor(logits_name, logits, dtypes=FLOAT_DTYPES, dim=2)
    tokens = logits.shape[0]
    num_experts = static_int(logits.shape[1])  # a kernel constant, also under dynamic shapes
    if num_experts < 1:
        raise ValueError(f"{logits_name} must have at least one expert (last dim >= 1)")
    device = logits.device
    topk = static_int(check_int("topk", topk, low=1, high=num_experts))
    check_choice("score_function", score_function, SCORE_FUNCTIONS)
    renormalize = check_bool("renormalize", renormalize)
    approximate_activation = check_bool("approximate_activation", approximate_activation)
    num_groups, group_topk = check_groups(
        num_groups,
        group_topk,
        topk,
        num_experts,
        te_rule=False,
        biased=expert_bias is not None,
    )
    if scaling_factor is not None:
        scaling_factor = check_float("scaling_factor", scaling_factor, finite=True)
    check_backend(backend)
    num_shared = check_int("num_shared", num_shared, low=0)
    if shared_div is not None:
        shared_div = check_float("shared_div", shared_div, finite=True)
        if renormalize or scaling_factor is not None:
            raise ValueError("shared_div needs renormalize=False and no scaling_factor")
    if ids_dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids_dtype must be torch.int32 or torch.int64, got {ids_dtype}")
    input_dtype_math = check_bool("input_dtype_math", input_dtype_math)
    if input_dtype_math and score_function != "sigmoid":
        raise ValueError(
            "input_dtype_math (SGLang's moe_fused_gate arithmetic) needs sigmoid scores"
        )
    if expert_bias is not None:
        check_tensor(
            bias_name, expert_bias, dtypes=FLOAT_DTYPES, shape=(num_experts,), device=device
        )
        if not expert_bias.is_contiguous():
            expert_bias = expert_bias.contiguous()
    non_padded_rows = None
    if isinstance(non_padded, torch.Tensor):
        check_tensor(
            "num_token_non_padded",
            non_padded,
            dtypes=(torch.int32, torch.int64),
            device=device,
        )
        if non_padded.numel() != 1:
            raise ValueError(
                f"num_token_non_padded must hold one value, got shape {tuple(non_padded.shape)}"
            )
    elif non_padded is not None:
        non_padded_rows = check_int("num_token_non_padded", non_padded, low=0)
        non_padded = None
    if token_expert_indices and topk * tokens > 2**31 - 1:
        raise ValueError(f"token_expert_indices of {tokens} tokens x {topk} do not fit int32")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    call = TopkCall(
        num_experts,
        topk,
        score_function,
        bool(renormalize),
        scaling_factor,
        num_groups,
        group_topk,
        bool(approximate_activation),
        num_shared,
        float(shared_weight),
        shared_div,
        non_padded_rows,
        input_dtype_math and logits.dtype != torch.float32,
    )
    chosen_backend = dispatch.kernel_backend("biased_topk", device, backend, call)
    out_k = call.out_k
    weights = torch.empty(tokens, out_k, dtype=torch.float32, device=device)
    ids = torch.empty(tokens, out_k, dtype=ids_dtype, device=device)
    tei = (
        torch.empty(tokens, topk, dtype=torch.int32, device=device)
        if token_expert_indices
        else None
    )
    _biased_topk(call, logits, expert_bias, weights, ids, tei, non_padded, backend=chosen_backend)
    return weights, ids, tei
