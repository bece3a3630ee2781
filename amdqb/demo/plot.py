"""The demo's figures (matplotlib, optional): ``qb_demo.png`` and ``qb_compare_scales.png``."""

from __future__ import annotations

from .methods import REFERENCE
from .run import HIT_FACTOR

STYLES = {
    "none": {"color": "#7f7f7f", "ls": "-"},
    "aux_free": {"color": "#ff7f0e", "ls": "-"},
    "qb_uniform": {"color": "#1f77b4", "ls": "-"},
    "qb_default": {"color": "#d62728", "ls": "-"},
    "qb_exact": {"color": "#2ca02c", "ls": "--"},  # dashed: the QB curves often lie on each other
    "qb_exact_tie_free": {"color": "#9467bd", "ls": "-."},
    REFERENCE: {"color": "black", "ls": ":"},
}
ZOOM_STEPS = 12  # the first panel: the first steps, one by one


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is not installed (pip install 'amdqb[plot]'): skipping the plot")
        return False
    return True


def _log_axis(ax) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _target(final) -> float | None:
    ref = final.get(REFERENCE)
    return None if ref is None else HIT_FACTOR * ref["late_maxvio"]


def plot(path: str, methods, hist, final, config: dict, window: int) -> None:
    """MaxVio of the first steps; MaxVio per step; sorted per-expert load, step 0 vs the last."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(16, 6.4), dpi=100)
    FigureCanvasAgg(fig)
    first, whole, load = fig.subplots(1, 3, gridspec_kw={"width_ratios": [1, 1.4, 1]})
    steps = config["steps"]
    target = _target(final)

    zoom = min(steps, ZOOM_STEPS)
    for m in methods:
        first.plot(
            range(zoom), hist[m.name].maxvio[:zoom], marker="o", ms=3, lw=1.3, **STYLES[m.name]
        )
    if target is not None:
        first.axhline(target, color="black", lw=0.7, ls="--")
        first.text(zoom - 1, target, f"{HIT_FACTOR:g}x reference, late", ha="right", va="bottom")
    _log_axis(first)
    first.set_xlabel("step")
    first.set_ylabel("MaxVio = max load / mean load - 1  (log scale)")
    first.set_title(f"The first {zoom} steps from a cold start", fontsize=10)
    first.grid(True, which="major", alpha=0.3)

    whole.axvspan(max(0, steps - window), steps - 1, color="#eeeeee", zorder=0)
    for m in methods:
        row = final[m.name]
        text = f"{m.label}: late {row['late_maxvio']:.3f}"
        if row.get("first_hit") is not None and m.name != REFERENCE:
            text += f", first within {HIT_FACTOR:g}x at step {row['first_hit']}"
        elif m.name != REFERENCE and REFERENCE in final:
            text += f", never within {HIT_FACTOR:g}x"
        whole.plot(range(steps), hist[m.name].maxvio, lw=1.2, label=text, **STYLES[m.name])
    _log_axis(whole)
    whole.set_xlabel("step")
    whole.set_title(f"MaxVio per step; late = mean over the shaded last {window}", fontsize=10)
    whole.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=1)
    whole.grid(True, which="major", alpha=0.3)

    balanced = config["tokens"] * config["topk"] / config["experts"]
    ranks = range(1, config["experts"] + 1)
    start = sorted(hist[methods[0].name].first_load, reverse=True)
    load.plot(ranks, [v / balanced for v in start], color="black", ls=(0, (1, 3)), lw=1.4)
    for m in methods:
        last = sorted(hist[m.name].last_load, reverse=True)
        load.plot(ranks, [v / balanced for v in last], lw=1.4, **STYLES[m.name])
    load.axhline(1.0, color="black", lw=0.6)
    load.set_xlabel("expert rank (sorted by load)")
    load.set_ylabel("load / balanced load (T k / E)")
    load.set_title(f"Per-expert load, sorted: step 0 (dotted) vs step {steps - 1}", fontsize=10)
    load.grid(True, alpha=0.3)

    fig.suptitle(
        f"amdqb demo: E={config['experts']}, k={config['topk']}, T={config['tokens']} tokens/step, "
        f"stream '{config['stream']}', logit std ~ {config['logit_scale']:g}, seed {config['seed']}",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path)


def plot_scales(path: str, methods, per_scale: dict, config: dict, window: int) -> None:
    """Late MaxVio against the logit std (log-log), and the first step within 1.5x of the
    reference's late MaxVio, one line per method."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    fig = Figure(figsize=(13, 6.0), dpi=100)
    FigureCanvasAgg(fig)
    late, hits = fig.subplots(1, 2)
    scales = list(per_scale)
    never = 0
    for m in methods:
        values = [per_scale[s][m.name]["late_maxvio"] for s in scales]
        late.plot(scales, values, marker="o", lw=1.6, ms=4, label=m.label, **STYLES[m.name])
        firsts = [per_scale[s][m.name].get("first_hit") for s in scales]
        never = max([never, *(f for f in firsts if f is not None)])
    cap = never + 2  # where "never" is drawn
    for m in methods:
        firsts = [per_scale[s][m.name].get("first_hit") for s in scales]
        hits.plot(
            scales,
            [cap if f is None else f for f in firsts],
            marker="o",
            lw=1.4,
            ms=4,
            **STYLES[m.name],
        )
    for ax in (late, hits):
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(FixedLocator(scales))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("logit std (--logit-scale)")
        ax.grid(True, which="major", alpha=0.3)
    _log_axis(late)
    late.set_ylabel(f"MaxVio, mean of the last {window} steps (log scale)")
    late.set_title("Balance as the sigmoid saturates", fontsize=10)
    late.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    from matplotlib.ticker import MaxNLocator

    hits.set_ylim(-0.3, cap + 0.8)
    hits.yaxis.set_major_locator(MaxNLocator(integer=True))
    hits.axhline(cap, color="#999999", lw=0.6)
    hits.text(scales[0], cap, " never", va="bottom", fontsize=8, color="#666666")
    hits.set_ylabel(f"first step within {HIT_FACTOR:g}x of the reference's late MaxVio")
    hits.set_title("Steps from a cold start", fontsize=10)
    fig.suptitle(
        f"E={config['experts']}, k={config['topk']}, T={config['tokens']}, {config['steps']} "
        f"steps, stream '{config['stream']}', seed {config['seed']}",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path)
