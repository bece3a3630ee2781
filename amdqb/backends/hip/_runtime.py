"""Run-time compilation, code-object cache and launches of the ``hip_src`` kernels.

* ROCm (``torch.version.hip``): hiprtc through hip-python (``from rocm.bindings import hip,
  hiprtc``, else the legacy ``from hip import hip, hiprtc``), ``--offload-arch=<gcnArchName>``,
  ``hipModuleLoadData`` / ``hipModuleLaunchKernel``.
* NVIDIA: NVRTC through cuda-python (``from cuda.bindings import nvrtc, driver``, else the legacy
  ``from cuda import nvrtc, cuda``), ``--gpu-architecture=sm_XX`` (cubin; PTX of the newest
  supported arch when NVRTC does not know the device), ``cuModuleLoadData`` / ``cuLaunchKernel``
  in torch's primary context.

The hiprtc toolchain refuses a ROCm older than :data:`MIN_ROCM` (6.0) with an ImportError naming
it (the hip backend then reports itself unavailable and the other backends run).

Code objects are cached in memory per (device, key) and on disk under ``AMDQB_CACHE_DIR`` (default
``~/.cache/amdqb``), keyed by the sha256 of sources + arch + wave size + flags + compiler version,
written atomically (temporary file + ``os.replace``) under an ``fcntl`` file lock.
``AMDQB_REBUILD=1`` recompiles once per process. Launches go to
``torch.cuda.current_stream(device)`` with ``kernelParams`` of exact-width ctypes values, so they
are CUDA/HIP-graph capturable (compile and load before capturing: warm up eagerly).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import tempfile
import threading
from pathlib import Path

import torch

from ..._arch import amd_wave_size
from . import _spec


class HipBackendError(RuntimeError):
    """The hip backend cannot compile, load or launch a kernel. ``summary``: one line of cause."""

    def __init__(self, message: str, summary: str | None = None):
        super().__init__(message)
        self.summary = summary


class HipBuildError(HipBackendError):
    """A kernel could not be built: target query, compile, code-object load or function lookup of
    a module none of whose kernels had been handed out yet. Every op call takes its kernels from
    one module and requests one before its first launch, so nothing of the call has run: the
    dispatcher may run the op on another backend (``BuildError`` of the hip backend)."""


def _split(result):
    """(err, values) of a binding call: tuple or bare error (hip-python API drift)."""
    if isinstance(result, tuple):
        return result[0], result[1:]
    return result, ()


def _check(result, what: str):
    err, values = _split(result)
    if err is not None and int(err) != 0:
        raise HipBackendError(f"{what} failed: {err!s}")
    if len(values) == 1:
        return values[0]
    return values


def first_error_line(log: str) -> str:
    """The first line of a compiler log that reports an error (else its first line), trimmed."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    line = next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else "")
    return line if len(line) <= 200 else line[:197] + "..."


def _offload_arch(opts) -> str:
    return next((o.split("=", 1)[1] for o in opts if o.startswith("--offload-arch=")), "?")


_PDL_ATTRIBUTE = "CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION"


def _result_ok(result) -> bool:
    err, _ = _split(result)
    return err is None or int(err) == 0


# ------------------------------------------------------------------------------------------------
# Bindings (imported lazily; availability() reports what is missing)
# ------------------------------------------------------------------------------------------------
def import_hip_bindings():
    """(hip, hiprtc) modules of hip-python, or raise ImportError naming what is missing."""
    try:
        from rocm.bindings import hip, hiprtc  # hip-python >= 10 split packages
    except ImportError:
        try:
            from hip import hip, hiprtc  # legacy hip-python
        except ImportError as exc:
            raise ImportError(
                "hip-python is not installed: `pip install hip-python` (or amdqb[rocm]) provides "
                "hiprtc and the HIP module API the hip backend needs"
            ) from exc
    return hip, hiprtc


_CUDA_HINT = (
    "`pip install cuda-python` (or amdqb[cuda]) plus an NVRTC library matching its major version "
    "(`pip install nvidia-cuda-nvrtc-cu12` for 12.x, `nvidia-cuda-nvrtc` for 13.x)"
)


def import_nvrtc():
    """cuda-python's NVRTC module, or raise ImportError naming what is missing."""
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        try:
            from cuda import nvrtc  # legacy cuda-python < 12.6
        except ImportError as exc:
            raise ImportError(
                f"cuda-python (NVRTC bindings) is not installed: {_CUDA_HINT}"
            ) from exc
    return nvrtc


