"""The router oracle against independent brute force and hand-computed cases."""

import math

import numpy as np
import pytest
import torch

from amdqb import ref
from amdqb.backends import torch as torch_backend


def brute_topk(values: list[float], n: int) -> list[int]:
    """Selection order written out: value desc, id asc, NaN last, -0.0 == +0.0."""

    def sort_key(i):
        v = values[i]
        return (1, 0.0, i) if math.isnan(v) else (0, -v, i)

    return sorted(range(len(values)), key=sort_key)[:n]


def test_order_key_is_monotone_and_canonical():
    x = torch.tensor(
        [float("nan"), -float("inf"), -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, float("inf")]
    )
    key = ref.order_key(x)
    assert key[4] == key[5]  # -0.0 == +0.0
    assert key[0] < key[1]  # NaN below -inf
    assert torch.all(key[2:][1:] >= key[2:][:-1])
    assert torch.all(key[1:4][1:] > key[1:4][:-1])


@pytest.mark.parametrize("seed", range(5))
def test_ranked_indices_matches_brute_force_with_ties_and_nan(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (16, 40), generator=g).float()  # many exact ties
    x[x == 3] = float("nan")
    x[x == -3] = -float("inf")
    x[0] = -0.0
    x[1, ::2] = 0.0
    for n in (1, 7, 10, 11, 40):  # the Top-n path (4n <= row) and the sort path
        got = ref.ranked_indices(x, n)
        for row in range(x.shape[0]):
            assert got[row].tolist() == brute_topk(x[row].tolist(), n), n
        # rows of a 3-D input rank independently (the grouped router's per-group order)
        assert torch.equal(ref.ranked_indices(x.reshape(4, 4, 40), n).reshape(16, n), got)


def test_sigmoid_weights_and_bias_only_shifts_selection():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    bias = torch.tensor([10.0, 0.0, 0.0, 0.0])
    probs, idx, rmap = ref.fused_topk_with_score_function(logits, 2, expert_bias=bias)
    assert idx.tolist() == [[0, 3]]  # bias pulls expert 0 in
    s = torch.sigmoid(logits)[0]
    expected = torch.tensor([s[0], 0, 0, s[3]]) / (s[0] + s[3] + 1e-20)
    assert torch.allclose(probs[0], expected)
    assert rmap.tolist() == [[True, False, False, True]]


def test_topk1_weight_is_raw_score_and_scaling_applies():
    logits = torch.tensor([[0.5, -1.0, 2.0]])
    probs, idx, _ = ref.fused_topk_with_score_function(logits, 1, scaling_factor=2.5)
    assert idx.tolist() == [[2]]
    assert torch.allclose(probs[0, 2], torch.sigmoid(torch.tensor(2.0)) * 2.5)


def test_softmax_pre_and_post():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    post, idx, _ = ref.fused_topk_with_score_function(logits, 2, score_function="softmax")
    assert idx.tolist() == [[1, 2]]
    assert torch.allclose(post[0, [1, 2]], torch.softmax(torch.tensor([3.0, 2.0]), 0))
    pre, _, _ = ref.fused_topk_with_score_function(
        logits, 2, use_pre_softmax=True, score_function="softmax"
    )
    assert torch.allclose(pre[0, [1, 2]], torch.softmax(logits[0], 0)[[1, 2]])


def test_grouped_topk_hand_case():
    # 4 groups of 2; group scores (sum of best 1): g0=0.9, g1=0.8, g2=0.95, g3=0.1
    s = torch.tensor([[0.9, 0.1, 0.8, 0.7, 0.2, 0.95, 0.05, 0.1]])
    logits = torch.log(s / (1 - s))
    _, idx, _ = ref.fused_topk_with_score_function(logits, 2, num_groups=4, group_topk=2)
    # best groups g2, g0 -> experts {5, 0} (expert 2 of g1 is excluded despite 0.8 > 0.2)
    assert sorted(idx[0].tolist()) == [0, 5]


def test_qb_tie_and_clamp_vector_te():
    """TE's test_qb_topk_plus_one_tie_and_bin_clamping."""
    logits = torch.tensor(
        [[3, 3, 3, -1, -2, -3, -4, -5], [5, 4, 3, 2, -2, -3, -4, -5]], dtype=torch.float32
    )
    hist = torch.zeros(8, 8, dtype=torch.int32)
    _, idx, rmap = ref.fused_topk_with_score_function(
        logits,
        2,
        expert_bias=torch.zeros(8),
        qb_histogram=hist,
        qb_bin_bounds=torch.tensor([-0.05, 0.05]),
    )
    assert rmap[0, :3].tolist() == [True, True, False]  # the tied largest id is dropped
    assert hist[:, 0].sum() > 0 and hist[:, -1].sum() > 0
    assert hist.sum(1).tolist() == [2] * 8


