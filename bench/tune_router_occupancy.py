"""Tuning sweeps of the hip kernels' compile-time constants and launch shapes on the GPU at hand:
e.g. the router's register cap (``AMDQB_ROUTER_MIN_BLOCKS`` in router.hip) and the lds route
kernel's tile (``AMDQB_ROUTE_BLOCK`` threads x ``AMDQB_ROUTE_ITEMS`` routes in route.hip).

    python -m bench.tune_router_occupancy [--json PATH]

The router is latency-bound; capping its registers lets more blocks stay resident per SM but makes
the compiler spill. For each cap (resident blocks per SM the compiler must allow) this compiles
the router with that define, checks routes/probs/histograms against the oracle, and times no-QB,
QB two_kernel and biased_topk at the SPEC shapes (E=896, k=16, B=1000) in graph replay. The
default in router.hip records the winner; this script is how it was chosen. The route sweep
checks every variant's rows against the oracle, then times lds (per tile shape) against atomic at
M in {512, 2517, 8192}, k=16, E=896, uniform and all-one-expert ids, masked layout; the gate sweep
times both at small M for E in {256, 896, 2048} (the atomic / lds crossover behind the sm_90
entry of the capacity gate). The align sweep does the same
for the deterministic tile (``AMDQB_DET_ITEMS``: 32-route chunks per tile of the align passes) at
M in {2517, 8192}; the decode sweep times biased_topk's one-block-per-token kernel against the
router's one-warp-per-token form over T, and the router's two forms (no QB, fused QB) against the
two-kernel mode, which set ``_ops.DECODE_MAX_TOKENS``, ``ROUTER_DECODE_MAX_TOKENS``,
``ROUTER_DECODE_FUSED_MAX_TOKENS`` and the auto mode's switch; the qbhist sweep times the QB
two-kernel mode per launch shape of its histogram pass (``_ops.QB_HIST_BLOCK``,
``QB_HIST_BLOCKS_PER_CU``, ``QB_HIST_MAX_EXPERTS_PER_BLOCK``, and the defines
``AMDQB_QB_HIST_MIN_BLOCKS`` / ``AMDQB_QB_HIST_UNROLL``); the stages sweep cuts the warp router
after each stage (``AMDQB_ROUTER_STOP``) and times the sigmoid / histogram variants kept as
defines (library exponential, one-phase sigmoid, forward token walk) and the histogram pass as an
ordinary launch.

    python -m bench.tune_router_occupancy --parts route,gate,align,decode,qbhist,stages
"""

from __future__ import annotations

import argparse
import sys

import torch

import amdqb
from amdqb import dispatch, ref
from amdqb.backends.hip import _ops, _spec

from .common import Report, TimingConfig, environment, time_alternating, write_json
from .route import check_rows, make_ids

CAPS = (2, 3, 4)


def _patched(fn, *patches):
    """``fn`` run with each ``(obj, name, value)`` attribute set, restored afterwards. Variants are
    built this way: the launchers read the patched constants while a graph is captured, so each
    graph holds its own variant's kernels and launch shapes."""

    def call():
        saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
        for obj, name, value in patches:
            setattr(obj, name, value)
        try:
            return fn()
        finally:
            for obj, name, value in reversed(saved):
                setattr(obj, name, value)

    return call


def _router_defines(*defines):
    """A patch of ``_spec.router_module`` that adds compile-time ``(name, value)`` defines."""
    base = _spec.router_module

    def router_module(*args):
        return base(*args).with_defines(*defines)

    return (_spec, "router_module", router_module)


def _capped(cap, fn):
    """``fn`` with the router built for ``cap`` resident blocks per SM (AMDQB_ROUTER_MIN_BLOCKS)."""
    return _patched(fn, _router_defines(("AMDQB_ROUTER_MIN_BLOCKS", str(cap))))


def _route_module(*defines):
    """A patch of ``_spec.ROUTE_MODULE`` built with compile-time ``(name, value)`` defines."""
    module = _spec.ROUTE_MODULE.with_defines(*((name, str(value)) for name, value in defines))
    return (_spec, "ROUTE_MODULE", module)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--parts",
        default="router,route,gate,align,decode,qbhist,stages",
        help="comma-separated sweeps to run",
    )
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    dev = torch.device("cuda")
    cfg = TimingConfig()
    reports = []
    if "router" in parts:
        reports.append(router_caps(dev, cfg))
    sweeps = (
        ("route", route_tiles),
        ("gate", route_gate),
        ("align", align_tiles),
        ("decode", decode_sweep),
        ("qbhist", qb_hist_shapes),
        ("stages", router_stages),
    )
    for name, sweep in sweeps:
        if name in parts:
            reports.append(sweep(dev, cfg))
    for report in reports:
        print(report.markdown(), flush=True)
    if args.json:
        write_json(args.json, reports)
    return 0


