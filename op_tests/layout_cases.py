"""Inputs and oracle checks shared by the layout-op tests (route rows, align block size, chunk
sort + pad) and the QB update tests: named id distributions, the route-row checks, TE's chunk
layouts, random QB histograms and an ulp comparison."""

import torch

import amdqb
from amdqb import ref

from conftest import DEVICE

EXPERT_COUNTS = (1, 2, 255, 256, 257, 384, 385, 512, 513, 896, 1024, 4096)
ROUTE_MODES = ("atomic", "lds", "deterministic")


def gen(seed):
    return torch.Generator().manual_seed(seed)


def make_ids(m, k, e, dist, seed=0, dtype=torch.int32):
    """CPU ``[m, k]`` ids of a named distribution."""
    g = gen(seed)
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


def oracle_ids(m, k, e, dist, seed=0):
    """int32 ``[m, k]`` ids of the oracle-only tests (``dropped``: every third route -1, every
    fifth E + 3)."""
    g = torch.Generator().manual_seed(seed)
    if dist == "uniform":
        return torch.randint(0, e, (m, k), generator=g, dtype=torch.int32)
    if dist == "shared":  # expert 0 in every token, the rest random
        ids = torch.randint(0, e, (m, k), generator=g, dtype=torch.int32)
        ids[:, 0] = 0
        return ids
    if dist == "one":
        return torch.full((m, k), e - 1, dtype=torch.int32)
    if dist == "dropped":  # every third route -1 or >= E
        ids = torch.randint(0, e, (m, k), generator=g, dtype=torch.int32)
        flat = ids.view(-1)
        flat[::3] = -1
        flat[1::5] = e + 3
        return ids
    raise ValueError(dist)


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


# TE's chunk layouts: (split_sizes, sorted_indices, output_split_sizes)
TE_LAYOUTS = [
    ([0, 3, 5], [2, 0, 1], [5, 3, 8]),
    ([2, 0, 129, 1], [3, 1, 2, 0], [1, 7, 129, 127]),
    ([0, 0, 0], [0, 1, 2], [0, 0, 0]),
    ([0, 0, 0], [0, 1, 2], [4, 0, 4]),
    ([7], [0], [7]),
]


def chunk_meta(layout, dtype=torch.int64):
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


def random_histogram(e, b, dtype, seed):
    g = gen(seed)
    hist = torch.randint(0, 40, (e, b), generator=g)
    hist *= torch.rand(e, b, generator=g) < 0.2  # sparse rows, long empty runs
    hist[0] = 0  # m == 0 row -> (L + U) / 2
    if e > 2:
        hist[1] = 0
        hist[1, b - 1] = 7  # mass in the last bin only
    return hist.to(dtype)


def assert_ulp(got, exp, ulps=1):
    """fp32 equality up to ``ulps`` units in the last place (float64 means may sum in another
    order than torch's)."""
    got, exp = got.cpu(), exp.cpu()
    assert got.dtype == exp.dtype == torch.float32 and got.shape == exp.shape
    up = torch.nextafter(exp.abs(), torch.tensor(float("inf"))) - exp.abs()
    assert torch.all((got - exp).abs() <= ulps * up), (got - exp).abs().max()
