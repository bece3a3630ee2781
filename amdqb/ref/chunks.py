"""Pure-PyTorch oracles of the fused chunk sort + pad and its inverse (TE PR #3509 semantics).

* input chunk ``c`` is rows ``[in_start[c], in_start[c] + split_sizes[c])`` of ``inp``;
* output chunk ``i`` starts at ``out_start[i]`` (exclusive cumsum of ``output_split_sizes``) and
  holds source chunk ``sorted_indices[i]`` followed by zero padding up to ``output_split_sizes[i]``;
* ``row_map[p]`` is the source row of output row ``p``, ``-1`` for padding (and for rows past the
  last output chunk); padding rows are zero and receive zero gradient.
Copies are exact (no arithmetic), so every backend must match bitwise.

Inconsistent metadata (the device never reports it; every backend gives these outcomes):

* a negative size (``split_sizes`` or ``output_split_sizes``) counts as 0, and a size above
  ``2^31 - 1`` as ``2^31 - 1`` (clamped), so the cumulative sums are monotone and exact in int64;
* ``sorted_indices[i]`` outside ``[0, C)``: output chunk ``i`` is all padding (dropped);
* a duplicate in ``sorted_indices``: that input chunk is copied to every output chunk naming it
  (a chunk nobody names is not copied); its backward keeps one of the gradients, not their sum;
* a source row ``>= T`` (split sizes summing past the input): not copied (``row_map`` ``-1``, a
  zero row) -- dropped;
* ``output_split_sizes[i] < split_sizes[sorted_indices[i]]``: the chunk is cut to the output size;
* ``num_out_tokens`` other than ``sum(output_split_sizes)``: rows past the last output chunk are
  padding (``-1``, zero), output chunks past ``num_out_tokens`` are cut;
* restore (``moe_unpad_and_restore_chunks``): a ``row_map`` entry outside ``[0, num_tokens)``
  writes nothing (dropped); two entries naming one row leave one of the two inputs there
  (unspecified which).
"""

from __future__ import annotations

import torch

INT32_MAX = 2**31 - 1


def clamp_sizes(sizes: torch.Tensor) -> torch.Tensor:
    """int64 chunk sizes clamped to ``[0, 2^31 - 1]`` (the rule for inconsistent sizes)."""
    return sizes.to(torch.int64).clamp(0, INT32_MAX)


def chunk_row_map(
    split_sizes: torch.Tensor,
    sorted_indices: torch.Tensor,
    output_split_sizes: torch.Tensor,
    num_out_tokens: int,
    num_in_tokens: int | None = None,
) -> torch.Tensor:
    """int32 ``[num_out_tokens]`` destination -> source row map (``-1`` at padding and wherever
    the metadata names no row of the ``num_in_tokens``-row input; None: no input bound beyond
    int32)."""
    device = split_sizes.device
    sizes = clamp_sizes(split_sizes)
    out_sizes = clamp_sizes(output_split_sizes)
    order = sorted_indices.to(torch.int64)
    chunks = sizes.numel()
    in_start = torch.cumsum(sizes, 0) - sizes
    out_end = torch.cumsum(out_sizes, 0)
    out_start = out_end - out_sizes
    p = torch.arange(num_out_tokens, device=device, dtype=torch.int64)
    chunk = torch.searchsorted(out_end, p, right=True)
    inside = chunk < out_sizes.numel()
    chunk_c = chunk.clamp(max=max(out_sizes.numel() - 1, 0))
    named = (order >= 0) & (order < chunks)
    src_chunk = torch.where(named, order, 0)[chunk_c]
    offset = p - out_start[chunk_c]
    copy = inside & named[chunk_c] & (offset < sizes[src_chunk])
    row = in_start[src_chunk] + offset
    limit = INT32_MAX + 1 if num_in_tokens is None else num_in_tokens
    copy &= row < limit
    return torch.where(copy, row, torch.full_like(row, -1)).to(torch.int32)


def gather_rows(inp: torch.Tensor, row_map: torch.Tensor) -> torch.Tensor:
    """``out[p] = inp[row_map[p]]``, zero where ``row_map[p]`` is outside ``[0, rows)``
    (differentiable)."""
    # An appended zero row serves every unmapped entry (and keeps an empty input indexable).
    rows = inp.shape[0]
    padded = torch.cat([inp, inp.new_zeros(1, *inp.shape[1:])])
    return padded[torch.where((row_map >= 0) & (row_map < rows), row_map, rows).long()]


def moe_sort_chunks_and_pad(
    inp: torch.Tensor,
    split_sizes: torch.Tensor,
    sorted_indices: torch.Tensor,
    output_split_sizes: torch.Tensor,
    num_out_tokens: int,
    probs: torch.Tensor | None = None,
):
    """``(out [num_out_tokens, H], out_probs [num_out_tokens] | None, row_map int32)``."""
    row_map = chunk_row_map(
        split_sizes, sorted_indices, output_split_sizes, num_out_tokens, inp.shape[0]
    )
    out = gather_rows(inp, row_map)
    out_probs = None if probs is None else gather_rows(probs, row_map)
    return out, out_probs, row_map


def moe_unpad_and_restore_chunks(
    inp: torch.Tensor, row_map: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """``out[row_map[p]] = inp[p]`` for ``0 <= row_map[p] < num_tokens``; uncovered rows are
    zero."""
    valid = (row_map >= 0) & (row_map < num_tokens)
    out = torch.zeros(num_tokens, *inp.shape[1:], dtype=inp.dtype, device=inp.device)
    return out.index_put((row_map[valid].long(),), inp[valid])
