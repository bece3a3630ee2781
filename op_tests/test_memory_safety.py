"""Memory safety under adversarial metadata: no caller value makes a kernel read or write out of
bounds, and every backend gives the oracle's documented outcome (``amdqb.ref.layout``,
``amdqb.ref.chunks``).

Every buffer a kernel touches lies inside a larger one whose guard bands hold a sentinel: written
bands show an out-of-bounds store; input bands hold values that would change the result if read
(a poisoned row, a valid expert id), so an out-of-bounds load shows as a difference from the
oracle. Kernels run at the backend level (destination-passing launchers), on the CPU under the
Triton interpreter and the HIP emulator (op_tests/hip_emu), on a GPU for real.

Every test here is named ``test_memsafe_*`` with small shapes: ``-k memsafe`` selects the set that
scripts/gpu_check.sh runs under compute-sanitizer memcheck on the GPU.

Audit of the kernels (which derive an address from caller data): the chunk row map (sizes, sorted
indices: clamped / masked), the chunk copy (row_map: checked against the indexed rows), route rows
and align (ids: masked by ``[0, E)`` in 64 bits; counters only shift slots, never an address; the
align scatter's slot comes from the kernel's own histogram), the router's QB histogram (bins
clamped in fp32 before the int conversion, NaN to bin 0: any bounds, bias or logits), the QB
recovery (counts are values; the bin position is clamped) and the aux-loss kernels (no
caller-indexed access).
"""

from __future__ import annotations

import functools

import pytest
import torch

from amdqb import dispatch, ref
from amdqb.backends.calls import AlignCall, RouterCall

from conftest import DEVICE, HAS_GPU, available_backends

BAND = 96  # guard elements (or rows) on each side
INT32_MAX, INT32_MIN = 2**31 - 1, -(2**31)
SENTINEL = {
    torch.float32: -7777.0,
    torch.bfloat16: -7776.0,
    torch.float16: -7776.0,
    torch.int64: -0x5A5A5A5A5A5A5A5B,
    torch.int32: -0x5A5A5A5B,
    torch.int16: -0x5A5B,
    torch.uint8: 0xA5,
    torch.bool: True,
}


class Banded:
    """A tensor of ``shape`` (rows x rest) inside a buffer with ``BAND`` guard rows each side."""

    def __init__(self, shape, dtype, value=None, band_value=None):
        shape = tuple(shape)
        rows = shape[0] if shape else 1
        rest = shape[1:]
        fill = SENTINEL[dtype] if band_value is None else band_value
        self.buf = torch.full((rows + 2 * BAND, *rest), fill, dtype=dtype, device=DEVICE)
        self.t = self.buf[BAND : BAND + rows].view(shape)
        self.band = self.buf.clone()
        if value is not None:
            self.t.copy_(torch.as_tensor(value, dtype=dtype).reshape(shape))

    def bands_intact(self) -> bool:
        lo, hi = slice(0, BAND), slice(self.buf.shape[0] - BAND, None)
        return torch.equal(self.buf[lo], self.band[lo]) and torch.equal(self.buf[hi], self.band[hi])


# ------------------------------------------------------------------------------------------------
# The kernel implementations: the kernel backends on this device, plus the HIP emulator on a CPU.
# ------------------------------------------------------------------------------------------------
@functools.cache
def _emu():
    from hip_emu.runtime import EmuRuntime, compiler

    return EmuRuntime(wave_size=32, cus=2) if compiler() is not None else None


def _hip_emu(op):
    from amdqb.backends.hip import layout, router

    fn = {"route_rows": layout.route_rows, "align_block_size": layout.align_block_size}.get(op)
    fn = fn or {"router_fwd": router.router_fwd}.get(op)
    return functools.partial(fn, _emu())


def impls(op):
    params = [
        pytest.param(dispatch._backend_module(n).OPS[op], id=n)
        for n in available_backends(op)
        if n != "torch"
    ]
    if not HAS_GPU and op in ("route_rows", "align_block_size", "router_fwd"):
        from hip_emu.runtime import compiler

        if compiler() is not None:
            params.append(pytest.param(_hip_emu(op), id="hip-emu"))
    if not params:
        params.append(pytest.param(None, marks=pytest.mark.skip(reason=f"no kernel backend: {op}")))
    return params


