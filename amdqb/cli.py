"""``amdqb info | demo | bench``: the command line (also ``python -m amdqb``).

Every command parses its options with argparse: ``amdqb COMMAND --help`` lists them, an unknown
command or a bad option value is named in an error with exit status 2 (the range types of
``amdqb._cli_types``, shared with ``amdqb demo``).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import textwrap

from .bench import SUITE_HELP as BENCH_SUITES

COMMAND_HELP = {
    "info": (
        "device, architecture and backends",
        "the device (vendor, arch, wave size, LDS, CUs), the library versions, every backend "
        "(available or why not) and the backend chosen for every op, with the reason",
    ),
    "demo": (
        "QB balancing at a glance",
        "six balancers (none / aux-loss-free sign rule / QB uniform / QB log_margin / QB exact / "
        "QB tie-free) on one drifting, skewed token stream: MaxVio per step, cutoff diagnostics, "
        "summary.json and a plot; --compare-scales over logit stds",
    ),
    "bench": (
        "microbenchmarks (suites below)",
        "kernels vs baselines, each case checked against the oracle first; tables with the "
        "device / versions / shape header and p20 / p50 / p80 us per call; --json PATH",
    ),
}


# ------------------------------------------------------------------------------------------------
# Commands
# ------------------------------------------------------------------------------------------------
def _info(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="amdqb info", description=COMMAND_HELP["info"][1])
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
    from .devices import as_device

    try:
        device = dispatch.device_info(as_device(args.device, name="--device")).device
    except ValueError as exc:
        parser.error(str(exc))
    built = _build_ops(device) if args.build else None
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
    from .bench import cli as bench_cli

    return bench_cli.main(argv)


COMMANDS = {"info": _info, "demo": _demo, "bench": _bench}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: its help lists every command (and bench's suites)."""
    from . import __version__

    suites = "\n".join(f"    {name:8s} {text}" for name, text in BENCH_SUITES.items())
    details = "\n".join(
        textwrap.fill(text[1], 96, initial_indent=f"  {name:7s}", subsequent_indent=" " * 9)
        for name, text in COMMAND_HELP.items()
    )
    parser = argparse.ArgumentParser(
        prog="amdqb",
        description="amdqb: exact, graph-safe MoE routing kernels with Quantile Balancing.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            f"{details}\n\nbench suites (amdqb bench SUITE):\n{suites}\n\n"
            "amdqb COMMAND --help lists a command's options."
        ),
    )
    parser.add_argument("--version", action="version", version=f"amdqb {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, (short, _) in COMMAND_HELP.items():
        sub.add_parser(name, help=short, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in COMMANDS:
            return COMMANDS[argv[0]](argv[1:])
        parser = build_parser()
        if not argv:
            parser.print_help()
            return 0
        parser.parse_args(argv)  # --help / --version exit 0; anything else is an error (2)
        parser.error(f"unknown command {argv[0]!r}")
    except SystemExit as exc:  # argparse's exits, as a status (the entry point exits with it)
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 2)
    return 2
