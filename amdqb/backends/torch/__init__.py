"""The ``torch`` backend: the oracles of ``amdqb.ref`` behind the kernel-level op interface.

Always available (CPU and GPU). Results are exactly the oracle's; it is the CPU fallback and the
reference every other backend is compared with.
"""

from __future__ import annotations

import torch

from ... import ref
from ...ref import aux_loss as ref_aux
from ...ref.router import NORM_EPS, activation, qb_cutoff_and_routes, sigmoid_complement
from .. import _serving
from ..calls import AlignCall, RouterCall, TopkCall


def availability(info) -> tuple[bool, str]:
    return True, "pure PyTorch, always available"


def _router_scores(logits, call: RouterCall) -> torch.Tensor:
    """The fp32 scores the oracle ranks, before the bias (``RouterCall.write_scores``)."""
    z = logits.float()
    if call.score_function != "softmax":
        return activation(z, call.score_function)
    return torch.softmax(z, dim=-1) if call.use_pre_softmax else z


def router_fwd(
    call: RouterCall,
    logits,
    expert_bias,
    probs_out,
    map_out,
    qb_histogram,
    qb_bin_bounds,
    scores_out,
    cutoff_out,
):
    call.check_forward(logits, qb_histogram)
    # call.approximate is ignored: the oracle is exact (the approximation is a kernel opt-in)
    with torch.no_grad():
        probs, idx, routing_map = ref.fused_topk_with_score_function(
            logits,
            call.topk,
            use_pre_softmax=call.use_pre_softmax,
            num_groups=call.num_groups,
            group_topk=call.group_topk,
            scaling_factor=call.scaling_factor,
            score_function=call.score_function,
            expert_bias=expert_bias,
            qb_histogram=qb_histogram,
            qb_bin_bounds=qb_bin_bounds,
            selection=call.selection,
            qb_binning=call.qb_binning,
        )
        if call.write_scores or call.write_cutoff:
            scores = _router_scores(logits, call)
        if call.write_cutoff:
            complements = sigmoid_complement(logits) if call.selection == "tie_free" else None
            _, alpha, _ = qb_cutoff_and_routes(
                scores, expert_bias, call.topk, call.selection, complements
            )
            cutoff_out.copy_(alpha)
        if call.write_scores:
            scores_out.copy_(scores)
    probs_out.copy_(probs)
    if call.map_kind == "bytemap":
        map_out.copy_(routing_map)
    elif call.map_kind == "bitmap":
        map_out.copy_(ref.pack_bitmap(routing_map))
    else:
        map_out.copy_(idx)


def router_bwd(call: RouterCall, grad_probs, logits, routed, grad_logits_out):
    """TE's backward formulas, written out (the routed set is given, not re-selected)."""
    call.check(logits)
    score_function, topk = call.score_function, call.topk
    z = logits.float()
    scaling_factor = call.scaling_factor
    g = grad_probs.float() * (1.0 if scaling_factor is None else scaling_factor)
    mask = routed
    if score_function == "softmax":
        if call.use_pre_softmax:
            act = torch.softmax(z, dim=-1)
            g = torch.where(mask, g, 0.0)
            grad = act * (g - (g * act).sum(-1, keepdim=True))
        else:
            masked = torch.where(mask, z, float("-inf"))
            act = torch.where(mask, torch.softmax(masked, dim=-1), 0.0)
            grad = torch.where(mask, act * (g - (g * act).sum(-1, keepdim=True)), 0.0)
        grad_logits_out.copy_(grad)
        return
    act = activation(z, score_function)
    g = torch.where(mask, g, 0.0)
    if topk > 1:
        act_sel = torch.where(mask, act, 0.0)
        denom = act_sel.sum(-1, keepdim=True) + NORM_EPS
        weighted = (g * act_sel).sum(-1, keepdim=True)
        g = torch.where(mask, g / denom - weighted / (denom * denom), 0.0)
    if score_function == "sigmoid":
        g = g * act * (1.0 - act)
    else:  # sqrtsoftplus: d sqrt(softplus(x)) / dx = sigmoid(x) / (2 y)
        dsoft = torch.where(z > 20.0, torch.ones_like(z), torch.sigmoid(z))
        g = g * dsoft / (2.0 * act + NORM_EPS)
    grad_logits_out.copy_(g)


def biased_topk(call: TopkCall, logits, expert_bias, weights_out, ids_out, tei_out, non_padded):
    # the oracle is exact: call.approximate (a kernel opt-in) does not apply
    w, ids = ref.serving_topk(
        logits,
        call.topk,
        expert_bias,
        score_function=call.score_function,
        renormalize=call.renormalize,
        scaling_factor=call.scaling_factor,
        num_groups=call.num_groups,
        group_topk=call.group_topk,
        num_shared=call.num_shared,
        shared_weight=call.shared_weight,
        shared_div=call.shared_div,
        non_padded=non_padded if non_padded is not None else call.non_padded_rows,
        input_dtype_math=call.input_dtype_math,
    )
    weights_out.copy_(w)
    ids_out.copy_(ids)
    if tei_out is not None:
        tei_out.copy_(ref.token_expert_indices(logits.shape[0], call.topk, logits.device))


def qb_recover(histogram, bin_bounds, topk, out, binning="uniform", expert_bias=None):
    out.copy_(ref.qb_recover_bias(histogram, bin_bounds, topk, binning, expert_bias))


