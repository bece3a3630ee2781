"""The loop that routes a stream with every method, and the balance metrics computed from it.

Metrics of one run (:func:`balance_metrics`), against the reference (``exact64``):

* ``late``: the mean MaxVio of the last ``window`` steps; ``late_ratio`` = late / the reference's;
* ``first_hit``: the first step whose MaxVio is at most 1.5x the reference's late MaxVio (step 0
  routes with bias 0 for every method: the first balanced step is 1 at best);
* ``first_hit_after_shift`` (a stream with a shift at step S): the same from step S on, counted
  from S (S itself routes with the bias of the old router, so 1 at best);
* ``recovery_peak``: the largest MaxVio of steps S + 1 ... S + 5.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field

import torch

from .methods import REFERENCE, Method

HIT_FACTOR = 1.5  # "balanced": within 1.5x of the reference's late MaxVio
RECOVERY_STEPS = 5  # the recovery peak's window after a shift


@dataclass
class History:
    maxvio: list = field(default_factory=list)
    cv2: list = field(default_factory=list)
    bias_range: list = field(default_factory=list)
    tie_share: list = field(default_factory=list)
    first_load: list | None = None
    last_load: list | None = None


def cutoff_tie_share(logits: torch.Tensor, method: Method) -> float:
    """Share of tokens whose k-th and (k+1)-th selection values are equal in the method's own
    precision (fp32 ``s + b`` or ``b - sigmoid(-z)``; float64 for the reference): experts the
    router cannot tell apart, so no bias it can hold splits them."""
    from ..ref.router import selection_values, sigmoid_complement

    if method.selection == "fp64":
        values = method.bias[None, :] - torch.sigmoid(-logits.double())
    else:
        s = torch.sigmoid(logits.float())
        c = sigmoid_complement(logits) if method.selection == "tie_free" else None
        values = selection_values(s, method.bias, method.selection, c)
    top = torch.topk(values, method.topk + 1, dim=1).values
    return float((top[:, method.topk - 1] == top[:, method.topk]).float().mean())


def _progress(step: int, total: int, start: float, label: str = "") -> None:
    if not sys.stderr.isatty():
        return
    width = 30
    done = int(width * step / total)
    elapsed = time.perf_counter() - start
    sys.stderr.write(
        f"\r{label}[{'#' * done}{'.' * (width - done)}] {step}/{total}  {elapsed:5.1f}s"
    )
    if step == total:
        sys.stderr.write("\r" + " " * (len(label) + width + 30) + "\r")
    sys.stderr.flush()


def simulate(stream, methods, steps: int, *, diagnostics=True, on_step=None, label=""):
    """Route ``steps`` batches of ``stream`` with every method (``torch.no_grad``); returns
    ``{name: History}``. ``diagnostics``: also CV^2, bias range and the cutoff tie share (the
    bias each step routes with). ``on_step(step, histories)`` runs after each step."""
    import amdqb

    hist = {m.name: History() for m in methods}
    start = time.perf_counter()
    with torch.no_grad():
        for step in range(steps):
            logits = stream.next()
            for m in methods:
                h = hist[m.name]
                if diagnostics:
                    h.tie_share.append(cutoff_tie_share(logits, m))
                    h.bias_range.append(float(m.bias.max() - m.bias.min()))
                load = m.route(logits).sum(0)
                m.update(logits, load)
                h.maxvio.append(float(amdqb.maxvio(load)))
                if diagnostics:
                    h.cv2.append(float(amdqb.cv2(load)))
                if step == 0:
                    h.first_load = load.tolist()
                if step == steps - 1:
                    h.last_load = load.tolist()
            if on_step is not None:
                on_step(step, hist)
            _progress(step + 1, steps, start, label)
    return hist


def _mean(values) -> float:
    return sum(values) / len(values) if values else math.nan


def first_at_most(series, target: float, start: int = 0):
    """The first index ``>= start`` whose value is at most ``target``, counted from ``start``
    (None when there is none)."""
    for i in range(start, len(series)):
        if series[i] <= target:
            return i - start
    return None


def balance_metrics(series: dict, window: int, shift_at: int | None = None) -> dict:
    """Per method (``{name: MaxVio per step}``, the reference included): ``late``,
    ``late_ratio``, ``first_hit``, and with ``shift_at`` ``first_hit_after_shift`` and
    ``recovery_peak`` (see the module docstring)."""
    ref_late = _mean(series[REFERENCE][-window:])
    target = HIT_FACTOR * ref_late
    out = {}
    for name, values in series.items():
        late = _mean(values[-window:])
        row = {
            "late": late,
            "late_ratio": late / ref_late if ref_late > 0 else math.nan,
            "first_hit": first_at_most(values, target),
        }
        if shift_at is not None:
            row["first_hit_after_shift"] = first_at_most(values, target, shift_at)
            row["recovery_peak"] = max(values[shift_at + 1 : shift_at + 1 + RECOVERY_STEPS])
        out[name] = row
    return out


STUDY_METHODS = ("qb_default", "qb_no_moments", "qb_uniform")


def suite_case(
    kind: str,
    experts: int,
    topk: int,
    tokens: int,
    logit_std: float,
    steps: int,
    *,
    seed: int = 0,
    names=STUDY_METHODS,
    device: torch.device | str = "cpu",
    backend: str | None = None,
    known: dict | None = None,
) -> dict:
    """One cell of the balance suite: stream ``kind`` at ``logit_std``, ``steps`` steps (the
    ``shift`` stream shifts at ``steps // 2``; the late window is the last ``steps // 3``),
    the reference and the methods ``names`` on the same logits. Returns the configuration, the
    MaxVio series, :func:`balance_metrics` and the wall time. ``known``: MaxVio series of this
    cell already measured (``{name: series}``, the reference's included), taken as they are
    instead of routing those methods again (the stream is the same draw for a given seed)."""
    from .methods import build_methods
    from .streams import suite_stream

    device = torch.device(device)
    shift_at = steps // 2 if kind == "shift" else None
    window = max(1, steps // 3)
    stream = suite_stream(kind, tokens, experts, logit_std, seed, device, shift_at=steps // 2)
    known = dict(known or {})
    run_names = [n for n in (REFERENCE, *names) if n not in known]
    methods = build_methods(run_names, experts, topk, device)
    for m in methods:
        m.backend = backend
    start = time.perf_counter()
    hist = simulate(stream, methods, steps, diagnostics=False)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    series = {n: known[n] if n in known else hist[n].maxvio for n in (REFERENCE, *names)}
    return {
        "kind": kind,
        "shape": {"experts": experts, "topk": topk, "tokens": tokens},
        "logit_std": logit_std,
        "seed": seed,
        "steps": steps,
        "shift_at": shift_at,
        "window": window,
        "wall_s": time.perf_counter() - start,
        "series": series,
        "metrics": balance_metrics(series, window, shift_at),
        "known": sorted(known),
    }
