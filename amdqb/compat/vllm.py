"""vLLM's MoE routing and alignment entry points on amdqb, under vLLM's names and signatures::

    # from vllm.model_executor.layers.fused_moe.router.fused_topk_router import fused_topk
    # from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size
    # from vllm import _custom_ops as ops
    from amdqb.compat.vllm import fused_topk, moe_align_block_size, _custom_ops as ops

Provided: ``fused_topk``, ``fused_topk_bias``, ``grouped_topk`` (vLLM's routers, positional order
included), ``moe_align_block_size`` (the functional form, with ``ignore_invalid_experts``) and
``_custom_ops.moe_align_block_size`` (the preallocated form: ``topk_ids, num_experts, block_size,
sorted_token_ids, experts_ids, num_tokens_post_pad, expert_map``). Each is a translation onto
:func:`amdqb.biased_topk` and :func:`amdqb.moe_align_block_size`; nothing reads device values on
the host, so every path can be captured in a CUDA/HIP graph.

Semantics (vLLM's):

* scores are ``softmax`` over all experts or ``sigmoid`` (``fused_topk_bias`` also takes
  ``sqrtsoftplus``); ``e_score_correction_bias`` is added for the selection only, the weights
  are the unbiased scores; ``renormalize`` divides by their sum; ``routed_scaling_factor``
  multiplies last. Weights are fp32 ``[M, k]``, ids int32 (or ``indices_type``) ``[M, k]``.
* ``grouped_topk`` ranks the groups by their best score, or with a bias by the sum of their best
  two biased scores, keeps ``topk_group`` of them and takes the top ``topk`` inside;
  ``topk_group`` need not divide ``topk``. ``num_expert_group`` 0 or 1 is one group (plain top-k).
* ``moe_align_block_size``: vLLM's buffer sizes (``numel + E * (block_size - 1)``, rounded up
  to ``block_size`` with ``pad_sorted_ids``, ``numel * block_size`` below ``E`` routes); flat
  route indices, the sentinel ``numel``; blocks past ``num_tokens_post_pad`` have expert
  :data:`INACTIVE_EXPERT_ID` (-1, vLLM's value since its PR #35161; set it to 0 for the vLLM
  releases before, which wrote 0). Ids outside ``[0, E)`` are skipped. ``expert_map`` (global ->
  local, -1 remote): with ``ignore_invalid_experts`` (and always in the ``_custom_ops`` form)
  routes to remote experts are skipped and the blocks carry local ids; otherwise every route is
  aligned by its global id and every block is mapped as vLLM does, ``expert_map[expert_ids]``
  (remote experts' blocks become -1; the tail reads ``expert_map[INACTIVE_EXPERT_ID]``, PyTorch
  indexing, which vLLM's kernels never read).

Launches: on the hip backend every router is one kernel (``amdqb_topk``: ids, weights and
``token_expert_indices`` together) and every align one kernel, two from
``hip.align.single_block_routes`` routes on (docs/serving.md). ``indices_type`` int32 / int64 is
written by the kernel; other integer types cost a conversion.

Differences from vLLM (all documented in docs/serving.md):

* precision: scores, biased scores and weights are fp32 whatever the logits' dtype (vLLM's torch
  paths, ``grouped_topk`` among them, compute the softmax / sigmoid in the logits' dtype);
  ``renormalize`` divides by ``sum + 1e-20``;
* order: ids come in selection order (biased score descending, expert id ascending on ties; NaN
  scores rank last), where vLLM's ``sorted=False`` top-k leaves the order unspecified; inside an
  expert the aligned routes are in ascending route order (vLLM: any order);
* vLLM's kernels clamp NaN / Inf logits to 0 before the selection; amdqb ranks NaN scores last
  and keeps them (a NaN logit gives a NaN weight);
* the hash-routing form of ``fused_topk_bias`` (``hash_indices_table``) runs in PyTorch;
* ``topk_ids`` of an align are read as its logical ids (a non-contiguous tensor is copied first),
  where vLLM's kernel reads its storage in memory order; :data:`LEGACY_BUFFER_SIZES` selects
  vLLM's older sorted-ids size rule.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..ops import layout as _layout
from ..ops import router as _router
from ..ops._checks import (
    ID_DTYPES,
    INT32_MAX,
    MAX_ALLOCATED_EXPERTS,
    check_bool,
    check_float,
    check_int,
    check_tensor,
)
from ..ops.layout import MAX_ALIGN_PADDING
from ..ref.layout import align_buffer_sizes
from ..ref.router import activation, normalise

__all__ = [
    "INACTIVE_EXPERT_ID",
    "LEGACY_BUFFER_SIZES",
    "_custom_ops",
    "fused_topk",
    "fused_topk_bias",
    "grouped_topk",
    "moe_align_block_size",
]

#: Expert id of the aligned blocks past the padded total (vLLM's ``inactive_expert_id``): -1 in
#: vLLM since its PR #35161, 0 before. Read at every call.
INACTIVE_EXPERT_ID = -1

#: vLLM's buffer rule before its sizes were capped for decode: ``numel + E * (block_size - 1)``
#: rows even when there are fewer routes than experts (``numel * block_size`` rows since). Set it
#: to True for those releases (their tests check the sizes). Read at every call.
LEGACY_BUFFER_SIZES = False

_FUSED_TOPK_SCORES = ("softmax", "sigmoid")
_BIAS_SCORES = ("softmax", "sigmoid", "sqrtsoftplus")
_NAMES = ("gating_output", "e_score_correction_bias")


def _check_scoring(scoring_func, allowed) -> str:
    if scoring_func not in allowed:
        raise ValueError(f"Unsupported scoring function: {scoring_func!r} (one of {allowed})")
    return scoring_func


def _check_tokens(hidden_states, gating_output) -> None:
    check_tensor("gating_output", gating_output, dim=2)
    if isinstance(hidden_states, torch.Tensor) and hidden_states.size(0) != gating_output.size(0):
        raise ValueError(
            f"Number of tokens mismatch: hidden_states has {hidden_states.size(0)} rows, "
            f"gating_output {gating_output.size(0)}"
        )


def _scale(routed_scaling_factor) -> Optional[float]:
    if routed_scaling_factor is None:
        return None
    value = check_float("routed_scaling_factor", routed_scaling_factor, finite=True)
    return None if value == 1.0 else value


def _ids_dtype(indices_type) -> torch.dtype:
    """The kernel writes int32 or int64 ids itself; other integer types are converted after."""
    return indices_type if indices_type in (torch.int32, torch.int64) else torch.int32


def _ids_as(ids: torch.Tensor, indices_type) -> torch.Tensor:
    return ids if indices_type is None or indices_type == ids.dtype else ids.to(indices_type)


def fused_topk(
    hidden_states: torch.Tensor,
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    indices_type: Optional[torch.dtype] = None,
    scoring_func: str = "softmax",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's ``fused_topk``: ``(topk_weights fp32 [M, k], topk_ids [M, k], token_expert_indices
    int32 [M, k])`` with ``token_expert_indices[t, j] = j * M + t``, all from one kernel."""
    _check_tokens(hidden_states, gating_output)
    _check_scoring(scoring_func, _FUSED_TOPK_SCORES)
    weights, ids, token_expert_indices = _router.serving_topk(
        gating_output,
        topk,
        score_function=scoring_func,
        renormalize=check_bool("renormalize", renormalize),
        token_expert_indices=True,
        ids_dtype=_ids_dtype(indices_type),
        names=_NAMES,
    )
    return weights, _ids_as(ids, indices_type), token_expert_indices


