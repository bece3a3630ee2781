"""``@triton.jit`` bodies of the chunk sort + pad kernels (launchers in ``chunks.py``).

Offsets into ``[rows, H]`` tensors are int64 (``rows * H`` may pass 2^31); nothing here reads
device values on the host.

Memory safety for any metadata (``amdqb.ref.chunks`` states the outcomes): sizes are clamped to
``[0, 2^31 - 1]`` on load, a ``sorted_indices`` entry outside ``[0, C)`` names no chunk (all
padding), a source row past the input's ``N_IN`` rows is not mapped, and the copy kernel touches a
row of ``row_map`` only when it lies in ``[0, NROWS)`` of the tensor it indexes.
"""

from __future__ import annotations

import triton
import triton.language as tl

# ----------------------------------------------------------------------------------------------
# Chunk sort + pad
# ----------------------------------------------------------------------------------------------


@triton.jit
def _load_sizes(ptr, idx, mask):
    """Chunk sizes as int64 clamped to ``[0, 2^31 - 1]``: monotone, exact cumulative sums."""
    v = tl.load(ptr + idx, mask=mask, other=0).to(tl.int64)
    return tl.minimum(tl.maximum(v, 0), 2147483647)


@triton.jit
def _chunk_map_kernel(
    sizes_ptr,
    order_ptr,
    out_sizes_ptr,
    map_ptr,
    C,
    P,
    N_IN,
    BP: tl.constexpr,
    C_PAD: tl.constexpr,
):
    """Row map for C <= C_PAD chunks: every program rebuilds the chunk table in registers
    (int64 cumsums) and finds each row's output chunk by counting chunk ends <= row."""
    ci = tl.arange(0, C_PAD)
    cm = ci < C
    sizes = _load_sizes(sizes_ptr, ci, cm)
    osz = _load_sizes(out_sizes_ptr, ci, cm)
    raw = tl.load(order_ptr + ci, mask=cm, other=0).to(tl.int64)
    named = (raw >= 0) & (raw < C)
    order = tl.where(named, raw, 0).to(tl.int32)
    in_start = tl.cumsum(sizes, 0) - sizes
    out_end = tl.cumsum(osz, 0)
    out_start = out_end - osz
    src_start = tl.gather(in_start, order, 0)
    src_size = tl.where(named, tl.gather(sizes, order, 0), 0)  # an unnamed chunk: all padding
    p = tl.program_id(0).to(tl.int64) * BP + tl.arange(0, BP)
    below = (out_end[None, :] <= p[:, None]) & cm[None, :]
    chunk = tl.sum(below.to(tl.int32), 1)
    cc = tl.minimum(chunk, C_PAD - 1)
    off = p - tl.gather(out_start, cc, 0)
    row = tl.gather(src_start, cc, 0) + off
    copy = (chunk < C) & (off < tl.gather(src_size, cc, 0)) & (row < N_IN)
    tl.store(map_ptr + p, tl.where(copy, row, -1).to(tl.int32), mask=p < P)


@triton.jit
def _chunk_prefix_kernel(sizes_ptr, out_sizes_ptr, table_ptr, C, CHUNK: tl.constexpr):
    """Single program, any C: ``table[0] = exclusive cumsum(split_sizes)``,
    ``table[1] = inclusive cumsum(output_split_sizes)`` (int64)."""
    c_in = tl.zeros([], dtype=tl.int64)
    c_out = tl.zeros([], dtype=tl.int64)
    for c0 in range(0, C, CHUNK):
        idx = c0 + tl.arange(0, CHUNK)
        m = idx < C
        s = _load_sizes(sizes_ptr, idx, m)
        o = _load_sizes(out_sizes_ptr, idx, m)
        tl.store(table_ptr + idx, c_in + tl.cumsum(s, 0) - s, mask=m)
        tl.store(table_ptr + C + idx, c_out + tl.cumsum(o, 0), mask=m)
        c_in += tl.sum(s, 0)
        c_out += tl.sum(o, 0)


@triton.jit
def _chunk_map_search_kernel(
    sizes_ptr,
    order_ptr,
    out_sizes_ptr,
    table_ptr,
    map_ptr,
    C,
    P,
    N_IN,
    BP: tl.constexpr,
    STEPS: tl.constexpr,
):
    """Row map for any C: binary search of each row in the inclusive output ends."""
    p = tl.program_id(0).to(tl.int64) * BP + tl.arange(0, BP)
    lo = tl.zeros([BP], dtype=tl.int32)
    hi = tl.zeros([BP], dtype=tl.int32) + C
    for _ in range(STEPS):
        mid = (lo + hi) // 2
        act = lo < hi
        end = tl.load(table_ptr + C + mid, mask=act, other=0)
        go_right = act & (end <= p)
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(act & (end > p), mid, hi)
    chunk = lo
    inside = chunk < C
    cc = tl.minimum(chunk, C - 1)
    o_end = tl.load(table_ptr + C + cc)
    o_size = _load_sizes(out_sizes_ptr, cc, cc >= 0)
    raw = tl.load(order_ptr + cc).to(tl.int64)
    named = (raw >= 0) & (raw < C)
    src = tl.where(named, raw, 0).to(tl.int32)
    off = p - (o_end - o_size)
    row = tl.load(table_ptr + src) + off
    copy = inside & named & (off < _load_sizes(sizes_ptr, src, named)) & (row < N_IN)
    tl.store(map_ptr + p, tl.where(copy, row, -1).to(tl.int32), mask=p < P)


@triton.jit
def _chunk_copy_kernel(
    src_ptr,
    map_ptr,
    dst_ptr,
    P,
    H,
    NROWS,
    SRC_STRIDE,
    BR: tl.constexpr,
    BH: tl.constexpr,
    REVERSE: tl.constexpr,
):
    """Row gather (forward: ``dst[p] = src[map[p]]`` or 0) / scatter (reverse: ``dst[map[p]] =
    src[p]``) of ``[BR, BH]`` tiles; int64 element offsets, contiguous rows -> wide accesses.
    ``NROWS``: rows of the tensor ``map`` indexes (src forward, dst reverse); an entry outside
    ``[0, NROWS)`` is a zero row forward and no write in reverse. ``src`` rows are
    ``SRC_STRIDE`` elements apart (any row stride of a view with unit-stride rows), ``dst`` is
    contiguous."""
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    rm = r < P
    m = tl.load(map_ptr + r, mask=rm, other=-1)
    valid = (m >= 0) & (m < NROWS)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    cm = (cols < H)[None, :]
    mrow = tl.where(valid, m, 0).to(tl.int64)
    if REVERSE:
        msk = valid[:, None] & cm
        x = tl.load(src_ptr + (r * SRC_STRIDE)[:, None] + cols[None, :], mask=msk)
        tl.store(dst_ptr + (mrow * H)[:, None] + cols[None, :], x, mask=msk)
    else:
        src_off = (mrow * SRC_STRIDE)[:, None] + cols[None, :]
        x = tl.load(src_ptr + src_off, mask=valid[:, None] & cm, other=0)
        tl.store(dst_ptr + (r * H)[:, None] + cols[None, :], x, mask=rm[:, None] & cm)
