"""Offline AMD builds of the ``hip_src`` kernels: every module the runtime can request at the seed
shapes (:func:`module_variants`), compiled and linked into ELF code objects (``.hsaco``) with
Debian's clang and lld for every target of every toolchain (:mod:`amdqb_tools.toolchain`), against
each device-library set the toolchain links (``toolchain.LIBS_BY_MAJOR``: Debian's ROCm 5.2
ocml / ockl, and for clang 22 the ROCm 7.x ones of Triton's AMD backend). A build is named by its
toolchain and set (:func:`build_name`: ``clang-22`` links Debian's set, ``clang-22-rocm7`` ROCm
7's).

The flags are the runtime's (``amdqb.backends.hip._spec.hip_flags``), so a code object here is what
the compiler of a device's ROCm builds from the same sources with hipcc, up to the compiler
version. ``-c --cuda-device-only --no-gpu-bundle-output`` compiles and links with lld into a plain
code object; ``-save-temps`` also leaves the assembly listing, from which that object is assembled
(its ``; Kernel info`` comments are read by :mod:`amdqb_tools.code_objects`).

Builds are cached under ``<_spec.cache_dir()>/offline`` (``AMDQB_CACHE_DIR``): each code object
keyed by the sha256 of the sources, the flags, the compiler and linker versions and the
device-library directory. Within one process a build is made once (:func:`build_all` memoises).

Precision and tie-break contract: none of its own; the kernels' contract (``amdqb.backends.hip``)
holds for what is built here because the flags are the runtime's (fp contraction off).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from amdqb._arch import amd_arch_family, amd_wave_size
from amdqb.backends.hip import _spec

from .toolchain import (
    MEMO,
    Toolchain,
    device_lib_dir,
    inspect_tools,
    lld_dir,
    offline_root,
    predefines_wave_size,
    run,
    toolchains,
)

# Kernels of each module (a build lacking one fails the checks).
ROUTE_KERNELS = frozenset(
    {
        f"amdqb_route_{k}_{t}"
        for k in ("atomic", "lds", "det_hist", "det_rank", "compact")
        for t in ("i32", "i64")
    }
    | {"amdqb_route_det_scan", "amdqb_route_finalize"}
    | {
        "amdqb_align_hist",
        "amdqb_align",
        "amdqb_align_plan",
        "amdqb_align_place",
        "amdqb_align_tiles",
    }
)
TOPK_KERNELS = frozenset({"amdqb_topk"})
ROUTER_BWD_KERNELS = frozenset({"amdqb_router_bwd"})
ROUTER_KERNELS = frozenset(
    {
        "amdqb_router",
        "amdqb_qb_hist",
        "amdqb_qb_hist_bins",
        "amdqb_router_decode",
        "amdqb_router_scores",
    }
)


def arch_config(arch: str):
    """The runtime's config of ``arch`` (``amdqb/configs``, by its architecture family)."""
    from amdqb import configs

    return configs.load(amd_arch_family(arch))


