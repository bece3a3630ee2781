"""The hiprtc toolchain and the dispatcher's run-time build fallback, on the CPU.

Two hiprtcs: the real one of Debian's ROCm 5.2 (``libamdhip64.so.5``, through the ctypes binding
of op_tests/hip_emu/debian_hiprtc.py: it compiles on the CPU), whose version the toolchain must
refuse (older than ``_runtime.MIN_ROCM``) and, past that check, whose rejection of the kernels
(builtins its LLVM 15 lacks) must make the dispatcher fall back; and a fake one for everything a
device would add. No ROCm device exists here, so a FAKE hip-python binding stands in for it, injected through
``sys.modules`` in both layouts the runtime imports: the split one (``from rocm.bindings import
hip, hiprtc``) and the legacy one (``from hip import hip, hiprtc``). It mimics hip-python's call
shapes: results come back as ``(err, value, ...)`` tuples; calls that return only an error give
``(err,)`` in one fake layout and a bare ``err`` in the other (so both shapes are exercised
through both import paths); errors are enum-like objects with ``int()`` and ``str()``;
``hiprtcGetProgramLog`` and ``hiprtcGetCode`` fill a caller-sized buffer. torch's CUDA queries
(``get_device_properties`` with ``gcnArchName`` feature suffixes, the current stream and device)
are monkeypatched, and the dispatcher is shown an AMD device through a fake ``DeviceInfo``.

What is checked: the imports; the version and target queries; compile -> load -> function ->
launch with the launch's decoded arguments; a compile failure carrying its log; a load failure;
the guard against two HIP runtimes in one process; the build-failure contract of
``GpuRuntime.kernel`` (remembered, not retried; a module's later lookups are no build failures);
that every hip launcher takes its kernels from one module and requests one before launching (what
makes a fallback after a build failure safe); and the dispatcher end to end: a hip build failure
runs the op on the next backend of its order with one warning, later calls go there directly
(eagerly and through a graph traced before the failure), ``backend="hip"`` raises, ``report()``
lists the failure; ``AMDQB_BACKEND`` is a preference with per-op fallback. Results of the
fallback runs are compared with the torch oracles.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import sys
import types
import warnings

import pytest
import torch

import amdqb
from amdqb import configs, devices, dispatch, ref
from amdqb.backends.calls import AlignCall, RouterCall
from amdqb.backends.hip import _runtime, _spec
from amdqb.backends.hip import layout as hip_layout
from amdqb.backends.hip import router as hip_router
from amdqb.backends.hip._runtime import (
    GpuRuntime,
    HipBackendError,
    HipBuildError,
    HiprtcToolchain,
    import_hip_bindings,
)
from amdqb.backends.hip._spec import arg_i32, arg_i64, arg_ptr

from conftest import HAS_GPU, forget_build_failures, require
from hip_emu import debian_hiprtc

ARCH = "gfx942:sramecc+:xnack-"
HIP_VERSION = 60342000


# ------------------------------------------------------------------------------------------------
# The fake binding
# ------------------------------------------------------------------------------------------------
class FakeEnum:
    """An enum member as hip-python's: ``int()`` its value, ``str()`` ``Type.name``."""

    def __init__(self, type_name: str, name: str, value: int):
        self.type_name, self.name, self.value = type_name, name, value

    def __int__(self):
        return self.value

    def __index__(self):
        return self.value

    def __eq__(self, other):
        return int(self) == int(other)

    def __hash__(self):
        return hash(self.value)

    def __str__(self):
        return f"{self.type_name}.{self.name}"

    __repr__ = __str__


def _enum_type(type_name: str, members: dict[str, int]):
    return types.SimpleNamespace(**{n: FakeEnum(type_name, n, v) for n, v in members.items()})


hipError_t = _enum_type(
    "hipError_t",
    {
        "hipSuccess": 0,
        "hipErrorInvalidValue": 1,
        "hipErrorInvalidImage": 200,
        "hipErrorNoBinaryForGpu": 209,
        "hipErrorNotFound": 500,
        "hipErrorLaunchFailure": 719,
    },
)
hiprtcResult = _enum_type(
    "hiprtcResult",
    {"HIPRTC_SUCCESS": 0, "HIPRTC_ERROR_INVALID_OPTION": 5, "HIPRTC_ERROR_COMPILATION": 6},
)

COMPILE_LOGS = {  # the failure modes of the fake compiler and the logs they leave
    "unknown_target": (
        "error: unknown target ID '{arch}'\n"
        "error: cannot find ROCm device library for {arch}; provide its path via "
        "'--rocm-path' or '--rocm-device-lib-path'\n"
    ),
    "missing_builtin": (
        "In file included from {name}:1:\n"
        "amdqb_prelude.h:88:12: error: use of undeclared identifier "
        "'__builtin_amdgcn_ballot_w64'\n"
        "1 error generated when compiling for {arch}.\n"
    ),
}


class FakeProgram:
    def __init__(self, source: bytes, name: bytes):
        self.source, self.name = source, name
        self.log, self.code, self.destroyed = b"", b"", False

    def createRef(self):
        return types.SimpleNamespace(program=self)


