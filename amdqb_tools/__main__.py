"""AMD build and code-object tools (not part of the amdqb package: ``import amdqb`` never imports
them).

    python -m amdqb_tools build [--toolchain clang-22] [--arch gfx942] [--libs rocm7] [-j N]
                                [--rebuild]   (--libs: device-library sets, default every one found)
    python -m amdqb_tools inspect FILE.hsaco [--asm FILE.s] [--json]
    python -m amdqb_tools table [--write docs/amd_occupancy.md | --check docs/amd_occupancy.md]
    python -m amdqb_tools configs [--write]   the occupancy-derived AMD config entries (those
                                              that differ from default.json's are stored)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from .build import build_all
from .code_objects import inspect, inspect_build
from .occupancy import RULES, occupancy
from .table import render_sections, stale_sections, write_sections
from .toolchain import (
    DEVICE_LIB_SETS,
    Toolchain,
    device_bitcode_source,
    missing_toolchains,
    toolchains,
)


def _select(args) -> list[Toolchain]:
    tcs = toolchains()
    if args.toolchain:
        tcs = [tc for tc in tcs if tc.name in args.toolchain]
    if not tcs:
        raise SystemExit("no toolchain: " + "; ".join(missing_toolchains()))
    return tcs


def _cmd_build(args) -> int:
    start = time.perf_counter()
    libs = tuple(args.libs) or tuple(
        lb for lb in DEVICE_LIB_SETS if device_bitcode_source(lb) is not None
    )
    builds = build_all(
        _select(args),
        archs=tuple(args.arch) or None,
        jobs=args.jobs,
        rebuild=args.rebuild,
        libs=libs,
    )
    wall = time.perf_counter() - start
    failed = 0
    for b in sorted(builds.values(), key=lambda b: b.label):
        status = "cached" if b.cached else f"{b.seconds:.1f}s"
        if not b.ok:
            failed += 1
            print(f"FAIL {b.label}\n{b.log[-3000:]}")
            continue
        co = inspect_build(b)
        print(
            f"ok   {b.label:55s} {status:>7s} kernels={len(co.kernels)} undefined={len(co.undefined)}"
            f" calls={len(co.calls)} -> {b.hsaco}"
        )
    print(f"{len(builds)} builds, {failed} failed, {wall:.1f}s wall")
    return 1 if failed else 0


def _cmd_inspect(args) -> int:
    co = inspect(args.path, args.asm)
    arch = co.arch
    rows = []
    for name, k in sorted(co.kernels.items()):
        occ = occupancy(arch, k) if arch in RULES else None
        rows.append(
            {
                "kernel": name,
                **{
                    f: k.meta.get(f)
                    for f in (
                        "wavefront_size",
                        "vgpr_count",
                        "agpr_count",
                        "sgpr_count",
                        "group_segment_fixed_size",
                        "private_segment_fixed_size",
                        "uses_dynamic_stack",
                        "vgpr_spill_count",
                        "sgpr_spill_count",
                        "max_flat_workgroup_size",
                    )
                },
                "occupancy": dataclasses.asdict(occ) if occ else None,
                "listing_occupancy": k.info.get("Occupancy"),
            }
        )
    if args.json:
        print(
            json.dumps(
                {
                    "target": co.target,
                    "undefined": co.undefined,
                    "calls": len(co.calls),
                    "kernels": rows,
                },
                indent=1,
            )
        )
        return 0
    print(
        f"{co.path}: {co.target} ({co.elf_flags}); undefined: {co.undefined or 'none'}; "
        f"calls: {len(co.calls)}"
    )
    for r in rows:
        o = r["occupancy"] or {}
        print(
            f"  {r['kernel']:28s} wave{r['wavefront_size']} vgpr={r['vgpr_count']} "
            f"agpr={r['agpr_count']} sgpr={r['sgpr_count']} lds={r['group_segment_fixed_size']} "
            f"scratch={r['private_segment_fixed_size']} dyn_stack={r['uses_dynamic_stack']} "
            f"waves={o.get('waves')} ({o.get('limit')}) at_block={o.get('at_block')}"
        )
    return 0


def _cmd_table(args) -> int:
    start = time.perf_counter()
    sections = render_sections(build_all(_select(args), jobs=args.jobs))
    print(f"built and inspected in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    if args.write:
        write_sections(Path(args.write), sections)
    elif args.check:
        stale = stale_sections(Path(args.check), sections)
        if stale:
            print(
                f"{args.check}: sections {', '.join(stale)} are stale: regenerate with "
                f"`python -m amdqb_tools table --write {args.check}`",
                file=sys.stderr,
            )
            return 1
    else:
        sys.stdout.write("\n".join(sections.values()))
    return 0


def _cmd_configs(args) -> int:
    from .code_objects import inspect_all
    from .derive import DERIVED_ARCHS, derived_entries, stored_entries, write

    tc = [t for t in toolchains() if t.name == "clang-22"]
    if not tc:
        raise SystemExit("no clang-22: " + "; ".join(missing_toolchains()))
    objects = inspect_all(build_all(tc, archs=DERIVED_ARCHS, jobs=args.jobs))
    if args.write:
        for path in write(objects):
            print(f"wrote {path}")
        return 0
    for arch in DERIVED_ARCHS:
        _, equal = stored_entries(arch, objects)
        for key, (value, why) in derived_entries(arch, objects).items():
            note = " (the default's: not stored)" if key in equal else ""
            print(f"{arch:8s} {key:32s} {value!s:6s} {why}{note}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m amdqb_tools", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("build", "table"):
        s = sub.add_parser(name)
        s.add_argument("--toolchain", action="append", default=[], help="clang-22 / clang-19")
        s.add_argument("-j", "--jobs", type=int, default=None)
        if name == "build":
            s.add_argument("--arch", action="append", default=[])
            s.add_argument("--libs", action="append", default=[], choices=DEVICE_LIB_SETS)
            s.add_argument("--rebuild", action="store_true")
        else:
            g = s.add_mutually_exclusive_group()
            g.add_argument("--write", metavar="PATH")
            g.add_argument("--check", metavar="PATH")
    s = sub.add_parser("configs")
    s.add_argument("--write", action="store_true", help="into amdqb/configs/<arch>.json")
    s.add_argument("-j", "--jobs", type=int, default=None)
    s = sub.add_parser("inspect")
    s.add_argument("path")
    s.add_argument("--asm", help="the assembly listing of the same compile (for its comments)")
    s.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    commands = {"build": _cmd_build, "inspect": _cmd_inspect, "table": _cmd_table}
    commands["configs"] = _cmd_configs
    return commands[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
