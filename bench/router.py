"""Router benchmark: no-QB vs QB two_kernel vs QB fused_atomic per backend, a TE-style pure-PyTorch
QB baseline, and the serving form ``biased_topk`` at decode sizes.

Shapes follow seed 000: E=896, k=16, B=1000, fp32 logits, T in {256, 1024, 4096, 8192, 16384}.
Before timing, every case checks: routes/probs against the oracle (on the kernel's own scores where
the backend exposes them), both histogram modes bitwise equal, and each histogram row summing to T.
"""

from __future__ import annotations

import torch

import amdqb
from amdqb import dispatch, ref

from .common import (
    Progress,
    backends_for,
    Report,
    TimingConfig,
    copy_bandwidth,
    environment,
    is_h200,
    time_alternating,
)

# TransformerEngine's router on this H200 (SPEC §5, CUDA-graph replay, µs per call).
TE_H200 = {
    256: {"te_noqb": 36, "te_fused": 43, "te_two": 45, "torch_graph": 75},
    1024: {"te_noqb": 39, "te_fused": 50, "te_two": 54, "torch_graph": 123},
    4096: {"te_noqb": 83, "te_fused": 122, "te_two": 108, "torch_graph": 330},
    8192: {"te_noqb": 155, "te_fused": 231, "te_two": 203, "torch_graph": 634},
    16384: {"te_noqb": 265, "te_fused": 391, "te_two": 355, "torch_graph": 1198},
}


def te_style_torch_qb(logits, bias, topk, hist, bounds):
    """TE's pure-PyTorch QB reference shape: sigmoid, topk(k+1), cutoff, scatter, bincount."""
    s = torch.sigmoid(logits.float())
    u = s + bias
    vals, idx = torch.topk(u, topk + 1, dim=-1)
    alpha = vals[:, -1:]
    routed = idx[:, :topk]
    sel = s.gather(1, routed)
    probs = torch.zeros_like(s).scatter(1, routed, sel / (sel.sum(-1, keepdim=True) + 1e-20))
    rmap = torch.zeros_like(s, dtype=torch.bool).scatter(1, routed, True)
    e, b = hist.shape
    scale = float(b) / (bounds[1] - bounds[0])  # no host scalar tensor: capturable
    bins = torch.floor((alpha - s - bounds[0]) * scale).nan_to_num(0.0).clamp(0, b - 1).long()
    flat = (bins + torch.arange(e, device=s.device) * b).reshape(-1)
    # scatter_add rather than bincount: bincount sizes its output on the host (no graph capture)
    hist.view(-1).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    return probs, rmap


def _check_router(backend, logits, bias, topk, num_bins, bounds):
    """Routes, probs and histograms of ``backend`` against the oracle; raises on a mismatch."""
    t, e = logits.shape
    hists = {}
    outs = {}
    for mode in ("two_kernel", "fused_atomic"):
        hist = torch.zeros(e, num_bins, dtype=torch.int32, device=logits.device)
        outs[mode] = amdqb.fused_topk_with_score_function(
            logits,
            topk,
            expert_bias=bias,
            qb_histogram=hist,
            qb_bin_bounds=bounds,
            qb_histogram_mode=mode,
            backend=backend,
        )
        hists[mode] = hist
    if not torch.equal(hists["two_kernel"], hists["fused_atomic"]):
        raise AssertionError(f"{backend}: two_kernel and fused_atomic histograms differ")
    if not torch.all(hists["two_kernel"].sum(1) == t):
        raise AssertionError(f"{backend}: histogram rows do not sum to T={t}")
    module = dispatch._backend_module(backend)
    scores = module.score_values(logits, "sigmoid") if hasattr(module, "score_values") else None
    hist_ref = torch.zeros_like(hists["two_kernel"])
    probs_ref, _, rmap_ref = ref.fused_topk_with_score_function(
        logits, topk, expert_bias=bias, qb_histogram=hist_ref, qb_bin_bounds=bounds, scores=scores
    )
    probs, rmap = outs["fused_atomic"]
    if not torch.equal(rmap, rmap_ref):
        bad = (rmap != rmap_ref).any(1).sum().item()
        raise AssertionError(f"{backend}: routing map differs from the oracle on {bad} tokens")
    if not torch.equal(hist_ref, hists["fused_atomic"]):
        raise AssertionError(f"{backend}: histogram differs from the oracle on its own scores")
    torch.testing.assert_close(probs, probs_ref.to(probs.dtype), atol=2e-6, rtol=1e-5)