class FakeHiprtc:
    """hiprtc: compiles by recording the options and emitting a fake code object (with a NUL)."""

    hiprtcResult = hiprtcResult

    def __init__(self, state):
        self.state = state

    def _done(self, err):  # a call that returns only an error: (err,) or a bare err
        return (err,) if self.state.tuple_errors else err

    def hiprtcVersion(self):
        return (hiprtcResult.HIPRTC_SUCCESS, 6, 3)

    def hiprtcCreateProgram(self, source, name, num_headers, headers, include_names):
        assert isinstance(source, bytes) and isinstance(name, bytes)
        assert num_headers == 0 and list(headers) == [] and list(include_names) == []
        prog = FakeProgram(source, name)
        self.state.programs.append(prog)
        return (hiprtcResult.HIPRTC_SUCCESS, prog)

    def hiprtcCompileProgram(self, prog, num_options, options):
        assert num_options == len(options) and all(isinstance(o, bytes) for o in options)
        opts = [o.decode() for o in options]
        self.state.compiles.append(opts)
        arch = next(o.split("=", 1)[1] for o in opts if o.startswith("--offload-arch="))
        mode = self.state.compile_fails
        if mode is not None:
            text = COMPILE_LOGS[mode].format(arch=arch, name=prog.name.decode())
            prog.log = text.encode() + b"\0"  # hiprtc's log size counts the NUL
            return self._done(hiprtcResult.HIPRTC_ERROR_COMPILATION)
        # the kernels' names: token-pasted ones (amdqb_route_atomic_##SUFFIX) for both id types
        names = re.findall(rb"\b((?:amdqb|fake)_\w+?)(?:_##SUFFIX)?\b", prog.source)
        names += [
            n + s
            for n in re.findall(rb"\b(amdqb_\w+_)##SUFFIX", prog.source)
            for s in (b"i32", b"i64")
        ]
        body = arch.encode() + b"\0" + b" ".join(sorted(set(names)))
        prog.code = b"FAKEHSACO\0" + (14 + len(body)).to_bytes(4, "little") + body
        prog.log = b"\0"
        return self._done(hiprtcResult.HIPRTC_SUCCESS)

    def hiprtcGetProgramLogSize(self, prog):
        return (hiprtcResult.HIPRTC_SUCCESS, len(prog.log))

    def hiprtcGetProgramLog(self, prog, buf):
        assert isinstance(buf, bytearray) and len(buf) == len(prog.log)
        buf[:] = prog.log
        return self._done(hiprtcResult.HIPRTC_SUCCESS)

    def hiprtcGetCodeSize(self, prog):
        return (hiprtcResult.HIPRTC_SUCCESS, len(prog.code))

    def hiprtcGetCode(self, prog, buf):
        assert isinstance(buf, bytearray) and len(buf) == len(prog.code)
        buf[:] = prog.code
        return self._done(hiprtcResult.HIPRTC_SUCCESS)

    def hiprtcDestroyProgram(self, ref):
        ref.program.destroyed = True
        return self._done(hiprtcResult.HIPRTC_SUCCESS)


class FakeHip:
    """The HIP module API: loads the fake code objects, launches by decoding kernelParams."""

    hipError_t = hipError_t

    def __init__(self, state):
        self.state = state

    def hipRuntimeGetVersion(self):
        return (hipError_t.hipSuccess, HIP_VERSION)

    def hipModuleLoadData(self, image):
        assert isinstance(image, int)  # the runtime passes the address of its copy
        self.state.loads.append(image)
        if self.state.load_fails:
            return (hipError_t.hipErrorNoBinaryForGpu, None)
        head = ctypes.string_at(image, 14)
        assert head.startswith(b"FAKEHSACO\0"), head
        data = ctypes.string_at(image, int.from_bytes(head[10:14], "little"))
        names = set(data.rsplit(b"\0", 1)[1].decode().split())
        return (hipError_t.hipSuccess, types.SimpleNamespace(names=names, image=data))

    def hipModuleGetFunction(self, module, name):
        assert isinstance(name, bytes)
        if name.decode() not in module.names:
            return (hipError_t.hipErrorNotFound, None)
        return (hipError_t.hipSuccess, types.SimpleNamespace(name=name.decode(), module=module))

    def hipModuleLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        kinds = self.state.arg_types[fn.name]
        slots = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        args = [kind.from_address(slots[i]).value for i, kind in enumerate(kinds)]
        self.state.launches.append(
            {
                "kernel": fn.name,
                "grid": (gx, gy, gz),
                "block": (bx, by, bz),
                "smem": smem,
                "stream": stream,
                "extra": extra,
                "args": args,
            }
        )
        err = hipError_t.hipErrorLaunchFailure if self.state.launch_fails else hipError_t.hipSuccess
        return (err,) if self.state.tuple_errors else err

    def hipModuleOccupancyMaxActiveBlocksPerMultiprocessor(self, fn, block, smem):
        return (hipError_t.hipSuccess, 4)


class FakeBinding:
    def __init__(self, layout: str):
        self.layout = layout
        self.tuple_errors = layout == "legacy"
        self.programs, self.compiles, self.loads, self.launches = [], [], [], []
        self.compile_fails = None  # a key of COMPILE_LOGS
        self.load_fails = False
        self.launch_fails = False
        self.arg_types = {}
        self.hip, self.hiprtc = FakeHip(self), FakeHiprtc(self)


def install(monkeypatch, layout: str) -> FakeBinding:
    """Make ``layout``'s import path find the fake binding and the other one fail."""
    fake = FakeBinding(layout)
    pkg = types.ModuleType("fakehip")
    pkg.hip, pkg.hiprtc = fake.hip, fake.hiprtc
    if layout == "split":
        monkeypatch.setitem(sys.modules, "rocm", types.ModuleType("rocm"))
        monkeypatch.setitem(sys.modules, "rocm.bindings", pkg)
        monkeypatch.setitem(sys.modules, "hip", None)
    else:
        monkeypatch.setitem(sys.modules, "rocm", None)
        monkeypatch.setitem(sys.modules, "rocm.bindings", None)
        monkeypatch.setitem(sys.modules, "hip", pkg)
    return fake


