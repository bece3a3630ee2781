"""Triton launchers of the layout ops: route rows and vLLM's ``moe_align_block_size``. Kernel
bodies: ``_layout_kernels.py``; launch shapes: the ``triton.route.*`` entries of ``amdqb/configs``.

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
"""

from __future__ import annotations

import torch
import triton

from ...devices import arch_config
from .. import _serving
from ..calls import LDS_ROUTE_MAX_EXPERTS, AlignCall, RouteRowsRequest
from . import _layout_kernels as K
from ._common import on_device, pow2


def _e_pad(num_experts: int) -> int:
    return max(256, pow2(num_experts))


def _blocking(n: int, routes: int, cfg) -> tuple[int, int]:
    """(SUB, NSUB): sub-chunk of at most ``triton.route.sort_routes`` routes, shrunk for tiny
    inputs."""
    sub = min(cfg["triton.route.sort_routes"], pow2(routes), max(16, pow2(n)))
    return sub, max(1, min(routes // sub, triton.cdiv(n, sub)))


def _tile_rows(rows: int, width: int, budget: int = 16384) -> int:
    return max(1, min(pow2(rows), budget // width))


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


def _route_deterministic(ids, num_experts, capacity, counters, rows, counts, n, cfg):
    cap = 0 if capacity is None else capacity
    warps = cfg["triton.route.warps"]
    if num_experts > LDS_ROUTE_MAX_EXPERTS:
        sub = min(cfg["triton.route.sort_routes"], max(16, pow2(n)))
        nb = triton.cdiv(n, sub)
        hist = torch.zeros(nb + 1, num_experts, dtype=torch.int32, device=ids.device)
        K._count_atomic_kernel[(nb,)](ids, hist, n, num_experts, SUB=sub, num_warps=4)
        mode = "counters" if capacity is not None else "offsets"
        _scan(hist, counters, counts, nb, num_experts, num_experts, cap, capacity, mode)
        K._assign_wide_kernel[(nb,)](
            ids, hist, rows, counters, counts, n, num_experts, cap, nb,
            SUB=sub, MODE=0 if capacity is not None else 1, num_warps=warps,
        )  # fmt: skip
        return
    e_pad = _e_pad(num_experts)
    sub, nsub = _blocking(n, cfg["triton.route.det_routes"], cfg)
    nb = triton.cdiv(n, sub * nsub)
    hist = torch.empty(nb, e_pad, dtype=torch.int32, device=ids.device)
    K._block_hist_kernel[(nb,)](
        ids, hist, hist, n, num_experts, 0, 0, 0,
        SUB=sub, NSUB=nsub, E_PAD=e_pad, FILL=False, FILL_BLOCK=16, num_warps=warps,
    )  # fmt: skip
    _scan(hist, counters, counts, nb, num_experts, e_pad, cap, capacity, "counters")
    K._block_assign_kernel[(nb,)](
        ids, hist, counters, counts, rows, n, num_experts, cap,
        SUB=sub, NSUB=nsub, LOG_SUB=sub.bit_length() - 1, E_PAD=e_pad,
        MODE=0 if capacity is not None else 3, num_warps=warps,
    )  # fmt: skip


def _route_fixup(ids, rows, counters, counts, off, n, num_experts, cfg):
    block = cfg["triton.route.fixup_block"]
    in_reg = off is None
    K._route_fixup_kernel[(triton.cdiv(n, block),)](
        ids, rows, counters, counts, counters if in_reg else off, n, num_experts,
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
    cfg = arch_config(ids.device)
    with on_device(ids):
        if deterministic:
            _route_deterministic(ids, num_experts, capacity, counters, rows, counts_out, n, cfg)
        elif impl == "lds":
            e_pad = _e_pad(num_experts)
            routes = min(
                cfg["triton.route.lds_max_routes"],
                cfg["triton.route.lds_routes_per_bucket"] * e_pad,
            )
            sub, nsub = _blocking(n, max(routes, cfg["triton.route.sort_routes"]), cfg)
            K._route_lds_kernel[(triton.cdiv(n, sub * nsub),)](
                ids, counters, counts_out, rows, n, num_experts, cap,
                SUB=sub, NSUB=nsub, LOG_SUB=sub.bit_length() - 1, E_PAD=e_pad,
                CAPACITY=capacity is not None, num_warps=cfg["triton.route.warps"],
            )  # fmt: skip
            if capacity is None:
                _route_fixup(ids, rows, counters, counts_out, None, n, num_experts, cfg)
        else:
            block = cfg["triton.route.atomic_block"]
            counts_out.copy_(counters)  # snapshot: counts = f(final, initial)
            K._route_atomic_kernel[(triton.cdiv(n, block),)](
                ids, counters, rows, n, num_experts, cap,
                BLOCK=block, CAPACITY=capacity is not None, num_warps=4,
            )  # fmt: skip
            compact = capacity is None
            wide = num_experts > LDS_ROUTE_MAX_EXPERTS
            off = (
                torch.empty(num_experts, dtype=torch.int32, device=ids.device)
                if compact and wide
                else counts_out
            )
            K._route_finish_kernel[(1,)](
                counters, counts_out, off, num_experts, cap,
                CHUNK=min(pow2(num_experts), 4096), CAPACITY=not compact,
                WRITE_OFF=compact and wide, num_warps=8,
            )  # fmt: skip
            if compact:
                _route_fixup(
                    ids, rows, counters, counts_out, off if wide else None, n, num_experts, cfg
                )


# ----------------------------------------------------------------------------------------------
# align_block_size
# ----------------------------------------------------------------------------------------------


def _align_wide(
    ids, block_size, num_experts, sorted_ids, expert_ids, num_post_pad, n, cfg, fill=True
):
    """E > 4096: nothing E-wide in registers (atomic block counts, single-program offsets, binary
    search for expert_ids, sort + segmented-scan ranks); 7 launches."""
    sub = min(cfg["triton.route.sort_routes"], max(16, pow2(n)))
    nb = triton.cdiv(n, sub)
    hist = torch.zeros(nb + 2, num_experts, dtype=torch.int32, device=ids.device)
    if fill:
        sorted_ids.fill_(n)
    K._count_atomic_kernel[(nb,)](ids, hist, n, num_experts, SUB=sub, num_warps=4)
    _scan(hist, hist, hist, nb, num_experts, num_experts, 0, None, "totals")
    K._align_offsets_wide_kernel[(1,)](
        hist, num_post_pad, nb, num_experts, block_size, CHUNK=4096, num_warps=8
    )
    n_eid = expert_ids.numel()
    bj = min(1024, pow2(n_eid))
    K._align_expert_ids_wide_kernel[(triton.cdiv(n_eid, bj),)](
        hist[nb + 1], expert_ids, num_experts, n_eid,
        BJ=bj, STEPS=(num_experts + 1).bit_length(), num_warps=4,
    )  # fmt: skip
    K._assign_wide_kernel[(nb,)](
        ids, hist, sorted_ids, hist, hist, n, num_experts, 0, nb,
        SUB=sub, MODE=2, num_warps=cfg["triton.route.warps"],
    )  # fmt: skip


def align_block_size(
    call: AlignCall, topk_ids, expert_map, sorted_ids_out, expert_ids_out, num_post_pad_out
):
    ids = _serving.align_buckets(call, topk_ids, expert_map)
    _align_block_size(
        ids,
        call.block_size,
        call.num_experts,
        sorted_ids_out,
        expert_ids_out,
        num_post_pad_out,
        call.fill_sentinel,
    )
    _serving.align_finish(call, expert_map, expert_ids_out, num_post_pad_out)


def _align_block_size(
    topk_ids, block_size, num_experts, sorted_ids_out, expert_ids_out, num_post_pad_out, fill=True
):
    n = topk_ids.numel()
    if n == 0:
        if fill:
            sorted_ids_out.fill_(0)
        expert_ids_out.zero_()
        num_post_pad_out.zero_()
        return
    ids = topk_ids.reshape(-1)
    cfg = arch_config(ids.device)
    if num_experts > LDS_ROUTE_MAX_EXPERTS:
        with on_device(ids):
            _align_wide(
                ids,
                block_size,
                num_experts,
                sorted_ids_out,
                expert_ids_out,
                num_post_pad_out,
                n,
                cfg,
                fill,
            )
        return
    e_pad = _e_pad(num_experts)
    sub, nsub = _blocking(n, cfg["triton.route.align_routes"], cfg)
    nb = triton.cdiv(n, sub * nsub)
    fill_len = sorted_ids_out.numel()
    fill_block = 1024
    fill_per = triton.cdiv(triton.cdiv(fill_len, nb), fill_block) * fill_block
    warps = cfg["triton.route.warps"]
    with on_device(ids):
        hist = torch.empty(nb + 1, e_pad, dtype=torch.int32, device=ids.device)
        K._block_hist_kernel[(nb,)](
            ids, hist, sorted_ids_out, n, num_experts, fill_len, fill_per, n,
            SUB=sub, NSUB=nsub, E_PAD=e_pad, FILL=fill, FILL_BLOCK=fill_block, num_warps=warps,
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


OPS = {"route_rows": route_rows, "align_block_size": align_block_size}


def route_rows_limits(info, request: RouteRowsRequest) -> str | None:
    """A capability check of the dispatcher's: a reason passes this backend over."""
    if request.impl == "lds" and request.num_experts > LDS_ROUTE_MAX_EXPERTS:
        return (
            f"impl='lds' supports E <= {LDS_ROUTE_MAX_EXPERTS} (LDS histogram), got "
            f"{request.num_experts}"
        )
    return None


LIMITS = {"route_rows": route_rows_limits}
