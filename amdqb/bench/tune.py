"""Tuning sweeps of the hip kernels' launch shapes and thresholds on the GPU at hand; with
``--write`` the winners go into ``amdqb/configs/<arch>.json`` with their provenance.

    python -m amdqb.bench.tune --parts route,gate,align,align_threads,align_rank_first,align_plan,align_cluster,topk,topk_lanes,topk_rounds,topk_keys,decode,qbhist,router [--json PATH] [--write]

A variant is a set of config entries (``amdqb.configs.override``): the launchers read their
config while a CUDA graph is captured, so each graph holds its variant's kernels (built from the
variant's ``-D`` constants) and launch shapes. Every variant's outputs are checked against the
default's (or the oracle) before it is timed; timing is ``amdqb.bench.common.time_alternating``.

* ``route``  -- the lds route kernel's tile (``hip.route.lds_block`` x ``lds_items``) against the
  atomic kernel, masked layout, uniform and all-one-expert ids, M in {512, 2517, 8192};
* ``gate``   -- atomic vs lds at small M for E in {256, 896, 2048}: the crossover behind
  ``route.lds_gate_scale``;
* ``align``  -- amdqb_align's single-block crossover and tile shape (tile scale, smallest tile,
  most tiles; E=256, k=8, block 64);
* ``align_threads`` -- the tiled align's rank-block threads (buckets per thread);
* ``align_rank_first`` -- the tiled align's rank pass: amdqb_align or amdqb_align_tiles;
* ``align_plan`` -- the one-block, planned (one block scans, its dependent places) and tiled
  aligns side by side: the routes where each is taken and the planned form's tile;
* ``align_cluster`` -- one thread block cluster (NVIDIA sm_90+) against the other forms: the
  routes where it is taken and its blocks' tile;
* ``topk``   -- amdqb_topk's threads per block at the serving shapes;
* ``topk_lanes`` -- amdqb_topk's experts per lane (decode and wide) and the switch between them;
* ``topk_rounds`` -- amdqb_topk's row Top-k by list merges or by rounds of a butterfly max, over T;
* ``topk_keys`` -- amdqb_topk's row Top-k over 32-bit keys first or over the 64-bit entries, by E;
* ``decode`` -- one block per token against one warp per token over T: the decode thresholds;
* ``qbhist`` -- the two-kernel histogram pass's launch shape;
* ``router`` -- the router's register cap at few tokens (``hip.router.few_tokens_min_blocks``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys

import torch

import amdqb
from amdqb import configs, dispatch, ref

from .common import Report, TimingConfig, environment, time_alternating, write_json
from .route import check_rows, make_ids

E, K, B = 896, 16, 1000


def _with(values: dict, fn):
    """``fn`` run with the config entries ``values`` of this device's architecture."""
    arch = dispatch.device_info("cuda").arch_family

    def call():
        with configs.override(arch, values, "tuning variant"):
            return fn()

    return call


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _qb_inputs(dev, g, e=E, b=B):
    bias = (torch.randn(e, generator=g) * 0.05).to(dev)
    bounds = torch.stack([bias.min() - 1, bias.max() + 1]).contiguous()
    amdqb.mark_qb_bin_bounds_validated(bounds)
    return bias, bounds, torch.zeros(e, b, dtype=torch.int32, device=dev)


def route_tiles(dev, cfg, shapes=((256, 5), (512, 2), (512, 4), (1024, 2), (1024, 4))):
    report = Report("tune_route_tiles", environment(dev))
    g = torch.Generator().manual_seed(0)
    totals: dict = {}
    for m in (512, 2517, 8192):
        for dist in ("uniform", "one"):
            ids = make_ids(m, K, E, dist, g).to(dev)
            cap = m * K

            def run(impl, ids=ids, cap=cap):
                return amdqb.moe_route_rows(ids, E, capacity=cap, impl=impl, backend="hip")

            impls = {"atomic": lambda run=run: run("atomic")}
            for block, items in shapes:
                values = {"hip.route.lds_block": block, "hip.route.lds_items": items}
                impls[f"{block}x{items}"] = _with(values, lambda run=run: run("lds"))
            for fn in impls.values():
                check_rows(*fn(), ids, E, cap)
            times = time_alternating(impls, dev, cfg)
            for name, us in times.items():
                report.add(M=m, dist=dist, impl=name, us=us)
                if name != "atomic":
                    totals[name] = totals.get(name, 0.0) + us
    best = min(totals, key=totals.get)
    block, items = map(int, best.split("x"))
    why = f"{best}: {totals[best]:.2f} us summed over M = 512 / 2517 / 8192 x uniform / one expert"
    return report, {"hip.route.lds_block": (block, why), "hip.route.lds_items": (items, why)}


