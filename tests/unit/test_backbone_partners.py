"""A swarm member's side of backbone partners (``region_backbone = "partners"``): which mates'
contributions it takes, and which it leaves out (a fake averager stands in for hivemind's; the
network path is tested in tests/network/test_swarm_simulator_equivalence.py)."""

import math
import types

import torch

from worldlm_p2p.config import AveragingConfig
from worldlm_p2p.net.averaging import RoundResult
from worldlm_p2p.net.robust_allreduce import RoundReport
from worldlm_p2p.peer.region_round import RegionRound
from worldlm_p2p.rounds import RoundRule
from worldlm_p2p.split import split_parameters

NAMES = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "lm_head.weight"]
SPLIT = split_parameters(NAMES, "embed_head")  # backbone = (1,)
ANCHOR = [torch.zeros(4, 2), torch.zeros(3, 3), torch.zeros(4, 2)]


class _FakeAverager:
    def __init__(self, served: dict) -> None:
        self.peer_id = "me"
        self.served = served  # peer -> list of answers, one per download (the last repeats)
        self.asked: list[str] = []

    def download_contribution_from(self, peer: str, *, timeout: float):
        self.asked.append(peer)
        answers = self.served[peer]
        return answers.pop(0) if len(answers) > 1 else answers[0]


def _round(served: dict, *, cap: int = 6, round_index: int = 7) -> RegionRound:
    rr = RegionRound.__new__(RegionRound)  # only what fetch_mates reads
    rr.rule = RoundRule.of(SPLIT, region_backbone="partners", partner_candidates=cap)
    rr.averaging = AveragingConfig(request_timeout=0.2, matchmaking_time=0.5, averaging_timeout=1.0)
    rr.averager = _FakeAverager(served)
    rr.stats = types.SimpleNamespace(round=round_index)
    rr.stopping = lambda: False
    return rr


def test_a_member_takes_the_mates_that_serve_this_rounds_change_and_leaves_out_the_others(caplog) -> None:
    good = [torch.full((3, 3), 0.5, dtype=torch.float16)]
    meta = {"round": 7, "anchor": "abc"}
    served = {
        "good": [(meta, good)],
        "late": [None, ({"round": 6, "anchor": "abc"}, good), (meta, [torch.ones(3, 3)])],  # catches up
        "other-anchor": [({"round": 7, "anchor": "xyz"}, good)],
        "ahead": [({"round": 8, "anchor": "abc"}, good)],
        "nan": [(meta, [torch.full((3, 3), math.nan)])],
        "shape": [(meta, [torch.zeros(2, 3)])],
        "silent": [None],
    }
    gathered = {p: {"label": f"L-{p}"} for p in served} | {"me": {"label": "me"}, "relay": {"relay": True},
                                                            "outbound": {"label": "o", "outbound": True}}
    result = RoundResult(ok=True, group_size=len(gathered) - 1, gathered=gathered, averaged=[])
    rr = _round(served, cap=16)
    with caplog.at_level("WARNING"):
        mates = rr.fetch_mates(result, anchor=ANCHOR, digest="abc")
    assert sorted(mates) == ["good", "late"]
    assert mates["good"][0].dtype == torch.float32 and torch.equal(mates["good"][0], torch.full((3, 3), 0.5))
    assert torch.equal(mates["late"][0], torch.ones(3, 3))
    assert not {"me", "relay", "outbound"} & set(rr.averager.asked)  # (an outbound-only mate serves nothing)
    text = caplog.text
    for peer in ("other-anchor", "ahead", "nan", "shape", "silent"):
        assert f"left out {peer} ('L-{peer}') as a backbone partner" in text, peer
    assert "serves round 8 already" in text and "not finite" in text and "shape" in text


def test_a_member_asks_only_the_window_of_mates_for_this_round() -> None:
    meta = {"round": 3, "anchor": "abc"}
    served = {f"m{i}": [(meta, [torch.zeros(3, 3)])] for i in range(5)}
    gathered = {p: {} for p in served} | {"me": {}}
    result = RoundResult(ok=True, group_size=6, gathered=gathered, averaged=[])
    rr = _round(served, cap=2, round_index=3)  # windows of 2 over 5 mates: round 3 starts at 6 % 5 = 1
    mates = rr.fetch_mates(result, anchor=ANCHOR, digest="abc")
    assert sorted(mates) == ["m1", "m2"] and rr.averager.asked == ["m1", "m2"]


