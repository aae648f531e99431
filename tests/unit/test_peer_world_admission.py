"""Which leaders a world round waits for, where regions admit their peers: only leaders admitted
to the region they lead, whose lease is signed by their own key."""

from types import SimpleNamespace

from worldlm_p2p.net.records import LeaseRecord
from worldlm_p2p.peer.world import WorldRounds

FP = "fp"


def _lease(peer, region, *, since=1.0, signer="same"):
    return LeaseRecord(region=region, peer_id=peer, since=since, expires=4e9, fingerprint=FP,
                       signer=peer if signer == "same" else signer)


def _rounds(leases, admitted):
    w = WorldRounds.__new__(WorldRounds)  # the election view only: no DHT, no lease thread
    w.lease = SimpleNamespace(live=lambda: leases)  # (unexpired: 4e9)
    w.manifest = SimpleNamespace(fingerprint=lambda: FP)
    w.peer_id, w._run_admitted = "me", admitted
    return w


def test_leaders_a_world_round_waits_for():
    leases = [_lease("me", "eu", signer=None),  # this peer's own record (it knows itself)
              _lease("na-leader", "na"),
              _lease("mallory", "asia", since=0.5),  # not admitted anywhere
              _lease("eu-member", "xx"),  # admitted, but to eu: cannot lead region xx
              _lease("impostor", "sa", signer="someone-else")]  # admitted to sa, lease signed by another key
    admitted = {"me": "eu", "na-leader": "na", "eu-member": "eu", "impostor": "sa"}
    assert _rounds(leases, admitted).live_leaders() == 2  # eu and na
    assert _rounds(leases, None).live_leaders() == 5  # no region admits: every region with a lease
