"""Tuning sweeps of two hip compile-time constants on the GPU at hand:
the router's register cap (``AMDQB_ROUTER_MIN_BLOCKS`` in router.hip) and the lds route kernel's
routes per thread (``AMDQB_ROUTE_ITEMS`` in route.hip, hence its tile and grid size).

    python -m bench.tune_router_occupancy [--json PATH]

The router is latency-bound; capping its registers lets more blocks stay resident per SM but makes
the compiler spill. For each cap (resident blocks per SM the compiler must allow) this compiles
the router with that define, checks routes/probs/histograms against the oracle, and times no-QB,
QB two_kernel and biased_topk at the SPEC shapes (E=896, k=16, B=1000) in graph replay. The
default in router.hip records the winner; this script is how it was chosen. The route sweep
checks every variant's rows against the oracle, then times lds (per tile size) against atomic at
M=8192, k=16, E=896, uniform and all-one-expert ids, masked layout.
"""

from __future__ import annotations

import argparse
import sys

import torch

import amdqb
from amdqb import dispatch, ref
from amdqb.backends.hip import _spec

from .common import Report, TimingConfig, environment, time_alternating, write_json
from .route import check_rows, make_ids

CAPS = (2, 3, 4)
_CAP: list = [None]  # the cap the next router launch compiles with (read while capturing graphs)


def _install():
    original = _spec.router_module

    def router_module(num_experts, dtype_name, score_function):
        spec = original(num_experts, dtype_name, score_function)
        if _CAP[0] is None:
            return spec
        return _spec.ModuleSpec(
            spec.kernel_file, spec.defines + (("AMDQB_ROUTER_MIN_BLOCKS", str(_CAP[0])),)
        )

    _spec.router_module = router_module


def _capped(cap, fn):
    def call():
        _CAP[0] = cap
        try:
            return fn()
        finally:
            _CAP[0] = None

    return call


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    dev = torch.device("cuda")
    e, k, b = 896, 16, 1000
    g = torch.Generator(device="cpu").manual_seed(0)
    bias = (torch.randn(e, generator=g) * 0.05).to(dev)
    bounds = torch.stack([bias.min() - 1, bias.max() + 1]).contiguous()
    amdqb.mark_qb_bin_bounds_validated(bounds)
    hist = torch.zeros(e, b, dtype=torch.int32, device=dev)
    data = {t: torch.randn(t, e, generator=g).to(dev) for t in (8, 256, 1024, 4096, 16384)}
    _install()
    impls = {}
    for cap in CAPS:
        z = data[4096]
        h = torch.zeros_like(hist)
        probs, rmap = _capped(
            cap,
            lambda: amdqb.fused_topk_with_score_function(
                z,
                k,
                expert_bias=bias,
                qb_histogram=h,
                qb_bin_bounds=bounds,
                qb_histogram_mode="two_kernel",
                backend="hip",
            ),
        )()
        h_ref = torch.zeros_like(hist)
        scores = dispatch._backend_module("hip").score_values(z, "sigmoid")  # the kernel's fp32 s
        p_ref, _, m_ref = ref.fused_topk_with_score_function(
            z, k, expert_bias=bias, qb_histogram=h_ref, qb_bin_bounds=bounds, scores=scores
        )
        assert torch.equal(rmap, m_ref) and torch.equal(h, h_ref), f"cap {cap}: mismatch"
        torch.testing.assert_close(probs, p_ref, atol=2e-6, rtol=1e-5)
        for t, z in data.items():
            if t == 8:
                impls[f"cap{cap}:biased_topk:{t}"] = _capped(
                    cap, lambda z=z: amdqb.biased_topk(z, k, bias, backend="hip")
                )
                continue
            for mode in ("noqb", "two_kernel"):
                qb = {}
                if mode != "noqb":
                    qb = dict(qb_histogram=hist, qb_bin_bounds=bounds, qb_histogram_mode=mode)
                impls[f"cap{cap}:{mode}:{t}"] = _capped(
                    cap,
                    lambda z=z, qb=qb: amdqb.fused_topk_with_score_function(
                        z, k, expert_bias=bias, backend="hip", **qb
                    ),
                )
    report = Report("router_occupancy", environment(dev))
    cfg = TimingConfig()
    for t in data:
        group = {n: f for n, f in impls.items() if n.endswith(f":{t}")}
        for name, us in time_alternating(group, dev, cfg).items():
            cap, mode, _ = name.split(":")
            report.add(T=t, cap=int(cap[3:]), mode=mode, us=us)
    print(report.markdown(), flush=True)
    route = route_tiles(dev, cfg)
    print(route.markdown())
    if args.json:
        write_json(args.json, [report, route])
    return 0


def route_tiles(dev, cfg, items=(2, 4, 8, 16), m=8192, k=16, e=896) -> Report:
    report = Report("route_lds_items", environment(dev))
    g = torch.Generator().manual_seed(0)
    original = (_spec.ROUTE_MODULE, _spec.ROUTE_ITEMS)

    def variant(n, fn):
        def call():
            _spec.ROUTE_MODULE = _spec.ModuleSpec("route.hip", (("AMDQB_ROUTE_ITEMS", str(n)),))
            _spec.ROUTE_ITEMS = n
            try:
                return fn()
            finally:
                _spec.ROUTE_MODULE, _spec.ROUTE_ITEMS = original

        return call

    for dist in ("uniform", "one"):
        ids = make_ids(m, k, e, dist, g).to(dev)
        cap = m * k
        impls = {
            "atomic": lambda: amdqb.moe_route_rows(
                ids, e, capacity=cap, impl="atomic", backend="hip"
            )
        }
        for n in items:
            impls[f"lds{n}"] = variant(
                n, lambda: amdqb.moe_route_rows(ids, e, capacity=cap, impl="lds", backend="hip")
            )
        for name, fn in impls.items():
            rows, counts = fn()
            check_rows(rows, counts, ids, e, cap)
        times = time_alternating(impls, dev, cfg)
        for name, us in times.items():
            report.add(M=m, dist=dist, impl=name, us=us, x_vs_atomic=times["atomic"] / us)
    return report


if __name__ == "__main__":
    sys.exit(main())
