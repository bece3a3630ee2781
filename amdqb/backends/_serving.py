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


def align_buckets(call, topk_ids, expert_map) -> torch.Tensor:
    """The bucket of every route of an align call (:class:`amdqb.backends.calls.AlignCall`) as
    int64 ids for a kernel that skips ids outside ``[0, num_experts)``."""
    v = topk_ids.reshape(-1).long()
    if call.map_mode == "filter":
        inside = (v >= 0) & (v < expert_map.numel())
        mapped = expert_map.long()[v.clamp(0, expert_map.numel() - 1)]
        return torch.where(inside, mapped, torch.full_like(v, -1))
    return v + call.id_shift if call.id_shift else v


def align_finish(call, expert_map, expert_ids_out, num_post_pad_out) -> None:
    """The blocks' experts of an align call from a kernel that wrote each used block's bucket:
    minus ``owner_shift`` or through the map, ``tail_value`` past the padded total."""
    if call.owner_shift == 0 and call.tail_value == 0 and call.map_mode != "output":
        return  # the kernels' own convention (buckets, 0 past the total)
    starts = torch.arange(
        0, expert_ids_out.numel() * call.block_size, call.block_size, device=expert_ids_out.device
    )
    used = starts < num_post_pad_out.view(1)
    value = torch.where(
        used,
        expert_ids_out - call.owner_shift,
        torch.full_like(expert_ids_out, call.tail_value),
    )
    if call.map_mode == "output":
        as_int32 = expert_map.to(torch.int32)
        value = torch.where(used, as_int32[expert_ids_out.long()], as_int32[call.tail_value])
    expert_ids_out.copy_(value)
