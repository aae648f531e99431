"""Region leader election: the pure rule, and LeaderLease over an in-memory DHT (no processes)."""

import itertools
import logging
import random
import threading
import time
from types import SimpleNamespace

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey

from worldlm_p2p.net import keys
from worldlm_p2p.net import leader as leader_mod
from worldlm_p2p.net import records
from worldlm_p2p.net.leader import LeaderLease, elect
from worldlm_p2p.net.records import LeaseRecord


def _lease(peer_id="a", *, region="eu", since=10.0, expires=100.0, fingerprint="fp", **kw):
    return LeaseRecord(region=region, peer_id=peer_id, since=since, expires=expires, fingerprint=fingerprint, **kw)


# ----------------------------------------------------------------------------------- elect


def test_elect_empty_and_all_expired_give_none():
    assert elect([], region="eu", now=0.0) is None
    # a record expires at ``expires`` (a withdrawal publishes expires = now)
    assert elect([_lease(expires=50.0), _lease("b", expires=49.0)], region="eu", now=50.0) is None


def test_elect_ignores_expired_records_even_if_older():
    old_dead = _lease("a", since=1.0, expires=50.0)
    young_live = _lease("b", since=5.0, expires=60.0)
    assert elect([old_dead, young_live], region="eu", now=55.0) == young_live
    assert elect([old_dead, young_live], region="eu", now=40.0) == old_dead


def test_elect_smallest_since_wins_then_peer_id():
    recs = [_lease("m", since=3.0), _lease("c", since=2.0), _lease("z", since=2.0), _lease("a", since=9.0)]
    assert elect(recs, region="eu", now=0.0).peer_id == "c"
    assert elect([_lease("b", since=2.0), _lease("a", since=2.0)], region="eu", now=0.0).peer_id == "a"


def test_elect_ignores_other_regions_and_fingerprints():
    na = _lease("a", region="na", since=0.0)
    other_run = _lease("b", since=1.0, fingerprint="other")
    mine = _lease("c", since=5.0)
    assert elect([na, other_run, mine], region="eu", now=0.0, fingerprint="fp") == mine
    assert elect([na, other_run, mine], region="eu", now=0.0) == other_run  # no fingerprint: any run
    assert elect([na, other_run, mine], region="na", now=0.0) == na
    assert elect([na, other_run, mine], region="asia", now=0.0) is None
    assert elect([other_run], region="eu", now=0.0, fingerprint="fp") is None


def test_elect_is_order_independent():
    recs = [_lease("b", since=2.0), _lease("a", since=2.0, expires=5.0), _lease("c", since=2.0),
            _lease("a", since=2.0, expires=90.0, world_round=3), _lease("a", since=2.0, expires=90.0),
            _lease("d", since=1.0, region="na")]
    for now in (0.0, 10.0, 95.0):
        expected = elect(recs, region="eu", now=now)
        for perm in itertools.permutations(recs):
            assert elect(perm, region="eu", now=now) == expected
    assert elect(recs, region="eu", now=10.0) == recs[4]  # peer a, unexpired; the ties end deterministically
    rng = random.Random(0)
    many = [_lease(f"p{rng.randrange(20)}", since=float(rng.randrange(5)), expires=float(rng.randrange(5, 30)))
            for _ in range(60)]
    expected = elect(many, region="eu", now=10.0)
    for _ in range(200):
        rng.shuffle(many)
        assert elect(many, region="eu", now=10.0) == expected


def test_elect_skips_non_finite_records():
    good = _lease("b", since=3.0)
    assert elect([_lease("a", since=float("nan")), good], region="eu", now=0.0) == good
    assert elect([_lease("a", since=float("nan")), good][::-1], region="eu", now=0.0) == good


def test_lease_record_wire_round_trip_and_rejections():
    rec = _lease(world_round=4, maddrs=("/ip4/127.0.0.1/tcp/1/p2p/Qm",))
    assert LeaseRecord.from_wire(rec.to_wire()) == rec
    assert isinstance(rec.to_wire()["maddrs"], list)
    for bad in (dict(since=-1.0), dict(since=1), dict(world_round=-2), dict(region=3), dict(extra=1),
                dict(maddrs=["x"] * 9), dict(maddrs=["x" * 257]), dict(maddrs="abc"), dict(expires=None)):
        with pytest.raises(ValueError):
            LeaseRecord.from_wire(dict(rec.to_wire(), **bad))
    with pytest.raises(ValueError):
        LeaseRecord.from_wire([1, 2])
    # to_wire keeps records within the schema: too many or too long addresses are left out
    wide = _lease(maddrs=tuple(f"/ip4/10.0.0.{i}/tcp/1" for i in range(12)) + ("y" * 300,), since=float("inf"))
    back = LeaseRecord.from_wire(wide.to_wire())
    assert len(back.maddrs) == records.MAX_LEASE_MADDRS and back.since == 0.0


