"""Pure-PyTorch oracles (fp32 math, CPU and GPU). Importable by users; every kernel is tested
against these. Nothing here launches a custom kernel."""

from .aux_loss import compute_scores_for_aux_loss, moe_aux_loss
from .chunks import chunk_row_map, moe_sort_chunks_and_pad, moe_unpad_and_restore_chunks
from .layout import align_buffer_sizes, moe_align_block_size, moe_route_rows
from .ordering import order_key, ranked_indices
from .qb import (
    aux_free_bias_update,
    centre,
    cv2,
    maxvio,
    qb_exact_bias,
    qb_exact_bias_fp64,
    qb_recover_bias,
    qb_step_update,
    recover_uncentred,
    required_bias,
    route_fp64,
)
from .router import (
    activation,
    biased_topk,
    fused_topk_with_score_function,
    pack_bitmap,
    qb_bin_index,
    qb_cutoff_and_routes,
    qb_histogram_counts,
    serving_topk,
    token_expert_indices,
    unpack_bitmap,
)

__all__ = [name for name in dir() if not name.startswith("_")]