# ------------------------------------------------------------------------------------------------
# Chunk row map and chunk copy
# ------------------------------------------------------------------------------------------------
def _chunk_cases():
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(6, generator=g)
    cases = {
        "consistent": ([3, 0, 5, 2, 4, 1], perm, [3, 1, 5, 4, 6, 1]),
        "index_out_of_range": ([3, 2, 4, 1, 2, 3], [6, -1, 2, INT32_MAX, 0, INT32_MIN], [4] * 6),
        "sizes_past_input": ([10, 20, 30, 40, 2, 1], perm, [40, 30, 20, 10, 5, 5]),
        "negative_sizes": ([-5, 8, -1, 4, 0, 3], perm, [-3, 9, 4, -7, 5, 2]),
        "int32_extreme_sizes": (
            [INT32_MAX, 3, INT32_MIN, 4, 2, 1],
            perm,
            [INT32_MAX, 6, 1, 2, 3, 4],
        ),
        "duplicates": ([3, 4, 2, 1, 5, 2], [1, 1, 1, 0, 0, 5], [5, 5, 5, 4, 4, 3]),
        "output_too_small": ([5, 5, 5, 2, 2, 2], perm, [1, 0, 2, 1, 0, 1]),
    }
    out = []
    for name, (sizes, order, out_sizes) in cases.items():
        out.append((name, torch.tensor(sizes), torch.as_tensor(order), torch.tensor(out_sizes)))
    # int64 metadata beyond int32 (the kernels compare before they narrow)
    out.append(
        (
            "int64_huge",
            torch.tensor([2**40, 3, -(2**40), 4, 2, 1]),
            torch.tensor([2**33 + 1, 0, -(2**35), 1, 2, 3]),
            torch.tensor([2**41, 5, 3, -(2**40), 2, 2]),
        )
    )
    # beyond the single-launch limit (C > 1024 chunks: prefix table + binary search)
    c = 1100
    sizes = torch.randint(-3, 6, (c,), generator=g)
    order = torch.randint(-50, c + 50, (c,), generator=g)
    out_sizes = torch.randint(-3, 8, (c,), generator=g)
    out.append(("many_chunks_random", sizes, order, out_sizes))
    return out


CHUNK_CASES = _chunk_cases()


