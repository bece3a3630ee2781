"""Helpers shared by the Triton launchers."""

from __future__ import annotations

import contextlib
import os

import torch
import triton


def interpreting() -> bool:
    """Whether Triton runs its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return triton.next_power_of_2(max(int(n), 1))


def floor_pow2(n: int) -> int:
    """The largest power of two <= ``n`` (1 for ``n <= 1``)."""
    return 1 << (max(1, int(n)).bit_length() - 1)


def compile_options(device: torch.device) -> dict:
    """Options of launches that must compute torch's bits: no FMA contraction, and on NVIDIA
    libdevice without flush-to-zero (Triton links it with denormals flushed unless told
    otherwise; torch's kernels keep them)."""
    opts = {"enable_fp_fusion": False}
    if device.type == "cuda" and torch.version.hip is None and not interpreting():
        opts["enable_reflect_ftz"] = False
    return opts


def on_device(t: torch.Tensor):
    """Launch on ``t``'s device whatever the current device is (Triton uses the current one)."""
    if t.device.type == "cuda" and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def row_stride(t: torch.Tensor) -> int:
    """Elements between the rows of a 2-D tensor whose rows are contiguous (the op checked that):
    its row stride, any value (0 for expanded rows) when it has more than one row."""
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]
