"""Triton launchers of the layout ops (route rows, align block size, chunk sort + pad) and the QB
bias updates. Kernel bodies: ``_layout_kernels.py``.

Every launcher is destination-passing (``amdqb.backends`` signatures), never reads device values
on the host, launches on the current stream of the tensors' device and launches nothing for an
empty input (outputs that must still be defined are filled with torch ops). Internal scratch is
``torch.empty`` (written in full before it is read) unless noted.

Launches per call (``N`` routes, ``R`` routes per program):

* ``route_rows``
  - ``lds``: zero counts + 1 [+ 1 compact fix-up]. A program takes R = max(1024, E_PAD) routes,
    builds their histogram with ``tl.histogram`` (LDS), reserves one interval per non-empty
    expert with one masked vector atomic on the counters (returns the bases), adds its accepted
    counts with a second one, and ranks routes inside the intervals by a bitonic sort of
    ``(expert << 10 | lane)`` keys (1024 per sort). Compact rows are relative slots until the
    fix-up adds ``offset[e]`` (scanned from the final counters in registers by every program).
  - ``atomic``: counter snapshot + 1 (one returning global atomic per route) + finish (counts
    from the snapshot; compact offsets when E > 4096) [+ 1 compact fix-up].
  - ``deterministic`` (either impl): 3 -- per-block histograms into a ``[NB, E_PAD]`` matrix, an
    exclusive scan over blocks (one program per 64 experts; also updates counters and counts),
    stable ranks + stores. E > 4096: zero + 3 (atomic counts, scan, sort + segmented scan).
* ``align_block_size`` -- 3: histograms + sentinel fill, per-expert block scan, then each
  program rebuilds the padded expert starts in registers, scatters its routes by stable rank and
  writes a slice of ``expert_ids`` (a histogram of cumulative block counts); E <= 4096.
* ``chunk_row_map`` -- 1 (C <= 1024 chunks: tables rebuilt in registers per program), else 2
  (prefix table + binary search); ``chunk_copy`` -- 1 (``[rows, H]`` tiles, 16-byte accesses
  when H allows).
* ``qb_recover`` / ``qb_step`` -- 2: per-expert recovery over a grid (int64 cumsums, float64
  interpolation, no FP contraction), one program to centre / mix / write the bounds.

Tuning knobs (environment, read at import): ``AMDQB_ROUTE_SUB`` (routes per sort, default 1024;
64 under the CPU interpreter), ``AMDQB_LDS_ROUTES_PER_BUCKET``, ``AMDQB_LDS_MAX_ROUTES``,
``AMDQB_ROUTE_WARPS``, ``AMDQB_DET_ROUTES``, ``AMDQB_ALIGN_ROUTES``, ``AMDQB_COPY_TILE``,
``AMDQB_COPY_WARPS``.
"""

from __future__ import annotations

import contextlib
import os
import struct

import torch
import triton

from . import _layout_kernels as K
from .codegen import KernelSpec

LDS_MAX_EXPERTS = 4096  # E_PAD <= 4096: the int32 LDS histogram stays <= 16 KiB
CHUNK_MAP_MAX_REG = 1024  # chunks handled in registers by the single-launch row map


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    return int(value) if value else default


# Launch configuration (H200 / MI3xx starting points; the benchmark overrides them through the
# environment so a sweep needs no code change).
CONFIG = {
    # routes per program of the lds path, as a multiple of E_PAD (amortises the E_PAD-wide
    # histogram sweep and the interval reservation; seed 004: cost grows with ceil(E/256))
    "lds_routes_per_bucket": _env_int("AMDQB_LDS_ROUTES_PER_BUCKET", 1),
    "lds_max_routes": _env_int("AMDQB_LDS_MAX_ROUTES", 4096),
    "route_warps": _env_int("AMDQB_ROUTE_WARPS", 8),
    "atomic_block": 1024,
    "fixup_block": 2048,
    "det_routes": _env_int("AMDQB_DET_ROUTES", 1024),
    "align_routes": _env_int("AMDQB_ALIGN_ROUTES", 1024),
    "copy_tile": _env_int("AMDQB_COPY_TILE", 8192),  # elements per chunk_copy program
    "copy_warps": _env_int("AMDQB_COPY_WARPS", 4),
    # routes per bitonic sort; the CPU interpreter runs the sort network in Python, so it uses
    # small sorts (which also exercises the multi-sub-chunk paths on tiny test inputs)
    "sub_max": _env_int("AMDQB_ROUTE_SUB", 64 if _interpreting() else 1024),
}


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _e_pad(num_experts: int) -> int:
    return max(256, _pow2(num_experts))


