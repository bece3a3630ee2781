"""Timing, environment and reporting helpers shared by the benchmarks.

Timing method (GPU): every implementation is captured once in a CUDA/HIP graph holding
``calls`` back-to-back calls on preallocated buffers; a sample replays the graph ``replays``
times between two events; implementations are sampled in alternating order (A B C, C B A, ...)
and the per-call 20th / 50th / 80th percentiles over the samples are reported (``us`` is the
median). On the CPU (no graphs) a sample is the wall time of ``calls`` eager calls, with torch's
intra-op threads pinned by the CLI (1 unless ``--threads``). Every case is checked for
correctness before it is timed.

Every figure a row prints is measured in the same run: the floors beside the rows (a device copy
of the same bytes for bandwidth-bound ops, a one-element add -- one kernel launch -- for
latency-bound ones) are timed in the same alternation. The peers' figures (TransformerEngine,
vLLM, SGLang) are not measured here; docs/targets.md and docs/serving.md state them with their
source, and no row prints a ratio to them.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class TimingConfig:
    calls: int = 20  # calls captured per graph
    replays: int = 5  # graph replays per sample
    samples: int = 9  # alternating samples per implementation
    warmup: int = 3


def quick_config() -> TimingConfig:
    return TimingConfig(calls=4, replays=2, samples=5, warmup=1)


class Stats(float):
    """Microseconds per call: the median as a float, with the 20th / 80th percentiles."""

    p20: float
    p80: float

    def __new__(cls, samples: list[float]):
        p20, p50, p80 = (_percentile(samples, q) for q in (20, 50, 80))
        self = super().__new__(cls, p50)
        self.p20, self.p80 = p20, p80
        return self


def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default method)."""
    v = sorted(values)
    if not v:
        return float("nan")
    pos = (len(v) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def on_gpu(device: torch.device) -> bool:
    return device.type == "cuda"


def _graph(fn: Callable[[], object], calls: int, warmup: int) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    return graph


def time_alternating(
    impls: dict[str, Callable[[], object]],
    device: torch.device,
    cfg: TimingConfig,
    graphs: bool = True,
) -> dict[str, float]:
    """:class:`Stats` (median and p20 / p80 microseconds per call) of each implementation,
    sampled in alternating order.

    ``graphs=False`` on a GPU times eager calls between events (launch overhead included).
    """
    names = list(impls)
    samples: dict[str, list[float]] = {n: [] for n in names}
    if on_gpu(device) and not graphs:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for n in names:
            for _ in range(cfg.warmup):
                impls[n]()
        for s in range(cfg.samples):
            for n in names if s % 2 == 0 else reversed(names):
                torch.cuda.synchronize()
                start.record()
                for _ in range(cfg.calls):
                    impls[n]()
                end.record()
                end.synchronize()
                samples[n].append(start.elapsed_time(end) * 1e3 / cfg.calls)
    elif on_gpu(device):
        graphs = {n: _graph(impls[n], cfg.calls, cfg.warmup) for n in names}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for s in range(cfg.samples):
            for n in names if s % 2 == 0 else reversed(names):
                graphs[n].replay()  # warm this graph's instruction and data caches
                start.record()
                for _ in range(cfg.replays):
                    graphs[n].replay()
                end.record()
                end.synchronize()
                samples[n].append(start.elapsed_time(end) * 1e3 / (cfg.replays * cfg.calls))
        del graphs
    else:
        for n in names:
            for _ in range(cfg.warmup):
                impls[n]()
        for s in range(cfg.samples):
            for n in names if s % 2 == 0 else reversed(names):
                t0 = time.perf_counter()
                for _ in range(cfg.calls):
                    impls[n]()
                samples[n].append((time.perf_counter() - t0) * 1e6 / cfg.calls)
    return {n: Stats(v) for n, v in samples.items()}


def backends_for(op: str, device: torch.device, names=("hip", "triton")) -> list[str]:
    """The backends among ``names`` that are available on ``device`` and implement ``op``, plus
    the dispatcher's own choice for ``op`` when it is none of them (on a CPU without the Triton
    interpreter: the torch backend), so that every device shows amdqb's rows."""
    from amdqb import dispatch

    info = dispatch.device_info(device)
    found = [
        n
        for n in names
        if dispatch.backend_status(n, info)[0] and op in dispatch._backend_module(n).OPS
    ]
    try:
        chosen = dispatch.select(op, device).backend
    except RuntimeError:
        return found
    return found if chosen in found else [*found, chosen]


def copy_bandwidth(device: torch.device, nbytes: int = 58 * 2**20, cfg: TimingConfig | None = None):
    """Measured device copy bandwidth in GB/s counting bytes read + written."""
    cfg = cfg or TimingConfig()
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    us = time_alternating({"copy": lambda: dst.copy_(src)}, device, cfg)["copy"]
    return 2 * nbytes / (us * 1e-6) / 1e9, us


def environment(device: torch.device) -> dict:
    """Device, arch, versions, date and git revision for every JSON row."""
    from amdqb import __version__, dispatch

    info = dispatch.device_info(device)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    # AMDQB_GIT_COMMIT names the revision of a copied working tree whose .git is not its own
    sha = os.environ.get("AMDQB_GIT_COMMIT", "")
    try:
        sha = (
            sha
            or subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                cwd=Path(__file__).parent,
                timeout=10,
            ).stdout.strip()
        )
    except (OSError, subprocess.SubprocessError):
        sha = ""
    name = info.name
    if info.vendor == "cpu":
        import platform

        name = f"cpu ({platform.processor() or platform.machine()}, {info.cu_count} cores)"
    return {
        "device": name,
        "arch": info.arch,
        "cu_count": info.cu_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "triton": triton_version,
        "amdqb": __version__,
        "git": sha,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **RUN_INFO,
    }


