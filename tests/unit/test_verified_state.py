"""A joiner's download of its region's model is checked against what the region's members publish
(:meth:`worldlm_p2p.peer.serving.StateServer.download_verified`): the (round, digest) most live
members publish wins, and a donor that serves another model than it publishes is refused."""

from types import SimpleNamespace

import torch

from worldlm_p2p.codec import ServedState, state_digest
from worldlm_p2p.peer.serving import StateServer
from worldlm_p2p.peer.state import RegionState
from worldlm_p2p.peer.stats import PeerStats
from worldlm_p2p.rounds import RoundRule
from worldlm_p2p.split import split_parameters

SPLIT = split_parameters(["embed.weight", "layers.0.self_attn.k_proj.weight"], "kv")


class FakeAverager:
    """Serves, per peer id, a (meta, tensors) pair, as hivemind's state download would."""

    def __init__(self, served: dict) -> None:
        self.served, self.asked = served, []

    def download_state_from(self, peer_id, *, timeout):
        self.asked.append(peer_id)
        return self.served.get(peer_id)

    def set_shared_state(self, **kw):
        pass


def _served(model, round_):
    meta, tensors = ServedState(round=round_, world_round=-1, agreed=model).encode()
    return dict(meta, fingerprint="fp", round=round_), tensors


def _record(peer, round_, digest):
    return SimpleNamespace(peer_id=peer, finished=False, state_round=round_, state_digest=digest, reachability="direct")


def test_the_majoritys_model_is_taken_and_a_lying_donor_refused():
    template = [torch.zeros(3), torch.zeros(2, 2)]
    good = [torch.ones(3), torch.ones(2, 2)]
    bad = [torch.full((3,), 7.0), torch.ones(2, 2)]
    averager = FakeAverager({"liar": _served(bad, 5), "a": _served(good, 5), "b": _served(good, 5),
                             "absurd": _served(bad, 10 ** 9)})
    server = StateServer(averager=averager, state=RegionState(anchor=template, border_delta=None), stats=PeerStats(),
                         rule=RoundRule.of(SPLIT), fingerprint="fp")
    d = state_digest(good)
    # the liar publishes the honest digest but serves another model; one claims an absurd round
    records = [_record("liar", 5, d), _record("a", 5, d), _record("b", 5, d),
               _record("absurd", 10 ** 9, state_digest(bad))]
    got = server.download_verified(timeout=5.0, fetch_others=lambda: records)
    assert got is not None and got.round == 5 and state_digest(got.agreed) == d
    assert "absurd" not in averager.asked
    if averager.asked[0] == "liar":
        assert averager.asked[1] in ("a", "b")


def test_nothing_verified_means_nothing_taken():
    template = [torch.zeros(3)]
    averager = FakeAverager({"liar": _served([torch.ones(3)], 2)})
    server = StateServer(averager=averager, state=RegionState(anchor=template, border_delta=None), stats=PeerStats(),
                         rule=RoundRule.of(SPLIT, strategy="fedavg"), fingerprint="fp")
    records = [_record("liar", 2, state_digest([torch.zeros(3)]))]
    assert server.download_verified(timeout=1.5, fetch_others=lambda: records) is None


def test_digest_covers_values_dtypes_and_shapes():
    a = [torch.arange(6.0).reshape(2, 3)]
    assert state_digest(a) == state_digest([t.clone() for t in a])
    assert state_digest(a) != state_digest([a[0].reshape(3, 2)])
    assert state_digest(a) != state_digest([a[0].double()])
    b = [a[0].clone()]
    b[0][1, 2] += 1e-6
    assert state_digest(a) != state_digest(b)


def test_an_outbound_only_member_is_never_asked_for_the_regions_model():
    # (an outbound-only peer serves nothing: asking it would only wait out the timeout)
    template = [torch.zeros(3)]
    good = [torch.ones(3)]
    averager = FakeAverager({"out": _served(good, 2)})
    server = StateServer(averager=averager, state=RegionState(anchor=template, border_delta=None), stats=PeerStats(),
                         rule=RoundRule.of(SPLIT, strategy="fedavg"), fingerprint="fp")
    rec = _record("out", 2, state_digest(good))
    rec.reachability = "outbound"
    assert server.download_verified(timeout=1.0, fetch_others=lambda: [rec]) is None
    rec.reachability = "direct"
    assert server.download_verified(timeout=5.0, fetch_others=lambda: [rec]) is not None
