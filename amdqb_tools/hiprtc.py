"""The hip kernels built the way hiprtc builds them on a ROCm device, with Debian's clang 22.

The runtime (``amdqb.backends.hip._runtime.HiprtcToolchain``) hands hiprtc the kernel source and
``_spec.hip_flags(arch, wave, spec) + ["-I<include>"]``. hiprtc (ROCm's ``hiprtcCompileProgram``,
through comgr) puts its own options in front of them -- ``-O3``, ``--hip-version=...``, the
``HIP_VERSION_*`` defines, ``-D__HIPCC_RTC__``, ``-include hiprtc_runtime.h`` (its builtin header:
the HIP device API, types and math, no system header), ``-std=c++14`` (the runtime's
``-std=c++17`` comes later and wins), ``-nogpuinc``, ``-Wno-gnu-line-marker``,
``-Wno-missing-prototypes`` -- and then

1. compiles the source to bitcode without optimisation (``-Xclang -disable-llvm-passes``),
   linking the device libraries (ocml, ockl, the oclc control files of the target);
2. generates code from that bitcode at ``-O3`` with ``-mllvm -amdgpu-internalize-symbols``;
3. links the relocatable object into the code object.

:func:`build` runs the same three steps with clang 22 and lld 22 for one module and target, with
``hiprtc_runtime.h`` taken from Debian's hiprtc (the builtin header compiled into
``libhiprtc-builtins.so.5``, ROCm 5.2: the newest here; :func:`builtin_header`) and either
device-library set of :data:`amdqb_tools.toolchain.DEVICE_LIB_SETS`. So the kernels' ``__HIPCC_RTC__``
branch -- no ``hip_runtime.h``, only what hiprtc predefines -- is compiled and linked here for every
target. Builds are cached like the offline builds (``<cache>/offline/hiprtc``).

The runtime refuses a ROCm older than ``_runtime.MIN_ROCM`` (whose compiler lacks builtins the
kernels use); op_tests/test_hip_runtime_rocm.py drives that check and the build fallback with the
real Debian hiprtc.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from amdqb._arch import amd_wave_size, base_arch
from amdqb.backends.hip import _spec

from .build import Build, titled_variants
from .toolchain import (
    MEMO,
    OFFLINE_FORMAT,
    Toolchain,
    device_lib_dir,
    offline_root,
    predefines_wave_size,
    run,
)

# The HIP version hiprtc passes (--hip-version, HIP_VERSION_*): the builtin header's release.
HIP_VERSION = (5, 2, 21153)
_BUILTINS = (
    "/usr/lib/x86_64-linux-gnu/libhiprtc-builtins.so.5",
    "/usr/lib/*/libhiprtc-builtins.so.5",
    "/opt/rocm/lib/libhiprtc-builtins.so*",
)


def builtins_library() -> Path | None:
    """libhiprtc-builtins (Debian's libhiprtc-builtins5), or None."""
    for pattern in _BUILTINS:
        for path in sorted(glob.glob(pattern)):
            if Path(path).is_file():
                return Path(path)
    return None


def builtin_header() -> Path:
    """hiprtc_runtime.h as hiprtc includes it: the ``__hipRTC_header`` bytes of
    libhiprtc-builtins, written to the cache (keyed by the library's sha256)."""
    lib_path = builtins_library()
    if lib_path is None:
        raise FileNotFoundError(
            "libhiprtc-builtins.so.5 not found (apt-get install libamdhip64-dev)"
        )
    digest = hashlib.sha256(lib_path.read_bytes()).hexdigest()[:20]
    dest = offline_root() / "hiprtc" / f"include-{digest}" / "hiprtc_runtime.h"
    if not dest.is_file():
        lib = ctypes.CDLL(str(lib_path))
        size = ctypes.c_uint.in_dll(lib, "__hipRTC_header_size").value
        data = ctypes.string_at(
            ctypes.addressof(ctypes.c_char.in_dll(lib, "__hipRTC_header")), size
        )
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, dest)
    return dest


def hiprtc_options(header: Path) -> list[str]:
    """The options hiprtc puts in front of the caller's (hiprtcInternal.cpp of ROCm's clr)."""
    major, minor, patch = HIP_VERSION
    return [
        "-O3",
        f"--hip-version={major}.{minor}.{patch}",
        f"-DHIP_VERSION_MAJOR={major}",
        f"-DHIP_VERSION_MINOR={minor}",
        f"-DHIP_VERSION_PATCH={patch}",
        "-D__HIPCC_RTC__",
        "-include",
        str(header),
        "-std=c++14",
        "-nogpuinc",
        "-Wno-gnu-line-marker",
        "-Wno-missing-prototypes",
    ]