def test_a_mate_the_robust_rule_caught_in_this_round_is_not_a_partner(caplog) -> None:
    """A member that scales its change is clipped in the region's average; taken as half of a pair
    it would come in whole (a larger step can look good on a slice early in training): a sender
    this peer's reducer caught, or a reducer that failed it, is never asked for its change."""
    meta = {"round": 7, "anchor": "abc"}
    served = {p: [(meta, [torch.full((3, 3), 0.5)])] for p in ("honest", "scaled", "bad-reducer")}
    gathered = {p: {"label": p} for p in served} | {"me": {"label": "me"}}
    report = RoundReport(caught={"scaled": "100% of its values lay beyond the clip"},
                         bad_reducers={"bad-reducer": "sent a part that is not the average"})
    result = RoundResult(ok=True, group_size=4, gathered=gathered, averaged=[], report=report)
    rr = _round(served)
    with caplog.at_level("WARNING"):
        mates = rr.fetch_mates(result, anchor=ANCHOR, digest="abc")
    assert sorted(mates) == ["honest"] and rr.averager.asked == ["honest"]
    assert "left out scaled ('scaled') as a backbone partner: the robust rule caught it" in caplog.text
    # (a reducer that failed the round is named as such: the robust rule did not catch it)
    assert "left out bad-reducer ('bad-reducer') as a backbone partner: it failed this round as a reducer" in caplog.text


def test_a_mate_that_serves_another_change_than_it_sent_is_left_out_and_struck(caplog) -> None:
    """This peer's reducer kept a sample of what each mate sent into the all-reduce (positions in the
    payload, the backbone first); a mate whose served change disagrees there is left out, and the
    round counts against it as against a sender the robust rule caught (banned after ``ban_after``)."""
    from worldlm_p2p.peer.region_round import Strikes

    meta = {"round": 7, "anchor": "abc"}
    served = {p: [(meta, [torch.full((3, 3), 0.5, dtype=torch.float16)])] for p in ("honest", "liar", "unsampled")}
    gathered = {p: {"label": p} for p in served} | {"me": {"label": "me"}}
    seen = {"honest": (torch.tensor([1, 2, 9, 12]), torch.tensor([0.5, 0.5, 7.0, -3.0])),  # 9, 12: key layers
            "liar": (torch.tensor([0, 4, 8]), torch.tensor([0.5, 0.25, 0.5]))}
    result = RoundResult(ok=True, group_size=4, gathered=gathered, averaged=[], report=RoundReport(seen=seen))
    rr = _round(served)
    wrong: dict = {}
    with caplog.at_level("WARNING"):
        mates = rr.fetch_mates(result, anchor=ANCHOR, digest="abc", codecs=["fp16", "fp16", "fp16"], wrong=wrong)
    assert sorted(mates) == ["honest", "unsampled"]
    assert list(wrong) == ["liar"] and "differs from what it sent" in wrong["liar"]
    assert "left out liar ('liar') as a backbone partner: what it served differs" in caplog.text
    # without the payload's codecs (no partners in this round) nothing is compared
    assert sorted(_round(served).fetch_mates(result, anchor=ANCHOR, digest="abc")) == ["honest", "liar", "unsampled"]

    emitted, banned = [], []
    rr.events = types.SimpleNamespace(emit=lambda kind, **kw: emitted.append((kind, kw)))
    rr.strikes = Strikes(ban_after=2)
    rr.averager.set_banned = lambda peers: banned.append(sorted(peers))
    rr.judge(result, served_wrong=wrong)
    assert rr.strikes.counts == {"liar": 1} and banned == []
    assert ("caught", dict(round=7, peer="liar", why=wrong["liar"], role="partner")) in emitted
    rr.judge(result, served_wrong=wrong)
    assert banned == [["liar"]] and ("banned", dict(round=7, peer="liar")) in emitted
