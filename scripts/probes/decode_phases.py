"""Where a decode-size serving call spends its cycles, on an NVIDIA GPU: clock64 stamps between the
phases of ``amdqb_topk`` (row 0, lane 0) and of the one-block ``amdqb_align`` (thread 0).

A copy of ``hip_src`` with the stamps inserted is built into a temporary folder and loaded in place
of the repository's kernels (the stamped modules carry an extra define, so they never share a cache
entry with the real ones); the stamps go to a buffer passed through an argument the compact
outputs do not use (``TopkParams.scores``; ``AlignParams.tile_counts`` of the one-block form).
Phases of ``amdqb_topk``: load (bounds check to the loads issued), score (the loads' latency and
the scores), select (the row's Top-k), weights, store. Of ``amdqb_align``: zero_fill (LDS rows
and the sentinel), count, warp_bases, scan, expert_ids, walk.

    PYTHONPATH=$PWD python scripts/probes/decode_phases.py --out /tmp/decode_phases.json

The stamps themselves cost a few tens of cycles each; compare phases, not absolute totals.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _insert(text: str, anchor: str, add: str, after: bool = True) -> str:
    if text.count(anchor) != 1:
        raise SystemExit(f"anchor not found once in the kernel source: {anchor[:60]!r}")
    return text.replace(anchor, anchor + add if after else add + anchor)


# (kernel signature, stamp macro, [(anchor, text, text goes after the anchor)], last stamp)
TOPK_STAMPS = (
    "AMDQB_KERNEL void AMDQB_LAUNCH_BOUNDS(BLOCK) amdqb_topk(TopkParams p) {",
    "#define STAMP(i) do { if (p.scores != nullptr && blockIdx.x == 0 && threadIdx.x == 0) "
    "reinterpret_cast<long long*>(p.scores)[i] = clock64(); } while (0)\n",
    [
        (
            "  if (first >= p.tokens) return;  // uniform across the logical warp\n",
            "  STAMP(0);\n",
            True,
        ),
        ("  for (int i = 0; i < V; ++i) keep_loaded(raw[i]);\n", "  STAMP(1);\n", True),
        (
            "  if (IN_MATH) {\n",
            "  { float q = s[0]; keep_loaded(q); s[0] = q; } STAMP(2);\n",
            False,
        ),
        (
            "  float acc[KP];\n",
            "  { u32 q = (u32)(top[0] >> 32); keep_loaded(q); top[0] = ((u64)q << 32) | (u32)top[0];"
            " float w0 = wk[0]; keep_loaded(w0); wk[0] = w0; } STAMP(3);\n",
            False,
        ),
        (
            "  const bool padded_row",
            "  { float q = wk[0]; keep_loaded(q); wk[0] = q; } STAMP(4);\n",
            False,
        ),
    ],
    "STAMP(5)",
)
ALIGN_STAMPS = (
    "AMDQB_KERNEL void AMDQB_LAUNCH_BOUNDS(1024) amdqb_align(AlignParams p) {",
    "#define ASTAMP(i) do { if (p.tiles == 1 && p.tile_counts != nullptr && threadIdx.x == 0) "
    "reinterpret_cast<long long*>(p.tile_counts)[i] = clock64(); } while (0)\n",
    [
        ("  int* mine = next + (w < warps ? w : 0) * E;\n", "  ASTAMP(0);\n", True),
        (
            "  if (p.tiles == 1 && !(p.flags & 4)) fill_i32(p.sorted_ids, p.sorted_len, (int)p.n, tid, "
            "nt);\n  block_sync();\n",
            "  ASTAMP(1);\n",
            True,
        ),
        (
            "  if (p.tiles > 1) wait_for_prior_grid();  // tile_counts (and the sentinel fill): "
            "amdqb_align_hist\n  block_sync();\n",
            "  ASTAMP(2);\n",
            True,
        ),
        ("  u32 padded_total;\n", "  ASTAMP(3);\n", False),
        ("  const i64 total = (i64)padded_total;\n", "  ASTAMP(4);\n", True),
        (
            "    if (blockIdx.x == 0 && tid == h0) p.post_pad[0] = (int)total;\n  }\n",
            "  ASTAMP(5);\n",
            True,
        ),
    ],
    "ASTAMP(6)",
)


def _stamp(path: Path, stamps) -> None:
    """The kernel (the last function of the file) at path with its stamps."""
    kernel, macro, points, last = stamps
    s = _insert(path.read_text(), kernel, macro, after=False)
    for anchor, add, after in points:
        s = _insert(s, anchor, add, after)
    s = s.rstrip()
    path.write_text(s[: s.rindex("}")] + f"  {last};\n}}\n")


def stamped_sources(dst: Path) -> None:
    """hip_src with the stamps, into dst."""
    shutil.copytree(ROOT / "hip_src", dst)
    _stamp(dst / "kernels" / "topk.hip", TOPK_STAMPS)
    _stamp(dst / "kernels" / "layout.hip", ALIGN_STAMPS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="decode_phases.json")
    ap.add_argument("--calls", type=int, default=30)
    args = ap.parse_args()

    from amdqb import configs, dispatch
    from amdqb.backends.hip import _spec
    from amdqb.backends.hip import layout as hip_layout
    from amdqb.backends.hip import topk as hip_topk
    from amdqb.compat import vllm
    from amdqb.ref.layout import align_buffer_sizes

    tmp = Path(tempfile.mkdtemp(prefix="amdqb_stamped_"))
    stamped_sources(tmp / "hip_src")
    _spec.source_root = lambda: tmp / "hip_src"
    for name in ("topk_module", "layout_module"):
        base = getattr(_spec, name)
        setattr(
            _spec, name, lambda *a, _b=base, **k: _b(*a, **k).with_defines(("AMDQB_STAMPED", "1"))
        )

    dev = torch.device("cuda")
    arch = dispatch.device_info(dev).arch_family
    stamps = torch.zeros(16, dtype=torch.int64, device=dev)
    params = hip_topk._params
    hip_topk._params = lambda logits, bias, **f: params(
        logits, bias, **dict(f, scores=stamps.data_ptr())
    )
    align_params = hip_layout.AlignParams
    hip_layout.AlignParams = lambda *a: align_params(
        *(a[:2] + (stamps.data_ptr() if a[2] is None else a[2],) + a[3:])
    )
    g = torch.Generator().manual_seed(0)
    rows = []

    def measure(label, fn, names, values=None):
        deltas = []
        for _ in range(args.calls):
            stamps.zero_()
            with configs.override(arch, values or {}, "probe"):
                fn()
            torch.cuda.synchronize()
            v = stamps.cpu().tolist()
            n = len(names)
            deltas.append([v[i + 1] - v[i] for i in range(n)] + [v[n] - v[0]])
        med = [statistics.median(d[i] for d in deltas[5:]) for i in range(len(names) + 1)]
        row = dict(case=label, **dict(zip(names, med)), total=med[-1])
        rows.append(row)
        print(json.dumps(row), flush=True)

    topk_phases = ("load", "score", "select", "weights", "store")
    for t in (1, 64):
        x8 = torch.randn(t, 8, generator=g).to(dev)
        for slots in (1, 2, 4, 8):
            measure(
                f"E=8 k=2 fp32 softmax, T={t}, {slots} experts per lane",
                lambda x=x8: vllm.fused_topk(x, x, 2, True),
                topk_phases,
                {"hip.topk.decode_lane_slots": slots},
            )
        x128 = torch.randn(t, 128, generator=g).to(dev, torch.bfloat16)
        measure(
            f"E=128 k=8 bf16 softmax, T={t}",
            lambda x=x128: vllm.fused_topk(x, x, 8, True),
            topk_phases,
        )
        x256 = torch.randn(t, 256, generator=g).to(dev)
        b256 = (torch.randn(256, generator=g) * 0.1).to(dev)
        measure(
            f"DeepSeek-V3 gate, T={t}",
            lambda x=x256, b=b256: vllm.grouped_topk(x, x, 8, True, 8, 4, "sigmoid", 2.5, b),
            topk_phases,
        )
    align_phases = ("zero_fill", "count", "warp_bases", "scan", "expert_ids", "walk")
    for m in (8, 64, 512, 2048):
        ids = torch.rand(m, 256, generator=g).argsort(dim=1)[:, :8].to(dev, torch.int32)
        n_rows, n_blocks = align_buffer_sizes(ids.numel(), 256, 64, False)
        bufs = [
            torch.empty(n_rows, dtype=torch.int32, device=dev),
            torch.empty(n_blocks, dtype=torch.int32, device=dev),
            torch.empty(1, dtype=torch.int32, device=dev),
        ]
        measure(
            f"align one block, E=256 k=8 block 64, M={m}",
            lambda ids=ids, bufs=bufs: vllm._custom_ops.moe_align_block_size(ids, 256, 64, *bufs),
            align_phases,
            {"hip.align.single_block_routes": 1 << 30},
        )
    Path(args.out).write_text(
        json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1)
    )
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
