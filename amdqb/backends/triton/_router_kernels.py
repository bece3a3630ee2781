"""@triton.jit bodies of the fused Top-k router, its QB histogram and its backward.

Precision contract (the same as ``amdqb.ref.router``): logits are converted to fp32 on load; the
activation, the biased score, selection, normalisation, the QB cutoff and all histogram arithmetic
are fp32; only ``probs`` is cast to the logits dtype on store. ``scale = B / (U - L)`` uses a
correctly rounded division (``div_rn``), like PyTorch, so the bins are the oracle's bit for bit when
the oracle is evaluated on this module's own activations (``_score``).

Tie-break contract: experts are ranked by (selection value descending, expert id ascending) through
the monotone int32 key of ``amdqb.ref.ordering`` (``-0.0 == +0.0``; NaN below every number). NaN
is mapped to ``INT32_MIN + 1`` here so that ``INT32_MIN`` is free for padding columns and for experts
outside the chosen groups: those rank below every real expert, NaN included, and never get picked
while k real candidates exist. The rank-R element (R = k-1, or k under QB) is the cutoff; membership
of an element is "(key, -id) beats or equals (key_c, -id_c)" (strictly beats under QB), so every
row gets exactly k distinct experts whatever the data (ties, NaN, +-inf).

Selection (per program: BT rows x W = next_pow2(E) padded columns held in registers; BT = 1 at
E=896):

* fast path (k small): a lower bound ``tau`` on the cutoff key is the (R+1)-th largest of the maxima
  of G strided column groups; the few elements with ``key >= tau`` are compacted into a
  [BT, CAP] tile through a small global scratch (cumsum positions, one barrier) and ranked pairwise.
  Ranks are exact (everything that beats a candidate is a candidate), so the tile gives the cutoff
  and the selection order directly.
* exact path: if any row of the program has more than CAP candidates (adversarial ties) the program
  finds the cutoff by a 32-step search on the key bits plus a search on the ids of the tied
  elements, then compacts exactly R+1 elements; when k is too large for the tile the exact search
  is used alone and the selection order (for index outputs) comes from k best-first extractions.

Compaction slots come from atomics on a per-row counter in the scratch (any order: the pairwise
ranks do not depend on it), cheaper than a row-wide scan in Triton's layouts.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from ._common import interpreting

INT32_MIN = tl.constexpr(-2147483648)
NAN_KEY = tl.constexpr(-2147483647)  # INT32_MIN + 1: NaN ranks below every number, above padding
ID_FLIP = tl.constexpr(2147483647)  # rank composite: key << 32 | (ID_FLIP - id), larger is better


# --------------------------------------------------------------------------------------------
# Element-wise helpers shared by every kernel (bitwise-identical results wherever used).
# --------------------------------------------------------------------------------------------
@triton.jit
def _order_key(x):
    """Monotone int32 key of fp32 ``x`` (ref.ordering.order_key, NaN -> INT32_MIN + 1)."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)  # -0.0 + 0.0 == +0.0 (round to nearest)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(x != x, NAN_KEY, key)


@triton.jit
def _key_value(key):
    """fp32 value of a key (``-0.0`` comes back as ``+0.0``; the NaN key as a NaN)."""
    bits = tl.where(key < 0, key ^ 0x7FFFFFFF, key)
    return bits.to(tl.float32, bitcast=True)


# The library functions torch's kernels use (libdevice on NVIDIA, ocml on ROCm, resolved for the
# compile target). Triton's CPU interpreter has no libdevice: there numpy's functions stand in
# (the CPU tests compare the oracle on the kernels' own activations, not with torch's bits).
if interpreting():

    @triton.jit
    def _lib_exp(x):
        return tl.exp(x)

    @triton.jit
    def _lib_log1p(x):
        u = 1.0 + x  # Kahan: log1p(x) = log(u) * x / (u - 1), exact-ish for tiny x
        return tl.where(u == 1.0, x, tl.log(u) * (x / (u - 1.0)))

else:

    @triton.jit
    def _lib_exp(x):
        return libdevice.exp(x)

    @triton.jit
    def _lib_log1p(x):
        return libdevice.log1p(x)


@triton.jit
def _exp(x, APPROX: tl.constexpr):
    """e^x: the library exp (torch's) or, opt-in, ``tl.exp`` (the hardware 2^x)."""
    if APPROX:
        y = tl.exp(x)
    else:
        y = _lib_exp(x)
    return y