def _hip_two_kernel_qb(z, k, bias, hist, bounds):
    return amdqb.fused_topk_with_score_function(
        z,
        k,
        expert_bias=bias,
        qb_histogram=hist,
        qb_bin_bounds=bounds,
        qb_histogram_mode="two_kernel",
        backend="hip",
    )


def router_caps(dev, cfg) -> Report:
    e, k, b = 896, 16, 1000
    g = torch.Generator(device="cpu").manual_seed(0)
    bias = (torch.randn(e, generator=g) * 0.05).to(dev)
    bounds = torch.stack([bias.min() - 1, bias.max() + 1]).contiguous()
    amdqb.mark_qb_bin_bounds_validated(bounds)
    hist = torch.zeros(e, b, dtype=torch.int32, device=dev)
    data = {t: torch.randn(t, e, generator=g).to(dev) for t in (8, 256, 1024, 4096, 8192, 16384)}
    impls = {}
    for cap in CAPS:
        z = data[4096]
        h = torch.zeros_like(hist)
        probs, rmap = _capped(cap, lambda: _hip_two_kernel_qb(z, k, bias, h, bounds))()
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
    for t in data:
        group = {n: f for n, f in impls.items() if n.endswith(f":{t}")}
        for name, us in time_alternating(group, dev, cfg).items():
            cap, mode, _ = name.split(":")
            report.add(T=t, cap=int(cap[3:]), mode=mode, us=us)
    return report


def route_tiles(
    dev,
    cfg,
    shapes=((256, 4), (256, 5), (512, 2), (512, 3), (512, 4), (512, 5), (1024, 2), (1024, 4)),
    ms=(512, 2517, 8192),
    k=16,
    e=896,
) -> Report:
    """The lds kernel's tile (threads per block, routes per thread) against the atomic kernel, in
    the masked layout the route benchmark times."""
    report = Report("route_lds_tiles", environment(dev))
    g = torch.Generator().manual_seed(0)

    def variant(block, items, fn):
        return _patched(
            fn,
            _route_module(("AMDQB_ROUTE_BLOCK", block), ("AMDQB_ROUTE_ITEMS", items)),
            (_spec, "ROUTE_BLOCK", block),
            (_spec, "ROUTE_ITEMS", items),
        )

    for m in ms:
        for dist in ("uniform", "one"):
            ids = make_ids(m, k, e, dist, g).to(dev)
            cap = m * k

            def run(impl, ids=ids, cap=cap):
                return amdqb.moe_route_rows(ids, e, capacity=cap, impl=impl, backend="hip")

            impls = {"atomic": lambda run=run: run("atomic")}
            for block, items in shapes:
                impls[f"lds{block}x{items}"] = variant(block, items, lambda run=run: run("lds"))
            for name, fn in impls.items():
                rows, counts = fn()
                check_rows(rows, counts, ids, e, cap)
            times = time_alternating(impls, dev, cfg)
            for name, us in times.items():
                report.add(M=m, dist=dist, impl=name, us=us, x_vs_atomic=times["atomic"] / us)
    return report


def route_gate(
    dev, cfg, experts=(256, 896, 2048), ms=(8, 32, 64, 128, 256, 512, 1024, 2048), k=16
) -> Report:
    """atomic vs lds (the op's tile) at small M around the capacity gate, masked and compact
    layouts, uniform ids: the crossover the dispatcher's sm_90 gate (ops/route.py) records."""
    from amdqb.ops.route import lds_route_threshold

    report = Report("route_gate", environment(dev))
    g = torch.Generator().manual_seed(0)
    for e in experts:
        for m in ms:
            ids = make_ids(m, k, e, "uniform", g).to(dev)
            for cap in (m * k, None):
                impls = {
                    impl: lambda impl=impl, ids=ids, cap=cap: amdqb.moe_route_rows(
                        ids, e, capacity=cap, impl=impl, backend="hip"
                    )
                    for impl in ("atomic", "lds")
                }
                for fn in impls.values():
                    rows, counts = fn()
                    check_rows(rows, counts, ids, e, cap)
                times = time_alternating(impls, dev, cfg)
                report.add(
                    E=e,
                    M=m,
                    layout="compact" if cap is None else "masked",
                    atomic_us=times["atomic"],
                    lds_us=times["lds"],
                    atomic_over_lds=times["atomic"] / times["lds"],
                    seed_gate_picks=(
                        "lds" if m * k >= lds_route_threshold(e, "gfx1250") else "atomic"
                    ),
                )
    return report


