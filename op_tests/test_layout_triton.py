"""Layout and QB-update kernels (route rows, align block size, chunk sort + pad, QB recovery and
step) against the ``amdqb.ref`` oracles, through the public API, for every kernel backend.

On the CPU the Triton kernels run under ``TRITON_INTERPRET=1`` (slow: shapes stay small and the
sorts use 64-route sub-chunks, which also exercises the multi-sub-chunk paths); on a GPU the same
tests run at the seed shapes (M up to 8192, k=16, E up to 4096, H=2048).
"""

import struct

import pytest
import torch

import amdqb
from amdqb import ref
from conftest import DEVICE, HAS_GPU, available_backends, kernel_backends

OPS = ("route_rows", "align_block_size", "chunk_copy", "qb_step")
EXPERT_COUNTS = (1, 2, 255, 256, 257, 384, 385, 512, 513, 896, 1024, 4096)
ROUTE_MODES = ("atomic", "lds", "deterministic")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def make_ids(m, k, e, dist, seed=0, dtype=torch.int32):
    """CPU ``[m, k]`` ids of a named distribution."""
    g = _gen(seed)
    ids = torch.randint(0, e, (m, k), generator=g, dtype=torch.int64)
    if dist == "shared":  # expert 0 in every token (a fused shared expert)
        ids[:, 0] = 0
    elif dist == "one":
        ids.fill_(e - 1)
    elif dist == "dropped":  # -1 and >= E routes mixed in
        flat = ids.view(-1)
        flat[::3] = -1
        flat[1::5] = e + 3
        flat[2::7] = 2**31 - 1 if dtype == torch.int32 else 2**40
    elif dist != "uniform":
        raise ValueError(dist)
    return ids.to(dtype)


def route(ids, e, mode, capacity=None, counters=None, backend=None):
    return amdqb.moe_route_rows(
        ids,
        e,
        capacity=capacity,
        counters=counters,
        deterministic=mode == "deterministic",
        impl="lds" if mode == "lds" else "atomic",
        backend=backend,
    )


def check_route(ids, e, capacity, c0, rows, counts, counters_after, exact):
    """Counts and counters equal the oracle's; rows equal it bitwise (``exact``) or form a
    bijection onto its row set with every row owned by the route's expert."""
    c_ref = c0.clone()
    r_ref, n_ref = ref.moe_route_rows(ids.cpu(), e, capacity, c_ref)
    rows, counts, counters_after = rows.cpu(), counts.cpu(), counters_after.cpu()
    assert rows.shape == ids.shape and rows.dtype == torch.int32
    assert torch.equal(counts, n_ref)
    assert torch.equal(counters_after, c_ref)
    if exact:
        assert torch.equal(rows, r_ref)
        return
    flat = ids.reshape(-1).cpu().long()
    valid = (flat >= 0) & (flat < e)
    r, rr = rows.reshape(-1).long(), r_ref.reshape(-1).long()
    assert torch.all(r[~valid] == -1)
    assert torch.equal(torch.sort(r[r >= 0]).values, torch.sort(rr[rr >= 0]).values)
    if (rr >= 0).any():
        owner = torch.full((int(rr.max()) + 1,), -1, dtype=torch.int64)
        owner[rr[rr >= 0]] = flat[rr >= 0]
        assert torch.equal(owner[r[r >= 0]], flat[r >= 0])


