"""Test configuration.

Without a GPU the Triton kernels run on the CPU interpreter: ``TRITON_INTERPRET`` must be set before
``triton.jit`` decorates anything, so it is set here, before amdqb is imported.

The op tests (one file per op) take their kernel backends from :func:`over_backends`: on a GPU the
available ``triton`` and ``hip``; on the CPU ``triton`` (interpreter) and ``hip`` run by the
emulator of op_tests/hip_emu (marked ``emulator``), both through the public ops.
"""

import contextlib
import os
import sys
from pathlib import Path

# The checkout's amdqb_tools (AMD build tools, not installed with the package) for the AMD tests.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

# pytest-xdist workers spread over the visible GPUs (AMDQB_SPREAD_GPUS=N, set by
# scripts/gpu_check.sh on multi-GPU machines); must happen before torch initialises CUDA.
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
_spread = int(os.environ.get("AMDQB_SPREAD_GPUS", "0") or 0)
if _worker.startswith("gw") and _spread > 1:
    os.environ["CUDA_VISIBLE_DEVICES"] = str(int(_worker[2:]) % _spread)

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from amdqb import dispatch  # noqa: E402

from hip_emu.backend import active_runtime, emulated_hip_backend  # noqa: E402
from hip_emu.runtime import compiler  # noqa: E402

DEVICE = torch.device("cuda") if HAS_GPU else torch.device("cpu")

# CI=true (.ci/run sets it): a tool a test needs that is missing here (g++, clang-19 / clang-22,
# lld-22, LLVM's tools, the device libraries, Debian's hiprtc) fails the test instead of
# skipping it, so CI cannot pass by skipping what it should have checked.
CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def require(ok: bool, reason: str) -> None:
    """Skip the running test with ``reason`` unless ``ok``; under CI=true fail it instead."""
    if ok:
        return
    if CI:
        pytest.fail(f"{reason} (CI=true: a missing tool fails the run; .ci/run installs it)")
    pytest.skip(reason)


def needs(ok: bool, reason: str):
    """A mark: :func:`require` (``ok``, ``reason``) before the test runs."""
    return pytest.mark.amdqb_needs(ok=bool(ok), reason=reason)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "amdqb_needs(ok, reason): skip unless ok (under CI=true: fail)"
    )


def pytest_runtest_setup(item):
    for mark in item.iter_markers("amdqb_needs"):
        require(mark.kwargs["ok"], mark.kwargs["reason"])


# The suite's mutation check (test_mutations.py) runs op tests with a planted kernel bug.
if os.environ.get("AMDQB_TEST_MUTANT"):
    import mutants

    mutants.activate(os.environ["AMDQB_TEST_MUTANT"])


def available_backends(op: str) -> list[str]:
    """Backends that can run ``op`` on DEVICE (torch always)."""
    info = dispatch.device_info(DEVICE)
    names = []
    for name in dispatch.BACKENDS:
        ok, _ = dispatch.backend_status(name, info)
        if ok and op in getattr(dispatch._backend_module(name), "OPS", {}):
            names.append(name)
    return names


class EmulatedHip:
    """A ``backend`` parameter: ``hip`` on the CPU emulator of op_tests/hip_emu, with the
    prelude's substitutes on ``wave``-lane waves or (``arch``) its AMD branches on the AMDGCN model
    of that target (the ``backend`` fixture enters :func:`hip_emu.backend.emulated_hip_backend`)."""

    def __init__(self, wave: int, arch: str | None = None):
        self.wave = wave
        self.arch = arch

    def __repr__(self):
        return f"hip-{self.arch}" if self.arch else f"hip-emu{self.wave}"


def _emulated(op: str, waves, gcn=()) -> list:
    if op not in dispatch._backend_module("hip").OPS:
        return []
    marks = [
        pytest.mark.emulator,
        needs(compiler() is not None, "the hip emulator needs g++ (C++20)"),
    ]
    models = [EmulatedHip(w) for w in waves] + [EmulatedHip(64, a) for a in gcn]
    return [pytest.param(m, id=repr(m), marks=marks) for m in models]


