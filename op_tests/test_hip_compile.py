"""Every hip_src kernel variant the runtime can request at the seed shapes builds for AMD into a
linked code object (``amdqb_tools`` (``amdqb_tools.build``: Debian's clang 22 for gfx942 / gfx950 wave64 and
gfx1100 / gfx1201 / gfx1250 wave32, clang 19 for gfx942 / gfx1100 / gfx1201, lld, ocml / ockl from
Debian's rocm-device-libs plus the per-target constant files it lacks), compiles for NVIDIA sm_90
with nvcc, and with NVRTC through the backend's own compiler class when cuda-python and an NVRTC
library are installed (NVRTC needs no GPU). The flags are the runtime's (``_spec``), so what
compiles here is what hiprtc / NVRTC compile on a device. The prelude's check that AMDQB_WAVE_SIZE
matches the target's wave size fires with both clang versions.

What the AMD code objects contain (metadata, occupancy, ISA) is checked in
op_tests/test_amd_code_objects.py; nothing here executes a kernel.
"""

import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from amdqb import configs, dispatch
from amdqb._arch import amd_wave_size
from amdqb.backends.hip import _spec
from amdqb_tools import build as tools_build
from amdqb_tools import toolchain as tools_toolchain

from conftest import require

CFG = configs.load("default")  # the default config's constants

ROOT = _spec.source_root()
# NVIDIA builds (nvcc, NVRTC): the shapes the NVIDIA checks have always covered.
MODULES = [
    _spec.layout_module(CFG),
    _spec.router_module(896, "float32", "sigmoid", CFG),
    _spec.router_module(896, "bfloat16", "sigmoid", CFG),
    _spec.router_module(129, "float16", "sqrtsoftplus", CFG),
    _spec.router_module(17, "float32", "softmax", CFG),
    _spec.router_module(2048, "bfloat16", "sigmoid", CFG),
    _spec.router_module(896, "float32", "sigmoid", CFG, prefilter=True),
]
AMD_TARGETS = [
    (f"clang-{m}", arch)
    for m in tools_toolchain.TOOLCHAIN_MAJORS
    for arch in tools_toolchain.ARCHS_BY_MAJOR[m]
]

NVCC = shutil.which("nvcc") or (
    "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").is_file() else None
)
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="needs nvcc (CUDA toolkit)")

CFG = configs.load("default")  # the default config's constants


def _toolchain(name):
    tc = tools_toolchain.toolchain(int(name.split("-")[1]))
    if (
        tc is None
        or tools_toolchain.device_bitcode_source() is None
        or tools_toolchain.inspect_tools() is None
    ):
        require(
            False, "needs " + "; ".join(tools_toolchain.missing_toolchains()) + " (see .ci/run)"
        )
    return tc


def amd_params():
    return [pytest.param(tc, arch, id=f"{tc}-{arch}") for tc, arch in AMD_TARGETS]


@pytest.mark.parametrize("tc, arch", amd_params())
def test_every_variant_builds_a_linked_code_object(tc, arch):
    _toolchain(tc)
    # The whole matrix at once (made once per process), so the workers stay busy.
    builds = {k: b for k, b in tools_build.build_all().items() if k[0] == tc and k[2] == arch}
    assert len(builds) == len(tools_build.module_variants(arch))
    failed = {b.label: b.log[-4000:] for b in builds.values() if not b.ok}
    assert not failed, failed
    readelf, _ = tools_toolchain.inspect_tools()
    for b in builds.values():
        assert b.hsaco.read_bytes()[:4] == b"\x7fELF", b.label
        header = subprocess.run(
            [readelf, "-h", str(b.hsaco)], check=False, capture_output=True, text=True
        )
        assert re.search(r"Type:\s+DYN", header.stdout), (b.label, header.stdout)  # linked
        assert re.search(r"Machine:\s+EM_AMDGPU", header.stdout), (b.label, header.stdout)
        assert arch in header.stdout, (b.label, header.stdout)
        assert "warning:" not in b.log, (b.label, b.log[-4000:])


@pytest.mark.parametrize("tc, arch", amd_params())
def test_wave_size_mismatch_is_a_compile_error(tc, arch):
    """AMDQB_WAVE_SIZE other than the target's: the prelude refuses (clang 19 predefines
    __AMDGCN_WAVEFRONT_SIZE; for clang 22 the build defines it from the arch)."""
    toolchain = _toolchain(tc)
    wrong = 96 - amd_wave_size(arch)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = tools_build.compile_command(
            toolchain, _spec.layout_module(CFG), arch, Path(tmp) / "x.hsaco", amdqb_wave=wrong
        )
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=tmp)
    assert proc.returncode != 0
    assert "AMDQB_WAVE_SIZE does not match the target's wavefront size" in proc.stderr, proc.stderr


