"""The ``triton`` backend: portable Triton kernels for NVIDIA and AMD GPUs.

One launcher module per op family (``router.py``, ``layout.py``, ``chunks.py``, ``qb.py``,
``aux_loss.py``), the ``@triton.jit`` bodies in the private ``_*_kernels.py`` modules; launch
shapes come from the ``triton.*`` entries of ``amdqb/configs``. On a machine without a GPU the
kernels run only under ``TRITON_INTERPRET=1`` (the test suite sets it), which is how CI checks them
against the oracles.
"""

from __future__ import annotations

from . import aux_loss, chunks, layout, qb, router
from ._common import interpreting

_MODULES = (router, layout, chunks, qb, aux_loss)
OPS = {name: fn for module in _MODULES for name, fn in module.OPS.items()}
# the capability checks, declared next to each op's launcher
LIMITS = {name: fn for module in _MODULES for name, fn in getattr(module, "LIMITS", {}).items()}


def availability(info) -> tuple[bool, str]:
    try:
        import triton
    except ImportError as exc:  # pragma: no cover - triton is a hard dependency
        return False, f"triton is not importable: {exc}"
    if info.vendor == "cpu":
        if interpreting():
            return True, "TRITON_INTERPRET=1 (CPU interpreter)"
        return False, "no GPU (set TRITON_INTERPRET=1 to run the kernels on the CPU interpreter)"
    return True, f"triton {triton.__version__} on {info.arch}"
