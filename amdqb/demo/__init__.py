"""``amdqb demo``: Quantile Balancing at a glance.

A tiny router sees a drifting, skewed token stream and several balancers route the *same* logits
every step, side by side, against exact tie-free QB in float64 (the reference): none, the
aux-loss-free sign rule, K3's uniform histogram with TransformerEngine's selection, the default
``amdqb.QuantileBalancer`` and QB with the exact fp32 quantile (``methods``). The output shows the
first steps one by one (how fast each balancer balances from a cold start), the first step within
1.5x of the reference's late MaxVio and the late mean.

Modules: ``streams`` (the token streams, also the balance suite's and the tests'), ``reference``
(the float64 yardstick), ``methods``, ``run`` (the loop and the balance metrics), ``report``
(text), ``plot`` (figures) and ``cli`` (the command line).
"""

from .cli import build_parser, main
from .methods import METHOD_NAMES, REFERENCE, SHORT, build_methods
from .reference import ExactQB64
from .run import balance_metrics, simulate, suite_case
from .streams import SUITE, SUITE_KINDS, SUITE_SHAPES, SUITE_STDS, Stream, suite_stream

__all__ = [
    "METHOD_NAMES",
    "REFERENCE",
    "SHORT",
    "SUITE",
    "SUITE_KINDS",
    "SUITE_SHAPES",
    "SUITE_STDS",
    "ExactQB64",
    "Stream",
    "balance_metrics",
    "build_methods",
    "build_parser",
    "main",
    "simulate",
    "suite_case",
    "suite_stream",
]
