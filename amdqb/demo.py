"""``amdqb demo``: Quantile Balancing at a glance.

A tiny router sees a drifting, skewed token stream and six balancers route the *same* logits every
step, side by side:

* ``none``          -- no bias (the stream's natural imbalance);
* ``aux_free``      -- the DeepSeek-V3 aux-loss-free sign rule, ``amdqb.aux_free_bias_update_``
  (rate 1e-3);
* ``qb_uniform``    -- Kimi K3 Quantile Balancing, ``amdqb.QuantileBalancer(binning="uniform")``:
  App. D's histogram of ``r = alpha - s`` on B = 1000 uniform bins of ``[min b - 1, max b + 1]``
  (TransformerEngine's histogram);
* ``qb_log_margin`` -- ``QuantileBalancer(binning="log_margin")`` (the default): the biased margin
  ``d = alpha - u`` on B = 64 log bins scaled to the bias spread; its quantile is the bias change;
* ``qb_exact``      -- QB with the exact, bin-free quantile, ``amdqb.qb_exact_bias``: the **fp32**
  exact quantile of the required biases as the router computes them (fp32 ``s + b``, fp32
  ``alpha``), applied through the same fp32 router;
* ``qb_tie_free``   -- log_margin QB whose router ranks by ``b - sigmoid(-z)`` instead of
  ``s + b`` (``selection="tie_free"``; the weights still come from ``s``).

``--fp64-reference`` (on with ``--compare-scales``) adds ``qb_exact_fp64``: exact QB with scores,
routes, required biases, quantile and bias all in float64 (``amdqb.ref.qb.route_fp64`` and
``qb_exact_bias_fp64``), the yardstick for the others. It is the one row that routes outside the
amdqb router (the router is fp32 by contract).

Every bias computed from batch t is applied at t+1, never to the batch it came from, and all QB
biases are mean-centred. Every other number comes from the real amdqb router: ``none``,
``aux_free`` and ``qb_exact`` route with ``amdqb.fused_topk_with_score_function(logits, k,
score_function="sigmoid", expert_bias=bias)``, the balancers through their ``.route`` and
``.step``; the loads are ``routing_map.sum(0)``. MaxVio and CV^2 are ``amdqb.maxvio`` /
``amdqb.cv2``.

Two diagnostics per step (the bias the step routes with; shares of tokens), with ``g`` the gap
between a token's k-th and (k+1)-th selection value (``s + b``; ``b - sigmoid(-z)`` for tie_free):

* ``margin<bin`` (binned methods): ``g`` is below one histogram bin at the cutoff -- ``(U-L)/B``
  for uniform, the innermost log_margin bin ``eps / 2^M`` for log_margin (``eps`` = 1e-4 x the
  bias spread, ``M`` = 1 at B = 64). A high share says the histogram cannot see where the cutoff
  falls between the two experts; it says nothing about ties.
* ``tie`` (every method): ``g == 0`` in fp32, the router's precision (float64 for the reference):
  the k-th and (k+1)-th experts are indistinguishable to the router, so no bias that fp32 can
  resolve splits them. Saturated sigmoid scores cause it: fp32 ``1 - s`` is a multiple of 2^-24,
  so ``s + b`` collapses onto a few values near ``1 + b``.

The stream (:class:`Stream`): each step draws T fresh token features ``x ~ N(mu_t, I_d)`` whose mean
``mu_t`` rotates slowly, multiplies them by router weights ``W_t`` (d x E, unit columns) that take a
small random-walk step every step, and adds a persistent positive logit offset to a few *hot*
experts. The logits are scaled once (calibrated on the first batch) so that their standard deviation
is about ``--logit-scale``.

What the default run shows (E=64, k=4, T=4096, 160 steps, seed 0; the summary averages the last
50 steps; about 40 s on a 2-core CPU):

* the sign rule moves each bias by a fixed 1e-3 per step, so it needs hundreds of steps to absorb
  the hot experts and keeps lagging the drift (late MaxVio 1.28 against 4.44 unbalanced);
* every QB variant gets to the floor set by per-batch sampling noise (256 tokens per expert) and
  one step of drift (0.24): the bias is estimated on batch t and applied to batch t+1, so with a
  drifting router QB tracks, it never anticipates;
* log_margin starts from a bias spread of 0, where its axis scale is ``eps_0 = 1e-30``; the axis
  reaches 6.55 spreads, so the spread can grow at most ~14x per step and log_margin first
  balances after ~23 steps (the plot shows it); uniform and exact QB balance after one step.
* at this scale the uniform histogram's ``margin<bin`` is 13% without harm: a high share says the
  histogram *may* lack resolution, not that it does.

``--compare-scales`` runs the same stream at logit std 1, 3, 10 and 20 and prints one MaxVio table
(methods x scales, the fp64 reference included). Seed 0, 160 steps, mean of the last 50:

======================  =====  =====  ======  ======
method                  std 1  std 3  std 10  std 20
======================  =====  =====  ======  ======
none                    4.44   4.44   4.83    8.72
aux-free sign rule      1.34   1.40   2.99    5.04
QB K3 uniform (B=1000)  0.240  0.242  1.331   2.737
QB log_margin (B=64)    0.241  0.236  0.256   8.720
QB exact (fp32)         0.243  0.238  0.257   8.719
QB log_margin+tie_free  0.242  0.236  0.247   0.300
QB exact (fp64 ref.)    0.243  0.238  0.248   0.252
======================  =====  =====  ======  ======

* std 1 and 3: every QB variant is within 2% of the fp64 reference.
* std 10: the sigmoid saturates. Uniform bins (~2e-3 wide) are wider than every cutoff gap
  (margin<bin 100%) and uniform QB stalls. log_margin's bins follow the bias change
  (margin<bin 6%) and it matches exact fp32 QB; both sit a few % above fp64 because fp32
  ``s + b`` still ties at the cutoff for 6-8% of the tokens. tie_free has no ties and matches
  fp64.
* std 20: the balancing biases span ~1e-9..1e-7, below the fp32 spacing of ``s + b`` near 1
  (6e-8), and 100% of the tokens tie at the cutoff: log_margin and exact fp32 QB route as if
  unbiased (the bias spread never leaves the range fp32 cannot resolve), uniform QB moves its
  biases by whole bins (~2e-3) and balances coarsely. tie_free balances (no ties), 1.19x the
  fp64 reference here: two log bins per octave resolve the bias change to ~40% of its size, and
  on this drifting stream the change per step is as large as the bias spread itself.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field

import torch

from .devices import as_device

DEFAULT_LOGIT_SCALE = 1.5
COMPARE_SCALES = (1.0, 3.0, 10.0, 20.0)
KIMI = {"experts": 896, "topk": 16, "tokens": 16384}
DEFAULTS = {"experts": 64, "topk": 4, "tokens": 4096}
DEFAULT_STEPS = 160


# --------------------------------------------------------------------------------------------
# The stream: drifting features and weights, a few hot experts.
# --------------------------------------------------------------------------------------------
class Stream:
    """Router logits ``scale * (x_t @ W_t + hot) / c`` for a drifting, skewed token stream.

    * ``x_t ~ N(mu_t, I_d)``, ``T`` fresh tokens per step; ``mu_t`` rotates in a random plane with
      period ``period`` steps, its projection on each expert direction having std ``mean_drift``;
    * ``W_t`` has unit columns and takes a random-walk step of size ``weight_drift`` per step;
    * ``hot`` is ``+hot_offset`` on ``num_hot`` randomly chosen experts and 0 elsewhere;
    * ``c = sqrt(1 + var_e(mu_0 . w_e + hot_e))`` is the expected std of the unscaled step-0
      logits (unit variance per column plus the spread of the column means), so that
      ``std(logits) ~= scale``.

    Everything is drawn from one CPU generator seeded with ``seed`` (so the stream does not depend
    on the device) and moved to ``device``.
    """

    def __init__(
        self,
        tokens: int,
        experts: int,
        dim: int,
        logit_scale: float,
        seed: int,
        device: torch.device,
        num_hot: int,
        hot_offset: float = 1.0,
        mean_drift: float = 0.25,
        weight_drift: float = 0.05,
        period: float = 100.0,
    ):
        self.tokens, self.experts, self.dim = tokens, experts, dim
        self.logit_scale = logit_scale
        self.device = device
        self.weight_drift = weight_drift
        self.period = period
        self.gen = torch.Generator().manual_seed(seed)
        self.weights = self._unit_columns(torch.randn(dim, experts, generator=self.gen))
        self.hot = torch.randperm(experts, generator=self.gen)[:num_hot].sort().values
        self.offset = torch.zeros(experts)
        self.offset[self.hot] = hot_offset
        plane, _ = torch.linalg.qr(torch.randn(dim, 2, generator=self.gen))
        # mu . w_e has std |mu| / sqrt(d) over random unit w_e: scale |mu| to sqrt(d) * mean_drift.
        self.plane = plane.T * (mean_drift * math.sqrt(dim))
        self.step_index = 0
        column_means = self._mean(0) @ self.weights + self.offset
        self.calibration = math.sqrt(1.0 + float(column_means.var(unbiased=False)))
        self.first_std: float | None = None  # measured std of the step-0 logits

    @staticmethod
    def _unit_columns(w: torch.Tensor) -> torch.Tensor:
        return w / w.norm(dim=0, keepdim=True)

    def _mean(self, step: int) -> torch.Tensor:
        phase = 2.0 * math.pi * step / self.period
        return math.cos(phase) * self.plane[0] + math.sin(phase) * self.plane[1]

    def next(self) -> torch.Tensor:
        """This step's fp32 logits ``[T, E]`` on the device; then the weights drift."""
        x = torch.randn(self.tokens, self.dim, generator=self.gen) + self._mean(self.step_index)
        raw = (x @ self.weights + self.offset) * (self.logit_scale / self.calibration)
        if self.first_std is None:
            self.first_std = float(raw.std())
        logits = raw.to(self.device)
        noise = torch.randn(self.dim, self.experts, generator=self.gen)
        self.weights = self._unit_columns(
            self.weights + self.weight_drift * noise / math.sqrt(self.dim)
        )
        self.step_index += 1
        return logits


