"""Region leader election on real hivemind DHT nodes (127.0.0.1): agreement, failover, withdrawal."""

from __future__ import annotations

import subprocess
import time
from contextlib import ExitStack

import pytest
from hivemind.utils.crypto import RSAPrivateKey

from swarm_utils import LOOPBACK, wait_for
from worldlm_p2p.net import keys
from worldlm_p2p.config import NetConfig
from worldlm_p2p.net import records
from worldlm_p2p.net.leader import LeaderLease
from worldlm_p2p.net.records import LeaseRecord

pytestmark = pytest.mark.network

FP = "fp-test"


def _live(pids: set[int]) -> set[int]:
    """The processes among ``pids`` that still run (zombies count as gone)."""
    if not pids:
        return set()
    out = subprocess.run(["ps", "-o", "pid=,stat=", "-p", ",".join(map(str, sorted(pids)))], capture_output=True,
                         text=True).stdout
    return {int(r.split()[0]) for r in out.splitlines() if len(r.split()) == 2 and not r.split()[1].startswith("Z")}


def _children(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return {int(x) for x in out.split()}


class World:
    """DHT nodes (a bootstrap node and peers) plus their leases; ``close()`` stops and shuts down all
    of them and checks that no process (DHT node or p2pd) is left behind."""

    def __init__(self, run_id: str, stack: ExitStack) -> None:
        from worldlm_p2p.net.dht import start_dht

        self.run_id = run_id
        self._start_dht = start_dht
        self.dhts: list = []
        self.leases: list[LeaderLease] = []
        self.pids: set[int] = set()  # DHT processes and their p2p daemons
        stack.callback(self.close)
        self.boot = self._dht(())
        self.maddrs = tuple(str(m) for m in self.boot.get_visible_maddrs())

    def _dht(self, initial, validators=None):
        validators = validators or records.make_validators(self.run_id, RSAPrivateKey())
        dht = self._start_dht(NetConfig(initial_peers=initial, host_maddrs=(LOOPBACK,)), record_validators=validators)
        self.dhts.append(dht)
        daemons = _children(dht.pid)
        assert daemons, "found no p2p daemon under the DHT process"
        self.pids |= {dht.pid} | daemons
        return dht

    def peer(self, region: str, *, ttl: float) -> tuple[LeaderLease, object]:
        validators = records.make_validators(self.run_id, RSAPrivateKey())
        dht = self._dht(self.maddrs, validators)
        lease = LeaderLease(dht=dht, validators=validators, run_id=self.run_id, region=region,
                            peer_id=dht.peer_id.to_base58(), fingerprint=FP, ttl=ttl, renew_every=1.0,
                            maddrs=[str(m) for m in dht.get_visible_maddrs()])
        self.leases.append(lease)
        return lease, dht

    def close(self) -> None:
        try:
            for lease in self.leases:
                lease.stop(timeout=5)
        finally:
            for dht in self.dhts:
                dht.shutdown()
        assert not any(d.is_alive() for d in self.dhts)
        wait_for(lambda: not _live(self.pids), 10, "the DHT processes and p2p daemons to exit", poll=0.2)


def _leader_ids(leases) -> set:
    return {lease.leader().peer_id if lease.leader() is not None else None for lease in leases}


def _agreed(leases, *, other_than: str | None = None) -> str | None:
    ids = _leader_ids(leases)
    if len(ids) == 1 and None not in ids and other_than not in ids:
        return next(iter(ids))
    return None


def test_leaders_per_region_agree_and_fail_over_when_the_leader_dies():
    ttl = 3.0
    with ExitStack() as stack:
        world = World("lead", stack)
        eu = [world.peer("eu", ttl=ttl) for _ in range(3)]
        na_lease, _ = world.peer("na", ttl=ttl)
        for lease, _ in eu:
            lease.start()
        na_lease.start()
        eu_leases = [lease for lease, _ in eu]

        leader_id = wait_for(lambda: _agreed(eu_leases), 20, f"eu peers to agree on a leader: {_leader_ids(eu_leases)}",
                             poll=0.1)
        assert leader_id == eu_leases[0].peer_id  # started first: the smallest since
        assert sum(lease.is_leader() for lease in eu_leases) == 1
        wait_for(na_lease.is_leader, 10, "the na peer to lead its own region", poll=0.1)
        assert all(lease.leader().region == "eu" for lease in eu_leases)
        mine = eu_leases[0].leader()
        assert isinstance(mine, LeaseRecord) and mine.fingerprint == FP and mine.maddrs

        # the eu leader dies: no withdrawal, its DHT node goes away, its record must expire
        dead_lease, dead_dht = eu[0]
        dead_lease.stop()
        dead_dht.shutdown()
        died = time.monotonic()
        survivors = eu_leases[1:]
        new_id = wait_for(lambda: _agreed(survivors, other_than=leader_id), ttl + 12,
                          f"a new eu leader: {_leader_ids(survivors)}", poll=0.1)
        took = time.monotonic() - died
        print(f"failover took {took:.2f}s (ttl {ttl}s, renewal every 1s)")
        assert new_id == eu_leases[1].peer_id  # the next-oldest candidate
        assert sum(lease.is_leader() for lease in survivors) == 1
        assert na_lease.is_leader()  # other regions are not affected


def test_withdraw_hands_over_long_before_the_lease_expires():
    ttl = 20.0  # any handover within the wait below is due to the withdrawal, not to expiry
    with ExitStack() as stack:
        world = World("leadw", stack)
        a, _ = world.peer("eu", ttl=ttl)
        b, _ = world.peer("eu", ttl=ttl)
        a.start()
        b.start()
        wait_for(lambda: _agreed([a, b]) == a.peer_id, 15, f"a to lead: {_leader_ids([a, b])}", poll=0.1)
        withdrew = time.monotonic()
        assert a.withdraw()
        assert not a.is_leader()
        wait_for(lambda: _agreed([a, b]) == b.peer_id, ttl / 2, f"b to take over: {_leader_ids([a, b])}", poll=0.1)
        print(f"handover after withdraw took {time.monotonic() - withdrew:.2f}s (ttl {ttl}s)")
        assert b.is_leader() and not a.is_leader()


def test_lease_records_are_signed_and_schema_checked():
    with ExitStack() as stack:
        world = World("leads", stack)
        good_vals, bad_vals = (records.make_validators("leads", RSAPrivateKey()) for _ in range(2))
        good_dht, bad_dht = world._dht(world.maddrs, good_vals), world._dht(world.maddrs, bad_vals)
        now = records.get_dht_time()
        rec = LeaseRecord(region="eu", peer_id="good", since=now, expires=now + 30, fingerprint=FP, world_round=2,
                          maddrs=("/ip4/127.0.0.1/tcp/1",))
        assert records.publish_lease(good_dht, good_vals, "leads", rec, ttl=30)
        assert records.fetch_leases(bad_dht, "leads") == [rec]
        key = keys.leaders_key("leads")
        # a record that breaks the schema is refused; so is a write into another peer's subkey
        malformed = dict(rec.to_wire(), peer_id="bad", since=-1.0)
        assert not bad_dht.store(key, malformed, expiration_time=now + 30, subkey=records.owner_subkey(bad_vals))
        forged = dict(rec.to_wire(), since=0.0)
        assert not bad_dht.store(key, forged, expiration_time=now + 31, subkey=records.owner_subkey(good_vals))
        assert records.fetch_leases(good_dht, "leads") == [rec]