@pytest.mark.parametrize("tc", [f"clang-{m}" for m in tools_toolchain.TOOLCHAIN_MAJORS])
def test_device_libraries_come_from_the_generated_directory(tc):
    """Every bitcode library the compile links is in the generated directory: Debian's ocml /
    ockl / oclc files, plus the ISA-version file of each target (and the ABI file of code object
    v6 for clang 22), which Debian's 5.2 bitcode lacks."""
    toolchain = _toolchain(tc)
    devlib = tools_toolchain.device_lib_dir(toolchain)
    made = tools_toolchain.generated_device_libs(toolchain)
    for arch in toolchain.archs:
        suffix, _ = tools_toolchain.isa_version(arch)
        assert (devlib / f"oclc_isa_version_{suffix}.bc").is_file(), arch
        cmd = tools_build.compile_command(
            toolchain,
            _spec.router_module(896, "float32", "sqrtsoftplus", CFG),
            arch,
            Path("x.hsaco"),
        )
        proc = subprocess.run([*cmd, "-###"], check=False, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        linked = re.findall(r'"-mlink-builtin-bitcode" "([^"]+)"', proc.stderr)
        names = {Path(p).name for p in linked}
        assert {"ocml.bc", "ockl.bc", f"oclc_isa_version_{suffix}.bc"} <= names, (arch, names)
        assert all(Path(p).parent == devlib for p in linked), (arch, linked)
        abi = next(n for n in names if n.startswith("oclc_abi_version_"))
        assert (devlib / abi).is_file()
    assert all(n.startswith("oclc_") for n in made), made


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
    spec = _spec.router_module(num_experts, "float32", "sigmoid", CFG)
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
    """Records the module and the ctypes argument types of every launch the launchers make (runs
    nothing)."""

    def __init__(self):
        self.calls = {}  # kernel name -> {argument types}
        self.specs = {}  # module label -> ModuleSpec
        self.clusters = False  # what supports_clusters answers

    def kernel(self, device_index, spec, name):
        self.specs[spec.label()] = spec
        return name

    def launch(self, kernel, grid, block, smem, args):
        self.calls.setdefault(kernel, set()).add(tuple(type(a) for a in args))

    launch_dependent = launch

    def supports_clusters(self, device_index):
        return self.clusters

    def launch_cluster(self, kernel, grid, cluster, block, smem, args):
        self.launch(kernel, grid, block, smem, args)

    def num_cus(self, device_index):
        return 4

    def smem_budget(self, device_index):
        return 48 * 1024


def _record_launches():
    """Every hip launcher, through its current signature, on CPU tensors (nothing runs)."""
    import torch

    from amdqb.backends.calls import AlignCall, RouterCall, TopkCall
    from amdqb.backends.hip import layout as hip_layout
    from amdqb.backends.hip import router as hip_router
    from amdqb.backends.hip import router_bwd as hip_router_bwd
    from amdqb.backends.hip import topk as hip_topk

    rt = RecordingRuntime()
    ids = torch.zeros(8, 4, dtype=torch.int32)
    # past hip.align.single_block_routes: the planned align (plan + its dependent); past
    # hip.align.plan_max_routes: the tiled one (hist + its dependent)
    many = torch.zeros(int(CFG["hip.align.single_block_routes"]) + 1, dtype=torch.int32)
    most = torch.zeros(int(CFG["hip.align.plan_max_routes"]) + 1, dtype=torch.int32)
    for dtype in (torch.int32, torch.int64):
        for det, impl, cap in ((False, "atomic", None), (False, "lds", 4), (True, "lds", None)):
            c = torch.zeros(16, dtype=torch.int32)
            hip_layout.route_rows(
                rt, ids.to(dtype), 16, cap, c, torch.empty_like(ids), c.clone(), det, impl
            )
        forms = ((ids, False, False), (many, False, False), (most, False, False))
        for routes, rank_first, clusters in forms + ((most, True, False), (many, False, True)):
            n = routes.numel()
            # hip.align.tiles_rank_first: the tiled form's rank pass as amdqb_align_tiles; a
            # device with clusters: amdqb_align_cluster
            rt.clusters = clusters
            arch = dispatch.device_info(routes.device).arch_family
            values = {"hip.align.tiles_rank_first": rank_first, "hip.align.cluster_max_routes": n}
            with configs.override(arch, values):
                hip_layout.align_block_size(
                    rt,
                    AlignCall(16, 4),
                    routes.to(dtype),
                    None,
                    torch.empty(n + 16 * 3, dtype=torch.int32),
                    torch.empty(n // 4 + 16, dtype=torch.int32),
                    torch.empty(1, dtype=torch.int32),
                )
    # decode (amdqb_router_decode) and full-size (amdqb_router) rows; both QB binnings
    for tokens, binning in (
        (4, "uniform"),
        (int(CFG["hip.router.decode_max_tokens"]) + 1, "log_margin"),
    ):
        logits = torch.zeros(tokens, 16)
        probs = torch.empty(tokens, 16)
        routed = torch.empty(tokens, 16, dtype=torch.bool)
        call = RouterCall(
            16,
            2,
            qb_mode="two_kernel",
            qb_binning=binning,
            num_bins=10,
            write_scores=True,
            write_cutoff=True,
        )
        hip_router.router_fwd(
            rt,
            call,
            logits,
            torch.zeros(16),
            probs,
            routed,
            torch.zeros(16, 10, dtype=torch.int32),
            torch.tensor([-1.0, 1.0]),
            torch.empty(tokens, 16),
            torch.empty(tokens),
        )
    logits, probs, routed = logits[:4], probs[:4], routed[:4]
    hip_router.biased_topk(
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
    hip_router_bwd.router_bwd(
        rt, RouterCall(16, 2), torch.zeros(4, 16), logits, routed, torch.empty(4, 16)
    )
    # amdqb_topk: the serving form (every output) and the grouped router's dense form
    tei = torch.empty(4, 2, dtype=torch.int32)
    hip_topk.biased_topk(
        rt,
        TopkCall(16, 2, score_function="sigmoid", num_groups=4, group_topk=2),
        logits,
        torch.zeros(16),
        torch.empty(4, 2),
        torch.empty(4, 2, dtype=torch.int64),
        tei,
        torch.ones(1, dtype=torch.int64),
    )
    grouped = RouterCall(16, 2, num_groups=4, group_topk=2, score_function="sigmoid")
    hip_topk.router_fwd_grouped(rt, grouped, logits, None, probs, routed, None, None, None, None)
    return rt


_PTX_WIDTH = {"u64": 8, "b64": 8, "s64": 8, "u32": 4, "b32": 4, "s32": 4, "f32": 4}


def _ptx_entries(ptx: str) -> dict:
    """{kernel: [(bytes, ptx type)]}: scalars by their type, a by-value structure (``.param
    .align A .b8 name[N]``) as N bytes of b8."""
    entries = {}
    for m in re.finditer(r"\.entry\s+(\w+)\s*\((.*?)\)", ptx, re.S):
        params = []
        for p in m.group(2).split(","):
            array = re.match(r"\s*\.param\s+(?:\.align\s+\d+\s+)?\.b8\s+\w+\[(\d+)\]", p)
            if array:
                params.append((int(array.group(1)), "b8"))
            else:
                t = re.match(r"\s*\.param\s+\.(\w+)", p).group(1)
                params.append((_PTX_WIDTH[t], t))
        entries[m.group(1)] = params
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
    """Every launch passes exactly the kernel's parameters, each with its exact width/kind, and
    every kernel of the modules launched is launched by some launcher."""
    import ctypes

    nvrtc = _nvrtc()
    rt = _record_launches()
    entries = {}
    for spec in rt.specs.values():
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
    assert rt.calls, "no launch recorded"
    assert set(entries) == set(rt.calls), (sorted(entries), sorted(rt.calls))
    for name, signatures in rt.calls.items():
        params = entries[name]
        for sig in signatures:
            assert len(sig) == len(params), (name, sig, params)
            for ctype, (width, ptx_type) in zip(sig, params):
                if issubclass(ctype, ctypes.Structure):  # by value: a byte array of its size
                    want_width, allowed = ctypes.sizeof(ctype), "b8"
                else:
                    want_width, allowed = kinds[ctype]
                assert want_width == width and re.fullmatch(allowed, ptx_type), (name, sig, params)
