"""The selection order every amdqb router uses, as pure PyTorch.

Order contract (shared by the oracles and every kernel):

* candidates are ranked by value descending, then expert id ascending: among equal values the
  smaller id wins;
* ``-0.0`` and ``+0.0`` are equal;
* every NaN ranks below every number, ``-inf`` included; NaNs tie among themselves (smaller id first).

The order is expressed through a monotone int32 key of the fp32 value (``order_key``), which is also
how the kernels implement it, so "equal" always means "equal fp32 value".
"""

from __future__ import annotations

import torch

INT32_MIN = -(2**31)


def order_key(x: torch.Tensor) -> torch.Tensor:
    """Monotone int32 key of fp32 values: ``a < b`` (as floats) iff ``key(a) < key(b)``.

    Negative floats have their magnitude bits flipped so that signed-int order equals float order;
    ``-0.0`` maps onto ``+0.0``'s key and every NaN onto ``INT32_MIN`` (below ``-inf``).
    """
    if x.dtype != torch.float32:
        raise TypeError(f"order_key expects float32, got {x.dtype}")
    bits = x.contiguous().view(torch.int32)
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = torch.where(key == -1, torch.zeros_like(key), key)  # -0.0 -> +0.0
    return torch.where(torch.isnan(x), torch.full_like(key, INT32_MIN), key)


def ranked_indices(values: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of the first ``n`` entries of each row in the selection order (int64 ``[..., n]``)."""
    key = order_key(values.float()).to(torch.int64)
    size = key.shape[-1]
    if 4 * n > size:
        # A stable descending sort keeps equal keys in ascending index order: smaller id first.
        order = torch.sort(key, dim=-1, descending=True, stable=True).indices
        return order[..., :n]
    # Few of many: (key desc, index asc) packed in one int64 that is unique within a row, so its
    # Top-n (descending) is exactly the stable sort's first n, at a fraction of a full sort.
    rank = torch.arange(size - 1, -1, -1, dtype=torch.int64, device=key.device)
    return torch.topk(key * (1 << 32) + rank, n, dim=-1).indices
