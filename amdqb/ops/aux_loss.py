"""TransformerEngine's aux-loss router ops: ``fused_compute_score_for_moe_aux_loss`` and
``fused_moe_aux_loss`` (TE ``transformer_engine/pytorch/router.py`` semantics), with backward.

Scores: ``softmax(z)`` over the experts, or ``a / (sum_E a + 1e-20)`` with ``a = sigmoid(z)`` /
``sqrt(softplus(z))``, normalised over all experts whatever ``topk`` is; the routing map marks the
``topk`` best scores. Aux loss: ``C * sum_c (sum_r probs[r, c]) * tokens_per_expert[c]`` with
``C = (num_experts * coeff) / topk / T / T`` in fp32 (T = ``total_num_tokens``).

Precision: logits are converted to fp32 on load and all math is fp32; ``scores`` is fp32, the
logits gradient is in the logits dtype, the loss and its gradient are in the probs dtype. The
element-wise activations (sigmoid, sqrt-softplus) are bitwise PyTorch's on the same device; the
softmax, the normalising row sum and the aux-loss reductions are fp32 in the kernel's summation
order and agree with PyTorch (and TE) to fp32 rounding, not bit for bit.

Tie-break contract: the routing map ranks the fp32 scores by (score descending, expert id
ascending); NaN ranks below every number; exactly ``topk`` distinct experts per token. (TE's
small-k kernel does not promise the smaller id on exact ties; its radix path does.)

Graph safety: ``total_num_tokens`` may be a 0-dim int64 device tensor; then the coefficient is
computed on the device at every launch and never read by the host, so the call can be captured in a
CUDA/HIP graph and replayed with a changed count (forward and backward). A Python int folds the
coefficient on the host (TE's fast path). Both ops trace under ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from .. import dispatch
from .._library import impl, kernel_op
from ..ref import aux_loss as ref_aux
from ..ref.router import SCORE_FUNCTIONS
from ._checks import (
    FLOAT_DTYPES,
    ROWS,
    check_backend,
    check_choice,
    check_float,
    check_int,
    check_tensor,
    kernel_input,
    static_int,
)
from .router import _map_format

TOKENS_PER_EXPERT_DTYPES = (torch.int32, torch.int64, torch.float32, torch.bfloat16)


# --------------------------------------------------------------------------------------------
# Kernel-level ops (custom ops under torch.compile, direct calls in eager mode).
# --------------------------------------------------------------------------------------------
def _map_shape(tokens: int, num_experts: int, map_kind: str) -> tuple[tuple[int, int], torch.dtype]:
    if map_kind == "bitmap":
        return (tokens, (num_experts + 7) // 8), torch.uint8
    return (tokens, num_experts), torch.bool


def _scores_fake(logits, topk, score_function, map_kind, backend):
    shape, dtype = _map_shape(logits.shape[0], logits.shape[1], map_kind)
    return logits.new_empty(logits.shape, dtype=torch.float32), logits.new_empty(shape, dtype=dtype)


@kernel_op("aux_scores_fwd", mutates_args=(), fake=_scores_fake)
def _aux_scores_fwd(
    logits: torch.Tensor, topk: int, score_function: str, map_kind: str, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, num_experts = logits.shape
    shape, dtype = _map_shape(tokens, num_experts, map_kind)
    scores = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    routing_map = torch.empty(shape, dtype=dtype, device=logits.device)
    impl("aux_scores_fwd", backend)(logits, topk, score_function, scores, routing_map, map_kind)
    return scores, routing_map


def _scores_bwd_fake(grad_scores, logits, score_function, backend):
    return torch.empty_like(logits)


@kernel_op("aux_scores_bwd", mutates_args=(), fake=_scores_bwd_fake)
def _aux_scores_bwd(
    grad_scores: torch.Tensor, logits: torch.Tensor, score_function: str, backend: str
) -> torch.Tensor:
    grad = torch.empty_like(logits)
    impl("aux_scores_bwd", backend)(grad_scores, logits, score_function, grad)
    return grad


def _loss_fake(probs, tokens_per_expert, total_num_tokens, coeff_host, coeff_prefix, backend):
    return probs.new_empty((), dtype=probs.dtype), probs.new_empty(2, dtype=torch.float32)


@kernel_op("aux_loss_fwd", mutates_args=(), fake=_loss_fake)
def _aux_loss_fwd(
    probs: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_num_tokens: Optional[torch.Tensor],
    coeff_host: float,
    coeff_prefix: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    loss = torch.empty((), dtype=probs.dtype, device=probs.device)
    coeff_buf = torch.empty(2, dtype=torch.float32, device=probs.device)
    impl("aux_loss_fwd", backend)(
        probs, tokens_per_expert, total_num_tokens, coeff_host, coeff_prefix, loss, coeff_buf
    )
    return loss, coeff_buf


def _loss_bwd_fake(coeff_buf, tokens_per_expert, grad_loss, num_rows, backend):
    return grad_loss.new_empty((num_rows, tokens_per_expert.shape[0]))


@kernel_op("aux_loss_bwd", mutates_args=(), fake=_loss_bwd_fake)
def _aux_loss_bwd(
    coeff_buf: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    grad_loss: torch.Tensor,
    num_rows: int,
    backend: str,
) -> torch.Tensor:
    shape = (num_rows, tokens_per_expert.shape[0])
    grad = torch.empty(shape, dtype=grad_loss.dtype, device=grad_loss.device)
    impl("aux_loss_bwd", backend)(coeff_buf, tokens_per_expert, grad_loss, grad)
    return grad


# --------------------------------------------------------------------------------------------
# Autograd.
# --------------------------------------------------------------------------------------------
class _AuxScoresFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits2d, topk, score_function, map_kind, backends):
        scores, routing_map = _aux_scores_fwd(logits2d, topk, score_function, map_kind, backends[0])
        ctx.save_for_backward(logits2d)
        ctx.meta = (score_function, backends[1])
        ctx.mark_non_differentiable(routing_map)
        return routing_map, scores

    @staticmethod
    def backward(ctx, _grad_map, grad_scores):
        (logits2d,) = ctx.saved_tensors
        score_function, backend = ctx.meta
        grad = _aux_scores_bwd(grad_scores.float().contiguous(), logits2d, score_function, backend)
        return grad, None, None, None, None


class _AuxLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, probs, tokens_per_expert, total, coeff_host, coeff_prefix, backends):
        loss, coeff_buf = _aux_loss_fwd(
            probs, tokens_per_expert, total, coeff_host, coeff_prefix, backends[0]
        )
        ctx.save_for_backward(coeff_buf, tokens_per_expert)
        ctx.meta = (probs.shape[0], backends[1])
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        coeff_buf, tokens_per_expert = ctx.saved_tensors
        num_rows, backend = ctx.meta
        grad = _aux_loss_bwd(
            coeff_buf, tokens_per_expert, grad_loss.contiguous(), num_rows, backend
        )
        return grad, None, None, None, None, None


# --------------------------------------------------------------------------------------------
# Public ops.
# --------------------------------------------------------------------------------------------
def fused_compute_score_for_moe_aux_loss(
    logits: torch.Tensor,
    topk: int,
    score_function: str,
    routing_map_format="bytemap",
    *,
    backend: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores for the MoE aux loss and their Top-k routing map (TransformerEngine-compatible).

    Args:
        logits: ``[..., E]`` fp32/bf16/fp16 router logits (any leading dims).
        topk: experts marked per token, ``1 <= topk <= E``.
        score_function: ``"softmax"``, ``"sigmoid"`` or ``"sqrtsoftplus"``; the latter two are
            normalised over all experts (``a / (sum a + 1e-20)``).
        routing_map_format: ``"bytemap"`` (bool ``[..., E]``) or ``"bitmap_u8"`` (uint8
            ``[..., ceil(E/8)]``, bit ``e % 8`` of byte ``e // 8``); TE's ``RoutingMapFormat`` or
            its int (0 / 1) also work.
        backend: force ``"triton"`` or ``"torch"`` (default: the dispatcher's choice).

    Returns:
        ``(routing_map, scores)``: the map as chosen by ``routing_map_format`` and fp32 ``scores``
        of the logits' shape, differentiable w.r.t. ``logits``.
    """
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, min_dim=1)
    num_experts = static_int(logits.shape[-1])
    if num_experts < 1:
        raise ValueError("logits must have at least one expert (last dim >= 1)")
    topk = static_int(check_int("topk", topk, low=1, high=num_experts))
    check_choice("score_function", score_function, SCORE_FUNCTIONS)
    check_backend(backend)
    map_kind = "bitmap" if _map_format(routing_map_format) == "bitmap_u8" else "bytemap"
    lead = logits.shape[:-1]
    # rows read through their stride: a logits slice of a wider projection is not copied
    logits2d = kernel_input(logits.reshape(-1, num_experts), ROWS)
    device = logits.device
    features = dict(num_experts=num_experts, topk=topk, score_function=score_function)
    fwd = dispatch.kernel_backend("aux_scores_fwd", device, backend, **features)
    if torch.is_grad_enabled() and logits.requires_grad:
        bwd = dispatch.kernel_backend("aux_scores_bwd", device, prefer=fwd, **features)
        routing_map, scores = _AuxScoresFunction.apply(
            logits2d, topk, score_function, map_kind, (fwd, bwd)
        )
    else:
        scores, routing_map = _aux_scores_fwd(logits2d, topk, score_function, map_kind, fwd)
    return routing_map.view(*lead, routing_map.shape[-1]), scores.view(*lead, num_experts)


