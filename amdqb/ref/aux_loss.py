"""Pure-PyTorch oracles of TransformerEngine's aux-loss router ops.

``compute_scores_for_aux_loss(logits, topk, score_function) -> (routing_map, scores)``

* ``z = fp32(logits)``; ``softmax``: ``scores = softmax(z)`` over the experts;
  ``sigmoid`` / ``sqrtsoftplus``: ``a = sigmoid(z)`` or ``sqrt(softplus(z))`` (torch's threshold
  20), then ``scores = a / (sum_E a + 1e-20)``, normalised over *all* experts for every ``topk``
  (no expert bias, no groups, no scaling).
* ``routing_map``: the ``topk`` best scores of each token in the selection order of
  ``amdqb.ref.ordering`` (score descending, expert id ascending, NaN lowest).
* backward: gradient of ``scores`` to the logits through the normalisation and the activation (the
  map is not differentiable).

``moe_aux_loss(probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff)``

* ``loss = C * sum_c (sum_r probs[r, c]) * tokens_per_expert[c]`` with
  ``C = fp32(fp32(fp32(num_experts) * fp32(coeff)) / topk) / T / T``, every step rounded to fp32
  (TE's ``(num_experts * coeff) / topk / total_num_tokens / total_num_tokens`` in C++ float); ``T``
  is the total token count: a Python int (``C`` is folded on the host) or a 0-dim int64 tensor
  (``C`` is computed on its device; the host never reads it, so the call is graph-safe).
* ``probs`` is ``[rows, cols]`` with ``cols`` a multiple of ``num_experts`` (the sequence aux loss
  batches sequences along the expert axis); sums are fp32; the loss is a 0-dim tensor in the probs
  dtype. Backward: ``d loss / d probs[r, c] = (C * tokens_per_expert[c]) * grad``.
"""

from __future__ import annotations

import struct

import torch

from .ordering import ranked_indices
from .router import NORM_EPS, activation

SCORE_FUNCTIONS = ("sigmoid", "softmax", "sqrtsoftplus")


def compute_scores_for_aux_loss(
    logits: torch.Tensor, topk: int, score_function: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(routing_map bool [..., E], scores fp32 [..., E])``; differentiable w.r.t. ``logits``."""
    z = logits.float()
    if score_function == "softmax":
        scores = torch.softmax(z, dim=-1)
    else:
        a = activation(z, score_function)
        scores = a / (a.sum(dim=-1, keepdim=True) + NORM_EPS)
    idx = ranked_indices(scores.detach(), topk)
    routing_map = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    routing_map.scatter_(-1, idx, True)
    return routing_map, scores


def _fp32(x: float) -> float:
    """``x`` rounded to the nearest fp32 (as a Python float)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def coefficient_prefix(num_experts: int, topk: int, coeff: float) -> float:
    """fp32 ``(fp32(num_experts) * fp32(coeff)) / fp32(topk)``, each step rounded to fp32.

    Python's double result of one fp32 * or / is rounded once more to fp32; with 53 >= 2 * 24 + 2
    bits that double rounding equals the correctly rounded fp32 result.
    """
    prod = _fp32(_fp32(float(num_experts)) * _fp32(float(coeff)))
    return _fp32(prod / _fp32(float(topk)))


def host_coefficient(num_experts: int, topk: int, coeff: float, total_num_tokens: int) -> float:
    """fp32 ``C`` for a host token count (TE's host-folded path)."""
    t = _fp32(float(total_num_tokens))
    return _fp32(_fp32(coefficient_prefix(num_experts, topk, coeff) / t) / t)


def device_coefficient(prefix: float, total_num_tokens: torch.Tensor) -> torch.Tensor:
    """0-dim fp32 ``C = prefix / T / T`` on ``total_num_tokens``' device, without reading it.

    Both operands are device tensors: a Python or CPU-scalar divisor would make PyTorch multiply by
    a reciprocal, which is not the correctly rounded quotient.
    """
    t = total_num_tokens.reshape(()).to(torch.float32)
    a = torch.full((), prefix, dtype=torch.float32, device=t.device)
    return (a / t) / t


def aux_loss_coefficient(
    num_experts: int, topk: int, coeff: float, total_num_tokens
) -> torch.Tensor | float:
    """``C`` as a Python float (int token count) or a 0-dim fp32 device tensor (tensor count)."""
    if isinstance(total_num_tokens, torch.Tensor):
        return device_coefficient(coefficient_prefix(num_experts, topk, coeff), total_num_tokens)
    return host_coefficient(num_experts, topk, coeff, total_num_tokens)


def aux_loss_sum(probs: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """fp32 ``sum_c (sum_r probs[r, c]) * tokens_per_expert[c]`` (differentiable in ``probs``)."""
    return (probs.float().sum(dim=0) * tokens_per_expert.float()).sum()


def moe_aux_loss(
    probs: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_num_tokens,
    num_experts: int,
    topk: int,
    coeff: float,
) -> torch.Tensor:
    """Oracle aux loss: a 0-dim tensor in ``probs.dtype``, differentiable w.r.t. ``probs``."""
    c = aux_loss_coefficient(num_experts, topk, coeff, total_num_tokens)
    if not isinstance(c, torch.Tensor):
        c = torch.full((), c, dtype=torch.float32, device=probs.device)
    return (aux_loss_sum(probs, tokens_per_expert) * c).to(probs.dtype)
