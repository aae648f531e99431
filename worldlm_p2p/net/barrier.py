"""The region barrier: line up a region's live peers before a round's all-reduce.

hivemind forms a group from the peers that call ``step()`` within one matchmaking window. Peers that
start at different times (a late joiner, a restarted peer) would otherwise stay out of phase and
never meet. Before each round a peer therefore publishes ``waiting_for_round = r`` in its progress
record and waits, for a bounded time, until every *live* peer of its region (a progress record that
has not expired) waits for the same round. Peers waiting for a later round pull the others forward
to it when they are at least half of the region (this peer included): the round is the region
majority's, so that a record that claims an absurd round (a malicious or broken member) moves
nobody, and a peer ahead of the majority is not waited for (it joins the region when the region
reaches its round); a dead peer stops counting once its record expires, so the barrier is bounded by
``min(barrier_timeout, progress_ttl)`` after a death. A region with no other live peer trains alone.

A region whose live members are all outbound-only has nobody who can reduce a round; where the run
has a relay for it (:mod:`worldlm_p2p.peer.relay`: a reachable node endorsed by the run key that
joins the group as an auxiliary member, reducing without sending anything of its own), the barrier
lines the members up as usual and the group holds the relay too (:attr:`Decision.relay`); without
one, each member trains alone. The relay follows the same records (:func:`relay_due`).
"""

from __future__ import annotations

import enum
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from worldlm_p2p.net.records import ProgressRecord

logger = logging.getLogger(__name__)


class Action(enum.Enum):
    GO = "go"  # every live region peer waits for this round: all-reduce now
    WAIT = "wait"  # some live region peer is still training towards this round
    ALONE = "alone"  # no other live peer in the region: keep training locally


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    round: int  # the round to run (may be later than asked, to catch up with the region)
    waiting: int  # other live peers that wait for ``round``
    live: int  # other live peers of the region
    relay: bool = False  # every live member is outbound-only: the group needs the region's relay, one more peer


