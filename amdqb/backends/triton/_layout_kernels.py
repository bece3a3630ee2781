"""``@triton.jit`` bodies of the layout kernels: route rows and align (launchers in ``layout.py``).

Contracts shared by every kernel here:

* a *route* is one flat entry of ``topk_ids`` (int32 or int64); ids outside ``[0, E)`` are
  dropped. Route offsets are int64 (``pid * R`` may pass 2^31 near the int32 route limit) and
  element offsets of ``[rows, H]`` tensors are int64 (``rows * H`` may pass 2^31);
* a *block* is the ``R = NSUB * SUB`` consecutive routes of one program, processed in ``NSUB``
  sub-chunks of ``SUB`` routes; ``E_PAD`` is a power of two >= E (histogram width, <= 4096);
* the stable rank of a route among the same-expert routes of its sub-chunk comes from a bitonic
  ``tl.sort`` of ``(expert << LOG_SUB) | lane`` keys: in sorted order the position minus the
  sub-chunk's exclusive expert histogram is that rank, and ascending lanes make it stable;
* per-block expert histograms are ``tl.histogram`` (LDS atomics on AMD, shared memory on NVIDIA);
* nothing here reads device values on the host: every size the host passes is a shape;
* any caller counter is memory-safe and gives the oracle's outcome (``amdqb.ref.layout``): a slot
  (int32, wrapping) that is negative is dropped, and the compact layout keeps a row only when its
  slot lies below the expert's updated counter and the row fits int32 (offsets are int64 sums of
  the counters clamped at 0; a stored offset past int32 is the sentinel -1). Counts count kept
  routes: the capacity/slot rule in closed form from the counter interval, the compact rule by a
  decrement for each route the final pass drops (none for consistent counters).
"""

from __future__ import annotations

import triton
import triton.language as tl

INT32_LIMIT = tl.constexpr(2147483648)  # 2^31: the first slot / row past int32

# ----------------------------------------------------------------------------------------------
# Route-block helpers (route rows "lds" / deterministic, align block size)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _block_histogram(
    ids_ptr, start, stop, E, SUB: tl.constexpr, NSUB: tl.constexpr, E_PAD: tl.constexpr
):
    """Expert histogram ``[E_PAD]`` of the valid routes in ``[start, stop)``."""
    lane = tl.arange(0, SUB)
    h = tl.zeros([E_PAD], dtype=tl.int32)
    for c in range(NSUB):
        offs = start + c * SUB + lane
        raw = tl.load(ids_ptr + offs, mask=offs < stop, other=-1)
        valid = (raw >= 0) & (raw < E)
        h += tl.histogram(tl.where(valid, raw, 0).to(tl.int32), E_PAD, mask=valid)
    return h


@triton.jit
def _block_assign(
    ids_ptr,
    out_ptr,
    start,
    stop,
    E,
    g,
    cap,
    SUB: tl.constexpr,
    NSUB: tl.constexpr,
    LOG_SUB: tl.constexpr,
    E_PAD: tl.constexpr,
    MODE: tl.constexpr,
    h0=None,
    off=None,
    fin=None,
    counts_ptr=None,
):
    """Give every route of ``[start, stop)`` slot ``g[e] + rank`` (rank: stable, in-block).

    ``MODE`` 0: ``out[route] = e * cap + slot`` if ``0 <= slot < cap`` else -1 (masked layout);
    1: ``out[route] = slot`` (-1 for dropped ids and negative slots); 2: ``out[slot] = route``
    (align scatter); 3: compact rows ``off[e] + slot`` (int64 ``off``) kept when
    ``0 <= slot < fin[e]`` and the row fits int32, else -1 and one off ``counts[e]``.
    ``h0``: the block histogram when the caller has it and ``NSUB == 1`` (saves a histogram).
    """
    lane = tl.arange(0, SUB)
    for c in range(NSUB):
        sub0 = start + c * SUB
        offs = sub0 + lane
        raw = tl.load(ids_ptr + offs, mask=offs < stop, other=-1)
        valid = (raw >= 0) & (raw < E)
        e = tl.where(valid, raw, 0).to(tl.int32)
        if h0 is None:
            hs = tl.histogram(e, E_PAD, mask=valid)
        else:
            hs = h0
        # Dropped ids and the tail past `stop` get expert E_PAD: they sort after every valid key.
        keys = tl.sort((tl.where(valid, e, E_PAD) << LOG_SUB) | lane)
        se = keys >> LOG_SUB
        sl = keys & (SUB - 1)
        ok = se < E_PAD
        excl = tl.cumsum(hs, 0) - hs
        slot = tl.gather(g - excl, tl.minimum(se, E_PAD - 1), 0) + lane
        g += hs
        dest = sub0 + sl
        if MODE == 0:
            keep = ok & (slot >= 0) & (slot < cap)
            tl.store(out_ptr + dest, tl.where(keep, se * cap + slot, -1), mask=dest < stop)
        elif MODE == 1:
            tl.store(out_ptr + dest, tl.where(ok & (slot >= 0), slot, -1), mask=dest < stop)
        elif MODE == 3:
            ec = tl.minimum(se, E_PAD - 1)
            row = tl.gather(off, ec, 0) + slot
            live = ok & (slot >= 0)
            keep = live & (slot < tl.gather(fin, ec, 0)) & (row < INT32_LIMIT)
            tl.store(out_ptr + dest, tl.where(keep, row, -1).to(tl.int32), mask=dest < stop)
            tl.atomic_add(counts_ptr + ec, -1, mask=live & ~keep, sem="relaxed")
        else:
            tl.store(out_ptr + slot, dest.to(tl.int32), mask=ok)


