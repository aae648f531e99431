"""Evidence mixing: a member takes from its region and from the world only what lowers its loss on
a slice of its own training text held apart for this (pure: imports torch only).

After a round a member holds its own model ``theta`` and a candidate ``c`` (the region's agreed
model; the world's change of it). It keeps ``theta + lam * (c - theta)`` with ``lam`` in ``[0, 1]``
chosen by a line search on its *tune slice*, text it never trains on and is never evaluated on:

1. the loss of its own model, ``f(0)``, then of the mixes at the ``grid`` points (default 1/16, 1/4,
   1) in increasing order, stopping at the first point that is worse than the one before it (the
   minimum is then bracketed, taking the loss along the line to be unimodal);
2. where the best point lies between two others, the vertex of the parabola through the three is
   tried as well (one more evaluation);
3. the lowest loss wins; ``lam = 0`` (the member's own model, bit for bit) unless a mix is strictly
   better by more than ``margin`` nats and, with ``z > 0`` and per-window losses, its gain is
   significant: the mean of the paired per-window gains exceeds ``z`` standard errors
   (:func:`significant`). A slice of a few thousand tokens measures a gain of a few thousandths of a
   nat no better than noise; taken on such a gain, a change towards other languages can cost a
   member far more on text it has not seen (measured: the han region of the scripts corpus).

So a member with no useful partner gets its own model back and trains on as it would alone (on its
training text less the tune slice); one whose partners' models help takes as much of them as its
evidence supports. Repeated small
pulls towards a region model act like Ditto's proximal term (arXiv 2012.04221) and APFL's mixing
weight (arXiv 2003.13461), with the strength set by held-out evidence each round instead of a
tuned constant. The search costs 2 forward passes over the slice when even the smallest mix
does not help, at most ``len(grid) + 2``, and no communication.

:func:`mix_weights` is the same choice over several candidates at once (a greedy sequence of line
searches, best candidate first): weights over ``{own} + candidates`` that are non-negative and sum to
one, independent of the order in which the candidates are given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

DEFAULT_GRID = (1 / 16, 1 / 4, 1.0)

#: forward passes that training one token costs (a backward pass costs about two forward passes):
#: the unit in which :class:`EvidenceBudget` weighs the evidence's evaluations against training
TRAIN_PASSES = 3.0

#: what a loss function returns: the slice's mean loss, or its per-window losses (a 1-D tensor,
#: whose mean is the loss; a window is one evaluation sequence of the slice)
Loss = float | torch.Tensor


def mean_loss(value: Loss) -> float:
    """The mean of a :data:`Loss` (NaN for an empty tensor)."""
    if isinstance(value, torch.Tensor):
        return float(value.double().mean()) if value.numel() else math.nan
    return float(value)


def significant(own: Loss, other: Loss, *, z: float) -> bool:
    """True when ``other`` is better than ``own`` (lower mean loss) and, when both are per-window
    losses of the same windows and ``z > 0``, the mean paired gain ``own_i - other_i`` exceeds ``z``
    times its standard error (the sample standard deviation over the ``n`` windows over
    ``sqrt(n)``). With scalar losses, or a single window, only the mean decides."""
    if z < 0:
        raise ValueError(f"z must be >= 0, got {z}")
    gain = mean_loss(own) - mean_loss(other)
    if not gain > 0:
        return False
    if z == 0 or not (isinstance(own, torch.Tensor) and isinstance(other, torch.Tensor)):
        return True
    if own.shape != other.shape:
        raise ValueError(f"per-window losses of different shapes: {tuple(own.shape)} against {tuple(other.shape)}")
    d = own.double().flatten() - other.double().flatten()
    if d.numel() < 2:
        return True
    return gain > z * float(d.std(unbiased=True)) / math.sqrt(d.numel())


@dataclass(frozen=True, slots=True)
class MixChoice:
    """The outcome of one line search: the chosen ``lam``, its slice loss, the loss of the member's
    own model (``lam = 0``) and every ``(lam, loss)`` evaluated, in evaluation order."""

    lam: float
    loss: float
    own_loss: float
    evaluated: tuple[tuple[float, float], ...]
    #: with a mix by parts (:func:`mix_parts`): the second part's weight (``lam`` is the first's)
    second_lam: float | None = None
    #: True when the weights were not searched but reused from an earlier search (``fixed``: an
    #: :class:`EvidenceBudget` that said no search was due); ``loss`` and ``own_loss`` are then NaN
    reused: bool = False

    @property
    def gain(self) -> float:
        """Nats per token the mix saves on the slice (>= 0); NaN when the own model's loss is not
        finite (nothing to compare with)."""
        if not (math.isfinite(self.own_loss) and math.isfinite(self.loss)):
            return math.nan
        return self.own_loss - self.loss


def check_grid(grid: Sequence[float]) -> tuple[float, ...]:
    """The grid sorted, or ValueError when a point is outside ``(0, 1]`` or none is given."""
    pts = tuple(sorted({float(x) for x in grid}))
    if not pts or any(not (0.0 < x <= 1.0) or not math.isfinite(x) for x in pts):
        raise ValueError(f"mixing grid points must lie in (0, 1], got {tuple(grid)}")
    return pts


def _vertex(x: Sequence[float], y: Sequence[float]) -> float | None:
    """The minimiser of the parabola through three points, or None when it is not convex."""
    (x0, x1, x2), (y0, y1, y2) = x, y
    den = (x0 - x1) * (x0 - x2) * (x1 - x2)
    if den == 0:
        return None
    a = (x2 * (y1 - y0) + x1 * (y0 - y2) + x0 * (y2 - y1)) / den
    b = (x2 ** 2 * (y0 - y1) + x1 ** 2 * (y2 - y0) + x0 ** 2 * (y1 - y2)) / den
    if not a > 0:
        return None
    return min(max(-b / (2 * a), x0), x2)


def line_search(loss_at: Callable[[float], Loss], *, grid: Sequence[float] = DEFAULT_GRID,
                margin: float = 0.0, own_loss: Loss | None = None, z: float = 0.0,
                fixed: float | None = None) -> MixChoice:
    """Choose ``lam`` in ``[0, 1]`` minimising ``loss_at(lam)`` (see the module docstring).

    ``fixed``: no search; ``lam = fixed`` (an earlier search's weight, reused), nothing evaluated,
    the choice marked ``reused`` with NaN losses.

    ``loss_at(0.0)`` must be the member's own model; ``own_loss``, when given, is its value already
    known (it is not evaluated again, unless the significance test needs per-window losses and it
    is a mean). ``loss_at`` may return means or per-window losses (:data:`Loss`); the search
    compares means, and ``z > 0`` adds the significance test of the winner against the own model
    (:func:`significant`). A non-finite loss counts as infinitely bad, so a candidate that makes the
    model diverge is never taken."""
    grid_pts = check_grid(grid)
    if fixed is not None:
        return reused_choice(fixed)
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    if z < 0:
        raise ValueError(f"z must be >= 0, got {z}")
    raw: dict[float, Loss] = {}

    def f(lam: float) -> float:
        value = loss_at(lam)
        raw[lam] = value
        m = mean_loss(value)
        return m if math.isfinite(m) else math.inf

    known = own_loss is not None and math.isfinite(mean_loss(own_loss)) and not (
        z > 0 and not isinstance(own_loss, torch.Tensor))
    if known:
        raw[0.0] = own_loss
    pts = [0.0]
    ys = [mean_loss(own_loss) if known else f(0.0)]
    evaluated = [] if known else [(0.0, ys[0])]
    for x in grid_pts:
        pts.append(x)
        ys.append(f(x))
        evaluated.append((x, ys[-1]))
        if ys[-1] > ys[-2]:  # the minimum is bracketed
            break
    own = ys[0]
    i = min(range(len(pts)), key=lambda k: (ys[k], pts[k]))  # ties: the smaller mix
    best, best_y = pts[i], ys[i]
    if 0 < i < len(pts) - 1 and all(math.isfinite(v) for v in ys[i - 1:i + 2]):
        v = _vertex(pts[i - 1:i + 2], ys[i - 1:i + 2])
        if v is not None and v not in pts:
            yv = f(v)
            evaluated.append((v, yv))
            if yv < best_y:
                best, best_y = v, yv
    if not math.isfinite(own):  # the own model is broken: anything finite is better
        pass
    elif best > 0 and not (best_y < own - margin and significant(raw[0.0], raw[best], z=z)):
        best, best_y = 0.0, own
    return MixChoice(lam=best, loss=best_y, own_loss=own, evaluated=tuple(evaluated))


def reused_choice(lam: float, second_lam: float | None = None) -> MixChoice:
    """The choice of a mix whose weights were reused, not searched (ValueError outside ``[0, 1]``)."""
    for x in (lam, second_lam):
        if x is not None and not (0.0 <= float(x) <= 1.0):
            raise ValueError(f"a reused mixing weight must lie in [0, 1], got {x}")
    return MixChoice(lam=float(lam), loss=math.nan, own_loss=math.nan, evaluated=(),
                     second_lam=None if second_lam is None else float(second_lam), reused=True)


def interpolate(own: Sequence[torch.Tensor], target: Sequence[torch.Tensor], lam: float) -> list[torch.Tensor]:
    """``own + lam * (target - own)`` per tensor (computed in float64, cast back to own's dtype);
    ``lam = 0`` returns copies of ``own`` exactly."""
    if len(own) != len(target):
        raise ValueError(f"interpolate: {len(own)} tensors against {len(target)}")
    out = []
    for i, (a, b) in enumerate(zip(own, target)):
        if a.shape != b.shape:
            raise ValueError(f"interpolate: tensor {i} has shape {tuple(a.shape)} against {tuple(b.shape)}")
        if lam == 0.0:
            out.append(a.detach().clone())
        else:
            a64 = a.detach().to(torch.float64)
            out.append((a64 + lam * (b.detach().to(torch.float64) - a64)).to(a.dtype))
    return out


def shift(own: Sequence[torch.Tensor], change: Sequence[torch.Tensor], lam: float) -> list[torch.Tensor]:
    """``own + lam * change`` per tensor (a fraction of a change made elsewhere, e.g. by a world round)."""
    if len(own) != len(change):
        raise ValueError(f"shift: {len(own)} tensors against {len(change)}")
    out = []
    for i, (a, d) in enumerate(zip(own, change)):
        if a.shape != d.shape:
            raise ValueError(f"shift: tensor {i} has shape {tuple(a.shape)} against {tuple(d.shape)}")
        out.append(a.detach().clone() if lam == 0.0 else
                   (a.detach().to(torch.float64) + lam * d.detach().to(torch.float64)).to(a.dtype))
    return out


def mix_toward(own: Sequence[torch.Tensor], target: Sequence[torch.Tensor],
               loss_of: Callable[[list[torch.Tensor]], Loss], *, grid: Sequence[float] = DEFAULT_GRID,
               margin: float = 0.0, own_loss: Loss | None = None, z: float = 0.0, fixed: float | None = None
               ) -> tuple[list[torch.Tensor], MixChoice]:
    """The member's next model ``own + lam * (target - own)`` with ``lam`` from :func:`line_search`
    of ``loss_of`` (the slice loss of a parameter list), and the choice (``fixed``: that ``lam``,
    no search)."""
    choice = line_search(lambda lam: loss_of(interpolate(own, target, lam)), grid=grid, margin=margin,
                         own_loss=own_loss, z=z, fixed=fixed)
    return interpolate(own, target, choice.lam), choice


def mix_change(own: Sequence[torch.Tensor], change: Sequence[torch.Tensor],
               loss_of: Callable[[list[torch.Tensor]], Loss], *, grid: Sequence[float] = DEFAULT_GRID,
               margin: float = 0.0, own_loss: Loss | None = None, z: float = 0.0, fixed: float | None = None
               ) -> tuple[list[torch.Tensor], MixChoice]:
    """The member's next model ``own + lam * change`` with ``lam`` from :func:`line_search`
    (``fixed``: that ``lam``, no search)."""
    choice = line_search(lambda lam: loss_of(shift(own, change, lam)), grid=grid, margin=margin, own_loss=own_loss,
                         z=z, fixed=fixed)
    return shift(own, change, choice.lam), choice


def mix_parts(own: Sequence[torch.Tensor], steps: Sequence[Sequence[torch.Tensor]],
              loss_of: Callable[[list[torch.Tensor]], Loss], *, grids: Sequence[Sequence[float]],
              margin: float = 0.0, own_loss: Loss | None = None, z: float = 0.0,
              fixed: tuple[float, float] | None = None) -> tuple[list[torch.Tensor], MixChoice]:
    """The member's next model ``own + lam_1 * step_1 + lam_2 * step_2``, the weights chosen one after
    the other by :func:`line_search` (``lam_2`` from the model ``lam_1`` gave), each on its own
    ``grids[i]``; the steps are changes of disjoint parts of the model (say the backbone's and the
    key layers', the rest of each step zero), so a part that does not help is left as it is while
    another is taken. The choice: ``lam`` the first weight, ``second_lam`` the second, ``own_loss``
    the own model's and ``loss`` the final mix's slice loss, ``evaluated`` both searches' points.
    ``fixed``: the two weights, reused (no search)."""
    if len(steps) != 2 or len(grids) != 2:
        raise ValueError(f"mix_parts takes two steps and two grids, got {len(steps)} and {len(grids)}")
    if fixed is not None:
        choice = reused_choice(*fixed)
        return shift(shift(own, steps[0], choice.lam), steps[1], choice.second_lam), choice
    first_model, first = mix_change(own, steps[0], loss_of, grid=grids[0], margin=margin, own_loss=own_loss, z=z)
    # the first search's best loss is the second's starting point (a mean: with z > 0 the second
    # search evaluates its own per-window losses again)
    start = first.loss if z == 0 and math.isfinite(first.loss) else None
    model, second = mix_change(first_model, steps[1], loss_of, grid=grids[1], margin=margin, own_loss=start, z=z)
    return model, MixChoice(lam=first.lam, loss=second.loss, own_loss=first.own_loss,
                            evaluated=first.evaluated + second.evaluated, second_lam=second.lam)


def mix_weights(own: Sequence[torch.Tensor], candidates: Mapping[str, Sequence[torch.Tensor]],
                loss_of: Callable[[list[torch.Tensor]], Loss], *, grid: Sequence[float] = DEFAULT_GRID,
                margin: float = 0.0, z: float = 0.0) -> tuple[list[torch.Tensor], dict[str, float]]:
    """Weights over ``{"own"} + candidates`` (non-negative, summing to one) and the mixed model.

    Candidates are visited best first (by their own slice loss, then by name, so the result does not
    depend on the order they are given in); each is mixed in by a line search from the current mix,
    and the weights of what was mixed before shrink by ``1 - lam``. With no candidate that lowers
    the slice loss the member's own model comes back unchanged with weight 1. Like every search
    here it leaves the last parameters tried wherever ``loss_of`` loads them: the caller sets the
    model it settles on."""
    if "own" in candidates:
        raise ValueError("'own' is reserved for the member's own model")
    order = sorted(candidates, key=lambda name: (_finite_or_inf(mean_loss(loss_of([t.detach() for t in candidates[name]]))),
                                                 name))
    weights = {"own": 1.0, **{name: 0.0 for name in sorted(candidates)}}
    current = [t.detach().clone() for t in own]
    for name in order:
        current, choice = mix_toward(current, candidates[name], loss_of, grid=grid, margin=margin, z=z)
        if choice.lam > 0:
            for k in weights:
                weights[k] *= 1.0 - choice.lam
            weights[name] += choice.lam
    return current, weights


def _finite_or_inf(x: float) -> float:
    x = float(x)
    return x if math.isfinite(x) else math.inf


class EvidenceBudget:
    """How much of a member's compute its evidence searches may take (``aggregation.evidence_share``).

    A search evaluates the member's tune slice a few times (:func:`line_search`: 2 to
    ``len(grid) + 2`` forward passes over it), whatever the member trained since the last one: at a
    small H, or with a slice large against a round's batches, the evidence costs as much as training
    (``benchmarks/RESULTS.md``, issue 14). With ``share > 0`` a search of one *kind* (a member's
    region, world or personal mix) is *due* only while the slice tokens
    that kind evaluated so far (:meth:`charge`) are at most ``share`` times the forward passes of the
    member's training so far (``TRAIN_PASSES x models x trained tokens``, ``models`` the models it
    trains per token: 2 with a personal model apart); when none is due the member reuses that kind's
    last weights (``fixed`` in :func:`line_search`). (A leader's residual step, once per world
    round, is charged to its own account, ``"leader"``, and always made.) Each kind keeps its own account, so that one
    kind's searches never starve another's (the personal mix, which makes the model a member holds,
    comes after the region's in a round), and over a run each kind costs about ``share`` of training
    with its weights refreshed as often as that allows: a slowly updated mixing weight, as in APFL
    (arXiv 2003.13461). ``share = 0``: every search is due (the default). Deterministic: a function of
    the tokens trained and the slice tokens evaluated."""

    def __init__(self, *, share: float, models: int = 1) -> None:
        if not (math.isfinite(share) and share >= 0):
            raise ValueError(f"evidence share must be a finite number >= 0, got {share}")
        if models < 1:
            raise ValueError(f"models must be >= 1, got {models}")
        self.share, self.models = float(share), int(models)
        self.spent: dict[str, float] = {}  # kind -> slice tokens its searches evaluated
        self._last: dict[str, MixChoice] = {}  # kind -> its last searched choice

    @property
    def total(self) -> float:
        """Slice tokens evaluated by every kind together."""
        return sum(self.spent.values())

    def allowance(self, trained_tokens: float) -> float:
        """The slice tokens one kind may have evaluated after ``trained_tokens`` of training."""
        return self.share * TRAIN_PASSES * self.models * float(trained_tokens)

    def due(self, kind: str, trained_tokens: float) -> bool:
        """Whether a search of ``kind`` may run now (always with ``share = 0``)."""
        return self.share == 0 or self.spent.get(kind, 0.0) <= self.allowance(trained_tokens)

    def reuse(self, kind: str, trained_tokens: float) -> MixChoice | None:
        """The last searched choice of this ``kind`` to take again instead of a search, or None when a
        search is due now or none was made yet."""
        last = self._last.get(kind)
        if last is None or self.due(kind, trained_tokens):
            return None
        return last

    def remember(self, kind: str, choice: MixChoice | None) -> None:
        """Keep ``choice`` as this kind's last search (a choice that evaluated nothing is not one)."""
        if choice is not None and choice.evaluated and not choice.reused:
            self._last[kind] = choice

    def charge(self, kind: str, tokens: float) -> None:
        """Count one evaluation of ``tokens`` slice tokens by a search of ``kind``."""
        self.spent[kind] = self.spent.get(kind, 0.0) + float(tokens)

    def state_dict(self) -> dict[str, Any]:
        """The accounts and the last searched weights, as plain numbers (a peer's checkpoint keeps them,
        so that a resumed member neither searches again at once nor starts a new account)."""
        return {"spent": dict(self.spent),
                "last": {k: [c.lam, c.second_lam] for k, c in self._last.items()}}

    def load_state_dict(self, state: Any) -> None:
        """Restore :meth:`state_dict`'s output (ValueError, saying why, for anything else; nothing is
        changed then)."""
        if not isinstance(state, Mapping) or not isinstance(state.get("spent"), Mapping) or not isinstance(
                state.get("last"), Mapping):
            raise ValueError("evidence budget state must be a mapping with 'spent' and 'last' mappings")
        spent: dict[str, float] = {}
        for kind, v in state["spent"].items():
            if not isinstance(kind, str) or isinstance(v, bool) or not isinstance(v, (int, float)) or not (
                    math.isfinite(v) and v >= 0):
                raise ValueError(f"evidence budget: spent[{kind!r}] = {v!r} is not a finite count >= 0")
            spent[kind] = float(v)
        last: dict[str, MixChoice] = {}
        for kind, v in state["last"].items():
            if not isinstance(kind, str) or not isinstance(v, (list, tuple)) or len(v) != 2:
                raise ValueError(f"evidence budget: last[{kind!r}] = {v!r} is not [lam, second_lam]")
            lam, second = v
            ok = lambda x: not isinstance(x, bool) and isinstance(x, (int, float)) and 0.0 <= x <= 1.0  # noqa: E731
            if not ok(lam) or not (second is None or ok(second)):
                raise ValueError(f"evidence budget: last[{kind!r}] = {v!r} holds a weight outside [0, 1]")
            last[kind] = MixChoice(lam=float(lam), loss=math.nan, own_loss=math.nan, evaluated=(),
                                   second_lam=None if second is None else float(second))
        self.spent, self._last = spent, last

    def counting(self, loss_of: Callable[[list[torch.Tensor]], Loss] | None, tokens: int, kind: str
                 ) -> Callable[[list[torch.Tensor]], Loss] | None:
        """``loss_of`` that charges ``tokens`` to ``kind`` per call (None stays None)."""
        if loss_of is None:
            return None

        def counted(params: list[torch.Tensor]) -> Loss:
            self.charge(kind, tokens)
            return loss_of(params)

        return counted
