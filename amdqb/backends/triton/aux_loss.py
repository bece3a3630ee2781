"""Triton launchers of TransformerEngine's aux-loss router ops.

Precision and tie-break contract: the one of ``amdqb.ref.aux_loss`` (see ``_aux_loss_kernels``):
sigmoid / sqrtsoftplus activations are PyTorch's on the same device bit for bit (vendor ``exp`` /
``log1p``, correctly rounded division and square root, no FMA contraction, no flush-to-zero on
NVIDIA); the normalisation, softmax and loss reductions agree with PyTorch to fp32 rounding; the
Top-k map is exact in the (score descending, expert id ascending, NaN lowest) order of the kernel's
own scores. The aux loss never reads the token count on the host: with a device ``T`` the
coefficient ``C`` is computed by the last kernel from the tensor at every launch (graph-safe).

Launch knobs: the ``triton.aux_loss.*`` entries of ``amdqb/configs``:

* ``row_elems``: BT * W per scores program (BT rows of W = next_pow2(E) columns in registers);
  ``elems_per_warp`` / ``max_warps``: num_warps = BT * W / elems_per_warp, clamped;
* ``extract_max_k``: up to this k the map comes from k best-first extractions (2k row
  reductions), above it from the 32 + log2(W) step exact cutoff search of the router;
* ``loss_max_programs``: row slices of the aux-loss reduction (one fp32 partial each, folded in a
  fixed order by one program: deterministic); ``loss_tile_elems``: rows x columns per iteration.
"""

from __future__ import annotations

import torch
import triton

from ... import configs
from ...devices import device_info
from ...ref.router import pack_bitmap
from ..calls import SCORE_CODES, AuxScoresRequest
from . import _aux_loss_kernels as K
from ._common import compile_options, floor_pow2, on_device, pow2, row_stride

MAX_ROW_EXPERTS = 8192


def _config_of(family: str) -> dict:
    """The ``triton.aux_loss.*`` entries of ``family``'s config without their prefix."""
    cfg = configs.load(family)
    prefix = "triton.aux_loss."
    return {key[len(prefix) :]: cfg[key] for key in cfg.keys() if key.startswith(prefix)}


def _config(device: torch.device) -> dict:
    return _config_of(device_info(device).arch_family)


