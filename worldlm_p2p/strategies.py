"""The strategies as objects: what each one averages, where, and what crosses region borders
(imports the standard library only).

Every caller (the pure rounds of :mod:`worldlm_p2p.rounds`, the simulator, the peer, the world
exchange, the CLIs) asks a :class:`Strategy` what to do; no code outside this module compares a
strategy's name. ``shared/design/worldlm.md`` section 5 has the table this encodes:

============  ========  =====================  ===========  ============  ===========
strategy      group     key layers K           world        border DP     members mix
============  ========  =====================  ===========  ============  ===========
worldlm       region    attentive              residual     leaders       yes
fedavg        world     shared (part of B)     none         flat (sim)    no
hierfavg      region    shared (part of B)     mean         leaders       no
fedper        world     personal (never sent)  none         none          no
local         none      -                      none         none          no
centralized   (pooled)  -                      none         none          no
============  ========  =====================  ===========  ============  ===========

- **group**: where region rounds average: per region, in one world group of every peer, or never.
- **key layers**: ``shared``: K is part of the backbone B (the whole model is averaged);
  ``attentive``: K goes into the all-reduce encoded for WorldLM's attention
  (:mod:`worldlm_p2p.attention`); ``personal``: K stays with each peer, and the region model a
  member holds or exports is B with its own K.
- **world**: what leaders do in world rounds: ``mean``: adopt the world's mean of the whole model;
  ``residual``: WorldLM's exchange (the world's mean B and K by residual embeddings, or world
  attention over the whole model, :class:`worldlm_p2p.config.AggregationConfig.world_target`).
- **border DP**: where region-level DP applies (``privacy.border_*``): ``leaders``: a leader
  releases the region's clipped, noised change at each world round, in the swarm and in the
  simulator; ``flat``: the region's mean change leaves at every round of the single world group,
  the standard-FL baseline, which only the simulator runs (a swarm's fedavg group has no border
  to guard: every peer averages with every other).
- **members mix**: a member's model after a round is set by ``aggregation.mix`` (evidence, cosine
  or none); otherwise every member adopts the round's result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from worldlm_p2p.kinds import STRATEGY_NAMES, SWARM_STRATEGIES

Group = Literal["region", "world", "none"]
KeyRule = Literal["shared", "attentive", "personal"]
WorldRule = Literal["residual", "mean", "none"]
BorderDP = Literal["leaders", "flat", "none"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Strategy:
    """One strategy's behaviour (see the module's table)."""

    name: str
    group: Group
    key: KeyRule
    world: WorldRule
    border_dp: BorderDP
    mixes: bool = False
    pooled: bool = False  # one model on every peer's text (the simulator's centralized baseline)
    about: str = ""

    # -- the questions callers ask ------------------------------------------------------------
    @property
    def averages(self) -> bool:
        """True when peers take part in region rounds at all."""
        return self.group != "none"

    @property
    def in_swarm(self) -> bool:
        """True when a swarm can run it (the others are simulator baselines)."""
        return self.name in SWARM_STRATEGIES

    @property
    def world_group(self) -> bool:
        """True when region rounds span every peer of the run (one world group)."""
        return self.group == "world"

    @property
    def localises(self) -> bool:
        """True when K is handled apart from B (attentive or personal)."""
        return self.key != "shared"

    @property
    def attentive(self) -> bool:
        return self.key == "attentive"

    @property
    def personal_key(self) -> bool:
        return self.key == "personal"

    @property
    def has_world_rounds(self) -> bool:
        return self.world != "none"

    @property
    def residual_exchange(self) -> bool:
        """True when world rounds exchange residual embeddings between leaders (WorldLM)."""
        return self.world == "residual"

    def border_dp_in(self, where: Literal["swarm", "simulator"]) -> bool:
        """True when region-level DP can be applied to this strategy in a swarm or the simulator."""
        return self.border_dp == "leaders" or (self.border_dp == "flat" and where == "simulator")


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy(name="worldlm", group="region", key="attentive", world="residual", border_dp="leaders", mixes=True,
             about="region rounds average B by token-weighted mean and K by attention; leaders exchange B and "
                   "residual embeddings across regions"),
    Strategy(name="fedavg", group="world", key="shared", world="none", border_dp="flat",
             about="one world group averages the whole model"),
    Strategy(name="hierfavg", group="region", key="shared", world="mean", border_dp="leaders",
             about="region rounds average the whole model; leaders average it across regions"),
    Strategy(name="fedper", group="world", key="personal", world="none", border_dp="none",
             about="one world group averages B; K stays with each peer"),
    Strategy(name="local", group="none", key="shared", world="none", border_dp="none",
             about="every peer trains alone"),
    Strategy(name="centralized", group="none", key="shared", world="none", border_dp="none", pooled=True,
             about="one model on the pooled text of every peer (simulator only)"),
)}
assert tuple(STRATEGIES) == STRATEGY_NAMES


def strategy(name: str) -> Strategy:
    """The strategy called ``name`` (``ValueError`` naming the choices for any other)."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}: one of {', '.join(STRATEGIES)}") from None


def with_border_dp(where: Literal["swarm", "simulator"]) -> tuple[str, ...]:
    """The strategies that take region-level DP in a swarm or in the simulator."""
    return tuple(n for n, s in STRATEGIES.items() if s.border_dp_in(where))
