"""TransformerEngine's aux-loss router ops: the oracle against hand-derived values and float64
autograd of the plain formulas, every kernel backend against the oracle (forward and backward),
the graph-safe device token count (eager, CUDA graph capture + replay, torch.compile) and bad inputs.

Kernel tests are parametrised over the non-oracle backends of each op (today ``triton``; on the CPU
its kernels run under ``TRITON_INTERPRET=1``). The routing map must be exact: equal to the oracle's
on tie-free logits, and on any logits (ties, NaN, +-inf) equal to the Top-k of the backend's own
scores in the (score desc, id asc, NaN lowest) order. Scores, losses and gradients agree with the
oracle to fp32 rounding (the row sums associate differently); the element-wise activations are
bitwise PyTorch's on a GPU.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

import amdqb
from amdqb import ref
from amdqb.ref import aux_loss as ref_aux

from conftest import DEVICE, HAS_GPU, kernel_backends, requires_gpu

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on NaN / inf inputs

SCORE_BACKENDS = kernel_backends("aux_scores_fwd")
LOSS_BACKENDS = kernel_backends("aux_loss_fwd")
SCORE_FUNCTIONS = ("sigmoid", "softmax", "sqrtsoftplus")
FORMATS = ("bytemap", "bitmap_u8")

if HAS_GPU:
    SCORE_SHAPES = [((2048,), 1024), ((7168,), 128), ((64, 2), 32)]
    TOPKS = (1, 4, 16, 32)
    LOSS_SHAPES = [(2048, 256), (14234, 32), (7168, 1024)]
else:
    SCORE_SHAPES = [((3, 2), 37), ((5,), 130)]
    TOPKS = (1, 4, 20)  # 20 > 16 takes the exact cutoff search instead of extractions
    LOSS_SHAPES = [(33, 16), (70, 130)]

FP_TOL = {torch.float32: (2e-6, 1e-6), torch.bfloat16: (1.6e-2, 1e-5), torch.float16: (2e-3, 1e-5)}


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def tie_free_logits(lead, e, dtype=torch.float32, seed=0, span=6.0):
    """A per-token permutation of an evenly spaced grid plus a small per-token offset."""
    g = torch.Generator().manual_seed(seed)
    t = math.prod(lead)
    base = torch.arange(e, dtype=torch.float64) * (span / e) - span / 2
    rows = torch.stack([base[torch.randperm(e, generator=g)] for _ in range(t)])
    rows = rows + torch.rand(t, 1, generator=g, dtype=torch.float64) * 0.05
    return rows.reshape(*lead, e).to(dtype).to(DEVICE)


def adversarial_logits(t, e, seed=0):
    """Ties, repeated values, NaN, +-inf, huge and denormal magnitudes."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(t, e, generator=g) * 4
    z[0] = 1.5  # a row of exact ties
    z[1, ::3] = float("nan")
    z[2, ::5] = float("inf")
    z[2, 1::5] = float("-inf")
    z[3] = torch.tensor([90.0, -90.0, 1e-40, -1e-40, 0.0, -0.0, 20.0, -20.0] * e)[:e]
    z[4, : e // 2] = z[4, e // 2 : 2 * (e // 2)]  # pairwise ties
    return z.to(DEVICE)


def score_rtol(e):
    """Scores divide by a row sum of E terms summed in another order: a few sqrt(E) ulp."""
    return max(2e-6, 4 * math.sqrt(e) * 6e-8)


def packed(routing_map, fmt):
    return ref.pack_bitmap(routing_map) if fmt == "bitmap_u8" else routing_map


def map_of_scores(scores, topk):
    """The Top-k map of given fp32 scores in the contract's order."""
    idx = ref.ranked_indices(scores.reshape(-1, scores.shape[-1]), topk)
    m = torch.zeros(idx.shape[0], scores.shape[-1], dtype=torch.bool, device=scores.device)
    return m.scatter_(1, idx, True).reshape(scores.shape)


def plain_scores_f64(logits, score_function):
    """The aux-loss scores written directly in float64."""
    z = logits.double()
    if score_function == "softmax":
        ex = torch.exp(z - z.max(-1, keepdim=True).values)
        return ex / ex.sum(-1, keepdim=True)
    if score_function == "sigmoid":
        a = 1.0 / (1.0 + torch.exp(-z))
    else:
        a = torch.sqrt(torch.where(z > 20, z, torch.log1p(torch.exp(z))))
    return a / (a.sum(-1, keepdim=True) + 1e-20)


# ----------------------------------------------------------------------------------------------
# the oracle
# ----------------------------------------------------------------------------------------------
def test_ref_scores_hand_vector_and_tie_order():
    # sigmoid([0, 0, ln 3]) = [1/2, 1/2, 3/4] -> normalised [2/7, 2/7, 3/7]
    z = torch.tensor([[0.0, 0.0, math.log(3.0)]])
    rmap, s = ref_aux.compute_scores_for_aux_loss(z, 2, "sigmoid")
    torch.testing.assert_close(s, torch.tensor([[2 / 7, 2 / 7, 3 / 7]]))
    assert rmap.tolist() == [[True, False, True]]  # the tie at 2/7 keeps the smaller id
    # normalised for topk = 1 too (TE normalises whatever topk is)
    _, s1 = ref_aux.compute_scores_for_aux_loss(z, 1, "sigmoid")
    torch.testing.assert_close(s1, s)
    # softmax([0, 0, ln 2]) = [1/4, 1/4, 1/2]
    rmap, s = ref_aux.compute_scores_for_aux_loss(
        torch.tensor([[0.0, 0.0, math.log(2.0)]]), 1, "softmax"
    )
    torch.testing.assert_close(s, torch.tensor([[0.25, 0.25, 0.5]]))
    assert rmap.tolist() == [[False, False, True]]
    # sqrt(softplus): the branch above torch's threshold 20 is the identity
    _, s = ref_aux.compute_scores_for_aux_loss(torch.tensor([[25.0, 25.0]]), 1, "sqrtsoftplus")
    torch.testing.assert_close(s, torch.tensor([[0.5, 0.5]]))


@pytest.mark.parametrize("score_function", SCORE_FUNCTIONS)
def test_ref_scores_and_grad_match_float64_formula(score_function):
    z = tie_free_logits((6,), 24, seed=3).cpu().requires_grad_(True)
    rmap, s = ref_aux.compute_scores_for_aux_loss(z, 5, score_function)
    z64 = z.detach().double().requires_grad_(True)
    s64 = plain_scores_f64(z64, score_function)
    torch.testing.assert_close(s.double(), s64, rtol=2e-6, atol=1e-7)
    assert torch.equal(rmap, map_of_scores(s64.float(), 5))
    g = torch.randn(s.shape, generator=torch.Generator().manual_seed(1))
    (s * g).sum().backward()
    (s64 * g.double()).sum().backward()
    torch.testing.assert_close(z.grad.double(), z64.grad, rtol=1e-5, atol=1e-7)
    # the torch backend's explicit (TE) backward formulas equal autograd of the oracle
    out = torch.empty_like(z)
    importlib.import_module("amdqb.backends.torch").aux_scores_bwd(
        g, z.detach(), score_function, out
    )
    torch.testing.assert_close(out, z.grad, rtol=1e-5, atol=1e-8)


def test_ref_aux_loss_hand_vector_and_gradient():
    probs = torch.tensor([[0.1, 0.2], [0.3, 0.4]], requires_grad=True)
    tpe = torch.tensor([3, 5], dtype=torch.int32)
    # C = 2 * 0.5 / 1 / 2 / 2 = 0.25; sum = 0.4 * 3 + 0.6 * 5 = 4.2
    loss = ref_aux.moe_aux_loss(probs, tpe, 2, 2, 1, 0.5)
    torch.testing.assert_close(loss, torch.tensor(1.05))
    loss.backward()
    torch.testing.assert_close(probs.grad, torch.tensor([[0.75, 1.25], [0.75, 1.25]]))


@pytest.mark.parametrize(
    "num_experts,topk,coeff,total",
    [(128, 4, 0.01, 4096), (1024, 32, 1e-3, 14234), (896, 16, 0.1, 2**25 + 1), (3, 7, 1 / 3, 97)],
)
def test_coefficient_is_te_fp32_sequence(num_experts, topk, coeff, total):
    np = pytest.importorskip("numpy")
    f = np.float32
    expect = f(f(f(f(num_experts) * f(coeff)) / f(topk)) / f(total)) / f(total)
    assert ref_aux.host_coefficient(num_experts, topk, coeff, total) == float(expect)
    prefix = ref_aux.coefficient_prefix(num_experts, topk, coeff)
    dev = ref_aux.device_coefficient(prefix, torch.tensor(total, dtype=torch.int64, device=DEVICE))
    assert dev.dtype == torch.float32 and dev.item() == float(expect)


# ----------------------------------------------------------------------------------------------
# kernels: scores
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", SCORE_BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("topk", TOPKS)
@pytest.mark.parametrize("score_function", SCORE_FUNCTIONS)
@pytest.mark.parametrize("lead,e", SCORE_SHAPES)
def test_scores_forward_backward_match_oracle(backend, lead, e, score_function, topk, fmt):
    if topk > e:
        pytest.skip(f"topk={topk} > E={e}")
    z = tie_free_logits(lead, e, seed=e + topk).requires_grad_(True)
    rmap, s = amdqb.fused_compute_score_for_moe_aux_loss(
        z, topk, score_function, fmt, backend=backend
    )
    zr = z.detach().clone().requires_grad_(True)
    want_map, want = ref_aux.compute_scores_for_aux_loss(zr, topk, score_function)
    assert s.dtype == torch.float32 and s.shape == z.shape
    nbytes = (e + 7) // 8
    assert rmap.shape == (*lead, e if fmt == "bytemap" else nbytes)
    assert rmap.dtype == (torch.bool if fmt == "bytemap" else torch.uint8)
    torch.testing.assert_close(s, want, rtol=score_rtol(e), atol=1e-7)
    assert torch.equal(rmap, packed(want_map, fmt))
    g = torch.randn(s.shape, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    (s * g).sum().backward()
    (want * g).sum().backward()
    assert z.grad.dtype == z.dtype
    torch.testing.assert_close(z.grad, zr.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", SCORE_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("score_function", SCORE_FUNCTIONS)
def test_scores_low_precision_logits(backend, score_function, dtype):
    lead, e = SCORE_SHAPES[0]
    z = tie_free_logits(lead, e, dtype=dtype, seed=11).requires_grad_(True)
    rmap, s = amdqb.fused_compute_score_for_moe_aux_loss(z, 4, score_function, backend=backend)
    zr = z.detach().clone().requires_grad_(True)
    want_map, want = ref_aux.compute_scores_for_aux_loss(zr, 4, score_function)
    assert s.dtype == torch.float32  # math and scores stay fp32 whatever the logits dtype
    torch.testing.assert_close(s, want, rtol=score_rtol(e), atol=1e-7)
    assert torch.equal(rmap, want_map)
    g = torch.randn(s.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    (s * g).sum().backward()
    (want * g).sum().backward()
    assert z.grad.dtype == dtype
    rtol, atol = FP_TOL[dtype]
    torch.testing.assert_close(z.grad, zr.grad, rtol=rtol, atol=atol)


@pytest.mark.parametrize("backend", SCORE_BACKENDS)
@pytest.mark.parametrize("score_function", SCORE_FUNCTIONS)
def test_map_is_exact_topk_of_own_scores_on_adversarial_logits(backend, score_function):
    t, e = (9, 40) if not HAS_GPU else (64, 896)
    z = adversarial_logits(t, e)
    for topk in (1, 3, 17, e):
        for fmt in FORMATS:
            rmap, s = amdqb.fused_compute_score_for_moe_aux_loss(
                z, topk, score_function, fmt, backend=backend
            )
            assert torch.equal(rmap, packed(map_of_scores(s, topk), fmt)), (topk, fmt)
            if fmt == "bytemap":
                assert torch.all(rmap.sum(-1) == topk)
        # scores agree with the oracle wherever the oracle is finite
        _, want = ref_aux.compute_scores_for_aux_loss(z, 1, score_function)
        torch.testing.assert_close(s, want, rtol=2e-6, atol=1e-7, equal_nan=True)


@pytest.mark.parametrize("backend", SCORE_BACKENDS)
@pytest.mark.parametrize("score_function", SCORE_FUNCTIONS)
def test_bitmap_and_bytemap_agree_bitwise(backend, score_function):
    lead, e = SCORE_SHAPES[-1]
    z = tie_free_logits(lead, e, seed=5)
    za, zb = (z.clone().requires_grad_(True) for _ in range(2))
    byte_map, s_byte = amdqb.fused_compute_score_for_moe_aux_loss(
        za, 4, score_function, "bytemap", backend=backend
    )
    bit_map, s_bit = amdqb.fused_compute_score_for_moe_aux_loss(
        zb, 4, score_function, "bitmap_u8", backend=backend
    )
    assert torch.equal(s_byte, s_bit)
    assert torch.equal(bit_map, ref.pack_bitmap(byte_map))
    s_byte.sum().backward()
    s_bit.sum().backward()
    assert torch.equal(za.grad, zb.grad)


@pytest.mark.parametrize("backend", SCORE_BACKENDS)
def test_activations_are_torch_bitwise(backend):
    if backend != "triton":
        pytest.skip(f"{backend} exposes no activation probe")
    from amdqb.backends.triton.aux_loss import activation_values

    g = torch.Generator().manual_seed(0)
    special = [0.0, -0.0, 1e-40, -1e-40, 20.0, 20.000002, 19.999998, 88.7, -88.7, 87.3, -87.3]
    special += [103.0, -103.0, -104.0, 200.0, -200.0, float("inf"), float("-inf"), float("nan")]
    x = torch.cat([torch.randn(1 << 14, generator=g) * 12, torch.linspace(-110, 110, 8193)])
    x = torch.cat([x, torch.tensor(special)]).to(DEVICE)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        for name, fn in (
            ("sigmoid", torch.sigmoid),
            ("sqrtsoftplus", lambda v: torch.sqrt(torch.nn.functional.softplus(v))),
        ):
            got = activation_values(xd, name)
            want = fn(xd.float())
            if HAS_GPU:  # libdevice / ocml on the device, as PyTorch uses them
                assert torch.equal(got.isnan(), want.isnan())
                ok = got.isnan() | (got == want)
                assert bool(ok.all()), (name, dtype, x[~ok][:8].tolist())
            else:  # the interpreter's numpy exp is not PyTorch's CPU exp: a few ulp
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-20, equal_nan=True)


@pytest.mark.parametrize("backend", SCORE_BACKENDS)
def test_scores_empty_and_default_format(backend):
    z = torch.empty(0, 3, 8, device=DEVICE)
    rmap, s = amdqb.fused_compute_score_for_moe_aux_loss(z, 2, "sigmoid", backend=backend)
    assert rmap.shape == (0, 3, 8) and rmap.dtype == torch.bool and s.shape == (0, 3, 8)


# ----------------------------------------------------------------------------------------------
# kernels: aux loss
# ----------------------------------------------------------------------------------------------
def loss_inputs(rows, cols, probs_dtype, tpe_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    probs = (torch.rand(rows, cols, generator=g) - 0.3).to(probs_dtype).to(DEVICE)
    tpe = torch.randint(1, 1000, (cols,), generator=g).to(tpe_dtype).to(DEVICE)
    return probs.requires_grad_(True), tpe


@pytest.mark.parametrize("backend", LOSS_BACKENDS)
@pytest.mark.parametrize("multiplier", [1, 2])
@pytest.mark.parametrize("rows,e", LOSS_SHAPES)
@pytest.mark.parametrize("graph_safe", [False, True])
def test_aux_loss_matches_oracle(backend, rows, e, multiplier, graph_safe):
    cols = e * multiplier
    probs, tpe = loss_inputs(rows, cols, torch.float32, torch.int32, seed=rows)
    topk, coeff = 4, 0.01
    total = torch.tensor(rows, dtype=torch.int64, device=DEVICE) if graph_safe else rows
    loss = amdqb.fused_moe_aux_loss(probs, tpe, total, e, topk, coeff, backend=backend)
    pr = probs.detach().clone().requires_grad_(True)
    want = ref_aux.moe_aux_loss(pr, tpe, rows, e, topk, coeff)
    assert loss.shape == () and loss.dtype == torch.float32
    # TE's tolerance scaled by the column count: sums of that many values associate differently
    tol = max(1e-5, 2 * cols * 2e-7)
    torch.testing.assert_close(loss, want, rtol=tol, atol=tol)
    loss.backward()
    want.backward()
    torch.testing.assert_close(probs.grad, pr.grad, rtol=1e-6, atol=0.0)
    # the backward is C * tokens_per_expert * grad in fp32: bitwise the torch backend's
    pt = probs.detach().clone().requires_grad_(True)
    amdqb.fused_moe_aux_loss(pt, tpe, total, e, topk, coeff, backend="torch").backward()
    assert torch.equal(probs.grad, pt.grad)


@pytest.mark.parametrize("backend", LOSS_BACKENDS)
@pytest.mark.parametrize("probs_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tpe_dtype", [torch.int32, torch.int64, torch.float32, torch.bfloat16])
def test_aux_loss_dtypes(backend, probs_dtype, tpe_dtype):
    rows, e = LOSS_SHAPES[0]
    probs, tpe = loss_inputs(rows, e, probs_dtype, tpe_dtype, seed=3)
    loss = amdqb.fused_moe_aux_loss(probs, tpe, rows, e, 2, 0.1, backend=backend)
    pr = probs.detach().clone().requires_grad_(True)
    want = ref_aux.moe_aux_loss(pr, tpe, rows, e, 2, 0.1)
    assert loss.dtype == probs_dtype  # the loss and its gradient are in the probs dtype
    rtol, atol = FP_TOL[probs_dtype]
    torch.testing.assert_close(loss, want, rtol=max(rtol, 2e-5), atol=atol)
    loss.backward()
    want.backward()
    assert probs.grad.dtype == probs_dtype
    torch.testing.assert_close(probs.grad, pr.grad, rtol=rtol, atol=atol)


@pytest.mark.parametrize("backend", LOSS_BACKENDS)
def test_graph_safe_count_equals_int_path_and_is_read_every_call(backend):
    rows, e = LOSS_SHAPES[-1]
    probs, tpe = loss_inputs(rows, e, torch.float32, torch.int64, seed=9)
    total = torch.tensor(rows, dtype=torch.int64, device=DEVICE)
    with torch.no_grad():
        by_int = amdqb.fused_moe_aux_loss(probs, tpe, rows, e, 8, 0.01, backend=backend)
        by_tensor = amdqb.fused_moe_aux_loss(probs, tpe, total, e, 8, 0.01, backend=backend)
        assert torch.equal(by_int, by_tensor)  # the same fp32 coefficient, the same sums
        total.fill_(3 * rows - 5)  # changed in place: the next call must see it
        again = amdqb.fused_moe_aux_loss(probs, tpe, total, e, 8, 0.01, backend=backend)
        want = amdqb.fused_moe_aux_loss(probs, tpe, 3 * rows - 5, e, 8, 0.01, backend=backend)
    assert torch.equal(again, want)
    # a one-element [1] tensor works like the 0-dim one
    one = torch.tensor([rows], dtype=torch.int64, device=DEVICE)
    with torch.no_grad():
        assert torch.equal(
            amdqb.fused_moe_aux_loss(probs, tpe, one, e, 8, 0.01, backend=backend), by_int
        )


@requires_gpu
@pytest.mark.parametrize("backend", LOSS_BACKENDS)
def test_aux_loss_graph_capture_replays_with_changed_count_and_probs(backend):
    rows, e, topk, coeff = 4096, 128, 4, 0.01
    probs, tpe = loss_inputs(rows, e, torch.float32, torch.int32, seed=1)
    total = torch.tensor(rows, dtype=torch.int64, device=DEVICE)

    def step():
        out = amdqb.fused_moe_aux_loss(probs, tpe, total, e, topk, coeff, backend=backend)
        return out, torch.autograd.grad(out, probs)[0]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, grad = step()
    g = torch.Generator().manual_seed(5)
    for new_total in (rows, rows // 2, 2 * rows - 17):
        with torch.no_grad():
            probs.copy_(torch.rand(rows, e, generator=g).to(DEVICE))
        total.fill_(new_total)
        graph.replay()
        torch.cuda.synchronize()
        pr = probs.detach().clone().requires_grad_(True)
        want = ref_aux.moe_aux_loss(pr, tpe, new_total, e, topk, coeff)
        (want_grad,) = torch.autograd.grad(want, pr)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=0.0)


@requires_gpu
@pytest.mark.parametrize("backend", SCORE_BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_scores_graph_capture_replays_with_changed_logits(backend, fmt):
    t, e, topk = 1024, 256, 8
    z = tie_free_logits((t,), e, seed=1).requires_grad_(True)
    gout = torch.randn(t, e, device=DEVICE)

    def step():
        rmap, s = amdqb.fused_compute_score_for_moe_aux_loss(
            z, topk, "sigmoid", fmt, backend=backend
        )
        return rmap, s, torch.autograd.grad(s, z, gout)[0]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rmap, s, grad = step()
    for seed in (2, 3):
        with torch.no_grad():
            z.copy_(tie_free_logits((t,), e, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        zr = z.detach().clone().requires_grad_(True)
        want_map, want = ref_aux.compute_scores_for_aux_loss(zr, topk, "sigmoid")
        (want_grad,) = torch.autograd.grad(want, zr, gout)
        assert torch.equal(rmap, packed(want_map, fmt))
        torch.testing.assert_close(s, want, rtol=2e-6, atol=1e-7)
        torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-7)


@requires_gpu
@pytest.mark.parametrize("backend", LOSS_BACKENDS)
def test_graph_safe_path_never_syncs(backend):
    probs, tpe = loss_inputs(512, 64, torch.float32, torch.int32)
    total = torch.tensor(512, dtype=torch.int64, device=DEVICE)
    amdqb.fused_moe_aux_loss(probs, tpe, total, 64, 2, 0.01, backend=backend).backward()  # warm
    amdqb.fused_compute_score_for_moe_aux_loss(probs, 2, "softmax", backend=backend)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = amdqb.fused_moe_aux_loss(probs, tpe, total, 64, 2, 0.01, backend=backend)
        loss.backward()
        amdqb.fused_compute_score_for_moe_aux_loss(probs, 2, "softmax", backend=backend)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("backend", SCORE_BACKENDS)
def test_both_ops_compile_without_graph_breaks(backend):
    torch._dynamo.reset()
    e, topk = 32, 4
    z = tie_free_logits((6, 2), e, seed=4)
    probs, tpe = loss_inputs(12, e, torch.float32, torch.int32, seed=2)
    total = torch.tensor(12, dtype=torch.int64, device=DEVICE)

    def fn(x, p, n):
        rmap, s = amdqb.fused_compute_score_for_moe_aux_loss(
            x, topk, "sigmoid", "bitmap_u8", backend=backend
        )
        loss = amdqb.fused_moe_aux_loss(p, tpe, n, e, topk, 0.01, backend=backend)
        return rmap, s * 2, loss

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    xa, xb = (z.clone().requires_grad_(True) for _ in range(2))
    pa, pb = (probs.detach().clone().requires_grad_(True) for _ in range(2))
    got = compiled(xa, pa, total)
    want = fn(xb, pb, total)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    torch.testing.assert_close(got[2], want[2])
    (got[1].sum() + got[2]).backward()
    (want[1].sum() + want[2]).backward()
    torch.testing.assert_close(xa.grad, xb.grad)
    torch.testing.assert_close(pa.grad, pb.grad)
    for name in ("aux_scores_fwd", "aux_scores_bwd", "aux_loss_fwd", "aux_loss_bwd"):
        assert hasattr(torch.ops.amdqb, name), name


# ----------------------------------------------------------------------------------------------
# bad inputs: a clear error naming the argument, before any launch
# ----------------------------------------------------------------------------------------------
def _scores(**kw):
    args = dict(logits=torch.randn(4, 8), topk=2, score_function="sigmoid")
    args.update(kw)
    return lambda: amdqb.fused_compute_score_for_moe_aux_loss(**args)


def _loss(**kw):
    args = dict(
        probs=torch.rand(4, 8),
        tokens_per_expert=torch.ones(8, dtype=torch.int32),
        total_num_tokens=4,
        num_experts=8,
        topk=2,
        coeff=0.01,
    )
    args.update(kw)
    return lambda: amdqb.fused_moe_aux_loss(**args)


BAD = [
    ("logits list", _scores(logits=[[1.0, 2.0]]), TypeError, "logits"),
    ("logits fp64", _scores(logits=torch.randn(4, 8, dtype=torch.float64)), TypeError, "logits"),
    ("logits 0-dim", _scores(logits=torch.tensor(1.0)), ValueError, "logits"),
    ("no experts", _scores(logits=torch.randn(4, 0)), ValueError, "logits"),
    ("topk zero", _scores(topk=0), ValueError, "topk"),
    ("topk > E", _scores(topk=9), ValueError, "topk"),
    ("topk float", _scores(topk=2.0), TypeError, "topk"),
    ("score fn", _scores(score_function="relu"), ValueError, "score_function"),
    ("map format", _scores(routing_map_format="dense"), ValueError, "routing_map_format"),
    ("map format int", _scores(routing_map_format=2), ValueError, "routing_map_format"),
    ("probs 1-D", _loss(probs=torch.rand(8)), ValueError, "probs"),
    ("probs 3-D", _loss(probs=torch.rand(2, 2, 8)), ValueError, "probs"),
    ("probs int", _loss(probs=torch.ones(4, 8, dtype=torch.int32)), TypeError, "probs"),
    ("tpe shape", _loss(tokens_per_expert=torch.ones(7)), ValueError, "tokens_per_expert"),
    (
        "tpe fp16",
        _loss(tokens_per_expert=torch.ones(8, dtype=torch.float16)),
        TypeError,
        "tokens_per_expert",
    ),
    ("tpe list", _loss(tokens_per_expert=[1] * 8), TypeError, "tokens_per_expert"),
    ("experts zero", _loss(num_experts=0), ValueError, "num_experts"),
    ("cols not multiple", _loss(num_experts=3), ValueError, "num_experts"),
    ("loss topk zero", _loss(topk=0), ValueError, "topk"),
    ("coeff str", _loss(coeff="0.1"), TypeError, "coeff"),
    ("total zero", _loss(total_num_tokens=0), ValueError, "total_num_tokens"),
    ("total float", _loss(total_num_tokens=4.0), TypeError, "total_num_tokens"),
    ("total bool", _loss(total_num_tokens=True), TypeError, "total_num_tokens"),
    (
        "total int32 tensor",
        _loss(total_num_tokens=torch.tensor(4, dtype=torch.int32)),
        TypeError,
        "total_num_tokens",
    ),
    (
        "total two elements",
        _loss(total_num_tokens=torch.tensor([4, 4])),
        ValueError,
        "total_num_tokens",
    ),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_inputs_name_the_argument(case, monkeypatch):
    _, call, exc, phrase = case

    def no_launch(*args, **kwargs):  # validation must come before any kernel-level call
        raise AssertionError("a kernel was reached with a bad argument")

    from amdqb.ops import aux_loss as ops_aux

    for name in ("_aux_scores_fwd", "_aux_loss_fwd"):
        monkeypatch.setattr(ops_aux, name, no_launch)
    with pytest.raises(exc, match=phrase):
        call()


@requires_gpu
def test_device_mismatch_names_the_argument():
    with pytest.raises(ValueError, match="tokens_per_expert"):
        amdqb.fused_moe_aux_loss(torch.rand(4, 8, device="cuda"), torch.ones(8), 4, 8, 2, 0.01)
    with pytest.raises(ValueError, match="total_num_tokens"):
        amdqb.fused_moe_aux_loss(
            torch.rand(4, 8, device="cuda"),
            torch.ones(8, device="cuda"),
            torch.tensor(4),
            8,
            2,
            0.01,
        )
