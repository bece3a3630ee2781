"""Triton launchers of the Quantile Balancing updates (App. D recovery, the balancer step).
Kernel bodies: ``_qb_kernels.py``.

``qb_recover`` / ``qb_step`` -- 2 launches: per-expert recovery over a grid (int64 cumsums, float64
interpolation, no FP contraction: the float64 steps round like the oracle's separate ops), then one
program that centres, mixes (EMA) and writes the bias and the bounds. No host sync.
"""

from __future__ import annotations

import struct

import torch
import triton

from ...ref import qb as R
from ...ref.router import MARGIN_MOMENT_BITS, margin_fine_keys
from . import _qb_kernels as K
from ._common import on_device, pow2


def _f64_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _qb_tiles(num_bins: int) -> tuple[int, int]:
    bb = min(pow2(num_bins), 2048)
    return max(1, 4096 // bb), bb


def _qb(histogram, bin_bounds, topk, bias, out, ema, step, binning, rejected=None, committed=None):
    num_experts, num_bins = histogram.shape[-2:]
    moments = histogram.dim() == 3
    dev = histogram.device
    rows, bb = _qb_tiles(num_bins)
    rows = min(rows, pow2(num_experts))
    margin = binning == "log_margin"
    with on_device(histogram):
        bhat = torch.empty(num_experts, dtype=torch.float32, device=dev)
        msum = torch.empty(num_experts, dtype=torch.int64, device=dev)
        scale = torch.empty(num_experts if margin else 1, dtype=torch.float32, device=dev)
        # No FP contraction: the float64 steps must round like the oracle's separate ops.
        guard = committed is not None
        committed = committed if guard else bhat
        K._qb_rows_kernel[(triton.cdiv(num_experts, rows),)](
            histogram, bin_bounds, bias if bias is not None else bhat, bhat, msum, scale,
            committed, num_experts, num_bins, topk, ROWS=rows, BB=bb, SINGLE=num_bins <= bb,
            MARGIN=margin, FINE=margin_fine_keys(num_bins) if margin else 0, MOMENTS=moments,
            MBITS=MARGIN_MOMENT_BITS, GUARD=guard,
            **_SCALE, num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
        K._qb_finish_kernel[(1,)](
            bhat, msum, scale, bias if bias is not None else bhat, bin_bounds, out,
            rejected if rejected is not None else msum, committed, num_experts,
            _f64_bits(ema), _f64_bits(1.0 - ema), EB=min(pow2(num_experts), 4096), STEP=step,
            MARGIN=margin, COUNT=rejected is not None, GUARD=guard, SPREAD=R.BIAS_SPREAD_MAX,
            num_warps=8, enable_fp_fusion=False,
        )  # fmt: skip


def qb_recover(histogram, bin_bounds, topk, out, binning="uniform", expert_bias=None):
    _qb(histogram, bin_bounds, topk, expert_bias, out, 0.0, False, binning)


def qb_step(
    bias, histogram, bin_bounds, topk, ema, binning="uniform", rejected=None, committed=None
):
    _qb(histogram, bin_bounds, topk, bias, bias, float(ema), True, binning, rejected, committed)


_SCALE = dict(
    ZOOM=R.MARGIN_ZOOM_EXP,
    DECAY=R.MARGIN_DECAY_EXP,
    INV_MIN=R.MARGIN_INV_MIN_EXP,
    INV_MAX=R.MARGIN_INV_MAX_EXP,
)


OPS = {"qb_recover": qb_recover, "qb_step": qb_step}
