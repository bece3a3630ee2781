"""Instruction counts of the cross-lane and atomic operations in a kernel's disassembly.

Categories (first token of each instruction of ``llvm-objdump -d``):

* ``bpermute``: ``ds_bpermute_b32`` / ``ds_permute_b32``, LDS-pipe lane permutes with a per-lane
  address (the prelude keeps them for shuffles whose lane pattern is known only at run time);
* ``dpp``: VALU instructions with a DPP operand (``*_dpp``: quad_perm, row_shr, row_bcast,
  row_mirror, row_xmask, ...), lane permutes fused into the arithmetic;
* ``swizzle``: ``ds_swizzle_b32`` (fixed-pattern permute on the LDS pipe, no address operand);
* ``permlane``: ``v_permlane*`` (gfx10+ VALU permutes across rows of 16);
* ``readlane``: ``v_readlane_b32`` / ``v_readfirstlane_b32`` (one lane to a scalar; also how
  SGPRs spilled to VGPR lanes come back);
* ``writelane``: ``v_writelane_b32`` (the prelude writes none: SGPR spills to VGPR lanes);
* ``lds_atomic``: LDS read-modify-writes (``ds_add_u32``, ``ds_add_rtn_u32``, ...);
* ``global_atomic``: ``global_`` / ``flat_`` / ``buffer_atomic_*``.

``in_loops`` counts only instructions inside a loop (between a backward branch's target and the
branch), where a kernel spends its time.
"""

from __future__ import annotations

import re

CATEGORIES = {
    "bpermute": re.compile(r"^ds_b?permute_b32\b"),
    "dpp": re.compile(r"^v_\w+_dpp\b"),
    "swizzle": re.compile(r"^ds_swizzle_b32\b"),
    "permlane": re.compile(r"^v_permlane\w*"),
    "readlane": re.compile(r"^v_read(first)?lane_b32\b"),
    "writelane": re.compile(r"^v_writelane_b32\b"),
    "lds_atomic": re.compile(
        r"^ds_(add|sub|rsub|inc|dec|min|max|and|or|xor|cmpst|cmpstore|wrxchg|cmpswap|cond_sub|"
        r"sub_clamp)(_rtn)?_[ubf]\d+"
    ),
    "global_atomic": re.compile(r"^(global|flat|buffer)_atomic_\w+"),
}


def loops(code) -> list[tuple[int, int]]:
    """[(header address, last latch address)] of a kernel's loops: its backward branches, merged
    per header."""
    latest: dict[int, int] = {}
    for addr, _, target in code:
        if target is not None and target <= addr:
            latest[target] = max(latest.get(target, addr), addr)
    return sorted(latest.items())


def in_any_loop(code) -> list[bool]:
    """Per instruction of ``code``: whether it lies inside one of the kernel's loops."""
    spans = loops(code)
    return [any(h <= addr <= e for h, e in spans) for addr, _, _ in code]


def counts(code, only_loops: bool = False) -> dict[str, int]:
    """{category: instructions} of a kernel (``code``: ``Kernel.code`` of amdqb_tools.code_objects)."""
    inside = in_any_loop(code) if only_loops else [True] * len(code)
    out = dict.fromkeys(CATEGORIES, 0)
    for (_, text, _), keep in zip(code, inside):
        if not keep:
            continue
        for name, pattern in CATEGORIES.items():
            if pattern.search(text):
                out[name] += 1
    return out
