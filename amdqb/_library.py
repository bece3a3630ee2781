"""torch.library registration with an eager bypass.

Every kernel-level call goes through :func:`kernel_op`: under ``torch.compile`` it is a
``torch.library.custom_op`` (``amdqb::<name>``) with a fake implementation, so graphs capture it
without a break; in eager mode the registration layer is skipped and the Python body runs directly,
because the custom-op dispatch boundary costs tens of microseconds per call, more than the routing
kernels themselves.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import dispatch


def _is_compiling() -> bool:
    return bool(torch.compiler.is_compiling())


class KernelOp:
    """A callable that is the registered custom op while compiling and the plain body otherwise."""

    def __init__(self, body: Callable, op):
        self.body = body
        self.op = op
        self.__doc__ = body.__doc__

    def __call__(self, *args):
        if _is_compiling():
            return self.op(*args)
        return self.body(*args)


def kernel_op(name: str, mutates_args: tuple[str, ...], fake: Callable | None = None):
    """Register ``body`` as ``amdqb::name``; ``fake`` defaults to a no-op (pure out-parameter ops)."""

    def deco(body: Callable) -> KernelOp:
        op = torch.library.custom_op(f"amdqb::{name}", body, mutates_args=mutates_args)

        def _noop_fake(*args, **kwargs):
            return None

        op.register_fake(fake or _noop_fake)
        return KernelOp(body, op)

    return deco


# The backend implementation of a kernel-level op for the token ``dispatch.kernel_backend`` gave
# (a backend's name, or "<name>><fallback>": the guarded callable that runs the fallback should the
# backend fail to build its kernels). One dict lookup per call.
impl = dispatch.implementation
