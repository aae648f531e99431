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
   Every reducer of the all-reduce applies the run's robust rule (:mod:`worldlm_p2p.robust`); the
   senders this peer's reducer caught, and the reducers that failed it, are named in the log and
   the event log, and a peer caught in ``averaging.ban_after`` rounds is banned (:class:`Strikes`):
   never averaged with, waited for or served again;
3. **apply** (:attr:`Outcome.AVERAGED`): evidence mixing on the member's tune slice
   (:func:`worldlm_p2p.rounds.member_mix`), then the region's state takes the agreed model and the
   momentum, and the peer serves it.

Steps 1 and 2 read only the snapshot and the region state (:meth:`RegionRound._fly`); only step 3
writes the model (:meth:`RegionRound._conclude`). A synchronous round runs them in turn
(:meth:`RegionRound.run`); with ``aggregation.overlap`` steps 1 and 2 run in a background thread
while the next H inner steps train (:meth:`RegionRound.start`), and step 3 applies the result at the
next round, one round stale (:meth:`RegionRound.finish`, :func:`worldlm_p2p.rounds.stale_apply`).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from worldlm_p2p import aggregation, rounds
from worldlm_p2p.codec import state_digest
from worldlm_p2p.config import AveragingConfig
from worldlm_p2p.net import barrier, priority
from worldlm_p2p.net.averaging import RegionAverager, RoundResult, is_relay_gather

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
    PARTIAL = "partial"  # taken, but the round lost a part (a member that waited was not in the group, or a
    #                      sender's part was dropped by this peer's reducer): counted apart from complete rounds
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
    #: with ``region_backbone = "partners"``: the member's candidate backbones (the region's, and its
    #: pair with each mate that served what it sent; :func:`worldlm_p2p.rounds.partner_candidates`)
    candidates: dict[str, list[torch.Tensor]] | None = None
    #: mates whose served contribution was not what they sent into the round (peer id -> why)
    served_wrong: dict[str, str] = dataclasses.field(default_factory=dict)
    #: whether what the mates served gave the round's average (:meth:`RegionRound.check_average`):
    #: "agrees", "differs", or "" (not told)
    served_average: str = ""


@dataclass(slots=True)
class _Flight:
    """One round between its snapshot and its conclusion: the snapshot ``pre`` and the tokens
    trained up to it; what the barrier decided, the average, or the error that stopped it."""

    pre: list[torch.Tensor] | None  # (None: a synchronous round, taken after the barrier)
    tokens: int
    thread: threading.Thread | None = None
    decision: barrier.Decision | None = None
    averaged: Averaged | None = None
    error: str = ""
    # an overlapped round's evidence search, made in its thread on a copy of the model: the tune-slice
    # loss it uses, and what it chose (next model, choice)
    loss_of: Callable | None = None
    mixed: tuple | None = None
    # the member's last region choice to take again, when its evidence budget had no search due at
    # the snapshot (aggregation.evidence_share)
    reuse: Any = None
    # the CPU priority (nice value) of the thread that ran the round's network part (the audit trail)
    nice: int | None = None


class Strikes:
    """Rounds in which each peer was caught (by this peer's reducer, or as a reducer that failed
    it), and the peers banned after ``ban_after`` of them."""

    def __init__(self, *, ban_after: int, banned: set[str] | None = None) -> None:
        self.ban_after = ban_after
        self.counts: dict[str, int] = {}
        self.banned: set[str] = banned if banned is not None else set()

    def record(self, offenders: set[str]) -> list[str]:
        """Count one round against each of ``offenders``; return the ones banned by it."""
        newly = []
        for p in sorted(offenders - self.banned):
            self.counts[p] = self.counts.get(p, 0) + 1
            if self.counts[p] >= self.ban_after:
                self.banned.add(p)
                newly.append(p)
        return newly


