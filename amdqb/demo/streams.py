"""Router-logit streams for the demo, the balance study and the tests.

:class:`Stream` draws each step's logits ``scale * (x_t @ W_t + offset_t)`` for a drifting token
stream; its options make the five streams of the suite (:data:`SUITE`):

* ``drift``      -- the stationary drifting router: the token mean rotates, the router weights
  random-walk, ``E // 16`` hot experts carry a persistent offset (the demo's default);
* ``mean_drift`` -- ``drift`` plus an independent mean-reverting walk of every expert's mean logit;
* ``shift``      -- ``drift`` whose router weights and hot experts are redrawn at one step;
* ``heavy_tail`` -- ``drift`` with Student-t token features (3 degrees of freedom);
* ``favoured``   -- four experts systematically favoured by a large offset, no other hot experts.

Everything is drawn from one CPU generator seeded with ``seed``, so a stream does not depend on
the device it is moved to.
"""

from __future__ import annotations

import math

import torch

SUITE_KINDS = ("drift", "mean_drift", "shift", "heavy_tail", "favoured")
SUITE_STDS = (1.0, 3.0, 10.0, 20.0)
SUITE_SHAPES = ((64, 4, 4096), (256, 8, 8192), (896, 16, 16384))  # (E, k, T)


class Stream:
    """Router logits ``scale * (x_t @ W_t + offset_t) / c`` for a drifting, skewed token stream.

    * ``x_t ~ N(mu_t, I_d)`` (or Student-t with ``tail_df`` degrees of freedom around ``mu_t``),
      ``T`` fresh tokens per step; ``mu_t`` rotates in a random plane with period ``period``
      steps, its projection on each expert direction having std ``mean_drift``;
    * ``W_t`` has unit columns and takes a random-walk step of size ``weight_drift`` per step;
    * ``offset_t`` is ``+hot_offset`` on ``num_hot`` random experts, ``+favoured_offset`` on
      ``num_favoured`` others, plus (``expert_walk > 0``) a per-expert walk
      ``w <- walk_keep * w + expert_walk * N(0, 1)``;
    * ``shift_at``: at that step ``W`` and the hot experts are drawn afresh;
    * ``c`` is the std of the unscaled step-0 logits, so that ``std(logits) ~= logit_scale``.
    """

    def __init__(
        self,
        tokens: int,
        experts: int,
        dim: int,
        logit_scale: float,
        seed: int,
        device: torch.device | str = "cpu",
        num_hot: int | None = None,
        hot_offset: float = 1.0,
        mean_drift: float = 0.25,
        weight_drift: float = 0.05,
        period: float = 100.0,
        *,
        expert_walk: float = 0.0,
        walk_keep: float = 0.99,
        shift_at: int | None = None,
        tail_df: float | None = None,
        num_favoured: int = 0,
        favoured_offset: float = 0.0,
    ):
        self.tokens, self.experts, self.dim = tokens, experts, dim
        self.logit_scale = logit_scale
        self.device = torch.device(device)
        self.hot_offset = hot_offset
        self.weight_drift = weight_drift
        self.period = period
        self.expert_walk, self.walk_keep = expert_walk, walk_keep
        self.shift_at = shift_at
        self.tail_df = tail_df
        self.num_hot = max(1, experts // 16) if num_hot is None else num_hot
        self.gen = torch.Generator().manual_seed(seed)
        self.weights = self._unit_columns(torch.randn(dim, experts, generator=self.gen))
        order = torch.randperm(experts, generator=self.gen)
        self.hot = order[: self.num_hot].sort().values
        self.favoured = order[self.num_hot : self.num_hot + num_favoured].sort().values
        self.base = torch.zeros(experts)
        self.base[self.favoured] = favoured_offset
        self.walk = torch.zeros(experts)
        plane, _ = torch.linalg.qr(torch.randn(dim, 2, generator=self.gen))
        # mu . w_e has std |mu| / sqrt(d) over random unit w_e: scale |mu| to sqrt(d) * mean_drift.
        self.plane = plane.T * (mean_drift * math.sqrt(dim))
        self.step_index = 0
        self.calibration: float | None = None  # std of the unscaled step-0 logits
        self.first_std: float | None = None  # measured std of the step-0 logits

    @staticmethod
    def _unit_columns(w: torch.Tensor) -> torch.Tensor:
        return w / w.norm(dim=0, keepdim=True)

    def _mean(self, step: int) -> torch.Tensor:
        phase = 2.0 * math.pi * step / self.period
        return math.cos(phase) * self.plane[0] + math.sin(phase) * self.plane[1]

    def _offset(self) -> torch.Tensor:
        offset = self.base + self.walk
        offset[self.hot] += self.hot_offset
        return offset

    def _features(self) -> torch.Tensor:
        x = torch.randn(self.tokens, self.dim, generator=self.gen)
        if self.tail_df is not None:
            # Student-t: a normal over sqrt(chi^2_df / df), the chi^2 from df squared normals
            df = int(self.tail_df)
            chi2 = torch.randn(self.tokens, df, generator=self.gen).square().sum(1, keepdim=True)
            x = x / torch.sqrt(chi2 / df)
        return x + self._mean(self.step_index)

    def next(self) -> torch.Tensor:
        """This step's fp32 logits ``[T, E]`` on the device; then the router drifts."""
        if self.shift_at is not None and self.step_index == self.shift_at:
            self.weights = self._unit_columns(
                torch.randn(self.dim, self.experts, generator=self.gen)
            )
            self.hot = (
                torch.randperm(self.experts, generator=self.gen)[: self.num_hot].sort().values
            )
        raw = self._features() @ self.weights + self._offset()
        if self.calibration is None:
            self.calibration = float(raw.std())
        raw = raw * (self.logit_scale / self.calibration)
        if self.first_std is None:
            self.first_std = float(raw.std())
        noise = torch.randn(self.dim, self.experts, generator=self.gen)
        self.weights = self._unit_columns(
            self.weights + self.weight_drift * noise / math.sqrt(self.dim)
        )
        if self.expert_walk > 0:
            step = torch.randn(self.experts, generator=self.gen)
            self.walk = self.walk_keep * self.walk + self.expert_walk * step
        self.step_index += 1
        return raw.to(self.device)


SUITE = {
    "drift": {},
    "mean_drift": {"expert_walk": 0.04, "walk_keep": 0.99},
    "shift": {},  # shift_at is set by suite_stream
    "heavy_tail": {"tail_df": 3.0},
    "favoured": {"num_hot": 0, "num_favoured": 4, "favoured_offset": 1.5},
}


def suite_stream(
    kind: str,
    tokens: int,
    experts: int,
    logit_std: float,
    seed: int = 0,
    device: torch.device | str = "cpu",
    *,
    shift_at: int | None = None,
    dim: int = 64,
) -> Stream:
    """The suite's stream ``kind`` (:data:`SUITE_KINDS`); ``shift_at`` is the step at which the
    ``shift`` stream redraws its router (required for it, ignored by the others)."""
    if kind not in SUITE:
        raise ValueError(f"stream kind must be one of {SUITE_KINDS}, got {kind!r}")
    options = dict(SUITE[kind])
    if kind == "shift":
        if shift_at is None:
            raise ValueError("the shift stream needs shift_at (the step of the shift)")
        options["shift_at"] = shift_at
    return Stream(tokens, experts, dim, logit_std, seed, device, **options)
