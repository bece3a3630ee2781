"""The balancers the demo and the balance study compare, each with one bias, routing the same
logits every step.

* ``none``       -- no bias (the stream's natural imbalance);
* ``aux_free``   -- the DeepSeek-V3 aux-loss-free sign rule, ``amdqb.aux_free_bias_update_``;
* ``qb_uniform`` -- K3 Quantile Balancing with TransformerEngine's histogram and selection,
  ``amdqb.QuantileBalancer(E, k, binning="uniform")`` (B = 1000 bins of ``[min b - 1, max b + 1]``);
* ``qb_default`` -- ``amdqb.QuantileBalancer(E, k)``: the tie-free selection and each expert's
  biased margin on its own log axis (B = 64), the quantile placed inside its bin by the bin's
  in-bin moments;
* ``qb_no_moments`` (not in the default list) -- the default without the in-bin moments (linear
  interpolation inside the bin), ``amdqb.QuantileBalancer(E, k, moments=False)``;
* ``qb_exact``   -- QB with the exact, bin-free quantile of the fp32 router, ``amdqb.qb_exact_bias``
  (TE's ``s + b`` selection, fp32: it ties once the sigmoid saturates);
* ``qb_exact_tie_free`` (an ablation, not in the default list) -- the default balancer's fp32
  tie-free selection and median pinning with the exact quantile of its fp32 margins instead of
  the histogram: what the fp32 router allows without any binning;
* ``exact64``    -- the yardstick, exact tie-free QB in float64 (:mod:`.reference`), the one row
  that routes outside the amdqb router.

Every bias computed from batch t is applied at t+1, never to the batch it came from. The amdqb
rows route with the real router (``QuantileBalancer.route`` / ``.step``, or
``amdqb.fused_topk_with_score_function(logits, k, score_function="sigmoid", expert_bias=bias)``).
"""

from __future__ import annotations

import torch

from .reference import ExactQB64

METHOD_NAMES = ("none", "aux_free", "qb_uniform", "qb_default", "qb_exact")
REFERENCE = "exact64"
SHORT = {
    "none": "none",
    "aux_free": "aux_free",
    "qb_uniform": "K3",
    "qb_default": "default",
    "qb_exact": "exact32",
    "qb_exact_tie_free": "exact32tf",
    "qb_no_moments": "no_moments",
    "exact64": "exact64",
}


class Method:
    """A balancer: ``route`` the step's logits with the current bias, then ``update`` the bias."""

    name = "none"
    label = "none"
    selection = "te"  # the values the router ranks: "te" (s + b), "tie_free" or "fp64"
    backend = None  # the amdqb backend the router runs on (None: the dispatcher's choice)

    def __init__(self, experts: int, topk: int, device: torch.device):
        import amdqb

        self.amdqb = amdqb
        self.topk = topk
        self._bias = torch.zeros(experts, dtype=torch.float32, device=device)

    @property
    def bias(self) -> torch.Tensor:
        return self._bias

    def route(self, logits: torch.Tensor) -> torch.Tensor:
        _, routing_map = self.amdqb.fused_topk_with_score_function(
            logits, self.topk, score_function="sigmoid", expert_bias=self.bias, backend=self.backend
        )
        return routing_map

    def update(self, logits: torch.Tensor, tokens_per_expert: torch.Tensor) -> None:
        pass


class AuxFree(Method):
    name = "aux_free"

    def __init__(self, experts, topk, device, rate: float = 1e-3):
        super().__init__(experts, topk, device)
        self.rate = rate
        self.label = f"aux-free sign rule (rate {rate:g})"

    def update(self, logits, tokens_per_expert):
        self.amdqb.aux_free_bias_update_(self.bias, tokens_per_expert, rate=self.rate)


class QBBalancer(Method):
    """``amdqb.QuantileBalancer``: ``.route(logits)`` accumulates the histogram, ``.step()``."""

    def __init__(self, experts, topk, device, name: str, label: str, **settings):
        super().__init__(experts, topk, device)
        self.balancer = self.amdqb.QuantileBalancer(experts, topk, device=device, **settings)
        self.selection = self.balancer.selection
        self.name, self.label = name, label

    @property
    def bias(self):
        return self.balancer.bias

    def route(self, logits):
        # accumulate=True: the demo runs under no_grad, where the balancer would not accumulate.
        _, routing_map = self.balancer.route(logits, accumulate=True, backend=self.backend)
        return routing_map

    def update(self, logits, tokens_per_expert):
        self.balancer.step(backend=self.backend)


