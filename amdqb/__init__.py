"""amdqb: exact, graph-safe MoE routing kernels with Quantile Balancing, for AMD and NVIDIA GPUs.

Public API re-exports only; see ``amdqb.ops`` (validate -> dispatch -> backend), ``amdqb.ref``
(pure-PyTorch oracles), ``amdqb.balance``, ``amdqb.dispatch`` and ``amdqb.compat`` (the peers'
own module surfaces, e.g. ``amdqb.compat.te`` for TransformerEngine's router module).
"""

from .balance import QuantileBalancer, aux_free_bias_update_, cv2, maxvio
from .dispatch import device_info
from .ops.aux_loss import fused_compute_score_for_moe_aux_loss, fused_moe_aux_loss
from .ops.chunks import moe_sort_chunks_and_pad, moe_unpad_and_restore_chunks
from .ops.layout import moe_align_block_size, moe_route_rows
from .ops.qb import qb_exact_bias, qb_recover_bias, qb_step_
from .ops.router import (
    biased_topk,
    fused_topk_with_score_function,
    mark_qb_bin_bounds_validated,
)

__version__ = "0.1.0"

__all__ = [
    "QuantileBalancer",
    "aux_free_bias_update_",
    "biased_topk",
    "cv2",
    "device_info",
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
    "fused_topk_with_score_function",
    "mark_qb_bin_bounds_validated",
    "maxvio",
    "moe_align_block_size",
    "moe_route_rows",
    "moe_sort_chunks_and_pad",
    "moe_unpad_and_restore_chunks",
    "qb_exact_bias",
    "qb_recover_bias",
    "qb_step_",
]
