"""The AMD toolchains installed here and the device-library directory each one links against.

A :class:`Toolchain` is one clang with the tools of its version: clang 22 for gfx942 and gfx950
(wave64), gfx1100, gfx1201 and gfx1250 (wave32); clang 19 for gfx942, gfx1100 and gfx1201 (it knows
neither gfx950 nor gfx1250). Toolchain facts this relies on (Debian 12, measured):

* clang 22 no longer predefines ``__AMDGCN_WAVEFRONT_SIZE``, which the HIP 5.2 headers use; the
  builds define it from the target's real wave size (``amdqb._arch.amd_wave_size``, the rule the
  runtime uses), never from ``AMDQB_WAVE_SIZE``, so the prelude's mismatch check still fires.
* Debian's rocm-device-libs (ROCm 5.2 bitcode: ocml, ockl and the oclc control files) lacks the
  ISA-version files of these targets and the ABI-version file of code object v6 (clang 22's
  default). :func:`device_lib_dir` builds a directory for ``--rocm-device-lib-path`` holding links
  to Debian's bitcode plus the missing constant files, assembled from two-line LLVM IR with the
  toolchain's ``llvm-as`` (nothing binary is committed). ocml supplies the math the precision
  contract needs that clang's headers do not lower to builtins (``log1pf``; ``expf`` and ``sqrtf``
  are LLVM intrinsics with clang 22's headers, as with the clang of a current ROCm).
* clang 19 finds no lld of its own version on Debian; lld 22 links for it (``-B`` to a directory
  holding an ``lld`` link).
"""

from __future__ import annotations

import glob
import hashlib
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
    out = run([*cmd, "-o", "-", "/dev/null"])
    m = re.search(r'^target datalayout = "([^"]*)"', out.stdout, re.MULTILINE)
    if out.returncode or not m:
        raise RuntimeError(f"{tc.name}: cannot read the amdgcn data layout: {out.stderr[-2000:]}")
    return m.group(1)


def device_lib_dir(tc: Toolchain) -> Path:
    """A ``--rocm-device-lib-path`` directory for ``tc``: links to Debian's bitcode plus the
    constant files it lacks for ``tc.archs`` (assembled with ``tc.llvm_as``), cached."""
    with MEMO.lock:
        if tc.name in MEMO.devlibs:
            return MEMO.devlibs[tc.name]
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
        MEMO.devlibs[tc.name] = dest
    return dest


def generated_device_libs(tc: Toolchain) -> list[str]:
    """Stems of the constant files :func:`device_lib_dir` had to generate for ``tc``."""
    info = json.loads((device_lib_dir(tc) / ".complete").read_text())
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
