"""QuantileBalancer.step() benchmark (E=896, B=1000, no collective): recover, EMA, centre, bounds,
mark, zero -- captured in a graph, so the figure also proves the step has no host sync."""

from __future__ import annotations

import torch

import amdqb
from amdqb import dispatch, ref

from .common import Report, TimingConfig, environment, time_alternating


def run(device, cfg: TimingConfig, num_experts=896, topk=16, num_bins=1000) -> list[Report]:
    env = environment(device)
    report = Report("balancer_step", env)
    info = dispatch.device_info(device)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4096, num_experts, generator=g).to(device)
    impls = {}
    for name in ("hip", "triton", "torch"):
        ok, _ = dispatch.backend_status(name, info)
        if not ok or "qb_step" not in dispatch._backend_module(name).OPS:
            continue
        bal = amdqb.QuantileBalancer(num_experts, topk, num_bins, device=device)
        bal.route(logits, accumulate=True, backend="torch")
        hist = bal.histogram.clone()
        want_bias, want_bounds = ref.qb_step_update(bal.bias, hist, bal.bin_bounds, topk)
        bal.step(backend=name)
        torch.testing.assert_close(bal.bias, want_bias, atol=1e-6, rtol=0)
        torch.testing.assert_close(bal.bin_bounds, want_bounds, atol=1e-6, rtol=0)
        impls[name] = lambda b=bal, n=name: b.step(backend=n)
    eager = {"torch": impls.pop("torch")} if "torch" in impls else {}
    times = time_alternating(impls, device, cfg)
    times.update(time_alternating(eager, device, cfg, graphs=False))
    for name, us in times.items():
        report.add(E=num_experts, B=num_bins, backend=name, us=us, target_us=30.0, meets=us <= 30)
    return [report]
