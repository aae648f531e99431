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