# --------------------------------------------------------------------------------------------
# The methods: one bias each, routed by the real amdqb router.
# --------------------------------------------------------------------------------------------
class Method:
    """A balancer: ``route`` the step's logits with the current bias, then ``update`` the bias."""

    name = "none"
    label = "none"
    selection = "te"  # the values the router ranks: "te" (s + b), "tie_free" or "fp64"

    def __init__(self, experts: int, topk: int, device: torch.device):
        import amdqb

        self.amdqb = amdqb
        self.topk = topk
        self._bias = torch.zeros(experts, dtype=torch.float32, device=device)

    @property
    def bias(self) -> torch.Tensor:
        return self._bias

    def route(self, logits: torch.Tensor) -> torch.Tensor:
        _, routing_map = self.amdqb.fused_topk_with_score_function(
            logits, self.topk, score_function="sigmoid", expert_bias=self.bias
        )
        return routing_map

    def update(self, logits: torch.Tensor, tokens_per_expert: torch.Tensor) -> None:
        pass

    def bin_width(self) -> float | None:
        """Width of the histogram bin at the cutoff for the bias used this step (binned QB)."""
        return None


class AuxFree(Method):
    name = "aux_free"

    def __init__(self, experts, topk, device, rate: float = 1e-3):
        super().__init__(experts, topk, device)
        self.rate = rate
        self.label = f"aux-free sign rule (rate {rate:g})"

    def update(self, logits, tokens_per_expert):
        self.amdqb.aux_free_bias_update_(self.bias, tokens_per_expert, rate=self.rate)


