"""Exactness of the routers against torch on the same device, bit for bit.

The contract (``amdqb.ref.router``): every kernel backend computes the scores torch computes for
the same logits on the same device (``torch.sigmoid``, ``sqrt(softplus)``, ``torch.softmax`` for
rows of at most 1024 fp32 values), so probs, routing maps, indices and QB histograms equal the
torch-based oracle evaluated on the GPU bit for bit -- the oracle's fixed-order sums
(``routes_sum``) are element-wise adds, the same on every device.

These comparisons run on a GPU: on the CPU the Triton interpreter and the hip emulator use numpy's
and the C library's ``exp``, not torch's, and the CPU suite compares them with the oracle evaluated
on their own activations instead. Inputs: the seed shapes (E=896, k=16, B=1000, T=257 and 4096),
and adversarial rows -- logits around +-88 (the sigmoid's divisor overflows), denormals, NaN and
+-inf, exact ties at the cutoff, and scores on exact bin edges.
"""

from __future__ import annotations

import pytest
import torch

import amdqb
from amdqb import ref
from amdqb.ref import qb as ref_qb

from conftest import DEVICE, HAS_GPU, kernel_backends
from router_cases import kernel_scores

pytestmark = [
    pytest.mark.skipif(
        not HAS_GPU,
        reason="torch's bits are the GPU's (libdevice / ocml); the CPU interpreter and emulator "
        "use numpy's and libc's exp, so the CPU suite compares on the kernels' own activations",
    ),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]

BACKENDS = kernel_backends("router_fwd")
E, K, B = 896, 16, 1000
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _logits(t, e, dtype=torch.float32, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, e, generator=g) * scale).to(dtype).to(DEVICE)


def adversarial_logits(t=64, e=E, seed=1):
    """Rows that stress the activation and the selection: +-88 (e^-z overflows near -88.7),
    denormals, NaN / +-inf, long runs of equal logits (ties at the cutoff, r on bin edges)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(t, e, generator=g) * 4
    z[0] = torch.linspace(-90.0, 90.0, e)
    z[1] = torch.linspace(-88.8, -86.5, e)
    z[2] = torch.full((e,), 1e-40)  # denormal
    z[2, ::3] = -1e-40
    z[3, ::7] = float("nan")
    z[4, ::5] = float("inf")
    z[4, 1::5] = -float("inf")
    z[5] = 0.0  # every expert tied; s = 0.5 exactly
    z[6, : e // 2] = 1.0  # a tie across the cutoff
    z[7] = torch.randint(-3, 4, (e,), generator=g).float()  # many ties
    return z.to(DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("score_function", ["sigmoid", "sqrtsoftplus", "softmax"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_scores_are_torchs_bits(backend, score_function, dtype):
    for z in (_logits(257, E, dtype), adversarial_logits().to(dtype)):
        got = kernel_scores(backend, z, score_function)
        want = ref.activation(z.float(), score_function)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)) or (
            torch.equal(torch.isnan(got), torch.isnan(want))
            and torch.equal(
                torch.where(torch.isnan(got), 0.0, got), torch.where(torch.isnan(want), 0.0, want)
            )
        )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "score_function,pre,bias",
    [("sigmoid", False, True), ("sigmoid", False, False), ("sqrtsoftplus", False, True),
     ("softmax", True, False), ("softmax", False, False)],
)  # fmt: skip
@pytest.mark.parametrize("dtype", DTYPES)
def test_router_outputs_equal_the_torch_oracle(backend, score_function, pre, bias, dtype):
    z = _logits(4096, E, dtype)
    b = (torch.randn(E, generator=torch.Generator().manual_seed(2)) * 0.05).to(DEVICE)
    b = b if bias else None
    for scaling in (None, 1.25):
        probs, rmap = amdqb.fused_topk_with_score_function(
            z, K, pre, None, None, scaling, score_function, b, backend=backend
        )
        ref_probs, _, ref_map = ref.fused_topk_with_score_function(
            z, K, pre, None, None, scaling, score_function, b
        )
        assert torch.equal(rmap, ref_map)
        assert torch.equal(probs, ref_probs.to(dtype))


@pytest.mark.parametrize("backend", BACKENDS)
def test_router_adversarial_rows_equal_the_torch_oracle(backend):
    z = adversarial_logits()
    b = torch.zeros(E, device=DEVICE)
    idx = torch.empty(z.shape[0], K, dtype=torch.int64, device=DEVICE)
    probs, _ = amdqb.fused_topk_with_score_function(
        z, K, expert_bias=b, topk_indices=idx, backend=backend
    )
    ref_probs, ref_idx, _ = ref.fused_topk_with_score_function(z, K, expert_bias=b)
    assert torch.equal(idx, ref_idx)
    assert torch.equal(torch.nan_to_num(probs, nan=7.0), torch.nan_to_num(ref_probs, nan=7.0))


@pytest.mark.parametrize("backend", kernel_backends("biased_topk"))
@pytest.mark.parametrize("score_function", ["sigmoid", "softmax"])
def test_biased_topk_equals_the_torch_oracle(backend, score_function):
    z = _logits(256, E)
    b = (torch.randn(E, generator=torch.Generator().manual_seed(3)) * 0.05).to(DEVICE)
    w, ids = amdqb.biased_topk(z, K, b, score_function=score_function, backend=backend)
    rw, rids = ref.biased_topk(z, K, b, score_function=score_function)
    assert torch.equal(ids, rids)
    assert torch.equal(w, rw)


def _qb_inputs(t, k, seed=4):
    z = _logits(t, E, seed=seed)
    bias = torch.linspace(-0.2, 0.2, E, device=DEVICE)
    bounds = torch.stack([bias.min() - 1, bias.max() + 1]).contiguous()
    return z, bias, bounds


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["two_kernel", "fused_atomic"])
@pytest.mark.parametrize("k", [8, 16])
@pytest.mark.parametrize("fmt", ["bytemap", "bitmap_u8", "int16", "int32", "int64"])
def test_qb_histogram_equals_the_torch_oracle(backend, mode, k, fmt):
    """TE's QB test shape (T=257, E=896, B=1000, bias linspace(-0.2, 0.2)): histogram, routes and
    probs bitwise the torch oracle's on the GPU."""
    z, bias, bounds = _qb_inputs(257, k)
    hist = torch.zeros(E, B, dtype=torch.int32, device=DEVICE)
    idx = None
    if fmt.startswith("int"):
        idx = torch.empty(257, k, dtype=getattr(torch, fmt), device=DEVICE)
    probs, out = amdqb.fused_topk_with_score_function(
        z,
        k,
        expert_bias=bias,
        routing_map_format="bitmap_u8" if fmt == "bitmap_u8" else "bytemap",
        topk_indices=idx,
        qb_histogram=hist,
        qb_bin_bounds=bounds,
        qb_histogram_mode=mode,
        backend=backend,
    )
    want = torch.zeros_like(hist)
    ref_probs, ref_idx, ref_map = ref.fused_topk_with_score_function(
        z, k, expert_bias=bias, qb_histogram=want, qb_bin_bounds=bounds
    )
    assert torch.equal(hist, want)
    assert torch.equal(probs, ref_probs)
    if fmt == "bytemap":
        assert torch.equal(out, ref_map)
    elif fmt == "bitmap_u8":
        assert torch.equal(out, ref.pack_bitmap(ref_map))
    else:
        assert torch.equal(out.long(), ref_idx)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["two_kernel", "fused_atomic"])
