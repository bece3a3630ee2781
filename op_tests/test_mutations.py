"""The suite catches a broken kernel: for every mutant of ``mutants.py`` (a flipped tie-break or
an off-by-one histogram bin in the hip kernels on the emulator, NaN ranked first in a Triton
kernel), the op tests it names fail when run against it -- by an assertion, not a build error --
while the same tests pass on the real kernels in the rest of the suite.

Each mutant costs one pytest process of a few tests (and, for hip, one emulator build of the
patched sources); CPU only: the mutants patch the emulator's sources and the Triton interpreter."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mutants import ENV, MUTANTS

from conftest import HAS_GPU
from hip_emu.runtime import compiler

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(HAS_GPU, reason="the mutants patch the CPU emulator and Triton interpreter")
@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_op_tests_catch_the_mutant(name):
    mutant = MUTANTS[name]
    if mutant.source_edits and compiler() is None:
        pytest.skip("the hip mutants run on the emulator, which needs g++")
    env = {**os.environ, ENV: name, "PYTHONPATH": str(ROOT)}
    res = subprocess.run(
        [sys.executable, "-m", "pytest", *mutant.tests, "-n", "0", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 1, f"{mutant.what}: the tests did not fail (rc {res.returncode})"
    # failed by a test's own assertion on the outputs, not by a build or an interpreter error
    for broken in ("emulator build failed", "InterpreterError", "CompilationError"):
        assert broken not in out, f"{mutant.what}: {broken}\n{out[-3000:]}"
    assert re.search(r"^E +(assert |AssertionError)", out, re.M), out[-3000:]