def qb_step(
    bias,
    histogram,
    bin_bounds,
    topk,
    ema,
    binning="uniform",
    rejected=None,
    committed=None,
):
    if committed is not None:
        ref.qb.restore_committed(bias, bin_bounds, committed, binning)
    new_bias, new_bounds = ref.qb_step_update(bias, histogram, bin_bounds, topk, ema, binning)
    ok = ref.qb.step_commits(new_bias, new_bounds, histogram, binning)  # on the device: no sync
    bias.copy_(torch.where(ok, new_bias, bias))
    bin_bounds.copy_(torch.where(ok, new_bounds, bin_bounds))
    if rejected is not None:
        rejected.add_((~ok).to(rejected.dtype))
    if committed is not None:
        torch.cat([bias, bin_bounds], out=committed)


def route_rows(
    topk_ids, num_experts, capacity, counters, rows_out, counts_out, deterministic, impl
):
    rows, counts = ref.moe_route_rows(topk_ids, num_experts, capacity, counters)
    rows_out.copy_(rows)
    counts_out.copy_(counts)


def align_block_size(
    call: AlignCall, topk_ids, expert_map, sorted_ids_out, expert_ids_out, num_post_pad_out
):
    # The layout of any buffer length is a prefix of the oracle's, the rest sentinel / expert 0:
    # the op checked that the buffers hold the padded total, so only those fill values are cut.
    ids = _serving.align_buckets(call, topk_ids, expert_map)
    sorted_ids, expert_ids, post = ref.moe_align_block_size(ids, call.block_size, call.num_experts)
    n = min(sorted_ids.numel(), sorted_ids_out.numel())
    if call.fill_sentinel:
        sorted_ids_out.fill_(topk_ids.numel())
        sorted_ids_out[:n].copy_(sorted_ids[:n])
    else:  # the route slots only (route indices lie below the sentinel numel)
        slots = sorted_ids[:n] != topk_ids.numel()
        sorted_ids_out[:n][slots] = sorted_ids[:n][slots]
    nb = min(expert_ids.numel(), expert_ids_out.numel())
    expert_ids_out.zero_()
    expert_ids_out[:nb].copy_(expert_ids[:nb])
    num_post_pad_out.copy_(post)
    _serving.align_finish(call, expert_map, expert_ids_out, num_post_pad_out)


def chunk_row_map(split_sizes, sorted_indices, output_split_sizes, row_map_out, num_in_tokens):
    row_map_out.copy_(
        ref.chunk_row_map(
            split_sizes, sorted_indices, output_split_sizes, row_map_out.numel(), num_in_tokens
        )
    )


def chunk_copy(src, row_map, dst, reverse):
    if reverse:
        valid = (row_map >= 0) & (row_map < dst.shape[0])
        dst.index_copy_(0, row_map[valid].long(), src[valid])
    else:
        dst.copy_(ref.chunks.gather_rows(src, row_map))


def aux_scores_fwd(logits, topk, score_function, scores_out, map_out, map_kind):
    with torch.no_grad():
        routing_map, scores = ref_aux.compute_scores_for_aux_loss(logits, topk, score_function)
    scores_out.copy_(scores)
    map_out.copy_(routing_map if map_kind == "bytemap" else ref.pack_bitmap(routing_map))


def aux_scores_bwd(grad_scores, logits, score_function, grad_logits_out):
    """TE's backward of the aux-loss scores, written out (normalisation over all experts)."""
    z = logits.float()
    g = grad_scores.float()
    if score_function == "softmax":
        act = torch.softmax(z, dim=-1)
        grad_logits_out.copy_(act * (g - (g * act).sum(-1, keepdim=True)))
        return
    act = activation(z, score_function)
    denom = act.sum(-1, keepdim=True) + NORM_EPS
    g = g / denom - (g * act).sum(-1, keepdim=True) / (denom * denom)
    if score_function == "sigmoid":
        g = g * act * (1.0 - act)
    else:  # d sqrt(softplus(x)) / dx = sigmoid(x) / (2 y), sigmoid -> 1 above torch's threshold 20
        dsoft = torch.where(z > 20.0, torch.ones_like(z), torch.sigmoid(z))
        g = g * (dsoft / (2.0 * act + NORM_EPS))
    grad_logits_out.copy_(g)


def aux_loss_fwd(
    probs, tokens_per_expert, total_num_tokens, coeff_host, coeff_prefix, loss_out, coeff_out
):
    if total_num_tokens is not None:
        c = ref_aux.device_coefficient(coeff_prefix, total_num_tokens)
    else:
        c = torch.full((), coeff_host, dtype=torch.float32, device=probs.device)
    loss = ref_aux.aux_loss_sum(probs, tokens_per_expert) * c
    coeff_out[0].copy_(c)
    coeff_out[1].copy_(loss)
    loss_out.copy_(loss)


def aux_loss_bwd(coeff_buf, tokens_per_expert, grad_loss, grad_probs_out):
    row = (coeff_buf[0] * tokens_per_expert.float()) * grad_loss.float()
    grad_probs_out.copy_(row.expand_as(grad_probs_out))


OPS = {
    "router_fwd": router_fwd,
    "router_bwd": router_bwd,
    "biased_topk": biased_topk,
    "qb_recover": qb_recover,
    "qb_step": qb_step,
    "route_rows": route_rows,
    "align_block_size": align_block_size,
    "chunk_row_map": chunk_row_map,
    "chunk_copy": chunk_copy,
    "aux_scores_fwd": aux_scores_fwd,
    "aux_scores_bwd": aux_scores_bwd,
    "aux_loss_fwd": aux_loss_fwd,
    "aux_loss_bwd": aux_loss_bwd,
}