# ----------------------------------------------------------------------------------------------
# route rows
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", kernel_backends("route_rows"))
@pytest.mark.parametrize("capacity_mode", ["capacity", "compact"])
@pytest.mark.parametrize("e", EXPERT_COUNTS)
def test_route_rows_expert_counts(backend, e, capacity_mode):
    m, k = (2048, 16) if HAS_GPU else (16, 4)
    ids = make_ids(m, k, e, "dropped", seed=e)
    c0 = torch.randint(0, 3, (e,), generator=_gen(1), dtype=torch.int32)
    capacity = max(1, (m * k) // (2 * e)) if capacity_mode == "capacity" else None
    counts_by_mode = {}
    for mode in ROUTE_MODES:
        counters = c0.clone().to(DEVICE)
        rows, counts = route(ids.to(DEVICE), e, mode, capacity, counters, backend)
        check_route(ids, e, capacity, c0, rows, counts, counters, mode == "deterministic")
        counts_by_mode[mode] = counts.cpu()
    assert torch.equal(counts_by_mode["atomic"], counts_by_mode["lds"])


@pytest.mark.parametrize("backend", kernel_backends("route_rows"))
@pytest.mark.parametrize("mode", ROUTE_MODES)
@pytest.mark.parametrize("dist", ["uniform", "shared", "one", "dropped", "counters", "int64"])
def test_route_rows_distributions(backend, dist, mode):
    m, k, e = (8192, 16, 896) if HAS_GPU else (24, 4, 385)
    dtype = torch.int64 if dist in ("int64", "dropped") else torch.int32
    base = {"int64": "dropped", "counters": "uniform"}.get(dist, dist)
    ids = make_ids(m, k, e, base, seed=7, dtype=dtype)
    if dist == "counters":
        c0 = torch.randint(0, 1000, (e,), generator=_gen(2), dtype=torch.int32)
    else:
        c0 = torch.zeros(e, dtype=torch.int32)
    for capacity in (None, (m * k) // e + 2, 1):
        counters = c0.clone().to(DEVICE)
        rows, counts = route(ids.to(DEVICE), e, mode, capacity, counters, backend)
        check_route(ids, e, capacity, c0, rows, counts, counters, mode == "deterministic")


@pytest.mark.parametrize("backend", kernel_backends("route_rows"))
@pytest.mark.parametrize("mode", ROUTE_MODES)
def test_route_rows_many_blocks(backend, mode):
    """Several programs (and several sort sub-chunks per program) reserve intervals of the same
    experts; nonzero caller counters shift every slot."""
    m, k, e = (16384, 16, 4096) if HAS_GPU else (300, 4, 300)
    ids = make_ids(m, k, e, "dropped", seed=3)
    ids.view(-1)[::4] = 5  # one hot expert across blocks
    c0 = torch.randint(0, 50, (e,), generator=_gen(4), dtype=torch.int32)
    for capacity in (None, (m * k) // e):
        counters = c0.clone().to(DEVICE)
        rows, counts = route(ids.to(DEVICE), e, mode, capacity, counters, backend)
        check_route(ids, e, capacity, c0, rows, counts, counters, mode == "deterministic")


@pytest.mark.parametrize("backend", kernel_backends("route_rows"))
def test_route_rows_deterministic_reproducible(backend):
    m, k, e = (8192, 16, 896) if HAS_GPU else (32, 4, 896)
    ids = make_ids(m, k, e, "shared", seed=11).to(DEVICE)
    first = route(ids, e, "deterministic", backend=backend)
    for impl in ("atomic", "lds"):
        again = amdqb.moe_route_rows(ids, e, deterministic=True, impl=impl, backend=backend)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("backend", kernel_backends("route_rows"))
@pytest.mark.parametrize("mode", ["atomic", "deterministic"])
def test_route_rows_beyond_lds_experts(backend, mode):
    """E > 4096: the atomic path and the wide deterministic kernels; lds is refused."""
    m, k, e = (4096, 16, 10000) if HAS_GPU else (40, 4, 5000)
    ids = make_ids(m, k, e, "dropped", seed=5)
    ids.view(-1)[1::9] = e - 1
    c0 = torch.randint(0, 3, (e,), generator=_gen(6), dtype=torch.int32)
    for capacity in (None, 2):
        counters = c0.clone().to(DEVICE)
        rows, counts = route(ids.to(DEVICE), e, mode, capacity, counters, backend)
        check_route(ids, e, capacity, c0, rows, counts, counters, mode == "deterministic")
    with pytest.raises((ValueError, RuntimeError)):
        amdqb.moe_route_rows(ids.to(DEVICE), e, impl="lds", backend=backend)


@pytest.mark.parametrize("backend", kernel_backends("route_rows"))
@pytest.mark.parametrize("mode", ROUTE_MODES)
def test_route_rows_empty(backend, mode):
    ids = torch.empty(0, 4, dtype=torch.int32, device=DEVICE)
    counters = torch.arange(8, dtype=torch.int32, device=DEVICE)
    rows, counts = route(ids, 8, mode, None, counters, backend)
    assert rows.shape == (0, 4)
    assert torch.equal(counts.cpu(), torch.zeros(8, dtype=torch.int32))
    assert torch.equal(counters.cpu(), torch.arange(8, dtype=torch.int32))


# ----------------------------------------------------------------------------------------------
# moe_align_block_size
# ----------------------------------------------------------------------------------------------


def check_align(ids, block_size, e, pad, backend, expert_map=None):
    got = amdqb.moe_align_block_size(
        ids.to(DEVICE), block_size, e, expert_map, pad_sorted_ids=pad, backend=backend
    )
    emap = None if expert_map is None else expert_map.cpu()
    exp = ref.moe_align_block_size(ids.cpu(), block_size, e, emap, pad)
    for g, x in zip(got, exp):
        assert g.dtype == torch.int32
        assert torch.equal(g.cpu(), x)
    return got


@pytest.mark.parametrize("backend", kernel_backends("align_block_size"))
def test_align_vllm_example(backend):
    ids = torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]], dtype=torch.int32)
    sorted_ids, expert_ids, post = check_align(ids, 4, 5, False, backend)
    assert sorted_ids[:16].tolist() == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
    assert torch.all(sorted_ids[16:] == 12)
    assert expert_ids.tolist()[:4] == [1, 2, 3, 4] and post.tolist() == [16]
    check_align(ids, 4, 5, True, backend)


