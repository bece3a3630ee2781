"""The emulator's model of the AMDGCN cross-lane builtins (op_tests/hip_emu/amdqb_emu.h), one
builtin at a time against the AMDGPU ISA documents' definitions written out here: ds_bpermute,
ds_swizzle (bit-mask and quad-permute modes), DPP moves (every control of gfx9 and of gfx10+, row
and bank masks, bound_ctrl), permlane16 / permlanex16 (gfx10+), readlane / readfirstlane, the
64-bit ballot and mbcnt lo / hi, on whole waves, on partial waves (a block's last wave: its
missing lanes inactive) and in 32-lane rows of a wave64 (a lane of the other half reads as the
model's garbage marker, so a 32-lane primitive that depends on it fails its tests).

The kernels' AMD branches run on this model in the emulator tests of the ops (``hip-gfx942``,
``hip-gfx1250`` parameters).
"""

import ctypes
import os

import pytest
import torch

from amdqb.backends.hip import _spec

from conftest import needs
from hip_emu import runtime as emu_runtime
from hip_emu.backend import runtime
from hip_emu.runtime import compiler

pytestmark = [
    pytest.mark.emulator,
    needs(compiler() is not None, "needs g++ (C++20) for the emulator"),
]

OPS = {
    "bpermute": 0,
    "swizzle": 1,
    "update_dpp": 2,
    "readlane": 3,
    "readfirstlane": 4,
    "ballot": 5,
    "mbcnt_lo": 6,
    "mbcnt_hi": 7,
    "permlanex16": 8,
    "permlane16": 9,
}
M32 = 0xFFFFFFFF


def garbage(lane: int) -> int:
    """The model's value of a lane outside the caller's row (amdqb_emu::garbage), as int32."""
    return _i32(0xA5A5A5A5 ^ ((lane * 0x9E3779B9) & M32))


def _i32(x: int) -> int:
    x &= M32
    return x - (1 << 32) if x >= 1 << 31 else x


def run(arch, op, values, old=None, a=0, b=0, c=0, d=0, scope=None):
    """out[t] of builtin ``op`` over one block of ``len(values)`` lanes on ``arch``'s model."""
    rt = runtime(arch=arch)
    fn = rt.lane_ops().amdqb_emu_launch_amdqb_emu_lane_op
    fn.argtypes = [ctypes.c_uint] * 4 + [ctypes.c_ulonglong, ctypes.c_void_p]
    n = len(values)
    inp = torch.tensor([_i32(v) for v in values], dtype=torch.int32)
    old_t = torch.tensor([_i32(v) for v in (old or [0] * n)], dtype=torch.int32)
    out = torch.full((n,), -7, dtype=torch.int32)
    args = [_spec.arg_ptr(t.data_ptr()) for t in (inp, old_t, out)]
    args += [_spec.arg_i32(x) for x in (OPS[op], a, b, c, d, scope or rt.wave_size)]
    params = _spec.KernelParams(args)
    assert fn(1, 1, 1, n, 0, params.address) == 0
    return out.tolist()


WAVE = {"gfx942": 64, "gfx1250": 32}
ARCHS = list(WAVE)


def lanes_of(arch, seed=1, n=None):
    """Random int32 lane values: a whole wave of ``arch`` (``n`` lanes if given)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, (n or WAVE[arch],), generator=g).tolist()


def expect(values, source, inactive, row=None):
    """out[l] = values[source(l)]; ``inactive(l)`` where the source is out of bounds or beyond the
    block; garbage where it lies outside lane l's row (``row``: lanes per row)."""
    n, out = len(values), []
    for lane in range(n):
        s = source(lane)
        if s is None or s >= n:
            out.append(inactive(lane))
        elif row is not None and s // row != lane // row:
            out.append(garbage(s))
        else:
            out.append(values[s])
    return out


# ------------------------------------------------------------------------------------------------
# ds_bpermute, ds_swizzle
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("n", ["full", "partial"])
def test_bpermute_reads_lane_addr_over_4_modulo_the_wave(arch, n):
    wave = WAVE[arch]
    count = wave if n == "full" else wave - 11
    vals = lanes_of(arch, count, count)
    g = torch.Generator().manual_seed(count)
    lanes = torch.randint(0, 4 * wave, (count,), generator=g).tolist()  # beyond the wave: wraps
    got = run(arch, "bpermute", vals, old=[4 * s for s in lanes])
    assert got == expect(vals, lambda i: lanes[i] % wave, lambda i: 0)


