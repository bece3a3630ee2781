"""The ``hip`` backend: loader unit tests (no GPU) and GPU tests against the oracles.

CPU: cache keys, atomic disk cache with reload and concurrent builders, ``AMDQB_CACHE_DIR`` /
``AMDQB_REBUILD``, exact-width argument packing read back through the kernelParams array,
availability reasons, ``unsupported`` reasons, source lookup.

GPU (NVIDIA through NVRTC + cuda-python, or ROCm through hiprtc + hip-python): route rows ``atomic``
vs ``lds`` (and ``deterministic``) against the oracle on both sides of the seed gate, graph capture
with 8 replays on changed ids and counters; the router's QB modes x output formats x k x T x dtypes
(histograms bitwise equal between the modes and to the oracle evaluated on the kernel's own scores),
ties / NaN rows, biased_topk, non-default streams and graph capture of the router.
"""

import ctypes
import os
import threading

import pytest
import torch

import amdqb
from amdqb import dispatch, ref
from amdqb.backends import hip as hip_backend
from amdqb.backends.hip import _ops, _runtime, _spec
from amdqb.ops.layout import lds_route_threshold
from amdqb.ref.router import qb_cutoff_and_routes, qb_histogram_counts
from conftest import HAS_GPU
from hip_emu.checks import check_routes, make_ids, make_logits, routed_mask


# ================================================================================================
# Loader unit tests (no GPU)
# ================================================================================================
def _key(**over):
    args = dict(
        compiler_id="nvrtc-12.8",
        arch="sm_90",
        wave_size=32,
        flags=["--fmad=false", "-DAMDQB_NUM_EXPERTS=896"],
        sources={"kernels/router.hip": "aa", "include/amdqb_prelude.h": "bb"},
    )
    args.update(over)
    return _spec.cache_key(**args)


