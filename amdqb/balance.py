"""Quantile Balancing (Kimi K3 §2.3.3) as a persistent, graph-safe balancer, plus the
aux-loss-free baseline and the load metrics.

``QuantileBalancer`` owns three buffers whose addresses never change:

* ``bias``       fp32 ``[E]``   selection bias, initialised to 0;
* ``bin_bounds`` fp32 ``[2]``   histogram range ``[L, U]``, initialised to ``[-1, 1]``;
* ``histogram``  int32 ``[E, B]`` counts accumulated by every routed (micro)batch since the last step.

``step()`` sums the histogram over ``process_group`` (one integer all-reduce, so the recovered
quantile is the pooled global-batch quantile, not a mean of per-rank quantiles), recovers the
App. D bias, mixes it with the old one (``ema``), centres it, sets the bounds to
``[min(bias) - 1, max(bias) + 1]``, marks them validated and zeroes the histogram -- all in place,
with no host synchronisation, so it can be captured in a CUDA/HIP graph with the training step.
"""

from __future__ import annotations

from typing import Optional

import torch

from .ops._checks import check_float, check_int, check_tensor
from .ops.qb import qb_step_
from .ops.router import fused_topk_with_score_function, mark_qb_bin_bounds_validated
from .ref import qb as _ref_qb


class QuantileBalancer:
    """Persistent QB state for one MoE router.

    Args:
        num_experts: E.
        topk: experts per token (``0 < topk < E``).
        num_bins: histogram bins B (K3 uses 1000).
        ema: weight of the previous bias in ``new = ema*old + (1-ema)*recovered`` (0 = K3).
        process_group: group to all-reduce the histogram over; ``None`` uses the default group
            when torch.distributed is initialised, else no collective.
        device: where the buffers live.
    """

    def __init__(
        self,
        num_experts: int,
        topk: int,
        num_bins: int = 1000,
        ema: float = 0.0,
        process_group=None,
        device: Optional[torch.device | str] = None,
    ):
        check_int("num_experts", num_experts, low=2)
        check_int("topk", topk, low=1, high=num_experts - 1)
        check_int("num_bins", num_bins, low=2)
        ema = check_float("ema", ema)
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"ema must be in [0, 1), got {ema}")
        self.num_experts = num_experts
        self.topk = topk
        self.num_bins = num_bins
        self.ema = ema
        self.process_group = process_group
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.bias = torch.zeros(num_experts, dtype=torch.float32, device=device)
        self.bin_bounds = torch.tensor([-1.0, 1.0], dtype=torch.float32, device=device)
        self.histogram = torch.zeros(num_experts, num_bins, dtype=torch.int32, device=device)
        mark_qb_bin_bounds_validated(self.bin_bounds)

    @property
    def device(self) -> torch.device:
        return self.bias.device

    def route(
        self,
        logits: torch.Tensor,
        *,
        accumulate: Optional[bool] = None,
        histogram_mode: str = "auto",
        scaling_factor: Optional[float] = None,
        routing_map_format="bytemap",
        topk_indices: Optional[torch.Tensor] = None,
        backend: Optional[str] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Route ``logits`` (sigmoid scores + ``bias``) and accumulate the QB histogram.

        ``accumulate`` defaults to ``torch.is_grad_enabled()``: evaluation and ``no_grad`` calls
        route with the current bias but leave the histogram alone unless asked explicitly, so they
        never leak into the next training step.
        """
        if accumulate is None:
            accumulate = torch.is_grad_enabled()
        qb = (self.histogram, self.bin_bounds, histogram_mode) if accumulate else (None,) * 3
        return fused_topk_with_score_function(
            logits,
            self.topk,
            scaling_factor=scaling_factor,
            score_function="sigmoid",
            expert_bias=self.bias,
            routing_map_format=routing_map_format,
            topk_indices=topk_indices,
            qb_histogram=qb[0],
            qb_bin_bounds=qb[1],
            qb_histogram_mode=qb[2],
            backend=backend,
        )

    def _group(self):
        if self.process_group is not None:
            return self.process_group
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.group.WORLD
        return None

    def all_reduce_histogram(self) -> None:
        """Sum the histogram over the process group in place (no-op without a group)."""
        group = self._group()
        if group is None:
            return
        import torch.distributed as dist

        dist.all_reduce(self.histogram, op=dist.ReduceOp.SUM, group=group)

    @torch.no_grad()
    def step(self, *, backend: Optional[str] = None) -> None:
        """All-reduce, recover, EMA, centre, new bounds, mark validated, zero the histogram."""
        self.all_reduce_histogram()
        qb_step_(self.bias, self.histogram, self.bin_bounds, self.topk, self.ema, backend=backend)
        mark_qb_bin_bounds_validated(self.bin_bounds)
        self.histogram.zero_()

    def state_dict(self) -> dict:
        return {
            "bias": self.bias.clone(),
            "bin_bounds": self.bin_bounds.clone(),
            "num_bins": self.num_bins,
            "topk": self.topk,
            "ema": self.ema,
        }

    def load_state_dict(self, state: dict) -> None:
        """Copy a saved state into the existing buffers (addresses unchanged)."""
        for key in ("bias", "bin_bounds", "num_bins", "topk", "ema"):
            if key not in state:
                raise ValueError(f"state_dict is missing {key!r}")
        if state["num_bins"] != self.num_bins or state["topk"] != self.topk:
            raise ValueError(
                f"state_dict has num_bins={state['num_bins']}, topk={state['topk']}; this balancer "
                f"has num_bins={self.num_bins}, topk={self.topk}"
            )
        check_tensor("state_dict['bias']", state["bias"], shape=(self.num_experts,))
        check_tensor("state_dict['bin_bounds']", state["bin_bounds"], shape=(2,))
        self.bias.copy_(state["bias"])
        self.bin_bounds.copy_(state["bin_bounds"])
        self.ema = float(state["ema"])
        self.histogram.zero_()


@torch.no_grad()
def aux_free_bias_update_(
    bias: torch.Tensor, tokens_per_expert: torch.Tensor, rate: float = 1e-3
) -> torch.Tensor:
    """DeepSeek-V3 aux-loss-free update in place: ``b += rate * sign(mean_load - load)``."""
    check_tensor("bias", bias, dtypes=(torch.float32,), dim=1)
    check_tensor("tokens_per_expert", tokens_per_expert, shape=(bias.numel(),), device=bias.device)
    rate = check_float("rate", rate)
    bias.copy_(_ref_qb.aux_free_bias_update(bias, tokens_per_expert, rate))
    return bias


def maxvio(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """MaxVio = ``max(load) / mean(load) - 1`` (0-dim fp32 tensor, no host sync)."""
    check_tensor("tokens_per_expert", tokens_per_expert, dim=1)
    return _ref_qb.maxvio(tokens_per_expert)


def cv2(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """CV^2 of the load shares (0-dim fp32 tensor)."""
    check_tensor("tokens_per_expert", tokens_per_expert, dim=1)
    return _ref_qb.cv2(tokens_per_expert)