def test_qb_histogram_on_bin_edges_and_adversarial_rows(backend, mode):
    """Zero bias and bounds [-1, 1]: tied logits give r exactly on bin edges (0.002 apart)."""
    z = adversarial_logits()
    bias = torch.zeros(E, device=DEVICE)
    bounds = torch.tensor([-1.0, 1.0], device=DEVICE)
    hist = torch.zeros(E, B, dtype=torch.int32, device=DEVICE)
    amdqb.fused_topk_with_score_function(
        z,
        K,
        expert_bias=bias,
        qb_histogram=hist,
        qb_bin_bounds=bounds,
        qb_histogram_mode=mode,
        backend=backend,
    )
    want = torch.zeros_like(hist)
    ref.fused_topk_with_score_function(
        z, K, expert_bias=bias, qb_histogram=want, qb_bin_bounds=bounds
    )
    assert torch.equal(hist, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["two_kernel", "fused_atomic"])
@pytest.mark.parametrize("selection", ["te", "tie_free"])
@pytest.mark.parametrize("t", [257, 4096])
def test_log_margin_histogram_equals_the_torch_oracle(backend, mode, selection, t):
    z = _logits(t, E, seed=5, scale=8.0)
    bias = (torch.randn(E, generator=torch.Generator().manual_seed(6)) * 1e-3).to(DEVICE)
    scale = ref_qb.margin_scale(bias)
    hist = torch.zeros(E, 64, dtype=torch.int32, device=DEVICE)
    probs, rmap = amdqb.fused_topk_with_score_function(
        z,
        K,
        expert_bias=bias,
        qb_histogram=hist,
        qb_bin_bounds=scale,
        qb_histogram_mode=mode,
        selection=selection,
        qb_binning="log_margin",
        backend=backend,
    )
    want = torch.zeros_like(hist)
    ref_probs, _, ref_map = ref.fused_topk_with_score_function(
        z,
        K,
        expert_bias=bias,
        qb_histogram=want,
        qb_bin_bounds=scale,
        selection=selection,
        qb_binning="log_margin",
    )
    assert torch.equal(hist, want)
    assert torch.equal(rmap, ref_map)
    assert torch.equal(probs, ref_probs)
    assert int(hist.sum()) == t * E
