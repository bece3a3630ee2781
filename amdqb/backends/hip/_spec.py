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
import functools
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

try:
    from ..calls import SCORE_CODES
except ImportError:  # loaded from its file by setup.py (no package): calls.py, from its file too
    import importlib.util as _util
    import sys as _sys

    _calls = _util.spec_from_file_location("_amdqb_calls", _HERE.parent / "calls.py")
    _module = _sys.modules[_calls.name] = _util.module_from_spec(_calls)  # for the dataclasses
    _calls.loader.exec_module(_module)
    SCORE_CODES = _module.SCORE_CODES

# Router kernels: compile-time codes (the score codes are every backend's: amdqb.backends.calls).
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}


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

    def with_defines(self, *defines: tuple[str, str]) -> ModuleSpec:
        """The same module with ``(name, value)`` compile-time constants added or replaced
        (tests build variants this way)."""
        merged = dict(self.defines)
        merged.update((name, str(value)) for name, value in defines)
        return ModuleSpec(self.kernel_file, tuple(merged.items()))

    def define_flags(self) -> list[str]:
        return [f"-D{name}={value}" for name, value in self.defines]

    def label(self) -> str:
        """A readable name for files: the kernel file and its constants; past 160 characters
        (file names stop at 255 bytes with the suffixes callers add) cut, with a digest of the
        whole name."""
        stem = self.kernel_file.rsplit(".", 1)[0]
        full = "_".join([stem] + [f"{n.lower().replace('amdqb_', '')}{v}" for n, v in self.defines])
        if len(full) <= 160:
            return full
        return f"{full[:144]}_{hashlib.sha256(full.encode()).hexdigest()[:15]}"


# Compile-time constants of each module, from the architecture's config (``amdqb/configs``): the
# launchers read the same entries for their grid arithmetic, and a kernel file #errors when one
# of its constants is missing, so no value is written twice.
@functools.lru_cache(maxsize=1024)  # launchers ask per call; specs are immutable
def layout_module(cfg) -> ModuleSpec:
    """layout.hip: route rows and align."""
    return ModuleSpec(
        "layout.hip",
        (
            ("AMDQB_ROUTE_BLOCK", str(int(cfg["hip.route.lds_block"]))),
            ("AMDQB_ROUTE_ITEMS", str(int(cfg["hip.route.lds_items"]))),
            ("AMDQB_DET_ITEMS", str(int(cfg["hip.route.det_items"]))),
            ("AMDQB_SCAN_EXPERTS", str(int(cfg["hip.route.scan_experts"]))),
        ),
    )


def det_tile(cfg) -> int:
    """Routes per tile of the deterministic route / align passes (32-route chunks)."""
    return 32 * int(cfg["hip.route.det_items"])


def router_min_blocks(cfg, num_experts: int) -> int:
    """Resident blocks per SM the router's build must allow at ``num_experts`` (NVIDIA)."""
    for max_experts, blocks in cfg["hip.router.min_blocks"]:
        if num_experts <= max_experts:
            return int(blocks)
    return 1


