"""Offline AMD builds of the ``hip_src`` kernels, and what their code objects say.

Builds every kernel module the runtime can request at the seed shapes (:func:`module_variants`)
into linked ELF code objects (``.hsaco``) with Debian's clang and lld: clang 22 for gfx942 and
gfx950 (wave64), gfx1100, gfx1201 and gfx1250 (wave32); clang 19 for gfx942, gfx1100 and gfx1201
(it knows neither gfx950 nor gfx1250). The flags are the runtime's (``_spec.hip_flags``), so a code
object here is what hiprtc builds on a device from the same sources, up to the compiler version.
Then reads each code object: the AMDGPU metadata note (``llvm-readelf --notes``), its symbols, its
disassembly (``llvm-objdump -d``) and the ``; Kernel info`` comments of the assembly listing the
same compile wrote, and derives occupancy (waves per SIMD) from the register and LDS counts with
LLVM's AMDGPU rules (:data:`RULES`). Nothing here runs a kernel.

Toolchain facts this relies on (Debian 12, measured):

* clang 22 no longer predefines ``__AMDGCN_WAVEFRONT_SIZE``, which the HIP 5.2 headers use; it is
  defined from the target's real wave size, derived from the arch (:func:`wave_size`: gfx9 is
  wave64 and ignores ``-mno-wavefrontsize64``; gfx1250 is wave32 only; gfx10-12 run wave32 as the
  runtime uses them), never from ``AMDQB_WAVE_SIZE``, so the prelude's mismatch check still fires.
* Debian's rocm-device-libs (ROCm 5.2 bitcode: ocml, ockl and the oclc control files) lacks the
  ISA-version files of these targets and the ABI-version file of code object v6 (clang 22's
  default). :func:`device_lib_dir` builds a directory for ``--rocm-device-lib-path`` holding links
  to Debian's bitcode plus the missing constant files, assembled from two-line LLVM IR with the
  toolchain's ``llvm-as`` (nothing binary is committed). ocml supplies the math the precision
  contract needs that clang's headers do not lower to builtins (``log1pf``; ``expf`` and ``sqrtf``
  are LLVM intrinsics with clang 22's headers, as with the clang of a current ROCm).
* ``-c --cuda-device-only --no-gpu-bundle-output`` compiles and links with lld into a plain code
  object; ``-save-temps`` also leaves the assembly listing, from which that object is assembled.
  clang 19 finds no lld of its own version on Debian; lld 22 links for it (``-B`` to a directory
  holding an ``lld`` link).

Builds are cached under ``<_spec.cache_dir()>/offline`` (``AMDQB_CACHE_DIR``): the device-library
directory per toolchain, and each code object keyed by the sha256 of the sources, the flags, the
compiler and linker versions and the device-library directory. Within one process a build is made
once (:func:`build_all` memoises).

Precision and tie-break contract: none of its own; the kernels' contract (``amdqb.backends.hip``)
holds for what is built here because the flags are the runtime's (fp contraction off).

CLI::

    python -m amdqb.backends.hip._offline build [--toolchain clang-22] [--arch gfx942] [-j N]
    python -m amdqb.backends.hip._offline inspect FILE.hsaco [--json]
    python -m amdqb.backends.hip._offline table [--write docs/amd_occupancy.md | --check ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from . import _spec

OFFLINE_FORMAT = 1  # bump when the cache layout, the generated bitcode or the parsing changes
INSPECT_FORMAT = 2  # bump when the reading of a code object changes (2: long branches are no calls)

# Targets and the clang major versions that know them.
AMD_ARCHS = ("gfx942", "gfx950", "gfx1100", "gfx1201", "gfx1250")
_ARCHS_BY_MAJOR = {22: AMD_ARCHS, 19: ("gfx942", "gfx1100", "gfx1201")}
TOOLCHAIN_MAJORS = (22, 19)

# Kernels of each module (a build lacking one fails the checks).
ROUTE_KERNELS = frozenset(
    {
        f"amdqb_route_{k}_{t}"
        for k in ("atomic", "lds", "det_hist", "det_rank", "compact")
        for t in ("i32", "i64")
    }
    | {"amdqb_route_det_scan", "amdqb_route_finalize"}
    | {"amdqb_align_hist", "amdqb_align"}
)
TOPK_KERNELS = frozenset({"amdqb_topk"})
ROUTER_BWD_KERNELS = frozenset({"amdqb_router_bwd"})
ROUTER_KERNELS = frozenset(
    {
        "amdqb_router",
        "amdqb_qb_hist",
        "amdqb_qb_hist_bins",
        "amdqb_router_decode",
        "amdqb_router_scores",
    }
)


def arch_config(arch: str):
    """The runtime's config of ``arch`` (``amdqb/configs``, by its architecture family)."""
    from ... import configs
    from ...devices import amd_arch_family

    return configs.load(amd_arch_family(arch.split(":")[0]))


def _variants(arch: str = "gfx942") -> list[tuple[str, _spec.ModuleSpec]]:
    cfg = arch_config(arch)
    e = 896  # seeds 000 / 004: 896 routed experts, top-16
    routers = [
        (e, "float32", "sigmoid", {}),
        (e, "bfloat16", "sigmoid", {}),
        (e, "float16", "sigmoid", {}),
        (e, "float32", "sqrtsoftplus", {}),
        (e, "float32", "softmax", {}),
        (e, "float32", "sigmoid", {"tie_free": True}),
        (e, "float32", "sigmoid", {"approximate": True}),
        (129, "float16", "sqrtsoftplus", {}),
        (17, "float32", "softmax", {}),
        (2048, "bfloat16", "sigmoid", {}),
    ]
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    # the serving top-k at the peers' shapes: Mixtral, Qwen3-MoE, DeepSeek-V3 (grouped, bias),
    # Kimi-K2 (bias)
    from .topk import plan as topk_plan

    # (and the rows of few lanes amdqb_topk takes from hip.topk.wide_min_tokens tokens on)
    wide = 1 << 20
    topks = [
        (8, 2, "float32", "softmax", None, None, None, None),
        (8, 2, "float32", "softmax", None, None, None, wide),
        (128, 8, "bfloat16", "softmax", None, None, None, None),
        (128, 8, "bfloat16", "softmax", None, None, None, wide),
        (256, 8, "float32", "sigmoid", "float32", 8, 4, None),
        (384, 8, "float32", "sigmoid", "bfloat16", None, None, None),
    ]
    return (
        [("layout", _spec.layout_module(cfg))]
        + [
            (
                " ".join([f"router E={n} {short[dt]} {sf}", *opts]),
                _spec.router_module(n, dt, sf, cfg, **opts),
            )
            for n, dt, sf, opts in routers
        ]
        + [
            (
                f"topk E={n} k={k} {short[dt]} {sf}"
                + (f" bias {short[bdt]}" if bdt else "")
                + (f" groups {g}/{tg}" if g else "")
                + (" wide rows" if t else ""),
                _spec.topk_module(topk_plan(n, k, sf, g, tg, cfg, tokens=t), dt, bdt, sf, cfg),
            )
            for n, k, dt, sf, bdt, g, tg, t in topks
        ]
        + [
            (
                f"router_bwd E={n} {short[dt]} {sf}",
                _spec.router_bwd_module(n, dt, dt, sf),
            )
            for n, dt, sf in ((e, "float32", "sigmoid"), (256, "bfloat16", "softmax"))
        ]
    )