class QBBalancer(Method):
    """``amdqb.QuantileBalancer``: ``.route(logits)`` accumulates the histogram, ``.step()``."""

    def __init__(self, experts, topk, device, binning: str, num_bins: int, selection: str = "te"):
        super().__init__(experts, topk, device)
        self.balancer = self.amdqb.QuantileBalancer(
            experts, topk, binning=binning, num_bins=num_bins, selection=selection, device=device
        )
        self.selection = selection
        if binning == "uniform":
            self.name, self.label = "qb_uniform", f"QB K3 uniform (B={num_bins})"
        elif selection == "te":
            self.name, self.label = "qb_log_margin", f"QB log_margin (B={num_bins})"
        else:
            self.name, self.label = "qb_tie_free", f"QB log_margin + tie_free (B={num_bins})"

    @property
    def bias(self):
        return self.balancer.bias

    def route(self, logits):
        # accumulate=True: the demo runs under no_grad, where the balancer would not accumulate.
        _, routing_map = self.balancer.route(logits, accumulate=True)
        return routing_map

    def update(self, logits, tokens_per_expert):
        self.balancer.step()

    def bin_width(self):
        b = self.balancer
        if b.binning == "uniform":
            lower, upper = b.bin_bounds.tolist()
            return (upper - lower) / b.num_bins
        from .ref.router import margin_octave_bits

        # bounds = [eps, 1/eps]; the two innermost bins are |d| < eps / 2^M, one on each side
        return float(b.bin_bounds[0]) / (1 << margin_octave_bits(b.num_bins))


class QBExact(Method):
    name = "qb_exact"
    label = "QB exact quantile (fp32)"

    def update(self, logits, tokens_per_expert):
        self.bias.copy_(self.amdqb.qb_exact_bias(logits, self.topk, self.bias))


class QBExactFp64(Method):
    """The float64 reference: routes with :func:`amdqb.ref.qb.route_fp64` (not the amdqb router)
    and carries a float64 bias from :func:`amdqb.ref.qb.qb_exact_bias_fp64`."""

    name = "qb_exact_fp64"
    label = "QB exact quantile (fp64 reference)"
    selection = "fp64"

    def __init__(self, experts, topk, device):
        super().__init__(experts, topk, device)
        self._bias = torch.zeros(experts, dtype=torch.float64, device=device)

    def route(self, logits):
        from .ref.qb import route_fp64

        self._routes = route_fp64(logits, self.topk, self.bias)  # reused by update
        return self._routes[0]

    def update(self, logits, tokens_per_expert):
        from .ref.qb import qb_exact_bias_fp64

        routes, self._routes = self._routes, None
        self.bias.copy_(qb_exact_bias_fp64(logits, self.topk, self.bias, routes=routes))


METHOD_NAMES = ("none", "aux_free", "qb_uniform", "qb_log_margin", "qb_exact", "qb_tie_free")
REFERENCE = "qb_exact_fp64"
SHORT = {
    "none": "none",
    "aux_free": "aux_free",
    "qb_uniform": "uniform",
    "qb_log_margin": "log_margin",
    "qb_exact": "exact32",
    "qb_tie_free": "tie_free",
    "qb_exact_fp64": "exact64",
}