class FakeProps:
    def __init__(self, arch=ARCH, warp_size=64):
        self.gcnArchName = arch
        self.warp_size = warp_size
        self.name = "fake AMD Instinct"
        self.multi_processor_count = 4


@pytest.fixture
def rocm(monkeypatch, tmp_path):
    """torch as a ROCm build with one fake gfx942 device (the CPU tensors stand for its memory);
    a fresh hip runtime, disk cache and dispatcher state."""
    props = {"value": FakeProps()}
    monkeypatch.setattr(torch.version, "hip", "6.3.42134-fake")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: props["value"])
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda index=None: types.SimpleNamespace(cuda_stream=0xABC)
    )
    monkeypatch.setenv("AMDQB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("AMDQB_REBUILD", raising=False)
    monkeypatch.delenv("AMDQB_BACKEND", raising=False)
    monkeypatch.setattr(_spec, "PREBUILT_DIR", tmp_path / "no_prebuilt")
    monkeypatch.setattr(_runtime, "_RUNTIME", None)
    monkeypatch.setattr(_runtime, "_RUNTIME_ERROR", None)
    monkeypatch.setattr(_runtime, "mapped_libraries", lambda prefix: set())
    return props


AMD_INFO = dispatch.DeviceInfo("cpu", "amd", "fake AMD Instinct", "gfx942", 64, 65536, 4, "gfx942")


@pytest.fixture
def amd_dispatch(rocm, monkeypatch):
    """The dispatcher sees the CPU as a gfx942 device (hip available through the fake binding,
    triton through the interpreter); its caches and failure records start and end empty."""
    if HAS_GPU:
        pytest.skip("fakes a gfx942 on CPU tensors, whose Triton fallback needs the interpreter")
    monkeypatch.setattr(devices, "_device_info_cached", lambda device_str: AMD_INFO)
    forget_build_failures()
    yield
    forget_build_failures()  # also drops the choices cached for the fake device


def install_debian(monkeypatch):
    """The split layout with Debian's real ROCm 5.2 hiprtc (compiles on the CPU) and the fake HIP
    module API (loads and launches need a device); hipRuntimeGetVersion is the real library's."""
    require(
        debian_hiprtc.library_path() is not None,
        "needs Debian's ROCm 5.2 hiprtc (apt-get install libamdhip64-5 libamd-comgr2)",
    )
    fake = install(monkeypatch, "split")
    real = debian_hiprtc.DebianHiprtc()
    version = real.runtime_version()
    monkeypatch.setattr(fake.hip, "hipRuntimeGetVersion", lambda: (hipError_t.hipSuccess, version))
    sys.modules["rocm.bindings"].hiprtc = real
    return fake, real


# ------------------------------------------------------------------------------------------------
# Imports, versions, targets
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["split", "legacy"])
def test_bindings_import_each_layout(monkeypatch, layout):
    fake = install(monkeypatch, layout)
    hip, hiprtc = import_hip_bindings()
    assert hip is fake.hip and hiprtc is fake.hiprtc


def test_missing_binding_names_the_package(monkeypatch):
    for name in ("rocm", "rocm.bindings", "hip"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match="hip-python is not installed"):
        import_hip_bindings()


@pytest.mark.parametrize("layout", ["split", "legacy"])
def test_versions_and_target(rocm, monkeypatch, layout):
    install(monkeypatch, layout)
    tc = HiprtcToolchain()
    assert tc.compiler_id() == f"hip{HIP_VERSION}-hiprtc6.3"
    # the feature suffixes reach --offload-arch and the cache key; the wave size is the device's
    assert tc.target(0) == (ARCH, 64, "hsaco")
    rocm["value"] = FakeProps(arch=b"gfx1100", warp_size=0)  # bytes, no warp size: from the arch
    assert tc.target(0) == ("gfx1100", 32, "hsaco")
    rocm["value"] = FakeProps(arch="gfx950:xnack+", warp_size=0)
    assert tc.target(0) == ("gfx950:xnack+", 64, "hsaco")
    rocm["value"] = FakeProps(arch="")
    with pytest.raises(HipBackendError, match="gcnArchName"):
        tc.target(0)


def test_two_hip_runtimes_guard(rocm, monkeypatch):
    install(monkeypatch, "split")
    libs = {"/opt/rocm-6.3.0/lib/libamdhip64.so.6", "/usr/lib/python3/torch/lib/libamdhip64.so"}
    monkeypatch.setattr(_runtime, "mapped_libraries", lambda prefix: libs)
    with pytest.raises(ImportError, match="two HIP runtimes") as err:
        HiprtcToolchain()
    assert all(path in str(err.value) for path in libs)
    # the hip backend then reports itself unavailable, with that reason, and the error sticks
    from amdqb.backends import hip as hip_backend

    ok, why = hip_backend.availability(AMD_INFO)
    assert not ok and "two HIP runtimes" in why
    with pytest.raises(ImportError, match="two HIP runtimes"):
        _runtime.get_runtime()


def test_mapped_libraries_reads_this_process():
    libs = _runtime.mapped_libraries("libc")  # the interpreter's C library is mapped
    assert libs and all(p.startswith("/") and "libc" in p for p in libs)
    assert _runtime.mapped_libraries("libamdhip64_not_a_library") == set()


# ------------------------------------------------------------------------------------------------
# Compile, load, function, launch
# ------------------------------------------------------------------------------------------------
SOURCE = 'extern "C" __global__ void fake_kernel(int* out, long long n, int e) { }\n'


