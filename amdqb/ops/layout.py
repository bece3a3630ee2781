"""Route rows for expert-grouped GEMM and vLLM's ``moe_align_block_size``.

Contract (see ``amdqb.ref.layout``): ids outside ``[0, E)`` are dropped (row ``-1``, no slot); each
valid route claims a unique slot ``counters[e] + rank``; ``capacity`` gives the masked layout
``row = e * capacity + slot`` (slots ``>= capacity`` dropped), ``capacity=None`` the compact
expert-major layout. The order inside an expert is unspecified unless ``deterministic=True``
(ascending flat route index, bitwise reproducible). Row ids are int32: multiply by the hidden size
in int64 downstream.

Any counter value is memory-safe and has one outcome on every backend (``amdqb.ref.layout``): a
slot outside ``[0, 2^31 - 1]`` (a negative counter, or one passing int32) is dropped -- row ``-1``,
not counted, the counter still advances; the compact layout gives expert ``e`` the rows
``[offset[e], offset[e] + max(counters[e], 0))`` (``offset``: exclusive cumsum of the updated
counters clamped at 0) and drops a route whose row would leave that range or pass ``2^31 - 1``.
So every row handed out is in ``[0, 2^31 - 1]`` and owned by exactly one route.

Two implementations:

* ``atomic`` -- one global atomic per route (the "old" path);
* ``lds``    -- per-workgroup LDS histogram, one global interval reservation per non-empty
  (workgroup, expert), LDS-atomic ranks inside the interval (the "new" path); up to 4096 experts.

Memory (docs/memory_safety.md): ``topk_ids`` is read through its strides (a contiguous copy when
it is not contiguous) and compared in 64 bits (an int64 id of ``2^32 + 3`` drops); ``counters``
and the align buffers are written in place, so they must be contiguous and share no byte with
``topk_ids`` or each other (a ``ValueError`` naming both).

:func:`route_impl` is the capacity gate that picks one (aiter's gfx1250 rule, docs/targets.md; no model-name or shape branch).
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import configs, dispatch
from .._library import call_op, impl, kernel_op
from ..backends.calls import ALIGN_MAP_MODES, ALIGN_TENSORS, LDS_ROUTE_MAX_EXPERTS, AlignCall
from ..dispatch import DeviceInfo
from ..ref.layout import align_buffer_sizes
from ._checks import (
    ID_DTYPES,
    INT32_MAX,
    MAX_ALLOCATED_EXPERTS,
    check_backend,
    check_bool,
    check_choice,
    check_int,
    check_no_overlap,
    check_tensor,
    kernel_input,
    static_int,
)

ROUTE_IMPLS = ("atomic", "lds")
MAX_ALIGN_PADDING = 1 << 26  # E * (block_size - 1) padding rows of one align buffer (256 MiB)


def lds_route_threshold(num_experts: int, cfg) -> int:
    """Smallest route count for which the capacity gate picks ``lds``: ``route.lds_gate_scale``
    times aiter's bucket sweep ``256 * S * max(4, 2S)``, ``S = ceil(E / 256)`` (docs/targets.md;
    the scale is 1 on gfx1250, aiter's gate, and 0 on sm_90, where lds measured ahead at every
    size)."""
    sweeps = -(-num_experts // 256)
    return int(256 * sweeps * max(4, 2 * sweeps) * cfg["route.lds_gate_scale"])


def route_impl(info: DeviceInfo, num_routes: int, num_experts: int) -> tuple[str, str]:
    """(impl, reason) chosen by the capacity gate for this device and problem size."""
    if num_experts > LDS_ROUTE_MAX_EXPERTS:
        return "atomic", f"E={num_experts} > {LDS_ROUTE_MAX_EXPERTS}: beyond the LDS histogram"
    cfg = configs.load(info.arch_family)
    threshold = lds_route_threshold(num_experts, cfg)
    source = f"route.lds_gate_scale of {cfg.arch}: {cfg.entry('route.lds_gate_scale').provenance}"
    if num_routes >= threshold:
        return "lds", f"M*k={num_routes} >= {threshold} ({source})"
    return "atomic", f"M*k={num_routes} < {threshold} ({source})"


@torch.compiler.assume_constant_result
def _lds_min_routes(device: str, num_experts: int) -> int:
    """Fewest routes the capacity gate sends to ``lds`` on ``device`` (-1: never). A constant for
    torch.compile (the device query behind it cannot be traced); the route count is compared with
    it in the traced code, so a dynamic token count stays symbolic (one guard on the gate)."""
    if num_experts > LDS_ROUTE_MAX_EXPERTS:
        return -1
    return lds_route_threshold(num_experts, configs.load(dispatch.device_info(device).arch_family))


def _gate(device, num_routes, num_experts: int) -> str:
    threshold = _lds_min_routes(str(device), num_experts)
    return "lds" if 0 <= threshold <= num_routes else "atomic"


@kernel_op("route_rows", mutates_args=("counters", "rows_out", "counts_out"))
def _route_rows(
    topk_ids: torch.Tensor,
    num_experts: int,
    capacity: Optional[int],
    counters: torch.Tensor,
    rows_out: torch.Tensor,
    counts_out: torch.Tensor,
    deterministic: bool,
    route_impl_name: str,
    backend: str,
) -> None:
    impl("route_rows", backend)(
        topk_ids,
        num_experts,
        capacity,
        counters,
        rows_out,
        counts_out,
        deterministic,
        route_impl_name,
    )


# moe_align_block_size with the compat conventions, from one call (AlignCall).
_align_block_size = call_op(
    "align_block_size",
    AlignCall,
    ALIGN_TENSORS,
    mutates_args=("sorted_ids_out", "expert_ids_out", "num_post_pad_out"),
)


def _check_ids(topk_ids) -> None:
    check_tensor("topk_ids", topk_ids, dtypes=ID_DTYPES, min_dim=1)
    if topk_ids.numel() > INT32_MAX:
        raise ValueError(f"topk_ids has {topk_ids.numel()} routes; at most 2^31-1 are supported")


def moe_route_rows(
    topk_ids: torch.Tensor,
    num_experts: int,
    *,
    capacity: Optional[int] = None,
    counters: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    impl: Optional[str] = None,
    backend: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Assign every route a unique row of its expert.

    Args:
        topk_ids: ``[M, k]`` (or any shape) int32/int64 expert ids; ids outside ``[0, E)`` drop.
        num_experts: E (1 ... 65536: the per-expert buffers are allocated here).
        capacity: rows per expert in the masked layout ``row = e * capacity + slot``.
        counters: optional int32 ``[E]`` caller-initialised slot offsets, updated in place by the
            number of valid routes of each expert (int32, wrapping); slots outside
            ``[0, 2^31 - 1]`` get no row (see the module notes). Contiguous, sharing no memory
            with ``topk_ids``.
        deterministic: ascending flat route index inside each expert, bitwise reproducible.
        impl: force ``"atomic"`` or ``"lds"`` (default: the capacity gate).
        backend: force a backend.

    Returns:
        ``(rows int32 shaped like topk_ids, counts int32 [E])`` -- counts are the routes of this
        call that received a row.
    """
    _check_ids(topk_ids)
    num_experts = static_int(
        check_int("num_experts", num_experts, low=1, high=MAX_ALLOCATED_EXPERTS)
    )
    device = topk_ids.device
    if capacity is not None:
        capacity = check_int("capacity", capacity, low=0, high=INT32_MAX)
        if num_experts * capacity > INT32_MAX:
            raise ValueError(
                f"num_experts * capacity = {num_experts * capacity} does not fit int32 rows"
            )
    deterministic = check_bool("deterministic", deterministic)
    if counters is not None:
        check_tensor(
            "counters",
            counters,
            dtypes=(torch.int32,),
            shape=(num_experts,),
            device=device,
            contiguous=True,
        )
    if impl is not None:
        check_choice("impl", impl, ROUTE_IMPLS)
    check_backend(backend)
    check_no_overlap({"counters": counters}, {"topk_ids": topk_ids})
    chosen = impl or _gate(device, topk_ids.numel(), num_experts)
    if chosen == "lds" and num_experts > LDS_ROUTE_MAX_EXPERTS:
        raise ValueError(
            f"impl='lds' supports num_experts <= {LDS_ROUTE_MAX_EXPERTS}, got {num_experts}"
        )
    chosen_backend = dispatch.kernel_backend(
        "route_rows",
        device,
        backend,
        num_experts=num_experts,
        impl=chosen,
        deterministic=deterministic,
    )
    ids = kernel_input(topk_ids)
    # counts arrive zero-filled at the backend (the lds kernels accumulate into them); with the
    # op's own counters both come from one fill
    if counters is None:
        counters, counts = torch.zeros(2, num_experts, dtype=torch.int32, device=device).unbind(0)
    else:
        counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    rows = torch.empty(ids.shape, dtype=torch.int32, device=device)
    _route_rows(
        ids,
        num_experts,
        capacity,
        counters,
        rows,
        counts,
        bool(deterministic),
        chosen,
        chosen_backend,
    )
    return rows, counts


