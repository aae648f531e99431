"""A leader's world rounds are adopted before the next one starts (peer.world.WorldRounds.count).

World rounds run in the background. When one is quicker than a region round, a leader that started
the next one at once would replace its last change before the region's adoption round came, and
never adopt any (found in the simulated internet: 5 world rounds led, 0 adopted). So a new world
round waits until the last one this leader made is adopted (or refused)."""

import threading
from types import SimpleNamespace

import torch

from worldlm_p2p.codec import WorldChange
from worldlm_p2p.peer.world import WorldRounds


def _leader(*, change, world_round=-1, refuted=()):
    w = WorldRounds.__new__(WorldRounds)  # count()'s decision only: no DHT, no lease thread, no exchange
    w.peer_id = "me"
    w.stats = SimpleNamespace(rounds_since_world=0, world_round=world_round)
    w.manifest = SimpleNamespace(aggregation=SimpleNamespace(world_every=1))
    w.lease = SimpleNamespace(is_leader=lambda: True)
    w.run_admitted = lambda: None
    w.live_leaders = lambda: 2
    w.collect = lambda: None
    w.state = SimpleNamespace(change=change, snapshot=lambda: [torch.zeros(2)])
    w._thread, w._finished, w._refuted, w.tokens_since_world = None, None, set(refuted), 0.0
    started = []
    w._exchange = SimpleNamespace(averager=None)
    w._border_release = lambda snapshot: (None, {})
    w._run = lambda *args: started.append(args[0])
    return w, started


def _change(world_round, source="me"):
    return WorldChange(world_round=world_round, delta=[torch.ones(2)], apply_round=3, source=source, reference=None)


def _count(w):
    w.count(100.0)
    if w._thread is not None:
        w._thread.join(timeout=10)


def test_no_new_world_round_while_the_last_one_is_not_adopted():
    w, started = _leader(change=_change(4), world_round=3)
    _count(w)
    assert started == [] and w._thread is None


def test_the_next_world_round_starts_once_the_last_one_is_adopted():
    w, started = _leader(change=_change(4), world_round=4)
    _count(w)
    assert started == [5]  # the world round after the last one


def test_a_refused_change_or_another_leaders_does_not_hold_the_next_one():
    w, started = _leader(change=_change(4), world_round=3, refuted={("me", 4)})
    _count(w)
    assert started == [5]
    w, started = _leader(change=_change(4, source="the-old-leader"), world_round=3)
    _count(w)
    assert started == [5]


def test_first_world_round():
    w, started = _leader(change=None)
    _count(w)
    assert started == [0]
    assert isinstance(w._thread, threading.Thread)


# ---------------------------------------------------------------------------------------------------
# A member learns of a world change from the leader's gather in the region round after it was made,
# not only from the leader's lease record (which its lease view may read seconds late: found in the
# simulated internet, a NAT peer entered the adoption round without the change and its anchor was
# not the group's). The leader sets the adoption round so that the announcement arrives in time.


def _member(*, leader="L", lease_world=-1, world_round=-1, known=None, served=None):
    w = WorldRounds.__new__(WorldRounds)
    w.peer_id = "me"
    w.stats = SimpleNamespace(world_round=world_round)
    w.lease = SimpleNamespace(leader=lambda: SimpleNamespace(peer_id=leader, world_round=lease_world))
    w.state = SimpleNamespace(change=known)
    w._announced = -1
    downloads = []

    def download(lead, announced):
        downloads.append((lead.peer_id, announced))
        return served

    w._download = download
    return w, downloads


def test_a_member_downloads_what_the_leader_announced_in_its_gather():
    w, downloads = _member(lease_world=-1, served=_change(0, source="L"))
    assert w.prefetch() is None and downloads == []  # nothing announced yet
    w.heard({"L": {"change": 0}, "other": {"change": 7}})
    assert w._announced == 0
    assert w.prefetch().world_round == 0 and downloads == [("L", 0)]


def test_announcements_of_other_members_or_malformed_ones_are_ignored():
    w, downloads = _member(lease_world=-1)
    w.heard({"other": {"change": 3}, "L": {"change": "3"}})
    w.heard({"L": {"change": True}})
    w.heard({"L": ["change", 3]})
    assert w._announced == -1
    assert w.prefetch() is None and downloads == []


def test_a_known_or_adopted_change_is_not_downloaded_again():
    w, downloads = _member(world_round=0, known=_change(0, source="L"))
    w.heard({"L": {"change": 0}})
    w.prefetch()
    w, downloads2 = _member(world_round=-1, known=_change(1, source="L"))
    w.heard({"L": {"change": 1}})
    w.prefetch()
    assert downloads == downloads2 == []


def test_the_lease_record_still_announces_when_no_gather_did():
    w, downloads = _member(lease_world=2, world_round=1)
    w.prefetch()
    assert downloads == [("L", 2)]


def test_the_adoption_round_leaves_the_announcement_a_round_to_travel():
    # synchronous rounds: announced in round n's gather, downloaded after round n + 1's barrier;
    # overlapped: downloaded in round n + 1's thread, adopted when round n + 2 starts
    for overlap, ahead in ((False, 1), (True, 2)):
        w = WorldRounds.__new__(WorldRounds)
        w.manifest = SimpleNamespace(aggregation=SimpleNamespace(overlap=overlap))
        w.next_round = lambda: 7
        assert w.apply_round() == 7 + ahead
