"""The spot check of what a mate serves (backbone partners) against what it sent into the round:
the pure comparison (:func:`worldlm_p2p.rounds.served_mismatch`) against hand-made values, and the
sample a robust reducer keeps of every sender's parts (:class:`RobustPartReducer`), which must be
the values it aggregated, at the positions they hold in the group's vector."""

import asyncio

import pytest
import torch

from worldlm_p2p import compression
from worldlm_p2p.net.robust_allreduce import RobustPartReducer, RobustSettings
from worldlm_p2p.rounds import SERVED_TOLERANCE, served_mismatch

SERVED = [torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([10.0, 20.0, 30.0])]  # 4 + 3 values


def test_a_served_change_that_agrees_where_the_reducer_looked_passes() -> None:
    seen = (torch.tensor([0, 3, 4, 6]), torch.tensor([1.0, 4.0, 10.0, 30.0]))
    assert served_mismatch(SERVED, seen, codecs=["fp16", "fp16"]) == ""
    # positions beyond the backbone (the key layers, the denominators) are not compared
    assert served_mismatch(SERVED, (torch.tensor([7, 40]), torch.tensor([5.0, -1.0])), codecs=["none", "none"]) == ""
    assert served_mismatch(SERVED, (torch.tensor([], dtype=torch.int64), torch.tensor([])), codecs=["fp16"] * 2) == ""


def test_one_value_off_in_an_exact_codec_is_caught_and_named_by_tensor() -> None:
    seen = (torch.tensor([0, 5]), torch.tensor([1.0, 20.001]))  # position 5 is tensor 1's second value
    why = served_mismatch(SERVED, seen, codecs=["fp16", "fp16"])
    assert "backbone tensor 1" in why and "at 1 positions" in why
    seen = (torch.tensor([2]), torch.tensor([float("nan")]))
    assert "backbone tensor 0" in served_mismatch(SERVED, seen, codecs=["none", "none"])


def test_int8_is_compared_within_its_quantisation_and_a_scaled_change_is_not() -> None:
    g = torch.Generator().manual_seed(0)
    change = torch.randn(5000, generator=g) * 0.01
    per_tensor = compression.roundtrip(change, "int8")  # what the mate serves
    per_part = torch.cat([compression.roundtrip(p, "int8") for p in change.split(1200)])  # as the all-reduce carries it
    at = torch.randperm(5000, generator=g)[:500]
    rel = float((per_tensor[at] - per_part[at]).square().mean().sqrt() / per_part[at].square().mean().sqrt())
    assert rel < SERVED_TOLERANCE["int8"] / 3, rel
    assert served_mismatch([per_tensor], (at, per_part[at]), codecs=["int8"]) == ""
    assert "relative difference" in served_mismatch([2.0 * per_tensor], (at, per_part[at]), codecs=["int8"])
    other = compression.roundtrip(torch.randn(5000, generator=g) * 0.01, "int8")  # an honest-looking other change
    assert served_mismatch([other], (at, per_part[at]), codecs=["int8"]) != ""


def test_positions_and_values_must_pair_up() -> None:
    with pytest.raises(ValueError, match="positions"):
        served_mismatch(SERVED, (torch.tensor([0, 1]), torch.tensor([1.0])), codecs=["fp16", "fp16"])


def test_a_reducer_keeps_a_sample_of_each_senders_parts_at_their_places_in_the_vector() -> None:
    """Two pieces of 300 and 200 values starting at 1000 and 1300 of the group's vector, three
    senders: every kept value is what that sender sent at that position, spread over both pieces,
    about ``samples`` of them, at the same positions for every sender; a sender dropped from a
    piece has nothing kept of it there."""
    g = torch.Generator().manual_seed(3)
    full = [torch.randn(1600, generator=g) for _ in range(3)]  # each sender's whole vector
    shapes, offsets = [torch.Size([300]), torch.Size([20, 10])], [1000, 1300]

    async def run() -> RobustPartReducer:
        red = RobustPartReducer(shapes, 3, settings=RobustSettings(rule="clip", clip=4.0), part_offsets=offsets,
                                samples=100)
        for piece, (shape, start) in enumerate(zip(shapes, offsets)):
            n = shape.numel()
            await asyncio.gather(*[red.accumulate_part(i, piece, full[i][start:start + n].reshape(shape), weight=1.0)
                                   for i in range(3)])
        return red

    red = asyncio.run(run())
    kept = [red.seen(i) for i in range(3)]
    for i, (pos, val) in enumerate(kept):
        assert torch.equal(val, full[i][pos])
        assert 100 <= pos.numel() <= 102 and len(set(pos.tolist())) == pos.numel()
        assert bool(((pos >= 1000) & (pos < 1500)).all())
        assert bool((pos < 1300).any()) and bool((pos >= 1300).any())
        assert torch.equal(pos, kept[0][0])

    async def without_offsets() -> None:  # (no place in the vector): it keeps nothing
        red = RobustPartReducer(shapes[:1], 1, settings=RobustSettings())
        await red.accumulate_part(0, 0, full[0][:300], weight=1.0)
        assert red.seen(0) is None

    asyncio.run(without_offsets())


