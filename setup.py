"""Build hooks for amdqb (metadata lives in pyproject.toml).

* Non-editable builds (wheels, ``pip install .``) copy ``hip_src`` into the package as
  ``amdqb/_hip_src``; the hip backend compiles from there at run time (hiprtc / NVRTC). Editable
  installs copy nothing: the backend then reads ``<repo>/hip_src`` directly, so edits take effect.
* ``AMDQB_ROCM_ARCHS="gfx942;gfx950"`` with ``hipcc`` on PATH (or ``$ROCM_PATH/bin``) additionally
  compiles code objects ahead of time into ``amdqb/_hip_prebuilt`` (with each architecture's
  ``amdqb/configs`` constants): the layout kernels, and the router
  for the expert counts in ``AMDQB_PREBUILD_EXPERTS`` (default ``896``) in fp32/fp16/bf16 with
  sigmoid scores. The runtime uses a prebuilt object only when its name (a hash of the sources,
  arch, wave size and flags) matches; anything else is compiled on first use as usual.
* The sdist carries ``hip_src``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py as _build_py
from setuptools.command.sdist import sdist as _sdist

HERE = Path(__file__).resolve().parent
HIP_SRC = HERE / "hip_src"


def _load(name: str, path: Path):
    """A module of amdqb loaded from its file, without importing amdqb (which needs torch)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _load_spec():
    return _load("_amdqb_hip_spec", HERE / "amdqb" / "backends" / "hip" / "_spec.py")


def _load_configs():
    return _load("_amdqb_configs", HERE / "amdqb" / "configs" / "__init__.py")


def _load_arch():
    """The runtime's wave-size and config-family rule (``amdqb/_arch.py``)."""
    return _load("_amdqb_arch", HERE / "amdqb" / "_arch.py")


def _hipcc() -> str | None:
    found = shutil.which("hipcc")
    if found:
        return found
    rocm = os.environ.get("ROCM_PATH", "/opt/rocm")
    candidate = Path(rocm) / "bin" / "hipcc"
    return str(candidate) if candidate.is_file() else None


def aot_compile(out_dir: Path, src_root: Path) -> list[Path]:
    """Code objects for AMDQB_ROCM_ARCHS (empty when unset or hipcc is missing)."""
    archs = [a.strip() for a in os.environ.get("AMDQB_ROCM_ARCHS", "").replace(",", ";").split(";")]
    archs = [a for a in archs if a]
    hipcc = _hipcc()
    if not archs:
        return []
    if hipcc is None:
        print("amdqb: AMDQB_ROCM_ARCHS is set but hipcc was not found; skipping AOT kernels")
        return []
    sp = _load_spec()
    configs = _load_configs()
    rules = _load_arch()
    experts = os.environ.get("AMDQB_PREBUILD_EXPERTS", "896").replace(",", ";").split(";")
    out_dir.mkdir(parents=True, exist_ok=True)
    built = []
    for arch in archs:
        base = rules.base_arch(arch)
        wave = rules.amd_wave_size(base)
        cfg = configs.load(rules.amd_arch_family(base))  # the runtime's config of this arch
        modules = [sp.layout_module(cfg)] + [
            sp.router_module(int(e), dtype, "sigmoid", cfg)
            for e in experts
            if e.strip()
            for dtype in ("float32", "float16", "bfloat16")
        ]
        for module in modules:
            out = out_dir / sp.prebuilt_name(module, base, wave, src_root)
            cmd = [
                hipcc,
                "--genco",
                *sp.hip_flags(base, wave, module),
                f"-I{src_root / 'include'}",
                "-o",
                str(out),
                str(src_root / "kernels" / module.kernel_file),
            ]
            print("amdqb:", " ".join(cmd))
            subprocess.run(cmd, check=True)
            built.append(out)
    return built


class build_py(_build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # the runtime reads <repo>/hip_src
        package = Path(self.build_lib) / "amdqb"
        target = package / "_hip_src"
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(HIP_SRC, target, ignore=shutil.ignore_patterns("*.o", "*.s", "*~"))
        aot_compile(package / "_hip_prebuilt", target)


class sdist(_sdist):
    def add_defaults(self):
        super().add_defaults()
        for path in sorted(HIP_SRC.rglob("*")):
            if path.is_file():
                self.filelist.append(path.relative_to(HERE).as_posix())


setup(cmdclass={"build_py": build_py, "sdist": sdist})
