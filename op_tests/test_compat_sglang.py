"""amdqb.compat.sglang against SGLang's documented semantics.

The references are plain-PyTorch statements of SGLang's math -- ``biased_grouped_topk`` (sigmoid
scores, a correction bias for the selection, groups ranked by their two best biased scores, fused
shared experts) and ``sgl_kernel.moe_align_block_size`` with its ``num_experts + 1`` EP buckets --
in fp32, amdqb's precision contract. Runs on the oracle backend and every kernel backend of the
op (on the CPU Triton runs under the interpreter).
"""

import inspect
import runpy
import sys
from pathlib import Path

import pytest
import torch

from amdqb.compat import sglang

from compat_cases import ALIGN_BACKENDS, ROUTER_BACKENDS, check_route, logits_for, top
from conftest import DEVICE


@pytest.fixture(params=ROUTER_BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("AMDQB_BACKEND", request.param)
    return request.param


@pytest.fixture(params=ALIGN_BACKENDS)
def align_backend(request, monkeypatch):
    monkeypatch.setenv("AMDQB_BACKEND", request.param)
    return request.param


def ref_gate(
    logits, bias, topk, renormalize, groups, topk_group, n_shared=0, scale=None, on_output=False
):
    """SGLang's biased grouped gate in fp32: ``topk - n_shared`` routed experts chosen on
    ``sigmoid + bias`` inside the ``topk_group`` groups of best two-score sums, weighted by the
    sigmoid; the shared slots are experts ``E + i`` weighted ``routed sum / scale``; the
    renormalization divides by the routed sum, then ``on_output`` multiplies by ``scale``."""
    s = torch.sigmoid(logits.float())
    choice = s + bias.float()
    t, e = s.shape
    if groups and groups > 1:
        per = torch.sort(choice.view(t, groups, e // groups), dim=-1, descending=True).values
        keep = top(per[..., :2].sum(-1), topk_group)
        mask = torch.zeros(t, groups, dtype=torch.bool, device=s.device).scatter(1, keep, True)
        choice = choice.masked_fill(~mask.repeat_interleave(e // groups, 1), float("-inf"))
    ids = top(choice, topk - n_shared)
    w = s.gather(1, ids)
    routed_sum = w.sum(-1, keepdim=True)
    f = 1.0 if scale is None else scale
    if n_shared:
        ids = torch.cat([ids, torch.arange(e, e + n_shared, device=s.device).expand(t, -1)], 1)
        w = torch.cat([w, (routed_sum / f).expand(t, n_shared)], 1)
    if renormalize:
        w = w / routed_sum
        if on_output:
            w = w * f
    return w, ids.to(torch.int32)


def bias_for(e, seed, dtype=torch.float32):
    return (torch.rand(e, generator=torch.Generator().manual_seed(seed)) * 0.5).to(dtype).to(DEVICE)


# ----------------------------------------------------------------------------------------------
# names and signatures
# ----------------------------------------------------------------------------------------------
SGLANG_SIGNATURES = {
    "moe_align_block_size": [
        "topk_ids", "num_experts", "block_size", "sorted_token_ids", "experts_ids",
        "num_tokens_post_pad", "cumsum_buffer", "pad_sorted_token_ids",
    ],
    "moe_fused_gate": [
        "input_tensor", "bias", "num_expert_group", "topk_group", "topk",
        "num_fused_shared_experts", "routed_scaling_factor",
        "apply_routed_scaling_factor_on_output",
    ],
    "biased_grouped_topk": [
        "hidden_states", "gating_output", "correction_bias", "topk", "renormalize",
        "num_expert_group", "topk_group", "num_fused_shared_experts", "routed_scaling_factor",
        "num_token_non_padded", "expert_location_dispatch_info",
        "apply_routed_scaling_factor_on_output", "compiled",
    ],
    "kimi_k2_moe_fused_gate": [
        "input_tensor", "bias", "topk", "renormalize", "routed_scaling_factor",
        "apply_routed_scaling_factor_on_output",
    ],
}  # fmt: skip


AMDQB_OPTIONS = {"input_dtype_math"}  # beyond SGLang's signatures


@pytest.mark.parametrize("name", sorted(SGLANG_SIGNATURES))
def test_signatures_are_sglang_order(name):
    params = inspect.signature(getattr(sglang, name)).parameters.values()
    # amdqb's own options come after SGLang's, keyword-only: a call binds as SGLang's
    own = [p for p in params if p.name in AMDQB_OPTIONS]
    assert all(p.kind == p.KEYWORD_ONLY for p in own), own
    assert [p.name for p in params if p.name not in AMDQB_OPTIONS] == SGLANG_SIGNATURES[name]


# ----------------------------------------------------------------------------------------------
# moe_fused_gate / biased_grouped_topk / kimi_k2_moe_fused_gate
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("on_output", [False, True])
@pytest.mark.parametrize("n_shared", [0, 1, 2])
@pytest.mark.parametrize(
    "e,groups,topk_group,k", [(64, 1, 1, 6), (128, 4, 2, 4), (256, 8, 4, 8), (32, 4, 3, 5)]
)  # (64, 1, 1, 6): Kimi-VL, one group; (32, 4, 3, 5): topk_group does not divide topk
def test_moe_fused_gate(backend, e, groups, topk_group, k, n_shared, on_output):
    t = 9
    logits, bias = logits_for(t, e, seed=e + k), bias_for(e, seed=e)
    topk = k + n_shared
    got = sglang.moe_fused_gate(logits, bias, groups, topk_group, topk, n_shared, 2.5, on_output)
    check_route(
        got, ref_gate(logits, bias, topk, True, groups, topk_group, n_shared, 2.5, on_output)
    )
    w = got[0]
    routed_sum = w[:, :k].sum(-1)
    want_sum = torch.full_like(routed_sum, 2.5 if on_output else 1.0)
    torch.testing.assert_close(routed_sum, want_sum)  # renormalized over the routed slots


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_moe_fused_gate_half_inputs_route_in_fp32(backend, dtype):
    """bf16/fp16 logits and bias: amdqb keeps its fp32 contract (the sigmoid and the bias add of
    the input values in fp32), where SGLang's kernel works in the input dtype -- the routes equal
    the fp32 reference of the same values; the weights stay close to SGLang's in-dtype ones."""
    e, groups, topk_group, k = 256, 8, 4, 8
    logits = logits_for(17, e, seed=3, dtype=dtype)
    bias = bias_for(e, seed=4, dtype=dtype)
    got = sglang.moe_fused_gate(logits, bias, groups, topk_group, k, 0, 2.5)
    check_route(got, ref_gate(logits.float(), bias.float(), k, True, groups, topk_group))
    in_dtype = torch.sigmoid(logits).gather(1, got[1].long()).float()
    torch.testing.assert_close(got[0], in_dtype / in_dtype.sum(-1, keepdim=True), atol=2e-2, rtol=0)


@pytest.mark.parametrize("on_output", [False, True])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("n_shared", [0, 1])
@pytest.mark.parametrize("scale", [None, 2.5])
def test_biased_grouped_topk(backend, renormalize, n_shared, scale, on_output):
    """Without renormalization a shared slot weighs ``routed sum / scale`` and the scale is not
    applied to the output (SGLang applies it only to renormalized weights)."""
    e, groups, topk_group, k = 64, 8, 3, 6
    logits, bias = logits_for(13, e, seed=k), bias_for(e, seed=1)
    topk = k + n_shared
    got = sglang.biased_grouped_topk(
        logits, logits, bias, topk, renormalize, groups, topk_group, n_shared, scale,
        apply_routed_scaling_factor_on_output=on_output,
    )  # fmt: skip
    want = ref_gate(logits, bias, topk, renormalize, groups, topk_group, n_shared, scale, on_output)
    check_route(got, want)


def test_biased_grouped_topk_padded_rows_and_rejections(backend):
    e = 32
    logits, bias = logits_for(6, e, seed=9), bias_for(e, seed=9)
    w, ids = sglang.biased_grouped_topk(
        logits, logits, bias, 4, True, 4, 2, 0, 1.0, torch.tensor([4], device=DEVICE)
    )
    want = ref_gate(logits, bias, 4, True, 4, 2)
    assert torch.equal(ids[:4].cpu(), want[1][:4].cpu()) and torch.all(ids[4:] == -1)
    torch.testing.assert_close(w.cpu(), want[0].cpu())
    with pytest.raises(NotImplementedError, match="expert_location_dispatch_info"):
        sglang.biased_grouped_topk(logits, logits, bias, 4, True, 4, 2, 0, 1.0, None, object())
    with pytest.raises(ValueError, match="Number of tokens mismatch"):
        sglang.biased_grouped_topk(logits[:2], logits, bias, 4, True, 4, 2)
    with pytest.raises(ValueError, match="num_fused_shared_experts"):
        sglang.moe_fused_gate(logits, bias, 4, 2, 4, 4, 1.0)
    with pytest.raises(ValueError, match="routed_scaling_factor"):
        sglang.moe_fused_gate(logits, bias, 4, 2, 4, 1, 0)


@pytest.mark.parametrize("on_output", [False, True])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("k", [6, 8])
def test_kimi_k2_moe_fused_gate(backend, k, renormalize, on_output):
    e = 384
    logits, bias = logits_for(5, e, seed=k), bias_for(e, seed=k)
    got = sglang.kimi_k2_moe_fused_gate(logits, bias, k, renormalize, 2.0, on_output)
    check_route(got, ref_gate(logits, bias, k, renormalize, 1, 1, scale=2.0, on_output=on_output))


# ----------------------------------------------------------------------------------------------
# moe_align_block_size (num_experts + 1 EP buckets)
# ----------------------------------------------------------------------------------------------
def ref_align(topk_ids, num_experts, bs, rows, blocks):
    """SGLang's layout: route id ``x`` in bucket ``x + 1`` of ``num_experts``, buckets ascending,
    each padded to whole blocks labelled ``bucket - 1`` (so EP-filtered -1 routes come first, in
    blocks of expert -1); sentinel ``numel``; blocks past the padded total 0 (the zeroed buffer)."""
    flat = topk_ids.reshape(-1).tolist()
    numel = len(flat)
    buckets = {}
    for i, x in enumerate(flat):
        if 0 <= x + 1 < num_experts:
            buckets.setdefault(x + 1, []).append(i)
    sorted_ids, expert_ids, pos = [numel] * rows, [0] * blocks, 0
    for b in sorted(buckets):
        routes = buckets[b]
        sorted_ids[pos : pos + len(routes)] = routes
        for j in range(-(-len(routes) // bs)):
            expert_ids[pos // bs + j] = b - 1
        pos += -(-len(routes) // bs) * bs
    return torch.tensor(sorted_ids), torch.tensor(expert_ids), torch.tensor([pos])


def sglang_buffers(numel, num_experts, bs):
    """SGLang's srt allocation (num_experts already + 1): zeroed expert ids, floor blocks."""
    rows = numel * bs if numel < num_experts else numel + num_experts * (bs - 1)
    return (
        torch.full((rows,), -7, dtype=torch.int32, device=DEVICE),
        torch.zeros(rows // bs, dtype=torch.int32, device=DEVICE),
        torch.full((1,), -7, dtype=torch.int32, device=DEVICE),
        torch.full((num_experts + 1,), -7, dtype=torch.int32, device=DEVICE),
    )


@pytest.mark.parametrize("pad_sorted_token_ids", [False, True])
@pytest.mark.parametrize("filtered", [False, True])
@pytest.mark.parametrize(
    "m,k,e,bs", [(1, 1, 64, 32), (4, 8, 64, 16), (33, 2, 160, 64), (64, 4, 8, 16), (3, 6, 257, 8)]
)
def test_moe_align_block_size(align_backend, m, k, e, bs, filtered, pad_sorted_token_ids):
    g = torch.Generator().manual_seed(m * k + e)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)]).to(torch.int32)
    if filtered:  # an EP dispatcher marks the routes to other ranks' experts -1
        ids[torch.rand(ids.shape, generator=g) < 0.4] = -1
    num_experts = e + 1  # SGLang passes the expert count + 1
    sorted_ids, expert_ids, post, cumsum = sglang_buffers(ids.numel(), num_experts, bs)
    if not pad_sorted_token_ids:
        sorted_ids.fill_(ids.numel())  # SGLang's callers prefill the sentinel then
    sglang.moe_align_block_size(
        ids.to(DEVICE), num_experts, bs, sorted_ids, expert_ids, post, cumsum,
        pad_sorted_token_ids,
    )  # fmt: skip
    want = ref_align(ids, num_experts, bs, sorted_ids.numel(), expert_ids.numel())
    for got, w in zip((sorted_ids, expert_ids, post), want):
        assert torch.equal(got.cpu(), w.int())
    assert torch.all(cumsum == -7)  # SGLang's scratch: not part of the result
    if filtered and int((ids == -1).sum()):
        assert int(expert_ids[0]) == -1  # the filtered routes' blocks come first


def test_moe_align_block_size_rejections():
    ids = torch.zeros(4, 2, dtype=torch.int32, device=DEVICE)
    sorted_ids, expert_ids, post, cumsum = sglang_buffers(8, 9, 4)
    with pytest.raises(ValueError, match="cumsum_buffer"):
        sglang.moe_align_block_size(ids, 9, 4, sorted_ids, expert_ids, post, cumsum[:9])
    with pytest.raises(ValueError, match="sorted_token_ids"):
        sglang.moe_align_block_size(ids, 9, 4, sorted_ids[:-1], expert_ids, post, cumsum)
    with pytest.raises(TypeError, match="topk_ids"):
        sglang.moe_align_block_size(ids.float(), 9, 4, sorted_ids, expert_ids, post, cumsum)


def test_example_layers_match_dense_reference(monkeypatch):
    """examples/serving_compat.py: the vLLM-style, SGLang-style and EP-shard layers on the compat
    modules equal a dense fp32 reference."""
    example = runpy.run_path(str(Path(__file__).parents[1] / "examples" / "serving_compat.py"))
    monkeypatch.setattr(sys, "argv", ["serving_compat.py", "--device", str(DEVICE)])
    assert example["main"]() == 0