@pytest.mark.parametrize("layout", ["split", "legacy"])
def test_compile_load_function_launch(rocm, monkeypatch, tmp_path, layout):
    fake = install(monkeypatch, layout)
    tc = HiprtcToolchain()
    flags = _spec.hip_flags(ARCH, 64, _spec.layout_module(configs.load("gfx942")))
    code = tc.compile(SOURCE, "fake.hip", flags, tmp_path / "include")
    assert code.startswith(b"FAKEHSACO\0") and b"fake_kernel" in code  # NUL bytes kept
    assert fake.compiles[-1] == flags + [f"-I{tmp_path / 'include'}"]
    assert f"--offload-arch={ARCH}" in fake.compiles[-1]
    assert fake.programs[-1].destroyed
    module = tc.load(0, code)
    fn = tc.function(module, "fake_kernel")
    assert fn.name == "fake_kernel" and module.image == code

    fake.arg_types["fake_kernel"] = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32]
    rt = GpuRuntime(tc)
    kernel = _runtime.Kernel(fn, "fake_kernel", 0)
    rt.launch(kernel, (3, 2), 256, 1024, [arg_ptr(0x1000), arg_i64(2**40 + 5), arg_i32(-7)])
    rt.launch(kernel, 0, 256, 0, [arg_ptr(0), arg_i64(0), arg_i32(0)])  # empty grid: no launch
    assert fake.launches == [
        {
            "kernel": "fake_kernel",
            "grid": (3, 2, 1),
            "block": (256, 1, 1),
            "smem": 1024,
            "stream": 0xABC,
            "extra": None,
            "args": [0x1000, 2**40 + 5, -7],
        }
    ]
    assert rt.blocks_per_cu(kernel, 256) == 4


@pytest.mark.parametrize("layout", ["split", "legacy"])
def test_runtime_builds_caches_and_launches_a_hip_src_kernel(rocm, monkeypatch, tmp_path, layout):
    fake = install(monkeypatch, layout)
    rt = GpuRuntime(HiprtcToolchain())
    spec = _spec.layout_module(configs.load("gfx942"))
    k = rt.kernel(0, spec, "amdqb_route_atomic_i32")
    assert len(fake.compiles) == 1 and f"--offload-arch={ARCH}" in fake.compiles[0]
    assert rt.kernel(0, spec, "amdqb_route_atomic_i32") is k  # cached in memory
    rt.kernel(0, spec, "amdqb_route_finalize")  # same module: a lookup, no compile, no load
    assert len(fake.compiles) == 1 and len(fake.loads) == 1
    cached = list((tmp_path / "cache").rglob("*.hsaco"))
    assert len(cached) == 1 and cached[0].parent.name == "gfx942_sramecc__xnack-"
    # a new process's runtime loads the code object from disk without compiling
    rt2 = GpuRuntime(HiprtcToolchain())
    rt2.kernel(0, spec, "amdqb_route_atomic_i32")
    assert len(fake.compiles) == 1 and len(fake.loads) == 2
    fake.arg_types["amdqb_route_atomic_i32"] = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32]
    rt.launch(k, 5, 256, 0, [arg_ptr(0x2000), arg_i64(77), arg_i32(896)])
    assert fake.launches[-1]["args"] == [0x2000, 77, 896]
    assert fake.launches[-1]["grid"] == (5, 1, 1) and fake.launches[-1]["block"] == (256, 1, 1)


@pytest.mark.parametrize("mode", sorted(COMPILE_LOGS))
@pytest.mark.parametrize("layout", ["split", "legacy"])
def test_compile_failure_carries_the_log(rocm, monkeypatch, tmp_path, layout, mode):
    fake = install(monkeypatch, layout)
    fake.compile_fails = mode
    tc = HiprtcToolchain()
    with pytest.raises(HipBackendError) as err:
        tc.compile(SOURCE, "fake.hip", [f"--offload-arch={ARCH}", "-O3"], tmp_path)
    message, summary = str(err.value), err.value.summary
    log = COMPILE_LOGS[mode].format(arch=ARCH, name="fake.hip")
    assert log.strip() in message and "HIPRTC_ERROR_COMPILATION" in message
    assert "\0" not in message  # the log's terminating NUL is not part of the text
    first_error = next(line for line in log.splitlines() if "error" in line)
    assert summary == (
        f"hiprtc could not compile fake.hip for {ARCH} (hiprtcResult.HIPRTC_ERROR_COMPILATION): "
        f"{first_error.strip()}"
    )
    assert fake.programs[-1].destroyed


@pytest.mark.parametrize("layout", ["split", "legacy"])
def test_build_failures_are_remembered_and_not_retried(rocm, monkeypatch, layout):
    fake = install(monkeypatch, layout)
    fake.compile_fails = "missing_builtin"
    rt = GpuRuntime(HiprtcToolchain())
    spec = _spec.layout_module(configs.load("gfx942"))
    with pytest.raises(HipBuildError, match="__builtin_amdgcn_ballot_w64") as first:
        rt.kernel(0, spec, "amdqb_route_atomic_i32")
    assert "layout.hip" in str(first.value) and "__builtin_amdgcn_ballot_w64" in first.value.summary
    with pytest.raises(HipBuildError) as again:
        rt.kernel(0, spec, "amdqb_route_finalize")  # same module: raised without compiling
    assert again.value.summary == first.value.summary and len(fake.compiles) == 1

    # a load failure (the driver refuses the code object) is a build failure as well
    fake.compile_fails, fake.load_fails = None, True
    spec2 = spec.with_defines(("AMDQB_FAKE_VARIANT", "1"))
    with pytest.raises(HipBuildError, match="hipModuleLoadData failed") as load:
        rt.kernel(0, spec2, "amdqb_route_atomic_i32")
    assert "hipErrorNoBinaryForGpu" in load.value.summary
    with pytest.raises(HipBuildError):
        rt.kernel(0, spec2, "amdqb_route_atomic_i32")
    assert len(fake.loads) == 1

    # a module that loaded: a missing function is a build failure only on its first request
    fake.load_fails = False
    spec3 = spec.with_defines(("AMDQB_FAKE_VARIANT", "2"))
    with pytest.raises(HipBuildError, match="amdqb_no_such_kernel"):
        rt.kernel(0, spec3, "amdqb_no_such_kernel")  # nothing of the module handed out yet
    rt.kernel(0, spec3, "amdqb_route_atomic_i32")
    with pytest.raises(HipBackendError, match="hipModuleGetFunction") as late:
        rt.kernel(0, spec3, "amdqb_no_such_kernel_either")
    assert not isinstance(late.value, HipBuildError)  # a kernel of it may have launched