@pytest.mark.parametrize("backend", kernel_backends("align_block_size"))
@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("block_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("e", [1, 3, 257, 513, 896, 4096])
def test_align_matches_oracle(backend, e, block_size, pad):
    m, k = (8192, 16) if HAS_GPU else (12, 4)
    dist = "dropped" if block_size in (16, 128) else "uniform"
    check_align(make_ids(m, k, e, dist, seed=block_size + e), block_size, e, pad, backend)


@pytest.mark.parametrize("backend", kernel_backends("align_block_size"))
@pytest.mark.parametrize("dist", ["shared", "one", "dropped"])
def test_align_many_blocks(backend, dist):
    m, k, e = (8192, 16, 896) if HAS_GPU else (300, 4, 300)
    ids = make_ids(m, k, e, dist, seed=9, dtype=torch.int64 if dist == "dropped" else torch.int32)
    check_align(ids, 64, e, dist == "shared", backend)


@pytest.mark.parametrize("backend", kernel_backends("align_block_size"))
def test_align_expert_map_and_empty(backend):
    e = 8
    ids = make_ids(6, 2, e, "uniform", seed=1)
    expert_map = torch.tensor([0, -1, 1, -1, 2, 3, -1, 4], dtype=torch.int32, device=DEVICE)
    check_align(ids, 4, e, False, backend, expert_map)
    check_align(torch.empty(0, 2, dtype=torch.int32), 4, e, False, backend)


@pytest.mark.parametrize("backend", kernel_backends("align_block_size"))
@pytest.mark.parametrize("e", [4097, 10000])
def test_align_beyond_4096_experts(backend, e):
    m, k = (8192, 16) if HAS_GPU else (40, 4)
    ids = make_ids(m, k, e, "dropped", seed=e)
    ids.view(-1)[1::6] = e - 1
    check_align(ids, 16, e, False, backend)
    check_align(ids, 64, e, True, backend)


# ----------------------------------------------------------------------------------------------
# chunk sort + pad
# ----------------------------------------------------------------------------------------------

TE_LAYOUTS = [
    ([0, 3, 5], [2, 0, 1], [5, 3, 8]),
    ([2, 0, 129, 1], [3, 1, 2, 0], [1, 7, 129, 127]),
    ([0, 0, 0], [0, 1, 2], [0, 0, 0]),
    ([0, 0, 0], [0, 1, 2], [4, 0, 4]),
    ([7], [0], [7]),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _meta(layout, dtype=torch.int64):
    return tuple(torch.tensor(v, dtype=dtype, device=DEVICE) for v in layout)


def expected_sort_pad(inp, meta, num_out, probs=None):
    """The oracle, with the zero-row input case (``inp`` has no row to gather) written out."""
    row_map = ref.chunk_row_map(*[t.cpu() for t in meta], num_out)
    out = torch.zeros(num_out, inp.shape[1], dtype=inp.dtype)
    keep = row_map >= 0
    out[keep] = inp.cpu()[row_map[keep].long()]
    out_probs = None
    if probs is not None:
        out_probs = torch.zeros(num_out, dtype=probs.dtype)
        out_probs[keep] = probs.cpu()[row_map[keep].long()]
    return out, out_probs, row_map


@pytest.mark.parametrize("backend", kernel_backends("chunk_copy"))
@pytest.mark.parametrize("prob_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", TE_LAYOUTS, ids=lambda v: str(v[0]))
def test_sort_chunks_te_layouts(backend, layout, dtype, prob_dtype):
    meta = _meta(layout, torch.int32 if dtype == torch.float16 else torch.int64)
    tokens, num_out = sum(layout[0]), sum(layout[2])
    g = _gen(len(layout[0]))
    inp = torch.randn(tokens, 24, generator=g).to(dtype).to(DEVICE)
    probs = None if prob_dtype is None else torch.rand(tokens, generator=g).to(prob_dtype)
    probs = None if probs is None else probs.to(DEVICE)
    out, out_probs, row_map = amdqb.moe_sort_chunks_and_pad(
        inp, *meta, num_out, probs=probs, backend=backend
    )
    exp_out, exp_probs, exp_map = expected_sort_pad(inp, meta, num_out, probs)
    assert torch.equal(row_map.cpu(), exp_map)
    assert torch.equal(out.cpu(), exp_out)
    if probs is not None:
        assert out_probs.dtype == prob_dtype and torch.equal(out_probs.cpu(), exp_probs)
    # unpad + restore with a different hidden size
    back = torch.randn(num_out, 37, generator=g).to(dtype).to(DEVICE)
    restored = amdqb.moe_unpad_and_restore_chunks(back, row_map, tokens, backend=backend)
    exp = torch.zeros(tokens, 37, dtype=dtype)
    keep = exp_map >= 0
    exp[exp_map[keep].long()] = back.cpu()[keep]
    assert torch.equal(restored.cpu(), exp)


@pytest.mark.parametrize("backend", kernel_backends("chunk_copy"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_sort_chunks_round_trip_and_grad(backend, dtype):
    layout = TE_LAYOUTS[1]
    meta = _meta(layout)
    tokens, num_out = sum(layout[0]), sum(layout[2])
    g = _gen(3)
    base = torch.randn(tokens, 2 * 19, generator=g).to(dtype).to(DEVICE)
    inp = base[:, ::2]
    leaf = base.clone().requires_grad_(True)
    strided = leaf[:, ::2]  # non-contiguous input
    probs = torch.rand(tokens, generator=g).to(DEVICE).requires_grad_(True)
    out, out_probs, row_map = amdqb.moe_sort_chunks_and_pad(
        strided, *meta, num_out, probs=probs, backend=backend
    )
    exp_out, _, exp_map = expected_sort_pad(inp.contiguous(), meta, num_out)
    assert torch.equal(out.detach().cpu(), exp_out)
    restored = amdqb.moe_unpad_and_restore_chunks(out, row_map, tokens, backend=backend)
    assert torch.equal(restored.detach().cpu(), inp.cpu())
    grad_out = torch.randn(num_out, 19, generator=g).to(dtype).to(DEVICE)
    grad_probs = torch.randn(num_out, generator=g).to(DEVICE)
    torch.autograd.backward([out, out_probs], [grad_out, grad_probs])
    keep = exp_map >= 0
    exp_grad = torch.zeros(tokens, 19, dtype=dtype)
    exp_grad[exp_map[keep].long()] = grad_out.cpu()[keep]
    assert torch.equal(leaf.grad[:, ::2].cpu(), exp_grad)
    assert torch.equal(leaf.grad[:, 1::2].cpu(), torch.zeros_like(exp_grad))
    exp_pgrad = torch.zeros(tokens)
    exp_pgrad[exp_map[keep].long()] = grad_probs.cpu()[keep]
    assert torch.equal(probs.grad.cpu(), exp_pgrad)
    # restore backward: gradient of padding rows is exactly zero
    y = torch.randn(num_out, 5, generator=g).to(dtype).to(DEVICE).requires_grad_(True)
    r = amdqb.moe_unpad_and_restore_chunks(y, row_map, tokens, backend=backend)
    gr = torch.randn(tokens, 5, generator=g).to(dtype).to(DEVICE)
    r.backward(gr)
    assert torch.equal(y.grad.cpu()[~keep], torch.zeros(int((~keep).sum()), 5, dtype=dtype))
    assert torch.equal(y.grad.cpu()[keep], gr.cpu()[exp_map[keep].long()])


@pytest.mark.parametrize("backend", kernel_backends("chunk_copy"))
@pytest.mark.parametrize("meta_dtype", [torch.int32, torch.int64])
def test_sort_chunks_many_chunks(backend, meta_dtype):
    """More chunks than the register path holds (binary-search row map), random order and
    padding, rows past the last chunk."""
    c = 1500
    g = _gen(8)
    sizes = torch.randint(0, 4, (c,), generator=g)
    order = torch.randperm(c, generator=g)
    out_sizes = sizes[order] + torch.randint(0, 3, (c,), generator=g)
    tokens, num_out = int(sizes.sum()), int(out_sizes.sum()) + 5
    meta = tuple(t.to(meta_dtype).to(DEVICE) for t in (sizes, order, out_sizes))
    inp = torch.randn(tokens, 3, generator=g).to(DEVICE)
    out, _, row_map = amdqb.moe_sort_chunks_and_pad(inp, *meta, num_out, backend=backend)
    exp_out, _, exp_map = expected_sort_pad(inp, meta, num_out)
    assert torch.equal(row_map.cpu(), exp_map) and torch.equal(out.cpu(), exp_out)
    assert torch.all(exp_map[-5:] == -1)


@pytest.mark.parametrize("backend", kernel_backends("chunk_copy"))
def test_sort_chunks_compile_fullgraph(backend):
    layout = TE_LAYOUTS[0]
    meta = _meta(layout)
    tokens, num_out = sum(layout[0]), sum(layout[2])
    inp = torch.randn(tokens, 16, generator=_gen(2)).to(DEVICE)

    def round_trip(x, sizes, order, out_sizes):
        out, _, row_map = amdqb.moe_sort_chunks_and_pad(
            x, sizes, order, out_sizes, num_out, backend=backend
        )
        return out, amdqb.moe_unpad_and_restore_chunks(out * 2, row_map, tokens, backend=backend)

    torch._dynamo.reset()
    compiled = torch.compile(round_trip, fullgraph=True, backend="aot_eager")
    out, back = compiled(inp, *meta)
    exp_out, _, _ = expected_sort_pad(inp, meta, num_out)
    assert torch.equal(out.cpu(), exp_out)
    assert torch.equal(back.cpu(), inp.cpu() * 2)


@pytest.mark.parametrize("backend", kernel_backends("chunk_copy"))
@pytest.mark.parametrize("tokens", [8192, 32768] if HAS_GPU else [96])
def test_sort_chunks_benchmark_layout(backend, tokens):
    """The TE PR benchmark layout: 8 ranks x 16 experts, expert-major, alignment 128, padding on
    each expert's last rank chunk, H=2048 bf16 (H=64 on the CPU)."""
    ranks, experts, align = 8, 16, 128
    hidden = 2048 if HAS_GPU else 64
    g = _gen(tokens)
    split = torch.multinomial(torch.ones(ranks * experts), tokens, replacement=True, generator=g)
    sizes = torch.bincount(split, minlength=ranks * experts)  # rank-major chunks
    order = torch.arange(ranks * experts).view(ranks, experts).t().reshape(-1)  # expert-major
    out_sizes = sizes[order].clone().view(experts, ranks)
    per_expert = out_sizes.sum(1)
    out_sizes[:, -1] += (per_expert + align - 1) // align * align - per_expert
    out_sizes = out_sizes.reshape(-1)
    num_out = int(out_sizes.sum())
    meta = tuple(t.to(DEVICE) for t in (sizes, order, out_sizes))
    inp = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).to(DEVICE)
    probs = torch.rand(tokens, generator=g).to(DEVICE)
    out, out_probs, row_map = amdqb.moe_sort_chunks_and_pad(
        inp, *meta, num_out, probs=probs, backend=backend
    )
    exp_out, exp_probs, exp_map = expected_sort_pad(inp, meta, num_out, probs)
    assert torch.equal(row_map.cpu(), exp_map)
    assert torch.equal(out.cpu(), exp_out) and torch.equal(out_probs.cpu(), exp_probs)
    back = amdqb.moe_unpad_and_restore_chunks(out, row_map, tokens, backend=backend)
    assert torch.equal(back, inp)


# ----------------------------------------------------------------------------------------------
# Quantile Balancing
# ----------------------------------------------------------------------------------------------


def assert_ulp(got, exp, ulps=1):
    """fp32 equality up to ``ulps`` units in the last place (float64 means may sum in another
    order than torch's)."""
    got, exp = got.cpu(), exp.cpu()
    assert got.dtype == exp.dtype == torch.float32 and got.shape == exp.shape
    up = torch.nextafter(exp.abs(), torch.tensor(float("inf"))) - exp.abs()
    assert torch.all((got - exp).abs() <= ulps * up), (got - exp).abs().max()


@pytest.mark.parametrize("backend", kernel_backends("qb_step"))
def test_qb_recovery_vector(backend):
    hist = torch.tensor([[0, 2, 2, 0], [2, 2, 0, 0]], dtype=torch.int32, device=DEVICE)
    bounds = torch.tensor([-1.0, 1.0], device=DEVICE)
    bhat = amdqb.qb_recover_bias(hist, bounds, 1, backend=backend)
    assert bhat.cpu().tolist() == [0.25, -0.25]
    bias = torch.zeros(2, device=DEVICE)
    amdqb.qb_step_(bias, hist, bounds, 1, backend=backend)
    assert bias.cpu().tolist() == [0.25, -0.25]
    assert bounds.cpu().tolist() == [-1.25, 1.25]


@pytest.mark.parametrize("backend", kernel_backends("qb_recover"))
def test_qb_pooled_vs_mean_vector(backend):
    """notes/qb_anchors.md §2.3: the quantile of the pooled histogram is not the mean of the
    per-microbatch quantiles."""
    mb1 = torch.zeros(2, 10, dtype=torch.int32)
    mb2 = torch.zeros(2, 10, dtype=torch.int32)
    mb1[0, 0], mb1[0, 9], mb1[1, 0] = 3, 1, 4
    mb2[0, 9], mb2[1, 0] = 4, 4
    bounds = torch.tensor([0.0, 10.0], device=DEVICE)
    pooled = amdqb.qb_recover_bias((mb1 + mb2).to(DEVICE), bounds, 1, backend=backend).cpu()
    assert torch.equal(pooled, ref.qb_recover_bias(mb1 + mb2, bounds.cpu(), 1))
    # m=8, q=4: expert 0 -> bin 9, frac 1/5 -> 9.2; expert 1 -> bin 0, frac 1/2 -> 0.5
    assert torch.allclose(pooled, torch.tensor([4.35, -4.35]), atol=1e-6)
    per_mb = [
        amdqb.qb_recover_bias(h.to(DEVICE), bounds, 1, backend=backend).cpu() for h in (mb1, mb2)
    ]
    assert not torch.allclose(pooled, (per_mb[0] + per_mb[1]) / 2, atol=1e-3)


def random_histogram(e, b, dtype, seed):
    g = _gen(seed)
    hist = torch.randint(0, 40, (e, b), generator=g)
    hist *= torch.rand(e, b, generator=g) < 0.2  # sparse rows, long empty runs
    hist[0] = 0  # m == 0 row -> (L + U) / 2
    if e > 2:
        hist[1] = 0
        hist[1, b - 1] = 7  # mass in the last bin only
    return hist.to(dtype)


QB_SHAPES = [(1, 2), (2, 3), (7, 1000), (64, 2500), (896 if HAS_GPU else 130, 1000), (5000, 16)]


@pytest.mark.parametrize("backend", kernel_backends("qb_recover"))
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("shape", QB_SHAPES, ids=str)
def test_qb_recover_random(backend, shape, dtype):
    e, b = shape
    hist = random_histogram(e, b, dtype, seed=e + b)
    bounds = torch.tensor([-1.75, 2.5])
    for topk in sorted({1, max(1, min(e - 1, 6))}):
        got = amdqb.qb_recover_bias(hist.to(DEVICE), bounds.to(DEVICE), topk, backend=backend)
        assert_ulp(got, ref.qb_recover_bias(hist, bounds, topk))


@pytest.mark.parametrize("backend", kernel_backends("qb_step"))
@pytest.mark.parametrize("ema", [0.0, 0.1, 0.9])
@pytest.mark.parametrize("shape", [(2, 3), (7, 1000), (896 if HAS_GPU else 130, 1000)], ids=str)
def test_qb_step_random(backend, shape, ema):
    e, b = shape
    hist = random_histogram(e, b, torch.int32, seed=e * 3 + b)
    bounds = torch.tensor([-0.5, 0.75])
    bias = torch.randn(e, generator=_gen(e)) * 0.1
    exp_bias, exp_bounds = ref.qb_step_update(bias, hist, bounds, 3 if e > 3 else 1, ema)
    got_bias, got_bounds = bias.to(DEVICE), bounds.to(DEVICE)
    ptr = got_bias.data_ptr()
    amdqb.qb_step_(got_bias, hist.to(DEVICE), got_bounds, 3 if e > 3 else 1, ema, backend=backend)
    assert got_bias.data_ptr() == ptr
    assert_ulp(got_bias, exp_bias)
    assert_ulp(got_bounds, exp_bounds)


@pytest.mark.parametrize("backend", kernel_backends("qb_step"))
def test_qb_step_ema_is_float64(backend):
    """ema = 0.1 is not an fp32 value: the mix must use the float64 ema, like the oracle."""
    e = 4
    hist = torch.tensor([[0, 3, 1], [2, 2, 0], [0, 0, 4], [4, 0, 0]], dtype=torch.int32)
    bounds = torch.tensor([-1.0, 1.0])
    bias = torch.tensor([0.3, -0.2, 0.1, -0.2])
    exp_bias, exp_bounds = ref.qb_step_update(bias, hist, bounds, 1, 0.1)
    got, gb = bias.to(DEVICE), bounds.to(DEVICE)
    amdqb.qb_step_(got, hist.to(DEVICE), gb, 1, 0.1, backend=backend)
    assert torch.equal(got.cpu(), exp_bias) and torch.equal(gb.cpu(), exp_bounds)
    assert struct.unpack("<d", struct.pack("<d", 0.1))[0] != float(torch.tensor(0.1))


@pytest.mark.parametrize("backend", kernel_backends("qb_step"))
def test_qb_step_empty_histogram_keeps_bias(backend):
    e = 6
    bias = torch.tensor([0.5, -0.25, 0.0, 1.0, -1.5, 0.25], device=DEVICE)
    old = bias.clone()
    bounds = torch.tensor([-3.0, 3.0], device=DEVICE)
    amdqb.qb_step_(
        bias, torch.zeros(e, 8, dtype=torch.int32, device=DEVICE), bounds, 2, 0.5, backend=backend
    )
    assert torch.equal(bias, old)
    assert bounds.cpu().tolist() == [-2.5, 2.0]


@pytest.mark.parametrize("backend", kernel_backends("qb_step"))
def test_balancer_step_matches_oracle(backend):
    e, k, b = (896, 16, 1000) if HAS_GPU else (32, 4, 64)
    bal = amdqb.QuantileBalancer(e, k, num_bins=b, ema=0.25, device=DEVICE)
    bal.histogram.copy_(random_histogram(e, b, torch.int32, seed=1).to(DEVICE))
    bal.bias.copy_((torch.randn(e, generator=_gen(2)) * 0.01).to(DEVICE))
    exp_bias, exp_bounds = ref.qb_step_update(
        bal.bias.cpu(), bal.histogram.cpu(), bal.bin_bounds.cpu(), k, 0.25
    )
    addresses = (bal.bias.data_ptr(), bal.bin_bounds.data_ptr(), bal.histogram.data_ptr())
    bal.step(backend=backend)
    assert addresses == (bal.bias.data_ptr(), bal.bin_bounds.data_ptr(), bal.histogram.data_ptr())
    assert_ulp(bal.bias, exp_bias)
    assert_ulp(bal.bin_bounds, exp_bounds)
    assert int(bal.histogram.sum()) == 0


# ----------------------------------------------------------------------------------------------
# GPU: graph capture with changed inputs, no host synchronisation
# ----------------------------------------------------------------------------------------------


@pytest.mark.skipif(not HAS_GPU, reason="CUDA/HIP graphs need a GPU")
@pytest.mark.parametrize("backend", kernel_backends("route_rows"))
def test_graph_replay_changed_inputs(backend):
    m, k, e = 8192, 16, 896
    ids = make_ids(m, k, e, "uniform", seed=0).to(DEVICE)
    hist = random_histogram(e, 1000, torch.int32, seed=0).to(DEVICE)
    bias = torch.zeros(e, device=DEVICE)
    bounds = torch.tensor([-1.0, 1.0], device=DEVICE)
    layout = TE_LAYOUTS[1]
    meta = _meta(layout)
    x = torch.randn(sum(layout[0]), 64, device=DEVICE)

    has = {op: backend in available_backends(op) for op in OPS}

    def body():
        out = {}
        out["det"] = route(ids, e, "deterministic", backend=backend)
        out["lds"] = route(ids, e, "lds", capacity=200, backend=backend)
        if has["align_block_size"]:
            out["align"] = amdqb.moe_align_block_size(ids, 64, e, backend=backend)
        if has["chunk_copy"]:
            out["chunks"] = amdqb.moe_sort_chunks_and_pad(x, *meta, sum(layout[2]), backend=backend)
        if has["qb_step"]:
            amdqb.qb_step_(bias, hist, bounds, k, backend=backend)
        return out

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            outs = body()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for seed in (1, 2):
        ids.copy_(make_ids(m, k, e, "shared" if seed == 1 else "one", seed=seed).to(DEVICE))
        hist.copy_(random_histogram(e, 1000, torch.int32, seed=seed).to(DEVICE))
        meta[0].copy_(torch.tensor([1, 0, 130, 1], device=DEVICE))
        bias.zero_()
        bounds.copy_(torch.tensor([-1.0, 1.0]))
        graph.replay()
        torch.cuda.synchronize()
        r_ref, n_ref = ref.moe_route_rows(ids.cpu(), e)
        assert torch.equal(outs["det"][0].cpu(), r_ref) and torch.equal(outs["det"][1].cpu(), n_ref)
        _, n_cap = ref.moe_route_rows(ids.cpu(), e, 200)
        assert torch.equal(outs["lds"][1].cpu(), n_cap)
        if has["align_block_size"]:
            exp = ref.moe_align_block_size(ids.cpu(), 64, e)
            assert all(torch.equal(a.cpu(), b) for a, b in zip(outs["align"], exp))
        if has["chunk_copy"]:
            exp_out, _, exp_map = expected_sort_pad(x, meta, sum(layout[2]))
            assert torch.equal(outs["chunks"][2].cpu(), exp_map)
            assert torch.equal(outs["chunks"][0].cpu(), exp_out)
        if not has["qb_step"]:
            continue
        exp_bias, exp_bounds = ref.qb_step_update(
            torch.zeros(e), hist.cpu(), torch.tensor([-1.0, 1.0]), k
        )
        assert_ulp(bias, exp_bias)
        assert_ulp(bounds, exp_bounds)
