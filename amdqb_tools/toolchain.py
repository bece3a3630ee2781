"""The AMD toolchains installed here and the device-library directory each one links against.

A :class:`Toolchain` is one clang with the tools of its version: clang 22 for gfx942 and gfx950
(wave64), gfx1100, gfx1201 and gfx1250 (wave32); clang 19 for gfx942, gfx1100 and gfx1201 (it knows
neither gfx950 nor gfx1250). Toolchain facts this relies on (Debian 12, measured):

* clang 22 no longer predefines ``__AMDGCN_WAVEFRONT_SIZE``, which the HIP 5.2 headers use; the
  builds define it from the target's real wave size (``amdqb._arch.amd_wave_size``, the rule the
  runtime uses), never from ``AMDQB_WAVE_SIZE``, so the prelude's mismatch check still fires.
* Debian's rocm-device-libs (ROCm 5.2 bitcode: ocml, ockl and the oclc control files) lacks the
  ISA-version files of these targets and the ABI-version file of code object v6 (clang 22's
  default); the ROCm 7.x ocml / ockl of Triton's AMD backend come without any control file
  (:data:`DEVICE_LIB_SETS`). :func:`device_lib_dir` builds a directory for
  ``--rocm-device-lib-path`` holding links to a set's bitcode plus the missing constant files,
  assembled from two-line LLVM IR with the toolchain's ``llvm-as`` (nothing binary is committed). ocml supplies the math the precision
  contract needs that clang's headers do not lower to builtins (``log1pf``; ``expf`` and ``sqrtf``
  are LLVM intrinsics with clang 22's headers, as with the clang of a current ROCm).
* clang 19 finds no lld of its own version on Debian; lld 22 links for it (``-B`` to a directory
  holding an ``lld`` link).
* The ROCm 7.x bitcode is written by LLVM 20 (``Producer: 'LLVM20.0.0git'``), which clang 19
  cannot read: clang 22 links both device-library sets, clang 19 Debian's alone
  (:data:`LIBS_BY_MAJOR`).
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from amdqb.backends.hip import _spec

OFFLINE_FORMAT = 1  # bump when the cache layout, the generated bitcode or the parsing changes

# Targets and the clang major versions that know them.
AMD_ARCHS = ("gfx942", "gfx950", "gfx1100", "gfx1201", "gfx1250")
ARCHS_BY_MAJOR = {22: AMD_ARCHS, 19: ("gfx942", "gfx1100", "gfx1201")}
TOOLCHAIN_MAJORS = (22, 19)


def isa_version(arch: str) -> tuple[str, int]:
    """(file suffix, ``__oclc_ISA_version``) of ``arch``: gfx942 -> ("942", 9402); the value is
    major * 1000 + minor * 100 + stepping, as in the device libraries' own files."""
    base = arch.split(":")[0]
    m = re.fullmatch(r"gfx(\d+)([0-9a-f])([0-9a-f])", base)
    if not m:
        raise ValueError(f"arch must look like gfx942 / gfx1100, got {arch!r}")
    major, minor, step = int(m.group(1)), int(m.group(2), 16), int(m.group(3), 16)
    return base[3:], major * 1000 + minor * 100 + step


def run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=False, capture_output=True, text=True, **kw)


def _first_line(cmd) -> str:
    try:
        out = run([*cmd, "--version"])
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
        return ARCHS_BY_MAJOR.get(self.major, ())

    @property
    def lib_sets(self) -> tuple[str, ...]:
        """The device-library sets this toolchain links (:data:`LIBS_BY_MAJOR`)."""
        return LIBS_BY_MAJOR.get(self.major, ())

    @property
    def ident(self) -> str:
        return f"{self.version} | {self.lld_version}"


def _which(name: str) -> str | None:
    return shutil.which(name)


@dataclass
class Memo:
    lock: threading.Lock = field(default_factory=threading.Lock)
    toolchains: dict = field(default_factory=dict)
    predef: dict = field(default_factory=dict)
    devlibs: dict = field(default_factory=dict)
    builds: dict = field(default_factory=dict)
    objects: dict = field(default_factory=dict)


MEMO = Memo()  # per-process memo of what was found, generated and built


