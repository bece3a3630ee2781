"""Serving entry points at the peers' shapes: vLLM's and SGLang's routers and align as a server
calls them (``amdqb.compat.vllm`` / ``amdqb.compat.sglang``), next to the launch floor measured in
the same run (a one-element add: one kernel launch, nothing else, in the same graph replay).

Shapes (SPEC section 5, the figures vLLM's and SGLang's own CUDA kernels give on an H200 are in
docs/targets.md with their source; they are not measured here, so they appear in no ratio):
softmax top-k with renormalisation at E=8 k=2 fp32 (Mixtral) and E=128 k=8 bf16 (Qwen3-MoE);
DeepSeek-V3's grouped sigmoid gate with the correction bias (E=256, 8 groups, topk_group 4, k=8)
through vLLM's ``grouped_topk`` and SGLang's ``moe_fused_gate``; Kimi-K2's ungrouped gate (E=384,
k=8) through both; ``moe_align_block_size`` at E=256, k=8 over M tokens in blocks of 16 / 64 / 128
through vLLM's ``_custom_ops`` and SGLang's preallocated forms (SGLang's with its default
``pad_sorted_token_ids=False``: the buffer holds the caller's sentinel, the call writes the routes).

Every case is checked against the torch backend (the oracles) before it is timed. Rows: ``us``
per call (graph replay of ``calls`` calls, median of alternating samples), ``floor_us`` the launch
floor of the same run and ``x_floor`` their ratio; ``eager_us`` / ``eager_floor_us`` the same
two called eagerly back to back (GPU only: the host's time per call where it exceeds the
kernel's); ``launches`` the kernels one call issues (profiled, GPU only).
"""

from __future__ import annotations

import contextlib
import os

import torch

from amdqb.compat import sglang, vllm
from amdqb.ref.layout import align_buffer_sizes

from .common import Progress, Report, TimingConfig, environment, on_gpu, time_alternating

TOKENS = (1, 8, 64, 256, 1024, 4096, 16384)
ALIGN_TOKENS = (8, 64, 512, 2048, 8192, 32768, 131072)
ALIGN_BLOCKS = (16, 64, 128)
CPU_TOKENS = (1, 64)
CPU_ALIGN_TOKENS = (8, 512)


@contextlib.contextmanager
def _oracle_backend():
    saved = os.environ.get("AMDQB_BACKEND")
    os.environ["AMDQB_BACKEND"] = "torch"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("AMDQB_BACKEND", None)
        else:
            os.environ["AMDQB_BACKEND"] = saved


def _same(got, want) -> bool:
    return all(torch.equal(g, w) for g, w in zip(got, want))


def _close(got, want) -> bool:
    (gw, gi), (ww, wi) = got[:2], want[:2]
    return torch.equal(gi, wi) and torch.allclose(gw, ww, rtol=1e-5, atol=1e-6)


def router_cases(device, g):
    """(op, shape label, T, callable) of the routers."""
    cases = []
    tokens = TOKENS if on_gpu(device) else CPU_TOKENS
    for t in tokens:
        x8 = torch.randn(t, 8, generator=g).to(device)
        x128 = torch.randn(t, 128, generator=g).to(device, torch.bfloat16)
        x256 = torch.randn(t, 256, generator=g).to(device)
        x384 = torch.randn(t, 384, generator=g).to(device)
        b256 = (torch.randn(256, generator=g) * 0.1).to(device)
        b384 = (torch.randn(384, generator=g) * 0.1).to(device)
        cases += [
            ("vllm.fused_topk", "E=8 k=2 fp32 softmax", t, lambda x=x8: vllm.fused_topk(x, x, 2, True)),
            ("vllm.fused_topk", "E=128 k=8 bf16 softmax", t, lambda x=x128: vllm.fused_topk(x, x, 8, True)),
            (
                "vllm.grouped_topk",
                "E=256 k=8 8 groups top 4, sigmoid + bias fp32",
                t,
                lambda x=x256, b=b256: vllm.grouped_topk(
                    x, x, 8, True, 8, 4, "sigmoid", 2.5, b
                ),
            ),
            (
                "sglang.moe_fused_gate",
                "E=256 k=8 8 groups top 4, sigmoid + bias fp32",
                t,
                lambda x=x256, b=b256: sglang.moe_fused_gate(x, b, 8, 4, 8, 0, 2.5),
            ),
            (
                "vllm.grouped_topk",
                "E=384 k=8 1 group, sigmoid + bias fp32",
                t,
                lambda x=x384, b=b384: vllm.grouped_topk(
                    x, x, 8, True, 1, 1, "sigmoid", 2.5, b
                ),
            ),
            (
                "sglang.kimi_k2_moe_fused_gate",
                "E=384 k=8 sigmoid + bias fp32",
                t,
                lambda x=x384, b=b384: sglang.kimi_k2_moe_fused_gate(x, b, 8),
            ),
        ]  # fmt: skip
    return cases