def test_bpermute_outside_the_row_is_garbage():
    vals = lanes_of("gfx942")
    src = [(i + 17) % 64 for i in range(64)]
    got = run("gfx942", "bpermute", vals, old=[4 * s for s in src], scope=32)
    assert got == expect(vals, lambda i: src[i], lambda i: 0, row=32)
    assert got[20] == garbage(37) != vals[37]


def _swizzle_bitmask(and_mask, or_mask, xor_mask):
    return lambda i: (i & ~31) | (((i & 31 & and_mask) | or_mask) ^ xor_mask)


@pytest.mark.parametrize("arch", ARCHS)
def test_swizzle_bitmask_and_quad_modes(arch):
    vals = lanes_of(arch)
    cases = [(0x1F, 0, m) for m in range(1, 32)]  # xor butterflies inside 32 lanes
    cases += [(0, k, 0) for k in (0, 7, 31)] + [(0x18, 3, 4), (0x1C, 0, 0)]  # broadcasts, groups
    for and_mask, or_mask, xor_mask in cases:
        pattern = and_mask | (or_mask << 5) | (xor_mask << 10)
        got = run(arch, "swizzle", vals, a=pattern)
        want = expect(vals, _swizzle_bitmask(and_mask, or_mask, xor_mask), lambda i: 0)
        assert got == want, (and_mask, or_mask, xor_mask)
    for perm in ([1, 0, 3, 2], [3, 3, 0, 1], [0, 0, 0, 0]):
        pattern = 0x8000 | sum(p << (2 * j) for j, p in enumerate(perm))
        got = run(arch, "swizzle", vals, a=pattern)
        assert got == expect(vals, lambda i, p=perm: (i & ~3) | p[i & 3], lambda i: 0), perm
    # partial wave: a swizzle reading a missing lane gets 0
    short = vals[: WAVE[arch] - 5]
    got = run(arch, "swizzle", short, a=0x1F | (16 << 10))
    assert got == expect(short, _swizzle_bitmask(0x1F, 0, 16), lambda i: 0)


# ------------------------------------------------------------------------------------------------
# DPP
# ------------------------------------------------------------------------------------------------
def dpp_controls(arch):
    """{control: source lane of lane i (None: out of bounds)} of every DPP16 control of ``arch``."""
    wave = WAVE[arch]
    ctrls = {}
    for q in (0x1B, 0xB1, 0x4E, 0xE4, 0x00, 0xFF, 0x93):
        ctrls[q] = lambda i, q=q: (i & ~3) | ((q >> (2 * (i & 3))) & 3)
    for n in range(1, 16):
        ctrls[0x100 + n] = lambda i, n=n: i + n if (i & 15) + n <= 15 else None  # row_shl
        ctrls[0x110 + n] = lambda i, n=n: i - n if (i & 15) >= n else None  # row_shr
        ctrls[0x120 + n] = lambda i, n=n: (i & ~15) | (((i & 15) - n) % 16)  # row_ror
    ctrls[0x140] = lambda i: (i & ~15) | (15 - (i & 15))  # row_mirror
    ctrls[0x141] = lambda i: (i & ~7) | (7 - (i & 7))  # row_half_mirror
    if arch == "gfx942":
        ctrls[0x130] = lambda i: i + 1 if i + 1 < wave else None  # wave_shl:1
        ctrls[0x134] = lambda i: (i + 1) % wave  # wave_rol:1
        ctrls[0x138] = lambda i: i - 1 if i >= 1 else None  # wave_shr:1
        ctrls[0x13C] = lambda i: (i - 1) % wave  # wave_ror:1
        ctrls[0x142] = lambda i: (i & ~15) - 1 if i >= 16 else None  # row_bcast:15
        ctrls[0x143] = lambda i: 31 if i >= 32 else None  # row_bcast:31
    else:
        for n in range(16):
            ctrls[0x150 + n] = lambda i, n=n: (i & ~15) | n  # row_share
            ctrls[0x160 + n] = lambda i, n=n: (i & ~15) | ((i & 15) ^ n)  # row_xmask
    return ctrls


