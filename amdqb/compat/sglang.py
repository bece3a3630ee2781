"""SGLang's MoE routing and alignment kernels on amdqb, under SGLang's names and signatures::

    # from sgl_kernel import moe_align_block_size, moe_fused_gate, kimi_k2_moe_fused_gate
    # from sglang.srt.layers.moe.topk import biased_grouped_topk
    from amdqb.compat.sglang import (
        biased_grouped_topk, kimi_k2_moe_fused_gate, moe_align_block_size, moe_fused_gate)

Each is a translation onto :func:`amdqb.biased_topk` and :func:`amdqb.moe_align_block_size`;
nothing reads device values on the host (graph-capturable).

Semantics (SGLang's):

* ``moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids,
  num_tokens_post_pad, cumsum_buffer, pad_sorted_token_ids=False)`` writes into the caller's
  buffers with SGLang's EP convention: ``num_experts`` counts one more slot than the model has
  experts, route ids ``-1 .. num_experts - 2`` fall in buckets ``id + 1``, so the routes an EP
  dispatcher marked -1 are aligned first, in blocks of expert -1 (which SGLang's fused MoE kernel
  writes as zeros). Flat route indices, the sentinel ``numel``; ``num_tokens_post_pad`` is the
  padded total. As SGLang's kernel, the sentinel is written only with ``pad_sorted_token_ids``;
  without it the route slots are written and the rest of ``sorted_token_ids`` keeps the caller's
  prefill.
* ``moe_fused_gate`` / ``biased_grouped_topk``: ``sigmoid`` scores plus the correction bias for
  the selection, groups ranked by the sum of their best two biased scores, ``topk_group`` of them
  kept, weights the unbiased sigmoid scores; ``moe_fused_gate`` always renormalizes.
  ``num_fused_shared_experts`` ``n``: the last ``n`` of the ``topk`` slots are the shared experts
  ``E .. E + n - 1``, each weighted ``sum(routed weights) / routed_scaling_factor`` before the
  renormalization (which divides by the routed sum only); ``apply_routed_scaling_factor_on_output``
  multiplies the renormalized weights by ``routed_scaling_factor``.
* ``kimi_k2_moe_fused_gate``: the same with one group and no shared experts.

Differences from SGLang (docs/serving.md):

* precision: amdqb computes the sigmoid, the bias add and the weights in fp32 for every input
  dtype (its contract); SGLang's ``moe_fused_gate`` computes the sigmoid and the bias add in the
  input dtype, so for bf16/fp16 logits its selection near ties and its weights (to ~1e-2) differ
  -- ``moe_fused_gate(..., input_dtype_math=True)`` rounds them to the input dtype as SGLang does;
  ``renormalize`` divides by ``sum + 1e-20``;
* order: ids in selection order (biased score descending, expert id ascending on ties); SGLang's
  torch paths use an unsorted top-k;
* ``moe_align_block_size`` writes expert 0 into the ``experts_ids`` blocks past the padded total
  (SGLang leaves them untouched; its callers allocate zeros), leaves ``cumsum_buffer`` untouched
  (SGLang's scratch), skips ids outside ``-1 .. num_experts - 2`` (SGLang's kernel would index
  out of bounds), and orders each expert's routes by route index (SGLang: any order);
* ``biased_grouped_topk`` does not take SGLang's ``expert_location_dispatch_info`` (EPLB's
  logical -> physical map, part of SGLang's runtime).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..ops import layout as _layout
from ..ops import router as _router
from ..ops._checks import ID_DTYPES, check_bool, check_float, check_int, check_tensor

__all__ = [
    "biased_grouped_topk",
    "kimi_k2_moe_fused_gate",
    "moe_align_block_size",
    "moe_fused_gate",
]


def moe_align_block_size(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_size: int,
    sorted_token_ids: torch.Tensor,
    experts_ids: torch.Tensor,
    num_tokens_post_pad: torch.Tensor,
    cumsum_buffer: torch.Tensor,
    pad_sorted_token_ids: bool = False,
) -> None:
    """``sgl_kernel.moe_align_block_size`` into the caller's int32 buffers (see the module
    docstring for the ``num_experts + 1`` EP convention). The buffers must hold the padded total
    of any routing, ``numel + min(numel, num_experts) * (block_size - 1)`` rows (checked from
    their shapes)."""
    check_tensor("topk_ids", topk_ids, dtypes=ID_DTYPES, min_dim=1)
    check_int("num_experts", num_experts, low=1)
    check_int("block_size", block_size, low=1)
    check_tensor("experts_ids", experts_ids, dtypes=(torch.int32,), dim=1)
    check_tensor(
        "cumsum_buffer", cumsum_buffer, dtypes=(torch.int32,), dim=1, device=topk_ids.device
    )
    if cumsum_buffer.numel() < num_experts + 1:
        raise ValueError(
            f"cumsum_buffer must hold num_experts + 1 = {num_experts + 1} ints, "
            f"got {cumsum_buffer.numel()}"
        )
    # bucket id + 1: the EP-filtered routes (-1) become bucket 0, aligned first; blocks carry
    # bucket - 1, 0 past the padded total; ids read in memory order, as SGLang's kernel does
    _layout.align_block_size_into(
        topk_ids,
        block_size,
        num_experts,
        sorted_token_ids,
        experts_ids,
        num_tokens_post_pad,
        id_shift=1,
        owner_shift=1,
        raw_storage=True,
        fill_sentinel=pad_sorted_token_ids,
    )


def _shared_and_routed(
    gating_output: torch.Tensor,
    bias: torch.Tensor,
    topk: int,
    renormalize: bool,
    num_groups: Optional[int],
    group_topk: Optional[int],
    num_fused_shared_experts: int,
    routed_scaling_factor: Optional[float],
    apply_routed_scaling_factor_on_output: bool,
    num_token_non_padded=None,
    input_dtype_math: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's biased (grouped) gate: ``topk - n`` routed experts, then ``n`` shared slots, all
    written by one kernel."""
    check_tensor("gating_output", gating_output, dim=2)
    check_tensor("bias", bias, dim=1)
    check_int("num_fused_shared_experts", num_fused_shared_experts, low=0, high=topk - 1)
    scale = (
        1.0
        if routed_scaling_factor is None
        else check_float("routed_scaling_factor", routed_scaling_factor, finite=True)
    )
    if num_fused_shared_experts and scale == 0.0:
        raise ValueError("routed_scaling_factor must be non-zero with fused shared experts")
    renormalize = check_bool("renormalize", renormalize)
    on_output = renormalize and check_bool(
        "apply_routed_scaling_factor_on_output", apply_routed_scaling_factor_on_output
    )
    # shared experts: (routed sum / scale) / routed sum after the renormalisation (times scale on
    # the output), or the routed sum / scale without it
    shared = {}
    if num_fused_shared_experts:
        if renormalize:
            shared = dict(shared_weight=1.0 if on_output else 1.0 / scale)
        else:
            shared = dict(shared_div=scale)
    weights, ids, _ = _router.serving_topk(
        gating_output,
        topk - num_fused_shared_experts,
        bias,
        score_function="sigmoid",
        renormalize=renormalize,
        scaling_factor=scale if on_output else None,
        num_groups=num_groups,
        group_topk=group_topk,
        num_shared=num_fused_shared_experts,
        non_padded=num_token_non_padded,
        input_dtype_math=input_dtype_math,
        names=("gating_output", "bias"),
        **shared,
    )
    return weights, ids