def module_variants(arch: str = "gfx942") -> list[_spec.ModuleSpec]:
    """Every module the runtime can request at the seed shapes on ``arch`` (its config's
    constants), plus the shapes the compile tests cover: the layout module; the router at E=896 in
    fp32 / bf16 / fp16 with sigmoid, with sqrtsoftplus and softmax, with the tie-free selection and
    with the approximate activation; small odd E (129 fp16 sqrtsoftplus, 17 fp32 softmax) and
    E=2048 bf16 sigmoid. The one place that lists them (:func:`_variants`)."""
    return [spec for _, spec in _variants(arch)]


def expected_kernels(spec: _spec.ModuleSpec) -> frozenset:
    return {
        "layout.hip": ROUTE_KERNELS,
        "topk.hip": TOPK_KERNELS,
        "router_bwd.hip": ROUTER_BWD_KERNELS,
    }.get(spec.kernel_file, ROUTER_KERNELS)


def wave_size(arch: str) -> int:
    """The wave size the runtime uses on ``arch`` (feature suffixes allowed): gfx9 (CDNA) is
    wave64 only; gfx10, gfx11 and gfx12 run wave32 (their default; gfx1250 has no wave64)."""
    base = arch.split(":")[0]
    m = re.fullmatch(r"gfx(\d+)[0-9a-f]{2}", base)
    if not m:
        raise ValueError(f"arch must look like gfx942 / gfx1100, got {arch!r}")
    major = int(m.group(1))
    if major == 9:
        return 64
    if major in (10, 11, 12):
        return 32
    raise ValueError(f"arch {arch!r}: no wave size known for gfx{major}")


def isa_version(arch: str) -> tuple[str, int]:
    """(file suffix, ``__oclc_ISA_version``) of ``arch``: gfx942 -> ("942", 9402); the value is
    major * 1000 + minor * 100 + stepping, as in the device libraries' own files."""
    base = arch.split(":")[0]
    m = re.fullmatch(r"gfx(\d+)([0-9a-f])([0-9a-f])", base)
    if not m:
        raise ValueError(f"arch must look like gfx942 / gfx1100, got {arch!r}")
    major, minor, step = int(m.group(1)), int(m.group(2), 16), int(m.group(3), 16)
    return base[3:], major * 1000 + minor * 100 + step


# ------------------------------------------------------------------------------------------------
# Toolchains
# ------------------------------------------------------------------------------------------------
def _run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=False, capture_output=True, text=True, **kw)


def _first_line(cmd) -> str:
    try:
        out = _run([*cmd, "--version"])
    except OSError:
        return ""
    text = (out.stdout or out.stderr).strip()
    return text.splitlines()[0] if text else ""


@dataclass(frozen=True)
class Toolchain:
    """One clang with the tools of its version (lld may be a newer one)."""

    name: str  # "clang-22"
    major: int
    clang: str
    llvm_as: str
    lld: str
    version: str  # clang --version, first line
    lld_version: str

    @property
    def archs(self) -> tuple[str, ...]:
        return _ARCHS_BY_MAJOR.get(self.major, ())

    @property
    def ident(self) -> str:
        return f"{self.version} | {self.lld_version}"


def _which(name: str) -> str | None:
    return shutil.which(name)


@dataclass
class _Memo:
    lock: threading.Lock = field(default_factory=threading.Lock)
    toolchains: dict = field(default_factory=dict)
    predef: dict = field(default_factory=dict)
    devlibs: dict = field(default_factory=dict)
    builds: dict = field(default_factory=dict)
    objects: dict = field(default_factory=dict)


_MEMO = _Memo()


def toolchain(major: int) -> Toolchain | None:
    """clang++-<major>, llvm-as-<major> and an lld (of that version, else the newest), or None."""
    with _MEMO.lock:
        if major in _MEMO.toolchains:
            return _MEMO.toolchains[major]
    clang, llvm_as = _which(f"clang++-{major}"), _which(f"llvm-as-{major}")
    lld = _which(f"lld-{major}") or next(
        (p for p in (_which(f"lld-{m}") for m in TOOLCHAIN_MAJORS) if p), None
    )
    tc = None
    if clang and llvm_as and lld:
        version = _first_line([clang])
        if f"version {major}." in version:
            lld_version = _first_line([lld, "-flavor", "gnu"])
            tc = Toolchain(f"clang-{major}", major, clang, llvm_as, lld, version, lld_version)
    with _MEMO.lock:
        _MEMO.toolchains[major] = tc
    return tc


def toolchains() -> list[Toolchain]:
    """The toolchains installed here, newest first (``AMDQB_OFFLINE_TOOLCHAINS=22,19`` limits)."""
    wanted = os.environ.get("AMDQB_OFFLINE_TOOLCHAINS", "")
    majors = [int(m) for m in re.findall(r"\d+", wanted)] or list(TOOLCHAIN_MAJORS)
    return [tc for tc in (toolchain(m) for m in majors if m in _ARCHS_BY_MAJOR) if tc]


def missing_toolchains() -> list[str]:
    """Why a toolchain of :data:`TOOLCHAIN_MAJORS` is not usable here (for skip reasons)."""
    out = []
    for m in TOOLCHAIN_MAJORS:
        if toolchain(m) is None:
            out.append(f"clang-{m} (apt-get install clang-{m} lld-22 llvm-{m})")
    if device_bitcode_source() is None:
        out.append("rocm-device-libs (ocml.bc / ockl.bc)")
    if not Path("/usr/include/hip/hip_runtime.h").is_file():
        out.append("libamdhip64-dev (HIP headers)")
    return out