def commands(
    tc: Toolchain, spec: _spec.ModuleSpec, arch: str, out_dir: Path, libs: str = "debian"
) -> list[list[str]]:
    """The three commands of a hiprtc build of ``spec`` for ``arch`` into ``out_dir`` (code.bc,
    code.o + code.s, code.hsaco)."""
    root = _spec.source_root()
    wave = amd_wave_size(arch)
    runtime_flags = _spec.hip_flags(arch, wave, spec) + [f"-I{root / 'include'}"]
    compile_bc = [tc.clang, "-x", "hip", "--cuda-device-only", "-c", "-emit-llvm"]
    compile_bc += [f"--rocm-device-lib-path={device_lib_dir(tc, libs)}"]
    compile_bc += hiprtc_options(builtin_header()) + runtime_flags
    if not predefines_wave_size(tc):  # as a ROCm clang predefines it (the builtin header reads it)
        compile_bc.append(f"-D__AMDGCN_WAVEFRONT_SIZE={wave}")
    devlib = device_lib_dir(tc, libs)
    if b"__oclc_daz_opt" in (devlib / "ocml.bc").read_bytes():
        # ROCm 5's ocml reads the denormal mode from a control file that clang 22 no longer links
        # and that comgr of that release linked: daz off, the kernels' mode (denormals kept)
        compile_bc += ["-Xclang", "-mlink-builtin-bitcode", "-Xclang"]
        compile_bc.append(str(devlib / "oclc_daz_opt_off.bc"))
    compile_bc += ["-Xclang", "-disable-llvm-passes", "-o", str(out_dir / "code.bc")]
    compile_bc.append(str(root / "kernels" / spec.kernel_file))
    codegen = [
        tc.clang,
        "-x",
        "ir",
        "--target=amdgcn-amd-amdhsa",
        f"-mcpu={base_arch(arch)}",
        "-nogpulib",
    ]
    codegen += ["-O3", "-mllvm", "-amdgpu-internalize-symbols", "-save-temps=obj", "-c"]
    codegen += ["-o", str(out_dir / "code.o"), str(out_dir / "code.bc")]
    link = [tc.lld, "-flavor", "gnu", "-shared", "-o", str(out_dir / "code.hsaco")]
    link.append(str(out_dir / "code.o"))
    return [compile_bc, codegen, link]


def _key(tc: Toolchain, spec: _spec.ModuleSpec, arch: str, libs: str) -> str:
    placeholder = Path("/OUT")
    root = _spec.source_root()
    cmds = commands(tc, spec, arch, placeholder, libs)
    devlib, header = device_lib_dir(tc, libs), builtin_header()
    flags = [
        [
            a.replace(str(devlib), devlib.name)
            .replace(str(header.parent), header.parent.name)
            .replace(str(root), "<src>")
            for a in cmd[1:]
        ]
        for cmd in cmds
    ]
    _, digests = _spec.read_sources(spec, root)
    return _spec.cache_key(f"hiprtc {tc.ident}", arch, amd_wave_size(arch), flags, digests)


def build(
    tc: Toolchain, spec: _spec.ModuleSpec, arch: str, libs: str = "debian", rebuild: bool = False
) -> Build:
    """The hiprtc build of ``spec`` for ``arch`` against device-library set ``libs`` (cached; a
    :class:`amdqb_tools.build.Build` whose toolchain is ``hiprtc-<libs>``)."""
    name = f"hiprtc-{libs}"
    memo_key = (name, spec, arch)
    with MEMO.lock:
        if not rebuild and memo_key in MEMO.builds:
            return MEMO.builds[memo_key]
    key = _key(tc, spec, arch, libs)
    objects = offline_root() / "hiprtc" / "objects"
    dest = objects / f"{spec.label()}-{arch}-{libs}-{key[:20]}"
    if not rebuild and (dest / "build.json").is_file() and (dest / "code.hsaco").is_file():
        info = json.loads((dest / "build.json").read_text())
        done = Build(name, spec, arch, 0, info["log"], key, dest, info["seconds"], True)
    else:
        objects.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=objects))
        try:
            start, log, rc = time.perf_counter(), "", 0
            for cmd in commands(tc, spec, arch, tmp, libs):
                proc = run(cmd, cwd=tmp)
                log += proc.stderr
                if proc.returncode:
                    rc = proc.returncode
                    break
            seconds = round(time.perf_counter() - start, 3)
            listings = sorted(tmp.glob("*.s"))
            if rc or not listings or not (tmp / "code.hsaco").is_file():
                return Build(name, spec, arch, rc or 1, log, key, None, seconds, False)
            os.replace(listings[0], tmp / "code.s")
            for p in tmp.iterdir():
                if p.name not in ("code.hsaco", "code.s"):
                    p.unlink()
            info = {"log": log, "seconds": seconds, "key": key, "format": OFFLINE_FORMAT}
            (tmp / "build.json").write_text(json.dumps(info, indent=1))
            # Only an explicit rebuild removes a finished build: another test worker may be
            # reading the same object right now.
            if rebuild and dest.exists():
                shutil.rmtree(dest, ignore_errors=True)
            try:
                os.replace(tmp, dest)
            except OSError:  # built meanwhile by another process
                pass
            done = Build(name, spec, arch, 0, log, key, dest, seconds, False)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    with MEMO.lock:
        MEMO.builds[memo_key] = done
    return done


# The router modules the hiprtc builds cover (titles of build.titled_variants): the seed shape
# (expf under the builtin header) and its sqrtsoftplus form (log1pf and sqrtf from ocml).
ROUTER_MODULES = ("router E=896 fp32 sigmoid", "router E=896 fp32 sqrtsoftplus")


def module_variants(arch: str) -> list[tuple[str, _spec.ModuleSpec]]:
    """(title, spec) of the modules the hiprtc builds cover on ``arch``, as the offline builds
    list them (:func:`amdqb_tools.build.titled_variants`): the route / align module, the router
    modules of :data:`ROUTER_MODULES`, and every serving top-k (topk.hip, at the peers' shapes)
    and router backward (router_bwd.hip) module."""
    return [
        (title, spec)
        for title, spec in titled_variants(arch)
        if title == "layout"
        or title in ROUTER_MODULES
        or spec.kernel_file in ("topk.hip", "router_bwd.hip")
    ]