# JSON path that every Report rewrites after each row (set by the CLI's --json).
AUTOSAVE: str | Path | None = None
# How this run times (method, calls, samples, CPU threads): set by the CLI, stored in every env.
RUN_INFO: dict = {}


@dataclass
class Report:
    """Rows of one benchmark run, printed as a markdown table (under a header with the device,
    the versions, the commit, the shape and the timing method) and optionally written as JSON.
    ``shape``: the suite's fixed sizes, also stored in the JSON ``env``."""

    title: str
    env: dict
    rows: list[dict] = field(default_factory=list)
    shape: dict = field(default_factory=dict)

    def __post_init__(self):
        self.env = {**self.env, "shape": dict(self.shape)} if self.shape else dict(self.env)

    def add(self, **row) -> None:
        us = row.get("us")
        if isinstance(us, Stats):  # the percentiles next to the median ("us")
            spread = {}
            for key, value in row.items():
                if key == "us":
                    spread.update(p20_us=us.p20, us=float(us), p80_us=us.p80)
                else:
                    spread[key] = value
            row = spread
        self.rows.append(row)
        if AUTOSAVE is not None:  # an interrupted run keeps every finished row
            write_json(AUTOSAVE, [self])
            print(f"[{self.title}] " + json.dumps(row, default=str), file=sys.stderr, flush=True)

    def header(self) -> list[str]:
        env = self.env
        versions = ", ".join(
            f"{k} {env[k]}" for k in ("amdqb", "torch", "triton", "cuda", "hip") if env.get(k)
        )
        where = env.get("device")
        if env.get("arch") != "cpu":
            where = f"{where} ({env.get('arch')}, {env.get('cu_count')} CUs)"
        lines = [
            f"device: {where} | {versions} | commit {env.get('git') or '?'} | {env.get('date')}"
        ]
        if env.get("shape"):
            lines.append("shape: " + ", ".join(f"{k}={v}" for k, v in env["shape"].items()))
        timing = env.get("timing")
        if timing:
            lines.append(f"timing: {timing}")
        return lines

    def markdown(self, columns: list[str] | None = None) -> str:
        head = [f"### {self.title}", *(f"{line}  " for line in self.header())]
        if not self.rows:
            return "\n".join(head) + "\n(no rows)\n"
        cols = columns or list(dict.fromkeys(k for r in self.rows for k in r))
        names = [{"us": "p50_us"}.get(c, c) for c in cols]
        lines = [*head, "", "| " + " | ".join(names) + " |"]
        lines.append("|" + "|".join("---" for _ in cols) + "|")
        for r in self.rows:
            lines.append("| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |")
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict:
        return {"title": self.title, "env": self.env, "rows": self.rows}


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) < 1e4 else f"{value:.3g}"
    return str(value)


def write_json(path: str | Path, reports: list[Report]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    existing = {}
    if path.exists():
        existing = json.loads(path.read_text())
    for report in reports:
        existing[report.title] = report.to_json()
    path.write_text(json.dumps(existing, indent=1, sort_keys=True))


class Progress:
    """A one-line progress bar on stderr (no dependency)."""

    def __init__(self, total: int, label: str):
        self.total, self.label, self.done = max(total, 1), label, 0
        self.t0 = time.perf_counter()

    def step(self, what: str = "") -> None:
        self.done += 1
        width = 30
        filled = int(width * self.done / self.total)
        elapsed = time.perf_counter() - self.t0
        sys.stderr.write(
            f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] "
            f"{self.done}/{self.total} {elapsed:5.1f}s {what[:40]:40s}"
        )
        if self.done >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()