def inspect_tools() -> tuple[str, str] | None:
    """(llvm-readelf, llvm-objdump) of the newest LLVM installed: they must know every target."""
    for m in TOOLCHAIN_MAJORS:
        readelf, objdump = _which(f"llvm-readelf-{m}"), _which(f"llvm-objdump-{m}")
        if readelf and objdump:
            return readelf, objdump
    return None


def predefines_wave_size(tc: Toolchain) -> bool:
    """Whether ``tc`` predefines ``__AMDGCN_WAVEFRONT_SIZE`` (clang 19 does, clang 22 does not)."""
    with _MEMO.lock:
        if tc.name in _MEMO.predef:
            return _MEMO.predef[tc.name]
    probe = [tc.clang, "-x", "hip", "--cuda-device-only", "-nogpulib", "-nogpuinc"]
    out = _run([*probe, "--offload-arch=gfx942", "-dM", "-E", "-"], input="")
    found = re.search(r"^#define __AMDGCN_WAVEFRONT_SIZE\s", out.stdout, re.MULTILINE) is not None
    with _MEMO.lock:
        _MEMO.predef[tc.name] = found
    return found


def offline_root() -> Path:
    return _spec.cache_dir() / "offline"


# ------------------------------------------------------------------------------------------------
# Device libraries
# ------------------------------------------------------------------------------------------------
_BITCODE_DIRS = (
    "/usr/lib/*/amdgcn/bitcode",
    "/usr/lib/amdgcn/bitcode",
    "/usr/share/amdgcn/bitcode",
    "/opt/rocm/amdgcn/bitcode",
    "/opt/rocm/lib/llvm/lib/clang/*/lib/amdgcn/bitcode",
)


def device_bitcode_source() -> Path | None:
    """Where rocm-device-libs put ocml.bc / ockl.bc (``AMDQB_DEVICE_LIBS`` overrides)."""
    env = os.environ.get("AMDQB_DEVICE_LIBS")
    candidates = [env] if env else [p for pat in _BITCODE_DIRS for p in sorted(glob.glob(pat))]
    for c in candidates:
        if c and (Path(c) / "ocml.bc").is_file() and (Path(c) / "ockl.bc").is_file():
            return Path(c)
    return None


def _control_files(archs) -> dict[str, tuple[str, str, int]]:
    """{file stem: (global, IR type, value)} of every constant file clang may ask for."""
    files = {}
    for arch in archs:
        suffix, value = isa_version(arch)
        files[f"oclc_isa_version_{suffix}"] = ("__oclc_ISA_version", "i32", value)
    for abi in (400, 500, 600):  # code object v4 / v5 / v6
        files[f"oclc_abi_version_{abi}"] = ("__oclc_ABI_version", "i32", abi)
    for name, glob_name in (
        ("daz_opt", "__oclc_daz_opt"),
        ("unsafe_math", "__oclc_unsafe_math_opt"),
        ("finite_only", "__oclc_finite_only_opt"),
        ("correctly_rounded_sqrt", "__oclc_correctly_rounded_sqrt32"),
        ("wavefrontsize64", "__oclc_wavefrontsize64"),
    ):
        for state, value in (("on", 1), ("off", 0)):
            files[f"oclc_{name}_{state}"] = (glob_name, "i8", value)
    return files


def _datalayout(tc: Toolchain) -> str:
    cmd = [tc.clang, "-x", "c", "--target=amdgcn-amd-amdhsa", "-nogpulib", "-S", "-emit-llvm"]
    out = _run([*cmd, "-o", "-", "/dev/null"])
    m = re.search(r'^target datalayout = "([^"]*)"', out.stdout, re.MULTILINE)
    if out.returncode or not m:
        raise RuntimeError(f"{tc.name}: cannot read the amdgcn data layout: {out.stderr[-2000:]}")
    return m.group(1)


def device_lib_dir(tc: Toolchain) -> Path:
    """A ``--rocm-device-lib-path`` directory for ``tc``: links to Debian's bitcode plus the
    constant files it lacks for ``tc.archs`` (assembled with ``tc.llvm_as``), cached."""
    with _MEMO.lock:
        if tc.name in _MEMO.devlibs:
            return _MEMO.devlibs[tc.name]
    src = device_bitcode_source()
    if src is None:
        raise FileNotFoundError("rocm-device-libs bitcode (ocml.bc, ockl.bc) not found")
    present = sorted(p for p in src.glob("*.bc"))
    wanted = _control_files(tc.archs)
    material = {
        "format": OFFLINE_FORMAT,
        "toolchain": tc.ident,
        "source": str(src),
        "files": [(p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in present],
        "wanted": sorted(wanted.items()),
    }
    key = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:20]
    dest = offline_root() / "devlib" / f"{tc.name}-{key}"
    if not (dest / ".complete").is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=dest.parent))
        try:
            for p in present:
                (tmp / p.name).symlink_to(p)
            layout = _datalayout(tc)
            names = {p.stem for p in present}
            made = []
            for stem, (sym, ty, value) in sorted(wanted.items()):
                if stem in names:
                    continue
                align = 4 if ty == "i32" else 1
                ir = (
                    f'target datalayout = "{layout}"\ntarget triple = "amdgcn-amd-amdhsa"\n'
                    f"@{sym} = linkonce_odr protected local_unnamed_addr addrspace(4) "
                    f"constant {ty} {value}, align {align}\n"
                )
                out = _run([tc.llvm_as, "-o", str(tmp / f"{stem}.bc"), "-"], input=ir)
                if out.returncode:
                    raise RuntimeError(f"{tc.llvm_as} failed on {stem}: {out.stderr[-2000:]}")
                made.append(stem)
            (tmp / ".complete").write_text(json.dumps({"generated": made, **material}, indent=1))
            try:
                os.replace(tmp, dest)
            except OSError:  # made meanwhile by another process
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    with _MEMO.lock:
        _MEMO.devlibs[tc.name] = dest
    return dest


def generated_device_libs(tc: Toolchain) -> list[str]:
    """Stems of the constant files :func:`device_lib_dir` had to generate for ``tc``."""
    info = json.loads((device_lib_dir(tc) / ".complete").read_text())
    return list(info["generated"])


def _lld_dir(tc: Toolchain) -> Path | None:
    """A ``-B`` directory holding ``lld`` when clang has none next to it (clang 19 on Debian)."""
    if (Path(tc.clang).resolve().parent / "lld").exists():
        return None
    d = offline_root() / "bin" / f"lld-for-{tc.name}"
    link = d / "lld"
    if not link.exists() or link.resolve() != Path(tc.lld).resolve():
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".lld-{os.getpid()}-{threading.get_ident()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(Path(tc.lld).resolve())
        os.replace(tmp, link)
    return d


