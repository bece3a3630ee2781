"""Occupancy (waves per SIMD) of AMD kernels from their register and LDS counts, with LLVM's AMDGPU
rules (AMDGPUBaseInfo.cpp / AMDGPUSubtarget.cpp) per target (:data:`RULES`), and probe kernels that
let the tests check those rules against what the backend itself prints.
"""

from __future__ import annotations

from dataclasses import dataclass

from .code_objects import Kernel, parse_kernel_info
from .toolchain import Toolchain, run


@dataclass(frozen=True)
class Rules:
    """Per-target resources as LLVM's AMDGPU backend models them for occupancy."""

    wave: int
    max_waves: int  # waves per SIMD (getMaxWavesPerEU)
    vgprs: int  # VGPRs per lane a SIMD's waves share (getTotalNumVGPRs)
    vgpr_granule: int  # allocation granule (getVGPRAllocGranule)
    unified_agprs: bool  # gfx90a+: AGPRs share the VGPR file, after the VGPRs aligned to 4
    sgpr_limits: bool  # gfx9: SGPRs limit waves (getOccupancyWithNumSGPRs); gfx10+: never
    lds_per_cu: int  # bytes shared by the workgroups on a CU (a WGP in WGP mode)
    lds_per_workgroup: int  # addressable by one workgroup
    eus: int  # SIMDs sharing that LDS and the barriers (getEUsPerCU)
    max_barriers: int  # resident multi-wave workgroups per CU / WGP


