"""moe_align_block_size's buffer sizes (vLLM's rule) and the preallocated form.

vLLM sizes ``sorted_token_ids`` ``numel + E * (block_size - 1)`` (rounded up to ``block_size``
with ``pad_sorted_ids``) and, with fewer routes than experts, ``numel * block_size``: at most
``numel`` experts are non-empty. The tests check the rule against its definition, that the padded
total of the worst routing (every route to its own expert) fits exactly, and that every backend's
kernels fill such buffers -- and caller buffers of the minimal checked length -- equal to the
oracle, without a write past them.
"""

import pytest
import torch

import amdqb
from amdqb import ref
from amdqb.ops.layout import align_block_size_into, align_min_rows
from amdqb.ref.layout import align_buffer_sizes

from conftest import DEVICE, kernel_backends
from hip_emu.checks import make_ids
from hip_emu.runtime import EmuRuntime, compiler

BACKENDS = ["torch"] + [b for b in kernel_backends("align_block_size") if isinstance(b, str)]


def vllm_rows(numel, e, bs, pad):
    """vLLM's sizing, spelled out: the general bound, its rounding, then the decode cap."""
    rows = numel + e * (bs - 1)
    if pad and rows % bs:
        rows += bs - rows % bs
    if numel < e:
        rows = min(rows, numel * bs)
    return rows


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize(
    "numel,e,bs",
    [(1, 32, 32), (3, 256, 128), (31, 32, 16), (32, 32, 16), (33, 32, 16), (96, 257, 64),
     (4096, 256, 128), (5, 8, 1), (0, 4, 16), (12, 5, 4)],
)  # fmt: skip
def test_buffer_rule(numel, e, bs, pad):
    rows, blocks = align_buffer_sizes(numel, e, bs, pad)
    assert rows == vllm_rows(numel, e, bs, pad)
    assert blocks == -(-rows // bs)
    if numel < e:
        assert rows == numel * bs  # the cap always wins below E routes, rounding or not
    assert rows >= align_min_rows(numel, e, bs)  # any routing's padded total fits


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize(
    "m,k,e,bs", [(1, 1, 32, 32), (3, 4, 256, 16), (2, 6, 64, 8), (7, 2, 16, 4)]
)
def test_worst_case_routing_fills_the_decode_buffer(backend, m, k, e, bs, pad):
    """Every route to a distinct expert: m*k non-empty experts, one block each -- the padded
    total is numel * block_size, exactly the buffer vLLM allocates below E routes."""
    numel = m * k
    assert numel < e
    g = torch.Generator().manual_seed(numel + e)
    ids = torch.randperm(e, generator=g)[:numel].view(m, k).to(torch.int32)
    got = amdqb.moe_align_block_size(ids.to(DEVICE), bs, e, pad_sorted_ids=pad, backend=backend)
    want = ref.moe_align_block_size(ids, bs, e, pad_sorted_ids=pad)
    assert got[0].numel() == numel * bs and got[1].numel() == numel
    assert int(got[2]) == numel * bs
    for g_, w in zip(got, want):
        assert torch.equal(g_.cpu(), w)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_routes(backend):
    ids = torch.empty(0, 4, dtype=torch.int32, device=DEVICE)
    sorted_ids, expert_ids, post = amdqb.moe_align_block_size(ids, 16, 8, backend=backend)
    assert sorted_ids.numel() == 0 and expert_ids.numel() == 0 and post.tolist() == [0]


def _routes(dist, m, k, e, seed):
    """int32 [m, k] ids: distinct experts (mod E), all on the last expert, or some outside [0, E)."""
    numel = m * k
    g = torch.Generator().manual_seed(seed)
    if dist == "distinct":
        ids = torch.randperm(max(e, numel), generator=g)[:numel] % e
    elif dist == "one":
        ids = torch.full((numel,), e - 1)
    else:
        ids = torch.randint(-2, e + 3, (numel,), generator=g)
    return ids.view(m, k).to(torch.int32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dist", ["distinct", "one", "dropped"])
@pytest.mark.parametrize("m,k,e,bs", [(3, 4, 64, 16), (40, 4, 32, 8), (5, 3, 7, 5)])
def test_into_minimal_buffers_without_writes_past_them(backend, dist, m, k, e, bs):
    """Caller buffers of exactly the checked minimum (numel + min(numel, E) * (bs - 1) rows,
    that many rows' whole blocks) inside guard-banded allocations: the layout equals the oracle's
    prefix, every entry of the buffers is written, the guard bands keep their poison."""
    numel = m * k
    ids = _routes(dist, m, k, e, m * e + bs)
    rows = align_min_rows(numel, e, bs)
    guard = 37
    big_sorted = torch.full((rows + guard,), -7, dtype=torch.int32, device=DEVICE)
    big_blocks = torch.full((rows // bs + guard,), -7, dtype=torch.int32, device=DEVICE)
    post = torch.full((1,), -7, dtype=torch.int32, device=DEVICE)
    sorted_ids, expert_ids = big_sorted[:rows], big_blocks[: rows // bs]
    align_block_size_into(ids.to(DEVICE), bs, e, sorted_ids, expert_ids, post, backend=backend)
    want_sorted, want_blocks, want_post = ref.moe_align_block_size(ids, bs, e)
    assert torch.equal(post.cpu(), want_post)
    assert int(post) <= rows
    assert torch.equal(sorted_ids.cpu(), want_sorted[:rows])
    assert torch.equal(expert_ids.cpu(), want_blocks[: rows // bs])
    assert torch.all(big_sorted[rows:] == -7) and torch.all(big_blocks[rows // bs :] == -7)


def test_into_rejects_buffers_a_routing_could_overflow():
    ids = torch.zeros(4, 2, dtype=torch.int32, device=DEVICE)
    rows = align_min_rows(8, 16, 4)  # 8 + 8 * 3
    post = torch.empty(1, dtype=torch.int32, device=DEVICE)

    def buffers(n_rows, n_blocks):
        return (
            torch.empty(n_rows, dtype=torch.int32, device=DEVICE),
            torch.empty(n_blocks, dtype=torch.int32, device=DEVICE),
        )

    with pytest.raises(ValueError, match="sorted_token_ids"):
        align_block_size_into(ids, 4, 16, *buffers(rows - 1, rows // 4), post)
    with pytest.raises(ValueError, match="expert_ids"):
        align_block_size_into(ids, 4, 16, *buffers(rows, rows // 4 - 1), post)
    with pytest.raises(TypeError, match="sorted_token_ids"):
        s, b = buffers(rows, rows // 4)
        align_block_size_into(ids, 4, 16, s.long(), b, post)
    with pytest.raises(ValueError, match="num_tokens_post_pad"):
        align_block_size_into(ids, 4, 16, *buffers(rows, rows // 4), post.repeat(2))
    align_block_size_into(ids, 4, 16, *buffers(rows, rows // 4), post)  # the minimum is enough


@pytest.mark.skipif(compiler() is None, reason="needs g++ (C++20) for the hip kernel emulator")
@pytest.mark.parametrize("wave", [32, 64])
def test_hip_kernels_fill_the_decode_buffers_on_the_emulator(wave):
    """The hip launchers and kernels (hip_src/kernels/layout.hip, on the CPU emulator) with
    buffers of vLLM's decode size equal the oracle bitwise, partial tiles and dropped ids
    included."""
    from amdqb.backends.calls import AlignCall
    from amdqb.backends.hip import layout as hip_layout

    rt = EmuRuntime(wave_size=wave, cus=2)
    cases = [
        (33, 1, 1, "uniform", 8, False),
        (4096, 70, 4, "dropped", 128, False),
        (4096, 70, 4, "one", 64, True),
        (896, 10, 16, "uniform", 64, True),
        (257, 3, 16, "shared", 32, False),
        (300, 20, 6, "dropped", 12, True),
    ]
    for e, m, k, dist, bs, pad in cases:
        for dtype in (torch.int32, torch.int64):
            ids = make_ids(m, k, e, dist, e + m, dtype)
            rows, blocks = align_buffer_sizes(ids.numel(), e, bs, pad)
            assert rows == ids.numel() * bs  # fewer routes than experts: the decode rule
            got = tuple(torch.full((n,), -7, dtype=torch.int32) for n in (rows, blocks, 1))
            hip_layout.align_block_size(rt, AlignCall(e, bs), ids.reshape(-1), None, *got)
            want = ref.moe_align_block_size(ids, bs, e, pad_sorted_ids=pad)
            for name, g, w in zip(("sorted_ids", "expert_ids", "num_post_pad"), got, want):
                assert torch.equal(g, w), f"{name} differs (E={e}, m={m}, k={k}, {dist})"


def _check_padding_kept(got_sorted, want_sorted, numel, prefill):
    """The route slots of the oracle's layout written, every other entry the caller's prefill."""
    routes = want_sorted != numel
    assert torch.equal(got_sorted[routes], want_sorted[routes])
    assert torch.all(got_sorted[~routes] == prefill)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dist", ["distinct", "one", "dropped"])
@pytest.mark.parametrize("m,k,e,bs", [(3, 4, 64, 16), (40, 4, 32, 8), (600, 8, 256, 64)])
def test_into_without_sentinel_keeps_the_callers_padding(backend, dist, m, k, e, bs):
    """fill_sentinel=False (SGLang's pad_sorted_token_ids=False): only the route slots of
    sorted_token_ids are written, the padding keeps the caller's values; expert_ids and the
    padded total as with the sentinel. 4800 routes take the two-launch hip path."""
    numel = m * k
    ids = _routes(dist, m, k, e, m * e + bs + 1)
    rows = align_min_rows(numel, e, bs)
    sorted_ids = torch.full((rows,), -5, dtype=torch.int32, device=DEVICE)
    expert_ids = torch.full((rows // bs,), -7, dtype=torch.int32, device=DEVICE)
    post = torch.full((1,), -7, dtype=torch.int32, device=DEVICE)
    align_block_size_into(
        ids.to(DEVICE), bs, e, sorted_ids, expert_ids, post, fill_sentinel=False, backend=backend
    )
    want_sorted, want_blocks, want_post = ref.moe_align_block_size(ids, bs, e)
    assert torch.equal(post.cpu(), want_post)
    assert torch.equal(expert_ids.cpu(), want_blocks[: rows // bs])
    _check_padding_kept(sorted_ids.cpu(), want_sorted[:rows], numel, -5)


@pytest.mark.skipif(compiler() is None, reason="needs g++ (C++20) for the hip kernel emulator")
@pytest.mark.parametrize("routes", [40, 4800])
def test_hip_kernels_leave_the_padding_to_the_caller_on_the_emulator(routes):
    """flags bit 2 (AlignCall.fill_sentinel=False) on the emulator: neither the one-block kernel
    (40 routes) nor amdqb_align_plan (4800 routes, two launches) writes the sentinel."""
    from amdqb.backends.calls import AlignCall
    from amdqb.backends.hip import layout as hip_layout

    rt = EmuRuntime(wave_size=32, cus=2)
    e, bs = 64, 16
    ids = make_ids(routes // 8, 8, e, "uniform", routes, torch.int32)
    rows = align_min_rows(ids.numel(), e, bs)
    got = (
        torch.full((rows,), -5, dtype=torch.int32),
        torch.full((rows // bs,), -7, dtype=torch.int32),
        torch.full((1,), -7, dtype=torch.int32),
    )
    call = AlignCall(e, bs, fill_sentinel=False)
    hip_layout.align_block_size(rt, call, ids.reshape(-1), None, *got)
    names = {x[0] for x in rt.launches}
    assert names == (
        {"amdqb_align_plan", "amdqb_align_place"} if routes > 1000 else {"amdqb_align"}
    )
    want_sorted, want_blocks, want_post = ref.moe_align_block_size(ids, bs, e)
    assert torch.equal(got[2], want_post) and torch.equal(got[1], want_blocks[: rows // bs])
    _check_padding_kept(got[0], want_sorted[:rows], ids.numel(), -5)