@pytest.mark.parametrize("layout", ["split", "legacy"])
def test_launch_failure_is_not_a_build_failure(rocm, monkeypatch, layout):
    fake = install(monkeypatch, layout)
    rt = GpuRuntime(HiprtcToolchain())
    k = rt.kernel(0, _spec.layout_module(configs.load("gfx942")), "amdqb_route_atomic_i32")
    fake.arg_types[k.name] = [ctypes.c_int32]
    fake.launch_fails = True
    with pytest.raises(HipBackendError, match="hipErrorLaunchFailure") as err:
        rt.launch(k, 1, 256, 0, [arg_i32(1)])
    assert not isinstance(err.value, HipBuildError)


# ------------------------------------------------------------------------------------------------
# The invariant behind a safe fallback: one module per op call, requested before any launch
# ------------------------------------------------------------------------------------------------
class RecordingRuntime:
    """Stands in for GpuRuntime: hands out dummy kernels and records requests and launches."""

    caps_registers_by_blocks = False

    def __init__(self):
        self.events = []

    def kernel(self, device_index, spec, name):
        self.events.append(("kernel", spec, name))
        return types.SimpleNamespace(name=name, spec=spec)

    def launch(self, kernel, grid, block, smem, args):
        _spec.KernelParams(args)  # the arguments are exact-width ctypes values
        self.events.append(("launch", kernel.spec, kernel.name))

    launch_dependent = launch

    def supports_clusters(self, device_index):
        return False

    def blocks_per_cu(self, kernel, block, smem=0):
        return None

    def num_cus(self, device_index):
        return 4

    def smem_budget(self, device_index):
        return 48 * 1024


def _router_calls():
    e, k = 64, 4
    for tokens in (1, 700):  # the decode kernel, the persistent one
        logits = torch.randn(tokens, e)
        probs = torch.empty(tokens, e)
        yield f"router_fwd T={tokens}", lambda rt, lg=logits, p=probs: hip_router.router_fwd(
            rt,
            RouterCall(e, k),
            lg,
            None,
            p,
            torch.empty(lg.shape, dtype=torch.bool),
            None,
            None,
            None,
            None,
        )
        for mode, binning in (
            ("fused_atomic", "uniform"),
            ("two_kernel", "uniform"),
            ("two_kernel", "log_margin"),
        ):
            hist = torch.zeros(e, 16, dtype=torch.int32)
            bounds = torch.tensor([-1.0, 1.0])
            call = RouterCall(e, k, qb_mode=mode, qb_binning=binning, num_bins=16)
            yield f"router_fwd T={tokens} qb {mode} {binning}", (
                lambda rt, lg=logits, p=probs, h=hist, b=bounds, c=call: hip_router.router_fwd(
                    rt,
                    c,
                    lg,
                    torch.zeros(e),
                    p,
                    torch.empty(lg.shape, dtype=torch.bool),
                    h,
                    b,
                    None,
                    None,
                )
            )
        yield f"biased_topk T={tokens}", lambda rt, lg=logits: hip_router.biased_topk(
            rt,
            lg,
            k,
            None,
            "sigmoid",
            True,
            None,
            None,
            None,
            torch.empty(lg.shape[0], k),
            torch.empty(lg.shape[0], k, dtype=torch.int32),
        )


def _layout_calls():
    e = 64
    ids = torch.randint(0, e, (300, 4), dtype=torch.int32)
    for deterministic, impl in ((True, "atomic"), (False, "lds"), (False, "atomic")):
        for capacity in (None, 8):
            yield f"route_rows det={deterministic} {impl} cap={capacity}", (
                lambda rt, d=deterministic, i=impl, c=capacity: hip_layout.route_rows(
                    rt,
                    ids,
                    e,
                    c,
                    torch.zeros(e, dtype=torch.int32),
                    torch.empty(ids.shape, dtype=torch.int32),
                    torch.zeros(e, dtype=torch.int32),
                    d,
                    i,
                )
            )
    yield "align_block_size", lambda rt: hip_layout.align_block_size(
        rt,
        AlignCall(e, 16),
        ids,
        None,
        torch.empty(2000, dtype=torch.int32),
        torch.empty(200, dtype=torch.int32),
        torch.empty(1, dtype=torch.int32),
    )