def toolchain(major: int) -> Toolchain | None:
    """clang++-<major>, llvm-as-<major> and an lld (of that version, else the newest), or None."""
    with MEMO.lock:
        if major in MEMO.toolchains:
            return MEMO.toolchains[major]
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
    with MEMO.lock:
        MEMO.toolchains[major] = tc
    return tc


def toolchains() -> list[Toolchain]:
    """The toolchains installed here, newest first (``AMDQB_OFFLINE_TOOLCHAINS=22,19`` limits)."""
    wanted = os.environ.get("AMDQB_OFFLINE_TOOLCHAINS", "")
    majors = [int(m) for m in re.findall(r"\d+", wanted)] or list(TOOLCHAIN_MAJORS)
    return [tc for tc in (toolchain(m) for m in majors if m in ARCHS_BY_MAJOR) if tc]


def missing_toolchains() -> list[str]:
    """Why a toolchain of :data:`TOOLCHAIN_MAJORS` is not usable here (for skip reasons)."""
    out = []
    for m in TOOLCHAIN_MAJORS:
        if toolchain(m) is None:
            out.append(f"clang-{m} (apt-get install clang-{m} lld-22 llvm-{m})")
    if device_bitcode_source() is None:
        out.append("rocm-device-libs (ocml.bc / ockl.bc)")
    if device_bitcode_source("rocm7") is None:
        out.append("Triton's AMD backend (ROCm 7 ocml.bc / ockl.bc: pip install triton)")
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
    with MEMO.lock:
        if tc.name in MEMO.predef:
            return MEMO.predef[tc.name]
    probe = [tc.clang, "-x", "hip", "--cuda-device-only", "-nogpulib", "-nogpuinc"]
    out = run([*probe, "--offload-arch=gfx942", "-dM", "-E", "-"], input="")
    found = re.search(r"^#define __AMDGCN_WAVEFRONT_SIZE\s", out.stdout, re.MULTILINE) is not None
    with MEMO.lock:
        MEMO.predef[tc.name] = found
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


# Device-library sets a build links against: Debian's rocm-device-libs (ROCm 5.2 bitcode) and the
# ROCm 7.x ocml / ockl that Triton's AMD backend ships (site-packages/triton/backends/amd/lib).
DEVICE_LIB_SETS = ("debian", "rocm7")
# The sets each toolchain can link: ROCm 7's bitcode needs an LLVM of 20 or later to read it.
LIBS_BY_MAJOR = {22: DEVICE_LIB_SETS, 19: ("debian",)}


def _triton_amd() -> Path | None:
    """site-packages/triton/backends/amd (located without importing triton)."""
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.origin:
        return None
    path = Path(spec.origin).parent / "backends" / "amd"
    return path if path.is_dir() else None


def device_bitcode_source(libs: str = "debian") -> Path | None:
    """The directory holding ocml.bc / ockl.bc of device-library set ``libs``
    (``AMDQB_DEVICE_LIBS`` overrides Debian's)."""
    if libs not in DEVICE_LIB_SETS:
        raise ValueError(f"libs must be one of {DEVICE_LIB_SETS}, got {libs!r}")
    if libs == "rocm7":
        amd = _triton_amd()
        candidates = [str(amd / "lib")] if amd else []
    else:
        env = os.environ.get("AMDQB_DEVICE_LIBS")
        candidates = [env] if env else [p for pat in _BITCODE_DIRS for p in sorted(glob.glob(pat))]
    for c in candidates:
        if c and (Path(c) / "ocml.bc").is_file() and (Path(c) / "ockl.bc").is_file():
            return Path(c)
    return None


def device_libs_version(libs: str) -> str:
    """The ROCm release of device-library set ``libs``, as far as its files say."""
    if libs == "rocm7":
        amd = _triton_amd()
        header = amd / "include" / "hip" / "hip_version.h" if amd else None
        if header is not None and header.is_file():
            text = header.read_text()
            parts = [re.search(rf"#define HIP_VERSION_{n} (\d+)", text) for n in ("MAJOR", "MINOR")]
            if all(parts):
                return f"ROCm {parts[0].group(1)}.{parts[1].group(1)} (Triton's AMD backend)"
        return "ROCm 7 (Triton's AMD backend)"
    return "ROCm 5.2 (Debian's rocm-device-libs)"


