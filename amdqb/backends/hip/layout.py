"""hip launchers of the layout ops: route rows and vLLM's ``moe_align_block_size``
(``hip_src/kernels/layout.hip``; signatures of ``amdqb.backends``).

Contract (``amdqb.ref.layout``): ids outside ``[0, E)`` are dropped; each valid route claims a
unique slot ``counters[e] + rank``; counts exact, rows a bijection onto each expert's slots; the
order inside an expert is unspecified (any atomic interleaving) unless ``deterministic=True``
(ascending flat route index, bitwise reproducible).

Launch shapes come from the ``hip.route.*`` entries of the device's config, the same entries that
build the module's ``-D`` constants (``_spec.layout_module``).

The scan and rank passes of the deterministic kernels may go out as dependents of the pass before
(``rt.launch_dependent``: NVIDIA's programmatic dependent launch, an ordinary launch elsewhere):
they start during the previous pass's tail, and the rank passes load their ids before they wait
for the scan. The rank pass does so only while its tiles fill at most
``hip.route.det_dependent_max_tiles_per_cu`` of the CUs: its blocks are placed while the scan still
runs, and with a tile per CU some CUs got two (the serial ranking walk doubled).
"""

from __future__ import annotations

import torch

from ..calls import AlignRequest, RouteRowsRequest
from . import _spec
from ._common import _STATIC_LDS_LIMIT, cdiv, config, dev, ptr
from ._spec import arg_i32, arg_i64

# Capability limits (declared in LIMITS below: the dispatcher passes this backend over beyond them).
MAX_DET_EXPERTS = 12288  # deterministic route kernels keep E ints in LDS
MAX_ALIGN_EXPERTS = 4096  # the align rank kernel keeps (warps + 1) * E + tile ints in LDS


def _id_suffix(topk_ids) -> str:
    """Kernel-name suffix of the route kernels instantiated for the ids' dtype."""
    return "i32" if topk_ids.dtype == torch.int32 else "i64"


def _det_launch(rt, cfg, tiles=None, device=None):
    """The launch of a scan (``tiles`` None) or rank pass (over ``tiles`` tiles)."""
    if not cfg["hip.route.det_dependent_launch"]:
        return rt.launch
    share = cfg["hip.route.det_dependent_max_tiles_per_cu"]
    if tiles is not None and tiles > share * rt.num_cus(device):
        return rt.launch
    return rt.launch_dependent


def _tile_slot_bases(rt, cfg, topk_ids, num_experts, start, totals, fill=None):
    """Passes 1-2 of the deterministic kernels: per-tile histograms, then each tile's first slot
    per expert (exclusive scan over the tiles from ``start``, or 0; ``totals`` gets the ends).
    ``fill=(buffer, value)``: pass 1 also writes ``value`` over ``buffer``. Returns
    ``(tiles, tile_slots int32 [tiles * E])``."""
    n = topk_ids.numel()
    device = dev(topk_ids)
    spec = _spec.layout_module(cfg)
    suffix = _id_suffix(topk_ids)
    e_arg = arg_i32(num_experts)
    tiles = cdiv(n, _spec.det_tile(cfg))
    tile_counts = torch.empty(tiles * num_experts, dtype=torch.int32, device=topk_ids.device)
    fill_args = (
        [ptr(None), arg_i64(0), arg_i32(0)]
        if fill is None
        else [ptr(fill[0]), arg_i64(fill[0].numel()), arg_i32(fill[1])]
    )
    k = rt.kernel(device, spec, f"amdqb_route_det_hist_{suffix}")
    rt.launch(
        k,
        tiles,
        256,
        4 * num_experts,
        [ptr(topk_ids), arg_i64(n), e_arg, ptr(tile_counts), *fill_args],
    )
    k = rt.kernel(device, spec, "amdqb_route_det_scan")
    _det_launch(rt, cfg)(
        k,
        cdiv(num_experts, cfg["hip.route.scan_experts"]),
        256,
        0,
        [arg_i32(tiles), e_arg, ptr(tile_counts), ptr(start), ptr(totals)],
    )
    return tiles, tile_counts