def titled_variants(arch: str = "gfx942") -> list[tuple[str, _spec.ModuleSpec]]:
    cfg = arch_config(arch)
    e = 896  # seeds 000 / 004: 896 routed experts, top-16
    routers = [
        (e, "float32", "sigmoid", {}),
        (e, "bfloat16", "sigmoid", {}),
        (e, "float16", "sigmoid", {}),
        (e, "float32", "sqrtsoftplus", {}),
        (e, "float32", "softmax", {}),
        (e, "float32", "sigmoid", {"tie_free": True}),
        # the balancer's default QB (tie-free, log_margin) in the fused mode: LDS bin counters
        (e, "float32", "sigmoid", {"tie_free": True, "margin_lds": True}),
        # and with the in-bin moments (int64 [3, E, B]): LDS counters, and device atomics alone
        (e, "float32", "sigmoid", {"tie_free": True, "margin_lds": True, "moments": True}),
        (e, "float32", "sigmoid", {"tie_free": True, "moments": True}),
        (e, "float32", "sigmoid", {"approximate": True}),
        # the exact sigmoid selected through the bounded approximation first
        (e, "float32", "sigmoid", {"prefilter": True}),
        (129, "float16", "sqrtsoftplus", {}),
        (17, "float32", "softmax", {}),
        # the op's largest E: rows of many slots per lane, loaded in chunks (router.hip CHUNK)
        (4096, "bfloat16", "sigmoid", {}),
        (4096, "float32", "sigmoid", {"tie_free": True}),
    ]
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    # the serving top-k at the peers' shapes: Mixtral, Qwen3-MoE, DeepSeek-V3 (grouped, bias),
    # Kimi-K2 (bias)
    from amdqb.backends.hip.topk import plan as topk_plan

    # (and the rows of few lanes amdqb_topk takes from hip.topk.wide_min_tokens tokens on)
    wide = 1 << 20
    # (and the row Top-k over 32-bit keys first: "keys", AMDQB_KEY_SELECT whatever the config says)
    topks = [
        (8, 2, "float32", "softmax", None, None, None, None, False),
        (8, 2, "float32", "softmax", None, None, None, wide, False),
        (128, 8, "bfloat16", "softmax", None, None, None, None, False),
        (128, 8, "bfloat16", "softmax", None, None, None, wide, False),
        (256, 8, "float32", "sigmoid", "float32", 8, 4, None, False),
        (384, 8, "float32", "sigmoid", "bfloat16", None, None, None, False),
        (8, 2, "float32", "softmax", None, None, None, None, True),
        (128, 8, "bfloat16", "softmax", None, None, None, None, True),
        (256, 8, "float32", "sigmoid", "float32", 8, 4, None, True),
    ]
    return (
        [("layout", _spec.layout_module(cfg))]
        + [
            (
                " ".join([f"router E={n} {short[dt]} {sf}", *opts]),
                _spec.router_module(n, dt, sf, cfg, **opts),
            )
            for n, dt, sf, opts in routers
        ]
        + [
            (
                f"topk E={n} k={k} {short[dt]} {sf}"
                + (f" bias {short[bdt]}" if bdt else "")
                + (f" groups {g}/{tg}" if g else "")
                + (" wide rows" if t else "")
                + (" keys" if keys else ""),
                _spec.topk_module(
                    topk_plan(n, k, sf, g, tg, cfg, tokens=t), dt, bdt, sf, cfg
                ).with_defines(*([("AMDQB_KEY_SELECT", "1")] if keys else [])),
            )
            for n, k, dt, sf, bdt, g, tg, t, keys in topks
        ]
        + [
            (
                f"router_bwd E={n} {short[dt]} {sf}",
                _spec.router_bwd_module(n, dt, dt, sf),
            )
            for n, dt, sf in ((e, "float32", "sigmoid"), (256, "bfloat16", "softmax"))
        ]
    )


# The modules built against each device-library set (titles of :func:`titled_variants`; None:
# every one): every module against both Debian's ROCm 5.2 set and ROCm 7's. Only the sqrtsoftplus
# routers (ocml's log1pf) give different instructions between the two sets (clang 22.1.8, ROCm 7.1,
# all five targets); the others are built against both so that no variant goes unchecked.
LIB_MODULES: dict[str, tuple[str, ...] | None] = {
    "debian": None,
    "rocm7": None,
}


def module_variants(arch: str = "gfx942", libs: str = "debian") -> list[_spec.ModuleSpec]:
    """Every module the runtime can request at the seed shapes on ``arch`` (its config's
    constants), plus the shapes the compile tests cover: the layout module; the router at E=896 in
    fp32 / bf16 / fp16 with sigmoid, with sqrtsoftplus and softmax, with the tie-free selection
    (also in the build that counts the fused log_margin histogram in LDS) and with the approximate
    activation; small odd E (129 fp16 sqrtsoftplus, 17 fp32 softmax) and
    E=4096 (the op's largest) bf16 sigmoid and fp32 tie-free sigmoid; the serving top-k at the
    peers' shapes; the router backward. The one place that lists them (:func:`titled_variants`);
    those built against device-library set ``libs``: :data:`LIB_MODULES`."""
    titled, wanted = titled_variants(arch), LIB_MODULES[libs]
    unknown = set(wanted or ()) - {title for title, _ in titled}
    if unknown:
        raise ValueError(f"LIB_MODULES[{libs!r}] names no module {sorted(unknown)}")
    return [spec for title, spec in titled if wanted is None or title in wanted]