def align_min_rows(numel: int, num_experts: int, block_size: int) -> int:
    """Rows any routing of ``numel`` routes over ``num_experts`` experts can pad to: at most
    ``min(numel, E)`` experts are non-empty and each pads by at most ``block_size - 1``."""
    return numel + min(numel, num_experts) * (block_size - 1)


def _check_align(topk_ids, block_size, num_experts, backend=None, raw_storage=False):
    """(flat ids, block_size, num_experts) of an align call, every argument checked. The ids are
    the logical ones (a copy when ``topk_ids`` is not contiguous), or with ``raw_storage`` the
    ``numel`` values from its first element on in memory order (SGLang's kernel reads them so)."""
    _check_ids(topk_ids)
    block_size = check_int("block_size", block_size, low=1, high=INT32_MAX)
    num_experts = static_int(
        check_int("num_experts", num_experts, low=1, high=MAX_ALLOCATED_EXPERTS)
    )
    if num_experts * (block_size - 1) > MAX_ALIGN_PADDING:
        raise ValueError(
            f"num_experts * (block_size - 1) = {num_experts * (block_size - 1)} padding rows "
            f"exceed {MAX_ALIGN_PADDING} (block_size={block_size}, num_experts={num_experts})"
        )
    check_backend(backend)
    numel = topk_ids.numel()
    if topk_ids.is_contiguous():
        return topk_ids.reshape(-1), block_size, num_experts
    if not raw_storage:
        return topk_ids.contiguous().reshape(-1), block_size, num_experts
    end = (topk_ids.storage_offset() + numel) * topk_ids.element_size()
    if end > topk_ids.untyped_storage().nbytes():
        raise ValueError(
            f"topk_ids (non-contiguous, shape {tuple(topk_ids.shape)}) is read as its {numel} "
            "values in memory order, which run past the end of its storage"
        )
    return topk_ids.as_strided((numel,), (1,)), block_size, num_experts


