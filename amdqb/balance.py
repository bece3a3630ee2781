"""Quantile Balancing (Kimi K3 §2.3.3) as a persistent, graph-safe balancer, plus the
aux-loss-free baseline and the load metrics.

``QuantileBalancer(num_experts, topk)`` balances from its first step, at any logit scale: it
routes by the tie-free selection ``b - sigmoid(-z)`` (no fp32 ties once the sigmoid saturates)
and recovers each expert's bias change from a 64-bin histogram of its biased margin on the
expert's own log axis (``binning="log_margin"``, ``docs/qb_binning.md``), placing the quantile
inside its bin by the bin's own mean and variance (the in-bin moments). K3's uniform histogram
with TransformerEngine's selection is the explicit TE-exact option:
``QuantileBalancer(num_experts, topk, binning="uniform")``.

It owns buffers whose addresses never change:

* ``bias``       fp32 ``[E]``    selection bias, initialised to 0;
* ``bin_bounds`` fp32            the histogram's axis: ``[L, U]`` for the uniform binning
  (initialised to ``[-1, 1]``), the per-expert inverse scales ``[E]`` for log_margin
  (initialised to ``2^68``: the first step sees any correction from ``2^-68`` to 1);
* ``histogram``  accumulated by every routed (micro)batch since the last step: int64
  ``[3, E, B]`` with ``moments`` (log_margin's default: the counts, then the in-bin moments),
  else int32 ``[E, B]`` counts;
* ``rejected_steps`` int32 ``[1]`` steps whose candidate state was not committed.

``step()`` sums the histogram over ``process_group`` (one integer all-reduce, so the recovered
quantile is the pooled global-batch quantile, not a mean of per-rank quantiles), recovers the
App. D bias (uniform) or bias change (log_margin), mixes it with the old bias (``ema``), centres
it (uniform: the mean; log_margin: the median at 0, so that fp32 spacing is finest where most
experts sit, with every bias within +-2), sets the new axis, marks the bounds validated and
zeroes the histogram -- all in place, with no host synchronisation, so it can be captured in a
CUDA/HIP graph with the training step. A step whose result is not finite, or whose histogram holds a negative (wrapped) count,
commits nothing and counts in ``rejected_steps``; a bias or bounds overwritten with non-finite
values from outside are restored from the last committed state before the update.

Capacity: the int32 histogram holds at most ``2**31 - 1`` tokens per bin and step, summed over the
ranks of the process group (the int64 planes of the moments keep the same bound). ``route``
refuses a batch that would pass ``2**31 - 1`` tokens since the last ``step`` (a host count, no
device read). The count also runs while a graph is captured, so a captured sequence is checked
once, at capture; its replays are not seen by the host. A graph that routes and steps starts
every replay from a zeroed histogram; one replayed without a step in between accumulates, and the
device-side check takes over: an int32 bin past ``2**31 - 1`` wraps negative and the step rejects
that histogram (exact while fewer than ``2**32`` tokens are routed between two steps).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import dispatch
from .ops._checks import (
    INT32_MAX,
    LOAD_DTYPES,
    MAX_ALLOCATED_EXPERTS,
    check_backend,
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_no_overlap,
    check_tensor,
)
from .ops.qb import qb_step_
from .ops.router import (
    check_qb_bounds_values,
    fused_topk_with_score_function,
    mark_qb_bin_bounds_validated,
)
from .ref import qb as _ref_qb
from .ref.router import BINNINGS, MAX_MARGIN_BINS, MIN_MARGIN_BINS, SELECTIONS

DEFAULT_BINS = {"log_margin": 64, "uniform": 1000}
DEFAULT_SELECTION = {"log_margin": "tie_free", "uniform": "te"}
MAX_UNIFORM_BINS = 1 << 16
MAX_HISTOGRAM = 1 << 27  # E * B counts of the int32 histogram (512 MiB)


class QuantileBalancer:
    """Persistent QB state for one MoE router.

    Args:
        num_experts: E (2 ... 65536).
        topk: experts per token (``0 < topk < E``).
        binning: ``"log_margin"`` (default: each expert's biased margin on its own log axis, the
            resolution relative to that expert's correction; 64 bins) or ``"uniform"`` (K3 and
            TE's histogram of ``alpha - s`` over ``[min b - 1, max b + 1]``; 1000 bins).
        num_bins: B (default 64 for log_margin, even, 64 ... 256; 1000 for uniform, 2 ... 65536).
        selection: ``"tie_free"`` (``b - sigmoid(-z)``: no fp32 ties once the sigmoid saturates;
            the default with log_margin) or ``"te"`` (TE's ``s + b``: the default, and the only
            choice, with uniform).
        moments: log_margin: the histogram also sums each fine-key bin's in-bin position and
            its square (``histogram`` int64 ``[3, E, B]``: a pair adds up to ``255**2``), and
            the step places the quantile inside its bin by those moments instead of
            interpolating linearly (``docs/qb_binning.md``). ``None`` (default): on with
            log_margin, off with uniform (which has none); ``False`` keeps the int32 ``[E, B]``
            counts alone. At saturated logits an expert's margins are atoms at the other
            experts' bias gaps: the moments place an atom to 1/256 of its bin, where the
            interpolation can miss it by the bin's width (41% of the margin), which after a
            sudden shift of the router costs 2-3 steps. Every backend's router counts them, in
            both histogram modes.
        ema: weight of the previous bias in ``new = ema*old + (1-ema)*recovered`` (0 = K3).
        process_group: a ``torch.distributed`` process group to all-reduce the histogram over;
            ``None`` uses the default group when torch.distributed is initialised, else no
            collective.
        device: where the buffers live (the CPU or a CUDA/ROCm device).
    """

    def __init__(
        self,
        num_experts: int,
        topk: int,
        *,
        binning: str = "log_margin",
        num_bins: Optional[int] = None,
        selection: Optional[str] = None,
        moments: Optional[bool] = None,
        ema: float = 0.0,
        process_group=None,
        device: Optional[torch.device | str] = None,
    ):
        num_experts = check_int("num_experts", num_experts, low=2, high=MAX_ALLOCATED_EXPERTS)
        topk = check_int("topk", topk, low=1, high=num_experts - 1)
        check_choice("binning", binning, BINNINGS)
        if selection is None:
            selection = DEFAULT_SELECTION[binning]
        check_choice("selection", selection, SELECTIONS)
        if selection == "tie_free" and binning != "log_margin":
            raise ValueError("selection='tie_free' needs binning='log_margin'")
        if num_bins is None:
            num_bins = DEFAULT_BINS[binning]
        if binning == "log_margin":
            # below 64 bins the axis has no room for its fine keys (docs/qb_binning.md)
            num_bins = check_int("num_bins", num_bins, low=MIN_MARGIN_BINS, high=MAX_MARGIN_BINS)
            if num_bins % 2:
                raise ValueError(f"num_bins must be even for binning='log_margin', got {num_bins}")
        else:
            num_bins = check_int("num_bins", num_bins, low=2, high=MAX_UNIFORM_BINS)
        if num_experts * num_bins > MAX_HISTOGRAM:
            raise ValueError(
                f"num_experts * num_bins = {num_experts * num_bins} histogram counts exceed "
                f"{MAX_HISTOGRAM} (num_experts={num_experts}, num_bins={num_bins})"
            )
        moments = binning == "log_margin" if moments is None else check_bool("moments", moments)
        if moments and binning != "log_margin":
            raise ValueError("moments=True needs binning='log_margin' (the in-bin moments)")
        ema = check_float("ema", ema)
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"ema must be in [0, 1), got {ema}")
        _check_process_group(process_group)
        device = _check_device(device)
        self.num_experts = num_experts
        self.topk = topk
        self.binning = binning
        self.selection = selection
        self.num_bins = num_bins
        self.moments = moments
        self.ema = ema
        self.process_group = process_group
        self.bias = torch.zeros(num_experts, dtype=torch.float32, device=device)
        self.bin_bounds = self._initial_bounds(device)
        self.histogram = _ref_qb.new_histogram(num_experts, num_bins, moments, device)
        self.rejected_steps = torch.zeros(1, dtype=torch.int32, device=device)
        # the last committed state: restores a bias or bounds overwritten from outside
        self._committed = torch.cat([self.bias, self.bin_bounds])
        self._pending_tokens = 0
        mark_qb_bin_bounds_validated(self.bin_bounds)

    def _initial_bounds(self, device) -> torch.Tensor:
        if self.binning == "uniform":
            return torch.tensor([-1.0, 1.0], dtype=torch.float32, device=device)
        return _ref_qb.initial_margin_scale(self.num_experts, device)

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
        approximate_activation: bool = False,
        backend: Optional[str] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Route ``logits`` (sigmoid scores + ``bias``) and accumulate the QB histogram.

        ``accumulate`` defaults to ``torch.is_grad_enabled()``: evaluation and ``no_grad`` calls
        route with the current bias but leave the histogram alone unless asked explicitly, so they
        never leak into the next training step.
        """
        check_tensor("logits", logits, min_dim=1)
        if logits.shape[-1] != self.num_experts:
            raise ValueError(
                f"logits must have num_experts={self.num_experts} columns (last dim), got shape "
                f"{tuple(logits.shape)}"
            )
        if logits.device != self.device:
            raise ValueError(
                f"logits must be on the balancer's device {self.device}, got {logits.device}"
            )
        if accumulate is None:
            accumulate = torch.is_grad_enabled()
        accumulate = check_bool("accumulate", accumulate)
        approximate_activation = check_bool("approximate_activation", approximate_activation)
        if accumulate:
            tokens = logits.numel() // max(1, logits.shape[-1]) if logits.dim() else 0
            if (self._pending_tokens + tokens) * self._world_size() > INT32_MAX:
                raise ValueError(
                    f"routing {tokens} more tokens before step() would pass the int32 histogram's "
                    f"2^31 - 1 tokens per step (pending {self._pending_tokens}, "
                    f"x{self._world_size()} ranks); call step() more often"
                )
        qb = (self.histogram, self.bin_bounds, histogram_mode) if accumulate else (None,) * 3
        out = fused_topk_with_score_function(
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
            selection=self.selection,
            qb_binning=self.binning,
            approximate_activation=approximate_activation,
            backend=backend,
        )
        if accumulate:
            self._pending_tokens += tokens
        return out

    def _group(self):
        if self.process_group is not None:
            return self.process_group
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.group.WORLD
        return None

    def _world_size(self) -> int:
        group = self._group()
        if group is None:
            return 1
        import torch.distributed as dist

        return dist.get_world_size(group)

    def all_reduce_histogram(self) -> None:
        """Sum the histogram over the process group in place (no-op without a group)."""
        group = self._group()
        if group is None:
            return
        import torch.distributed as dist

        dist.all_reduce(self.histogram, op=dist.ReduceOp.SUM, group=group)

    @torch.no_grad()
    def step(self, *, backend: Optional[str] = None) -> None:
        """All-reduce, recover, EMA, centre, new bounds, mark validated, zero the histogram.

        A bias or bounds entry made non-finite (or bounds made invalid) from outside is first
        restored from the last committed state; a candidate state that is not finite, or a
        histogram with a negative (wrapped) count, is not committed and counts in
        ``rejected_steps``. Device ops only: no host sync."""
        check_backend(backend)
        self.all_reduce_histogram()
        # the bounds are trusted here: the update reads them through the committed state
        qb_step_(
            self.bias,
            self.histogram,
            mark_qb_bin_bounds_validated(self.bin_bounds),
            self.topk,
            self.ema,
            binning=self.binning,
            rejected=self.rejected_steps,
            committed=self._committed,
            backend=backend,
        )
        mark_qb_bin_bounds_validated(self.bin_bounds)
        self.histogram.zero_()
        self._pending_tokens = 0

    def state_dict(self) -> dict:
        return {
            "bias": self.bias.clone(),
            "bin_bounds": self.bin_bounds.clone(),
            "num_bins": self.num_bins,
            "topk": self.topk,
            "ema": self.ema,
            "binning": self.binning,
            "selection": self.selection,
        }

    def load_state_dict(self, state: dict) -> None:
        """Copy a saved state into the existing buffers (addresses unchanged), after checking all
        of it: the settings must match this balancer's, ``ema`` lie in ``[0, 1)``, the bias be
        finite (uniform: with ``max - min + 2`` finite in fp32, the span of its bounds) and the
        bounds valid for the binning. Tensors are copied by value (one that requires grad loses
        nothing; a meta tensor is refused). A log_margin state saved with the earlier global
        ``[eps, 1/eps]`` axis keeps its bias and restarts the axis wide. Nothing is changed when
        a check fails."""
        if not isinstance(state, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state).__name__}")
        for key in ("bias", "bin_bounds", "num_bins", "topk", "ema"):
            if key not in state:
                raise ValueError(f"state_dict is missing {key!r}")
        binning = state.get("binning", "uniform")  # states saved before the binning existed
        selection = state.get("selection", "te")
        settings = (state["num_bins"], state["topk"], binning, selection)
        if settings != (self.num_bins, self.topk, self.binning, self.selection):
            raise ValueError(
                f"state_dict has num_bins={state['num_bins']}, topk={state['topk']}, "
                f"binning={binning!r}, selection={selection!r}; this balancer has "
                f"num_bins={self.num_bins}, topk={self.topk}, binning={self.binning!r}, "
                f"selection={self.selection!r}"
            )
        ema = check_float("state_dict['ema']", state["ema"])
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"state_dict['ema'] must be in [0, 1), got {ema}")
        bias = check_tensor(
            "state_dict['bias']", state["bias"], dtypes=(torch.float32,), shape=(self.num_experts,)
        )
        bounds = check_tensor(
            "state_dict['bin_bounds']", state["bin_bounds"], dtypes=(torch.float32,), dim=1
        )
        for name, t in (("state_dict['bias']", bias), ("state_dict['bin_bounds']", bounds)):
            if t.device.type == "meta":
                raise ValueError(f"{name} is on the meta device: it holds no values to load")
        # a load is a host-side event: reading the values here is allowed
        bias_values = bias.detach().cpu()
        if not bool(torch.isfinite(bias_values).all()):
            raise ValueError("state_dict['bias'] must be finite")
        bound_values = bounds.detach().cpu()
        if self.binning == "uniform":
            if bound_values.shape != (2,):
                raise ValueError(
                    f"state_dict['bin_bounds'] must have shape (2,) for binning='uniform', got "
                    f"{tuple(bound_values.shape)}"
                )
            span = float(bias_values.max()) - float(bias_values.min()) + 2.0
            if not math.isfinite(torch.tensor(span, dtype=torch.float32).item()):
                raise ValueError(
                    f"state_dict['bias'] spans {span:.3g}: its uniform bounds [min - 1, max + 1] "
                    "would not be finite in fp32, so no step could balance from it"
                )
        elif bound_values.shape == (2,) and self.num_experts != 2:
            bound_values = _ref_qb.initial_margin_scale(self.num_experts)  # the global axis
        elif bound_values.shape != (self.num_experts,):
            raise ValueError(
                f"state_dict['bin_bounds'] must have shape ({self.num_experts},) for "
                f"binning='log_margin' (the per-expert inverse scales), got "
                f"{tuple(bound_values.shape)}"
            )
        check_qb_bounds_values(bound_values.tolist(), self.binning, "state_dict['bin_bounds']")
        # every check passed: the writes below cannot fail on the values
        with torch.no_grad():
            self.bias.copy_(bias_values)
            self.bin_bounds.copy_(bound_values)
            torch.cat([self.bias, self.bin_bounds], out=self._committed)
            self.histogram.zero_()
        mark_qb_bin_bounds_validated(self.bin_bounds)
        self.ema = ema
        self._pending_tokens = 0


