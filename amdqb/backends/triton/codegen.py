"""Ahead-of-time compilation of the Triton kernels for AMD targets, without an AMD GPU.

Each launcher module exposes ``codegen_specs() -> list[KernelSpec]``: a kernel with concrete
argument types and constexprs, as the launcher would specialise it. :func:`compile_spec` compiles
one for ``GPUTarget("hip", arch, wave)`` with Triton's AMD backend and reports what the ISA shows.
Used by the CI codegen test (in a subprocess: the interpreter must be off) and ``amdqb info``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# LDS a single workgroup may allocate, by target (bytes).
AMD_TARGETS = {"gfx942": (64, 64 * 1024), "gfx950": (64, 160 * 1024), "gfx1250": (32, 160 * 1024)}


@dataclass
class KernelSpec:
    name: str
    fn: object  # a @triton.jit function
    signature: dict  # arg name -> Triton type string ("*fp32", "i32", "constexpr", ...)
    constexprs: dict
    num_warps: int = 4
    expect_lds_atomics: bool = False  # the kernel's histogram must use LDS atomics (ds_add)
    notes: str = field(default="")


def compile_spec(spec: KernelSpec, arch: str) -> dict:
    """Compile ``spec`` for ``arch``; returns wave size, LDS bytes and atomic counts from the ISA."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    wave, lds_budget = AMD_TARGETS[arch]
    src = ASTSource(fn=spec.fn, signature=spec.signature, constexprs=spec.constexprs)
    compiled = triton.compile(
        src, target=GPUTarget("hip", arch, wave), options={"num_warps": spec.num_warps}
    )
    isa = compiled.asm["amdgcn"]
    meta = compiled.metadata
    return {
        "name": spec.name,
        "arch": arch,
        "wave_size": int(getattr(meta, "warp_size", wave)),
        "num_warps": int(meta.num_warps),
        "lds_bytes": int(meta.shared),
        "lds_budget": lds_budget,
        "lds_atomics": len(re.findall(r"\bds_(?:add|inc|max|min)_(?:rtn_)?[ub]32\b", isa)),
        "global_atomics": len(re.findall(r"\b(?:global|buffer|flat)_atomic_\w+", isa)),
        "expect_lds_atomics": spec.expect_lds_atomics,
        "isa_lines": isa.count("\n"),
    }


_PTR = {"i32": "*i32", "i64": "*i64", "f32": "*fp32", "bf16": "*bf16", "f16": "*fp16"}


def typed_spec(name, fn, ptrs, constexprs, num_warps, lds=False, notes="", ints=None) -> KernelSpec:
    """A :class:`KernelSpec` with every pointer typed from ``ptrs`` (name -> short dtype), the
    remaining runtime arguments i32 (or as ``ints`` says), constexprs as given."""
    ints = ints or {}
    sig = {}
    for arg in fn.arg_names:
        if arg in constexprs:
            sig[arg] = "constexpr"
        elif arg in ptrs:
            sig[arg] = _PTR[ptrs[arg]]
        else:
            sig[arg] = ints.get(arg, "i32")
    return KernelSpec(name, fn, sig, constexprs, num_warps, lds, notes)