def check_align_sizes(
    topk_ids: torch.Tensor,
    block_size: int,
    num_experts: int,
    pad_sorted_ids: bool = False,
    *,
    backend: Optional[str] = None,
) -> tuple[int, int, int, int]:
    """``(block_size, num_experts, rows, blocks)`` of an align call with vLLM's buffer sizes
    (:func:`amdqb.ref.layout.align_buffer_sizes`), every argument checked before anything is
    allocated: what a caller that allocates the buffers itself (``amdqb.compat``) runs first, so
    that an absurd ``block_size`` or ``num_experts`` fails here, not in the allocator."""
    _check_ids(topk_ids)
    block_size = check_int("block_size", block_size, low=1, high=INT32_MAX)
    num_experts = static_int(
        check_int("num_experts", num_experts, low=1, high=MAX_ALLOCATED_EXPERTS)
    )
    if num_experts * (block_size - 1) > MAX_ALIGN_PADDING:
        raise ValueError(
            f"num_experts * (block_size - 1) = {num_experts * (block_size - 1)} padding rows "
            f"exceed {MAX_ALIGN_PADDING} (block_size={block_size}, num_experts={num_experts})"
        )
    check_backend(backend)
    pad_sorted_ids = check_bool("pad_sorted_ids", pad_sorted_ids)
    rows, blocks = align_buffer_sizes(topk_ids.numel(), num_experts, block_size, pad_sorted_ids)
    if rows > INT32_MAX:
        raise ValueError(f"aligned buffer of {rows} rows does not fit int32 indices")
    return block_size, num_experts, rows, blocks