@triton.jit
def _block_hist_kernel(
    ids_ptr,
    hist_ptr,
    fill_ptr,
    N,
    E,
    fill_len,
    fill_per,
    fill_val,
    SUB: tl.constexpr,
    NSUB: tl.constexpr,
    E_PAD: tl.constexpr,
    FILL: tl.constexpr,
    FILL_BLOCK: tl.constexpr,
):
    """Row ``pid`` of the ``[NB, E_PAD]`` per-block histogram matrix (every entry written).

    With ``FILL`` the program also writes ``fill_val`` over its ``fill_per`` slice of ``fill_ptr``
    (the align sentinel), so the fill costs no extra launch.
    """
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * (SUB * NSUB)
    stop = tl.minimum(start + SUB * NSUB, N)
    h = _block_histogram(ids_ptr, start, stop, E, SUB, NSUB, E_PAD)
    tl.store(hist_ptr + pid.to(tl.int64) * E_PAD + tl.arange(0, E_PAD), h)
    if FILL:
        f0 = pid.to(tl.int64) * fill_per
        fend = tl.minimum(f0 + fill_per, fill_len)
        vals = tl.full([FILL_BLOCK], 0, tl.int32) + fill_val
        for f in range(0, fill_per, FILL_BLOCK):
            offs = f0 + f + tl.arange(0, FILL_BLOCK)
            tl.store(fill_ptr + offs, vals, mask=offs < fend)


@triton.jit
def _block_assign_kernel(
    ids_ptr,
    hist_ptr,
    counters_ptr,
    counts_ptr,
    out_ptr,
    N,
    E,
    cap,
    SUB: tl.constexpr,
    NSUB: tl.constexpr,
    LOG_SUB: tl.constexpr,
    E_PAD: tl.constexpr,
    MODE: tl.constexpr,
):
    """Route rows, deterministic pass 3: the slot base of block ``pid`` is row ``pid`` of the
    scanned matrix; compact mode (``MODE`` 3) adds the exclusive cumsum of the final counters
    (clamped at 0, int64), recomputed in registers by every program (E_PAD <= 4096 adds)."""
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * (SUB * NSUB)
    stop = tl.minimum(start + SUB * NSUB, N)
    eidx = tl.arange(0, E_PAD)
    g = tl.load(hist_ptr + pid.to(tl.int64) * E_PAD + eidx)
    if MODE == 3:
        tot = tl.load(counters_ptr + eidx, mask=eidx < E, other=0)
        clamped = tl.maximum(tot, 0).to(tl.int64)
        _block_assign(
            ids_ptr, out_ptr, start, stop, E, g, cap, SUB, NSUB, LOG_SUB, E_PAD, MODE,
            off=tl.cumsum(clamped, 0) - clamped, fin=tot, counts_ptr=counts_ptr,
        )  # fmt: skip
    else:
        _block_assign(ids_ptr, out_ptr, start, stop, E, g, cap, SUB, NSUB, LOG_SUB, E_PAD, MODE)


