"""Every Triton kernel, in the specialisations its launcher requests at the seed shapes, compiles
with Triton's AMD backend for gfx942, gfx950, gfx1100, gfx1201 and gfx1250 (amdqb_tools.
triton_codegen: the launches are recorded from public op calls while the dispatcher sees a device
of the target, then compiled through Triton's own JIT specialisation of those arguments).

Checked per compiled kernel: the target's wave size; LDS inside the target's budget; LDS atomics
in the ISA of the kernels that privatise a histogram; no scratch and no VGPR spills (but the known
case of :data:`KNOWN_SCRATCH`, bounded), few SGPR spills; at least :data:`MIN_WAVES` waves per SIMD (from the code object's register and LDS counts, the rules of
amdqb_tools.occupancy). The compilation runs in a subprocess with the interpreter off (the rest of
the suite may run with ``TRITON_INTERPRET=1``), two workers, results cached on disk by the
kernel's source and specialisation.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from amdqb._arch import amd_wave_size
from amdqb_tools.code_objects import inspect_tools
from amdqb_tools.toolchain import AMD_ARCHS

from conftest import require

# the module fixture compiles every kernel once: its tests stay on one xdist worker
pytestmark = pytest.mark.xdist_group("amd_codegen")

ROOT = Path(__file__).resolve().parents[1]
# Waves per SIMD every kernel must reach (the QB row update is the widest: 194 VGPRs on gfx942).
MIN_WAVES = 2
# SGPRs a kernel may spill: they go to VGPR lanes (v_writelane), not to memory.
MAX_SGPR_SPILLS = 16
# Known scratch: (launch, target) -> the most scratch bytes allowed. The QB row update at 1000 bins
# (4 rows of 1024 lanes, with the per-expert log_margin scales) needs more than RDNA's 256 VGPRs
# per lane: 484 / 472 B of scratch, 120 / 117 VGPRs spilled on gfx1100 / gfx1201 (gfx1250's 512
# per lane hold it). A smaller row block for RDNA would be a triton.qb config entry of that family.
KNOWN_SCRATCH = {
    ("qb_step:_qb_rows_kernel", "gfx1100"): 484,
    ("qb_step:_qb_rows_kernel", "gfx1201"): 484,
}


@pytest.fixture(scope="module")
def codegen_rows():
    try:
        import triton.backends.amd  # noqa: F401
    except ImportError as exc:
        require(False, f"needs Triton's AMD backend ({exc})")
    require(
        inspect_tools() is not None,
        "reads the code objects with llvm-readelf / llvm-objdump (apt-get install llvm-22)",
    )
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the launchers pass enable_fp_fusion themselves
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "amdqb_tools.triton_codegen"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=3000,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_kernel_compiles_for_every_amd_target(codegen_rows):
    assert codegen_rows, "no Triton launch was recorded: the codegen check would check nothing"
    errors = [r for r in codegen_rows if "error" in r]
    assert not errors, errors
    assert {r["arch"] for r in codegen_rows} == set(AMD_ARCHS)
    per_arch = {a: {r["name"] for r in codegen_rows if r["arch"] == a} for a in AMD_ARCHS}
    for arch, names in per_arch.items():  # every launcher family on every target
        for kernel in ("_router_fwd_kernel", "_qb_hist_kernel", "_route_lds_kernel"):
            assert any(n.endswith(":" + kernel) for n in names), (arch, kernel)
        assert len(names) >= 20, (arch, sorted(names))


def test_wave_size_and_lds_budget(codegen_rows):
    for row in codegen_rows:
        assert row["wave_size"] == amd_wave_size(row["arch"]), row
        assert row["lds_bytes"] <= row["lds_budget"], row


def test_histogram_kernels_use_lds_atomics(codegen_rows):
    rows = [r for r in codegen_rows if r["expect_lds_atomics"]]
    assert rows, "no LDS-histogram kernel among the launches"
    for row in rows:
        assert row["lds_atomics"] > 0, row


def test_no_scratch_no_spills_and_occupancy(codegen_rows):
    """No scratch and no VGPR spills (but :data:`KNOWN_SCRATCH`, within its bound), at most
    :data:`MAX_SGPR_SPILLS` SGPRs spilled to VGPR lanes, at least :data:`MIN_WAVES` waves/SIMD."""
    bad = []
    for r in codegen_rows:
        allowed = KNOWN_SCRATCH.get((r["name"], r["arch"]), 0)
        vgpr_spills, sgpr_spills = r["spills"]
        if (
            r["scratch"] > allowed or (vgpr_spills and not allowed)
        ) or sgpr_spills > MAX_SGPR_SPILLS:
            bad.append((r["name"], r["arch"], r["scratch"], r["spills"], r["vgprs"]))
        if r["waves"] < MIN_WAVES:
            bad.append((r["name"], r["arch"], "waves", r["waves"], r["vgprs"], r["lds_bytes"]))
    assert not bad, bad
    seen = {(r["name"], r["arch"]) for r in codegen_rows}
    assert set(KNOWN_SCRATCH) <= seen, "a known-scratch launch is no longer compiled: drop it"
