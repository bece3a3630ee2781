"""Route-row, alignment and chunk oracles: invariants over many expert counts, vLLM's example,
TE's chunk layouts."""

import pytest
import torch

from amdqb import ref

EXPERT_COUNTS = (1, 2, 255, 256, 257, 384, 385, 512, 513, 896, 1024, 4096)


def make_ids(m, k, e, dist, seed=0):
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
    ids = make_ids(m, k, e, dist, seed=e)
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


def test_align_block_size_vllm_docstring_example():
    ids = torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]])
    sorted_ids, expert_ids, post = ref.moe_align_block_size(ids, 4, 5)
    assert sorted_ids[:16].tolist() == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
    assert torch.all(sorted_ids[16:] == 12)
    assert expert_ids[:4].tolist() == [1, 2, 3, 4] and torch.all(expert_ids[4:] == 0)
    assert post.tolist() == [16] and post.dtype == torch.int32
    assert sorted_ids.numel() == 12 + 5 * 3


@pytest.mark.parametrize("e", (32, 257, 896))
@pytest.mark.parametrize("block", (16, 64, 256))
def test_align_block_size_invariants(e, block):
    ids = make_ids(50, 6, e, "dropped", seed=block)
    sorted_ids, expert_ids, post = ref.moe_align_block_size(ids, block, e, pad_sorted_ids=True)
    numel = ids.numel()
    assert sorted_ids.numel() % block == 0
    n = int(post)
    assert n % block == 0
    flat = ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < e)
    got = sorted_ids[:n][sorted_ids[:n] != numel].long()
    assert sorted(got.tolist()) == torch.nonzero(valid).flatten().tolist()
    owner = expert_ids[(torch.nonzero(sorted_ids[:n] != numel).flatten() // block)]
    assert torch.equal(flat[got], owner.long())  # every id sits in a block of its expert


def test_align_expert_map_applies_to_all_blocks():
    ids = torch.tensor([[0, 1], [1, 3]])
    emap = torch.tensor([-1, 0, -1, 1], dtype=torch.int32)
    _, expert_ids, _ = ref.moe_align_block_size(ids, 2, 4)
    from amdqb import moe_align_block_size

    _, mapped, _ = moe_align_block_size(ids, 2, 4, expert_map=emap)
    assert torch.equal(mapped, emap[expert_ids.long()])


TE_LAYOUTS = [
    ([0, 3, 5], [2, 0, 1], [5, 3, 8]),
    ([2, 0, 129, 1], [3, 1, 2, 0], [1, 7, 129, 127]),
    ([0, 0, 0], [0, 1, 2], [0, 0, 0]),
    ([0, 0, 0], [0, 1, 2], [4, 0, 4]),
    ([7], [0], [7]),
]


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
