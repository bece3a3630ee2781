"""``amdqb bench route | router | chunks | balance | all``."""

from __future__ import annotations

import argparse
import sys
import traceback

import torch

from . import balance, chunks, route, router, serving
from . import common
from .common import TimingConfig, quick_config, write_json

SUITES = {
    "route": route.run,
    "router": router.run,
    "chunks": chunks.run,
    "balance": balance.run,
    "serving": serving.run,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="amdqb bench", description=__doc__)
    parser.add_argument("suite", choices=[*SUITES, "all"])
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--json", default=None, help="append results to this JSON file")
    parser.add_argument("--quick", action="store_true", help="few samples and small shapes")
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--calls", type=int, default=None, help="calls captured per graph")
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = quick_config() if args.quick or device.type == "cpu" else TimingConfig()
    if args.samples:
        cfg.samples = args.samples
    if args.calls:
        cfg.calls = args.calls
    small = args.quick or device.type == "cpu"
    shapes = {
        "route": dict(tokens=(64, 256), num_experts=128) if small else {},
        "router": dict(tokens=(64, 256), num_experts=128, decode_tokens=(1, 8)) if small else {},
        "chunks": dict(tokens=(512,), hidden=256) if small else {},
        "balance": dict(num_experts=128, num_bins=200) if small else {},
        "serving": dict(buckets=(1, 8), config="small") if small else {},
    }
    common.AUTOSAVE = args.json
    names = list(SUITES) if args.suite == "all" else [args.suite]
    failed = []
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
    if args.json:
        print(f"results written to {args.json}", file=sys.stderr)
    if failed:
        print(f"failed suites: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
