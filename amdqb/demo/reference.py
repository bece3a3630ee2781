"""The yardstick of the demo and the balance study: exact Quantile Balancing in float64 with the
tie-free selection, written from the definitions alone (no amdqb code).

Routing ranks ``v = b - sigmoid(-z)`` (float64), the same order as ``s + b`` in exact arithmetic
but without its ties once the sigmoid saturates: float64 ``sigmoid(-z)`` keeps its relative
precision down to ``z ~ 745``, where ``s + b`` in float64 stops resolving at ``z ~ 36.7``. The
first k of the order (``v`` descending, expert id ascending on equal values) are routed and
``alpha`` is the (k+1)-th ``v``.

The update is App. D's exact quantile: with ``r = alpha - (v - b) = alpha + sigmoid(-z)`` the
bias expert j would need to be routed, and ``n = ceil(T k / E)``, the new bias of expert j is the
midpoint of its n-th and (n+1)-th smallest r (every bias strictly between them routes it to
exactly n tokens of the batch). The biases are then shifted so that the smallest is 0 (routing
only depends on differences; float64 is finest near 0). Everything is float64; the bias is
carried in float64 into the next step.
"""

from __future__ import annotations

import torch


class ExactQB64:
    """Exact float64 tie-free QB: ``route(logits)`` -> routing map, then ``update()``."""

    def __init__(self, experts: int, topk: int, device: torch.device | str = "cpu"):
        if not 0 < topk < experts:
            raise ValueError(f"need 0 < topk < experts, got topk={topk}, experts={experts}")
        self.topk = topk
        self.bias = torch.zeros(experts, dtype=torch.float64, device=device)
        self._last = None

    def route(self, logits: torch.Tensor) -> torch.Tensor:
        """The routing map (bool ``[T, E]``) of ``logits`` under the current bias."""
        complement = torch.sigmoid(-logits.double())  # sigmoid(-z) = 1 - sigmoid(z), exactly
        value = self.bias[None, :] - complement
        # a stable sort keeps equal values in ascending id order: the smaller id first
        order = torch.sort(value, dim=1, descending=True, stable=True).indices[:, : self.topk + 1]
        alpha = value.gather(1, order[:, self.topk :])
        routing_map = torch.zeros(value.shape, dtype=torch.bool, device=value.device)
        routing_map.scatter_(1, order[:, : self.topk], True)
        self._last = (alpha, complement)
        return routing_map

    def update(self) -> None:
        """The exact App. D bias of the last routed batch, its minimum moved to 0."""
        alpha, complement = self._last
        self._last = None
        required = alpha + complement  # [T, E]
        tokens, experts = required.shape
        if tokens == 0:
            return
        n = -(-tokens * self.topk // experts)
        smallest = torch.topk(required, min(n + 1, tokens), dim=0, largest=False).values
        new = (smallest[n - 1] + smallest[min(n, tokens - 1)]) / 2
        self.bias = new - new.min()