def route_rows(
    rt, topk_ids, num_experts, capacity, counters, rows_out, counts_out, deterministic, impl
):
    n = topk_ids.numel()
    if n == 0:
        return  # counts_out arrives zero-filled; counters and rows are unchanged / empty
    cfg = config(topk_ids)
    device = dev(topk_ids)
    spec = _spec.layout_module(cfg)
    suffix = _id_suffix(topk_ids)
    cap = -1 if capacity is None else int(capacity)
    e_arg = arg_i32(num_experts)
    ids, n_arg = ptr(topk_ids), arg_i64(n)
    lds = impl == "lds" and not deterministic
    # counts: the lds kernel adds them up itself; the others derive them from the counter delta
    before = None if lds else counters.clone()
    if deterministic:
        tiles, tile_counts = _tile_slot_bases(rt, cfg, topk_ids, num_experts, counters, counters)
        k = rt.kernel(device, spec, f"amdqb_route_det_rank_{suffix}")
        _det_launch(rt, cfg, tiles, device)(
            k,
            tiles,
            32,
            4 * num_experts,
            [ids, n_arg, e_arg, arg_i32(cap), ptr(tile_counts), ptr(rows_out)],
        )
    elif lds:
        block = cfg["hip.route.lds_block"]
        k = rt.kernel(device, spec, f"amdqb_route_lds_{suffix}")
        rt.launch(
            k,
            cdiv(n, block * cfg["hip.route.lds_items"]),
            block,
            4 * num_experts,
            [ids, n_arg, e_arg, arg_i32(cap), ptr(counters), ptr(counts_out), ptr(rows_out)],
        )
    else:
        grid = min(cdiv(n, 256), rt.num_cus(device) * cfg["hip.route.atomic_blocks_per_cu"])
        k = rt.kernel(device, spec, f"amdqb_route_atomic_{suffix}")
        rt.launch(k, grid, 256, 0, [ids, n_arg, e_arg, arg_i32(cap), ptr(counters), ptr(rows_out)])
    if capacity is not None and lds:
        return  # masked lds: rows and counts are complete
    offsets = None
    if capacity is None:
        offsets = torch.empty(num_experts, dtype=torch.int32, device=topk_ids.device)
    k = rt.kernel(device, spec, "amdqb_route_finalize")
    if offsets is None:  # masked layout: counts only, elementwise over a grid
        grid, block = max(1, cdiv(num_experts, 256)), 256
    else:  # compact layout: one block scans the counters into offsets
        grid, block = 1, 1024 if num_experts > 4096 else 256
    rt.launch(
        k,
        grid,
        block,
        0,
        [e_arg, arg_i32(cap), ptr(before), ptr(counters), ptr(counts_out), ptr(offsets)],
    )
    if capacity is None:
        grid = min(cdiv(n, 256), rt.num_cus(device) * cfg["hip.route.atomic_blocks_per_cu"])
        k = rt.kernel(device, spec, f"amdqb_route_compact_{suffix}")
        rt.launch(
            k,
            grid,
            256,
            0,
            [
                ptr(topk_ids),
                arg_i64(n),
                e_arg,
                ptr(offsets),
                ptr(counters),
                ptr(counts_out),
                ptr(rows_out),
            ],
        )


def align_warps(num_experts: int, cfg) -> int:
    """Logical warps per tile of the align rank kernel: the most (<= 8, a power of two) whose
    per-warp slot rows fit the LDS of a launch without an opt-in."""
    warps = 8
    while warps > 1 and align_smem(num_experts, warps, cfg) + 128 > _STATIC_LDS_LIMIT:
        warps //= 2
    return warps


def align_smem(num_experts: int, warps: int, cfg) -> int:
    """Dynamic LDS bytes of the align rank kernel: starts, per-warp slots, the tile's experts."""
    return 4 * ((warps + 1) * num_experts + _spec.det_tile(cfg))


def align_block_size(
    rt, topk_ids, block_size, num_experts, sorted_ids_out, expert_ids_out, num_post_pad_out
):
    n = topk_ids.numel()
    if n == 0:
        sorted_ids_out.fill_(0)  # the sentinel is numel = 0
        expert_ids_out.zero_()
        num_post_pad_out.zero_()
        return
    if num_experts > MAX_ALIGN_EXPERTS:
        raise ValueError(
            f"hip align supports num_experts <= {MAX_ALIGN_EXPERTS}, got {num_experts}"
        )
    cfg = config(topk_ids)
    device = dev(topk_ids)
    spec = _spec.layout_module(cfg)
    suffix = _id_suffix(topk_ids)
    ids, n_arg, e_arg = ptr(topk_ids), arg_i64(n), arg_i32(num_experts)
    totals = torch.empty(num_experts, dtype=torch.int32, device=topk_ids.device)
    tiles, tile_counts = _tile_slot_bases(
        rt, cfg, topk_ids, num_experts, None, totals, fill=(sorted_ids_out, n)
    )
    warps = align_warps(num_experts, cfg)
    k = rt.kernel(device, spec, f"amdqb_align_rank_{suffix}")
    _det_launch(rt, cfg, tiles, device)(
        k,
        tiles,
        32 * warps,
        align_smem(num_experts, warps, cfg),
        [
            ids,
            n_arg,
            e_arg,
            arg_i32(block_size),
            ptr(tile_counts),
            ptr(totals),
            ptr(sorted_ids_out),
            ptr(expert_ids_out),
            arg_i32(expert_ids_out.numel()),
            ptr(num_post_pad_out),
        ],
    )


# ------------------------------------------------------------------------------------------------
# Capability checks (the dispatcher's: a reason passes this backend over, the next one runs)
# ------------------------------------------------------------------------------------------------
def route_rows_limits(info, request: RouteRowsRequest) -> str | None:
    if request.deterministic and request.num_experts > MAX_DET_EXPERTS:
        return (
            f"deterministic routes with num_experts={request.num_experts} > {MAX_DET_EXPERTS} "
            "(the kernels keep E counters in LDS)"
        )
    return None


def align_block_size_limits(info, request: AlignRequest) -> str | None:
    if request.num_experts > MAX_ALIGN_EXPERTS:
        return f"align with num_experts={request.num_experts} > {MAX_ALIGN_EXPERTS} (LDS rows)"
    return None


LIMITS = {"route_rows": route_rows_limits, "align_block_size": align_block_size_limits}
