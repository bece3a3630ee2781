"""Outputs of a serving top-k call (:class:`amdqb.backends.calls.TopkCall`) that a backend's
routed kernel does not write itself: the fused shared experts, ``token_expert_indices``, padded
rows and int64 ids, filled around compact ``[T, k]`` weights and ids with a few torch ops (the hip
backend's ``amdqb_topk`` writes them all in its one launch; the Triton kernels and the hip router
kernels it declines to go through this).
"""

from __future__ import annotations

import torch

from ..ref.router import routes_sum, token_expert_indices


def routed_buffers(call, weights_out, ids_out):
    """Where a routed kernel writes its compact ``(weights fp32 [T, k], ids int32 [T, k])``: the
    outputs themselves when they are exactly that, else scratch that :func:`finish` copies."""
    if call.num_shared == 0 and ids_out.dtype == torch.int32:
        return weights_out, ids_out
    tokens = weights_out.shape[0]
    return (
        torch.empty(tokens, call.topk, dtype=torch.float32, device=weights_out.device),
        torch.empty(tokens, call.topk, dtype=torch.int32, device=weights_out.device),
    )


def finish(
    call, num_experts, routed_w, routed_ids, weights_out, ids_out, tei_out, non_padded
) -> None:
    """Completes the outputs of ``call`` from the routed kernel's compact ones."""
    k = call.topk
    tokens = weights_out.shape[0]
    if routed_w is not weights_out:
        weights_out[:, :k].copy_(routed_w)
        ids_out[:, :k].copy_(routed_ids)
    if call.num_shared:
        if call.shared_div is not None:  # renormalize off, no scaling: the raw routed scores
            weights_out[:, k:].copy_(routes_sum(routed_w) / call.shared_div)
        else:
            weights_out[:, k:].fill_(call.shared_weight)
        shared = torch.arange(num_experts, num_experts + call.num_shared, device=ids_out.device)
        ids_out[:, k:].copy_(shared)
    limit = non_padded if non_padded is not None else call.non_padded_rows
    if limit is not None:
        rows = torch.arange(tokens, device=ids_out.device)
        ids_out.masked_fill_((rows >= limit).unsqueeze(1), -1)
    if tei_out is not None:
        tei_out.copy_(token_expert_indices(tokens, k, tei_out.device))
