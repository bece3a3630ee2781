"""The generated tables of docs/amd_occupancy.md: per target, every kernel's registers, LDS,
scratch, spills and occupancy, from the code objects of :func:`amdqb_tools.build.build_all`.
"""

from __future__ import annotations

from pathlib import Path

from amdqb.backends.hip import _spec

from .build import module_variants, titled_variants
from .code_objects import inspect_build
from .occupancy import RULES, occupancy
from .toolchain import AMD_ARCHS, TOOLCHAIN_MAJORS, toolchains

TABLE_BEGIN = "<!-- BEGIN GENERATED: python -m amdqb_tools table --write -->"
TABLE_END = "<!-- END GENERATED -->"


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
    lines = [TABLE_BEGIN, ""]
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


def generated_section(text: str) -> str | None:
    i, j = text.find(TABLE_BEGIN), text.find(TABLE_END)
    if i < 0 or j < 0:
        return None
    return text[i : j + len(TABLE_END)] + "\n"


def write_table(path: Path, table: str) -> None:
    text = path.read_text() if path.is_file() else "# AMD code objects: occupancy\n\n"
    current = generated_section(text)
    text = text.replace(current, table) if current else text.rstrip("\n") + "\n\n" + table
    path.write_text(text)