# ------------------------------------------------------------------------------------------------
# Builds
# ------------------------------------------------------------------------------------------------
def compile_command(
    tc: Toolchain,
    spec: _spec.ModuleSpec,
    arch: str,
    out: Path,
    root: Path | None = None,
    amdqb_wave: int | None = None,
) -> list[str]:
    """The clang command that compiles and links ``spec`` for ``arch`` into ``out`` (and leaves
    the assembly listing next to it). ``amdqb_wave`` overrides the ``AMDQB_WAVE_SIZE`` the
    runtime would pass (tests of the prelude's mismatch check); the target's wave size stays."""
    root = root or _spec.source_root()
    wave = wave_size(arch)
    cmd = [tc.clang, "-x", "hip", "--cuda-device-only", "--no-gpu-bundle-output", "-c"]
    cmd += ["-save-temps=obj", f"--rocm-device-lib-path={device_lib_dir(tc)}"]
    cmd += _spec.hip_flags(arch, amdqb_wave or wave, spec)
    if not predefines_wave_size(tc):
        cmd.append(f"-D__AMDGCN_WAVEFRONT_SIZE={wave}")  # from the arch, not AMDQB_WAVE_SIZE
    lld_dir = _lld_dir(tc)
    if lld_dir is not None:
        cmd.append(f"-B{lld_dir}")
    cmd += [f"-I{root / 'include'}", "-o", str(out), str(root / "kernels" / spec.kernel_file)]
    return cmd


@dataclass
class Build:
    toolchain: str
    spec: _spec.ModuleSpec
    arch: str
    rc: int
    log: str  # compiler stderr
    key: str
    dir: Path | None  # cache entry (code.hsaco, code.s, build.json), None when it failed
    seconds: float
    cached: bool

    @property
    def ok(self) -> bool:
        return self.rc == 0 and self.dir is not None

    @property
    def hsaco(self) -> Path:
        return self.dir / "code.hsaco"

    @property
    def asm(self) -> Path:
        return self.dir / "code.s"

    @property
    def label(self) -> str:
        return f"{self.spec.label()}@{self.arch}/{self.toolchain}"


def _key(tc: Toolchain, spec: _spec.ModuleSpec, arch: str, root: Path) -> str:
    placeholder = Path("/OUT/code.hsaco")
    cmd = compile_command(tc, spec, arch, placeholder, root)
    devlib = device_lib_dir(tc)
    flags = [
        a.replace(str(devlib), devlib.name)
        .replace(str(root), "<src>")
        .replace(str(offline_root()), "<cache>")
        for a in cmd[1:]
    ]
    _, digests = _spec.read_sources(spec, root)
    return _spec.cache_key(tc.ident, arch, wave_size(arch), flags, digests)


def build(
    tc: Toolchain,
    spec: _spec.ModuleSpec,
    arch: str,
    rebuild: bool = False,
    root: Path | None = None,
) -> Build:
    """Compile + link ``spec`` for ``arch`` with ``tc``, or take it from the cache."""
    root = root or _spec.source_root()
    if arch not in tc.archs:
        raise ValueError(f"{tc.name} does not build {arch} (it builds {', '.join(tc.archs)})")
    key = _key(tc, spec, arch, root)
    objects = offline_root() / "objects"
    dest = objects / f"{spec.label()}-{arch}-{tc.name}-{key[:20]}"
    if not rebuild and (dest / "build.json").is_file() and (dest / "code.hsaco").is_file():
        info = json.loads((dest / "build.json").read_text())
        return Build(tc.name, spec, arch, 0, info["log"], key, dest, info["seconds"], True)
    objects.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=objects))
    try:
        cmd = compile_command(tc, spec, arch, tmp / "code.hsaco", root)
        start = time.perf_counter()
        proc = _run(cmd, cwd=tmp)
        seconds = round(time.perf_counter() - start, 3)
        listings = sorted(tmp.glob("*.s"))
        if proc.returncode or not listings or not (tmp / "code.hsaco").is_file():
            return Build(
                tc.name, spec, arch, proc.returncode or 1, proc.stderr, key, None, seconds, False
            )
        os.replace(listings[0], tmp / "code.s")
        for p in tmp.iterdir():  # preprocessed source, bitcode, object, lld's save-temps
            if p.name not in ("code.hsaco", "code.s"):
                p.unlink()
        info = {"command": cmd, "log": proc.stderr, "seconds": seconds, "key": key}
        (tmp / "build.json").write_text(json.dumps(info, indent=1))
        if rebuild and dest.exists():
            shutil.rmtree(dest, ignore_errors=True)
        try:
            os.replace(tmp, dest)
        except OSError:  # built meanwhile by another process
            pass
        done = Build(tc.name, spec, arch, 0, proc.stderr, key, dest, seconds, False)
        if inspect_tools() is not None:
            inspect_build(done)  # while the other workers compile; kept as inspect.json
        return done
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_matrix(
    tcs: list[Toolchain] | None = None,
    variants: list[_spec.ModuleSpec] | None = None,
    archs: tuple[str, ...] | None = None,
) -> list[tuple[Toolchain, _spec.ModuleSpec, str]]:
    tcs = toolchains() if tcs is None else tcs
    return [
        (tc, spec, arch)
        for tc in tcs
        for arch in tc.archs
        if archs is None or arch in archs
        for spec in (module_variants(arch) if variants is None else variants)
    ]


def build_all(
    tcs: list[Toolchain] | None = None,
    variants: list[_spec.ModuleSpec] | None = None,
    archs: tuple[str, ...] | None = None,
    jobs: int | None = None,
    rebuild: bool = False,
) -> dict[tuple[str, _spec.ModuleSpec, str], Build]:
    """Every (toolchain, module, target) build, in parallel, each made once per process."""
    todo = build_matrix(tcs, variants, archs)
    for tc in {tc.name: tc for tc, _, _ in todo}.values():
        device_lib_dir(tc)  # once, before the workers
        predefines_wave_size(tc)
        _lld_dir(tc)

    def one(job):
        tc, spec, arch = job
        memo_key = (tc.name, spec, arch)
        with _MEMO.lock:
            done = None if rebuild else _MEMO.builds.get(memo_key)
        if done is None:
            done = build(tc, spec, arch, rebuild=rebuild)
            with _MEMO.lock:
                _MEMO.builds[memo_key] = done
        return memo_key, done

    workers = max(1, jobs or os.cpu_count() or 2)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(pool.map(one, todo))


