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

import ctypes
import math
from dataclasses import dataclass

import torch

from ..calls import AlignCall, RouteRowsRequest
from . import _spec
from ._common import _STATIC_LDS_LIMIT, cdiv, config, dev, ptr
from ._spec import arg_i32, arg_i64

# Capability limits (declared in LIMITS below: the dispatcher passes this backend over beyond them).
MAX_DET_EXPERTS = 12288  # deterministic route kernels keep E ints in LDS
MAX_ALIGN_EXPERTS = 4096  # the align kernel keeps (1 + warps) * E ints in LDS


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


def _tile_slot_bases(rt, cfg, topk_ids, num_experts, start, totals):
    """Passes 1-2 of the deterministic kernels: per-tile histograms, then each tile's first slot
    per expert (exclusive scan over the tiles from ``start``, or 0; ``totals`` gets the ends).
    Returns ``(tiles, tile_slots int32 [tiles * E])``."""
    n = topk_ids.numel()
    device = dev(topk_ids)
    spec = _spec.layout_module(cfg)
    suffix = _id_suffix(topk_ids)
    e_arg = arg_i32(num_experts)
    tiles = cdiv(n, _spec.det_tile(cfg))
    tile_counts = torch.empty(tiles * num_experts, dtype=torch.int32, device=topk_ids.device)
    k = rt.kernel(device, spec, f"amdqb_route_det_hist_{suffix}")
    rt.launch(
        k,
        tiles,
        256,
        4 * num_experts,
        [ptr(topk_ids), arg_i64(n), e_arg, ptr(tile_counts)],
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


class AlignParams(ctypes.Structure):
    """``struct AlignParams`` of layout.hip, field for field."""

    _fields_ = [
        ("ids", ctypes.c_void_p),
        ("expert_map", ctypes.c_void_p),
        ("tile_counts", ctypes.c_void_p),
        ("sorted_ids", ctypes.c_void_p),
        ("expert_ids", ctypes.c_void_p),
        ("post_pad", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("sorted_len", ctypes.c_int64),
        ("num_experts", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("tile", ctypes.c_int32),
        ("tiles", ctypes.c_int32),
        ("num_blocks", ctypes.c_int32),
        ("id_shift", ctypes.c_int32),
        ("map_len", ctypes.c_int32),
        ("map_mode", ctypes.c_int32),
        ("owner_shift", ctypes.c_int32),
        ("tail_value", ctypes.c_int32),
        ("flags", ctypes.c_int32),
        ("rank_warps", ctypes.c_int32),
        ("warp_run", ctypes.c_int32),
        ("tile_blocks", ctypes.c_int32),
    ]


_MAP_MODES = {"none": 0, "filter": 1, "output": 2}
_BASES_PER_THREAD = (
    16  # the rank kernel's per-thread registers for the tile bases (E <= 16 * threads)
)


def align_rank_warps(num_experts: int) -> int:
    """Warps that rank in amdqb_align: the most (<= 32, a power of two) whose per-warp slot rows
    fit the LDS of a launch without an opt-in (align_lds_bytes)."""
    warps = 32
    while warps > 1 and align_lds_bytes(num_experts, warps) + 128 > _STATIC_LDS_LIMIT:
        warps //= 2
    return warps


def align_lds_bytes(num_experts: int, warps: int) -> int:
    """amdqb_align's dynamic LDS: the buckets' starts and one row per ranking warp."""
    return 4 * (1 + warps) * num_experts


def align_plan(n: int, num_experts: int, cfg) -> tuple[int, int, int, int]:
    """(tiles, routes per tile, threads, ranking warps) of an align call. Up to
    ``hip.align.single_block_routes`` routes one block does everything (one launch); beyond,
    tiles of ``hip.align.tile_scale * sqrt(n)`` routes rounded up to a power of two (at least
    ``hip.align.min_tile_routes``; at most ``hip.align.max_tiles`` tiles and
    ``hip.align.colsum_budget`` column entries tiles * E for every rank block to sum; one tile
    is the one-block form): the column sums grow with the tiles, the serial walk with the routes
    per tile. Either way as many ranking warps as give each two or more chunks of 32 routes;
    a rank block of the tiled form has threads enough for ``hip.align.rank_buckets_per_thread``
    buckets each (up to 1024), as each sums its buckets' columns in turn."""
    lds_warps = align_rank_warps(num_experts)

    def warps_for(routes: int) -> int:
        warps = 1
        while warps < lds_warps and 64 * warps < routes:
            warps *= 2
        return warps

    if n > cfg["hip.align.single_block_routes"]:
        tile = 1 << max(0, math.ceil(math.log2(cfg["hip.align.tile_scale"] * math.sqrt(n))))
        tiles = min(
            cfg["hip.align.max_tiles"],
            max(1, cfg["hip.align.colsum_budget"] // num_experts),
            cdiv(n, max(tile, cfg["hip.align.min_tile_routes"])),
        )
        if tiles > 1:
            per = cdiv(n, tiles)
            warps = warps_for(per)
            threads = 32 * warps
            # each thread sums the tile columns of its run of buckets, one bucket after another
            per_thread = min(_BASES_PER_THREAD, cfg["hip.align.rank_buckets_per_thread"])
            while threads < 1024 and threads * per_thread < num_experts:
                threads *= 2
            return cdiv(n, per), per, threads, warps
    # one block: also the threads that fill sorted_ids; 256 at least (512 / 1024 took 4.28 / 4.88
    # against 4.22 us at M=8, E=256, k=8, block 64 on an H100: one CU's store bandwidth bounds it)
    warps = warps_for(n)
    return 1, max(n, 1), max(256, 32 * warps), warps


_ALIGN_CACHED = 4  # ALIGN_CACHED of layout.hip: chunks of 32 routes a place warp ranks at most
_CLUSTER_CHUNKS = 8  # CHUNKS of amdqb_align_cluster: chunks of 32 routes its warps rank at most
_PLAN_THREADS = 1024  # amdqb_align_plan's block: block 0 counts every route, the others fill
_FILL_PER_BLOCK = 16384  # sorted_ids slots per fill block of amdqb_align_plan (4 x 16 B a thread)


def align_planned(n: int, num_experts: int, cfg):
    """(tiles, routes per tile, warps) of the planned align (amdqb_align_plan +
    amdqb_align_place), or None: past ``hip.align.single_block_routes`` and up to
    ``hip.align.plan_max_routes`` routes, in tiles of ``hip.align.plan_tile_routes`` or more (a
    power of two: at most ``hip.align.plan_max_tiles`` tiles, then doubled until the plan's
    [tiles, E] counts fit the LDS of a launch without an opt-in), a place warp per 64 routes of a
    tile (up to 32; each ranks at most _ALIGN_CACHED chunks of 32)."""
    if not cfg["hip.align.single_block_routes"] < n <= cfg["hip.align.plan_max_routes"]:
        return None

    def plan_fits(tile: int) -> bool:  # the plan's [tiles + 1, E] LDS counts and its scan's
        return 4 * (cdiv(n, tile) + 1) * num_experts + 4 * 33 <= _STATIC_LDS_LIMIT

    least = max(cfg["hip.align.plan_tile_routes"], cdiv(n, cfg["hip.align.plan_max_tiles"]))
    tile = 1 << max(2, math.ceil(math.log2(least)))
    while not plan_fits(tile) and tile < n:
        tile *= 2
    tiles = cdiv(n, tile)
    warps = 1
    while warps < 32 and 64 * warps < tile:
        warps *= 2
    if (
        not plan_fits(tile)
        or 4 * warps * num_experts > _STATIC_LDS_LIMIT
        or cdiv(cdiv(tile, warps), 32) > _ALIGN_CACHED
    ):
        return None
    return tiles, tile, warps


def align_tiles_lds_bytes(num_experts: int, warps: int) -> int:
    """amdqb_align_tiles's dynamic LDS: the warps' rank rows, two rows per column-sum group
    (max(1, threads / E) of them), the padded starts and the tile's bases."""
    groups = max(1, 32 * warps // num_experts)
    return 4 * (warps + 2 * groups + 2) * num_experts


def align_tiles_shape(per: int, num_experts: int):
    """(threads, warps) of an amdqb_align_tiles block ranking ``per`` routes, or None where it
    cannot: every warp ranks at most _ALIGN_CACHED chunks of 32 routes, and the block takes as
    many warps as its LDS holds, up to 32 (more threads put more of a tile column's loads in
    flight at once)."""

    def fits(warps: int) -> bool:
        return align_tiles_lds_bytes(num_experts, warps) + 4 * 33 <= _STATIC_LDS_LIMIT

    warps = 1
    while warps < 32 and warps * 32 * _ALIGN_CACHED < per:
        warps *= 2
    if warps * 32 * _ALIGN_CACHED < per or not fits(warps):
        return None
    while warps < 32 and fits(2 * warps):
        warps *= 2
    return 32 * warps, warps


def align_cluster_lds_bytes(num_experts: int, warps: int) -> int:
    """amdqb_align_cluster's dynamic LDS: the warps' rank rows, the tile's counts (read by the
    cluster), the padded starts and the tile's bases."""
    return 4 * (warps + 3) * num_experts


def align_clustered(n: int, num_experts: int, cfg):
    """(blocks, routes per block, warps) of the cluster align (amdqb_align_cluster: one launch of
    one thread block cluster, NVIDIA sm_90+), or None: past ``hip.align.single_block_routes`` and
    up to ``hip.align.cluster_max_routes`` routes, in 2 to ``hip.align.cluster_blocks`` blocks (a
    power of two) of ``hip.align.cluster_tile_routes`` routes or more, a ranking warp per 64
    routes of a block (up to 32) where their LDS rows fit a launch without an opt-in, fewer where
    they do not (each ranks at most _CLUSTER_CHUNKS chunks of 32)."""
    if not cfg["hip.align.single_block_routes"] < n <= cfg["hip.align.cluster_max_routes"]:
        return None
    blocks = 2
    while (
        blocks < cfg["hip.align.cluster_blocks"]
        and blocks * cfg["hip.align.cluster_tile_routes"] < n
    ):
        blocks *= 2
    per = 32 * cdiv(n, 32 * blocks)
    warps = 1
    while warps < 32 and 64 * warps < per:
        warps *= 2

    def fits(w: int) -> bool:
        return align_cluster_lds_bytes(num_experts, w) + 4 * 33 <= _STATIC_LDS_LIMIT

    while warps > 1 and not fits(warps):
        warps //= 2
    if cdiv(cdiv(per, warps), 32) > _CLUSTER_CHUNKS or not fits(warps):
        return None
    return cdiv(n, per), per, warps


def align_cluster_threads(warps: int, num_experts: int) -> int:
    """Threads of an amdqb_align_cluster block: its ranking warps, and at least one thread per
    bucket up to 1024 (each thread sums, scans and places one bucket; the others idle in the
    walk) and 128 (the sentinel's stores)."""
    threads = max(32 * warps, 128)
    while threads < 1024 and threads < num_experts:
        threads *= 2
    return threads


def align_hist_threads(per: int) -> int:
    """Threads of an amdqb_align_hist block counting ``per`` routes: one batch of 8 ids per
    thread, 256 to 1024 (on sm_90, 256 threads in place of 1024 took 5.94 -> 5.55 / 7.36 -> 6.61
    / 9.86 -> 9.54 us at M = 512 / 2048 / 8192, E=256 k=8)."""
    threads = 256
    while threads < 1024 and 8 * threads < per:
        threads *= 2
    return threads


@dataclass(frozen=True)
class AlignForm:
    """The kernels of an align call and their launch shape (align_form)."""

    kernels: tuple[str, ...]  # in launch order; a second one is the first one's dependent
    tiles: int
    per: int  # routes per tile
    threads: int  # of the last kernel's blocks
    warps: int  # ranking warps of the last kernel's blocks


def align_form(n: int, num_experts: int, cfg, clusters: bool = False) -> AlignForm:
    """amdqb_align (one launch up to hip.align.single_block_routes routes), else
    amdqb_align_cluster (one launch, where the device has thread block clusters and
    align_clustered fits), else amdqb_align_plan + amdqb_align_place (align_planned), else
    amdqb_align_hist + amdqb_align_tiles (where ``hip.align.tiles_rank_first`` is set and
    align_tiles_shape fits the tile) or amdqb_align."""
    clustered = align_clustered(n, num_experts, cfg) if clusters else None
    if clustered is not None:
        blocks, per, warps = clustered
        threads = align_cluster_threads(warps, num_experts)
        return AlignForm(("amdqb_align_cluster",), blocks, per, threads, warps)
    planned = align_planned(n, num_experts, cfg)
    if planned is not None:
        tiles, per, warps = planned
        return AlignForm(("amdqb_align_plan", "amdqb_align_place"), tiles, per, 32 * warps, warps)
    tiles, per, threads, warps = align_plan(n, num_experts, cfg)
    if tiles == 1:
        return AlignForm(("amdqb_align",), tiles, per, threads, warps)
    ranked = align_tiles_shape(per, num_experts) if cfg["hip.align.tiles_rank_first"] else None
    if ranked is not None:
        return AlignForm(("amdqb_align_hist", "amdqb_align_tiles"), tiles, per, *ranked)
    return AlignForm(("amdqb_align_hist", "amdqb_align"), tiles, per, threads, warps)


def align_block_size(
    rt, call: AlignCall, topk_ids, expert_map, sorted_ids_out, expert_ids_out, num_post_pad_out
):
    """The kernels of align_form, the second one launched as the first one's dependent."""
    n = topk_ids.numel()
    num_experts = call.num_experts
    if num_experts > MAX_ALIGN_EXPERTS:
        raise ValueError(
            f"hip align supports num_experts <= {MAX_ALIGN_EXPERTS}, got {num_experts}"
        )
    cfg = config(topk_ids)
    device = dev(topk_ids)
    spec = _spec.layout_module(cfg)
    clusters = cfg["hip.align.cluster_max_routes"] > 0 and rt.supports_clusters(device)
    form = align_form(n, num_experts, cfg, clusters)
    tiles, per, warps = form.tiles, form.per, form.warps
    tile_counts = None
    if len(form.kernels) > 1:  # the tiles' counts, or the planned tiles' bases
        tile_counts = torch.empty(tiles * num_experts, dtype=torch.int32, device=topk_ids.device)
    flags = (
        (1 if topk_ids.dtype == torch.int64 else 0)
        | (2 if expert_map is not None and expert_map.dtype == torch.int64 else 0)
        | (0 if call.fill_sentinel else 4)
    )
    params = AlignParams(
        topk_ids.data_ptr() if n else None,
        None if expert_map is None else expert_map.data_ptr(),
        None if tile_counts is None else tile_counts.data_ptr(),
        sorted_ids_out.data_ptr() if sorted_ids_out.numel() else None,
        expert_ids_out.data_ptr() if expert_ids_out.numel() else None,
        num_post_pad_out.data_ptr(),
        n,
        sorted_ids_out.numel(),
        num_experts,
        call.block_size,
        per,
        tiles,
        expert_ids_out.numel(),
        call.id_shift,
        0 if expert_map is None else expert_map.numel(),
        _MAP_MODES[call.map_mode],
        call.owner_shift,
        call.tail_value,
        flags,
        warps,
        cdiv(cdiv(per, warps), 32) * 32,
        cdiv(expert_ids_out.numel(), tiles),
    )
    if form.kernels[0] == "amdqb_align_plan":
        fill_blocks = cdiv(sorted_ids_out.numel(), _FILL_PER_BLOCK) if call.fill_sentinel else 0
        first = (1 + fill_blocks, _PLAN_THREADS, 4 * (tiles + 1) * num_experts)
    else:
        first = (tiles, align_hist_threads(per), 4 * num_experts)
    smem = {
        "amdqb_align": align_lds_bytes(num_experts, warps),
        "amdqb_align_tiles": align_tiles_lds_bytes(num_experts, warps),
        "amdqb_align_place": 4 * warps * num_experts,
        "amdqb_align_cluster": align_cluster_lds_bytes(num_experts, warps),
    }[form.kernels[-1]]
    if form.kernels[0] == "amdqb_align_cluster":  # the grid is one cluster
        kernel = rt.kernel(device, spec, form.kernels[0])
        rt.launch_cluster(kernel, tiles, tiles, form.threads, smem, [params])
        return
    launch = rt.launch
    if len(form.kernels) > 1:
        rt.launch(rt.kernel(device, spec, form.kernels[0]), *first, [params])
        if cfg["hip.route.det_dependent_launch"]:
            launch = rt.launch_dependent
    launch(rt.kernel(device, spec, form.kernels[-1]), tiles, form.threads, smem, [params])


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


def align_block_size_limits(info, request: AlignCall) -> str | None:
    if request.num_experts > MAX_ALIGN_EXPERTS:
        return f"align with num_experts={request.num_experts} > {MAX_ALIGN_EXPERTS} (LDS rows)"
    return None


LIMITS = {"route_rows": route_rows_limits, "align_block_size": align_block_size_limits}
