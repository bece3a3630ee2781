"""AMD architecture rules shared by the runtime, ``setup.py`` and the build tools.

The one place that says which wave size an AMD target runs and which config family it reads.
Standard library only, no package-relative import: ``setup.py`` loads this file by path, without
importing amdqb (which needs torch).

* Wave size: CDNA (gfx9xx: gfx90a, gfx942, gfx950) is wave64 only (it ignores
  ``-mno-wavefrontsize64``); gfx10xx, gfx11xx and gfx12xx run wave32, their default and what the
  runtime compiles for (gfx1250 has no wave64).
* LDS a workgroup may use: 160 KiB on gfx950 (which raised it) and gfx1250 (320 KiB per WGP, of
  which a workgroup in CU mode may use half); 64 KiB on gfx90a / gfx942 and the RDNA parts.
* Config family (``amdqb/configs/<family>.json``): gfx942, gfx950 and gfx1250 have their own;
  other CDNA parts read ``cdna``, RDNA parts ``rdna`` (neither file exists: the defaults).
"""

from __future__ import annotations

import re

_GFX = re.compile(r"gfx(\d+)[0-9a-f]{2}")
OWN_CONFIG = ("gfx942", "gfx950", "gfx1250")
_LDS_BYTES = {"gfx950": 160 * 1024, "gfx1250": 160 * 1024}
_DEFAULT_LDS_BYTES = 64 * 1024


def base_arch(arch: str) -> str:
    """``arch`` without its feature suffixes: ``gfx942:sramecc+:xnack-`` -> ``gfx942``."""
    return str(arch).split(":")[0]


def gfx_major(arch: str) -> int:
    """The major version of ``arch`` (gfx942 -> 9, gfx1250 -> 12); ValueError if not a gfx name."""
    m = _GFX.fullmatch(base_arch(arch))
    if not m:
        raise ValueError(f"arch must look like gfx942 / gfx1100, got {arch!r}")
    return int(m.group(1))


def amd_wave_size(arch: str) -> int:
    """The wave size the runtime uses on ``arch`` (feature suffixes allowed): 64 on gfx9, 32 on
    gfx10, gfx11 and gfx12. ValueError for anything else."""
    major = gfx_major(arch)
    if major == 9:
        return 64
    if major in (10, 11, 12):
        return 32
    raise ValueError(f"arch {arch!r}: no wave size known for gfx{major}")


def amd_lds_bytes(arch: str) -> int:
    """LDS bytes one workgroup may use on ``arch`` (feature suffixes allowed)."""
    return _LDS_BYTES.get(base_arch(arch), _DEFAULT_LDS_BYTES)


def amd_arch_family(arch: str) -> str:
    """The ``amdqb/configs`` family of ``arch`` (feature suffixes allowed)."""
    base = base_arch(arch)
    if base in OWN_CONFIG:
        return base
    return "cdna" if base.startswith("gfx9") else "rdna"