def test_qb_histogram_matches_python_loop():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(37, 11, generator=g)
    bias = torch.linspace(-0.2, 0.2, 11)
    bounds = torch.tensor([bias.min() - 1, bias.max() + 1])
    hist = torch.zeros(11, 50, dtype=torch.int32)
    ref.fused_topk_with_score_function(
        logits, 3, expert_bias=bias, qb_histogram=hist, qb_bin_bounds=bounds
    )
    s = torch.sigmoid(logits).numpy()
    u = s + bias.numpy()
    lo, hi = np.float32(bounds[0]), np.float32(bounds[1])
    scale = np.float32(50) / (hi - lo)
    expected = np.zeros((11, 50), dtype=np.int64)
    for t in range(37):
        alpha = u[t][brute_topk(u[t].tolist(), 4)[3]]
        for j in range(11):
            r = np.float32(alpha) - np.float32(s[t, j])
            b = np.floor(np.float32(r - lo) * scale)
            expected[j, int(min(max(b, 0), 49))] += 1
    assert (hist.numpy() == expected).all()


def test_bin_index_on_exact_edges_and_nan():
    bounds = torch.tensor([-1.0, 1.0])
    r = torch.tensor([-1.0, -0.75, -0.5, 0.0, 0.9999999, 1.0, 5.0, -5.0, float("nan")])
    bins = ref.qb_bin_index(r, bounds, 8)
    assert bins.tolist() == [0, 1, 2, 4, 7, 7, 7, 0, 0]
    below = torch.nextafter(torch.tensor(-0.75), torch.tensor(-1.0))
    assert ref.qb_bin_index(below.reshape(1), bounds, 8).item() == 0


def test_bin_index_fp32_formula_non_power_of_two():
    """Edges of a non power-of-two range: the fp32 formula, not float64 or true division."""
    lo, hi, nb = np.float32(-1.2), np.float32(1.3), 1000
    scale = np.float32(nb) / (hi - lo)
    edges = lo + np.arange(nb, dtype=np.float32) / scale  # values on (or next to) edges
    r = np.concatenate([edges, np.nextafter(edges, np.float32(-2)), np.nextafter(edges, 2)])
    expected = np.clip(np.floor((r.astype(np.float32) - lo) * scale), 0, nb - 1).astype(np.int64)
    got = ref.qb_bin_index(torch.from_numpy(r), torch.tensor([lo, hi]), nb).numpy()
    assert (got == expected).all()


def test_bitmap_roundtrip_lsb_first():
    rmap = torch.zeros(2, 11, dtype=torch.bool)
    rmap[0, [0, 9]] = True
    rmap[1, [7, 10]] = True
    packed = ref.pack_bitmap(rmap)
    assert packed.tolist() == [[1, 2], [128, 4]]
    assert torch.equal(ref.unpack_bitmap(packed, 11), rmap)
    npb = np.packbits(rmap.numpy(), axis=-1, bitorder="little")
    assert (packed.numpy() == npb).all()


@pytest.mark.parametrize(
    "score_function,pre,k",
    [("sigmoid", False, 4), ("sigmoid", False, 1), ("sqrtsoftplus", False, 3)]
    + [("softmax", False, 3), ("softmax", True, 3)],
)
def test_explicit_backward_formulas_equal_autograd_of_oracle(score_function, pre, k):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 13, generator=g, dtype=torch.float64).float().requires_grad_()
    grad_out = torch.randn(9, 13, generator=g)
    probs, _, rmap = ref.fused_topk_with_score_function(
        logits, k, use_pre_softmax=pre, score_function=score_function, scaling_factor=1.3
    )
    (probs * grad_out).sum().backward()
    explicit = torch.empty(9, 13)
    torch_backend.router_bwd(grad_out, logits.detach(), rmap, k, score_function, pre, 1.3, explicit)
    torch.testing.assert_close(explicit, logits.grad, atol=1e-6, rtol=1e-5)


def test_biased_topk_oracle():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    w, ids = ref.biased_topk(logits, 2, torch.tensor([0.0, 0.0, 0.0, 5.0]))
    assert ids.tolist() == [[3, 1]] and ids.dtype == torch.int32
    s = torch.sigmoid(logits[0])
    torch.testing.assert_close(w[0], torch.stack([s[3], s[1]]) / (s[3] + s[1] + 1e-20))
