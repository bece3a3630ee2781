"""Every hip_src kernel compiles for AMD (gfx942 wave64, gfx1100 / gfx1201 wave32) with Debian's
clang-19 and the HIP headers of libamdhip64-dev, for NVIDIA sm_90 with nvcc, and with NVRTC through
the backend's own compiler class when cuda-python and an NVRTC library are installed (NVRTC needs
no GPU). The flags are the runtime's (``amdqb.backends.hip._spec``), so what compiles here is what
hiprtc / NVRTC compile on a device.

ISA checks (AMDGCN): the ``lds`` route kernel privatises its histogram in LDS (``ds_add``) and has
a single global atomic site, in the per-expert interval-reservation loop (the "old" kernel's
single site is executed once per route); the QB two-kernel histogram uses LDS atomics and one
flush site; wave sizes match the targets; the route kernels use no scratch.

hiprtc itself cannot run here (no ROCm runtime on these machines); nothing here executes a kernel.
"""

import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from amdqb.backends.hip import _spec

ROOT = _spec.source_root()
AMD_TARGETS = {"gfx942": 64, "gfx1100": 32, "gfx1201": 32}
MODULES = [
    _spec.ROUTE_MODULE,
    _spec.router_module(896, "float32", "sigmoid"),
    _spec.router_module(896, "bfloat16", "sigmoid"),
    _spec.router_module(129, "float16", "sqrtsoftplus"),
    _spec.router_module(17, "float32", "softmax"),
    _spec.router_module(2048, "bfloat16", "sigmoid"),
]


def _clang():
    for name in (os.environ.get("AMDQB_CLANG", ""), "clang++-19", "clang++"):
        path = shutil.which(name) if name else None
        if path:
            out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
            if "version 19" in out or name == os.environ.get("AMDQB_CLANG"):
                return path
    return None


def _hip_headers() -> bool:
    return any(
        Path(p, "hip", "hip_runtime.h").is_file() for p in ("/usr/include", "/opt/rocm/include")
    )


CLANG = _clang()
NVCC = shutil.which("nvcc") or (
    "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").is_file() else None
)
needs_clang = pytest.mark.skipif(
    CLANG is None or not _hip_headers(),
    reason="needs clang++-19 and the HIP headers (apt-get install clang-19 libamdhip64-dev)",
)
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="needs nvcc (CUDA toolkit)")


