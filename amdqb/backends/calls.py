"""Descriptions of kernel-level calls: what every backend of an op receives besides the tensors.

A call type is a frozen (hashable, immutable) dataclass built once by the op (``amdqb.ops``) after
validation and handed unchanged to the dispatcher's capability checks and to the backend's entry
point; the tensors follow it positionally in the order of the op's ``*_TENSORS`` tuple. Under
``torch.compile`` the registered custom op (``amdqb._library``) carries the fields flat, in
declaration order, and rebuilds the call inside the op.

The contract of every backend is then ``router_fwd(call: RouterCall, *ROUTER_FWD_TENSORS)``,
``router_bwd(call: RouterCall, *ROUTER_BWD_TENSORS)``, ``biased_topk(call: TopkCall,
*TOPK_TENSORS)`` and ``align_block_size(call: AlignCall, *ALIGN_TENSORS)``
(op_tests/test_backend_contract.py checks every backend's signature and that each field changes
what it computes).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional

# The vocabularies of the calls (this module imports nothing of amdqb, nor torch: the oracles,
# the ops and the path-loaded hip build specification of setup.py all take them from here).
SCORE_FUNCTIONS = ("sigmoid", "softmax", "sqrtsoftplus")
SCORE_CODES = {"sigmoid": 0, "sqrtsoftplus": 1, "softmax": 2}  # the kernels' compile-time codes
SELECTIONS = ("te", "tie_free")
BINNINGS = ("uniform", "log_margin")
MAP_KINDS = ("bytemap", "bitmap", "indices")
QB_MODES = ("two_kernel", "fused_atomic", "auto")


@dataclass(frozen=True)
class RouterCall:
    """One call of the fused router (forward and backward share it).

    * ``num_experts`` E (the logits' last dimension), ``topk`` k;
    * ``score_function`` and ``use_pre_softmax`` (softmax: over all E before Top-k, else Top-k of
      the logits and a softmax over the k), ``num_groups`` / ``group_topk`` (grouped Top-k, both
      None when ungrouped), ``scaling_factor`` (None: 1);
    * ``map_kind``: ``"bytemap"`` (``map_out`` bool [T, E]), ``"bitmap"`` (uint8 [T, ceil(E/8)])
      or ``"indices"`` ([T, k] int16/32/64 in selection order);
    * ``selection``: ``"te"`` ranks by ``s + b``, ``"tie_free"`` by ``b - sigmoid(-z)``;
    * ``approximate``: the kernels' opt-in approximate exponential (the oracle ignores it);
    * ``qb_mode``: None (no Quantile Balancing) or ``"two_kernel"`` / ``"fused_atomic"`` /
      ``"auto"``: the histogram ``qb_histogram`` [E, ``num_bins``] accumulates under bounds
      ``qb_bin_bounds`` with ``qb_binning`` ``"uniform"`` or ``"log_margin"``; ``qb_moments``
      (log_margin): the histogram is ``[3, E, num_bins]``, the counts and the in-bin moments;
    * ``write_scores``: ``scores_out`` fp32 [T, E] receives the scores the selection ranked,
      before the bias (softmax with ``use_pre_softmax``: over E; softmax without: the logits);
    * ``write_cutoff`` (QB only): ``cutoff_out`` fp32 [T] receives each token's cutoff, the
      (k+1)-th selection value.
    """

    num_experts: int
    topk: int
    score_function: str = "sigmoid"
    use_pre_softmax: bool = False
    num_groups: Optional[int] = None
    group_topk: Optional[int] = None
    scaling_factor: Optional[float] = None
    map_kind: str = "bytemap"
    selection: str = "te"
    approximate: bool = False
    qb_mode: Optional[str] = None
    qb_binning: str = "uniform"
    num_bins: int = 0
    qb_moments: bool = False
    write_scores: bool = False
    write_cutoff: bool = False

    def __post_init__(self):
        for name, choices in (
            ("score_function", SCORE_FUNCTIONS),
            ("map_kind", MAP_KINDS),
            ("selection", SELECTIONS),
            ("qb_binning", BINNINGS),
        ):
            if getattr(self, name) not in choices:
                value = getattr(self, name)
                raise ValueError(f"RouterCall.{name} must be one of {choices}, got {value!r}")
        if self.qb_mode is not None and self.qb_mode not in QB_MODES:
            raise ValueError(f"RouterCall.qb_mode must be None or one of {QB_MODES}")
        if (self.qb_mode is None) != (self.num_bins == 0):
            raise ValueError("RouterCall.num_bins is the QB histogram's B (0 without qb_mode)")
        if self.qb_moments and (self.qb_mode is None or self.qb_binning != "log_margin"):
            raise ValueError("RouterCall.qb_moments needs qb_mode with qb_binning='log_margin'")
        if self.write_cutoff and self.qb_mode is None:
            raise ValueError("RouterCall.write_cutoff needs qb_mode (the cutoff is QB's)")
        if (self.num_groups is None) != (self.group_topk is None):
            raise ValueError("RouterCall.num_groups and group_topk go together")

    def check(self, logits) -> None:
        """The expert count against the logits (the first statement of a backend's entry point:
        ``amdqb.ops`` builds consistent calls, direct callers may not)."""
        if logits.shape[-1] != self.num_experts:
            raise ValueError(
                f"RouterCall.num_experts={self.num_experts} but the logits have "
                f"{logits.shape[-1]} experts"
            )

    def check_forward(self, logits, qb_histogram) -> None:
        """:meth:`check`, and the bin count against the QB histogram."""
        self.check(logits)
        planes = 3 if self.qb_moments else 2
        if self.qb and (
            qb_histogram is None
            or qb_histogram.shape[-1] != self.num_bins
            or qb_histogram.dim() != planes
        ):
            got = None if qb_histogram is None else tuple(qb_histogram.shape)
            raise ValueError(
                f"RouterCall.num_bins={self.num_bins}, qb_moments={self.qb_moments} but "
                f"qb_histogram is {got}"
            )

    @property
    def qb(self) -> bool:
        return self.qb_mode is not None

    @property
    def grouped(self) -> bool:
        return self.num_groups is not None

    @property
    def num_selected(self) -> int:
        """Experts selected per token: k, or k + 1 under QB (the cutoff)."""
        return self.topk + (1 if self.qb else 0)


# The tensors that follow the call, in order (None where the call does not use one).
ROUTER_FWD_TENSORS = (
    "logits",  # [T, E] fp32/bf16/fp16, contiguous
    "expert_bias",  # fp32 [E] or None
    "probs_out",  # [T, E] in the logits dtype
    "map_out",  # per call.map_kind
    "qb_histogram",  # int32 [E, B] or, with call.qb_moments, [3, E, B] (accumulated) or None
    "qb_bin_bounds",  # fp32 [2] (uniform) or [E] (log_margin inverse scales), or None
    "scores_out",  # fp32 [T, E] when call.write_scores, else None
    "cutoff_out",  # fp32 [T] when call.write_cutoff, else None
)
ROUTER_BWD_TENSORS = (
    "grad_probs",  # [T, E] any float dtype, contiguous
    "logits",  # [T, E] the forward's logits
    "routed",  # bool [T, E]: the forward's routes
    "grad_logits_out",  # fp32 [T, E]
)


def field_values(call) -> tuple:
    """The fields of a call, in declaration order (the custom ops' flat form)."""
    return tuple(getattr(call, f.name) for f in fields(call))


@dataclass(frozen=True)
class TopkCall:
    """A serving top-k call (``amdqb.biased_topk`` and the vLLM / SGLang routers of
    ``amdqb.compat``): the backends' ``biased_topk(call, *TOPK_TENSORS)``.

    The last ``num_shared`` slots of a row are the fused shared experts ``E .. E + num_shared - 1``
    (SGLang), each weighted ``shared_weight``, or ``routed_sum / shared_div`` when ``shared_div``
    is set (``routed_sum`` the sum of the routed weights before renormalisation, in the order of
    ``amdqb.ref.router.routes_sum``; only with ``renormalize=False`` and no scaling factor). Rows at
    or past the device scalar ``non_padded`` (when given) or ``non_padded_rows`` get ids -1
    (SGLang's ``num_token_non_padded``). ``input_dtype_math`` (fp16 / bf16 logits, sigmoid):
    SGLang's ``moe_fused_gate`` arithmetic -- the sigmoid, the bias, the biased scores and the
    group sums rounded to the logits' dtype; the weights are the rounded scores.
    """

    num_experts: int
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
    input_dtype_math: bool = False

    def __post_init__(self):
        if self.score_function not in SCORE_FUNCTIONS:
            raise ValueError(
                f"TopkCall.score_function must be one of {SCORE_FUNCTIONS}, "
                f"got {self.score_function!r}"
            )
        if (self.num_groups is None) != (self.group_topk is None):
            raise ValueError("TopkCall.num_groups and group_topk go together")

    @property
    def grouped(self) -> bool:
        return self.num_groups is not None

    @property
    def out_k(self) -> int:
        """Entries per row of the weights and ids."""
        return self.topk + self.num_shared


TOPK_TENSORS = (
    "logits",  # [T, E] fp32/bf16/fp16, rows may be strided (experts contiguous)
    "expert_bias",  # [E] fp32/fp16/bf16 or None (selection only)
    "weights_out",  # fp32 [T, out_k]
    "ids_out",  # int32 or int64 [T, out_k]
    "tei_out",  # int32 [T, topk] (vLLM's token_expert_indices, j * T + t) or None
    "non_padded",  # int32 / int64 device scalar or None
)

ALIGN_MAP_MODES = ("none", "filter", "output")


@dataclass(frozen=True)
class AlignCall:
    """A ``moe_align_block_size`` call with the compat modules' conventions: the backends'
    ``align_block_size(call, *ALIGN_TENSORS)``.

    ``topk_ids`` is read as its ``numel`` ids in memory order (int32 / int64). A route with id ``v``
    goes to bucket ``v + id_shift`` (SGLang's EP convention: ``id_shift=1``), or with
    ``map_mode="filter"`` to bucket ``expert_map[v]`` (vLLM's global -> local filter, -1 remote);
    buckets outside ``[0, num_experts)`` are skipped. A used block's expert is its bucket minus
    ``owner_shift`` (``map_mode="output"``: ``expert_map[bucket]``); blocks at or past the padded
    total get ``tail_value`` (``"output"``: ``expert_map[tail_value]``, negative values indexing
    from the end as in PyTorch). ``fill_sentinel=False`` writes only the route slots of
    ``sorted_ids``: the padding keeps the caller's values (SGLang's ``pad_sorted_token_ids=False``,
    whose callers prefill the sentinel).
    """

    num_experts: int
    block_size: int
    id_shift: int = 0
    map_mode: str = "none"
    owner_shift: int = 0
    tail_value: int = 0
    fill_sentinel: bool = True

    def __post_init__(self):
        if self.map_mode not in ALIGN_MAP_MODES:
            raise ValueError(
                f"AlignCall.map_mode must be one of {ALIGN_MAP_MODES}, got {self.map_mode!r}"
            )


ALIGN_TENSORS = (
    "topk_ids",  # int32 / int64, numel ids in memory order
    "expert_map",  # int32 / int64 [map_len] or None (map_mode "filter" / "output")
    "sorted_ids_out",  # int32 [R]
    "expert_ids_out",  # int32 [blocks]
    "num_post_pad_out",  # int32 [1]
)


# ------------------------------------------------------------------------------------------------
# Requests: what the dispatcher's capability checks read of the ops whose backends take plain
# arguments (their entry points are listed in ``amdqb.backends``).
# ------------------------------------------------------------------------------------------------
# route_rows impl="lds" (every backend's): the experts' int32 LDS histogram, padded to a power of
# two, within 16 KiB. Beyond it the op's capacity gate picks "atomic" and impl="lds" is rejected.
LDS_ROUTE_MAX_EXPERTS = 4096


@dataclass(frozen=True)
class RouteRowsRequest:
    num_experts: int = 256
    impl: str = "atomic"  # "atomic" | "lds" (the op's capacity gate chose it)
    deterministic: bool = False


@dataclass(frozen=True)
class QbRequest:
    num_bins: int = 64
    moments: bool = False  # a [3, E, B] log_margin histogram with the in-bin moments


@dataclass(frozen=True)
class ChunkRowMapRequest:
    pass


@dataclass(frozen=True)
class ChunkCopyRequest:
    dtype: str = "torch.float32"


@dataclass(frozen=True)
class AuxScoresRequest:
    num_experts: int = 256
    topk: int = 8
    score_function: str = "softmax"


@dataclass(frozen=True)
class AuxLossRequest:
    cols: int = 256


# The request of every op without features: a representative configuration every backend of the
# op handles (``amdqb info`` reports the choice for it); the ops replace its fields.
DEFAULT_REQUESTS = {
    "router_fwd": RouterCall(256, 8),
    "router_bwd": RouterCall(256, 8),
    "biased_topk": None,  # TopkCall(256, 8): set below
    "qb_recover": QbRequest(),
    "qb_step": QbRequest(),
    "route_rows": RouteRowsRequest(),
    "align_block_size": None,  # AlignCall(256, 64): set below
    "chunk_row_map": ChunkRowMapRequest(),
    "chunk_copy": ChunkCopyRequest(),
    "aux_scores_fwd": AuxScoresRequest(),
    "aux_scores_bwd": AuxScoresRequest(),
    "aux_loss_fwd": AuxLossRequest(),
    "aux_loss_bwd": AuxLossRequest(),
}


DEFAULT_REQUESTS["biased_topk"] = TopkCall(256, 8)
DEFAULT_REQUESTS["align_block_size"] = AlignCall(256, 64)


def request(op: str, **features):
    """The request of ``op``: its default with ``features`` replacing fields (a TypeError names
    a feature the op's request type lacks)."""
    try:
        default = DEFAULT_REQUESTS[op]
    except KeyError:
        raise ValueError(f"unknown op {op!r}; ops: {sorted(DEFAULT_REQUESTS)}") from None
    return replace(default, **features) if features else default
