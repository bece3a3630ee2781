"""The prelude's logical-warp primitives (``amdqb::Warp<W>``, hip_src/include/amdqb_prelude.h) on
the emulator against their contracts, one primitive at a time: on the AMDGCN model of gfx942
(wave64: Warp<32> in both halves of each wave, and Warp<64>) and gfx1250 (wave32), where the AMD
branches run (DPP scans and sums, ds_swizzle / row_xmask / permlanex16 butterflies, readlane
broadcasts, ballot-per-bit matches), and on the emulator's substitutes (wave32 and wave64). The fp32
sum must equal the contract's association order bit for bit (the butterfly over 16, 8, 4, 2, 1
inside each 32 lanes, then the lower 32's sum plus the upper 32's), which is what keeps the router's
results identical across widths and platforms.
"""

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from amdqb.backends.hip import _spec

from conftest import needs
from hip_emu.backend import runtime
from hip_emu.runtime import compiler

pytestmark = [
    pytest.mark.emulator,
    needs(compiler() is not None, "needs g++ (C++20) for the emulator"),
]

OPS = {
    "shfl_xor": 0,
    "shfl": 1,
    "bcast": 2,
    "sum_i32": 3,
    "sum_f32": 4,
    "max_f32": 5,
    "inclusive_sum_u32": 6,
    "ballot": 7,
    "prefix_count": 8,
    "match_any": 9,
    "match_any_in": 10,
    "lanemask_lt": 11,
    "lane_index": 12,
    "sat_scan": 13,
}
# (lane model, logical-warp width): the AMD branches on gfx942 (both widths) and gfx1250, the
# emulator's substitutes on wave32 and wave64
MODELS = [("gfx942", 32), ("gfx942", 64), ("gfx1250", 32), (32, 32), (64, 32)]
M32 = 0xFFFFFFFF
BLOCK = 128  # two wave64s, four wave32s


def _rt(model, fiber_switch="native"):
    if isinstance(model, str):
        return runtime(arch=model, fiber_switch=fiber_switch)
    return runtime(model, fiber_switch=fiber_switch)


def run(model, width, op, values, aux=None, arg=0, fiber_switch="native"):
    """(out, out2) of primitive ``op`` of Warp<width> over one block of ``len(values)`` lanes;
    ``fiber_switch``: how the emulator's fibers switch stacks (EmuRuntime's)."""
    fn = _rt(model, fiber_switch).warp_ops().amdqb_emu_launch_amdqb_emu_warp_op
    fn.argtypes = [ctypes.c_uint] * 4 + [ctypes.c_ulonglong, ctypes.c_void_p]
    n = len(values)
    inp = torch.tensor(np.asarray(values, dtype=np.int64).astype(np.int32), dtype=torch.int32)
    aux_t = torch.tensor(aux if aux is not None else [0] * n, dtype=torch.int32)
    out, out2 = torch.full((n,), -7, dtype=torch.int32), torch.full((n,), -7, dtype=torch.int32)
    args = [_spec.arg_ptr(t.data_ptr()) for t in (inp, aux_t, out, out2)]
    arg = arg - (1 << 32) if arg >= 1 << 31 else arg  # a u32 argument as its int32 bits
    args += [_spec.arg_i32(x) for x in (OPS[op], arg, width)]
    params = _spec.KernelParams(args)
    assert fn(1, 1, 1, n, 0, params.address) == 0
    lo = out.numpy().view(np.uint32).astype(np.uint64)
    hi = out2.numpy().view(np.uint32).astype(np.uint64)
    return lo.astype(np.int64), (hi << np.uint64(32)) | lo


def mask_of(bits) -> int:
    """The mask with bit l set where bits[l] is true."""
    return sum(1 << i for i, b in enumerate(bits) if b)


def groups(x, width):
    return np.asarray(x).reshape(-1, width)


def per_lane(width, fn, x):
    """fn applied to each logical warp (an array of ``width`` lane values), per lane."""
    return np.concatenate([fn(g) for g in groups(x, width)])


def ints(seed, n=BLOCK, lo=-(2**31), hi=2**31 - 1):
    return torch.randint(lo, hi, (n,), generator=torch.Generator().manual_seed(seed)).numpy()


params = pytest.mark.parametrize(
    "model, width",
    MODELS,
    ids=[f"{m if isinstance(m, str) else f'emu{m}'}-w{w}" for m, w in MODELS],
)


@params
def test_shuffles_and_broadcast(model, width):
    v = ints(1)
    lanes = np.arange(width)
    for m in range(1, width):
        got, _ = run(model, width, "shfl_xor", v, arg=m)
        assert np.array_equal(got, per_lane(width, lambda g, m=m: g[lanes ^ m] & M32, v)), m
    src = ints(2, lo=0, hi=1 << 16)
    got, _ = run(model, width, "shfl", v, aux=src.tolist())
    want = np.concatenate(
        [g[s % width] & M32 for g, s in zip(groups(v, width), groups(src, width))]
    )
    assert np.array_equal(got, want)
    for lane in (0, 7, width - 1):
        got, _ = run(model, width, "bcast", v, arg=lane)
        assert np.array_equal(
            got, per_lane(width, lambda g, lane=lane: np.full(width, g[lane] & M32), v)
        )