class RegionRound:
    def __init__(self, *, rule: rounds.RoundRule, averaging: AveragingConfig, averager: RegionAverager,
                 state: RegionState, stats: PeerStats, member: Member, server: StateServer, region: str, label: str,
                 started: float, payload_bytes: int, fetch_others: Callable[[], list], publish: Callable[[], None],
                 stopping: Callable[[], bool], trace: Callable[[str, dict], None],
                 before_average: Callable[[], None], on_averaged: Callable[[RoundResult], None],
                 on_alone: Callable[[bool], None], on_refresh: Callable[[int, str], None], events: EventLog,
                 admitted: Callable[[], set[str] | None] = lambda: None, banned: set[str] | None = None,
                 outbound: bool = False, in_flight_fetch: Callable[[], None] = lambda: None,
                 relays: Callable[[], list[str]] = lambda: [], background_nice: int = 0) -> None:
        """``before_average()``: world changes due are adopted there (main thread);
        ``in_flight_fetch()``: on the round's network path, before the barrier (a world change the
        leader announced is downloaded there); ``on_averaged(result)``: counts
        the round towards world rounds; ``on_alone(no_live_peer)``: the region of one;
        ``on_refresh(missed, why)``: this peer's anchor may be stale (the region went ``missed``
        rounds ahead of it, or its last round failed here while others may have taken theirs): it
        takes the region's current agreed model as its reference again, keeping its own model;
        ``admitted()``: the peers this one may average with (None: an open region); ``banned``: the
        set of banned peers, which this round adds to (shared with the barrier's record reader);
        ``outbound``: this peer is outbound-only (a round needs a member others can dial, or a relay:
        ``relays()``, the endorsed relays that serve the region now, :mod:`worldlm_p2p.peer.relay`);
        ``background_nice``: an overlapped round's thread runs at this nice value
        (:mod:`worldlm_p2p.net.priority`; a synchronous round runs in the training thread, as it is)."""
        self.rule, self.averaging, self.averager = rule, averaging, averager
        self.state, self.stats, self.member, self.server = state, stats, member, server
        self.region, self.label, self.started, self.payload_bytes = region, label, started, payload_bytes
        self.fetch_others, self.publish, self.stopping, self.trace = fetch_others, publish, stopping, trace
        self.before_average, self.on_averaged, self.on_alone, self.on_refresh = (before_average, on_averaged,
                                                                                 on_alone, on_refresh)
        self.events, self.admitted, self.outbound = events, admitted, outbound
        self.strikes = Strikes(ban_after=averaging.ban_after, banned=banned)
        self._was_alone = False
        self._failed_last = False  # the last round failed here: the others may hold a newer anchor
        self._flight: _Flight | None = None  # an overlapped round in the background
        self._concluding = False  # inside _conclude: the round's index is not counted past yet
        self.in_flight_fetch = in_flight_fetch
        self.relays = relays
        self.background_nice = background_nice

    def run(self) -> Outcome:
        """A synchronous round: training waits for it (``aggregation.overlap`` off)."""
        self.stats.round_entry_tokens = self.stats.tokens
        flight = _Flight(pre=None, tokens=int(self.stats.tokens_since_round))  # snapshot after the barrier
        self._fly(flight)
        return self._conclude(flight)

    def start(self) -> None:
        """An overlapped round (``aggregation.overlap``): apply the round in flight, if any (waiting
        for it only if it is not done yet), adopt a world change due, then start this round on a
        snapshot of the model in a background thread and return: training goes on meanwhile."""
        self.finish()
        self.before_average()
        self.stats.round_entry_tokens = self.stats.tokens
        flight = self._snapshot()
        flight.loss_of = self.member.background_loss_of() if self.rule.evidence else None
        flight.reuse = self.member.reuse_for("region") if self.rule.evidence else None
        flight.thread = threading.Thread(target=self._fly_in_background, args=(flight,),
                                         name=f"region-round-{self.stats.round}",
                                         daemon=True)
        self._flight = flight
        flight.thread.start()

    def _fly_in_background(self, flight: _Flight) -> None:
        priority.lower_this_thread(self.background_nice)
        self._fly(flight)

    def finish(self) -> Outcome | None:
        """Wait for the round in flight and apply it, one round stale: its result for the snapshot
        plus the local progress made since (:func:`worldlm_p2p.rounds.stale_apply`). None: no round
        was in flight."""
        flight, self._flight = self._flight, None
        if flight is None:
            return None
        if flight.thread is not None:
            flight.thread.join()
        return self._conclude(flight)

    def abandon(self, *, timeout: float) -> None:
        """On shutdown: wait (at most ``timeout`` seconds) for a round in flight to see the stop,
        without applying it."""
        flight, self._flight = self._flight, None
        if flight is not None and flight.thread is not None:
            flight.thread.join(timeout=timeout)

    @property
    def in_flight(self) -> bool:
        return self._flight is not None

    @property
    def landed(self) -> bool:
        """No round is in flight, or the one in flight has finished its network part (applying it
        then waits for nothing)."""
        flight = self._flight
        return flight is None or flight.thread is None or not flight.thread.is_alive()

    @property
    def next_round(self) -> int:
        """The index of the round this peer enters next: one past a round in flight, or past the
        round being concluded (whose callbacks may ask)."""
        return self.stats.round + (1 if self.in_flight or self._concluding else 0)

    def _snapshot(self) -> "_Flight":
        return _Flight(pre=self.member.params(), tokens=int(self.stats.tokens_since_round))

    def _fly(self, flight: "_Flight") -> None:
        """Steps 1 and 2 (barrier, average), on the snapshot only: inline for a synchronous round, in
        a background thread for an overlapped one. It writes the flight, the round index and, on a
        stale anchor, the region state's anchor (:func:`worldlm_p2p.peer.joining.resync_anchor`:
        the model is not touched); everything else waits for :meth:`_conclude`."""
        try:
            s = self.stats
            flight.nice = priority.thread_nice()
            self.in_flight_fetch()

            def announce(r: int) -> None:
                s.waiting_for_round = r
                self.publish()

            decision = barrier.wait_for_region(my_round=s.round, fetch_others=self.fetch_others, announce=announce,
                                               timeout=self.averaging.barrier_timeout, should_stop=self.stopping,
                                               outbound=self.outbound, relayed=lambda: bool(self.relays()))
            flight.decision = decision
            missed, s.round = decision.round - s.round, decision.round
            if (missed > 0 or self._failed_last) and decision.action is not barrier.Action.ALONE \
                    and not self.stopping():
                # every member of a round must hold the same anchor (the reference of the K attention,
                # of the outer step and of the pure round); a peer that the region went ahead of, or
                # whose last round failed on its side only, takes the region's current one
                self.on_refresh(missed, "the region went ahead" if missed > 0 else "its last round failed here")
                self._failed_last = False
            if decision.action is barrier.Action.ALONE or self.stopping():
                return
            if flight.pre is None:  # a synchronous round: world changes due now, then the snapshot
                self.before_average()
                flight.pre = self.member.params()
            flight.averaged = a = self.average(flight.pre, waiting=decision.waiting, tokens=flight.tokens,
                                               relay=decision.relay)
            if flight.loss_of is not None and a.result.ok and not self.stopping():
                # the member's evidence search, here on a copy of the model while training goes on
                # (a failure leaves it to the conclusion, in the training thread)
                try:
                    target, partner = self.partner_target(a, loss_of=flight.loss_of, reuse=flight.reuse)
                    flight.mixed = rounds.member_mix(self.rule, own=a.pre, agreed=target, loss_of=flight.loss_of,
                                                     reuse=flight.reuse) + (partner,)
                except Exception as e:
                    logger.debug("round %d: background evidence search failed: %s: %s", self.stats.round,
                                 type(e).__name__, e)
        except Exception as e:  # never kill the peer for a round: it counts as failed
            logger.warning("round %d: %s: %s", self.stats.round, type(e).__name__, e)
            flight.error = f"{type(e).__name__}: {e}"

    def _conclude(self, flight: "_Flight") -> Outcome:
        """Step 3 and the round's books, in the main thread (it sets the model)."""
        self._concluding = True
        try:
            return self._conclude_round(flight)
        finally:
            self._concluding = False

    def _conclude_round(self, flight: "_Flight") -> Outcome:
        s, decision = self.stats, flight.decision
        if flight.averaged is None and (decision is None or decision.action is barrier.Action.ALONE
                                        or self.stopping()):
            outcome = Outcome.STOPPED if self.stopping() or decision is None else Outcome.ALONE
            if flight.error and not self.stopping():
                outcome = Outcome.FAILED
                s.rounds_failed += 1
                self._failed_last = True
            if outcome is Outcome.ALONE:
                level = logging.DEBUG if self._was_alone else logging.INFO
                if decision.live:  # (an outbound-only peer whose live region mates are all outbound-only too)
                    logger.log(level if self._was_alone else logging.WARNING,
                               "round %d: none of the %d live peers of region %s can be dialled (all outbound-only), "
                               "so nobody can reduce a round: training on locally until a reachable peer joins or the run "
                               "offers a relay (worldlm-bootstrap --relay)",
                               s.round, decision.live, self.region)
                else:
                    logger.log(level, "round %d: no other live peer in region %s, training on locally", s.round,
                               self.region)
                self.on_alone(decision.live == 0)
                self._was_alone = True
            s.waiting_for_round = -1
            self.events.emit("round", round=s.round, outcome=outcome.value, group_size=1, seconds=0.0, step=s.step,
                             **({"error": flight.error} if flight.error else {}))
            s.round += 1
            return outcome
        self._was_alone = False
        averaged = flight.averaged
        if averaged is None:  # the round failed between the barrier and the average
            pre = flight.pre if flight.pre is not None else self.member.params()
            averaged = Averaged(result=RoundResult(ok=False, group_size=0, gathered={}, averaged=None,
                                                   error=flight.error), pre=pre, anchor=self.state.anchor,
                                weight=0.0)
        self.judge(averaged.result, served_wrong=averaged.served_wrong)
        since = s.tokens_since_round - flight.tokens  # trained while the round was in flight
        outcome = self.apply(averaged, expected=decision.waiting + 1 if decision is not None else None,
                             current=self.member.params() if flight.thread is not None else None,
                             mixed=flight.mixed, nice=flight.nice)
        if averaged.result.ok:
            s.tokens_since_round = since
        self._failed_last = outcome is Outcome.FAILED
        r = averaged.result
        self.events.emit("round", round=s.round, outcome=outcome.value, group_size=r.group_size,
                         seconds=round(r.seconds, 4), step=s.step,
                         expected=decision.waiting + 1 if decision is not None else None,
                         **({"error": r.error} if not r.ok else {}),
                         **({"dropped": list(r.report.dropped)} if r.report.dropped else {}))
        s.round += 1
        s.waiting_for_round = -1
        self.publish()
        return outcome

    # ------------------------------------------------------------------ step 2: average
    def average(self, pre: list[torch.Tensor], *, waiting: int, tokens: int | None = None,
                relay: bool = False) -> Averaged:
        """``tokens``: what the member trained up to the snapshot ``pre`` (default: up to now);
        ``relay``: every member is outbound-only, the group holds the region's relay too."""
        s, anchor = self.stats, self.state.anchor
        tokens = s.tokens_since_round if tokens is None else tokens
        weight = aggregation.round_weight(tokens)
        payload = rounds.region_payload(self.rule, pre, anchor, usage=self.member.usage)
        relays = self.relays() if relay else []  # (an admitting region admits them too)
        self.averager.set_target_group_size(min(waiting + 1, self.averaging.target_group_size) + (1 if relays else 0))
        admitted = self.admitted()
        if admitted is not None:  # an admitting region: only the members whose records the barrier admitted
            self.averager.set_admitted(admitted)
        digest = state_digest(anchor)
        sent = None
        if self.rule.backbone_partners:  # serve what this member sends, before any mate can ask for it
            sent = rounds.sent_backbone(self.rule, payload)
            codecs = rounds.payload_codecs(self.rule, payload)
            self.averager.set_contribution(round_index=s.round, anchor=digest, tensors=[
                t.to(torch.float16) if c == "fp16" else t for t, c in zip(sent, codecs)])
        result = self.averager.run_round(payload, weight=weight, gather=dict(
            label=self.label, weight=weight, tokens=tokens, round=s.round, world=s.world_round,
            change=self.state.change.world_round if self.state.change is not None else -1, expected=waiting + 1,
            outbound=self.outbound, anchor=digest))
        if result.ok and (why := anchor_disagreement(result.gathered, digest)):
            # the payload is each member's change since its anchor: this member applies the group's
            # average to its own anchor, so one whose anchor is not the group's drops the round and
            # takes the region's again (the others apply it: for them it is the old average of models)
            result = dataclasses.replace(result, ok=False, averaged=None, error=why)
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
        candidates = None
        wrong: dict[str, str] = {}
        verdict = ""
        if sent is not None and result.group_size >= rounds.SEVERAL and not self.stopping():
            mates = self.fetch_mates(result, anchor=anchor, digest=digest, codecs=codecs, wrong=wrong)
            mates, verdict = self.check_average(result, own=sent, mates=mates, codecs=codecs)
            candidates = rounds.partner_candidates(self.rule, anchor=anchor, own=sent, mates=mates, agreed=agreed)
        return Averaged(result=result, pre=pre, anchor=anchor, weight=weight, new=new, agreed=agreed,
                        momentum=momentum, candidates=candidates, served_wrong=wrong, served_average=verdict)

    # ------------------------------------------------------------------ backbone partners
    def fetch_mates(self, result: RoundResult, *, anchor: list[torch.Tensor], digest: str,
                    codecs: Sequence[str] | None = None, wrong: dict[str, str] | None = None
                    ) -> dict[str, list[torch.Tensor]]:
        """What the mates :func:`worldlm_p2p.rounds.partner_mates` picks from the round's group sent
        into it (their backbone changes, served by their averagers), by peer id. Outbound-only mates
        serve nothing and are not asked. A mate serves what it sent before the all-reduce starts,
        so one that has not served it within a few seconds (``2 x request_timeout``, at least 2 s;
        all mates together within the round's averaging timeout), serves another round's or
        anchor's, or something that does not fit the backbone is left out (logged). So is a mate that
        this peer's reducer caught in this round, or that failed it as a reducer: what the robust
        rule held to its bound in the region's average must not come in whole as half of a pair (a
        scaled change can look good on a slice early in training). And so is a mate whose served
        change disagrees with what this peer's reducer saw it send into the all-reduce, at the
        positions the reducer kept (:func:`worldlm_p2p.rounds.served_mismatch`, with the payload's
        ``codecs``): it is added to ``wrong`` (peer id -> why), and :meth:`judge` counts the round
        against it, as against a sender the robust rule caught."""
        me = str(self.averager.peer_id)
        suspect = set(result.report.caught) | set(result.report.bad_reducers)
        mates = [p for p, g in result.gathered.items() if p != me and not is_relay_gather(g)
                 and not (isinstance(g, dict) and g.get("outbound") is True)]
        for peer in sorted(suspect & set(mates)):
            why = ("the robust rule caught it in this round" if peer in result.report.caught
                   else "it failed this round as a reducer")
            logger.warning("round %d: left out %s%s as a backbone partner: %s", self.stats.round, peer,
                           self._label_of(result, peer), why)
        mates = [p for p in mates if p not in suspect]
        picked = rounds.partner_mates(mates, cap=self.rule.config.partner_candidates, round_index=self.stats.round)
        deadline = time.monotonic() + self.averaging.averaging_timeout
        patience = max(2.0, 2 * self.averaging.request_timeout)
        out: dict[str, list[torch.Tensor]] = {}
        for peer in picked:
            why = ""
            own_deadline = min(deadline, time.monotonic() + patience)
            while True:
                left = own_deadline - time.monotonic()
                if left <= 0 or self.stopping():
                    why = why or "it did not serve it in time"
                    break
                got = self.averager.download_contribution_from(peer, timeout=min(left, 10.0))
                meta, tensors = got if got is not None else (None, None)
                if isinstance(meta, dict) and meta.get("round") == self.stats.round and meta.get("anchor") == digest:
                    tensors = [t.to(torch.float32) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                               for t in tensors]
                    why = rounds.check_sent_backbone(self.rule, anchor, tensors)
                    seen = result.report.seen.get(peer)
                    if not why and seen is not None and codecs is not None:
                        why = rounds.served_mismatch(tensors, seen, codecs=codecs)
                        if why and wrong is not None:
                            wrong[peer] = why
                    if not why:
                        out[peer] = tensors
                    break
                if isinstance(meta, dict) and isinstance(meta.get("round"), int) and meta["round"] > self.stats.round:
                    why = f"it serves round {meta['round']} already"
                    break
                why = "it serves another round's" if isinstance(meta, dict) else why
                time.sleep(0.1)  # (a mate whose averager has not taken it yet)
            if why:
                logger.warning("round %d: left out %s%s as a backbone partner: %s", self.stats.round, peer,
                               self._label_of(result, peer), why)
        return out

    def check_average(self, result: RoundResult, *, own: list[torch.Tensor], mates: dict[str, list[torch.Tensor]],
                      codecs: Sequence[str]) -> tuple[dict[str, list[torch.Tensor]], str]:
        """Whether what the ``mates`` served, with what this member sent (``own``), gives the round's
        average (:func:`worldlm_p2p.rounds.served_average_mismatch`): ``(mates, "agrees")`` when it
        does, ``(mates, "")`` when that cannot be told, and ``({}, "differs")`` when it does not
        (logged): some mate served another change than it sent, somewhere in the vector (the spot
        check of :meth:`fetch_mates` covers this peer's span only), and no pair is taken this round.
        It can be told when every other member of the group served its change
        (no outbound-only member; no more mates than ``partner_candidates``), nobody was caught or
        dropped, every member's weight is known, and the backbone travels in an element-wise codec."""
        me = str(self.averager.peer_id)
        members = {p: g for p, g in result.gathered.items() if not is_relay_gather(g)}
        others = set(members) - {me}
        if not mates or set(mates) != others or me not in members or result.report.dropped:
            return mates, ""
        order = [me, *sorted(others)]
        weights = [members[p].get("weight") if isinstance(members[p], dict) else None for p in order]
        known = all(isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) and w >= 0
                    for w in weights)
        exact = all(c in ("none", "fp16") for c in codecs[:len(own)])
        if not known or not exact or result.averaged is None:
            return mates, ""
        why = rounds.served_average_mismatch(self.rule, [own, *(mates[p] for p in order[1:])], weights,
                                             averaged=result.averaged[:len(own)], codecs=codecs,
                                             max_weight=self.averager.robust.max_weight)
        if not why:
            return mates, "agrees"
        logger.warning("round %d: the changes the mates served do not give the round's average (%s): one of them "
                       "served another change than it sent; no backbone pair this round", self.stats.round, why)
        return {}, "differs"

    def partner_target(self, a: Averaged, *, loss_of, reuse) -> tuple[list[torch.Tensor], str | None]:
        """What the member's model moves towards (:func:`worldlm_p2p.rounds.partner_target`): the
        agreed model, or its pair with the mate its tune slice prefers; a member that reuses an
        earlier choice (its evidence budget spent) takes the region's."""
        if a.candidates is None or reuse is not None:
            return [t.detach().clone() for t in a.agreed], None
        return rounds.partner_target(self.rule, agreed=a.agreed, own=a.pre, candidates=a.candidates, loss_of=loss_of)

    @staticmethod
    def _partner_label(result: RoundResult, partner: str | None) -> str | None:
        """A chosen partner by its label (its peer id when it has none); the region's stays as it is."""
        if partner is None or partner == rounds.REGION_CANDIDATE:
            return partner
        g = result.gathered.get(partner)
        label = g.get("label") if isinstance(g, dict) else None
        return str(label) if label else partner

    def judge(self, result: RoundResult, *, served_wrong: dict[str, str] | None = None) -> None:
        """Name the peers the round's report accuses, and the mates whose served contribution was not
        what they sent (``served_wrong``, :meth:`fetch_mates`), and ban the repeat offenders."""
        report, s = result.report, self.stats
        served_wrong = served_wrong or {}
        for peer, why in sorted(report.caught.items()):
            label = self._label_of(result, peer)
            logger.warning("round %d: the robust rule caught %s%s: %s", s.round, peer, label, why)
            self.events.emit("caught", round=s.round, peer=peer, why=why, role="sender")
        for peer, why in sorted(report.bad_reducers.items()):
            logger.warning("round %d: reducer %s%s %s; the round is not used", s.round, peer,
                           self._label_of(result, peer), why)
            self.events.emit("caught", round=s.round, peer=peer, why=why, role="reducer")
        for peer, why in sorted(served_wrong.items()):
            self.events.emit("caught", round=s.round, peer=peer, why=why, role="partner")
        newly = self.strikes.record(set(report.caught) | set(report.bad_reducers) | set(served_wrong))
        if newly:
            self.averager.set_banned(self.strikes.banned)
            for peer in newly:
                logger.warning("banned %s for the rest of the run: caught in %d rounds", peer, self.strikes.ban_after)
                self.events.emit("banned", round=s.round, peer=peer)

    @staticmethod
    def _label_of(result: RoundResult, peer: str) -> str:
        g = result.gathered.get(peer)
        label = g.get("label") if isinstance(g, dict) else None
        return f" ({str(label)[:40]!r})" if label else ""

    # ------------------------------------------------------------------ step 3: apply
    def apply(self, a: Averaged, *, expected: int | None = None, current: list[torch.Tensor] | None = None,
              mixed: tuple | None = None, nice: int | None = None) -> Outcome:
        """``expected``: the peers (this one included) that waited for the round at the barrier; a
        smaller group, or a sender dropped by this peer's reducer, makes the round partial.
        ``current``: the member's model now, for an overlapped round computed on the snapshot
        ``a.pre`` (None: a synchronous round, the model is ``a.pre``). ``mixed``: the evidence search's
        (next model, choice), when the round's thread made it already. ``nice``: the CPU priority the
        round's network part ran at (recorded in the audit trail)."""
        s, result = self.stats, a.result
        lost = lost_parts(group_size=result.group_size, expected=expected, target=self.averaging.target_group_size,
                          dropped=result.report.dropped) if result.ok else []
        mix, new, partner = None, a.new, None
        if result.ok and self.rule.evidence:
            if mixed is not None:
                new, mix, partner = mixed
            else:
                def search():
                    loss_of, reuse = self.member.loss_of(), self.member.reuse_for("region")
                    target, chosen = self.partner_target(a, loss_of=loss_of, reuse=reuse)
                    return rounds.member_mix(self.rule, own=a.pre, agreed=target, loss_of=loss_of, reuse=reuse) + (chosen,)

                new, mix, partner = self.member.mix_safely(search, own=a.pre, extra=1)
            partner = self._partner_label(result, partner)
            self.member.record_mix("region", s.round, mix, partner=partner)
        minority = minority_group(result.gathered, group_size=result.group_size,
                                  target=self.averaging.target_group_size) if result.ok else None
        if minority is not None:
            lost.append(f"a group of {result.group_size} of the {minority} members that waited moves its members' "
                        f"models, not the region's anchor")
        if result.ok:
            self.member.set(new if current is None else rounds.stale_apply(new, pre=a.pre, current=current))
            self.member.mix_personal(s.round)
            if minority is None:
                self.state.momentum = a.momentum
                self.state.anchor = a.agreed
            clients = sum(1 for g in result.gathered.values() if isinstance(g, dict) and g.get("outbound") is True)
            sent, received = aggregation.allreduce_traffic(self.payload_bytes, result.group_size, clients=clients,
                                                           client=self.outbound)
            s.count_round(group_size=result.group_size, seconds=result.seconds, sent=sent, received=received)
            if s.seconds_to_first_round is None:
                s.seconds_to_first_round = time.monotonic() - self.started
            self.server.publish(round_index=s.round + 1)
            worlds = {g.get("world") for g in result.gathered.values() if isinstance(g, dict)}
            if len(worlds) > 1:
                logger.warning("round %d: members had adopted different world rounds (%s); the group's average "
                               "mixes them", s.round, sorted(w for w in worlds if isinstance(w, int)))
            self.on_averaged(result)
            if lost:
                s.rounds_partial += 1
                logger.warning("round %d: averaged with %d peers in %.2fs (weight %.0f), partial: %s", s.round,
                               result.group_size, result.seconds, a.weight, "; ".join(lost))
            else:
                logger.info("round %d: averaged with %d peers in %.2fs (weight %.0f)", s.round, result.group_size,
                            result.seconds, a.weight)
        else:
            s.rounds_failed += 1
            if current is not None:  # (a mixing search leaves its trial parameters in the model)
                self.member.set(current)
            logger.warning("round %d: all-reduce failed (%s); keeping the local model", s.round, result.error)
        self.trace(f"round-{s.round:05d}", dict(ok=result.ok, weight=a.weight, pre=a.pre, anchor=a.anchor,
                                                agreed=self.state.anchor if result.ok else None,
                                                mix_lam=mix.lam if mix is not None else None,
                                                mix_key_lam=mix.second_lam if mix is not None else None,
                                                mix_reused=mix.reused if mix is not None else None, current=current,
                                                partner=partner, served_average=a.served_average,
                                                nice=nice,
                                                gathered=result.gathered, post=self.member.params(), lost=lost,
                                                personal=self.member.personal_params()
                                                if self.member.personal is not None else None))
        if not result.ok:
            return Outcome.FAILED
        return Outcome.PARTIAL if lost else Outcome.AVERAGED