# The AMDGCN targets the emulator tests that run the AMD branches use: wave64 gfx9 and wave32 gfx12.
GCN = ("gfx942", "gfx1250")


def backends(op: str, *, waves=(32,), gcn=(), only=None, emulator: bool | None = None) -> list:
    """pytest params of the kernel backends (not the torch oracle) that run ``op`` here.

    ``emulator=None``: on a GPU the available ones (``triton``, ``hip``); on the CPU ``triton``
    (interpreter) and ``hip`` executed by the emulator, once per wave size in ``waves`` (the
    prelude's substitutes) and once per AMD target in ``gcn`` (its AMD branches on the AMDGCN
    model, e.g. :data:`GCN`).
    ``emulator=True``: ``hip`` on the emulator on any machine (the emulator's own cases on CPU
    tensors, some reading its launch records). ``emulator=False``: real backends only.
    ``only``: a subset of backend names. A skip with the reasons when none is left. Tests take
    them through :func:`over_backends`."""
    if emulator:
        params = _emulated(op, waves, gcn)
    else:
        params = [n for n in available_backends(op) if n != "torch"]
        if emulator is None and not HAS_GPU:
            params += _emulated(op, waves, gcn)
        if only is not None:
            params = [p for p in params if (p if isinstance(p, str) else "hip") in only]
    if params:
        return params
    info = dispatch.device_info(DEVICE)
    reasons = "; ".join(
        f"{n}: {dispatch.backend_status(n, info)[1]}"
        for n in dispatch.BACKENDS
        if n != "torch" and (only is None or n in only)
    )
    return [
        pytest.param(None, marks=pytest.mark.skip(reason=f"no kernel backend for {op}: {reasons}"))
    ]


def over_backends(op: str, **kwargs):
    """Parametrise a test's ``backend`` argument over :func:`backends` (``op``, ``kwargs``)."""
    return pytest.mark.parametrize("backend", backends(op, **kwargs), indirect=True)


def kernel_backends(op: str) -> list:
    """The real kernel backends of ``op`` (plain names, no emulator) for a direct parametrize."""
    return backends(op, emulator=False)


@pytest.fixture
def backend(request):
    """The backend name a test passes as ``backend=``; an emulated ``hip`` parameter runs the test
    inside :func:`hip_emu.backend.emulated_hip_backend`."""
    value = getattr(request, "param", None)
    if isinstance(value, EmulatedHip):
        with emulated_hip_backend(value.wave, value.arch):
            yield "hip"
    else:
        yield value


@pytest.fixture
def emu_rt(backend):
    """The emulator runtime the test's ``hip`` backend runs on, or None (a real backend)."""
    return active_runtime()


@pytest.fixture
def warp_router(monkeypatch, emu_rt):
    """On the emulator, the router's warp-per-token kernel (amdqb_router) at every token count: the
    emulator's router tests check it against the oracles at small T, where the op would pick its
    decode form, which test_router_decode_kernel_is_bitwise_the_warp_kernel checks bitwise against
    it. A real backend runs as configured."""
    if emu_rt is not None:
        set_config(
            monkeypatch,
            {"hip.router.decode_max_tokens": 0, "hip.router.decode_max_tokens_fused": 0},
            torch.device("cpu"),
        )


def forget_build_failures() -> None:
    """Forget the dispatcher's recorded run-time build failures, their warnings and its cached
    choices (tests that fake a failing toolchain start and end clean)."""
    with dispatch._LOCK:
        dispatch._FAILURES.clear()
        dispatch._WARNED.clear()
    dispatch._select.cache_clear()


