"""64-bit safety: shapes whose flat offsets pass 2^31 either work (64-bit offsets in the kernels) or
are rejected with a clear error before any launch."""

import pytest
import torch

import amdqb
from amdqb import ref

from conftest import HAS_GPU, kernel_backends

BIG = 2**31


def test_route_count_beyond_int32_is_rejected():
    ids = torch.zeros(1, dtype=torch.int32).expand(BIG + 1)  # no memory behind the view
    with pytest.raises(ValueError, match="2\\^31"):
        amdqb.moe_route_rows(ids, 8)
    with pytest.raises(ValueError, match="2\\^31"):
        amdqb.moe_align_block_size(ids, 64, 8)


def test_padded_align_buffer_beyond_int32_is_rejected():
    ids = torch.zeros(1, dtype=torch.int32).expand(BIG - 100)
    with pytest.raises(ValueError, match="int32"):
        amdqb.moe_align_block_size(ids, 256, 4096)


def test_chunk_output_beyond_int32_is_rejected():
    inp = torch.zeros(1, 1).expand(4, 8)
    meta = torch.tensor([4])
    with pytest.raises(ValueError, match="num_out_tokens"):
        amdqb.moe_sort_chunks_and_pad(inp, meta, torch.tensor([0]), meta, BIG)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_GPU, reason="needs ~12 GB of device memory")
@pytest.mark.parametrize("backend", kernel_backends("router_fwd"))
def test_router_with_more_than_2_31_logits(backend):
    e = 896
    t = BIG // e + 257
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(t, e, device="cuda", generator=g, dtype=torch.bfloat16)
    bias = torch.linspace(-0.1, 0.1, e, device="cuda")
    hist = torch.zeros(e, 1000, dtype=torch.int32, device="cuda")
    bounds = torch.tensor([-1.1, 1.1], device="cuda")
    probs, rmap = amdqb.fused_topk_with_score_function(
        logits,
        16,
        expert_bias=bias,
        qb_histogram=hist,
        qb_bin_bounds=bounds,
        qb_histogram_mode="two_kernel",
        backend=backend,
    )
    assert torch.all(hist.sum(1) == t)
    rows = torch.cat([torch.arange(64), torch.arange(t - 64, t)]).cuda()  # last rows pass 2^31
    _, _, want = ref.fused_topk_with_score_function(logits[rows], 16, expert_bias=bias)
    assert torch.equal(rmap[rows], want)
    assert torch.all(rmap[-1000:].sum(1) == 16)
    del probs, rmap, logits


@pytest.mark.slow
@pytest.mark.skipif(not HAS_GPU, reason="needs ~10 GB of device memory")
@pytest.mark.parametrize("backend", kernel_backends("chunk_copy"))
def test_chunks_with_more_than_2_31_elements(backend):
    h = 8192
    n = BIG // h + 1000
    inp = torch.empty(n, h, device="cuda", dtype=torch.bfloat16)
    inp[:, 0] = torch.arange(n, device="cuda").to(torch.bfloat16)
    inp[-5:] = 7.0
    sizes = torch.tensor([n - 10, 10], device="cuda")
    order = torch.tensor([1, 0], device="cuda")
    out_sizes = torch.tensor([16, n - 10], device="cuda")
    out, _, row_map = amdqb.moe_sort_chunks_and_pad(
        inp, sizes, order, out_sizes, n + 6, backend=backend
    )
    assert torch.equal(out[10:16], torch.zeros_like(out[10:16]))
    assert torch.equal(out[:10], inp[-10:])
    assert torch.equal(out[-1], inp[n - 11])
    back = amdqb.moe_unpad_and_restore_chunks(out, row_map, n, backend=backend)
    assert torch.equal(back[-5:], inp[-5:]) and torch.equal(back[:3], inp[:3])
