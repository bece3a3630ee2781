"""The kernels' hiprtc path (``__HIPCC_RTC__``: no hip_runtime.h, only what hiprtc predefines) built
as hiprtc builds it on a device (amdqb_tools.hiprtc: hiprtc's own options and builtin header in
front of the runtime's ``_spec.hip_flags``, bitcode without optimisation linked with the device
libraries, -O3 code generation, lld) with Debian's clang 22, for gfx942, gfx950, gfx1100, gfx1201
and gfx1250, against both device-library sets: Debian's ROCm 5.2 ocml / ockl and the ROCm 7.x ones
Triton's AMD backend ships. The modules (``amdqb_tools.hiprtc.module_variants``, from the offline
builds' list): the route / align module, the router at the seed shape and with sqrtsoftplus, the
serving top-k (topk.hip) at the peers' shapes and the router backward (router_bwd.hip). Each code
object must be linked with nothing left undefined (the builtin header's math resolved in ocml),
call nothing, hold every kernel at the target's wave size and keep the promised kernels free of
scratch (as op_tests/test_amd_code_objects.py promises them for the offline builds).

Nothing here runs a kernel (no AMD GPU); op_tests/test_hip_runtime_rocm.py drives the runtime's
hiprtc toolchain with Debian's real ROCm 5.2 hiprtc.
"""

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from amdqb._arch import amd_wave_size
from amdqb.backends.hip import _spec
from amdqb_tools import build as tools_build
from amdqb_tools import code_objects as tools_code_objects
from amdqb_tools import hiprtc as tools_hiprtc
from amdqb_tools import toolchain as tools_toolchain

from conftest import require

pytestmark = pytest.mark.xdist_group("amd_hiprtc")  # the module fixture builds everything once

ARCHS = tools_toolchain.AMD_ARCHS
LIBS = tools_toolchain.DEVICE_LIB_SETS
# Kernels of a router module that use no scratch and spill nothing; every kernel of the other
# modules uses no scratch, and every one but the router backward (which spills a few SGPRs into
# VGPR lanes on wave64) spills nothing.
NO_SCRATCH = ("amdqb_router_decode", "amdqb_qb_hist", "amdqb_qb_hist_bins")
WHOLE_MODULE = ("layout.hip", "topk.hip", "router_bwd.hip")


@pytest.fixture(scope="module")
def builds():
    """{(arch, libs, title): (Build, CodeObject)} of every hiprtc build (made once, cached)."""
    tc = tools_toolchain.toolchain(22)
    require(tc is not None, "needs clang-22, llvm-22 and lld-22 (see .ci/run)")
    require(
        tools_toolchain.inspect_tools() is not None, "needs llvm-readelf / llvm-objdump (llvm-22)"
    )
    require(tools_hiprtc.builtins_library() is not None, "needs libhiprtc-builtins5 (ROCm 5.2)")
    for libs in LIBS:
        require(
            tools_toolchain.device_bitcode_source(libs) is not None,
            f"needs the {libs} device libraries (rocm-device-libs / Triton's AMD backend)",
        )
    jobs = [
        (arch, libs, title, spec)
        for arch in ARCHS
        for libs in LIBS
        for title, spec in tools_hiprtc.module_variants(arch)
    ]
    for libs in LIBS:
        tools_toolchain.device_lib_dir(tc, libs)  # once, before the workers
    tools_hiprtc.builtin_header()

    def one(job):
        arch, libs, title, spec = job
        b = tools_hiprtc.build(tc, spec, arch, libs)
        co = tools_code_objects.inspect_build(b) if b.ok else None
        return (arch, libs, title), (b, co)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(one, jobs))


def of(builds, arch, libs):
    out = [(title, b, co) for (a, lb, title), (b, co) in builds.items() if (a, lb) == (arch, libs)]
    assert len(out) == len(tools_hiprtc.module_variants(arch)), (arch, libs)
    return out


params = pytest.mark.parametrize("arch, libs", [(a, lb) for a in ARCHS for lb in LIBS])


def test_the_commands_are_hiprtcs_around_the_runtimes_flags():
    """Step 1 passes hiprtc's own options (``__HIPCC_RTC__``, the builtin header, no GPU include
    path) and then exactly the runtime's flags, and compiles without optimisation; step 2
    generates code at -O3 with hiprtc's internalisation; step 3 links."""
    tc = tools_toolchain.toolchain(22)
    require(tc is not None, "needs clang-22 (see .ci/run)")
    require(tools_hiprtc.builtins_library() is not None, "needs libhiprtc-builtins5 (ROCm 5.2)")
    spec = _spec.layout_module(tools_build.arch_config("gfx942"))
    compile_bc, codegen, link = tools_hiprtc.commands(tc, spec, "gfx942", Path("/o"))
    fixed = tools_hiprtc.hiprtc_options(tools_hiprtc.builtin_header())
    assert "-D__HIPCC_RTC__" in fixed and "-nogpuinc" in fixed and "-include" in fixed
    i = compile_bc.index(fixed[0])
    assert compile_bc[i : i + len(fixed)] == fixed
    runtime = _spec.hip_flags("gfx942", 64, spec)
    j = i + len(fixed)
    assert compile_bc[j : j + len(runtime)] == runtime  # the runtime's, after hiprtc's
    assert compile_bc[j + len(runtime)].startswith("-I")
    assert ["-Xclang", "-disable-llvm-passes"] == compile_bc[-5:-3]
    assert "-O3" in codegen and "-amdgpu-internalize-symbols" in codegen
    assert link[1:4] == ["-flavor", "gnu", "-shared"]


@params
def test_every_hiprtc_build_links(builds, arch, libs):
    readelf, _ = tools_toolchain.inspect_tools()
    for title, b, co in of(builds, arch, libs):
        assert b.ok, (title, arch, libs, b.log[-4000:])
        header = subprocess.run(
            [readelf, "-h", str(b.hsaco)], check=False, capture_output=True, text=True
        ).stdout
        assert re.search(r"Type:\s+DYN", header) and re.search(r"Machine:\s+EM_AMDGPU", header)
        assert co.target == f"amdgcn-amd-amdhsa--{arch}", (title, co.target)
        assert co.undefined == [], (title, arch, libs, co.undefined)
        assert co.calls == [], (title, arch, libs, co.calls[:5])


@params
def test_hiprtc_builds_hold_every_kernel_at_the_wave_size(builds, arch, libs):
    for title, b, co in of(builds, arch, libs):
        spec = b.spec
        assert tools_build.expected_kernels(spec) <= set(co.kernels), (title, sorted(co.kernels))
        for name, k in co.kernels.items():
            assert k.wave == amd_wave_size(arch), (title, name, k.meta)
            assert k.dynamic_stack is False, (title, name)
        names = sorted(co.kernels) if spec.kernel_file in WHOLE_MODULE else NO_SCRATCH
        for name in names:
            k = co.kernels[name]
            assert k.scratch == 0, (title, arch, libs, name, k.meta)
            if spec.kernel_file != "router_bwd.hip":
                assert k.spills == (0, 0), (title, arch, libs, name, k.meta)
