"""The ``hip`` backend's runtime, without a GPU: cache keys, the atomic disk cache with reload and
concurrent builders, ``AMDQB_CACHE_DIR`` / ``AMDQB_REBUILD``, prebuilt code objects, exact-width
argument packing read back through the kernelParams array, availability reasons, missing
bindings, source lookup and occupancy queries (a fake toolchain stands in for hiprtc / NVRTC).
"""

import ctypes
import os
import threading

import pytest
import torch

from amdqb import configs, dispatch
from amdqb.backends import hip as hip_backend
from amdqb.backends.hip import _runtime, _spec

CFG = configs.load("default")


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
    text, digests = _spec.read_sources(_spec.layout_module(CFG))
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
    spec = _spec.router_module(896, "float32", "sigmoid", CFG)
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
    name = _spec.prebuilt_name(_spec.layout_module(CFG), "gfx942", 64)
    assert name.startswith("layout_") and "-gfx942-" in name and name.endswith(".hsaco")
    (tmp_path / "prebuilt").mkdir()
    (tmp_path / "prebuilt" / name).write_bytes(b"AOT code object")
    _runtime.GpuRuntime(tc).kernel(0, _spec.layout_module(CFG), "amdqb_route_lds_i32")
    assert tc.compiles == [] and tc.loads[0][1] == b"AOT code object"
    # Another wave size or other sources never match the file.
    assert _spec.prebuilt_name(_spec.layout_module(CFG), "gfx942", 32) != name
    monkeypatch.setenv("AMDQB_REBUILD", "1")
    tc2 = FakeToolchain()
    tc2.name, tc2.target = tc.name, tc.target
    _runtime.GpuRuntime(tc2).kernel(0, _spec.layout_module(CFG), "amdqb_route_lds_i32")
    assert len(tc2.compiles) == 1


def test_runtime_key_changes_with_defines(tmp_path, monkeypatch):
    monkeypatch.setenv("AMDQB_CACHE_DIR", str(tmp_path))
    rt = _runtime.GpuRuntime(FakeToolchain())
    a, _ = rt.code_object(0, _spec.router_module(896, "float32", "sigmoid", CFG))
    b, _ = rt.code_object(0, _spec.router_module(896, "bfloat16", "sigmoid", CFG))
    c, _ = rt.code_object(0, _spec.router_module(897, "float32", "sigmoid", CFG))
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
    k = rt.kernel(0, _spec.layout_module(CFG), "amdqb_route_finalize")
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


def test_mapped_libraries_reads_proc_maps():
    libs = _runtime.mapped_libraries("libc")
    assert isinstance(libs, set)
    if os.path.exists("/proc/self/maps"):
        assert libs and all(os.path.isabs(p) for p in libs)


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

    class Unbound:  # bindings without the occupancy query: no answer, the launcher's fallback
        pass

    rt = _runtime.GpuRuntime(Unbound(), disk=_runtime.DiskCache())
    assert rt.blocks_per_cu(_runtime.Kernel("fn", "amdqb_router", 0), 256) is None