def build_name(tc_name: str, libs: str = "debian") -> str:
    """The name of toolchain ``tc_name``'s builds against device-library set ``libs``: the
    toolchain's own for Debian's set (``clang-22``), else ``<toolchain>-<libs>``
    (``clang-22-rocm7``)."""
    return tc_name if libs == "debian" else f"{tc_name}-{libs}"


def expected_kernels(spec: _spec.ModuleSpec) -> frozenset:
    return {
        "layout.hip": ROUTE_KERNELS,
        "topk.hip": TOPK_KERNELS,
        "router_bwd.hip": ROUTER_BWD_KERNELS,
    }.get(spec.kernel_file, ROUTER_KERNELS)


def compile_command(
    tc: Toolchain,
    spec: _spec.ModuleSpec,
    arch: str,
    out: Path,
    root: Path | None = None,
    amdqb_wave: int | None = None,
    libs: str = "debian",
) -> list[str]:
    """The clang command that compiles and links ``spec`` for ``arch`` into ``out`` against
    device-library set ``libs`` (and leaves the assembly listing next to it). ``amdqb_wave``
    overrides the ``AMDQB_WAVE_SIZE`` the runtime would pass (tests of the prelude's mismatch
    check); the target's wave size stays."""
    root = root or _spec.source_root()
    wave = amd_wave_size(arch)
    cmd = [tc.clang, "-x", "hip", "--cuda-device-only", "--no-gpu-bundle-output", "-c"]
    cmd += ["-save-temps=obj", f"--rocm-device-lib-path={device_lib_dir(tc, libs)}"]
    cmd += _spec.hip_flags(arch, amdqb_wave or wave, spec)
    if not predefines_wave_size(tc):
        cmd.append(f"-D__AMDGCN_WAVEFRONT_SIZE={wave}")  # from the arch, not AMDQB_WAVE_SIZE
    lld = lld_dir(tc)
    if lld is not None:
        cmd.append(f"-B{lld}")
    cmd += [f"-I{root / 'include'}", "-o", str(out), str(root / "kernels" / spec.kernel_file)]
    return cmd


@dataclass
class Build:
    toolchain: str  # build_name(): the toolchain and the device-library set
    spec: _spec.ModuleSpec
    arch: str
    rc: int
    log: str  # compiler stderr
    key: str
    dir: Path | None  # cache entry (code.hsaco, code.s, build.json), None when it failed
    seconds: float
    cached: bool

    @property
    def ok(self) -> bool:
        return self.rc == 0 and self.dir is not None

    @property
    def hsaco(self) -> Path:
        return self.dir / "code.hsaco"

    @property
    def asm(self) -> Path:
        return self.dir / "code.s"

    @property
    def label(self) -> str:
        return f"{self.spec.label()}@{self.arch}/{self.toolchain}"


def _key(tc: Toolchain, spec: _spec.ModuleSpec, arch: str, root: Path, libs: str) -> str:
    placeholder = Path("/OUT/code.hsaco")
    cmd = compile_command(tc, spec, arch, placeholder, root, libs=libs)
    devlib = device_lib_dir(tc, libs)
    flags = [
        a.replace(str(devlib), devlib.name)
        .replace(str(root), "<src>")
        .replace(str(offline_root()), "<cache>")
        for a in cmd[1:]
    ]
    _, digests = _spec.read_sources(spec, root)
    return _spec.cache_key(tc.ident, arch, amd_wave_size(arch), flags, digests)


