"""@triton.jit bodies of TransformerEngine's aux-loss router ops (scores + Top-k map, aux loss).

Precision contract (``amdqb.ref.aux_loss``): logits are converted to fp32 on load and every
operation is fp32. The element-wise activations are computed the way PyTorch computes them on the
device: ``sigmoid(z) = 1 / (1 + exp(-z))`` with a correctly rounded division and the vendor math
library's ``exp`` (libdevice ``__nv_expf`` on NVIDIA, ocml on AMD), ``sqrt(softplus(z))`` as
``sqrt_rn(z > 20 ? z : log1p(exp(z)))`` (torch's threshold 20, libdevice ``log1p``). The launchers
compile them with FMA contraction off and, on NVIDIA, without libdevice's flush-to-zero, as
PyTorch's kernels are built. The normalisation ``a / (sum_E a + 1e-20)``, the softmax and the
aux-loss reductions sum in this kernel's order, so they agree with PyTorch to fp32 rounding.

Under ``TRITON_INTERPRET=1`` (CPU) the extern library cannot run: the router's stand-ins are used
(``_router_kernels``).

Tie-break contract: the Top-k map ranks the normalised scores by (value descending, expert id
ascending, NaN lowest) through the router's monotone int32 key, so exactly k distinct experts are
set per token for any data.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._router_kernels import INT32_MIN, _exact_cutoff, _lib_exp, _order_key, _score


@triton.jit
def _exp(x):
    return _lib_exp(x)


@triton.jit
def _activation(z, SCORE: tl.constexpr):
    """0: sigmoid, 1: sqrt(softplus), both as PyTorch evaluates them in fp32 (the router's)."""
    return _score(z, SCORE)


@triton.jit
def _row_scores(z, valid, SCORE: tl.constexpr):
    """Aux-loss scores of a [BT, W] tile: softmax (2) or the activation over its row sum."""
    if SCORE == 2:
        zm = tl.where(valid, z, float("-inf"))
        m = tl.max(zm, axis=1)
        ex = tl.where(valid, _exp(zm - m[:, None]), 0.0)
        den = tl.sum(ex, axis=1)
        s = tl.math.div_rn(ex, tl.zeros_like(ex) + den[:, None])
    else:
        a = tl.where(valid, _activation(z, SCORE), 0.0)
        den = tl.sum(a, axis=1) + 1e-20
        s = tl.math.div_rn(a, tl.zeros_like(a) + den[:, None])
    return s


@triton.jit
def _in_offsets(dense_offs, rows64, cols, row_stride, DENSE: tl.constexpr):
    """Offsets of a ``[rows, cols]`` tile of an input with unit-stride rows: the dense offsets
    (constexpr row length, which the compiler vectorises on) or ``row * row_stride + col``."""
    if DENSE:
        return dense_offs
    return rows64[:, None] * row_stride + cols[None, :]


@triton.jit
def _aux_scores_fwd_kernel(
    logits_ptr,
    scores_ptr,
    map_ptr,
    T,
    LS,  # row stride of the logits (unit-stride rows); E when DENSE
    E: tl.constexpr,
    K: tl.constexpr,
    W: tl.constexpr,  # next_pow2(E), >= 16
    BT: tl.constexpr,
    SCORE: tl.constexpr,  # 0 sigmoid, 1 sqrtsoftplus, 2 softmax
    EXTRACT: tl.constexpr,  # small k: k best-first extractions, else the exact cutoff search
    ID_BITS: tl.constexpr,
    DENSE: tl.constexpr,  # contiguous logits: the constexpr row length addresses them
):
    pid = tl.program_id(0)
    rows = pid * BT + tl.arange(0, BT)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    p = tl.arange(0, W)
    valid = p < E
    mask2 = row_ok[:, None] & valid[None, :]
    offs = rows64[:, None] * E + p[None, :]
    z = tl.load(logits_ptr + _in_offsets(offs, rows64, p, LS, DENSE), mask=mask2, other=0.0)
    z = z.to(tl.float32)
    s = _row_scores(z, valid[None, :], SCORE)
    tl.store(scores_ptr + offs, s, mask=mask2)

    key = tl.where(mask2, _order_key(s), INT32_MIN)
    if EXTRACT:
        left = mask2
        for _ in range(K):
            kb = tl.max(tl.where(left, key, INT32_MIN), axis=1)
            ib = tl.min(tl.where(left & (key == kb[:, None]), p[None, :], W), axis=1)
            left = left & (p[None, :] != ib[:, None])
        member = mask2 & ~left
    else:
        kc, ic = _exact_cutoff(key, p, K - 1, BT, ID_BITS)
        kcb = kc[:, None]
        member = mask2 & ((key > kcb) | ((key == kcb) & (p[None, :] <= ic[:, None])))

    tl.store(map_ptr + offs, member.to(tl.uint8), mask=mask2)


@triton.jit
def _aux_scores_bwd_kernel(
    grad_ptr,
    logits_ptr,
    out_ptr,
    T,
    LS,  # row stride of the logits (unit-stride rows); E when DENSE
    E: tl.constexpr,
    W: tl.constexpr,
    BT: tl.constexpr,
    SCORE: tl.constexpr,
    DENSE: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BT + tl.arange(0, BT)
    row_ok = rows < T
    p = tl.arange(0, W)
    valid = p < E
    mask2 = row_ok[:, None] & valid[None, :]
    rows64 = rows.to(tl.int64)
    offs = rows64[:, None] * E + p[None, :]
    z = tl.load(logits_ptr + _in_offsets(offs, rows64, p, LS, DENSE), mask=mask2, other=0.0)
    z = z.to(tl.float32)
    g = tl.load(grad_ptr + offs, mask=mask2, other=0.0).to(tl.float32)
    if SCORE == 2:
        act = _row_scores(z, valid[None, :], 2)
        dot = tl.sum(g * act, axis=1)
        grad = act * (g - dot[:, None])
    else:
        a = tl.where(valid[None, :], _activation(z, SCORE), 0.0)
        den = tl.sum(a, axis=1) + 1e-20
        ga = tl.sum(g * a, axis=1)
        gn = (
            tl.math.div_rn(g, tl.zeros_like(g) + den[:, None])
            - tl.math.div_rn(ga, den * den)[:, None]
        )
        if SCORE == 0:
            grad = gn * a * (1.0 - a)
        else:  # d sqrt(softplus(x)) / dx = sigmoid(x) / (2 y); sigmoid -> 1 above 20
            dsoft = tl.where(z > 20.0, 1.0, _score(z, 0))
            grad = gn * tl.math.div_rn(dsoft, 2.0 * a + 1e-20)
    tl.store(out_ptr + offs, grad.to(out_ptr.dtype.element_ty), mask=mask2)


@triton.jit
def _activation_kernel(logits_ptr, out_ptr, N, BLOCK: tl.constexpr, SCORE: tl.constexpr):
    """The element-wise activation alone (tests compare it bit for bit with PyTorch's)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    z = tl.load(logits_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, _activation(z, SCORE), mask=ok)


# --------------------------------------------------------------------------------------------
# Aux loss: per-program partial sums over a row slice, then one program folds them with C.
# --------------------------------------------------------------------------------------------
@triton.jit
def _aux_loss_partial_kernel(
    probs_ptr,
    tpe_ptr,
    partial_ptr,
    R,
    rows_per_prog,
    PS,  # row stride of probs (unit-stride rows); C when DENSE
    TS,  # element stride of tokens_per_expert
    C: tl.constexpr,
    BC: tl.constexpr,
    BR: tl.constexpr,
    DENSE: tl.constexpr,
):
    pid = tl.program_id(0)
    r_start = pid * rows_per_prog
    r_end = tl.minimum(R, r_start + rows_per_prog)
    acc = tl.zeros([BC], dtype=tl.float32)
    for c0 in range(0, C, BC):
        cols = c0 + tl.arange(0, BC)
        cok = cols < C
        colsum = tl.zeros([BC], dtype=tl.float32)
        for r0 in range(r_start, r_end, BR):
            r = r0 + tl.arange(0, BR)
            m = (r < r_end)[:, None] & cok[None, :]
            r64 = r.to(tl.int64)
            offs = _in_offsets(r64[:, None] * C + cols[None, :], r64, cols, PS, DENSE)
            x = tl.load(probs_ptr + offs, mask=m, other=0.0)
            colsum += tl.sum(x.to(tl.float32), axis=0)
        tpe = tl.load(tpe_ptr + cols.to(tl.int64) * TS, mask=cok, other=0).to(tl.float32)
        acc += colsum * tpe
    tl.store(partial_ptr + pid, tl.sum(acc, axis=0))


@triton.jit
def _aux_loss_final_kernel(
    partial_ptr,
    total_ptr,
    loss_ptr,
    coeff_ptr,
    P,
    coeff_host,
    coeff_prefix,
    PB: tl.constexpr,
    HAS_T: tl.constexpr,
):
    i = tl.arange(0, PB)
    total = tl.sum(tl.load(partial_ptr + i, mask=i < P, other=0.0), axis=0)
    if HAS_T:
        # The token count is read here, on the device, at every launch (graph replays included).
        t = tl.load(total_ptr).to(tl.float32)
        c = tl.math.div_rn(tl.math.div_rn(coeff_prefix + tl.zeros_like(t), t), t)
    else:
        c = coeff_host + tl.zeros_like(total)
    loss = total * c
    tl.store(coeff_ptr, c)
    tl.store(coeff_ptr + 1, loss)
    tl.store(loss_ptr, loss.to(loss_ptr.dtype.element_ty))


@triton.jit
def _aux_loss_bwd_kernel(
    coeff_ptr,
    tpe_ptr,
    grad_ptr,
    out_ptr,
    R,
    TS,  # element stride of tokens_per_expert
    C: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    cok = cols < C
    c = tl.load(coeff_ptr)
    g = tl.load(grad_ptr).to(tl.float32)
    tpe = tl.load(tpe_ptr + cols.to(tl.int64) * TS, mask=cok, other=0).to(tl.float32)
    v = (c * tpe) * g
    m = (r < R)[:, None] & cok[None, :]
    vals = tl.zeros([BR, BC], dtype=tl.float32) + v[None, :]
    tl.store(
        out_ptr + r.to(tl.int64)[:, None] * C + cols[None, :],
        vals.to(out_ptr.dtype.element_ty),
        mask=m,
    )
