"""Differential privacy at the region border: clipping, Gaussian noise and their accountant (pure, torch only).

Before a region's backbone delta ``d`` (its backbone minus the last world backbone) leaves through
its leader in a world round, it is clipped to L2 norm ``C`` and Gaussian noise of standard
deviation ``sigma * C`` is added to every coordinate (the Gaussian mechanism with sensitivity
``C``)::

    d' = d * min(1, C / ||d||) + N(0, (sigma C)^2 I)

Each world round is one release of the whole region's delta (no subsampling), so after ``T``
releases with noise multipliers ``sigma_t`` the region's Renyi-DP at order ``alpha`` is
``sum_t alpha / (2 sigma_t^2)`` (Mironov 2017, Prop. 7 and composition), converted to
``(epsilon, delta)`` with Balle et al. 2020, Thm. 21 (the conversion Opacus uses):

    epsilon = min_alpha  rdp(alpha) + log((alpha - 1) / alpha) - (log delta + log alpha) / (alpha - 1)

The unit of privacy is the region: the guarantee covers any change of the region's data that
changes its delta, as seen by the other regions' leaders. Noise is drawn from an explicit
``torch.Generator``; nothing here touches global random state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

__all__ = [
    "DEFAULT_ORDERS",
    "l2_norm",
    "clip_by_l2_norm",
    "gaussian_noise",
    "Privatized",
    "privatize",
    "gaussian_rdp",
    "rdp_to_epsilon",
    "BorderAccountant",
]

#: Renyi orders searched by the accountant (the same grid as Opacus's RDPAccountant).
DEFAULT_ORDERS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + [float(a) for a in range(12, 64)])


def l2_norm(tensors: Sequence[torch.Tensor]) -> float:
    """The L2 norm of all ``tensors`` taken together as one vector (float64 accumulation)."""
    return math.sqrt(sum(float(t.detach().double().pow(2).sum()) for t in tensors))


def clip_by_l2_norm(tensors: Sequence[torch.Tensor], max_norm: float) -> tuple[list[torch.Tensor], float]:
    """``(clipped, norm)``: ``tensors`` scaled by ``min(1, max_norm / norm)`` (new tensors), and their
    original joint norm. A zero or tiny norm is left as is (no division by zero)."""
    if not (max_norm > 0 and math.isfinite(max_norm)):
        raise ValueError(f"max_norm must be a positive finite number, got {max_norm}")
    norm = l2_norm(tensors)
    if not math.isfinite(norm):
        raise ValueError("cannot clip tensors with non-finite values")
    scale = min(1.0, max_norm / norm) if norm > 0 else 1.0
    return [t * scale for t in tensors], norm


def gaussian_noise(like: Sequence[torch.Tensor], std: float, generator: torch.Generator) -> list[torch.Tensor]:
    """Independent ``N(0, std^2)`` noise shaped like each tensor of ``like`` (float32, CPU), drawn
    from ``generator`` in order."""
    if not (std >= 0 and math.isfinite(std)):
        raise ValueError(f"noise std must be >= 0 and finite, got {std}")
    return [torch.randn(t.shape, generator=generator, dtype=torch.float32) * std for t in like]


@dataclass(frozen=True, kw_only=True, slots=True)
class Privatized:
    """A delta after :func:`privatize`: the tensors to send, the delta's norm before clipping, the
    clipped norm (``min(norm, clip)``) and the noise standard deviation used."""

    tensors: list[torch.Tensor]
    norm: float
    clipped_norm: float
    noise_std: float


def privatize(delta: Sequence[torch.Tensor], *, clip: float, noise_multiplier: float,
              generator: torch.Generator) -> Privatized:
    """The Gaussian mechanism on ``delta``: clip to L2 norm ``clip``, add ``N(0, (noise_multiplier * clip)^2)``
    to every coordinate. ``noise_multiplier = 0`` clips only."""
    if not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"noise_multiplier must be >= 0 and finite, got {noise_multiplier}")
    clipped, norm = clip_by_l2_norm(delta, clip)
    std = noise_multiplier * clip
    noise = gaussian_noise(clipped, std, generator) if std > 0 else [torch.zeros_like(t) for t in clipped]
    out = [c.float() + n for c, n in zip(clipped, noise)]
    return Privatized(tensors=out, norm=norm, clipped_norm=min(norm, clip), noise_std=std)


def gaussian_rdp(noise_multiplier: float, steps: int, orders: Sequence[float] = DEFAULT_ORDERS) -> list[float]:
    """Renyi-DP of ``steps`` releases of the (not subsampled) Gaussian mechanism with noise multiplier
    ``noise_multiplier``: ``steps * alpha / (2 sigma^2)`` per order (infinite for sigma = 0)."""
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if noise_multiplier < 0:
        raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
    if steps == 0:
        return [0.0 for _ in orders]
    if noise_multiplier == 0:
        return [math.inf for _ in orders]
    return [steps * a / (2.0 * noise_multiplier ** 2) for a in orders]


def rdp_to_epsilon(orders: Sequence[float], rdp: Sequence[float], delta: float) -> tuple[float, float]:
    """``(epsilon, best order)`` of an RDP curve at ``delta`` (Balle et al. 2020, Thm. 21)."""
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if len(orders) != len(rdp):
        raise ValueError("orders and rdp must have the same length")
    best, best_order = math.inf, math.nan
    for a, r in zip(orders, rdp):
        if a <= 1 or not math.isfinite(r):
            continue
        eps = r + math.log((a - 1) / a) - (math.log(delta) + math.log(a)) / (a - 1)
        if eps < best:
            best, best_order = eps, a
    return best, best_order


@dataclass(kw_only=True)
class BorderAccountant:
    """The privacy a region has spent at its border: one entry per world round whose delta left it.

    ``history`` holds ``(noise_multiplier, releases)`` pairs; :meth:`epsilon` composes them. Its
    state is plain data (:meth:`state_dict` / :meth:`from_state`) for checkpoints.
    """

    delta: float
    history: list[tuple[float, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {self.delta}")

    def record(self, noise_multiplier: float, releases: int = 1) -> None:
        if self.history and self.history[-1][0] == noise_multiplier:
            self.history[-1] = (noise_multiplier, self.history[-1][1] + releases)
        else:
            self.history.append((float(noise_multiplier), int(releases)))

    @property
    def releases(self) -> int:
        return sum(n for _, n in self.history)

    def epsilon(self, orders: Sequence[float] = DEFAULT_ORDERS) -> float:
        """Epsilon spent so far at :attr:`delta` (0 before the first release, inf without noise)."""
        if not self.releases:
            return 0.0
        total = [0.0] * len(orders)
        for sigma, n in self.history:
            total = [t + r for t, r in zip(total, gaussian_rdp(sigma, n, orders))]
        return rdp_to_epsilon(orders, total, self.delta)[0]

    def state_dict(self) -> dict:
        return dict(delta=self.delta, history=[list(h) for h in self.history])

    @classmethod
    def from_state(cls, state: dict) -> "BorderAccountant":
        return cls(delta=float(state["delta"]), history=[(float(s), int(n)) for s, n in state["history"]])
