"""The region barrier's pure rule and its bounded wait."""

import dataclasses
import time

from worldlm_p2p.net.barrier import (MIN_OWN_SHARE, Action, decide, region_tokens, relay_due, round_due,
                                     wait_for_region)
from worldlm_p2p.net.records import ProgressRecord


def rec(label, *, waiting=-1, rnd=0, finished=False, reachability=""):
    return ProgressRecord(region="eu", peer_id=label, label=label, step=0, tokens=0, train_loss=0.0, tokens_per_s=0.0,
                          rounds_completed=0, last_group_size=0, bytes_sent=0, bytes_received=0, round=rnd,
                          waiting_for_round=waiting, fingerprint="f", time=0.0, finished=finished,
                          reachability=reachability)


def test_alone_when_no_live_peer():
    assert decide(my_round=3, others=[]).action is Action.ALONE
    assert decide(my_round=3, others=[rec("b", finished=True)]).action is Action.ALONE


def test_go_only_when_every_live_peer_waits_for_the_round():
    assert decide(my_round=2, others=[rec("b", waiting=2), rec("c", waiting=2)]).action is Action.GO
    d = decide(my_round=2, others=[rec("b", waiting=2), rec("c")])
    assert d.action is Action.WAIT and d.waiting == 1 and d.live == 2


def test_a_peer_ahead_pulls_the_others_forward():
    d = decide(my_round=2, others=[rec("b", waiting=5)])
    assert d.action is Action.GO and d.round == 5


def test_wait_is_bounded_and_goes_with_those_waiting():
    announced = []
    t0 = time.monotonic()
    d = wait_for_region(my_round=1, fetch_others=lambda: [rec("b", waiting=1), rec("c")],
                        announce=announced.append, timeout=0.5, poll=0.05)
    assert time.monotonic() - t0 < 3
    assert d.action is Action.GO and d.waiting == 1 and announced[0] == 1


def test_wait_timeout_with_nobody_waiting_trains_alone():
    d = wait_for_region(my_round=1, fetch_others=lambda: [rec("c")], announce=lambda r: None, timeout=0.2, poll=0.05)
    assert d.action is Action.ALONE


def test_wait_stops_on_request():
    d = wait_for_region(my_round=1, fetch_others=lambda: [rec("c")], announce=lambda r: None, timeout=30,
                        poll=0.05, should_stop=lambda: True)
    assert d.action is Action.ALONE


def test_the_round_is_the_majoritys_and_an_absurd_claim_moves_nobody():
    # 3 peers (this one included): a record claiming round 10**12 is a minority of one
    d = decide(my_round=4, others=[rec("b", waiting=4), rec("mallory", waiting=10 ** 12)])
    assert d.action is Action.GO and d.round == 4 and d.waiting == 1
    # two of three at round 6: the majority pulls this peer forward
    d = decide(my_round=4, others=[rec("b", waiting=6), rec("c", waiting=6)])
    assert d.action is Action.GO and d.round == 6
    # one of three ahead: not followed, not waited for; the peer still training is
    d = decide(my_round=4, others=[rec("b", waiting=9), rec("c")])
    assert d.action is Action.WAIT and d.round == 4 and d.live == 2
    # the peer ahead waits for the region to reach its round
    d = decide(my_round=9, others=[rec("a", waiting=4), rec("c", waiting=4)])
    assert d.action is Action.WAIT and d.round == 9


def test_an_outbound_peer_needs_a_live_peer_others_can_dial():
    # two outbound-only peers: nobody could reduce their round, so neither waits for the other
    d = decide(my_round=2, others=[rec("b", waiting=2, reachability="outbound")], outbound=True)
    assert d.action is Action.ALONE and d.live == 1
    # a direct peer (or one of an older version, which says nothing) makes the round possible
    for reach in ("direct", "", "unknown", "not-direct"):
        d = decide(my_round=2, others=[rec("b", waiting=2, reachability="outbound"),
                                       rec("c", waiting=2, reachability=reach)], outbound=True)
        assert d.action is Action.GO and d.waiting == 2, reach
    # the direct peer itself waits for outbound ones: it reduces their round
    d = decide(my_round=2, others=[rec("b", waiting=2, reachability="outbound")], outbound=False)
    assert d.action is Action.GO and d.waiting == 1
    # a finished direct peer does not count
    d = decide(my_round=2, others=[rec("b", waiting=2, reachability="outbound"),
                                   rec("c", finished=True, reachability="direct")], outbound=True)
    assert d.action is Action.ALONE


