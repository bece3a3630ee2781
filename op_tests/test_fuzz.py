"""Differential fuzzing of every kernel backend against the oracles (hypothesis).

Profiles (``AMDQB_FUZZ_PROFILE``): ``fast`` (default; CI on the CPU, where Triton runs in its
interpreter: small shapes, few examples) and ``large`` (GPU: T up to 70000, E up to 4097, k up to
min(E, 36), >= 10,000 cases in all). Inputs are adversarial on purpose: exact ties, NaN and +-inf
logits, values on histogram bin edges, all routes to one expert, -1 and >= E ids, empty chunks.
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import amdqb
from amdqb import ref

from conftest import DEVICE, HAS_GPU, device_config, kernel_backends
from hip_emu.checks import make_logits
from router_cases import kernel_scores

PROFILE = os.environ.get("AMDQB_FUZZ_PROFILE", "fast")
LARGE = PROFILE == "large"
MAX_T = 70000 if LARGE else 24
MAX_E = 4097 if LARGE else 40
MAX_K = 36
EXAMPLES = {
    "router": 3000,
    "biased": 1500,
    "qb": 2500,
    "route": 2000,
    "align": 1500,
    "chunks": 800,
    "recover": 500,
}
# Kernel shapes (E, k, B) are compile-time constants: every new combination compiles (~1-2 s on a
# GPU). The large profile therefore draws them from menus that keep the edges (1, powers of two and
# one past them, 896, 4096, 4097; k = 1, 2, 8, 16, 36, E-1, E) while T and the values stay free.
E_MENU = (1, 2, 3, 17, 64, 255, 256, 257, 896, 1024, 2049, 4096, 4097)
K_MENU = (1, 2, 8, 16, 36)
B_MENU = (2, 3, 64, 1000, 1024, 4096)
SETTINGS = dict(
    max_examples=10 if not LARGE else None,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)


# The large profile splits the compile-heavy tests into shards (pytest parameters, so pytest-xdist
# runs them in parallel): each shard owns a disjoint set of expert counts, hence of kernel shapes,
# and runs its share of the examples.
SHARDED = ("router", "biased", "qb", "route", "align")
SHARDS = 8 if LARGE else 1


def _settings(op):
    n = EXAMPLES[op] if LARGE else SETTINGS["max_examples"]
    if op in SHARDED:
        n = -(-n // SHARDS)
    return settings(**{**SETTINGS, "max_examples": n})


def _shard_e(draw, shard):
    """An expert count of ``shard``: E in 1..MAX_E split by bit length (E_PAD) across shards."""
    lengths = [b for b in range(1, MAX_E.bit_length() + 1) if b % SHARDS == shard % SHARDS]
    b = draw(st.sampled_from(lengths))
    return draw(st.integers(1 << (b - 1), min(MAX_E, (1 << b) - 1)))


def _size(draw, max_value, small=64):
    """Mostly small sizes, sometimes up to ``max_value`` (keeps the large profile affordable)."""
    if max_value <= small or draw(st.integers(0, 9)) < 8:
        return draw(st.integers(0 if small else 1, min(small, max_value)))
    return draw(st.integers(small, max_value))


@st.composite
def router_case(draw, qb: bool, shard: int = 0):
    if LARGE:
        e = max(2 if qb else 1, draw(st.sampled_from(E_MENU[shard::SHARDS])))
        kmax = e - 1 if qb else e
        k = min(draw(st.sampled_from(K_MENU + (kmax,))), kmax)
    else:
        e = max(2 if qb else 1, _size(draw, MAX_E))
        k = draw(st.integers(1, min(e - 1 if qb else e, MAX_K)))
    t = _size(draw, MAX_T)
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    style = draw(st.sampled_from(["normal", "ties", "nan_inf", "one_hot", "saturated"]))
    seed = draw(st.integers(0, 2**31 - 1))
    return t, e, k, dtype, style, seed


def _unless_declined(backend, e, k, fn, qb=False):
    """``fn()``, or None when the forced backend declines the shape by design -- more than 4096
    experts in a row (both kernel backends), or hip selecting more than its cap (k, k + 1 under
    QB): the dispatcher must then refuse before any launch, and that refusal is the checked
    behaviour. Any other refusal fails the case (a broken capability check is not a skip)."""
    n = k + (1 if qb else 0)
    declined = e > 4096 or (backend == "hip" and n > device_config()["hip.router.cap"])
    if not declined:
        return fn()
    with pytest.raises(RuntimeError, match="no backend can run"):
        fn()
    event(f"{backend} declined E={e} k={k}")
    return None


def _check_router(backend, t, e, k, dtype, style, seed, qb):
    logits = make_logits(t, e, style, seed, dtype).to(DEVICE)
    g = torch.Generator().manual_seed(seed + 1)
    bias = (torch.randn(e, generator=g) * 0.1).to(DEVICE)
    kwargs = dict(expert_bias=bias)
    hist = hist_ref = None
    if qb:
        b = B_MENU[seed % len(B_MENU)] if LARGE else int(torch.randint(2, 1200, (1,), generator=g))
        bounds = torch.stack([bias.min() - 1, bias.max() + 1]).contiguous()
        hist = torch.zeros(e, b, dtype=torch.int32, device=DEVICE)
        mode = ("two_kernel", "fused_atomic")[seed % 2]
        kwargs.update(qb_histogram=hist, qb_bin_bounds=bounds, qb_histogram_mode=mode)
    out = _unless_declined(
        backend,
        e,
        k,
        lambda: amdqb.fused_topk_with_score_function(logits, k, backend=backend, **kwargs),
        qb,
    )
    if out is None:
        return
    probs, rmap = out
    module = amdqb.dispatch._backend_module(backend)
    scores = kernel_scores(backend, logits, "sigmoid") if "router_fwd" in module.OPS else None
    ref_kwargs = dict(expert_bias=bias, scores=scores)
    if qb:
        hist_ref = torch.zeros_like(hist)
        ref_kwargs.update(qb_histogram=hist_ref, qb_bin_bounds=kwargs["qb_bin_bounds"])
    probs_ref, _, rmap_ref = ref.fused_topk_with_score_function(logits, k, **ref_kwargs)
    assert torch.all(rmap.sum(-1) == k), "every token gets exactly k experts"
    assert torch.equal(rmap, rmap_ref), f"routing differs ({style}, T={t}, E={e}, k={k})"
    if qb:
        assert torch.equal(hist, hist_ref), "histogram differs from the oracle"
        assert torch.all(hist.sum(1) == t)
    want = probs_ref.to(dtype).float()
    torch.testing.assert_close(
        probs.float(), want, atol=1e-5 * max(1, e / 64), rtol=1e-2, equal_nan=True
    )


@pytest.mark.parametrize("backend", kernel_backends("router_fwd"))
@pytest.mark.parametrize("shard", range(SHARDS))
@_settings("router")
@given(data=st.data())
def test_fuzz_router(backend, shard, data):
    _check_router(backend, *data.draw(router_case(qb=False, shard=shard)), qb=False)


@pytest.mark.parametrize("backend", kernel_backends("biased_topk"))
@pytest.mark.parametrize("shard", range(SHARDS))
@_settings("biased")
@given(data=st.data())
def test_fuzz_biased_topk(backend, shard, data):
    """Serving form: ids exactly the oracle's selection over the kernel's fp32 scores plus bias
    (decode sizes run the hip block-per-token kernel, larger T the warp-per-token one)."""
    t, e, k, dtype, style, seed = data.draw(router_case(qb=False, shard=shard))
    k = min(k, 64)  # the hip serving kernels select at most 64
    logits = make_logits(t, e, style, seed, dtype).to(DEVICE)
    g = torch.Generator().manual_seed(seed + 2)
    bias = (torch.randint(-3, 4, (e,), generator=g) * 0.05).float().to(DEVICE)
    renorm = seed % 3 != 0
    out = _unless_declined(
        backend,
        e,
        k,
        lambda: amdqb.biased_topk(logits, k, bias, renormalize=renorm, backend=backend),
    )
    if out is None:
        return
    w, ids = out
    module = amdqb.dispatch._backend_module(backend)
    scores = (
        kernel_scores(backend, logits, "sigmoid")
        if "router_fwd" in module.OPS
        else ref.router.activation(logits.float(), "sigmoid")
    )
    want_ids = ref.ordering.ranked_indices(scores + bias, k).to(torch.int32)
    assert torch.equal(ids, want_ids), f"ids differ ({style}, T={t}, E={e}, k={k})"
    picked = scores.gather(-1, ids.long())
    if renorm:
        picked = picked / (picked.sum(-1, keepdim=True) + 1e-20)
    torch.testing.assert_close(w, picked, atol=1e-6, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("backend", kernel_backends("router_fwd"))
@pytest.mark.parametrize("shard", range(SHARDS))
@_settings("qb")
@given(data=st.data())
def test_fuzz_qb_router(backend, shard, data):
    _check_router(backend, *data.draw(router_case(qb=True, shard=shard)), qb=True)


@st.composite
def route_case(draw, shard: int = 0):
    e = _shard_e(draw, shard) if LARGE else max(1, _size(draw, MAX_E))
    m = _size(draw, MAX_T)
    k = draw(st.integers(1, MAX_K))
    dist = draw(st.sampled_from(["uniform", "one", "dropped", "negative"]))
    capacity = draw(st.one_of(st.none(), st.integers(0, 2 * m * k // e + 2)))
    impl = draw(st.sampled_from(["atomic", "lds"]))
    deterministic = draw(st.booleans())
    return m, k, e, dist, capacity, impl, deterministic, draw(st.integers(0, 2**31 - 1))


def make_ids(m, k, e, dist, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, e, (m, k), generator=g, dtype=torch.int32)
    if dist == "one":
        ids.fill_(e - 1)
    elif dist == "dropped":
        ids.view(-1)[::3] = e + int(torch.randint(0, 5, (1,), generator=g))
    elif dist == "negative":
        ids.view(-1)[::2] = -1
    return ids.to(DEVICE)


@pytest.mark.parametrize("backend", kernel_backends("route_rows"))
@pytest.mark.parametrize("shard", range(SHARDS))
@_settings("route")
@given(data=st.data())
def test_fuzz_route_rows(backend, shard, data):
    m, k, e, dist, capacity, impl, deterministic, seed = data.draw(route_case(shard))
    if impl == "lds" and e > 4096:
        impl = "atomic"
    ids = make_ids(m, k, e, dist, seed)
    c0 = torch.randint(0, 3, (e,), dtype=torch.int32).to(DEVICE)
    counters, counters_ref = c0.clone(), c0.clone()
    rows, counts = amdqb.moe_route_rows(
        ids,
        e,
        capacity=capacity,
        counters=counters,
        deterministic=deterministic,
        impl=impl,
        backend=backend,
    )
    rows_ref, counts_ref = ref.moe_route_rows(ids, e, capacity, counters_ref)
    assert torch.equal(counts, counts_ref) and torch.equal(counters, counters_ref)
    if deterministic:
        assert torch.equal(rows, rows_ref)
    else:  # the same (expert, row) pairs: a bijection onto the oracle's rows
        assert torch.equal(_expert_row_pairs(ids, rows), _expert_row_pairs(ids, rows_ref))


def _expert_row_pairs(ids, rows):
    flat, r = ids.reshape(-1).long(), rows.reshape(-1).long()
    keep = r >= 0
    assert r[keep].unique().numel() == int(keep.sum()), "duplicate rows"
    return torch.sort(flat[keep] * 2**32 + r[keep]).values


@st.composite
def align_case(draw, shard: int = 0):
    m = draw(st.integers(0, MAX_T if LARGE else 20))
    k = draw(st.integers(1, MAX_K))
    e = min(_shard_e(draw, shard), 4096) if LARGE else draw(st.integers(1, MAX_E))
    block = draw(st.sampled_from([16, 32, 64, 128, 256]))
    dist = draw(st.sampled_from(["uniform", "one", "dropped", "negative"]))
    return m, k, e, block, dist, draw(st.booleans()), draw(st.integers(0, 2**31 - 1))


@pytest.mark.parametrize("backend", kernel_backends("align_block_size"))
@pytest.mark.parametrize("shard", range(SHARDS))
@_settings("align")
@given(data=st.data())
def test_fuzz_align(backend, shard, data):
    m, k, e, block, dist, pad, seed = data.draw(align_case(shard))
    if m * k > 2_000_000:
        m = 2_000_000 // k
    ids = make_ids(m, k, e, dist, seed)
    got = amdqb.moe_align_block_size(ids, block, e, pad_sorted_ids=pad, backend=backend)
    want = amdqb.moe_align_block_size(ids, block, e, pad_sorted_ids=pad, backend="torch")
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@st.composite
def chunk_case(draw):
    c = draw(st.integers(1, 130))
    sizes = draw(st.lists(st.integers(0, 64 if LARGE else 6), min_size=c, max_size=c))
    extra = draw(st.lists(st.integers(0, 9), min_size=c, max_size=c))
    order = draw(st.permutations(list(range(c))))
    h = draw(st.sampled_from([1, 7, 37, 64, 2048] if LARGE else [1, 7, 37]))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    return sizes, extra, order, h, dtype


@pytest.mark.parametrize("backend", kernel_backends("chunk_copy"))
@_settings("chunks")
@given(case=chunk_case())
def test_fuzz_chunks(backend, case):
    sizes, extra, order, h, dtype = case
    out_sizes = [sizes[o] + x for o, x in zip(order, extra)]
    n, num_out = sum(sizes), sum(out_sizes)
    x = torch.randn(n, h).to(DEVICE, dtype)
    meta = [torch.tensor(v, device=DEVICE) for v in (sizes, order, out_sizes)]
    out, _, row_map = amdqb.moe_sort_chunks_and_pad(x, *meta, max(num_out, n), backend=backend)
    want, _, row_map_ref = ref.moe_sort_chunks_and_pad(x, *meta, max(num_out, n))
    assert torch.equal(row_map, row_map_ref) and torch.equal(out, want)
    back = amdqb.moe_unpad_and_restore_chunks(out, row_map, n, backend=backend)
    assert torch.equal(back, x)


@pytest.mark.parametrize("backend", kernel_backends("qb_recover"))
@_settings("recover")
@given(
    e=st.integers(2, 4096 if LARGE else 50),
    b=st.integers(2, 5000 if LARGE else 300),
    k=st.integers(1, 36),
    style=st.sampled_from(["random", "sparse", "empty", "one_bin"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_fuzz_qb_recover(backend, e, b, k, style, seed):
    k = min(k, max(e - 1, 1))
    g = torch.Generator().manual_seed(seed)
    hist = torch.randint(0, 50, (e, b), generator=g, dtype=torch.int32)
    if style == "sparse":
        hist *= torch.rand(e, b, generator=g) < 0.02
    elif style == "empty":
        hist.zero_()
    elif style == "one_bin":
        hist.zero_()
        hist[:, int(torch.randint(0, b, (1,), generator=g))] = 17
    lo = float(torch.randn(1, generator=g)) - 1
    bounds = torch.tensor([lo, lo + 0.5 + float(torch.rand(1, generator=g)) * 3])
    got = amdqb.qb_recover_bias(hist.to(DEVICE), bounds.to(DEVICE), k, backend=backend)
    want = ref.qb_recover_bias(hist, bounds, k)
    torch.testing.assert_close(got.cpu(), want, atol=2e-6, rtol=0)


@pytest.mark.skipif(not HAS_GPU, reason="determinism over runs is a GPU property (atomics)")
@pytest.mark.parametrize("backend", kernel_backends("router_fwd"))
def test_histograms_and_deterministic_modes_bitwise_identical_over_20_runs(backend):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4096, 896, generator=g).to(DEVICE)
    bias = (torch.randn(896, generator=g) * 0.05).to(DEVICE)
    bounds = torch.stack([bias.min() - 1, bias.max() + 1]).contiguous()
    ids = torch.randint(0, 896, (8192, 16), generator=g, dtype=torch.int32).to(DEVICE)
    first = None
    for _ in range(20):
        hists = []
        for mode in ("two_kernel", "fused_atomic"):
            h = torch.zeros(896, 1000, dtype=torch.int32, device=DEVICE)
            amdqb.fused_topk_with_score_function(
                logits,
                16,
                expert_bias=bias,
                qb_histogram=h,
                qb_bin_bounds=bounds,
                qb_histogram_mode=mode,
                backend=backend,
            )
            hists.append(h)
        outs = hists
        if "route_rows" in amdqb.dispatch._backend_module(backend).OPS:
            for impl in ("atomic", "lds"):
                outs += list(
                    amdqb.moe_route_rows(ids, 896, deterministic=True, impl=impl, backend=backend)
                )
        if "align_block_size" in amdqb.dispatch._backend_module(backend).OPS:
            outs += list(amdqb.moe_align_block_size(ids, 64, 896, backend=backend))
        if first is None:
            first = [o.clone() for o in outs]
        else:
            for a, b in zip(first, outs):
                assert torch.equal(a, b)
