"""A runtime for ``amdqb.backends.hip._ops`` that executes the hip_src kernels on the CPU.

The kernels are compiled with g++ against ``amdqb_emu.h`` (one std::thread per GPU thread,
barrier-synchronised 32-lane warp exchanges, poisoned per-block shared memory) and launched with
the same ``kernelParams`` array the GPU runtimes pass to cuLaunchKernel / hipModuleLaunchKernel, so
the Python launchers, their argument packing and the kernel bodies are all exercised. Tensors are
CPU tensors; ``data_ptr()`` is a host address.
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from amdqb import configs
from amdqb.backends.hip import _spec

HERE = Path(__file__).resolve().parent
_BUILD_LOCK = threading.Lock()


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


# libraries (by id) whose idle block threads are kept, least recently launched first
_RECENT_POOLS: collections.OrderedDict[int, ctypes.CDLL] = collections.OrderedDict()
_LIVE_POOLS = 8


class EmuKernel:
    def __init__(self, fn, name):
        self.fn = fn
        self.name = name


class EmuRuntime:
    def __init__(self, wave_size: int = 32, cus: int = 2, smem_budget: int = 48 * 1024):
        self.wave_size = wave_size
        self.cus = cus
        self.budget = smem_budget
        self.build_dir = (
            Path(os.environ.get("AMDQB_EMU_BUILD", tempfile.gettempdir())) / "amdqb_emu"
        )
        self._libs = {}
        self.launches = []  # (kernel name, grid, block, smem) of every launch
        self.dependent_launches = []  # names of the kernels launched with launch_dependent

    def _library(self, spec: _spec.ModuleSpec, which: str | None = None):
        if which is None:
            which = {
                "router.hip": "AMDQB_EMU_ROUTER",
                "router_bwd.hip": "AMDQB_EMU_ROUTER_BWD",
                "topk.hip": "AMDQB_EMU_TOPK",
                "layout.hip": "AMDQB_EMU_ROUTE",
            }[spec.kernel_file]
        lib = self._libs.get((spec, which))
        if lib is not None:
            return lib
        root = _spec.source_root()
        _, digests = _spec.read_sources(spec, root)
        flags = [
            "-std=c++20",
            "-O1",
            "-fPIC",
            "-shared",
            "-pthread",
            "-Wall",
            "-Wno-unknown-pragmas",
            f"-I{root / 'include'}",
            f"-I{root / 'kernels'}",
            f"-I{HERE}",
            f"-DAMDQB_WAVE_SIZE={self.wave_size}",
            f"-D{which}",
            *spec.define_flags(),
        ]
        material = repr((flags[:7], flags[10:], sorted(digests.items())))
        for name in ("amdqb_emu.h", "emu_kernels.cpp"):
            material += hashlib.sha256((HERE / name).read_bytes()).hexdigest()
        key = hashlib.sha256(material.encode()).hexdigest()[:24]
        out = self.build_dir / f"{spec.label()}_{which[10:].lower()}_w{self.wave_size}_{key}.so"
        with _BUILD_LOCK:
            if not out.is_file():
                out.parent.mkdir(parents=True, exist_ok=True)
                tmp = out.with_suffix(f".{os.getpid()}.tmp")
                cmd = [compiler(), *flags, "-o", str(tmp), str(HERE / "emu_kernels.cpp")]
                res = subprocess.run(cmd, capture_output=True, text=True)
                if res.returncode != 0:
                    raise RuntimeError(f"emulator build failed: {' '.join(cmd)}\n{res.stderr}")
                os.replace(tmp, out)
            lib = ctypes.CDLL(str(out))
        self._libs[(spec, which)] = lib
        return lib

    def converter(self):
        """ctypes library exposing the prelude's conversions and order key (no kernels)."""
        return self._library(_spec.layout_module(configs.load("cpu")), "AMDQB_EMU_CONVERT")

    def kernel(self, device_index, spec, name):
        lib = self._library(spec)
        fn = getattr(lib, f"amdqb_emu_launch_{name}")
        fn.argtypes = [ctypes.c_uint] * 4 + [ctypes.c_ulonglong, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        kernel = EmuKernel(fn, name)
        kernel.library = lib
        return kernel

    def _trim_idle_pools(self, lib) -> None:
        """Every emulator library keeps a pool of idle block threads; hundreds of libraries (one
        per kernel variant) in one test process exhausted the system's threads (the thread
        creation failed: std::terminate). Only the most recently launched
        ``_LIVE_POOLS`` libraries keep theirs."""
        live = _RECENT_POOLS
        live.pop(id(lib), None)
        live[id(lib)] = lib
        while len(live) > _LIVE_POOLS:
            _, old = live.popitem(last=False)
            old.amdqb_emu_trim(0)

    def launch(self, kernel, grid, block, smem, args):
        grid = _spec.grid3(grid)
        if min(grid) <= 0:
            return
        assert block % 32 == 0 and block % self.wave_size == 0 or block == 32, block
        assert smem <= self.budget, (kernel.name, smem)
        params = _spec.KernelParams(args)
        self.launches.append((kernel.name, tuple(grid), block, smem))
        kernel.fn(grid[0], grid[1], grid[2], block, smem, params.address)
        if getattr(kernel, "library", None) is not None:
            self._trim_idle_pools(kernel.library)

    def launch_dependent(self, kernel, grid, block, smem, args):
        """No overlap to model: the emulator runs grids one after another."""
        self.launch(kernel, grid, block, smem, args)
        self.dependent_launches.append(kernel.name)

    def num_cus(self, device_index):
        return self.cus

    def smem_budget(self, device_index):
        return self.budget