class QBExact(Method):
    name = "qb_exact"
    label = "QB exact quantile (fp32, s + b)"

    def update(self, logits, tokens_per_expert):
        self.bias.copy_(self.amdqb.qb_exact_bias(logits, self.topk, self.bias))


class QBExactTieFree(Method):
    """Tie-free fp32 routing (the amdqb router) and the exact quantile of the fp32 margins
    ``d = alpha - v`` as the bias change, the median pinned at 0: the default balancer without
    its histogram."""

    name = "qb_exact_tie_free"
    label = "QB exact quantile (fp32, tie-free)"
    selection = "tie_free"

    def route(self, logits):
        _, routing_map = self.amdqb.fused_topk_with_score_function(
            logits, self.topk, score_function="sigmoid", expert_bias=self.bias,
            selection="tie_free", backend=self.backend,
        )  # fmt: skip
        return routing_map

    def update(self, logits, tokens_per_expert):
        from ..ref import qb as ref_qb
        from ..ref.router import qb_cutoff_and_routes, sigmoid_complement

        s = torch.sigmoid(logits.float())
        _, alpha, values = qb_cutoff_and_routes(
            s, self.bias, self.topk, "tie_free", sigmoid_complement(logits)
        )
        margin = (alpha[:, None] - values).double()
        tokens, experts = margin.shape
        n = -(-tokens * self.topk // experts)
        smallest = torch.topk(margin, min(n + 1, tokens), dim=0, largest=False).values
        delta = (smallest[n - 1] + smallest[min(n, tokens - 1)]) / 2
        self.bias.copy_(ref_qb.pin_median((self.bias.double() + delta).float()))


class Reference(Method):
    """Exact tie-free QB in float64 (:class:`.reference.ExactQB64`), outside the amdqb router."""

    name = REFERENCE
    label = "QB exact, tie-free, fp64 (reference)"
    selection = "fp64"

    def __init__(self, experts, topk, device):
        self.topk = topk
        self.exact = ExactQB64(experts, topk, device)

    @property
    def bias(self):
        return self.exact.bias

    def route(self, logits):
        return self.exact.route(logits)

    def update(self, logits, tokens_per_expert):
        self.exact.update()


def build_methods(
    names, experts, topk, device, *, uniform_bins=1000, margin_bins=64, aux_rate=1e-3
):
    """The methods ``names`` (of ``METHOD_NAMES``, ``REFERENCE``, ``qb_no_moments`` and
    ``qb_exact_tie_free``), in that order."""
    make = {
        "none": lambda: Method(experts, topk, device),
        "aux_free": lambda: AuxFree(experts, topk, device, rate=aux_rate),
        "qb_uniform": lambda: QBBalancer(
            experts,
            topk,
            device,
            "qb_uniform",
            f"QB K3 uniform (B={uniform_bins}, TE)",
            binning="uniform",
            num_bins=uniform_bins,
        ),
        "qb_default": lambda: QBBalancer(
            experts,
            topk,
            device,
            "qb_default",
            f"QB default (log_margin B={margin_bins}, tie-free, in-bin moments)",
            num_bins=margin_bins,
        ),
        "qb_no_moments": lambda: QBBalancer(
            experts,
            topk,
            device,
            "qb_no_moments",
            f"QB log_margin B={margin_bins}, tie-free, no in-bin moments",
            num_bins=margin_bins,
            moments=False,
        ),
        "qb_exact": lambda: QBExact(experts, topk, device),
        "qb_exact_tie_free": lambda: QBExactTieFree(experts, topk, device),
        REFERENCE: lambda: Reference(experts, topk, device),
    }
    unknown = [n for n in names if n not in make]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose from {(*METHOD_NAMES, REFERENCE)}")
    return [make[name]() for name in names]