def import_cuda_driver():
    """cuda-python's driver-API module, or raise ImportError naming what is missing."""
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # legacy cuda-python < 12.6
        except ImportError as exc:
            raise ImportError(
                f"cuda-python (driver bindings) is not installed: {_CUDA_HINT}"
            ) from exc
    return driver


def mapped_libraries(prefix: str) -> set[str]:
    """Real paths of the shared objects named ``prefix*`` mapped into this process."""
    found = set()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(None, 5)[-1].strip() if line.count(" ") >= 5 else ""
                if path.startswith("/") and os.path.basename(path).startswith(prefix):
                    found.add(os.path.realpath(path))
    except OSError:
        pass
    return found


# ------------------------------------------------------------------------------------------------
# Disk cache
# ------------------------------------------------------------------------------------------------
class DiskCache:
    """Code objects as ``<root>/<toolchain>/<arch>/<key>.<ext>``, written atomically."""

    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else _spec.cache_dir() / "hip-kernels"

    def path(self, toolchain: str, arch: str, key: str, ext: str) -> Path:
        safe_arch = "".join(c if c.isalnum() or c in "-_." else "_" for c in arch)
        return self.root / toolchain / safe_arch / f"{key}.{ext}"

    def get_or_build(self, path: Path, build, force: bool = False) -> bytes:
        """Cached bytes at ``path``; else ``build()`` them and store them (under a file lock)."""
        if not force and path.is_file():
            return path.read_bytes()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError:  # read-only home / cache dir: compile, keep it in memory only
            return build()
        lock_path = path.with_suffix(path.suffix + ".lock")
        with open(lock_path, "a+") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                if not force and path.is_file():  # another process built it meanwhile
                    return path.read_bytes()
                data = build()
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
                try:
                    with os.fdopen(fd, "wb") as f:
                        f.write(data)
                    os.replace(tmp, path)
                except BaseException:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
                    raise
                return data
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


# ------------------------------------------------------------------------------------------------
# Toolchains
# ------------------------------------------------------------------------------------------------
class _Toolchain:
    name = "?"

    def compiler_id(self) -> str: ...

    def target(self, device_index: int) -> tuple[str, int, str]:
        """(arch for --offload-arch / --gpu-architecture and the cache key, wave size, file ext)."""

    def compile(self, source: str, name: str, flags: list[str], include_dir: Path) -> bytes: ...

    def load(self, device_index: int, image: bytes): ...

    def function(self, module, name: str): ...

    def launch(self, fn, grid, block, smem: int, device_index: int, params_address: int): ...

    def launch_dependent(self, fn, grid, block, smem: int, device_index: int, params_address: int):
        """A launch that may overlap the end of the stream's previous kernel (the kernel waits
        for it where it must); toolchains without such launches make an ordinary one."""
        self.launch(fn, grid, block, smem, device_index, params_address)

    def supports_clusters(self, device_index: int) -> bool:
        """Whether launch_cluster runs here (thread block clusters: NVIDIA sm_90+)."""
        return False

    def launch_cluster(self, fn, grid, cluster, block, smem, device_index, params_address):
        raise HipBackendError(f"{self.name}: no thread block clusters")

    def blocks_per_cu(self, fn, block: int, smem: int, device_index: int) -> int: ...

    def static_smem(self, fn, device_index: int) -> int: ...


