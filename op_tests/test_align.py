"""``moe_align_block_size`` (vLLM's alignment of routes to blocks of one expert) against the
``amdqb.ref`` oracle, bitwise, for every kernel backend of ``align_block_size``; the hip kernels on
the CPU emulator over both wave sizes, with their dependent launches; and the oracle itself
against vLLM's docstring example and its invariants.

On the CPU the Triton kernels run under ``TRITON_INTERPRET=1`` and the hip kernels on the emulator
(small shapes); on a GPU the same tests run at the seed shapes (M up to 8192, k=16, E up to 4096).
"""

import pytest
import torch

import amdqb
from amdqb import ref
from amdqb.backends.hip import layout as hip_layout

from conftest import DEVICE, GCN, HAS_GPU, device_config, expect_declined, over_backends, set_config
from hip_emu.backend import runtime as emu_runtime
from hip_emu.checks import make_ids as emu_ids
from hip_emu.runtime import compiler
from layout_cases import check_align, make_ids, oracle_ids


@over_backends("align_block_size")
def test_align_vllm_example(backend):
    ids = torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]], dtype=torch.int32)
    sorted_ids, expert_ids, post = check_align(ids, 4, 5, False, backend)
    assert sorted_ids[:16].tolist() == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
    assert torch.all(sorted_ids[16:] == 12)
    assert expert_ids.tolist()[:4] == [1, 2, 3, 4] and post.tolist() == [16]
    check_align(ids, 4, 5, True, backend)


