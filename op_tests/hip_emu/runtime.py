"""A runtime for the hip backend's launchers that executes the hip_src kernels on the CPU.

The kernels are compiled with g++ against ``amdqb_emu.h`` (one fiber per GPU thread on the
calling thread, barrier-synchronised lane exchanges, poisoned per-block shared memory) and launched
with the same ``kernelParams`` array the GPU runtimes pass to cuLaunchKernel /
hipModuleLaunchKernel, so the Python launchers, their argument packing and the kernel bodies are
all exercised. Tensors are CPU tensors; ``data_ptr()`` is a host address.

Two lane models (``amdqb_emu.h``): the prelude's emulator substitutes (``arch=None``: 32-lane
logical warps on waves of ``wave_size``), or ``arch="gfx942"`` / ``"gfx1250"`` / ... (one of
:data:`GCN_TARGETS`): the prelude's AMD branches, compiled as for that target (its generation
macros), on the emulator's model of the AMDGCN cross-lane builtins with waves of the target's size.
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
from amdqb._arch import amd_wave_size, gfx_major
from amdqb.backends.hip import _spec

HERE = Path(__file__).resolve().parent
_BUILD_LOCK = threading.Lock()


# Targets whose AMD branches the AMDGCN model runs: wave64 gfx9 (its DPP row broadcasts and wave
# shifts) and wave32 gfx12 (row_share / row_xmask, permlanex16); the same macros as clang's.
GCN_TARGETS = ("gfx942", "gfx950", "gfx1100", "gfx1201", "gfx1250")


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def target_defines(arch: str) -> list[str]:
    """The predefined macros of ``arch`` the prelude reads (``__GFX9__`` and ``__gfx942__``)."""
    if arch not in GCN_TARGETS:
        raise ValueError(f"the AMDGCN model emulates {', '.join(GCN_TARGETS)}, not {arch!r}")
    return [f"-D__GFX{gfx_major(arch)}__=1", f"-D__{arch}__=1"]


# libraries (by handle) whose fiber stacks are kept, least recently launched first
_RECENT_STACKS: collections.OrderedDict[int, ctypes.CDLL] = collections.OrderedDict()
_LIVE_STACKS = 8


class EmuKernel:
    def __init__(self, fn, name, lib):
        self.fn = fn
        self.name = name
        self.lib = lib


def _trim_idle_stacks(lib):
    """Every emulator library keeps the stacks of its largest launch's fibers (512 KiB of address
    space each, the pages a kernel touched resident); a test process loads hundreds of libraries
    (one per kernel variant), so only the most recently launched ``_LIVE_STACKS`` keep theirs.
    Returns ``lib``."""
    live = _RECENT_STACKS
    live.pop(lib._handle, None)
    live[lib._handle] = lib
    while len(live) > _LIVE_STACKS:
        _, old = live.popitem(last=False)
        old.amdqb_emu_trim(0)
    return lib


def _run(lib, name: str, rc: int) -> None:
    """A launcher's return code: 1 when the emulator refused the launch (a cluster that does not
    divide the grid) or could not map its fibers' stacks."""
    if rc != 0:
        fn = lib.amdqb_emu_last_error
        fn.restype = ctypes.c_char_p
        raise RuntimeError(f"emulator launch of {name} failed: {fn().decode(errors='replace')}")


