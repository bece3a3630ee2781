"""Fused MoE chunk sort + pad and its inverse unpad + restore (TransformerEngine PR #3509 semantics).

Chunk metadata (``split_sizes``, ``sorted_indices``, ``output_split_sizes``) stays on the device and
is never read by the host, so it may change between CUDA/HIP graph replays as long as the buffer
sizes (``num_out_tokens``) stay fixed. Copies are exact; padding rows are zero and get zero
gradient; ``row_map`` is ``-1`` at padding. Offsets are computed in 64-bit (``rows * hidden`` may
pass 2^31).

Strides: ``inp`` (and ``probs``) are read in place through their row stride when their rows are
contiguous (a slice of a wider buffer, expanded rows), else through a contiguous copy; the int
metadata and ``row_map`` must be contiguous (docs/memory_safety.md).

Any metadata value is memory-safe: no kernel reads or writes outside its tensors, whatever the
device-side ``split_sizes``, ``sorted_indices``, ``output_split_sizes`` or ``row_map`` hold.
Inconsistent metadata has these outcomes on every backend (``amdqb.ref.chunks``): negative sizes
count as 0 (clamped); a ``sorted_indices`` entry outside ``[0, C)`` makes its output chunk all
padding (dropped); source rows past the input (sizes summing past ``T``) are not copied (zero
rows, ``row_map`` -1); a duplicate index copies the chunk twice, and the backward then keeps one
of the two gradients; restore skips ``row_map`` entries outside ``[0, num_tokens)``.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import dispatch
from .._library import impl, kernel_op
from ._checks import (
    FLOAT_DTYPES,
    ID_DTYPES,
    INT32_MAX,
    ROWS,
    check_backend,
    check_int,
    check_tensor,
    kernel_input,
)


def _row_map_fake(
    split_sizes, sorted_indices, output_split_sizes, num_out_tokens, num_in_tokens, backend
):
    return split_sizes.new_empty(num_out_tokens, dtype=torch.int32)


def _copy_fake(src, row_map, num_rows, reverse, backend):
    return src.new_empty(num_rows, *src.shape[1:])


@kernel_op("chunk_row_map", mutates_args=(), fake=_row_map_fake)
def _chunk_row_map(
    split_sizes: torch.Tensor,
    sorted_indices: torch.Tensor,
    output_split_sizes: torch.Tensor,
    num_out_tokens: int,
    num_in_tokens: int,
    backend: str,
) -> torch.Tensor:
    row_map = torch.empty(num_out_tokens, dtype=torch.int32, device=split_sizes.device)
    impl("chunk_row_map", backend)(
        split_sizes, sorted_indices, output_split_sizes, row_map, num_in_tokens
    )
    return row_map


@kernel_op("chunk_copy", mutates_args=(), fake=_copy_fake)
def _chunk_copy(
    src: torch.Tensor, row_map: torch.Tensor, num_rows: int, reverse: bool, backend: str
) -> torch.Tensor:
    shape = (num_rows, *src.shape[1:])
    dst = (torch.zeros if reverse else torch.empty)(shape, dtype=src.dtype, device=src.device)
    impl("chunk_copy", backend)(src, row_map, dst, reverse)
    return dst


class _ChunkCopy(torch.autograd.Function):
    """Forward ``dst[p] = src[row_map[p]]`` (or 0); its adjoint is the reverse scatter."""

    @staticmethod
    def forward(ctx, src, row_map, num_rows, reverse, backend):
        ctx.save_for_backward(row_map)
        ctx.meta = (src.shape[0], reverse, backend)
        return _chunk_copy(src, row_map, num_rows, reverse, backend)

    @staticmethod
    def backward(ctx, grad):
        (row_map,) = ctx.saved_tensors
        src_rows, reverse, backend = ctx.meta
        grad_src = _ChunkCopy.apply(grad.contiguous(), row_map, src_rows, not reverse, backend)
        return grad_src, None, None, None, None


def _check_meta(name, value, device, length=None):
    check_tensor(name, value, dtypes=ID_DTYPES, dim=1, device=device, contiguous=True)
    if value.numel() == 0:
        raise ValueError(f"{name} must not be empty")
    if length is not None and value.numel() != length:
        raise ValueError(f"{name} must have {length} entries (one per chunk), got {value.numel()}")


def _backend(device, backend, dtype):
    return dispatch.kernel_backend("chunk_copy", device, backend, dtype=str(dtype))


def moe_sort_chunks_and_pad(
    inp: torch.Tensor,
    split_sizes: torch.Tensor,
    sorted_indices: torch.Tensor,
    output_split_sizes: torch.Tensor,
    num_out_tokens: int,
    probs: Optional[torch.Tensor] = None,
    *,
    backend: Optional[str] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """Reorder token chunks and pad each output chunk, in one copy.

    Args:
        inp: ``[T, H]`` fp32/fp16/bf16 tokens, chunk ``c`` being the next ``split_sizes[c]`` rows.
        split_sizes: ``[C]`` int32/int64 rows per input chunk (device).
        sorted_indices: ``[C]`` output chunk ``i`` takes input chunk ``sorted_indices[i]``.
        output_split_sizes: ``[C]`` rows of output chunk ``i`` (``>= split_sizes[sorted_indices[i]]``;
            the extra rows are zero padding).
        num_out_tokens: ``sum(output_split_sizes)``, given by the caller so the host never reads
            device metadata; ``T <= num_out_tokens < 2^31``.
        probs: optional ``[T]`` per-token probabilities, copied alongside.

    Returns:
        ``(out [num_out_tokens, H], out_probs [num_out_tokens] | None, row_map int32)``.
    """
    check_tensor("inp", inp, dtypes=FLOAT_DTYPES, dim=2)
    device = inp.device
    _check_meta("split_sizes", split_sizes, device)
    chunks = split_sizes.numel()
    _check_meta("sorted_indices", sorted_indices, device, chunks)
    _check_meta("output_split_sizes", output_split_sizes, device, chunks)
    num_out_tokens = check_int("num_out_tokens", num_out_tokens, low=inp.shape[0], high=INT32_MAX)
    if probs is not None:
        check_tensor("probs", probs, dtypes=FLOAT_DTYPES, shape=(inp.shape[0],), device=device)
    check_backend(backend)
    name = _backend(device, backend, inp.dtype)
    row_map = _chunk_row_map(
        split_sizes, sorted_indices, output_split_sizes, num_out_tokens, inp.shape[0], name
    )
    out = _ChunkCopy.apply(kernel_input(inp, ROWS), row_map, num_out_tokens, False, name)
    out_probs = None
    if probs is not None:
        p = kernel_input(probs.unsqueeze(1), ROWS)  # [T, 1]: one element per row, any stride
        out_probs = _ChunkCopy.apply(p, row_map, num_out_tokens, False, name).view(-1)
    return out, out_probs, row_map


def moe_unpad_and_restore_chunks(
    inp: torch.Tensor,
    row_map: torch.Tensor,
    num_tokens: int,
    *,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Inverse of :func:`moe_sort_chunks_and_pad`: drop padding, restore the original order.

    ``inp`` is ``[num_padded, H']`` (``H'`` may differ from the forward ``H``); returns
    ``[num_tokens, H']`` with ``out[row_map[p]] = inp[p]``. Rows no ``row_map`` entry covers are zero;
    entries outside ``[0, num_tokens)`` write nothing; two entries naming one row leave one of the
    two inputs there (unspecified which).
    """
    check_tensor("inp", inp, dtypes=FLOAT_DTYPES, dim=2)
    device = inp.device
    check_tensor("row_map", row_map, dtypes=(torch.int32,), dim=1, device=device, contiguous=True)
    if row_map.numel() != inp.shape[0]:
        raise ValueError(f"row_map has {row_map.numel()} entries but inp has {inp.shape[0]} rows")
    num_tokens = check_int("num_tokens", num_tokens, low=0, high=INT32_MAX)
    check_backend(backend)
    name = _backend(device, backend, inp.dtype)
    return _ChunkCopy.apply(kernel_input(inp, ROWS), row_map, num_tokens, True, name)
