"""torch.library registration with an eager bypass.

Every kernel-level call goes through :func:`kernel_op`: under ``torch.compile`` it is a
``torch.library.custom_op`` (``amdqb::<name>``) with a fake implementation, so graphs capture it
without a break; in eager mode the registration layer is skipped and the Python body runs directly,
because the custom-op dispatch boundary costs tens of microseconds per call, more than the routing
kernels themselves.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from dataclasses import fields
from typing import Optional

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


class CallOp:
    """A kernel-level op whose configuration is a call type (``amdqb.backends.calls``):
    ``op(call, *tensors, backend=...)`` runs ``impl(name, backend)(call, *tensors)`` eagerly; while
    compiling it is the custom op ``amdqb::<name>`` whose schema is flat -- the tensors, the
    call's fields in declaration order, then the backend token -- generated from the call type,
    so no signature is written twice."""

    def __init__(self, name: str, call_type: type, tensors: tuple[str, ...], op):
        self.name = name
        self.call_type = call_type
        self.tensors = tensors
        self.op = op

    def __call__(self, call, *tensors, backend: str):
        if len(tensors) != len(self.tensors):
            raise TypeError(f"{self.name} takes the tensors {self.tensors}, got {len(tensors)}")
        if _is_compiling():
            return self.op(*tensors, *(getattr(call, f.name) for f in fields(call)), backend)
        return impl(self.name, backend)(call, *tensors)


def _schema_annotation(hint):
    """A call field's type as torch.library's schema inference takes it (``X | None`` and
    ``Optional[X]`` both as ``Optional[X]``)."""
    args = typing.get_args(hint)
    if type(None) in args and len(args) == 2:
        return Optional[next(a for a in args if a is not type(None))]
    return hint


def call_op(name: str, call_type: type, tensors: tuple[str, ...], mutates_args: tuple[str, ...]):
    """Register ``amdqb::name`` for a call type and its tensors (every tensor Optional: the call
    says which are used); returns the :class:`CallOp`."""
    hints = typing.get_type_hints(call_type)
    names = [f.name for f in fields(call_type)]
    params = [
        inspect.Parameter(
            t, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Optional[torch.Tensor]
        )
        for t in tensors
    ]
    params += [
        inspect.Parameter(
            n, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=_schema_annotation(hints[n])
        )
        for n in names
    ]
    params.append(
        inspect.Parameter("backend", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str)
    )
    nt = len(tensors)

    def body(*args, **kwargs):
        bound = signature.bind(*args, **kwargs).args
        call = call_type(**dict(zip(names, bound[nt:-1])))
        impl(name, bound[-1])(call, *bound[:nt])

    signature = inspect.Signature(params, return_annotation=None)
    body.__signature__ = signature
    body.__name__ = name
    op = torch.library.custom_op(f"amdqb::{name}", body, mutates_args=mutates_args)
    op.register_fake(lambda *args, **kwargs: None)
    return CallOp(name, call_type, tensors, op)


# The backend implementation of a kernel-level op for the token ``dispatch.kernel_backend`` gave
# (a backend's name, or "<name>><fallback>": the guarded callable that runs the fallback should the
# backend fail to build its kernels). One dict lookup per call.
impl = dispatch.implementation
