"""``amdqb demo``'s command line: options, the run(s), summary.json and the figures."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

from .methods import METHOD_NAMES, REFERENCE, SHORT, build_methods
from .plot import have_matplotlib, plot, plot_scales
from .report import (
    print_step,
    print_step_header,
    report,
    report_scales,
    step_table_rows,
    summarise,
)
from .run import simulate
from .streams import SUITE, SUITE_KINDS, Stream

DEFAULT_LOGIT_SCALE = 1.5
COMPARE_SCALES = (1.0, 3.0, 10.0, 20.0)
KIMI = {"experts": 896, "topk": 16, "tokens": 16384}
DEFAULTS = {"experts": 64, "topk": 4, "tokens": 4096}
DEFAULT_STEPS = 100

EPILOG = """\
--logit-scale sets the std of the router logits. At the default (1.5) every QB method reaches the
per-batch sampling floor within a few steps (late MaxVio ~0.24; no balancing ~4.3; the sign rule
~1.3). As the scale grows the sigmoid saturates: at 10 K3's uniform histogram cannot resolve the
cutoff and fp32 s + b starts to tie; at 20 it ties for most tokens and only the tie-free selection
balances. The reference (exact64) is exact tie-free QB in float64. Try --compare-scales (four
runs) and --stream shift (the router is redrawn half-way)."""


def _scale_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--scales: {err}") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError("--scales needs positive numbers, e.g. 1,3,10,20")
    return values


def _method_list(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [n for n in names if n not in METHOD_NAMES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"--methods: unknown {bad}; choose from {', '.join(METHOD_NAMES)} (the reference "
            f"{REFERENCE} always runs)"
        )
    return names


def build_parser() -> argparse.ArgumentParser:
    from .._cli_types import float_range, int_range  # ranged argparse types: errors name the option

    pos = int_range(1)
    parser = argparse.ArgumentParser(
        prog="amdqb demo",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Balance a drifting, skewed token stream on the same logits every step: none, the\n"
            "aux-loss-free sign rule, K3 QB (uniform histogram, B=1000, TE's selection), the\n"
            "default amdqb.QuantileBalancer (tie-free, per-expert log_margin, B=64) and QB with\n"
            "the exact fp32 quantile, against exact tie-free QB in float64. Prints MaxVio per\n"
            "step (each of the first steps) and a summary (the first steps, the first step within\n"
            "1.5x of the reference, the late mean), writes <out>/summary.json and\n"
            "<out>/qb_demo.png (matplotlib, optional). --compare-scales runs logit std 1, 3, 10,\n"
            "20 instead and prints one table."
        ),
        epilog=EPILOG,
    )
    parser.add_argument(
        "--device", default=None, help="torch device (default: cpu; cuda for --kimi)"
    )
    parser.add_argument(
        "--kimi", action="store_true", help="Kimi K3 shape: E=896, k=16, T=16384 (meant for a GPU)"
    )
    parser.add_argument(
        "--stream",
        choices=SUITE_KINDS,
        default="drift",
        help="the token stream (default drift; shift redraws the router at --shift-at)",
    )
    parser.add_argument(
        "--shift-at", type=pos, default=None, help="the shift stream's step (default steps // 2)"
    )
    parser.add_argument(
        "--steps", type=pos, default=DEFAULT_STEPS, help=f"training steps (default {DEFAULT_STEPS})"
    )
    parser.add_argument("--tokens", type=pos, default=None, help="tokens per step (default 4096)")
    parser.add_argument("--experts", type=int_range(2), default=None, help="experts E (default 64)")
    parser.add_argument("--topk", type=pos, default=None, help="experts per token k (default 4)")
    parser.add_argument("--dim", type=pos, default=64, help="router input width d (default 64)")
    parser.add_argument("--seed", type=int_range(0), default=0, help="stream seed (default 0)")
    parser.add_argument(
        "--logit-scale",
        type=float_range(0.0, open_low=True),
        default=DEFAULT_LOGIT_SCALE,
        help=f"std of the router logits (default {DEFAULT_LOGIT_SCALE:g}; try 10 or 20)",
    )
    parser.add_argument(
        "--compare-scales",
        action="store_true",
        help="run every method at each of --scales and print one MaxVio table (methods x scales); "
        "writes <out>/compare_scales.json and <out>/qb_compare_scales.png",
    )
    parser.add_argument(
        "--scales",
        type=_scale_list,
        default=list(COMPARE_SCALES),
        help="logit stds for --compare-scales (default 1,3,10,20)",
    )
    parser.add_argument(
        "--methods",
        type=_method_list,
        default=list(METHOD_NAMES),
        help=f"comma-separated subset (default {','.join(METHOD_NAMES)}; the reference "
        f"{REFERENCE} always runs)",
    )
    parser.add_argument(
        "--hot",
        type=int_range(0),
        default=None,
        help="number of hot experts (default E // 16; the favoured stream has none)",
    )
    parser.add_argument(
        "--bins",
        type=int_range(2, 1 << 16),
        default=1000,
        help="bins B of K3's uniform histogram (default 1000)",
    )
    parser.add_argument(
        "--margin-bins",
        type=int_range(64, 256),
        default=64,
        help="bins B of the default balancer's log_margin histogram (even, 64-256; default 64)",
    )
    parser.add_argument(
        "--aux-rate", type=float_range(0.0), default=1e-3, help="sign-rule step (default 1e-3)"
    )
    parser.add_argument(
        "--window", type=pos, default=40, help="late window for the summary (default 40 steps)"
    )
    parser.add_argument(
        "--print-every",
        type=int_range(0),
        default=0,
        help="table row every N steps after the first six (default steps // 10)",
    )
    parser.add_argument(
        "--threads",
        type=int_range(0),
        default=1,
        help="torch CPU threads for the run (default 1: the per-step tensors are small and extra "
        "intra-op threads only add overhead, badly so on a busy CPU; 0 leaves torch's setting)",
    )
    parser.add_argument("--out", default="demo_out", help="output folder (default ./demo_out)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    return parser


def _versions() -> dict:
    import amdqb

    versions = {
        "amdqb": amdqb.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    try:
        import matplotlib

        versions["matplotlib"] = matplotlib.__version__
    except ImportError:
        versions["matplotlib"] = None
    return versions


def _device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} logical CPUs)"


def router_backend(method, device: torch.device, experts: int, topk: int) -> str:
    """The backend the amdqb router picks for ``method`` (``fp64 ref`` for the reference)."""
    from .. import dispatch
    from ..backends.calls import RouterCall

    if method.selection == "fp64":
        return "fp64 ref"
    balancer = getattr(method, "balancer", None)
    call = RouterCall(
        experts,
        topk,
        selection=method.selection,
        qb_mode="auto" if balancer is not None else None,
        qb_binning=balancer.binning if balancer is not None else "uniform",
        num_bins=balancer.num_bins if balancer is not None else 0,
    )
    return dispatch.select("router_fwd", device, None, call).backend


def make_stream(args, device: torch.device, logit_scale: float) -> Stream:
    options = dict(SUITE[args.stream])
    if args.hot is not None:
        options["num_hot"] = args.hot
    if args.stream == "shift":
        options["shift_at"] = args.shift_at
    return Stream(args.tokens, args.experts, args.dim, logit_scale, args.seed, device, **options)


def _simulate(args, device, logit_scale, names, quiet=False, label=""):
    """Build the stream and the methods, run the loop; returns them and the loop's wall time."""
    stream = make_stream(args, device, logit_scale)
    methods = build_methods(
        names,
        args.experts,
        args.topk,
        device,
        uniform_bins=args.bins,
        margin_bins=args.margin_bins,
        aux_rate=args.aux_rate,
    )
    every = args.print_every or max(1, args.steps // 10)
    rows = set(step_table_rows(args.steps, every))
    if not quiet:
        print_step_header(methods)

    def on_step(step, hist):
        if not quiet and step in rows:
            print_step(step, hist, methods)

    start = time.perf_counter()
    hist = simulate(stream, methods, args.steps, on_step=on_step, label=label)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return stream, methods, hist, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    from ..devices import as_device

    args = build_parser().parse_args(argv)
    preset = KIMI if args.kimi else DEFAULTS
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.device is None:
        args.device = "cuda" if args.kimi and torch.cuda.is_available() else "cpu"
    try:
        device = as_device(args.device, name="--device")  # the package's one device parser
    except ValueError as exc:
        print(f"amdqb demo: error: {exc}", file=sys.stderr)
        return 2
    if args.kimi and device.type == "cpu":
        print("note: --kimi on the CPU is slow; pass --device cuda on a GPU", file=sys.stderr)
    if not 0 < args.topk < args.experts:
        print(
            f"error: need 0 < --topk < --experts, got {args.topk}, {args.experts}", file=sys.stderr
        )
        return 2
    if args.margin_bins % 2:
        print(f"error: --margin-bins must be even, got {args.margin_bins}", file=sys.stderr)
        return 2
    if args.shift_at is None:
        args.shift_at = args.steps // 2
    shift_at = args.shift_at if args.stream == "shift" else None
    window = min(args.window, args.steps)
    names = [*args.methods, REFERENCE]

    import amdqb

    config = {
        "experts": args.experts,
        "topk": args.topk,
        "tokens": args.tokens,
        "steps": args.steps,
        "dim": args.dim,
        "seed": args.seed,
        "stream": args.stream,
        "shift_at": shift_at,
        "logit_scale": args.logit_scale,
        "bins": args.bins,
        "margin_bins": args.margin_bins,
        "aux_rate": args.aux_rate,
        "window": window,
        "threads": args.threads,
        "methods": names,
    }
    scales = args.scales if args.compare_scales else [args.logit_scale]
    if args.compare_scales:
        config["logit_scales"] = scales
        del config["logit_scale"]
    print(f"amdqb {amdqb.__version__} demo on {device} ({_device_description(device)})")
    std = ", ".join(f"{s:g}" for s in scales)
    print(
        f"E={args.experts} k={args.topk} T={args.tokens} steps={args.steps} logit std~{std} "
        f"stream {args.stream}"
        + (f" (shift at {shift_at})" if shift_at is not None else "")
        + f" seed={args.seed}"
    )

    threads = torch.get_num_threads()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    per_scale, hists, walls = {}, {}, {}
    try:
        for scale in scales:
            label = f"std {scale:g} " if args.compare_scales else ""
            stream, methods, hist, wall = _simulate(
                args, device, scale, names, quiet=args.compare_scales, label=label
            )
            per_scale[scale] = summarise(methods, hist, window, shift_at)
            hists[scale], walls[scale] = hist, wall
            if args.compare_scales:
                print(f"  logit std {scale:g}: {args.steps} steps in {wall:.1f} s", flush=True)
    finally:
        torch.set_num_threads(threads)
    backends = {m.name: router_backend(m, device, args.experts, args.topk) for m in methods}
    print("router backends: " + ", ".join(f"{SHORT[n]} {b}" for n, b in backends.items()))
    common = {
        "config": config,
        "device": str(device),
        "device_name": _device_description(device),
        "router_backend": backends,
        "versions": _versions(),
        "hot_experts": stream.hot.tolist(),
    }
    os.makedirs(args.out, exist_ok=True)

    if args.compare_scales:
        report_scales(methods, per_scale, window)
        total = sum(walls.values())
        print(f"\n{len(scales)} x {args.steps} steps in {total:.1f} s")
        summary = {
            **common,
            "wall_s": {f"{s:g}": walls[s] for s in scales},
            "maxvio_table": {
                m.name: {f"{s:g}": per_scale[s][m.name]["late_maxvio"] for s in scales}
                for m in methods
            },
            "first_hit_table": {
                m.name: {f"{s:g}": per_scale[s][m.name].get("first_hit") for s in scales}
                for m in methods
            },
            "scales": {f"{s:g}": per_scale[s] for s in scales},
        }
        path = os.path.join(args.out, "compare_scales.json")
        with open(path, "w") as f:
            json.dump(summary, f, indent=1)
        print(f"wrote {path}")
        if not args.no_plot and have_matplotlib():
            png = os.path.join(args.out, "qb_compare_scales.png")
            plot_scales(png, methods, per_scale, config, window)
            print(f"wrote {png}")
        return 0

    final = per_scale[args.logit_scale]
    hist, wall = hists[args.logit_scale], walls[args.logit_scale]
    report(methods, final, window)
    print(f"\n{args.steps} steps in {wall:.1f} s")
    summary = {
        **common,
        "wall_s": wall,
        "logit_std_step0": stream.first_std,
        "methods": final,
    }
    summary_path = os.path.join(args.out, "summary.json")
    with open(summary_path, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"wrote {summary_path}")

    if not args.no_plot and have_matplotlib():
        png = os.path.join(args.out, "qb_demo.png")
        plot(png, methods, hist, final, config, window)
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
