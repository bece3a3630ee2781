"""The Triton kernels compiled for the AMD targets by Triton's AMD backend (no AMD GPU needed), in
exactly the specialisations their launchers request.

Variants: the public op calls of :func:`op_calls` at the seed shapes (E=896, k=16, B=1000 bins; the align
and chunk shapes of the serving and TE tests), run on CPU tensors while the dispatcher sees an AMD
device of the target (its architecture family's configs) and each Triton launcher module's
kernels module is replaced by a recorder: every launch the launchers make is recorded -- kernel,
arguments, constexprs, launch options -- instead of run. The compile then goes through Triton's
own JIT specialisation (its binder over those arguments: argument types, pointer-alignment and
integer attributes, constexprs) for ``GPUTarget("hip", arch, wave)``, so what is compiled is what
the launcher would launch on that device (``HAS_BIAS`` is whether a bias was passed, every other
constexpr the launcher's own).

:func:`compile_variant` reads the code object (amdqb_tools.code_objects): wave size, LDS, VGPRs /
AGPRs / SGPRs, scratch, spills, occupancy (amdqb_tools.occupancy) and the LDS / global atomics of
the ISA. Results are cached on disk (``<cache>/triton-amd``) keyed by the kernel's source, the
specialisation, the target and Triton's version; :func:`compile_all` compiles in parallel worker
processes. Run in a process where ``TRITON_INTERPRET`` is unset (the interpreter replaces the
kernels).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from amdqb._arch import amd_arch_family, amd_lds_bytes, amd_wave_size
from amdqb.backends.hip import _spec

from . import isa
from .code_objects import inspect
from .occupancy import RULES, occupancy
from .toolchain import AMD_ARCHS

CODEGEN_FORMAT = 1  # bump when the cached result's fields change


@dataclass
class Launch:
    """One recorded launch: the op call that made it, the kernel and its arguments."""

    call: str
    kernel: object  # the @triton.jit function
    args: tuple
    kwargs: dict
    expect_lds_atomics: bool = False

    @property
    def name(self) -> str:
        return f"{self.call}:{self.kernel.__name__}"


@dataclass
class _Sink:
    launches: list = field(default_factory=list)
    call: str = ""


class _Kernel:
    def __init__(self, fn, sink):
        self.fn, self.sink = fn, sink

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            self.sink.launches.append(Launch(self.sink.call, self.fn, args, kwargs))

        return record


class _Kernels:
    """Stands in for a launcher's kernels module: its @triton.jit functions record their launches."""

    def __init__(self, module, sink):
        self._module, self._sink = module, sink

    def __getattr__(self, name):
        value = getattr(self._module, name)
        if type(value).__name__ == "JITFunction":
            return _Kernel(value, self._sink)
        return value


def _device_info(arch: str):
    from amdqb import devices

    return devices.DeviceInfo(
        "cpu",
        "amd",
        f"codegen {arch}",
        arch,
        amd_wave_size(arch),
        amd_lds_bytes(arch),
        304,
        amd_arch_family(arch),
    )


@contextlib.contextmanager
def recording(arch: str, sink: _Sink):
    """Inside: the dispatcher sees an ``arch`` device for CPU tensors and the Triton launchers
    record their launches into ``sink`` instead of running them."""
    from triton.backends.compiler import GPUTarget

    from amdqb import devices, dispatch
    from amdqb.backends.triton import aux_loss, chunks, layout, qb, router

    modules = (router, layout, qb, chunks, aux_loss)
    saved_k = {m: m.K for m in modules}
    saved_info, saved_probe = devices._device_info_cached, router.lds_histogram_is_per_element
    info = _device_info(arch)
    target = GPUTarget("hip", arch, amd_wave_size(arch))
    devices._device_info_cached = lambda device_str: info
    dispatch._select.cache_clear()
    # the router's choice of histogram kernel: the lowering probe compiled for the target, as on
    # a device of it (every AMD target lowers tl.histogram through ballots: the global variant)
    per_element = router._histogram_probe(target)
    router.lds_histogram_is_per_element = lambda device: per_element
    for m in modules:
        m.K = _Kernels(saved_k[m], sink)
    try:
        yield
    finally:
        for m in modules:
            m.K = saved_k[m]
        devices._device_info_cached = saved_info
        router.lds_histogram_is_per_element = saved_probe
        dispatch._select.cache_clear()


