"""Chunk sort + pad and its inverse (``moe_sort_chunks_and_pad``, ``moe_unpad_and_restore_chunks``)
against the ``amdqb.ref`` oracle, for every kernel backend of ``chunk_copy``, and the oracle itself
against TE's layouts written out by hand.

On the CPU the Triton kernels run under ``TRITON_INTERPRET=1`` (small shapes); on a GPU the TE
benchmark layout runs at H=2048 with up to 32768 tokens.
"""

import pytest
import torch

import amdqb
from amdqb import ref

from conftest import DEVICE, HAS_GPU, over_backends
from layout_cases import TE_LAYOUTS, chunk_meta, expected_sort_pad, gen

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@over_backends("chunk_copy")
@pytest.mark.parametrize("prob_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", TE_LAYOUTS, ids=lambda v: str(v[0]))
def test_sort_chunks_te_layouts(backend, layout, dtype, prob_dtype):
    meta = chunk_meta(layout, torch.int32 if dtype == torch.float16 else torch.int64)
    tokens, num_out = sum(layout[0]), sum(layout[2])
    g = gen(len(layout[0]))
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


@over_backends("chunk_copy")
@pytest.mark.parametrize("dtype", DTYPES)
def test_sort_chunks_round_trip_and_grad(backend, dtype):
    layout = TE_LAYOUTS[1]
    meta = chunk_meta(layout)
    tokens, num_out = sum(layout[0]), sum(layout[2])
    g = gen(3)
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


@over_backends("chunk_copy")
@pytest.mark.parametrize("meta_dtype", [torch.int32, torch.int64])
def test_sort_chunks_many_chunks(backend, meta_dtype):
    """More chunks than the register path holds (binary-search row map), random order and
    padding, rows past the last chunk."""
    c = 1500
    g = gen(8)
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


@over_backends("chunk_copy")
def test_sort_chunks_compile_fullgraph(backend):
    layout = TE_LAYOUTS[0]
    meta = chunk_meta(layout)
    tokens, num_out = sum(layout[0]), sum(layout[2])
    inp = torch.randn(tokens, 16, generator=gen(2)).to(DEVICE)

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


@over_backends("chunk_copy")
@pytest.mark.parametrize("tokens", [8192, 32768] if HAS_GPU else [96])
def test_sort_chunks_benchmark_layout(backend, tokens):
    """The TE PR benchmark layout: 8 ranks x 16 experts, expert-major, alignment 128, padding on
    each expert's last rank chunk, H=2048 bf16 (H=64 on the CPU)."""
    ranks, experts, align = 8, 16, 128
    hidden = 2048 if HAS_GPU else 64
    g = gen(tokens)
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
# the oracle
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes,order,out_sizes", TE_LAYOUTS)
def test_chunk_row_map_by_hand(sizes, order, out_sizes):
    num_out = sum(out_sizes)
    row_map = ref.chunk_row_map(
        torch.tensor(sizes), torch.tensor(order), torch.tensor(out_sizes), num_out
    )
    starts = [sum(sizes[:c]) for c in range(len(sizes))]
    expected = []
    for i, src in enumerate(order):
        expected += [starts[src] + r for r in range(sizes[src])]
        expected += [-1] * (out_sizes[i] - sizes[src])
    assert row_map.tolist() == expected


def test_chunk_roundtrip_and_gradients():
    x = torch.randn(9, 5, dtype=torch.float64, requires_grad=True)
    p = torch.rand(9, dtype=torch.float64, requires_grad=True)
    sizes, order, out_sizes = (
        torch.tensor([2, 3, 4]),
        torch.tensor([1, 2, 0]),
        torch.tensor([4, 4, 4]),
    )
    out, out_p, row_map = ref.moe_sort_chunks_and_pad(x, sizes, order, out_sizes, 12, p)
    assert torch.all(out[row_map < 0] == 0) and torch.all(out_p[row_map < 0] == 0)
    back = ref.moe_unpad_and_restore_chunks(out, row_map, 9)
    assert torch.equal(back, x)
    torch.autograd.gradcheck(
        lambda a: ref.moe_sort_chunks_and_pad(a, sizes, order, out_sizes, 12)[0], (x,)
    )
    torch.autograd.gradcheck(lambda a: ref.moe_unpad_and_restore_chunks(a, row_map, 9), (out,))
