"""Balance of the QB variants as the router's sigmoid saturates: methods x logit std x seeds.

Every method of ``amdqb demo`` plus the fp64 exact reference routes the same drifting, skewed
stream (``amdqb.demo.Stream``) through the real amdqb router and balancer (the reference through
``amdqb.ref.qb.route_fp64``); the figure of merit is the mean MaxVio of the last ``--window``
steps. Writes ``results.json`` next to this file (or ``--out``) and prints the tables.

    python bench/results/qb_balance_under_saturation/study.py            # both shapes
    python bench/results/qb_balance_under_saturation/study.py --shapes 64x4x4096 --seeds 0
    python bench/results/qb_balance_under_saturation/study.py --shapes 256x8x8192 --append
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))  # the repository root: this checkout's amdqb and bench

import torch

import amdqb
from amdqb import demo
from amdqb.ref import qb as ref_qb

METHODS = (*demo.METHOD_NAMES, demo.REFERENCE)
STDS = (1.0, 3.0, 10.0, 20.0)


def parse_shape(text: str) -> tuple[int, int, int]:
    e, k, t = (int(v) for v in text.split("x"))
    return e, k, t


def run_one(shape, std, seed, steps, window, dim=64) -> dict:
    """One stream, every method: late MaxVio and the cutoff diagnostics per method."""
    e, k, t = shape
    device = torch.device("cpu")
    stream = demo.Stream(t, e, dim, std, seed, device, num_hot=max(1, e // 16))
    methods = demo.build_methods(
        METHODS, e, k, device, uniform_bins=1000, margin_bins=64, aux_rate=1e-3
    )
    args = SimpleNamespace(steps=steps, print_every=0)
    start = time.perf_counter()
    with torch.no_grad():
        hist = demo.run(args, methods, stream, quiet=True)
    wall = time.perf_counter() - start
    final = demo.summarise(methods, hist, window)
    return {
        "wall_s": wall,
        "methods": {
            name: {
                key: row[key]
                for key in ("late_maxvio", "late_margin_below_bin", "late_tie_at_cutoff")
            }
            for name, row in final.items()
        },
    }


# --------------------------------------------------------------------------------------------
# Ablation at the saturated end: which part of tie-free log_margin QB limits it?
# --------------------------------------------------------------------------------------------
class TieFreeExactQuantile(demo.Method):
    """Tie-free fp32 selection (the router's values ``b - sigmoid(-z)``, oracle order) with the
    exact ``k/E`` quantile of the fp32 margins ``d = alpha - v`` as the bias change: the
    selection without the histogram."""

    name = "tie_free_exact"
    label = "tie-free selection + exact margin quantile"
    selection = "tie_free"

    def route(self, logits):
        from amdqb.ref.router import qb_cutoff_and_routes, sigmoid_complement

        s = torch.sigmoid(logits.float())
        c = sigmoid_complement(logits)
        idx, alpha, values = qb_cutoff_and_routes(s, self.bias, self.topk, "tie_free", c)
        self._margin = alpha[:, None] - values
        routing_map = torch.zeros_like(values, dtype=torch.bool)
        return routing_map.scatter_(1, idx, True)

    def update(self, logits, tokens_per_expert):
        d = self._margin.double()
        m, e = d.shape
        n = -(-m * self.topk // e)
        srt = torch.sort(d, dim=0).values
        delta = (srt[n - 1] + srt[min(n, m - 1)]) / 2
        self.bias.copy_(ref_qb.centre((self.bias.double() + delta).float()))


class Fp64LogMargin(demo.Method):
    """fp64 routing (``route_fp64``, float64 bias) with the log_margin histogram (64 bins, the
    product's bin index and recovery) of the float64 margins: the histogram without fp32."""

    name = "fp64_log_margin"
    label = "fp64 routing + log_margin histogram (B=64)"
    selection = "fp64"

    def __init__(self, experts, topk, device, num_bins=64):
        super().__init__(experts, topk, device)
        self._bias = torch.zeros(experts, dtype=torch.float64, device=device)
        self.num_bins = num_bins

    def route(self, logits):
        routing_map, alpha, s = ref_qb.route_fp64(logits, self.topk, self.bias)
        self._margin = alpha[:, None] - (s + self.bias)
        return routing_map

    def update(self, logits, tokens_per_expert):
        from amdqb.ref.router import qb_margin_bin_index

        e, b = self.bias.numel(), self.num_bins
        scale = ref_qb.margin_scale(self.bias)
        bins = qb_margin_bin_index(self._margin.float(), scale, b)
        flat = (bins + torch.arange(e, device=bins.device)[None, :] * b).reshape(-1)
        hist = torch.bincount(flat, minlength=e * b).reshape(e, b).to(torch.int32)
        new = self.bias + ref_qb.recover_margin_delta(hist, scale, self.topk)
        self.bias.copy_(new - new.mean())


class Fp64TieFreeExact(demo.Method):
    """Exact QB in float64 ranking by ``v = b - sigmoid(-z)`` (float64): the order of
    ``s + b``, with ``1 - s`` kept to full relative precision up to z ~ 745, where float64
    ``s + b`` saturates above z ~ 36.7. Required bias ``r = alpha - v + b``."""

    name = "fp64_tie_free_exact"
    label = "exact QB, fp64, ranked by b - sigmoid(-z)"
    selection = "fp64_tie_free"

    def __init__(self, experts, topk, device):
        super().__init__(experts, topk, device)
        self._bias = torch.zeros(experts, dtype=torch.float64, device=device)

    def route(self, logits):
        c = torch.sigmoid(-logits.double())
        v = self.bias - c
        order = torch.sort(v, dim=1, descending=True, stable=True).indices[:, : self.topk + 1]
        alpha = v.gather(1, order[:, self.topk :])
        self._r = alpha + c  # the bias at which each expert's v reaches alpha
        routing_map = torch.zeros_like(v, dtype=torch.bool)
        return routing_map.scatter_(1, order[:, : self.topk], True)

    def update(self, logits, tokens_per_expert):
        m, e = self._r.shape
        n = -(-m * self.topk // e)
        srt = torch.sort(self._r, dim=0).values
        new = (srt[n - 1] + srt[min(n, m - 1)]) / 2
        self.bias.copy_(new - new.mean())


def run_ablation(shape, std, seed, steps, window, bins=(32, 64, 128, 256), dim=64) -> dict:
    e, k, t = shape
    device = torch.device("cpu")
    stream = demo.Stream(t, e, dim, std, seed, device, num_hot=max(1, e // 16))
    methods = []
    for b in bins:
        m = demo.QBBalancer(e, k, device, "log_margin", b, selection="tie_free")
        m.name = f"tie_free_B{b}"
        methods.append(m)
    methods += [
        TieFreeExactQuantile(e, k, device),
        Fp64LogMargin(e, k, device),
        Fp64TieFreeExact(e, k, device),
    ]
    methods += demo.build_methods(
        [demo.REFERENCE], e, k, device, uniform_bins=1000, margin_bins=64, aux_rate=1e-3
    )
    with torch.no_grad():
        hist = demo.run(SimpleNamespace(steps=steps, print_every=0), methods, stream, quiet=True)
    final = demo.summarise(methods, hist, window)
    return {
        name: {"label": row["label"], "late_maxvio": row["late_maxvio"]}
        for name, row in final.items()
    }


def aggregate(runs: dict) -> dict:
    """Per method: the seed-mean late MaxVio, its ratio to the reference's seed mean, and the
    smallest and largest per-seed ratio."""
    seeds = list(runs)
    ref = [runs[s]["methods"][demo.REFERENCE]["late_maxvio"] for s in seeds]
    out = {}
    for name in METHODS:
        vals = [runs[s]["methods"][name]["late_maxvio"] for s in seeds]
        ratios = [v / r for v, r in zip(vals, ref)]
        out[name] = {
            "mean_maxvio": statistics.fmean(vals),
            "ratio_of_means": statistics.fmean(vals) / statistics.fmean(ref),
            "min_ratio": min(ratios),
            "max_ratio": max(ratios),
            "mean_tie_at_cutoff": statistics.fmean(
                runs[s]["methods"][name]["late_tie_at_cutoff"] for s in seeds
            ),
        }
        below = [runs[s]["methods"][name]["late_margin_below_bin"] for s in seeds]
        out[name]["mean_margin_below_bin"] = None if None in below else statistics.fmean(below)
    return out


def print_tables(shape_key: str, agg: dict, seeds) -> None:
    stds = list(agg)
    head = "".join(f"{'std ' + s:>20s}" for s in stds)
    print(f"\n{shape_key}: mean MaxVio over seeds {seeds} (x fp64 reference; per-seed range)")
    print(f"{'method':<16s}{head}")
    for name in METHODS:
        cells = ""
        for s in stds:
            a = agg[s][name]
            cell = (
                f"{a['mean_maxvio']:.3f} ({a['ratio_of_means']:.2f}x "
                f"{a['min_ratio']:.2f}-{a['max_ratio']:.2f})"
            )
            cells += f"{cell:>20s}" if len(cell) < 20 else f" {cell}"
        print(f"{demo.SHORT[name]:<16s}{cells}")
    print(f"{'tie at cutoff':<16s}" + "".join(f"{'':>20s}" for _ in stds))
    for name in METHODS:
        cells = "".join(f"{100 * agg[s][name]['mean_tie_at_cutoff']:19.1f}%" for s in stds)
        print(f"{demo.SHORT[name]:<16s}{cells}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="64x4x4096,256x8x8192", help="ExKxT, comma-separated")
    parser.add_argument("--seeds", default="0,1,2", help="seeds for the first shape")
    parser.add_argument("--seeds-large", default="0", help="seeds for the other shapes")
    parser.add_argument("--stds", default=",".join(f"{s:g}" for s in STDS))
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--window", type=int, default=40)
    parser.add_argument("--out", default=str(HERE / "results.json"))
    parser.add_argument(
        "--ablation",
        action="store_true",
        help="only the ablation at the largest std for each shape (tie-free QB: bins, the "
        "selection without the histogram, the histogram without fp32, a float64 reference "
        "ranked by b - sigmoid(-z)); adds it to --out",
    )
    parser.add_argument(
        "--append", action="store_true", help="keep the other shapes already in --out"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    stds = [float(s) for s in args.stds.split(",")]
    results = {
        "question": "late MaxVio of each QB variant against exact QB in fp64, by logit std",
        "config": {
            "steps": args.steps,
            "window": args.window,
            "stds": stds,
            "uniform_bins": 1000,
            "margin_bins": 64,
            "aux_rate": 1e-3,
            "stream": "amdqb.demo.Stream defaults (dim 64, E//16 hot experts, +1.0, drift 0.25)",
        },
        "versions": {"amdqb": amdqb.__version__, "torch": torch.__version__},
        "machine": f"{platform.machine()} CPU, 1 torch thread",
        "shapes": {},
    }
    if args.append and Path(args.out).is_file():
        stored = json.loads(Path(args.out).read_text())
        results["shapes"] = stored["shapes"]
        if "ablation" in stored:
            results["ablation"] = stored["ablation"]
    if args.ablation:
        stored = json.loads(Path(args.out).read_text()) if Path(args.out).is_file() else results
        stored.setdefault("ablation", {})
        std = max(stds)
        for i, shape in enumerate(shapes):
            seeds = [int(v) for v in (args.seeds if i == 0 else args.seeds_large).split(",")]
            key = "E{}_k{}_T{}".format(*shape)
            runs = {}
            for seed in seeds:
                runs[str(seed)] = run_ablation(shape, std, seed, args.steps, args.window)
                print(f"ablation {key} std {std:g} seed {seed}: done", flush=True)
            names = list(runs[str(seeds[0])])
            stored["ablation"][key] = {
                "std": std,
                "seeds": seeds,
                "runs": runs,
                "mean_maxvio": {
                    name: statistics.fmean(runs[s][name]["late_maxvio"] for s in runs)
                    for name in names
                },
            }
            print(key, json.dumps(stored["ablation"][key]["mean_maxvio"], indent=1))
            Path(args.out).write_text(json.dumps(stored, indent=1))
        return 0
    for i, shape in enumerate(shapes):
        seeds = [int(s) for s in (args.seeds if i == 0 else args.seeds_large).split(",")]
        key = "E{}_k{}_T{}".format(*shape)
        per_std, agg = {}, {}
        for std in stds:
            runs = {}
            for seed in seeds:
                runs[str(seed)] = run_one(shape, std, seed, args.steps, args.window)
                print(
                    f"{key} std {std:g} seed {seed}: {runs[str(seed)]['wall_s']:.0f} s",
                    flush=True,
                )
            per_std[f"{std:g}"] = runs
            agg[f"{std:g}"] = aggregate(runs)
        results["shapes"][key] = {"seeds": seeds, "runs": per_std, "summary": agg}
        print_tables(key, agg, seeds)
        Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