def align_cases(device, g):
    """(op, shape label, M, callable) of the aligns, E=256, k=8 (DeepSeek-V3)."""
    cases = []
    e, k = 256, 8
    tokens = ALIGN_TOKENS if on_gpu(device) else CPU_ALIGN_TOKENS
    for m in tokens:
        ids = torch.rand(m, e, generator=g).argsort(dim=1)[:, :k].to(device, torch.int32)
        for bs in ALIGN_BLOCKS:
            rows, blocks = align_buffer_sizes(ids.numel(), e, bs, False)
            out = [
                torch.empty(rows, dtype=torch.int32, device=device),
                torch.empty(blocks, dtype=torch.int32, device=device),
                torch.empty(1, dtype=torch.int32, device=device),
            ]
            sg_rows = ids.numel() + (e + 1) * (bs - 1)  # SGLang's E + 1 buckets
            # pad_sorted_token_ids=False, SGLang's default: the caller's buffer holds the sentinel
            sg = [
                torch.full((sg_rows,), ids.numel(), dtype=torch.int32, device=device),
                torch.empty(-(-sg_rows // bs), dtype=torch.int32, device=device),
                torch.empty(1, dtype=torch.int32, device=device),
                torch.empty(e + 2, dtype=torch.int32, device=device),
            ]  # fmt: skip

            def v(ids=ids, bs=bs, out=out):
                vllm._custom_ops.moe_align_block_size(ids, e, bs, *out)
                return tuple(out)

            def s(ids=ids, bs=bs, sg=sg):
                sglang.moe_align_block_size(ids, e + 1, bs, *sg)
                return tuple(sg[:3])

            label = f"E={e} k={k} block {bs}"
            cases += [("vllm._custom_ops.moe_align_block_size", label, m, v)]
            cases += [("sglang.moe_align_block_size", label, m, s)]
    return cases


def launches(fn, device) -> int | None:
    """Kernels one call of ``fn`` launches (torch.profiler; None where it cannot tell)."""
    if not on_gpu(device):
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    except Exception:  # no CUPTI
        return None
    kinds = ("Memcpy", "Memset")
    return sum(
        1
        for ev in prof.events()
        if ev.device_type == torch.autograd.DeviceType.CUDA
        and not any(ev.name.startswith(k) for k in kinds)
    )


def run(device, cfg: TimingConfig) -> list[Report]:
    g = torch.Generator().manual_seed(0)
    report = Report(
        "serving_entry_points",
        environment(device),
        shape=dict(tokens="T (routers) / M tokens x k=8 (align)", calls=cfg.calls),
    )
    one = torch.zeros(1, device=device)
    cases = router_cases(device, g) + align_cases(device, g)
    progress = Progress(len(cases), "compat")
    for op, shape, t, fn in cases:
        got = tuple(x.clone() for x in fn())  # the aligns return their (reused) buffers
        with _oracle_backend():
            want = fn()
        ok = _same(got, want) if "align" in op else _close(got, want)
        if not ok:
            raise AssertionError(f"{op} {shape} T={t}: differs from the torch backend")
        impls = {"op": fn, "floor": lambda: one.add_(1)}
        times = time_alternating(impls, device, cfg)
        row = dict(op=op, shape=shape, T=t, us=times["op"], floor_us=float(times["floor"]))
        row["x_floor"] = float(times["op"]) / float(times["floor"])
        if on_gpu(device):  # back-to-back eager calls: the host's time per call where it bounds
            eager = time_alternating(impls, device, cfg, graphs=False)
            row["eager_us"] = float(eager["op"])
            row["eager_floor_us"] = float(eager["floor"])
        count = launches(fn, device)
        if count is not None:
            row["launches"] = count
        report.add(**row)
        progress.step(f"{op} T={t}")
    return [report]