def decide(*, my_round: int, others: Sequence[ProgressRecord], outbound: bool = False,
           relayed: bool = False) -> Decision:
    """Pure barrier rule over the other live peers of the region (records of self excluded).
    ``outbound``: this peer is outbound-only; with no live peer that others can dial (every other
    one outbound too), nobody could reduce a round: the region trains alone until one comes, unless
    ``relayed`` (a relay of the run serves the region: the rounds go through it)."""
    live = [r for r in others if not r.finished]
    if not live:
        return Decision(Action.ALONE, my_round, 0, 0)
    relay = outbound and all(r.reachability == "outbound" for r in live)
    if relay and not relayed:
        return Decision(Action.ALONE, my_round, 0, len(live))
    claims = sorted([my_round] + [r.waiting_for_round for r in live], reverse=True)
    majority = claims[(len(claims) + 1) // 2 - 1]  # the latest round at least half of the region has reached
    target = max(my_round, majority)
    awaited = [r for r in live if r.waiting_for_round <= target]  # a peer ahead of the region waits for it
    waiting = sum(1 for r in awaited if r.waiting_for_round == target)
    if not awaited:  # every other peer is ahead of this one and of the majority: nobody to average with now
        return Decision(Action.WAIT, target, 0, len(live), relay)
    action = Action.GO if waiting == len(awaited) else Action.WAIT
    return Decision(action, target, waiting, len(live), relay)


def relay_due(*, members: Sequence[ProgressRecord], done: int, first_waiting: dict[int, float], now: float,
              timeout: float) -> tuple[int, int] | None:
    """What a relay of a region does now: ``(round, members)`` to join that round's group expecting
    ``members`` peers besides itself, or None to wait. ``members``: the region's live records (a
    relay needs every one outbound-only and at least two: otherwise a member reduces, or there is
    nobody to average with); ``done``: the last round it joined; ``first_waiting``: round -> when it
    first saw a member wait for it (updated here, ``now`` on the same clock). The round is the
    members' own barrier's (:func:`decide`): the latest that at least half of them wait for; the relay
    joins when every member not ahead of it waits for it, or ``timeout`` seconds (the members'
    ``barrier_timeout``) after the first began to, with at least two waiting, as the members then go
    ahead with whoever waits."""
    live = [r for r in members if not r.finished]
    if len(live) < 2 or any(r.reachability != "outbound" for r in live):
        return None
    claims = sorted((r.waiting_for_round for r in live), reverse=True)
    target = claims[(len(claims) + 1) // 2 - 1]
    if target < 0 or target <= done:
        return None
    awaited = [r for r in live if r.waiting_for_round <= target]
    waiting = sum(1 for r in awaited if r.waiting_for_round == target)
    first_waiting.setdefault(target, now)
    for r in [r for r in first_waiting if r < target]:
        del first_waiting[r]
    if waiting == len(awaited) or (waiting >= 2 and now - first_waiting[target] >= timeout):
        return target, waiting
    return None


def wait_for_region(*, my_round: int, fetch_others: Callable[[], list[ProgressRecord]],
                    announce: Callable[[int], None], timeout: float, poll: float = 0.25,
                    should_stop: Callable[[], bool] = lambda: False, outbound: bool = False,
                    relayed: Callable[[], bool] = lambda: False) -> Decision:
    """Announce readiness for ``my_round`` and wait until :func:`decide` says GO or ALONE, or until
    ``timeout``; at the timeout, go ahead with whoever waits (laggards miss this round).
    ``relayed()``: whether a relay serves the region now (asked of outbound-only peers only)."""
    deadline = time.monotonic() + timeout
    announce(my_round)
    decision = decide(my_round=my_round, others=fetch_others(), outbound=outbound,
                      relayed=outbound and relayed())
    while decision.action is Action.WAIT and time.monotonic() < deadline and not should_stop():
        if decision.round != my_round:
            my_round = decision.round
            announce(my_round)
        time.sleep(poll)
        decision = decide(my_round=my_round, others=fetch_others(), outbound=outbound,
                          relayed=outbound and relayed())
    if decision.round != my_round:
        announce(decision.round)
    if decision.action is Action.WAIT:
        if decision.waiting > 0:
            logger.info("barrier timeout: going ahead with %d of %d region peers", decision.waiting, decision.live)
            return Decision(Action.GO, decision.round, decision.waiting, decision.live, decision.relay)
        return Decision(Action.ALONE, decision.round, 0, decision.live)
    return decision



#: under ``schedule = "tokens"`` a member counts for at most this many rounds' worth of tokens per
#: member (the robust rule's weight cap, ``aggregation.max_round_weight``), and enters a round only
#: once it has trained this share of one itself: a record that lies about its tokens or its round
#: can make a region's rounds at most this many times more frequent, never continuous
MAX_MEMBER_SHARE = 2.0
MIN_OWN_SHARE = 0.25


def region_tokens(*, my_tokens: int, others: Sequence[ProgressRecord], now: float, max_age: float,
                  cap: float = math.inf) -> float:
    """The tokens the region's live members have trained since they last entered a round, as far as
    this peer can tell at ``now`` (DHT time): its own ``my_tokens`` exactly, and for every other
    live member the ``round_tokens`` its record says plus what it trains at its ``tokens_per_s``
    in the time since the record was made (at most ``max_age`` seconds of it, so that a record a
    dead peer left behind does not count for ever), each member's count at most ``cap``."""
    total = float(my_tokens)
    for r in others:
        if r.finished:
            continue
        total += min(r.round_tokens + r.tokens_per_s * min(max(now - r.time, 0.0), max_age), cap)
    return total


def round_due(*, my_tokens: int, my_round: int, others: Sequence[ProgressRecord], now: float, tokens_per_member: int,
              max_age: float) -> bool:
    """Whether this peer's next region round (index ``my_round``) is due under ``aggregation.schedule
    = "tokens"``, once it has trained ``MIN_OWN_SHARE`` of ``tokens_per_member`` itself: when a live
    member of the region already waits for exactly this round (so that everyone enters it within one
    read of the records), or when the region has trained ``tokens_per_member`` tokens per live member
    since the last round (:func:`region_tokens`, this peer included, each member counted for at most
    ``MAX_MEMBER_SHARE`` of that), whatever the members' speeds. A peer alone in its region is due
    after ``tokens_per_member`` of its own."""
    if my_tokens < MIN_OWN_SHARE * tokens_per_member:
        return False
    live = [r for r in others if not r.finished]
    if any(r.waiting_for_round == my_round for r in live):
        return True
    return region_tokens(my_tokens=my_tokens, others=live, now=now, max_age=max_age,
                         cap=MAX_MEMBER_SHARE * tokens_per_member) >= tokens_per_member * (1 + len(live))