@pytest.mark.parametrize(
    "name,call",
    list(_router_calls()) + list(_layout_calls()),
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_every_hip_op_call_uses_one_module_requested_before_launching(name, call):
    rt = RecordingRuntime()
    call(rt)
    assert rt.events, "the call launched nothing"
    assert rt.events[0][0] == "kernel", f"{name}: launched before its first kernel request"
    assert len({spec for _, spec, _ in rt.events}) == 1, f"{name}: kernels of two modules"
    assert any(kind == "launch" for kind, _, _ in rt.events)


# ------------------------------------------------------------------------------------------------
# The dispatcher's fallback, end to end
# ------------------------------------------------------------------------------------------------
E = 16


def _ids(seed=0, m=40, k=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, E, (m, k), generator=g, dtype=torch.int32)


def _assert_routes_match_oracle(ids, rows, counts):
    want_rows, want_counts = ref.moe_route_rows(ids, E)
    assert torch.equal(counts, want_counts)
    flat = ids.reshape(-1).long()  # every expert's set of rows is the oracle's

    def per_expert(r):
        return torch.sort(flat * (1 << 33) + r.reshape(-1).long()).values

    assert torch.equal(per_expert(rows), per_expert(want_rows))


def _hip_build_warnings(record):
    return [
        w
        for w in record
        if issubclass(w.category, RuntimeWarning) and "cannot build" in str(w.message)
    ]


@pytest.mark.parametrize("layout", ["split", "legacy"])
def test_hip_build_failure_falls_back_once_and_is_remembered(amd_dispatch, monkeypatch, layout):
    fake = install(monkeypatch, layout)
    fake.compile_fails = "missing_builtin"
    features = {"num_experts": E, "impl": "atomic"}
    assert dispatch.kernel_backend("route_rows", "cpu", **features) == "hip>triton"
    assert dispatch.select("route_rows", "cpu", **features).fallback == "triton"
    rt = _runtime.get_runtime()
    requests = []
    real_kernel = rt.kernel
    monkeypatch.setattr(rt, "kernel", lambda *a: requests.append(a[2]) or real_kernel(*a))

    ids = _ids()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        rows, counts = amdqb.moe_route_rows(ids, E, impl="atomic")
    (warning,) = _hip_build_warnings(record)
    text = str(warning.message)
    assert "'route_rows'" in text and "triton" in text and "__builtin_amdgcn_ballot_w64" in text
    _assert_routes_match_oracle(ids, rows, counts)
    assert len(fake.compiles) == 1 and len(requests) == 1

    # remembered: later calls select triton directly -- no kernel request, no compile, no warning
    assert dispatch.select("route_rows", "cpu", **features).backend == "triton"
    assert dispatch.kernel_backend("route_rows", "cpu", **features) == "triton"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for seed in (1, 2):
            ids = _ids(seed)
            _assert_routes_match_oracle(ids, *amdqb.moe_route_rows(ids, E, impl="atomic"))
    assert not _hip_build_warnings(record) and len(requests) == 1 and len(fake.compiles) == 1

    # a graph traced before the failure keeps its token: it goes to triton without asking hip
    stale = dispatch.implementation("route_rows", "hip>triton")
    ids = _ids(3)
    counters, counts = torch.zeros(E, dtype=torch.int32), torch.zeros(E, dtype=torch.int32)
    rows = torch.empty(ids.shape, dtype=torch.int32)
    stale(ids, E, None, counters, rows, counts, False, "atomic")
    _assert_routes_match_oracle(ids, rows, counts)
    assert len(requests) == 1

    # strict: backend="hip" names the recorded cause
    with pytest.raises(RuntimeError, match="hip: failed to build on cpu: .*ballot_w64"):
        amdqb.moe_route_rows(ids, E, impl="atomic", backend="hip")

    # the layout module is shared: align fails from the runtime's record (no second compile),
    # warns once for its own op, and matches the oracle on triton
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = amdqb.moe_align_block_size(ids, 4, E)
        again = amdqb.moe_align_block_size(ids, 4, E)
    (warning,) = _hip_build_warnings(record)
    assert "'align_block_size'" in str(warning.message)
    want = ref.moe_align_block_size(ids, 4, E)  # deterministic order on every backend
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(again, want))
    assert len(fake.compiles) == 1

    # the report: each op's backend and the recorded cause
    report = dispatch.report("cpu")
    for op in ("route_rows", "align_block_size"):
        assert report["ops"][op]["backend"] == "triton"
        assert "ballot_w64" in report["ops"][op]["rejected"]["hip"]
    assert report["ops"]["router_fwd"]["backend"] == "hip"  # its module was never built
    assert report["ops"]["router_fwd"]["fallback"] == "triton"
    assert {(f["op"], f["backend"]) for f in report["failures"]} == {
        ("route_rows", "hip"),
        ("align_block_size", "hip"),
    }
    assert all("ballot_w64" in f["cause"] for f in report["failures"])


def test_strict_backend_raises_the_build_error(amd_dispatch, monkeypatch):
    fake = install(monkeypatch, "split")
    fake.compile_fails = "unknown_target"
    ids = _ids()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(HipBuildError, match="unknown target ID"):
            amdqb.moe_route_rows(ids, E, impl="atomic", backend="hip")
    assert not _hip_build_warnings(record)  # raised, not fallen back
    assert dispatch.failures("cpu")[0]["op"] == "route_rows"
    # the dispatcher's own choice then skips hip for the op
    assert dispatch.select("route_rows", "cpu", num_experts=E, impl="atomic").backend == "triton"
    _assert_routes_match_oracle(ids, *amdqb.moe_route_rows(ids, E, impl="atomic"))
    assert len(fake.compiles) == 1


