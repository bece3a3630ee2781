"""Chunk sort/pad + unpad/restore round trip vs torch split + cat + pad (the shapes of docs/targets.md).

hidden 2048 bf16, 8 ranks x 16 experts = 128 rank-major chunks, sorted expert-major with each
expert padded to a multiple of 128 on its last rank chunk; N in {8192, 32768} dispatched tokens.
Rows: ``backend`` (amdqb's: ``impl="fused"``; the baseline: ``backend="torch"``,
``impl="split_cat"``). Reports µs, GB/s of the round trip (bytes read + written by both copies), % of the measured device
copy bandwidth, and the extra peak memory over the inputs.
"""

from __future__ import annotations

import torch

import amdqb
from amdqb import ref

from .common import (
    Progress,
    Report,
    TimingConfig,
    backends_for,
    copy_bandwidth,
    environment,
    time_alternating,
)


def make_layout(n, ranks, experts, align, g):
    chunks = ranks * experts
    cuts = torch.sort(torch.randint(0, n + 1, (chunks - 1,), generator=g)).values
    sizes = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([n])]))
    order = torch.tensor([r * experts + e for e in range(experts) for r in range(ranks)])
    out_sizes = sizes[order].clone()
    for e in range(experts):
        block = out_sizes[e * ranks : (e + 1) * ranks]
        total = int(block.sum())
        block[-1] += -(-total // align) * align - total
    return sizes, order, out_sizes, int(out_sizes.sum())


def torch_split_cat(inp, probs, sizes_list, order_list, out_sizes_list, num_out):
    """The unfused baseline: split, reorder with cat, pad each chunk with zeros."""
    pieces = torch.split(inp, sizes_list)
    p_pieces = torch.split(probs, sizes_list)
    out, out_p = [], []
    for i, src in enumerate(order_list):
        pad = out_sizes_list[i] - sizes_list[src]
        out.append(pieces[src])
        out_p.append(p_pieces[src])
        if pad:
            out.append(inp.new_zeros(pad, inp.shape[1]))
            out_p.append(probs.new_zeros(pad))
    return torch.cat(out), torch.cat(out_p)


def torch_restore(padded, sizes_list, order_list, out_sizes_list):
    pieces = torch.split(padded, out_sizes_list)
    restored = [None] * len(order_list)
    for i, src in enumerate(order_list):
        restored[src] = pieces[i][: sizes_list[src]]
    return torch.cat(restored)


def run(
    device,
    cfg: TimingConfig,
    tokens=(8192, 32768),
    hidden=2048,
    ranks=8,
    experts=16,
    align=128,
    dtype=torch.bfloat16,
) -> list[Report]:
    env = environment(device)
    bw, copy_us = copy_bandwidth(device, cfg=cfg) if device.type == "cuda" else (float("nan"), 0)
    env["copy_GBps"] = bw
    shape = dict(H=hidden, dtype=str(dtype).replace("torch.", ""), chunks=ranks * experts)
    shape.update(ranks=ranks, experts=experts, align=align)
    report = Report("chunks", env, shape=shape)
    g = torch.Generator().manual_seed(0)
    progress = Progress(len(tokens), "chunks")
    backends = backends_for("chunk_copy", device, ("hip", "triton", "torch"))
    for n in tokens:
        sizes, order, out_sizes, num_out = make_layout(n, ranks, experts, align, g)
        inp = torch.randn(n, hidden, generator=g).to(device, dtype)
        probs = torch.rand(n, generator=g).to(device)
        meta = [t.to(device) for t in (sizes, order, out_sizes)]
        lists = (sizes.tolist(), order.tolist(), out_sizes.tolist())
        want, want_p, row_map = ref.moe_sort_chunks_and_pad(inp, *meta, num_out, probs)
        impls, peak = {}, {}
        for name in backends:
            out, out_p, rmap = amdqb.moe_sort_chunks_and_pad(
                inp, *meta, num_out, probs, backend=name
            )
            back = amdqb.moe_unpad_and_restore_chunks(out, rmap, n, backend=name)
            if not (torch.equal(out, want) and torch.equal(out_p, want_p)):
                raise AssertionError(f"{name}: sort/pad differs from the oracle")
            if not torch.equal(back, inp):
                raise AssertionError(f"{name}: round trip does not restore the input")

            def roundtrip(n_=name):
                o, _, m_ = amdqb.moe_sort_chunks_and_pad(inp, *meta, num_out, probs, backend=n_)
                return amdqb.moe_unpad_and_restore_chunks(o, m_, n, backend=n_)

            impls[name] = roundtrip
        base_out, base_p = torch_split_cat(inp, probs, *lists, num_out)
        if not (torch.equal(base_out, want) and torch.equal(base_p, want_p)):
            raise AssertionError("the torch split/cat baseline disagrees with the oracle")
        impls["baseline"] = lambda: torch_restore(
            torch_split_cat(inp, probs, *lists, num_out)[0], *lists[:2], lists[2]
        )
        if device.type == "cuda":
            for name, fn in impls.items():
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                fn()
                torch.cuda.synchronize()
                peak[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
        # the torch backend and the split/cat baseline size or index by device values: eager
        eager = {n: impls.pop(n) for n in ("torch", "baseline") if n in impls}
        times = time_alternating(impls, device, cfg)
        times.update(time_alternating(eager, device, cfg, graphs=False))
        elt = inp.element_size()
        nbytes = 2 * (n + num_out) * hidden * elt  # forward r+w, restore r+w
        outputs_mib = (num_out * hidden * elt + num_out * 4 * 2 + n * hidden * elt) / 2**20
        for name, us in times.items():
            gbps = nbytes / (us * 1e-6) / 1e9
            backend, impl = ("torch", "split_cat") if name == "baseline" else (name, "fused")
            report.add(
                N=n,
                H=hidden,
                dtype=str(dtype).replace("torch.", ""),
                backend=backend,
                impl=impl,
                us=us,
                **({"GB/s": gbps} | ({"%copy": 100 * gbps / bw} if bw == bw else {})),
                **({"peak_extra_MiB": peak[name]} if name in peak else {}),
                outputs_MiB=outputs_mib,
            )
        progress.step(f"N={n}")
    return [report]