def align_block_size_into(
    topk_ids: torch.Tensor,
    block_size: int,
    num_experts: int,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_pad: torch.Tensor,
    *,
    expert_map: Optional[torch.Tensor] = None,
    map_mode: str = "none",
    id_shift: int = 0,
    owner_shift: int = 0,
    tail_value: int = 0,
    raw_storage: bool = False,
    fill_sentinel: bool = True,
    backend: Optional[str] = None,
) -> None:
    """:func:`moe_align_block_size` into the caller's int32 buffers (the preallocated form of the
    compatibility modules), in one kernel launch (two from ``hip.align.single_block_routes``
    routes on): every entry of both buffers is written, the sentinel ``numel`` past the routes and
    ``tail_value`` past the used blocks. The compat conventions (``id_shift``, ``expert_map`` with
    ``map_mode`` "filter" or "output", ``owner_shift``, ``tail_value``) are those of
    :class:`amdqb.backends.calls.AlignCall`; ``raw_storage``: a non-contiguous ``topk_ids`` is
    read as its ``numel`` values in memory order (SGLang's kernel), not as its logical ids.
    ``fill_sentinel=False``: only the route slots of ``sorted_token_ids`` are written, its other
    entries keep the caller's values (SGLang's ``pad_sorted_token_ids=False``: the caller filled
    the sentinel). ``sorted_token_ids`` must hold :func:`align_min_rows` entries (checked from the
    shapes: the padded total of any routing fits) and ``expert_ids`` at least that many rows'
    blocks, so no routing can make a kernel write out of bounds."""
    _check_ids(topk_ids)
    device = topk_ids.device
    for name, buf in (("sorted_token_ids", sorted_token_ids), ("expert_ids", expert_ids)):
        check_tensor(name, buf, dtypes=(torch.int32,), dim=1, device=device, contiguous=True)
    check_tensor("num_tokens_post_pad", num_tokens_post_pad, dtypes=(torch.int32,), device=device)
    if num_tokens_post_pad.numel() != 1:
        raise ValueError(
            f"num_tokens_post_pad must hold one element, got shape {tuple(num_tokens_post_pad.shape)}"
        )
    if not num_tokens_post_pad.is_contiguous():
        raise ValueError("num_tokens_post_pad must be contiguous")
    check_choice("map_mode", map_mode, ALIGN_MAP_MODES)
    if (expert_map is None) != (map_mode == "none"):
        raise ValueError("expert_map and map_mode ('filter' or 'output') go together")
    if expert_map is not None:
        check_tensor("expert_map", expert_map, dtypes=ID_DTYPES, dim=1, device=device)
        if expert_map.numel() > INT32_MAX:
            raise ValueError(f"expert_map of {expert_map.numel()} entries exceeds int32")
    check_no_overlap(
        {
            "sorted_token_ids": sorted_token_ids,
            "expert_ids": expert_ids,
            "num_tokens_post_pad": num_tokens_post_pad,
        },
        {"topk_ids": topk_ids, "expert_map": expert_map},
    )
    for name, v in (("id_shift", id_shift), ("owner_shift", owner_shift)):
        check_int(name, v, low=-INT32_MAX, high=INT32_MAX)
    check_int("tail_value", tail_value, low=-INT32_MAX, high=INT32_MAX)
    fill_sentinel = check_bool("fill_sentinel", fill_sentinel)
    ids, block_size, num_experts = _check_align(
        topk_ids, block_size, num_experts, backend, raw_storage
    )
    rows = align_min_rows(ids.numel(), num_experts, block_size)
    if sorted_token_ids.numel() < rows:
        raise ValueError(
            f"sorted_token_ids holds {sorted_token_ids.numel()} entries; {ids.numel()} routes over "
            f"{num_experts} experts in blocks of {block_size} can need {rows}"
        )
    if expert_ids.numel() < rows // block_size:
        raise ValueError(
            f"expert_ids holds {expert_ids.numel()} blocks; {rows} rows can need "
            f"{rows // block_size}"
        )
    if sorted_token_ids.numel() > INT32_MAX:
        raise ValueError(f"aligned buffer of {sorted_token_ids.numel()} rows exceeds int32")
    if expert_map is not None:  # int32 entries (outside int32: -1), read contiguously
        expert_map = int32_expert_map(expert_map).contiguous()
    call = AlignCall(
        num_experts,
        block_size,
        int(id_shift),
        map_mode,
        int(owner_shift),
        int(tail_value),
        fill_sentinel,
    )
    chosen_backend = dispatch.kernel_backend("align_block_size", device, backend, call)
    _align_block_size(
        call,
        ids,
        expert_map,
        sorted_token_ids,
        expert_ids,
        num_tokens_post_pad.view(1),
        backend=chosen_backend,
    )


