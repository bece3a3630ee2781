"""Serving MoE layer: routing share (biased_topk + moe_align_block_size) of the layer time per
batch bucket, eager vs graph, amdqb's kernels (the dispatcher's choice) vs the torch backend (eager
only: its oracles size outputs from device values, which graph capture forbids). The route share is
taken from graph replays for amdqb and from eager calls for torch.

Layer = amdqb.serving.moe_forward (Kimi-K3 TP8 shape by default: E=896, k=16, hidden 7168,
expert width 384, bf16).
"""

from __future__ import annotations

import torch

from amdqb import biased_topk, moe_align_block_size, serving

from .common import Progress, Report, TimingConfig, environment, time_alternating


def run(
    device, cfg: TimingConfig, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), config: str = "kimi"
) -> list[Report]:
    moe = serving.KIMI_K3_TP8 if config == "kimi" else serving.SMALL
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    weights = serving.init_weights(moe, device, dtype)
    report = Report("serving_moe", environment(device))
    g = torch.Generator().manual_seed(0)
    progress = Progress(len(buckets), "serving")
    for m in buckets:
        x = torch.randn(m, moe.hidden, generator=g).to(device, dtype)
        logits = x @ weights["router"]
        row = {"M": m}
        for label, backend in (("amdqb", None), ("torch", "torch")):

            def routing(b=backend):
                _, ids = biased_topk(logits, moe.topk, weights["expert_bias"], backend=b)
                return moe_align_block_size(
                    ids, moe.block_size, moe.num_experts, pad_sorted_ids=True, backend=b
                )

            def layer(b=backend):
                return serving.moe_forward(x, weights, moe, backend=b)

            impls = {"routing": routing, "layer": layer}
            eager_t = time_alternating(impls, device, cfg, graphs=False)
            row[f"{label}_route_eager_us"] = eager_t["routing"]
            row[f"{label}_layer_eager_us"] = eager_t["layer"]
            if backend == "torch":  # the torch oracles size outputs on the host: not capturable
                row[f"{label}_route_%"] = 100 * eager_t["routing"] / eager_t["layer"]
                continue
            graph_t = time_alternating(impls, device, cfg, graphs=True)
            row[f"{label}_route_graph_us"] = graph_t["routing"]
            row[f"{label}_layer_graph_us"] = graph_t["layer"]
            row[f"{label}_route_%"] = 100 * graph_t["routing"] / graph_t["layer"]
        report.add(**row)
        progress.step(f"M={m}")
    return [report]