class EmuRuntime:
    def __init__(
        self,
        wave_size: int = 32,
        cus: int = 2,
        smem_budget: int = 48 * 1024,
        arch: str | None = None,
        fiber_switch: str = "native",
    ):
        if fiber_switch not in ("native", "ucontext"):
            raise ValueError(f"fiber_switch must be 'native' or 'ucontext', got {fiber_switch!r}")
        if arch is not None:
            target_defines(arch)  # one of GCN_TARGETS
            wave_size = amd_wave_size(arch)
        self.arch = arch  # None: the prelude's emulator substitutes; else the AMDGCN model
        # "native": amdqb_emu_runtime.h's own register switch on x86-64 (ucontext elsewhere);
        # "ucontext": ucontext everywhere, the fallback run on this host
        self.fiber_switch = fiber_switch
        self.wave_size = wave_size
        self.cus = cus
        self.budget = smem_budget
        self.build_dir = (
            Path(os.environ.get("AMDQB_EMU_BUILD", tempfile.gettempdir())) / "amdqb_emu"
        )
        self._libs = {}
        self.launches = []  # (kernel name, grid, block, smem) of every launch
        self.dependent_launches = []  # names of the kernels launched with launch_dependent
        self.cluster_launches = []  # (kernel name, blocks per cluster) of launch_cluster

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
        if self.arch is not None:
            flags += ["-DAMDQB_EMU_AMDGCN=1", *target_defines(self.arch)]
        if self.fiber_switch == "ucontext":
            flags.append("-DAMDQB_EMU_UCONTEXT=1")
        material = repr((flags[:7], flags[10:], sorted(digests.items())))
        for name in ("amdqb_emu.h", "amdqb_emu_runtime.h", "emu_kernels.cpp"):
            material += hashlib.sha256((HERE / name).read_bytes()).hexdigest()
        key = hashlib.sha256(material.encode()).hexdigest()[:24]
        mode = (self.arch or f"w{self.wave_size}") + (
            "_uc" if self.fiber_switch == "ucontext" else ""
        )
        out = self.build_dir / f"{spec.label()}_{which[10:].lower()}_{mode}_{key}.so"
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

    def lane_ops(self):
        """ctypes library of the AMDGCN model's builtins one at a time (``amdqb_emu_lane_op``)."""
        if self.arch is None:
            raise ValueError("the lane ops need the AMDGCN model (arch=...)")
        return _trim_idle_stacks(
            self._library(_spec.layout_module(configs.load("cpu")), "AMDQB_EMU_LANES")
        )

    def warp_ops(self):
        """ctypes library of the prelude's Warp<W> primitives one at a time (``amdqb_emu_warp_op``)."""
        return _trim_idle_stacks(
            self._library(_spec.layout_module(configs.load("cpu")), "AMDQB_EMU_PRIMS")
        )

    def kernel(self, device_index, spec, name):
        lib = self._library(spec)
        fn = getattr(lib, f"amdqb_emu_launch_{name}")
        fn.argtypes = [ctypes.c_uint] * 4 + [ctypes.c_ulonglong, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        return EmuKernel(fn, name, lib)

    def launch(self, kernel, grid, block, smem, args):
        grid = _spec.grid3(grid)
        if min(grid) <= 0:
            return
        assert block % 32 == 0 and block % self.wave_size == 0 or block == 32, block
        assert smem <= self.budget, (kernel.name, smem)
        params = _spec.KernelParams(args)
        self.launches.append((kernel.name, tuple(grid), block, smem))
        _run(
            kernel.lib,
            kernel.name,
            kernel.fn(grid[0], grid[1], grid[2], block, smem, params.address),
        )
        _trim_idle_stacks(kernel.lib)

    def launch_dependent(self, kernel, grid, block, smem, args):
        """No overlap to model: the emulator runs grids one after another."""
        self.launch(kernel, grid, block, smem, args)
        self.dependent_launches.append(kernel.name)

    def supports_clusters(self, device_index):
        return True

    def launch_cluster(self, kernel, grid, cluster, block, smem, args):
        """The blocks of each cluster run together (their threads at once)."""
        if min(_spec.grid3(grid)) <= 0:
            return
        assert _spec.grid3(grid)[0] % cluster == 0 and 1 <= cluster <= 8, (grid, cluster)
        kernel.lib.amdqb_emu_set_cluster(ctypes.c_uint(cluster))  # the next launch's, then 1
        self.launch(kernel, grid, block, smem, args)
        self.cluster_launches.append((kernel.name, cluster))

    def amdgcn_wave_size(self, device_index):
        """The AMDGCN model's wave size; None with the prelude's substitutes (32-lane rows)."""
        return None if self.arch is None else self.wave_size

    def num_cus(self, device_index):
        return self.cus

    def smem_budget(self, device_index):
        return self.budget

    def dynamic_smem_budget(self, kernel):
        """The emulator's static shared memory comes from its own heap: all of the budget."""
        return self.budget
