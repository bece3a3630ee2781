"""``moe_route_rows`` (a unique row of its expert for every route: masked ``e * capacity + slot`` or
compact layout; ``atomic``, ``lds`` and ``deterministic`` kernels) against the ``amdqb.ref``
oracle, for every kernel backend of ``route_rows``; the hip kernels on the CPU emulator (both wave
sizes, launch shapes, tile variants, the deterministic passes' dependent launches) and on a GPU
on both sides of the seed's capacity gate with graph replays; one graph over all layout ops; and
the oracle against its invariants.

Counts and counters must equal the oracle's; rows equal it bitwise (``deterministic``) or form a
bijection onto its row set with every row owned by the route's expert. On the CPU the Triton
kernels run under ``TRITON_INTERPRET=1`` and the hip kernels on the emulator (small shapes); on a
GPU the same tests run at the seed shapes (M up to 16384, k=16, E up to 10000).
"""

import pytest
import torch

import amdqb
from amdqb import ref
from amdqb.backends.hip import _spec
from amdqb.backends.hip._common import ptr
from amdqb.ops.layout import lds_route_threshold

from conftest import (
    DEVICE,
    GCN,
    HAS_GPU,
    available_backends,
    device_config,
    over_backends,
    set_config,
)
from hip_emu.checks import check_routes
from hip_emu.checks import make_ids as emu_ids
from layout_cases import (
    EXPERT_COUNTS,
    ROUTE_MODES,
    TE_LAYOUTS,
    assert_ulp,
    check_route,
    chunk_meta,
    expected_sort_pad,
    gen,
    make_ids,
    oracle_ids,
    random_histogram,
    route,
)

# hip's own GPU tests (the emulator runs the small cases below)
hip_gpu = pytest.mark.skipif(
    not HAS_GPU, reason="hip kernels at GPU shapes (on the CPU the emulator runs the small cases)"
)


# ----------------------------------------------------------------------------------------------
# every kernel backend
# ----------------------------------------------------------------------------------------------