def moe_align_block_size(
    topk_ids: torch.Tensor,
    block_size: int,
    num_experts: int,
    expert_map: Optional[torch.Tensor] = None,
    pad_sorted_ids: bool = False,
    *,
    backend: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM-compatible alignment of routes to ``block_size`` blocks, one expert per block.

    Returns ``(sorted_token_ids int32 [R], expert_ids int32 [ceil(R / block_size)],
    num_tokens_post_pad int32 [1])`` with vLLM's buffer rule (:func:`amdqb.ref.layout.
    align_buffer_sizes`): ``R = numel + E * (block_size - 1)``, rounded up to ``block_size`` when
    ``pad_sorted_ids``, and ``numel * block_size`` when there are fewer routes than experts.
    ``sorted_token_ids`` holds flat route indices (token = index // k) padded with ``numel``; the
    order inside an expert is ascending (deterministic). Ids outside ``[0, E)`` are dropped. Unused
    tail blocks have expert 0; every block is then mapped through ``expert_map`` (global -> local,
    -1 for remote experts) when given, as vLLM's ``ignore_invalid_experts=False`` path does
    (``amdqb.compat.vllm`` has the filtering path and vLLM's -1 tail); an int64 ``expert_map``
    entry outside the int32 range maps to -1 (:func:`int32_expert_map`). One kernel launch (two
    from ``hip.align.single_block_routes`` routes on).
    """
    ids, block_size, num_experts = _check_align(topk_ids, block_size, num_experts, backend)
    pad_sorted_ids = check_bool("pad_sorted_ids", pad_sorted_ids)
    device = ids.device
    if expert_map is not None:
        check_tensor(
            "expert_map",
            expert_map,
            dtypes=ID_DTYPES,
            shape=(num_experts,),
            device=device,
        )
    numel = ids.numel()
    max_padded, max_blocks = align_buffer_sizes(numel, num_experts, block_size, pad_sorted_ids)
    if max_padded > INT32_MAX:
        raise ValueError(f"aligned buffer of {max_padded} rows does not fit int32 indices")
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_post_pad = torch.empty(1, dtype=torch.int32, device=device)
    align_block_size_into(
        ids,
        block_size,
        num_experts,
        sorted_ids,
        expert_ids,
        num_post_pad,
        expert_map=expert_map,
        map_mode="none" if expert_map is None else "output",
        backend=backend,
    )
    return sorted_ids, expert_ids, num_post_pad


def int32_expert_map(expert_map: torch.Tensor) -> torch.Tensor:
    """``expert_map`` as the int32 ids of the aligned blocks: an int64 entry outside the int32
    range becomes -1 (no local expert), where a cast would wrap it onto another id. On the
    device, no host read."""
    if expert_map.dtype == torch.int32:
        return expert_map
    fits = (expert_map >= -(2**31)) & (expert_map <= INT32_MAX)
    return torch.where(fits, expert_map, -1).to(torch.int32)