def lost_parts(*, group_size: int, expected: int | None, target: int, dropped: tuple[str, ...] = ()) -> list[str]:
    """Why a round whose average was taken is partial (empty: complete). ``expected``: the peers, this
    one included, that waited for it at the barrier (the group holds at most ``target`` of them);
    ``dropped``: senders this peer's reducer averaged without."""
    lost = []
    if expected is not None and group_size < min(expected, target):
        lost.append(f"{min(expected, target) - group_size} of the {expected} peers that waited were not in the group")
    if dropped:
        lost.append(f"this peer's reducer dropped the part of {', '.join(dropped)}")
    return lost


def minority_group(gathered: dict, *, group_size: int, target: int) -> int | None:
    """The members that waited for the round, when the group holds no more than half of them (None
    when it holds more): such a group's average moves its members' models but not the region's
    anchor. Two halves of a region that each moved the anchor would hold two anchors, and groups
    that later mix them have none by a majority and drop every round (found with 16 peers on 2
    cores). Every member decides alike, from the counts the group's members gathered (``expected``,
    each member's barrier view): their lower median (one member that claims a large count cannot
    hold the anchor of a group whose other members see fewer), at most ``target``."""
    counts = sorted(g["expected"] for g in gathered.values() if isinstance(g, dict)
                    and isinstance(g.get("expected"), int) and not isinstance(g.get("expected"), bool))
    if not counts or group_size <= 0:
        return None
    expected = min(counts[(len(counts) - 1) // 2], int(target))
    return expected if 2 * group_size <= expected else None


def anchor_disagreement(gathered: dict, own: str) -> str:
    """Why this member (anchor digest ``own``) must not apply a round whose members gathered these
    anchor digests ("" when it may): its anchor is not the group's. The group's anchor is the one
    most of its members hold; where several are held by equally many (a group of two with two
    anchors): one that a member reachable by others holds (the other side takes the region's state
    again by downloading it, and an outbound-only peer serves none), then the one whose holders
    adopted the most world rounds (the newer state), then the greatest digest. Every member of the
    group decides alike, so one side applies the round and the other takes the region's anchor
    again. (Without a tie-break both sides of a region of two dropped every round, and each resynced
    to the other's anchor: a livelock.) Members that sent no digest are not counted."""
    world_of: dict[str, int] = {}
    served: dict[str, bool] = {}
    counts: collections.Counter = collections.Counter()
    for g in gathered.values():
        if not (isinstance(g, dict) and isinstance(g.get("anchor"), str)):
            continue
        d = g["anchor"]
        counts[d] += 1
        w = g.get("world")
        world_of[d] = max(world_of.get(d, -1), w if isinstance(w, int) and not isinstance(w, bool) else -1)
        served[d] = served.get(d, False) or g.get("outbound") is not True
    if len(counts) <= 1:
        return ""
    top = max(counts, key=lambda d: (counts[d], served[d], world_of[d], d))
    if own == top:
        return ""
    n, total = counts[top], sum(counts.values())
    if sum(1 for c in counts.values() if c == n) > 1:
        return (f"the group's members held {len(counts)} different anchors, none by a majority; the tie went to "
                f"{top}: the round is not used here")
    return f"this peer's anchor {own} is not the group's ({top}, held by {n} of {total}): the round is not used here"


def gathered_tokens(result: RoundResult) -> float:
    """The tokens the group's members trained since the last round, from what they gathered."""
    return sum(float(g.get("tokens", 0)) for g in result.gathered.values() if isinstance(g, dict))