def test_cache_key_changes_with_every_input():
    base = _key()
    assert base == _key()  # deterministic
    assert base == _key(sources={"include/amdqb_prelude.h": "bb", "kernels/router.hip": "aa"})
    variants = [
        _key(compiler_id="nvrtc-12.9"),
        _key(arch="sm_100"),
        _key(wave_size=64),
        _key(flags=["--fmad=false", "-DAMDQB_NUM_EXPERTS=897"]),
        _key(sources={"kernels/router.hip": "ab", "include/amdqb_prelude.h": "bb"}),
        _key(sources={"kernels/router.hip": "aa", "include/amdqb_prelude.h": "bc"}),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_read_sources_hashes_kernel_and_every_header():
    text, digests = _spec.read_sources(_spec.ROUTE_MODULE)
    assert "amdqb_route_lds" in text
    assert "kernels/layout.hip" in digests and "include/amdqb_prelude.h" in digests


def test_source_root_prefers_the_packaged_copy(tmp_path, monkeypatch):
    assert _spec.source_root() in (_spec.PACKAGED_SRC, _spec.REPO_SRC)
    (tmp_path / "include").mkdir()
    (tmp_path / "kernels").mkdir()
    monkeypatch.setattr(_spec, "PACKAGED_SRC", tmp_path)
    assert _spec.source_root() == tmp_path
    monkeypatch.setattr(_spec, "PACKAGED_SRC", tmp_path / "missing")
    monkeypatch.setattr(_spec, "REPO_SRC", tmp_path / "missing2")
    with pytest.raises(FileNotFoundError, match="hip_src not found"):
        _spec.source_root()


def test_disk_cache_atomic_write_reload_and_force(tmp_path):
    cache = _runtime.DiskCache(tmp_path)
    path = cache.path("nvrtc", "gfx942:sramecc+:xnack-", "k" * 64, "hsaco")
    assert path.parent.name == "gfx942_sramecc__xnack-"  # sanitised arch folder
    builds = []

    def build():
        builds.append(1)
        return b"\x00ELF\x00code" * 10  # NUL bytes survive

    assert cache.get_or_build(path, build) == b"\x00ELF\x00code" * 10
    assert cache.get_or_build(path, build) == b"\x00ELF\x00code" * 10
    assert len(builds) == 1, "second call must reload from disk"
    assert not list(path.parent.glob("*.tmp")), "no temporary file left behind"
    cache.get_or_build(path, build, force=True)
    assert len(builds) == 2


def test_disk_cache_unwritable_dir_still_builds(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cache = _runtime.DiskCache(blocker / "sub")
    path = cache.path("nvrtc", "sm_90", "d" * 64, "cubin")
    assert cache.get_or_build(path, lambda: b"image") == b"image"


def test_disk_cache_failed_build_leaves_nothing(tmp_path):
    cache = _runtime.DiskCache(tmp_path)
    path = cache.path("hiprtc", "gfx942", "f" * 64, "hsaco")

    def boom():
        raise _runtime.HipBackendError("compile error")

    with pytest.raises(_runtime.HipBackendError):
        cache.get_or_build(path, boom)
    assert not path.exists()


def test_disk_cache_concurrent_builders_build_once(tmp_path):
    cache = _runtime.DiskCache(tmp_path)
    path = cache.path("nvrtc", "sm_90", "c" * 64, "cubin")
    builds, results = [], []
    gate = threading.Barrier(6)

    def build():
        builds.append(1)
        return b"cubin"

    def worker():
        gate.wait()
        results.append(cache.get_or_build(path, build))

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [b"cubin"] * 6 and len(builds) == 1


class FakeToolchain:
    """Compiles to bytes naming its inputs; records loads and launches."""

    name = "fake"

    def __init__(self):
        self.compiles, self.loads, self.launches = [], [], []

    def compiler_id(self):
        return "fake-1.0"

    def target(self, device_index):
        return "fakearch", 64, "bin"

    def compile(self, source, name, flags, include_dir):
        self.compiles.append((name, tuple(flags)))
        assert (include_dir / "amdqb_prelude.h").is_file()
        return f"{name}|{' '.join(flags)}".encode()

    def load(self, device_index, image):
        self.loads.append((device_index, image))
        return ("module", device_index, image)

    def function(self, module, name):
        return (module, name)

    def launch(self, fn, grid, block, smem, device_index, params_address):
        self.launches.append((fn, grid, block, smem, device_index, params_address))


def test_runtime_caches_in_memory_and_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("AMDQB_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("AMDQB_REBUILD", raising=False)
    tc = FakeToolchain()
    rt = _runtime.GpuRuntime(tc)
    assert rt.disk.root == tmp_path / "hip-kernels"
    spec = _spec.router_module(896, "float32", "sigmoid")
    k1 = rt.kernel(0, spec, "amdqb_router")
    k2 = rt.kernel(0, spec, "amdqb_qb_hist")
    assert len(tc.compiles) == 1 and len(tc.loads) == 1  # one module, two functions
    assert "-DAMDQB_NUM_EXPERTS=896" in tc.compiles[0][1]
    assert "-DAMDQB_WAVE_SIZE=64" in tc.compiles[0][1]
    assert "--offload-arch=fakearch" in tc.compiles[0][1]
    assert "-ffp-contract=off" in tc.compiles[0][1]
    assert k1.fn[1] == "amdqb_router" and k2.fn[1] == "amdqb_qb_hist"
    rt.kernel(1, spec, "amdqb_router")  # another device: loads again, compiles nothing
    assert len(tc.compiles) == 1 and len(tc.loads) == 2
    files = list((tmp_path / "hip-kernels" / "fake" / "fakearch").glob("*.bin"))
    assert len(files) == 1

    fresh = FakeToolchain()  # a new process: the code object comes from disk
    _runtime.GpuRuntime(fresh).kernel(0, spec, "amdqb_router")
    assert fresh.compiles == [] and fresh.loads[0][1] == files[0].read_bytes()

    monkeypatch.setenv("AMDQB_REBUILD", "1")
    rebuilt = FakeToolchain()
    rt3 = _runtime.GpuRuntime(rebuilt)
    rt3.kernel(0, spec, "amdqb_router")
    rt3.kernel(0, spec, "amdqb_router")
    assert len(rebuilt.compiles) == 1, "AMDQB_REBUILD recompiles once per process, not per call"


def test_runtime_uses_a_matching_prebuilt_code_object(tmp_path, monkeypatch):
    monkeypatch.setenv("AMDQB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("AMDQB_REBUILD", raising=False)
    monkeypatch.setattr(_spec, "PREBUILT_DIR", tmp_path / "prebuilt")
    tc = FakeToolchain()
    tc.name = "hiprtc"
    tc.target = lambda device_index: ("gfx942:sramecc+:xnack-", 64, "hsaco")
    name = _spec.prebuilt_name(_spec.ROUTE_MODULE, "gfx942", 64)
    assert name.startswith("route-gfx942-") and name.endswith(".hsaco")
    (tmp_path / "prebuilt").mkdir()
    (tmp_path / "prebuilt" / name).write_bytes(b"AOT code object")
    _runtime.GpuRuntime(tc).kernel(0, _spec.ROUTE_MODULE, "amdqb_route_lds_i32")
    assert tc.compiles == [] and tc.loads[0][1] == b"AOT code object"
    # Another wave size or other sources never match the file.
    assert _spec.prebuilt_name(_spec.ROUTE_MODULE, "gfx942", 32) != name
    monkeypatch.setenv("AMDQB_REBUILD", "1")
    tc2 = FakeToolchain()
    tc2.name, tc2.target = tc.name, tc.target
    _runtime.GpuRuntime(tc2).kernel(0, _spec.ROUTE_MODULE, "amdqb_route_lds_i32")
    assert len(tc2.compiles) == 1


def test_runtime_key_changes_with_defines(tmp_path, monkeypatch):
    monkeypatch.setenv("AMDQB_CACHE_DIR", str(tmp_path))
    rt = _runtime.GpuRuntime(FakeToolchain())
    a, _ = rt.code_object(0, _spec.router_module(896, "float32", "sigmoid"))
    b, _ = rt.code_object(0, _spec.router_module(896, "bfloat16", "sigmoid"))
    c, _ = rt.code_object(0, _spec.router_module(897, "float32", "sigmoid"))
    assert len({a, b, c}) == 3


def _read_params(address, types):
    arr = ctypes.cast(address, ctypes.POINTER(ctypes.c_void_p))
    return [ctypes.cast(arr[i], ctypes.POINTER(t)).contents.value for i, t in enumerate(types)]


def test_kernel_params_exact_widths_and_values():
    args = [
        _spec.arg_ptr(0x7F0012345678),
        _spec.arg_i32(-5),
        _spec.arg_i64(2**40 + 3),
        _spec.arg_f32(0.1),
        _spec.arg_ptr(None),
        _spec.arg_i32(2**31 - 1),
    ]
    params = _spec.KernelParams(args)
    assert [ctypes.sizeof(a) for a in args] == [8, 4, 8, 4, 8, 4]
    types = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p]
    types.append(ctypes.c_int32)
    got = _read_params(params.address, types)
    assert got[0] == 0x7F0012345678 and got[1] == -5 and got[2] == 2**40 + 3
    assert got[3] == ctypes.c_float(0.1).value != 0.1  # rounded to fp32, never a double
    assert got[4] is None and got[5] == 2**31 - 1
    with pytest.raises(ValueError, match="int32"):
        _spec.arg_i32(2**31)
    with pytest.raises(ValueError, match="int64"):
        _spec.arg_i64(2**63)
    with pytest.raises(TypeError, match="exact-width"):
        _spec.KernelParams([5])  # a bare Python int would be taken for a pointer


def test_runtime_launch_passes_kernel_params(tmp_path, monkeypatch):
    monkeypatch.setenv("AMDQB_CACHE_DIR", str(tmp_path))
    tc = FakeToolchain()
    rt = _runtime.GpuRuntime(tc)
    k = rt.kernel(0, _spec.ROUTE_MODULE, "amdqb_route_finalize")
    seen = {}

    def launch(fn, grid, block, smem, device_index, address):  # read while the array is alive
        seen["values"] = _read_params(address, [ctypes.c_int32, ctypes.c_float])
        seen["cfg"] = (grid, block, smem, device_index)

    tc.launch = launch
    rt.launch(k, (3, 2), 256, 128, [_spec.arg_i32(7), _spec.arg_f32(2.5)])
    assert seen["values"] == [7, 2.5] and seen["cfg"] == ((3, 2, 1), 256, 128, 0)
    # dependent launches go to the toolchain's launch_dependent with the same arguments
    seen.clear()
    tc.launch_dependent = launch
    rt.launch_dependent(k, 5, 64, 0, [_spec.arg_i32(-1), _spec.arg_f32(0.5)])
    assert seen["values"] == [-1, 0.5] and seen["cfg"] == ((5, 1, 1), 64, 0, 0)
    seen.clear()
    rt.launch_dependent(k, (0, 2), 64, 0, [_spec.arg_i32(1), _spec.arg_f32(1.0)])
    assert not seen, "an empty grid launches nothing"
    seen.clear()
    rt.launch(k, 0, 256, 0, [_spec.arg_i32(7)])  # empty grid: nothing launched
    assert not seen


def test_availability_reasons_on_cpu(monkeypatch):
    cpu = dispatch.device_info("cpu")
    ok, why = hip_backend.availability(cpu)
    assert not ok and "no GPU" in why
    fake_gpu = dispatch.DeviceInfo("cuda:0", "nvidia", "fake", "sm_90", 32, 48 << 10, 132, "sm_90")

    def missing():
        raise ImportError("cuda-python (NVRTC bindings) is not installed: pip install cuda-python")

    monkeypatch.setattr(_runtime, "get_runtime", missing)
    ok, why = hip_backend.availability(fake_gpu)
    assert not ok and "cuda-python" in why
    amd = dispatch.DeviceInfo("cuda:0", "amd", "fake", "gfx942", 64, 64 << 10, 304, "gfx942")
    if torch.version.hip is None:
        ok, why = hip_backend.availability(amd)
        assert not ok and "ROCm" in why


def test_missing_bindings_name_the_package(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_bindings(name, *args, **kwargs):
        if name.startswith(("cuda", "hip", "rocm")):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_bindings)
    with pytest.raises(ImportError, match="cuda-python"):
        _runtime.import_nvrtc()
    with pytest.raises(ImportError, match="cuda-python"):
        _runtime.import_cuda_driver()
    with pytest.raises(ImportError, match="hip-python"):
        _runtime.import_hip_bindings()


def test_unsupported_reasons():
    info = dispatch.device_info("cpu")
    ok = dict(num_experts=896, topk=16, score_function="sigmoid", grouped=False, qb=True)
    assert hip_backend.unsupported("router_fwd", info, {**ok, "num_bins": 1000}) is None
    assert "grouped" in hip_backend.unsupported("router_fwd", info, {**ok, "grouped": True})
    assert "num_experts" in hip_backend.unsupported(
        "biased_topk", info, {**ok, "num_experts": 5000}
    )
    assert "65" in hip_backend.unsupported("router_fwd", info, {**ok, "topk": 64})
    assert hip_backend.unsupported("router_fwd", info, {**ok, "topk": 64, "qb": False}) is None
    assert "num_bins" in hip_backend.unsupported("router_fwd", info, {**ok, "num_bins": 20000})
    assert (
        hip_backend.unsupported("route_rows", info, {"num_experts": 10**6, "impl": "atomic"})
        is None
    )


def test_mapped_libraries_reads_proc_maps():
    libs = _runtime.mapped_libraries("libc")
    assert isinstance(libs, set)
    if os.path.exists("/proc/self/maps"):
        assert libs and all(os.path.isabs(p) for p in libs)


def test_qb_hist_config_fits_the_budget():
    for bins in (2, 1000, 4000, 12288):
        for tokens in (1, 300, 4096):
            epb, slices, per = _ops.qb_hist_config(896, bins, tokens, 48 * 1024, 132)
            assert epb * bins * 4 <= 48 * 1024 and epb >= 1
            assert slices * per >= tokens and (slices - 1) * per < tokens
    with pytest.raises(ValueError):
        _ops.qb_hist_config(896, 13000, 16, 48 * 1024, 132)


def test_router_register_cap_at_few_tokens():
    """NVIDIA builds the router for 2 resident blocks per SM up to ROUTER_FEW_TOKENS tokens when
    256 < E <= 1024 (the default build spills there); elsewhere, and where minimum blocks do not
    cap registers (AMD, the emulator), the default module."""

    class Rt:
        caps_registers_by_blocks = True

    def cap(e, tokens, rt=Rt()):
        spec = _ops._router_spec(torch.empty(0, e), "sigmoid", rt, tokens)
        return dict(spec.defines).get("AMDQB_ROUTER_MIN_BLOCKS")

    few = str(_ops.ROUTER_FEW_TOKENS_MIN_BLOCKS)
    assert cap(896, 1) == few and cap(896, _ops.ROUTER_FEW_TOKENS) == few
    assert cap(896, _ops.ROUTER_FEW_TOKENS + 1) is None
    assert cap(256, 64) is None and cap(2048, 64) is None
    assert cap(896, 64, rt=object()) is None


def test_router_grid_is_one_wave_of_resident_blocks():
    class Rt:
        queries = []

        def num_cus(self, dev):
            return 132

        def blocks_per_cu(self, kernel, block, smem=0):
            self.queries.append((kernel, block, smem))
            return 3

    rt = Rt()
    assert _ops._router_grid(rt, "k", 0, 16384) == 132 * 3  # persistent warps loop over the rest
    assert _ops._router_grid(rt, "k", 0, 100) == -(-100 // _spec.ROUTER_WARPS)  # one warp a token
    assert _ops._router_grid(rt, "k", 0, 0) == 1
    assert rt.queries[0] == ("k", _spec.ROUTER_BLOCK, 0)

    class NoQuery:  # e.g. the CPU emulator: two blocks per CU assumed
        def num_cus(self, dev):
            return 4

    assert _ops._router_grid(NoQuery(), "k", 0, 10**6) == 8


def test_runtime_asks_occupancy_once_per_shape():
    class Toolchain:
        calls = 0

        def blocks_per_cu(self, fn, block, smem, device_index):
            Toolchain.calls += 1
            return 0  # a driver answering 0 still gets one block

    rt = _runtime.GpuRuntime(Toolchain(), disk=_runtime.DiskCache())
    k = _runtime.Kernel("fn", "amdqb_router", 0)
    assert rt.blocks_per_cu(k, 256) == 1 and rt.blocks_per_cu(k, 256) == 1
    assert Toolchain.calls == 1
    rt.blocks_per_cu(k, 256, 1024)
    assert Toolchain.calls == 2

    class Unbound:  # bindings without the occupancy query: a hint of 2, launches unaffected
        pass

    rt = _runtime.GpuRuntime(Unbound(), disk=_runtime.DiskCache())
    assert rt.blocks_per_cu(_runtime.Kernel("fn", "amdqb_router", 0), 256) == 2


def test_auto_qb_mode_switches_between_512_and_1024_tokens_at_896_experts():
    """The fused mode (its block-per-token form) up to T=512, two-kernel beyond (H200 bench)."""
    assert _ops.auto_qb_mode(256, 896) == "fused_atomic"
    assert _ops.auto_qb_mode(512, 896) == "fused_atomic"
    assert _ops.auto_qb_mode(1024, 896) == "two_kernel"
    assert _ops.auto_qb_mode(16384, 896) == "two_kernel"
    # every size auto sends to the fused mode runs its block-per-token form
    assert _ops.ROUTER_DECODE_FUSED_MAX_TOKENS * 896 >= _ops.AUTO_FUSED_MAX_UPDATES


# ================================================================================================
# GPU tests
# ================================================================================================
def _hip_ready():
    if not HAS_GPU:
        return False, "needs a CUDA/ROCm GPU"
    return hip_backend.availability(dispatch.device_info("cuda"))


_READY, _WHY = _hip_ready()
gpu = pytest.mark.skipif(not _READY, reason=f"hip backend unavailable: {_WHY}")
DEV = torch.device("cuda") if HAS_GPU else torch.device("cpu")

ROUTE_E = [1, 17, 129, 256, 257, 512, 513, 896, 1024, 2048, 4096]
ROUTE_DISTS = ["uniform", "shared", "one", "dropped", "counters"]


def _route_sizes(e, k):
    """Route counts just below and at/above the seed gate (lds_route_threshold)."""
    gate = lds_route_threshold(e)
    return sorted({max(1, (gate - 1) // k), -(-gate // k)})


@gpu
@pytest.mark.parametrize("e", ROUTE_E)
@pytest.mark.parametrize("dist", ROUTE_DISTS)
def test_route_rows_atomic_vs_lds(e, dist):
    k = 8
    for m in _route_sizes(e, k):
        ids = make_ids(m, k, e, "uniform" if dist == "counters" else dist, m + e)
        for capacity in (None, max(1, m * k // e)):
            results = {}
            c0 = (
                torch.randint(0, 50, (e,), dtype=torch.int32)
                if dist == "counters"
                else torch.zeros(e, dtype=torch.int32)
            )
            for impl in ("atomic", "lds"):
                counters = c0.clone().to(DEV)
                rows, counts = amdqb.moe_route_rows(
                    ids.to(DEV), e, capacity=capacity, counters=counters, impl=impl, backend="hip"
                )
                check_routes(ids, e, capacity, c0, rows, counts, counters)
                results[impl] = counts.cpu()
            assert torch.equal(results["atomic"], results["lds"])


@gpu
@pytest.mark.parametrize("e", [7, 129, 896, 4096])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_route_rows_deterministic(e, dtype):
    k = 8
    ids = make_ids(3001, k, e, "dropped", e, dtype)
    for capacity in (None, 4):
        outs = []
        c0 = torch.randint(0, 5, (e,), dtype=torch.int32)
        for impl in ("atomic", "lds", "lds"):
            counters = c0.clone().to(DEV)
            rows, counts = amdqb.moe_route_rows(
                ids.to(DEV),
                e,
                capacity=capacity,
                counters=counters,
                deterministic=True,
                impl=impl,
                backend="hip",
            )
            check_routes(ids, e, capacity, c0, rows, counts, counters, deterministic=True)
            outs.append(rows.cpu())
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])


@gpu
@pytest.mark.parametrize("impl", ["atomic", "lds"])
@pytest.mark.parametrize("capacity", [None, 40])
def test_route_rows_graph_capture_replays(impl, capacity):
    e, m, k = 896, 2517, 16
    ids_static = make_ids(m, k, e, "uniform", 0).to(DEV)
    counters_static = torch.zeros(e, dtype=torch.int32, device=DEV)
    # Warm up eagerly (compiles and loads the module), then capture.
    amdqb.moe_route_rows(
        ids_static, e, capacity=capacity, counters=counters_static, impl=impl, backend="hip"
    )
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rows, counts = amdqb.moe_route_rows(
            ids_static, e, capacity=capacity, counters=counters_static, impl=impl, backend="hip"
        )
    for replay in range(8):
        dist = ["uniform", "shared", "one", "dropped"][replay % 4]
        ids = make_ids(m, k, e, dist, 100 + replay)
        c0 = torch.randint(0, 20, (e,), dtype=torch.int32)
        ids_static.copy_(ids.to(DEV))
        counters_static.copy_(c0.to(DEV))
        rows.fill_(-7)  # poisoned outputs must be fully rewritten
        counts.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        check_routes(ids, e, capacity, c0, rows, counts, counters_static)


QB_FORMATS = ["bytemap", "bitmap_u8", "int16", "int32", "int64"]


def _run_router(logits, k, fmt, bias=None, qb_mode=None, num_bins=1000, **kw):
    t, e = logits.shape
    extra = {}
    if fmt.startswith("int"):
        extra["topk_indices"] = torch.empty(t, k, dtype=getattr(torch, fmt), device=DEV)
    else:
        extra["routing_map_format"] = fmt
    hist = bounds = None
    if qb_mode is not None:
        hist = torch.zeros(e, num_bins, dtype=torch.int32, device=DEV)
        bounds = torch.stack([bias.min() - 1, bias.max() + 1]).contiguous()
        extra.update(qb_histogram=hist, qb_bin_bounds=bounds, qb_histogram_mode=qb_mode)
    probs, out = amdqb.fused_topk_with_score_function(
        logits, k, expert_bias=bias, backend="hip", **extra, **kw
    )
    kind = "indices" if fmt.startswith("int") else ("bitmap" if fmt == "bitmap_u8" else "bytemap")
    return probs, out, kind, hist, bounds


def _check_qb(logits, k, fmt, bias, mode, num_bins=1000):
    t, e = logits.shape
    probs, out, kind, hist, bounds = _run_router(logits, k, fmt, bias, mode, num_bins)
    s = hip_backend.score_values(logits, "sigmoid").cpu()
    idx_ref, alpha = qb_cutoff_and_routes(s, bias.cpu(), k)
    want_hist = qb_histogram_counts(s, alpha, bounds.cpu(), num_bins)
    assert torch.equal(hist.cpu(), want_hist), "histogram differs from the oracle on own scores"
    assert torch.all(hist.sum(1).cpu() == t)
    mask = routed_mask(out, kind, e)
    assert torch.all(mask.sum(1) == k)
    want_map = torch.zeros(t, e, dtype=torch.bool).scatter_(1, idx_ref, True)
    assert torch.equal(mask, want_map), "routes differ from the oracle"
    if kind == "indices":
        assert torch.equal(out.cpu().long(), idx_ref), "indices not in selection order"
    probs_ref, _, _ = ref.fused_topk_with_score_function(
        logits.cpu(), k, expert_bias=bias.cpu(), scores=s
    )
    torch.testing.assert_close(
        probs.float().cpu(),
        probs_ref.to(logits.dtype).float(),
        atol=1e-6 if logits.dtype == torch.float32 else 1e-3,
        rtol=1e-5 if logits.dtype == torch.float32 else 1e-2,
    )
    return hist.cpu()


@gpu
@pytest.mark.parametrize("t", [1, 257, 4096])
@pytest.mark.parametrize("k", [8, 16])
@pytest.mark.parametrize("fmt", QB_FORMATS)
def test_qb_router_modes_agree_and_match_oracle(t, k, fmt):
    e = 896
    logits = make_logits(t, e, "normal", t * 31 + k).to(DEV)
    bias = torch.linspace(-0.2, 0.2, e, device=DEV)
    h_two = _check_qb(logits, k, fmt, bias, "two_kernel")
    h_fused = _check_qb(logits, k, fmt, bias, "fused_atomic")
    assert torch.equal(h_two, h_fused), "two_kernel and fused_atomic histograms differ"


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["two_kernel", "fused_atomic", "auto"])
def test_qb_router_dtypes(dtype, mode):
    e = 896
    logits = make_logits(1000, e, "normal", 7, dtype).to(DEV)
    bias = (torch.randn(e, generator=torch.Generator().manual_seed(3)) * 0.05).to(DEV)
    _check_qb(logits, 16, "bytemap", bias, mode)


@gpu
@pytest.mark.parametrize("style", ["ties", "nan_inf", "overflow", "zeros"])
@pytest.mark.parametrize("k,qb", [(8, False), (16, True), (40, False), (63, True)])
def test_router_ties_and_nan_rows(style, k, qb):
    e = 896
    logits = make_logits(129, e, style, k).to(DEV)
    bias = torch.zeros(e, device=DEV)
    mode = "fused_atomic" if qb else None
    probs, out, kind, hist, bounds = _run_router(logits, k, "int32", bias, mode, num_bins=50)
    mask = routed_mask(out, kind, e)
    assert torch.all(mask.sum(1) == k), "every token gets exactly k distinct experts"
    s = hip_backend.score_values(logits, "sigmoid").cpu()
    if qb:
        idx_ref, alpha = qb_cutoff_and_routes(s, bias.cpu(), k)
        assert torch.equal(hist.cpu(), qb_histogram_counts(s, alpha, bounds.cpu(), 50))
    else:
        idx_ref = ref.ordering.ranked_indices(s, k)
    assert torch.equal(out.cpu().long(), idx_ref), "tie-break differs from (value desc, id asc)"


@gpu
def test_sigmoid_fast_path_is_the_division_bit_for_bit():
    """The kernels' sigmoid (on NVIDIA with the IEEE division's fast path written out, router.hip
    sigmoid_fast) equals the same module built with the compiler's own division
    (-DAMDQB_SIGMOID_DIVISION_ONLY), bit for bit, over random bit patterns (NaN, inf, denormals),
    normal logits and every float of the range where the divisor leaves the fast path (z near
    -87.34, denormal results)."""
    g = torch.Generator().manual_seed(5)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=g, dtype=torch.int64)
    edge = torch.arange(
        torch.tensor(-87.5).view(torch.int32).item(),
        torch.tensor(-87.2).view(torch.int32).item(),
        -1,
        dtype=torch.int64,
    )  # negative floats: the signed bit pattern decreases as the value rises
    z = torch.cat(
        [bits.to(torch.int32).view(torch.float32), torch.randn(1 << 20, generator=g) * 30]
        + [edge.to(torch.int32).view(torch.float32)]
    )
    e = 896
    z = torch.cat([z, torch.zeros((-z.numel()) % e)]).reshape(-1, e).to(DEV)
    got = hip_backend.score_values(z, "sigmoid")
    want = _ops.score_values(
        _runtime.get_runtime(), z, "sigmoid", (("AMDQB_SIGMOID_DIVISION_ONLY", "1"),)
    )
    both_nan = torch.isnan(got) & torch.isnan(want)
    same = (got.view(torch.int32) == want.view(torch.int32)) | both_nan
    assert bool(same.all()), f"{int((~same).sum())} of {z.numel()} scores differ from the division"
    tiny = (want > 0) & (want < 1.1754944e-38)
    assert int(tiny.sum()) > 1000  # the denormal results of the slow path were exercised


@gpu
@pytest.mark.parametrize(
    "score,pre",
    [("sigmoid", False), ("sqrtsoftplus", False), ("softmax", True), ("softmax", False)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_score_functions(score, pre, dtype):
    e, t, k = 256, 513, 8
    logits = (make_logits(t, e, "normal", 1) * 2).to(dtype).to(DEV)
    bias = None if score == "softmax" else torch.randn(e, device=DEV) * 0.05
    probs, rmap = amdqb.fused_topk_with_score_function(
        logits,
        k,
        use_pre_softmax=pre,
        score_function=score,
        expert_bias=bias,
        scaling_factor=1.25,
        backend="hip",
    )
    s = hip_backend.score_values(logits, score).cpu()
    probs_ref, _, map_ref = ref.fused_topk_with_score_function(
        logits.cpu(),
        k,
        use_pre_softmax=pre,
        score_function=score,
        expert_bias=None if bias is None else bias.cpu(),
        scaling_factor=1.25,
        scores=None if score == "softmax" else s,
    )
    assert torch.equal(rmap.cpu(), map_ref)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-3, rtol=1e-2)
    torch.testing.assert_close(probs.float().cpu(), probs_ref.to(dtype).float(), **tol)


@gpu
@pytest.mark.parametrize("score", ["sigmoid", "softmax", "sqrtsoftplus"])
@pytest.mark.parametrize("t", [1, 8, 64, 256])
def test_biased_topk(score, t):
    e, k = 896, 16
    logits = make_logits(t, e, "normal", t).to(DEV)
    bias = None if score == "softmax" else torch.randn(e, device=DEV) * 0.05
    w, ids = amdqb.biased_topk(logits, k, bias, score_function=score, backend="hip")
    s = hip_backend.score_values(logits, score).cpu()
    sel = s if bias is None else s + bias.cpu()
    assert torch.equal(ids.cpu(), ref.ordering.ranked_indices(sel, k).to(torch.int32))
    want_w, _ = ref.biased_topk(logits.cpu(), k, None if bias is None else bias.cpu(), score)
    torch.testing.assert_close(w.cpu(), want_w, atol=1e-6, rtol=1e-4)


def _count_decode_launches(monkeypatch):
    """A list whose last entry counts the launches of the decode form (its block size comes from
    decode_threads); the caller appends a 0 to start each count."""
    forms = [0]
    threads = _ops.decode_threads

    def counted(num_experts):
        forms[-1] += 1
        return threads(num_experts)

    monkeypatch.setattr(_ops, "decode_threads", counted)
    return forms


@gpu
@pytest.mark.parametrize(
    "e,k,dtype,style",
    [
        (896, 16, torch.float32, "ties"),
        (896, 16, torch.bfloat16, "normal"),
        (300, 33, torch.float32, "nan_inf"),
        (64, 8, torch.float16, "ties"),
        (4096, 64, torch.float32, "saturated"),
    ],
)
def test_biased_topk_decode_kernel_is_bitwise_the_warp_kernel(monkeypatch, e, k, dtype, style):
    """One block per token (amdqb_router_decode) and one warp per token (amdqb_router) give the same
    ids and the same weight bits."""
    logits = make_logits(37, e, style, e, dtype).to(DEV)
    bias = (torch.randint(-2, 3, (e,)) * 0.125).float().to(DEV)
    forms = _count_decode_launches(monkeypatch)
    outs = []
    for limit in (1 << 30, 0):
        monkeypatch.setattr(_ops, "DECODE_MAX_TOKENS", limit)
        forms.append(0)
        outs.append(amdqb.biased_topk(logits, k, bias, scaling_factor=1.5, backend="hip"))
    assert forms[1:] == [1, 0], "the two forms did not both run"
    (w1, i1), (w2, i2) = outs
    assert torch.equal(i1, i2)
    assert torch.equal(w1.view(torch.int32), w2.view(torch.int32))
    s = hip_backend.score_values(logits, "sigmoid").cpu() + bias.cpu()
    assert torch.equal(i1.cpu(), ref.ordering.ranked_indices(s, k).to(torch.int32))


@gpu
@pytest.mark.parametrize(
    "e,k,dtype,qb",
    [
        (896, 16, torch.float32, "fused_atomic"),
        (896, 16, torch.bfloat16, "two_kernel"),
        (300, 33, torch.float32, None),
        (4096, 8, torch.float16, "fused_atomic"),
    ],
)
def test_router_decode_kernel_is_bitwise_the_warp_kernel(monkeypatch, e, k, dtype, qb):
    """The router's decode form (one block per token) and amdqb_router give the same probs bits,
    routing map and QB histogram."""
    logits = make_logits(67, e, "ties", e, dtype).to(DEV)
    bias = (torch.randint(-2, 3, (e,)) * 0.125).float().to(DEV)
    bounds = torch.stack([bias.min() - 1, bias.max() + 1]).contiguous()
    amdqb.mark_qb_bin_bounds_validated(bounds)
    forms = _count_decode_launches(monkeypatch)
    outs = []
    for limit in (1 << 30, 0):
        monkeypatch.setattr(_ops, "ROUTER_DECODE_MAX_TOKENS", limit)
        monkeypatch.setattr(_ops, "ROUTER_DECODE_FUSED_MAX_TOKENS", limit)
        forms.append(0)
        kw = {}
        if qb is not None:
            hist = torch.zeros(e, 300, dtype=torch.int32, device=DEV)
            kw = dict(qb_histogram=hist, qb_bin_bounds=bounds, qb_histogram_mode=qb)
        probs, rmap = amdqb.fused_topk_with_score_function(
            logits, k, expert_bias=bias, scaling_factor=1.5, backend="hip", **kw
        )
        outs.append((probs, rmap, kw.get("qb_histogram")))
    assert forms[1:] == [1, 0], "the two forms did not both run"
    (p1, m1, h1), (p2, m2, h2) = outs
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(p1.view(bits), p2.view(bits))
    assert torch.equal(m1, m2)
    assert h1 is None or torch.equal(h1, h2)


@gpu
def test_score_values_close_to_torch():
    logits = (torch.randn(64, 896) * 4).to(DEV)
    for score in ("sigmoid", "sqrtsoftplus", "softmax"):
        s = hip_backend.score_values(logits, score)
        torch.testing.assert_close(s, ref.router.activation(logits, score), atol=1e-6, rtol=1e-5)


@gpu
def test_router_on_a_side_stream():
    e, k = 896, 16
    logits = make_logits(300, e, "normal", 2).to(DEV)
    bias = torch.linspace(-0.1, 0.1, e, device=DEV)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        probs, rmap = amdqb.fused_topk_with_score_function(
            logits, k, expert_bias=bias, backend="hip"
        )
    torch.cuda.current_stream().wait_stream(stream)
    s = hip_backend.score_values(logits, "sigmoid").cpu()
    _, _, want = ref.fused_topk_with_score_function(
        logits.cpu(), k, expert_bias=bias.cpu(), scores=s
    )
    assert torch.equal(rmap.cpu(), want)


@gpu
@pytest.mark.parametrize("mode", ["two_kernel", "fused_atomic"])
def test_router_graph_capture_replays(mode):
    e, k, t, b = 896, 16, 1024, 1000
    logits_static = make_logits(t, e, "normal", 0).to(DEV)
    bias = torch.linspace(-0.2, 0.2, e, device=DEV)
    bounds = torch.stack([bias.min() - 1, bias.max() + 1]).contiguous()
    hist = torch.zeros(e, b, dtype=torch.int32, device=DEV)
    kwargs = dict(
        expert_bias=bias,
        qb_histogram=hist,
        qb_bin_bounds=bounds,
        qb_histogram_mode=mode,
        backend="hip",
    )
    amdqb.fused_topk_with_score_function(logits_static, k, **kwargs)  # warm-up + validation
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        probs, rmap = amdqb.fused_topk_with_score_function(logits_static, k, **kwargs)
    for replay in range(4):
        hist.zero_()
        logits = make_logits(t, e, "normal", 10 + replay)
        logits_static.copy_(logits.to(DEV))
        graph.replay()
        torch.cuda.synchronize()
        s = hip_backend.score_values(logits_static, "sigmoid").cpu()
        idx_ref, alpha = qb_cutoff_and_routes(s, bias.cpu(), k)
        assert torch.equal(hist.cpu(), qb_histogram_counts(s, alpha, bounds.cpu(), b))
        want = torch.zeros(t, e, dtype=torch.bool).scatter_(1, idx_ref, True)
        assert torch.equal(rmap.cpu(), want)


@gpu
def test_qb_histogram_pass_is_a_dependent_launch_on_sm90(monkeypatch):
    """On NVIDIA sm_90+ the histogram pass goes out as a programmatic dependent launch. The runtime
    falls back to ordinary launches for good if the bindings or the driver refuse one; this test
    makes such a fallback visible. The histogram equals the ordinary launch's and the oracle's
    (graph replay: test_router_graph_capture_replays)."""
    tc = _runtime.get_runtime().toolchain
    if tc.name != "nvrtc" or torch.cuda.get_device_capability(DEV)[0] < 9:
        pytest.skip("programmatic dependent launch is an NVIDIA sm_90+ feature")
    e, k, t, b = 896, 16, 3000, 1000
    logits = make_logits(t, e, "normal", 4).to(DEV)
    bias = torch.linspace(-0.2, 0.2, e, device=DEV)
    bounds = torch.stack([bias.min() - 1, bias.max() + 1]).contiguous()
    hists = []
    for dependent in (True, False):
        monkeypatch.setattr(_ops, "QB_HIST_DEPENDENT_LAUNCH", dependent)
        hist = torch.zeros(e, b, dtype=torch.int32, device=DEV)
        amdqb.fused_topk_with_score_function(
            logits,
            k,
            expert_bias=bias,
            qb_histogram=hist,
            qb_bin_bounds=bounds,
            qb_histogram_mode="two_kernel",
            backend="hip",
        )
        hists.append(hist.cpu())
    assert tc._pdl not in (None, False), "the dependent launch fell back to cuLaunchKernel"
    assert torch.equal(hists[0], hists[1])
    s = hip_backend.score_values(logits, "sigmoid").cpu()
    _, alpha = qb_cutoff_and_routes(s, bias.cpu(), k)
    assert torch.equal(hists[0], qb_histogram_counts(s, alpha, bounds.cpu(), b))


@gpu
def test_router_wide_expert_counts():
    # E in (2048, 4096] runs with register spills; beyond, the dispatcher is told to fall back.
    info = dispatch.device_info(DEV)
    assert hip_backend.unsupported("router_fwd", info, {"num_experts": 5000, "topk": 8})
    e = 3000
    logits = make_logits(33, e, "normal", e).to(DEV)
    probs, rmap = amdqb.fused_topk_with_score_function(logits, 8, backend="hip")
    s = hip_backend.score_values(logits, "sigmoid").cpu()
    want = ref.fused_topk_with_score_function(logits.cpu(), 8, scores=s)[2]
    assert torch.equal(rmap.cpu(), want)
