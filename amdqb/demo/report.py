"""Text output of the demo: the per-step table, the summary and the scales table."""

from __future__ import annotations

import math
import sys

from .methods import REFERENCE, SHORT
from .run import HIT_FACTOR, balance_metrics

FIRST_STEPS = 6  # the per-step table prints every one of the first steps, then every N-th
EARLY = (1, 2, 3)  # steps whose MaxVio the summary shows


def _fmt(value, width: int = 7, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-".rjust(width)
    return f"{value:{width}.{digits}f}"


def _pct(value, width: int = 7) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-".rjust(width)
    return f"{100 * value:{width - 1}.1f}%"


def _hit(value, width: int = 6) -> str:
    return ("never" if value is None else str(value)).rjust(width)


def step_table_rows(steps: int, every: int) -> list[int]:
    """The steps the per-step table prints: each of the first ``FIRST_STEPS``, every ``every``-th
    after them, and the last."""
    rows = list(range(min(steps, FIRST_STEPS)))
    rows += [s for s in range(FIRST_STEPS, steps) if s % every == 0]
    if steps - 1 not in rows:
        rows.append(steps - 1)
    return rows


def print_step(step: int, hist: dict, methods, out=None) -> None:
    out = out or sys.stdout
    row = " ".join(_fmt(hist[m.name].maxvio[-1], width=10) for m in methods)
    print(f"{step:5d} {row}", file=out, flush=True)


def print_step_header(methods, out=None) -> None:
    out = out or sys.stdout
    print("MaxVio per step (every one of the first steps, then every N-th)", file=out)
    print(f"{'step':>5s} " + " ".join(f"{SHORT[m.name]:>10s}" for m in methods), file=out)


def _late(values: list, window: int) -> float | None:
    tail = [v for v in values[-window:] if not math.isnan(v)]
    return sum(tail) / len(tail) if tail else None


def summarise(methods, hist, window: int, shift_at=None) -> dict:
    """Per method: the balance metrics (``amdqb.demo.run.balance_metrics``, when the reference
    ran), the first steps' MaxVio, late means (last ``window`` steps), the final bias and the
    per-step series."""
    series = {m.name: hist[m.name].maxvio for m in methods}
    metrics = balance_metrics(series, window, shift_at) if REFERENCE in series else {}
    final = {}
    for m in methods:
        h = hist[m.name]
        final[m.name] = {
            "label": m.label,
            **metrics.get(m.name, {}),
            "early_maxvio": {str(s): h.maxvio[s] for s in EARLY if s < len(h.maxvio)},
            "late_maxvio": _late(h.maxvio, window),
            "late_cv2": _late(h.cv2, window),
            "late_tie_at_cutoff": _late(h.tie_share, window),
            "final_bias_range": h.bias_range[-1] if h.bias_range else None,
            "final_bias": [float(v) for v in m.bias.tolist()],
            "maxvio": h.maxvio,
            "cv2": h.cv2,
            "tie_at_cutoff": h.tie_share,
        }
    return final


LEGEND = (
    "MaxVio = max/mean load - 1. step 1/2/3: MaxVio after 1, 2, 3 updates (step 0 routes with\n"
    f"bias 0 for all). first: the first step within {HIT_FACTOR:g}x of the reference's late MaxVio. "
    "late: mean of\nthe last window; x ref: late / the reference's. range: max - min bias. tie: "
    "share of tokens whose\nk-th and (k+1)-th selection values are equal in the method's precision "
    "(fp32; fp64 for the reference)."
)


def report(methods, final, window: int, out=None) -> None:
    out = out or sys.stdout
    print(file=out)
    print(f"Summary: the first steps, and means over the last {window} steps", file=out)
    early = " ".join(f"{'step ' + str(s):>7s}" for s in EARLY)
    print(
        f"{'method':<42s} {early} {'first':>6s} {'late':>7s} {'x ref':>6s} {'CV2':>7s} "
        f"{'range':>9s} {'tie':>7s}",
        file=out,
    )
    for m in methods:
        row = final[m.name]
        cells = " ".join(_fmt(row["early_maxvio"].get(str(s))) for s in EARLY)
        ratio = row.get("late_ratio")
        rng = row["final_bias_range"]
        print(
            f"{m.label:<42s} {cells} {_hit(row.get('first_hit'))} {_fmt(row['late_maxvio'])} "
            f"{_fmt(ratio, 6, 2)} {_fmt(row['late_cv2'])} "
            f"{'-'.rjust(9) if rng is None else format(rng, '9.3g')} "
            f"{_pct(row['late_tie_at_cutoff'])}",
            file=out,
        )
    print(LEGEND, file=out)


def report_scales(methods, per_scale: dict, window: int, out=None) -> None:
    """The methods x scales tables: late MaxVio (and its ratio to the reference), the first step
    within 1.5x of the reference, the cutoff tie share."""
    out = out or sys.stdout
    scales = list(per_scale)
    head = "".join(f"{'std ' + format(s, 'g'):>16s}" for s in scales)
    print(file=out)
    print(f"MaxVio, mean of the last {window} steps (x the reference's) by logit std", file=out)
    print(f"{'method':<42s}{head}", file=out)
    for m in methods:
        cells = ""
        for s in scales:
            row = per_scale[s][m.name]
            ratio = row.get("late_ratio")
            text = f"{row['late_maxvio']:.3f}"
            if ratio is not None and m.name != REFERENCE:
                text += f" ({ratio:.2f}x)"
            cells += f"{text:>16s}"
        print(f"{m.label:<42s}{cells}", file=out)
    print(file=out)
    print(f"First step within {HIT_FACTOR:g}x of the reference's late MaxVio", file=out)
    print(f"{'method':<42s}{head}", file=out)
    for m in methods:
        cells = "".join(_hit(per_scale[s][m.name].get("first_hit"), 16) for s in scales)
        print(f"{m.label:<42s}{cells}", file=out)
    print(file=out)
    print("tie at the cutoff (share of tokens, same window)", file=out)
    print(f"{'method':<42s}{head}", file=out)
    for m in methods:
        cells = "".join(_pct(per_scale[s][m.name]["late_tie_at_cutoff"], 16) for s in scales)
        print(f"{m.label:<42s}{cells}", file=out)
    print(LEGEND, file=out)
