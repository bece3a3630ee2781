"""What the linked AMD code objects of every hip_src kernel say about themselves.

The code objects come from ``amdqb_tools`` (``amdqb_tools.build``: the runtime's flags, Debian's
clang 22 for gfx942 / gfx950 / gfx1100 / gfx1201 / gfx1250 and clang 19 for gfx942 / gfx1100 /
gfx1201, linked with lld against ocml / ockl; op_tests/test_hip_compile.py checks they build).
Every check of a build runs for each device-library set: Debian's ROCm 5.2 ocml / ockl (clang 22
and clang 19) and the ROCm 7.x ones Triton's AMD backend ships (clang 22, the five targets; clang 19
cannot read that bitcode), every module of ``build.module_variants`` against both
(``build.LIB_MODULES``); only the sqrtsoftplus routers (ocml's log1pf) differ between the two.
The checks read each object's AMDGPU metadata
note, symbols and disassembly, not the compiler's assembly text: wave size; no undefined symbols,
no calls, no dynamic stack; no scratch in the route, align, decode Top-k and QB histogram kernels;
LDS inside the target's budget; the listing's resource comments agree with the metadata. Occupancy (waves per SIMD) is derived from the metadata with the
per-target rules of ``tools_occupancy.RULES``, which must reproduce what LLVM prints for its own kernels
and for probe kernels over register / LDS / block-size sweeps; docs/amd_occupancy.md must equal
the table these builds give. ISA checks (disassembly of the linked objects): the lds route kernel
privatises its histogram with LDS atomics and reserves each expert's interval with one returning
global atomic per (block, expert), in its per-expert loop; the QB histogram pass counts in LDS and
flushes once; the router's fused epilogue has one global atomic per (token, expert); no hot loop
keeps ds_bpermute chains, and the serving top-k and the router backward keep none at all.

Nothing here executes a kernel (no AMD GPU or ROCm runtime on these machines).
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from amdqb import configs
from amdqb._arch import amd_wave_size
from amdqb.backends.hip import _spec
from amdqb.backends.hip import router as hip_router
from amdqb_tools import build as tools_build
from amdqb_tools import code_objects as tools_code_objects
from amdqb_tools import derive as tools_derive
from amdqb_tools import isa as tools_isa
from amdqb_tools import occupancy as tools_occupancy
from amdqb_tools import table as tools_table
from amdqb_tools import toolchain as tools_toolchain

from conftest import needs, require

# the module fixture builds every kernel once: its tests stay on one xdist worker
pytestmark = pytest.mark.xdist_group("amd_code_objects")

# (toolchain, target) of every toolchain, and (toolchain, device-library set, target) of every
# build: clang 22 against both sets, clang 19 against Debian's (toolchain.LIBS_BY_MAJOR)
TOOLCHAIN_TARGETS = [
    (f"clang-{m}", arch)
    for m in tools_toolchain.TOOLCHAIN_MAJORS
    for arch in tools_toolchain.ARCHS_BY_MAJOR[m]
]
ALL_TARGETS = [
    (tc, libs, arch)
    for tc, arch in TOOLCHAIN_TARGETS
    for libs in tools_toolchain.LIBS_BY_MAJOR[int(tc.split("-")[1])]
]
ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "amd_occupancy.md"


def _available(tc_name: str, libs: str = "debian") -> bool:
    tc = tools_toolchain.toolchain(int(tc_name.split("-")[1]))
    return tc is not None and tools_toolchain.device_bitcode_source(libs) is not None


def _skip_reason() -> str:
    return "needs " + "; ".join(tools_toolchain.missing_toolchains()) + " (see .ci/run)"


def target_params():
    """(toolchain, device-library set, target) of every build (id: the build name and target)."""
    return [
        pytest.param(
            tc,
            libs,
            arch,
            id=f"{tools_build.build_name(tc, libs)}-{arch}",
            marks=needs(
                _available(tc, libs) and tools_toolchain.inspect_tools() is not None,
                _skip_reason(),
            ),
        )
        for tc, libs, arch in ALL_TARGETS
    ]


def toolchain_params():
    """(toolchain, target) of every toolchain (checks of the compiler, not of a build)."""
    return [
        pytest.param(
            tc,
            arch,
            id=f"{tc}-{arch}",
            marks=needs(
                _available(tc) and tools_toolchain.inspect_tools() is not None, _skip_reason()
            ),
        )
        for tc, arch in TOOLCHAIN_TARGETS
    ]


@pytest.fixture(scope="module")
def objects():
    """{(build name, module, arch): CodeObject} of every build against every device-library set
    found here (made once per process; a set missing fails its targets' tests under CI=true)."""
    require(
        any(_available(tc) for tc, _ in TOOLCHAIN_TARGETS)
        and tools_toolchain.inspect_tools() is not None,
        _skip_reason(),
    )
    libs = tuple(
        lb
        for lb in tools_toolchain.DEVICE_LIB_SETS
        if tools_toolchain.device_bitcode_source(lb) is not None
    )
    builds = tools_build.build_all(libs=libs)
    failed = {b.label: b.log[-3000:] for b in builds.values() if not b.ok}
    assert not failed, failed
    return tools_code_objects.inspect_all(builds)


def modules_of(objects, tc, libs, arch):
    name = tools_build.build_name(tc, libs)
    out = [(spec, co) for (t, spec, a), co in objects.items() if t == name and a == arch]
    assert len(out) == len(tools_build.module_variants(arch, libs)), (name, arch)
    return out


def code_object(objects, tc, libs, arch, spec):
    return objects[(tools_build.build_name(tc, libs), spec, arch)]


GLOBAL_ATOMIC = re.compile(r"^(global|flat|buffer)_atomic_add")
RETURNING = re.compile(r"_rtn|\b(glc|sc0)\b|TH_ATOMIC_RETURN")
BARRIER = re.compile(r"^s_barrier(_signal)?(\s|$)")  # gfx12 splits it: signal + wait
LDS_ATOMIC = re.compile(r"^ds_add(_rtn)?_u32")


def sgprs(info) -> int:
    """SGPRs incl. VCC / flat scratch / XNACK in a listing (clang 22: TotalNumSgprs; clang 19:
    NumSgprs)."""
    return info["TotalNumSgprs"] if "TotalNumSgprs" in info else info["NumSgprs"]


def count(instructions, pattern) -> int:
    return sum(1 for text in instructions if re.search(pattern, text))


def test_wave_size_and_isa_version_come_from_the_arch():
    """No toolchain needed: gfx9 is wave64, gfx10-12 wave32 (gfx1250 has no wave64); the device
    libraries' ISA constant is major * 1000 + minor * 100 + stepping (hex digits)."""
    assert [amd_wave_size(a) for a in tools_toolchain.AMD_ARCHS] == [64, 64, 32, 32, 32]
    assert amd_wave_size("gfx942:sramecc+:xnack-") == 64
    assert tools_toolchain.isa_version("gfx942") == ("942", 9402)
    assert tools_toolchain.isa_version("gfx90a") == ("90a", 9010)
    assert tools_toolchain.isa_version("gfx1250") == ("1250", 12500)
    assert tools_toolchain.isa_version("gfx1201") == ("1201", 12001)
    for bad in ("sm_90", "gfx", "gfx8xx", ""):
        with pytest.raises(ValueError, match="arch"):
            amd_wave_size(bad)


def test_the_package_does_not_import_the_tools():
    """``import amdqb`` (and its hip backend, its CLI) never imports amdqb_tools, even where the
    checkout's tools are importable; no module of the package names them."""
    code = (
        "import sys, amdqb, amdqb.cli, amdqb.backends.hip, amdqb.backends.hip._runtime; "
        "print(sorted(m for m in sys.modules if m.startswith('amdqb_tools')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
    named = [p for p in (ROOT / "amdqb").rglob("*.py") if "amdqb_tools" in p.read_text()]
    assert not named, named


def test_one_wave_size_rule():
    """The wave-size rule (gfx9 wave64, else wave32) is written once, in amdqb/_arch.py; the
    runtime, setup.py and the tools call it."""
    rule = re.compile(r'startswith\(\s*"gfx9"\s*\)\s*else|\b64 if\b.*gfx|gfx.*\belse 32\b')
    files = [*(ROOT / "amdqb").rglob("*.py"), *(ROOT / "amdqb_tools").rglob("*.py")]
    files.append(ROOT / "setup.py")
    dup = [p for p in files if p.name != "_arch.py" and rule.search(p.read_text())]
    assert not dup, dup
    for path in ("setup.py", "amdqb/devices.py", "amdqb/backends/hip/_runtime.py"):
        assert "amd_wave_size" in (ROOT / path).read_text(), path


# ------------------------------------------------------------------------------------------------
# Metadata
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tc, libs, arch", target_params())
def test_wave_size_is_the_targets(objects, tc, libs, arch):
    want = amd_wave_size(arch)
    for spec, co in modules_of(objects, tc, libs, arch):
        assert co.target == f"amdgcn-amd-amdhsa--{arch}", (spec.label(), co.target)
        for name, k in co.kernels.items():
            assert k.wave == want, (spec.label(), arch, name, k.meta)


@pytest.mark.parametrize("tc, libs, arch", target_params())
def test_no_external_calls_no_dynamic_stack(objects, tc, libs, arch):
    """Linked with --no-undefined: no symbol left to resolve, no call of any kind (every device
    function and library routine inlined), so the metadata's register and scratch counts are the
    kernels' own, not a lower bound."""
    for spec, co in modules_of(objects, tc, libs, arch):
        assert co.undefined == [], (spec.label(), co.undefined)
        assert co.calls == [], (spec.label(), co.calls[:10])
        for name, k in co.kernels.items():
            assert k.dynamic_stack is False, (spec.label(), name, k.meta)
            assert k.code, (spec.label(), name, "no disassembly")


@pytest.mark.parametrize("tc, libs, arch", target_params())
def test_no_scratch_where_promised(objects, tc, libs, arch):
    """Route and align kernels (every one), the serving top-k, the decode-form Top-k and the QB
    histogram pass (every router module, E up to 4096) keep their per-thread arrays in registers;
    the router backward uses no scratch (at E=896 on wave64 it spills a few SGPRs into VGPR
    lanes, docs/serving.md). The full router and its scores pass: the test below."""
    for spec, co in modules_of(objects, tc, libs, arch):
        names = (
            sorted(co.kernels)
            if spec.kernel_file in ("layout.hip", "topk.hip", "router_bwd.hip")
            else ["amdqb_router_decode", "amdqb_qb_hist", "amdqb_qb_hist_bins"]
        )
        for name in names:
            k = co.kernels[name]
            assert k.scratch == 0, (spec.label(), arch, name, k.meta)
            if spec.kernel_file != "router_bwd.hip":
                assert k.spills == (0, 0), (spec.label(), arch, name, k.meta)


# The E=896 router's register budget on the main targets: rows of a whole wave64 on gfx9 (14
# experts per lane), lane-derived masks and kernel arguments kept out of the loop-carried SGPRs,
# the exact selection path's candidates as slot bits (amdqb_select.h): at least 4 waves per SIMD,
# no VGPR or SGPR spill (docs/amd_occupancy.md).
ROUTER_896_TARGETS = ("gfx942", "gfx950", "gfx1250")


@pytest.mark.parametrize("tc, libs, arch", target_params())
def test_router_fits_four_waves_without_scratch(objects, tc, libs, arch):
    """amdqb_router and amdqb_router_scores: no scratch at any E built, up to the op's largest
    (4096: rows of many slots per lane load them in chunks, router.hip CHUNK), on any target;
    amdqb_router at E=896 on gfx942 / gfx950 / gfx1250: >= 4 waves per SIMD, no spill at all."""
    for spec, co in modules_of(objects, tc, libs, arch):
        if spec.kernel_file != "router.hip":
            continue
        for name in ("amdqb_router", "amdqb_router_scores"):
            assert co.kernels[name].scratch == 0, (spec.label(), arch, name, co.kernels[name].meta)
        k = co.kernels["amdqb_router"]
        if arch in ROUTER_896_TARGETS and dict(spec.defines)["AMDQB_NUM_EXPERTS"] == "896":
            occ = tools_occupancy.occupancy(arch, k)
            assert occ.waves >= 4, (spec.label(), arch, occ, k.meta)
            assert k.spills == (0, 0), (spec.label(), arch, k.meta)
    if tools_build.LIB_MODULES[libs] is None:  # every module built against this set
        assert any(
            dict(spec.defines)["AMDQB_NUM_EXPERTS"] == str(hip_router.MAX_ROUTER_EXPERTS)
            for spec, _ in modules_of(objects, tc, libs, arch)
            if spec.kernel_file == "router.hip"
        ), "the op's largest E is among the variants built"


@pytest.mark.parametrize("tc, libs, arch", target_params())
def test_router_decode_fits_eight_waves(objects, tc, libs, arch):
    """amdqb_router_decode up to E = 1024 (4 experts per thread: its 32-entry lists and E scores
    in under 8 KiB of LDS, registers held to that occupancy by amdgpu_waves_per_eu): 8 waves per
    SIMD on every target, whole blocks resident, no spill."""
    seen = 0
    for spec, co in modules_of(objects, tc, libs, arch):
        if spec.kernel_file != "router.hip" or int(dict(spec.defines)["AMDQB_NUM_EXPERTS"]) > 1024:
            continue
        k = co.kernels["amdqb_router_decode"]
        occ = tools_occupancy.occupancy(arch, k)
        assert occ.waves >= 8 and occ.at_block >= 8, (spec.label(), arch, occ, k.meta)
        assert k.spills == (0, 0) and k.scratch == 0, (spec.label(), arch, k.meta)
        seen += 1
    if tools_build.LIB_MODULES[libs] is None:  # every module built against this set
        assert seen, "no router module of E <= 1024 built"


# The kernels held to 8 waves per SIMD besides the decode form: the route and align kernels and
# the QB histogram passes (layout.hip; router.hip's amdqb_qb_hist / amdqb_qb_hist_bins).
EIGHT_WAVE_KERNELS = ("amdqb_route_", "amdqb_align", "amdqb_qb_hist")


@pytest.mark.parametrize("tc, libs, arch", target_params())
def test_route_align_and_qb_histogram_kernels_fit_eight_waves(objects, tc, libs, arch):
    """Every route / align kernel and both QB histogram passes: 8 waves per SIMD or more on every
    target with whole blocks resident, no spill, no scratch."""
    seen = 0
    for spec, co in modules_of(objects, tc, libs, arch):
        for name, k in co.kernels.items():
            if not name.startswith(EIGHT_WAVE_KERNELS):
                continue
            occ = tools_occupancy.occupancy(arch, k)
            assert occ.waves >= 8 and occ.at_block >= 8, (spec.label(), arch, name, occ, k.meta)
            assert k.spills == (0, 0) and k.scratch == 0, (spec.label(), arch, name, k.meta)
            seen += 1
    assert seen, "no route, align or QB histogram kernel built"


@pytest.mark.parametrize("tc, libs, arch", target_params())
def test_lds_inside_the_targets_budget(objects, tc, libs, arch):
    rules = tools_occupancy.RULES[arch]
    for spec, co in modules_of(objects, tc, libs, arch):
        for name, k in co.kernels.items():
            assert k.lds <= min(rules.lds_per_workgroup, 64 * 1024), (spec.label(), name, k.lds)


@pytest.mark.parametrize("tc, libs, arch", target_params())
def test_listing_agrees_with_the_metadata(objects, tc, libs, arch):
    """The ``; Kernel info`` comments of the listing the object was assembled from give the same
    register, LDS and scratch counts as the metadata note."""
    for spec, co in modules_of(objects, tc, libs, arch):
        for name, k in co.kernels.items():
            info = k.info
            assert info, (spec.label(), name, "no listing comments")
            assert info.get("TotalNumVgprs", info["NumVgprs"]) == k.vgprs, (name, info, k.meta)
            assert info.get("NumAgprs", 0) == k.agprs, (name, info, k.meta)
            assert sgprs(info) == k.sgprs, (name, info, k.meta)
            assert info["ScratchSize"] == k.scratch, (name, info, k.meta)
            assert info["LDSByteSize"] == k.lds, (name, info, k.meta)


@pytest.mark.parametrize("tc, libs, arch", target_params())
def test_expected_kernels_present(objects, tc, libs, arch):
    for spec, co in modules_of(objects, tc, libs, arch):
        assert tools_build.expected_kernels(spec) <= set(co.kernels), (
            spec.label(),
            sorted(co.kernels),
        )


# ------------------------------------------------------------------------------------------------
# Occupancy
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tc, libs, arch", target_params())
def test_occupancy_from_metadata_matches_llvm(objects, tc, libs, arch):
    """Waves per SIMD derived from the metadata equal the backend's own ``; Occupancy:``."""
    for spec, co in modules_of(objects, tc, libs, arch):
        for name, k in co.kernels.items():
            occ = tools_occupancy.occupancy(arch, k)
            assert occ.waves == k.info["Occupancy"], (spec.label(), name, occ, k.meta, k.info)
            assert 1 <= occ.at_block <= occ.waves, (spec.label(), name, occ)


def _probe_cases(arch):
    rules = tools_occupancy.RULES[arch]
    cases = [(v, 0, 0, 1, 256) for v in range(1, 257)]
    cases += [(0, s, 0, 1, 256) for s in range(1, 103)]
    blocks = [
        (1, 256),
        (1, 1024),
        (256, 256),
        (1024, 1024),
        (64, 64),
        (128, 512),
        (1, 64),
        (96, 96),
    ]
    sizes = [0, 1024, 4096, 8192, 12288, 16384, 20000, 24576, 32768, 40000, 49152, 65536]
    sizes += [98304, 131072, 163840, 200000, 327680]
    cases += [
        (0, 0, lds, lo, hi) for lo, hi in blocks for lds in sizes if lds <= rules.lds_per_workgroup
    ]
    cases += [(v, 0, 16384, 256, 256) for v in (40, 90, 130)]  # registers and LDS together
    return cases


@pytest.mark.parametrize("tc, arch", toolchain_params())
def test_occupancy_rules_match_llvm_on_probe_kernels(tc, arch):
    """The per-target register-file sizes, allocation granules, wave limits, LDS sizes and
    workgroup limits of tools_occupancy.RULES reproduce LLVM's occupancy for every VGPR count 1..256,
    SGPR count 1..102, and LDS sizes x block-size ranges (kernels that only clobber registers and
    touch LDS)."""
    toolchain = tools_toolchain.toolchain(int(tc.split("-")[1]))
    cases = _probe_cases(arch)
    infos = tools_occupancy.probe_occupancy(toolchain, arch, cases)
    rules = tools_occupancy.RULES[arch]
    bad = []
    for (v, s, lds, lo, hi), info in zip(cases, infos):
        assert info["LDSByteSize"] == lds
        want = min(
            tools_occupancy.waves_by_vgprs(rules, info["NumVgprs"]),
            tools_occupancy.waves_by_sgprs(rules, sgprs(info)),
            tools_occupancy.waves_by_workgroups(rules, lds, lo, hi),
        )
        if want != info["Occupancy"]:
            bad.append(((v, s, lds, lo, hi), info["Occupancy"], want))
    assert not bad, bad[:20]


def test_generated_tables_are_current(objects):
    """docs/amd_occupancy.md's generated sections (occupancy, ISA counts) equal what these builds
    give (so they cannot go stale: a kernel, flag or compiler change shows here; regenerate with
    ``python -m amdqb_tools table --write docs/amd_occupancy.md``)."""
    require(
        all(_available(tc) for tc, _ in TOOLCHAIN_TARGETS),
        "the tables cover every toolchain: " + _skip_reason(),
    )
    sections = tools_table.render_sections(tools_build.build_all())
    stale = tools_table.stale_sections(DOC, sections)
    assert not stale, (
        f"{DOC}: sections {stale} are stale: regenerate with "
        "`python -m amdqb_tools table --write docs/amd_occupancy.md`"
    )


# ------------------------------------------------------------------------------------------------
# ISA (disassembly of the linked code objects)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ids", ["i32", "i64"])
@pytest.mark.parametrize("tc, libs, arch", target_params())
def test_lds_route_kernel_privatises_histogram_and_reserves_once_per_expert(
    objects, tc, libs, arch, ids
):
    funcs = code_object(
        objects, tc, libs, arch, _spec.layout_module(tools_build.arch_config(arch))
    ).kernels
    new = funcs[f"amdqb_route_lds_{ids}"].code
    old = funcs[f"amdqb_route_atomic_{ids}"].instructions()
    # old: one global atomic site, executed once per route; no LDS, no barrier.
    assert count(old, GLOBAL_ATOMIC) == 1
    assert count(old, LDS_ATOMIC) == 0 and count(old, BARRIER) == 0
    text = [t for _, t, _ in new]
    # new: LDS histogram (ds_add) + LDS ranks (ds_add_rtn), three barriers.
    assert count(text, r"^ds_add_u32") >= 1
    assert count(text, r"^ds_add_rtn_u32") >= 1
    assert count(text, LDS_ATOMIC) >= 2 * tools_build.arch_config(arch)["hip.route.lds_items"]
    assert count(text, BARRIER) == 3
    # The per-expert loop (unrolled over a batch of 4 experts per thread): per expert one
    # returning global atomic (the interval reservation, once per (block, expert)) and one
    # non-returning (the accepted-count reduction after it); no other global atomic.
    sites = [(a, t) for a, t, _ in new if GLOBAL_ATOMIC.search(t)]
    ret = [a for a, t in sites if RETURNING.search(t)]
    assert len(ret) == 4 and len(sites) == 8, sites
    # The batch is in flight at once: no base is written back to LDS (which waits for the
    # atomic's result) before the last reservation is issued.
    between = [t for a, t, _ in new if ret[0] < a < ret[-1]]
    assert not any(re.match(r"ds_(store|write)", t) for t in between), between
    # All sites sit in one loop, whose body reads the LDS histogram (the count to reserve) and
    # writes the interval base back, and never loads route ids from global memory.
    loop = [(h, e) for h, e in tools_isa.loops(new) if h <= sites[0][0] and sites[-1][0] <= e]
    assert loop, (tools_isa.loops(new), sites)
    head, end = min(loop, key=lambda he: he[1] - he[0])
    body = [t for a, t, _ in new if head <= a <= end]
    assert any(re.match(r"ds_(load|read)", t) for t in body), body
    assert any(re.match(r"ds_(store|write)", t) for t in body), body
    assert not any(re.match(r"global_load", t) for t in body), body


@pytest.mark.parametrize("tc, libs, arch", target_params())
def test_qb_histogram_pass_counts_in_lds(objects, tc, libs, arch):
    spec = _spec.router_module(896, "float32", "sigmoid", tools_build.arch_config(arch))
    hist = code_object(objects, tc, libs, arch, spec).kernels["amdqb_qb_hist"].instructions()
    assert count(hist, LDS_ATOMIC) >= 1
    assert count(hist, GLOBAL_ATOMIC) == 1  # the flush of non-zero bins
    assert count(hist, BARRIER) == 2  # zeroed; counted
    # the vector form reads 4 experts' logits with one load: 16 bytes of fp32, 8 of bf16
    wide = {
        "float32": r"^global_load_(dwordx4|b128)\b",
        "bfloat16": r"^global_load_(dwordx2|b64)\b",
    }
    for dtype, pattern in wide.items():
        co = code_object(
            objects,
            tc,
            libs,
            arch,
            _spec.router_module(896, dtype, "sigmoid", tools_build.arch_config(arch)),
        )
        assert count(co.kernels["amdqb_qb_hist"].instructions(), pattern) >= 1, (dtype, arch)
    # fused_atomic epilogues (uniform and log_margin binning): one global atomic per (token,
    # expert) each, unrolled over the lane's slots (rows of a whole wave64 on gfx9: 64 lanes).
    router = code_object(objects, tc, libs, arch, spec).kernels["amdqb_router"].instructions()
    row = amd_wave_size(arch)
    assert count(router, GLOBAL_ATOMIC) == 2 * -(-896 // row)


# Kernels whose time is their loops, and the ds_bpermute they may keep there: the router family
# none (its butterflies, bitonic stages, scans and broadcasts lower to DPP / ds_swizzle /
# permlanex16 / readlane, matches to ballots), nor the deterministic rank passes (their peers
# read the bucket's slot from LDS themselves: layout.hip's warp_claim_slot).
HOT_BPERMUTE = {
    "amdqb_router": 0,
    "amdqb_router_decode": 0,
    "amdqb_router_scores": 0,
    "amdqb_qb_hist": 0,
    "amdqb_qb_hist_bins": 0,
    "amdqb_route_det_rank_i32": 0,
    "amdqb_route_det_rank_i64": 0,
    "amdqb_align": 0,
}
# Kernels that run straight through (a row of lanes per token, no loop around the selection or the
# sums), and the ds_bpermute they may keep anywhere in the kernel: the serving top-k none (its
# bitonic sorts, list merges, row rounds, group ranking and key selection lower to DPP /
# ds_swizzle / permlanex16 / readlane), nor the router backward (its row sums are butterflies).
STRAIGHT_BPERMUTE = {
    "amdqb_topk": 0,
    "amdqb_router_bwd": 0,
}


@pytest.mark.parametrize("tc, libs, arch", target_params())
def test_hot_loops_use_no_bpermute_chains(objects, tc, libs, arch):
    """No hot loop regresses to chains of ds_bpermute: every kernel keeps at most 2 of them
    (outside the router family: block scans' neighbour reads), the hot kernels' loops at most
    HOT_BPERMUTE, the straight-line kernels (serving top-k, router backward) at most
    STRAIGHT_BPERMUTE in all; the router's selection loop and the decode form's selection and
    merges run on DPP (and on gfx9 ds_swizzle for the xor by 16, gfx10+ permlanex16)."""
    seen = set()
    for spec, co in modules_of(objects, tc, libs, arch):
        seen |= set(co.kernels)
        for name, k in co.kernels.items():
            total = tools_isa.counts(k.code)
            looped = tools_isa.counts(k.code, only_loops=True)
            assert total["bpermute"] <= 2, (spec.label(), name, total)
            if name in HOT_BPERMUTE:
                assert looped["bpermute"] <= HOT_BPERMUTE[name], (spec.label(), name, looped)
            if name in STRAIGHT_BPERMUTE:
                assert total["bpermute"] <= STRAIGHT_BPERMUTE[name], (spec.label(), name, total)
        if spec.kernel_file == "router.hip":
            # the router's token loop and the decode form's (straight-line) selection and merge
            for name, only_loops in (("amdqb_router", True), ("amdqb_router_decode", False)):
                c = tools_isa.counts(co.kernels[name].code, only_loops=only_loops)
                assert c["dpp"] >= 20, (spec.label(), name, c)
                cross = c["swizzle"] if arch in ("gfx942", "gfx950") else c["permlane"]
                assert cross >= 1, (spec.label(), name, c)
    assert set(HOT_BPERMUTE) | set(STRAIGHT_BPERMUTE) <= seen, "every bounded kernel is built"


def test_amd_configs_follow_from_the_code_objects(objects):
    """The occupancy-derived entries of gfx942.json / gfx950.json / gfx1250.json are what the
    current code objects give -- values and the register / LDS figures their "why" quotes
    (regenerate with ``python -m amdqb_tools configs --write``) -- where the value differs from
    default.json's; a derived value equal to the default's is not in the architecture's file (the
    default stands until measured). The route gate gfx942 / gfx950 borrow from aiter's gfx1250
    measurement is marked as borrowed in their own files."""
    require(_available("clang-22"), _skip_reason())
    default = configs.load(configs.DEFAULT)
    for arch in tools_derive.DERIVED_ARCHS:
        cfg = configs.load(arch)
        for key, (value, why) in tools_derive.derived_entries(arch, objects).items():
            entry = cfg.entry(key)
            if value == default[key]:
                assert entry.source == configs.DEFAULT, (arch, key, "equals the default", entry)
                continue
            assert entry.source == arch, (arch, key, "not in the architecture's file")
            assert (entry.value, entry.why) == (value, why), (arch, key, entry, value, why)
            assert entry.provenance == tools_derive.PROVENANCE, (arch, key, entry.provenance)
        gate = cfg.entry("route.lds_gate_scale")
        assert gate.source == arch, (arch, "route gate inherited from default.json")
        if arch in ("gfx942", "gfx950"):
            assert gate.provenance.startswith("untuned:") and "borrowed" in gate.provenance, gate