# ---------------------------------------------------------------- the whole vector: the round's average


def _rule(**kw):
    from worldlm_p2p.rounds import RoundRule
    from worldlm_p2p.split import split_parameters

    names = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "lm_head.weight"]
    return RoundRule.of(split_parameters(names, "embed_head"), **kw)


def test_the_served_changes_give_the_rounds_weighted_mean_by_hand() -> None:
    from worldlm_p2p.rounds import served_average_mismatch

    rule = _rule(robust="mean")
    served = [[torch.tensor([1.0, 2.0])], [torch.tensor([3.0, 4.0])], [torch.tensor([5.0, 6.0])]]
    weights = [1.0, 1.0, 2.0]  # mean: [(1 + 3 + 10) / 4, (2 + 4 + 12) / 4]
    assert served_average_mismatch(rule, served, weights, averaged=[torch.tensor([3.5, 4.5])], codecs=["fp16"],
                                   max_weight=None) == ""
    lied = [served[0], [torch.tensor([3.0, 5.0])], served[2]]  # one value of one mate
    why = served_average_mismatch(rule, lied, weights, averaged=[torch.tensor([3.5, 4.5])], codecs=["fp16"],
                                  max_weight=None)
    assert "backbone tensor 0" in why
    # the weight cap counts as in the all-reduce: capped at 1, the third weighs as much as the others
    assert served_average_mismatch(rule, served, weights, averaged=[torch.tensor([3.0, 4.0])], codecs=["fp16"],
                                   max_weight=1.0) == ""
    # 8 bits are applied part by part in the all-reduce: not comparable, nothing is said
    assert served_average_mismatch(rule, lied, weights, averaged=[torch.tensor([3.5, 4.5])], codecs=["int8"],
                                   max_weight=None) == ""


def test_the_robust_rule_is_applied_as_in_the_all_reduce() -> None:
    """Under the default rule (clip around the median) the pure round's average of the same changes
    (:func:`worldlm_p2p.rounds.group_average`) passes; a mate's served change scaled or swapped for
    another fails, though the clip bounds what it moves."""
    from worldlm_p2p import compression
    from worldlm_p2p.rounds import group_average, served_average_mismatch

    rule = _rule()
    g = torch.Generator().manual_seed(5)
    changes = [[torch.randn(40, 30, generator=g) * 0.01, torch.randn(500, generator=g) * 0.01] for _ in range(4)]
    weights = [640.0, 640.0, 300.0, 640.0]
    codecs = ["fp16", "fp16"]
    served = [compression.roundtrip_all(c, codecs) for c in changes]
    averaged = group_average(rule, changes, weights, max_weight=640.0, codecs=codecs)
    assert served_average_mismatch(rule, served, weights, averaged=averaged, codecs=codecs, max_weight=640.0) == ""
    for bad in ([2 * t for t in served[1]], served[3], [served[1][0], served[1][1] + 0.003]):
        lied = [served[0], bad, served[2], served[3]]
        assert served_average_mismatch(rule, lied, weights, averaged=averaged, codecs=codecs, max_weight=640.0)


def test_check_average_drops_the_pairs_of_a_round_whose_served_changes_do_not_give_its_average(caplog) -> None:
    import types

    from worldlm_p2p.net.averaging import RoundResult
    from worldlm_p2p.net.robust_allreduce import RobustSettings, RoundReport
    from worldlm_p2p.peer.region_round import RegionRound

    rr = RegionRound.__new__(RegionRound)
    rr.rule = _rule(robust="mean")
    rr.averager = types.SimpleNamespace(peer_id="me", robust=RobustSettings(rule="mean", max_weight=None))
    rr.stats = types.SimpleNamespace(round=4)
    own = [torch.tensor([1.0, 2.0])]
    mates = {"a": [torch.tensor([3.0, 4.0])], "b": [torch.tensor([5.0, 6.0])]}
    gathered = {"me": {"weight": 1.0}, "a": {"weight": 1.0}, "b": {"weight": 2.0}, "r": {"relay": True}}
    averaged = [torch.tensor([3.5, 4.5]), torch.tensor([9.0])]  # the backbone's, then a key layer's

    def check(result, m=mates):
        return rr.check_average(result, own=own, mates=m, codecs=["fp16", "fp16"])

    ok = RoundResult(ok=True, group_size=3, gathered=gathered, averaged=averaged)
    assert check(ok) == (mates, "agrees")
    with caplog.at_level("WARNING"):
        assert check(ok, {"a": mates["a"], "b": [torch.tensor([5.0, 7.0])]}) == ({}, "differs")
    assert "do not give the round's average" in caplog.text
    # cannot be told: a mate that served nothing, a sender dropped, a weight unknown
    assert check(ok, {"a": mates["a"]}) == ({"a": mates["a"]}, "")
    dropped = RoundResult(ok=True, group_size=3, gathered=gathered, averaged=averaged,
                          report=RoundReport(dropped=("b",)))
    assert check(dropped) == (mates, "")
    unknown = RoundResult(ok=True, group_size=3, gathered=gathered | {"b": {"weight": "x"}}, averaged=averaged)
    assert check(unknown) == (mates, "")