# ------------------------------------------------------------------------------------------------
# Inspection
# ------------------------------------------------------------------------------------------------
@dataclass
class Kernel:
    name: str
    meta: dict  # scalar fields of the kernel's metadata entry, without the leading dot
    info: dict  # "; Kernel info" comments of the assembly listing (empty without one)
    code: list  # [(address, instruction text, branch target address or None)]

    @property
    def wave(self) -> int:
        return int(self.meta["wavefront_size"])

    @property
    def vgprs(self) -> int:
        """VGPRs per lane; with AGPRs (gfx942 / gfx950) the unified count: the VGPRs aligned to 4
        plus the AGPRs, which is what occupancy is computed from."""
        return int(self.meta["vgpr_count"])

    @property
    def agprs(self) -> int:
        return int(self.meta.get("agpr_count", 0))

    @property
    def sgprs(self) -> int:
        return int(self.meta["sgpr_count"])

    @property
    def lds(self) -> int:
        return int(self.meta["group_segment_fixed_size"])

    @property
    def scratch(self) -> int:
        return int(self.meta["private_segment_fixed_size"])

    @property
    def dynamic_stack(self) -> bool:
        return bool(self.meta.get("uses_dynamic_stack", False))

    @property
    def max_block(self) -> int:
        return int(self.meta["max_flat_workgroup_size"])

    @property
    def spills(self) -> tuple[int, int]:
        return int(self.meta.get("vgpr_spill_count", 0)), int(self.meta.get("sgpr_spill_count", 0))

    def instructions(self) -> list[str]:
        return [text for _, text, _ in self.code]


@dataclass
class CodeObject:
    path: Path
    target: str  # amdhsa.target, e.g. amdgcn-amd-amdhsa--gfx942
    elf_flags: str  # llvm-readelf's Flags line (the e_flags mach and feature bits)
    kernels: dict  # {name: Kernel}
    undefined: list  # undefined symbol names
    functions: dict  # {symbol: [(address, text, target)]} of every function in .text
    calls: list  # [(function, instruction)] of every s_swappc / s_setpc-based call

    @property
    def arch(self) -> str:
        return self.target.rsplit("--", 1)[-1].split(":")[0]


def _scalar(text: str):
    text = text.strip()
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    if text in ("true", "false"):
        return text == "true"
    return text.strip("'\"")


def parse_metadata(notes: str) -> tuple[str, list[dict]]:
    """(amdhsa.target, [kernel entries]) of ``llvm-readelf --notes`` output: the scalar fields of
    each entry of ``amdhsa.kernels`` (nested lists such as ``.args`` are skipped)."""
    target, kernels, current, in_kernels = "", [], None, False
    for line in notes.splitlines():
        if line.startswith("amdhsa.kernels:"):
            in_kernels = True
            continue
        if line and not line.startswith(" ") and not line.startswith("-"):
            in_kernels = False
            m = re.match(r"amdhsa\.target:\s+(\S+)", line)
            if m:
                target = m.group(1).strip("'\"")
            continue
        if not in_kernels:
            continue
        m = re.match(r"^  - \.(\w+):\s*(.*)$", line)
        if m:
            current = {}
            kernels.append(current)
            if m.group(2):
                current[m.group(1)] = _scalar(m.group(2))
            continue
        m = re.match(r"^    \.(\w+):\s+(\S.*)$", line)
        if m and current is not None:
            current[m.group(1)] = _scalar(m.group(2))
    return target, kernels


def parse_kernel_info(asm: str) -> dict[str, dict]:
    """{kernel: {field: int}} of the ``; Kernel info`` comment blocks of an assembly listing
    (``Occupancy``, ``NumVGPRsForWavesPerEU``, ``ScratchSize``, ...)."""
    out, current, label = {}, None, None
    for line in asm.splitlines():
        m = re.match(r"^(\w+):", line)
        if m and not line.startswith("."):
            label = m.group(1)
            continue
        if line.startswith("; Kernel info:"):
            current = out.setdefault(label, {})
            continue
        if current is not None:
            m = re.match(r"^; (\w+)(?: =|:)\s+(-?\d+)", line)
            if m:
                current[m.group(1)] = int(m.group(2))
            elif not line.startswith(";"):
                current = None
    return out


_FUNC = re.compile(r"^([0-9a-f]+) <([^>]+)>:$")
_INSN = re.compile(r"^\s+(\S.*?)\s*//\s*([0-9A-Fa-f]+):[^<]*(?:<([^+>]+)\+0x([0-9a-f]+)>)?\s*$")


def parse_disassembly(text: str) -> dict[str, list]:
    """{function: [(address, instruction, branch target address)]} of ``llvm-objdump -d``."""
    funcs, starts, current = {}, {}, None
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m:
            starts[m.group(2)] = int(m.group(1), 16)
            current = funcs.setdefault(m.group(2), [])
            continue
        m = _INSN.match(line) if current is not None else None
        if m:
            target = None
            if m.group(3) in starts:
                target = starts[m.group(3)] + int(m.group(4), 16)
            current.append((int(m.group(2), 16), m.group(1), target))
    return funcs


def _tools() -> tuple[str, str]:
    tools = inspect_tools()
    if tools is None:
        raise FileNotFoundError("llvm-readelf / llvm-objdump not found (apt-get install llvm-22)")
    return tools


def _read(path: Path, asm: Path | None) -> CodeObject:
    readelf, objdump = _tools()
    notes = _run([readelf, "--notes", str(path)])
    if notes.returncode:
        raise RuntimeError(f"{readelf} --notes {path}: {notes.stderr[-2000:]}")
    target, entries = parse_metadata(notes.stdout)
    header = _run([readelf, "--file-header", str(path)]).stdout
    flags = next((ln.split(":", 1)[1].strip() for ln in header.splitlines() if "Flags:" in ln), "")
    syms = _run([readelf, "--symbols", "--dyn-syms", "--wide", str(path)]).stdout
    undefined = sorted(
        {
            parts[7]
            for parts in (ln.split() for ln in syms.splitlines())
            if len(parts) >= 8 and parts[6] == "UND" and parts[0].endswith(":")
        }
    )
    dis = _run([objdump, "-d", "--no-show-raw-insn", str(path)])
    if dis.returncode:
        raise RuntimeError(f"{objdump} -d {path}: {dis.stderr[-2000:]}")
    functions = parse_disassembly(dis.stdout)
    info = parse_kernel_info(asm.read_text()) if asm else {}
    kernels = {}
    for entry in entries:
        name = entry.get("name")
        if name:
            kernels[name] = Kernel(name, entry, info.get(name, {}), functions.get(name, []))
    return CodeObject(path, target, flags, kernels, undefined, functions, _calls(functions))


