"""argparse types with ranges, shared by the command line and the tools it runs (``amdqb demo``,
``amdqb bench``): a bad value is named in argparse's error, exit status 2."""

from __future__ import annotations

import argparse
import math


def int_range(low: int | None = None, high: int | None = None):
    """argparse ``type=``: an int in ``[low, high]`` (either bound optional)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be in {_span(low, high)}, got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in its messages
    return parse


def float_range(low: float | None = None, high: float | None = None, *, open_low: bool = False):
    """argparse ``type=``: a finite float in ``[low, high]`` (``(low, high]`` with ``open_low``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        bad_low = low is not None and (value <= low if open_low else value < low)
        if not math.isfinite(value) or bad_low or (high is not None and value > high):
            span = _span(low, high).replace("[", "(", 1) if open_low else _span(low, high)
            raise argparse.ArgumentTypeError(f"must be a finite number in {span}, got {text}")
        return value

    parse.__name__ = "float"
    return parse


def _span(low, high) -> str:
    return f"[{'-inf' if low is None else low}, {'inf' if high is None else high}]"