@over_backends("align_block_size")
@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("block_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("e", [1, 3, 257, 513, 896, 4096])
def test_align_matches_oracle(backend, e, block_size, pad):
    m, k = (8192, 16) if HAS_GPU else (12, 4)
    dist = "dropped" if block_size in (16, 128) else "uniform"
    check_align(make_ids(m, k, e, dist, seed=block_size + e), block_size, e, pad, backend)


@over_backends("align_block_size")
@pytest.mark.parametrize("dist", ["shared", "one", "dropped"])
def test_align_many_blocks(backend, dist):
    m, k, e = (8192, 16, 896) if HAS_GPU else (300, 4, 300)
    ids = make_ids(m, k, e, dist, seed=9, dtype=torch.int64 if dist == "dropped" else torch.int32)
    check_align(ids, 64, e, dist == "shared", backend)


@over_backends("align_block_size")
def test_align_expert_map_and_empty(backend):
    e = 8
    ids = make_ids(6, 2, e, "uniform", seed=1)
    expert_map = torch.tensor([0, -1, 1, -1, 2, 3, -1, 4], dtype=torch.int32, device=DEVICE)
    check_align(ids, 4, e, False, backend, expert_map)
    check_align(torch.empty(0, 2, dtype=torch.int32), 4, e, False, backend)


@over_backends("align_block_size")
@pytest.mark.parametrize("e", [4097, 10000])
def test_align_beyond_4096_experts(backend, e):
    expect_declined(backend, "align_block_size", backend == "hip", num_experts=e)
    m, k = (8192, 16) if HAS_GPU else (40, 4)
    ids = make_ids(m, k, e, "dropped", seed=e)
    ids.view(-1)[1::6] = e - 1
    check_align(ids, 16, e, False, backend)
    check_align(ids, 64, e, True, backend)


@over_backends("align_block_size", emulator=True, waves=(32, 64), gcn=GCN)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("tiled", [False, True, "wide", "ranked", "planned"])
def test_align_block_size_matches_oracle_bitwise(monkeypatch, backend, emu_rt, dtype, tiled):
    """moe_align_block_size: sorted ids, expert ids and the padded total equal the oracle's bitwise
    (ascending flat order inside each expert), in one block (one launch) or over tiles that split
    experts' routes (the histogram pass, then the rank pass as its dependent), with partial last
    tiles, dropped ids, empty experts, 1..32 ranking warps (E up to 4096) and pad_sorted_ids;
    "wide": rank blocks of one bucket per thread (up to 1024 threads, the warps past the ranking
    ones idle in the walk); "ranked": the rank blocks rank their tiles before they wait and then
    sum the tile columns (amdqb_align_tiles), where their LDS holds a warp's rows (the others
    amdqb_align); "planned": one block plans the tiles (amdqb_align_plan) and the place pass
    ranks before it waits, where the [tiles, E] counts fit its LDS (the others tiled)."""
    rt = emu_rt
    if tiled:  # tiles of 64 routes (or sqrt(n) rounded up to a power of two) from 65 routes on
        values = {
            "hip.align.single_block_routes": 64,
            "hip.align.min_tile_routes": 64,
            "hip.align.tile_scale": 1,
            "hip.align.rank_buckets_per_thread": 1 if tiled == "wide" else 16,
            "hip.align.plan_max_routes": 1 << 20 if tiled == "planned" else 0,
            "hip.align.plan_tile_routes": 256,
            "hip.align.tiles_rank_first": tiled == "ranked",
        }
    else:  # every case in one block
        values = {"hip.align.single_block_routes": 1 << 20}
    set_config(monkeypatch, values, torch.device("cpu"))
    cases = [
        (7, 900, 3, "dropped", 4, False),
        (896, 300, 16, "uniform", 64, False),  # 8 ranking warps, many empty blocks of rows
        (896, 260, 8, "shared", 16, True),
        (129, 64, 5, "one", 1, False),  # block_size 1: no padding
        (2048, 600, 8, "uniform", 32, True),  # 4 ranking warps
        (4096, 70, 4, "dropped", 128, False),  # 1 ranking warp of 8, most experts empty
        (33, 1, 1, "uniform", 8, False),  # a single route
        (300, 200, 6, "shared", 12, True),  # a block size that is not a power of two
    ]
    planned = ranked = 0
    for e, m, k, dist, bs, pad in cases:
        ids = emu_ids(m, k, e, dist, e + m, dtype)
        want = ref.moe_align_block_size(ids, bs, e, pad_sorted_ids=pad)
        rt.launches.clear()
        rt.dependent_launches.clear()
        # the emulated backend poisons the three outputs (-7) before the kernels run
        got = amdqb.moe_align_block_size(ids, bs, e, pad_sorted_ids=pad, backend=backend)
        for name, g, w in zip(("sorted_ids", "expert_ids", "num_post_pad"), got, want):
            assert torch.equal(g, w), f"{name} differs (E={e}, m={m}, k={k}, {dist}, bs={bs})"
        names = [n for n, *_ in rt.launches]
        cfg = device_config(torch.device("cpu"))
        tiles, per, threads, warps = hip_layout.align_plan(ids.numel(), e, cfg)
        shape = hip_layout.align_planned(ids.numel(), e, cfg)
        if shape is not None:
            planned += 1
            assert names == ["amdqb_align_plan", "amdqb_align_place"], (e, m, k)
            assert rt.dependent_launches == ["amdqb_align_place"]
            assert rt.launches[1][1][0] == shape[0] > 1, (e, m, k)
            assert shape[1] & (shape[1] - 1) == 0 and shape[0] * shape[1] >= ids.numel()
        elif tiled and ids.numel() > 64:
            rank = "amdqb_align"
            if tiled == "ranked" and hip_layout.align_tiles_shape(per, e) is not None:
                rank = "amdqb_align_tiles"
                ranked += 1
            assert names == ["amdqb_align_hist", rank], (e, m, k)
            assert rt.dependent_launches == [rank]
            assert 1 < tiles == rt.launches[0][1][0] == rt.launches[1][1][0], (e, m, k)
            if tiled == "wide":
                assert threads >= min(e, 1024), (e, m, k, threads)
        else:
            assert names == ["amdqb_align"], (e, m, k)
    assert (planned >= 4) == (tiled == "planned"), planned
    assert (ranked >= 4) == (tiled == "ranked"), ranked
    assert hip_layout.align_rank_warps(896) == 8 and hip_layout.align_rank_warps(2048) == 4
    assert hip_layout.align_rank_warps(4096) == 1 and hip_layout.align_rank_warps(256) == 32


# ----------------------------------------------------------------------------------------------
# the oracle
# ----------------------------------------------------------------------------------------------


def test_align_block_size_vllm_docstring_example():
    ids = torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]])
    sorted_ids, expert_ids, post = ref.moe_align_block_size(ids, 4, 5)
    assert sorted_ids[:16].tolist() == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
    assert torch.all(sorted_ids[16:] == 12)
    assert expert_ids[:4].tolist() == [1, 2, 3, 4] and torch.all(expert_ids[4:] == 0)
    assert post.tolist() == [16] and post.dtype == torch.int32
    assert sorted_ids.numel() == 12 + 5 * 3