# Values: LLVM 22's rules for these targets, each checked against the `; Occupancy:` the backend
# prints for probe kernels over VGPR / SGPR / LDS / workgroup-size sweeps (op_tests/
# test_amd_code_objects.py). gfx1100 / gfx1201: 1.5x VGPR file (1536, granule 24), WGP mode (two
# CUs' LDS, 128 KiB; 64 KiB per workgroup); gfx1250: 1024 VGPRs, granule 16, 320 KiB LDS, no WGP
# mode, 16 barriers; gfx942 / gfx950: 512 unified VGPR+AGPR, granule 8, 8 waves, 64 / 160 KiB LDS.
RULES = {
    "gfx942": Rules(64, 8, 512, 8, True, True, 65536, 65536, 4, 16),
    "gfx950": Rules(64, 8, 512, 8, True, True, 163840, 163840, 4, 16),
    "gfx1100": Rules(32, 16, 1536, 24, False, False, 131072, 65536, 4, 32),
    "gfx1201": Rules(32, 16, 1536, 24, False, False, 131072, 65536, 4, 32),
    "gfx1250": Rules(32, 16, 1024, 16, False, False, 327680, 327680, 4, 16),
}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def waves_by_vgprs(rules: Rules, vgprs: int) -> int:
    if vgprs < rules.vgpr_granule:
        return rules.max_waves
    rounded = _cdiv(vgprs, rules.vgpr_granule) * rules.vgpr_granule
    return min(max(rules.vgprs // rounded, 1), rules.max_waves)


def waves_by_sgprs(rules: Rules, sgprs: int) -> int:
    if not rules.sgpr_limits:
        return rules.max_waves
    waves = 10 if sgprs <= 80 else 9 if sgprs <= 88 else 8 if sgprs <= 100 else 7
    return min(waves, rules.max_waves)


def _max_workgroups(rules: Rules, block: int) -> int:
    waves = _cdiv(block, rules.wave)
    slots = rules.max_waves * rules.eus
    return slots if waves == 1 else min(slots // waves, rules.max_barriers)


def waves_by_workgroups(rules: Rules, lds: int, min_block: int, max_block: int) -> int:
    """LLVM's getOccupancyWithWorkGroupSizes(...).second: the most waves per SIMD any block size
    in [min_block, max_block] reaches with ``lds`` bytes of LDS per block."""
    by_lds = rules.lds_per_cu // max(lds, 1)
    if not by_lds:
        return 1

    def props(block):
        w = _cdiv(block, rules.wave)
        g = min(_max_workgroups(rules, block), by_lds)
        return w, g, w * g

    min_wpg, max_groups, max_waves_cu = props(min_block)
    _, _, min_waves_cu = props(max_block)
    if min_waves_cu >= max_waves_cu:
        max_waves_cu = min_waves_cu
    else:
        left = rules.max_waves * rules.eus - max_groups * min_wpg
        per_group = left // max_groups
        if per_group:
            grow = min(per_group, (max_block - 1) // rules.wave + 1 - min_wpg)
            max_waves_cu += max_groups * grow
    return max(1, min(_cdiv(max_waves_cu, rules.eus), rules.max_waves))


@dataclass(frozen=True)
class Occupancy:
    vgpr_waves: int
    sgpr_waves: int
    group_waves: int  # from LDS and workgroup counts
    waves: int  # LLVM's occupancy: the minimum (the listing's `; Occupancy:`)
    limit: str  # what sets it: vgpr / sgpr / lds+wg / max
    at_block: int  # waves per SIMD with whole blocks of max_block threads resident


def occupancy(arch: str, k: Kernel) -> Occupancy:
    """Occupancy of kernel ``k`` on ``arch`` from its metadata (static LDS only; the kernels that
    take dynamic LDS get it at launch)."""
    rules = RULES[arch]
    v = waves_by_vgprs(rules, k.vgprs)  # gfx942 / gfx950: .vgpr_count already includes AGPRs
    s = waves_by_sgprs(rules, k.sgprs)
    g = waves_by_workgroups(rules, k.lds, 1, k.max_block)
    waves = min(v, s, g)
    limit = (
        "max"
        if waves == rules.max_waves
        else "vgpr" if waves == v else ("sgpr" if waves == s else "lds+wg")
    )
    # Whole blocks of max_block threads: each block's waves spread over the SIMDs, so registers
    # admit (register waves x SIMDs) // (waves per block) blocks; LDS and barriers cap it too.
    per_block = _cdiv(k.max_block, rules.wave)
    blocks = min(
        (min(v, s) * rules.eus) // per_block,
        rules.lds_per_cu // max(k.lds, 1),
        _max_workgroups(rules, k.max_block),
    )
    at_block = min(min(v, s), blocks * per_block // rules.eus)
    return Occupancy(v, s, g, waves, limit, at_block)


def probe_occupancy(
    tc: Toolchain, arch: str, cases: list[tuple[int, int, int, int, int]]
) -> list[dict]:
    """The ``; Kernel info`` of probe kernels (``Occupancy``, ``NumVgprs``, ``TotalNumSgprs``,
    ``LDSByteSize``, ...), one per case (vgprs, sgprs, lds bytes, min block, max block): each
    clobbers its highest VGPR / SGPR and touches its LDS."""
    ir, attrs = [], {}
    for i, (v, s, lds, lo, hi) in enumerate(cases):
        attr = attrs.setdefault((lo, hi), len(attrs))
        clobbers = ",".join(
            c for c in (f"~{{v{v - 1}}}" if v else "", f"~{{s{s - 1}}}" if s else "") if c
        )
        body = f'  call void asm sideeffect "", "{clobbers}"()\n' if clobbers else ""
        if lds:
            ir.append(f"@lds{i} = internal addrspace(3) global [{lds} x i8] poison, align 4")
            body += f"  store volatile i8 1, ptr addrspace(3) @lds{i}\n"
        ir.append(f"define amdgpu_kernel void @probe{i}() #{attr} {{\n{body}  ret void\n}}")
    for (lo, hi), n in attrs.items():
        ir.append(f'attributes #{n} = {{ "amdgpu-flat-work-group-size"="{lo},{hi}" }}')
    cmd = [tc.clang, "-x", "ir", "--target=amdgcn-amd-amdhsa", f"-mcpu={arch}", "-nogpulib"]
    out = run([*cmd, "-O1", "-S", "-o", "-", "-"], input="\n".join(ir) + "\n")
    if out.returncode:
        raise RuntimeError(f"{tc.name} probe for {arch} failed: {out.stderr[-3000:]}")
    info = parse_kernel_info(out.stdout)
    return [info[f"probe{i}"] for i in range(len(cases))]
