"""Pure-PyTorch oracle of the fused Top-k router and its Quantile Balancing (QB) histogram.

Precision contract (identical for every backend):

* logits of any float dtype are cast to fp32 on load; activations, biased scores, selection,
  normalisation, the QB cutoff and the histogram arithmetic are fp32; only ``probs`` is cast to the
  logits dtype on store.
* selection follows ``amdqb.ref.ordering`` (value descending, expert id ascending, NaN lowest).
* activations are torch's (``torch.sigmoid``, ``sqrt(softplus)``, ``torch.softmax``): on a GPU the
  kernels reproduce them bit for bit (softmax while torch uses its warp softmax, E <= 1024 fp32).
* sigmoid / sqrtsoftplus weights: ``p_j = s_j / (sum_selected s + 1e-20)`` for k > 1, ``p = s`` for
  k = 1, then ``* scaling_factor``; the sum runs in the fixed order of :func:`routes_sum`.
  ``expert_bias`` shifts selection only, never the weights.
* QB: Top-(k+1) of ``u = s + b``; the cutoff ``alpha`` is the (k+1)-th entry of that order (so on a
  tie at the cutoff the largest id is the one dropped); the first k are routed. For every expert j:
  ``r = alpha - s_j``, ``scale = fp32(B) / (U - L)``, ``bin = clamp(floor((r - L) * scale), 0, B-1)``
  with a NaN ``r`` counted in bin 0; ``hist[j, bin] += 1`` (the uniform binning). The log_margin
  binning counts the biased margin ``d = alpha - u_j`` on expert j's own log axis instead
  (:func:`qb_margin_bin_index`).

The forward is written with differentiable torch ops, so autograd of this oracle is the reference
backward (TransformerEngine's formulas).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..backends.calls import BINNINGS as BINNINGS
from ..backends.calls import SCORE_FUNCTIONS as SCORE_FUNCTIONS
from ..backends.calls import SELECTIONS as SELECTIONS
from .ordering import ranked_indices

NORM_EPS = 1e-20
WARP = 32


def routes_sum(values: torch.Tensor) -> torch.Tensor:
    """fp32 sum over the last dim in the kernels' fixed order (``[..., 1]``): lane ``l`` of a
    32-lane warp adds entries ``l, l + 32, ...`` left to right, then a butterfly adds lane
    ``l ^ d`` for ``d = 16, 8, 4, 2, 1`` -- TransformerEngine's warp reduction, and torch's warp
    softmax order. Element-wise adds only, so the result is the same on every device."""
    k = values.shape[-1]
    lanes = -(-k // WARP) * WARP
    padded = torch.nn.functional.pad(values.float(), (0, lanes - k))
    rows = padded.reshape(*values.shape[:-1], lanes // WARP, WARP)
    acc = rows[..., 0, :]
    for i in range(1, rows.shape[-2]):
        acc = acc + rows[..., i, :]
    lane = torch.arange(WARP, device=values.device)
    for d in (16, 8, 4, 2, 1):
        acc = acc + acc[..., lane ^ d]
    return acc[..., :1]


def normalise(selected: torch.Tensor) -> torch.Tensor:
    """``s / (routes_sum(s) + 1e-20)``: the sigmoid / sqrtsoftplus weights of the k routes."""
    return selected / (routes_sum(selected) + NORM_EPS)


def activation(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """fp32 scores ``s`` of fp32 ``logits`` (softmax over the last dim)."""
    if score_function == "sigmoid":
        return torch.sigmoid(logits)
    if score_function == "sqrtsoftplus":
        return torch.sqrt(F.softplus(logits))
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1)
    raise ValueError(f"score_function must be one of {SCORE_FUNCTIONS}, got {score_function!r}")


GROUP_RULES = ("te", "serving")


def group_scores(scores: torch.Tensor, topk: int, num_groups: int, group_topk: int, rule: str):
    """fp32 ``[T, num_groups]`` score of every expert group.

    ``"te"`` (TransformerEngine): the sum, in selection order, of the group's best
    ``topk // group_topk`` scores. ``"serving"`` (vLLM / SGLang): the group's best score, or --
    ``biased`` selection scores, i.e. with a correction bias -- the sum of its best two; pass the
    rule ``"serving_biased"`` for that case.
    """
    t, e = scores.shape
    grouped = scores.reshape(t, num_groups, e // num_groups)
    count = {"te": topk // group_topk, "serving": 1, "serving_biased": 2}[rule]
    best = grouped.gather(-1, ranked_indices(grouped, count))
    # an explicit left-to-right sum: torch.sum's reduction order differs between devices (a CUDA
    # tree sum of 4 values is not ((a + b) + c) + d), and the contract fixes selection order
    total = best[..., 0]
    for i in range(1, best.shape[-1]):
        total = total + best[..., i]
    return total


def _group_limited_candidates(
    scores: torch.Tensor,
    topk: int,
    num_groups: int,
    group_topk: int,
    rule: str,
    group_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Mask (True = eligible) of experts inside the ``group_topk`` best groups (:func:`group_scores`;
    groups ranked with the experts' order: score descending, group id ascending). ``group_dtype``:
    the group scores rounded to it (SGLang's moe_fused_gate sums in the input dtype)."""
    t, e = scores.shape
    gs = group_scores(scores, topk, num_groups, group_topk, rule)
    if group_dtype is not None:
        gs = gs.to(group_dtype).float()
    best_groups = ranked_indices(gs, group_topk)
    group_mask = torch.zeros(t, num_groups, dtype=torch.bool, device=scores.device)
    group_mask.scatter_(1, best_groups, True)
    return group_mask.repeat_interleave(e // num_groups, dim=1)


def select_experts(
    selection_scores: torch.Tensor,
    n: int,
    num_groups: int | None = None,
    group_topk: int | None = None,
    topk: int | None = None,
    group_rule: str = "te",
    group_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Indices ``[T, n]`` in selection order, optionally restricted to the best groups."""
    scores = selection_scores.detach()
    if num_groups is not None and group_topk is not None:
        eligible = _group_limited_candidates(
            scores, topk or n, num_groups, group_topk, group_rule, group_dtype
        )
        # Ineligible experts can never be chosen: there are always >= topk eligible ones.
        ranked = ranked_indices(scores, scores.shape[-1])
        keep = eligible.gather(1, ranked)
        order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices
        return ranked.gather(1, order)[:, :n]
    return ranked_indices(scores, n)


def qb_bin_index(
    required_bias: torch.Tensor, bin_bounds: torch.Tensor, num_bins: int
) -> torch.Tensor:
    """int64 bin of each required bias ``r`` with TE's exact fp32 arithmetic (NaN -> bin 0)."""
    lower = bin_bounds[0].float()
    upper = bin_bounds[1].float()
    scale = torch.tensor(float(num_bins), dtype=torch.float32, device=bin_bounds.device) / (
        upper - lower
    )
    x = torch.floor((required_bias.float() - lower) * scale)
    x = torch.where(torch.isnan(x), torch.zeros_like(x), x)
    x = torch.clamp(x, 0.0, float(num_bins - 1))
    return x.to(torch.int64)


def sigmoid_complement(logits: torch.Tensor) -> torch.Tensor:
    """fp32 ``c = sigmoid(-z) = 1 - s`` from the sigmoid's own ``e = exp(-z)``: ``e * s`` for
    ``z >= 0`` (relative precision kept as ``s`` saturates at 1), ``1 - s`` below."""
    z = logits.float()
    e = torch.exp(-z)
    s = 1.0 / (1.0 + e)
    return torch.where(z >= 0, e * s, 1.0 - s)


def selection_values(
    scores: torch.Tensor,
    expert_bias: torch.Tensor,
    selection: str = "te",
    complements: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 values the router ranks: ``u = s + b`` (``"te"``) or ``v = b - c`` with
    ``c = sigmoid(-z)`` (``"tie_free"``: ``u - 1`` in exact arithmetic, the same order, but
    without the ties and rounding of fp32 ``s + b`` once ``s`` saturates). ``complements`` are
    the ``c`` values (tie_free)."""
    if selection == "te":
        return scores + expert_bias.float()
    return expert_bias.float() - complements


def qb_cutoff_and_routes(
    scores: torch.Tensor,
    expert_bias: torch.Tensor,
    topk: int,
    selection: str = "te",
    complements: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Routed indices ``[T, k]`` (selection order), the fp32 cutoff ``alpha`` ``[T]`` (the
    (k+1)-th selection value) and the selection values ``[T, E]``."""
    values = selection_values(scores, expert_bias, selection, complements)
    order = select_experts(values, topk + 1)
    alpha = values.gather(1, order[:, topk : topk + 1]).squeeze(1)
    return order[:, :topk], alpha, values


MARGIN_COARSE_KEYS = 16  # keys a side on the coarse part of the log_margin axis
MARGIN_COARSE_SHIFT = 3  # a coarse key spans 2^3 half-octaves: 4 octaves, 64 octaves in all
MIN_MARGIN_BINS = 64  # 16 fine keys a side (8 octaves: a correction 16x off its scale either way)
MAX_MARGIN_BINS = 256  # the two-kernel histogram stores a bin per byte
# In-bin moments: a fine-key pair's position inside its bin, the top 8 of the 22 fraction bits of
# y (1/256 of a half-octave key: 0.16% of the margin). 0.1% noise on exact corrections moves
# MaxVio one step after a shift from 0.66 to 1.17 (E=256 k=8, logit std 20); 8 bits and 12 bits
# recover that shift alike (peak 0.90 / 0.91, first hit 2 steps after it).
MARGIN_MOMENT_BITS = 8
MARGIN_MOMENT_MAX = (1 << MARGIN_MOMENT_BITS) - 1  # the largest in-bin position


def margin_fine_keys(num_bins: int) -> int:
    """F: the half-octave keys a side next to 0 on the log_margin axis of ``num_bins`` bins
    (``B/2 - 16``; the other 16 keys a side are coarse)."""
    return num_bins // 2 - MARGIN_COARSE_KEYS


def _margin_y_bits(margin: torch.Tensor, margin_scale: torch.Tensor):
    """``(d, bits)``: the fp32 margins and the bits of ``|y|``, ``y = 1 + |d| * inv_j`` in fp32
    (two roundings, no contraction), as int64 -- the bin and the in-bin position both come from
    them (a NaN y from unchecked bounds: the same bits whatever its sign)."""
    d = margin.float()
    y = 1.0 + d.abs() * margin_scale.float()
    return d, y.view(torch.int32).to(torch.int64) & 0x7FFFFFFF


def qb_margin_bin_index(
    margin: torch.Tensor, margin_scale: torch.Tensor, num_bins: int
) -> torch.Tensor:
    """int64 log_margin bin of each biased margin ``d = alpha - u`` ``[T, E]`` (NaN -> bin 0).

    ``margin_scale`` is fp32 ``[E]``: ``inv_j``, the reciprocal of expert j's axis scale.
    ``y = 1 + |d| * inv_j`` in fp32 (two roundings, no contraction);
    ``L = ((bits(y) & 0x7fffffff) >> 22) - 254`` is ``2 log2(y)`` rounded down on the float
    format's piecewise-linear log2 (half-octaves, ``L >= 0``) -- integer operations on the bits,
    the same on every device, no transcendental. The key is ``L`` on the F fine keys
    (:func:`margin_fine_keys`) and ``F + ((L - F) >> 3)`` beyond (coarse keys of 4 octaves),
    at least 0. With ``h = B/2``: ``d > 0`` counts in bin ``h + 1 + min(key, h - 2)``, ``d < 0`` in
    ``h - 1 - min(key, h - 1)`` and ``d == 0`` (the token's own cutoff expert) in bin ``h``, a bin
    of width 0. Bins ascend with d."""
    d, bits = _margin_y_bits(margin, margin_scale)
    # a key clamped at 0 (y >= 1 for every valid scale)
    level = (bits >> 22) - 254
    fine = margin_fine_keys(num_bins)
    key = torch.where(level < fine, level, fine + ((level - fine) >> MARGIN_COARSE_SHIFT))
    half = num_bins // 2
    up = half + 1 + key.clamp(0, half - 2)
    down = half - 1 - key.clamp(0, half - 1)
    bins = torch.where(d > 0, up, torch.where(d < 0, down, torch.full_like(up, half)))
    return torch.where(torch.isnan(d), torch.zeros_like(bins), bins)


def qb_margin_in_bin(
    margin: torch.Tensor, margin_scale: torch.Tensor, num_bins: int
) -> torch.Tensor:
    """int64 ``[T, E]``: each biased margin's position inside its log_margin bin, ``u`` in
    ``[0, 255]`` ascending with ``d`` (the top :data:`MARGIN_MOMENT_BITS` of the 22 fraction bits
    of ``y = 1 + |d| * inv_j`` below its half-octave level; ``255 - u`` for ``d < 0``, whose bins
    descend with ``|d|``), and -1 where the pair is not on a fine key (``d`` zero or NaN, or a
    coarse or clamped key): the pairs whose moments :func:`qb_histogram_counts` adds."""
    d, bits = _margin_y_bits(margin, margin_scale)
    level = (bits >> 22) - 254
    u = (bits >> (22 - MARGIN_MOMENT_BITS)) & MARGIN_MOMENT_MAX
    u = torch.where(d < 0, MARGIN_MOMENT_MAX - u, u)
    fine = (level >= 0) & (level < margin_fine_keys(num_bins)) & (d != 0) & ~torch.isnan(d)
    return torch.where(fine, u, torch.full_like(u, -1))


def qb_histogram_counts(
    scores: torch.Tensor,
    alpha: torch.Tensor,
    bin_bounds: torch.Tensor,
    num_bins: int,
    binning: str = "uniform",
    values: torch.Tensor | None = None,
    moments: bool = False,
) -> torch.Tensor:
    """int32 ``[E, B]`` histogram of one batch: ``"uniform"`` bins ``r = alpha - s`` of the fp32
    scores ``[T, E]`` (:func:`qb_bin_index`, ``bin_bounds = [L, U]``), ``"log_margin"`` bins
    ``d = alpha - values`` of the selection values (:func:`qb_margin_bin_index`, ``bin_bounds``
    the per-expert inverse scales ``[E]``). ``moments`` (log_margin): int64 ``[3, E, B]``, the
    counts, then per bin the sums of ``u`` and of ``u * u`` over its fine-key pairs
    (:func:`qb_margin_in_bin`; integer sums, the same in any order)."""
    t, e = scores.shape
    if binning == "uniform":
        bins = qb_bin_index(alpha[:, None] - scores, bin_bounds, num_bins)
    else:
        bins = qb_margin_bin_index(alpha[:, None] - values, bin_bounds, num_bins)
    flat = bins + torch.arange(e, device=scores.device)[None, :] * num_bins
    # a scatter_add, not torch.bincount: bincount sizes its output from the data (a host sync on
    # a GPU, which breaks graph capture); on the CPU scatter_add is also the faster (46 vs 64 ms
    # for E=896, T=4096, B=1000 on one thread)
    counts = torch.zeros(e * num_bins, dtype=torch.int32, device=scores.device)
    flat = flat.reshape(-1)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    if not moments:
        return counts.reshape(e, num_bins)
    u = qb_margin_in_bin(alpha[:, None] - values, bin_bounds, num_bins).reshape(-1)
    u = torch.where(u >= 0, u, 0)
    sums = torch.zeros(2, e * num_bins, dtype=torch.int64, device=scores.device)
    sums[0].scatter_add_(0, flat, u)
    sums[1].scatter_add_(0, flat, u * u)
    return torch.cat([counts[None].to(torch.int64), sums]).reshape(3, e, num_bins)


def fused_topk_with_score_function(
    logits: torch.Tensor,
    topk: int,
    use_pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    score_function: str = "sigmoid",
    expert_bias: torch.Tensor | None = None,
    qb_histogram: torch.Tensor | None = None,
    qb_bin_bounds: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
    selection: str = "te",
    qb_binning: str = "uniform",
    complements: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Oracle router on ``[T, E]`` logits: ``(probs fp32 [T,E], routed_idx [T,k], routing_map bool)``.

    ``probs`` is fp32 here (the op casts it); it is differentiable w.r.t. ``logits``. When
    ``qb_histogram`` is given it is accumulated in place (``[3, E, B]``: with the log_margin
    in-bin moments, :func:`qb_histogram_counts`). ``scores`` / ``complements`` let a test
    evaluate the oracle on a kernel's own fp32 activations ``s`` and ``c = sigmoid(-z)``
    (selection and histogram only; no gradient). ``selection="tie_free"`` (sigmoid with a bias)
    ranks by ``b - c`` instead of ``s + b``.
    """
    if selection == "tie_free" and complements is None:
        complements = sigmoid_complement(logits)
    z = logits.float()
    if scores is None:
        act_for_weights = activation(z, score_function) if score_function != "softmax" else None
    else:
        act_for_weights = scores.float()
    t, e = z.shape

    if qb_histogram is not None:
        s = act_for_weights
        idx, alpha, values = qb_cutoff_and_routes(
            s.detach(), expert_bias, topk, selection, complements
        )
        qb_histogram += qb_histogram_counts(
            s.detach(),
            alpha,
            qb_bin_bounds,
            qb_histogram.shape[-1],
            qb_binning,
            values,
            moments=qb_histogram.dim() == 3,
        )
        selected = s.gather(1, idx)
        selected = normalise(selected) if topk > 1 else selected
    elif score_function == "softmax":
        if use_pre_softmax:
            act = torch.softmax(z, dim=-1)
            idx = select_experts(act, topk, num_groups, group_topk, topk)
            selected = act.gather(1, idx)
        else:
            idx = select_experts(z, topk, num_groups, group_topk, topk)
            selected = torch.softmax(z.gather(1, idx), dim=-1)
    else:
        s = act_for_weights
        if expert_bias is None:
            sel_scores = s
        else:
            sel_scores = selection_values(s.detach(), expert_bias, selection, complements)
        idx = select_experts(sel_scores, topk, num_groups, group_topk, topk)
        selected = s.gather(1, idx)
        selected = normalise(selected) if topk > 1 else selected

    if scaling_factor is not None:
        selected = selected * scaling_factor
    probs = torch.zeros(t, e, dtype=torch.float32, device=z.device).scatter(1, idx, selected)
    routing_map = torch.zeros(t, e, dtype=torch.bool, device=z.device)
    routing_map.scatter_(1, idx, True)
    return probs, idx, routing_map


def biased_topk(
    logits: torch.Tensor,
    topk: int,
    expert_bias: torch.Tensor | None = None,
    score_function: str = "sigmoid",
    renormalize: bool = True,
    scaling_factor: float | None = None,
    num_groups: int | None = None,
    group_topk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Serving-form oracle (vLLM's ``fused_topk`` / ``fused_topk_bias`` / ``grouped_topk``,
    SGLang's ``biased_grouped_topk``): ``(weights fp32 [T,k], ids int32 [T,k])``, ids in
    selection order.

    Scores are the activation over all experts (softmax over E, or sigmoid / sqrtsoftplus); the
    correction bias ``expert_bias`` is added for selection only. Groups are ranked by the
    ``"serving"`` rule of :func:`group_scores` (best biased score, or the sum of the best two with
    a bias). The weights are the unbiased scores of the selected experts; ``renormalize`` divides
    them by their sum ``+ 1e-20`` (:func:`routes_sum` order); ``scaling_factor`` multiplies last.
    """
    z = logits.float()
    s = activation(z, score_function)
    sel_scores = s if expert_bias is None else s + expert_bias.float()
    rule = "serving" if expert_bias is None else "serving_biased"
    idx = select_experts(sel_scores, topk, num_groups, group_topk, topk, group_rule=rule)
    w = s.gather(1, idx)
    if renormalize:
        w = normalise(w)
    if scaling_factor is not None:
        w = w * scaling_factor
    return w, idx.to(torch.int32)


def serving_topk(
    logits: torch.Tensor,
    topk: int,
    expert_bias: torch.Tensor | None = None,
    score_function: str = "sigmoid",
    renormalize: bool = True,
    scaling_factor: float | None = None,
    num_groups: int | None = None,
    group_topk: int | None = None,
    *,
    num_shared: int = 0,
    shared_weight: float = 0.0,
    shared_div: float | None = None,
    non_padded=None,
    input_dtype_math: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`biased_topk` with the outputs of the peers' fused gates (amdqb.backends.calls.TopkCall):
    ``(weights fp32 [T, topk + num_shared], ids int64 [T, topk + num_shared])``.

    The last ``num_shared`` slots are the fused shared experts ``E .. E + num_shared - 1`` with
    weight ``shared_weight``, or ``routed_sum / shared_div`` (``routed_sum`` the
    :func:`routes_sum` of the routed weights before renormalisation); rows at or past
    ``non_padded`` (an int or a device scalar) get ids -1. The bias may be fp16 / bf16: it is
    converted to fp32 first. ``input_dtype_math``: SGLang's moe_fused_gate arithmetic for fp16 /
    bf16 logits -- the scores, the bias, the biased scores and the group sums rounded to the
    logits' dtype (the weights are the rounded scores)."""
    z = logits.float()
    s = activation(z, score_function)
    bias = None if expert_bias is None else expert_bias.float()
    low = logits.dtype if input_dtype_math and logits.dtype != torch.float32 else None
    if low is not None:
        s = s.to(low).float()
        bias = None if bias is None else bias.to(low).float()
    sel_scores = s if bias is None else s + bias
    if low is not None:
        sel_scores = sel_scores.to(low).float()
    rule = "serving" if bias is None else "serving_biased"
    idx = select_experts(
        sel_scores, topk, num_groups, group_topk, topk, group_rule=rule, group_dtype=low
    )
    w = s.gather(1, idx)
    routed_sum = routes_sum(w)
    if renormalize:
        w = w / (routed_sum + NORM_EPS)
    if scaling_factor is not None:
        w = w * scaling_factor
    ids = idx
    if num_shared:
        t, e = z.shape
        if shared_div is not None:
            shared_w = (routed_sum / shared_div).expand(t, num_shared)
        else:
            shared_w = torch.full((t, num_shared), shared_weight, device=z.device)
        shared_ids = torch.arange(e, e + num_shared, device=z.device).expand(t, num_shared)
        w = torch.cat([w, shared_w], dim=1)
        ids = torch.cat([ids, shared_ids], dim=1)
    if non_padded is not None:
        rows = torch.arange(ids.shape[0], device=ids.device)
        ids = ids.masked_fill((rows >= non_padded).unsqueeze(1), -1)
    return w, ids


def token_expert_indices(tokens: int, topk: int, device=None) -> torch.Tensor:
    """vLLM's ``token_expert_indices`` int32 ``[T, k]``: ``j * T + t``."""
    return torch.arange(topk * tokens, dtype=torch.int32, device=device).view(topk, tokens).t()


def pack_bitmap(routing_map: torch.Tensor) -> torch.Tensor:
    """bool ``[..., E]`` -> uint8 ``[..., ceil(E/8)]``, bit ``e % 8`` of byte ``e // 8`` (LSB first)."""
    *lead, e = routing_map.shape
    nbytes = (e + 7) // 8
    padded = torch.zeros(*lead, nbytes * 8, dtype=torch.uint8, device=routing_map.device)
    padded[..., :e] = routing_map.to(torch.uint8)
    weights = (2 ** torch.arange(8, device=routing_map.device, dtype=torch.int32)).to(torch.uint8)
    return (padded.reshape(*lead, nbytes, 8) * weights).sum(-1, dtype=torch.int32).to(torch.uint8)


def unpack_bitmap(bitmap: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Inverse of :func:`pack_bitmap`."""
    bits = torch.arange(8, device=bitmap.device, dtype=torch.int32)
    unpacked = (bitmap.to(torch.int32)[..., None] >> bits) & 1
    return unpacked.reshape(*bitmap.shape[:-1], -1)[..., :num_experts].bool()
