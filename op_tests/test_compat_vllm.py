"""amdqb.compat.vllm against vLLM's documented semantics.

The references below are plain-PyTorch statements of vLLM's math (its ``fused_topk`` /
``fused_topk_bias`` / ``grouped_topk`` routers and ``moe_align_block_size``'s layout), evaluated
in fp32 -- amdqb's precision contract. Runs on the oracle backend and every kernel backend of the
op (on the CPU Triton runs under the interpreter).
"""

import inspect

import pytest
import torch

from amdqb.compat import vllm

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


# ----------------------------------------------------------------------------------------------
# references (vLLM's semantics in fp32)
# ----------------------------------------------------------------------------------------------
def scores_of(logits, scoring_func):
    z = logits.float()
    if scoring_func == "softmax":
        return torch.softmax(z, dim=-1)
    if scoring_func == "sigmoid":
        return torch.sigmoid(z)
    return torch.sqrt(torch.nn.functional.softplus(z))


def ref_route(
    logits, topk, renormalize, scoring_func, bias=None, groups=None, topk_group=None, scale=1.0
):
    """vLLM: select on ``scores + bias``; groups ranked by their max score, or with a bias by
    the sum of their two best biased scores; weights the unbiased scores, renormalized, scaled."""
    s = scores_of(logits, scoring_func)
    choice = s if bias is None else s + bias.float()
    if groups:
        t, e = choice.shape
        per = choice.view(t, groups, e // groups)
        best = torch.sort(per, dim=-1, descending=True).values
        gscore = best[..., 0] if bias is None else best[..., :2].sum(-1)
        keep = top(gscore, topk_group)
        mask = torch.zeros(t, groups, dtype=torch.bool, device=s.device).scatter(1, keep, True)
        choice = choice.masked_fill(~mask.repeat_interleave(e // groups, 1), float("-inf"))
    ids = top(choice, topk)
    w = s.gather(1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w * scale, ids.to(torch.int32)


# ----------------------------------------------------------------------------------------------
# names and signatures
# ----------------------------------------------------------------------------------------------
VLLM_SIGNATURES = {
    "fused_topk": [
        "hidden_states", "gating_output", "topk", "renormalize", "indices_type", "scoring_func",
    ],
    "fused_topk_bias": [
        "hidden_states", "gating_output", "scoring_func", "e_score_correction_bias", "topk",
        "renormalize", "indices_type", "input_tokens", "hash_indices_table",
        "routed_scaling_factor",
    ],
    "grouped_topk": [
        "hidden_states", "gating_output", "topk", "renormalize", "num_expert_group", "topk_group",
        "scoring_func", "routed_scaling_factor", "e_score_correction_bias",
    ],
    "moe_align_block_size": [
        "topk_ids", "block_size", "num_experts", "expert_map", "pad_sorted_ids",
        "ignore_invalid_experts",
    ],
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(VLLM_SIGNATURES))
def test_signatures_are_vllm_positional_order(name):
    assert list(inspect.signature(getattr(vllm, name)).parameters) == VLLM_SIGNATURES[name]


def test_custom_ops_signature():
    params = inspect.signature(vllm._custom_ops.moe_align_block_size).parameters
    assert list(params) == [
        "topk_ids", "num_experts", "block_size", "sorted_token_ids", "experts_ids",
        "num_tokens_post_pad", "expert_map",
    ]  # fmt: skip
    assert params["expert_map"].default is None


# ----------------------------------------------------------------------------------------------
# fused_topk / fused_topk_bias
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("t,e,k", [(1, 6, 3), (33, 16, 4), (8, 64, 6)])
def test_fused_topk(backend, t, e, k, renormalize, scoring_func, dtype):
    logits = logits_for(t, e, seed=t * e + k, dtype=dtype)
    hidden = torch.empty(t, 8, device=DEVICE)
    w, ids, token_expert = vllm.fused_topk(hidden, logits, k, renormalize, None, scoring_func)
    check_route((w, ids), ref_route(logits, k, renormalize, scoring_func))
    # vLLM's source-row index: slot j of token t is row j * M + t of the expanded routes
    want = torch.arange(k)[None, :] * t + torch.arange(t)[:, None]
    assert token_expert.dtype == torch.int32 and torch.equal(token_expert.cpu(), want.int())


def test_fused_topk_indices_type_and_errors(backend):
    logits = logits_for(4, 8, seed=1)
    _, ids, _ = vllm.fused_topk(logits, logits, 2, True, indices_type=torch.int64)
    assert ids.dtype == torch.int64
    with pytest.raises(ValueError, match="Unsupported scoring function"):
        vllm.fused_topk(logits, logits, 2, True, scoring_func="sqrtsoftplus")
    with pytest.raises(ValueError, match="Number of tokens mismatch"):
        vllm.fused_topk(logits[:3], logits, 2, True)


@pytest.mark.parametrize("scale", [1.0, 2.5])
@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("t,e,k", [(1, 6, 3), (33, 16, 4)])
def test_fused_topk_bias(backend, t, e, k, renormalize, scoring_func, scale):
    """The correction bias moves the selection only -- for softmax scores too (DeepSeek-style
    routers with a softmax gate)."""
    logits = logits_for(t, e, seed=t + e)
    bias = torch.randn(e, generator=torch.Generator().manual_seed(e)).to(DEVICE) * 0.3
    got = vllm.fused_topk_bias(
        logits, logits, scoring_func, bias, k, renormalize, routed_scaling_factor=scale
    )
    check_route(got, ref_route(logits, k, renormalize, scoring_func, bias, scale=scale))
    unbiased = ref_route(logits, k, renormalize, scoring_func, scale=scale)
    if t > 1:  # the bias is large enough to change some selection
        assert not torch.equal(got[1].cpu(), unbiased[1].cpu())


def test_fused_topk_bias_keywords_none_bias_and_half_bias(backend):
    logits = logits_for(9, 16, seed=3)
    got = vllm.fused_topk_bias(
        hidden_states=logits,
        gating_output=logits,
        scoring_func="softmax",
        e_score_correction_bias=None,
        topk=4,
        renormalize=False,
    )
    check_route(got, ref_route(logits, 4, False, "softmax"))
    bias = (torch.randn(16, generator=torch.Generator().manual_seed(2)) * 0.3).bfloat16()
    got = vllm.fused_topk_bias(logits, logits, "sigmoid", bias.to(DEVICE), 4, True)
    check_route(got, ref_route(logits, 4, True, "sigmoid", bias.float().to(DEVICE)))


def test_fused_topk_bias_hash_routing():
    """Hash MoE: the ids are a table lookup of the input tokens; the weights the scores there."""
    e, k, vocab = 8, 3, 20
    g = torch.Generator().manual_seed(5)
    table = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(vocab)]).to(DEVICE)
    tokens = torch.randint(0, vocab, (6,), generator=g).to(DEVICE)
    logits = logits_for(6, e, seed=6)
    w, ids = vllm.fused_topk_bias(
        logits, logits, "sqrtsoftplus", None, k, True, None, tokens, table, 1.5
    )
    assert torch.equal(ids.cpu(), table[tokens].int().cpu())
    s = scores_of(logits, "sqrtsoftplus").gather(1, ids.long())
    torch.testing.assert_close(w, s / s.sum(-1, keepdim=True) * 1.5)


# ----------------------------------------------------------------------------------------------
# grouped_topk
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize(
    "e,groups,topk_group,k",
    [(16, 4, 2, 4), (16, 4, 3, 5), (32, 8, 3, 8), (64, 8, 4, 6), (12, 3, 2, 7)],
)  # (16, 4, 3, 5), (32, 8, 3, 8), (12, 3, 2, 7): topk_group does not divide topk
@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_grouped_topk(backend, e, groups, topk_group, k, biased, scoring_func, scale):
    t = 17
    logits = logits_for(t, e, seed=e * groups + k)
    bias = None
    if biased:
        bias = torch.randn(e, generator=torch.Generator().manual_seed(k)).to(DEVICE) * 0.2
    got = vllm.grouped_topk(logits, logits, k, True, groups, topk_group, scoring_func, scale, bias)
    check_route(got, ref_route(logits, k, True, scoring_func, bias, groups, topk_group, scale))
    chosen_groups = (got[1].long() // (e // groups)).cpu()
    assert all(len(set(row.tolist())) <= topk_group for row in chosen_groups)


def test_grouped_topk_best_two_rule_differs_from_best_one(backend):
    """With a bias a group's score is its two best biased scores: a group holding one strong
    expert loses to a group of two good ones (vLLM / SGLang), where the best-one rule keeps it."""
    e, groups = 8, 4
    s = torch.tensor([[0.9, -5, 0.6, 0.55, -5, -5, -5, -5]])  # group 0: one strong; group 1: two
    logits = torch.logit(torch.sigmoid(s)).to(DEVICE)
    bias = torch.zeros(e, device=DEVICE)
    _, ids = vllm.grouped_topk(logits, logits, 1, False, groups, 1, "sigmoid", 1.0, bias)
    assert ids.tolist() == [[2]]  # group 1 (0.6 + 0.55) beats group 0 (0.9 + sigmoid(-5))
    _, ids = vllm.grouped_topk(logits, logits, 1, False, groups, 1, "sigmoid", 1.0, None)
    assert ids.tolist() == [[0]]  # without a bias: the group with the best single score


@pytest.mark.parametrize("num_expert_group", [0, 1])
def test_grouped_topk_one_group_is_plain_topk(backend, num_expert_group):
    logits = logits_for(5, 16, seed=7)
    got = vllm.grouped_topk(logits, logits, 4, True, num_expert_group, num_expert_group)
    check_route(got, ref_route(logits, 4, True, "softmax"))


# ----------------------------------------------------------------------------------------------
# moe_align_block_size (functional and _custom_ops forms)
# ----------------------------------------------------------------------------------------------
def ref_align(
    topk_ids, bs, e, expert_map=None, ignore_invalid=False, pad=False, rows=None, inactive=-1
):
    """vLLM's layout: routes grouped by expert in ascending expert order (by local id when the
    map filters), each expert padded to whole blocks, sentinel ``numel``, block expert ids,
    ``inactive`` past the padded total; without filtering every block id is then mapped through
    the map (``expert_map[expert_ids]``, Python / PyTorch indexing)."""
    flat = topk_ids.reshape(-1).tolist()
    numel = len(flat)
    if rows is None:
        rows = numel + e * (bs - 1)
        if pad:
            rows = -(-rows // bs) * bs
        if numel < e:
            rows = min(rows, numel * bs)
    emap = None if expert_map is None else expert_map.tolist()
    buckets = {}
    for i, x in enumerate(flat):
        if not 0 <= x < e:
            continue  # raw ids outside [0, E) are skipped in every mode
        key = x
        if emap is not None and ignore_invalid:
            key = emap[x]
            if key < 0:
                continue
        buckets.setdefault(key, []).append(i)
    sorted_ids = [numel] * rows
    expert_ids = [inactive] * (-(-rows // bs))
    pos = 0
    for key in sorted(buckets):
        routes = buckets[key]
        blocks = -(-len(routes) // bs)
        sorted_ids[pos : pos + len(routes)] = routes
        for b in range(blocks):
            expert_ids[pos // bs + b] = key
        pos += blocks * bs
    if emap is not None and not ignore_invalid:
        expert_ids = [emap[x] for x in expert_ids]
    return torch.tensor(sorted_ids), torch.tensor(expert_ids), torch.tensor([pos])


def check_align(got, want):
    for g, w in zip(got, want):
        assert g.dtype == torch.int32
        assert torch.equal(g.cpu(), w.int()), (g.cpu().tolist(), w.tolist())


def even_map(e):
    emap = torch.full((e,), -1, dtype=torch.int32)
    emap[0::2] = torch.arange(len(range(0, e, 2)), dtype=torch.int32)
    return emap


def random_ids(m, k, e, seed, invalid=False, dtype=torch.int32):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)])
    if invalid:  # -1 (EP padding), -2, E and E + 7 are no experts
        flat = ids.view(-1)
        flat[0::5] = -1
        flat[3::11] = -2
        flat[1::7] = e
        flat[2::13] = e + 7
    return ids.to(dtype)


def test_align_docstring_example(align_backend):
    ids = torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]], dtype=torch.int32)
    got = vllm.moe_align_block_size(ids.to(DEVICE), 4, 5)
    assert got[0][:16].tolist() == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
    check_align(got, ref_align(ids, 4, 5))
    assert got[1].tolist()[4:] == [-1] * 3  # vLLM marks the unused blocks -1


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize(
    "m,k,e", [(1, 1, 32), (1, 16, 256), (3, 2, 160), (3, 32, 257), (20, 8, 64)]
)
def test_align_sizes_and_layout(align_backend, m, k, e, block_size, pad):
    ids = random_ids(m, k, e, seed=m * k + e)
    got = vllm.moe_align_block_size(ids.to(DEVICE), block_size, e, pad_sorted_ids=pad)
    want = ref_align(ids, block_size, e, pad=pad)
    assert got[0].numel() == want[0].numel() and got[1].numel() == want[1].numel()
    if m * k < e:
        assert got[0].numel() == m * k * block_size  # the decode rule
    check_align(got, want)
    assert int(got[2]) % block_size == 0


@pytest.mark.parametrize("ignore_invalid", [False, True])
@pytest.mark.parametrize("m,k,e,bs", [(16, 2, 8, 64), (16, 2, 64, 64), (32, 4, 64, 16)])
def test_align_expert_map(align_backend, m, k, e, bs, ignore_invalid):
    """EP: with ignore_invalid_experts the remote experts' routes are skipped and the blocks hold
    local ids (no -1 among the used blocks); without, every route is aligned and the remote
    experts' blocks map to -1. (16, 2, 64): fewer routes than experts, the decode buffer size."""
    ids = random_ids(m, k, e, seed=e + bs)
    emap = even_map(e)
    got = vllm.moe_align_block_size(ids.to(DEVICE), bs, e, emap.to(DEVICE), False, ignore_invalid)
    want = ref_align(ids, bs, e, emap, ignore_invalid)
    check_align(got, want)
    used = got[1][: int(got[2]) // bs]
    assert bool((used >= 0).all()) == ignore_invalid


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("mode", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("m,k,e,bs", [(8, 4, 8, 4), (300, 4, 8, 16), (8, 4, 80, 8)])
def test_align_skips_raw_invalid_ids(align_backend, m, k, e, bs, mode, dtype):
    use_map, ignore_invalid = mode
    ids = random_ids(m, k, e, seed=m + e, invalid=True, dtype=torch.int64).to(dtype)
    emap = even_map(e) if use_map else None
    got = vllm.moe_align_block_size(
        ids.to(DEVICE), bs, e, None if emap is None else emap.to(DEVICE), False, ignore_invalid
    )
    check_align(got, ref_align(ids, bs, e, emap, ignore_invalid))


def test_align_all_invalid(align_backend):
    ids = torch.tensor([[-1, 8, 15], [-1, -1, 8]], dtype=torch.int32, device=DEVICE)
    sorted_ids, expert_ids, post = vllm.moe_align_block_size(ids, 4, 8)
    assert post.tolist() == [0] and torch.all(sorted_ids == 6) and torch.all(expert_ids == -1)


def test_align_is_deterministic(align_backend):
    ids = torch.randint(0, 32, (128, 2), generator=torch.Generator().manual_seed(42))
    ids = ids.to(torch.int32).to(DEVICE)
    first = vllm.moe_align_block_size(ids, 64, 32)
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(first, vllm.moe_align_block_size(ids, 64, 32)))


@pytest.mark.parametrize("with_map", [False, True])
@pytest.mark.parametrize("m,k,e,bs", [(3, 4, 64, 16), (40, 2, 16, 8)])
def test_custom_ops_align_into_caller_buffers(align_backend, m, k, e, bs, with_map):
    """The preallocated form fills the caller's buffers (vLLM's sizes), the expert map filtering
    remote experts; experts_ids past ceil(len(sorted_token_ids) / block_size) is not touched."""
    ids = random_ids(m, k, e, seed=m + k + e, invalid=True)
    rows = vllm_rows = m * k + e * (bs - 1)
    if m * k < e:
        rows = vllm_rows = min(vllm_rows, m * k * bs)
    blocks = -(-rows // bs)
    sorted_ids = torch.full((rows,), -7, dtype=torch.int32, device=DEVICE)
    expert_ids = torch.full((blocks + 3,), -7, dtype=torch.int32, device=DEVICE)
    post = torch.full((1,), -7, dtype=torch.int32, device=DEVICE)
    emap = even_map(e) if with_map else None
    vllm._custom_ops.moe_align_block_size(
        ids.to(DEVICE),
        e,
        bs,
        sorted_ids,
        expert_ids,
        post,
        None if emap is None else emap.to(DEVICE),
    )
    want = ref_align(ids, bs, e, emap, ignore_invalid=True, rows=vllm_rows)
    check_align((sorted_ids, expert_ids[:blocks], post), want)
    assert expert_ids[blocks:].tolist() == [-7] * 3


def test_custom_ops_align_rejects_short_buffers():
    ids = torch.zeros(8, 2, dtype=torch.int32, device=DEVICE)  # 16 routes, 32 experts
    post = torch.empty(1, dtype=torch.int32, device=DEVICE)
    short = torch.empty(16 * 4 - 1, dtype=torch.int32, device=DEVICE)
    blocks = torch.empty(16, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="sorted_token_ids"):
        vllm._custom_ops.moe_align_block_size(ids, 32, 4, short, blocks, post)
    with pytest.raises(TypeError, match="experts_ids"):
        vllm._custom_ops.moe_align_block_size(ids, 32, 4, short, blocks.float(), post)


@pytest.mark.parametrize("inactive", [-1, 0])
@pytest.mark.parametrize("map_mode", [None, "keep", "ignore"])
def test_align_inactive_expert_id(align_backend, monkeypatch, inactive, map_mode):
    """Blocks past the padded total: -1 (vLLM since PR #35161) or 0 (before), set by
    INACTIVE_EXPERT_ID; with an unfiltering map the tail goes through expert_map as in vLLM."""
    monkeypatch.setattr(vllm, "INACTIVE_EXPERT_ID", inactive)
    e, bs = 16, 4
    ids = random_ids(6, 2, e, seed=inactive + 3)
    emap = None if map_mode is None else even_map(e)
    ignore = map_mode == "ignore"
    got = vllm.moe_align_block_size(
        ids.to(DEVICE), bs, e, None if emap is None else emap.to(DEVICE), True, ignore
    )
    check_align(got, ref_align(ids, bs, e, emap, ignore, pad=True, inactive=inactive))
    rows = got[0].numel()
    sorted_ids = torch.empty(rows, dtype=torch.int32, device=DEVICE)
    blocks = torch.empty(-(-rows // bs), dtype=torch.int32, device=DEVICE)
    post = torch.empty(1, dtype=torch.int32, device=DEVICE)
    vllm._custom_ops.moe_align_block_size(
        ids.to(DEVICE), e, bs, sorted_ids, blocks, post, None if emap is None else emap.to(DEVICE)
    )
    want = ref_align(ids, bs, e, emap, True, rows=rows, inactive=inactive)
    check_align((sorted_ids, blocks, post), want)