def moe_fused_gate(
    input_tensor: torch.Tensor,
    bias: torch.Tensor,
    num_expert_group: int,
    topk_group: int,
    topk: int,
    num_fused_shared_experts: int = 0,
    routed_scaling_factor: float = 0,
    apply_routed_scaling_factor_on_output: bool = False,
    *,
    input_dtype_math: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sgl_kernel.moe_fused_gate``: DeepSeek-V3 grouped gate, renormalized;
    ``(topk_weights fp32 [T, topk], topk_ids int32 [T, topk])``. ``input_dtype_math`` (beyond
    SGLang's signature): SGLang's arithmetic for fp16 / bf16 logits -- the sigmoid, the bias, the
    biased scores and the group sums rounded to the input dtype -- instead of amdqb's fp32."""
    check_int("num_expert_group", num_expert_group, low=1)
    check_int("topk", topk, low=1)
    grouped = num_expert_group > 1
    return _shared_and_routed(
        input_tensor,
        bias,
        topk,
        True,
        num_expert_group if grouped else None,
        topk_group if grouped else None,
        num_fused_shared_experts,
        routed_scaling_factor,
        apply_routed_scaling_factor_on_output,
        input_dtype_math=input_dtype_math,
    )


def biased_grouped_topk(
    hidden_states: torch.Tensor,
    gating_output: torch.Tensor,
    correction_bias: torch.Tensor,
    topk: int,
    renormalize: bool,
    num_expert_group: Optional[int] = None,
    topk_group: Optional[int] = None,
    num_fused_shared_experts: int = 0,
    routed_scaling_factor: Optional[float] = None,
    num_token_non_padded: Optional[torch.Tensor] = None,
    expert_location_dispatch_info=None,
    apply_routed_scaling_factor_on_output: Optional[bool] = False,
    *,
    compiled: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sglang.srt.layers.moe.topk.biased_grouped_topk``; rows at or past
    ``num_token_non_padded`` (a device scalar or an int) get ids -1. ``compiled`` (SGLang's
    torch.compile switch of its native path) is accepted and has no effect."""
    del compiled
    check_tensor("gating_output", gating_output, dim=2)
    if isinstance(hidden_states, torch.Tensor) and hidden_states.size(0) != gating_output.size(0):
        raise ValueError(
            f"Number of tokens mismatch: hidden_states has {hidden_states.size(0)} rows, "
            f"gating_output {gating_output.size(0)}"
        )
    if expert_location_dispatch_info is not None:
        raise NotImplementedError(
            "expert_location_dispatch_info (SGLang's EPLB logical -> physical expert map) is not "
            "supported: map the returned ids with SGLang's topk_ids_logical_to_physical"
        )
    check_int("topk", topk, low=1)
    grouped = num_expert_group is not None and num_expert_group > 1
    return _shared_and_routed(
        gating_output,
        correction_bias,
        topk,
        renormalize,
        num_expert_group if grouped else None,
        topk_group if grouped else None,
        num_fused_shared_experts,
        routed_scaling_factor,
        bool(apply_routed_scaling_factor_on_output),
        num_token_non_padded,
    )


def kimi_k2_moe_fused_gate(
    input_tensor: torch.Tensor,
    bias: torch.Tensor,
    topk: int,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    apply_routed_scaling_factor_on_output: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sgl_kernel.kimi_k2_moe_fused_gate``: ungrouped sigmoid + bias gate (Kimi K2);
    ``(topk_weights fp32, topk_ids int32)``. SGLang's kernel is built for 384 experts; any count
    works here."""
    check_int("topk", topk, low=1)
    return _shared_and_routed(
        input_tensor,
        bias,
        topk,
        renormalize,
        None,
        None,
        0,
        routed_scaling_factor,
        apply_routed_scaling_factor_on_output,
    )