def route_gate(dev, cfg, experts=(256, 896, 2048), ms=(8, 32, 128, 512, 2048)):
    report = Report("tune_route_gate", environment(dev))
    g = torch.Generator().manual_seed(0)
    ahead = []
    for e in experts:
        for m in ms:
            ids = make_ids(m, K, e, "uniform", g).to(dev)
            for cap in (m * K, None):
                impls = {
                    impl: lambda impl=impl, ids=ids, cap=cap, e=e: amdqb.moe_route_rows(
                        ids, e, capacity=cap, impl=impl, backend="hip"
                    )
                    for impl in ("atomic", "lds")
                }
                for fn in impls.values():
                    check_rows(*fn(), ids, e, cap)
                t = time_alternating(impls, dev, cfg)
                layout = "compact" if cap is None else "masked"
                report.add(E=e, M=m, layout=layout, atomic_us=t["atomic"], lds_us=t["lds"])
                ahead.append(t["lds"] <= t["atomic"])
    if all(ahead):
        return report, {"route.lds_gate_scale": (0.0, "lds ahead of atomic at every M measured")}
    return report, {}


def align_tiles(dev, cfg, tokens=(64, 256, 512, 1024, 2048, 8192, 32768, 131072)):
    """amdqb_align in one block against the tiled form (histogram + rank passes) at E=256, k=8,
    block 64 (DeepSeek-V3), over the tile scale, the smallest tile and the most tiles: the
    single-block crossover and the tile shape with the least summed time ratio to the best
    variant at each M from 256 tokens on (every size counts alike, not the largest most)."""
    e, k, bs = 256, 8, 64
    report = Report("tune_align", environment(dev), shape=dict(E=e, k=k, block=bs))
    g = torch.Generator().manual_seed(0)
    tiled = {
        f"scale{sc}_min{mr}_tiles{mt}": {
            "hip.align.single_block_routes": 0,
            "hip.align.tile_scale": sc,
            "hip.align.max_tiles": mt,
            "hip.align.min_tile_routes": mr,
        }
        for sc in (4, 8, 16)
        for mr in (256, 512)
        for mt in (64, 128)
    }
    variants = {"single": {"hip.align.single_block_routes": 1 << 30}, **tiled}
    best_at, ratios = {}, {}
    for m in tokens:
        ids = make_ids(m, k, e, "uniform", g).to(dev)
        want = ref.moe_align_block_size(ids.cpu(), bs, e)
        impls = {
            name: _with(values, lambda: amdqb.moe_align_block_size(ids, bs, e, backend="hip"))
            for name, values in variants.items()
            if name != "single" or m * k <= 65536  # one block for everything: small inputs
        }
        for name, fn in impls.items():
            assert _same([x.cpu() for x in fn()], want), f"align {name} M={m} differs"
        times = time_alternating(impls, dev, cfg)
        for name, us in times.items():
            report.add(M=m, routes=m * k, variant=name, us=us)
        if m >= 256:
            fastest = min(us for name, us in times.items() if name != "single")
            for name, us in times.items():
                if name != "single":
                    ratios[name] = ratios.get(name, 0.0) + us / fastest
        # one block wins within 1% of the best (at the smallest sizes a tiled shape is one tile)
        best_at[m * k] = "single" in times and times["single"] <= 1.01 * min(times.values())
    shape = min(ratios, key=ratios.get)
    single = max([n for n, wins in best_at.items() if wins], default=0)
    values = tiled[shape]
    counted = sum(1 for m in tokens if m >= 256)
    why_tiles = (
        f"{shape}: {ratios[shape] / counted:.3f}x the best variant on average over M >= 256 "
        "(E=256, k=8, block 64)"
    )
    why_single = f"one block within 1% of the best up to {single} routes (E=256, k=8, block 64)"
    return report, {
        "hip.align.single_block_routes": (single, why_single),
        "hip.align.tile_scale": (values["hip.align.tile_scale"], why_tiles),
        "hip.align.max_tiles": (values["hip.align.max_tiles"], why_tiles),
        "hip.align.min_tile_routes": (values["hip.align.min_tile_routes"], why_tiles),
    }


