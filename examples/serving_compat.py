"""A vLLM-style and an SGLang-style MoE layer with amdqb swapped in by import.

    python examples/serving_compat.py            # tiny config, CPU or GPU

The two layers below are written against the peers' own routing and alignment entry points; the
only amdqb-specific lines are the imports::

    # vLLM:   from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import grouped_topk
    #         from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size
    from amdqb.compat import vllm
    # SGLang: from sglang.srt.layers.moe.topk import biased_grouped_topk
    #         from sgl_kernel import moe_align_block_size
    from amdqb.compat import sglang

Both run DeepSeek-style routing (sigmoid scores, a correction bias for the selection, grouped
top-k, a routed scaling factor), align the routes to expert blocks and run the experts block by
block; the SGLang layer also runs an expert-parallel shard, whose dispatcher marks the routes to
other ranks' experts -1 (SGLang aligns them into expert -1 blocks, which the expert GEMM skips).
Each is checked against a dense fp32 reference: every token through its k experts.
"""

from __future__ import annotations

import argparse

import torch

from amdqb.compat import sglang, vllm

E, K, HIDDEN, WIDTH, BLOCK = 16, 4, 64, 32, 8
GROUPS, TOPK_GROUP, SCALE = 4, 3, 2.5  # topk_group does not divide K