def build_methods(names, experts, topk, device, *, uniform_bins, margin_bins, aux_rate):
    """The methods ``names`` (a subset of ``METHOD_NAMES`` plus ``REFERENCE``), in that order."""
    make = {
        "none": lambda: Method(experts, topk, device),
        "aux_free": lambda: AuxFree(experts, topk, device, rate=aux_rate),
        "qb_uniform": lambda: QBBalancer(experts, topk, device, "uniform", uniform_bins),
        "qb_log_margin": lambda: QBBalancer(experts, topk, device, "log_margin", margin_bins),
        "qb_exact": lambda: QBExact(experts, topk, device),
        "qb_tie_free": lambda: QBBalancer(
            experts, topk, device, "log_margin", margin_bins, selection="tie_free"
        ),
        REFERENCE: lambda: QBExactFp64(experts, topk, device),
    }
    return [make[name]() for name in names]


class StepScores:
    """The step's activations, computed once for every method's diagnostic: fp32 ``s`` (as the
    router computes it), fp32 ``c = sigmoid(-z)`` (tie_free) and float64 ``s`` (reference)."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits
        self.s = torch.sigmoid(logits.float())
        self._c = None
        self._s64 = None

    def selection_values(self, method: Method) -> torch.Tensor:
        from .ref.router import selection_values, sigmoid_complement

        if method.selection == "fp64":
            if self._s64 is None:
                self._s64 = torch.sigmoid(self.logits.double())
            return self._s64 + method.bias.double()
        if method.selection == "tie_free" and self._c is None:
            self._c = sigmoid_complement(self.logits)
        return selection_values(self.s, method.bias, method.selection, self._c)


def cutoff_diagnostics(values: torch.Tensor, topk: int, width: float | None):
    """``(margin<bin share or NaN, tie share)``: the gap between each token's k-th and (k+1)-th
    selection value below ``width``, and exactly zero."""
    top = torch.topk(values, topk + 1, dim=1).values
    gap = top[:, topk - 1] - top[:, topk]
    tie = float((gap == 0).float().mean())
    below = float((gap < width).float().mean()) if width else math.nan
    return below, tie


def router_backend(method: Method, device: torch.device, experts: int, topk: int) -> str:
    """The backend the amdqb router picks for ``method`` (``ref`` for the fp64 reference)."""
    from . import dispatch
    from .backends.calls import RouterCall

    if method.selection == "fp64":
        return "fp64 ref"
    balancer = getattr(method, "balancer", None)
    call = RouterCall(
        experts,
        topk,
        selection=method.selection,
        qb_mode="auto" if balancer is not None else None,
        qb_binning=balancer.binning if balancer is not None else "uniform",
        num_bins=balancer.num_bins if balancer is not None else 0,
    )
    return dispatch.select("router_fwd", device, None, call).backend


# --------------------------------------------------------------------------------------------
# The loop.
# --------------------------------------------------------------------------------------------
@dataclass
class History:
    maxvio: list = field(default_factory=list)
    cv2: list = field(default_factory=list)
    bias_range: list = field(default_factory=list)
    margin_share: list = field(default_factory=list)
    tie_share: list = field(default_factory=list)
    first_load: list | None = None
    last_load: list | None = None


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


def _fmt(value: float | None, width: int = 7, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-".rjust(width)
    return f"{value:{width}.{digits}f}"


def _pct(value: float | None, width: int = 10) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-".rjust(width)
    return f"{100 * value:{width - 1}.1f}%"


def run(args, methods: list[Method], stream, out=None, quiet: bool = False, label: str = ""):
    """Route ``args.steps`` batches of ``stream`` with every method; ``{name: History}``.
    ``quiet``: no per-step table (the progress bar only, on a terminal)."""
    import amdqb

    out = out or sys.stdout
    hist = {m.name: History() for m in methods}
    every = args.print_every or max(1, args.steps // 10)
    if not quiet:
        print("MaxVio per step", file=out)
        print(f"{'step':>5s} " + " ".join(f"{SHORT[m.name]:>10s}" for m in methods), file=out)
    start = time.perf_counter()
    for step in range(args.steps):
        logits = stream.next()
        scores = StepScores(logits)
        for m in methods:
            # the diagnostics see the bias (and bounds) this step routes with
            values = scores.selection_values(m)
            below, tie = cutoff_diagnostics(values, m.topk, m.bin_width())
            bias_range = float(m.bias.max() - m.bias.min())
            routing_map = m.route(logits)
            load = routing_map.sum(0)
            m.update(logits, load)
            h = hist[m.name]
            h.maxvio.append(float(amdqb.maxvio(load)))
            h.cv2.append(float(amdqb.cv2(load)))
            h.bias_range.append(bias_range)
            h.margin_share.append(below)
            h.tie_share.append(tie)
            if step == 0:
                h.first_load = load.tolist()
            if step == args.steps - 1:
                h.last_load = load.tolist()
        if not quiet and (step % every == 0 or step == args.steps - 1):
            row = " ".join(f"{_fmt(hist[m.name].maxvio[-1], width=10)}" for m in methods)
            print(f"{step:5d} {row}", file=out, flush=True)
        _progress(step + 1, args.steps, start, label)
    return hist


def _late(values: list, window: int) -> float | None:
    tail = [v for v in values[-window:] if not math.isnan(v)]
    return sum(tail) / len(tail) if tail else None


def summarise(methods, hist, window: int) -> dict:
    """Per method: late means (last ``window`` steps), the final bias and the per-step series."""
    final = {}
    for m in methods:
        h = hist[m.name]
        final[m.name] = {
            "label": m.label,
            "late_maxvio": _late(h.maxvio, window),
            "late_cv2": _late(h.cv2, window),
            "late_margin_below_bin": _late(h.margin_share, window),
            "late_tie_at_cutoff": _late(h.tie_share, window),
            "final_bias_range": h.bias_range[-1],
            "final_bias": [float(v) for v in m.bias.tolist()],
            "maxvio": h.maxvio,
            "cv2": h.cv2,
            "margin_below_bin": [None if math.isnan(v) else v for v in h.margin_share],
            "tie_at_cutoff": h.tie_share,
        }
    return final


LEGEND = (
    "MaxVio = max/mean load - 1; CV2 = squared coefficient of variation of the load shares;\n"
    "range = max - min of the bias; margin<bin (binned QB) = share of tokens whose gap g between\n"
    "the k-th and (k+1)-th selection value is below one bin at the cutoff ((U-L)/B uniform,\n"
    "eps/2^M log_margin); tie = share with g == 0 in fp32 (fp64 for the reference): experts the\n"
    "router cannot tell apart."
)


def report(methods, final, window: int, out=None) -> None:
    out = out or sys.stdout
    print(file=out)
    print(f"Summary: means over the last {window} steps", file=out)
    print(
        f"{'method':<36s} {'MaxVio':>7s} {'CV2':>7s} {'range@end':>10s} {'margin<bin':>10s} "
        f"{'tie':>7s}",
        file=out,
    )
    for m in methods:
        row = final[m.name]
        print(
            f"{m.label:<36s} {_fmt(row['late_maxvio'])} {_fmt(row['late_cv2'])} "
            f"{row['final_bias_range']:10.3g} {_pct(row['late_margin_below_bin'])} "
            f"{_pct(row['late_tie_at_cutoff'], 7)}",
            file=out,
        )
    print(LEGEND, file=out)


def report_scales(methods, per_scale: dict, window: int, out=None) -> None:
    """The methods x scales tables: late MaxVio, then margin<bin / tie shares."""
    out = out or sys.stdout
    scales = list(per_scale)
    head = "".join(f"{'std ' + format(s, 'g'):>12s}" for s in scales)
    print(file=out)
    print(f"MaxVio (mean of the last {window} steps) by logit std", file=out)
    print(f"{'method':<36s}{head}", file=out)
    for m in methods:
        cells = "".join(_fmt(per_scale[s][m.name]["late_maxvio"], width=12) for s in scales)
        print(f"{m.label:<36s}{cells}", file=out)
    print(file=out)
    print("margin<bin / tie at the cutoff (shares of tokens, same window)", file=out)
    print(f"{'method':<36s}{head}", file=out)
    for m in methods:
        cells = ""
        for s in scales:
            row = per_scale[s][m.name]
            below, tie = row["late_margin_below_bin"], row["late_tie_at_cutoff"]
            below_txt = "-" if below is None else f"{100 * below:.0f}%"
            cells += f"{below_txt + ' / ' + f'{100 * tie:.0f}%':>12s}"
        print(f"{m.label:<36s}{cells}", file=out)
    print(LEGEND, file=out)


# --------------------------------------------------------------------------------------------
# The plots.
# --------------------------------------------------------------------------------------------
STYLES = {
    "none": {"color": "#7f7f7f", "ls": "-"},
    "aux_free": {"color": "#ff7f0e", "ls": "-"},
    "qb_uniform": {"color": "#1f77b4", "ls": "-"},
    "qb_log_margin": {"color": "#d62728", "ls": "-"},
    "qb_exact": {"color": "#2ca02c", "ls": "--"},  # dashed: the QB curves often lie on each other
    "qb_tie_free": {"color": "#9467bd", "ls": "-."},
    "qb_exact_fp64": {"color": "black", "ls": ":"},
}


def _diag_text(row: dict) -> str:
    parts = []
    if row["late_margin_below_bin"] is not None:
        parts.append(f"margin<bin {100 * row['late_margin_below_bin']:.0f}%")
    if row["late_tie_at_cutoff"]:
        parts.append(f"tie {100 * row['late_tie_at_cutoff']:.0f}%")
    return f"  ({', '.join(parts)})" if parts else ""


def _log_axis(ax) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


FOOTNOTE = (
    "margin<bin: share of tokens whose gap between the k-th and (k+1)-th selection value is below "
    "one histogram bin at the cutoff ((U-L)/B uniform, eps/2^M log_margin).\n"
    "tie: share whose k-th and (k+1)-th selection values are equal in fp32 (the router cannot "
    "separate them; saturated sigmoid scores). Shown where non-zero."
)


def plot(path: str, methods, hist, final, config: dict, window: int) -> None:
    """Left: MaxVio per step per method. Right: sorted per-expert load, step 0 vs the last step."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 6.2), dpi=110)
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    steps = config["steps"]

    left.axvspan(max(0, steps - window), steps - 1, color="#eeeeee", zorder=0)
    for m in methods:
        row = final[m.name]
        label = f"{m.label}: {row['late_maxvio']:.2f}{_diag_text(row)}"
        left.plot(range(steps), hist[m.name].maxvio, lw=1.3, label=label, **STYLES[m.name])
    _log_axis(left)
    left.set_xlabel("step")
    left.set_ylabel("MaxVio = max load / mean load - 1  (log scale)")
    left.set_title(
        f"MaxVio per step; legend: mean over the shaded last {window} steps", fontsize=10
    )
    left.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    left.grid(True, which="major", alpha=0.3)

    balanced = config["tokens"] * config["topk"] / config["experts"]
    ranks = range(1, config["experts"] + 1)
    first = sorted(hist[methods[0].name].first_load, reverse=True)
    right.plot(
        ranks,
        [v / balanced for v in first],
        color="black",
        ls=(0, (1, 3)),
        lw=1.4,
        label="step 0 (every method: bias 0)",
    )
    for m in methods:
        last = sorted(hist[m.name].last_load, reverse=True)
        right.plot(ranks, [v / balanced for v in last], lw=1.5, label=m.label, **STYLES[m.name])
    right.axhline(1.0, color="black", lw=0.6)
    right.set_xlabel("expert rank (sorted by load)")
    right.set_ylabel("load / balanced load (T k / E)")
    right.set_title(f"Per-expert load, sorted: step 0 vs step {steps - 1}", fontsize=10)
    right.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    right.grid(True, alpha=0.3)

    fig.suptitle(
        f"amdqb demo: E={config['experts']}, k={config['topk']}, T={config['tokens']} tokens/step, "
        f"{config['num_hot']} hot experts, drifting router, logit std ~ {config['logit_scale']:g}, "
        f"seed {config['seed']}",
        fontsize=11,
    )
    fig.text(0.5, 0.01, FOOTNOTE, ha="center", fontsize=8, color="#444444")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path)