@triton.jit
def _score(z, SCORE: tl.constexpr, APPROX: tl.constexpr = False):
    """Element-wise activation of fp32 logits, torch's bits unless ``APPROX``: 0 = sigmoid
    ``1 / (1 + e^-z)`` (IEEE division), 1 = ``sqrt(softplus(z))`` with softplus ``z`` above
    torch's threshold 20, else ``log1p(e^z)`` (IEEE sqrt)."""
    if SCORE == 0:
        s = tl.math.div_rn(tl.full(z.shape, 1.0, tl.float32), 1.0 + _exp(-z, APPROX))
    else:
        sp = tl.where(z > 20.0, z, _lib_log1p(_exp(z, APPROX)))
        s = tl.sqrt_rn(sp)
    return s


@triton.jit
def _butterfly_sum(v, BT: tl.constexpr, N: tl.constexpr):
    """``[BT, N]`` (N a power of two <= 32) -> ``[BT]``: lane l adds lane l ^ d for d = N/2 ... 1,
    the xor butterfly of a 32-lane warp whose lanes >= N hold zeros."""
    for i in tl.static_range(5):
        if (N >> i) > 1:
            v = tl.sum(tl.reshape(v, (BT, 2, N >> (i + 1))), axis=1)
    return tl.reshape(v, (BT,))


@triton.jit
def _warp_order_sum(x, BT: tl.constexpr, N: tl.constexpr):
    """fp32 row sums of ``[BT, N]`` (N a power of two) in ``amdqb.ref.router.routes_sum``'s
    order: lane l of a 32-lane warp adds entries l, l + 32, ... left to right, then the xor
    butterfly. Each partial sum is built from exact extractions (one non-zero per row)."""
    if N <= 32:
        out = _butterfly_sum(x, BT, N)
    else:
        G: tl.constexpr = N // 32
        x3 = tl.reshape(x, (BT, G, 32))
        g = tl.arange(0, G)[None, :, None]
        acc = tl.sum(tl.where(g == 0, x3, 0.0), axis=1)
        for i in tl.static_range(1, G):
            acc = acc + tl.sum(tl.where(g == i, x3, 0.0), axis=1)
        out = _butterfly_sum(acc, BT, 32)
    return out


@triton.jit
def _softmax_row_sum(logits_ptr, rbase, row_ok, m, E: tl.constexpr, BT: tl.constexpr, APPROX):
    """sum_e exp(z_e - m) over each row in torch's warp-softmax order (expert e on lane e % 32,
    added in order of e // 32, then the butterfly), reading the row in expert order: the tile's
    column order is not expert order under groups."""
    lane = tl.arange(0, 32)
    acc = tl.zeros([BT, 32], dtype=tl.float32)
    for c in range(0, E, 32):
        e = c + lane
        ok = row_ok[:, None] & (e < E)[None, :]
        z = tl.load((logits_ptr + rbase)[:, None] + e[None, :], mask=ok, other=0.0)
        acc = acc + tl.where(ok, _exp(z.to(tl.float32) - m[:, None], APPROX), 0.0)
    return _butterfly_sum(acc, BT, 32)


@triton.jit
def _qb_scale(bounds_ptr, NBINS: tl.constexpr):
    lower = tl.load(bounds_ptr)
    upper = tl.load(bounds_ptr + 1)
    # fp32(B) / (U - L), correctly rounded (plain '/' may be approximate on GPUs).
    nb = tl.zeros_like(lower) + NBINS
    return lower, tl.math.div_rn(nb, upper - lower)


@triton.jit
def _qb_bins(r, lower, scale, NBINS: tl.constexpr):
    """``clamp(floor((r - L) * scale), 0, B - 1)`` in fp32 with NaN -> 0, then int32.

    Written as ``x >= 0 ? min(floor(x), B - 1) : 0``: the same value for every x (negatives and
    -inf floor below 0, NaN fails the compare, +inf clamps to B - 1) in fewer instructions.
    """
    x = (r - lower) * scale
    return tl.where(x >= 0.0, tl.minimum(tl.floor(x), NBINS - 1.0), 0.0).to(tl.int32)