def op_calls():
    """(name, call) of the op calls whose launches are compiled; each call runs on CPU tensors."""
    import torch

    import amdqb

    E, k, T, B = 896, 16, 256, 1000
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(T, E, generator=g)
    bias = torch.randn(E, generator=g) * 0.05
    hist = torch.zeros(E, B, dtype=torch.int32)
    bounds = torch.tensor([-1.0, 1.0])
    ids = torch.randint(0, E, (4096, k), generator=g, dtype=torch.int32)
    t = "triton"

    def router(**kw):
        return lambda: amdqb.fused_topk_with_score_function(logits, k, backend=t, **kw)

    def qb_router(mode):
        return lambda: amdqb.fused_topk_with_score_function(
            logits, k, expert_bias=bias, qb_histogram=hist.clone(), qb_bin_bounds=bounds,
            qb_histogram_mode=mode, backend=t,
        )  # fmt: skip

    def train_step():
        z = logits[:64].clone().requires_grad_(True)
        probs, _ = amdqb.fused_topk_with_score_function(z, k, expert_bias=bias, backend=t)
        probs.sum().backward()

    def aux(score, e, kk):
        def call():
            z = torch.randn(128, e, generator=g).requires_grad_(True)
            routing_map, scores = amdqb.fused_compute_score_for_moe_aux_loss(
                z, kk, score, backend=t
            )
            tokens = routing_map.sum(0).to(torch.int32)
            loss = amdqb.fused_moe_aux_loss(scores, tokens, 128, e, kk, 1e-2, backend=t)
            loss.backward()

        return call

    def chunks(c, h, dtype):
        def call():
            sizes = torch.full((c,), 4, dtype=torch.int32)
            order = torch.randperm(c, generator=g).to(torch.int32)
            padded = torch.full((c,), 8, dtype=torch.int32)
            x = torch.zeros(4 * c, h, dtype=dtype)
            amdqb.moe_sort_chunks_and_pad(x, sizes, order, padded, 8 * c, backend=t)

        return call

    return [
        ("router_sigmoid_bias_bytemap", router(expert_bias=bias)),
        ("router_sigmoid_bitmap", router(routing_map_format="bitmap_u8")),
        ("router_softmax_pre_grouped", router(
            score_function="softmax", use_pre_softmax=True, num_groups=8, group_topk=4
        )),  # fmt: skip
        ("router_qb_fused_atomic", qb_router("fused_atomic")),
        ("router_qb_two_kernel", qb_router("two_kernel")),
        ("router_train_step", train_step),
        ("biased_topk_sigmoid", lambda: amdqb.biased_topk(logits, k, bias, backend=t)),
        ("route_rows_lds_capacity", lambda: amdqb.moe_route_rows(
            ids, E, capacity=64, impl="lds", backend=t
        )),  # fmt: skip
        ("route_rows_atomic", lambda: amdqb.moe_route_rows(ids, E, impl="atomic", backend=t)),
        ("align_block_size", lambda: amdqb.moe_align_block_size(ids, 64, E, backend=t)),
        ("qb_step", lambda: amdqb.qb_step_(bias.clone(), hist, bounds.clone(), k, 0.5, backend=t)),
        ("aux_loss_sigmoid", aux("sigmoid", E, k)),
        ("aux_loss_softmax", aux("softmax", 1024, 32)),
        ("chunks_bf16_h2048", chunks(128, 2048, torch.bfloat16)),
    ]


# Kernels that privatise a histogram in LDS: their ISA must hold LDS atomics.
LDS_HISTOGRAM_KERNELS = frozenset(
    {"_route_lds_kernel", "_block_hist_kernel", "_align_assign_kernel", "_block_assign_kernel"}
)


def record_launches(arch: str) -> list[Launch]:
    """Every distinct launch the :func:`op_calls` make on ``arch`` (the launchers' specialisation
    for its architecture family)."""
    sink = _Sink()
    with recording(arch, sink):
        for name, call in op_calls():
            sink.call = name
            call()
    out, seen = [], set()
    for launch in sink.launches:
        key = (launch.kernel.__name__, _spec_key(launch))
        if key not in seen:
            seen.add(key)
            name = launch.kernel.__name__
            launch.expect_lds_atomics = name in LDS_HISTOGRAM_KERNELS or (
                name == "_qb_hist_kernel" and bool(launch.kwargs.get("LDS"))
            )
            out.append(launch)
    return out