def align_rank_threads(
    dev, cfg, shapes=((256, 8), (257, 8), (896, 16)), tokens=(512, 2048, 8192), blocks=(1, 2, 4, 16)
):
    """The tiled align's rank-block threads: at most ``hip.align.rank_buckets_per_thread``
    buckets a thread (each sums its buckets' tile columns in turn), block 64, at E = 256 (vLLM's
    DeepSeek-V3 form), 257 (SGLang's, one bucket more) and 896 (k=16); the value with the least
    summed time ratio to the best at each shape wins."""
    report = Report("tune_align_rank_threads", environment(dev), shape=dict(block=64))
    g = torch.Generator().manual_seed(0)
    variants = {f"buckets{b}": {"hip.align.rank_buckets_per_thread": b} for b in blocks}
    ratios = {name: 0.0 for name in variants}
    seen = {}
    for e, k in shapes:
        for m in tokens:
            ids = make_ids(m, k, e, "uniform", g).to(dev)
            want = ref.moe_align_block_size(ids.cpu(), 64, e)
            impls = {
                name: _with(
                    values, lambda e=e: amdqb.moe_align_block_size(ids, 64, e, backend="hip")
                )
                for name, values in variants.items()
            }
            for name, fn in impls.items():
                assert _same([x.cpu() for x in fn()], want), f"align {name} E={e} M={m} differs"
            times = time_alternating(impls, dev, cfg)
            fastest = min(times.values())
            for name, us in times.items():
                report.add(E=e, k=k, M=m, variant=name, us=us)
                ratios[name] += us / fastest
            seen[(e, m)] = times
    best = min(ratios, key=ratios.get)
    cases = len(shapes) * len(tokens)
    # the shape where the winner gains most over 16 buckets a thread
    (e, m), times = max(seen.items(), key=lambda kv: kv[1]["buckets16"] / kv[1][best])
    why = (
        f"{best}: {times[best]:.2f} vs {times['buckets16']:.2f} us with 16 at E={e} M={m}; "
        f"{ratios[best] / cases:.3f}x the best on average over E = 256 / 257 / 896, "
        "M = 512 / 2048 / 8192 (block 64)"
    )
    return report, {
        "hip.align.rank_buckets_per_thread": (
            variants[best]["hip.align.rank_buckets_per_thread"],
            why,
        )
    }


def _align_variants(variants: dict, ids, block: int, num_experts: int) -> dict:
    """One hip align call per variant (its config entries), each checked bitwise against the
    oracle before it is timed."""
    want = ref.moe_align_block_size(ids.cpu(), block, num_experts)
    impls = {
        name: _with(
            values, lambda: amdqb.moe_align_block_size(ids, block, num_experts, backend="hip")
        )
        for name, values in variants.items()
    }
    for name, fn in impls.items():
        got = [x.cpu() for x in fn()]
        assert _same(got, want), f"align {name} E={num_experts} M={ids.shape[0]} differs"
    return impls


def align_rank_first(
    dev,
    cfg,
    shapes=((256, 8, 16), (256, 8, 64), (256, 8, 128), (257, 8, 64), (896, 16, 64)),
    tokens=(512, 1024, 2048, 8192, 32768),
):
    """The tiled form's rank pass, amdqb_align (ranks after the wait) against amdqb_align_tiles
    (ranks before it; ``hip.align.tiles_rank_first``), the planned form off, at E = 256 (vLLM's
    DeepSeek-V3 form, blocks 16 / 64 / 128), 257 (SGLang's buckets) and 896 (k=16): the kernel
    with the least summed time ratio to the faster one at each shape wins."""
    report = Report("tune_align_rank_first", environment(dev))
    g = torch.Generator().manual_seed(0)
    variants = {
        name: {"hip.align.plan_max_routes": 0, "hip.align.tiles_rank_first": first}
        for name, first in (("amdqb_align", False), ("amdqb_align_tiles", True))
    }
    ratios = {name: 0.0 for name in variants}
    for e, k, bs in shapes:
        for m in tokens:
            ids = make_ids(m, k, e, "uniform", g).to(dev)
            impls = _align_variants(variants, ids, bs, e)
            times = time_alternating(impls, dev, cfg)
            fastest = min(times.values())
            for name, us in times.items():
                report.add(E=e, k=k, block=bs, M=m, routes=m * k, variant=name, us=us)
                ratios[name] += us / fastest
    best = min(ratios, key=ratios.get)
    cases = len(shapes) * len(tokens)
    why = (
        f"{best} ranks: {ratios[best] / cases:.3f}x the faster on average against "
        f"{max(ratios.values()) / cases:.3f}x (E = 256 / 257 / 896, M = 512 to 32768)"
    )
    return report, {"hip.align.tiles_rank_first": (best == "amdqb_align_tiles", why)}


