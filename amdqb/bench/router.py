"""Router benchmark: the fused router without QB and with QB in both binnings and every histogram
mode, per backend, next to a TE-style pure-PyTorch QB baseline; and the serving form
``biased_topk`` at decode sizes.

Shapes follow docs/targets.md: E=896, k=16, fp32 logits, T in {256, 1024, 4096, 8192, 16384}; QB with
``qb_binning="uniform"`` (K3's histogram, B=1000) and ``"log_margin"`` (B=64, the balancer's
default), each in ``two_kernel`` / ``fused_atomic`` / ``auto``, and log_margin with the tie-free
selection, with and without the in-bin moments (int64 ``[3, E, B]``: the balancer's default). Rows carry ``qb/noqb`` (over the same backend's exact no-QB router), the histogram's
all-reduce volume per balancer step, and ``floor_us`` / ``x_floor``: a device copy of the
router's own traffic (logits in, probs and byte map out) timed in the same alternation, and the
row's ratio to it. ``biased_topk``'s rows carry the launch floor (a one-element add) the same
way. TransformerEngine's figures are not measured here (docs/targets.md has them with their
source); no row prints a ratio to them.

Before timing, every case checks: routes, probs and histogram against the oracle (exact activation:
bitwise torch's scores, so the oracle computes its own), both histogram modes bitwise equal, and
each histogram row summing to T.
"""

from __future__ import annotations

import torch

import amdqb
from amdqb import dispatch, ref
from amdqb.backends.triton._common import interpreting
from amdqb.ref.qb import margin_scale, new_histogram

from .common import (
    Progress,
    Report,
    TimingConfig,
    backends_for,
    copy_bandwidth,
    environment,
    time_alternating,
)

# (binning, selection, bins, moments): the QB variants timed. uniform is K3's (TE-exact)
# histogram; log_margin with B=64, tie_free and the in-bin moments is the balancer's default;
# tie_free needs log_margin.
QB_VARIANTS = (
    ("uniform", "te", 1000, False),
    ("log_margin", "te", 64, False),
    ("log_margin", "tie_free", 64, False),
    ("log_margin", "tie_free", 64, True),
)
HIST_MODES = ("two_kernel", "fused_atomic", "auto")


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


def _qb_call(logits, topk, bias, hist, bounds, binning, selection, mode, backend):
    return amdqb.fused_topk_with_score_function(
        logits,
        topk,
        expert_bias=bias,
        qb_histogram=hist,
        qb_bin_bounds=bounds,
        qb_histogram_mode=mode,
        selection=selection,
        qb_binning=binning,
        backend=backend,
    )


def _check_router(backend, logits, bias, topk, bounds, binning, selection, num_bins, moments):
    """Routes, probs and histograms of ``backend`` against the oracle; raises on a mismatch."""
    t, e = logits.shape
    hists, outs = {}, {}
    for mode in HIST_MODES:
        hist = new_histogram(e, num_bins, moments, logits.device)
        outs[mode] = _qb_call(logits, topk, bias, hist, bounds, binning, selection, mode, backend)
        hists[mode] = hist
    what = f"{backend} {binning}/{selection}" + (" moments" if moments else "")
    interpreted = backend == "triton" and interpreting()
    for mode in HIST_MODES[1:]:
        if not torch.equal(hists["two_kernel"], hists[mode]):
            raise AssertionError(f"{what}: two_kernel and {mode} histograms differ")
    if not torch.all(hists["two_kernel"].reshape(-1, e, num_bins)[0].sum(1) == t):
        raise AssertionError(f"{what}: histogram rows do not sum to T={t}")
    hist_ref = torch.zeros_like(hists["two_kernel"])
    probs_ref, _, rmap_ref = ref.fused_topk_with_score_function(
        logits,
        topk,
        expert_bias=bias,
        qb_histogram=hist_ref,
        qb_bin_bounds=bounds,
        selection=selection,
        qb_binning=binning,
    )
    for mode in HIST_MODES:
        probs, rmap = outs[mode]
        if not torch.equal(rmap, rmap_ref):
            bad = (rmap != rmap_ref).any(1).sum().item()
            raise AssertionError(
                f"{what} {mode}: routing map differs from the oracle on {bad} tokens"
            )
        probs_ref = probs_ref.to(probs.dtype)
        if interpreted and torch.allclose(probs, probs_ref, rtol=1e-6, atol=0):
            continue  # the interpreter's exp is numpy's, not the device library the kernel links
        if not torch.equal(probs, probs_ref):
            raise AssertionError(f"{what} {mode}: probs differ from the oracle bitwise")
    if not torch.equal(hist_ref, hists["two_kernel"]):
        raise AssertionError(f"{what}: histogram differs from the oracle")


def _bounds(binning, bias):
    if binning == "log_margin":
        return margin_scale(bias).to(bias.device)
    return torch.stack([bias.min() - 1, bias.max() + 1]).contiguous()


