"""Pure-PyTorch oracles of route rows and vLLM's ``moe_align_block_size``.

Route contract:

* a route is one entry ``(t, j)`` of ``topk_ids [M, k]``; its flat index is ``t * k + j``;
* ids outside ``[0, E)`` (``-1`` included) are dropped: row ``-1``, no slot, not counted;
* each valid route to expert ``e`` claims slot ``c0[e] + rank`` where ``c0`` are the caller's
  counters (zeros when not given) and ``rank`` is its position among this call's routes to ``e``;
  the oracle (and ``deterministic=True``) uses ascending flat index, kernels otherwise any order;
* ``capacity`` given: ``row = e * capacity + slot``, slots ``>= capacity`` dropped (row ``-1``);
  ``capacity=None``: ``row = offset[e] + slot`` with ``offset`` the exclusive cumsum of the updated
  counters, i.e. the expert-major layout of every slot claimed so far;
* ``counts[e]`` = routes of this call that received a row; ``counters[e] +=`` valid routes to ``e``
  (int32, wrapping).

Inconsistent counters (any int32 value is memory-safe; every backend gives these outcomes):

* a slot outside ``[0, 2^31 - 1]`` (a negative counter, or one that passes int32) is dropped: row
  ``-1``, not counted; the counter still advances by the valid routes;
* compact layout: ``offset`` is the exclusive cumsum of the updated counters clamped at 0, and
  expert ``e`` owns rows ``[offset[e], offset[e] + max(counters[e], 0))``; a route whose slot is not
  below its updated counter (the counter wrapped past int32) or whose row passes ``2^31 - 1`` is
  dropped. Every row handed out is therefore in ``[0, 2^31 - 1]`` and owned by one route.
"""

from __future__ import annotations

import torch


def _stable_ranks(flat: torch.Tensor, valid: torch.Tensor, num_experts: int):
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))
    order = torch.sort(key, stable=True).indices
    sorted_key = key[order]
    raw = torch.bincount(key, minlength=num_experts + 1)
    start = torch.cumsum(raw, 0) - raw
    rank_sorted = torch.arange(flat.numel(), device=flat.device) - start[sorted_key]
    rank = torch.empty_like(rank_sorted)
    rank[order] = rank_sorted
    return rank, raw[:num_experts]


def moe_route_rows(
    topk_ids: torch.Tensor,
    num_experts: int,
    capacity: int | None = None,
    counters: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic oracle: ``(rows int32 [M, k], counts int32 [E])``; ``counters`` updated in place."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    valid = (flat >= 0) & (flat < num_experts)
    rank, raw = _stable_ranks(flat, valid, num_experts)
    e = torch.where(valid, flat, torch.zeros_like(flat))
    c0 = (
        torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
        if counters is None
        else counters.to(torch.int64)
    )
    slot = c0[e] + rank  # exact: int32 counter + a rank below 2^31
    accept = valid & (slot >= 0) & (slot <= INT32_MAX)
    updated = _wrap_int32(c0 + raw)  # the counters after the call, as int32 stores them
    if capacity is not None:
        accept &= slot < capacity
        row = e * capacity + slot
    else:
        total = updated.clamp(min=0)
        offset = torch.cumsum(total, 0) - total
        row = offset[e] + slot
        accept &= (slot < updated[e]) & (row <= INT32_MAX)
    rows = torch.where(accept, row, torch.full_like(row, -1)).to(torch.int32)
    counts = torch.bincount(e[accept], minlength=num_experts).to(torch.int32)
    if counters is not None:
        counters.copy_(updated.to(counters.dtype))
    return rows.reshape(topk_ids.shape), counts


INT32_MAX = 2**31 - 1


def _wrap_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 values reduced to the int32 range modulo 2^32 (two's complement), as int64."""
    return (x + 2**31) % 2**32 - 2**31


def align_buffer_sizes(numel: int, num_experts: int, block_size: int, pad_sorted_ids: bool):
    """vLLM's buffer sizes: ``(max_num_tokens_padded, max_num_m_blocks)``.

    ``numel + E * (block_size - 1)`` rows, rounded up to ``block_size`` when ``pad_sorted_ids``;
    with fewer routes than experts (decode) at most ``numel`` experts are non-empty, so vLLM
    caps the rows at ``numel * block_size`` (already a multiple of ``block_size``, so the cap
    applies after the rounding). Either way the padded total of any routing fits:
    ``sum_e ceil(c_e / bs) * bs <= numel + min(numel, E) * (bs - 1)``.
    """
    max_padded = numel + num_experts * (block_size - 1)
    if pad_sorted_ids:
        max_padded = -(-max_padded // block_size) * block_size
    if numel < num_experts:
        max_padded = min(numel * block_size, max_padded)
    return max_padded, -(-max_padded // block_size)


def moe_align_block_size(
    topk_ids: torch.Tensor,
    block_size: int,
    num_experts: int,
    expert_map: torch.Tensor | None = None,
    pad_sorted_ids: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM semantics with a deterministic order (ascending flat route index inside an expert).

    ``sorted_token_ids`` holds flat route indices padded with the sentinel ``numel``; ``expert_ids``
    holds one expert per block (unused tail blocks 0, then mapped through ``expert_map`` when given);
    ``num_tokens_post_pad`` is an int32 ``[1]`` tensor. Ids outside ``[0, E)`` are dropped.
    """
    device = topk_ids.device
    numel = topk_ids.numel()
    max_padded, max_blocks = align_buffer_sizes(numel, num_experts, block_size, pad_sorted_ids)
    flat = topk_ids.reshape(-1).to(torch.int64)
    valid = (flat >= 0) & (flat < num_experts)
    rank, counts = _stable_ranks(flat, valid, num_experts)
    padded = (counts + block_size - 1) // block_size * block_size
    start = torch.cumsum(padded, 0) - padded
    sorted_ids = torch.full((max_padded,), numel, dtype=torch.int32, device=device)
    e = torch.where(valid, flat, torch.zeros_like(flat))
    pos = start[e] + rank
    sorted_ids[pos[valid]] = torch.arange(numel, device=device, dtype=torch.int32)[valid]
    block_expert = torch.repeat_interleave(
        torch.arange(num_experts, device=device), padded // block_size
    )
    expert_ids = torch.zeros(max_blocks, dtype=torch.int32, device=device)
    expert_ids[: block_expert.numel()] = block_expert.to(torch.int32)
    if expert_map is not None:
        expert_ids = expert_map.to(torch.int32)[expert_ids.long()]
    num_post_pad = padded.sum().reshape(1).to(torch.int32)
    return sorted_ids, expert_ids, num_post_pad