def align_plan_routes(
    dev,
    cfg,
    shapes=((256, 8, 16), (256, 8, 64), (256, 8, 128), (257, 8, 64), (896, 16, 64)),
    tokens=(8, 16, 32, 64, 128, 256, 512, 1024, 2048),
    tiles=((128, 8), (256, 8), (256, 16), (512, 8)),
):
    """The three align forms side by side -- one block, planned (amdqb_align_plan +
    amdqb_align_place; ``tiles``: its smallest tile and most tiles) and tiled (amdqb_align_hist +
    amdqb_align) -- at E = 256 (vLLM's DeepSeek-V3 form, blocks 16 / 64 / 128), 257 (SGLang's
    buckets) and 896 (k=16), M tokens. Each form is judged by its time ratio to the fastest,
    summed over the shapes at each route count: ``hip.align.single_block_routes`` is the most
    routes up to which one block is within 1% of the least sum; each planned variant is taken up
    to the most routes where its sum stays below the tiled form's (``plan_max_routes``), and the
    variant whose policy (planned there, tiled beyond) has the least sum past one block wins."""
    report = Report("tune_align_plan", environment(dev))
    g = torch.Generator().manual_seed(0)
    # the tiled form with its smallest tiles 32 routes: two or more tiles from 256 routes on (below,
    # one tile is the one-block form)
    tiled = {
        "hip.align.single_block_routes": 0,
        "hip.align.plan_max_routes": 0,
        "hip.align.min_tile_routes": 32,
    }
    variants = {"single": {"hip.align.single_block_routes": 1 << 30}, "tiled": tiled}
    for t, most in tiles:
        variants[f"planned{t}x{most}"] = {
            "hip.align.single_block_routes": 0,
            "hip.align.plan_max_routes": 1 << 30,
            "hip.align.plan_tile_routes": t,
            "hip.align.plan_max_tiles": most,
        }
    ratio: dict = {}  # routes -> variant -> summed ratio to the fastest
    for e, k, bs in shapes:
        for m in tokens:
            ids = make_ids(m, k, e, "uniform", g).to(dev)
            # one block for everything: small inputs only
            kept = {n: v for n, v in variants.items() if n != "single" or m * k <= 8192}
            impls = _align_variants(kept, ids, bs, e)
            t = time_alternating(impls, dev, cfg)
            fastest = min(t.values())
            sums = ratio.setdefault(m * k, {"shapes": 0.0})
            sums["shapes"] += 1
            for name in variants:
                if name in t:
                    report.add(E=e, k=k, block=bs, M=m, routes=m * k, variant=name, us=t[name])
                sums[name] = sums.get(name, 0.0) + t.get(name, float("inf")) / fastest
    counts = sorted(ratio)
    single = 0
    for r in counts:  # ratios averaged over the shapes of each route count
        shapes_r = ratio[r].pop("shapes")
        ratio[r] = {name: x / shapes_r for name, x in ratio[r].items()}
    for r in counts:
        if ratio[r]["single"] > 1.01 * min(ratio[r].values()):
            break
        single = r
    past = [r for r in counts if r > single]

    def reach(name) -> int:  # the most routes up to which the planned variant beats tiled
        most = single
        for r in past:
            if ratio[r][name] >= ratio[r]["tiled"]:
                break
            most = r
        return most

    def policy(name) -> float:  # the planned variant up to its reach, tiled beyond
        return sum(ratio[r][name] if r <= reach(name) else ratio[r]["tiled"] for r in past)

    name = min((n for n in variants if n.startswith("planned")), key=policy)
    most = reach(name)
    t, cap = (
        variants[name]["hip.align.plan_tile_routes"],
        variants[name]["hip.align.plan_max_tiles"],
    )
    why_single = f"one block within 1% of the fastest on average up to {single} routes"
    why_tile = (
        f"{name} up to {most} routes, tiled beyond: {policy(name) / max(1, len(past)):.3f}x the "
        f"fastest form on average past {single} routes (E = 256 / 257 / 896)"
    )
    why_most = f"{name} faster than tiled on average up to {most} routes" + (
        f" ({ratio[most][name]:.3f}x vs {ratio[most]['tiled']:.3f}x the fastest there)"
        if most > single
        else ""
    )
    return report, {
        "hip.align.single_block_routes": (single, why_single),
        "hip.align.plan_tile_routes": (t, why_tile),
        "hip.align.plan_max_tiles": (cap, why_tile),
        "hip.align.plan_max_routes": (most, why_most),
    }


