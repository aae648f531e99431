"""A member whose anchor went stale takes the region's current one (peer.joining.resync_anchor).

Every member of a round must hold the same anchor: the reference of the K attention and of the
outer step, and the model a late joiner downloads. A member whose last round failed on its side
only, or that the region went ahead of, downloads the region's agreed model again and keeps its
own trained model; when nobody serves a newer state it downloads nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from worldlm_p2p.codec import ServedState, state_digest
from worldlm_p2p.config import AggregationConfig
from worldlm_p2p.peer.joining import resync_anchor
from worldlm_p2p.peer.state import RegionState
from worldlm_p2p.peer.stats import PeerStats
from worldlm_p2p.rounds import RoundRule
from worldlm_p2p.split import split_parameters

NAMES = ["embed.weight", "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight", "layers.0.mlp.weight"]
RULE = RoundRule.from_config(AggregationConfig(), split_parameters(NAMES, "kv"), seed=0)


@dataclass
class _Record:
    peer_id: str
    state_round: int
    state_digest: str
    finished: bool = False
    reachability: str = "direct"


@dataclass
class _Server:
    served: ServedState | None
    downloads: list = field(default_factory=list)

    def download_verified(self, *, timeout, fetch_others, admitted):
        self.downloads.append(timeout)
        return self.served


class _Member:
    usage = None  # (no token counts: aggregation.usage_rows is off)

    def __init__(self, params):
        self._params = params

    def params(self):
        return [t.clone() for t in self._params]


def _setup(*, my_round: int, served_round: int, same: bool = False):
    old = [torch.zeros(2), torch.zeros(2, 2), torch.zeros(2), torch.zeros(3)]
    new = [t + 1.0 for t in old]
    own = [t + 0.5 for t in old]
    state = RegionState(anchor=old, border_delta=None)
    state.momentum = None
    stats = PeerStats()
    stats.round = my_round
    served = ServedState(round=served_round, world_round=-1, agreed=old if same else new,
                         momentum=[torch.full((2,), 7.0)])
    server = _Server(served)
    records = [_Record("b", served_round, state_digest(served.agreed)),
               _Record("c", served_round, state_digest(served.agreed))]
    parts = dict(config=SimpleNamespace(join_state_timeout=5.0), rule=RULE, member=_Member(own), state=state,
                 stats=stats, server=server, fetch_others=lambda: records)
    return parts, state, server, new, own


def test_a_member_whose_round_failed_here_takes_the_regions_newer_agreed_model_and_keeps_its_own():
    parts, state, server, new, own = _setup(my_round=4, served_round=4)
    assert resync_anchor(0, "its last round failed here", **parts)
    assert len(server.downloads) == 1
    for a, b in zip(state.anchor, new):
        assert torch.equal(a, b)
    assert torch.equal(state.momentum[0], torch.full((2,), 7.0))
    # the member's own model is its contribution: untouched
    for a, b in zip(parts["member"].params(), own):
        assert torch.equal(a, b)


def test_nothing_newer_served_means_no_download_and_the_anchor_is_kept():
    # every member failed the round: they all serve the state of the round before this peer's own
    parts, state, server, _, _ = _setup(my_round=4, served_round=3)
    before = [t.clone() for t in state.anchor]
    assert not resync_anchor(0, "its last round failed here", **parts)
    assert server.downloads == []
    for a, b in zip(state.anchor, before):
        assert torch.equal(a, b)


def test_the_same_agreed_model_as_this_peers_anchor_is_not_downloaded_again():
    parts, state, server, _, _ = _setup(my_round=4, served_round=4, same=True)
    assert not resync_anchor(0, "its last round failed here", **parts)
    assert server.downloads == []


def test_a_peer_the_region_went_ahead_of_downloads_even_a_same_digest_state():
    # (missed > 0: the round number moves, so the served state is taken for its momentum too)
    parts, state, server, _, _ = _setup(my_round=6, served_round=6, same=True)
    assert resync_anchor(2, "the region went ahead", **parts)
    assert len(server.downloads) == 1


def test_outbound_only_peers_serve_nothing_so_their_records_ask_for_no_download():
    # (found in the swarm: a member waited its whole download timeout for an outbound-only region mate)
    parts, state, server, _, _ = _setup(my_round=6, served_round=6)
    records = parts["fetch_others"]()
    for r in records:
        r.reachability = "outbound"
    assert not resync_anchor(2, "the region went ahead", **parts)
    assert server.downloads == []


def test_a_member_whose_anchor_is_not_the_groups_drops_the_round():
    """The payload is each member's change since its own anchor, so a member applies the group's
    average only when its anchor is the one most of the group gathered (peer.region_round)."""
    from worldlm_p2p.peer.region_round import anchor_disagreement

    same = {"a": dict(anchor="x"), "b": dict(anchor="x"), "c": dict(anchor="x")}
    assert anchor_disagreement(same, "x") == ""
    stale = {"a": dict(anchor="x"), "b": dict(anchor="x"), "c": dict(anchor="old")}
    assert anchor_disagreement(stale, "x") == ""  # (the majority applies it: the old average of models)
    assert "is not the group's (x, held by 2 of 3)" in anchor_disagreement(stale, "old")
    # a tie: one side applies the round, the other drops it, whatever order the group gathered in;
    # the anchor whose holders adopted more world rounds wins, then the greater digest
    tie = {"a": dict(anchor="x", world=3), "b": dict(anchor="y", world=3)}
    assert anchor_disagreement(tie, "y") == ""
    assert "none by a majority; the tie went to y" in anchor_disagreement(tie, "x")
    assert anchor_disagreement(dict(reversed(tie.items())), "y") == ""
    newer = {"a": dict(anchor="x", world=4), "b": dict(anchor="y", world=3)}
    assert anchor_disagreement(newer, "x") == "" and "tie went to x" in anchor_disagreement(newer, "y")
    # ... but first an anchor that a reachable member holds: the other side downloads it
    behind_nat = {"a": dict(anchor="x", world=4, outbound=True), "b": dict(anchor="y", world=3, outbound=False)}
    assert anchor_disagreement(behind_nat, "y") == "" and "tie went to y" in anchor_disagreement(behind_nat, "x")
    three = {"a": dict(anchor="x"), "b": dict(anchor="y"), "c": dict(anchor="z", world="junk")}
    assert [anchor_disagreement(three, d) == "" for d in "xyz"] == [False, False, True]
    # members that sent no digest (or garbage) are not counted
    assert anchor_disagreement({"a": dict(anchor="x"), "b": {}, "c": "junk", "d": dict(anchor=5)}, "x") == ""


def test_a_joiner_whose_live_region_mates_serve_nothing_does_not_wait_for_a_download():
    """Late join: the region has run rounds, but its only live peer is outbound-only (it serves
    nothing): the joiner starts from the common initialisation at once, asking nobody (it used to
    wait the whole join timeout for a server that could not exist)."""
    from worldlm_p2p.config import PeerConfig
    from worldlm_p2p.peer.joining import late_join

    server = _Server(served=None)
    outbound = SimpleNamespace(peer_id="b", finished=False, rounds_completed=0, round=3, state_digest="",
                               reachability="outbound")
    kw = dict(config=PeerConfig(region="eu", data="x"), rule=RULE, member=_Member([torch.zeros(2)]),
              state=RegionState(anchor=[torch.zeros(2)], border_delta=None), stats=PeerStats(), server=server,
              trace=lambda *a: None)
    late_join(others=[outbound], **kw)
    assert server.downloads == []
    # a directly reachable peer that serves its state is asked
    direct = SimpleNamespace(peer_id="c", finished=False, rounds_completed=2, round=3, state_digest="d1",
                             reachability="direct")
    late_join(others=[outbound, direct], **kw)
    assert len(server.downloads) == 1


def test_a_group_of_at_most_half_the_members_that_waited_does_not_move_the_anchor():
    """Two halves of a region that each moved the anchor would hold two anchors, and groups mixing
    them would drop every round; so a group holding at most half of the members that waited (as the
    group's members gathered it, their lower median, at most the target group size) moves its
    members' models only (peer.region_round.minority_group)."""
    from worldlm_p2p.peer.region_round import minority_group

    def g(*expected):
        return {f"p{i}": dict(expected=e) for i, e in enumerate(expected)}

    assert minority_group(g(4, 4), group_size=2, target=64) == 4  # 2 of 4: a half
    assert minority_group(g(4, 4, 4), group_size=3, target=64) is None  # 3 of 4: a majority
    assert minority_group(g(2, 2), group_size=2, target=64) is None  # the whole region of 2
    assert minority_group(g(3, 3), group_size=2, target=64) is None  # 2 of 3
    assert minority_group(g(5, 5), group_size=2, target=64) == 5
    # one member's count cannot hold the group's anchor: the lower median decides
    assert minority_group(g(3, 64), group_size=2, target=64) is None
    assert minority_group(g(3, 3, 64), group_size=3, target=64) is None
    assert minority_group(g(8, 8), group_size=2, target=4) == 4  # at most the target group size
    assert minority_group(g(8, 8, 8), group_size=3, target=4) is None
    # members that gathered no count, or garbage, are not counted; none at all: no decision
    assert minority_group({"a": {}, "b": "junk", "c": dict(expected=True)}, group_size=2, target=64) is None
    assert minority_group({"a": dict(expected=6), "b": dict(expected="6")}, group_size=3, target=64) == 6
    assert minority_group(g(4, 4), group_size=0, target=64) is None


def test_a_resync_to_a_state_that_adopted_world_rounds_counts_them_as_adopted():
    """The served agreed model holds the world changes its server adopted: a member that takes it as
    its anchor has them too, and must not adopt them again (their delta would count twice, and its
    anchor would be nobody's: found in CI, a joiner's region of two then dropped every round)."""
    import dataclasses

    parts, state, server, new, _ = _setup(my_round=15, served_round=15)
    server.served = dataclasses.replace(server.served, world_round=0)
    assert parts["stats"].world_round == -1
    assert resync_anchor(1, "the region went ahead", **parts)
    assert parts["stats"].world_round == 0
    # a state that adopted fewer world rounds than this peer does not take its count back
    parts, state, server, new, _ = _setup(my_round=15, served_round=15)
    parts["stats"].world_round = 2
    server.served = dataclasses.replace(server.served, world_round=1)
    assert resync_anchor(1, "the region went ahead", **parts)
    assert parts["stats"].world_round == 2