def test_make_validators_keeps_run_independent_validators_first():
    key = RSAPrivateKey()
    base, run = records.make_validators(None, key), records.make_validators("r", key)
    assert len(base) == 2 and len(run) == 6  # progress, leaders, residuals, relays
    assert [type(v) for v in run[:2]] == [type(v) for v in base]


# ----------------------------------------------------------------------------------- LeaderLease


class FakeDHT:
    """The part of ``hivemind.DHT`` that records use, in memory and shared by every FakeDHT on
    the same ``store`` dict; keeps hivemind's rule that a subkey only takes a later expiration."""

    def __init__(self, store: dict, clock) -> None:
        self.data = store
        self.clock = clock
        self.fail = False

    def store(self, key, value, expiration_time, subkey=None, return_future=False):
        if self.fail:
            raise RuntimeError("dht down")
        entries = self.data.setdefault(key, {})
        old = entries.get(subkey)
        if expiration_time < self.clock() or (old is not None and old[1] >= expiration_time):
            return False
        entries[subkey] = (value, expiration_time)
        return True

    def get(self, key, latest=False, return_future=False):
        if self.fail:
            raise RuntimeError("dht down")
        now = self.clock()
        live = {k: SimpleNamespace(value=v, expiration_time=e) for k, (v, e) in self.data.get(key, {}).items()
                if e >= now}
        return SimpleNamespace(value=live, expiration_time=now) if live else None


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture()
def swarm(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(leader_mod, "get_dht_time", clock)
    monkeypatch.setattr(records, "get_dht_time", clock)
    shared: dict = {}

    def lease(peer_id, region="eu", **kw):
        dht = FakeDHT(shared, clock)
        kw.setdefault("ttl", 6.0)
        return LeaderLease(dht=dht, validators=[RSASignatureValidator(RSAPrivateKey())], run_id="r", region=region,
                           peer_id=peer_id, fingerprint="fp", **kw), dht

    return SimpleNamespace(clock=clock, lease=lease)


def test_lease_validates_its_periods(swarm):
    with pytest.raises(ValueError):
        swarm.lease("a", ttl=0.0)
    with pytest.raises(ValueError):
        swarm.lease("a", ttl=3.0, renew_every=3.0)
    lease, _ = swarm.lease("a", ttl=6.0)
    assert lease.renew_every == pytest.approx(2.0)


def test_oldest_candidate_leads_and_newcomers_do_not_take_over(swarm, caplog):
    caplog.set_level(logging.INFO, logger="worldlm_p2p.net.leader")
    t = swarm.clock.t  # candidacies of the last few seconds (a record is aged from when it was first seen)
    a, _ = swarm.lease("a", since=t - 5.0)
    b, _ = swarm.lease("b", since=t - 9.0)
    c, _ = swarm.lease("c", since=t - 1.0, region="na")
    assert a.leader() is None and not a.is_leader()
    for lease in (a, b, c):
        lease.renew()
    a.renew()
    assert a.leader().peer_id == b.leader().peer_id == "b"
    assert b.is_leader() and not a.is_leader()
    assert c.is_leader() and c.leader().region == "na"
    assert "this peer is now the leader" in caplog.text

    newcomer, _ = swarm.lease("0-newcomer")  # smaller peer id, but joins later: no takeover
    newcomer._since = swarm.clock.t
    newcomer.renew()
    a.renew()
    assert {x.leader().peer_id for x in (a, b, newcomer)} == {"b"}


def test_dead_leader_expires_within_one_ttl(swarm):
    a, _ = swarm.lease("a", since=1.0, ttl=6.0)
    b, _ = swarm.lease("b", since=2.0, ttl=6.0)
    a.renew(), b.renew()
    assert b.leader().peer_id == "a"
    swarm.clock.t += 5.9  # a died after its renewal; b keeps renewing
    b.renew()
    assert b.leader().peer_id == "a"
    swarm.clock.t += 0.2  # a's record ran out: a no longer leads in its own view ...
    assert not a.is_leader()
    assert b.leader().peer_id == "a"  # ... and b takes over at its first refresh after that
    b.renew()
    assert b.leader().peer_id == "b" and b.is_leader()


def test_a_leader_renewing_late_is_not_given_up_before_the_dht_says_so(swarm):
    """A member whose last read is a period old does not give the lease up by the clock alone: the
    leader's renewal may be late by a second (a busy machine) and already in the DHT."""
    a, _ = swarm.lease("a", since=1.0, ttl=6.0)
    b, _ = swarm.lease("b", since=2.0, ttl=6.0)
    a.renew(), b.renew()
    swarm.clock.t += 6.5  # b's view of a has run out by the clock; a renewed late, a moment ago
    a.renew()
    assert b.leader().peer_id == "a" and not b.is_leader()
    b.renew()
    assert b.leader().peer_id == "a" and a.is_leader()

    def busy(*args, **kwargs):
        raise TimeoutError("the DHT did not answer")

    b._dht.get = busy  # b's reads fail (its renewals go through) and a dies
    for _ in range(3):
        swarm.clock.t += 2.0
        b.renew()
    assert b.leader().peer_id == "a"  # a's record ran out by the clock, not yet a TTL ago
    for _ in range(4):
        swarm.clock.t += 2.0
        b.renew()
    assert b.leader().peer_id == "b"  # no refresh for more than a TTL: b judges a by the clock


def test_withdraw_hands_over_at_once_and_a_return_queues_behind(swarm):
    a, _ = swarm.lease("a", since=1.0)
    b, _ = swarm.lease("b", since=2.0)
    a.renew(), b.renew()
    assert a.is_leader()
    assert a.withdraw()
    assert not a.is_leader()
    b.renew()  # the withdrawal is in the DHT: b takes over without waiting for the TTL
    assert b.is_leader() and b.leader().peer_id == "b"
    a.renew()  # a withdrawn peer publishes nothing more
    assert a.leader().peer_id == "b"

    swarm.clock.t += 1.0
    a.eligible = True  # back, but with a new since: behind b
    a.renew(), b.renew()
    assert b.is_leader() and a.leader().peer_id == "b"
    a.eligible = False  # withdrawal published at the next renewal
    b.eligible = False
    b.renew(), a.renew(), b.renew()
    assert a.leader() is None and b.leader() is None


def test_dht_errors_never_raise_and_an_unrenewed_lease_lapses(swarm):
    a, dht = swarm.lease("a", since=1.0, ttl=3.0)
    a.renew()
    assert a.is_leader()
    dht.fail = True
    assert a.renew().peer_id == "a"  # still within the lease
    assert not a.withdraw()  # refused by the DHT; locally no longer a candidate
    assert not a.is_leader()
    a.eligible = True
    swarm.clock.t += 3.1
    assert a.renew() is None and not a.is_leader()  # cannot renew: the lease lapses
    dht.fail = False
    a.renew()
    assert a.is_leader()


def test_thread_renews_and_stops(monkeypatch):
    shared: dict = {}
    dht = FakeDHT(shared, time.time)
    lock = threading.Lock()
    lease = LeaderLease(dht=dht, validators=[RSASignatureValidator(RSAPrivateKey())], run_id="r", region="eu",
                        peer_id="a", fingerprint="fp", ttl=0.3, lock=lock)
    lease.start()
    try:
        deadline = time.monotonic() + 5
        while not lease.is_leader() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert lease.is_leader()
        dht.fail = True  # errors are swallowed by the thread
        time.sleep(0.25)
        assert lease._thread.is_alive()
        dht.fail = False
        time.sleep(0.25)
        first = shared[keys.leaders_key("r")]
        assert LeaseRecord.from_wire(next(iter(first.values()))[0]).expires > time.time()
        with pytest.raises(RuntimeError):
            lease.start()
    finally:
        lease.stop(withdraw=True)
    assert not lease._thread.is_alive() and not lease.is_leader()
    assert LeaseRecord.from_wire(next(iter(shared[keys.leaders_key("r")].values()))[0]).expires <= time.time()


def test_an_admitting_region_elects_only_admitted_candidacies_signed_by_their_peer(swarm):
    """The oldest candidacy wins only among peers the region admitted, whose lease record is signed
    by the key of the peer id it names: a stranger's older candidacy, or one that copies an admitted
    peer's id under another key, is not counted (leases of other regions are left to their members)."""
    from worldlm_p2p.net.admission import peer_id_of

    shared = {}
    keys = {name: RSAPrivateKey() for name in ("alice", "bob", "mallory")}
    ids = {name: peer_id_of(k.get_public_key()) for name, k in keys.items()}
    admitted = {ids["alice"], ids["bob"]}

    def lease(name, *, since, peer_id=None, region="eu", rules=lambda: admitted):
        return LeaderLease(dht=FakeDHT(shared, swarm.clock), validators=[RSASignatureValidator(keys[name])],
                           run_id="r", region=region, peer_id=peer_id or ids[name], fingerprint="fp", since=since,
                           admitted=rules)

    alice, bob = lease("alice", since=5.0), lease("bob", since=6.0)
    stranger = lease("mallory", since=1.0)  # the oldest, not admitted
    impostor = lease("mallory", since=2.0, peer_id=ids["bob"])  # bob's id, mallory's signature
    for x in (stranger, impostor, alice, bob):
        x.renew()
    alice.renew(), bob.renew()
    assert alice.leader().peer_id == bob.leader().peer_id == ids["alice"]
    assert alice.is_leader() and not bob.is_leader()
    # an open region (admitted() is None) counts every candidacy, as before
    open_view = lease("bob", since=7.0, rules=lambda: None)
    open_view.renew()
    assert open_view.leader().peer_id == ids["mallory"]


def test_a_newcomer_claiming_an_old_lease_is_aged_from_when_it_was_first_seen(swarm):
    a, _ = swarm.lease("a", since=swarm.clock.t)
    b, _ = swarm.lease("b", since=swarm.clock.t + 1)
    a.renew(), b.renew(), a.renew()
    assert a.leader().peer_id == b.leader().peer_id == "a"
    for _ in range(50):  # 100 s of renewals
        swarm.clock.t += 2.0
        a.renew(), b.renew()
    mallory, _ = swarm.lease("mallory", since=0.0)  # claims to have been a candidate since time 0
    mallory.renew()
    a.renew(), b.renew()
    # a and b first read mallory's candidacy now: it counts from now less the tolerance, after a's
    assert a.leader().peer_id == b.leader().peer_id == "a"
    aged = [r for r in a.leases() if r.peer_id == "mallory"][0]
    assert aged.since == pytest.approx(swarm.clock.t - 3 * a.ttl)
    # a peer whose first refresh already holds it cannot know better: it takes the claim as it is
    late, _ = swarm.lease("late", since=swarm.clock.t)
    late.renew()
    assert late.leader().peer_id == "mallory"


def test_a_refused_leader_is_counted_no_more_by_the_peer_that_refused_it(swarm):
    """A member that refused a leader's world change stops counting that leader's candidacy at once
    and at every later refresh: the next candidate leads, as it sees the region; others are not
    affected, and a peer cannot refuse itself."""
    t = swarm.clock.t
    m, _ = swarm.lease("mallory", since=t - 9.0)
    a, _ = swarm.lease("a", since=t - 5.0)
    b, _ = swarm.lease("b", since=t - 3.0)
    for lease in (m, a, b, a, b):
        lease.renew()
    assert a.leader().peer_id == b.leader().peer_id == "mallory"
    a.refuse("mallory")
    assert a.leader().peer_id == "a" and a.is_leader()  # at once, before a refresh
    a.renew(), b.renew()
    assert a.leader().peer_id == "a" and b.leader().peer_id == "mallory"
    a.refuse("a")
    assert a.is_leader()


def test_standby_peers_renew_nothing_and_step_in_when_the_candidates_ahead_die(swarm):
    """With standby = 2 only the two oldest candidates renew; the election is the one every peer
    makes when all renew; when both die, the next in line publishes at its next renewal and leads."""
    with pytest.raises(ValueError):
        swarm.lease("x", standby=0)
    leases = {pid: swarm.lease(pid, since=float(i + 1), ttl=6.0, standby=2)[0] for i, pid in enumerate("abcde")}
    data = leases["a"]._dht.data

    def period(alive):  # one renewal period (ttl / 3) of the peers still alive
        swarm.clock.t += 2.0
        for p in alive:
            leases[p].renew()

    def live_subkeys():
        return sum(1 for entries in data.values() for _, e in entries.values() if e > swarm.clock.t)

    period("abcde")  # nobody known yet: everyone publishes
    period("abcde")
    assert [p for p, lease in leases.items() if lease.standing_by()] == ["c", "d", "e"]
    for _ in range(4):  # the standbys' first records run out; only a and b keep theirs
        period("abcde")
        assert all(lease.leader().peer_id == "a" for lease in leases.values())
    assert live_subkeys() == 2
    # a and b die: once their records have run out, c, d and e see fewer than 2 ahead and publish;
    # at the renewal after, e (third in line) stands by again, and c leads
    for _ in range(4):
        period("cde")
    assert {leases[p].leader().peer_id for p in "cde"} == {"c"} and leases["c"].is_leader()
    assert [p for p in "cde" if leases[p].standing_by()] == ["e"]
    period("cde"), period("cde"), period("cde")
    assert live_subkeys() == 2


def test_a_leader_whose_record_ran_out_queues_behind_instead_of_taking_the_lease_back(swarm):
    a, _ = swarm.lease("a", since=1.0, ttl=6.0)
    b, _ = swarm.lease("b", since=2.0, ttl=6.0)
    a.renew(), b.renew()
    assert a.is_leader()
    for _ in range(4):  # a's renewals are late (a busy machine): its record runs out, b takes over
        swarm.clock.t += 2.0
        b.renew()
    assert b.is_leader()
    a.renew()  # a is back: it publishes again, but with a new since, behind b
    b.renew()
    assert b.is_leader() and a.leader().peer_id == "b" and not a.is_leader()
    assert a._since == pytest.approx(swarm.clock.t)
    swarm.clock.t += 2.0
    a.renew(), b.renew()
    assert a.leader().peer_id == b.leader().peer_id == "b"