def plot_scales(path: str, methods, per_scale: dict, config: dict, window: int) -> None:
    """Late MaxVio against the logit std, one line per method (log-log)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    fig = Figure(figsize=(8.5, 6.4), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.subplots(1, 1)
    scales = list(per_scale)
    for m in methods:
        values = [per_scale[s][m.name]["late_maxvio"] for s in scales]
        ax.plot(scales, values, marker="o", lw=1.6, ms=4, label=m.label, **STYLES[m.name])
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(FixedLocator(scales))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    _log_axis(ax)
    ax.set_xlabel("logit std (--logit-scale)")
    ax.set_ylabel(f"MaxVio, mean of the last {window} steps (log scale)")
    ax.set_title(
        f"E={config['experts']}, k={config['topk']}, T={config['tokens']}, {config['steps']} "
        f"steps, seed {config['seed']}: balance as the sigmoid saturates",
        fontsize=10,
    )
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    fig.tight_layout()
    fig.savefig(path)


EPILOG = """\
--logit-scale sets the std of the router logits. At the default (1.5) every QB variant reaches
the per-batch sampling floor (late MaxVio ~0.24; no balancing ~4.4; sign rule ~1.3). As the
scale grows the sigmoid saturates: at 10 the uniform K3 histogram cannot resolve the cutoff
(margin<bin ~100%, MaxVio ~1.3) while log_margin stays near exact QB; at 20 fp32 s + b ties for
every token at the cutoff (tie ~100%) and only the tie-free selection balances. Try
--compare-scales (four runs; add --methods to pick a subset).