def _tile(E: int, cfg: dict) -> tuple[int, int, int]:
    W = max(16, pow2(E))
    BT = floor_pow2(max(1, cfg["row_elems"] // W))
    warps = max(1, min(cfg["max_warps"], BT * W // cfg["elems_per_warp"]))
    return W, BT, warps


# --------------------------------------------------------------------------------------------
# Scores for the aux loss.
# --------------------------------------------------------------------------------------------
def aux_scores_fwd(logits, topk, score_function, scores_out, map_out, map_kind):
    T, E = logits.shape
    if T == 0:
        return
    cfg = _config(logits.device)
    W, BT, warps = _tile(E, cfg)
    # The bitmap is packed from a byte map after the kernel: packing inside it changed the layout
    # Triton picks for the row sums, and with it the normalised scores' bits (sm_90, Triton 3.6).
    byte_map = (
        map_out.view(torch.uint8)
        if map_kind == "bytemap"
        else logits.new_empty((T, E), dtype=torch.uint8)
    )
    with on_device(logits):
        K._aux_scores_fwd_kernel[(triton.cdiv(T, BT),)](
            logits,
            scores_out,
            byte_map,
            T,
            row_stride(logits),
            E=E,
            K=topk,
            W=W,
            BT=BT,
            SCORE=SCORE_CODES[score_function],
            EXTRACT=topk <= cfg["extract_max_k"],
            ID_BITS=max(1, (W - 1).bit_length()),
            DENSE=logits.is_contiguous(),
            num_warps=warps,
            **compile_options(logits.device),
        )
    if map_kind != "bytemap":
        map_out.copy_(pack_bitmap(byte_map))


def aux_scores_bwd(grad_scores, logits, score_function, grad_logits_out):
    T, E = logits.shape
    if T == 0:
        return
    cfg = _config(logits.device)
    W, BT, warps = _tile(E, cfg)
    with on_device(logits):
        K._aux_scores_bwd_kernel[(triton.cdiv(T, BT),)](
            grad_scores,
            logits,
            grad_logits_out,
            T,
            row_stride(logits),
            E=E,
            W=W,
            BT=BT,
            SCORE=SCORE_CODES[score_function],
            DENSE=logits.is_contiguous(),
            num_warps=warps,
            **compile_options(logits.device),
        )


def activation_values(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """fp32 sigmoid / sqrtsoftplus of ``logits``, by exactly the aux-loss kernels' code."""
    x = logits.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    n = x.numel()
    if n == 0:
        return out
    block = 1024
    with on_device(x):
        K._activation_kernel[(triton.cdiv(n, block),)](
            x, out, n, BLOCK=block, SCORE=SCORE_CODES[score_function], **compile_options(x.device)
        )
    return out


# --------------------------------------------------------------------------------------------
# Aux loss.
# --------------------------------------------------------------------------------------------
def _loss_tile(C: int, cfg: dict) -> tuple[int, int]:
    BC = min(pow2(C), 1024)
    BR = floor_pow2(max(1, cfg["loss_tile_elems"] // BC))
    return BC, BR


def aux_loss_fwd(
    probs, tokens_per_expert, total_num_tokens, coeff_host, coeff_prefix, loss_out, coeff_out
):
    R, C = probs.shape
    cfg = _config(probs.device)
    BC, BR = _loss_tile(C, cfg)
    progs = max(1, min(cfg["loss_max_programs"], triton.cdiv(R, BR)))
    rows_per = max(1, triton.cdiv(R, progs))
    progs = max(1, triton.cdiv(R, rows_per))
    opts = compile_options(probs.device)
    with on_device(probs):
        partial = torch.empty(progs, dtype=torch.float32, device=probs.device)
        K._aux_loss_partial_kernel[(progs,)](
            probs,
            tokens_per_expert,
            partial,
            R,
            rows_per,
            row_stride(probs),
            tokens_per_expert.stride(0),
            C=C,
            BC=BC,
            BR=BR,
            DENSE=probs.is_contiguous(),
            num_warps=cfg["loss_warps"],
            **opts,
        )
        has_t = total_num_tokens is not None
        K._aux_loss_final_kernel[(1,)](
            partial,
            total_num_tokens if has_t else partial,
            loss_out,
            coeff_out,
            progs,
            float(coeff_host),
            float(coeff_prefix),
            PB=max(16, pow2(progs)),
            HAS_T=has_t,
            num_warps=1,
            **opts,
        )


def aux_loss_bwd(coeff_buf, tokens_per_expert, grad_loss, grad_probs_out):
    R, C = grad_probs_out.shape
    if R == 0:
        return
    cfg = _config(grad_probs_out.device)
    BC, BR = _loss_tile(C, cfg)
    with on_device(grad_probs_out):
        K._aux_loss_bwd_kernel[(triton.cdiv(R, BR), triton.cdiv(C, BC))](
            coeff_buf,
            tokens_per_expert,
            grad_loss,
            grad_probs_out,
            R,
            tokens_per_expert.stride(0),
            C=C,
            BR=BR,
            BC=BC,
            num_warps=cfg["loss_warps"],
            **compile_options(grad_probs_out.device),
        )


# --------------------------------------------------------------------------------------------
# Capability checks (the dispatcher's: a reason passes this backend over, the next one runs).
# --------------------------------------------------------------------------------------------
def aux_scores_limits(info, request: AuxScoresRequest) -> str | None:
    if request.num_experts > MAX_ROW_EXPERTS:
        return (
            f"E > {MAX_ROW_EXPERTS} (num_experts={request.num_experts}): a whole row is kept in "
            "registers"
        )
    return None


OPS = {
    "aux_scores_fwd": aux_scores_fwd,
    "aux_scores_bwd": aux_scores_bwd,
    "aux_loss_fwd": aux_loss_fwd,
    "aux_loss_bwd": aux_loss_bwd,
}
LIMITS = {"aux_scores_fwd": aux_scores_limits, "aux_scores_bwd": aux_scores_limits}