@functools.lru_cache(maxsize=1024)  # launchers ask per call; specs are immutable
def router_module(
    num_experts: int,
    dtype_name: str,
    score_function: str,
    cfg,
    *,
    min_blocks: int | None = None,
    approximate: bool = False,
    tie_free: bool = False,
    margin_lds: bool = False,
    moments: bool = False,
    prefilter: bool = False,
) -> ModuleSpec:
    """router.hip for one expert count, logits dtype and score function. ``min_blocks`` replaces
    the config's register cap (the launcher's few-token build); ``approximate`` builds the opt-in
    approximate activation instead of torch's exact one; ``tie_free`` the tie-free selection
    (sigmoid: ranks by ``b - sigmoid(-z)``); ``margin_lds`` the build whose amdqb_router counts
    the fused log_margin histogram in LDS (a build of its own: the other builds keep the
    registers they had without it); ``moments`` the build whose log_margin histogram is int64
    ``[3, E, B]`` with the in-bin moments (both QB modes); ``prefilter`` the build whose
    amdqb_router selects through the bounded approximate sigmoid first (the exact sigmoid's
    outputs; not with ``approximate``, ``tie_free``, ``margin_lds`` or another score)."""
    if prefilter and (score_function != "sigmoid" or approximate or tie_free or margin_lds):
        raise ValueError("the prefilter build is the exact sigmoid router's")
    blocks = router_min_blocks(cfg, num_experts) if min_blocks is None else min_blocks
    return ModuleSpec(
        "router.hip",
        (
            ("AMDQB_NUM_EXPERTS", str(int(num_experts))),
            ("AMDQB_IN_DTYPE", str(DTYPE_CODES[dtype_name])),
            ("AMDQB_SCORE", str(SCORE_CODES[score_function])),
            ("AMDQB_APPROX_ACTIVATION", "1" if approximate else "0"),
            ("AMDQB_TIE_FREE", "1" if tie_free else "0"),
            ("AMDQB_MARGIN_LDS", "1" if margin_lds else "0"),
            ("AMDQB_MOMENTS", "1" if moments else "0"),
            ("AMDQB_PREFILTER", "1" if prefilter else "0"),
            ("AMDQB_ROUTER_WARPS", str(int(cfg["hip.router.warps"]))),
            ("AMDQB_ROUTER_CAP", str(int(cfg["hip.router.cap"]))),
            ("AMDQB_ROUTER_MIN_BLOCKS", str(int(blocks))),
            ("AMDQB_DECODE_EPW", str(int(cfg["hip.router.decode_epw"]))),
            ("AMDQB_QB_HIST_BLOCK", str(int(cfg["hip.qb_hist.block"]))),
            ("AMDQB_QB_HIST_UNROLL", str(int(cfg["hip.qb_hist.unroll"]))),
            ("AMDQB_QB_HIST_MIN_BLOCKS", str(int(cfg["hip.qb_hist.min_blocks"]))),
        ),
    )