def align_cluster_routes(
    dev,
    cfg,
    shapes=((256, 8, 16), (256, 8, 64), (256, 8, 128), (257, 8, 64), (896, 16, 64)),
    tokens=(32, 64, 128, 256, 512, 1024, 2048, 4096),
    tiles=(256, 512, 1024, 2048),
):
    """The cluster align (amdqb_align_cluster: one launch of one thread block cluster, each block
    ``tiles`` routes or more, at most 8 blocks) against the forms the config takes without it, at
    E = 256 (blocks 16 / 64 / 128), 257 and 896 (k=16), M tokens. Each tile's variant is taken up
    to the most routes where its time ratio to the fastest, averaged over the shapes, stays below
    the config's (``hip.align.cluster_max_routes``; 0 where it never does); the variant whose
    policy (cluster there, the config's forms beyond) has the least sum wins."""
    report = Report("tune_align_cluster", environment(dev))
    g = torch.Generator().manual_seed(0)
    variants = {"config": {"hip.align.cluster_max_routes": 0}}
    for t in tiles:
        variants[f"cluster{t}"] = {
            "hip.align.cluster_max_routes": 1 << 30,
            "hip.align.cluster_tile_routes": t,
            "hip.align.cluster_blocks": 8,
        }
    ratio: dict = {}  # routes -> variant -> summed ratio to the fastest
    for e, k, bs in shapes:
        for m in tokens:
            ids = make_ids(m, k, e, "uniform", g).to(dev)
            t = time_alternating(_align_variants(variants, ids, bs, e), dev, cfg)
            fastest = min(t.values())
            sums = ratio.setdefault(m * k, {"shapes": 0})
            sums["shapes"] += 1
            for name, us in t.items():
                report.add(E=e, k=k, block=bs, M=m, routes=m * k, variant=name, us=us)
                sums[name] = sums.get(name, 0.0) + us / fastest
    for r in ratio:  # ratios averaged over the shapes of each route count
        shapes_r = ratio[r].pop("shapes")
        ratio[r] = {name: x / shapes_r for name, x in ratio[r].items()}
    single = configs.load(dispatch.device_info(dev).arch_family)["hip.align.single_block_routes"]
    counts = sorted(r for r in ratio if r > single)

    def reach(name) -> int:  # the most routes up to which the variant beats the config's forms
        most = 0
        for r in counts:
            if ratio[r][name] >= ratio[r]["config"]:
                break
            most = r
        return most

    def policy(name) -> float:
        return sum(ratio[r][name] if r <= reach(name) else ratio[r]["config"] for r in counts)

    name = min((n for n in variants if n != "config"), key=policy)
    most = reach(name)
    cases = max(1, len(counts))
    without = sum(ratio[r]["config"] for r in counts) / cases
    why = (
        f"{name} up to {most} routes: {policy(name) / cases:.3f}x the fastest on average against "
        f"{without:.3f}x without it (E = 256 / 257 / 896)"
    )
    if most:
        why += f"; at {most} routes {ratio[most][name]:.3f}x vs {ratio[most]['config']:.3f}x"
    return report, {
        "hip.align.cluster_max_routes": (most, why),
        "hip.align.cluster_tile_routes": (variants[name]["hip.align.cluster_tile_routes"], why),
    }


def _topk_shape(e, score_function, groups, g, dev):
    """(bias or None, biased_topk keywords) of a serving shape: a bias with sigmoid scores,
    ``groups`` = (num_groups, group_topk) or None."""
    bias = (torch.randn(e, generator=g) * 0.1).to(dev) if score_function == "sigmoid" else None
    kw = dict(score_function=score_function)
    if groups:
        kw.update(num_groups=groups[0], group_topk=groups[1])
    return bias, kw


def topk_blocks(dev, cfg, blocks=(64, 128, 256, 512), tokens=(1, 256, 4096, 16384)):
    """amdqb_topk's threads per block at the serving shapes (E=8 / 128 softmax, E=256 grouped
    sigmoid with a bias, E=384 sigmoid with a bias)."""
    report = Report("tune_topk", environment(dev))
    g = torch.Generator().manual_seed(0)
    totals: dict = {}
    shapes = [
        (8, 2, torch.float32, "softmax", None),
        (128, 8, torch.bfloat16, "softmax", None),
        (256, 8, torch.float32, "sigmoid", (8, 4)),
        (384, 8, torch.float32, "sigmoid", None),
    ]
    for e, k, dtype, sf, groups in shapes:
        bias, kw = _topk_shape(e, sf, groups, g, dev)
        for t in tokens:
            x = torch.randn(t, e, generator=g).to(dev, dtype)
            want = amdqb.biased_topk(x, k, bias, backend="torch", **kw)
            impls = {
                f"block{b}": _with(
                    {"hip.topk.block": b},
                    lambda x=x, bias=bias: amdqb.biased_topk(x, k, bias, backend="hip", **kw),
                )
                for b in blocks
            }
            for name, fn in impls.items():
                got = fn()
                assert torch.equal(got[1], want[1]), f"topk {name} E={e} T={t} ids differ"
            for name, us in time_alternating(impls, dev, cfg).items():
                report.add(E=e, k=k, T=t, variant=name, us=us)
                totals[name] = totals.get(name, 0.0) + us
    best = min(totals, key=totals.get)
    why = f"{best}: {totals[best]:.1f} us summed over E = 8 / 128 / 256 / 384, T = 1 .. 16384"
    return report, {"hip.topk.block": (int(best[5:]), why)}


