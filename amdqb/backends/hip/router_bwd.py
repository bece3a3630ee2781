"""hip launcher of the router's backward: ``amdqb_router_bwd`` (``hip_src/kernels/router_bwd.hip``),
TransformerEngine's formulas (``amdqb.backends.torch.router_bwd``) in one launch, grouped or not
(the routed set comes from the forward's map).

Precision: fp32 without contraction, torch's activations; the row sums run in butterfly order, so
the gradient agrees with the oracle's to fp32 rounding, not bit for bit.
"""

from __future__ import annotations

import ctypes

import torch

from ..calls import RouterCall
from . import _spec
from ._common import cdiv, dev

MAX_BWD_EXPERTS = 1024  # 32 experts per lane of a 32-lane row held in registers (3 arrays)
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class RouterBwdParams(ctypes.Structure):
    """``struct RouterBwdParams`` of router_bwd.hip, field for field."""

    _fields_ = [
        ("grad_probs", ctypes.c_void_p),
        ("logits", ctypes.c_void_p),
        ("routed", ctypes.c_void_p),
        ("grad_logits", ctypes.c_void_p),
        ("tokens", ctypes.c_int64),
        ("topk", ctypes.c_int32),
        ("use_pre_softmax", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("pad_", ctypes.c_int32),
    ]


def router_bwd(rt, call: RouterCall, grad_probs, logits, routed, grad_logits_out):
    call.check(logits)
    tokens, num_experts = logits.shape
    if tokens == 0:
        return
    spec = _spec.router_bwd_module(
        num_experts,
        _DTYPE_NAMES[logits.dtype],
        _DTYPE_NAMES[grad_probs.dtype],
        call.score_function,
    )
    lanes = dict(spec.defines)["AMDQB_ROW_LANES"]
    rows_per_block = (256 // 32) * (32 // int(lanes))
    params = RouterBwdParams(
        grad_probs.data_ptr(),
        logits.data_ptr(),
        routed.data_ptr(),
        grad_logits_out.data_ptr(),
        tokens,
        call.topk,
        1 if call.use_pre_softmax else 0,
        1.0 if call.scaling_factor is None else float(call.scaling_factor),
        0,
    )
    k = rt.kernel(dev(logits), spec, "amdqb_router_bwd")
    rt.launch(k, cdiv(tokens, rows_per_block), 256, 0, [params])


def router_bwd_limits(info, call: RouterCall) -> str | None:
    if call.num_experts > MAX_BWD_EXPERTS:
        return (
            f"router backward with num_experts={call.num_experts} > {MAX_BWD_EXPERTS} "
            "(register-resident rows)"
        )
    return None


LIMITS = {"router_bwd": router_bwd_limits}
