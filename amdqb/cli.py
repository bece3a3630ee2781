"""``amdqb info | demo | bench``: the command line (also ``python -m amdqb``)."""

from __future__ import annotations

import argparse
import json
import platform
import sys


def _info(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="amdqb info", description=__doc__)
    parser.add_argument("--device", default=None, help="device to describe (default: cuda if any)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument(
        "--build",
        action="store_true",
        help="first run every op that builds kernels at run time once, at a small shape, so that "
        "build failures (and the fallbacks they cause) are found and listed",
    )
    args = parser.parse_args(argv)

    import torch

    from . import __version__, dispatch

    built = _build_ops(dispatch.device_info(args.device).device) if args.build else None
    report = dispatch.report(args.device)
    if built is not None:
        report["build"] = built
    versions = {
        "amdqb": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch.version.cuda": torch.version.cuda,
        "torch.version.hip": torch.version.hip,
    }
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        versions["triton"] = None
    report["versions"] = versions
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print("amdqb", __version__)
    print("versions:", ", ".join(f"{k}={v}" for k, v in versions.items()))
    print("device:")
    for key, value in report["device"].items():
        print(f"  {key:12s} {value}")
    print("backends:")
    for name, status in report["backends"].items():
        mark = "yes" if status["available"] else "no "
        print(f"  {name:7s} {mark}  {status['reason']}")
    print("op -> backend (why):")
    for op, status in report["ops"].items():
        line = f"  {op:17s} {status['backend'] or '-':7s} {status['reason']}"
        if status["fallback"]:
            line += f"; should its kernels fail to build: {status['fallback']}"
        print(line)
        failed = [n for n, why in status["rejected"].items() if why.startswith("failed to build")]
        if failed:
            print(f"  {'':17s} {'':7s} passed over {', '.join(failed)}: failed to build (below)")
    pref = report["preference"]
    if pref is not None:
        if pref["error"]:
            print(f"AMDQB_BACKEND ignored: {pref['error']}")
        else:
            print(f"AMDQB_BACKEND={pref['backend']} (a preference; backend= on an op is strict):")
            print(f"  followed by: {', '.join(pref['follow']) or '-'}")
            for op, fb in pref["fell_back"].items():
                print(f"  {op:17s} -> {fb['backend']:7s} {pref['backend']}: {fb['why']}")
    if report["failures"]:
        print("build failures (the op runs on its next backend on this device):")
        for f in report["failures"]:
            print(f"  {f['op']:17s} {f['backend']:7s} {f['cause']}")
    if report.get("build"):
        print("--build: ran " + ", ".join(f"{op} ({r})" for op, r in report["build"].items()))
    config = report["config"]
    files = (
        "default.json"
        if config["arch"] == "default"
        else f"{config['arch']}.json over default.json"
    )
    print(f"config (amdqb/configs/{files}):")
    for key, entry in config["entries"].items():
        print(
            f"  {key:42s} {json.dumps(entry['value']):20s} [{entry['file']}] {entry['provenance']}"
        )
    return 0


def _build_ops(device: str) -> dict[str, str]:
    """Run each op of the hip backend once at a small shape on ``device`` (E=64, k=4, 32 tokens):
    its kernels are compiled or loaded (disk cache), and a build failure is recorded and makes the
    op fall back, as in a real run. Returns ``{op: "ok" or the error}``."""
    import warnings

    import torch

    import amdqb
    from amdqb import dispatch

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 64, generator=g).to(device)
    ids = torch.randint(0, 64, (32, 4), generator=g, dtype=torch.int32).to(device)
    calls = {
        "router_fwd": lambda: amdqb.fused_topk_with_score_function(logits, 4),
        "biased_topk": lambda: amdqb.biased_topk(logits, 4),
        "route_rows": lambda: amdqb.moe_route_rows(ids, 64),
        "align_block_size": lambda: amdqb.moe_align_block_size(ids, 16, 64),
    }
    ran = {}
    for op, call in calls.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # the report lists the failure
                call()
            if device.startswith("cuda"):
                torch.cuda.synchronize(device)
            ran[op] = "ok"
        except Exception as exc:  # report, do not stop: the other ops still tell something
            ran[op] = f"error: {dispatch.failure_cause(exc)}"
    return ran


def _demo(argv: list[str]) -> int:
    from . import demo

    return demo.main(argv)


def _bench(argv: list[str]) -> int:
    # bench/ lives next to the package in a source checkout (it is not installed).
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if (root / "bench" / "cli.py").exists() and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        from bench import cli as bench_cli
    except ImportError as exc:
        print(
            "amdqb bench needs the repository's bench/ folder on the path "
            f"(run from a source checkout): {exc}",
            file=sys.stderr,
        )
        return 2
    return bench_cli.main(argv)


COMMANDS = {"info": _info, "demo": _demo, "bench": _bench}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: amdqb {info,demo,bench} [options]   (amdqb <command> --help for details)")
        print("  info   device, architecture, backends and the backend chosen for every op")
        print("  demo   QB balancing at a glance: none / aux-free / QB histogram / QB exact")
        print("  bench  microbenchmarks: route | router | chunks | balance")
        return 0 if argv and argv[0] in ("-h", "--help") else (2 if argv else 0)
    return COMMANDS[argv[0]](argv[1:])
