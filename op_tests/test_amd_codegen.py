"""Every Triton kernel compiles for gfx942, gfx950 and gfx1250 with Triton's AMD backend.

The compilation runs in a subprocess with the interpreter off (the rest of the suite may run with
``TRITON_INTERPRET=1``). Asserts the wave size of the target, LDS use inside the target's budget and,
for kernels that privatise a histogram, LDS atomics in the ISA.
"""

import json
import os
import subprocess
import sys

import pytest

# the module fixture builds every kernel once: its tests stay on one xdist worker
pytestmark = pytest.mark.xdist_group("amd_codegen")

SCRIPT = r"""
import json, sys
from amdqb.backends.triton import aux_loss, chunks, codegen, layout, qb, router

rows = []
for module in (router, layout, qb, chunks, aux_loss):
    for spec in module.codegen_specs():
        for arch in codegen.AMD_TARGETS:
            try:
                rows.append(codegen.compile_spec(spec, arch))
            except Exception as exc:  # report, the test fails on it
                rows.append({"name": spec.name, "arch": arch, "error": repr(exc)[:2000]})
print(json.dumps(rows))
"""


@pytest.fixture(scope="module")
def codegen_rows():
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_kernel_compiles_for_every_amd_target(codegen_rows):
    if not codegen_rows:
        pytest.skip("no Triton kernels registered yet")
    errors = [r for r in codegen_rows if "error" in r]
    assert not errors, errors
    archs = {r["arch"] for r in codegen_rows}
    assert archs == {"gfx942", "gfx950", "gfx1250"}


def test_wave_size_and_lds_budget(codegen_rows):
    for row in codegen_rows:
        if "error" in row:
            continue
        expected_wave = 32 if row["arch"] == "gfx1250" else 64
        assert row["wave_size"] == expected_wave, row
        assert row["lds_bytes"] <= row["lds_budget"], row


def test_histogram_kernels_use_lds_atomics(codegen_rows):
    rows = [r for r in codegen_rows if r.get("expect_lds_atomics")]
    if not rows:
        pytest.skip("no LDS-histogram kernel registered yet")
    for row in rows:
        assert row["lds_atomics"] > 0, row