def _calls(functions: dict) -> list:
    """[(function, instruction)] of every call: s_swappc / s_call, and an s_setpc other than the
    assembler's long branch -- ``s_getpc_b64 s[n:n+1]``, adds of a label's offset, ``s_setpc_b64
    s[n:n+1]`` -- which relaxes a branch beyond s_branch's 16-bit offset (a large kernel's own
    code, not a call)."""
    out = []
    for fn, code in functions.items():
        for i, (_, text, _) in enumerate(code):
            m = re.match(r"s_(swappc|setpc|call)_b64\s+(\S+)", text)
            if m is None:
                continue
            if m.group(1) == "setpc":
                pair = m.group(2)
                before = [t for _, t, _ in code[max(0, i - 8) : i]]
                if any(re.match(rf"s_getpc_b64\s+{re.escape(pair)}$", t) for t in before):
                    continue
            out.append((fn, text))
    return out


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _save_inspection(co: CodeObject, dest: Path, asm: Path | None) -> None:
    data = {
        "format": OFFLINE_FORMAT,
        "inspect": INSPECT_FORMAT,
        "hsaco": _digest(co.path),
        "asm": _digest(asm) if asm else None,
        "target": co.target,
        "elf_flags": co.elf_flags,
        "undefined": co.undefined,
        "calls": co.calls,
        "kernels": {n: {"meta": k.meta, "info": k.info} for n, k in co.kernels.items()},
        "functions": co.functions,
    }
    dest.write_text(json.dumps(data))


def _load_inspection(path: Path, asm: Path | None, src: Path) -> CodeObject | None:
    try:
        data = json.loads(src.read_text())
    except (OSError, ValueError):
        return None
    if data.get("format") != OFFLINE_FORMAT or data.get("hsaco") != _digest(path):
        return None
    if data.get("inspect") != INSPECT_FORMAT:
        return None
    if data.get("asm") != (_digest(asm) if asm else None):
        return None
    functions = {n: [tuple(x) for x in code] for n, code in data["functions"].items()}
    kernels = {
        n: Kernel(n, k["meta"], k["info"], functions.get(n, [])) for n, k in data["kernels"].items()
    }
    calls = [tuple(c) for c in data["calls"]]
    return CodeObject(
        path, data["target"], data["elf_flags"], kernels, data["undefined"], functions, calls
    )


def inspect(path: Path | str, asm: Path | str | None = None) -> CodeObject:
    """Read a code object: metadata note, symbols, disassembly (and the listing, if given). For a
    build in the cache the result is kept next to it (``inspect.json``)."""
    path = Path(path)
    asm = Path(asm) if asm else None
    with _MEMO.lock:
        if path in _MEMO.objects:
            return _MEMO.objects[path]
    saved = path.parent / "inspect.json"
    cached = path.name == "code.hsaco" and saved.is_file()
    co = _load_inspection(path, asm, saved) if cached else None
    if co is None:
        co = _read(path, asm)
        if path.name == "code.hsaco" and (path.parent / "build.json").is_file():
            _save_inspection(co, saved, asm)
    with _MEMO.lock:
        _MEMO.objects[path] = co
    return co


def inspect_build(b: Build) -> CodeObject:
    if not b.ok:
        raise RuntimeError(f"{b.label} did not build:\n{b.log[-4000:]}")
    return inspect(b.hsaco, b.asm)


def inspect_all(builds: dict, jobs: int | None = None) -> dict:
    """{key: CodeObject} of the successful builds of :func:`build_all`, read in parallel."""
    ok = [(key, b) for key, b in builds.items() if b.ok]
    with ThreadPoolExecutor(max_workers=max(1, jobs or os.cpu_count() or 2)) as pool:
        return dict(zip([k for k, _ in ok], pool.map(lambda kb: inspect_build(kb[1]), ok)))


# ------------------------------------------------------------------------------------------------
# Occupancy (LLVM's AMDGPU rules: AMDGPUBaseInfo.cpp / AMDGPUSubtarget.cpp)
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rules:
    """Per-target resources as LLVM's AMDGPU backend models them for occupancy."""

    wave: int
    max_waves: int  # waves per SIMD (getMaxWavesPerEU)
    vgprs: int  # VGPRs per lane a SIMD's waves share (getTotalNumVGPRs)
    vgpr_granule: int  # allocation granule (getVGPRAllocGranule)
    unified_agprs: bool  # gfx90a+: AGPRs share the VGPR file, after the VGPRs aligned to 4
    sgpr_limits: bool  # gfx9: SGPRs limit waves (getOccupancyWithNumSGPRs); gfx10+: never
    lds_per_cu: int  # bytes shared by the workgroups on a CU (a WGP in WGP mode)
    lds_per_workgroup: int  # addressable by one workgroup
    eus: int  # SIMDs sharing that LDS and the barriers (getEUsPerCU)
    max_barriers: int  # resident multi-wave workgroups per CU / WGP


