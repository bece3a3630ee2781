"""Config entries of the AMD architectures (``amdqb/configs/gfx942.json``, ``gfx950.json``,
``gfx1250.json``) that follow from the code objects' occupancy, with the figures that chose them.

No AMD GPU has run these kernels: every value here is ``derived:`` from register, LDS and
workgroup counts (amdqb_tools.occupancy), never from a timing; ``python -m amdqb.bench.tune --write`` on
the GPU replaces an entry with a ``measured:`` one. :func:`derived_entries` computes them from the
clang-22 builds of the layout module and the router at the seed shape (E=896, fp32, sigmoid).
An AMD file holds a derived entry only where its value differs from ``default.json``'s: one equal
to the default stays out of the file until a measurement gives it (:func:`stored_entries`).
``python -m amdqb_tools configs --write`` stores them (and drops derived entries the default now
equals) and op_tests/test_amd_code_objects.py checks the files still say what the current code
objects give.
"""

from __future__ import annotations

from .build import arch_config, titled_variants
from .occupancy import RULES, Rules, _max_workgroups, waves_by_sgprs, waves_by_vgprs

DERIVED_ARCHS = ("gfx942", "gfx950", "gfx1250")
PROVENANCE = "derived: the code objects' occupancy (docs/amd_occupancy.md), no AMD GPU measured"
BLOCK_CHOICES = (256, 512, 1024)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def resident_blocks(rules: Rules, k, block: int, lds: int | None = None) -> int:
    """Whole blocks of ``block`` threads of kernel ``k`` resident on one CU: registers (waves per
    SIMD x SIMDs over the block's waves), LDS (``lds`` bytes per block, default the kernel's
    static LDS) and the per-CU workgroup limit."""
    waves = min(waves_by_vgprs(rules, k.vgprs), waves_by_sgprs(rules, k.sgprs))
    lds = k.lds if lds is None else lds
    by_lds = rules.lds_per_cu // lds if lds else 1 << 30
    return min(waves * rules.eus // _cdiv(block, rules.wave), by_lds, _max_workgroups(rules, block))


def _waves_at(rules: Rules, k, block: int, lds: int) -> int:
    """Waves per SIMD with whole blocks resident."""
    return resident_blocks(rules, k, block, lds) * _cdiv(block, rules.wave) // rules.eus


def largest_full_block(rules: Rules, k, lds_per_block) -> tuple[int, int]:
    """(the largest block of :data:`BLOCK_CHOICES` whose resident whole blocks keep the kernel at
    its best waves per SIMD, those waves); ``lds_per_block(block)``: its LDS bytes."""
    best = max(_waves_at(rules, k, b, lds_per_block(b)) for b in BLOCK_CHOICES)
    block = max(b for b in BLOCK_CHOICES if _waves_at(rules, k, b, lds_per_block(b)) == best)
    return block, best


def derived_entries(arch: str, objects: dict) -> dict[str, tuple[object, str]]:
    """{config key: (value, why)} for ``arch`` from ``objects`` ({(toolchain, spec, arch):
    CodeObject}, the clang-22 builds)."""
    rules = RULES[arch]
    cfg = arch_config(arch)
    mods = {title: objects[("clang-22", spec, arch)] for title, spec in titled_variants(arch)}
    layout, router = mods["layout"], mods["router E=896 fp32 sigmoid"]
    wave_name = f"wave{rules.wave}"
    out = {}

    k = router.kernels["amdqb_router"]
    block = 32 * int(cfg["hip.router.warps"])
    n = resident_blocks(rules, k, block)
    out["hip.fallback_blocks_per_cu"] = (
        max(1, n),
        f"router E=896: {k.vgprs} VGPRs give {waves_by_vgprs(rules, k.vgprs)} waves/SIMD: {n} "
        f"resident {block}-thread blocks ({_cdiv(block, rules.wave)} {wave_name} each) per CU",
    )

    k = layout.kernels["amdqb_route_atomic_i32"]
    n = resident_blocks(rules, k, 256)
    out["hip.route.atomic_blocks_per_cu"] = (
        n,
        f"atomic route kernel: {k.vgprs} VGPRs, {_cdiv(256, rules.wave)} {wave_name} waves per "
        f"256-thread block: {n} blocks resident per CU (the persistent grid fills them)",
    )

    k = layout.kernels["amdqb_route_lds_i32"]
    items = int(cfg["hip.route.lds_items"])
    experts = 896  # dynamic LDS: a histogram row of E ints
    b, waves = largest_full_block(rules, k, lambda _b: k.lds + 4 * experts)
    out["hip.route.lds_block"] = (
        b,
        f"lds route kernel: {k.vgprs} VGPRs, {4 * experts} B LDS at E=896: {b}-thread blocks "
        f"({b * items} routes per tile) keep {waves} waves/SIMD resident",
    )

    k = router.kernels["amdqb_qb_hist"]
    epb, bins = int(cfg["hip.qb_hist.max_experts_per_block"]), 1000
    b, waves = largest_full_block(rules, k, lambda _b: k.lds + 4 * epb * bins)
    out["hip.qb_hist.block"] = (
        b,
        f"histogram pass: {k.vgprs} VGPRs, {4 * epb * bins} B LDS ({epb} experts x {bins} bins): "
        f"{b}-thread blocks keep {waves} waves/SIMD resident",
    )
    return out


def stored_entries(arch: str, objects: dict) -> tuple[dict[str, tuple[object, str]], list[str]]:
    """(the derived entries ``arch``'s file holds: those whose value differs from default.json's,
    the derived keys it leaves to the default: those whose value equals it)."""
    from amdqb import configs

    default = configs.load(configs.DEFAULT)
    entries = derived_entries(arch, objects)
    kept = {key: vw for key, vw in entries.items() if vw[0] != default[key]}
    return kept, sorted(set(entries) - set(kept))


def write(objects: dict) -> list:
    """Write the derived entries of every :data:`DERIVED_ARCHS` config that differ from the
    default, and drop the derived entries equal to it (configs.write)."""
    from amdqb import configs

    paths = []
    for arch in DERIVED_ARCHS:
        kept, equal = stored_entries(arch, objects)
        values = {key: (value, PROVENANCE, why) for key, (value, why) in kept.items()}
        # only entries this tool wrote leave: a measured one stays
        derived = [k for k in equal if configs.load(arch).entry(k).provenance == PROVENANCE]
        paths.append(configs.write(arch, values, remove=tuple(derived)))
    return paths