def test_graph_compiled_before_the_failure_falls_back(amd_dispatch, monkeypatch):
    fake = install(monkeypatch, "legacy")
    fake.compile_fails = "unknown_target"

    def route(x):
        return amdqb.moe_route_rows(x, E, impl="atomic")

    compiled = torch.compile(route, fullgraph=True, backend="aot_eager")
    ids = _ids()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        rows, counts = compiled(ids)  # traced with "hip>triton"; hip fails at its first request
        _assert_routes_match_oracle(ids, rows, counts)
        ids2 = _ids(5)
        _assert_routes_match_oracle(ids2, *compiled(ids2))
    assert len(_hip_build_warnings(record)) == 1 and len(fake.compiles) == 1


# ------------------------------------------------------------------------------------------------
# AMDQB_BACKEND: a preference with per-op fallback; backend= strict
# ------------------------------------------------------------------------------------------------
def test_preference_follows_or_falls_back_per_op(amd_dispatch, monkeypatch):
    fake = install(monkeypatch, "split")
    monkeypatch.setenv("AMDQB_BACKEND", "hip")
    assert dispatch.select("route_rows", "cpu", num_experts=E, impl="atomic").backend == "hip"
    assert dispatch.kernel_backend("route_rows", "cpu", num_experts=E, impl="atomic") == (
        "hip>triton"
    )
    choice = dispatch.select("qb_recover", "cpu", num_bins=16)
    assert choice.backend == "triton"
    assert "AMDQB_BACKEND=hip cannot run it" in choice.reason
    assert dict(choice.rejected)["hip"] == "does not implement 'qb_recover'"
    grouped = dispatch.select(  # grouped under QB: no amdqb_topk row plan
        "router_fwd",
        "cpu",
        num_experts=E,
        topk=2,
        num_groups=2,
        group_topk=1,
        qb_mode="auto",
        num_bins=16,
    )
    assert grouped.backend == "triton" and "grouped" in dict(grouped.rejected)["hip"]
    with pytest.raises(RuntimeError, match="hip: does not implement 'qb_recover'"):
        dispatch.select("qb_recover", "cpu", "hip", num_bins=16)  # backend= stays strict

    # a preferred backend that fails to build falls back like the dispatcher's own choice
    fake.compile_fails = "missing_builtin"
    ids = _ids()
    with pytest.warns(RuntimeWarning, match="cannot build its kernels for 'route_rows'"):
        _assert_routes_match_oracle(ids, *amdqb.moe_route_rows(ids, E, impl="atomic"))

    pref = dispatch.report("cpu")["preference"]
    assert pref["backend"] == "hip" and pref["error"] is None
    assert {"router_fwd", "router_bwd", "biased_topk", "align_block_size"} <= set(pref["follow"])
    for op in (
        "qb_recover",
        "qb_step",
        "chunk_copy",
        "chunk_row_map",
        "aux_scores_fwd",
        "aux_scores_bwd",
        "aux_loss_fwd",
        "aux_loss_bwd",
    ):
        assert pref["fell_back"][op] == {"backend": "triton", "why": f"does not implement {op!r}"}
    assert pref["fell_back"]["route_rows"]["backend"] == "triton"
    assert pref["fell_back"]["route_rows"]["why"].startswith("failed to build on cpu: ")


def test_preference_runs_every_op_where_the_backend_cannot(monkeypatch):
    """AMDQB_BACKEND=hip where hip cannot run at all (here: no GPU): every op still runs, on its
    normal order, with the oracle's results; backend="hip" raises."""
    monkeypatch.setenv("AMDQB_BACKEND", "hip")
    g = torch.Generator().manual_seed(0)
    e, k, t, b = 8, 2, 12, 10
    logits = torch.randn(t, e, generator=g)
    hist = torch.randint(0, 5, (e, b), generator=g, dtype=torch.int32)
    bounds = torch.tensor([-1.0, 1.0])

    def run(backend=None):
        out = {}
        out["recover"] = amdqb.qb_recover_bias(hist, bounds, k, backend=backend)
        bias, bb = torch.zeros(e), bounds.clone()
        amdqb.qb_step_(bias, hist, bb, k, 0.5, backend=backend)
        out["step"] = (bias, bb)
        out["router"] = amdqb.fused_topk_with_score_function(logits, k, backend=backend)
        out["topk"] = amdqb.biased_topk(logits, k, backend=backend)
        ids = out["topk"][1]
        out["align"] = amdqb.moe_align_block_size(ids, 4, e, backend=backend)
        x = torch.randn(6, 3, generator=torch.Generator().manual_seed(1))
        sizes = torch.tensor([2, 1, 3], dtype=torch.int32)
        order = torch.tensor([2, 0, 1], dtype=torch.int32)
        padded = torch.tensor([4, 4, 4], dtype=torch.int32)
        out["chunks"] = amdqb.moe_sort_chunks_and_pad(x, sizes, order, padded, 12, backend=backend)
        z = logits.clone().requires_grad_(True)
        routing_map, scores = amdqb.fused_compute_score_for_moe_aux_loss(
            z, k, "softmax", backend=backend
        )
        tokens = routing_map.sum(0).to(torch.int32)
        loss = amdqb.fused_moe_aux_loss(scores, tokens, t, e, k, 1e-2, backend=backend)
        loss.backward()
        out["aux"] = (routing_map, scores.detach(), loss.detach(), z.grad)
        return out

    got, want = run(), run("torch")

    def flat(v):
        if v is None or isinstance(v, torch.Tensor):
            return [v]
        return [x for item in v for x in flat(item)]

    for key in want:
        pairs = list(zip(flat(got[key]), flat(want[key]), strict=True))
        assert all(a is b2 if a is None else torch.equal(a, b2) for a, b2 in pairs), key
    with pytest.raises(RuntimeError, match="no backend can run 'qb_recover'"):
        amdqb.qb_recover_bias(hist, bounds, k, backend="hip")