def run(
    device,
    cfg: TimingConfig,
    tokens=(256, 1024, 4096, 8192, 16384),
    num_experts=896,
    topk=16,
    num_bins=1000,
    decode_tokens=(1, 8, 64, 256),
) -> list[Report]:
    env = environment(device)
    bw, _ = copy_bandwidth(device, cfg=cfg) if device.type == "cuda" else (float("nan"), 0)
    env["copy_GBps"] = bw
    backends = backends_for("router_fwd", device)
    shape = dict(E=num_experts, k=topk, B=num_bins, dtype="fp32", bias="randn*0.05")
    report = Report("router", env, shape=shape)
    serving = Report("biased_topk", env, shape=dict(E=num_experts, k=topk, dtype="fp32"))
    h200 = is_h200(env)
    g = torch.Generator(device="cpu").manual_seed(0)
    progress = Progress(len(tokens) + len(decode_tokens), "router")
    bias = (torch.randn(num_experts, generator=g) * 0.05).to(device)
    bounds = torch.stack([bias.min() - 1, bias.max() + 1]).contiguous()
    for t in tokens:
        logits = torch.randn(t, num_experts, generator=g).to(device)
        for name in backends:
            _check_router(name, logits, bias, topk, num_bins, bounds)
        hist = torch.zeros(num_experts, num_bins, dtype=torch.int32, device=device)
        impls = {}
        for name in backends:
            impls[f"{name}:noqb"] = lambda n=name: amdqb.fused_topk_with_score_function(
                logits, topk, expert_bias=bias, backend=n
            )
            for mode in ("two_kernel", "fused_atomic"):
                impls[f"{name}:{mode}"] = lambda n=name, m=mode: (
                    amdqb.fused_topk_with_score_function(
                        logits,
                        topk,
                        expert_bias=bias,
                        qb_histogram=hist,
                        qb_bin_bounds=bounds,
                        qb_histogram_mode=m,
                        backend=n,
                    )
                )
        impls["torch:te_style_qb"] = lambda: te_style_torch_qb(logits, bias, topk, hist, bounds)
        times = time_alternating(impls, device, cfg)
        nbytes = t * num_experts * (4 + 4 + 1)  # read logits, write probs + bytemap
        for impl, us in times.items():
            backend, mode = impl.split(":")
            row = {"T": t, "E": num_experts, "k": topk, "dtype": "fp32", "backend": backend}
            row.update(mode=mode, us=us)
            row["GB/s"] = nbytes / (us * 1e-6) / 1e9
            if bw == bw:  # a measured device copy bandwidth (GPUs)
                row["%copy"] = 100 * row["GB/s"] / bw
            noqb = times.get(f"{backend}:noqb")
            if mode in ("two_kernel", "fused_atomic") and noqb:
                row["qb/noqb"] = us / noqb
            anchor = TE_H200.get(t) if h200 and (num_experts, topk) == (896, 16) else None
            if anchor and mode != "noqb":
                row["x_vs_TE_best_QB"] = min(anchor["te_fused"], anchor["te_two"]) / us
            elif anchor:
                row["x_vs_TE_noQB"] = anchor["te_noqb"] / us
            report.add(**row)
        progress.step(f"T={t}")
    for t in decode_tokens:
        logits = torch.randn(t, num_experts, generator=g).to(device)
        w_ref, ids_ref = ref.biased_topk(logits, topk, bias)
        impls = {}
        for name in dict.fromkeys(backends + ["torch"]):
            if "biased_topk" not in dispatch._backend_module(name).OPS:
                continue
            w, ids = amdqb.biased_topk(logits, topk, bias, backend=name)
            if not torch.equal(ids, ids_ref):
                raise AssertionError(f"{name}: biased_topk ids differ from the oracle at T={t}")
            torch.testing.assert_close(w, w_ref, atol=2e-6, rtol=1e-5)
            impls[name] = lambda n=name: amdqb.biased_topk(logits, topk, bias, backend=n)
        for name, us in time_alternating(impls, device, cfg).items():
            row = dict(T=t, E=num_experts, k=topk, dtype="fp32", backend=name, us=us)
            if h200:  # the SPEC §5 target was set for the H200
                row.update(target_us=5.0, meets=us <= 5.0)
            serving.add(**row)
        progress.step(f"decode T={t}")
    return [report, serving]
