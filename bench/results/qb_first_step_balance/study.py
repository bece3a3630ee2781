"""Balance from the first step: the default QuantileBalancer and K3's uniform option against exact
tie-free QB in float64, over the suite's streams x logit stds x shapes.

Every cell routes one stream (``amdqb.demo.suite_stream``) with the reference
(``amdqb.demo.ExactQB64``), ``QuantileBalancer(E, k)`` (``qb_default``, with the in-bin
moments), ``QuantileBalancer(E, k, moments=False)`` (``qb_no_moments``) and
``QuantileBalancer(E, k, binning="uniform")`` (``qb_uniform``) on the same logits, and records the
MaxVio series and ``amdqb.demo.balance_metrics``: the late MaxVio (last steps // 3) and its ratio
to the reference's, the first step within 1.5x of the reference's late MaxVio (from a cold start
and, for the shift stream, after the shift at steps // 2) and the recovery peak. Writes
``results.json`` next to this file (cells are merged in, so shapes can run separately) and prints
the table.

    python bench/results/qb_first_step_balance/study.py                      # every shape (CPU)
    python bench/results/qb_first_step_balance/study.py --shapes 64x4x4096
    python bench/results/qb_first_step_balance/study.py --device cuda        # the GPU version
    python bench/results/qb_first_step_balance/study.py --table              # print, no runs
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))  # the repository root: this checkout's amdqb

import torch  # noqa: E402

import amdqb  # noqa: E402
from amdqb.demo import SUITE_KINDS, SUITE_SHAPES, SUITE_STDS, suite_case  # noqa: E402

STEPS = {64: 60, 256: 40, 896: 30}  # per E: the CPU's time for E=896, T=16384 caps it at 30
METHODS = ("qb_default", "qb_no_moments", "qb_uniform")


def parse_shape(text: str) -> tuple[int, int, int]:
    e, k, t = (int(v) for v in text.split("x"))
    return e, k, t


def cell_key(shape, kind, std, seed) -> str:
    e, k, t = shape
    return f"E{e}_k{k}_T{t}/{kind}/std{std:g}/seed{seed}"


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()} CPU ({os.cpu_count()} logical), {torch.get_num_threads()} thread"


def head_commit() -> str | None:
    """The checkout's commit (short hash; AMDQB_GIT_COMMIT for a copied tree whose .git is not
    its own, as amdqb.bench.common), None outside a git checkout."""
    import os
    import subprocess

    if os.environ.get("AMDQB_GIT_COMMIT"):
        return os.environ["AMDQB_GIT_COMMIT"]

    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True
        )
    except OSError:
        return None
    return out.stdout.strip() or None


def _hit(value) -> str:
    return "never" if value is None else str(value)


def table(results: dict) -> str:
    """Markdown: one row per cell, the reference's numbers next to each method's ("-" where a
    cell has no series of a method)."""
    head = (
        "| shape | stream | std | ref late | ref first | default late x | default first | "
        "no-moments late x | no-moments first | K3 late x | K3 first |"
    )
    lines = [head, "|" + "---|" * 11]
    for key, cell in results["cells"].items():
        shape, kind, std, _ = key.split("/")
        m = cell["metrics"]

        def first(row, shifted=cell["shift_at"] is not None):
            text = _hit(row["first_hit"])
            if shifted:
                text += f" / {_hit(row['first_hit_after_shift'])} (peak {row['recovery_peak']:.2f})"
            return text

        def cols(name, digits=3, m=m):
            row = m.get(name)
            return f"{row['late_ratio']:.{digits}f} | {first(row)}" if row else "- | -"

        ref = m["exact64"]
        lines.append(
            f"| {shape} | {kind} | {std[3:]} | {ref['late']:.3f} | {first(ref)} | "
            f"{cols('qb_default')} | {cols('qb_no_moments')} | {cols('qb_uniform', 2)} |"
        )
    return "\n".join(lines)


def ablation_table(results: dict) -> str:
    """Markdown: the default balancer against the fp32 tie-free router with the exact quantile
    (no histogram), both against the reference."""
    head = "| cell | ref late | ref first | default late x | default first | exact32 tie-free late x | exact32 tie-free first |"
    lines = [head, "|" + "---|" * 7]
    for key, cell in results.get("ablation", {}).items():
        m = cell["metrics"]
        ref, d, x = m["exact64"], m["qb_default"], m["qb_exact_tie_free"]
        lines.append(
            f"| {key} | {ref['late']:.3f} | {_hit(ref['first_hit'])} | {d['late_ratio']:.3f} | "
            f"{_hit(d['first_hit'])} | {x['late_ratio']:.3f} | {_hit(x['first_hit'])} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SUITE_SHAPES))
    p.add_argument("--kinds", default=",".join(SUITE_KINDS))
    p.add_argument("--stds", default=",".join(f"{s:g}" for s in SUITE_STDS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="steps per cell (default per shape)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default=None, help="amdqb backend (default: torch on the CPU)")
    p.add_argument("--out", default=str(HERE / "results.json"))
    p.add_argument("--table", action="store_true", help="print the table of --out and exit")
    p.add_argument(
        "--ablation",
        action="store_true",
        help="also run qb_exact_tie_free (the fp32 tie-free router with the exact quantile) and "
        "store the cells under ablation/ (not in the table)",
    )
    p.add_argument(
        "--rerun",
        default=None,
        help="comma list of methods (of exact64 and the study's) to route again; the other "
        "methods' series are kept from --out's cell of the same shape, stream, std, seed and "
        "steps (the stream is the same draw), so a change to one balancer reruns only that one",
    )
    args = p.parse_args(argv)
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {"cells": {}}
    if args.table:
        print(table(results))
        if results.get("ablation"):
            print()
            print(ablation_table(results))
        return 0
    device = torch.device(args.device)
    backend = args.backend or ("torch" if device.type == "cpu" else None)
    torch.set_num_threads(1)  # the per-step tensors are small: extra threads only cost time
    results.update(
        question="steps to balance and late MaxVio of QuantileBalancer's default and uniform "
        "options against exact tie-free QB in float64, per stream x logit std x shape",
        versions={"amdqb": amdqb.__version__, "torch": torch.__version__},
        protocol={
            "steps": "60 (E=64), 40 (E=256), 30 (E=896) unless --steps",
            "late_window": "the last steps // 3",
            "shift_at": "steps // 2 (shift stream)",
            "first_hit": "first step with MaxVio <= 1.5x the reference's late MaxVio",
            "recovery_peak": "max MaxVio of steps shift_at+1 .. shift_at+5",
            "methods": list(METHODS),
        },
    )
    for shape in (parse_shape(s) for s in args.shapes.split(",")):
        e, k, t = shape
        steps = args.steps or STEPS.get(e, 40)
        for kind in args.kinds.split(","):
            for std in (float(s) for s in args.stds.split(",")):
                start = time.perf_counter()
                names = (*METHODS, "qb_exact_tie_free") if args.ablation else METHODS
                key = cell_key(shape, kind, std, args.seed)
                old = results["cells"].get(key)
                known = {}
                if args.rerun is not None and old is not None and old["steps"] == steps:
                    rerun = args.rerun.split(",")
                    known = {n: v for n, v in old["series"].items() if n not in rerun}
                cell = suite_case(
                    kind, e, k, t, std, steps, seed=args.seed, names=names, device=device,
                    backend=backend, known=known,
                )  # fmt: skip
                cell.update(
                    machine=machine(device), backend=backend or "dispatcher", commit=head_commit()
                )
                where = results.setdefault("ablation", {}) if args.ablation else results["cells"]
                if known:  # the kept series were measured with the earlier cell's code
                    cell["kept_from"] = {n: old.get("commit") or "an earlier run" for n in known}
                where[key] = cell
                out.write_text(json.dumps(results, indent=1) + "\n")
                m = cell["metrics"]
                print(
                    f"{cell_key(shape, kind, std, args.seed)}: ref late {m['exact64']['late']:.3f}"
                    f", default x{m['qb_default']['late_ratio']:.3f} first "
                    f"{_hit(m['qb_default']['first_hit'])}, no moments "
                    f"x{m['qb_no_moments']['late_ratio']:.3f} first "
                    f"{_hit(m['qb_no_moments']['first_hit'])}"
                    f", K3 x{m['qb_uniform']['late_ratio']:.2f}"
                    f" ({time.perf_counter() - start:.0f} s)",
                    flush=True,
                )
    print(ablation_table(results) if args.ablation else table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