def align_tiles(dev, cfg, items=(32,), ms=(2517, 8192), k=16, e=896, block=64) -> Report:
    report = Report("align_det_items", environment(dev))
    g = torch.Generator().manual_seed(0)

    def variant(n, fn):
        return _patched(
            fn,
            _route_module(("AMDQB_DET_ITEMS", n)),
            (_spec, "DET_ITEMS", n),
            (_spec, "DET_TILE", 32 * n),
        )

    for m in ms:
        ids = make_ids(m, k, e, "uniform", g).to(dev)
        want = ref.moe_align_block_size(ids.cpu(), block, e)
        impls = {}
        for n in items:
            impls[f"items{n}"] = variant(
                n, lambda: amdqb.moe_align_block_size(ids, block, e, backend="hip")
            )
            got = impls[f"items{n}"]()
            for a, b in zip(got, want):
                assert torch.equal(a.cpu(), b), f"align items={n} M={m}: differs from the oracle"
        # Marginal cost of each pass (default tile): the op's launches cut after the first n.
        from amdqb.backends.hip import _rt

        outs = [torch.empty_like(x, device=dev) for x in want]
        for n_passes in (1, 2):
            impls[f"passes{n_passes}"] = lambda n_passes=n_passes: _ops.align_block_size(
                _FirstLaunches(_rt(), n_passes), ids, block, e, *outs
            )
        # the passes as ordinary launches instead of dependents of the pass before
        impls["ordinary_launch"] = _patched(
            lambda: amdqb.moe_align_block_size(ids, block, e, backend="hip"),
            (_ops, "DET_DEPENDENT_LAUNCH", False),
        )
        for a, b in zip(impls["ordinary_launch"](), want):
            assert torch.equal(a.cpu(), b), f"align ordinary launches M={m}: differs"
        # ... and the rank pass cut after stage k (AMDQB_ALIGN_STOP)
        for k_stop in range(-1, 4):
            impls[f"rank_stop{k_stop}"] = _patched(
                lambda: _ops.align_block_size(_rt(), ids, block, e, *outs),
                _route_module(("AMDQB_ALIGN_STOP", k_stop)),
            )
        for name, us in time_alternating(impls, dev, cfg).items():
            if name.startswith("passes"):
                report.add(M=m, det_items=f"{_spec.DET_ITEMS}, first {name[6:]} pass(es)", us=us)
            elif name == "ordinary_launch":
                report.add(M=m, det_items=f"{_spec.DET_ITEMS}, ordinary launches", us=us)
            elif name.startswith("rank_stop"):
                report.add(
                    M=m, det_items=f"{_spec.DET_ITEMS}, rank pass to stage {name[9:]}", us=us
                )
            else:
                report.add(M=m, det_items=int(name[5:]), us=us)
    return report


class _FirstLaunches:
    """A runtime that forwards only the first ``n`` launches (stage timings)."""

    def __init__(self, rt, n):
        self.rt, self.n, self.seen = rt, n, 0

    def __getattr__(self, name):
        return getattr(self.rt, name)

    def launch(self, *args):
        self.seen += 1
        if self.seen <= self.n:
            self.rt.launch(*args)

    launch_dependent = launch