@torch.compiler.assume_constant_result
def _host_coefficient(num_experts: int, topk: int, coeff: float, total_num_tokens: int) -> float:
    return ref_aux.host_coefficient(num_experts, topk, coeff, total_num_tokens)


@torch.compiler.assume_constant_result
def _coefficient_prefix(num_experts: int, topk: int, coeff: float) -> float:
    return ref_aux.coefficient_prefix(num_experts, topk, coeff)


def fused_moe_aux_loss(
    probs: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_num_tokens: Union[int, torch.Tensor],
    num_experts: int,
    topk: int,
    coeff: float,
    *,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Fused MoE aux loss (TransformerEngine-compatible), differentiable w.r.t. ``probs``.

    Args:
        probs: ``[num_tokens, cols]`` fp32/bf16/fp16; ``cols`` is ``num_experts`` or a multiple of
            it (sequence aux loss: sequences batched along the expert axis).
        tokens_per_expert: ``[cols]`` int32/int64/fp32/bf16 token counts.
        total_num_tokens: a Python int (coefficient folded on the host) or a 0-dim int64 tensor on
            the probs device (coefficient computed on the device, never read by the host: capturable
            in a CUDA/HIP graph whose replays see the tensor's current value).
        num_experts, topk: ints >= 1.
        coeff: the aux-loss coefficient.
        backend: force ``"triton"`` or ``"torch"`` (default: the dispatcher's choice).

    Returns:
        A 0-dim tensor in the probs dtype:
        ``(num_experts * coeff) / topk / T / T * sum_c (sum_r probs[r, c]) * tokens_per_expert[c]``.
    """
    check_tensor("probs", probs, dtypes=FLOAT_DTYPES, dim=2)
    cols = static_int(probs.shape[1])
    device = probs.device
    check_tensor(
        "tokens_per_expert",
        tokens_per_expert,
        dtypes=TOKENS_PER_EXPERT_DTYPES,
        shape=(cols,),
        device=device,
    )
    num_experts = static_int(check_int("num_experts", num_experts, low=1))
    if cols % num_experts:
        raise ValueError(
            f"probs has {cols} columns, which must be a multiple of num_experts={num_experts}"
        )
    topk = static_int(check_int("topk", topk, low=1))
    coeff = check_float("coeff", coeff, finite=True)
    check_backend(backend)
    if torch.compiler.is_compiling() and not isinstance(total_num_tokens, torch.Tensor):
        # A traced int may be symbolic (dynamic shapes), which cannot fold on the host, and traced
        # code cannot tell: a compiled call takes the device path, whose fp32 quotients are the
        # host path's bits (IEEE division either way).
        check_int("total_num_tokens", total_num_tokens, low=1)
        total_num_tokens = torch.full((), total_num_tokens, dtype=torch.int64, device=device)
    if isinstance(total_num_tokens, torch.Tensor):
        check_tensor("total_num_tokens", total_num_tokens, dtypes=(torch.int64,), device=device)
        if total_num_tokens.numel() != 1:
            raise ValueError(
                "total_num_tokens must be a 0-dim (one-element) int64 tensor, got shape "
                f"{tuple(total_num_tokens.shape)}"
            )
        total = total_num_tokens.reshape(())
        coeff_host = 0.0
        coeff_prefix = _coefficient_prefix(num_experts, topk, coeff)
    else:
        # numpy integers too, as TE's int() accepts them
        total_num_tokens = check_int("total_num_tokens", total_num_tokens, low=1)
        total = None
        coeff_host = _host_coefficient(num_experts, topk, coeff, total_num_tokens)
        coeff_prefix = 0.0
    probs = kernel_input(probs, ROWS)  # tokens_per_expert: read through its stride as it is
    fwd = dispatch.kernel_backend("aux_loss_fwd", device, backend, cols=cols)
    if torch.is_grad_enabled() and probs.requires_grad:
        bwd = dispatch.kernel_backend("aux_loss_bwd", device, prefer=fwd, cols=cols)
        return _AuxLossFunction.apply(
            probs, tokens_per_expert, total, coeff_host, coeff_prefix, (fwd, bwd)
        )
    loss, _ = _aux_loss_fwd(probs, tokens_per_expert, total, coeff_host, coeff_prefix, fwd)
    return loss