def _device(t: torch.Tensor):
    """Launch on ``t``'s device whatever the current device is (Triton uses the current one)."""
    if t.device.type == "cuda" and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def _blocking(n: int, routes: int) -> tuple[int, int]:
    """(SUB, NSUB): sub-chunk of at most CONFIG["sub_max"] routes, shrunk for tiny inputs."""
    sub = min(CONFIG["sub_max"], _pow2(routes), max(16, _pow2(n)))
    return sub, max(1, min(routes // sub, triton.cdiv(n, sub)))


def _tile_rows(rows: int, width: int, budget: int = 16384) -> int:
    return max(1, min(_pow2(rows), budget // width))


# ----------------------------------------------------------------------------------------------
# route_rows
# ----------------------------------------------------------------------------------------------


def _scan(hist, counters, counts, nb, num_experts, stride, cap, capacity, mode):
    """Launch ``_block_scan_kernel``: expert chunks in parallel, or one program carrying the
    cross-expert offsets (``mode == "offsets"``)."""
    single = mode == "offsets"
    ec = 1024 if single else 64
    K._block_scan_kernel[(1 if single else triton.cdiv(num_experts, ec),)](
        hist, counters, counts, nb, num_experts, stride, cap,
        EC=ec, BT=_tile_rows(nb, ec, 16384 if single else 8192),
        USE_COUNTERS=mode != "totals", CAPACITY=capacity is not None,
        WRITE_TOTAL=mode == "totals", WRITE_OFF=single, num_warps=8 if single else 4,
    )  # fmt: skip


def _route_deterministic(ids, num_experts, capacity, counters, rows, counts, n):
    cap = 0 if capacity is None else capacity
    warps = CONFIG["route_warps"]
    if num_experts > LDS_MAX_EXPERTS:
        sub = min(CONFIG["sub_max"], max(16, _pow2(n)))
        nb = triton.cdiv(n, sub)
        hist = torch.zeros(nb + 1, num_experts, dtype=torch.int32, device=ids.device)
        K._count_atomic_kernel[(nb,)](ids, hist, n, num_experts, SUB=sub, num_warps=4)
        mode = "counters" if capacity is not None else "offsets"
        _scan(hist, counters, counts, nb, num_experts, num_experts, cap, capacity, mode)
        K._assign_wide_kernel[(nb,)](
            ids, hist, rows, n, num_experts, cap, nb,
            SUB=sub, MODE=0 if capacity is not None else 1, num_warps=warps,
        )  # fmt: skip
        return
    e_pad = _e_pad(num_experts)
    sub, nsub = _blocking(n, CONFIG["det_routes"])
    nb = triton.cdiv(n, sub * nsub)
    hist = torch.empty(nb, e_pad, dtype=torch.int32, device=ids.device)
    K._block_hist_kernel[(nb,)](
        ids, hist, hist, n, num_experts, 0, 0, 0,
        SUB=sub, NSUB=nsub, E_PAD=e_pad, FILL=False, FILL_BLOCK=16, num_warps=warps,
    )  # fmt: skip
    _scan(hist, counters, counts, nb, num_experts, e_pad, cap, capacity, "counters")
    K._block_assign_kernel[(nb,)](
        ids, hist, counters, rows, n, num_experts, cap,
        SUB=sub, NSUB=nsub, LOG_SUB=sub.bit_length() - 1, E_PAD=e_pad,
        MODE=0 if capacity is not None else 1, ADD_OFF=capacity is None, num_warps=warps,
    )  # fmt: skip


def _route_fixup(ids, rows, counters, off, n, num_experts):
    block = CONFIG["fixup_block"]
    in_reg = off is None
    K._route_fixup_kernel[(triton.cdiv(n, block),)](
        ids, rows, counters, counters if in_reg else off, n, num_experts,
        BLOCK=block, E_PAD=_e_pad(num_experts) if in_reg else 16, IN_REG=in_reg, num_warps=8,
    )  # fmt: skip


def route_rows(
    topk_ids, num_experts, capacity, counters, rows_out, counts_out, deterministic, impl
):
    n = topk_ids.numel()
    if n == 0:
        return  # counts_out arrives zero-filled
    ids = topk_ids.reshape(-1)
    rows = rows_out.view(-1)
    cap = 0 if capacity is None else capacity
    with _device(ids):
        if deterministic:
            _route_deterministic(ids, num_experts, capacity, counters, rows, counts_out, n)
        elif impl == "lds":
            e_pad = _e_pad(num_experts)
            routes = min(CONFIG["lds_max_routes"], CONFIG["lds_routes_per_bucket"] * e_pad)
            sub, nsub = _blocking(n, max(routes, CONFIG["sub_max"]))
            K._route_lds_kernel[(triton.cdiv(n, sub * nsub),)](
                ids, counters, counts_out, rows, n, num_experts, cap,
                SUB=sub, NSUB=nsub, LOG_SUB=sub.bit_length() - 1, E_PAD=e_pad,
                CAPACITY=capacity is not None, num_warps=CONFIG["route_warps"],
            )  # fmt: skip
            if capacity is None:
                _route_fixup(ids, rows, counters, None, n, num_experts)
        else:
            block = CONFIG["atomic_block"]
            counts_out.copy_(counters)  # snapshot: counts = f(final, initial)
            K._route_atomic_kernel[(triton.cdiv(n, block),)](
                ids, counters, rows, n, num_experts, cap,
                BLOCK=block, CAPACITY=capacity is not None, num_warps=4,
            )  # fmt: skip
            compact = capacity is None
            wide = num_experts > LDS_MAX_EXPERTS
            off = (
                torch.empty(num_experts, dtype=torch.int32, device=ids.device)
                if compact and wide
                else counts_out
            )
            K._route_finish_kernel[(1,)](
                counters, counts_out, off, num_experts, cap,
                CHUNK=min(_pow2(num_experts), 4096), CAPACITY=not compact,
                WRITE_OFF=compact and wide, num_warps=8,
            )  # fmt: skip
            if compact:
                _route_fixup(ids, rows, counters, off if wide else None, n, num_experts)


# ----------------------------------------------------------------------------------------------
# align_block_size
# ----------------------------------------------------------------------------------------------


def _align_wide(ids, block_size, num_experts, sorted_ids, expert_ids, num_post_pad, n):
    """E > 4096: nothing E-wide in registers (atomic block counts, single-program offsets, binary
    search for expert_ids, sort + segmented-scan ranks); 7 launches."""
    sub = min(CONFIG["sub_max"], max(16, _pow2(n)))
    nb = triton.cdiv(n, sub)
    hist = torch.zeros(nb + 2, num_experts, dtype=torch.int32, device=ids.device)
    sorted_ids.fill_(n)
    K._count_atomic_kernel[(nb,)](ids, hist, n, num_experts, SUB=sub, num_warps=4)
    _scan(hist, hist, hist, nb, num_experts, num_experts, 0, None, "totals")
    K._align_offsets_wide_kernel[(1,)](
        hist, num_post_pad, nb, num_experts, block_size, CHUNK=4096, num_warps=8
    )
    n_eid = expert_ids.numel()
    bj = min(1024, _pow2(n_eid))
    K._align_expert_ids_wide_kernel[(triton.cdiv(n_eid, bj),)](
        hist[nb + 1], expert_ids, num_experts, n_eid,
        BJ=bj, STEPS=(num_experts + 1).bit_length(), num_warps=4,
    )  # fmt: skip
    K._assign_wide_kernel[(nb,)](
        ids, hist, sorted_ids, n, num_experts, 0, nb,
        SUB=sub, MODE=2, num_warps=CONFIG["route_warps"],
    )  # fmt: skip


def align_block_size(
    topk_ids, block_size, num_experts, sorted_ids_out, expert_ids_out, num_post_pad_out
):
    n = topk_ids.numel()
    if n == 0:
        sorted_ids_out.fill_(0)
        expert_ids_out.zero_()
        num_post_pad_out.zero_()
        return
    ids = topk_ids.reshape(-1)
    if num_experts > LDS_MAX_EXPERTS:
        with _device(ids):
            _align_wide(
                ids, block_size, num_experts, sorted_ids_out, expert_ids_out, num_post_pad_out, n
            )
        return
    e_pad = _e_pad(num_experts)
    sub, nsub = _blocking(n, CONFIG["align_routes"])
    nb = triton.cdiv(n, sub * nsub)
    fill_len = sorted_ids_out.numel()
    fill_block = 1024
    fill_per = triton.cdiv(triton.cdiv(fill_len, nb), fill_block) * fill_block
    warps = CONFIG["route_warps"]
    with _device(ids):
        hist = torch.empty(nb + 1, e_pad, dtype=torch.int32, device=ids.device)
        K._block_hist_kernel[(nb,)](
            ids, hist, sorted_ids_out, n, num_experts, fill_len, fill_per, n,
            SUB=sub, NSUB=nsub, E_PAD=e_pad, FILL=True, FILL_BLOCK=fill_block, num_warps=warps,
        )  # fmt: skip
        _scan(hist, hist, hist, nb, num_experts, e_pad, 0, None, "totals")
        n_eid = expert_ids_out.numel()
        jc = 256
        K._align_assign_kernel[(nb,)](
            ids, hist, sorted_ids_out, expert_ids_out, num_post_pad_out, n, num_experts, nb,
            block_size, n_eid, triton.cdiv(triton.cdiv(n_eid, nb), jc) * jc,
            SUB=sub, NSUB=nsub, LOG_SUB=sub.bit_length() - 1, E_PAD=e_pad, JC=jc,
            num_warps=warps,
        )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Chunk sort + pad
# ----------------------------------------------------------------------------------------------


def chunk_row_map(split_sizes, sorted_indices, output_split_sizes, row_map_out):
    p = row_map_out.numel()
    if p == 0:
        return
    c = split_sizes.numel()
    with _device(row_map_out):
        if c <= CHUNK_MAP_MAX_REG:
            c_pad = _pow2(c)
            bp = max(16, min(1024, 8192 // c_pad, _pow2(p)))
            K._chunk_map_kernel[(triton.cdiv(p, bp),)](
                split_sizes, sorted_indices, output_split_sizes, row_map_out, c, p,
                BP=bp, C_PAD=c_pad, num_warps=4,
            )  # fmt: skip
            return
        table = torch.empty(2 * c, dtype=torch.int64, device=row_map_out.device)
        K._chunk_prefix_kernel[(1,)](
            split_sizes, output_split_sizes, table, c, CHUNK=4096, num_warps=8
        )
        bp = min(1024, _pow2(p))
        K._chunk_map_search_kernel[(triton.cdiv(p, bp),)](
            split_sizes, sorted_indices, output_split_sizes, table, row_map_out, c, p,
            BP=bp, STEPS=(c + 1).bit_length(), num_warps=4,
        )  # fmt: skip


def _copy_tiles(rows: int, hidden: int) -> tuple[int, int]:
    bh = min(_pow2(hidden), 4096)
    br = max(1, min(CONFIG["copy_tile"] // bh, _pow2(rows)))
    return br, bh


def chunk_copy(src, row_map, dst, reverse):
    p = row_map.numel()
    hidden = 1
    for size in src.shape[1:]:
        hidden *= size
    if p == 0 or hidden == 0:
        return
    br, bh = _copy_tiles(p, hidden)
    with _device(src):
        K._chunk_copy_kernel[(triton.cdiv(p, br), triton.cdiv(hidden, bh))](
            src, row_map, dst, p, hidden, BR=br, BH=bh, REVERSE=bool(reverse),
            num_warps=CONFIG["copy_warps"],
        )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Quantile Balancing
# ----------------------------------------------------------------------------------------------


def _f64_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _qb_tiles(num_bins: int) -> tuple[int, int]:
    bb = min(_pow2(num_bins), 2048)
    return max(1, 4096 // bb), bb


def _qb(histogram, bin_bounds, topk, bias, out, ema, step):
    num_experts, num_bins = histogram.shape
    dev = histogram.device
    rows, bb = _qb_tiles(num_bins)
    rows = min(rows, _pow2(num_experts))
    with _device(histogram):
        bhat = torch.empty(num_experts, dtype=torch.float32, device=dev)
        msum = torch.empty(num_experts, dtype=torch.int64, device=dev)
        # No FP contraction: the float64 steps must round like the oracle's separate ops.
        K._qb_rows_kernel[(triton.cdiv(num_experts, rows),)](
            histogram, bin_bounds, bhat, msum, num_experts, num_bins, topk,
            ROWS=rows, BB=bb, SINGLE=num_bins <= bb, num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
        K._qb_finish_kernel[(1,)](
            bhat, msum, bias, bin_bounds, out, num_experts,
            _f64_bits(ema), _f64_bits(1.0 - ema),
            EB=min(_pow2(num_experts), 4096), STEP=step, num_warps=8, enable_fp_fusion=False,
        )  # fmt: skip


def qb_recover(histogram, bin_bounds, topk, out):
    _qb(histogram, bin_bounds, topk, out, out, 0.0, False)


def qb_step(bias, histogram, bin_bounds, topk, ema):
    _qb(histogram, bin_bounds, topk, bias, bias, float(ema), True)


OPS = {
    "route_rows": route_rows,
    "align_block_size": align_block_size,
    "chunk_row_map": chunk_row_map,
    "chunk_copy": chunk_copy,
    "qb_recover": qb_recover,
    "qb_step": qb_step,
}


def _route_unsupported(info, features):
    if features.get("impl") == "lds" and features.get("num_experts", 0) > LDS_MAX_EXPERTS:
        return f"impl='lds' supports E <= {LDS_MAX_EXPERTS} (LDS histogram), got {features['num_experts']}"
    return None


UNSUPPORTED = {"route_rows": _route_unsupported}


# ----------------------------------------------------------------------------------------------
# AMD code generation specs (op_tests/test_amd_codegen.py)
# ----------------------------------------------------------------------------------------------

_PTR = {"i32": "*i32", "i64": "*i64", "f32": "*fp32", "bf16": "*bf16", "f16": "*fp16"}


def _spec(name, fn, ptrs, constexprs, num_warps, lds=False, notes="", ints=None):
    """KernelSpec with every pointer typed from ``ptrs`` (name -> short dtype), the remaining
    runtime arguments i32 (or ``ints``), constexprs as given."""
    ints = ints or {}
    sig = {}
    for arg in fn.arg_names:
        if arg in constexprs:
            sig[arg] = "constexpr"
        elif arg in ptrs:
            sig[arg] = _PTR[ptrs[arg]]
        else:
            sig[arg] = ints.get(arg, "i32")
    return KernelSpec(name, fn, sig, constexprs, num_warps, lds, notes)


def codegen_specs() -> list:
    """Every layout / QB kernel at the constexprs its launcher uses for the seed shapes
    (E=896 -> E_PAD=1024, E=4096, k=16, block 64, H=2048 bf16, B=1000)."""
    ids = {"ids_ptr": "i32"}
    i32 = lambda *names: {n: "i32" for n in names}  # noqa: E731
    route = dict(SUB=1024, LOG_SUB=10)
    specs = [
        _spec(
            "route_lds_capacity_e896", K._route_lds_kernel,
            {**ids, **i32("counters_ptr", "counts_ptr", "rows_ptr")},
            dict(route, NSUB=1, E_PAD=1024, CAPACITY=True), 8, lds=True,
            notes="lds route: LDS histogram + one interval atomic per non-empty expert",
        ),
        _spec(
            "route_lds_compact_e4096", K._route_lds_kernel,
            {"ids_ptr": "i64", **i32("counters_ptr", "counts_ptr", "rows_ptr")},
            dict(route, NSUB=4, E_PAD=4096, CAPACITY=False), 8, lds=True,
        ),
        _spec(
            "route_atomic", K._route_atomic_kernel, {**ids, **i32("counters_ptr", "rows_ptr")},
            dict(BLOCK=1024, CAPACITY=True), 4,
        ),
        _spec(
            "route_finish", K._route_finish_kernel, i32("counters_ptr", "counts_ptr", "off_ptr"),
            dict(CHUNK=1024, CAPACITY=False, WRITE_OFF=True), 8,
        ),
        _spec(
            "route_fixup_inreg_e896", K._route_fixup_kernel,
            {**ids, **i32("rows_ptr", "counters_ptr", "off_ptr")},
            dict(BLOCK=2048, E_PAD=1024, IN_REG=True), 8,
        ),
        _spec(
            "block_hist_align_fill_e896", K._block_hist_kernel,
            {**ids, **i32("hist_ptr", "fill_ptr")},
            dict(SUB=1024, NSUB=1, E_PAD=1024, FILL=True, FILL_BLOCK=1024), 8, lds=True,
        ),
        _spec(
            "align_assign_e896", K._align_assign_kernel,
            {**ids, **i32("hist_ptr", "sorted_ptr", "expert_ids_ptr", "post_pad_ptr")},
            dict(route, NSUB=1, E_PAD=1024, JC=256), 8, lds=True,
            notes="stable ranks + scatter; expert_ids via a histogram of cumulative block counts",
        ),
        _spec(
            "block_assign_compact_e4096", K._block_assign_kernel,
            {"ids_ptr": "i64", **i32("hist_ptr", "counters_ptr", "out_ptr")},
            dict(route, NSUB=1, E_PAD=4096, MODE=1, ADD_OFF=True), 8, lds=True,
        ),
        _spec(
            "block_scan_parallel", K._block_scan_kernel,
            i32("hist_ptr", "counters_ptr", "counts_ptr"),
            dict(EC=64, BT=128, USE_COUNTERS=True, CAPACITY=True, WRITE_TOTAL=False,
                 WRITE_OFF=False), 4,
        ),
        _spec(
            "block_scan_offsets", K._block_scan_kernel,
            i32("hist_ptr", "counters_ptr", "counts_ptr"),
            dict(EC=1024, BT=16, USE_COUNTERS=True, CAPACITY=False, WRITE_TOTAL=False,
                 WRITE_OFF=True), 8,
        ),
        _spec(
            "count_atomic_wide", K._count_atomic_kernel, {**ids, "hist_ptr": "i32"},
            dict(SUB=1024), 4,
        ),
        _spec(
            "assign_wide_align", K._assign_wide_kernel,
            {**ids, **i32("hist_ptr", "out_ptr")}, dict(SUB=1024, MODE=2), 8,
        ),
        _spec(
            "align_offsets_wide", K._align_offsets_wide_kernel,
            i32("hist_ptr", "post_pad_ptr"), dict(CHUNK=4096), 8,
        ),
        _spec(
            "align_expert_ids_wide", K._align_expert_ids_wide_kernel,
            i32("cum_ptr", "expert_ids_ptr"), dict(BJ=1024, STEPS=14), 4,
        ),
        _spec(
            "chunk_map_c128", K._chunk_map_kernel,
            {"sizes_ptr": "i64", "order_ptr": "i64", "out_sizes_ptr": "i64", "map_ptr": "i32"},
            dict(BP=64, C_PAD=128), 4,
        ),
        _spec(
            "chunk_prefix", K._chunk_prefix_kernel,
            {"sizes_ptr": "i32", "out_sizes_ptr": "i32", "table_ptr": "i64"}, dict(CHUNK=4096), 8,
        ),
        _spec(
            "chunk_map_search", K._chunk_map_search_kernel,
            {**i32("sizes_ptr", "order_ptr", "out_sizes_ptr", "map_ptr"), "table_ptr": "i64"},
            dict(BP=1024, STEPS=13), 4,
        ),
        _spec(
            "chunk_copy_fwd_bf16_h2048", K._chunk_copy_kernel,
            {"src_ptr": "bf16", "map_ptr": "i32", "dst_ptr": "bf16"},
            dict(BR=4, BH=2048, REVERSE=False), 4,
        ),
        _spec(
            "chunk_copy_rev_f32_h1", K._chunk_copy_kernel,
            {"src_ptr": "f32", "map_ptr": "i32", "dst_ptr": "f32"},
            dict(BR=8192, BH=1, REVERSE=True), 4,
        ),
        _spec(
            "qb_rows_b1000", K._qb_rows_kernel,
            {"hist_ptr": "i32", "bounds_ptr": "f32", "bhat_ptr": "f32", "msum_ptr": "i64"},
            dict(ROWS=4, BB=1024, SINGLE=True), 4,
        ),
        _spec(
            "qb_rows_chunked", K._qb_rows_kernel,
            {"hist_ptr": "i64", "bounds_ptr": "f32", "bhat_ptr": "f32", "msum_ptr": "i64"},
            dict(ROWS=2, BB=2048, SINGLE=False), 4,
        ),
        _spec(
            "qb_finish_step_e896", K._qb_finish_kernel,
            {"bhat_ptr": "f32", "msum_ptr": "i64", "bias_ptr": "f32", "bounds_ptr": "f32",
             "out_ptr": "f32"},
            dict(EB=1024, STEP=True), 8, ints={"ema_bits": "i64", "keep_bits": "i64"},
        ),
    ]  # fmt: skip
    return specs