def fused_topk_bias(
    hidden_states: torch.Tensor,
    gating_output: torch.Tensor,
    scoring_func: str,
    e_score_correction_bias: Optional[torch.Tensor],
    topk: int,
    renormalize: bool,
    indices_type: Optional[torch.dtype] = None,
    input_tokens: Optional[torch.Tensor] = None,
    hash_indices_table: Optional[torch.Tensor] = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``fused_topk_bias``: top-k of ``scores + e_score_correction_bias`` (any score
    function), weights the unbiased scores; ``(topk_weights fp32, topk_ids int32)``. With
    ``hash_indices_table`` the ids are ``hash_indices_table[input_tokens]`` (hash MoE)."""
    _check_tokens(hidden_states, gating_output)
    _check_scoring(scoring_func, _BIAS_SCORES)
    scale = _scale(routed_scaling_factor)
    renormalize = check_bool("renormalize", renormalize)
    if hash_indices_table is not None:
        if input_tokens is None:
            raise ValueError("hash_indices_table needs input_tokens")
        check_tensor("hash_indices_table", hash_indices_table, dtypes=ID_DTYPES, dim=2)
        ids = hash_indices_table[input_tokens.long()]
        scores = activation(gating_output.float(), scoring_func)
        weights = scores.gather(1, ids.long())
        if renormalize:
            weights = normalise(weights)
        if scale is not None:
            weights = weights * scale
        return weights, _ids_as(ids.to(torch.int32), indices_type)
    weights, ids, _ = _router.serving_topk(
        gating_output,
        topk,
        e_score_correction_bias,
        score_function=scoring_func,
        renormalize=renormalize,
        scaling_factor=scale,
        ids_dtype=_ids_dtype(indices_type),
        names=_NAMES,
    )
    return weights, _ids_as(ids, indices_type)


def grouped_topk(
    hidden_states: torch.Tensor,
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    num_expert_group: int = 0,
    topk_group: int = 0,
    scoring_func: str = "softmax",
    routed_scaling_factor: float = 1.0,
    e_score_correction_bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``grouped_topk`` (DeepSeek-V2/V3 routing): ``(topk_weights fp32, topk_ids int32)``."""
    _check_tokens(hidden_states, gating_output)
    _check_scoring(scoring_func, _FUSED_TOPK_SCORES)
    check_int("num_expert_group", num_expert_group, low=0)
    check_int("topk_group", topk_group, low=0)
    groups = None if num_expert_group <= 1 else num_expert_group
    if groups is not None and topk_group < 1:
        raise ValueError(f"topk_group must be >= 1 with num_expert_group={num_expert_group}")
    weights, ids, _ = _router.serving_topk(
        gating_output,
        topk,
        e_score_correction_bias,
        score_function=scoring_func,
        renormalize=check_bool("renormalize", renormalize),
        scaling_factor=_scale(routed_scaling_factor),
        num_groups=groups,
        group_topk=None if groups is None else topk_group,
        names=_NAMES,
    )
    return weights, ids


# ----------------------------------------------------------------------------------------------
# moe_align_block_size
# ----------------------------------------------------------------------------------------------


def _check_expert_map(expert_map, num_experts: int, device) -> torch.Tensor:
    check_tensor("expert_map", expert_map, dtypes=ID_DTYPES, shape=(num_experts,), device=device)
    return expert_map


def buffer_sizes(numel: int, num_experts: int, block_size: int, pad_sorted_ids: bool):
    """``(rows of sorted_token_ids, blocks of expert_ids)`` by vLLM's rule (see
    :data:`LEGACY_BUFFER_SIZES`)."""
    if not LEGACY_BUFFER_SIZES:
        return align_buffer_sizes(numel, num_experts, block_size, pad_sorted_ids)
    rows = numel + num_experts * (block_size - 1)
    if pad_sorted_ids:
        rows = -(-rows // block_size) * block_size
    return rows, -(-rows // block_size)


def moe_align_block_size(
    topk_ids: torch.Tensor,
    block_size: int,
    num_experts: int,
    expert_map: Optional[torch.Tensor] = None,
    pad_sorted_ids: bool = False,
    ignore_invalid_experts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's functional ``moe_align_block_size``: ``(sorted_token_ids int32, expert_ids int32,
    num_tokens_post_pad int32 [1])`` in buffers of vLLM's sizes (``num_experts`` global), written
    by one kernel launch (two for large inputs); every argument is checked before anything is
    allocated."""
    check_tensor("topk_ids", topk_ids, dtypes=ID_DTYPES, min_dim=1)
    block_size = check_int("block_size", block_size, low=1, high=INT32_MAX)
    num_experts = check_int("num_experts", num_experts, low=1, high=MAX_ALLOCATED_EXPERTS)
    pad_sorted_ids = check_bool("pad_sorted_ids", pad_sorted_ids)
    ignore_invalid_experts = check_bool("ignore_invalid_experts", ignore_invalid_experts)
    device = topk_ids.device
    if expert_map is not None:
        _check_expert_map(expert_map, num_experts, device)
    if num_experts * (block_size - 1) > MAX_ALIGN_PADDING:
        raise ValueError(
            f"num_experts * (block_size - 1) = {num_experts * (block_size - 1)} padding rows "
            f"exceed {MAX_ALIGN_PADDING} (block_size={block_size}, num_experts={num_experts})"
        )
    rows, blocks = buffer_sizes(topk_ids.numel(), num_experts, block_size, pad_sorted_ids)
    if rows > INT32_MAX:
        raise ValueError(f"aligned buffer of {rows} rows does not fit int32 indices")
    sorted_ids = torch.empty(rows, dtype=torch.int32, device=device)
    expert_ids = torch.empty(blocks, dtype=torch.int32, device=device)
    num_post_pad = torch.empty(1, dtype=torch.int32, device=device)
    mode = "none" if expert_map is None else "filter" if ignore_invalid_experts else "output"
    _layout.align_block_size_into(
        topk_ids,
        block_size,
        num_experts,
        sorted_ids,
        expert_ids,
        num_post_pad,
        expert_map=expert_map,
        map_mode=mode,
        tail_value=INACTIVE_EXPERT_ID,
    )
    return sorted_ids, expert_ids, num_post_pad


def _ops_moe_align_block_size(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_size: int,
    sorted_token_ids: torch.Tensor,
    experts_ids: torch.Tensor,
    num_tokens_post_pad: torch.Tensor,
    expert_map: Optional[torch.Tensor] = None,
) -> None:
    """``vllm._custom_ops.moe_align_block_size``: the layout written into the caller's int32
    buffers by one kernel launch (two for large inputs). ``sorted_token_ids`` is filled whole (the
    sentinel past the routes); ``experts_ids`` over ``ceil(len(sorted_token_ids) / block_size)``
    blocks, :data:`INACTIVE_EXPERT_ID` past the padded total. An ``expert_map`` filters remote
    experts (vLLM passes it here only with ``ignore_invalid_experts``). The buffers must hold the
    padded total of any routing (``numel + min(numel, E) * (block_size - 1)`` rows): checked from
    their shapes."""
    check_tensor("topk_ids", topk_ids, dtypes=ID_DTYPES, min_dim=1)
    num_experts = check_int("num_experts", num_experts, low=1, high=MAX_ALLOCATED_EXPERTS)
    block_size = check_int("block_size", block_size, low=1, high=INT32_MAX)
    check_tensor("sorted_token_ids", sorted_token_ids, dtypes=(torch.int32,), dim=1)
    check_tensor("experts_ids", experts_ids, dtypes=(torch.int32,), dim=1)
    if expert_map is not None:
        _check_expert_map(expert_map, num_experts, topk_ids.device)
    written = experts_ids[: -(-sorted_token_ids.numel() // block_size)]
    _layout.align_block_size_into(
        topk_ids,
        block_size,
        num_experts,
        sorted_token_ids,
        written,
        num_tokens_post_pad,
        expert_map=expert_map,
        map_mode="none" if expert_map is None else "filter",
        tail_value=INACTIVE_EXPERT_ID,
    )


class _custom_ops:  # noqa: N801 -- vLLM's module name, so ``_custom_ops as ops`` reads the same
    """The preallocated forms of ``vllm._custom_ops`` that amdqb implements."""

    moe_align_block_size = staticmethod(_ops_moe_align_block_size)
