"""Build specification of the ``hip_src`` kernels: where the sources are, which modules exist,
their compile-time constants, compile flags and cache keys, and exact-width kernel arguments.

This module imports neither torch nor the GPU bindings, so ``setup.py`` (ahead-of-time builds)
and the CPU tests can use it.

Flags keep fp contraction off (``-ffp-contract=off`` for HIP, ``--fmad=false`` for NVRTC): the
QB histogram must be bit-identical between the router epilogue and the two-kernel histogram, which
recompute the sigmoid in different inlining contexts.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

CACHE_FORMAT = 1  # bump when the on-disk layout or the kernel ABI changes

_HERE = Path(__file__).resolve().parent
PACKAGED_SRC = _HERE.parent.parent / "_hip_src"  # amdqb/_hip_src (non-editable installs)
PREBUILT_DIR = _HERE.parent.parent / "_hip_prebuilt"  # setup.py AOT code objects (optional)
REPO_SRC = _HERE.parents[2] / "hip_src"  # <repo>/hip_src (editable / source tree)

# Router kernels: compile-time codes.
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
SCORE_CODES = {"sigmoid": 0, "sqrtsoftplus": 1, "softmax": 2}
ROUTER_WARPS = 8  # logical warps (tokens in flight) per 256-thread router block
ROUTER_BLOCK = 32 * ROUTER_WARPS
ROUTER_CAP = 64  # largest Top-n the router selects (n = k, or k + 1 under QB)
# Resident blocks per CU assumed where a runtime cannot answer the occupancy query.
FALLBACK_BLOCKS_PER_CU = 2
# Tile of the lds route kernel: ROUTE_BLOCK threads x ROUTE_ITEMS routes (AMDQB_ROUTE_BLOCK /
# AMDQB_ROUTE_ITEMS in route.hip). The kernel is latency-bound (ncu, H200, 256 x 5 at M=8192
# uniform: 2 warps per scheduler, one issue every 6.6 cycles, bench/results/h200_2026-11-30_s8/
# call1/ncu.txt): more threads per block keep more loads and reservations in flight and leave each
# thread fewer of the E reservations. H200, 2026-11-30, E=896 k=16 masked, graph replay
# (bench/tune_router_occupancy.py --parts route -> bench/results/h200_2026-11-30_s8/call2/
# tune.md), uniform at M = 8192 / 2517 / 512, then all-one-expert: 1024 x 2 4.23 / 3.70 / 3.52,
# 4.37 / 4.35 / 4.30 us; 512 x 2 4.92 / 3.85 / 3.37, 3.82 / 3.68 / 3.63; 512 x 3 4.61 / 3.85 /
# 3.51, 4.05 / 4.00 / 3.96; 256 x 5 (before) 5.01 / 4.15 / 3.88, 4.08 / 4.01 / 3.85; atomic 17.42
# / 8.94 / 5.78, 100.96 / 34.38 / 10.86. Larger tiles lose on one expert (LDS atomics on one
# address: 1024 x 4 5.72 us at M=8192). AMD targets build the same tile (16 wave64 / 32 wave32
# waves per workgroup); no AMD timing exists to tune it there.
ROUTE_ITEMS = 2
ROUTE_BLOCK = 1024
# 32-route chunks per deterministic tile (AMDQB_DET_ITEMS). H200, 2026-11-29 (tune align sweep,
# bench/results/h200_2026-11-29_s5/call1/tune.md, E=896 k=16 block 64, graph replay): align at
# items 16/32/64 = 11.33/11.76/13.49 us (M=2517), 14.04/12.48/13.60 us (M=8192); with the later
# rank-pass changes 11.0 / 11.6 us at 32 (call9, and the bench in call11).
DET_ITEMS = 32
DET_TILE = 32 * DET_ITEMS
SCAN_EXPERTS = 32  # experts per block of amdqb_route_det_scan (route.hip; 8 tile groups each)


def source_root() -> Path:
    """``amdqb/_hip_src`` when installed as a wheel, else ``<repo>/hip_src``."""
    for root in (PACKAGED_SRC, REPO_SRC):
        if (root / "include").is_dir() and (root / "kernels").is_dir():
            return root
    raise FileNotFoundError(
        f"hip_src not found: looked for {PACKAGED_SRC} (installed package) and {REPO_SRC} "
        "(source tree); reinstall amdqb or run from the repository"
    )


@dataclass(frozen=True)
class ModuleSpec:
    """One compiled module: a kernel file plus its compile-time constants."""

    kernel_file: str  # file name under hip_src/kernels
    defines: tuple[tuple[str, str], ...] = ()

    def with_defines(self, *defines: tuple[str, str]) -> "ModuleSpec":
        """The same module with more ``(name, value)`` compile-time constants (tests and tuning
        sweeps build variants this way)."""
        return ModuleSpec(self.kernel_file, self.defines + tuple(defines))

    def define_flags(self) -> list[str]:
        return [f"-D{name}={value}" for name, value in self.defines]

    def label(self) -> str:
        stem = self.kernel_file.rsplit(".", 1)[0]
        return "_".join([stem] + [f"{n.lower().replace('amdqb_', '')}{v}" for n, v in self.defines])


ROUTE_MODULE = ModuleSpec("route.hip")


def router_module(num_experts: int, dtype_name: str, score_function: str) -> ModuleSpec:
    return ModuleSpec(
        "router.hip",
        (
            ("AMDQB_NUM_EXPERTS", str(int(num_experts))),
            ("AMDQB_IN_DTYPE", str(DTYPE_CODES[dtype_name])),
            ("AMDQB_SCORE", str(SCORE_CODES[score_function])),
        ),
    )


def read_sources(spec: ModuleSpec, root: Path | None = None) -> tuple[str, dict[str, str]]:
    """(kernel source text, {relative path: sha256}) of the kernel file and every header."""
    root = root or source_root()
    kernel = root / "kernels" / spec.kernel_file
    text = kernel.read_text()
    digests = {f"kernels/{spec.kernel_file}": hashlib.sha256(text.encode()).hexdigest()}
    for header in sorted((root / "include").rglob("*")):
        if header.is_file():
            rel = header.relative_to(root).as_posix()
            digests[rel] = hashlib.sha256(header.read_bytes()).hexdigest()
    return text, digests


def hip_flags(arch: str, wave_size: int, spec: ModuleSpec) -> list[str]:
    """hiprtc / clang flags (no include path). ``arch`` may carry feature suffixes."""
    return [
        f"--offload-arch={arch}",
        "-O3",
        "-std=c++17",
        "-ffp-contract=off",
        f"-DAMDQB_WAVE_SIZE={int(wave_size)}",
        *spec.define_flags(),
    ]


def nvrtc_flags(arch: str, spec: ModuleSpec) -> list[str]:
    """NVRTC flags (no include path); ``arch`` is ``sm_XX`` (cubin) or ``compute_XX`` (PTX)."""
    return [
        f"--gpu-architecture={arch}",
        "--std=c++17",
        "--fmad=false",
        "-DAMDQB_WAVE_SIZE=32",
        *spec.define_flags(),
    ]


def cache_key(
    compiler_id: str, arch: str, wave_size: int, flags: list[str], sources: dict[str, str]
) -> str:
    """sha256 over everything that determines the code object."""
    material = {
        "format": CACHE_FORMAT,
        "compiler": compiler_id,
        "arch": arch,
        "wave": int(wave_size),
        "flags": list(flags),
        "sources": dict(sorted(sources.items())),
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def prebuilt_name(
    spec: ModuleSpec, base_arch: str, wave_size: int, root: Path | None = None
) -> str:
    """File name of an ahead-of-time code object (setup.py, AMDQB_ROCM_ARCHS): a hash of the
    sources, the base arch (any xnack/sramecc mode), the wave size and the flags -- the compiler
    is hipcc, not hiprtc, so its version is not part of it."""
    _, digests = read_sources(spec, root)
    material = {
        "format": CACHE_FORMAT,
        "arch": base_arch,
        "wave": int(wave_size),
        "flags": hip_flags(base_arch, wave_size, spec),
        "sources": dict(sorted(digests.items())),
    }
    key = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:32]
    return f"{spec.label()}-{base_arch}-{key}.hsaco"


def cache_dir() -> Path:
    """``AMDQB_CACHE_DIR`` or ``~/.cache/amdqb``."""
    env = os.environ.get("AMDQB_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "amdqb"


def rebuild_requested() -> bool:
    return os.environ.get("AMDQB_REBUILD", "0").strip().lower() not in ("", "0", "false", "no")


# ------------------------------------------------------------------------------------------------
# Kernel arguments: exact-width ctypes values (a Python int would be taken for a pointer, a float
# for a double) and the kernelParams array of their addresses.
# ------------------------------------------------------------------------------------------------
_I32 = (-(2**31), 2**31 - 1)
_I64 = (-(2**63), 2**63 - 1)


def grid3(grid) -> tuple[int, int, int]:
    """A launch grid given as ``n``, ``(x, y)`` or ``(x, y, z)`` as three extents."""
    if isinstance(grid, int):
        return (grid, 1, 1)
    if len(grid) == 2:
        return (grid[0], grid[1], 1)
    return tuple(grid)


def arg_i32(value: int) -> ctypes.c_int32:
    value = int(value)
    if not _I32[0] <= value <= _I32[1]:
        raise ValueError(f"kernel argument {value} does not fit int32")
    return ctypes.c_int32(value)


def arg_i64(value: int) -> ctypes.c_int64:
    value = int(value)
    if not _I64[0] <= value <= _I64[1]:
        raise ValueError(f"kernel argument {value} does not fit int64")
    return ctypes.c_int64(value)


def arg_f32(value: float) -> ctypes.c_float:
    return ctypes.c_float(float(value))


def arg_ptr(address: int | None) -> ctypes.c_void_p:
    """A device pointer (``tensor.data_ptr()``) or NULL."""
    return ctypes.c_void_p(int(address) if address else None)


class KernelParams:
    """``void*[n]`` whose entries point at the ctypes argument values; keeps them alive."""

    __slots__ = ("values", "array")

    def __init__(self, values):
        for v in values:
            if not isinstance(v, (ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p)):
                raise TypeError(f"kernel arguments must be exact-width ctypes values, got {v!r}")
        self.values = tuple(values)
        self.array = (ctypes.c_void_p * max(1, len(self.values)))(
            *[ctypes.addressof(v) for v in self.values]
        )

    @property
    def address(self) -> int:
        return ctypes.addressof(self.array)

    def __len__(self) -> int:
        return len(self.values)