def decode_sweep(dev, cfg, tokens=(1, 64, 256, 512, 768, 1024), k=16, e=896) -> Report:
    report = Report("biased_topk_decode", environment(dev))
    g = torch.Generator().manual_seed(0)
    bias = (torch.randn(e, generator=g) * 0.05).to(dev)

    def variant(limit, fn):
        return _patched(fn, (_ops, "DECODE_MAX_TOKENS", limit))

    # The floor: one trivial kernel node (a 1-element fill) in the same graph replay.
    one = torch.empty(1, device=dev)
    floor = time_alternating({"fill": lambda: one.zero_()}, dev, cfg)["fill"]
    report.add(T=0, kernel="one_element_fill", us=floor)

    # Stage costs of the decode kernel (the same launch returning after stage k:
    # AMDQB_DECODE_STOP) and its experts per warp (AMDQB_DECODE_EPW).
    def stopped(fn, stop):
        return _patched(fn, _router_defines(("AMDQB_DECODE_STOP", str(stop))))

    def per_warp(fn, epw):
        return _patched(
            fn, _router_defines(("AMDQB_DECODE_EPW", str(epw))), (_ops, "DECODE_EPW", epw)
        )

    for t in (1, 64, 256):
        z = torch.randn(t, e, generator=g).to(dev)
        full = variant(1 << 30, lambda z=z: amdqb.biased_topk(z, k, bias, backend="hip"))
        impls = {"full": full, **{f"stop{s}": stopped(full, s) for s in range(4)}}
        impls.update({f"epw{n}": per_warp(full, n) for n in (64, 256)})
        want = full()
        for name in ("epw64", "epw256"):
            got = impls[name]()
            assert all(torch.equal(a, b) for a, b in zip(got, want)), f"{name} differs at T={t}"
        for name, us in time_alternating(impls, dev, cfg).items():
            report.add(T=t, kernel=f"block_per_token:{name}", us=us)
    # The router's decode form against amdqb_router (routing map + probs; no QB, QB fused), and
    # the two-kernel QB mode (its router pass in the form the op picks) for the auto mode's switch.
    bounds = torch.stack([bias.min() - 1, bias.max() + 1]).contiguous()
    amdqb.mark_qb_bin_bounds_validated(bounds)

    def router_form(limit, fn):
        return _patched(
            fn,
            (_ops, "ROUTER_DECODE_MAX_TOKENS", limit),
            (_ops, "ROUTER_DECODE_FUSED_MAX_TOKENS", limit),
        )

    for t in (64, 256, 512, 1024, 2048, 4096):
        z = torch.randn(t, e, generator=g).to(dev)
        hist = torch.zeros(e, 1000, dtype=torch.int32, device=dev)
        impls = {}
        for mode in (None, "fused_atomic"):
            qb = {}
            if mode is not None:
                qb = dict(qb_histogram=hist, qb_bin_bounds=bounds, qb_histogram_mode=mode)

            def fn(z=z, qb=qb):
                return amdqb.fused_topk_with_score_function(
                    z, k, expert_bias=bias, backend="hip", **qb
                )

            forms = {
                f"router_{name}:{mode or 'noqb'}": router_form(limit, fn)
                for name, limit in (("block_per_token", 1 << 30), ("warp_per_token", 0))
            }
            outs = [f() for f in forms.values()]
            assert all(torch.equal(a, b) for a, b in zip(*outs)), f"router forms differ at T={t}"
            impls.update(forms)
        impls["two_kernel"] = lambda z=z, h=hist: _hip_two_kernel_qb(z, k, bias, h, bounds)
        for name, us in time_alternating(impls, dev, cfg).items():
            report.add(T=t, kernel=name, us=us)
    for t in tokens:
        z = torch.randn(t, e, generator=g).to(dev)
        impls = {
            name: variant(limit, lambda z=z: amdqb.biased_topk(z, k, bias, backend="hip"))
            for name, limit in (("block_per_token", 1 << 30), ("warp_per_token", 0))
        }
        outs = [fn() for fn in impls.values()]
        assert all(torch.equal(a, b) for a, b in zip(*outs)), f"decode kernels differ at T={t}"
        times = time_alternating(impls, dev, cfg)
        for name, us in times.items():
            report.add(T=t, kernel=name, us=us)
    return report