def topk_lanes(dev, cfg, tokens=(1, 64, 256, 1024, 4096, 16384), slots=(1, 2, 4, 8)):
    """amdqb_topk's experts per lane without groups (E=8 k=2 fp32 and E=128 k=8 bf16 softmax,
    vLLM's fused_topk shapes): every ``slots`` value as the one plan for every T, then the decode
    value, the wide value and the token count between them that minimise the time summed over
    the shapes and T."""
    report = Report("tune_topk_lanes", environment(dev))
    g = torch.Generator().manual_seed(0)
    times: dict = {}  # (shape, T) -> {slots: us}
    for e, k, dtype in ((8, 2, torch.float32), (128, 8, torch.bfloat16)):
        for t in tokens:
            x = torch.randn(t, e, generator=g).to(dev, dtype)
            want = amdqb.biased_topk(x, k, score_function="softmax", backend="torch")
            impls = {
                s: _with(
                    {"hip.topk.wide_min_tokens": 1, "hip.topk.lane_slots": s},
                    lambda x=x: amdqb.biased_topk(x, k, score_function="softmax", backend="hip"),
                )
                for s in slots
            }
            outs = {s: fn() for s, fn in impls.items()}
            for s, got in outs.items():  # the softmax and weight sums keep their order
                assert torch.equal(got[1], want[1]), f"topk slots {s} E={e} T={t} ids differ"
                assert _same(got, outs[slots[0]]), f"topk slots {s} E={e} T={t} bits differ"
            measured = time_alternating(impls, dev, cfg)
            for s, us in measured.items():
                report.add(E=e, k=k, T=t, slots=s, us=us)
            times[(e, t)] = measured
    return report, lane_choice(times, tokens)


def lane_choice(times: dict, tokens) -> dict:
    """The decode and wide experts per lane, the token count between them and the experts a row
    needs for the wide form, minimising the time summed over ``times`` ((E, T) -> {slots: us})."""
    slots = sorted(next(iter(times.values())))
    best = None
    for min_experts in sorted({1, *(e for e, _ in times)}):
        for wide_min in (*tokens, 1 << 30):
            for decode in slots:
                for wide in slots:
                    total = sum(
                        row[decode if t < wide_min or e < min_experts else wide]
                        for (e, t), row in times.items()
                    )
                    if best is None or total < best[0] - 1e-9:
                        best = (total, decode, wide, wide_min, min_experts)
    total, decode, wide, wide_min, min_experts = best
    why = (
        f"{decode} / {wide} experts per lane below / from T={wide_min} at E >= {min_experts}: "
        f"{total:.1f} us summed over E = {' / '.join(str(e) for e in sorted({e for e, _ in times}))} "
        f"softmax, T = {tokens[0]} .. {tokens[-1]}"
    )
    return {
        "hip.topk.decode_lane_slots": (decode, why),
        "hip.topk.lane_slots": (wide, why),
        "hip.topk.wide_min_tokens": (wide_min, why),
        "hip.topk.wide_min_experts": (min_experts, why),
    }


def _topk_variant_pair(dev, cfg, report, shapes, tokens, key, pair):
    """Times amdqb_topk under two values of the config entry ``key`` (``pair``: ((name, value),
    (name, value)), the first checked against the oracle, the second bit for bit against the
    first) at each serving shape of ``shapes`` and each T of ``tokens``; adds a report row per
    (E, T) and returns {(E, T): {name: us}}."""
    g = torch.Generator().manual_seed(0)
    (first, _), (second, _) = pair
    times: dict = {}
    for e, k, dtype, sf, groups in shapes:
        bias, kw = _topk_shape(e, sf, groups, g, dev)
        for t in tokens:
            x = torch.randn(t, e, generator=g).to(dev, dtype)
            want = amdqb.biased_topk(x, k, bias, backend="torch", **kw)
            impls = {
                name: _with(
                    {key: value},
                    lambda x=x, bias=bias, kw=kw: amdqb.biased_topk(
                        x, k, bias, backend="hip", **kw
                    ),
                )
                for name, value in pair
            }
            outs = {name: fn() for name, fn in impls.items()}
            assert torch.equal(outs[first][1], want[1]), f"topk E={e} T={t} ids differ"
            assert _same(outs[second], outs[first]), f"topk {second} E={e} T={t} differ"
            measured = time_alternating(impls, dev, cfg)
            report.add(E=e, k=k, T=t, **{f"{n}_us": us for n, us in measured.items()})
            times[(e, t)] = measured
    return times


_NEVER = 1 << 30


