"""Per-architecture configs (``amdqb/configs``): well-formed files with provenance, every entry
read by the code, kernel constants only from the config (a kernel file refuses to build without
them), overrides reaching the kernels, and each measured backend order agreeing with the
benchmark data it cites (``bench/results/h200.json``)."""

from __future__ import annotations

import ast
import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from amdqb import configs, dispatch
from amdqb.backends.hip import _spec

ROOT = Path(__file__).resolve().parents[1]
PROVENANCE = re.compile(
    r"^(measured: [^,]+, \d{4}-\d{2}-\d{2}, .+|seed: .+|derived: .+|untuned: .+)$"
)
ARCHES = configs.available()


@pytest.mark.parametrize("arch", ARCHES)
def test_config_file_is_well_formed(arch):
    raw = json.loads(configs.config_path(arch).read_text())
    assert raw["arch"] == arch
    default_keys = set(json.loads(configs.config_path("default").read_text())["entries"])
    for key, item in raw["entries"].items():
        assert set(item) <= {"value", "provenance", "why"}, key
        assert PROVENANCE.match(item["provenance"]), (key, item["provenance"])
        if item["provenance"].startswith("measured"):
            assert item.get("why"), f"{arch}: measured entry {key} states no figure"
        if key.startswith(configs.BACKEND_ORDER):
            order = item["value"]
            assert order and set(order) <= set(dispatch.BACKENDS), (key, order)
            assert order[-1] == "torch", f"{key}: torch (the oracle-backed fallback) comes last"
        else:
            assert key in default_keys, f"{arch}: {key} is not a key of default.json"
    # the file is in the canonical layout configs.write produces (tuning rewrites it so)
    assert configs.config_path(arch).read_text() == configs.dumps(arch, raw["entries"])


AMD_ARCHES = [a for a in ARCHES if a.startswith("gfx") or a in ("cdna", "rdna")]


@pytest.mark.parametrize("arch", AMD_ARCHES)
def test_amd_entries_equal_to_the_default_are_measured(arch):
    """An AMD architecture's file holds an entry whose value equals default.json's only with a
    measurement behind it (measured or seed on that architecture, or a measurement named as
    borrowed until one is taken there: the route gate); nothing derived or untuned repeats the
    default."""
    raw = json.loads(configs.config_path(arch).read_text())["entries"]
    default = json.loads(configs.config_path("default").read_text())["entries"]
    for key, item in raw.items():
        if key not in default or item["value"] != default[key]["value"]:
            continue
        provenance = item["provenance"]
        measured = provenance.startswith(("measured:", "seed:")) or "borrowed" in provenance
        assert measured, f"{arch}: {key} equals default.json's value ({provenance})"


def _strings(node) -> set[str]:
    return {
        n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def config_reads(source: str, keys) -> set[str]:
    """The config keys ``source`` reads: a string subscript (``cfg["hip.router.cap"]``, either
    side of a conditional inside the brackets too) or ``.entry(key)`` / ``.get(key)`` naming the
    key, or naming its last part in a module that builds a prefix-stripped view
    (``config(family)["row_elems"]`` where the module holds the prefix ``"triton.router."``). A
    name in a comment, a docstring or any other string reads nothing."""
    tree = ast.parse(source)
    named = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript):
            named |= _strings(node.slice)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("entry", "get")
            and node.args
        ):
            named |= _strings(node.args[0])
    prefixes = {c for c in _strings(tree) if c.endswith(".") and any(k.startswith(c) for k in keys)}
    return {k for k in keys if k in named or any(k == p + n for p in prefixes for n in named)}


def test_every_default_entry_is_read_by_the_code():
    entries = json.loads(configs.config_path("default").read_text())["entries"]
    keys = {k for k in entries if not k.startswith(configs.BACKEND_ORDER)}
    read = set()
    for path in (ROOT / "amdqb").rglob("*.py"):
        read |= config_reads(path.read_text(), keys)
    assert not keys - read, f"config entries no code reads: {sorted(keys - read)}"