@over_backends("route_rows")
@pytest.mark.parametrize("capacity_mode", ["capacity", "compact"])
@pytest.mark.parametrize("e", EXPERT_COUNTS)
def test_route_rows_expert_counts(backend, e, capacity_mode):
    m, k = (2048, 16) if HAS_GPU else (16, 4)
    ids = make_ids(m, k, e, "dropped", seed=e)
    c0 = torch.randint(0, 3, (e,), generator=gen(1), dtype=torch.int32)
    capacity = max(1, (m * k) // (2 * e)) if capacity_mode == "capacity" else None
    counts_by_mode = {}
    for mode in ROUTE_MODES:
        counters = c0.clone().to(DEVICE)
        rows, counts = route(ids.to(DEVICE), e, mode, capacity, counters, backend)
        check_route(ids, e, capacity, c0, rows, counts, counters, mode == "deterministic")
        counts_by_mode[mode] = counts.cpu()
    assert torch.equal(counts_by_mode["atomic"], counts_by_mode["lds"])


@over_backends("route_rows")
@pytest.mark.parametrize("mode", ROUTE_MODES)
@pytest.mark.parametrize("dist", ["uniform", "shared", "one", "dropped", "counters", "int64"])
def test_route_rows_distributions(backend, dist, mode):
    m, k, e = (8192, 16, 896) if HAS_GPU else (24, 4, 385)
    dtype = torch.int64 if dist in ("int64", "dropped") else torch.int32
    base = {"int64": "dropped", "counters": "uniform"}.get(dist, dist)
    ids = make_ids(m, k, e, base, seed=7, dtype=dtype)
    if dist == "counters":
        c0 = torch.randint(0, 1000, (e,), generator=gen(2), dtype=torch.int32)
    else:
        c0 = torch.zeros(e, dtype=torch.int32)
    for capacity in (None, (m * k) // e + 2, 1):
        counters = c0.clone().to(DEVICE)
        rows, counts = route(ids.to(DEVICE), e, mode, capacity, counters, backend)
        check_route(ids, e, capacity, c0, rows, counts, counters, mode == "deterministic")


@over_backends("route_rows")
@pytest.mark.parametrize("mode", ROUTE_MODES)
def test_route_rows_many_blocks(backend, mode):
    """Several programs (and several sort sub-chunks per program) reserve intervals of the same
    experts; nonzero caller counters shift every slot."""
    m, k, e = (16384, 16, 4096) if HAS_GPU else (300, 4, 300)
    ids = make_ids(m, k, e, "dropped", seed=3)
    ids.view(-1)[::4] = 5  # one hot expert across blocks
    c0 = torch.randint(0, 50, (e,), generator=gen(4), dtype=torch.int32)
    for capacity in (None, (m * k) // e):
        counters = c0.clone().to(DEVICE)
        rows, counts = route(ids.to(DEVICE), e, mode, capacity, counters, backend)
        check_route(ids, e, capacity, c0, rows, counts, counters, mode == "deterministic")


@over_backends("route_rows")
def test_route_rows_deterministic_reproducible(backend):
    m, k, e = (8192, 16, 896) if HAS_GPU else (32, 4, 896)
    ids = make_ids(m, k, e, "shared", seed=11).to(DEVICE)
    first = route(ids, e, "deterministic", backend=backend)
    for impl in ("atomic", "lds"):
        again = amdqb.moe_route_rows(ids, e, deterministic=True, impl=impl, backend=backend)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@over_backends("route_rows")
@pytest.mark.parametrize("mode", ["atomic", "deterministic"])
def test_route_rows_beyond_lds_experts(backend, mode):
    """E > 4096: the atomic path and the wide deterministic kernels; lds is refused."""
    m, k, e = (4096, 16, 10000) if HAS_GPU else (40, 4, 5000)
    ids = make_ids(m, k, e, "dropped", seed=5)
    ids.view(-1)[1::9] = e - 1
    c0 = torch.randint(0, 3, (e,), generator=gen(6), dtype=torch.int32)
    for capacity in (None, 2):
        counters = c0.clone().to(DEVICE)
        rows, counts = route(ids.to(DEVICE), e, mode, capacity, counters, backend)
        check_route(ids, e, capacity, c0, rows, counts, counters, mode == "deterministic")
    with pytest.raises((ValueError, RuntimeError)):
        amdqb.moe_route_rows(ids.to(DEVICE), e, impl="lds", backend=backend)


@over_backends("route_rows")
@pytest.mark.parametrize("mode", ROUTE_MODES)
def test_route_rows_empty(backend, mode):
    ids = torch.empty(0, 4, dtype=torch.int32, device=DEVICE)
    counters = torch.arange(8, dtype=torch.int32, device=DEVICE)
    rows, counts = route(ids, 8, mode, None, counters, backend)
    assert rows.shape == (0, 4)
    assert torch.equal(counts.cpu(), torch.zeros(8, dtype=torch.int32))
    assert torch.equal(counters.cpu(), torch.arange(8, dtype=torch.int32))


# ----------------------------------------------------------------------------------------------
# hip on the CPU emulator
# ----------------------------------------------------------------------------------------------


ROUTE_EXPERTS = [1, 17, 129, 257, 513, 896, 4096]


@pytest.mark.parametrize("e", ROUTE_EXPERTS)
@pytest.mark.parametrize("impl", ["atomic", "lds"])
@over_backends("route_rows", emulator=True)
def test_route_rows_distributions_over_expert_counts(backend, e, impl):
    # Emulator-sized calls (<= ~6000 routes); the GPU tests cover both sides of the seed gate.
    k = 4
    cases = [("uniform", 1500), ("shared", 300), ("one", 200), ("dropped", 700), ("uniform", 1)]
    for seed, (dist, m) in enumerate(cases):
        ids = emu_ids(m, k, e, dist, seed)
        for capacity in (None, max(1, m * k // (2 * e))):
            c0 = torch.randint(0, 3, (e,), dtype=torch.int32)
            counters = c0.clone()
            rows, counts = amdqb.moe_route_rows(
                ids, e, capacity=capacity, counters=counters, impl=impl, backend=backend
            )
            check_routes(ids, e, capacity, c0, rows, counts, counters)


@over_backends("route_rows", emulator=True)
def test_route_finalize_scan_with_a_1024_thread_block(backend):
    """E > 4096 (atomic path): the compact layout's offsets come from a 1024-thread block scan."""
    e = 5000
    ids = emu_ids(900, 4, e, "uniform", 7)
    c0 = torch.randint(0, 2**20, (e,), dtype=torch.int32)  # large counters: the scan must wrap
    for capacity in (None, 3):
        counters = c0.clone()
        rows, counts = amdqb.moe_route_rows(
            ids, e, capacity=capacity, counters=counters, impl="atomic", backend=backend
        )
        check_routes(ids, e, capacity, c0, rows, counts, counters)


@over_backends("route_rows", emulator=True, waves=(32, 64), gcn=GCN)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_route_rows_deterministic_matches_oracle_bitwise(backend, emu_rt, dtype):
    rt = emu_rt
    for e, m, k, dist in [(7, 800, 3, "dropped"), (896, 300, 8, "shared"), (129, 64, 5, "one")]:
        ids = emu_ids(m, k, e, dist, e, dtype)
        for capacity in (None, 9):
            c0 = torch.randint(0, 5, (e,), dtype=torch.int32)
            counters = c0.clone()
            rows, counts = amdqb.moe_route_rows(
                ids,
                e,
                capacity=capacity,
                counters=counters,
                deterministic=True,
                impl="lds",
                backend=backend,
            )
            check_routes(ids, e, capacity, c0, rows, counts, counters, deterministic=True)
    # the scan goes out as a dependent of the histogram pass (NVIDIA: programmatic launch), the
    # rank pass too while its tiles fill at most half of the CUs (the last case: one tile)
    suffix = "i32" if dtype == torch.int32 else "i64"
    assert rt.dependent_launches[-2:] == ["amdqb_route_det_scan", f"amdqb_route_det_rank_{suffix}"]


@over_backends("route_rows", emulator=True)
def test_route_rows_int64_ids_and_empty(backend):
    e = 33
    ids = emu_ids(300, 4, e, "dropped", 3, torch.int64)
    for impl in ("atomic", "lds"):
        c0 = torch.zeros(e, dtype=torch.int32)
        counters = c0.clone()
        rows, counts = amdqb.moe_route_rows(ids, e, counters=counters, impl=impl, backend=backend)
        check_routes(ids, e, None, c0, rows, counts, counters)
    empty = torch.empty(0, 4, dtype=torch.int32)
    counters = torch.full((e,), 3, dtype=torch.int32)
    rows, counts = amdqb.moe_route_rows(empty, e, counters=counters, impl="lds", backend=backend)
    assert rows.shape == (0, 4)
    assert torch.all(counts == 0) and torch.all(counters == 3)


@pytest.mark.parametrize("num_tiles", [1, 7, 64, 65, 150])
@over_backends("route_rows", emulator=True)
def test_det_scan_over_tile_groups(emu_rt, num_tiles):
    """amdqb_route_det_scan: per-expert exclusive scan over the tiles from start (or 0), totals =
    the end; groups of at most 8 tiles stay in registers (<= 64 tiles), longer groups reload."""
    rt, e = emu_rt, 45  # two blocks of 32 experts, the second partly empty
    g = torch.Generator().manual_seed(num_tiles)
    counts = torch.randint(0, 50, (num_tiles, e), generator=g, dtype=torch.int32)
    for start in (None, torch.randint(0, 1000, (e,), generator=g, dtype=torch.int32)):
        tile = counts.clone().reshape(-1)
        totals = torch.full((e,), -7, dtype=torch.int32)
        cfg = device_config(torch.device("cpu"))
        k = rt.kernel(-1, _spec.layout_module(cfg), "amdqb_route_det_scan")
        args = [_spec.arg_i32(num_tiles), _spec.arg_i32(e), ptr(tile), ptr(start), ptr(totals)]
        rt.launch(k, -(-e // cfg["hip.route.scan_experts"]), 256, 0, args)
        base = torch.zeros(e, dtype=torch.int64) if start is None else start.long()
        incl = counts.long().cumsum(0) + base
        assert torch.equal(tile.reshape(num_tiles, e).long(), incl - counts.long())
        assert torch.equal(totals.long(), incl[-1])


@over_backends("route_rows", emulator=True)
def test_route_lds_launch_shape(backend, emu_rt):
    rt = emu_rt
    rt.launches.clear()
    ids = emu_ids(1025, 16, 896, "uniform", 0)
    counters = torch.zeros(896, dtype=torch.int32)
    amdqb.moe_route_rows(ids, 896, capacity=64, counters=counters, impl="lds", backend=backend)
    assert [launch[0] for launch in rt.launches] == ["amdqb_route_lds_i32"]  # masked: one kernel
    name, grid, block, smem = rt.launches[0]
    assert name == "amdqb_route_lds_i32"
    cfg = device_config(torch.device("cpu"))
    block_size = cfg["hip.route.lds_block"]
    assert grid[0] == -(-ids.numel() // (block_size * cfg["hip.route.lds_items"]))
    assert smem == 4 * 896 and block == block_size


@pytest.mark.parametrize("block,items", [(512, 8), (1024, 4)])
@over_backends("route_rows", emulator=True)
def test_route_lds_other_tiles(monkeypatch, backend, block, items):
    """The tile shapes the tuner sweeps (hip.route.lds_block x hip.route.lds_items) are correct
    builds too: several experts per thread in the reservation loop or fewer, partial last tile."""
    values = {"hip.route.lds_block": block, "hip.route.lds_items": items}
    set_config(monkeypatch, values, torch.device("cpu"))
    for e, dist, m in ((896, "uniform", 700), (4096, "dropped", 300), (3, "one", 500)):
        ids = emu_ids(m, 16, e, dist, e)
        for capacity in (None, max(1, m * 16 // (2 * e))):
            c0 = torch.randint(0, 3, (e,), dtype=torch.int32)
            counters = c0.clone()
            rows, counts = amdqb.moe_route_rows(
                ids, e, capacity=capacity, counters=counters, impl="lds", backend=backend
            )
            check_routes(ids, e, capacity, c0, rows, counts, counters)


# ----------------------------------------------------------------------------------------------
# hip on a GPU
# ----------------------------------------------------------------------------------------------


ROUTE_E = [1, 17, 129, 256, 257, 512, 513, 896, 1024, 2048, 4096]


ROUTE_DISTS = ["uniform", "shared", "one", "dropped", "counters"]


def _route_sizes(e, k):
    """Route counts just below and at/above the seed gate (lds_route_threshold)."""
    gate = lds_route_threshold(e, device_config())
    return sorted({max(1, (gate - 1) // k), -(-gate // k)})


@hip_gpu
@over_backends("route_rows", only=("hip",))
@pytest.mark.parametrize("e", ROUTE_E)
@pytest.mark.parametrize("dist", ROUTE_DISTS)
def test_route_rows_atomic_vs_lds(backend, e, dist):
    k = 8
    for m in _route_sizes(e, k):
        ids = emu_ids(m, k, e, "uniform" if dist == "counters" else dist, m + e)
        for capacity in (None, max(1, m * k // e)):
            results = {}
            c0 = (
                torch.randint(0, 50, (e,), dtype=torch.int32)
                if dist == "counters"
                else torch.zeros(e, dtype=torch.int32)
            )
            for impl in ("atomic", "lds"):
                counters = c0.clone().to(DEVICE)
                rows, counts = amdqb.moe_route_rows(
                    ids.to(DEVICE),
                    e,
                    capacity=capacity,
                    counters=counters,
                    impl=impl,
                    backend=backend,
                )
                check_routes(ids, e, capacity, c0, rows, counts, counters)
                results[impl] = counts.cpu()
            assert torch.equal(results["atomic"], results["lds"])


@hip_gpu
@over_backends("route_rows", only=("hip",))
@pytest.mark.parametrize("e", [7, 129, 896, 4096])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_route_rows_deterministic(backend, e, dtype):
    k = 8
    ids = emu_ids(3001, k, e, "dropped", e, dtype)
    for capacity in (None, 4):
        outs = []
        c0 = torch.randint(0, 5, (e,), dtype=torch.int32)
        for impl in ("atomic", "lds", "lds"):
            counters = c0.clone().to(DEVICE)
            rows, counts = amdqb.moe_route_rows(
                ids.to(DEVICE),
                e,
                capacity=capacity,
                counters=counters,
                deterministic=True,
                impl=impl,
                backend=backend,
            )
            check_routes(ids, e, capacity, c0, rows, counts, counters, deterministic=True)
            outs.append(rows.cpu())
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])


@hip_gpu
@over_backends("route_rows", only=("hip",))
@pytest.mark.parametrize("impl", ["atomic", "lds"])
@pytest.mark.parametrize("capacity", [None, 40])
def test_route_rows_graph_capture_replays(backend, impl, capacity):
    e, m, k = 896, 2517, 16
    ids_static = emu_ids(m, k, e, "uniform", 0).to(DEVICE)
    counters_static = torch.zeros(e, dtype=torch.int32, device=DEVICE)
    # Warm up eagerly (compiles and loads the module), then capture.
    amdqb.moe_route_rows(
        ids_static, e, capacity=capacity, counters=counters_static, impl=impl, backend=backend
    )
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rows, counts = amdqb.moe_route_rows(
            ids_static, e, capacity=capacity, counters=counters_static, impl=impl, backend=backend
        )
    for replay in range(8):
        dist = ["uniform", "shared", "one", "dropped"][replay % 4]
        ids = emu_ids(m, k, e, dist, 100 + replay)
        c0 = torch.randint(0, 20, (e,), dtype=torch.int32)
        ids_static.copy_(ids.to(DEVICE))
        counters_static.copy_(c0.to(DEVICE))
        rows.fill_(-7)  # poisoned outputs must be fully rewritten
        counts.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        check_routes(ids, e, capacity, c0, rows, counts, counters_static)


# ----------------------------------------------------------------------------------------------
# one graph over every layout op
# ----------------------------------------------------------------------------------------------


OPS = ("route_rows", "align_block_size", "chunk_copy", "qb_step")


@pytest.mark.skipif(not HAS_GPU, reason="CUDA/HIP graphs need a GPU")
@over_backends("route_rows")
def test_graph_replay_changed_inputs(backend):
    m, k, e = 8192, 16, 896
    ids = make_ids(m, k, e, "uniform", seed=0).to(DEVICE)
    hist = random_histogram(e, 1000, torch.int32, seed=0).to(DEVICE)
    bias = torch.zeros(e, device=DEVICE)
    bounds = torch.tensor([-1.0, 1.0], device=DEVICE)
    layout = TE_LAYOUTS[1]
    meta = chunk_meta(layout)
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


# ----------------------------------------------------------------------------------------------
# the oracle
# ----------------------------------------------------------------------------------------------


def check_route_invariants(ids, e, capacity, c0, rows, counts, counters_after):
    flat = ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < e)
    raw = torch.bincount(flat[valid], minlength=e)
    assert torch.equal(counters_after.long(), c0.long() + raw)
    r = rows.reshape(-1).long()
    assert torch.all(r[~valid] == -1)
    got = r[r >= 0]
    assert got.unique().numel() == got.numel()  # unique rows
    assert torch.equal(torch.bincount(flat[r >= 0], minlength=e).int(), counts)
    if capacity is not None:
        assert torch.all(got // capacity == flat[r >= 0])  # per-expert ownership
        slots = got % capacity
        assert torch.all(slots >= c0.long()[flat[r >= 0]])
        expected = torch.minimum(raw, (capacity - c0.long()).clamp(min=0))
        assert torch.equal(counts.long(), expected)
    else:
        total = c0.long() + raw
        start = torch.cumsum(total, 0) - total
        owner = flat[r >= 0]
        assert torch.all(got >= start[owner] + c0.long()[owner])
        assert torch.all(got < start[owner] + total[owner])
        assert torch.equal(counts.long(), raw)


@pytest.mark.parametrize("e", EXPERT_COUNTS)
@pytest.mark.parametrize("dist", ["uniform", "shared", "one", "dropped"])
@pytest.mark.parametrize("capacity", [None, "tight"])
def test_route_rows_oracle_invariants(e, dist, capacity):
    m, k = 37, min(4, e)
    ids = oracle_ids(m, k, e, dist, seed=e)
    cap = None if capacity is None else max(1, (m * k) // (2 * e) + 1)
    c0 = torch.randint(0, 3, (e,), dtype=torch.int32)
    counters = c0.clone()
    rows, counts = ref.moe_route_rows(ids, e, cap, counters)
    check_route_invariants(ids, e, cap, c0, rows, counts, counters)


def test_route_rows_deterministic_order_is_ascending_flat_index():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], dtype=torch.int32)
    rows, counts = ref.moe_route_rows(ids, 3)
    # expert 0: flat 1, 5 -> rows 0, 1; expert 1: flat 3 -> 2; expert 2: flat 0, 2, 4 -> 3, 4, 5
    assert rows.tolist() == [[3, 0], [4, 2], [1, 5]]
    assert counts.tolist() == [2, 1, 3]
