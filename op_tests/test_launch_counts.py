"""One kernel per routing call, nothing around it: every serving entry point (``biased_topk``, the
vLLM and SGLang routers and aligns of ``amdqb.compat``) issues exactly one kernel on the hip
backend -- two for an align past ``hip.align.single_block_routes`` routes (a plan or histogram pass,
then its dependent) unless one thread block cluster aligns them -- and no PyTorch kernel besides (no arange, cast, cat, fill or copy).

On the CPU the hip kernels run on the emulator: its launch record gives the hip kernels, and a
TorchDispatchMode records every ATen op the call runs; only allocations and views (no kernel on a
GPU) may appear. On a GPU the profiler counts the kernels one call issues.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from amdqb import biased_topk, dispatch
from amdqb.backends.hip import layout as hip_layout
from amdqb.compat import sglang, vllm
from amdqb.ref.layout import align_buffer_sizes

from conftest import DEVICE, HAS_GPU, device_config, gpu_kernel_names, over_backends, set_config

# ATen ops that launch no kernel on a GPU: allocation, metadata and views
_NO_KERNEL = {
    "empty",
    "empty_strided",
    "empty_like",
    "view",
    "_unsafe_view",
    "as_strided",
    "slice",
    "select",
    "alias",
    "unsqueeze",
    "squeeze",
    "t",
    "transpose",
    "expand",
    "_reshape_alias",
    "reshape",
    "detach",
    "lift_fresh",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
    "is_contiguous",
}


class _AtenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _kernels_beside(ops) -> list[str]:
    return [op for op in ops if op not in _NO_KERNEL]


def _unpoisoned(monkeypatch, op: str) -> None:
    """The emulated hip backend's ``op`` without the poisoning fill of its outputs (a test
    harness's op, not the call's)."""
    from amdqb.backends import hip as hip_backend

    monkeypatch.setenv("AMDQB_BACKEND", "hip")
    monkeypatch.setitem(hip_backend.OPS, op, hip_backend.OPS[op].__wrapped__)
    dispatch._select.cache_clear()
    dispatch._IMPLS.clear()


def _entry_points(tokens: int):
    g = torch.Generator().manual_seed(tokens)
    x8 = torch.randn(tokens, 8, generator=g).to(DEVICE)
    x128 = torch.randn(tokens, 128, generator=g).to(DEVICE, torch.bfloat16)
    x256 = torch.randn(tokens, 256, generator=g).to(DEVICE)
    b256 = (torch.randn(256, generator=g) * 0.1).to(DEVICE, torch.bfloat16)
    b384 = (torch.randn(384, generator=g) * 0.1).to(DEVICE)
    x384 = torch.randn(tokens, 384, generator=g).to(DEVICE)
    b256f = b256.float()
    non_padded = torch.tensor(tokens // 2, device=DEVICE)
    return {
        "biased_topk": lambda: biased_topk(x256, 8, b256f, num_groups=8, group_topk=4),
        "vllm.fused_topk": lambda: vllm.fused_topk(x8, x8, 2, True),
        "vllm.fused_topk int64": lambda: vllm.fused_topk(x128, x128, 8, True, torch.int64),
        "vllm.fused_topk_bias": lambda: vllm.fused_topk_bias(
            x256, x256, "sigmoid", b256, 8, True, routed_scaling_factor=2.5
        ),
        "vllm.grouped_topk": lambda: vllm.grouped_topk(
            x256, x256, 8, True, 8, 4, "sigmoid", 2.5, b256
        ),
        "sglang.moe_fused_gate": lambda: sglang.moe_fused_gate(x256, b256, 8, 4, 9, 1, 2.5),
        "sglang.biased_grouped_topk": lambda: sglang.biased_grouped_topk(
            x256,
            x256,
            b256,
            8,
            False,
            8,
            4,
            num_token_non_padded=non_padded,
        ),
        "sglang.kimi_k2_moe_fused_gate": lambda: sglang.kimi_k2_moe_fused_gate(x384, b384, 8),
    }


def _aligns(tokens: int):
    e, k, bs = 256, 8, 16
    g = torch.Generator().manual_seed(tokens)
    ids = torch.rand(tokens, e, generator=g).argsort(dim=1)[:, :k].to(DEVICE, torch.int32)
    rows, blocks = align_buffer_sizes(ids.numel(), e, bs, False)
    out = [torch.empty(n, dtype=torch.int32, device=DEVICE) for n in (rows, blocks, 1)]
    sg_rows = ids.numel() + (e + 1) * (bs - 1)
    sg = [torch.empty(n, dtype=torch.int32, device=DEVICE) for n in (sg_rows, sg_rows, 1, e + 2)]
    emap = torch.arange(e, dtype=torch.int32, device=DEVICE).roll(3)
    emap[::5] = -1
    strided = torch.rand(tokens, e, generator=g).argsort(dim=1).to(DEVICE, torch.int32)[:, :k]
    return {
        "vllm._custom_ops.moe_align_block_size": lambda: vllm._custom_ops.moe_align_block_size(
            ids, e, bs, *out, emap
        ),
        "vllm.moe_align_block_size": lambda: vllm.moe_align_block_size(ids, bs, e, emap),
        "sglang.moe_align_block_size": lambda: sglang.moe_align_block_size(ids, e + 1, bs, *sg),
        "sglang.moe_align_block_size (strided ids)": lambda: sglang.moe_align_block_size(
            strided, e + 1, bs, *sg
        ),
    }


@pytest.mark.skipif(HAS_GPU, reason="the emulator's launch record (the GPU test profiles)")
@over_backends("biased_topk", emulator=True)
@pytest.mark.parametrize("tokens", [3, 40])
def test_routers_are_one_hip_kernel_and_nothing_else(backend, emu_rt, monkeypatch, tokens):
    _unpoisoned(monkeypatch, "biased_topk")
    for name, fn in _entry_points(tokens).items():
        fn()  # builds the kernels
        emu_rt.launches.clear()
        with _AtenOps() as seen:
            fn()
        assert [n for n, *_ in emu_rt.launches] == ["amdqb_topk"], name
        assert _kernels_beside(seen.ops) == [], (name, seen.ops)


@pytest.mark.skipif(HAS_GPU, reason="the emulator's launch record (the GPU test profiles)")
@over_backends("align_block_size", emulator=True)
@pytest.mark.parametrize("tiled", [False, True, "ranked", "planned", "cluster"])
def test_aligns_are_one_or_two_hip_kernels_and_nothing_else(backend, emu_rt, monkeypatch, tiled):
    _unpoisoned(monkeypatch, "align_block_size")
    if tiled:
        values = {"hip.align.single_block_routes": 64, "hip.align.min_tile_routes": 64}
        values["hip.align.plan_max_routes"] = 1 << 20 if tiled == "planned" else 0
        values["hip.align.tiles_rank_first"] = tiled == "ranked"
        values["hip.align.cluster_max_routes"] = 1 << 20 if tiled == "cluster" else 0
        set_config(monkeypatch, values, torch.device("cpu"))
    want = {
        False: ["amdqb_align"],
        True: ["amdqb_align_hist", "amdqb_align"],
        "ranked": ["amdqb_align_hist", "amdqb_align_tiles"],
        "planned": ["amdqb_align_plan", "amdqb_align_place"],
        "cluster": ["amdqb_align_cluster"],
    }[tiled]
    for name, fn in _aligns(20).items():
        fn()
        emu_rt.launches.clear()
        with _AtenOps() as seen:
            fn()
        assert [n for n, *_ in emu_rt.launches] == want, name
        assert _kernels_beside(seen.ops) == [], (name, seen.ops)


def _profiled_kernels(fn) -> list[str]:
    fn()  # builds and caches first: the profiled call launches only the kernels themselves
    with gpu_kernel_names() as names:
        fn()
    return names


@pytest.mark.skipif(not HAS_GPU, reason="profiles the kernels one call launches on a GPU")
@pytest.mark.parametrize("tokens", [1, 256, 16384])
def test_entry_points_launch_one_kernel_on_the_gpu(monkeypatch, tokens):
    monkeypatch.setenv("AMDQB_BACKEND", "hip")
    dispatch._select.cache_clear()
    for name, fn in _entry_points(tokens).items():
        kernels = _profiled_kernels(fn)
        # amdqb_topk, or amdqb_router where the config sends a row shape there (hip.topk.max_slots)
        assert len(kernels) == 1 and kernels[0].startswith("amdqb_"), (name, tokens, kernels)


@pytest.mark.skipif(not HAS_GPU, reason="profiles the kernels one call launches on a GPU")
@pytest.mark.parametrize("tokens", [8, 2048, 131072])
def test_aligns_launch_one_or_two_kernels_on_the_gpu(monkeypatch, tokens):
    monkeypatch.setenv("AMDQB_BACKEND", "hip")
    dispatch._select.cache_clear()
    from amdqb.backends.hip._runtime import get_runtime

    clusters = get_runtime().supports_clusters(torch.cuda.current_device())
    want = list(hip_layout.align_form(tokens * 8, 256, device_config(), clusters).kernels)
    for name, fn in _aligns(tokens).items():
        kernels = _profiled_kernels(fn)
        assert kernels == want, (name, tokens, kernels)