@triton.jit
def _align_assign_kernel(
    ids_ptr,
    hist_ptr,
    sorted_ptr,
    expert_ids_ptr,
    post_pad_ptr,
    N,
    E,
    NB,
    block_size,
    n_eid,
    eid_per,
    SUB: tl.constexpr,
    NSUB: tl.constexpr,
    LOG_SUB: tl.constexpr,
    E_PAD: tl.constexpr,
    JC: tl.constexpr,
):
    """Align pass 3. Every program rebuilds the padded expert starts from the totals (row
    ``NB``) in registers, scatters its routes (stable ranks), and writes its ``eid_per`` slice of
    ``expert_ids``: block j belongs to expert ``#{e : cumblocks[e] <= j}``, counted as a histogram
    of cumblocks over the slice plus the experts ending before it; blocks past the padded total
    get 0. Program 0 writes ``num_tokens_post_pad``."""
    pid = tl.program_id(0)
    eidx = tl.arange(0, E_PAD)
    em = eidx < E
    counts = tl.load(
        hist_ptr + (NB + tl.zeros([], dtype=tl.int64)) * E_PAD + eidx, mask=em, other=0
    )
    nblk = (counts + block_size - 1) // block_size
    padded = nblk * block_size
    g = tl.load(hist_ptr + pid.to(tl.int64) * E_PAD + eidx) + tl.cumsum(padded, 0) - padded
    start = pid.to(tl.int64) * (SUB * NSUB)
    stop = tl.minimum(start + SUB * NSUB, N)
    _block_assign(ids_ptr, sorted_ptr, start, stop, E, g, 0, SUB, NSUB, LOG_SUB, E_PAD, 2)
    total_blocks = tl.sum(nblk, 0)
    if pid == 0:
        tl.store(post_pad_ptr, total_blocks * block_size)
    cum = tl.cumsum(nblk, 0)
    j_lo = pid * eid_per
    j_hi = tl.minimum(j_lo + eid_per, n_eid)
    for j0 in range(j_lo, j_hi, JC):
        inr = em & (cum >= j0) & (cum < j0 + JC)
        d = tl.histogram(tl.where(inr, cum - j0, 0), JC, mask=inr)
        before = tl.sum((em & (cum < j0)).to(tl.int32), 0)
        j = j0 + tl.arange(0, JC)
        ex = tl.where(j < total_blocks, before + tl.cumsum(d, 0), 0)
        tl.store(expert_ids_ptr + j, ex, mask=j < j_hi)


@triton.jit
def _route_lds_kernel(
    ids_ptr,
    counters_ptr,
    counts_ptr,
    rows_ptr,
    N,
    E,
    cap,
    SUB: tl.constexpr,
    NSUB: tl.constexpr,
    LOG_SUB: tl.constexpr,
    E_PAD: tl.constexpr,
    CAPACITY: tl.constexpr,
):
    """Route rows, "lds" path: LDS histogram of the block, ONE masked vector atomic reserving an
    interval per non-empty expert (returns the bases), a second one adding this block's counts,
    then sort-based ranks inside the intervals. Compact mode stores relative slots (fix-up later).
    """
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * (SUB * NSUB)
    stop = tl.minimum(start + SUB * NSUB, N)
    h = _block_histogram(ids_ptr, start, stop, E, SUB, NSUB, E_PAD)
    eidx = tl.arange(0, E_PAD)
    live = h > 0
    base = tl.atomic_add(counters_ptr + eidx, h, mask=live, sem="relaxed")
    base = tl.where(live, base, 0)
    # Slots [base, base + h) (int64: base is the int32 counter, possibly wrapped -- then every slot
    # of the interval is negative as int32) of which those in [0, cap) / [0, 2^31) get a row.
    b64 = base.to(tl.int64)
    if CAPACITY:
        lim = cap + tl.zeros([E_PAD], dtype=tl.int64)
        mode: tl.constexpr = 0
    else:
        lim = tl.full([E_PAD], INT32_LIMIT, tl.int64)
        mode: tl.constexpr = 1
    acc = tl.maximum(tl.minimum(b64 + h, lim) - tl.maximum(b64, 0), 0).to(tl.int32)
    tl.atomic_add(counts_ptr + eidx, acc, mask=live & (acc > 0), sem="relaxed")
    if NSUB == 1:
        _block_assign(
            ids_ptr, rows_ptr, start, stop, E, base, cap, SUB, NSUB, LOG_SUB, E_PAD, mode, h
        )
    else:
        _block_assign(ids_ptr, rows_ptr, start, stop, E, base, cap, SUB, NSUB, LOG_SUB, E_PAD, mode)


# ----------------------------------------------------------------------------------------------
# Route rows: "atomic" path and the shared compact fix-up
# ----------------------------------------------------------------------------------------------


