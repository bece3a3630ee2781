"""Test configuration.

Without a GPU the Triton kernels run on the CPU interpreter: ``TRITON_INTERPRET`` must be set before
``triton.jit`` decorates anything, so it is set here, before amdqb is imported.
"""

import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import amdqb  # noqa: E402
from amdqb import dispatch  # noqa: E402

DEVICE = torch.device("cuda") if HAS_GPU else torch.device("cpu")


def available_backends(op: str) -> list[str]:
    """Backends that can run ``op`` on DEVICE (torch always)."""
    info = dispatch.device_info(DEVICE)
    names = []
    for name in dispatch.BACKENDS:
        ok, _ = dispatch.backend_status(name, info)
        if ok and op in getattr(dispatch._backend_module(name), "OPS", {}):
            names.append(name)
    return names


def kernel_backends(op: str) -> list:
    """pytest params for the non-oracle backends of ``op``; a skip with the reason when none."""
    names = [n for n in available_backends(op) if n != "torch"]
    if names:
        return names
    info = dispatch.device_info(DEVICE)
    reasons = "; ".join(
        f"{n}: {dispatch.backend_status(n, info)[1]}" for n in dispatch.BACKENDS if n != "torch"
    )
    return [
        pytest.param(None, marks=pytest.mark.skip(reason=f"no kernel backend for {op}: {reasons}"))
    ]


@pytest.fixture
def device():
    return DEVICE


requires_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA/ROCm GPU")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """A test that forces a backend on a configuration the backend declines (its ``unsupported``
    hook, e.g. grouped Top-k on ``hip``) is reported as skipped, with the dispatcher's reason."""
    outcome = yield
    excinfo = outcome.excinfo
    if excinfo and isinstance(excinfo[1], RuntimeError) and "no backend can run" in str(excinfo[1]):
        outcome.force_exception(pytest.skip.Exception(str(excinfo[1]), _use_item_location=True))
