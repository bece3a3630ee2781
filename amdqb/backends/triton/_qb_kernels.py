"""``@triton.jit`` bodies of the QB update kernels (launchers in ``qb.py``).

Precision: int64 cumulative counts, float64 interpolation and centring (no FP contraction: the
launchers pass ``enable_fp_fusion=False``), fp32 results -- the oracle's arithmetic step for step
(``amdqb.ref.qb``). The log_margin scale update is integer arithmetic on the float64 exponents.
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
def _bounds(bounds_ptr, committed_ptr, E, GUARD: tl.constexpr):
    """The uniform bounds ``[L, U]`` the update reads: under ``GUARD`` the committed ones
    (``committed[E:]``) when the tensor's are not finite with ``L < U``
    (``amdqb.ref.qb.bounds_are_valid``)."""
    lo = tl.load(bounds_ptr)
    hi = tl.load(bounds_ptr + 1)
    if GUARD:
        ok = (lo < hi) & (lo > float("-inf")) & (hi < float("inf"))
        lo = tl.where(ok, lo, tl.load(committed_ptr + E))
        hi = tl.where(ok, hi, tl.load(committed_ptr + E + 1))
    return lo, hi


@triton.jit
def _scale(bounds_ptr, committed_ptr, E, idx, m, GUARD: tl.constexpr):
    """log_margin: the inverse scales of experts ``idx``; under ``GUARD`` an entry that is not
    finite and positive is the committed one (``committed[E + idx]``)."""
    v = tl.load(bounds_ptr + idx, mask=m, other=1.0)
    if GUARD:
        ok = (v > 0) & (v < float("inf"))
        v = tl.where(ok, v, tl.load(committed_ptr + E + idx, mask=m, other=1.0))
    return v


@triton.jit
def _bias(bias_ptr, committed_ptr, idx, m, GUARD: tl.constexpr):
    """The bias the update reads: under ``GUARD`` a non-finite entry is the committed one."""
    b = tl.load(bias_ptr + idx, mask=m, other=0.0)
    if GUARD:
        b = tl.where(_finite(b), b, tl.load(committed_ptr + idx, mask=m, other=0.0))
    return b


@triton.jit
def _order_key(x):
    """fp32 ``x`` (zeros as +0) as an int64 in ``[0, 2^32)`` that orders like the floats."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) + 2147483648


@triton.jit
def _candidate(
    bhat_ptr, bias_ptr, committed_ptr, idx, m, ema, keep, MIX: tl.constexpr, GUARD: tl.constexpr
):
    """log_margin: the fp32 value the median is taken of -- ``bhat`` (recover) or
    ``fp32(ema * old + (1 - ema) * bhat)`` (``MIX``: the step)."""
    v = tl.load(bhat_ptr + idx, mask=m, other=0.0)
    if MIX:
        old = _bias(bias_ptr, committed_ptr, idx, m, GUARD)
        v = (ema * old.to(tl.float64) + keep * v.to(tl.float64)).to(tl.float32)
    return v


@triton.jit
def _lower_median(
    bhat_ptr,
    bias_ptr,
    committed_ptr,
    E,
    ema,
    keep,
    EB: tl.constexpr,
    MIX: tl.constexpr,
    GUARD: tl.constexpr,
):
    """The ``(E - 1) // 2``-th smallest candidate (``amdqb.ref.qb.lower_median``), fp32: a radix
    select on the order keys, one bit a pass (32 passes), exact and deterministic. With E <= EB
    (E <= 4096) the keys are computed once and every pass counts them in registers; beyond, each
    pass recomputes them a chunk at a time."""
    rank = (E - 1) // 2
    found = tl.zeros([], dtype=tl.int64)
    if E <= EB:
        idx = tl.arange(0, EB)
        m = idx < E
        v = _candidate(bhat_ptr, bias_ptr, committed_ptr, idx, m, ema, keep, MIX, GUARD)
        keys = tl.where(m, _order_key(v), 1 << 33)  # padding above every key: never counted
        for bit in range(31, -1, -1):
            trial = found | (tl.full([], 1, tl.int64) << bit)
            below = tl.sum((keys < trial).to(tl.int64), 0)
            found = tl.where(below <= rank, trial, found)
    else:
        for bit in range(31, -1, -1):
            trial = found | (tl.full([], 1, tl.int64) << bit)
            below = tl.zeros([], dtype=tl.int64)
            for c0 in range(0, E, EB):
                idx = c0 + tl.arange(0, EB)
                m = idx < E
                v = _candidate(bhat_ptr, bias_ptr, committed_ptr, idx, m, ema, keep, MIX, GUARD)
                below += tl.sum((m & (_order_key(v) < trial)).to(tl.int64), 0)
            found = tl.where(below <= rank, trial, found)
    key = (found - 2147483648).to(tl.int32)
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _pin(v, mid, SPREAD: tl.constexpr):
    """``amdqb.ref.qb.pin_median`` of the float64 ``v`` about the fp32 median ``mid``."""
    x = (v - mid.to(tl.float64)) + 0.0
    return tl.minimum(tl.maximum(x, -SPREAD / 2), SPREAD / 2).to(tl.float32)


