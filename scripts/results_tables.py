"""The performance tables of docs/performance.md, generated from a results file
(``bench/results/<device>.json``, written by ``amdqb bench all --json``), so the docs and the data
cannot disagree.

    python scripts/results_tables.py [bench/results/h200.json] [--arch sm_90] [--doc docs/performance.md]

``--doc`` replaces the text between the file's ``BEGIN`` and ``END`` markers below instead of
printing (op_tests/test_configs.py checks that docs/performance.md holds what this script
generates).

Each table shows the backend the dispatcher picks on ``--arch`` (its config's backend order, first
backend present in the rows) and the floor measured in the same run (a device copy of the same
bytes, or one kernel launch) where the rows carry it. No peer figure appears: the peers' kernels
are not measured by ``amdqb bench`` (docs/targets.md and docs/serving.md state theirs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from amdqb import configs  # noqa: E402


def _default(rows, op: str, arch: str) -> str:
    present = {r["backend"] for r in rows}
    for name in configs.load(arch).backend_order(op):
        if name in present:
            return name
    raise SystemExit(f"no backend of the {op} order in the rows")


def _us(value) -> str:
    return "–" if value is None else (f"{value:.1f}" if value >= 10 else f"{value:.2f}")


def _x(value) -> str:
    return "–" if value is None else f"{value:.2f}×"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _pick(rows, **want):
    """The first row with these fields (``moments`` False matches rows without the field)."""
    for r in rows:
        if all(r.get(k, False if k == "moments" else None) == v for k, v in want.items()):
            return r
    return None


def _floor(row) -> str:
    return _us(row.get("floor_us") if row else None)


def router(results, arch):
    rows = results["router"]["rows"]
    b = _default(rows, "router_fwd", arch)
    out = []
    for t in sorted({r["T"] for r in rows}):
        noqb = _pick(rows, T=t, backend=b, mode="noqb", activation="exact")
        approx = _pick(rows, T=t, backend=b, mode="noqb", activation="approximate")
        uni = _pick(rows, T=t, backend=b, mode="auto", binning="uniform")
        lm = _pick(rows, T=t, backend=b, mode="auto", binning="log_margin", selection="te")
        margin = dict(T=t, backend=b, mode="auto", binning="log_margin", selection="tie_free")
        tf = _pick(rows, **margin, moments=False)
        mom = _pick(rows, **margin, moments=True)
        torch_qb = _pick(rows, T=t, mode="te_style_qb")
        out.append(
            [
                str(t),
                _us(noqb and noqb["us"]),
                _floor(noqb),
                _x(noqb and noqb.get("x_floor")),
                _us(approx and approx["us"]),
                _us(uni and uni["us"]),
                _x(uni and uni.get("qb/noqb")),
                _us(lm and lm["us"]),
                _x(lm and lm.get("qb/noqb")),
                _us(tf and tf["us"]),
                _us(mom and mom["us"]),
                _x(mom and mom.get("qb/noqb")),
                _us(torch_qb and torch_qb["us"]),
            ]
        )
    header = [
        "T",
        "no QB µs",
        "copy floor µs",
        "no QB / floor",
        "approx. activation µs",
        "QB uniform µs",
        "uniform / no QB",
        "QB log_margin µs",
        "log_margin / no QB",
        "+ tie_free µs",
        "+ moments µs",
        "moments / no QB",
        "PyTorch QB µs",
    ]
    note = (
        f'backend: `{b}`; QB columns: `qb_histogram_mode="auto"`; uniform B=1000, log_margin '
        "B=64; + moments: tie_free with the in-bin moments (the balancer's default); approx. activation: no QB with `approximate_activation=True`; copy floor: a device "
        "copy of the router's own bytes (logits in, probs and byte map out) in the same run"
    )
    return note + "\n\n" + _table(header, out)


def biased_topk(results, arch):
    rows = results["biased_topk"]["rows"]
    b = _default(rows, "biased_topk", arch)
    backends = sorted({r["backend"] for r in rows}, key=lambda n: (n != b, n))
    out = []
    for t in sorted({r["T"] for r in rows}):
        ours = _pick(rows, T=t, backend=b)
        out.append(
            [str(t)]
            + [_us((_pick(rows, T=t, backend=n) or {}).get("us")) for n in backends]
            + [_floor(ours)]
        )
    header = ["T"] + [f"`{n}` µs" + (" (default)" if n == b else "") for n in backends]
    return _table(header + ["launch floor µs"], out)


def route_rows(results, arch):
    rows = results["route_rows"]["rows"]
    b = _default(rows, "route_rows", arch)
    out = []
    for m in sorted({r["M"] for r in rows}):
        for dist in ("uniform", "one", "uniform_compact"):
            lds = _pick(rows, M=m, backend=b, dist=dist, impl="lds")
            atomic = _pick(rows, M=m, backend=b, dist=dist, impl="atomic")
            det = _pick(rows, M=m, backend=b, dist=dist, impl="deterministic")
            torch_ = _pick(rows, M=m, dist=dist, impl="bincount_argsort")
            if lds is None:
                continue
            ratio = atomic["us"] / lds["us"] if atomic else None
            out.append(
                [
                    str(m),
                    dist,
                    _us(lds["us"]),
                    _us(atomic and atomic["us"]),
                    _x(ratio),
                    _us(det and det["us"]),
                    _us(torch_ and torch_["us"]),
                ]
            )
    header = ["M", "ids", "lds µs", "atomic µs", "atomic / lds", "deterministic µs", "torch µs"]
    return f"backend: `{b}`\n\n" + _table(header, out)


def align(results, arch):
    rows = results["moe_align_block_size"]["rows"]
    b = _default(rows, "align_block_size", arch)
    out = []
    for m in sorted({r["M"] for r in rows}):
        ours = _pick(rows, M=m, backend=b)
        out.append(
            [
                str(m),
                _us(ours["us"]),
                _floor(ours),
                _x(ours.get("x_floor")),
                _us((_pick(rows, M=m, backend="triton") or {}).get("us")),
            ]
        )
    header = ["M (tokens)", f"`{b}` µs", "launch floor µs", "/ floor", "amdqb `triton` µs"]
    return _table(header, out)


def compat(results, arch):
    """The serving entry points at the peers' shapes (``amdqb bench compat``)."""
    if "serving_entry_points" not in results:
        return "(not measured in this results file: `amdqb bench compat`)"
    rows = results["serving_entry_points"]["rows"]
    out = [
        [
            f"`{r['op']}`",
            r["shape"],
            str(r["T"]),
            _us(r["us"]),
            _floor(r),
            _x(r.get("x_floor")),
            str(r.get("launches", "–")),
        ]
        for r in rows
    ]
    header = ["entry point", "shape", "T (M)", "µs", "launch floor µs", "/ floor", "kernels"]
    return _table(header, out)