@pytest.mark.parametrize("arch", ARCHS)
def test_update_dpp_every_control(arch):
    vals, old = lanes_of(arch), lanes_of(arch, 7)
    for ctrl, src in dpp_controls(arch).items():
        for bound_ctrl in (0, 1):
            got = run(arch, "update_dpp", vals, old=old, a=ctrl, b=0xF, c=0xF, d=bound_ctrl)
            want = expect(vals, src, lambda i, bc=bound_ctrl: 0 if bc else old[i])
            assert got == want, (hex(ctrl), bound_ctrl)


@pytest.mark.parametrize("arch", ARCHS)
def test_update_dpp_masks_and_partial_waves(arch):
    wave = WAVE[arch]
    vals, old = lanes_of(arch), lanes_of(arch, 9)
    shr1 = dpp_controls(arch)[0x111]
    for row_mask, bank_mask in ((0xA, 0xF), (0x5, 0x3), (0xF, 0x8)):
        got = run(arch, "update_dpp", vals, old=old, a=0x111, b=row_mask, c=bank_mask, d=1)
        want = expect(vals, shr1, lambda i: 0)
        for i in range(wave):
            if not (row_mask >> (i // 16)) & 1 or not (bank_mask >> ((i % 16) // 4)) & 1:
                want[i] = old[i]
        assert got == want, (row_mask, bank_mask)
    # inactive source lanes (missing from the block): 0 with bound_ctrl, old without
    n = wave - 6
    for bound_ctrl in (0, 1):
        got = run(arch, "update_dpp", vals[:n], old=old[:n], a=0x101, b=0xF, c=0xF, d=bound_ctrl)
        src = dpp_controls(arch)[0x101]
        assert got == expect(vals[:n], src, lambda i, bc=bound_ctrl: 0 if bc else old[i])


def test_row_broadcasts_and_wave_shifts_of_gfx9():
    vals, old = lanes_of("gfx942"), lanes_of("gfx942", 3)
    # row_bcast:15 into rows 1 and 3 (row_mask 0xA): the scan step that crosses 16 lanes
    got = run("gfx942", "update_dpp", vals, old=old, a=0x142, b=0xA, c=0xF, d=0)
    assert got[16:32] == [vals[15]] * 16 and got[48:64] == [vals[47]] * 16
    assert got[:16] == old[:16] and got[32:48] == old[32:48]
    # within a 32-lane row, row_bcast:31 reads across the halves: garbage there
    got = run("gfx942", "update_dpp", vals, old=old, a=0x143, b=0xC, c=0xF, d=0, scope=32)
    assert got[32:] == [garbage(31)] * 32 and got[:32] == old[:32]


# ------------------------------------------------------------------------------------------------
# permlane16 / permlanex16 (gfx10+)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["permlane16", "permlanex16"])
def test_permlanes_of_gfx12(op):
    vals, old = lanes_of("gfx1250"), lanes_of("gfx1250", 5)
    for sel in (list(range(16)), [15] * 16, [(3 * k + 1) % 16 for k in range(16)]):
        sel_lo = sum(s << (4 * k) for k, s in enumerate(sel[:8]))
        sel_hi = sum(s << (4 * k) for k, s in enumerate(sel[8:]))

        def src(i, sel=sel):
            row = (i & ~31) | ((~i) & 16) if op == "permlanex16" else i & ~15
            return row | sel[i & 15]

        for bound_ctrl in (0, 1):
            got = run("gfx1250", op, vals, old=old, a=_i32(sel_lo), b=_i32(sel_hi), d=bound_ctrl)
            assert got == expect(vals, src, lambda i: 0), (sel, bound_ctrl)
            short = 25  # lanes 25..31 inactive
            got = run("gfx1250", op, vals[:short], old=old[:short], a=_i32(sel_lo), b=_i32(sel_hi))
            assert got == expect(vals[:short], src, lambda i: old[i]), sel


# ------------------------------------------------------------------------------------------------
# readlane, readfirstlane, ballot, mbcnt
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_readlane_readfirstlane(arch):
    wave = WAVE[arch]
    vals = lanes_of(arch)
    for lane in (0, 5, wave - 1):
        assert run(arch, "readlane", vals, a=lane) == [vals[lane]] * wave
    assert run(arch, "readfirstlane", vals) == [vals[0]] * wave
    short = vals[:20]
    assert run(arch, "readlane", short, a=25) == [garbage(25)] * 20  # an inactive lane
    if arch == "gfx942":  # rows of 32: each half reads its own first lane; lane 40 is row 1's
        assert run(arch, "readfirstlane", vals, scope=32) == [vals[0]] * 32 + [vals[32]] * 32
        got = run(arch, "readlane", vals, a=40, scope=32)
        assert got == [garbage(40)] * 32 + [vals[40]] * 32


@pytest.mark.parametrize("arch", ARCHS)
def test_ballot_and_mbcnt(arch):
    wave = WAVE[arch]
    g = torch.Generator().manual_seed(3)
    pred = torch.randint(0, 2, (wave,), generator=g).tolist()
    mask = sum(p << i for i, p in enumerate(pred))
    assert run(arch, "ballot", pred) == [_i32(mask)] * wave
    assert run(arch, "ballot", pred, a=1) == [0 if wave == 32 else _i32(mask >> 32)] * wave
    n = wave - 9  # inactive lanes contribute 0 bits
    part = sum(p << i for i, p in enumerate(pred[:n]))
    lo, hi = run(arch, "ballot", pred[:n]), run(arch, "ballot", pred[:n], a=1)
    assert lo == [_i32(part)] * n and hi == [_i32(part >> 32) if wave == 64 else 0] * n
    masks = lanes_of(arch)
    acc = list(range(wave))
    below = [(1 << i) - 1 for i in range(wave)]
    assert run(arch, "mbcnt_lo", masks, old=acc) == [
        acc[i] + bin(masks[i] & M32 & (below[i] if i < 32 else M32)).count("1") for i in range(wave)
    ]
    assert run(arch, "mbcnt_hi", masks, old=acc) == [
        acc[i] + (bin(masks[i] & M32 & below[i - 32]).count("1") if i >= 32 else 0)
        for i in range(wave)
    ]


def test_ballot_of_a_32_lane_row_has_garbage_in_the_other_half():
    pred = [1 if i % 3 == 0 else 0 for i in range(64)]
    lo = run("gfx942", "ballot", pred, scope=32)
    hi = run("gfx942", "ballot", pred, a=1, scope=32)
    row0 = sum(p << i for i, p in enumerate(pred[:32]))
    row1 = sum(p << i for i, p in enumerate(pred[32:]))
    junk_hi = sum((garbage(32 + i) & 1) << i for i in range(32))
    junk_lo = sum((garbage(i) & 1) << i for i in range(32))
    assert lo[:32] == [_i32(row0)] * 32 and hi[:32] == [_i32(junk_hi)] * 32
    assert lo[32:] == [_i32(junk_lo)] * 32 and hi[32:] == [_i32(row1)] * 32


def _mapped_bytes() -> int:
    """The process's address space (VmSize)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize in /proc/self/status")


@pytest.mark.skipif(not os.path.isfile("/proc/self/status"), reason="reads VmSize in /proc")
def test_libraries_not_launched_lately_release_their_stacks(monkeypatch):
    """Each emulator library keeps the fiber stacks of its launches (512 KiB of address space per
    GPU thread: 128 MiB for a 256-thread block); a test run loads hundreds of libraries. Only the
    most recently launched keep theirs: with room for one, alternating between two libraries keeps
    one set mapped."""
    monkeypatch.setattr(emu_runtime, "_LIVE_STACKS", 1)
    lanes = list(range(256))
    rt = runtime(arch="gfx942")
    prims = rt.warp_ops()
    fn = prims.amdqb_emu_launch_amdqb_emu_warp_op
    fn.argtypes = [ctypes.c_uint] * 4 + [ctypes.c_ulonglong, ctypes.c_void_p]

    def warp_launch():
        bufs = [torch.zeros(256, dtype=torch.int32) for _ in range(4)]
        args = [_spec.arg_ptr(t.data_ptr()) for t in bufs] + [_spec.arg_i32(x) for x in (12, 0, 32)]
        assert fn(1, 1, 1, 256, 0, _spec.KernelParams(args).address) == 0
        assert [v & 0xFF for v in bufs[2].tolist()] == [t % 32 for t in lanes]  # the lane ids

    run("gfx942", "readfirstlane", lanes)  # the lane-ops library maps 256 stacks
    before = _mapped_bytes()
    rt.warp_ops()
    warp_launch()  # this library maps its own, the lane-ops library's are released
    after = _mapped_bytes()
    assert after < before + (64 << 20), (before, after)
    for _ in range(3):
        run("gfx942", "readfirstlane", lanes)
        rt.warp_ops()
        warp_launch()
    assert _mapped_bytes() < before + (64 << 20), (before, _mapped_bytes())
