"""Typed descriptions of kernel-level calls: what an op hands every backend besides the tensors.

A call type is frozen and holds host values only (sizes, modes, constants); the tensors travel
beside it. ``amdqb.ops`` builds one per call after validating its arguments, so a backend never
re-validates and never sees a partially checked configuration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class TopkCall:
    """A serving top-k call (``amdqb.biased_topk`` and the vLLM / SGLang routers of
    ``amdqb.compat``), the backends' ``biased_topk(call, logits, expert_bias, weights_out,
    ids_out, token_expert_indices_out, non_padded)``.

    Tensors: ``logits [T, E]`` (rows may be strided, experts contiguous); ``expert_bias [E]`` fp32,
    fp16 or bf16, or None; ``weights_out fp32 [T, topk + num_shared]``; ``ids_out int32 / int64
    [T, topk + num_shared]``; ``token_expert_indices_out int32 [T, topk]`` or None (``j * T + t``,
    vLLM's ``fused_topk``); ``non_padded`` a device int32 / int64 scalar or None: rows at or past it
    (or past ``non_padded_rows`` when it is None) get ids -1 (SGLang's ``num_token_non_padded``).

    The last ``num_shared`` slots of a row are the fused shared experts ``E .. E + num_shared - 1``
    (SGLang), each weighted ``shared_weight``, or ``routed_sum / shared_div`` when ``shared_div``
    is set (``routed_sum`` the sum of the routed weights before renormalisation, in the order of
    ``amdqb.ref.router.routes_sum``).
    """

    topk: int
    score_function: str = "sigmoid"
    renormalize: bool = True
    scaling_factor: Optional[float] = None
    num_groups: Optional[int] = None
    group_topk: Optional[int] = None
    approximate: bool = False
    num_shared: int = 0
    shared_weight: float = 0.0
    shared_div: Optional[float] = None
    non_padded_rows: Optional[int] = None

    @property
    def out_k(self) -> int:
        """Entries per row of the weights and ids."""
        return self.topk + self.num_shared


ALIGN_MAP_MODES = ("none", "filter", "output")


@dataclass(frozen=True)
class AlignCall:
    """A ``moe_align_block_size`` call with the compat modules' conventions, the backends'
    ``align_block_size(call, topk_ids, expert_map, sorted_ids_out, expert_ids_out,
    num_post_pad_out)``.

    ``topk_ids`` is read as its ``numel`` ids in memory order (int32 / int64). A route with id ``v``
    goes to bucket ``v + id_shift`` (SGLang's EP convention: ``id_shift=1``), or with
    ``map_mode="filter"`` to bucket ``expert_map[v]`` (vLLM's global -> local filter, -1 remote);
    buckets outside ``[0, num_experts)`` are skipped. A used block's expert is its bucket minus
    ``owner_shift`` (``map_mode="output"``: ``expert_map[bucket]``); blocks at or past the padded
    total get ``tail_value`` (``"output"``: ``expert_map[tail_value]``, negative values indexing
    from the end as in PyTorch).
    """

    block_size: int
    num_experts: int
    id_shift: int = 0
    map_mode: str = "none"
    owner_shift: int = 0
    tail_value: int = 0
