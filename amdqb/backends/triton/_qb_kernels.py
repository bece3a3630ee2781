"""``@triton.jit`` bodies of the QB update kernels (launchers in ``qb.py``).

Precision: int64 cumulative counts, float64 interpolation and centring (no FP contraction: the
launchers pass ``enable_fp_fusion=False``), fp32 results -- the oracle's arithmetic step for step.
"""

from __future__ import annotations

import triton
import triton.language as tl

# ----------------------------------------------------------------------------------------------
# Quantile Balancing updates
# ----------------------------------------------------------------------------------------------


@triton.jit
def _finite(x):
    return (x == x) & (tl.abs(x) < float("inf"))


@triton.jit
def _bounds(bounds_ptr, committed_ptr, E, MARGIN: tl.constexpr, GUARD: tl.constexpr):
    """The bounds the update reads: under ``GUARD`` the committed ones (``committed[E:]``) when
    the tensor's are invalid for the binning (``amdqb.ref.qb.bounds_are_valid``)."""
    lo = tl.load(bounds_ptr)
    hi = tl.load(bounds_ptr + 1)
    if GUARD:
        if MARGIN:
            ok = (lo > 0) & (lo < float("inf")) & (hi > 0) & (hi < float("inf"))
        else:
            ok = (lo < hi) & (lo > float("-inf")) & (hi < float("inf"))
        lo = tl.where(ok, lo, tl.load(committed_ptr + E))
        hi = tl.where(ok, hi, tl.load(committed_ptr + E + 1))
    return lo, hi


@triton.jit
def _bias(bias_ptr, committed_ptr, idx, m, GUARD: tl.constexpr):
    """The bias the update reads: under ``GUARD`` a non-finite entry is the committed one."""
    b = tl.load(bias_ptr + idx, mask=m, other=0.0)
    if GUARD:
        b = tl.where(_finite(b), b, tl.load(committed_ptr + idx, mask=m, other=0.0))
    return b


