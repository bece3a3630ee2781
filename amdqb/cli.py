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
    args = parser.parse_args(argv)

    import torch

    from . import __version__, dispatch

    report = dispatch.report(args.device)
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
        print(f"  {op:17s} {status['backend'] or '-':7s} {status['reason']}")
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
