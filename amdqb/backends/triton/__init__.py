"""The ``triton`` backend: portable Triton kernels for NVIDIA and AMD GPUs.

Launchers live in the public modules of this folder (``router.py``, ``layout.py``,
``aux_loss.py``); the ``@triton.jit`` bodies live in the private ``_*_kernels.py`` modules;
per-architecture launch configurations in ``configs.py``. On a machine without a GPU the kernels
run only under ``TRITON_INTERPRET=1`` (the test suite sets it), which is how CI checks them against
the oracles.
"""

from __future__ import annotations

import os

from . import aux_loss, layout, router
from .router import score_values  # the router's own activations (tests compare on them)

OPS = {**router.OPS, **layout.OPS, **aux_loss.OPS}
_UNSUPPORTED = {**router.UNSUPPORTED, **layout.UNSUPPORTED, **aux_loss.UNSUPPORTED}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def availability(info) -> tuple[bool, str]:
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # pragma: no cover - triton is a hard dependency
        return False, f"triton is not importable: {exc}"
    if info.vendor == "cpu":
        if interpreting():
            return True, "TRITON_INTERPRET=1 (CPU interpreter)"
        return False, "no GPU (set TRITON_INTERPRET=1 to run the kernels on the CPU interpreter)"
    return True, f"triton {triton.__version__} on {info.arch}"


def unsupported(op: str, info, features: dict):
    """Reason this backend declines a configuration, or None."""
    hook = _UNSUPPORTED.get(op)
    return hook(info, features) if hook else None
