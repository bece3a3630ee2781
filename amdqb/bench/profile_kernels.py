"""Launch each hot kernel once inside a profiler range, for ``ncu --profile-from-start off``.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... \
        python -m amdqb.bench.profile_kernels

Everything is compiled and warmed up before ``cudaProfilerStart`` so that only the timed kernels of
the docs/targets.md shapes are profiled: the QB router (E=896, k=16, T=16384; B=1000 and
log_margin with B=64 in both histogram modes, and no QB) per backend, biased_topk at a decode size,
route rows (atomic / lds, M=8192 uniform) and moe_align_block_size (M=8192); the serving entry
points at the peers' shapes through ``amdqb.compat.vllm`` (softmax top-k E=8 k=2 fp32 and E=128 k=8
bf16, DeepSeek-V3's and Kimi-K2's gates at T=1, align E=256 k=8 block 64 over M tokens).
``AMDQB_PROFILE_K=a,b``: only the cases whose name contains a or b.
"""

from __future__ import annotations

import os

import torch

import amdqb
from amdqb import dispatch
from amdqb.compat import vllm


def _cases(dev):
    g = torch.Generator(device=dev).manual_seed(0)
    e, k, b, t = 896, 16, 1000, 16384
    logits = torch.randn(t, e, device=dev, generator=g)
    bias = 0.01 * torch.randn(e, device=dev, generator=g)
    bounds = torch.tensor([-1.0, 1.0], device=dev)
    amdqb.mark_qb_bin_bounds_validated(bounds)
    hist = torch.zeros(e, b, dtype=torch.int32, device=dev)
    dec = torch.randn(8, e, device=dev, generator=g)
    ids = torch.randint(0, e, (8192, k), device=dev, generator=g, dtype=torch.int32)
    margin_hist = torch.zeros(e, 64, dtype=torch.int32, device=dev)
    margin_bounds = amdqb.ref.qb.margin_scale(bias)
    amdqb.mark_qb_bin_bounds_validated(margin_bounds)
    cases = []
    for be in ("triton", "hip"):
        for margin_mode in ("two_kernel", "fused_atomic"):
            cases.append(
                (
                    f"router {be} log_margin {margin_mode} T={t}",
                    be,
                    "router_fwd",
                    lambda be=be, margin_mode=margin_mode: amdqb.fused_topk_with_score_function(
                        logits,
                        k,
                        expert_bias=bias,
                        qb_histogram=margin_hist,
                        qb_bin_bounds=margin_bounds,
                        qb_histogram_mode=margin_mode,
                        qb_binning="log_margin",
                        backend=be,
                    ),
                )
            )
        for mode in (None, "two_kernel", "fused_atomic"):
            qb = {} if mode is None else dict(qb_histogram=hist, qb_bin_bounds=bounds)
            cases.append(
                (
                    f"router {be} {mode or 'noqb'} T={t}",
                    be,
                    "router_fwd",
                    lambda be=be, mode=mode, qb=qb: amdqb.fused_topk_with_score_function(
                        logits,
                        k,
                        expert_bias=bias,
                        qb_histogram_mode=mode,
                        backend=be,
                        **qb,
                    ),
                )
            )
        cases.append(
            (
                f"biased_topk {be} T=8",
                be,
                "biased_topk",
                lambda be=be: amdqb.biased_topk(dec, k, bias, backend=be),
            )
        )
        for impl in ("atomic", "lds"):
            for cap in (None, 8192 * k):  # compact layout, and the masked one the bench times
                cases.append(
                    (
                        f"route_rows {be} {impl} capacity={cap} M=8192",
                        be,
                        "route_rows",
                        lambda be=be, impl=impl, cap=cap: amdqb.moe_route_rows(
                            ids, e, capacity=cap, impl=impl, backend=be
                        ),
                    )
                )
        cases.append(
            (
                f"align {be} M=8192",
                be,
                "align_block_size",
                lambda be=be: amdqb.moe_align_block_size(ids, 64, e, backend=be),
            )
        )
    return cases + _serving_cases(dev)


def _serving_cases(dev):
    """The compat entry points at the decode and prefill shapes of amdqb.bench.compat (hip)."""
    g = torch.Generator(device=dev).manual_seed(1)
    cases = []
    for e, k, dtype in ((8, 2, torch.float32), (128, 8, torch.bfloat16)):
        for t in (1, 1024, 4096):
            x = torch.randn(t, e, device=dev, generator=g).to(dtype)
            cases.append(
                (
                    f"serving fused_topk E={e} k={k} T={t}",
                    "hip",
                    "biased_topk",
                    lambda x=x, k=k: vllm.fused_topk(x, x, k, True),
                )
            )
    for e, groups in ((256, (8, 4)), (384, (1, 1))):
        x = torch.randn(1, e, device=dev, generator=g)
        b = 0.1 * torch.randn(e, device=dev, generator=g)
        cases.append(
            (
                f"serving grouped_topk E={e} groups={groups[0]} T=1",
                "hip",
                "biased_topk",
                lambda x=x, b=b, gr=groups: vllm.grouped_topk(
                    x, x, 8, True, gr[0], gr[1], "sigmoid", 2.5, b
                ),
            )
        )
    for m in (8, 64, 512, 2048, 8192):
        ids = torch.rand(m, 256, device=dev, generator=g).argsort(dim=1)[:, :8].to(torch.int32)
        cases.append(
            (
                f"serving align E=256 k=8 block 64 M={m}",
                "hip",
                "align_block_size",
                lambda ids=ids: vllm.moe_align_block_size(ids, 64, 256),
            )
        )
    return cases


def main() -> None:
    dev = torch.device("cuda")
    info = dispatch.device_info(dev)
    runnable = []
    only = [w for w in os.environ.get("AMDQB_PROFILE_K", "").split(",") if w]
    for name, be, op, fn in _cases(dev):
        if only and not any(w in name for w in only):
            continue
        ok, _ = dispatch.backend_status(be, info)
        if not ok or op not in getattr(dispatch._backend_module(be), "OPS", {}):
            print(f"skip {name}: {be} cannot run {op}")
            continue
        try:
            for _ in range(3):
                fn()
        except RuntimeError as exc:  # a backend declining a shape
            print(f"skip {name}: {exc}")
            continue
        runnable.append((name, fn))
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, fn in runnable:
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled:", ", ".join(n for n, _ in runnable))


if __name__ == "__main__":
    main()
