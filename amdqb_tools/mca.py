"""A static performance model of the hot hip kernels' main loops: llvm-mca over the loop's
instructions, plus occupancy and the bytes the loop moves. A model, relative only: nothing here
has run on an AMD GPU, and llvm-mca models one wave's instruction stream on the target's LLVM
scheduling model (no memory system, no other waves, branches taken as straight-line code).

* **main loop**: the loop of the kernel (from the ``; in Loop: Header=... Depth=...`` annotations
  of the assembly listing the code object was assembled from) with the most instructions,
  nested loops included, laid out contiguously;
* **mca cycles**: llvm-mca's cycles per iteration of that loop body for one wave
  (``Total Cycles / Iterations``, 100 iterations); **RThroughput**: its reciprocal throughput,
  the issue-bound cycles per iteration;
* **waves**: the kernel's occupancy (waves per SIMD, amdqb_tools.occupancy);
* **model cycles**: ``max(RThroughput, mca cycles / waves)``: the SIMD cycles one iteration
  costs when the resident waves hide each other's latency perfectly, or issue-bound;
* **bytes/iter**: global memory bytes the loop body loads and stores per wave iteration (every
  lane active: load / store width x wave size).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from .build import titled_variants
from .code_objects import inspect_build
from .occupancy import RULES, occupancy
from .toolchain import run

MCA_ARCHS = ("gfx942", "gfx950", "gfx1250")
MODULES = ("layout", "router E=896 fp32 sigmoid")
HOT_KERNELS = (
    "amdqb_router",
    "amdqb_router_decode",
    "amdqb_qb_hist",
    "amdqb_qb_hist_bins",
    "amdqb_route_lds_i32",
    "amdqb_route_det_rank_i32",
    "amdqb_align",
)

_LABEL = re.compile(r"^(\.LBB\d+_\d+):")
_IN_LOOP = re.compile(r"in Loop: Header=(BB\d+_\d+) Depth=(\d+)")
_HEADER = re.compile(r"=>This (?:Inner )?Loop Header: Depth=(\d+)")
_MEM = re.compile(
    r"^(global|buffer|flat)_(load|store)_(dword(x\d)?|b(\d+)|ubyte|sbyte|ushort|sshort|short|byte"
    r"|u8|i8|u16|i16|d16\w*)"
)


def llvm_mca() -> str | None:
    return shutil.which("llvm-mca-22")


_PARENT = re.compile(r"Parent Loop (BB\d+_\d+) Depth=(\d+)")


@dataclass
class Block:
    label: str
    header: str | None  # innermost loop's header block (BBx_y), None outside loops
    depth: int
    lines: list
    loops: set  # every loop the block lies in (headers)

    @property
    def name(self) -> str:
        return self.label[2:]  # .LBB0_22 -> BB0_22, as the annotations name it


def _function(asm: str, kernel: str) -> list[str]:
    lines, inside = [], False
    for line in asm.splitlines():
        if re.match(rf"^{re.escape(kernel)}:", line):
            inside = True
            continue
        if inside:
            if line.startswith("\t.section") or re.match(r"^\.Lfunc_end\d+:", line):
                break
            lines.append(line)
    return lines


def blocks(asm: str, kernel: str) -> list[Block]:
    """The basic blocks of ``kernel`` in the listing, with their loop annotations (``in Loop``,
    ``Loop Header`` and ``Parent Loop`` comments, on the label's line or the lines after it)."""
    out = [Block(".Lentry", None, 0, [], set())]

    def note(b: Block, line: str) -> None:
        h, inner = _HEADER.search(line), _IN_LOOP.search(line)
        if h:
            b.header, b.depth = b.name, int(h.group(1))
        elif inner:
            b.header, b.depth = inner.group(1), int(inner.group(2))
        b.loops.update(p.group(1) for p in _PARENT.finditer(line))
        if b.header:
            b.loops.add(b.header)

    for line in _function(asm, kernel):
        m = _LABEL.match(line)
        if m:
            out.append(Block(m.group(1), None, 0, [], set()))
            note(out[-1], line)
            continue
        if out[-1].lines == [] and line.lstrip().startswith(";"):  # the label's comment lines
            note(out[-1], line)
            continue
        text = line.split(";")[0].strip()
        if text and not text.startswith("."):
            out[-1].lines.append(text)
    return out


def loops(asm: str, kernel: str) -> dict[str, list[str]]:
    """{loop header: the instructions of every block in the loop, nested loops included, in
    layout order}."""
    bs = blocks(asm, kernel)
    headers = {b.name for b in bs if b.header == b.name}
    return {h: [line for b in bs if h in b.loops for line in b.lines] for h in sorted(headers)}


def main_loop(asm: str, kernel: str) -> list[str]:
    found = loops(asm, kernel)
    return max(found.values(), key=len) if found else []


def mca(arch: str, lines: list[str], iterations: int = 100) -> dict:
    """llvm-mca's summary of ``lines`` on ``arch``."""
    tool = llvm_mca()
    if tool is None:
        raise FileNotFoundError("llvm-mca-22 not found (apt-get install llvm-22)")
    cmd = [tool, "-mtriple=amdgcn-amd-amdhsa", f"-mcpu={arch}", f"-iterations={iterations}"]
    proc = run(cmd, input="\n".join(lines) + "\n")
    if proc.returncode:
        raise RuntimeError(f"llvm-mca failed on {arch}: {proc.stderr[-2000:]}")
    fields = {}
    for key, name in (("Total Cycles", "cycles"), ("Block RThroughput", "rthroughput")):
        m = re.search(rf"^{key}:\s+([\d.]+)", proc.stdout, re.MULTILINE)
        fields[name] = float(m.group(1)) if m else float("nan")
    return {"cycles": fields["cycles"] / iterations, "rthroughput": fields["rthroughput"]}


def global_bytes(lines: list[str], wave: int) -> int:
    """Bytes of global memory the instructions load and store per wave (every lane active)."""
    total = 0
    for text in lines:
        m = _MEM.match(text.split()[0])
        if not m:
            continue
        op = m.group(3)
        if op.startswith("dword"):
            width = 4 * int(m.group(4)[1:]) if m.group(4) else 4
        elif m.group(5):
            width = int(m.group(5)) // 8
        elif op in ("ubyte", "sbyte", "byte", "u8", "i8"):
            width = 1
        else:
            width = 2
        total += width * wave
    return total


@dataclass(frozen=True)
class Estimate:
    kernel: str
    insts: int
    cycles: float
    rthroughput: float
    waves: int
    model: float
    bytes: int


def _cached_mca(arch: str, lines: list[str], cache: Path | None) -> dict:
    """:func:`mca`, kept in ``cache`` (a build's directory) keyed by the loop's text."""
    text = "\n".join(lines)
    key = hashlib.sha256(f"{arch}\n{text}".encode()).hexdigest()[:24]
    path = cache / f"mca-{key}.json" if cache is not None else None
    if path is not None and path.is_file():
        return json.loads(path.read_text())
    result = mca(arch, lines)
    if path is not None:
        path.write_text(json.dumps(result))
    return result


def estimate(arch: str, co, asm: str, kernel: str, cache: Path | None = None) -> Estimate | None:
    lines = main_loop(asm, kernel)
    if not lines:
        return None
    k = co.kernels[kernel]
    m = _cached_mca(arch, lines, cache)
    waves = occupancy(arch, k).waves
    model = max(m["rthroughput"], m["cycles"] / waves)
    return Estimate(
        kernel, len(lines), m["cycles"], m["rthroughput"], waves, model, global_bytes(lines, k.wave)
    )


def render_model_table(builds: dict, table_begin, table_end: str) -> str:
    """The ``model`` section of docs/amd_occupancy.md (clang-22 builds of :data:`MODULES`)."""
    lines = [table_begin("model"), ""]
    for arch in MCA_ARCHS:
        rows = []
        for title, spec in titled_variants(arch):
            b = builds.get(("clang-22", spec, arch))
            if title not in MODULES or b is None or not b.ok:
                continue
            co = inspect_build(b)
            asm = b.asm.read_text()
            for name in HOT_KERNELS:
                if name not in co.kernels:
                    continue
                e = estimate(arch, co, asm, name, b.dir)
                if e is None:
                    continue
                rows.append(
                    f"| `{name}` | {e.insts} | {e.cycles:.1f} | {e.rthroughput:.1f} | {e.waves} "
                    f"| {e.model:.1f} | {e.bytes} |"
                )
        lines += [
            f"### {arch} (wave{RULES[arch].wave}), clang-22: main loop (model)",
            "",
            "| kernel | instructions | mca cycles / iter | RThroughput | waves/SIMD "
            "| model cycles / iter | global bytes / iter |",
            "|---|--:|--:|--:|--:|--:|--:|",
            *rows,
            "",
        ]
    lines.append(table_end)
    return "\n".join(lines) + "\n"
