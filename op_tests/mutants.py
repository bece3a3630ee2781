"""Deliberate bugs planted in the kernels, for the suite's mutation check (test_mutations.py):
each mutant names the op tests that must fail when it is active.

A mutant is activated for a whole pytest session by ``AMDQB_TEST_MUTANT=<name>`` (conftest.py
calls :func:`activate` before any test runs); nothing of it touches the product's files:

* hip mutants compile the kernels from a patched copy of ``hip_src`` (the emulator builds from
  ``_spec.source_root()``, which points at the copy);
* Triton mutants replace a ``@triton.jit`` helper of a kernel module (the CPU interpreter resolves
  a kernel's helpers at call time).
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import triton
import triton.language as tl

ENV = "AMDQB_TEST_MUTANT"


@dataclass(frozen=True)
class Mutant:
    what: str  # the planted bug
    tests: tuple[str, ...]  # pytest arguments selecting the op tests that must catch it
    source_edits: tuple[tuple[str, str, str], ...] = ()  # hip: (header, text, replacement)


MUTANTS = {
    "hip_tie_break": Mutant(
        "hip: experts tied on the selection value rank by id descending (the tie-break flipped)",
        ("op_tests/test_router.py", "-k", "test_router_ties_nan_inf_exact and sigmoid and emu32"),
        (
            ("include/amdqb_prelude.h", "(ka == kb && ida < idb)", "(ka == kb && ida > idb)"),
            ("include/amdqb_select.h", "(k == bk && id <= bid)", "(k == bk && id >= bid)"),
        ),
    ),
    "hip_histogram_bin": Mutant(
        "hip: the QB uniform bin is one too high (floor(x) + 1, clamped)",
        ("op_tests/test_router_qb.py", "-k", "test_qb_bin_edges and emu32"),
        (
            (
                "include/amdqb_qb_bins.h",
                "return (int)floorf(fminf(fmaxf(x, 0.0f), (float)(num_bins - 1)));",
                "return (int)floorf(fminf(fmaxf(x + 1.0f, 0.0f), (float)(num_bins - 1)));",
            ),
        ),
    ),
    "triton_nan_rank": Mutant(
        "triton: NaN ranks above every number instead of below",
        ("op_tests/test_router.py", "-k", "test_router_ties_nan_inf_exact and sigmoid and triton"),
    ),
}


def activate(name: str) -> None:
    """Plant mutant ``name`` for this process."""
    mutant = MUTANTS[name]
    if mutant.source_edits:
        _patch_hip_sources(mutant)
    if name == "triton_nan_rank":
        _patch_triton_nan_rank()


def _patch_hip_sources(mutant: Mutant) -> None:
    from amdqb.backends.hip import _spec

    root = Path(tempfile.mkdtemp(prefix="amdqb_mutant_")) / "hip_src"
    shutil.copytree(_spec.source_root(), root)
    for rel, text, replacement in mutant.source_edits:
        path = root / rel
        source = path.read_text()
        assert source.count(text) == 1, f"the mutant's target {text!r} is not once in {rel}"
        path.write_text(source.replace(text, replacement))
    _spec.source_root = lambda: root


@triton.jit
def _order_key_nan_first(x):
    """``_router_kernels._order_key`` with NaN mapped above every number."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(x != x, 2147483647, key)


def _patch_triton_nan_rank() -> None:
    from amdqb.backends.triton import _router_kernels as K

    K._order_key = _order_key_nan_first