def test_config_reads_need_a_subscript():
    """A key named in prose, or its short name anywhere but in brackets, is not a read."""
    keys = {"triton.router.row_elems", "hip.router.cap"}
    prose = '''"""row_elems and hip.router.cap tune the router."""
PREFIX = "triton.router."
names = ["row_elems", "hip.router.cap"]
'''
    assert config_reads(prose, keys) == set()
    reads = """PREFIX = "triton.router."
def plan(cfg, view, fused):
    return view["row_elems"], cfg["hip.router.cap" if fused else "other"]
"""
    assert config_reads(reads, keys) == keys


def test_override_reaches_the_hip_module_defines():
    cfg = configs.load("cpu")
    base = _spec.layout_module(cfg)
    block = int(cfg["hip.route.lds_block"])
    with configs.override("cpu", {"hip.route.lds_block": block // 2}):
        varied = _spec.layout_module(configs.load("cpu"))
    assert dict(varied.defines)["AMDQB_ROUTE_BLOCK"] == str(block // 2)
    assert dict(base.defines)["AMDQB_ROUTE_BLOCK"] == str(block)
    assert configs.load("cpu")["hip.route.lds_block"] == block  # restored after the block
    with pytest.raises(KeyError, match="no config entry"):
        with configs.override("cpu", {"hip.route.no_such_entry": 1}):
            pass


def _modules():
    cfg = configs.load("sm_90")
    return {
        "layout": (_spec.layout_module(cfg), "AMDQB_EMU_ROUTE"),
        "router": (_spec.router_module(896, "float32", "sigmoid", cfg), "AMDQB_EMU_ROUTER"),
    }


@pytest.mark.parametrize("module", ["layout", "router"])
def test_kernel_sources_define_no_tunable_of_their_own(module):
    spec, _ = _modules()[module]
    text = "".join(p.read_text() for p in (_spec.source_root()).rglob("*") if p.is_file())
    for name, _value in spec.defines:
        assert not re.search(rf"#\s*define\s+{name}\b", text), f"{name} has a default in hip_src"


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ (the emulator's compiler) is absent")
@pytest.mark.parametrize("module", ["layout", "router"])
def test_kernel_file_refuses_to_build_without_a_config_constant(module):
    """Preprocessing the module with all its config defines succeeds; dropping any one fails with
    the kernel file's #error, so no kernel runs on a value the host did not choose."""
    spec, which = _modules()[module]
    root = _spec.source_root()
    emu = ROOT / "op_tests" / "hip_emu"
    base = ["g++", "-std=c++20", "-E", "-o", "/dev/null", f"-I{root / 'include'}"]
    base += [f"-I{root / 'kernels'}", f"-I{emu}", "-DAMDQB_WAVE_SIZE=32", f"-D{which}"]
    source = str(emu / "emu_kernels.cpp")
    full = subprocess.run([*base, *spec.define_flags(), source], capture_output=True, text=True)
    assert full.returncode == 0, full.stderr[-2000:]
    for i, (name, _value) in enumerate(spec.defines):
        flags = [f for j, f in enumerate(spec.define_flags()) if j != i]
        res = subprocess.run([*base, *flags, source], capture_output=True, text=True)
        assert res.returncode != 0 and "#error" in res.stderr, f"builds without {name}"


# Which table of bench/results/<device>.json times each op, and the row fields that only measure
# (every other field but "backend" names the case).
OP_TABLES = {
    "router_fwd": "router",
    "biased_topk": "biased_topk",
    "route_rows": "route_rows",
    "align_block_size": "moe_align_block_size",
    "chunk_copy": "chunks",
    "qb_step": "balancer_step",
}
MEASURES = re.compile(r"(us|GB/s|%copy|meets|target_us|MiB|^x_|/)")
# The order is chosen over an op's cases: the first backend must be the fastest in geometric
# mean, and no single case may be a gross misorder. The widest case-level loss in the H200
# results: hip route_rows atomic, uniform_compact, M=512 at 1.14x triton's.
CASE_SLACK = 1.25


def _cases(rows):
    cases: dict[tuple, dict[str, float]] = {}
    for row in rows:
        key = tuple(sorted((k, str(v)) for k, v in row.items() if not MEASURES.search(k)))
        key = tuple(kv for kv in key if kv[0] != "backend")
        best = cases.setdefault(key, {})
        best[row["backend"]] = min(best.get(row["backend"], float("inf")), row["us"])
    return cases


@pytest.mark.parametrize("op", sorted(OP_TABLES))
def test_measured_backend_order_is_the_fastest_in_the_results(op):
    """The sm_90 config's first backend for ``op`` is within noise of the fastest in every case
    of the H200 results where the backends meet."""
    entry = configs.load("sm_90").entry(configs.BACKEND_ORDER + op)
    if not entry.provenance.startswith("measured"):
        pytest.skip(f"backend_order.{op} on sm_90 is {entry.provenance!r}, not a measurement")
    results = json.loads((ROOT / "bench" / "results" / "h200.json").read_text())
    rows = results[OP_TABLES[op]]["rows"]
    first = entry.value[0]
    log_ratio: dict[str, list[float]] = {}
    for key, best in _cases(rows).items():
        if first not in best:
            continue
        for other, us in best.items():
            if other != first and other in entry.value:
                assert best[first] <= CASE_SLACK * us, (op, dict(key), best)
                log_ratio.setdefault(other, []).append(math.log(best[first] / us))
    assert log_ratio, f"{OP_TABLES[op]} has no case where {first} meets another backend"
    for other, logs in log_ratio.items():
        mean = math.exp(sum(logs) / len(logs))
        assert mean < 1.0, f"{op}: {first} is {mean:.2f}x {other} in geometric mean"


def test_performance_tables_are_the_results_data():
    """docs/performance.md's tables are what scripts/results_tables.py generates from
    bench/results/h200.json (regenerate with ``--doc docs/performance.md`` after a benchmark
    run)."""
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location(
        "results_tables", root / "scripts/results_tables.py"
    )
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    doc = (root / "docs/performance.md").read_text()
    results = json.loads((root / "bench/results/h200.json").read_text())
    assert tables.with_tables(doc, tables.render(results, "sm_90")) == doc


def test_ncu_mix_counts_what_ran():
    """scripts/ncu_hotspots.py --mix: opcode shares of the executed warp instructions (predicates
    and modifiers stripped) and the stretches of consecutive executed lines, a never-run line
    ending one, on an ncu source-page CSV of two launches."""
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("ncu_hotspots", root / "scripts/ncu_hotspots.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    header = '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"'
    body = [
        '"0x0","IMAD.WIDE R2, R3, 0x4, R4","1","64"',
        '"0x10","@!P0 IMAD R5, R6, R7, RZ","0","64"',
        '"0x20","BRA 0x40","0","0"',
        '"0x30","ISETP.GE.AND P0, PT, R1, R2, PT","3","128"',
    ]
    text = "\n".join(['"Kernel Name","k1"', header, *body, '"Kernel Name","k2"', header, body[0]])
    blocks = list(tool._blocks(text))
    assert [t for t, _ in blocks] == ["k1", "k2"] and len(blocks[0][1]) == 4
    assert tool.opcode("@!P0 IMAD.WIDE.U32 R2, R3") == "IMAD"
    lines = tool.mix(blocks[0][1], "Source", "Instructions Executed", 5)
    assert lines[0].strip() == "IMAD 50.0%, ISETP 50.0%, BRA 0.0%"
    # stretches: lines 0-1 (128 instructions) and line 3 (128), each half of the 256
    assert "lines 0-1 (2, each run 64x)" in "\n".join(lines[1:])
    assert "lines 3-3 (1, each run 128x)" in "\n".join(lines[1:])
    assert all("50.0%" in ln for ln in lines[1:])