def _describe(v):
    import torch

    if isinstance(v, torch.Tensor):
        return ("tensor", str(v.dtype), v.data_ptr() % 16 == 0)
    if isinstance(v, (bool, int, float, str)) or v is None:
        return (
            type(v).__name__,
            v if not isinstance(v, int) or isinstance(v, bool) else _int_class(v),
        )
    return (type(v).__name__, repr(v))


def _int_class(v: int):
    """What Triton's specialisation keeps of an integer argument: 1, divisibility by 16, width."""
    return (v == 1, v % 16 == 0, -(2**31) <= v < 2**31)


def _spec_key(launch: Launch) -> str:
    params = [p.name for p in launch.kernel.params]
    constexprs = {p.name for p in launch.kernel.params if p.is_constexpr}
    parts = []
    for i, v in enumerate(launch.args):
        name = params[i]
        parts.append((name, repr(v) if name in constexprs else _describe(v)))
    for name, v in sorted(launch.kwargs.items()):
        parts.append((name, repr(v) if name in constexprs or name not in params else _describe(v)))
    return repr(parts)


def _cache_key(launch: Launch, arch: str) -> str:
    import triton

    material = {
        "format": CODEGEN_FORMAT,
        "triton": triton.__version__,
        "src": launch.kernel.src,
        "kernel": launch.kernel.__name__,
        "spec": _spec_key(launch),
        "arch": arch,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def cache_root() -> Path:
    return _spec.cache_dir() / "triton-amd"


def _compile(launch: Launch, arch: str) -> dict:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.kernel
    target = GPUTarget("hip", arch, amd_wave_size(arch))
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(launch.kwargs, debug=False)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, kwargs, bound, specialization, options
    )
    src = ASTSource(fn, signature, constexprs, attrs)
    compiled = compile(src, target=target, options=options.__dict__)
    isa_text = compiled.asm["amdgcn"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.hsaco"
        path.write_bytes(compiled.asm["hsaco"])
        co = inspect(path)
    (kernel,) = co.kernels.values()
    occ = occupancy(arch, kernel)
    return {
        "name": launch.name,
        "arch": arch,
        "wave_size": kernel.wave,
        "num_warps": int(compiled.metadata.num_warps),
        "lds_bytes": int(compiled.metadata.shared),
        "lds_budget": RULES[arch].lds_per_workgroup,
        "vgprs": kernel.vgprs,
        "agprs": kernel.agprs,
        "sgprs": kernel.sgprs,
        "scratch": kernel.scratch,
        "spills": list(kernel.spills),
        "waves": occ.waves,
        "limit": occ.limit,
        "lds_atomics": isa.counts(kernel.code)["lds_atomic"],
        "global_atomics": isa.counts(kernel.code)["global_atomic"],
        "isa_lines": isa_text.count("\n"),
        "expect_lds_atomics": launch.expect_lds_atomics,
    }


def compile_variant(launch: Launch, arch: str) -> dict:
    """The compile report of ``launch`` for ``arch`` (cached; ``error`` set where it failed)."""
    path = cache_root() / f"{launch.kernel.__name__}-{arch}-{_cache_key(launch, arch)[:24]}.json"
    if path.is_file():
        return json.loads(path.read_text())
    try:
        row = _compile(launch, arch)
    except Exception as exc:  # reported; the test fails on it
        return {"name": launch.name, "arch": arch, "error": repr(exc)[:3000]}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(row))
    os.replace(tmp, path)
    return row


_WORK: list = []


def _work(i: int) -> dict:
    launch, arch = _WORK[i]
    return compile_variant(launch, arch)


def compile_all(archs=AMD_ARCHS, jobs: int | None = None) -> list[dict]:
    """Compile reports of every recorded launch on every target of ``archs``, in parallel."""
    _WORK[:] = [(launch, arch) for arch in archs for launch in record_launches(arch)]
    jobs = max(1, jobs or os.cpu_count() or 2)
    if jobs == 1:
        return [_work(i) for i in range(len(_WORK))]
    ctx = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        return list(pool.map(_work, range(len(_WORK))))


def main() -> int:
    """Print the compile reports as one JSON list (op_tests/test_amd_codegen.py runs this)."""
    rows = compile_all()
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
