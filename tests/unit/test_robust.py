"""The robust rule against hand-computed values (:mod:`worldlm_p2p.robust`)."""

from __future__ import annotations

import math

import pytest
import torch

from worldlm_p2p import robust
from worldlm_p2p.aggregation import weighted_mean


def t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_hand_computed_clip_of_three():
    # coordinate 0: values 0, 1, 10 -> centre 1, deviations 1, 0, 9 -> spread 1; clip 4: [-3, 5]
    #   -> 0, 1, 5 with weights 1, 1, 2 -> (0 + 1 + 10) / 4 = 2.75
    # coordinate 1: values 2, 2, 2 -> nothing clipped -> 2
    agg = robust.robust_mean(t([0.0, 2.0], [1.0, 2.0], [10.0, 2.0]), [1.0, 1.0, 2.0], clip=4.0)
    assert agg.value.tolist() == pytest.approx([2.75, 2.0])
    assert agg.clipped == (0.0, 0.0, 0.5)
    assert agg.nonfinite == (0.0, 0.0, 0.0)
    assert robust.caught(agg) == {}  # half its values: not above the default 0.5
    assert robust.caught(agg, clipped_above=0.4) == {2: "50% of its values beyond the clip"}


def test_even_count_uses_the_middle_pair_and_two_senders_are_the_weighted_mean():
    # four values 0, 1, 3, 100: centre (1 + 3) / 2 = 2, deviations 2, 1, 1, 98 -> spread 1.5;
    # clip 2: [-1, 5] -> 0, 1, 3, 5 -> mean 2.25
    agg = robust.robust_mean(t([0.0], [1.0], [3.0], [100.0]), [1.0] * 4, clip=2.0)
    assert agg.value.item() == pytest.approx(2.25)
    g = torch.Generator().manual_seed(0)
    two = torch.randn(2, 50, generator=g)
    got = robust.robust_mean(two, [3.0, 1.0], clip=1.0).value
    want = weighted_mean([[two[0]], [two[1]]], [3.0, 1.0])[0]
    torch.testing.assert_close(got, want.to(torch.float32))


def test_no_clipping_within_the_spread_gives_the_weighted_mean_and_mean_rule_never_clips():
    x = t([1.0, 0.0], [2.0, 1.0], [3.0, 2.0])  # deviations 1, 0, 1 -> spread 1, clip 4: nothing moves
    w = [1.0, 2.0, 3.0]
    want = [(1 + 4 + 9) / 6, (0 + 2 + 6) / 6]
    assert robust.robust_mean(x, w).value.tolist() == pytest.approx(want)
    far = t([1.0], [2.0], [1e6])
    assert robust.robust_mean(far, [1.0] * 3, rule="mean").value.item() == pytest.approx((3 + 1e6) / 3, rel=1e-6)


def test_weights_are_capped_and_a_weight_claim_does_not_move_the_centre():
    x = t([0.0], [1.0], [2.0])
    agg = robust.robust_mean(x, [1.0, 1.0, 1e9], max_weight=2.0)
    assert agg.weights == (1.0, 1.0, 2.0)
    assert agg.value.item() == pytest.approx((0 + 1 + 4) / 4)


def test_nonfinite_values_take_no_part_in_their_coordinate():
    # coordinate 0: NaN from sender 2 -> mean of 1 and 3 (two left: no clipping) = 2
    # coordinate 1: all finite: 0, 1, 2 -> 1
    agg = robust.robust_mean(t([1.0, 0.0], [3.0, 1.0], [math.nan, 2.0]), [1.0] * 3)
    assert agg.value.tolist() == pytest.approx([2.0, 1.0])
    assert agg.nonfinite == (0.0, 0.0, 0.5)
    assert robust.caught(agg) == {2: "sent NaN/Inf"}
    inf_weight = robust.robust_mean(t([1.0], [3.0], [5.0]), [1.0, 1.0, math.inf])
    assert inf_weight.value.item() == pytest.approx(2.0) and inf_weight.nonfinite == (0.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="no finite value"):
        robust.robust_mean(t([math.nan], [math.inf]), [1.0, 1.0])


def test_a_minority_moves_the_result_at_most_the_bound_whatever_it_sends():
    g = torch.Generator().manual_seed(1)
    honest = torch.randn(3, 2000, generator=g) * 0.01 + 1.0
    for attack in (honest[0] * 1000, -honest[0], torch.randn(2000, generator=g) * 50):
        x = torch.cat([honest, attack.unsqueeze(0), attack.unsqueeze(0)])  # 2 of 5
        agg = robust.robust_mean(x, [1.0] * 5, clip=4.0)
        rng = honest.max(dim=0).values - honest.min(dim=0).values
        h = honest.mean(dim=0)
        assert bool(((agg.value.double() - h).abs() <= (4.0 + 1) * rng * 2 / 5 + 1e-6).all())
        assert set(robust.caught(agg)) == {3, 4}


def test_lists_keep_shapes_and_equal_the_flat_rule():
    a = [torch.ones(2, 3), torch.zeros(4)]
    b = [torch.ones(2, 3) * 3, torch.ones(4)]
    c = [torch.ones(2, 3) * 100, torch.ones(4) * 2]
    out, agg = robust.robust_mean_of_lists([a, b, c], [1.0, 1.0, 1.0], clip=1.0)
    assert [o.shape for o in out] == [torch.Size([2, 3]), torch.Size([4])]
    # first tensor: 1, 3, 100: centre 3, spread 2 -> clip to [1, 5] -> (1 + 3 + 5) / 3 = 3
    assert out[0].flatten().tolist() == pytest.approx([3.0] * 6)
    assert out[1].tolist() == pytest.approx([1.0] * 4)  # 0, 1, 2 -> 1
    with pytest.raises(ValueError, match="same shapes"):
        robust.robust_mean_of_lists([a, [torch.ones(3)]], [1.0, 1.0])


@pytest.mark.parametrize("bad", [dict(rule="median"), dict(clip=0.5), dict(max_weight=0.0)])
def test_bad_settings_say_why(bad):
    with pytest.raises(ValueError):
        robust.robust_mean(t([1.0], [2.0]), [1.0, 1.0], **bad)