def chunks(results, arch):
    rows = results["chunks"]["rows"]
    b = _default(rows, "chunk_copy", arch)
    out = []
    for n in sorted({r["N"] for r in rows}):
        ours = _pick(rows, N=n, backend=b)
        base = _pick(rows, N=n, backend="torch", impl="split_cat")
        out.append(
            [
                str(n),
                _us(ours["us"]),
                f"{ours['%copy']:.0f}%",
                _us(base and base["us"]),
                _x(base["us"] / ours["us"] if base else None),
                f"{ours['peak_extra_MiB']:.1f} / {ours['outputs_MiB']:.1f}",
            ]
        )
    header = ["N", f"`{b}` µs", "of copy bandwidth", "torch split + cat µs", "speed-up"]
    return _table(header + ["extra peak / outputs MiB"], out)


def balancer(results, arch):
    rows = results["balancer_step"]["rows"]
    b = _default(rows, "qb_step", arch)
    out = []
    for r in rows:
        if r["backend"] != b:
            continue
        base = _pick(rows, E=r["E"], B=r["B"], backend="torch", **_extra(r))
        label = ", ".join(f"{k}={r[k]}" for k in ("binning",) if k in r)
        out.append(
            [f"E={r['E']}, B={r['B']}" + (f", {label}" if label else ""), _us(r["us"])]
            + [_us(base and base["us"])]
        )
    return _table(["shape", f"`{b}` µs", "torch µs"], out)


def _extra(row):
    return {k: row[k] for k in ("binning",) if k in row}


def serving(results, arch):
    rows = results["serving_moe"]["rows"]
    if rows and "part" not in rows[0]:
        return "(older row format)"
    out = []
    for m in sorted({r["M"] for r in rows}):
        rg = [r for r in rows if r["M"] == m and r["mode"] == "graph" and r["backend"] != "torch"]
        route = next((r for r in rg if r["part"] == "route"), None)
        layer = next((r for r in rg if r["part"] == "layer"), None)
        if not (route and layer):
            continue
        out.append([str(m), _us(route["us"]), _us(layer["us"]), f"{route['route_%']:.1f}%"])
    return _table(["tokens", "routing µs (graph)", "layer µs (graph)", "routing share"], out)


TABLES = {
    "router": router,
    "biased_topk": biased_topk,
    "route_rows": route_rows,
    "align": align,
    "compat": compat,
    "chunks": chunks,
    "balancer": balancer,
    "serving": serving,
}


def env_line(results) -> str:
    env = results["router"]["env"]
    return (
        f"{env['device']}, torch {env['torch']}, Triton {env['triton']}, CUDA {env.get('cuda')}, "
        f"commit {env['git']}, {env['date'][:10]}"
    )


BEGIN = "<!-- performance tables: generated by scripts/results_tables.py -->"
END = "<!-- end of the generated performance tables -->"


# the results-file suite each table reads (its env names the commit it measured)
SUITE_OF = {
    "router": "router",
    "biased_topk": "biased_topk",
    "route_rows": "route_rows",
    "align": "moe_align_block_size",
    "compat": "serving_entry_points",
    "chunks": "chunks",
    "balancer": "balancer_step",
    "serving": "serving_moe",
}


def measured(results, table: str) -> str:
    env = results.get(SUITE_OF[table], {}).get("env")
    if not env:
        return ""
    return f"measured at commit {env.get('git') or '?'}, {str(env.get('date', ''))[:10]}\n\n"


def render(results: dict, arch: str, only: str | None = None) -> str:
    parts = [f"<!-- {env_line(results)} -->\n"]
    for name, fn in TABLES.items():
        if only in (None, name):
            parts.append(f"#### {name}\n\n{measured(results, name)}{fn(results, arch)}\n")
    return "\n".join(parts)


def with_tables(text: str, tables: str) -> str:
    """``text`` with the part between :data:`BEGIN` and :data:`END` replaced by ``tables``."""
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise SystemExit(f"no {BEGIN!r} ... {END!r} section to replace")
    return f"{head}{BEGIN}\n\n{tables}\n{END}{tail}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", default=str(ROOT / "bench/results/h200.json"))
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--only", choices=sorted(TABLES), default=None)
    parser.add_argument("--doc", default=None, help="rewrite this file's tables in place")
    args = parser.parse_args(argv)
    tables = render(json.loads(Path(args.path).read_text()), args.arch, args.only)
    if args.doc is None:
        print(tables)
        return 0
    path = Path(args.doc)
    path.write_text(with_tables(path.read_text(), tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