@pytest.mark.parametrize("e", (32, 257, 896))
@pytest.mark.parametrize("block", (16, 64, 256))
def test_align_block_size_invariants(e, block):
    ids = oracle_ids(50, 6, e, "dropped", seed=block)
    sorted_ids, expert_ids, post = ref.moe_align_block_size(ids, block, e, pad_sorted_ids=True)
    numel = ids.numel()
    assert sorted_ids.numel() % block == 0
    n = int(post)
    assert n % block == 0
    flat = ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < e)
    got = sorted_ids[:n][sorted_ids[:n] != numel].long()
    assert sorted(got.tolist()) == torch.nonzero(valid).flatten().tolist()
    owner = expert_ids[(torch.nonzero(sorted_ids[:n] != numel).flatten() // block)]
    assert torch.equal(flat[got], owner.long())  # every id sits in a block of its expert


def test_align_expert_map_applies_to_all_blocks():
    ids = torch.tensor([[0, 1], [1, 3]])
    emap = torch.tensor([-1, 0, -1, 1], dtype=torch.int32)
    _, expert_ids, _ = ref.moe_align_block_size(ids, 2, 4)
    from amdqb import moe_align_block_size

    _, mapped, _ = moe_align_block_size(ids, 2, 4, expert_map=emap)
    assert torch.equal(mapped, emap[expert_ids.long()])


_FORMS = {  # AlignCall keywords, the map (mode "filter" / "output"), the ids' element offset
    "vllm": (dict(), None, 0),
    "vllm_unaligned_ids": (dict(), None, 1),  # not at a 16-byte boundary: the one-id loads
    "sglang_ep": (dict(id_shift=1, owner_shift=1, tail_value=-1), None, 0),
    "filter_map": (dict(map_mode="filter"), "filter", 0),
    "output_map": (dict(map_mode="output", tail_value=-1), "output", 0),
    "caller_sentinel": (dict(fill_sentinel=False), None, 0),
}


def _form_case(form: str, dtype, tokens: int, seed: int):
    """(AlignCall, flat ids, expert map) of a _FORMS convention: E=48, k=8, block 16, ids dropped
    out of range; "filter" maps 60 global ids onto the 48 local buckets (a fifth remote, -1),
    "output" permutes the experts."""
    from amdqb.backends.calls import AlignCall

    kw, map_mode, offset = _FORMS[form]
    e = 48
    call = AlignCall(e + kw.get("id_shift", 0), 16, **kw)
    ids = emu_ids(tokens, 8, e, "dropped", seed, dtype).reshape(-1)
    ids = torch.cat([torch.zeros(offset, dtype=dtype), ids])[offset:]
    g = torch.Generator().manual_seed(3)
    emap = None
    if map_mode == "filter":
        emap = torch.randperm(60, generator=g).to(torch.int32)
        emap = torch.where(emap < e, emap, torch.full_like(emap, -1))
    elif map_mode == "output":
        emap = torch.randperm(e, generator=g).to(torch.int32)
    return call, ids, emap


def _align_with(monkeypatch, emu_rt, values: dict, call, ids, emap):
    """The three outputs (poisoned first: the caller's padding -5) of one align call with the
    config entries ``values``, and the names of the kernels it launched."""
    set_config(monkeypatch, values, torch.device("cpu"))
    rows = ids.numel() + call.num_experts * (call.block_size - 1)
    got = (
        torch.full((rows,), -5, dtype=torch.int32),
        torch.full((rows // call.block_size + 1,), -7, dtype=torch.int32),
        torch.full((1,), -7, dtype=torch.int32),
    )
    emu_rt.launches.clear()
    hip_layout.align_block_size(emu_rt, call, ids, emap, *got)
    return got, [n for n, *_ in emu_rt.launches]


@pytest.mark.skipif(compiler() is None, reason="needs g++ (C++20) for the hip kernel emulator")
@pytest.mark.parametrize("wave", [32, 64])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("form", sorted(_FORMS))
def test_planned_align_equals_the_tiled_form_in_every_convention(monkeypatch, form, dtype, wave):
    """amdqb_align_plan + amdqb_align_place and amdqb_align_hist + amdqb_align_tiles write what
    amdqb_align_hist + amdqb_align write
    (bitwise, every output, the caller's padding kept alike) for vLLM's and SGLang's conventions,
    both maps, int32 ids off a 16-byte boundary and int64 ids (the plan's one-id loads) and ids
    out of range, over tiles that split experts' routes and a partial last tile."""
    emu_rt = emu_runtime(wave)
    call, ids, emap = _form_case(form, dtype, 333, 7)  # 2664 routes: tiles of 512, a partial one
    outs = {}
    for name, most in (("tiled", 0), ("ranked", 0), ("planned", 1 << 20)):
        values = {
            "hip.align.single_block_routes": 256,
            "hip.align.plan_max_routes": most,
            "hip.align.plan_tile_routes": 512,
            "hip.align.tiles_rank_first": name == "ranked",
        }
        outs[name], names = _align_with(monkeypatch, emu_rt, values, call, ids, emap)
        want = {
            "tiled": ["amdqb_align_hist", "amdqb_align"],
            "ranked": ["amdqb_align_hist", "amdqb_align_tiles"],
            "planned": ["amdqb_align_plan", "amdqb_align_place"],
        }[name]
        assert names == want, (name, names)
    for other in ("ranked", "planned"):
        for a, b, what in zip(outs["tiled"], outs[other], ("sorted_ids", "expert_ids", "post_pad")):
            assert torch.equal(a, b), f"{what} differs ({other}, {form}, {dtype})"
    assert (outs["planned"][0] == -5).any() != call.fill_sentinel  # the caller's padding kept


_CLUSTER_CASES = {  # (E, tokens, k, ids, block size, pad_sorted_ids)
    "emulator": [
        (48, 90, 8, "dropped", 16, False),  # 4 blocks, partial last tile, skipped ids
        (7, 40, 3, "uniform", 4, True),  # 2 blocks, one warp each
        (257, 100, 4, "shared", 64, False),
        (300, 50, 6, "one", 12, True),  # a block size that is not a power of two
        (896, 40, 8, "uniform", 64, False),
        (2048, 200, 4, "dropped", 32, False),  # LDS for one warp's rows: 7 chunks a warp
        (4096, 40, 4, "uniform", 16, False),  # not even one warp's rows: another form
    ],
    "gpu": [
        (256, 512, 8, "uniform", 64, False),
        (256, 2048, 8, "uniform", 16, True),
        (256, 4096, 8, "shared", 128, False),  # 8 blocks of 4096 routes, 4 chunks a warp
        (256, 8192, 8, "uniform", 64, False),  # 8 blocks of 8192 routes, 8 chunks a warp
        (257, 1000, 8, "dropped", 64, False),
        (64, 3000, 6, "one", 128, True),
        (896, 1024, 16, "uniform", 64, False),  # 8 warps' rows fit: 8 chunks a warp
        (4096, 256, 8, "dropped", 64, False),  # not even one warp's rows: another form
    ],
}


@over_backends("align_block_size", only=("hip",), waves=(32, 64), gcn=GCN)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_cluster_align_matches_oracle_bitwise(monkeypatch, backend, emu_rt, dtype):
    """amdqb_align_cluster (one thread block cluster: each block ranks its tile, reads the tiles'
    counts from its peers' LDS after the cluster barrier and writes the sentinel only into the
    padding) writes the oracle's sorted ids, expert ids and padded total bitwise; where its LDS
    rows do not fit, another form runs."""
    from amdqb.backends.hip._runtime import get_runtime

    device = torch.device("cpu") if emu_rt is not None else DEVICE
    if emu_rt is None and not get_runtime().supports_clusters(torch.cuda.current_device()):
        pytest.skip("the GPU has no thread block clusters (NVIDIA sm_90+)")
    values = {"hip.align.cluster_max_routes": 1 << 20}
    if emu_rt is not None:  # small blocks: every thread of a cluster is a host thread
        values.update({"hip.align.single_block_routes": 64, "hip.align.cluster_tile_routes": 64})
        values["hip.align.cluster_blocks"] = 4
    cfg = set_config(monkeypatch, values, device)
    clustered = 0
    for e, m, k, dist, bs, pad in _CLUSTER_CASES["emulator" if emu_rt is not None else "gpu"]:
        ids = emu_ids(m, k, e, dist, e + m, dtype).to(device)
        want = ref.moe_align_block_size(ids.cpu(), bs, e, pad_sorted_ids=pad)
        if emu_rt is not None:
            emu_rt.launches.clear()
            emu_rt.cluster_launches.clear()
        got = amdqb.moe_align_block_size(ids, bs, e, pad_sorted_ids=pad, backend=backend)
        for name, g, w in zip(("sorted_ids", "expert_ids", "num_post_pad"), got, want):
            assert torch.equal(g.cpu(), w), f"{name} differs (E={e}, m={m}, k={k}, {dist}, bs={bs})"
        shape = hip_layout.align_clustered(ids.numel(), e, cfg)
        clustered += shape is not None
        if emu_rt is not None:
            names = [n for n, *_ in emu_rt.launches]
            if shape is not None:
                assert names == ["amdqb_align_cluster"], (e, m, k, names)
                assert emu_rt.cluster_launches == [("amdqb_align_cluster", shape[0])]
                assert emu_rt.launches[0][1][0] == shape[0] > 1
            else:
                assert "amdqb_align_cluster" not in names, (e, m, k, names)
    assert clustered >= 4, clustered


@pytest.mark.skipif(compiler() is None, reason="needs g++ (C++20) for the hip kernel emulator")
@pytest.mark.parametrize("wave", [32, 64])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("form", sorted(_FORMS))
def test_cluster_align_equals_the_tiled_form_in_every_convention(monkeypatch, form, dtype, wave):
    """amdqb_align_cluster writes what amdqb_align_hist + amdqb_align write (bitwise, every output,
    the caller's padding kept alike) in vLLM's and SGLang's conventions, both maps, int32 ids off a
    16-byte boundary and int64 ids, over four blocks that split experts' routes."""
    emu_rt = emu_runtime(wave)
    call, ids, emap = _form_case(form, dtype, 90, 11)  # 720 routes: 4 blocks of 192, a partial one
    outs = {}
    for name, most in (("tiled", 0), ("cluster", 1 << 20)):
        values = {
            "hip.align.single_block_routes": 64,
            "hip.align.min_tile_routes": 64,
            "hip.align.plan_max_routes": 0,
            "hip.align.cluster_max_routes": most,
            "hip.align.cluster_tile_routes": 64,
            "hip.align.cluster_blocks": 4,
        }
        outs[name], names = _align_with(monkeypatch, emu_rt, values, call, ids, emap)
        want = {"tiled": ["amdqb_align_hist", "amdqb_align"], "cluster": ["amdqb_align_cluster"]}
        assert names == want[name], (name, names)
    for a, b, what in zip(outs["tiled"], outs["cluster"], ("sorted_ids", "expert_ids", "post_pad")):
        assert torch.equal(a, b), f"{what} differs ({form}, {dtype}, wave {wave})"
    assert (outs["cluster"][0] == -5).any() != call.fill_sentinel  # the caller's padding kept