Diagnostics: margin<bin = share of tokens whose gap between the k-th and (k+1)-th selection
value is below one histogram bin at the cutoff; tie = share with that gap exactly 0 in fp32."""


# --------------------------------------------------------------------------------------------
# Command line.
# --------------------------------------------------------------------------------------------
def _scale_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--scales: {err}") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError("--scales needs positive numbers, e.g. 1,3,10,20")
    return values


def _method_list(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    known = (*METHOD_NAMES, REFERENCE)
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"--methods: unknown {bad}; choose from {', '.join(known)}"
        )
    return names


def build_parser() -> argparse.ArgumentParser:
    from ._cli_types import (
        float_range,
        int_range,
    )  # argparse types with ranges: errors name the option

    pos = int_range(1)
    parser = argparse.ArgumentParser(
        prog="amdqb demo",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Balance a drifting, skewed token stream six ways on the same logits every step: none,\n"
            "the aux-loss-free sign rule, K3 QB (uniform histogram, B=1000), QB with the log_margin\n"
            "histogram (B=64), QB with the exact fp32 quantile and log_margin QB with tie-free\n"
            "selection. Prints MaxVio per step and a summary (MaxVio, CV2, bias range, margin<bin,\n"
            "tie), writes <out>/summary.json and <out>/qb_demo.png (matplotlib, optional).\n"
            "--compare-scales runs logit std 1, 3, 10, 20 instead and prints one table."
        ),
        epilog=EPILOG,
    )
    parser.add_argument(
        "--device", default=None, help="torch device (default: cpu; cuda for --kimi)"
    )
    parser.add_argument(
        "--kimi", action="store_true", help="Kimi K3 shape: E=896, k=16, T=16384 (meant for a GPU)"
    )
    parser.add_argument(
        "--steps", type=pos, default=DEFAULT_STEPS, help=f"training steps (default {DEFAULT_STEPS})"
    )
    parser.add_argument("--tokens", type=pos, default=None, help="tokens per step (default 4096)")
    parser.add_argument("--experts", type=int_range(2), default=None, help="experts E (default 64)")
    parser.add_argument("--topk", type=pos, default=None, help="experts per token k (default 4)")
    parser.add_argument("--dim", type=pos, default=64, help="router input width d (default 64)")
    parser.add_argument("--seed", type=int_range(0), default=0, help="stream seed (default 0)")
    parser.add_argument(
        "--logit-scale",
        type=float_range(0.0, open_low=True),
        default=DEFAULT_LOGIT_SCALE,
        help=f"std of the router logits (default {DEFAULT_LOGIT_SCALE:g}; try 10 or 20)",
    )
    parser.add_argument(
        "--compare-scales",
        action="store_true",
        help="run every method at each of --scales and print one MaxVio table (methods x scales); "
        "writes <out>/compare_scales.json and <out>/qb_compare_scales.png",
    )
    parser.add_argument(
        "--scales",
        type=_scale_list,
        default=list(COMPARE_SCALES),
        help="logit stds for --compare-scales (default 1,3,10,20)",
    )
    parser.add_argument(
        "--methods",
        type=_method_list,
        default=list(METHOD_NAMES),
        help=f"comma-separated subset (default {','.join(METHOD_NAMES)}; {REFERENCE} is the "
        "fp64 reference)",
    )
    parser.add_argument(
        "--fp64-reference",
        action="store_true",
        help=f"add {REFERENCE}, exact QB in float64 (always on with --compare-scales)",
    )
    parser.add_argument(
        "--hot", type=int_range(0), default=None, help="number of hot experts (default E // 16)"
    )
    parser.add_argument(
        "--hot-offset",
        type=float_range(),
        default=1.0,
        help="logit offset of the hot experts, before scaling (default 1.0)",
    )
    parser.add_argument(
        "--drift",
        type=float_range(0.0),
        default=0.25,
        help="std over experts of the drifting token mean's logit shift, before scaling (0.25)",
    )
    parser.add_argument(
        "--bins",
        type=int_range(2, 1 << 16),
        default=1000,
        help="bins B of K3's uniform histogram (default 1000)",
    )
    parser.add_argument(
        "--margin-bins",
        type=int_range(2, 1 << 16),
        default=64,
        help="bins B of the log_margin histogram (default 64)",
    )
    parser.add_argument(
        "--aux-rate", type=float_range(0.0), default=1e-3, help="sign-rule step (default 1e-3)"
    )
    parser.add_argument(
        "--window", type=pos, default=50, help="late window for the summary (default 50 steps)"
    )
    parser.add_argument(
        "--print-every",
        type=int_range(0),
        default=0,
        help="table row every N steps (default steps // 10)",
    )
    parser.add_argument(
        "--threads",
        type=int_range(0),
        default=1,
        help="torch CPU threads for the run (default 1: the per-step tensors are small and extra "
        "intra-op threads only add overhead, badly so on a busy CPU; 0 leaves torch's setting)",
    )
    parser.add_argument("--out", default="demo_out", help="output folder (default ./demo_out)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    return parser


def _versions() -> dict:
    import amdqb

    versions = {
        "amdqb": amdqb.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    try:
        import matplotlib

        versions["matplotlib"] = matplotlib.__version__
    except ImportError:
        versions["matplotlib"] = None
    return versions


def _device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} logical CPUs)"


def make_stream(args, device: torch.device, num_hot: int, logit_scale: float) -> Stream:
    return Stream(
        args.tokens,
        args.experts,
        args.dim,
        logit_scale,
        args.seed,
        device,
        num_hot=num_hot,
        hot_offset=args.hot_offset,
        mean_drift=args.drift,
    )


def _simulate(args, device, num_hot, logit_scale, names, quiet=False, label=""):
    """Build the stream and the methods, run the loop; returns them and the loop's wall time."""
    stream = make_stream(args, device, num_hot, logit_scale)
    methods = build_methods(
        names,
        args.experts,
        args.topk,
        device,
        uniform_bins=args.bins,
        margin_bins=args.margin_bins,
        aux_rate=args.aux_rate,
    )
    start = time.perf_counter()
    hist = run(args, methods, stream, quiet=quiet, label=label)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return stream, methods, hist, time.perf_counter() - start


