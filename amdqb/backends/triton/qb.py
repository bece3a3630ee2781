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

from ...ref.qb import LOG_MARGIN_RHO
from ...ref.router import margin_octave_bits
from . import _qb_kernels as K
from ._common import on_device, pow2


def _f64_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _qb_tiles(num_bins: int) -> tuple[int, int]:
    bb = min(pow2(num_bins), 2048)
    return max(1, 4096 // bb), bb


def _qb(
    histogram, bin_bounds, topk, bias, out, ema, step, binning, rho, rejected=None, committed=None
):
    num_experts, num_bins = histogram.shape
    dev = histogram.device
    rows, bb = _qb_tiles(num_bins)
    rows = min(rows, pow2(num_experts))
    margin = binning == "log_margin"
    with on_device(histogram):
        bhat = torch.empty(num_experts, dtype=torch.float32, device=dev)
        msum = torch.empty(num_experts, dtype=torch.int64, device=dev)
        # No FP contraction: the float64 steps must round like the oracle's separate ops.
        guard = committed is not None
        committed = committed if guard else bhat
        K._qb_rows_kernel[(triton.cdiv(num_experts, rows),)](
            histogram, bin_bounds, bias if bias is not None else bhat, bhat, msum, committed,
            num_experts, num_bins, topk, ROWS=rows, BB=bb, SINGLE=num_bins <= bb, MARGIN=margin,
            MBITS=margin_octave_bits(num_bins), GUARD=guard, num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
        K._qb_finish_kernel[(1,)](
            bhat, msum, bias if bias is not None else bhat, bin_bounds, out,
            rejected if rejected is not None else msum, committed, num_experts,
            _f64_bits(ema), _f64_bits(1.0 - ema), _f64_bits(rho),
            EB=min(pow2(num_experts), 4096), STEP=step, MARGIN=margin,
            COUNT=rejected is not None, GUARD=guard, num_warps=8, enable_fp_fusion=False,
        )  # fmt: skip


def qb_recover(histogram, bin_bounds, topk, out, binning="uniform", expert_bias=None):
    _qb(histogram, bin_bounds, topk, expert_bias, out, 0.0, False, binning, 0.0)


def qb_step(
    bias,
    histogram,
    bin_bounds,
    topk,
    ema,
    binning="uniform",
    rho=LOG_MARGIN_RHO,
    rejected=None,
    committed=None,
):
    _qb(
        histogram, bin_bounds, topk, bias, bias, float(ema), True, binning, float(rho),
        rejected, committed,
    )  # fmt: skip


OPS = {"qb_recover": qb_recover, "qb_step": qb_step}
