"""A region round, as this peer takes part in it: a small state machine with named outcomes.

1. **barrier** (:func:`worldlm_p2p.net.barrier.wait_for_region`): wait until the region's live
   peers are ready for the same round; the outcome is :attr:`Outcome.STOPPED` (the peer is
   stopping), :attr:`Outcome.ALONE` (no other live peer: a region of one, see
   :meth:`RegionRound.alone`) or on to the all-reduce;
2. **average**: the member's payload (:func:`worldlm_p2p.rounds.region_payload`) of a snapshot of
   its model, weighted by the tokens it trained since the last round, all-reduced with the group;
   :func:`worldlm_p2p.rounds.region_step` turns the average into the region's agreed model and the
   member's next model. The average is refused when it is not finite or not usable: the outcome is
   then :attr:`Outcome.FAILED` and the member keeps its model;
3. **apply** (:attr:`Outcome.AVERAGED`): evidence mixing on the member's tune slice
   (:func:`worldlm_p2p.rounds.member_mix`), then the region's state takes the agreed model and the
   momentum, and the peer serves it.

Steps 2's computation reads only the snapshot and the region state it is given (so that it can
later run in the background while training goes on); only step 3 writes.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from worldlm_p2p import aggregation, rounds
from worldlm_p2p.config import AveragingConfig
from worldlm_p2p.net import barrier
from worldlm_p2p.net.averaging import RegionAverager, RoundResult

from worldlm_p2p.peer.events import EventLog
from worldlm_p2p.peer.member import Member
from worldlm_p2p.peer.serving import StateServer
from worldlm_p2p.peer.state import RegionState
from worldlm_p2p.peer.stats import PeerStats

logger = logging.getLogger(__name__)


class Outcome(enum.Enum):
    STOPPED = "stopped"  # the peer is stopping: no round
    ALONE = "alone"  # no other live peer in the region: a region round of one
    AVERAGED = "averaged"  # the group's average was taken
    FAILED = "failed"  # the all-reduce failed or its result was unusable: the member keeps its model


@dataclass(frozen=True, slots=True)
class Averaged:
    """The computation of step 2: the all-reduce's result and, when usable, what it means for this
    member (its next model before mixing, the region's agreed model, the outer momentum)."""

    result: RoundResult
    pre: list[torch.Tensor]
    anchor: list[torch.Tensor]
    weight: float
    new: list[torch.Tensor] | None = None
    agreed: list[torch.Tensor] | None = None
    momentum: list[torch.Tensor] | None = None


class RegionRound:
    def __init__(self, *, rule: rounds.RoundRule, averaging: AveragingConfig, averager: RegionAverager,
                 state: RegionState, stats: PeerStats, member: Member, server: StateServer, region: str, label: str,
                 started: float, payload_bytes: int, fetch_others: Callable[[], list], publish: Callable[[], None],
                 stopping: Callable[[], bool], trace: Callable[[str, dict], None],
                 before_average: Callable[[], None], on_averaged: Callable[[RoundResult], None],
                 on_alone: Callable[[bool], None], on_refresh: Callable[[int], None], events: EventLog,
                 admitted: Callable[[], set[str] | None] = lambda: None) -> None:
        """``before_average()``: world changes due are adopted there; ``on_averaged(result)``: counts
        the round towards world rounds; ``on_alone(no_live_peer)``: the region of one;
        ``on_refresh(missed)``: a peer that joined from the region's state finds the region ahead;
        ``admitted()``: the peers this one may average with (None: an open region)."""
        self.rule, self.averaging, self.averager = rule, averaging, averager
        self.state, self.stats, self.member, self.server = state, stats, member, server
        self.region, self.label, self.started, self.payload_bytes = region, label, started, payload_bytes
        self.fetch_others, self.publish, self.stopping, self.trace = fetch_others, publish, stopping, trace
        self.before_average, self.on_averaged, self.on_alone, self.on_refresh = (before_average, on_averaged,
                                                                                 on_alone, on_refresh)
        self.events, self.admitted = events, admitted
        self._was_alone = False

    def run(self) -> Outcome:
        s = self.stats

        def announce(r: int) -> None:
            s.waiting_for_round = r
            self.publish()

        decision = barrier.wait_for_region(my_round=s.round, fetch_others=self.fetch_others, announce=announce,
                                           timeout=self.averaging.barrier_timeout, should_stop=self.stopping)
        missed, s.round = decision.round - s.round, decision.round
        if (missed > 0 and s.rounds_completed == 0 and s.started_from == "region"
                and decision.action is not barrier.Action.ALONE and not self.stopping()):
            self.on_refresh(missed)
        if decision.action is barrier.Action.ALONE or self.stopping():
            outcome = Outcome.STOPPED if self.stopping() else Outcome.ALONE
            if outcome is Outcome.ALONE:
                level = logging.DEBUG if self._was_alone else logging.INFO
                logger.log(level, "round %d: no other live peer in region %s, training on locally", s.round,
                           self.region)
                self.on_alone(decision.live == 0)
            self._was_alone = True
            s.waiting_for_round = -1
            self.events.emit("round", round=s.round, outcome=outcome.value, group_size=1, seconds=0.0, step=s.step)
            s.round += 1
            return outcome
        self._was_alone = False
        self.before_average()
        averaged = self.average(self.member.params(), waiting=decision.waiting)
        outcome = self.apply(averaged)
        r = averaged.result
        self.events.emit("round", round=s.round, outcome=outcome.value, group_size=r.group_size,
                         seconds=round(r.seconds, 4), step=s.step, **({"error": r.error} if not r.ok else {}))
        s.round += 1
        s.waiting_for_round = -1
        self.publish()
        return outcome

    # ------------------------------------------------------------------ step 2: average
    def average(self, pre: list[torch.Tensor], *, waiting: int) -> Averaged:
        s, anchor = self.stats, self.state.anchor
        weight = aggregation.round_weight(s.tokens_since_round)
        payload = rounds.region_payload(self.rule, pre, anchor)
        self.averager.set_target_group_size(min(waiting + 1, self.averaging.target_group_size))
        admitted = self.admitted()
        if admitted is not None:  # an admitting region: only the members whose records the barrier admitted
            self.averager.set_admitted(admitted)
        result = self.averager.run_round(payload, weight=weight, gather=dict(
            label=self.label, weight=weight, tokens=s.tokens_since_round, round=s.round, world=s.world_round))
        if result.ok and not all(bool(torch.isfinite(t).all()) for t in result.averaged):
            result = dataclasses.replace(result, ok=False, averaged=None,
                                         error="the group's average is not finite (a peer sent NaN/inf)")
        if not result.ok:
            return Averaged(result=result, pre=pre, anchor=anchor, weight=weight)
        try:
            new, agreed, momentum = rounds.region_step(self.rule, result.averaged, params=pre, anchor=anchor,
                                                       momentum=self.state.momentum)
        except ValueError as e:  # e.g. a non-positive attention denominator from a corrupted part
            result = dataclasses.replace(result, ok=False, averaged=None, error=f"unusable average: {e}")
            return Averaged(result=result, pre=pre, anchor=anchor, weight=weight)
        return Averaged(result=result, pre=pre, anchor=anchor, weight=weight, new=new, agreed=agreed,
                        momentum=momentum)

    # ------------------------------------------------------------------ step 3: apply
    def apply(self, a: Averaged) -> Outcome:
        s, result = self.stats, a.result
        mix, new = None, a.new
        if result.ok and self.rule.evidence:
            new, mix = self.member.mix_safely(lambda: rounds.member_mix(self.rule, own=a.pre, agreed=a.agreed,
                                                                        loss_of=self.member.loss_of()), own=a.pre)
            self.member.record_mix("region", s.round, mix)
        if result.ok:
            self.state.momentum = a.momentum
            self.member.set(new)
            self.state.anchor = a.agreed
            sent, received = aggregation.allreduce_traffic(self.payload_bytes, result.group_size)
            s.count_round(group_size=result.group_size, seconds=result.seconds, sent=sent, received=received)
            if s.seconds_to_first_round is None:
                s.seconds_to_first_round = time.monotonic() - self.started
            self.server.publish(round_index=s.round + 1)
            worlds = {g.get("world") for g in result.gathered.values() if isinstance(g, dict)}
            if len(worlds) > 1:
                logger.warning("round %d: members had adopted different world rounds (%s); the group's average "
                               "mixes them", s.round, sorted(w for w in worlds if isinstance(w, int)))
            self.on_averaged(result)
            logger.info("round %d: averaged with %d peers in %.2fs (weight %.0f)", s.round, result.group_size,
                        result.seconds, a.weight)
        else:
            s.rounds_failed += 1
            logger.warning("round %d: all-reduce failed (%s); keeping the local model", s.round, result.error)
        self.trace(f"round-{s.round:05d}", dict(ok=result.ok, weight=a.weight, pre=a.pre, anchor=a.anchor,
                                                agreed=self.state.anchor if result.ok else None,
                                                mix_lam=mix.lam if mix is not None else None,
                                                gathered=result.gathered, post=self.member.params()))
        return Outcome.AVERAGED if result.ok else Outcome.FAILED


def gathered_tokens(result: RoundResult) -> float:
    """The tokens the group's members trained since the last round, from what they gathered."""
    return sum(float(g.get("tokens", 0)) for g in result.gathered.values() if isinstance(g, dict))

