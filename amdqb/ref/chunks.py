"""Pure-PyTorch oracles of the fused chunk sort + pad and its inverse (TE PR #3509 semantics).

* input chunk ``c`` is rows ``[in_start[c], in_start[c] + split_sizes[c])`` of ``inp``;
* output chunk ``i`` starts at ``out_start[i]`` (exclusive cumsum of ``output_split_sizes``) and
  holds source chunk ``sorted_indices[i]`` followed by zero padding up to ``output_split_sizes[i]``;
* ``row_map[p]`` is the source row of output row ``p``, ``-1`` for padding (and for rows past the
  last output chunk); padding rows are zero and receive zero gradient.
Copies are exact (no arithmetic), so every backend must match bitwise.
"""

from __future__ import annotations

import torch


def chunk_row_map(
    split_sizes: torch.Tensor,
    sorted_indices: torch.Tensor,
    output_split_sizes: torch.Tensor,
    num_out_tokens: int,
) -> torch.Tensor:
    """int32 ``[num_out_tokens]`` destination -> source row map (``-1`` at padding)."""
    device = split_sizes.device
    sizes = split_sizes.to(torch.int64)
    out_sizes = output_split_sizes.to(torch.int64)
    order = sorted_indices.to(torch.int64)
    in_start = torch.cumsum(sizes, 0) - sizes
    out_end = torch.cumsum(out_sizes, 0)
    out_start = out_end - out_sizes
    p = torch.arange(num_out_tokens, device=device, dtype=torch.int64)
    chunk = torch.searchsorted(out_end, p, right=True)
    inside = chunk < out_sizes.numel()
    chunk_c = chunk.clamp(max=max(out_sizes.numel() - 1, 0))
    src_chunk = order[chunk_c]
    offset = p - out_start[chunk_c]
    copy = inside & (offset < sizes[src_chunk])
    row = in_start[src_chunk] + offset
    return torch.where(copy, row, torch.full_like(row, -1)).to(torch.int32)


def gather_rows(inp: torch.Tensor, row_map: torch.Tensor) -> torch.Tensor:
    """``out[p] = inp[row_map[p]]`` or zero where ``row_map[p] < 0`` (differentiable)."""
    # An appended zero row serves every -1 entry (and keeps an empty input indexable).
    padded = torch.cat([inp, inp.new_zeros(1, *inp.shape[1:])])
    return padded[torch.where(row_map >= 0, row_map, inp.shape[0]).long()]


def moe_sort_chunks_and_pad(
    inp: torch.Tensor,
    split_sizes: torch.Tensor,
    sorted_indices: torch.Tensor,
    output_split_sizes: torch.Tensor,
    num_out_tokens: int,
    probs: torch.Tensor | None = None,
):
    """``(out [num_out_tokens, H], out_probs [num_out_tokens] | None, row_map int32)``."""
    row_map = chunk_row_map(split_sizes, sorted_indices, output_split_sizes, num_out_tokens)
    out = gather_rows(inp, row_map)
    out_probs = None if probs is None else gather_rows(probs, row_map)
    return out, out_probs, row_map


def moe_unpad_and_restore_chunks(
    inp: torch.Tensor, row_map: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """``out[row_map[p]] = inp[p]`` for ``row_map[p] >= 0``; uncovered rows are zero."""
    valid = row_map >= 0
    out = torch.zeros(num_tokens, *inp.shape[1:], dtype=inp.dtype, device=inp.device)
    return out.index_put((row_map[valid].long(),), inp[valid])