def set_config(monkeypatch, values: dict, device=None):
    """For the test, ``values`` replace the config entries of ``device``'s architecture family
    (default: the suite's device), as ``amdqb.configs.override`` does; undone by ``monkeypatch``."""
    from amdqb import configs, dispatch

    arch = dispatch.device_info(DEVICE if device is None else device).arch_family
    monkeypatch.setitem(configs._OVERRIDES, arch, configs.load(arch).with_values(values, "test"))
    return configs.load(arch)


def device_config(device=None):
    """The config (``amdqb.configs``) the launchers read on ``device`` (default: the suite's)."""
    from amdqb import devices

    return devices.arch_config(DEVICE if device is None else device)


@contextlib.contextmanager
def gpu_kernel_names():
    """Yields a list that receives the names of the GPU kernels the block runs (the torch
    profiler's; copies and fills excluded) when it exits."""
    from torch.profiler import ProfilerActivity, profile

    names: list[str] = []
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        yield names
        torch.cuda.synchronize()
    names.extend(
        ev.name
        for ev in prof.events()
        if ev.device_type == torch.autograd.DeviceType.CUDA
        and not ev.name.startswith(("Memcpy", "Memset"))
    )


@pytest.fixture
def device():
    return DEVICE


requires_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA/ROCm GPU")


def expect_declined(backend: str, op: str, expected: bool, *, skip: bool = True, **features):
    """For a test over configurations some backend declines by design: ``expected`` (the test's
    own statement of the limit) says this one is. Then the backend's capability check must decline
    it -- a check that stopped declining fails here -- and the test skips naming the reason (or,
    with ``skip=False``, gets True and moves on to its next case). Otherwise returns False: the
    test runs the op, and a check that declines what it should run fails the op call with the
    dispatcher's error (nothing turns that into a skip)."""
    if not expected:
        return False
    from amdqb.backends import calls

    check = getattr(dispatch._backend_module(backend), "LIMITS", {}).get(op)
    why = check(dispatch.device_info(DEVICE), calls.request(op, **features)) if check else None
    assert why, f"{backend} was expected to decline {op} with {features}, and accepts it"
    if skip:
        pytest.skip(f"{backend} declines {op} by design: {why}")
    return True


_LIVE_LOG = os.environ.get("AMDQB_TEST_LOG")


def pytest_runtest_logreport(report):
    """With AMDQB_TEST_LOG set, append each test's outcome, duration and (on failure) its error as
    it happens: an interrupted run still leaves every finished result behind."""
    if not _LIVE_LOG or _worker or not (report.when == "call" or report.outcome != "passed"):
        return  # under xdist the controller, which receives every report, writes the log
    line = f"{report.outcome:7s} {report.duration:8.2f}s {report.when:8s} {report.nodeid}\n"
    if report.failed:
        line += "    " + str(report.longrepr)[-3000:].replace("\n", "\n    ") + "\n"
    elif report.skipped and isinstance(report.longrepr, tuple):
        line += f"    {report.longrepr[2][:300]}\n"  # the skip reason
    with open(_LIVE_LOG, "a") as f:
        f.write(line)


def pytest_collection_modifyitems(config, items):
    """AMDQB_RESUME_FROM=<live log>[:<live log>...]: deselect the tests these logs record as passed,
    so an interrupted suite can be finished by a second run (scripts/gpu_check.sh)."""
    paths = [p for p in os.environ.get("AMDQB_RESUME_FROM", "").split(os.pathsep) if p]
    done = set()
    for path in paths:
        with open(path) as f:
            # "outcome duration when nodeid": node ids may hold spaces (parametrize ids)
            done.update(
                ln.split(None, 3)[3].rstrip("\n")
                for ln in f
                if ln.startswith("passed ") and len(ln.split(None, 3)) == 4
            )
    if not done:
        return
    deselected = [it for it in items if it.nodeid in done]
    config.hook.pytest_deselected(items=deselected)
    items[:] = [it for it in items if it.nodeid not in done]