@triton.jit
def _exponent(x):
    """floor(log2 |x|) of a float64 from its exponent field (-1023 for 0 and subnormals)."""
    return ((x.to(tl.int64, bitcast=True) >> 52) & 0x7FF) - 1023


@triton.jit
def _qb_rows_kernel(
    hist_ptr,
    bounds_ptr,
    bias_ptr,
    bhat_ptr,
    msum_ptr,
    scale_ptr,
    committed_ptr,
    E,
    B,
    topk,
    ROWS: tl.constexpr,
    BB: tl.constexpr,
    SINGLE: tl.constexpr,
    MARGIN: tl.constexpr,
    FINE: tl.constexpr,  # log_margin: the fine keys a side (amdqb.ref.router.margin_fine_keys)
    MOMENTS: tl.constexpr,  # log_margin: int64 [3, E, B], the in-bin moments after the counts
    MBITS: tl.constexpr,  # the in-bin position's bits (amdqb.ref.router.MARGIN_MOMENT_BITS)
    GUARD: tl.constexpr,
    ZOOM: tl.constexpr,  # log_margin scale update (amdqb.ref.qb.margin_scale_update)
    DECAY: tl.constexpr,
    INV_MIN: tl.constexpr,
    INV_MAX: tl.constexpr,
):
    """App. D recovery of ``ROWS`` experts, uncentred, fp32: int64 cumulative counts, integer
    target ``ceil(m*k/E)``, float64 interpolation. Uniform (``amdqb.ref.qb.recover_uncentred``):
    ``L + position * (U - L) / B``; log_margin (``recover_margin_delta``): ``bias + delta`` with
    the position mapped back through the expert's margin bins, and the expert's next inverse
    scale (``margin_scale_update``) into ``scale``. Writes each row's sum (int64; -1 for a row
    holding a negative count, which rejects the step). ``GUARD``: bias and bounds are read
    through the committed state (``_bias``, ``_bounds``, ``_scale``).

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
        negative = tl.min(cnt, 1) < 0
        target = (m * topk + E - 1) // E
        lt = msk & (cum < target[:, None])
        beta = tl.sum(lt.to(tl.int64), 1)
        before = tl.max(tl.where(lt, cum, 0), 1)
        first = tl.min(tl.where(msk & (cum >= target[:, None]), cum, big[:, None]), 1)
    else:
        m = tl.zeros([ROWS], dtype=tl.int64)
        low = tl.zeros([ROWS], dtype=tl.int64)
        for b0 in range(0, B, BB):
            msk = rm[:, None] & ((b0 + cols) < B)[None, :]
            ptrs = hist_ptr + rbase[:, None] + (b0 + cols)[None, :]
            cnt = tl.load(ptrs, mask=msk, other=0).to(tl.int64)
            m += tl.sum(cnt, 1)
            low = tl.minimum(low, tl.min(cnt, 1))
        negative = low < 0
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
    q = (m * topk).to(tl.float64) / E
    frac = tl.where(h > 0, (q - before.to(tl.float64)) / tl.maximum(h, 1).to(tl.float64), 0.0)
    frac = tl.minimum(tl.maximum(frac, 0.0), 1.0)
    if MOMENTS:
        # amdqb.ref.qb.refine_in_bin: the fraction inside a fine-key bin from its moments, the
        # quantile of a uniform distribution with the bin's mean and variance
        half = B // 2
        on_fine = ((beta >= half - FINE) & (beta < half)) | ((beta > half) & (beta <= half + FINE))
        on_fine = on_fine & (h > 0) & rm
        at = hist_ptr + E * B + rbase + beta
        s1 = tl.load(at, mask=on_fine, other=0).to(tl.float64)
        s2 = tl.load(at + E * B, mask=on_fine, other=0).to(tl.float64)
        n = tl.maximum(h, 1).to(tl.float64)
        mean = s1 / n
        second = s2 / n
        # the positions' unit, 2^MBITS (a power of two: the divisions are exact scalings)
        mu = (mean + 0.5) / (1 << MBITS)
        var = tl.maximum(second - mean * mean, 0.0) / ((1 << MBITS) * (1 << MBITS))
        refined = mu + (frac - 0.5) * 2.0 * tl.sqrt(3.0 * var)  # f64: IEEE on both vendors
        refined = tl.minimum(tl.maximum(refined, 0.0), 1.0)
        frac = tl.where(on_fine, refined, frac)
    position = beta.to(tl.float64) + frac
    if MARGIN:
        # the zero bin [h, h+1) is delta = 0; kappa: the key position away from 0; level: the
        # half-octave of y = 1 + |d| * inv (8 per coarse key); y = 2^o (1 + f), o, f of level/2
        offset = position - (B // 2)
        up = offset >= 1.0
        kappa = tl.maximum(tl.where(up, offset - 1.0, -offset), 0.0)
        level = tl.where(kappa < FINE, kappa, FINE + (kappa - FINE) * 8.0)
        octave = tl.floor(level / 2.0)
        two_o = ((octave.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)
        y = (1.0 + (level / 2.0 - octave)) * two_o
        inv = _scale(bounds_ptr, committed_ptr, E, r, rm, GUARD)
        magnitude = (y - 1.0) / inv.to(tl.float64)
        delta = tl.where(up, magnitude, tl.where(offset >= 0.0, 0.0, -magnitude))
        delta = tl.where(m > 0, delta, 0.0)
        old = _bias(bias_ptr, committed_ptr, r, rm, GUARD).to(tl.float64)
        bhat = old + delta
        # next scale: n = min(ZOOM - floor(log2|delta|), floor(log2 inv) + DECAY), clamped
        wider = tl.where(delta != 0.0, ZOOM - _exponent(delta), INV_MAX)
        n = tl.minimum(wider, _exponent(inv.to(tl.float64)) + DECAY)
        n = tl.minimum(tl.maximum(n, INV_MIN), INV_MAX)
        new_inv = ((n + 127) << 23).to(tl.int32).to(tl.float32, bitcast=True)
        tl.store(scale_ptr + r, new_inv, mask=rm)
    else:
        lower, upper = _bounds(bounds_ptr, committed_ptr, E, GUARD)
        lower = lower.to(tl.float64)
        upper = upper.to(tl.float64)
        bhat = lower + position * ((upper - lower) / B)
        bhat = tl.where(m > 0, bhat, (lower + upper) / 2)
    tl.store(bhat_ptr + r, bhat.to(tl.float32), mask=rm)
    tl.store(msum_ptr + r, tl.where(negative, -1, m), mask=rm)


@triton.jit(do_not_specialize=["ema_bits", "keep_bits"])
def _qb_finish_kernel(
    bhat_ptr,
    msum_ptr,
    scale_ptr,
    bias_ptr,
    bounds_ptr,
    out_ptr,
    rejected_ptr,
    committed_ptr,
    E,
    ema_bits,
    keep_bits,
    EB: tl.constexpr,
    STEP: tl.constexpr,
    MARGIN: tl.constexpr,
    COUNT: tl.constexpr,
    GUARD: tl.constexpr,
    SPREAD: tl.constexpr,  # log_margin: the spread cap (amdqb.ref.qb.BIAS_SPREAD_MAX)
):
    """Single program. Recover: ``out = centre(bhat)`` (log_margin: ``pin_median(bhat)``).
    Step (``amdqb.ref.qb.qb_step_update``), unless the histogram is empty:
    uniform ``bias = centre(fp32(ema*old + (1-ema)*centre(bhat)))``, bounds
    ``[min(bias) - 1, max(bias) + 1]``; log_margin ``bias = pin_median(fp32(ema*old +
    (1-ema)*bhat))``, bounds the rows kernel's new scales. Means and differences are float64 of
    fp32 values. The step commits only a finite bias, valid bounds and a histogram without a
    negative count (``msum < 0``); otherwise bias and bounds keep their values and
    ``rejected[0]`` (``COUNT``) gains one. ``GUARD``: bias and bounds are read through the
    committed state, and the state the step leaves is written to ``committed`` (bias, bounds).

    ``ema`` and ``1 - ema`` arrive as the bits of the host's float64 values (a Python float
    argument would be narrowed to fp32). The candidate bias goes through ``bhat`` (the program's
    own scratch, read back after a barrier).
    """
    acc = tl.zeros([], dtype=tl.float64)
    total = tl.zeros([], dtype=tl.int64)
    negative = tl.zeros([], dtype=tl.int32)
    for c0 in range(0, E, EB):
        idx = c0 + tl.arange(0, EB)
        m = idx < E
        v = tl.load(bhat_ptr + idx, mask=m, other=0.0)
        acc += tl.sum(v.to(tl.float64), 0)
        rows = tl.load(msum_ptr + idx, mask=m, other=0)
        total += tl.sum(tl.maximum(rows, 0), 0)
        negative += tl.sum((rows < 0).to(tl.int32), 0)
    mean1 = acc / E
    if not STEP:
        if MARGIN:
            mid = _lower_median(bhat_ptr, bias_ptr, committed_ptr, E, 0.0, 1.0, EB, False, GUARD)
        for c0 in range(0, E, EB):
            idx = c0 + tl.arange(0, EB)
            m = idx < E
            v = tl.load(bhat_ptr + idx, mask=m, other=0.0).to(tl.float64)
            if MARGIN:
                res = _pin(v, mid, SPREAD)
            else:
                res = (v - mean1).to(tl.float32)
            tl.store(out_ptr + idx, res, mask=m)
    else:
        ema = ema_bits.to(tl.int64).to(tl.float64, bitcast=True)
        keep = keep_bits.to(tl.int64).to(tl.float64, bitcast=True)
        # the level the mixed values are centred on: the float64 mean (uniform) or the fp32
        # lower median (log_margin)
        acc2 = tl.zeros([], dtype=tl.float64)
        if MARGIN:
            mid = _lower_median(bhat_ptr, bias_ptr, committed_ptr, E, ema, keep, EB, True, GUARD)
        else:
            for c0 in range(0, E, EB):
                idx = c0 + tl.arange(0, EB)
                m = idx < E
                v = tl.load(bhat_ptr + idx, mask=m, other=0.0).to(tl.float64)
                v = (v - mean1).to(tl.float32).to(tl.float64)
                old = _bias(bias_ptr, committed_ptr, idx, m, GUARD)
                mixed = (ema * old.to(tl.float64) + keep * v).to(tl.float32)
                acc2 += tl.sum(tl.where(m, mixed.to(tl.float64), 0.0), 0)
        mean2 = acc2 / E
        lo = tl.full([], float("inf"), tl.float32)
        hi = tl.full([], float("-inf"), tl.float32)
        bad = negative
        for c0 in range(0, E, EB):
            idx = c0 + tl.arange(0, EB)
            m = idx < E
            v = tl.load(bhat_ptr + idx, mask=m, other=0.0).to(tl.float64)
            if not MARGIN:
                v = (v - mean1).to(tl.float32).to(tl.float64)
            old = _bias(bias_ptr, committed_ptr, idx, m, GUARD)
            mixed = (ema * old.to(tl.float64) + keep * v).to(tl.float32)
            if MARGIN:
                new = _pin(mixed.to(tl.float64), mid, SPREAD)
            else:
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
            if not MARGIN:
                v = (v - mean1).to(tl.float32).to(tl.float64)
            old = _bias(bias_ptr, committed_ptr, idx, m, GUARD)
            mixed = (ema * old.to(tl.float64) + keep * v).to(tl.float32)
            if MARGIN:
                new = _pin(mixed.to(tl.float64), mid, SPREAD)
            else:
                new = (mixed.to(tl.float64) - mean2).to(tl.float32)
            new = tl.where(total > 0, new, old)
            tl.store(bhat_ptr + idx, new, mask=m)
        if MARGIN:
            ok = bad == 0
        else:
            b0 = lo - 1.0
            b1 = hi + 1.0
            ok = (bad == 0) & (b0 < b1) & (b0 > float("-inf")) & (b1 < float("inf"))
            old_lo, old_hi = _bounds(bounds_ptr, committed_ptr, E, GUARD)
        tl.debug_barrier()  # the candidates are in bhat; every thread has read the old state
        for c0 in range(0, E, EB):
            idx = c0 + tl.arange(0, EB)
            m = idx < E
            new = tl.load(bhat_ptr + idx, mask=m, other=0.0)
            old = _bias(bias_ptr, committed_ptr, idx, m, GUARD)
            final = tl.where(ok, new, old)
            if MARGIN:
                old_inv = _scale(bounds_ptr, committed_ptr, E, idx, m, GUARD)
                new_inv = tl.load(scale_ptr + idx, mask=m, other=1.0)
                inv = tl.where(ok & (total > 0), new_inv, old_inv)
            tl.store(bias_ptr + idx, final, mask=m)
            if MARGIN:
                tl.store(bounds_ptr + idx, inv, mask=m)
            if GUARD:
                tl.store(committed_ptr + idx, final, mask=m)
                if MARGIN:
                    tl.store(committed_ptr + E + idx, inv, mask=m)
        if not MARGIN:
            lo_final = tl.where(ok, b0, old_lo)
            hi_final = tl.where(ok, b1, old_hi)
            tl.store(bounds_ptr, lo_final)
            tl.store(bounds_ptr + 1, hi_final)
            if GUARD:
                tl.store(committed_ptr + E, lo_final)
                tl.store(committed_ptr + E + 1, hi_final)
        if COUNT:
            tl.atomic_add(rejected_ptr, tl.where(ok, 0, 1).to(tl.int32), sem="relaxed")
