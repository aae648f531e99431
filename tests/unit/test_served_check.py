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