def test_outbound_peers_line_up_when_a_relay_serves_their_region():
    out = [rec("b", waiting=2, reachability="outbound"), rec("c", waiting=1, reachability="outbound")]
    # a relay serves the region: the usual barrier (c is still training towards round 2) ...
    d = decide(my_round=2, others=out, outbound=True, relayed=True)
    assert d.action is Action.WAIT and d.relay
    # ... then GO once everyone waits, the group holding the relay too
    out[1] = rec("c", waiting=2, reachability="outbound")
    d = decide(my_round=2, others=out, outbound=True, relayed=True)
    assert d.action is Action.GO and d.waiting == 2 and d.relay
    # no relay: each trains alone, as before
    assert decide(my_round=2, others=out, outbound=True, relayed=False).action is Action.ALONE
    # a reachable member reduces: no relay in the group, even where one is offered
    d = decide(my_round=2, others=out + [rec("x", waiting=2, reachability="direct")], outbound=True, relayed=True)
    assert d.action is Action.GO and not d.relay
    # the barrier at its timeout keeps the relay flag
    calls = iter([[rec("b", waiting=2, reachability="outbound"), rec("c", waiting=-1, reachability="outbound")]] * 100)
    d = wait_for_region(my_round=2, fetch_others=lambda: next(calls), announce=lambda r: None, timeout=0.05,
                        poll=0.01, outbound=True, relayed=lambda: True)
    assert d.action is Action.GO and d.waiting == 1 and d.relay


def test_a_relay_joins_the_round_the_members_barrier_goes_for():
    o = dict(reachability="outbound")
    first: dict = {}
    members = [rec("a", waiting=3, **o), rec("b", waiting=-1, **o)]
    # b still trains towards round 3: wait (and remember when a began to wait)
    assert relay_due(members=members, done=2, first_waiting=first, now=100.0, timeout=60.0) is None
    assert first == {3: 100.0}
    # everyone waits: join round 3, expecting both
    members[1] = rec("b", waiting=3, **o)
    assert relay_due(members=members, done=2, first_waiting=first, now=101.0, timeout=60.0) == (3, 2)
    # ... once: round 3 is done
    assert relay_due(members=members, done=3, first_waiting=first, now=102.0, timeout=60.0) is None
    # the members' barrier timeout: those waiting go ahead (at least two of them), and so does the relay
    three = [rec("a", waiting=5, **o), rec("b", waiting=5, **o), rec("c", waiting=-1, **o)]
    first = {}
    assert relay_due(members=three, done=4, first_waiting=first, now=0.0, timeout=60.0) is None
    assert relay_due(members=three, done=4, first_waiting=first, now=59.0, timeout=60.0) is None
    assert relay_due(members=three, done=4, first_waiting=first, now=60.0, timeout=60.0) == (5, 2)
    # the round is the majority's: one record claiming an absurd round moves nothing
    liar = [rec("a", waiting=10 ** 9, **o), rec("b", waiting=-1, **o), rec("c", waiting=-1, **o)]
    assert relay_due(members=liar, done=4, first_waiting={}, now=0.0, timeout=0.0) is None
    # nothing to relay: a reachable member reduces, a single member has nobody to average with
    assert relay_due(members=[rec("a", waiting=3, **o), rec("b", waiting=3, reachability="direct")], done=0,
                     first_waiting={}, now=0.0, timeout=0.0) is None
    assert relay_due(members=[rec("a", waiting=3, **o)], done=0, first_waiting={}, now=0.0, timeout=0.0) is None
    # finished members do not count
    assert relay_due(members=[rec("a", waiting=3, **o), rec("b", waiting=3, finished=True, **o)], done=0,
                     first_waiting={}, now=0.0, timeout=0.0) is None


def test_a_round_that_lost_a_part_is_partial():
    from worldlm_p2p.peer.region_round import lost_parts

    assert lost_parts(group_size=3, expected=3, target=8) == []
    assert lost_parts(group_size=2, expected=2, target=2) == []
    # three waited at the barrier, the group held two: one member's part is missing
    assert lost_parts(group_size=2, expected=3, target=8) == ["1 of the 3 peers that waited were not in the group"]
    # a group capped by target_group_size is not partial for being smaller than the crowd
    assert lost_parts(group_size=4, expected=6, target=4) == []
    why = lost_parts(group_size=3, expected=3, target=8, dropped=("QmB",))
    assert why == ["this peer's reducer dropped the part of QmB"]
    assert lost_parts(group_size=3, expected=None, target=8) == []


