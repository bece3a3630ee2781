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
def _qb_rows_kernel(
    hist_ptr,
    bounds_ptr,
    bhat_ptr,
    msum_ptr,
    E,
    B,
    topk,
    ROWS: tl.constexpr,
    BB: tl.constexpr,
    SINGLE: tl.constexpr,
):
    """App. D recovery of ``ROWS`` experts, uncentred, fp32 (``amdqb.ref.qb.recover_uncentred``):
    int64 cumulative counts, integer target ``ceil(m*k/E)``, float64 interpolation. Also writes
    each row's sum (int64) for the empty-histogram test of ``qb_step``.

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
    lower = tl.load(bounds_ptr).to(tl.float64)
    upper = tl.load(bounds_ptr + 1).to(tl.float64)
    q = (m * topk).to(tl.float64) / E
    frac = tl.where(h > 0, (q - before.to(tl.float64)) / tl.maximum(h, 1).to(tl.float64), 0.0)
    frac = tl.minimum(tl.maximum(frac, 0.0), 1.0)
    width = (upper - lower) / B
    bhat = lower + (beta.to(tl.float64) + frac) * width
    bhat = tl.where(m > 0, bhat, (lower + upper) / 2)
    tl.store(bhat_ptr + r, bhat.to(tl.float32), mask=rm)
    tl.store(msum_ptr + r, m, mask=rm)


@triton.jit(do_not_specialize=["ema_bits", "keep_bits"])
def _qb_finish_kernel(
    bhat_ptr,
    msum_ptr,
    bias_ptr,
    bounds_ptr,
    out_ptr,
    E,
    ema_bits,
    keep_bits,
    EB: tl.constexpr,
    STEP: tl.constexpr,
):
    """Single program. Recover: ``out = centre(bhat)``. Step (``amdqb.ref.qb.qb_step_update``):
    ``bias = centre(fp32(ema*old + (1-ema)*centre(bhat)))`` unless the histogram is empty, then
    ``bounds = [min(bias) - 1, max(bias) + 1]``. Means are float64 sums of fp32 values.

    ``ema`` and ``1 - ema`` arrive as the bits of the host's float64 values (a Python float
    argument would be narrowed to fp32). Chunks of ``EB`` are recomputed in each pass instead of
    being stored and re-read, which would need a barrier between threads.
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
            old = tl.load(bias_ptr + idx, mask=m, other=0.0)
            mixed = (ema * old.to(tl.float64) + keep * cen.to(tl.float64)).to(tl.float32)
            acc2 += tl.sum(tl.where(m, mixed.to(tl.float64), 0.0), 0)
            total += tl.sum(tl.load(msum_ptr + idx, mask=m, other=0), 0)
        mean2 = acc2 / E
        lo = tl.full([], float("inf"), tl.float32)
        hi = tl.full([], float("-inf"), tl.float32)
        for c0 in range(0, E, EB):
            idx = c0 + tl.arange(0, EB)
            m = idx < E
            v = tl.load(bhat_ptr + idx, mask=m, other=0.0).to(tl.float64)
            cen = (v - mean1).to(tl.float32)
            old = tl.load(bias_ptr + idx, mask=m, other=0.0)
            mixed = (ema * old.to(tl.float64) + keep * cen.to(tl.float64)).to(tl.float32)
            new = (mixed.to(tl.float64) - mean2).to(tl.float32)
            new = tl.where(total > 0, new, old)
            tl.store(bias_ptr + idx, new, mask=m)
            lo = tl.minimum(lo, tl.min(tl.where(m, new, float("inf")), 0))
            hi = tl.maximum(hi, tl.max(tl.where(m, new, float("-inf")), 0))
        tl.store(bounds_ptr, lo - 1.0)
        tl.store(bounds_ptr + 1, hi + 1.0)
    else:
        for c0 in range(0, E, EB):
            idx = c0 + tl.arange(0, EB)
            m = idx < E
            v = tl.load(bhat_ptr + idx, mask=m, other=0.0).to(tl.float64)
            tl.store(out_ptr + idx, (v - mean1).to(tl.float32), mask=m)
