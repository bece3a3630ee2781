"""Serving MoE layer: routing share (biased_topk + moe_align_block_size) of the layer time per
batch bucket, eager vs graph, amdqb's kernels (the dispatcher's choice) vs the torch backend (eager
only: its oracles size outputs from device values, which graph capture forbids).

Layer = amdqb.serving.moe_forward (Kimi-K3 TP8 shape by default: E=896, k=16, hidden 7168,
expert width 384, bf16). One row per (batch, backend, part, mode): ``part`` is ``route`` or
``layer``, ``mode`` ``eager`` or ``graph``; route rows carry ``route_%``, their share of the layer
in the same mode.
"""

from __future__ import annotations

import dataclasses

import torch

from amdqb import biased_topk, dispatch, moe_align_block_size, serving

from .common import Progress, Report, TimingConfig, environment, time_alternating


def run(
    device,
    cfg: TimingConfig,
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
    config: str = "kimi",
    num_experts=None,
    topk=None,
) -> list[Report]:
    moe = serving.KIMI_K3_TP8 if config == "kimi" else serving.SMALL
    changes = {k: v for k, v in (("num_experts", num_experts), ("topk", topk)) if v is not None}
    moe = dataclasses.replace(moe, **changes)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    weights = serving.init_weights(moe, device, dtype)
    shape = dict(E=moe.num_experts, k=moe.topk, hidden=moe.hidden, intermediate=moe.intermediate)
    shape.update(block=moe.block_size, dtype=str(dtype).replace("torch.", ""))
    report = Report("serving_moe", environment(device), shape=shape)
    g = torch.Generator().manual_seed(0)
    progress = Progress(len(buckets), "serving")
    chosen = dispatch.select("biased_topk", device).backend
    for m in buckets:
        x = torch.randn(m, moe.hidden, generator=g).to(device, dtype)
        logits = x @ weights["router"]
        for label, backend in ((chosen, None), ("torch", "torch")):
            if backend is None and chosen == "torch":
                continue  # the dispatcher's choice is the torch backend: one set of rows

            def routing(b=backend):
                _, ids = biased_topk(logits, moe.topk, weights["expert_bias"], backend=b)
                return moe_align_block_size(
                    ids, moe.block_size, moe.num_experts, pad_sorted_ids=True, backend=b
                )

            def layer(b=backend):
                return serving.moe_forward(x, weights, moe, backend=b)

            impls = {"route": routing, "layer": layer}
            modes = {"eager": time_alternating(impls, device, cfg, graphs=False)}
            # the torch oracles size outputs on the host: not capturable; the CPU has no graphs
            if label != "torch" and device.type == "cuda":
                modes["graph"] = time_alternating(impls, device, cfg, graphs=True)
            for mode, times in modes.items():
                for part in ("route", "layer"):
                    row = dict(M=m, E=moe.num_experts, k=moe.topk, backend=label)
                    row.update(part=part, mode=mode, us=times[part])
                    if part == "route":
                        row["route_%"] = 100 * times["route"] / times["layer"]
                    report.add(**row)
        progress.step(f"M={m}")
    return [report]