def test_invalid_preference_is_named(monkeypatch):
    monkeypatch.setenv("AMDQB_BACKEND", "cuda")
    with pytest.raises(ValueError, match="AMDQB_BACKEND must be one of"):
        dispatch.select("route_rows", "cpu")
    pref = dispatch.report("cpu")["preference"]
    assert pref["backend"] is None and "AMDQB_BACKEND must be one of" in pref["error"]


def test_info_shows_preference_and_failures(amd_dispatch, monkeypatch, capsys):
    fake = install(monkeypatch, "split")
    fake.compile_fails = "unknown_target"
    monkeypatch.setenv("AMDQB_BACKEND", "hip")
    from amdqb import cli

    assert cli.main(["info", "--build"]) == 0
    out = capsys.readouterr().out
    assert "AMDQB_BACKEND=hip (a preference; backend= on an op is strict)" in out
    assert re.search(r"qb_recover\s+-> triton\s+hip: does not implement 'qb_recover'", out)
    assert "build failures (the op runs on its next backend on this device):" in out
    for op in ("router_fwd", "biased_topk", "route_rows", "align_block_size"):
        assert re.search(rf"^  {op}\s+hip\s+.*unknown target ID", out, re.MULTILINE), op
        assert re.search(rf"^  {op}\s+triton\s", out, re.MULTILINE), op
    assert "passed over hip: failed to build (below)" in out
    assert "--build: ran router_fwd (ok), biased_topk (ok), route_rows (ok)" in out


# ------------------------------------------------------------------------------------------------
# Debian's real ROCm 5.2 hiprtc
# ------------------------------------------------------------------------------------------------
def test_rocm_releases_older_than_the_minimum_are_refused(rocm, monkeypatch):
    """The version check: ROCm 6.0 passes, 5.7 is refused with a message naming both."""
    fake = install(monkeypatch, "split")
    assert _runtime.rocm_release(60342000) == (6, 3, 42000)
    for version, ok in ((60000000, True), (70125424, True), (50721000, False)):
        monkeypatch.setattr(fake.hip, "hipRuntimeGetVersion", lambda v=version: (0, v))
        if ok:
            HiprtcToolchain()
        else:
            with pytest.raises(ImportError, match=r"ROCm 5\.7 .* older than ROCm 6\.0"):
                HiprtcToolchain()


def test_rocm52_is_refused_by_the_version_check(rocm, monkeypatch):
    """Debian's real ROCm 5.2: the toolchain refuses it before compiling anything, naming the
    minimum; the hip backend reports that as its reason and the dispatcher runs triton."""
    _, real = install_debian(monkeypatch)
    major, minor = _runtime.rocm_release(real.runtime_version())[:2]
    assert (major, minor) < (6, 0)  # Debian 12's 5.2; Ubuntu 24.04's libamdhip64-5 is 5.7
    with pytest.raises(ImportError, match=rf"ROCm {major}\.{minor} .*older than ROCm 6\.0") as err:
        HiprtcToolchain()
    assert "__builtin_amdgcn_exp2f" in str(err.value)
    from amdqb.backends import hip as hip_backend

    ok, why = hip_backend.availability(AMD_INFO)
    assert not ok and "ROCm 6.0" in why
    assert real.compiles == []


@pytest.mark.parametrize("op", ["route_rows", "biased_topk"])
def test_rocm52_hiprtc_rejection_falls_back(amd_dispatch, rocm, monkeypatch, op):
    """Past the version check, Debian's real hiprtc compiles the runtime's module for a gfx90a
    (a target it knows) with the runtime's flags and rejects it on builtins its compiler lacks:
    the dispatcher warns once, runs the op on triton with the oracle's results, remembers the
    failure (no second compile) and backend="hip" raises it."""
    _, real = install_debian(monkeypatch)
    monkeypatch.setattr(_runtime, "MIN_ROCM", (5, 0))
    arch = "gfx90a:sramecc+:xnack-"
    rocm["value"] = FakeProps(arch=arch, warp_size=64)
    cfg = configs.load("gfx942")
    ids = _ids()
    logits = torch.randn(6, E, generator=torch.Generator().manual_seed(3))

    def call(backend=None):
        if op == "route_rows":
            return amdqb.moe_route_rows(ids, E, impl="atomic", backend=backend)
        return amdqb.biased_topk(logits, 4, backend=backend)

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = call()
    (warning,) = _hip_build_warnings(record)
    assert "__builtin_amdgcn_ballot_w64" in str(warning.message), str(warning.message)
    if op == "route_rows":
        _assert_routes_match_oracle(ids, *got)
        spec = _spec.layout_module(cfg)
    else:
        w_ref, ids_ref = ref.biased_topk(logits, 4)
        assert torch.equal(got[1], ids_ref)
        torch.testing.assert_close(got[0], w_ref, atol=1e-6, rtol=1e-5)
        spec = None  # the serving top-k module of the call
    (opts,) = real.compiles  # the runtime's flags reached the real compiler
    if spec is not None:
        assert opts[: len(_spec.hip_flags(arch, 64, spec))] == _spec.hip_flags(arch, 64, spec)
    base = _spec.hip_flags(arch, 64, _spec.ModuleSpec("x"))  # the flags every module gets
    assert opts[: len(base)] == base and opts[-1].startswith("-I")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        call()
    assert not _hip_build_warnings(record) and len(real.compiles) == 1
    with pytest.raises(RuntimeError, match="ballot_w64"):
        call("hip")