def build(
    tc: Toolchain,
    spec: _spec.ModuleSpec,
    arch: str,
    rebuild: bool = False,
    root: Path | None = None,
    libs: str = "debian",
) -> Build:
    """Compile + link ``spec`` for ``arch`` with ``tc`` against device-library set ``libs``, or
    take it from the cache."""
    root = root or _spec.source_root()
    if arch not in tc.archs:
        raise ValueError(f"{tc.name} does not build {arch} (it builds {', '.join(tc.archs)})")
    if libs not in tc.lib_sets:
        raise ValueError(f"{tc.name} does not link {libs} (it links {', '.join(tc.lib_sets)})")
    name = build_name(tc.name, libs)
    key = _key(tc, spec, arch, root, libs)
    objects = offline_root() / "objects"
    dest = objects / f"{spec.label()}-{arch}-{name}-{key[:20]}"
    if not rebuild and (dest / "build.json").is_file() and (dest / "code.hsaco").is_file():
        info = json.loads((dest / "build.json").read_text())
        return Build(name, spec, arch, 0, info["log"], key, dest, info["seconds"], True)
    objects.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=objects))
    try:
        cmd = compile_command(tc, spec, arch, tmp / "code.hsaco", root, libs=libs)
        start = time.perf_counter()
        proc = run(cmd, cwd=tmp)
        seconds = round(time.perf_counter() - start, 3)
        listings = sorted(tmp.glob("*.s"))
        if proc.returncode or not listings or not (tmp / "code.hsaco").is_file():
            return Build(
                name, spec, arch, proc.returncode or 1, proc.stderr, key, None, seconds, False
            )
        os.replace(listings[0], tmp / "code.s")
        for p in tmp.iterdir():  # preprocessed source, bitcode, object, lld's save-temps
            if p.name not in ("code.hsaco", "code.s"):
                p.unlink()
        info = {"command": cmd, "log": proc.stderr, "seconds": seconds, "key": key}
        (tmp / "build.json").write_text(json.dumps(info, indent=1))
        if rebuild and dest.exists():
            shutil.rmtree(dest, ignore_errors=True)
        try:
            os.replace(tmp, dest)
        except OSError:  # built meanwhile by another process
            pass
        done = Build(name, spec, arch, 0, proc.stderr, key, dest, seconds, False)
        if inspect_tools() is not None:
            from .code_objects import inspect_build

            inspect_build(done)  # while the other workers compile; kept as inspect.json
        return done
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_matrix(
    tcs: list[Toolchain] | None = None,
    variants: list[_spec.ModuleSpec] | None = None,
    archs: tuple[str, ...] | None = None,
    libs: tuple[str, ...] = ("debian",),
) -> list[tuple[Toolchain, str, _spec.ModuleSpec, str]]:
    """(toolchain, device-library set, module, target) of every build: the sets of ``libs`` the
    toolchain links, each with its modules (:func:`module_variants`) unless ``variants``."""
    tcs = toolchains() if tcs is None else tcs
    return [
        (tc, lb, spec, arch)
        for tc in tcs
        for lb in tc.lib_sets
        if lb in libs
        for arch in tc.archs
        if archs is None or arch in archs
        for spec in (module_variants(arch, lb) if variants is None else variants)
    ]


def build_all(
    tcs: list[Toolchain] | None = None,
    variants: list[_spec.ModuleSpec] | None = None,
    archs: tuple[str, ...] | None = None,
    jobs: int | None = None,
    rebuild: bool = False,
    libs: tuple[str, ...] = ("debian",),
) -> dict[tuple[str, _spec.ModuleSpec, str], Build]:
    """Every (build name, module, target) build against the device-library sets ``libs``
    (:func:`build_matrix`; the key's name is :func:`build_name`), in parallel, each made once per
    process."""
    todo = build_matrix(tcs, variants, archs, libs)
    for tc, lb in {(tc.name, lb): (tc, lb) for tc, lb, _, _ in todo}.values():
        device_lib_dir(tc, lb)  # once, before the workers
        predefines_wave_size(tc)
        lld_dir(tc)

    def one(job):
        tc, lb, spec, arch = job
        memo_key = (build_name(tc.name, lb), spec, arch)
        with MEMO.lock:
            done = None if rebuild else MEMO.builds.get(memo_key)
        if done is None:
            done = build(tc, spec, arch, rebuild=rebuild, libs=lb)
            with MEMO.lock:
                MEMO.builds[memo_key] = done
        return memo_key, done

    workers = max(1, jobs or os.cpu_count() or 2)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(pool.map(one, todo))