def _check_process_group(group) -> None:
    """``process_group=``: None or a ``torch.distributed`` process group (not a name)."""
    if group is None:
        return
    import torch.distributed as dist

    process_group = getattr(dist, "ProcessGroup", None)
    if process_group is None or not isinstance(group, process_group):
        raise TypeError(
            f"process_group must be a torch.distributed ProcessGroup or None, got {group!r}"
        )


def _check_device(device) -> torch.device:
    """``device=``: None (the CPU), a ``torch.device`` or its string; the CPU or an available
    CUDA/ROCm device."""
    dev = torch.device("cpu") if device is None else dispatch.as_device(device)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be the CPU or a CUDA/ROCm device, got {device!r}")
    return dev


@torch.no_grad()
def aux_free_bias_update_(
    bias: torch.Tensor, tokens_per_expert: torch.Tensor, rate: float = 1e-3
) -> torch.Tensor:
    """DeepSeek-V3 aux-loss-free update in place: ``b += rate * sign(mean_load - load)``."""
    check_tensor("bias", bias, dtypes=(torch.float32,), dim=1)
    check_tensor(
        "tokens_per_expert",
        tokens_per_expert,
        dtypes=LOAD_DTYPES,
        shape=(bias.numel(),),
        device=bias.device,
    )
    rate = check_float("rate", rate, finite=True)
    check_no_overlap({"bias": bias}, {"tokens_per_expert": tokens_per_expert})
    bias.copy_(_ref_qb.aux_free_bias_update(bias, tokens_per_expert, rate))
    return bias


def maxvio(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """MaxVio = ``max(load) / mean(load) - 1`` (0-dim fp32 tensor, no host sync; 0 for an empty
    load or one with no tokens; NaN when a load is NaN or infinite)."""
    check_tensor("tokens_per_expert", tokens_per_expert, dtypes=LOAD_DTYPES, dim=1)
    return _ref_qb.maxvio(tokens_per_expert)


def cv2(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """CV^2 of the load shares (0-dim fp32 tensor; 0 for an empty load)."""
    check_tensor("tokens_per_expert", tokens_per_expert, dtypes=LOAD_DTYPES, dim=1)
    return _ref_qb.cv2(tokens_per_expert)