def init(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    weights = {
        "router": torch.randn(HIDDEN, E, generator=g) * HIDDEN**-0.5,
        "bias": torch.rand(E, generator=g) * 0.1,  # e_score_correction_bias
        "w13": torch.randn(E, HIDDEN, 2 * WIDTH, generator=g) * HIDDEN**-0.5,
        "w2": torch.randn(E, WIDTH, HIDDEN, generator=g) * WIDTH**-0.5,
    }
    return {name: value.to(device) for name, value in weights.items()}


def swiglu(h):
    gate, up = h.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def experts_by_block(x, weights, topk_weights, sorted_ids, expert_ids, num_post_pad):
    """The expert GEMMs over the aligned blocks (what vLLM's / SGLang's fused MoE kernel does):
    block j holds routes of expert ``expert_ids[j]``; sentinel rows, blocks past the padded total
    and expert -1 blocks contribute nothing. Returns the weighted sum per token."""
    m, numel = x.shape[0], topk_weights.numel()
    blocks = expert_ids.numel()
    rows = torch.full((blocks * BLOCK,), numel, dtype=torch.long, device=x.device)
    n = min(rows.numel(), sorted_ids.numel())
    rows[:n] = sorted_ids[:n].long()
    live = torch.arange(blocks, device=x.device) * BLOCK < num_post_pad
    live &= expert_ids >= 0
    rows = torch.where(live.repeat_interleave(BLOCK), rows, numel).view(blocks, BLOCK)
    eid = expert_ids.clamp(min=0).long()
    x_pad = torch.cat([x, x.new_zeros(1, x.shape[1])])  # the sentinel row reads zeros
    a = x_pad[rows.clamp(max=numel) // K]  # [blocks, BLOCK, HIDDEN]
    y = torch.bmm(swiglu(torch.bmm(a, weights["w13"][eid])), weights["w2"][eid])
    w = torch.cat([topk_weights.reshape(-1), topk_weights.new_zeros(1)])[rows]
    out = torch.zeros(m + 1, x.shape[1], device=x.device)
    out.index_add_(0, (rows // K).clamp(max=m).view(-1), (y * w[..., None]).view(-1, x.shape[1]))
    return out[:m]


def vllm_layer(x, weights):
    logits = x @ weights["router"]
    topk_weights, topk_ids = vllm.grouped_topk(
        x, logits, K, True, GROUPS, TOPK_GROUP, "sigmoid", SCALE, weights["bias"]
    )
    sorted_ids, expert_ids, num_post_pad = vllm.moe_align_block_size(
        topk_ids, BLOCK, E, pad_sorted_ids=True
    )
    return experts_by_block(x, weights, topk_weights, sorted_ids, expert_ids, num_post_pad)


def sglang_layer(x, weights, local_experts=None):
    """SGLang-style: ``biased_grouped_topk``, then ``moe_align_block_size`` into buffers sized the
    way SGLang's wrapper sizes them (``num_experts + 1`` slots for the EP -1 routes)."""
    logits = x @ weights["router"]
    topk_weights, topk_ids = sglang.biased_grouped_topk(
        x, logits, weights["bias"], K, True, GROUPS, TOPK_GROUP, 0, SCALE,
        apply_routed_scaling_factor_on_output=True,
    )  # fmt: skip
    if local_experts is not None:  # an EP dispatcher: routes to other ranks' experts become -1
        topk_ids = torch.where(local_experts[topk_ids.long()], topk_ids, -1)
    numel, slots = topk_ids.numel(), E + 1
    rows = numel * BLOCK if numel < slots else numel + slots * (BLOCK - 1)
    blocks = -(-rows // BLOCK)
    dev = x.device
    sorted_ids = torch.empty(rows, dtype=torch.int32, device=dev)
    expert_ids = torch.zeros(blocks, dtype=torch.int32, device=dev)
    num_post_pad = torch.empty(1, dtype=torch.int32, device=dev)
    cumsum = torch.empty(slots + 1, dtype=torch.int32, device=dev)
    sglang.moe_align_block_size(
        topk_ids, slots, BLOCK, sorted_ids, expert_ids, num_post_pad, cumsum, True
    )
    return experts_by_block(x, weights, topk_weights, sorted_ids, expert_ids, num_post_pad)


def dense_reference(x, weights, local_experts=None):
    """fp32, no alignment: DeepSeek's routing in plain PyTorch, every token through its experts."""
    s = torch.sigmoid((x @ weights["router"]).float())
    choice = s + weights["bias"]
    per = choice.view(-1, GROUPS, E // GROUPS).topk(2, -1).values.sum(-1)
    keep = torch.zeros_like(per, dtype=torch.bool).scatter(1, per.topk(TOPK_GROUP, -1)[1], True)
    choice = choice.masked_fill(~keep.repeat_interleave(E // GROUPS, 1), float("-inf"))
    ids = choice.topk(K, -1).indices
    w = s.gather(1, ids)
    w = w / w.sum(-1, keepdim=True) * SCALE
    out = torch.zeros_like(x)
    for j in range(K):
        e = ids[:, j]
        y = torch.bmm(swiglu(torch.bmm(x[:, None], weights["w13"][e])), weights["w2"][e])[:, 0]
        if local_experts is not None:
            y = y * local_experts[e][:, None]
        out += w[:, j : j + 1] * y
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=37)
    args = parser.parse_args()
    device = torch.device(args.device)
    weights = init(device)
    x = torch.randn(args.tokens, HIDDEN, generator=torch.Generator().manual_seed(1)).to(device)
    local = torch.arange(E, device=device) % 2 == 0  # this rank holds the even experts
    worst = 0.0
    for name, got, want in (
        ("vLLM-style layer (amdqb.compat.vllm)", vllm_layer(x, weights), None),
        ("SGLang-style layer (amdqb.compat.sglang)", sglang_layer(x, weights), None),
        ("SGLang-style EP shard, -1 routes", sglang_layer(x, weights, local), local),
    ):
        ref = dense_reference(x, weights, want)
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        worst = max(worst, err)
        print(f"{name:42s} vs dense fp32 reference: max rel error {err:.1e}")
    decode = x[:1]  # one token, 4 routes < 16 experts: vLLM's decode buffer, 4 blocks of rows
    _, ids = vllm.grouped_topk(
        decode, decode @ weights["router"], K, True, GROUPS, TOPK_GROUP, "sigmoid", SCALE,
        weights["bias"],
    )  # fmt: skip
    sorted_ids, expert_ids, _ = vllm.moe_align_block_size(ids, BLOCK, E)
    print(f"decode align buffers: {sorted_ids.numel()} rows, {expert_ids.numel()} blocks")
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