def router_stages(dev, cfg, tokens=(1024, 4096, 16384), k=16, e=896) -> Report:
    """The warp-per-token router (no QB; probs and byte map, as the bench) cut after each stage
    (``AMDQB_ROUTER_STOP``: 0 loads, 1 scores and keys, 2 selection, 3 cutoff and weights), and
    the QB two-kernel mode with it: where the time of each token's chain goes."""
    report = Report("router_stages", environment(dev))
    g = torch.Generator().manual_seed(0)
    bias = (torch.randn(e, generator=g) * 0.05).to(dev)
    bounds = torch.stack([bias.min() - 1, bias.max() + 1]).contiguous()
    amdqb.mark_qb_bin_bounds_validated(bounds)
    for t in tokens:
        z = torch.randn(t, e, generator=g).to(dev)
        hist = torch.zeros(e, 1000, dtype=torch.int32, device=dev)

        def full(z=z):
            return amdqb.fused_topk_with_score_function(z, k, expert_bias=bias, backend="hip")

        def two_kernel(z=z, h=hist):
            return _hip_two_kernel_qb(z, k, bias, h, bounds)

        impls = {"full": full}
        for stop in range(4):
            impls[f"stop{stop}"] = _patched(full, _router_defines(("AMDQB_ROUTER_STOP", str(stop))))
        impls["two_kernel"] = two_kernel
        # the sigmoid's e^-z through the library expf (the default before session 7): other scores
        # (a few 2^-22 apart), so compared by time only
        library = _router_defines(("AMDQB_SIGMOID_APPROX_EXP", "0"))
        impls["full:library_exp"] = _patched(full, library)
        impls["two_kernel:library_exp"] = _patched(two_kernel, library)
        # the histogram's sigmoid one element at a time
        impls["two_kernel:hist_one_phase"] = _patched(
            two_kernel, _router_defines(("AMDQB_QB_HIST_TWO_PHASE", "0"))
        )
        # the histogram pass walking the tokens first to last
        impls["two_kernel:hist_forward"] = _patched(
            two_kernel, _router_defines(("AMDQB_QB_HIST_REVERSE", "0"))
        )
        # the histogram pass as an ordinary launch instead of the router's dependent
        impls["two_kernel:ordinary_launch"] = _patched(
            two_kernel, (_ops, "QB_HIST_DEPENDENT_LAUNCH", False)
        )
        hists = []
        for name in [n for n in impls if n.startswith("two_kernel") and "library" not in n]:
            hist.zero_()
            impls[name]()
            hists.append(hist.clone())
        assert all(torch.equal(h, hists[0]) for h in hists), "histogram variants differ"
        for name, us in time_alternating(impls, dev, cfg).items():
            report.add(T=t, kernel=name, us=us)
    return report


def qb_hist_shapes(
    dev,
    cfg,
    shapes=(
        (1024, 0, 8, 1, 2),
        (1024, 1, 8, 1, 2),
        (1024, 0, 8, 2, 2),
        (512, 1, 8, 2, 2),
    ),
    tokens=(1024, 4096, 8192, 16384),
    k=16,
    e=896,
    b=1000,
) -> Report:
    """QB two_kernel end to end per launch shape of the histogram pass: threads per block, blocks
    per CU the token slices aim for (0: one token slice), the most experts per block, the resident
    blocks per SM its registers must allow (``AMDQB_QB_HIST_MIN_BLOCKS``) and tokens per step
    (``AMDQB_QB_HIST_UNROLL``); every shape's histogram checked against the default's."""
    report = Report("qb_hist_launch_shapes", environment(dev))
    g = torch.Generator().manual_seed(0)
    bias = (torch.randn(e, generator=g) * 0.05).to(dev)
    bounds = torch.stack([bias.min() - 1, bias.max() + 1]).contiguous()
    amdqb.mark_qb_bin_bounds_validated(bounds)

    def shaped(shape, fn):
        block, per_cu, epb, min_blocks, unroll = shape
        return _patched(
            fn,
            _router_defines(
                ("AMDQB_QB_HIST_MAX_BLOCK", str(max(256, block))),
                ("AMDQB_QB_HIST_MIN_BLOCKS", str(min_blocks)),
                ("AMDQB_QB_HIST_UNROLL", str(unroll)),
            ),
            (_ops, "QB_HIST_BLOCK", block),
            (_ops, "QB_HIST_BLOCKS_PER_CU", per_cu),
            (_ops, "QB_HIST_MAX_EXPERTS_PER_BLOCK", epb),
        )

    for t in tokens:
        z = torch.randn(t, e, generator=g).to(dev)
        hist = torch.zeros(e, b, dtype=torch.int32, device=dev)

        def qb(h=hist, z=z):
            return _hip_two_kernel_qb(z, k, bias, h, bounds)

        want = torch.zeros_like(hist)
        qb(want)
        impls = {}
        for shape in shapes:
            name = "x".join(map(str, shape))
            got = torch.zeros_like(hist)
            shaped(shape, lambda got=got: qb(got))()
            assert torch.equal(got, want), f"histogram differs at {name}"
            impls[name] = shaped(shape, qb)
        for name, us in time_alternating(impls, dev, cfg).items():
            block, per_cu, epb, min_blocks, unroll = map(int, name.split("x"))
            report.add(
                T=t,
                block=block,
                blocks_per_cu=per_cu,
                experts_per_block=epb,
                min_blocks=min_blocks,
                unroll=unroll,
                us=us,
            )
    return report


if __name__ == "__main__":
    sys.exit(main())