def _have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is not installed (pip install 'amdqb[plot]'): skipping the plot")
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    preset = KIMI if args.kimi else DEFAULTS
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.device is None:
        args.device = "cuda" if args.kimi and torch.cuda.is_available() else "cpu"
    try:
        device = as_device(args.device, name="--device")  # the package's one device parser
    except ValueError as exc:
        print(f"amdqb demo: error: {exc}", file=sys.stderr)
        return 2
    if args.kimi and device.type == "cpu":
        print("note: --kimi on the CPU is slow; pass --device cuda on a GPU", file=sys.stderr)
    if not 0 < args.topk < args.experts:
        print(
            f"error: need 0 < --topk < --experts, got {args.topk}, {args.experts}", file=sys.stderr
        )
        return 2
    if args.steps < 1 or args.tokens < 1 or args.window < 1:
        print("error: --steps, --tokens and --window must be positive", file=sys.stderr)
        return 2
    num_hot = args.hot if args.hot is not None else max(1, args.experts // 16)
    window = min(args.window, args.steps)
    names = list(args.methods)
    if (args.fp64_reference or args.compare_scales) and REFERENCE not in names:
        names.append(REFERENCE)

    import amdqb

    config = {
        "experts": args.experts,
        "topk": args.topk,
        "tokens": args.tokens,
        "steps": args.steps,
        "dim": args.dim,
        "seed": args.seed,
        "logit_scale": args.logit_scale,
        "num_hot": num_hot,
        "hot_offset": args.hot_offset,
        "drift": args.drift,
        "bins": args.bins,
        "margin_bins": args.margin_bins,
        "aux_rate": args.aux_rate,
        "window": window,
        "threads": args.threads,
        "methods": names,
    }
    scales = args.scales if args.compare_scales else [args.logit_scale]
    if args.compare_scales:
        config["logit_scales"] = scales
        del config["logit_scale"]
    print(f"amdqb {amdqb.__version__} demo on {device} ({_device_description(device)})")
    std = ", ".join(f"{s:g}" for s in scales)
    print(
        f"E={args.experts} k={args.topk} T={args.tokens} steps={args.steps} logit std~{std} "
        f"hot experts={num_hot} (+{args.hot_offset:g}) seed={args.seed}"
    )

    threads = torch.get_num_threads()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    per_scale, hists, walls = {}, {}, {}
    try:
        with torch.no_grad():
            for scale in scales:
                label = f"std {scale:g} " if args.compare_scales else ""
                stream, methods, hist, wall = _simulate(
                    args, device, num_hot, scale, names, quiet=args.compare_scales, label=label
                )
                per_scale[scale] = summarise(methods, hist, window)
                hists[scale], walls[scale] = hist, wall
                if args.compare_scales:
                    print(f"  logit std {scale:g}: {args.steps} steps in {wall:.1f} s", flush=True)
    finally:
        torch.set_num_threads(threads)
    backends = {m.name: router_backend(m, device, args.experts, args.topk) for m in methods}
    print("router backends: " + ", ".join(f"{SHORT[n]} {b}" for n, b in backends.items()))
    common = {
        "config": config,
        "device": str(device),
        "device_name": _device_description(device),
        "router_backend": backends,
        "versions": _versions(),
        "hot_experts": stream.hot.tolist(),
    }
    os.makedirs(args.out, exist_ok=True)

    if args.compare_scales:
        report_scales(methods, per_scale, window)
        total = sum(walls.values())
        print(f"\n{len(scales)} x {args.steps} steps in {total:.1f} s")
        summary = {
            **common,
            "wall_s": {f"{s:g}": walls[s] for s in scales},
            "maxvio_table": {
                m.name: {f"{s:g}": per_scale[s][m.name]["late_maxvio"] for s in scales}
                for m in methods
            },
            "scales": {f"{s:g}": per_scale[s] for s in scales},
        }
        path = os.path.join(args.out, "compare_scales.json")
        with open(path, "w") as f:
            json.dump(summary, f, indent=1)
        print(f"wrote {path}")
        if not args.no_plot and _have_matplotlib():
            png = os.path.join(args.out, "qb_compare_scales.png")
            plot_scales(png, methods, per_scale, config, window)
            print(f"wrote {png}")
        return 0

    final = per_scale[args.logit_scale]
    hist, wall = hists[args.logit_scale], walls[args.logit_scale]
    report(methods, final, window)
    print(f"\n{args.steps} steps in {wall:.1f} s")
    summary = {
        **common,
        "wall_s": wall,
        "logit_std_step0": stream.first_std,
        "methods": final,
    }
    summary_path = os.path.join(args.out, "summary.json")
    with open(summary_path, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"wrote {summary_path}")

    if not args.no_plot and _have_matplotlib():
        png = os.path.join(args.out, "qb_demo.png")
        plot(png, methods, hist, final, config, window)
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