@triton.jit
def _route_atomic_kernel(
    ids_ptr, counters_ptr, rows_ptr, N, E, cap, BLOCK: tl.constexpr, CAPACITY: tl.constexpr
):
    """One global atomic per valid route claims its slot (the "old" path)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < N
    raw = tl.load(ids_ptr + offs, mask=inb, other=-1)
    valid = (raw >= 0) & (raw < E)
    e = tl.where(valid, raw, 0).to(tl.int32)
    slot = tl.atomic_add(counters_ptr + e, 1, mask=valid, sem="relaxed")
    if CAPACITY:
        row = tl.where(valid & (slot >= 0) & (slot < cap), e * cap + slot, -1)
    else:
        row = tl.where(valid & (slot >= 0), slot, -1)
    tl.store(rows_ptr + offs, row, mask=inb)


@triton.jit
def _claimed_in_range(c0, fin, cap, CAPACITY: tl.constexpr):
    """Routes of this call whose slot lies in ``[0, cap)`` (``[0, 2^31)`` without ``CAPACITY``):
    the slots are ``[c0, c0 + n)`` with ``n = fin - c0`` modulo 2^32 (``n < 2^31``); int64."""
    s = c0.to(tl.int64)
    d = fin.to(tl.int64) - s
    end = s + tl.where(d < 0, d + 4294967296, d)
    if CAPACITY:
        lim = end * 0 + cap
    else:
        lim = end * 0 + INT32_LIMIT
    return tl.maximum(tl.minimum(end, lim) - tl.maximum(s, 0), 0).to(tl.int32)


@triton.jit
def _compact_offsets(fin, carry, off_ptrs, m):
    """Store the exclusive cumsum (from ``carry``) of the counters ``fin`` clamped at 0, int64
    arithmetic, as int32 with -1 for an offset past int32; returns the new carry."""
    clamped = tl.where(m, tl.maximum(fin, 0), 0).to(tl.int64)
    off = carry + tl.cumsum(clamped, 0) - clamped
    tl.store(off_ptrs, tl.where(off < INT32_LIMIT, off, -1).to(tl.int32), mask=m)
    return carry + tl.sum(clamped, 0)


@triton.jit
def _route_finish_kernel(
    counters_ptr,
    counts_ptr,
    off_ptr,
    E,
    cap,
    CHUNK: tl.constexpr,
    CAPACITY: tl.constexpr,
    WRITE_OFF: tl.constexpr,
):
    """Single program: ``counts`` from the final counters and their snapshot (held in ``counts``):
    the slots ``[snap, snap + routes)`` inside ``[0, cap)`` (``[0, 2^31)`` compact; the compact
    fix-up then takes off the routes it drops). With ``WRITE_OFF`` the compact offsets
    (``_compact_offsets``)."""
    carry = tl.zeros([], dtype=tl.int64)
    for c0 in range(0, E, CHUNK):
        idx = c0 + tl.arange(0, CHUNK)
        m = idx < E
        fin = tl.load(counters_ptr + idx, mask=m, other=0)
        snap = tl.load(counts_ptr + idx, mask=m, other=0)
        cnt = _claimed_in_range(snap, fin, cap, CAPACITY)
        tl.store(counts_ptr + idx, cnt, mask=m)
        if WRITE_OFF:
            carry = _compact_offsets(fin, carry, off_ptr + idx, m)


@triton.jit
def _route_fixup_kernel(
    ids_ptr,
    rows_ptr,
    counters_ptr,
    counts_ptr,
    off_ptr,
    N,
    E,
    BLOCK: tl.constexpr,
    E_PAD: tl.constexpr,
    IN_REG: tl.constexpr,
):
    """Compact mode: ``row = offset[e] + slot`` for the routes holding a slot, kept when the slot
    lies below the expert's final counter and the row fits int32 (else -1, and one off
    ``counts[e]``). ``IN_REG`` scans the final counters in each program (E <= 4096, saves a
    launch); otherwise the offsets (-1: past int32) come from ``_route_finish_kernel``."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < N
    raw = tl.load(ids_ptr + offs, mask=inb, other=-1)
    valid = (raw >= 0) & (raw < E)
    e = tl.where(valid, raw, 0).to(tl.int32)
    r = tl.load(rows_ptr + offs, mask=valid, other=-1)
    live = valid & (r >= 0)
    if IN_REG:
        eidx = tl.arange(0, E_PAD)
        tot = tl.load(counters_ptr + eidx, mask=eidx < E, other=0)
        clamped = tl.maximum(tot, 0).to(tl.int64)
        o = tl.gather(tl.cumsum(clamped, 0) - clamped, e, 0)
        f = tl.gather(tot, e, 0)
    else:
        o32 = tl.load(off_ptr + e, mask=live, other=0)
        o = tl.where(o32 >= 0, o32.to(tl.int64), INT32_LIMIT)
        f = tl.load(counters_ptr + e, mask=live, other=0)
    row = o + r
    keep = live & (r < f) & (row < INT32_LIMIT)
    tl.store(rows_ptr + offs, tl.where(keep, row, -1).to(tl.int32), mask=live)
    tl.atomic_add(counts_ptr + e, -1, mask=live & ~keep, sem="relaxed")


