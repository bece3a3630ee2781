"""The host emulator of op_tests/hip_emu itself: the prelude's scalar float conversions and order
key against torch bit for bit, and the scope of the emulated ``hip`` backend (available to the
dispatcher on the CPU inside :func:`hip_emu.backend.emulated_hip_backend` only, outputs poisoned
before the kernels run, everything restored on exit).
"""

import ctypes

import pytest
import torch

import amdqb
from amdqb import dispatch
from amdqb.backends import hip as hip_backend
from amdqb.ref.ordering import order_key

from conftest import needs
from hip_emu.backend import active_runtime, emulated_hip_backend, runtime
from hip_emu.runtime import compiler

pytestmark = [
    pytest.mark.emulator,
    needs(compiler() is not None, "needs g++ (C++20) for the emulator"),
]


def emu(wave: int = 32):
    return runtime(wave)


def _call(fn, x, out):
    fn(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()), ctypes.c_longlong(x.numel()))
    return out


def _float_corpus():
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (400_000,), generator=g, dtype=torch.int64)
    specials = [65504.0, 65519.99, 65520.0, 65520.01, 2.0**-25, 2.0**-25 * 1.0001, 2.0**-24 * 1.5]
    specials += [2.0**-24 * 2.5, 2.0**-14, 2.0**-14 * (1 - 2**-12), -0.0, 0.0, 1e-45, 3.4e38]
    specials += [float("inf"), -float("inf"), float("nan"), -float("nan")]
    all_halves = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    return torch.cat(
        [
            bits.to(torch.int32).view(torch.float32),
            torch.randn(200_000, generator=g) * 1e-5,
            torch.randn(200_000, generator=g) * 3e4,
            torch.randn(50_000, generator=g) * 1e-7,
            all_halves.view(torch.float16).float(),
            all_halves.view(torch.bfloat16).float(),
            torch.tensor(specials),
        ]
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prelude_float_conversions_match_torch_bitwise(dtype):
    lib = emu().converter()
    x = _float_corpus()
    name = "f16" if dtype == torch.float16 else "bf16"
    y = _call(
        getattr(lib, f"amdqb_emu_f32_to_{name}"), x, torch.empty(x.numel(), dtype=torch.int16)
    )
    want = x.to(dtype).view(torch.int16)
    nan = x.isnan()
    assert torch.equal(y[~nan], want[~nan])
    assert y[nan].view(dtype).isnan().all()
    h = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    back = _call(getattr(lib, f"amdqb_emu_{name}_to_f32"), h, torch.empty(65536))
    want = h.view(dtype).float()
    nan = want.isnan()
    assert torch.equal(back.view(torch.int32)[~nan], want.view(torch.int32)[~nan])
    assert back[nan].isnan().all()


def test_prelude_order_key_matches_oracle():
    x = _float_corpus()
    k = _call(emu().converter().amdqb_emu_order_key, x, torch.empty(x.numel(), dtype=torch.int32))
    assert torch.equal(k, order_key(x))


def test_emulated_backend_is_scoped():
    cpu = dispatch.device_info("cpu")
    ops = dict(hip_backend.OPS)
    assert not hip_backend.availability(cpu)[0] and active_runtime() is None
    with emulated_hip_backend(64) as rt:
        assert active_runtime() is rt and rt.wave_size == 64
        choice = dispatch.select("route_rows", "cpu", "hip", num_experts=4, impl="atomic")
        assert choice.backend == "hip" and "emulator" in choice.reason
        rows, counts = amdqb.moe_route_rows(
            torch.tensor([[0, 3], [3, 9]], dtype=torch.int32), 4, impl="atomic", backend="hip"
        )
        # expert 0: row 0; expert 3: rows 1 and 2 in either order; id 9 drops
        assert rows[0, 0] == 0 and rows[1, 1] == -1
        assert sorted([int(rows[0, 1]), int(rows[1, 0])]) == [1, 2]
        assert counts.tolist() == [1, 0, 0, 2] and rt.launches
    assert not hip_backend.availability(cpu)[0] and active_runtime() is None
    assert hip_backend.OPS == ops
    with pytest.raises(RuntimeError, match="hip"):
        dispatch.select("route_rows", "cpu", "hip", num_experts=4, impl="atomic")
