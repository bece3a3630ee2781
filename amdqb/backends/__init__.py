"""Backends: one folder each. A backend module exposes

* ``availability(info: DeviceInfo) -> (bool, reason)``;
* ``OPS: dict[str, callable]`` keyed by the kernel-level op names below;
* optionally ``unsupported(op, info, features) -> reason | None`` to decline a configuration (the
  dispatcher then tries the next backend), and ``score_values(logits, score_function)``, the fp32
  activations exactly as its router kernels compute them (tests evaluate the oracle on them);
* optionally ``BuildError``: the exception a backend that builds kernels at run time raises when a
  build fails before anything of the op call has launched; the dispatcher then runs the op on the
  next backend of its order (``amdqb.dispatch``).

The ``torch`` backend is the oracle: exact, but not written for speed and not graph-capturable
(some oracles size outputs from device values). The kernel backends never synchronise.

Kernel-level ops are destination-passing (outputs are preallocated by ``amdqb.ops``), take
tensors that ``amdqb.ops`` has already validated, never synchronise with the host and never
allocate output buffers the caller sees. Tensors arrive contiguous, except the inputs read through
their strides (docs/memory_safety.md): ``chunk_copy``'s ``src`` and the aux-loss ``logits`` /
``probs`` are 2-D with unit-stride rows (any row stride), ``tokens_per_expert`` is any 1-D view.
No output overlaps an input or another output. Signatures:

``router_fwd(logits [T,E], topk, score_function, use_pre_softmax, num_groups, group_topk,
    scaling_factor, expert_bias|None, probs_out [T,E], map_out, map_kind, qb_histogram|None,
    qb_bin_bounds|None, qb_mode|None) -> None``
    ``map_kind``: ``"bytemap"`` (bool [T,E]), ``"bitmap"`` (uint8 [T,ceil(E/8)]) or ``"indices"``
    ([T,k] int16/32/64, selection order).
``router_bwd(grad_probs [T,E], logits [T,E], routed bool [T,E], topk, score_function,
    use_pre_softmax, scaling_factor, grad_logits_out [T,E] fp32) -> None``
``biased_topk(logits [T,E], topk, expert_bias|None, score_function, renormalize, scaling_factor,
    num_groups, group_topk, weights_out fp32 [T,k], ids_out int32 [T,k]) -> None``
``qb_recover(histogram [E,B] int32, bin_bounds fp32 [2], topk, out fp32 [E]) -> None`` (centred)
``qb_step(bias fp32 [E], histogram int32 [E,B], bin_bounds fp32 [2], topk, ema) -> None``
    (in place: bias, bounds; the histogram is left for the caller to zero)
``route_rows(topk_ids [M,k] int32, num_experts, capacity|None, counters int32 [E] (zeroed by the
    op when the caller passed none), rows_out int32 [M,k], counts_out int32 [E] (zero-filled by
    the op), deterministic, impl "atomic"|"lds") -> None``
``align_block_size(topk_ids [M,k] int32, block_size, num_experts, sorted_ids_out, expert_ids_out,
    num_post_pad_out) -> None`` (``expert_map`` is applied by the op)
``chunk_row_map(split_sizes, sorted_indices, output_split_sizes, row_map_out int32,
    num_in_tokens) -> None`` (rows past ``num_in_tokens`` are never mapped)
``chunk_copy(src [N,H], row_map int32 [P], dst, reverse: bool) -> None``
    forward (``reverse=False``): ``dst[p] = src[row_map[p]]`` or 0; reverse: ``dst[row_map[p]] =
    src[p]`` (``dst`` pre-zeroed by the op); entries outside the indexed tensor's rows are 0 /
    skipped (any ``row_map`` is memory-safe).
``aux_scores_fwd(logits [T,E], topk, score_function, scores_out fp32 [T,E], map_out, map_kind)
    -> None``: TE's aux-loss scores (softmax, or the activation normalised over all E) and the
    Top-k map of them; ``map_kind`` ``"bytemap"`` (bool [T,E]) or ``"bitmap"`` (uint8
    [T,ceil(E/8)]).
``aux_scores_bwd(grad_scores fp32 [T,E], logits [T,E], score_function, grad_logits_out [T,E])
    -> None`` (``grad_logits_out`` in the logits dtype; activations recomputed from the logits).
``aux_loss_fwd(probs [R,C], tokens_per_expert [C], total_num_tokens int64 [] | None, coeff_host,
    coeff_prefix, loss_out [] (probs dtype), coeff_out fp32 [2]) -> None``: ``C = coeff_prefix /
    T / T`` in fp32 from the device token count (never read by the host) or ``C = coeff_host``
    when it is None; ``coeff_out = [C, loss]`` (kept for the backward, like TE's ``Const_buf``).
``aux_loss_bwd(coeff_buf fp32 [2], tokens_per_expert [C], grad_loss [], grad_probs_out [R,C])
    -> None``: ``grad_probs[r, c] = (C * tokens_per_expert[c]) * grad_loss``.
"""

OP_NAMES = (
    "router_fwd",
    "router_bwd",
    "biased_topk",
    "qb_recover",
    "qb_step",
    "route_rows",
    "align_block_size",
    "chunk_row_map",
    "chunk_copy",
    "aux_scores_fwd",
    "aux_scores_bwd",
    "aux_loss_fwd",
    "aux_loss_bwd",
)