def compile_amd(spec, arch, out_dir):
    wave = AMD_TARGETS[arch]
    out = Path(out_dir) / f"{spec.label()}_{arch}.s"
    cmd = [
        CLANG,
        "-x",
        "hip",
        "--cuda-device-only",
        "-nogpulib",
        "-S",
        *_spec.hip_flags(arch, wave, spec),
        f"-I{ROOT / 'include'}",
        "-o",
        str(out),
        str(ROOT / "kernels" / spec.kernel_file),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return spec, arch, proc.returncode, proc.stderr[-6000:], out


def parse_functions(asm: str) -> dict:
    """{kernel: {"lines": [...], "meta": {...}}} of an AMDGCN assembly listing."""
    funcs, current = {}, None
    for line in asm.splitlines():
        m = re.match(r"^(amdqb_\w+):", line)
        if m:
            current = m.group(1)
            funcs[current] = {"lines": [], "meta": {}}
            continue
        if current and line.startswith(".Lfunc_end"):
            current = None
            continue
        if current:
            funcs[current]["lines"].append(line)
    # Kernel metadata (YAML): .name / .wavefront_size / .private_segment_fixed_size / LDS.
    for block in (
        asm.split("  - .agpr_count")[1:] if ".agpr_count" in asm else asm.split("  - .args:")[1:]
    ):
        name = re.search(r"\.name:\s+(amdqb_\w+)", block)
        if not name or name.group(1) not in funcs:
            continue
        meta = funcs[name.group(1)]["meta"]
        for key in ("wavefront_size", "private_segment_fixed_size", "group_segment_fixed_size"):
            m = re.search(rf"\.{key}:\s+(\d+)", block)
            if m:
                meta[key] = int(m.group(1))
    return funcs


GLOBAL_ATOMIC = re.compile(r"^\s+(global|flat|buffer)_atomic_add")
BARRIER = re.compile(r"^\s+s_barrier(_signal)?(\s|$)")  # gfx12 splits it: signal + wait
LDS_ATOMIC = re.compile(r"^\s+ds_add(_rtn)?_u32")


def count(lines, pattern):
    return sum(1 for line in lines if re.search(pattern, line))


@pytest.fixture(scope="module")
def amd_builds():
    if CLANG is None or not _hip_headers():
        pytest.skip(
            "needs clang++-19 and the HIP headers (apt-get install clang-19 libamdhip64-dev)"
        )
    out_dir = tempfile.mkdtemp(prefix="amdqb_hip_compile_")
    jobs = [(spec, arch) for spec in MODULES for arch in AMD_TARGETS]
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        results = list(pool.map(lambda j: compile_amd(j[0], j[1], out_dir), jobs))
    builds = {}
    for spec, arch, rc, err, out in results:
        builds[(spec, arch)] = {
            "rc": rc,
            "stderr": err,
            "funcs": parse_functions(out.read_text()) if rc == 0 else {},
        }
    return builds


@needs_clang
def test_every_kernel_compiles_for_gfx942_gfx1100_gfx1201(amd_builds):
    failed = {f"{s.label()}@{a}": b["stderr"] for (s, a), b in amd_builds.items() if b["rc"]}
    assert not failed, failed
    for (spec, arch), build in amd_builds.items():
        expected = (
            {"amdqb_router", "amdqb_qb_hist", "amdqb_scores", "amdqb_router_decode"}
            if spec.kernel_file == "router.hip"
            else {
                f"amdqb_route_{k}_{t}"
                for k in ("atomic", "lds", "det_hist", "det_rank", "compact")
                for t in ("i32", "i64")
            }
            | {"amdqb_route_det_scan", "amdqb_route_finalize"}
            | {f"amdqb_align_rank_{t}" for t in ("i32", "i64")}
        )
        assert expected <= set(build["funcs"]), (spec, arch, sorted(build["funcs"]))


@needs_clang
def test_wave_size_metadata(amd_builds):
    for (spec, arch), build in amd_builds.items():
        for name, f in build["funcs"].items():
            assert f["meta"].get("wavefront_size") == AMD_TARGETS[arch], (arch, name, f["meta"])


@needs_clang
@pytest.mark.parametrize("arch", sorted(AMD_TARGETS))
@pytest.mark.parametrize("ids", ["i32", "i64"])
def test_lds_route_kernel_uses_lds_atomics_and_one_reservation_per_expert(amd_builds, arch, ids):
    funcs = amd_builds[(_spec.ROUTE_MODULE, arch)]["funcs"]
    new = funcs[f"amdqb_route_lds_{ids}"]["lines"]
    old = funcs[f"amdqb_route_atomic_{ids}"]["lines"]
    # old: one global atomic site, executed once per route; no LDS, no barrier.
    assert count(old, GLOBAL_ATOMIC) == 1
    assert count(old, LDS_ATOMIC) == 0 and count(old, BARRIER) == 0
    # new: LDS histogram (ds_add) + LDS ranks (ds_add_rtn), three barriers, and in the per-expert
    # loop (unrolled over a batch of 4 experts per thread) two global sites per expert: the interval
    # reservation (returns the base) and the accepted-count reduction after it.
    assert count(new, r"^\s+ds_add_u32") >= 1
    assert count(new, r"^\s+ds_add_rtn_u32") >= 1
    assert count(new, LDS_ATOMIC) >= 2 * _spec.ROUTE_ITEMS
    assert count(new, BARRIER) == 3
    sites = [i for i, line in enumerate(new) if GLOBAL_ATOMIC.search(line)]
    ret = [i for i in sites if re.search(r"_rtn|\b(glc|sc0)\b|ATOMIC_RETURN", new[i])]
    assert len(ret) == 4 and len(sites) == 8, [new[i] for i in sites]
    # The batch is in flight at once: no base is written back to LDS (which waits for the atomic's
    # result) before the last reservation is issued.
    assert not any(re.search(r"^\s+ds_(store|write)", line) for line in new[ret[0] : ret[-1]])
    # The sites sit in the per-expert loop: its loop body reads the LDS histogram (the count to
    # reserve) and writes the interval base back; it never loads route ids from global memory.
    header = max(i for i in range(ret[0]) if "Loop Header" in new[i])
    body = new[header : sites[-1] + 1]
    assert any(re.search(r"^\s+ds_(load|read)", line) for line in body), body
    assert any(re.search(r"^\s+ds_(store|write)", line) for line in body), body
    assert not any(re.search(r"^\s+global_load", line) for line in body), body
    meta = funcs[f"amdqb_route_lds_{ids}"]["meta"]
    assert meta.get("private_segment_fixed_size") == 0


@needs_clang
@pytest.mark.parametrize("arch", sorted(AMD_TARGETS))
def test_qb_two_kernel_histogram_uses_lds_atomics(amd_builds, arch):
    spec = _spec.router_module(896, "float32", "sigmoid")
    hist = amd_builds[(spec, arch)]["funcs"]["amdqb_qb_hist"]["lines"]
    assert count(hist, LDS_ATOMIC) >= 1
    assert count(hist, GLOBAL_ATOMIC) == 1  # the flush of non-zero bins
    assert count(hist, BARRIER) == 2  # zeroed; counted
    # the vector form reads 4 experts' logits with one load: 16 bytes of fp32, 8 of bf16
    wide = {"float32": r"global_load_(dwordx4|b128)\b", "bfloat16": r"global_load_(dwordx2|b64)\b"}
    for dtype, pattern in wide.items():
        lines = amd_builds[(_spec.router_module(896, dtype, "sigmoid"), arch)]["funcs"]
        assert count(lines["amdqb_qb_hist"]["lines"], re.compile(pattern)) >= 1, (dtype, arch)
    router = amd_builds[(spec, arch)]["funcs"]["amdqb_router"]
    # fused_atomic epilogue: one global atomic per (token, expert), unrolled over the lane's row.
    assert count(router["lines"], GLOBAL_ATOMIC) == -(-896 // 32)
    assert router["meta"].get("group_segment_fixed_size", 0) <= 64 * 1024


@needs_clang
def test_decode_and_histogram_kernels_use_no_scratch(amd_builds):
    """The decode-form Top-k (one block per token) and the QB histogram pass keep their per-thread
    arrays in registers on every AMD target, for every router module (E up to 2048; the histogram
    pass has a body in the sigmoid modules only)."""
    for (spec, arch), build in amd_builds.items():
        if spec.kernel_file != "router.hip":
            continue
        for name in ("amdqb_router_decode", "amdqb_qb_hist"):
            meta = build["funcs"][name]["meta"]
            assert meta.get("private_segment_fixed_size") == 0, (spec.label(), arch, name, meta)


@needs_clang
def test_route_kernels_use_no_scratch(amd_builds):
    for arch in AMD_TARGETS:
        for name, f in amd_builds[(_spec.ROUTE_MODULE, arch)]["funcs"].items():
            assert f["meta"].get("private_segment_fixed_size") == 0, (arch, name)


# ------------------------------------------------------------------------------------------------
# NVIDIA
# ------------------------------------------------------------------------------------------------
def compile_nvcc(spec, out_dir):
    out = Path(out_dir) / f"{spec.label()}.cubin"
    flags = [f for f in _spec.nvrtc_flags("sm_90", spec) if not f.startswith("--gpu-arch")]
    cmd = [NVCC, "-arch=sm_90", "-x", "cu", "-cubin", "-O3", *flags, f"-I{ROOT / 'include'}"]
    cmd += ["-Xptxas", "-v", "-o", str(out), str(ROOT / "kernels" / spec.kernel_file)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return spec, proc.returncode, proc.stdout + proc.stderr


@needs_nvcc
def test_every_kernel_compiles_for_sm90_with_nvcc():
    out_dir = tempfile.mkdtemp(prefix="amdqb_nvcc_")
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda s: compile_nvcc(s, out_dir), MODULES))
    for spec, rc, log in results:
        assert rc == 0, (spec.label(), log[-6000:])
        # ptxas -v: the route kernels keep everything in registers; the E=896 router, whose
        # registers are capped for occupancy (AMDQB_ROUTER_MIN_BLOCKS), spills at most a few
        # loop-invariant words (ptxas 13: 40 bytes).
        if spec.kernel_file == "layout.hip" or "896" in spec.label():
            spills = [int(s) for s in re.findall(r"(\d+) bytes spill stores", log)]
            limit = 64 if spec.kernel_file == "router.hip" else 0
            assert spills and all(s <= limit for s in spills), (spec.label(), log[-3000:])


def _cuobjdump():
    """cuobjdump from the toolkit, else the copy Triton's NVIDIA backend ships."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton

        path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        return str(path) if path.is_file() else None
    except ImportError:
        return None


def _router_sass_ops(num_experts: int = 896) -> list[str]:
    """Opcodes of the sm_90 SASS of amdqb_router (nvcc, the runtime's flags), in program order."""
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("needs cuobjdump (CUDA toolkit or Triton's NVIDIA backend)")
    out_dir = tempfile.mkdtemp(prefix="amdqb_sass_")
    spec = _spec.router_module(num_experts, "float32", "sigmoid")
    _, rc, log = compile_nvcc(spec, out_dir)
    assert rc == 0, log[-3000:]
    sass = subprocess.run(
        [tool, "-sass", str(Path(out_dir) / f"{spec.label()}.cubin")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    body = sass[sass.index("Function : amdqb_router\n") :]
    end = body.find("Function :", 1)
    body = body if end < 0 else body[:end]
    return re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", body)


@needs_nvcc
def test_router_issues_a_tokens_logit_loads_as_one_batch_on_sm90():
    """The H200 profile that found 28 serial DRAM round trips per token: ptxas never moves a load
    across the CALL of an IEEE division's slow path, so loads interleaved with the sigmoids wait
    one by one. The router pins them as one batch (keep_loaded); this checks the SASS keeps it."""
    ops = _router_sass_ops()
    vpl = -(-896 // 32)
    # every logit load of the first token is issued before its first sigmoid (MUFU.EX2); without
    # the pin, ptxas issues one load per sigmoid
    first_exp = next(i for i, op in enumerate(ops) if op.startswith("MUFU.EX2"))
    loads = sum(op.startswith("LDG") for op in ops[:first_exp])
    assert loads >= vpl, f"{loads} global loads before the first exp; want >= {vpl}"


@needs_nvcc
def test_router_sigmoids_have_no_call_between_them_on_sm90():
    """The compiler's IEEE division puts a CALL to its slow path after every reciprocal, one per
    expert, and the experts' arithmetic cannot interleave across them; the router writes the fast
    path out (sigmoid_fast), so one token's VPL reciprocals form a run with no CALL inside."""
    ops = _router_sass_ops()
    vpl = -(-896 // 32)
    best = run = 0
    for op in ops:
        if op.startswith("CALL"):
            best, run = max(best, run), 0
        elif op.startswith("MUFU.RCP"):
            run += 1
    best = max(best, run)
    assert best >= vpl, f"at most {best} reciprocals between calls; want a run of >= {vpl}"


def _nvrtc():
    from amdqb.backends.hip._runtime import NvrtcCompiler

    try:
        return NvrtcCompiler()
    except ImportError as exc:
        pytest.skip(f"NVRTC not available: {exc}")


class RecordingRuntime:
    """Records the ctypes argument types of every launch the launchers make (runs nothing)."""

    def __init__(self):
        self.calls = {}

    def kernel(self, device_index, spec, name):
        return name

    def launch(self, kernel, grid, block, smem, args):
        self.calls.setdefault(kernel, set()).add(tuple(type(a) for a in args))

    launch_dependent = launch

    def num_cus(self, device_index):
        return 4

    def smem_budget(self, device_index):
        return 48 * 1024


def _record_launches():
    import torch

    from amdqb.backends.hip import _ops

    rt = RecordingRuntime()
    ids = torch.zeros(8, 4, dtype=torch.int32)
    for dtype in (torch.int32, torch.int64):
        for det, impl, cap in ((False, "atomic", None), (False, "lds", 4), (True, "lds", None)):
            c = torch.zeros(16, dtype=torch.int32)
            _ops.route_rows(
                rt, ids.to(dtype), 16, cap, c, torch.empty_like(ids), c.clone(), det, impl
            )
        _ops.align_block_size(
            rt,
            ids.to(dtype),
            4,
            16,
            torch.empty(32 + 16 * 3, dtype=torch.int32),
            torch.empty(20, dtype=torch.int32),
            torch.empty(1, dtype=torch.int32),
        )
    logits = torch.zeros(4, 16)
    hist = torch.zeros(16, 10, dtype=torch.int32)
    bounds = torch.tensor([-1.0, 1.0])
    _ops.router_fwd(
        rt,
        logits,
        2,
        "sigmoid",
        False,
        None,
        None,
        None,
        torch.zeros(16),
        torch.empty(4, 16),
        torch.empty(4, 16, dtype=torch.bool),
        "bytemap",
        hist,
        bounds,
        "two_kernel",
    )
    _ops.biased_topk(
        rt,
        logits,
        2,
        None,
        "sigmoid",
        True,
        None,
        None,
        None,
        torch.empty(4, 2),
        torch.empty(4, 2, dtype=torch.int32),
    )
    _ops.score_values(rt, logits, "sigmoid")
    return rt.calls


_PTX_WIDTH = {"u64": 8, "b64": 8, "s64": 8, "u32": 4, "b32": 4, "s32": 4, "f32": 4}


def _ptx_entries(ptx: str) -> dict:
    entries = {}
    for m in re.finditer(r"\.entry\s+(\w+)\s*\((.*?)\)", ptx, re.S):
        types = [re.match(r"\s*\.param\s+\.(\w+)", p).group(1) for p in m.group(2).split(",")]
        entries[m.group(1)] = [(_PTX_WIDTH[t], t) for t in types]
    return entries


def test_nvrtc_compiles_every_module_like_the_runtime():
    nvrtc = _nvrtc()
    for spec in MODULES[:4]:
        source, _ = _spec.read_sources(spec, ROOT)
        image = nvrtc.compile(
            source, spec.kernel_file, _spec.nvrtc_flags("sm_90", spec), ROOT / "include"
        )
        assert image[:4] == b"\x7fELF", spec.label()


def test_launch_arguments_match_the_kernel_signatures():
    """Every launch passes exactly the kernel's parameters, each with its exact width/kind."""
    import ctypes

    nvrtc = _nvrtc()
    calls = _record_launches()
    entries = {}
    for spec in (_spec.ROUTE_MODULE, _spec.router_module(16, "float32", "sigmoid")):
        source, _ = _spec.read_sources(spec, ROOT)
        ptx = nvrtc.compile(
            source, spec.kernel_file, _spec.nvrtc_flags("compute_90", spec), ROOT / "include"
        )
        entries.update(_ptx_entries(ptx.decode(errors="replace")))
    kinds = {
        ctypes.c_void_p: (8, "u64"),
        ctypes.c_int32: (4, "u32|s32|b32"),
        ctypes.c_int64: (8, "u64|s64|b64"),
        ctypes.c_float: (4, "f32|u32|b32"),
    }
    assert calls, "no launch recorded"
    for name, signatures in calls.items():
        assert name in entries, (name, sorted(entries))
        params = entries[name]
        for sig in signatures:
            assert len(sig) == len(params), (name, sig, params)
            for ctype, (width, ptx_type) in zip(sig, params):
                want_width, allowed = kinds[ctype]
                assert want_width == width and re.fullmatch(allowed, ptx_type), (name, sig, params)
