"""Robust aggregation of a group's vectors (pure: imports torch only).

hivemind's all-reduce computes ``sum_i w_i x_i / sum_i w_i`` and trusts every sender's weight and
values: one member that scales its payload, flips its sign or claims a weight of 1e9 moves the
region's agreed model wherever it likes, and one NaN fails every round. The rule here replaces that
mean, inside each reducer of the all-reduce (:mod:`worldlm_p2p.net.robust_allreduce`), in the
simulator and in the tests, through the same function:

**clipped mean around the coordinate-wise median** (``rule = "clip"``). For every coordinate ``j``
of the senders' vectors ``x_1..x_n`` (the senders whose vector is finite):

- the centre ``m_j`` is the (unweighted) median of ``x_1j..x_nj`` (the mean of the two middle
  values when ``n`` is even), so a weight claim cannot move it;
- the spread ``s_j`` is the median of ``|x_ij - m_j|`` over the senders;
- every value is clipped to ``[m_j - c s_j, m_j + c s_j]`` (``c = clip``);
- the result is the weighted mean of the clipped values, each weight capped at ``max_weight``
  (what one round's training can have produced: the tokens of H steps).

Properties (tested): with two senders, or any senders within ``c`` spreads of the centre, it is the
weighted mean exactly (``c >= 1``). For a minority of ``f < n / 2`` senders, whatever they send, the
centre lies between the honest values and the spread is at most the honest values' range, so every
clipped value lies within ``c + 1`` honest ranges of the honest values, and the result moves from
the honest senders' mean by at most ``(c + 1) * range_j * f_w`` on coordinate ``j`` (``f_w``: the
share of the weight the minority holds after the cap). A NaN or Inf value takes no part in its
coordinate (and names its sender). The rule is coordinate-wise, so it does not depend on how the all-reduce cuts the vector
into parts: the swarm's result equals this function on the whole vectors.

``rule = "mean"`` is the plain weighted mean (hivemind's), with the weight cap and the exclusion of
non-finite senders: the ablation.

The rule follows the spirit of CenteredClip (Karimireddy et al. 2021; used by BTARD, Gorbunov et
al., arXiv 2106.11257), clipping coordinate-wise instead of by norm so that the all-reduce's parts
need no common scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from worldlm_p2p.kinds import ROBUST_RULES, RobustRule

#: a sender is caught when more of its values than this lie beyond the clip (:func:`caught`)
CAUGHT_ABOVE = 0.5


@dataclass(frozen=True, slots=True)
class Aggregate:
    """The result of :func:`robust_mean`, and what it says of each sender.

    ``value``: the aggregate (float32, the shape of one sender's vector); ``nonfinite[i]``: the
    fraction of sender ``i``'s values that were NaN or Inf (each took no part in its coordinate; a
    non-finite weight makes it 1); ``clipped[i]``: the fraction of its values that were clipped;
    ``weights[i]``: the weight it was given (after the cap; 0 when its weight was not usable)."""

    value: torch.Tensor
    nonfinite: tuple[float, ...]
    clipped: tuple[float, ...]
    weights: tuple[float, ...]


def median_rows(x: torch.Tensor, count: torch.Tensor | None = None) -> torch.Tensor:
    """The median over dim 0 (the mean of the two middle values for an even count). With
    ``count`` (per column: how many leading values are real), ``x`` must hold NaN where a value is
    missing: NaN sorts last, so the median of column ``j`` is taken over its ``count[j]`` values."""
    n = x.shape[0]
    s = x.sort(dim=0).values
    if count is None:
        return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
    k = count.clamp(min=1).unsqueeze(0)
    lo = torch.gather(s, 0, (k - 1) // 2).squeeze(0)
    hi = torch.gather(s, 0, k // 2).squeeze(0)
    return (lo + hi) / 2


def robust_mean(values: torch.Tensor | Sequence[torch.Tensor], weights: Sequence[float], *,
                rule: RobustRule = "clip", clip: float = 4.0, max_weight: float | None = None) -> Aggregate:
    """Aggregate the rows of ``values`` (shape ``(senders, d)``, or one 1-D tensor per sender) with
    ``weights`` by ``rule`` (see the module docstring), coordinate by coordinate: a NaN or Inf value
    takes no part in its coordinate. Raises ``ValueError`` when a coordinate has no finite value."""
    x = values if isinstance(values, torch.Tensor) else torch.stack([v.reshape(-1) for v in values])
    if x.dim() != 2 or x.shape[0] != len(weights) or x.shape[0] == 0:
        raise ValueError(f"need values of shape (senders, d) with one weight per sender, got "
                         f"{tuple(x.shape)} and {len(weights)} weights")
    if rule not in ROBUST_RULES:
        raise ValueError(f"robust rule {rule!r} is not one of {ROBUST_RULES}")
    if not clip >= 1.0:
        raise ValueError(f"clip must be >= 1 (the spread of the centre's values), got {clip}")
    if max_weight is not None and not max_weight > 0:
        raise ValueError(f"max_weight must be > 0, got {max_weight}")
    n, d = x.shape
    x = x.detach().to(torch.float64)
    w = torch.as_tensor([float(v) for v in weights], dtype=torch.float64)
    usable = torch.isfinite(w) & (w >= 0)
    w = torch.where(usable, w, torch.zeros_like(w))
    if max_weight is not None:
        w = w.clamp(max=float(max_weight))
    if float(w[usable].sum()) <= 0:  # no positive weight: count the usable senders equally
        w = usable.to(torch.float64)
    ok = torch.isfinite(x) & usable.unsqueeze(1)  # (n, d): the values that take part
    count = ok.sum(dim=0)
    if d and bool((count == 0).any()):
        raise ValueError(f"{int((count == 0).sum())} coordinates have no finite value from any sender")
    xs = torch.where(ok, x, torch.full_like(x, float("nan")))
    clipped = torch.zeros(n, d, dtype=torch.bool)
    if rule == "clip" and n > 2:
        centre = median_rows(xs, count)
        spread = median_rows((xs - centre).abs(), count)
        lo, hi = centre - clip * spread, centre + clip * spread
        ys = torch.maximum(torch.minimum(xs, hi), lo)  # NaN stays NaN
        clipped = ok & (ys != xs) & (count > 2).unsqueeze(0)
        xs = torch.where(clipped, ys, xs)
    wm = w.unsqueeze(1) * ok
    total = wm.sum(dim=0)
    # a coordinate whose senders all weigh 0 (possible only when some weights are 0): equal weights
    wm = torch.where((total > 0).unsqueeze(0), wm, ok.to(torch.float64))
    value = (wm * torch.where(ok, xs, torch.zeros_like(xs))).sum(dim=0) / wm.sum(dim=0).clamp(min=1e-300)
    frac = (lambda m: tuple(float(v) for v in m.to(torch.float64).mean(dim=1))) if d else (lambda m: (0.0,) * n)
    return Aggregate(value=value.to(torch.float32), nonfinite=frac(~ok), clipped=frac(clipped),
                     weights=tuple(float(v) for v in w))


def robust_mean_of_lists(states: Sequence[Sequence[torch.Tensor]], weights: Sequence[float], *,
                         rule: RobustRule = "clip", clip: float = 4.0, max_weight: float | None = None
                         ) -> tuple[list[torch.Tensor], Aggregate]:
    """:func:`robust_mean` of several peers' tensor lists (``states[i][j]``: tensor ``j`` of peer
    ``i``), flattened and concatenated as the all-reduce sees them; the tensors come back in their
    shapes and dtypes."""
    if not states:
        raise ValueError("no states to aggregate")
    ref = states[0]
    for s in states:
        if len(s) != len(ref) or any(a.shape != b.shape for a, b in zip(s, ref)):
            raise ValueError("all peers must contribute tensors of the same shapes")
    flat = torch.stack([torch.cat([t.detach().reshape(-1).to(torch.float64) for t in s]) if s
                        else torch.zeros(0, dtype=torch.float64) for s in states])
    agg = robust_mean(flat, weights, rule=rule, clip=clip, max_weight=max_weight)
    out, offset = [], 0
    for t in ref:
        n = t.numel()
        out.append(agg.value[offset:offset + n].reshape(t.shape).to(t.dtype))
        offset += n
    return out, agg


def caught(agg: Aggregate, *, clipped_above: float = CAUGHT_ABOVE) -> dict[int, str]:
    """The senders this aggregate gives evidence against: sender index -> why. A sender is caught
    when its vector was not finite, or when more than ``clipped_above`` of its coordinates lay beyond
    the clip (an honest member lies beyond it on a minority of its coordinates: in a group of
    three, where one of them is far out on that coordinate; a scaled, sign-flipped or random vector on
    most)."""
    out = {}
    for i, (nf, cl) in enumerate(zip(agg.nonfinite, agg.clipped)):
        if nf > 0:
            out[i] = "sent NaN/Inf"
        elif cl > clipped_above:
            out[i] = f"{cl:.0%} of its values beyond the clip"
    return out