@params
def test_integer_sum_and_scans(model, width):
    v = ints(3)
    got, _ = run(model, width, "sum_i32", v)
    assert np.array_equal(got, per_lane(width, lambda g: np.full(width, g.sum() & M32), v))
    got, _ = run(model, width, "inclusive_sum_u32", v)
    assert np.array_equal(got, per_lane(width, lambda g: np.cumsum(g & M32) & M32, v))
    cap = 1 << 31  # the saturating scan of the compact offsets: values up to 2^31, cap 2^31
    big = ints(4, lo=0, hi=1 << 27)
    big[::9] = 1 << 30
    got, _ = run(model, width, "sat_scan", big, arg=cap)

    def sat(g):
        out, acc = [], 0
        for x in g:
            acc = min(acc + int(x), cap)
            out.append(acc)
        return np.array(out)

    assert np.array_equal(got, per_lane(width, sat, big))


def butterfly(g, op):
    """The contract's association order over one logical warp (32 or 64 lanes) of float32."""

    def within32(x):
        x = x.copy()
        for m in (16, 8, 4, 2, 1):
            x = op(x, x[np.arange(32) ^ m])
        return x[0]

    halves = [within32(g[i : i + 32]) for i in range(0, len(g), 32)]
    total = halves[0] if len(halves) == 1 else op(halves[0], halves[1])
    return np.full(len(g), np.float32(total).view(np.uint32), dtype=np.int64)


@params
def test_float_sum_and_max_in_the_contracts_order(model, width):
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(BLOCK, generator=g) * torch.logspace(-6, 6, BLOCK)).numpy().astype(np.float32)
    x[::13] = np.nan  # max: NaN is ignored unless every lane is NaN
    bits = x.view(np.int32)
    got, _ = run(model, width, "max_f32", bits)
    assert np.array_equal(got, per_lane(width, lambda gr: butterfly(gr, np.fmax), x))
    x = np.nan_to_num(x, nan=1.5)
    got, _ = run(model, width, "sum_f32", x.view(np.int32))
    want = per_lane(width, lambda gr: butterfly(gr, lambda a, b: (a + b).astype(np.float32)), x)
    assert np.array_equal(got, want)

    # the order matters: a sequential sum differs in some logical warp (the check is not vacuous)
    def sequential(gr):
        acc = np.float32(0)
        for val in gr:
            acc = np.float32(acc + val)
        return acc.view(np.uint32)

    assert any(sequential(gr) != w[0] for gr, w in zip(groups(x, width), groups(want, width)))


@params
def test_ballots_counts_masks(model, width):
    p = ints(6, lo=0, hi=2)
    _, got = run(model, width, "ballot", p)
    want = per_lane(width, lambda g: np.full(width, mask_of(g), dtype=np.uint64), p)
    assert np.array_equal(got, want)
    got, _ = run(model, width, "prefix_count", p)
    assert np.array_equal(got, per_lane(width, lambda g: np.cumsum(g) - g, p))
    _, got = run(model, width, "lanemask_lt", p)
    lt = np.array([(1 << i) - 1 for i in range(width)], dtype=np.uint64)
    assert np.array_equal(got, per_lane(width, lambda g: lt, p))
    got, _ = run(model, width, "lane_index", p)
    lanes = np.arange(BLOCK)
    assert np.array_equal(got, (lanes % width) | ((lanes // width) << 8))


@params
def test_match_any(model, width):
    def match(g):
        return np.array([mask_of(g == g[i]) for i in range(width)], dtype=np.uint64)

    for seed, (lo, hi) in enumerate(((-1, 3), (-1, 896), (-(2**31), 2**31 - 1))):
        v = ints(10 + seed, lo=lo, hi=hi)
        _, got = run(model, width, "match_any", v)
        assert np.array_equal(got, per_lane(width, match, v)), (lo, hi)
    for limit in (1, 2, 33, 896, 4096):
        v = ints(limit, lo=-1, hi=limit)
        v[::5] = -1  # dropped routes share a peer set
        _, got = run(model, width, "match_any_in", v, arg=limit)
        assert np.array_equal(got, per_lane(width, match, v)), limit


_ABORTING_LAUNCH = """
import sys
sys.path[:0] = [{tests!r}, {root!r}]
from test_amd_warp_primitives import OPS, run
OPS["diverge"], OPS["after_exit"] = 14, 15
run({model!r}, 32, {op!r}, list(range(64)), fiber_switch={fiber_switch!r})
"""


@pytest.mark.parametrize(
    "model, fiber_switch", [("gfx942", "native"), (32, "native"), (32, "ucontext")]
)
@pytest.mark.parametrize(
    "op, message",
    [
        ("diverge", "waits at a barrier that cannot open"),
        ("after_exit", "after a lane of"),
    ],
)
def test_divergent_primitives_abort_with_a_message(model, fiber_switch, op, message):
    """A warp primitive that not every lane of its row reaches stops the emulator with a message
    naming the cause (on a GPU it hangs or reads undefined lanes): lanes waiting at different
    barriers (no thread can run), or a primitive after a lane of the row exited. Subprocesses: the
    emulator aborts the process."""
    tests = Path(__file__).resolve().parent
    code = _ABORTING_LAUNCH.format(
        tests=str(tests), root=str(tests.parent), model=model, op=op, fiber_switch=fiber_switch
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=os.environ
    )
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert message in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("model, width", [("gfx942", 64), ("gfx1250", 32), (32, 32)])
def test_ucontext_fibers_give_the_register_switchs_results(model, width):
    """The emulator's fiber switch off x86-64 (ucontext), built here on purpose: every primitive
    returns the same lanes as under the register switch, on a block of several rows."""
    rng = np.random.default_rng(7)
    values = rng.integers(-(1 << 20), 1 << 20, BLOCK).tolist()
    aux = [(7 * lane + 3) % width for lane in range(BLOCK)]
    for op in OPS:
        want = run(model, width, op, values, aux, 1)
        got = run(model, width, op, values, aux, 1, fiber_switch="ucontext")
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), op
