"""The generated sections of docs/amd_occupancy.md, from the code objects of
:func:`amdqb_tools.build.build_all`: ``occupancy`` (per target, every kernel's registers, LDS,
scratch, spills and occupancy) and ``isa`` (per target, the cross-lane and atomic instructions of
the hot modules' kernels, the serving top-k's and the router backward's, :mod:`amdqb_tools.isa`) and ``model`` (llvm-mca over the hot kernels'
main loops with occupancy and bytes moved, :mod:`amdqb_tools.mca`). Each section sits between its
own BEGIN marker and the next END marker.
"""

from __future__ import annotations

from pathlib import Path

from amdqb.backends.hip import _spec

from . import isa, mca
from .build import module_variants, titled_variants
from .code_objects import inspect_build
from .occupancy import RULES, occupancy
from .toolchain import AMD_ARCHS, TOOLCHAIN_MAJORS, toolchains

TABLE_END = "<!-- END GENERATED -->"


def table_begin(name: str) -> str:
    return f"<!-- BEGIN GENERATED {name}: python -m amdqb_tools table --write -->"


def _module_title(spec: _spec.ModuleSpec) -> str:
    titles = (title for arch in AMD_ARCHS for title, v in titled_variants(arch) if v == spec)
    return next(titles, spec.label())


def render_table(builds: dict) -> str:
    """The generated part of docs/amd_occupancy.md for ``builds`` (from :func:`build_all`)."""
    by_target: dict = {}
    versions = {}
    for (tc_name, _module, arch), b in builds.items():
        by_target.setdefault((tc_name, arch), []).append(b)
    for tc in toolchains():
        versions[tc.name] = tc.version
    lines = [table_begin("occupancy"), ""]
    for name in sorted(versions, key=lambda n: -int(n.split("-")[1])):
        if any(t == name for t, _ in by_target):
            lines.append(f"* {name}: `{versions[name]}`")
    lines += [
        "",
        (
            "| target | wave | waves/SIMD max | VGPRs per SIMD lane | VGPR granule | SGPRs limit "
            "| LDS per CU | LDS per block | SIMDs per CU | blocks per CU max |"
        ),
        "|---|--:|--:|--:|--:|---|--:|--:|--:|--:|",
    ]
    for arch in AMD_ARCHS:
        r = RULES[arch]
        lines.append(
            f"| {arch} | {r.wave} | {r.max_waves} | {r.vgprs}{' (VGPR+AGPR)' if r.unified_agprs else ''}"
            f" | {r.vgpr_granule} | {'yes' if r.sgpr_limits else 'no'} | {r.lds_per_cu} "
            f"| {r.lds_per_workgroup} | {r.eus} | {r.max_barriers} |"
        )
    lines.append("")
    order = {spec: i for arch in AMD_ARCHS for i, spec in enumerate(module_variants(arch))}
    tc_order = {f"clang-{m}": i for i, m in enumerate(TOOLCHAIN_MAJORS)}
    for tc_name, arch in sorted(
        by_target, key=lambda t: (tc_order.get(t[0], 99), AMD_ARCHS.index(t[1]))
    ):
        rules = RULES[arch]
        lines += [
            f"### {arch} (wave{rules.wave}), {tc_name}",
            "",
            (
                "| module | kernel | VGPR | AGPR | SGPR | LDS | scratch | spills v/s | block "
                "| waves/SIMD | limit | at block |"
            ),
            "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|---|--:|",
        ]
        for b in sorted(by_target[(tc_name, arch)], key=lambda b: order.get(b.spec, 99)):
            if not b.ok:
                lines.append(f"| {_module_title(b.spec)} | BUILD FAILED | | | | | | | | | | |")
                continue
            co = inspect_build(b)
            for name in sorted(co.kernels):
                k = co.kernels[name]
                occ = occupancy(arch, k)
                sv, ss = k.spills
                lines.append(
                    f"| {_module_title(b.spec)} | `{name}` | {k.vgprs} | {k.agprs} | {k.sgprs} "
                    f"| {k.lds} | {k.scratch} | {sv}/{ss} | {k.max_block} | {occ.waves} "
                    f"| {occ.limit} | {occ.at_block} |"
                )
        lines.append("")
    lines.append(TABLE_END)
    return "\n".join(lines) + "\n"


# Modules of the ISA section: the route / align kernels, the router at the seed shape, and every
# module of the serving top-k and of the router backward.
ISA_MODULES = ("layout", "router E=896 fp32 sigmoid")
ISA_KERNEL_FILES = ("topk.hip", "router_bwd.hip")
ISA_COLUMNS = (
    ("bpermute", "ds_bpermute"),
    ("dpp", "DPP"),
    ("swizzle", "ds_swizzle"),
    ("permlane", "permlane"),
    ("readlane", "readlane"),
    ("writelane", "writelane"),
    ("lds_atomic", "LDS atomics"),
    ("global_atomic", "global atomics"),
)


def render_isa_table(builds: dict) -> str:
    """The ``isa`` section: per clang-22 target (Debian's device libraries), the instruction
    counts of the kernels of :data:`ISA_MODULES` and of the modules of :data:`ISA_KERNEL_FILES`,
    each cell ``all (in loops)``."""
    lines = [table_begin("isa"), ""]
    head = " | ".join(title for _, title in ISA_COLUMNS)
    for arch in AMD_ARCHS:
        rows = []
        for title, spec in titled_variants(arch):
            b = builds.get(("clang-22", spec, arch))
            shown = title in ISA_MODULES or spec.kernel_file in ISA_KERNEL_FILES
            if not shown or b is None or not b.ok:
                continue
            co = inspect_build(b)
            for name in sorted(co.kernels):
                code = co.kernels[name].code
                total, looped = isa.counts(code), isa.counts(code, only_loops=True)
                cells = " | ".join(
                    f"{total[c]} ({looped[c]})" if total[c] else "0" for c, _ in ISA_COLUMNS
                )
                rows.append(f"| {title} | `{name}` | {cells} |")
        if not rows:
            continue
        lines += [
            f"### {arch} (wave{RULES[arch].wave}), clang-22: instructions (in loops)",
            "",
            f"| module | kernel | {head} |",
            "|---|---|" + "--:|" * len(ISA_COLUMNS),
            *rows,
            "",
        ]
    lines.append(TABLE_END)
    return "\n".join(lines) + "\n"


def render_sections(builds: dict) -> dict[str, str]:
    """{section name: its generated text} of docs/amd_occupancy.md."""
    return {
        "occupancy": render_table(builds),
        "isa": render_isa_table(builds),
        "model": mca.render_model_table(builds, table_begin, TABLE_END),
    }


def generated_section(text: str, name: str = "occupancy") -> str | None:
    i = text.find(table_begin(name))
    j = text.find(TABLE_END, i) if i >= 0 else -1
    if i < 0 or j < 0:
        return None
    return text[i : j + len(TABLE_END)] + "\n"


def write_sections(path: Path, sections: dict[str, str]) -> None:
    text = path.read_text() if path.is_file() else "# AMD code objects\n\n"
    for name, table in sections.items():
        current = generated_section(text, name)
        text = text.replace(current, table) if current else text.rstrip("\n") + "\n\n" + table
    path.write_text(text)


def stale_sections(path: Path, sections: dict[str, str]) -> list[str]:
    """Names of the sections whose text in ``path`` differs from ``sections`` (or is missing)."""
    text = path.read_text()
    return [name for name, table in sections.items() if generated_section(text, name) != table]