# Values: LLVM 22's rules for these targets, each checked against the `; Occupancy:` the backend
# prints for probe kernels over VGPR / SGPR / LDS / workgroup-size sweeps (op_tests/
# test_amd_code_objects.py). gfx1100 / gfx1201: 1.5x VGPR file (1536, granule 24), WGP mode (two
# CUs' LDS, 128 KiB; 64 KiB per workgroup); gfx1250: 1024 VGPRs, granule 16, 320 KiB LDS, no WGP
# mode, 16 barriers; gfx942 / gfx950: 512 unified VGPR+AGPR, granule 8, 8 waves, 64 / 160 KiB LDS.
RULES = {
    "gfx942": Rules(64, 8, 512, 8, True, True, 65536, 65536, 4, 16),
    "gfx950": Rules(64, 8, 512, 8, True, True, 163840, 163840, 4, 16),
    "gfx1100": Rules(32, 16, 1536, 24, False, False, 131072, 65536, 4, 32),
    "gfx1201": Rules(32, 16, 1536, 24, False, False, 131072, 65536, 4, 32),
    "gfx1250": Rules(32, 16, 1024, 16, False, False, 327680, 327680, 4, 16),
}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def waves_by_vgprs(rules: Rules, vgprs: int) -> int:
    if vgprs < rules.vgpr_granule:
        return rules.max_waves
    rounded = _cdiv(vgprs, rules.vgpr_granule) * rules.vgpr_granule
    return min(max(rules.vgprs // rounded, 1), rules.max_waves)


def waves_by_sgprs(rules: Rules, sgprs: int) -> int:
    if not rules.sgpr_limits:
        return rules.max_waves
    waves = 10 if sgprs <= 80 else 9 if sgprs <= 88 else 8 if sgprs <= 100 else 7
    return min(waves, rules.max_waves)


def _max_workgroups(rules: Rules, block: int) -> int:
    waves = _cdiv(block, rules.wave)
    slots = rules.max_waves * rules.eus
    return slots if waves == 1 else min(slots // waves, rules.max_barriers)


def waves_by_workgroups(rules: Rules, lds: int, min_block: int, max_block: int) -> int:
    """LLVM's getOccupancyWithWorkGroupSizes(...).second: the most waves per SIMD any block size
    in [min_block, max_block] reaches with ``lds`` bytes of LDS per block."""
    by_lds = rules.lds_per_cu // max(lds, 1)
    if not by_lds:
        return 1

    def props(block):
        w = _cdiv(block, rules.wave)
        g = min(_max_workgroups(rules, block), by_lds)
        return w, g, w * g

    min_wpg, max_groups, max_waves_cu = props(min_block)
    _, _, min_waves_cu = props(max_block)
    if min_waves_cu >= max_waves_cu:
        max_waves_cu = min_waves_cu
    else:
        left = rules.max_waves * rules.eus - max_groups * min_wpg
        per_group = left // max_groups
        if per_group:
            grow = min(per_group, (max_block - 1) // rules.wave + 1 - min_wpg)
            max_waves_cu += max_groups * grow
    return max(1, min(_cdiv(max_waves_cu, rules.eus), rules.max_waves))


@dataclass(frozen=True)
class Occupancy:
    vgpr_waves: int
    sgpr_waves: int
    group_waves: int  # from LDS and workgroup counts
    waves: int  # LLVM's occupancy: the minimum (the listing's `; Occupancy:`)
    limit: str  # what sets it: vgpr / sgpr / lds+wg / max
    at_block: int  # waves per SIMD with whole blocks of max_block threads resident


def occupancy(arch: str, k: Kernel) -> Occupancy:
    """Occupancy of kernel ``k`` on ``arch`` from its metadata (static LDS only; the kernels that
    take dynamic LDS get it at launch)."""
    rules = RULES[arch]
    v = waves_by_vgprs(rules, k.vgprs)  # gfx942 / gfx950: .vgpr_count already includes AGPRs
    s = waves_by_sgprs(rules, k.sgprs)
    g = waves_by_workgroups(rules, k.lds, 1, k.max_block)
    waves = min(v, s, g)
    limit = (
        "max"
        if waves == rules.max_waves
        else "vgpr" if waves == v else ("sgpr" if waves == s else "lds+wg")
    )
    # Whole blocks of max_block threads: each block's waves spread over the SIMDs, so registers
    # admit (register waves x SIMDs) // (waves per block) blocks; LDS and barriers cap it too.
    per_block = _cdiv(k.max_block, rules.wave)
    blocks = min(
        (min(v, s) * rules.eus) // per_block,
        rules.lds_per_cu // max(k.lds, 1),
        _max_workgroups(rules, k.max_block),
    )
    at_block = min(min(v, s), blocks * per_block // rules.eus)
    return Occupancy(v, s, g, waves, limit, at_block)


def probe_occupancy(
    tc: Toolchain, arch: str, cases: list[tuple[int, int, int, int, int]]
) -> list[dict]:
    """The ``; Kernel info`` of probe kernels (``Occupancy``, ``NumVgprs``, ``TotalNumSgprs``,
    ``LDSByteSize``, ...), one per case (vgprs, sgprs, lds bytes, min block, max block): each
    clobbers its highest VGPR / SGPR and touches its LDS."""
    ir, attrs = [], {}
    for i, (v, s, lds, lo, hi) in enumerate(cases):
        attr = attrs.setdefault((lo, hi), len(attrs))
        clobbers = ",".join(
            c for c in (f"~{{v{v - 1}}}" if v else "", f"~{{s{s - 1}}}" if s else "") if c
        )
        body = f'  call void asm sideeffect "", "{clobbers}"()\n' if clobbers else ""
        if lds:
            ir.append(f"@lds{i} = internal addrspace(3) global [{lds} x i8] poison, align 4")
            body += f"  store volatile i8 1, ptr addrspace(3) @lds{i}\n"
        ir.append(f"define amdgpu_kernel void @probe{i}() #{attr} {{\n{body}  ret void\n}}")
    for (lo, hi), n in attrs.items():
        ir.append(f'attributes #{n} = {{ "amdgpu-flat-work-group-size"="{lo},{hi}" }}')
    cmd = [tc.clang, "-x", "ir", "--target=amdgcn-amd-amdhsa", f"-mcpu={arch}", "-nogpulib"]
    out = _run([*cmd, "-O1", "-S", "-o", "-", "-"], input="\n".join(ir) + "\n")
    if out.returncode:
        raise RuntimeError(f"{tc.name} probe for {arch} failed: {out.stderr[-3000:]}")
    info = parse_kernel_info(out.stdout)
    return [info[f"probe{i}"] for i in range(len(cases))]


# ------------------------------------------------------------------------------------------------
# The occupancy table (docs/amd_occupancy.md)
# ------------------------------------------------------------------------------------------------
TABLE_BEGIN = "<!-- BEGIN GENERATED: python -m amdqb.backends.hip._offline table --write -->"
TABLE_END = "<!-- END GENERATED -->"


def _module_title(spec: _spec.ModuleSpec) -> str:
    titles = (title for arch in AMD_ARCHS for title, v in _variants(arch) if v == spec)
    return next(titles, spec.label())


def render_table(builds: dict) -> str:
    """The generated part of docs/amd_occupancy.md for ``builds`` (from :func:`build_all`)."""
    by_target: dict = {}
    versions = {}
    for (tc_name, _module, arch), b in builds.items():
        by_target.setdefault((tc_name, arch), []).append(b)
    for tc in toolchains():
        versions[tc.name] = tc.version
    lines = [TABLE_BEGIN, ""]
    for name in sorted(versions, key=lambda n: -int(n.split("-")[1])):
        if any(t == name for t, _ in by_target):
            lines.append(f"* {name}: `{versions[name]}`")
    lines += [
        "",
        (
            "| target | wave | waves/SIMD max | VGPRs per SIMD lane | VGPR granule | SGPRs limit "
            "| LDS per CU | LDS per block | SIMDs per CU | blocks per CU max |"
        ),
        "|---|--:|--:|--:|--:|---|--:|--:|--:|--:|",
    ]
    for arch in AMD_ARCHS:
        r = RULES[arch]
        lines.append(
            f"| {arch} | {r.wave} | {r.max_waves} | {r.vgprs}{' (VGPR+AGPR)' if r.unified_agprs else ''}"
            f" | {r.vgpr_granule} | {'yes' if r.sgpr_limits else 'no'} | {r.lds_per_cu} "
            f"| {r.lds_per_workgroup} | {r.eus} | {r.max_barriers} |"
        )
    lines.append("")
    order = {spec: i for arch in AMD_ARCHS for i, spec in enumerate(module_variants(arch))}
    tc_order = {f"clang-{m}": i for i, m in enumerate(TOOLCHAIN_MAJORS)}
    for tc_name, arch in sorted(
        by_target, key=lambda t: (tc_order.get(t[0], 99), AMD_ARCHS.index(t[1]))
    ):
        rules = RULES[arch]
        lines += [
            f"### {arch} (wave{rules.wave}), {tc_name}",
            "",
            (
                "| module | kernel | VGPR | AGPR | SGPR | LDS | scratch | spills v/s | block "
                "| waves/SIMD | limit | at block |"
            ),
            "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|---|--:|",
        ]
        for b in sorted(by_target[(tc_name, arch)], key=lambda b: order.get(b.spec, 99)):
            if not b.ok:
                lines.append(f"| {_module_title(b.spec)} | BUILD FAILED | | | | | | | | | | |")
                continue
            co = inspect_build(b)
            for name in sorted(co.kernels):
                k = co.kernels[name]
                occ = occupancy(arch, k)
                sv, ss = k.spills
                lines.append(
                    f"| {_module_title(b.spec)} | `{name}` | {k.vgprs} | {k.agprs} | {k.sgprs} "
                    f"| {k.lds} | {k.scratch} | {sv}/{ss} | {k.max_block} | {occ.waves} "
                    f"| {occ.limit} | {occ.at_block} |"
                )
        lines.append("")
    lines.append(TABLE_END)
    return "\n".join(lines) + "\n"


def generated_section(text: str) -> str | None:
    i, j = text.find(TABLE_BEGIN), text.find(TABLE_END)
    if i < 0 or j < 0:
        return None
    return text[i : j + len(TABLE_END)] + "\n"


def write_table(path: Path, table: str) -> None:
    text = path.read_text() if path.is_file() else "# AMD code objects: occupancy\n\n"
    current = generated_section(text)
    text = text.replace(current, table) if current else text.rstrip("\n") + "\n\n" + table
    path.write_text(text)


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def _select(args) -> list[Toolchain]:
    tcs = toolchains()
    if args.toolchain:
        tcs = [tc for tc in tcs if tc.name in args.toolchain]
    if not tcs:
        raise SystemExit("no toolchain: " + "; ".join(missing_toolchains()))
    return tcs


def _cmd_build(args) -> int:
    start = time.perf_counter()
    builds = build_all(
        _select(args), archs=tuple(args.arch) or None, jobs=args.jobs, rebuild=args.rebuild
    )
    wall = time.perf_counter() - start
    failed = 0
    for b in sorted(builds.values(), key=lambda b: b.label):
        status = "cached" if b.cached else f"{b.seconds:.1f}s"
        if not b.ok:
            failed += 1
            print(f"FAIL {b.label}\n{b.log[-3000:]}")
            continue
        co = inspect_build(b)
        print(
            f"ok   {b.label:55s} {status:>7s} kernels={len(co.kernels)} undefined={len(co.undefined)}"
            f" calls={len(co.calls)} -> {b.hsaco}"
        )
    print(f"{len(builds)} builds, {failed} failed, {wall:.1f}s wall")
    return 1 if failed else 0


def _cmd_inspect(args) -> int:
    co = inspect(args.path, args.asm)
    arch = co.arch
    rows = []
    for name, k in sorted(co.kernels.items()):
        occ = occupancy(arch, k) if arch in RULES else None
        rows.append(
            {
                "kernel": name,
                **{
                    f: k.meta.get(f)
                    for f in (
                        "wavefront_size",
                        "vgpr_count",
                        "agpr_count",
                        "sgpr_count",
                        "group_segment_fixed_size",
                        "private_segment_fixed_size",
                        "uses_dynamic_stack",
                        "vgpr_spill_count",
                        "sgpr_spill_count",
                        "max_flat_workgroup_size",
                    )
                },
                "occupancy": dataclasses.asdict(occ) if occ else None,
                "listing_occupancy": k.info.get("Occupancy"),
            }
        )
    if args.json:
        print(
            json.dumps(
                {
                    "target": co.target,
                    "undefined": co.undefined,
                    "calls": len(co.calls),
                    "kernels": rows,
                },
                indent=1,
            )
        )
        return 0
    print(
        f"{co.path}: {co.target} ({co.elf_flags}); undefined: {co.undefined or 'none'}; "
        f"calls: {len(co.calls)}"
    )
    for r in rows:
        o = r["occupancy"] or {}
        print(
            f"  {r['kernel']:28s} wave{r['wavefront_size']} vgpr={r['vgpr_count']} "
            f"agpr={r['agpr_count']} sgpr={r['sgpr_count']} lds={r['group_segment_fixed_size']} "
            f"scratch={r['private_segment_fixed_size']} dyn_stack={r['uses_dynamic_stack']} "
            f"waves={o.get('waves')} ({o.get('limit')}) at_block={o.get('at_block')}"
        )
    return 0


def _cmd_table(args) -> int:
    start = time.perf_counter()
    table = render_table(build_all(_select(args), jobs=args.jobs))
    print(f"built and inspected in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    if args.write:
        write_table(Path(args.write), table)
    elif args.check:
        current = generated_section(Path(args.check).read_text())
        if current != table:
            print(
                f"{args.check} is stale: regenerate with `python -m amdqb.backends.hip._offline "
                f"table --write {args.check}`",
                file=sys.stderr,
            )
            return 1
    else:
        sys.stdout.write(table)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m amdqb.backends.hip._offline", description=__doc__.split("\n")[0]
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("build", "table"):
        s = sub.add_parser(name)
        s.add_argument("--toolchain", action="append", default=[], help="clang-22 / clang-19")
        s.add_argument("-j", "--jobs", type=int, default=None)
        if name == "build":
            s.add_argument("--arch", action="append", default=[])
            s.add_argument("--rebuild", action="store_true")
        else:
            g = s.add_mutually_exclusive_group()
            g.add_argument("--write", metavar="PATH")
            g.add_argument("--check", metavar="PATH")
    s = sub.add_parser("inspect")
    s.add_argument("path")
    s.add_argument("--asm", help="the assembly listing of the same compile (for its comments)")
    s.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    return {"build": _cmd_build, "inspect": _cmd_inspect, "table": _cmd_table}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
