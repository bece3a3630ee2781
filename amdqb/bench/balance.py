"""QuantileBalancer.step() benchmark (no collective): recover, EMA, centre, bounds, mark, zero --
captured in a graph on a GPU, so the figure also proves the step has no host sync. Both binnings:
``uniform`` (K3 / TE, the docs/targets.md shape E=896, B=1000) and ``log_margin`` (the balancer's default,
64 bins). Every step is checked against the oracle update first."""

from __future__ import annotations

import torch

import amdqb
from amdqb import ref

from .common import Report, TimingConfig, backends_for, environment, time_alternating


def run(
    device,
    cfg: TimingConfig,
    num_experts=896,
    topk=16,
    num_bins=1000,
    tokens=(4096,),
    margin_bins=64,
) -> list[Report]:
    env = environment(device)
    t = tokens[0]
    report = Report("balancer_step", env, shape=dict(E=num_experts, k=topk, T_routed=t))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(t, num_experts, generator=g).to(device)
    backends = backends_for("qb_step", device, ("hip", "triton", "torch"))
    impls, meta = {}, {}
    for binning, bins in (("uniform", num_bins), ("log_margin", margin_bins)):
        for name in backends:
            bal = amdqb.QuantileBalancer(
                num_experts, topk, binning=binning, num_bins=bins, device=device
            )
            bal.route(logits, accumulate=True, backend="torch")
            hist = bal.histogram.clone()
            want_bias, want_bounds = ref.qb_step_update(
                bal.bias, hist, bal.bin_bounds, topk, binning=binning
            )
            bal.step(backend=name)
            torch.testing.assert_close(bal.bias, want_bias, atol=1e-6, rtol=0)
            torch.testing.assert_close(bal.bin_bounds, want_bounds, atol=1e-6, rtol=1e-6)
            key = f"{name}:{binning}"
            impls[key] = lambda b=bal, n=name: b.step(backend=n)
            meta[key] = (name, binning, bins)
    # the torch backend's recovery sizes work from device values: timed eagerly
    eager = {k: impls.pop(k) for k in list(impls) if k.startswith("torch:")}
    times = time_alternating(impls, device, cfg)
    times.update(time_alternating(eager, device, cfg, graphs=False))
    for key, us in times.items():
        name, binning, bins = meta[key]
        row = dict(E=num_experts, k=topk, B=bins, binning=binning, backend=name, us=us)
        report.add(**row)
    return [report]