# ------------------------------------------------------------------ rounds due by the region's tokens


def paced(label, *, round_tokens, rate=0.0, at=100.0, waiting=-1, finished=False):
    return dataclasses.replace(rec(label, waiting=waiting, finished=finished), round_tokens=round_tokens,
                               tokens_per_s=rate, time=at)


def test_region_tokens_extrapolate_each_record_for_a_bounded_time():
    # hand-computed: own 100; b's record (made 2 s ago) says 300 at 50 tokens/s -> 400; c's record is
    # 30 s old at 10 tokens/s: at most max_age = 4 s of it -> 200 + 40; d has finished: nothing
    others = [paced("b", round_tokens=300, rate=50, at=98.0), paced("c", round_tokens=200, rate=10, at=70.0),
              paced("d", round_tokens=999, rate=999, finished=True)]
    assert region_tokens(my_tokens=100, others=others, now=100.0, max_age=4.0) == 100 + 400 + 240
    # a record from the future (clock skew) is not extrapolated backwards
    assert region_tokens(my_tokens=0, others=[paced("b", round_tokens=10, rate=5, at=200.0)], now=100.0,
                         max_age=4.0) == 10
    # the cap bounds what one member counts for
    assert region_tokens(my_tokens=0, others=[paced("b", round_tokens=10**9)], now=100.0, max_age=4.0,
                         cap=2000) == 2000


def test_a_round_is_due_when_the_region_trained_its_share_whatever_the_speeds():
    T = 1000  # tokens per member per round (H x batch x seq_len)
    # alone: after T of its own
    assert not round_due(my_tokens=999, my_round=3, others=[], now=100.0, tokens_per_member=T, max_age=4.0)
    assert round_due(my_tokens=1000, my_round=3, others=[], now=100.0, tokens_per_member=T, max_age=4.0)
    # a fast peer (1300) with a slow one (700): 2000 = 2 x T, due for both, neither waited for H steps
    slow, fast = paced("slow", round_tokens=700, at=100.0), paced("fast", round_tokens=1300, at=100.0)
    assert round_due(my_tokens=1300, my_round=3, others=[slow], now=100.0, tokens_per_member=T, max_age=4.0)
    assert round_due(my_tokens=700, my_round=3, others=[fast], now=100.0, tokens_per_member=T, max_age=4.0)
    assert not round_due(my_tokens=1299, my_round=3, others=[slow], now=100.0, tokens_per_member=T, max_age=4.0)
    # a member waiting for this very round makes it due for everyone (once it trained a quarter)
    waiter = paced("b", round_tokens=0, waiting=3)
    assert round_due(my_tokens=250, my_round=3, others=[waiter], now=100.0, tokens_per_member=T, max_age=4.0)
    assert not round_due(my_tokens=249, my_round=3, others=[waiter], now=100.0, tokens_per_member=T, max_age=4.0)
    # ... but not one waiting for another round (a round in flight, or an absurd claim)
    for other_round in (2, 4, 10**6):
        w = paced("b", round_tokens=0, waiting=other_round)
        assert not round_due(my_tokens=900, my_round=3, others=[w], now=100.0, tokens_per_member=T, max_age=4.0)


def test_a_member_that_lies_about_its_tokens_makes_rounds_at_most_a_few_times_more_frequent():
    T = 1000
    liar = paced("liar", round_tokens=10**12, rate=1e12, at=100.0)
    # in a region of 2, it counts for 2 T at most: the honest member enters after a quarter of T of its own
    assert not round_due(my_tokens=MIN_OWN_SHARE * T - 1, my_round=0, others=[liar], now=100.0, tokens_per_member=T,
                         max_age=4.0)
    assert round_due(my_tokens=MIN_OWN_SHARE * T, my_round=0, others=[liar], now=100.0, tokens_per_member=T,
                     max_age=4.0)
    # with two honest members it counts for 2 T of the 3 T due: they enter after half of T each, rounds
    # twice as frequent as honest ones would make them, with each member's weight its own tokens
    assert not round_due(my_tokens=499, my_round=0, others=[liar, paced("h", round_tokens=499, at=100.0)],
                         now=100.0, tokens_per_member=T, max_age=4.0)
    assert round_due(my_tokens=500, my_round=0, others=[liar, paced("h", round_tokens=500, at=100.0)], now=100.0,
                     tokens_per_member=T, max_age=4.0)
