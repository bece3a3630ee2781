"""Triton launchers of the fused chunk sort + pad and its inverse (TE PR #3509 semantics).
Kernel bodies: ``_chunk_kernels.py``.

* ``chunk_row_map`` -- 1 launch (C <= 1024 chunks: tables rebuilt in registers per program), else
  2 (prefix table + binary search);
* ``chunk_copy`` -- 1 launch (``[rows, H]`` tiles, 16-byte accesses when H allows; tile size from
  the ``triton.chunks.*`` config entries). The source is read through its row stride (a 2-D
  view with unit-stride rows: a slice of a wider buffer is not copied first).

Copies are exact; element offsets are 64-bit. Nothing reads device metadata on the host. Any
metadata value is memory-safe (outcomes in ``amdqb.ref.chunks``): the row map never names a row
outside the input, and the copy checks every ``row_map`` entry against the rows it indexes.
"""

from __future__ import annotations

import torch
import triton

from ...devices import arch_config
from . import _chunk_kernels as K
from ._common import on_device, pow2, row_stride

CHUNK_MAP_MAX_REG = 1024  # chunks handled in registers by the single-launch row map


def chunk_row_map(split_sizes, sorted_indices, output_split_sizes, row_map_out, num_in_tokens):
    p = row_map_out.numel()
    if p == 0:
        return
    c = split_sizes.numel()
    with on_device(row_map_out):
        if c <= CHUNK_MAP_MAX_REG:
            c_pad = pow2(c)
            bp = max(16, min(1024, 8192 // c_pad, pow2(p)))
            K._chunk_map_kernel[(triton.cdiv(p, bp),)](
                split_sizes, sorted_indices, output_split_sizes, row_map_out, c, p, num_in_tokens,
                BP=bp, C_PAD=c_pad, num_warps=4,
            )  # fmt: skip
            return
        table = torch.empty(2 * c, dtype=torch.int64, device=row_map_out.device)
        K._chunk_prefix_kernel[(1,)](
            split_sizes, output_split_sizes, table, c, CHUNK=4096, num_warps=8
        )
        bp = min(1024, pow2(p))
        K._chunk_map_search_kernel[(triton.cdiv(p, bp),)](
            split_sizes, sorted_indices, output_split_sizes, table, row_map_out, c, p,
            num_in_tokens, BP=bp, STEPS=(c + 1).bit_length(), num_warps=4,
        )  # fmt: skip


def _copy_tiles(rows: int, hidden: int, cfg) -> tuple[int, int]:
    bh = min(pow2(hidden), 4096)
    br = max(1, min(cfg["triton.chunks.copy_tile"] // bh, pow2(rows)))
    return br, bh


def chunk_copy(src, row_map, dst, reverse):
    p = row_map.numel()
    hidden = src.shape[1]
    if p == 0 or hidden == 0:
        return
    cfg = arch_config(src.device)
    br, bh = _copy_tiles(p, hidden, cfg)
    with on_device(src):
        K._chunk_copy_kernel[(triton.cdiv(p, br), triton.cdiv(hidden, bh))](
            src, row_map, dst, p, hidden, (dst if reverse else src).shape[0], row_stride(src),
            BR=br, BH=bh, REVERSE=bool(reverse),
            num_warps=cfg["triton.chunks.copy_warps"],
        )  # fmt: skip


OPS = {"chunk_row_map": chunk_row_map, "chunk_copy": chunk_copy}
