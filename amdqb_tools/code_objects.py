"""What a linked AMD code object says about itself: its AMDGPU metadata note (``llvm-readelf
--notes``), its symbols, its disassembly (``llvm-objdump -d``) and the ``; Kernel info`` comments of
the assembly listing the same compile wrote. Nothing here runs a kernel.

A build's inspection is kept next to it (``inspect.json``, keyed by the object's and the listing's
sha256) and memoised per process.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .toolchain import MEMO, OFFLINE_FORMAT, inspect_tools, run

INSPECT_FORMAT = 2  # bump when the reading of a code object changes (2: long branches are no calls)


@dataclass
class Kernel:
    name: str
    meta: dict  # scalar fields of the kernel's metadata entry, without the leading dot
    info: dict  # "; Kernel info" comments of the assembly listing (empty without one)
    code: list  # [(address, instruction text, branch target address or None)]

    @property
    def wave(self) -> int:
        return int(self.meta["wavefront_size"])

    @property
    def vgprs(self) -> int:
        """VGPRs per lane; with AGPRs (gfx942 / gfx950) the unified count: the VGPRs aligned to 4
        plus the AGPRs, which is what occupancy is computed from."""
        return int(self.meta["vgpr_count"])

    @property
    def agprs(self) -> int:
        return int(self.meta.get("agpr_count", 0))

    @property
    def sgprs(self) -> int:
        return int(self.meta["sgpr_count"])

    @property
    def lds(self) -> int:
        return int(self.meta["group_segment_fixed_size"])

    @property
    def scratch(self) -> int:
        return int(self.meta["private_segment_fixed_size"])

    @property
    def dynamic_stack(self) -> bool:
        return bool(self.meta.get("uses_dynamic_stack", False))

    @property
    def max_block(self) -> int:
        return int(self.meta["max_flat_workgroup_size"])

    @property
    def spills(self) -> tuple[int, int]:
        return int(self.meta.get("vgpr_spill_count", 0)), int(self.meta.get("sgpr_spill_count", 0))

    def instructions(self) -> list[str]:
        return [text for _, text, _ in self.code]


@dataclass
class CodeObject:
    path: Path
    target: str  # amdhsa.target, e.g. amdgcn-amd-amdhsa--gfx942
    elf_flags: str  # llvm-readelf's Flags line (the e_flags mach and feature bits)
    kernels: dict  # {name: Kernel}
    undefined: list  # undefined symbol names
    functions: dict  # {symbol: [(address, text, target)]} of every function in .text
    calls: list  # [(function, instruction)] of every s_swappc / s_setpc-based call

    @property
    def arch(self) -> str:
        return self.target.rsplit("--", 1)[-1].split(":")[0]


def _scalar(text: str):
    text = text.strip()
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    if text in ("true", "false"):
        return text == "true"
    return text.strip("'\"")


def parse_metadata(notes: str) -> tuple[str, list[dict]]:
    """(amdhsa.target, [kernel entries]) of ``llvm-readelf --notes`` output: the scalar fields of
    each entry of ``amdhsa.kernels`` (nested lists such as ``.args`` are skipped)."""
    target, kernels, current, in_kernels = "", [], None, False
    for line in notes.splitlines():
        if line.startswith("amdhsa.kernels:"):
            in_kernels = True
            continue
        if line and not line.startswith(" ") and not line.startswith("-"):
            in_kernels = False
            m = re.match(r"amdhsa\.target:\s+(\S+)", line)
            if m:
                target = m.group(1).strip("'\"")
            continue
        if not in_kernels:
            continue
        m = re.match(r"^  - \.(\w+):\s*(.*)$", line)
        if m:
            current = {}
            kernels.append(current)
            if m.group(2):
                current[m.group(1)] = _scalar(m.group(2))
            continue
        m = re.match(r"^    \.(\w+):\s+(\S.*)$", line)
        if m and current is not None:
            current[m.group(1)] = _scalar(m.group(2))
    return target, kernels


def parse_kernel_info(asm: str) -> dict[str, dict]:
    """{kernel: {field: int}} of the ``; Kernel info`` comment blocks of an assembly listing
    (``Occupancy``, ``NumVGPRsForWavesPerEU``, ``ScratchSize``, ...)."""
    out, current, label = {}, None, None
    for line in asm.splitlines():
        m = re.match(r"^(\w+):", line)
        if m and not line.startswith("."):
            label = m.group(1)
            continue
        if line.startswith("; Kernel info:"):
            current = out.setdefault(label, {})
            continue
        if current is not None:
            m = re.match(r"^; (\w+)(?: =|:)\s+(-?\d+)", line)
            if m:
                current[m.group(1)] = int(m.group(2))
            elif not line.startswith(";"):
                current = None
    return out


_FUNC = re.compile(r"^([0-9a-f]+) <([^>]+)>:$")
_INSN = re.compile(r"^\s+(\S.*?)\s*//\s*([0-9A-Fa-f]+):[^<]*(?:<([^+>]+)\+0x([0-9a-f]+)>)?\s*$")


def parse_disassembly(text: str) -> dict[str, list]:
    """{function: [(address, instruction, branch target address)]} of ``llvm-objdump -d``."""
    funcs, starts, current = {}, {}, None
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m:
            starts[m.group(2)] = int(m.group(1), 16)
            current = funcs.setdefault(m.group(2), [])
            continue
        m = _INSN.match(line) if current is not None else None
        if m:
            target = None
            if m.group(3) in starts:
                target = starts[m.group(3)] + int(m.group(4), 16)
            current.append((int(m.group(2), 16), m.group(1), target))
    return funcs


def _tools() -> tuple[str, str]:
    tools = inspect_tools()
    if tools is None:
        raise FileNotFoundError("llvm-readelf / llvm-objdump not found (apt-get install llvm-22)")
    return tools


def _read(path: Path, asm: Path | None) -> CodeObject:
    readelf, objdump = _tools()
    notes = run([readelf, "--notes", str(path)])
    if notes.returncode:
        raise RuntimeError(f"{readelf} --notes {path}: {notes.stderr[-2000:]}")
    target, entries = parse_metadata(notes.stdout)
    header = run([readelf, "--file-header", str(path)]).stdout
    flags = next((ln.split(":", 1)[1].strip() for ln in header.splitlines() if "Flags:" in ln), "")
    syms = run([readelf, "--symbols", "--dyn-syms", "--wide", str(path)]).stdout
    undefined = sorted(
        {
            parts[7]
            for parts in (ln.split() for ln in syms.splitlines())
            if len(parts) >= 8 and parts[6] == "UND" and parts[0].endswith(":")
        }
    )
    dis = run([objdump, "-d", "--no-show-raw-insn", str(path)])
    if dis.returncode:
        raise RuntimeError(f"{objdump} -d {path}: {dis.stderr[-2000:]}")
    functions = parse_disassembly(dis.stdout)
    info = parse_kernel_info(asm.read_text()) if asm else {}
    kernels = {}
    for entry in entries:
        name = entry.get("name")
        if name:
            kernels[name] = Kernel(name, entry, info.get(name, {}), functions.get(name, []))
    return CodeObject(path, target, flags, kernels, undefined, functions, _calls(functions))


def _calls(functions: dict) -> list:
    """[(function, instruction)] of every call: s_swappc / s_call, and an s_setpc other than the
    assembler's long branch -- ``s_getpc_b64 s[n:n+1]``, adds of a label's offset, ``s_setpc_b64
    s[n:n+1]`` -- which relaxes a branch beyond s_branch's 16-bit offset (a large kernel's own
    code, not a call)."""
    out = []
    for fn, code in functions.items():
        for i, (_, text, _) in enumerate(code):
            m = re.match(r"s_(swappc|setpc|call)_b64\s+(\S+)", text)
            if m is None:
                continue
            if m.group(1) == "setpc":
                pair = m.group(2)
                before = [t for _, t, _ in code[max(0, i - 8) : i]]
                if any(re.match(rf"s_getpc_b64\s+{re.escape(pair)}$", t) for t in before):
                    continue
            out.append((fn, text))
    return out


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _save_inspection(co: CodeObject, dest: Path, asm: Path | None) -> None:
    data = {
        "format": OFFLINE_FORMAT,
        "inspect": INSPECT_FORMAT,
        "hsaco": _digest(co.path),
        "asm": _digest(asm) if asm else None,
        "target": co.target,
        "elf_flags": co.elf_flags,
        "undefined": co.undefined,
        "calls": co.calls,
        "kernels": {n: {"meta": k.meta, "info": k.info} for n, k in co.kernels.items()},
        "functions": co.functions,
    }
    dest.write_text(json.dumps(data))


def _load_inspection(path: Path, asm: Path | None, src: Path) -> CodeObject | None:
    try:
        data = json.loads(src.read_text())
    except (OSError, ValueError):
        return None
    if data.get("format") != OFFLINE_FORMAT or data.get("hsaco") != _digest(path):
        return None
    if data.get("inspect") != INSPECT_FORMAT:
        return None
    if data.get("asm") != (_digest(asm) if asm else None):
        return None
    functions = {n: [tuple(x) for x in code] for n, code in data["functions"].items()}
    kernels = {
        n: Kernel(n, k["meta"], k["info"], functions.get(n, [])) for n, k in data["kernels"].items()
    }
    calls = [tuple(c) for c in data["calls"]]
    return CodeObject(
        path, data["target"], data["elf_flags"], kernels, data["undefined"], functions, calls
    )


def inspect(path: Path | str, asm: Path | str | None = None) -> CodeObject:
    """Read a code object: metadata note, symbols, disassembly (and the listing, if given). For a
    build in the cache the result is kept next to it (``inspect.json``)."""
    path = Path(path)
    asm = Path(asm) if asm else None
    with MEMO.lock:
        if path in MEMO.objects:
            return MEMO.objects[path]
    saved = path.parent / "inspect.json"
    cached = path.name == "code.hsaco" and saved.is_file()
    co = _load_inspection(path, asm, saved) if cached else None
    if co is None:
        co = _read(path, asm)
        if path.name == "code.hsaco" and (path.parent / "build.json").is_file():
            _save_inspection(co, saved, asm)
    with MEMO.lock:
        MEMO.objects[path] = co
    return co


def inspect_build(b) -> CodeObject:
    """The code object of a successful :class:`amdqb_tools.build.Build`."""
    if not b.ok:
        raise RuntimeError(f"{b.label} did not build:\n{b.log[-4000:]}")
    return inspect(b.hsaco, b.asm)


def inspect_all(builds: dict, jobs: int | None = None) -> dict:
    """{key: CodeObject} of the successful builds of :func:`build_all`, read in parallel."""
    ok = [(key, b) for key, b in builds.items() if b.ok]
    with ThreadPoolExecutor(max_workers=max(1, jobs or os.cpu_count() or 2)) as pool:
        return dict(zip([k for k, _ in ok], pool.map(lambda kb: inspect_build(kb[1]), ok)))