class NvrtcCompiler:
    """NVRTC through cuda-python; needs no GPU (the CPU tests compile every kernel with it)."""

    def __init__(self):
        self.nvrtc = import_nvrtc()
        try:
            major, minor = _check(self.nvrtc.nvrtcVersion(), "nvrtcVersion")
        except Exception as exc:  # the binding exists but libnvrtc cannot be loaded
            raise ImportError(f"NVRTC is not usable ({exc}): {_CUDA_HINT}") from exc
        self.version = (int(major), int(minor))
        try:
            archs = _check(self.nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")
            self.supported = sorted(int(a) for a in archs)
        except Exception:
            self.supported = []

    def compiler_id(self) -> str:
        return f"nvrtc-{self.version[0]}.{self.version[1]}"

    def arch_for(self, cc: int) -> str:
        """``sm_XX`` (cubin) when NVRTC knows the device, else PTX of the newest older arch."""
        if not self.supported or cc in self.supported:
            return f"sm_{cc}"
        older = [a for a in self.supported if a <= cc]
        if not older:
            raise HipBackendError(f"NVRTC {self.version} supports no arch <= sm_{cc}")
        return f"compute_{older[-1]}"

    def compile(self, source: str, name: str, flags: list[str], include_dir: Path) -> bytes:
        nvrtc = self.nvrtc
        opts = list(flags) + [f"-I{include_dir}"]
        cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
        if os.path.isdir(os.path.join(cuda_home, "include")):
            opts.append(f"-I{os.path.join(cuda_home, 'include')}")
        prog = _check(
            nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []),
            "nvrtcCreateProgram",
        )
        try:
            err, _ = _split(nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts]))
            if int(err) != 0:
                size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
                log = b" " * int(size)
                _check(nvrtc.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
                raise HipBackendError(
                    f"NVRTC failed to compile {name} ({err!s}) with {opts}:\n"
                    f"{log.decode(errors='replace')}"
                )
            if any(o.startswith("--gpu-architecture=sm_") for o in opts):
                size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
                image = b" " * int(size)
                _check(nvrtc.nvrtcGetCUBIN(prog, image), "nvrtcGetCUBIN")
            else:
                size = _check(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
                image = b" " * int(size)
                _check(nvrtc.nvrtcGetPTX(prog, image), "nvrtcGetPTX")
            return bytes(image)
        finally:
            nvrtc.nvrtcDestroyProgram(prog)


class NvrtcToolchain(_Toolchain):
    name = "nvrtc"

    def __init__(self):
        self.compiler = NvrtcCompiler()
        self.driver = import_cuda_driver()
        _check(self.driver.cuInit(0), "cuInit")
        self._primary = {}
        self._streams = {}
        self._lock = threading.Lock()
        self._pdl = None  # the launch attribute once built; False: dependent launches unavailable
        self._sm90 = {}  # device index -> compute capability >= 9.0 (programmatic launches)

    def compiler_id(self) -> str:
        return self.compiler.compiler_id()

    def target(self, device_index: int):
        major, minor = torch.cuda.get_device_capability(device_index)
        arch = self.compiler.arch_for(major * 10 + minor)
        return arch, 32, "cubin" if arch.startswith("sm_") else "ptx"

    def compile(self, source, name, flags, include_dir):
        return self.compiler.compile(source, name, flags, include_dir)

    def ensure_context(self, device_index: int) -> None:
        """Make torch's primary context of ``device_index`` current for the driver API."""
        drv = self.driver
        ctx = self._primary.get(device_index)
        if ctx is None:
            with self._lock:
                ctx = self._primary.get(device_index)
                if ctx is None:
                    dev = _check(drv.cuDeviceGet(device_index), "cuDeviceGet")
                    ctx = _check(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
                    self._primary[device_index] = ctx
        current = _check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if current is None or int(current) != int(ctx):
            _check(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def load(self, device_index, image):
        self.ensure_context(device_index)
        buf = ctypes.create_string_buffer(image, len(image))
        try:
            return _check(self.driver.cuModuleLoadData(ctypes.addressof(buf)), "cuModuleLoadData")
        except HipBackendError as exc:
            try:
                drv = int(_check(self.driver.cuDriverGetVersion(), "cuDriverGetVersion"))
                drv = f"{drv // 1000}.{drv % 1000 // 10}"
            except Exception:
                drv = "?"
            raise HipBackendError(
                f"{exc} (code object from {self.compiler_id()}, driver supports CUDA {drv}): "
                "install an NVRTC no newer than the driver, e.g. nvidia-cuda-nvrtc-cu12"
            ) from exc

    def function(self, module, name):
        return _check(self.driver.cuModuleGetFunction(module, name.encode()), "cuModuleGetFunction")

    def _stream(self, device_index):
        handle = torch.cuda.current_stream(device_index).cuda_stream
        stream = self._streams.get(handle)
        if stream is None:
            stream = self._streams.setdefault(handle, self.driver.CUstream(handle))
        return stream

    def launch(self, fn, grid, block, smem, device_index, params_address):
        self.ensure_context(device_index)
        stream = self._stream(device_index)
        _check(
            self.driver.cuLaunchKernel(
                fn, grid[0], grid[1], grid[2], block, 1, 1, smem, stream, params_address, 0
            ),
            "cuLaunchKernel",
        )

    def launch_dependent(self, fn, grid, block, smem, device_index, params_address):
        # Programmatic dependent launch (CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
        # sm_90+, captured into CUDA graphs as a programmatic edge). Bindings or drivers without
        # it fall back to cuLaunchKernel for the rest of the process.
        if self._pdl is not False and self._is_sm90(device_index):
            self.ensure_context(device_index)
            stream = self._stream(device_index)
            try:
                drv = self.driver
                if self._pdl is None:
                    attr = drv.CUlaunchAttribute()
                    attr.id = getattr(drv.CUlaunchAttributeID, _PDL_ATTRIBUTE)
                    attr.value.programmaticStreamSerializationAllowed = 1
                    self._pdl = attr
                cfg = drv.CUlaunchConfig()
                cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
                cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block, 1, 1
                cfg.sharedMemBytes = smem
                cfg.hStream = stream
                cfg.attrs = [self._pdl]
                cfg.numAttrs = 1
                err = drv.cuLaunchKernelEx(cfg, fn, params_address, 0)
            except (AttributeError, TypeError, ValueError):
                self._pdl = False
            else:
                if _result_ok(err):
                    return
                self._pdl = False
        self.launch(fn, grid, block, smem, device_index, params_address)

    def _is_sm90(self, device_index) -> bool:
        """Compute capability >= 9.0, asked once per device (every dependent launch asks)."""
        sm90 = self._sm90.get(device_index)
        if sm90 is None:
            sm90 = self._sm90[device_index] = torch.cuda.get_device_capability(device_index)[0] >= 9
        return sm90

    def supports_clusters(self, device_index):
        return self._is_sm90(device_index) and hasattr(self.driver, "cuLaunchKernelEx")

    def launch_cluster(self, fn, grid, cluster, block, smem, device_index, params_address):
        # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION: the grid's blocks in clusters of `cluster` along
        # x, each cluster resident at once (a launch that cannot be fails: no fallback)
        self.ensure_context(device_index)
        drv = self.driver
        attr = drv.CUlaunchAttribute()
        attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster, 1, 1
        cfg = drv.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block, 1, 1
        cfg.sharedMemBytes = smem
        cfg.hStream = self._stream(device_index)
        cfg.attrs = [attr]
        cfg.numAttrs = 1
        _check(drv.cuLaunchKernelEx(cfg, fn, params_address, 0), "cuLaunchKernelEx (cluster)")

    def static_smem(self, fn, device_index):
        self.ensure_context(device_index)
        attr = self.driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES
        return int(_check(self.driver.cuFuncGetAttribute(attr, fn), "cuFuncGetAttribute"))

    def blocks_per_cu(self, fn, block, smem, device_index):
        self.ensure_context(device_index)
        return int(
            _check(
                self.driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, block, smem),
                "cuOccupancyMaxActiveBlocksPerMultiprocessor",
            )
        )


# The oldest ROCm whose hiprtc builds the hip kernels: its compiler (ROCm 6.0's LLVM 17) is the
# first with every builtin they use -- the compilers of ROCm 5 lack __builtin_amdgcn_exp2f, older
# ones also __builtin_amdgcn_ballot_w64 (Debian's ROCm 5.2 hiprtc, on LLVM 15, rejects both) -- and
# 6.0 is the first release for gfx942 (MI300X). Older releases are refused before compiling
# anything (ROCm 5.2's comgr aborts the process on a target it does not know, such as gfx942).
MIN_ROCM = (6, 0)


def rocm_release(hip_version: int) -> tuple[int, int, int]:
    """(major, minor, patch) of a HIP_VERSION (major * 10^7 + minor * 10^5 + patch)."""
    v = int(hip_version)
    return v // 10_000_000, v // 100_000 % 100, v % 100_000


class HiprtcToolchain(_Toolchain):
    name = "hiprtc"

    def __init__(self):
        self.hip, self.hiprtc = import_hip_bindings()
        try:
            runtime = _check(self.hip.hipRuntimeGetVersion(), "hipRuntimeGetVersion")
        except Exception as exc:
            raise ImportError(f"the HIP runtime is not usable through hip-python ({exc})") from exc
        major, minor, _ = rocm_release(runtime)
        if (major, minor) < MIN_ROCM:
            need = ".".join(map(str, MIN_ROCM))
            raise ImportError(
                f"ROCm {major}.{minor} (HIP runtime {int(runtime)}) is older than ROCm {need}, the "
                f"oldest whose hiprtc builds the hip kernels (its compiler lacks "
                "__builtin_amdgcn_exp2f / __builtin_amdgcn_ballot_w64): install ROCm "
                f"{need} or newer; the other backends run meanwhile"
            )
        try:
            rtc = _check(self.hiprtc.hiprtcVersion(), "hiprtcVersion")
            rtc = ".".join(str(int(v)) for v in (rtc if isinstance(rtc, tuple) else (rtc,)))
        except Exception:
            rtc = "?"
        self.version = f"hip{int(runtime)}-hiprtc{rtc}"
        libs = mapped_libraries("libamdhip64")
        if len(libs) > 1:
            raise ImportError(
                "two HIP runtimes are loaded in this process "
                f"({', '.join(sorted(libs))}): modules would load in one and torch's streams live "
                "in the other (hipErrorContextIsDestroyed on launch). Make hip-python use the "
                "libamdhip64 that torch loaded (same ROCm install / LD_LIBRARY_PATH)."
            )

    def compiler_id(self) -> str:
        return self.version

    def target(self, device_index):
        props = torch.cuda.get_device_properties(device_index)
        arch = getattr(props, "gcnArchName", None) or ""
        if isinstance(arch, bytes):
            arch = arch.decode()
        if not arch:
            raise HipBackendError("torch does not report gcnArchName for this device")
        wave = int(getattr(props, "warp_size", 0) or amd_wave_size(arch))
        return arch, wave, "hsaco"

    def compile(self, source, name, flags, include_dir):
        hiprtc = self.hiprtc
        opts = list(flags) + [f"-I{include_dir}"]
        prog = _check(
            hiprtc.hiprtcCreateProgram(source.encode(), name.encode(), 0, [], []),
            "hiprtcCreateProgram",
        )
        try:
            err, _ = _split(
                hiprtc.hiprtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
            )
            if int(err) != 0:
                size = _check(hiprtc.hiprtcGetProgramLogSize(prog), "hiprtcGetProgramLogSize")
                log = bytearray(int(size))
                _check(hiprtc.hiprtcGetProgramLog(prog, log), "hiprtcGetProgramLog")
                text = bytes(log).rstrip(b"\0").decode(errors="replace")
                raise HipBackendError(
                    f"hiprtc failed to compile {name} ({err!s}) with {opts}:\n{text}",
                    summary=f"hiprtc could not compile {name} for {_offload_arch(opts)} ({err!s})"
                    + (f": {first_error_line(text)}" if first_error_line(text) else ""),
                )
            size = _check(hiprtc.hiprtcGetCodeSize(prog), "hiprtcGetCodeSize")
            code = bytearray(int(size))
            _check(hiprtc.hiprtcGetCode(prog, code), "hiprtcGetCode")
            return bytes(code)  # binary with NUL bytes: never through a C string
        finally:
            try:
                hiprtc.hiprtcDestroyProgram(prog.createRef())
            except Exception:
                pass

    def load(self, device_index, image):
        buf = ctypes.create_string_buffer(image, len(image))
        with torch.cuda.device(device_index):
            return _check(self.hip.hipModuleLoadData(ctypes.addressof(buf)), "hipModuleLoadData")

    def function(self, module, name):
        return _check(self.hip.hipModuleGetFunction(module, name.encode()), "hipModuleGetFunction")

    def launch(self, fn, grid, block, smem, device_index, params_address):
        stream = torch.cuda.current_stream(device_index).cuda_stream
        if torch.cuda.current_device() != device_index:
            with torch.cuda.device(device_index):
                self.launch(fn, grid, block, smem, device_index, params_address)
            return
        result = self.hip.hipModuleLaunchKernel(
            fn, grid[0], grid[1], grid[2], block, 1, 1, smem, stream, params_address, None
        )
        _check(result, "hipModuleLaunchKernel")

    def static_smem(self, fn, device_index):
        attr = self.hip.hipFunction_attribute.HIP_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES
        return int(_check(self.hip.hipFuncGetAttribute(attr, fn), "hipFuncGetAttribute"))

    def blocks_per_cu(self, fn, block, smem, device_index):
        return int(
            _check(
                self.hip.hipModuleOccupancyMaxActiveBlocksPerMultiprocessor(fn, block, smem),
                "hipModuleOccupancyMaxActiveBlocksPerMultiprocessor",
            )
        )


# ------------------------------------------------------------------------------------------------
# Runtime: modules per device, launches
# ------------------------------------------------------------------------------------------------
class Kernel:
    __slots__ = ("fn", "name", "device_index", "occupancy", "static_smem")

    def __init__(self, fn, name, device_index):
        self.fn = fn
        self.name = name
        self.device_index = device_index
        self.occupancy = {}  # (block, smem) -> resident blocks per CU/SM
        self.static_smem = None  # its static shared memory in bytes, asked once


class GpuRuntime:
    """Compiles, caches and launches kernels on the GPUs torch sees."""

    def __init__(self, toolchain: _Toolchain, disk: DiskCache | None = None):
        self.toolchain = toolchain
        self.disk = disk or DiskCache()
        self._modules: dict = {}
        self._kernels: dict = {}
        self._failed: dict = {}  # (device, spec) -> (message, summary) of a failed build
        self._lock = threading.RLock()

    def code_object(self, device_index: int, spec: _spec.ModuleSpec) -> tuple[str, bytes]:
        tc = self.toolchain
        arch, wave, ext = tc.target(device_index)
        if tc.name == "nvrtc":
            flags = _spec.nvrtc_flags(arch, spec)
        else:
            flags = _spec.hip_flags(arch, wave, spec)
        root = _spec.source_root()
        source, digests = _spec.read_sources(spec, root)
        key = _spec.cache_key(tc.compiler_id(), arch, wave, flags, digests)
        if tc.name == "hiprtc" and not _spec.rebuild_requested():
            prebuilt = _spec.PREBUILT_DIR / _spec.prebuilt_name(
                spec, arch.split(":")[0], wave, root
            )
            if prebuilt.is_file():
                return key, prebuilt.read_bytes()
        path = self.disk.path(tc.name, arch, key, ext)
        data = self.disk.get_or_build(
            path,
            lambda: tc.compile(source, spec.kernel_file, flags, root / "include"),
            force=_spec.rebuild_requested(),
        )
        return key, data

    def kernel(self, device_index: int, spec: _spec.ModuleSpec, name: str) -> Kernel:
        """Kernel ``name`` of ``spec``'s module on ``device_index``, built and loaded on the first
        request. Raises HipBuildError when it cannot be (a failed module is remembered: asking
        again raises at once, without compiling again)."""
        k = self._kernels.get((device_index, spec, name))
        if k is not None:
            return k
        with self._lock:
            k = self._kernels.get((device_index, spec, name))
            if k is not None:
                return k
            module = self._modules.get((device_index, spec))
            fresh = module is None
            if fresh:
                failed = self._failed.get((device_index, spec))
                if failed is not None:
                    raise HipBuildError(*failed)
                try:
                    _, image = self.code_object(device_index, spec)
                    module = (self.toolchain.load(device_index, image), image)
                except Exception as exc:  # whatever the toolchain or the binding raised
                    error = self._build_error(exc, device_index, spec)
                    self._failed[(device_index, spec)] = (str(error), error.summary)
                    raise error from exc
                self._modules[(device_index, spec)] = module
            try:
                fn = self.toolchain.function(module[0], name)
            except Exception as exc:
                if not fresh:  # a kernel of this module may have launched in this op call
                    raise
                raise self._build_error(exc, device_index, spec, name) from exc
            k = Kernel(fn, name, device_index)
            self._kernels[(device_index, spec, name)] = k
            return k

    def _build_error(self, exc, device_index, spec, name=None) -> HipBuildError:
        what = f"{spec.kernel_file}" + (f" ({name})" if name else "")
        cause = getattr(exc, "summary", None) or (
            next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
            or type(exc).__name__
        )
        summary = cause if name is None else f"{cause} (looking up {name})"
        return HipBuildError(
            f"{self.toolchain.name}: cannot build {what} on device {device_index}: {exc}",
            summary=f"{self.toolchain.compiler_id()}: {summary}",
        )

    def launch(self, kernel: Kernel, grid, block: int, smem: int, args) -> None:
        self._launch(self.toolchain.launch, kernel, grid, block, smem, args)

    def amdgcn_wave_size(self, device_index: int) -> int | None:
        """The wave size the AMD branches of the kernels are built for (hiprtc), None on NVIDIA."""
        if self.toolchain.name == "nvrtc":
            return None
        return int(self.toolchain.target(device_index)[1])

    @property
    def caps_registers_by_blocks(self) -> bool:
        """Whether a kernel's minimum resident blocks per CU caps its registers (NVIDIA's launch
        bounds; HIP's second launch-bounds argument means something else and is not passed)."""
        return self.toolchain.name == "nvrtc"

    def launch_dependent(self, kernel: Kernel, grid, block: int, smem: int, args) -> None:
        """launch, but the kernel may start while the stream's previous kernel finishes (it calls
        wait_for_prior_grid before reading that kernel's outputs): NVIDIA's programmatic dependent
        launch; an ordinary launch elsewhere."""
        self._launch(self.toolchain.launch_dependent, kernel, grid, block, smem, args)

    def supports_clusters(self, device_index: int) -> bool:
        """Whether launch_cluster runs on the device (thread block clusters: NVIDIA sm_90+)."""
        return self.toolchain.supports_clusters(device_index)

    def launch_cluster(self, kernel: Kernel, grid, cluster: int, block: int, smem: int, args):
        """launch, with the grid's blocks in thread block clusters of ``cluster`` blocks along x
        (supports_clusters must hold)."""
        grid = _spec.grid3(grid)
        if min(grid) <= 0:
            return
        params = _spec.KernelParams(args)  # alive until the launch has read the arguments
        self.toolchain.launch_cluster(
            kernel.fn,
            grid,
            int(cluster),
            int(block),
            int(smem),
            kernel.device_index,
            params.address,
        )

    @staticmethod
    def _launch(toolchain_launch, kernel: Kernel, grid, block: int, smem: int, args) -> None:
        grid = _spec.grid3(grid)
        if min(grid) <= 0:
            return
        params = _spec.KernelParams(args)  # alive until the launch has read the arguments
        toolchain_launch(
            kernel.fn, grid, int(block), int(smem), kernel.device_index, params.address
        )

    def blocks_per_cu(self, kernel: Kernel, block: int, smem: int = 0) -> int | None:
        """Resident blocks of ``kernel`` per CU/SM (registers, LDS, waves), asked once per shape.

        Only a launch-size hint: None where the bindings lack the query or fail it (the launcher
        then assumes ``hip.fallback_blocks_per_cu``)."""
        key = (block, smem)
        if key not in kernel.occupancy:
            try:
                n = self.toolchain.blocks_per_cu(kernel.fn, block, smem, kernel.device_index)
                n = max(1, int(n))
            except (HipBackendError, AttributeError, TypeError):
                n = None
            kernel.occupancy[key] = n
        return kernel.occupancy[key]

    def num_cus(self, device_index: int) -> int:
        return int(torch.cuda.get_device_properties(device_index).multi_processor_count)

    def smem_budget(self, device_index: int) -> int:
        """Dynamic shared memory a block may use without opt-in attributes."""
        return 48 * 1024

    def dynamic_smem_budget(self, kernel: Kernel) -> int:
        """Dynamic shared memory a block of ``kernel`` may use without opt-in attributes: the
        budget less the kernel's static shared memory (a launch whose sum exceeds it fails). 0
        where the bindings cannot tell the static size."""
        if kernel.static_smem is None:
            try:
                kernel.static_smem = int(self.toolchain.static_smem(kernel.fn, kernel.device_index))
            except (HipBackendError, AttributeError, TypeError):
                kernel.static_smem = -1
        if kernel.static_smem < 0:
            return 0
        return max(0, self.smem_budget(kernel.device_index) - kernel.static_smem)


_RUNTIME: GpuRuntime | None = None
_RUNTIME_ERROR: Exception | None = None
_RUNTIME_LOCK = threading.Lock()


def make_toolchain() -> _Toolchain:
    if torch.version.hip is not None:
        return HiprtcToolchain()
    return NvrtcToolchain()


def get_runtime() -> GpuRuntime:
    """The process-wide runtime; raises ImportError (with the reason) when it cannot exist."""
    global _RUNTIME, _RUNTIME_ERROR
    if _RUNTIME is not None:
        return _RUNTIME
    with _RUNTIME_LOCK:
        if _RUNTIME is None:
            if _RUNTIME_ERROR is not None:
                raise _RUNTIME_ERROR
            try:
                _RUNTIME = GpuRuntime(make_toolchain())
            except ImportError as exc:
                _RUNTIME_ERROR = exc
                raise
    return _RUNTIME
