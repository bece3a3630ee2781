"""amdqb bench SUITE: microbenchmarks of amdqb's kernels against their baselines.

Every case is checked against the oracle before it is timed. Tables carry the device, versions,
commit, shape and timing method, and p20 / p50 / p80 microseconds per call; --json PATH appends
every suite's rows (with "env": device, arch, versions, commit, date) to a JSON file keyed by
table title, the format of bench/results/h200.json.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import traceback

import torch

from ..devices import as_device
from . import SUITE_HELP, balance, chunks, common, compat, route, router, serving
from .common import TimingConfig, quick_config, write_json

SUITES = {
    "route": route.run,
    "router": router.run,
    "chunks": chunks.run,
    "balance": balance.run,
    "serving": serving.run,
    "compat": compat.run,
}

# What --tokens / --experts / --topk set in each suite (None: the flag does not apply).
FLAG_KEYS = {
    "route": ("tokens", "num_experts", "topk"),
    "router": ("tokens", "num_experts", "topk"),
    "chunks": ("tokens", "experts", None),
    "balance": ("tokens", "num_experts", "topk"),
    "serving": ("buckets", "num_experts", "topk"),
    "compat": (None, None, None),
}


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _int_list(text: str) -> tuple[int, ...]:
    values = tuple(_positive_int(v) for v in text.split(",") if v.strip())
    if not values:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers, got {text!r}"
        )
    return values


def build_parser() -> argparse.ArgumentParser:
    suites = "\n".join(f"  {name:8s} {text}" for name, text in SUITE_HELP.items())
    parser = argparse.ArgumentParser(
        prog="amdqb bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            f"suites:\n{suites}\n\n"
            "--tokens sets the token / route counts (router T, route M, chunks N, balance T,\n"
            "serving batch buckets); --experts E (chunks: experts per rank) and --topk k where the\n"
            "suite has them. On a CPU the shapes are small unless given, and torch runs with\n"
            "--threads intra-op threads (default 1). Targets and peer anchors of docs/targets.md were\n"
            "measured on an H200 and appear only in rows measured on one."
        ),
    )
    parser.add_argument("suite", choices=list(SUITE_HELP), metavar="SUITE", help="see below")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if any)")
    parser.add_argument("--json", default=None, metavar="PATH", help="append the rows to PATH")
    parser.add_argument("--quick", action="store_true", help="few samples and small shapes")
    parser.add_argument("--samples", type=_positive_int, default=None, help="timed samples")
    parser.add_argument(
        "--calls", type=_positive_int, default=None, help="calls per sample (captured per graph)"
    )
    parser.add_argument(
        "--tokens", type=_int_list, default=None, metavar="N[,N...]", help="token counts"
    )
    parser.add_argument("--experts", type=_positive_int, default=None, help="experts E")
    parser.add_argument("--topk", type=_positive_int, default=None, help="experts per token k")
    parser.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="torch CPU threads during the run (default 1 on a CPU; unchanged on a GPU)",
    )
    return parser


def _shapes(args, small: bool, names: list[str]) -> dict:
    shapes = {
        "route": dict(tokens=(64, 256), num_experts=128) if small else {},
        "router": dict(tokens=(64, 256), num_experts=128, decode_tokens=(1, 8)) if small else {},
        "chunks": dict(tokens=(512,), hidden=256) if small else {},
        "balance": dict(num_experts=128, num_bins=64) if small else {},
        "serving": dict(buckets=(1, 8), config="small") if small else {},
        "compat": {},
    }
    for name in names:
        for key, value in zip(FLAG_KEYS[name], (args.tokens, args.experts, args.topk)):
            if key is not None and value is not None:
                shapes[name][key] = value
    return shapes


def _effective(name: str, shape: dict) -> tuple[int | None, int | None]:
    """(E, k) a suite will run with: the shape's, else the run function's defaults."""
    params = inspect.signature(SUITES[name]).parameters

    def value(key):
        if key in shape:
            return shape[key]
        default = params[key].default if key in params else None
        return default if isinstance(default, int) else None

    if name == "serving":
        from amdqb import serving as layer

        moe = layer.KIMI_K3_TP8 if shape.get("config", "kimi") == "kimi" else layer.SMALL
        return shape.get("num_experts", moe.num_experts), shape.get("topk", moe.topk)
    return value("num_experts"), value("topk")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.experts is not None and args.topk is not None and args.topk >= args.experts:
        parser.error(f"--topk must be below --experts, got {args.topk} >= {args.experts}")
    try:
        device = as_device(args.device, name="--device")
    except ValueError as exc:
        parser.error(str(exc))
    cfg = quick_config() if args.quick or device.type == "cpu" else TimingConfig()
    if args.samples:
        cfg.samples = args.samples
    if args.calls:
        cfg.calls = args.calls
    small = args.quick or device.type == "cpu"
    names = list(SUITES) if args.suite == "all" else [args.suite]
    shapes = _shapes(args, small, names)
    for name in names:
        e, k = _effective(name, shapes[name])
        if e is not None and k is not None and not 0 < k < e:
            parser.error(f"suite {name}: need 0 < topk < experts, got topk={k}, experts={e}")

    saved_threads = torch.get_num_threads()
    threads = args.threads or (1 if device.type == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    if device.type == "cuda":
        method = f"graph replay, {cfg.calls} calls x {cfg.replays} replays"
    else:
        method = f"eager wall time, {cfg.calls} calls"
    common.RUN_INFO = {
        "timing": f"{method}, {cfg.samples} samples, p20/p50/p80 us per call"
        + (f", torch threads {threads}" if threads else ""),
        "threads": torch.get_num_threads(),
    }
    common.AUTOSAVE = args.json
    failed = []
    try:
        for name in names:
            try:
                reports = SUITES[name](device, cfg, **shapes[name])
            except Exception:  # report and go on: one broken suite must not hide the others
                traceback.print_exc()
                failed.append(name)
                continue
            for report in reports:
                print(report.markdown(), flush=True)
            if args.json:
                write_json(args.json, reports)
    finally:
        torch.set_num_threads(saved_threads)
    if args.json:
        print(f"results written to {args.json}", file=sys.stderr)
    if failed:
        print(f"failed suites: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