def topk_rounds(dev, cfg, tokens=(1, 256, 1024, 4096, 8192, 16384)):
    """amdqb_topk's row Top-k by list merges against rounds of a butterfly max over T (E=128 k=8
    bf16 softmax; DeepSeek-V3's grouped gate): the smallest T of the sweep from which rounds win
    at every larger T of both shapes."""
    report = Report("tune_topk_rounds", environment(dev))
    shapes = [
        (128, 8, torch.bfloat16, "softmax", None),
        (256, 8, torch.float32, "sigmoid", (8, 4)),
    ]
    pair = (("merges", _NEVER), ("rounds", 1))
    times = _topk_variant_pair(dev, cfg, report, shapes, tokens, "hip.topk.rounds_min_tokens", pair)
    wins = {
        t: all(times[(e, t)]["rounds"] < times[(e, t)]["merges"] for e, *_ in shapes)
        for t in tokens
    }
    start = _NEVER
    for t in sorted(tokens, reverse=True):
        if not wins[t]:
            break
        start = t
    why = (
        f"rounds ahead of merges from T={start} on (E=128 k=8 bf16, E=256 grouped), "
        f"sweep T = {tokens[0]} .. {tokens[-1]}"
        if start != _NEVER
        else f"merges ahead at T={tokens[-1]} (E=128 k=8 bf16, E=256 grouped)"
    )
    return report, {"hip.topk.rounds_min_tokens": (start, why)}


def topk_keys(dev, cfg, tokens=(1, 8, 64, 256, 1024, 4096, 16384)):
    """amdqb_topk's row Top-k over 32-bit keys first (list merges: rounds yield to it) against
    the 64-bit entries alone (list merges, rounds from hip.topk.rounds_min_tokens tokens on) at
    the serving shapes (E=8 k=2 fp32 and E=128 k=8 bf16 softmax, DeepSeek-V3's grouped gate):
    the smallest E of the sweep from which the keys take less time summed over T at that E and
    every larger one."""
    report = Report("tune_topk_keys", environment(dev))
    shapes = [
        (8, 2, torch.float32, "softmax", None),
        (128, 8, torch.bfloat16, "softmax", None),
        (256, 8, torch.float32, "sigmoid", (8, 4)),
    ]
    pair = (("entries", _NEVER), ("keys", 1))
    times = _topk_variant_pair(
        dev, cfg, report, shapes, tokens, "hip.topk.key_select_min_experts", pair
    )
    totals = {
        e: {n: sum(times[(e, t)][n] for t in tokens) for n in ("entries", "keys")}
        for e, *_ in shapes
    }
    start = _NEVER
    for e in sorted(totals, reverse=True):
        if totals[e]["keys"] >= totals[e]["entries"]:
            break
        start = e
    why = (
        "; ".join(
            f"E={e}: keys / entries {row['keys']:.1f} / {row['entries']:.1f} us"
            for e, row in sorted(totals.items())
        )
        + f" summed over T = {tokens[0]} .. {tokens[-1]}"
    )
    return report, {"hip.topk.key_select_min_experts": (start, why)}


def decode_sweep(dev, cfg, tokens=(1, 64, 256, 512, 768, 1024, 2048)):
    """The largest T at which one block per token is at least as fast as one warp per token."""
    report = Report("tune_decode", environment(dev))
    g = torch.Generator().manual_seed(0)
    bias, bounds, hist = _qb_inputs(dev, g)
    big = 1 << 30
    forms = {
        "hip.biased_topk.decode_max_tokens": lambda z: amdqb.biased_topk(z, K, bias, backend="hip"),
        "hip.router.decode_max_tokens": lambda z: amdqb.fused_topk_with_score_function(
            z, K, expert_bias=bias, backend="hip"
        ),
        "hip.router.decode_max_tokens_fused": lambda z: amdqb.fused_topk_with_score_function(
            z,
            K,
            expert_bias=bias,
            qb_histogram=hist,
            qb_bin_bounds=bounds,
            qb_histogram_mode="fused_atomic",
            backend="hip",
        ),
    }
    best = {key: 0 for key in forms}
    for t in tokens:
        z = torch.randn(t, E, generator=g).to(dev)
        for key, form in forms.items():
            impls = {
                "block_per_token": _with({key: big}, lambda form=form: form(z)),
                "warp_per_token": _with({key: 0}, lambda form=form: form(z)),
            }
            outs = [impls[name]() for name in impls]
            if key != "hip.router.decode_max_tokens_fused":  # the histogram accumulates
                assert _same(*outs), f"{key}: the two kernels differ at T={t}"
            times = time_alternating(impls, dev, cfg)
            report.add(T=t, threshold=key, **{f"{n}_us": us for n, us in times.items()})
            if times["block_per_token"] <= times["warp_per_token"]:
                best[key] = max(best[key], t)
    why = "largest T of the sweep where one block per token is at least as fast"
    return report, {key: (value, why) for key, value in best.items()}