# ----------------------------------------------------------------------------------------------
# Route rows: deterministic scan (any E), and the E > 4096 count / assign kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _block_scan_kernel(
    hist_ptr,
    counters_ptr,
    counts_ptr,
    NB,
    E,
    STRIDE,
    cap,
    EC: tl.constexpr,
    BT: tl.constexpr,
    USE_COUNTERS: tl.constexpr,
    CAPACITY: tl.constexpr,
    WRITE_TOTAL: tl.constexpr,
    WRITE_OFF: tl.constexpr,
):
    """Exclusive scan over blocks, one expert chunk of ``EC`` per program (experts are
    independent here): ``hist[b, e]`` (row stride ``STRIDE``) becomes ``c0[e] + sum_{b' < b}
    hist[b', e]`` with ``c0`` the caller counters (``USE_COUNTERS``, which then get the totals and
    ``counts`` this call's rows) or 0. ``WRITE_TOTAL`` stores the per-expert totals in row ``NB``;
    ``WRITE_OFF`` (single program, grid 1) stores the compact offsets -- the exclusive cumsum of
    the updated counters clamped at 0 across all experts, -1 past int32 -- there instead.
    ``counts``: slots in ``[0, cap)`` (``[0, 2^31)`` compact: the final pass takes off the routes
    the compact rule drops)."""
    carry = tl.zeros([], dtype=tl.int64)
    for e0 in range(tl.program_id(0) * EC, E, tl.num_programs(0) * EC):
        eidx = e0 + tl.arange(0, EC)
        em = eidx < E
        if USE_COUNTERS:
            c0 = tl.load(counters_ptr + eidx, mask=em, other=0)
        else:
            c0 = tl.zeros([EC], dtype=tl.int32)
        run = c0
        for b0 in range(0, NB, BT):
            rows = b0 + tl.arange(0, BT)
            ptrs = hist_ptr + rows.to(tl.int64)[:, None] * STRIDE + eidx[None, :]
            msk = (rows < NB)[:, None] & em[None, :]
            tile = tl.load(ptrs, mask=msk, other=0)
            tl.store(ptrs, run[None, :] + tl.cumsum(tile, 0) - tile, mask=msk)
            run += tl.sum(tile, 0)
        if USE_COUNTERS:
            tl.store(counters_ptr + eidx, run, mask=em)
            tl.store(counts_ptr + eidx, _claimed_in_range(c0, run, cap, CAPACITY), mask=em)
        row_nb = hist_ptr + (NB + tl.zeros([], dtype=tl.int64)) * STRIDE + eidx
        if WRITE_TOTAL:
            tl.store(row_nb, run, mask=em)
        if WRITE_OFF:
            carry = _compact_offsets(run, carry, row_nb, em)


