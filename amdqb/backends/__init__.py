"""Backends: one folder each. A backend module exposes

* ``availability(info: DeviceInfo) -> (bool, reason)``;
* ``OPS: dict[str, callable]`` keyed by the kernel-level op names below;
* optionally ``LIMITS: dict[str, check]``: the capability check of an op, declared next to its
  launcher, ``check(info, call) -> reason | None`` where ``call`` is the op's call type or request
  (``amdqb.backends.calls``: ``RouterCall`` for the router, ``BiasedTopkRequest``,
  ``RouteRowsRequest``, ... for the others); a reason passes the backend over (the dispatcher runs
  the call on the next backend; ``backend=`` raises naming it). A backend never runs another
  backend itself;
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

``router_fwd(call: RouterCall, logits [T,E], expert_bias fp32 [E]|None, probs_out [T,E],
    map_out, qb_histogram int32 [E,B]|None, qb_bin_bounds fp32 [2]|None, scores_out fp32
    [T,E]|None, cutoff_out fp32 [T]|None) -> None``
    ``call`` is an :class:`amdqb.backends.calls.RouterCall` (every field honoured; its docstring
    says what each means); the tensors are ``calls.ROUTER_FWD_TENSORS`` in order. ``map_out``
    per ``call.map_kind``: ``"bytemap"`` (bool [T,E]), ``"bitmap"`` (uint8 [T,ceil(E/8)]) or
    ``"indices"`` ([T,k] int16/32/64, selection order). Under QB (``call.qb_mode``) the histogram
    accumulates; ``scores_out`` / ``cutoff_out`` are given exactly when ``call.write_scores`` /
    ``call.write_cutoff``.
``router_bwd(call: RouterCall, grad_probs [T,E], logits [T,E], routed bool [T,E],
    grad_logits_out [T,E] fp32) -> None`` (the forward's call; ``calls.ROUTER_BWD_TENSORS``)
``biased_topk(call: TopkCall, logits [T,E] (rows may be strided), expert_bias [E]|None (fp32,
    fp16 or bf16), weights_out fp32 [T,out_k], ids_out int32/int64 [T,out_k], tei_out int32
    [T,k]|None, non_padded int32/int64 scalar|None) -> None``: every output of the peers' fused
    gates (``calls.TOPK_TENSORS``; :class:`amdqb.backends.calls.TopkCall` says what each field
    means: fused shared experts, padded rows, vLLM's ``token_expert_indices``)
``qb_recover(histogram [E,B] int32, bin_bounds fp32, topk, out fp32 [E], binning,
    expert_bias fp32 [E]|None) -> None`` (``bin_bounds``: uniform ``[L, U]``, log_margin the
    per-expert inverse scales [E]; ``expert_bias``: the log_margin binning's current bias, which
    its recovery is relative to; uniform centred, log_margin pinned at a median of 0)
``qb_step(bias fp32 [E], histogram int32 [E,B], bin_bounds fp32 [2]|[E], topk, ema, binning,
    rejected int32 [1]|None, committed fp32 [E+2]|[2E]|None) -> None``
    (in place: bias, bounds; the histogram is left for the caller to zero). ``binning``
    ``"uniform"`` or ``"log_margin"``. A candidate that is not finite (or has invalid bounds), or
    a histogram with a negative (wrapped) count, is not committed, on the device: bias and bounds
    keep their values and ``rejected`` gains one. ``committed`` (the last committed bias then
    bounds): non-finite entries of bias / invalid bounds are first restored from it, and it
    receives the new state.
``route_rows(topk_ids [M,k] int32, num_experts, capacity|None, counters int32 [E] (zeroed by the
    op when the caller passed none), rows_out int32 [M,k], counts_out int32 [E] (zero-filled by
    the op), deterministic, impl "atomic"|"lds") -> None``
``align_block_size(call: AlignCall, topk_ids (numel ids in memory order, int32/int64),
    expert_map [map_len]|None, sorted_ids_out int32, expert_ids_out int32, num_post_pad_out
    int32 [1]) -> None`` (``calls.ALIGN_TENSORS``; :class:`amdqb.backends.calls.AlignCall`:
    vLLM's expert-map filter or block map and tail value, SGLang's shifted buckets)
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