def run(
    device,
    cfg: TimingConfig,
    tokens=(256, 1024, 4096, 8192, 16384),
    num_experts=896,
    topk=16,
    decode_tokens=(1, 8, 64, 256),
) -> list[Report]:
    env = environment(device)
    bw, _ = copy_bandwidth(device, cfg=cfg) if device.type == "cuda" else (float("nan"), 0)
    env["copy_GBps"] = bw
    backends = backends_for("router_fwd", device)
    bins = {f"{b}/{s}": n for b, s, n, _ in QB_VARIANTS}
    shape = dict(E=num_experts, k=topk, B=bins, dtype="fp32", bias="randn*0.05")
    report = Report("router", env, shape=shape)
    serving = Report("biased_topk", env, shape=dict(E=num_experts, k=topk, dtype="fp32"))
    g = torch.Generator(device="cpu").manual_seed(0)
    progress = Progress(len(tokens) + len(decode_tokens), "router")
    bias = (torch.randn(num_experts, generator=g) * 0.05).to(device)
    bounds = {binning: _bounds(binning, bias) for binning, _, _, _ in QB_VARIANTS}
    for t in tokens:
        logits = torch.randn(t, num_experts, generator=g).to(device)
        impls, meta = {}, {}
        for name in backends:
            for approximate in (False, True):
                key = f"{name}:noqb" + (":approx" if approximate else "")
                impls[key] = lambda n=name, a=approximate: amdqb.fused_topk_with_score_function(
                    logits, topk, expert_bias=bias, approximate_activation=a, backend=n
                )
                meta[key] = dict(backend=name, mode="noqb", activation=_act(approximate))
            for binning, selection, num_bins, moments in QB_VARIANTS:
                lim = bounds[binning]
                _check_router(name, logits, bias, topk, lim, binning, selection, num_bins, moments)
                hist = new_histogram(num_experts, num_bins, moments, device)
                for mode in HIST_MODES:
                    key = f"{name}:{binning}:{selection}{':moments' if moments else ''}:{mode}"
                    impls[key] = lambda n=name, b=binning, s=selection, m=mode, h=hist, lim=lim: (
                        _qb_call(logits, topk, bias, h, lim, b, s, m, n)
                    )
                    meta[key] = dict(
                        backend=name,
                        mode=mode,
                        binning=binning,
                        selection=selection,
                        B=num_bins,
                        moments=moments,
                        activation="exact",
                    )
        hist = torch.zeros(num_experts, 1000, dtype=torch.int32, device=device)
        lim = bounds["uniform"]
        impls["torch:te_style_qb"] = lambda: te_style_torch_qb(logits, bias, topk, hist, lim)
        meta["torch:te_style_qb"] = dict(
            backend="torch", mode="te_style_qb", binning="uniform", selection="te", B=1000
        )
        nbytes = t * num_experts * (4 + 4 + 1)  # read logits, write probs + bytemap
        # the copy floor: a device copy moving the same bytes (half read, half written)
        src = torch.empty(nbytes // 8, dtype=torch.float32, device=device)
        dst = torch.empty_like(src)
        impls["floor:copy"] = lambda src=src, dst=dst: dst.copy_(src)
        times = time_alternating(impls, device, cfg)
        floor = float(times.pop("floor:copy"))
        for key, us in times.items():
            row = {"T": t, "E": num_experts, "k": topk, "dtype": "fp32", **meta[key], "us": us}
            row.update(floor_us=floor, x_floor=float(us) / floor)
            row["GB/s"] = nbytes / (us * 1e-6) / 1e9
            if bw == bw:  # a measured device copy bandwidth (GPUs)
                row["%copy"] = 100 * row["GB/s"] / bw
            noqb = times.get(f"{row['backend']}:noqb")
            if "binning" in row:
                # the histogram per step: int32 [E, B], or int64 [3, E, B] with the moments
                planes = 3 * 8 if row.get("moments") else 4
                row["allreduce_bytes"] = num_experts * row["B"] * planes
                if noqb:
                    row["qb/noqb"] = us / noqb
            report.add(**row)
        progress.step(f"T={t}")
    for t in decode_tokens:
        logits = torch.randn(t, num_experts, generator=g).to(device)
        w_ref, ids_ref = ref.biased_topk(logits, topk, bias)
        one = torch.zeros(1, device=device)
        impls = {"floor:launch": lambda one=one: one.add_(1)}  # one kernel launch, nothing else
        for name in dict.fromkeys(backends + ["torch"]):
            if "biased_topk" not in dispatch._backend_module(name).OPS:
                continue
            w, ids = amdqb.biased_topk(logits, topk, bias, backend=name)
            if not torch.equal(ids, ids_ref):
                raise AssertionError(f"{name}: biased_topk ids differ from the oracle at T={t}")
            torch.testing.assert_close(w, w_ref, atol=2e-6, rtol=1e-5)
            impls[name] = lambda n=name: amdqb.biased_topk(logits, topk, bias, backend=n)
        times = time_alternating(impls, device, cfg)
        floor = float(times.pop("floor:launch"))
        for name, us in times.items():
            row = dict(T=t, E=num_experts, k=topk, dtype="fp32", backend=name, us=us)
            row.update(floor_us=floor, x_floor=float(us) / floor)
            serving.add(**row)
        progress.step(f"decode T={t}")
    return [report, serving]


def _act(approximate: bool) -> str:
    return "approximate" if approximate else "exact"