def _control_files(archs) -> dict[str, list[tuple[str, str, int]]]:
    """{file stem: [(global, IR type, value)]} of every constant file clang may ask for (ROCm 7's
    ockl also reads __oclc_wavefrontsize_log2, which its wavefrontsize files define), and the
    opencl.bc clang looks for (empty)."""
    files = {}
    for arch in archs:
        suffix, value = isa_version(arch)
        files[f"oclc_isa_version_{suffix}"] = [("__oclc_ISA_version", "i32", value)]
    for abi in (400, 500, 600):  # code object v4 / v5 / v6
        files[f"oclc_abi_version_{abi}"] = [("__oclc_ABI_version", "i32", abi)]
    for name, glob_name in (
        ("daz_opt", "__oclc_daz_opt"),
        ("unsafe_math", "__oclc_unsafe_math_opt"),
        ("finite_only", "__oclc_finite_only_opt"),
        ("correctly_rounded_sqrt", "__oclc_correctly_rounded_sqrt32"),
        ("wavefrontsize64", "__oclc_wavefrontsize64"),
    ):
        for state, value in (("on", 1), ("off", 0)):
            files[f"oclc_{name}_{state}"] = [(glob_name, "i8", value)]
    for state, log2 in (("on", 6), ("off", 5)):
        files[f"oclc_wavefrontsize64_{state}"].append(("__oclc_wavefrontsize_log2", "i32", log2))
    files["opencl"] = []
    return files


def _datalayout(tc: Toolchain) -> str:
    cmd = [tc.clang, "-x", "c", "--target=amdgcn-amd-amdhsa", "-nogpulib", "-S", "-emit-llvm"]
    out = run([*cmd, "-o", "-", "/dev/null"])
    m = re.search(r'^target datalayout = "([^"]*)"', out.stdout, re.MULTILINE)
    if out.returncode or not m:
        raise RuntimeError(f"{tc.name}: cannot read the amdgcn data layout: {out.stderr[-2000:]}")
    return m.group(1)


def device_lib_dir(tc: Toolchain, libs: str = "debian") -> Path:
    """A ``--rocm-device-lib-path`` directory for ``tc``: links to the bitcode of device-library
    set ``libs`` plus the constant files it lacks for ``tc.archs`` (assembled with
    ``tc.llvm_as``), cached."""
    with MEMO.lock:
        if (tc.name, libs) in MEMO.devlibs:
            return MEMO.devlibs[(tc.name, libs)]
    src = device_bitcode_source(libs)
    if src is None:
        raise FileNotFoundError(f"{libs} device libraries (ocml.bc, ockl.bc) not found")
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
    dest = offline_root() / "devlib" / f"{tc.name}-{libs}-{key}"
    if not (dest / ".complete").is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=dest.parent))
        try:
            for p in present:
                (tmp / p.name).symlink_to(p)
            layout = _datalayout(tc)
            names = {p.stem for p in present}
            made = []
            for stem, globals_ in sorted(wanted.items()):
                if stem in names:
                    continue
                # opencl.bc: clang accepts a device-library directory only with one (HIP never
                # links it); Triton's set has none, so an empty module stands in
                ir = f'target datalayout = "{layout}"\ntarget triple = "amdgcn-amd-amdhsa"\n'
                for sym, ty, value in globals_:
                    align = 4 if ty == "i32" else 1
                    ir += (
                        f"@{sym} = linkonce_odr protected local_unnamed_addr addrspace(4) "
                        f"constant {ty} {value}, align {align}\n"
                    )
                out = run([tc.llvm_as, "-o", str(tmp / f"{stem}.bc"), "-"], input=ir)
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
    with MEMO.lock:
        MEMO.devlibs[(tc.name, libs)] = dest
    return dest


def generated_device_libs(tc: Toolchain, libs: str = "debian") -> list[str]:
    """Stems of the constant files :func:`device_lib_dir` had to generate for ``tc``."""
    info = json.loads((device_lib_dir(tc, libs) / ".complete").read_text())
    return list(info["generated"])


def lld_dir(tc: Toolchain) -> Path | None:
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
