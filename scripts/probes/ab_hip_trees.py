"""Two versions of the ``hip_src`` kernels side by side in one process, on a GPU: the serving entry
points of ``amdqb bench compat`` (``amdqb.bench.compat``), each timed with the repository's
kernels and with another copy of ``hip_src``, in graph replay with alternating samples, next to
the launch floor of the same run. Config variants of the repository's kernels (``--set``) add
columns; every variant's outputs must equal the repository kernels' bit for bit.

The other copy is a folder holding ``include/`` and ``kernels/``, e.g. an earlier commit's:

    git archive <rev> hip_src | tar -x -C /tmp/old
    PYTHONPATH=$PWD python scripts/probes/ab_hip_trees.py --old /tmp/old/hip_src \\
        -k moe_align_block_size --tokens 8,64,512,2048 --set hip.align.single_block_routes=2048 \\
        --out /tmp/ab.json

Each tree's modules are compiled and cached apart (the cache key holds the sources' digests);
the runtime's loaded modules are swapped when a call switches trees, so every captured graph
holds its own tree's kernels.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def parse_set(items: list[str]) -> list[tuple[str, dict]]:
    """``key=value`` (one variant each; values parsed as JSON where they can be)."""
    out = []
    for item in items:
        key, _, raw = item.partition("=")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        out.append((item, {key: value}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, type=Path, help="another hip_src folder")
    ap.add_argument("-k", default="", help="only cases whose op or shape contains this")
    ap.add_argument("--tokens", default="", help="only these T / M (comma-separated)")
    ap.add_argument("--set", action="append", default=[], help="config variant key=value")
    ap.add_argument("--out", type=Path, help="rows as JSON")
    args = ap.parse_args()

    from amdqb import configs
    from amdqb.backends.hip import _runtime, _spec
    from amdqb.bench import compat
    from amdqb.bench.common import TimingConfig, environment, time_alternating
    from amdqb.devices import tensor_device_info

    old = args.old.resolve()
    if not (old / "include").is_dir() or not (old / "kernels").is_dir():
        raise SystemExit(f"--old: {old} holds no include/ and kernels/")
    device = torch.device("cuda")
    arch = tensor_device_info(torch.empty(0, device=device)).arch_family
    runtime = _runtime.get_runtime()
    repo_root = _spec.source_root
    trees = {"new": repo_root, "old": lambda: old}
    loaded = {name: ({}, {}, {}) for name in trees}

    def use(name: str) -> None:
        _spec.source_root = trees[name]
        runtime._kernels, runtime._modules, runtime._failed = loaded[name]

    def variant(tree: str, fn, values: dict | None = None):
        def call():
            use(tree)
            with configs.override(arch, values) if values else contextlib.nullcontext():
                return fn()

        return call

    g = torch.Generator().manual_seed(0)
    cases = compat.router_cases(device, g) + compat.align_cases(device, g)
    tokens = {int(t) for t in args.tokens.split(",") if t}
    cases = [c for c in cases if args.k in c[0] + " " + c[1] and (not tokens or c[2] in tokens)]
    settings = parse_set(args.set)
    cfg = TimingConfig(calls=20, replays=10, samples=15, warmup=3)
    one = torch.zeros(1, device=device)
    rows = []
    try:
        for op, shape, t, fn in cases:
            impls = {"new": variant("new", fn), "old": variant("old", fn)}
            impls.update({label: variant("new", fn, values) for label, values in settings})
            want = tuple(x.clone() for x in impls["new"]())
            same = {}
            for name, impl in impls.items():
                got = impl()
                same[name] = all(torch.equal(a, b) for a, b in zip(got, want))
            impls["floor"] = lambda: one.add_(1)
            times = time_alternating(impls, device, cfg)
            row = dict(op=op, shape=shape, T=t, same=same)
            row.update({name: round(float(v), 3) for name, v in times.items()})
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        _spec.source_root = repo_root
    if args.out:
        report = dict(env=environment(device), old=str(old), rows=rows)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