@triton.jit
def _count_atomic_kernel(ids_ptr, hist_ptr, N, E, SUB: tl.constexpr):
    """E > 4096: per-block counts ``hist[pid, e]`` (zeroed) by global atomics (counting commutes,
    so the result is deterministic)."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * SUB + tl.arange(0, SUB)
    raw = tl.load(ids_ptr + offs, mask=offs < N, other=-1)
    valid = (raw >= 0) & (raw < E)
    e = tl.where(valid, raw, 0)
    tl.atomic_add(hist_ptr + pid.to(tl.int64) * E + e, 1, mask=valid, sem="relaxed")


@triton.jit
def _run_start(e_a, s_a, e_b, s_b):
    # Over sorted experts: the start of the run holding the last element of the span.
    return e_b, tl.where(e_a == e_b, s_a, s_b)


@triton.jit
def _assign_wide_kernel(
    ids_ptr,
    hist_ptr,
    out_ptr,
    counters_ptr,
    counts_ptr,
    N,
    E,
    cap,
    NB,
    SUB: tl.constexpr,
    MODE: tl.constexpr,
):
    """E > 4096 pass 3 (one sub-chunk per program, no E-wide registers): rank = sorted position
    minus the start of its expert's run (segmented scan over the sorted keys); slot base gathered
    from row ``pid`` of the scanned matrix, plus row ``NB`` (compact offsets, -1 past int32 /
    padded expert starts) in modes 1 and 2. Modes as in ``_block_assign`` (mode 1 here is the
    final compact pass: ``_block_assign``'s mode 3 rule with the final ``counters``)."""
    pid = tl.program_id(0)
    lane = tl.arange(0, SUB)
    start = pid.to(tl.int64) * SUB
    offs = start + lane
    raw = tl.load(ids_ptr + offs, mask=offs < N, other=-1)
    valid = (raw >= 0) & (raw < E)
    ek = tl.where(valid, raw, E).to(tl.int64)
    keys = tl.sort(ek * SUB + lane)
    se = keys // SUB
    dest = start + (keys % SUB)
    _, run0 = tl.associative_scan((se, lane), 0, _run_start)
    ok = se < E
    es = tl.where(ok, se, 0)
    slot = tl.load(hist_ptr + pid.to(tl.int64) * E + es, mask=ok, other=0) + (lane - run0)
    nb64 = NB + tl.zeros([], dtype=tl.int64)
    if MODE == 0:
        row = tl.where(ok & (slot >= 0) & (slot < cap), es.to(tl.int32) * cap + slot, -1)
        tl.store(out_ptr + dest, row, mask=dest < N)
    elif MODE == 1:
        live = ok & (slot >= 0)
        o32 = tl.load(hist_ptr + nb64 * E + es, mask=live, other=0)
        fin = tl.load(counters_ptr + es, mask=live, other=0)
        row = tl.where(o32 >= 0, o32.to(tl.int64), INT32_LIMIT) + slot
        keep = live & (slot < fin) & (row < INT32_LIMIT)
        tl.store(out_ptr + dest, tl.where(keep, row, -1).to(tl.int32), mask=dest < N)
        tl.atomic_add(counts_ptr + es, -1, mask=live & ~keep, sem="relaxed")
    else:
        slot += tl.load(hist_ptr + nb64 * E + es, mask=ok, other=0)
        tl.store(out_ptr + slot, dest.to(tl.int32), mask=ok)


@triton.jit
def _align_offsets_wide_kernel(hist_ptr, post_pad_ptr, NB, E, block_size, CHUNK: tl.constexpr):
    """E > 4096 align, single program: row ``NB`` (per-expert totals) becomes the padded expert
    starts, row ``NB + 1`` the inclusive cumulative block counts; ``num_tokens_post_pad``."""
    nb64 = NB + tl.zeros([], dtype=tl.int64)
    carry = tl.zeros([], dtype=tl.int32)
    for e0 in range(0, E, CHUNK):
        idx = e0 + tl.arange(0, CHUNK)
        m = idx < E
        nblk = (tl.load(hist_ptr + nb64 * E + idx, mask=m, other=0) + block_size - 1) // block_size
        cum = carry + tl.cumsum(nblk, 0)
        tl.store(hist_ptr + nb64 * E + idx, (cum - nblk) * block_size, mask=m)
        tl.store(hist_ptr + (nb64 + 1) * E + idx, cum, mask=m)
        carry += tl.sum(nblk, 0)
    tl.store(post_pad_ptr, carry * block_size)


@triton.jit
def _align_expert_ids_wide_kernel(
    cum_ptr, expert_ids_ptr, E, n_eid, BJ: tl.constexpr, STEPS: tl.constexpr
):
    """E > 4096 align: block j belongs to expert ``#{e : cumblocks[e] <= j}`` (binary search);
    blocks past the padded total get 0."""
    j = tl.program_id(0) * BJ + tl.arange(0, BJ)
    lo = tl.zeros([BJ], dtype=tl.int32)
    hi = tl.zeros([BJ], dtype=tl.int32) + E
    for _ in range(STEPS):
        act = lo < hi
        mid = (lo + hi) // 2
        below = act & (tl.load(cum_ptr + mid, mask=act, other=0) <= j)
        lo = tl.where(below, mid + 1, lo)
        hi = tl.where(act & ~below, mid, hi)
    total = tl.load(cum_ptr + E - 1)
    tl.store(expert_ids_ptr + j, tl.where(j < total, lo, 0), mask=j < n_eid)