@pytest.mark.parametrize("impl", impls("chunk_row_map"))
@pytest.mark.parametrize("case", CHUNK_CASES, ids=[c[0] for c in CHUNK_CASES])
@pytest.mark.parametrize("meta_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_memsafe_chunk_row_map(impl, case, meta_dtype):
    name, sizes, order, out_sizes = case
    if meta_dtype == torch.int32 and name == "int64_huge":
        pytest.skip("int64 values")
    num_in = 17 if sizes.numel() < 100 else 2000
    num_out = 40 if sizes.numel() < 100 else 3000
    # poisoned metadata bands: read past the chunks and the sizes / order would change the map
    meta = [
        Banded(v.shape, meta_dtype, v.to(meta_dtype), band_value=b)
        for v, b in ((sizes, 5), (order, 0), (out_sizes, 5))
    ]
    row_map = Banded((num_out,), torch.int32)
    impl(*(m.t for m in meta), row_map.t, num_in)
    want = ref.chunk_row_map(*(m.t.cpu() for m in meta), num_out, num_in)
    assert torch.equal(row_map.t.cpu(), want)
    got = row_map.t
    assert torch.all((got >= -1) & (got < num_in))
    assert row_map.bands_intact() and all(m.bands_intact() for m in meta)


def _row_maps(src_rows, p):
    g = torch.Generator().manual_seed(src_rows + p)
    valid = torch.randperm(max(src_rows, p), generator=g)[:p] % max(src_rows, 1)
    bad = torch.tensor([-1, -5, src_rows, src_rows + 1, INT32_MAX, INT32_MIN, 2 * src_rows + 3])
    mixed = valid.clone()
    mixed[: min(p, bad.numel())] = bad[: min(p, bad.numel())]
    return {
        "valid": valid,
        "out_of_range": mixed[torch.randperm(p, generator=g)],
        "all_past_the_end": torch.full((p,), src_rows),
        "all_negative": torch.full((p,), -3),
    }


@pytest.mark.parametrize("impl", impls("chunk_copy"))
@pytest.mark.parametrize("hidden", [1, 5, 64])
@pytest.mark.parametrize("reverse", [False, True], ids=["gather", "scatter"])
@pytest.mark.parametrize("kind", ["valid", "out_of_range", "all_past_the_end", "all_negative"])
def test_memsafe_chunk_copy(impl, hidden, reverse, kind):
    src_rows, p = 9, 12  # row_map has P entries; forward indexes src, reverse indexes dst
    g = torch.Generator().manual_seed(hidden)
    rm = _row_maps(src_rows, p)[kind].to(torch.int32)
    if reverse:  # unique targets (duplicates: see test_memsafe_chunk_scatter_duplicates)
        keep = torch.zeros(p, dtype=torch.bool)
        seen = set()
        for i, v in enumerate(rm.tolist()):
            keep[i] = not (0 <= v < src_rows and v in seen)
            seen.add(v)
        rm = torch.where(keep, rm, torch.tensor(-1, dtype=torch.int32))
    row_map = Banded((p,), torch.int32, rm, band_value=0)
    n_src, n_dst = (p, src_rows) if reverse else (src_rows, p)
    src = Banded((n_src, hidden), torch.float32, torch.randn(n_src, hidden, generator=g))
    dst = Banded((n_dst, hidden), torch.float32, torch.zeros(n_dst, hidden))
    impl(src.t, row_map.t, dst.t, reverse)
    if reverse:
        want = ref.moe_unpad_and_restore_chunks(src.t.cpu(), rm, n_dst)
    else:
        want = ref.chunks.gather_rows(src.t.cpu(), rm)
    assert torch.equal(dst.t.cpu(), want)
    assert src.bands_intact() and dst.bands_intact() and row_map.bands_intact()


@pytest.mark.parametrize("impl", impls("chunk_copy"))
@pytest.mark.parametrize("reverse", [False, True], ids=["gather", "scatter"])
@pytest.mark.parametrize("layout", ["row_slice", "expanded"])
def test_memsafe_chunk_copy_row_strided(impl, reverse, layout):
    """A source read through its row stride (a column slice of a wider buffer whose other columns
    and guard rows are poisoned, or one row expanded: stride 0) reads only its own elements."""
    src_rows, p, hidden = 9, 12, 5
    rm = _row_maps(src_rows, p)["out_of_range"].to(torch.int32)
    if reverse:
        rm = torch.tensor([3, -1, 0, 7, 12, 1, 2, 4, 5, 6, 8, -9], dtype=torch.int32)
    row_map = Banded((p,), torch.int32, rm, band_value=0)
    n_src, n_dst = (p, src_rows) if reverse else (src_rows, p)
    values = torch.randn(n_src, hidden, generator=torch.Generator().manual_seed(1))
    wide = Banded((n_src, hidden + 3), torch.float32)  # poisoned everywhere
    if layout == "row_slice":
        wide.t[:, :hidden].copy_(values)
        src = wide.t[:, :hidden]
    else:
        wide.t[0, :hidden].copy_(values[0])
        values = values[:1].expand(n_src, hidden)
        src = wide.t[0, :hidden].expand(n_src, hidden)
    before = wide.buf.clone()
    dst = Banded((n_dst, hidden), torch.float32, torch.zeros(n_dst, hidden))
    impl(src, row_map.t, dst.t, reverse)
    if reverse:
        want = ref.moe_unpad_and_restore_chunks(values.cpu(), rm, n_dst)
    else:
        want = ref.chunks.gather_rows(values.cpu(), rm)
    assert torch.equal(dst.t.cpu(), want)
    assert torch.equal(wide.buf, before) and dst.bands_intact() and row_map.bands_intact()


@pytest.mark.parametrize("impl", impls("aux_loss_fwd"))
@pytest.mark.parametrize("layout", ["row_slice", "expanded"])
def test_memsafe_aux_loss_row_strided(impl, layout):
    """The aux-loss reduction over a probs view with a row stride and a strided
    tokens_per_expert: the poisoned elements between them are never read."""
    rows, cols = 7, 16
    g = torch.Generator().manual_seed(2)
    values = torch.rand(rows, cols, generator=g)
    wide = Banded((rows, cols + 5), torch.float32)
    if layout == "row_slice":
        wide.t[:, :cols].copy_(values)
        probs = wide.t[:, :cols]
    else:
        wide.t[0, :cols].copy_(values[0])
        values = values[:1].expand(rows, cols)
        probs = wide.t[0, :cols].expand(rows, cols)
    counts = torch.randint(0, 9, (cols,), generator=g, dtype=torch.int32)
    tpe_buf = Banded((2 * cols,), torch.int32)
    tpe = tpe_buf.t[::2]
    tpe.copy_(counts.to(DEVICE))
    loss = torch.empty((), dtype=torch.float32, device=DEVICE)
    coeff = torch.empty(2, dtype=torch.float32, device=DEVICE)
    impl(probs, tpe, None, 1e-3, 0.0, loss, coeff)
    want = (values.sum(0).double() * counts.double()).sum() * 1e-3
    assert float(loss) == pytest.approx(float(want), rel=1e-5)
    assert wide.bands_intact() and tpe_buf.bands_intact()


@pytest.mark.parametrize("impl", impls("chunk_copy"))
def test_memsafe_chunk_scatter_duplicates(impl):
    """Two row_map entries naming one row: that row holds one of the two inputs."""
    rm = torch.tensor([2, 0, 2, 1, 2, -1, 7], dtype=torch.int32)
    src = Banded((7, 3), torch.float32, torch.arange(21, dtype=torch.float32).view(7, 3))
    dst = Banded((4, 3), torch.float32, torch.zeros(4, 3))
    impl(src.t, Banded((7,), torch.int32, rm).t, dst.t, True)
    got = dst.t.cpu()
    candidates = [src.t.cpu()[i] for i in (0, 2, 4)]
    assert any(torch.equal(got[2], c) for c in candidates)
    assert torch.equal(got[0], src.t.cpu()[1]) and torch.equal(got[1], src.t.cpu()[3])
    assert torch.all(got[3] == 0) and src.bands_intact() and dst.bands_intact()


@pytest.mark.parametrize("backend", [n for n in available_backends("chunk_copy")])
@pytest.mark.parametrize("case", CHUNK_CASES[:8], ids=[c[0] for c in CHUNK_CASES[:8]])
def test_memsafe_sort_chunks_op_matches_oracle(backend, case):
    """The public ops on a poisoned input view: forward, restore and the gradient."""
    import amdqb

    _, sizes, order, out_sizes = case
    t, h, num_out = 17, 3, 40
    inp = Banded((t, h), torch.float32, torch.randn(t, h, generator=torch.Generator()))
    meta = [m.to(DEVICE) for m in (sizes, order, out_sizes)]
    x = inp.t.clone().requires_grad_(True)
    out, _, rmap = amdqb.moe_sort_chunks_and_pad(inp.t, *meta, num_out, backend=backend)
    want, _, want_map = ref.moe_sort_chunks_and_pad(inp.t.cpu(), *[m.cpu() for m in meta], num_out)
    assert torch.equal(out.cpu(), want) and torch.equal(rmap.cpu(), want_map)
    back = amdqb.moe_unpad_and_restore_chunks(out, rmap, t, backend=backend)
    assert torch.equal(back.cpu(), ref.moe_unpad_and_restore_chunks(want, want_map, t))
    y, _, _ = amdqb.moe_sort_chunks_and_pad(x, *meta, num_out, backend=backend)
    y.sum().backward()
    assert torch.isfinite(x.grad).all() and inp.bands_intact()


# ------------------------------------------------------------------------------------------------
# Route rows and align
# ------------------------------------------------------------------------------------------------
def _counters(kind, e, g):
    if kind == "zeros":
        return torch.zeros(e, dtype=torch.int64)
    if kind == "negative":
        return torch.full((e,), -100000, dtype=torch.int64)
    if kind == "mixed":
        return torch.randint(-6, 7, (e,), generator=g)
    if kind == "near_int32_max":
        c = torch.randint(0, 4, (e,), generator=g)
        c[::2] = INT32_MAX - torch.randint(0, 3, (len(c[::2]),), generator=g)
        return c
    if kind == "extremes":
        c = torch.randint(INT32_MIN, INT32_MAX, (e,), generator=g)
        c[:4] = torch.tensor([INT32_MIN, INT32_MAX, -1, 0])[: min(4, e)]
        return c
    raise ValueError(kind)


def _ids(m, k, e, dtype, g):
    ids = torch.randint(0, e, (m, k), generator=g)
    flat = ids.view(-1)
    flat[::5] = -1
    flat[1::7] = e
    flat[2::11] = INT32_MAX
    if dtype == torch.int64:
        flat[3::13] = 2**32 + 1  # must drop, not alias expert 1
        flat[4::17] = -(2**40)
    return ids.to(dtype)


def _check_route_result(ids, e, capacity, c0, rows, counts, counters, deterministic):
    want_counters = c0.clone()
    want_rows, want_counts = ref.moe_route_rows(ids, e, capacity, want_counters)
    assert torch.equal(counts, want_counts), "counts differ from the oracle"
    assert torch.equal(counters, want_counters), "counters differ from the oracle"
    if deterministic:
        assert torch.equal(rows, want_rows)
    flat = ids.reshape(-1).long()

    def per_expert(r):
        return torch.sort(flat * 2**33 + r.reshape(-1).long()).values

    assert torch.equal(per_expert(rows), per_expert(want_rows)), "not the oracle's row sets"
    got = rows[rows >= 0]
    assert got.unique().numel() == got.numel(), "a row was claimed twice"


ROUTE_PATHS = [("atomic", False), ("lds", False), ("det", True)]
COUNTER_KINDS = ["zeros", "negative", "mixed", "near_int32_max", "extremes"]


@pytest.mark.parametrize("impl", impls("route_rows"))
@pytest.mark.parametrize("path", ROUTE_PATHS, ids=[p[0] for p in ROUTE_PATHS])
@pytest.mark.parametrize("capacity", [None, 3], ids=["compact", "cap3"])
@pytest.mark.parametrize("counters", COUNTER_KINDS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_memsafe_route_rows(impl, path, capacity, counters, dtype):
    e, m, k = 8, 21, 3
    g = torch.Generator().manual_seed(len(counters) + k)
    _route_case(impl, path, capacity, counters, dtype, e, m, k, g)


@pytest.mark.parametrize("impl", impls("route_rows"))
@pytest.mark.parametrize("path", ROUTE_PATHS, ids=[p[0] for p in ROUTE_PATHS])
@pytest.mark.parametrize("capacity", [None, 2], ids=["compact", "cap2"])
@pytest.mark.parametrize("counters", ["mixed", "near_int32_max"])
def test_memsafe_route_rows_wide(impl, path, capacity, counters):
    """E beyond the LDS histogram of the Triton kernels (its separate E > 4096 kernels) and beyond
    one scan block of the HIP finalize."""
    if path[0] == "lds":
        pytest.skip("lds needs E <= 4096")
    g = torch.Generator().manual_seed(3)
    _route_case(impl, path, capacity, counters, torch.int32, 4100, 40, 4, g)


def _route_case(impl, path, capacity, counters, dtype, e, m, k, g):
    name, det = path
    ids = _ids(m, k, e, dtype, g)
    c0 = _counters(counters, e, g).to(torch.int32)
    ids_b = Banded((m, k), dtype, ids, band_value=0)  # reading past the ids would add routes
    counters_b = Banded((e,), torch.int32, c0)
    rows_b = Banded((m, k), torch.int32)
    counts_b = Banded((e,), torch.int32, torch.zeros(e, dtype=torch.int32))
    impl(ids_b.t, e, capacity, counters_b.t, rows_b.t, counts_b.t, det, "atomic" if det else name)
    _check_route_result(
        ids, e, capacity, c0, rows_b.t.cpu(), counts_b.t.cpu(), counters_b.t.cpu(), det
    )
    assert all(b.bands_intact() for b in (ids_b, counters_b, rows_b, counts_b))


ALIGN_IDS = ["mixed_invalid", "all_invalid", "one_expert", "int64_huge"]


@pytest.mark.parametrize("impl", impls("align_block_size"))
@pytest.mark.parametrize("kind", ALIGN_IDS)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_memsafe_align(impl, kind, block_size):
    e, m, k = 8, 13, 3
    g = torch.Generator().manual_seed(block_size)
    dtype = torch.int64 if kind == "int64_huge" else torch.int32
    ids = _ids(m, k, e, dtype, g)
    if kind == "all_invalid":
        ids = torch.full((m, k), -1, dtype=dtype)
    elif kind == "one_expert":
        ids = torch.full((m, k), e - 1, dtype=dtype)
    padded, blocks = ref.layout.align_buffer_sizes(ids.numel(), e, block_size, False)
    ids_b = Banded((m, k), dtype, ids, band_value=0)
    sorted_b = Banded((padded,), torch.int32)
    experts_b = Banded((blocks,), torch.int32)
    post_b = Banded((1,), torch.int32)
    impl(AlignCall(e, block_size), ids_b.t, None, sorted_b.t, experts_b.t, post_b.t)
    want = ref.moe_align_block_size(ids, block_size, e)
    for got, w in zip((sorted_b.t, experts_b.t, post_b.t), want):
        assert torch.equal(got.cpu(), w)
    assert all(b.bands_intact() for b in (ids_b, sorted_b, experts_b, post_b))


# ------------------------------------------------------------------------------------------------
# Router QB histogram under any bounds / bias / logits, and the QB recovery under any counts
# ------------------------------------------------------------------------------------------------
NAN, INF = float("nan"), float("inf")
UNIFORM_BOUNDS = {
    "nan": [NAN, NAN],
    "inf": [-INF, INF],
    "reversed": [1.0, -1.0],
    "empty": [0.5, 0.5],
    "huge": [-3e38, 3e38],
    "tiny": [0.0, 1e-38],
}
MARGIN_BOUNDS = {"nan": [NAN, NAN], "zero": [0.0, 0.0], "negative": [-1.0, -5.0], "inf": [INF, INF]}


@pytest.mark.parametrize("impl", impls("router_fwd"))
@pytest.mark.parametrize("mode", ["two_kernel", "fused_atomic"])
@pytest.mark.parametrize(
    "binning,bounds",
    [("uniform", b) for b in UNIFORM_BOUNDS] + [("log_margin", b) for b in MARGIN_BOUNDS],
)
def test_memsafe_router_qb_histogram(impl, mode, binning, bounds):
    """Bounds a trusted producer marked validated without checking (any values), a bias and logits
    with NaN / inf: every histogram row gains exactly T counts, inside its buffer."""
    t, e, k, nb = 6, 16, 3, 8
    g = torch.Generator().manual_seed(len(bounds))
    logits = torch.randn(t, e, generator=g)
    logits[0, :3] = torch.tensor([NAN, INF, -INF])
    logits[1] = NAN
    bias = torch.randn(e, generator=g) * 0.1
    bias[2], bias[5] = NAN, INF
    table = UNIFORM_BOUNDS if binning == "uniform" else MARGIN_BOUNDS
    logits_b = Banded((t, e), torch.float32, logits, band_value=0.0)
    bias_b = Banded((e,), torch.float32, bias, band_value=0.0)
    bounds_b = Banded((2,), torch.float32, torch.tensor(table[bounds]))
    hist_b = Banded((e, nb), torch.int32, torch.full((e, nb), 2, dtype=torch.int32))
    probs_b = Banded((t, e), torch.float32)
    idx_b = Banded((t, k), torch.int32)
    selection = "tie_free" if binning == "log_margin" else "te"
    call = RouterCall(
        e, k, map_kind="indices", selection=selection, qb_mode=mode, qb_binning=binning, num_bins=nb
    )
    impl(call, logits_b.t, bias_b.t, probs_b.t, idx_b.t, hist_b.t, bounds_b.t, None, None)
    assert torch.all(hist_b.t.sum(1).cpu() == 2 * nb + t), "each row gains exactly T counts"
    idx = idx_b.t.cpu()
    assert torch.all((idx >= 0) & (idx < e))
    assert all(len(set(row)) == k for row in idx.tolist()), "k distinct experts per token"
    assert all(b.bands_intact() for b in (logits_b, bias_b, bounds_b, hist_b, probs_b, idx_b))


HIST_CASES = ["negative", "int32_max", "alternating", "empty"]


def _histogram(kind, e, b, dtype, g):
    if kind == "negative":
        return torch.randint(-50, 5, (e, b), generator=g).to(dtype)
    if kind == "int32_max":
        return torch.full((e, b), INT32_MAX, dtype=dtype)
    if kind == "alternating":
        h = torch.zeros(e, b, dtype=torch.int64)
        h[:, ::2] = INT32_MAX
        h[:, 1::2] = INT32_MIN
        return h.to(dtype)
    return torch.zeros(e, b, dtype=dtype)


@pytest.mark.parametrize("impl", impls("qb_recover"))
@pytest.mark.parametrize("kind", HIST_CASES)
@pytest.mark.parametrize("binning", ["uniform", "log_margin"])
def test_memsafe_qb_recover(impl, kind, binning):
    """Counts are values, never addresses: any histogram keeps every access inside the buffers;
    the estimate follows the oracle's arithmetic on the given counts."""
    e, b = 6, 10
    g = torch.Generator().manual_seed(len(kind))
    hist = _histogram(kind, e, b, torch.int32, g)
    bounds = [-1.0, 1.0] if binning == "uniform" else [0.01, 100.0]
    hist_b = Banded((e, b), torch.int32, hist, band_value=1)
    bounds_b = Banded((2,), torch.float32, torch.tensor(bounds))
    bias_b = Banded((e,), torch.float32, torch.linspace(-0.1, 0.1, e))
    out_b = Banded((e,), torch.float32)
    bias = bias_b.t if binning == "log_margin" else None
    impl(hist_b.t, bounds_b.t, 2, out_b.t, binning, bias)
    want = ref.qb_recover_bias(
        hist, torch.tensor(bounds), 2, binning=binning, expert_bias=bias_b.t.cpu()
    )
    torch.testing.assert_close(out_b.t.cpu(), want, equal_nan=True, atol=1e-6, rtol=0)
    assert all(x.bands_intact() for x in (hist_b, bounds_b, bias_b, out_b))


@pytest.mark.parametrize("impl", impls("qb_step"))
@pytest.mark.parametrize("kind", HIST_CASES)
def test_memsafe_qb_step(impl, kind):
    e, b = 6, 10
    g = torch.Generator().manual_seed(len(kind) + 1)
    hist_b = Banded((e, b), torch.int32, _histogram(kind, e, b, torch.int32, g), band_value=1)
    bias_b = Banded((e,), torch.float32, torch.linspace(-0.1, 0.1, e))
    bounds_b = Banded((2,), torch.float32, torch.tensor([-1.5, 1.5]))
    rejected_b = Banded((1,), torch.int32, torch.zeros(1, dtype=torch.int32))
    impl(bias_b.t, hist_b.t, bounds_b.t, 2, 0.0, "uniform", 0.25, rejected_b.t)
    assert torch.isfinite(bias_b.t).all() and torch.isfinite(bounds_b.t).all()
    assert int(rejected_b.t) in (0, 1)
    assert all(x.bands_intact() for x in (hist_b, bias_b, bounds_b, rejected_b))