def qb_hist_shapes(dev, cfg, shapes=((1024, 0, 8, 1, 2), (1024, 1, 8, 1, 2), (512, 1, 8, 2, 2))):
    """(threads, blocks per CU of the token slices, experts per block, min blocks, unroll)."""
    report = Report("tune_qb_hist", environment(dev))
    g = torch.Generator().manual_seed(0)
    bias, bounds, _ = _qb_inputs(dev, g)
    totals: dict = {}
    keys = (
        "hip.qb_hist.block",
        "hip.qb_hist.blocks_per_cu",
        "hip.qb_hist.max_experts_per_block",
        "hip.qb_hist.min_blocks",
        "hip.qb_hist.unroll",
    )
    for t in (1024, 4096, 16384):
        z = torch.randn(t, E, generator=g).to(dev)

        def qb(h, z=z):
            return amdqb.fused_topk_with_score_function(
                z,
                K,
                expert_bias=bias,
                qb_histogram=h,
                qb_bin_bounds=bounds,
                qb_histogram_mode="two_kernel",
                backend="hip",
            )

        want = torch.zeros(E, B, dtype=torch.int32, device=dev)
        qb(want)
        impls = {}
        for shape in shapes:
            values = dict(zip(keys, shape))
            got = torch.zeros_like(want)
            _with(values, lambda got=got: qb(got))()
            name = "x".join(map(str, shape))
            assert torch.equal(got, want), f"histogram differs with {name}"
            impls[name] = _with(values, lambda: qb(torch.zeros_like(want)))
        for name, us in time_alternating(impls, dev, cfg).items():
            report.add(T=t, shape=name, us=us)
            totals[name] = totals.get(name, 0.0) + us
    best = min(totals, key=totals.get)
    why = f"{best} (threads x slices/CU x experts x min blocks x unroll): {totals[best]:.1f} us"
    return report, {key: (int(v), why) for key, v in zip(keys, best.split("x"))}


def router_caps(dev, cfg, caps=(2, 3)):
    report = Report("tune_router_caps", environment(dev))
    g = torch.Generator().manual_seed(0)
    bias = (torch.randn(E, generator=g) * 0.05).to(dev)
    wins = {}
    for t in (1024, 4096, 8192):
        z = torch.randn(t, E, generator=g).to(dev)
        impls = {
            f"cap{c}": _with(
                {"hip.router.few_tokens": 1 << 30, "hip.router.few_tokens_min_blocks": c},
                lambda: amdqb.fused_topk_with_score_function(z, K, expert_bias=bias, backend="hip"),
            )
            for c in caps
        }
        outs = [fn() for fn in impls.values()]
        assert _same(*outs), f"router caps differ at T={t}"
        times = time_alternating(impls, dev, cfg)
        for name, us in times.items():
            report.add(T=t, cap=name, us=us)
        wins[t] = min(times, key=times.get)
    few = max((t for t, name in wins.items() if name == "cap2"), default=0)
    return report, {"hip.router.few_tokens": (few, f"cap 2 ahead of cap 3 up to T={few}")}


PARTS = {
    "route": route_tiles,
    "gate": route_gate,
    "align": align_tiles,
    "align_threads": align_rank_threads,
    "align_rank_first": align_rank_first,
    "align_plan": align_plan_routes,
    "align_cluster": align_cluster_routes,
    "topk": topk_blocks,
    "topk_lanes": topk_lanes,
    "topk_rounds": topk_rounds,
    "topk_keys": topk_keys,
    "decode": decode_sweep,
    "qbhist": qb_hist_shapes,
    "router": router_caps,
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m amdqb.bench.tune", description=__doc__)
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated sweeps")
    parser.add_argument("--json", default=None, help="append the measurements to this file")
    parser.add_argument("--write", action="store_true", help="write the winners to the config")
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {unknown}; choose from {list(PARTS)}")
    if not torch.cuda.is_available():
        parser.error("the sweeps time hip kernels on a GPU; none is visible")
    dev = torch.device("cuda")
    info = dispatch.device_info(dev)
    cfg = TimingConfig()
    date = dt.date.today().isoformat()
    reports, winners = [], {}
    for part in parts:
        report, chosen = PARTS[part](dev, cfg)
        print(report.markdown(), flush=True)
        reports.append(report)
        provenance = f"measured: {info.name}, {date}, python -m amdqb.bench.tune --parts {part}"
        winners.update({k: (v, provenance, why) for k, (v, why) in chosen.items()})
    for key, (value, _provenance, why) in winners.items():
        print(f"{key} = {value}  ({why})")
    if args.json:
        write_json(args.json, reports)
    if args.write:
        print(f"wrote {configs.write(info.arch_family, winners)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