@functools.lru_cache(maxsize=1024)  # launchers ask per call; specs are immutable
def router_bwd_module(
    num_experts: int, dtype_name: str, grad_dtype_name: str, score_function: str
) -> ModuleSpec:
    """router_bwd.hip for one expert count, logits / grad dtype and score function (rows of
    min(32, next_pow2(E)) lanes)."""
    lanes = 1
    while lanes < min(32, num_experts):
        lanes *= 2
    return ModuleSpec(
        "router_bwd.hip",
        (
            ("AMDQB_NUM_EXPERTS", str(int(num_experts))),
            ("AMDQB_IN_DTYPE", str(DTYPE_CODES[dtype_name])),
            ("AMDQB_GRAD_DTYPE", str(DTYPE_CODES[grad_dtype_name])),
            ("AMDQB_SCORE", str(SCORE_CODES[score_function])),
            ("AMDQB_APPROX_ACTIVATION", "0"),
            ("AMDQB_ROW_LANES", str(lanes)),
            ("AMDQB_SLOTS", str(-(-int(num_experts) // lanes))),
        ),
    )


@functools.lru_cache(maxsize=1024)  # launchers ask per call; specs are immutable
def topk_module(
    plan,
    dtype_name: str,
    bias_dtype_name: str | None,
    score_function: str,
    cfg,
    approximate: bool = False,
    dense: bool = False,
    input_dtype_math: bool = False,
) -> ModuleSpec:
    """topk.hip for one row plan (amdqb.backends.hip.topk.TopkPlan), logits / bias dtype and
    score function; ``dense``: the TransformerEngine router's outputs over every expert."""
    return ModuleSpec(
        "topk.hip",
        (
            ("AMDQB_NUM_EXPERTS", str(int(plan.num_experts))),
            ("AMDQB_IN_DTYPE", str(DTYPE_CODES[dtype_name])),
            (
                "AMDQB_BIAS_DTYPE",
                str(-1 if bias_dtype_name is None else DTYPE_CODES[bias_dtype_name]),
            ),
            ("AMDQB_SCORE", str(SCORE_CODES[score_function])),
            ("AMDQB_APPROX_ACTIVATION", "1" if approximate else "0"),
            ("AMDQB_TOPK", str(int(plan.topk))),
            ("AMDQB_ROW_LANES", str(int(plan.lanes))),
            ("AMDQB_SLOTS", str(int(plan.slots))),
            ("AMDQB_CONTIGUOUS", "1" if plan.contiguous else "0"),
            ("AMDQB_ROW_ROUNDS", "1" if plan.rounds else "0"),
            ("AMDQB_GROUPS", str(int(plan.groups))),
            ("AMDQB_GROUP_LANES", str(int(plan.group_lanes))),
            ("AMDQB_TOPK_GROUP", str(int(plan.topk_group))),
            ("AMDQB_GROUP_BEST", str(int(plan.group_best))),
            ("AMDQB_DENSE", "1" if dense else "0"),
            ("AMDQB_IN_DTYPE_MATH", "1" if input_dtype_math else "0"),
            ("AMDQB_TOPK_BLOCK", str(int(cfg["hip.topk.block"]))),
            (
                "AMDQB_KEY_SELECT",
                "1" if plan.num_experts >= int(cfg["hip.topk.key_select_min_experts"]) else "0",
            ),
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
        *(["-gline-tables-only"] if line_info_requested() else []),
    ]


def nvrtc_flags(arch: str, spec: ModuleSpec) -> list[str]:
    """NVRTC flags (no include path); ``arch`` is ``sm_XX`` (cubin) or ``compute_XX`` (PTX)."""
    return [
        f"--gpu-architecture={arch}",
        "--std=c++17",
        "--fmad=false",
        "-DAMDQB_WAVE_SIZE=32",
        *spec.define_flags(),
        *(["-lineinfo"] if line_info_requested() else []),
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


def _env_flag(name: str) -> bool:
    """An on/off environment switch: unset, empty, 0, false or no is off."""
    return os.environ.get(name, "0").strip().lower() not in ("", "0", "false", "no")


def line_info_requested() -> bool:
    """``AMDQB_LINEINFO=1``: source-line tables in the code objects (for a profiler's source view;
    the flag is part of the cache key)."""
    return _env_flag("AMDQB_LINEINFO")


def rebuild_requested() -> bool:
    return _env_flag("AMDQB_REBUILD")


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


class RouterParams(ctypes.Structure):
    """The by-value parameter of ``amdqb_router`` / ``amdqb_router_decode``: field for field
    ``amdqb::RouterParams`` of ``hip_src/include/amdqb_router_params.h`` (natural alignment, as
    the host and both GPU ABIs lay it out; op_tests/test_router_abi.py checks the offsets)."""

    _fields_ = [
        ("logits", ctypes.c_void_p),
        ("num_tokens", ctypes.c_int32),
        ("bias", ctypes.c_void_p),
        ("topk", ctypes.c_int32),
        ("nsel", ctypes.c_int32),
        ("normalize", ctypes.c_int32),
        ("softmax_pre", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("probs", ctypes.c_void_p),
        ("map", ctypes.c_void_p),
        ("map_kind", ctypes.c_int32),
        ("qb_mode", ctypes.c_int32),
        ("hist", ctypes.c_void_p),
        ("bounds", ctypes.c_void_p),
        ("num_bins", ctypes.c_int32),
        ("alpha_out", ctypes.c_void_p),
        ("w_out", ctypes.c_void_p),
        ("id_out", ctypes.c_void_p),
        ("qb_binning", ctypes.c_int32),
        ("margin_fine", ctypes.c_int32),
        ("bins_out", ctypes.c_void_p),
    ]

    @classmethod
    def of(cls, **values) -> RouterParams:
        """Every field given (addresses as ints or None, ints range-checked as arg_i32 does)."""
        names = [name for name, _ in cls._fields_]
        if sorted(values) != sorted(names):
            missing, extra = set(names) - set(values), set(values) - set(names)
            raise TypeError(
                f"RouterParams fields missing {sorted(missing)}, unknown {sorted(extra)}"
            )
        out = cls()
        for name, ctype in cls._fields_:
            value = values[name]
            if ctype is ctypes.c_int32:
                value = arg_i32(value).value
            elif ctype is ctypes.c_float:
                value = float(value)
            else:
                value = int(value) if value else None
            setattr(out, name, value)
        return out


# Exact-width scalars and by-value structures (RouterParams here, TopkParams and AlignParams beside
# their launchers) a kernel parameter may be.
_ARG_TYPES = (ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.Structure)


class KernelParams:
    """``void*[n]`` whose entries point at the ctypes argument values (scalars or by-value
    structures); keeps them alive."""

    __slots__ = ("values", "array")

    def __init__(self, values):
        for v in values:
            if not isinstance(v, _ARG_TYPES):
                raise TypeError(
                    "kernel arguments must be exact-width ctypes values or a by-value parameter "
                    f"structure, got {v!r}"
                )
        self.values = tuple(values)
        self.array = (ctypes.c_void_p * max(1, len(self.values)))(
            *[ctypes.addressof(v) for v in self.values]
        )

    @property
    def address(self) -> int:
        return ctypes.addressof(self.array)

    def __len__(self) -> int:
        return len(self.values)