@triton.jit
def _qb_rows_kernel(
    hist_ptr,
    bounds_ptr,
    bias_ptr,
    bhat_ptr,
    msum_ptr,
    committed_ptr,
    E,
    B,
    topk,
    ROWS: tl.constexpr,
    BB: tl.constexpr,
    SINGLE: tl.constexpr,
    MARGIN: tl.constexpr,
    MBITS: tl.constexpr,
    GUARD: tl.constexpr,
):
    """App. D recovery of ``ROWS`` experts, uncentred, fp32: int64 cumulative counts, integer
    target ``ceil(m*k/E)``, float64 interpolation. Uniform (``amdqb.ref.qb.recover_uncentred``):
    ``L + position * (U - L) / B``; log_margin (``recover_margin_delta``): ``bias + delta`` with
    the position mapped back through the margin bins. Also writes each row's sum (int64) for the
    empty-histogram test of ``qb_step``. ``GUARD``: bias and bounds are read through the
    committed state (``_bias``, ``_bounds``).

    The first bin whose cumulative count reaches the target is ``beta = #{cum < target}``
    (cum is non-decreasing); the count before it is the largest cum below the target, and the
    cum at beta is the smallest cum at or above it. Compiled without FP fusion so the float64
    arithmetic rounds like the oracle's separate operations.
    """
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rm = r < E
    rbase = r.to(tl.int64) * B
    big = tl.full([ROWS], 9223372036854775807, tl.int64)
    cols = tl.arange(0, BB)
    if SINGLE:
        msk = rm[:, None] & (cols < B)[None, :]
        cnt = tl.load(hist_ptr + rbase[:, None] + cols[None, :], mask=msk, other=0).to(tl.int64)
        cum = tl.cumsum(cnt, 1)
        m = tl.sum(cnt, 1)
        target = (m * topk + E - 1) // E
        lt = msk & (cum < target[:, None])
        beta = tl.sum(lt.to(tl.int64), 1)
        before = tl.max(tl.where(lt, cum, 0), 1)
        first = tl.min(tl.where(msk & (cum >= target[:, None]), cum, big[:, None]), 1)
    else:
        m = tl.zeros([ROWS], dtype=tl.int64)
        for b0 in range(0, B, BB):
            msk = rm[:, None] & ((b0 + cols) < B)[None, :]
            ptrs = hist_ptr + rbase[:, None] + (b0 + cols)[None, :]
            m += tl.sum(tl.load(ptrs, mask=msk, other=0).to(tl.int64), 1)
        target = (m * topk + E - 1) // E
        carry = tl.zeros([ROWS], dtype=tl.int64)
        beta = tl.zeros([ROWS], dtype=tl.int64)
        before = tl.zeros([ROWS], dtype=tl.int64)
        first = big
        for b0 in range(0, B, BB):
            msk = rm[:, None] & ((b0 + cols) < B)[None, :]
            ptrs = hist_ptr + rbase[:, None] + (b0 + cols)[None, :]
            cnt = tl.load(ptrs, mask=msk, other=0).to(tl.int64)
            cum = carry[:, None] + tl.cumsum(cnt, 1)
            lt = msk & (cum < target[:, None])
            beta += tl.sum(lt.to(tl.int64), 1)
            before = tl.maximum(before, tl.max(tl.where(lt, cum, 0), 1))
            ge = msk & (cum >= target[:, None])
            first = tl.minimum(first, tl.min(tl.where(ge, cum, big[:, None]), 1))
            carry += tl.sum(cnt, 1)
    beta = tl.minimum(beta, B - 1)
    h = tl.where(first == big, 0, first - before)
    lower, upper = _bounds(bounds_ptr, committed_ptr, E, MARGIN, GUARD)
    lower = lower.to(tl.float64)
    upper = upper.to(tl.float64)
    q = (m * topk).to(tl.float64) / E
    frac = tl.where(h > 0, (q - before.to(tl.float64)) / tl.maximum(h, 1).to(tl.float64), 0.0)
    frac = tl.minimum(tl.maximum(frac, 0.0), 1.0)
    position = beta.to(tl.float64) + frac
    if MARGIN:
        # key kappa = |p - B/2|, y = 2^o (1 + f) for o, f the parts of kappa / 2^M, then
        # delta = sign * (y - 1) / inv with inv = bounds[1], the multiplier the bins used
        offset = position - (B // 2)
        per_octave = (1 << MBITS) * 1.0
        scaled = tl.abs(offset) / per_octave
        octave = tl.floor(scaled)
        two_o = ((octave.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)
        y = (1.0 + (scaled - octave)) * two_o
        sign = tl.where(offset > 0, 1.0, tl.where(offset < 0, -1.0, 0.0))
        delta = sign * (y - 1.0) / upper
        old = _bias(bias_ptr, committed_ptr, r, rm, GUARD).to(tl.float64)
        bhat = old + tl.where(m > 0, delta, 0.0)
    else:
        bhat = lower + position * ((upper - lower) / B)
        bhat = tl.where(m > 0, bhat, (lower + upper) / 2)
    tl.store(bhat_ptr + r, bhat.to(tl.float32), mask=rm)
    tl.store(msum_ptr + r, m, mask=rm)


@triton.jit(do_not_specialize=["ema_bits", "keep_bits", "rho_bits"])
def _qb_finish_kernel(
    bhat_ptr,
    msum_ptr,
    bias_ptr,
    bounds_ptr,
    out_ptr,
    rejected_ptr,
    committed_ptr,
    E,
    ema_bits,
    keep_bits,
    rho_bits,
    EB: tl.constexpr,
    STEP: tl.constexpr,
    MARGIN: tl.constexpr,
    COUNT: tl.constexpr,
    GUARD: tl.constexpr,
):
    """Single program. Recover: ``out = centre(bhat)``. Step (``amdqb.ref.qb.qb_step_update``):
    ``bias = centre(fp32(ema*old + (1-ema)*centre(bhat)))`` unless the histogram is empty, then
    ``bounds = [min(bias) - 1, max(bias) + 1]`` (log_margin: ``[eps, 1/eps]`` with
    ``eps = rho * (max - min)`` in float64, ``1e-30`` for a spread of 0, the reciprocal of the fp32
    eps). Means are float64 sums of fp32 values. The step commits only a finite bias and finite
    bounds; otherwise bias and bounds keep their values and ``rejected[0]`` (``COUNT``) gains one.
    ``GUARD``: bias and bounds are read through the committed state (``_bias``, ``_bounds``), and
    the state the step leaves is written to ``committed`` (bias, then bounds).

    ``ema``, ``1 - ema`` and ``rho`` arrive as the bits of the host's float64 values (a Python
    float argument would be narrowed to fp32). The candidate bias goes through ``bhat`` (the
    program's own scratch, read back after a barrier).
    """
    acc = tl.zeros([], dtype=tl.float64)
    for c0 in range(0, E, EB):
        idx = c0 + tl.arange(0, EB)
        m = idx < E
        acc += tl.sum(tl.load(bhat_ptr + idx, mask=m, other=0.0).to(tl.float64), 0)
    mean1 = acc / E
    if STEP:
        ema = ema_bits.to(tl.int64).to(tl.float64, bitcast=True)
        keep = keep_bits.to(tl.int64).to(tl.float64, bitcast=True)
        acc2 = tl.zeros([], dtype=tl.float64)
        total = tl.zeros([], dtype=tl.int64)
        for c0 in range(0, E, EB):
            idx = c0 + tl.arange(0, EB)
            m = idx < E
            v = tl.load(bhat_ptr + idx, mask=m, other=0.0).to(tl.float64)
            cen = (v - mean1).to(tl.float32)
            old = _bias(bias_ptr, committed_ptr, idx, m, GUARD)
            mixed = (ema * old.to(tl.float64) + keep * cen.to(tl.float64)).to(tl.float32)
            acc2 += tl.sum(tl.where(m, mixed.to(tl.float64), 0.0), 0)
            total += tl.sum(tl.load(msum_ptr + idx, mask=m, other=0), 0)
        mean2 = acc2 / E
        lo = tl.full([], float("inf"), tl.float32)
        hi = tl.full([], float("-inf"), tl.float32)
        bad = tl.zeros([], dtype=tl.int32)
        for c0 in range(0, E, EB):
            idx = c0 + tl.arange(0, EB)
            m = idx < E
            v = tl.load(bhat_ptr + idx, mask=m, other=0.0).to(tl.float64)
            cen = (v - mean1).to(tl.float32)
            old = _bias(bias_ptr, committed_ptr, idx, m, GUARD)
            mixed = (ema * old.to(tl.float64) + keep * cen.to(tl.float64)).to(tl.float32)
            new = (mixed.to(tl.float64) - mean2).to(tl.float32)
            new = tl.where(total > 0, new, old)
            bad += tl.sum((m & (tl.abs(new) == float("inf")) | (m & (new != new))).to(tl.int32), 0)
            lo = tl.minimum(lo, tl.min(tl.where(m, new, float("inf")), 0))
            hi = tl.maximum(hi, tl.max(tl.where(m, new, float("-inf")), 0))
        tl.debug_barrier()  # every thread has read bhat: it becomes the candidate's scratch
        for c0 in range(0, E, EB):
            idx = c0 + tl.arange(0, EB)
            m = idx < E
            v = tl.load(bhat_ptr + idx, mask=m, other=0.0).to(tl.float64)
            cen = (v - mean1).to(tl.float32)
            old = _bias(bias_ptr, committed_ptr, idx, m, GUARD)
            mixed = (ema * old.to(tl.float64) + keep * cen.to(tl.float64)).to(tl.float32)
            new = (mixed.to(tl.float64) - mean2).to(tl.float32)
            new = tl.where(total > 0, new, old)
            tl.store(bhat_ptr + idx, new, mask=m)
        if MARGIN:
            rho = rho_bits.to(tl.int64).to(tl.float64, bitcast=True)
            spread = hi.to(tl.float64) - lo.to(tl.float64)
            b0 = tl.where(spread > 0, rho * spread, 1e-30).to(tl.float32)
            b1 = (1.0 / b0.to(tl.float64)).to(tl.float32)
            bounds_ok = (b0 > 0) & (b0 < float("inf")) & (b1 > 0) & (b1 < float("inf"))
        else:
            b0 = lo - 1.0
            b1 = hi + 1.0
            bounds_ok = (b0 < b1) & (b0 > float("-inf")) & (b1 < float("inf"))
        ok = (bad == 0) & bounds_ok
        old_lo, old_hi = _bounds(bounds_ptr, committed_ptr, E, MARGIN, GUARD)
        tl.debug_barrier()  # the candidates are in bhat; every thread has read the old state
        for c0 in range(0, E, EB):
            idx = c0 + tl.arange(0, EB)
            m = idx < E
            new = tl.load(bhat_ptr + idx, mask=m, other=0.0)
            old = _bias(bias_ptr, committed_ptr, idx, m, GUARD)
            final = tl.where(ok, new, old)
            tl.store(bias_ptr + idx, final, mask=m)
            if GUARD:
                tl.store(committed_ptr + idx, final, mask=m)
        lo_final = tl.where(ok, b0, old_lo)
        hi_final = tl.where(ok, b1, old_hi)
        tl.store(bounds_ptr, lo_final)
        tl.store(bounds_ptr + 1, hi_final)
        if GUARD:
            tl.store(committed_ptr + E, lo_final)
            tl.store(committed_ptr + E + 1, hi_final)
        if COUNT:
            tl.atomic_add(rejected_ptr, tl.where(ok, 0, 1).to(tl.int32), sem="relaxed")
    else:
        for c0 in range(0, E, EB):
            idx = c0 + tl.arange(0, EB)
            m = idx < E
            v = tl.load(bhat_ptr + idx, mask=m, other=0.0).to(tl.float64)
            tl.store(out_ptr + idx, (v - mean1).to(tl.float32), mask=m)