@triton.jit
def _margin_bins(d, inv, NBINS: tl.constexpr, FINE: tl.constexpr, MBITS: tl.constexpr):
    """``(bins, u, on)``: the log_margin bin of the biased margin d
    (``amdqb.ref.router.qb_margin_bin_index``), ``inv`` the experts' inverse scales: the
    half-octave level ``L = ((bits(1 + |d| * inv) & 0x7fffffff) >> 22) - 254``, the key ``L``
    below FINE and ``FINE + ((L - FINE) >> 3)`` beyond; ``d > 0`` in bin
    ``B/2 + 1 + min(key, B/2 - 2)``, ``d < 0`` in ``B/2 - 1 - min(key, B/2 - 1)``, ``d == 0`` in
    bin ``B/2``; NaN -> 0. Integer arithmetic on the float bits, the same on every device. And
    from the same bits the margin's position inside its bin (``qb_margin_in_bin``): ``u``, the
    top MBITS of y's 22 fraction bits below its level (``2^MBITS - 1 - u`` for ``d < 0``), ``on``
    where the pair is on a fine key (unused results cost nothing: the compiler drops them)."""
    y = 1.0 + tl.abs(d) * inv
    # |y|'s bits: a NaN y (unchecked bounds) is the same bin on every device whatever its sign
    bits = y.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    level = (bits >> 22) - 254
    # y >= 1 for every valid scale; the clamp keeps unchecked bounds inside the row
    key = tl.maximum(tl.where(level < FINE, level, FINE + ((level - FINE) >> 3)), 0)
    up = NBINS // 2 + 1 + tl.minimum(key, NBINS // 2 - 2)
    down = NBINS // 2 - 1 - tl.minimum(key, NBINS // 2 - 1)
    bins = tl.where(d > 0.0, up, tl.where(d < 0.0, down, NBINS // 2))
    top = (1 << MBITS) - 1
    u = (bits >> (22 - MBITS)) & top
    u = tl.where(d < 0.0, top - u, u)
    on = (level >= 0) & (level < FINE) & (d != 0.0) & (d == d)
    return tl.where(d != d, 0, bins), u.to(tl.int64), on


@triton.jit
def _tie_free_values(z, b, APPROX: tl.constexpr):
    """``(s, v)``: the sigmoid and the tie-free selection value ``v = b - c``, ``c = sigmoid(-z)``
    from the sigmoid's own ``e = exp(-z)``: ``e * s`` for ``z >= 0``, ``1 - s`` below
    (``amdqb.ref.router.sigmoid_complement``)."""
    e = _exp(-z, APPROX)
    s = tl.math.div_rn(tl.full(z.shape, 1.0, tl.float32), 1.0 + e)
    c = tl.where(z >= 0.0, e * s, 1.0 - s)
    return s, b - c


@triton.jit
def _exact_cutoff(key, ids, R: tl.constexpr, BT: tl.constexpr, ID_BITS: tl.constexpr):
    """(key, id) of the rank-R element of every row, for any data.

    The key is the largest ``x`` with ``count(key >= x) >= R + 1`` (MSB-first search on the
    offset-binary image of the int32 key); among the elements tied at that key the
    ``(R - count(key > x))``-th smallest id is found by a second search on the id bits.
    """
    y = tl.zeros([BT], dtype=tl.int64)
    step = tl.zeros([BT], dtype=tl.int64) + 2147483648
    for _ in range(32):
        yt = y + step
        xt = (yt - 2147483648).to(tl.int32)
        c = tl.sum((key >= xt[:, None]).to(tl.int32), axis=1)
        y = tl.where(c >= R + 1, yt, y)
        step = step // 2
    kc = (y - 2147483648).to(tl.int32)
    need = R - tl.sum((key > kc[:, None]).to(tl.int32), axis=1)
    tied = key == kc[:, None]
    # Largest v with count(tied & id < v) <= need: that v is the need-th (0-based) tied id.
    v = tl.zeros([BT], dtype=tl.int32)
    bit = tl.zeros([BT], dtype=tl.int32) + (1 << (ID_BITS - 1))
    for _ in range(ID_BITS):
        vt = v + bit
        c = tl.sum((tied & (ids[None, :] < vt[:, None])).to(tl.int32), axis=1)
        v = tl.where(c <= need, vt, v)
        bit = bit // 2
    return kc, v


# --------------------------------------------------------------------------------------------
# Forward router (also the serving-form biased_topk: compact outputs instead of dense ones).
# --------------------------------------------------------------------------------------------
@triton.jit
def _router_fwd_kernel(
    logits_ptr,
    bias_ptr,
    probs_ptr,
    map_ptr,
    ids_ptr,
    w_ptr,
    hist_ptr,
    bounds_ptr,
    cut_ptr,
    scratch_ptr,
    bytes_ptr,
    scores_ptr,
    cutoff_ptr,
    T,
    scaling,
    E: tl.constexpr,
    K: tl.constexpr,
    R: tl.constexpr,  # rank of the cutoff: K - 1, or K under QB
    NG: tl.constexpr,
    GS: tl.constexpr,
    GT: tl.constexpr,
    GN: tl.constexpr,  # a group's score: the sum of its GN best selection values
    NGP: tl.constexpr,
    GSP: tl.constexpr,
    W: tl.constexpr,  # NGP * GSP columns per row in registers (>= 16)
    EP: tl.constexpr,  # plain padded width (bitmap packing), == W when NG == 1
    BT: tl.constexpr,
    G: tl.constexpr,  # strided groups for the lower bound tau
    CAP: tl.constexpr,  # compacted candidates per row
    ID_BITS: tl.constexpr,  # bits of the largest id (padding ids run up to E + W)
    FAST: tl.constexpr,
    USE_TAU: tl.constexpr,
    SCORE: tl.constexpr,  # 0 sigmoid, 1 sqrtsoftplus, 2 softmax
    PRE: tl.constexpr,  # softmax: select on softmax(all) (else on logits, softmax over the k)
    RENORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    QB: tl.constexpr,  # 0 off, 1 fused atomic histogram, 2 write the cutoff only (two_kernel)
    NBINS: tl.constexpr,
    MAP: tl.constexpr,  # 0 none, 1 bytemap, 2 bitmap, 3 indices (ids_ptr)
    DENSE: tl.constexpr,  # write dense probs
    COMPACT_W: tl.constexpr,  # write compact weights [T, K] (w_ptr)
    KP: tl.constexpr,  # next_pow2(K): the by-rank value slots of a row's scratch
    APPROX: tl.constexpr,  # the opt-in approximate exponential (tl.exp) instead of torch's
    TIE_FREE: tl.constexpr,  # select by b - sigmoid(-z) instead of s + b (sigmoid with a bias)
    MARGIN: tl.constexpr,  # QB binning: False uniform (r = alpha - s), True log_margin (d)
    FINE: tl.constexpr,  # log_margin: the fine keys a side (amdqb.ref.router.margin_fine_keys)
    MOMENTS: tl.constexpr,  # log_margin: also the in-bin moments (int64 [3, E, B], QB == 1)
    MBITS: tl.constexpr,  # the in-bin position's bits (amdqb.ref.router.MARGIN_MOMENT_BITS)
    SCORES: tl.constexpr,  # write the scores before the bias (scores_ptr, fp32 [T, E])
    CUTOFF: tl.constexpr,  # QB: write the cutoff alpha (cutoff_ptr, fp32 [T])
):
    pid = tl.program_id(0)
    rows = pid * BT + tl.arange(0, BT)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)

    p = tl.arange(0, W)
    if NG > 1:
        gi = p // GSP
        ji = p % GSP
        col = gi * GS + ji
        valid = (gi < NG) & (ji < GS)
    else:
        col = p
        valid = p < E
    ids = tl.where(valid, col, E + p)  # distinct; padding ranks after every real id
    mask2 = row_ok[:, None] & valid[None, :]
    rbase = rows64 * E  # int64 row offsets (T * E may pass 2^31); columns stay int32
    z = tl.load((logits_ptr + rbase)[:, None] + col[None, :], mask=mask2, other=0.0)
    z = z.to(tl.float32)

    # ---- activation and selection value -------------------------------------------------
    if SCORE == 2:
        zm = tl.where(valid[None, :], z, float("-inf"))
        m = tl.max(zm, axis=1)
        ex = tl.where(valid[None, :], _exp(zm - m[:, None], APPROX), 0.0)
        ssum = _softmax_row_sum(logits_ptr, rbase, row_ok, m, E, BT, APPROX)
        act = tl.math.div_rn(ex, ssum[:, None])
        if PRE:
            sel = act
            wv = act
            if HAS_BIAS:  # a correction bias on softmax scores (serving form)
                b = tl.load(bias_ptr + col, mask=valid, other=0.0)
                sel = act + b[None, :]
        else:
            sel = z
            wv = z
    else:
        m = tl.zeros([BT], dtype=tl.float32)
        ssum = tl.zeros([BT], dtype=tl.float32)
        if TIE_FREE:
            b = tl.load(bias_ptr + col, mask=valid, other=0.0)
            wv, sel = _tie_free_values(z, b[None, :], APPROX)
        else:
            wv = _score(z, SCORE, APPROX)
            if HAS_BIAS:
                b = tl.load(bias_ptr + col, mask=valid, other=0.0)
                sel = wv + b[None, :]
            else:
                sel = wv
    key = tl.where(valid[None, :], _order_key(sel), INT32_MIN)
    if SCORES:
        tl.store((scores_ptr + rbase)[:, None] + col[None, :], wv, mask=mask2)

    # ---- grouped Top-k: keep the GT groups whose best GN selection values sum highest ----------
    if NG > 1:
        key3 = tl.reshape(key, (BT, NGP, GSP))
        sel3 = tl.reshape(sel, (BT, NGP, GSP))
        j3 = tl.reshape(tl.zeros([BT, W], dtype=tl.int32) + (p % GSP)[None, :], (BT, NGP, GSP))
        gsum = tl.zeros([BT, NGP], dtype=tl.float32)
        for _ in range(GN):  # extract each group's best in selection order
            mk = tl.max(key3, axis=2)
            first = tl.min(tl.where(key3 == mk[:, :, None], j3, GSP), axis=2)
            hit = j3 == first[:, :, None]
            gsum += tl.sum(tl.where(hit, sel3, 0.0), axis=2)
            key3 = tl.where(hit, INT32_MIN, key3)
        gidx = tl.arange(0, NGP)
        gkey = tl.where(gidx[None, :] < NG, _order_key(gsum), INT32_MIN)
        ga = gkey[:, :, None]
        gb = gkey[:, None, :]
        gbeats = (gb > ga) | ((gb == ga) & (gidx[None, None, :] < gidx[None, :, None]))
        grank = tl.sum(gbeats.to(tl.int32), axis=2)
        elig = tl.reshape(
            tl.zeros([BT, NGP, GSP], dtype=tl.int32) + (grank < GT).to(tl.int32)[:, :, None],
            (BT, W),
        )
        key = tl.where(elig != 0, key, INT32_MIN)

    # ---- cutoff (rank-R element) -------------------------------------------------------------
    if FAST:
        if USE_TAU:
            gmax = tl.max(tl.reshape(key, (BT, W // G, G)), axis=1)  # strided groups
            # ge[i] = #{j : gmax[j] >= gmax[i]}, j on the middle axis (thread-local reduction)
            ge = tl.sum((gmax[:, :, None] >= gmax[:, None, :]).to(tl.int32), axis=1)
            tau = tl.max(tl.where(ge >= R + 1, gmax, INT32_MIN), axis=1)
            cand = key >= tau[:, None]
        else:
            cand = key >= INT32_MIN
        cnt = tl.where(row_ok, tl.sum(cand.to(tl.int32), axis=1), 0)
        if tl.max(cnt, axis=0) > CAP:
            kx, ix = _exact_cutoff(key, ids, R, BT, ID_BITS)
            cand = (key > kx[:, None]) | ((key == kx[:, None]) & (ids[None, :] <= ix[:, None]))
        # Compact (key, id) of the candidates. Row r owns 2*CAP+1 int32 of scratch: keys [0, CAP),
        # ids [CAP, 2CAP), a slot counter at 2CAP. Slots come from atomics on the counter (any
        # order works: the ranks below do not depend on it), cheaper than a row-wide scan here.
        sbase = scratch_ptr + rows64 * (2 * CAP + 1 + KP)
        tl.store(sbase + 2 * CAP, tl.zeros([BT], dtype=tl.int32), mask=row_ok)
        tl.debug_barrier()
        take = cand & row_ok[:, None]
        # The counter's address per element as a computed block, not tl.broadcast_to: Triton's
        # interpreter up to 3.8 reads an atomic's pointers as a dense array, and a broadcast block
        # of one row is a stride-0 view there, so it read W pointers from one (segfault). Adding
        # a zero block gives the same addresses (and compiles to the same code on a GPU).
        cptr = (sbase + 2 * CAP)[:, None] + tl.zeros([BT, W], dtype=tl.int32)
        slot = tl.atomic_add(
            cptr,
            tl.full([BT, W], 1, dtype=tl.int32),
            mask=take,
            sem="relaxed",
        )
        smask = take & (slot < CAP)
        tl.store(sbase[:, None] + slot, key, mask=smask)
        tl.store(
            sbase[:, None] + CAP + slot,
            tl.zeros([BT, W], dtype=tl.int32) + ids[None, :],
            mask=smask,
        )
        tl.debug_barrier()  # the compacted rows are read back by other threads of the program
        ncand = tl.load(sbase + 2 * CAP, mask=row_ok, other=0)
        slots = tl.arange(0, CAP)
        sv = (slots[None, :] < ncand[:, None]) & row_ok[:, None]
        ck = tl.load(sbase[:, None] + slots[None, :], mask=sv, other=INT32_MIN)
        ci = tl.load(sbase[:, None] + CAP + slots[None, :], mask=sv, other=ID_FLIP)
        # One int64 compare per pair: (key << 32 | (ID_FLIP - id)) orders like (key desc, id asc).
        cc = (ck.to(tl.int64) << 32) | (-ci + ID_FLIP).to(tl.int64)
        rank = tl.sum((cc[:, :, None] > cc[:, None, :]).to(tl.int32), axis=1)  # j middle, i last
        at_cut = sv & (rank == R)
        kc = tl.max(tl.where(at_cut, ck, INT32_MIN), axis=1)
        ic = tl.max(tl.where(at_cut, ci, -1), axis=1)
    else:
        kc, ic = _exact_cutoff(key, ids, R, BT, ID_BITS)

    kcb = kc[:, None]
    if QB > 0:
        member = (key > kcb) | ((key == kcb) & (ids[None, :] < ic[:, None]))
    else:
        member = (key > kcb) | ((key == kcb) & (ids[None, :] <= ic[:, None]))

    # ---- weights ----------------------------------------------------------------------------
    # Sums over the k routes (the post-softmax denominator, the renormalisation) run in the order
    # of amdqb.ref.router.routes_sum, by rank: each route's value goes to slot `rank` of the row's
    # scratch, and the k slots are summed in warp order.
    POST: tl.constexpr = SCORE == 2 and not PRE
    NEED_SUM: tl.constexpr = POST or RENORM
    wbase = (scratch_ptr + rows64 * (2 * CAP + 1 + KP) + 2 * CAP + 1).to(
        tl.pointer_type(tl.float32)
    )
    msel = m
    if POST:
        zs = tl.where(member, z, float("-inf"))
        msel = tl.max(zs, axis=1)
        vals = tl.where(member, _exp(z - msel[:, None], APPROX), 0.0)
    else:
        vals = wv
    # the compact weights need the k values even without a sum (serving form, renormalize off)
    if NEED_SUM or COMPACT_W or (MAP == 3 and not FAST):
        if FAST:
            # The ranked candidate tile holds the order; the value is recomputed from the logit
            # (same code, same bits as the dense path).
            cok = sv & (rank < K)
            cid = tl.where(cok, ci, 0)
            zc = tl.load(logits_ptr + rows64[:, None] * E + cid, mask=cok, other=0.0)
            zc = zc.to(tl.float32)
            if SCORE == 2:
                if PRE:
                    vc = tl.math.div_rn(_exp(zc - m[:, None], APPROX), ssum[:, None])
                else:
                    vc = _exp(zc - msel[:, None], APPROX)
            else:
                vc = _score(zc, SCORE, APPROX)
            tl.store(wbase[:, None] + rank, vc, mask=cok)
        else:
            # Large k: extract the members best-first (k row reductions; rare configurations).
            left = member
            for i in range(K):
                kbest = tl.max(tl.where(left, key, INT32_MIN), axis=1)
                hitk = left & (key == kbest[:, None])
                ibest = tl.min(tl.where(hitk, ids[None, :], ID_FLIP), axis=1)
                hit = left & (ids[None, :] == ibest[:, None])
                left = left & (ids[None, :] != ibest[:, None])
                if MAP == 3:
                    out = rows64 * K + i
                    tl.store(ids_ptr + out, ibest.to(ids_ptr.dtype.element_ty), mask=row_ok)
                tl.store(wbase + i, tl.sum(tl.where(hit, vals, 0.0), axis=1), mask=row_ok)
        tl.debug_barrier()  # the by-rank slots are read back by other threads of the program
    den = tl.full([BT], 1.0, tl.float32)
    if NEED_SUM:
        r = tl.arange(0, KP)
        byrank = tl.load(
            wbase[:, None] + r[None, :], mask=row_ok[:, None] & (r < K)[None, :], other=0.0
        )
        den = _warp_order_sum(byrank, BT, KP)
        if RENORM:
            den = den + 1e-20
        w = tl.math.div_rn(vals, den[:, None])
    else:
        w = vals
    w = tl.where(member, w * scaling, 0.0)

    if DENSE:
        pdst = (probs_ptr + rbase)[:, None] + col[None, :]
        tl.store(pdst, w.to(probs_ptr.dtype.element_ty), mask=mask2)
    if MAP == 1:
        tl.store((map_ptr + rbase)[:, None] + col[None, :], member.to(tl.uint8), mask=mask2)
    if MAP == 2:
        if NG > 1:
            # Grouped layout is not column order: go through a [T, E] byte scratch.
            bdst = (bytes_ptr + rbase)[:, None] + col[None, :]
            tl.store(bdst, member.to(tl.uint8), mask=mask2)
            tl.debug_barrier()
            q = tl.arange(0, EP)
            bits = tl.load(
                bytes_ptr + rows64[:, None] * E + q[None, :],
                mask=row_ok[:, None] & (q[None, :] < E),
                other=0,
            ).to(tl.int32)
        else:
            bits = member.to(tl.int32)
        shifts = tl.arange(0, 8)
        packed = tl.sum(tl.reshape(bits, (BT, EP // 8, 8)) << shifts[None, None, :], axis=2)
        bidx = tl.arange(0, EP // 8)
        tl.store(
            map_ptr + rows64[:, None] * ((E + 7) // 8) + bidx[None, :],
            packed.to(tl.uint8),
            mask=row_ok[:, None] & (bidx[None, :] < (E + 7) // 8),
        )

    # ---- compact outputs in selection order (indices, serving-form weights) ------------------
    if MAP == 3 or COMPACT_W:
        if FAST:
            cok = sv & (rank < K)
            out = rows64[:, None] * K + rank
            if MAP == 3:
                cid = tl.where(cok, ci, 0)
                tl.store(ids_ptr + out, cid.to(ids_ptr.dtype.element_ty), mask=cok)
            if COMPACT_W:
                wc = tl.math.div_rn(vc, den[:, None]) if NEED_SUM else vc
                tl.store(w_ptr + out, wc * scaling, mask=cok)
        elif COMPACT_W:  # ids went out during the extraction
            r = tl.arange(0, KP)
            rok = row_ok[:, None] & (r < K)[None, :]
            byrank = tl.load(wbase[:, None] + r[None, :], mask=rok, other=0.0)
            wc = tl.math.div_rn(byrank, den[:, None]) if NEED_SUM else byrank
            tl.store(w_ptr + rows64[:, None] * K + r[None, :], wc * scaling, mask=rok)

    # ---- Quantile Balancing -------------------------------------------------------------------
    if QB > 0:
        alpha = _key_value(kc)  # the (k+1)-th selection value
        if CUTOFF:
            tl.store(cutoff_ptr + rows, alpha, mask=row_ok)
        if MARGIN:
            # log_margin: d = alpha - (the selection value), binned by the router itself on each
            # expert's axis (bounds: the inverse scales [E]); the two-kernel mode stores the
            # bins ([T, E] bytes) for the counting pass
            inv = tl.load(bounds_ptr + col, mask=valid, other=1.0)
            bins, u, on = _margin_bins(alpha[:, None] - sel, inv[None, :], NBINS, FINE, MBITS)
            if QB == 2:
                tl.store((cut_ptr + rbase)[:, None] + col[None, :], bins.to(tl.uint8), mask=mask2)
        elif QB == 2:
            tl.store(cut_ptr + rows, alpha, mask=row_ok)
        else:
            lower, scale = _qb_scale(bounds_ptr, NBINS)
            bins = _qb_bins(alpha[:, None] - wv, lower, scale, NBINS)
        if QB == 1:
            ones = tl.full([BT, W], 1, dtype=hist_ptr.dtype.element_ty)
            slot = col[None, :] * NBINS + bins
            tl.atomic_add(hist_ptr + slot, ones, mask=mask2, sem="relaxed")
            if MOMENTS:  # planes 1 and 2 of the int64 [3, E, B] histogram: sums of u and u^2
                plane = hist_ptr + E * NBINS + slot
                tl.atomic_add(plane, u, mask=mask2 & on, sem="relaxed")
                tl.atomic_add(plane + E * NBINS, u * u, mask=mask2 & on, sem="relaxed")


# --------------------------------------------------------------------------------------------
# QB histogram, second kernel of "two_kernel": grid (expert slices, token slices).
# --------------------------------------------------------------------------------------------
@triton.jit
def _qb_hist_kernel(
    logits_ptr,
    cut_ptr,
    bounds_ptr,
    hist_ptr,
    T,
    tokens_per_prog,
    E: tl.constexpr,
    NBINS: tl.constexpr,
    EPP: tl.constexpr,  # experts per program (power of two)
    BT: tl.constexpr,  # tokens per iteration
    NB: tl.constexpr,  # private histogram size: next_pow2(EPP * NBINS)
    LDS: tl.constexpr,  # True: tl.histogram (workgroup-private), False: global atomics
    APPROX: tl.constexpr,  # the router's activation: the opt-in approximate exponential
    FROM_BINS: tl.constexpr,  # log_margin: count the router's bins (cut_ptr: uint8 [T, E])
):
    pe = tl.program_id(0)
    ps = tl.program_id(1)
    le = tl.arange(0, EPP)
    cols = pe * EPP + le
    cok = cols < E
    lower, scale = _qb_scale(bounds_ptr, NBINS)
    t_start = ps * tokens_per_prog
    t_end = tl.minimum(T, t_start + tokens_per_prog)
    hbase = hist_ptr + pe * EPP * NBINS  # the slice's rows are contiguous: key = le*B + bin
    acc = tl.zeros([NB], dtype=tl.int32)
    for t0 in range(t_start, t_end, BT):
        rows = t0 + tl.arange(0, BT)
        rok = rows < t_end
        msk = rok[:, None] & cok[None, :]
        offs = rows.to(tl.int64)[:, None] * E + cols[None, :]
        if FROM_BINS:
            bins = tl.load(cut_ptr + offs, mask=msk, other=0).to(tl.int32)
        else:
            z = tl.load(logits_ptr + offs, mask=msk, other=0.0).to(tl.float32)
            alpha = tl.load(cut_ptr + rows, mask=rok, other=0.0)
            bins = _qb_bins(alpha[:, None] - _score(z, 0, APPROX), lower, scale, NBINS)
        hkey = le[None, :] * NBINS + bins
        if LDS:
            acc += tl.histogram(
                tl.reshape(hkey, (BT * EPP,)), NB, mask=tl.reshape(msk, (BT * EPP,))
            )
        else:
            tl.atomic_add(hbase + hkey, tl.full([BT, EPP], 1, tl.int32), mask=msk, sem="relaxed")
    if LDS:
        h = tl.arange(0, NB)
        ok = (acc > 0) & (h < EPP * NBINS) & (pe * EPP * NBINS + h < E * NBINS)
        tl.atomic_add(hbase + h, acc, mask=ok, sem="relaxed")


# --------------------------------------------------------------------------------------------
# Backward (TransformerEngine's formulas; the routed set is given).
# --------------------------------------------------------------------------------------------
@triton.jit
def _router_bwd_kernel(
    grad_ptr,
    logits_ptr,
    routed_ptr,
    out_ptr,
    T,
    scaling,
    E: tl.constexpr,
    W: tl.constexpr,
    BT: tl.constexpr,
    SCORE: tl.constexpr,
    PRE: tl.constexpr,
    NORM: tl.constexpr,  # topk > 1 (sigmoid / sqrtsoftplus normalisation)
):
    pid = tl.program_id(0)
    rows = pid * BT + tl.arange(0, BT)
    row_ok = rows < T
    p = tl.arange(0, W)
    valid = p < E
    mask2 = row_ok[:, None] & valid[None, :]
    offs = rows.to(tl.int64)[:, None] * E + p[None, :]
    z = tl.load(logits_ptr + offs, mask=mask2, other=0.0).to(tl.float32)
    g = tl.load(grad_ptr + offs, mask=mask2, other=0.0).to(tl.float32) * scaling
    routed = tl.load(routed_ptr + offs, mask=mask2, other=0) != 0
    if SCORE == 2:
        if PRE:
            zm = tl.where(valid[None, :], z, float("-inf"))
            m = tl.max(zm, axis=1)
            ex = tl.where(valid[None, :], _lib_exp(zm - m[:, None]), 0.0)
            act = ex / tl.sum(ex, axis=1)[:, None]
            g = tl.where(routed, g, 0.0)
            grad = act * (g - tl.sum(g * act, axis=1)[:, None])
        else:
            zm = tl.where(routed, z, float("-inf"))
            m = tl.max(zm, axis=1)
            ex = tl.where(routed, _lib_exp(zm - m[:, None]), 0.0)
            act = tl.where(routed, ex / tl.sum(ex, axis=1)[:, None], 0.0)
            dot = tl.sum(tl.where(routed, g * act, 0.0), axis=1)
            grad = tl.where(routed, act * (g - dot[:, None]), 0.0)
    else:
        act = _score(z, SCORE)
        g = tl.where(routed, g, 0.0)
        if NORM:
            act_sel = tl.where(routed, act, 0.0)
            denom = tl.sum(act_sel, axis=1) + 1e-20
            weighted = tl.sum(g * act_sel, axis=1)
            g = g / denom[:, None] - (weighted / (denom * denom))[:, None]
            g = tl.where(routed, g, 0.0)
        if SCORE == 0:
            grad = g * act * (1.0 - act)
        else:
            dsoft = tl.where(z > 20.0, 1.0, _score(z, 0))
            grad = g * dsoft / (2.0 * act + 1e-20)
    tl.store(out_ptr + offs, grad, mask=mask2)


# --------------------------------------------------------------------------------------------
# Probe: how does this Triton lower tl.histogram for the current target?
# --------------------------------------------------------------------------------------------
@triton.jit
def _histogram_probe_kernel(x_ptr, o_ptr, N: tl.constexpr, NB: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, N))
    tl.store(o_ptr + tl.arange(0, NB), tl.histogram(x, NB, mask=x >= 0))
