"""Pure aggregation math against hand-computed values."""

import pytest
import torch

from worldlm_p2p.aggregation import allreduce_traffic, outer_step, round_weight, weighted_mean


def test_weighted_mean_hand_computed():
    a = [torch.tensor([1.0, 2.0]), torch.tensor([[0.0]])]
    b = [torch.tensor([4.0, 8.0]), torch.tensor([[3.0]])]
    out = weighted_mean([a, b], [1, 2])  # (1*x + 2*y) / 3
    assert torch.allclose(out[0], torch.tensor([3.0, 6.0]))
    assert torch.allclose(out[1], torch.tensor([[2.0]]))
    assert out[0].dtype == torch.float32


def test_weighted_mean_order_invariant_and_identity():
    g = torch.Generator().manual_seed(0)
    states = [[torch.randn(5, generator=g)] for _ in range(4)]
    w = [3.0, 1.0, 7.0, 2.0]
    x = weighted_mean(states, w)[0]
    y = weighted_mean(states[::-1], w[::-1])[0]
    assert torch.allclose(x, y, atol=1e-6)
    assert torch.equal(weighted_mean(states[:1], [5.0])[0], states[0][0])
    # equal weights = plain mean
    assert torch.allclose(weighted_mean(states, [1] * 4)[0], torch.stack([s[0] for s in states]).mean(0), atol=1e-6)


@pytest.mark.parametrize("weights", [[0, 0], [-1, 2], [float("nan"), 1], [1]])
def test_weighted_mean_rejects_bad_weights(weights):
    with pytest.raises(ValueError):
        weighted_mean([[torch.zeros(1)], [torch.ones(1)]], weights)


def test_weighted_mean_rejects_shape_mismatch():
    with pytest.raises(ValueError):
        weighted_mean([[torch.zeros(2)], [torch.zeros(3)]], [1, 1])


def test_round_weight_and_outer_step():
    assert round_weight(1280) == 1280.0
    assert 0 < round_weight(0) < 1
    anchor, avg = [torch.tensor([0.0, 2.0])], [torch.tensor([2.0, 4.0])]
    assert torch.equal(outer_step(anchor, avg, 1.0)[0], avg[0])
    assert torch.allclose(outer_step(anchor, avg, 0.5)[0], torch.tensor([1.0, 3.0]))


def test_allreduce_traffic():
    assert allreduce_traffic(1000, 1) == (0, 0)
    assert allreduce_traffic(1000, 2) == (1000, 1000)  # send half, get half back, both ways
    assert allreduce_traffic(900, 3) == (1200, 1200)
    # two outbound-only members (hivemind's client mode) of a group of 3: the one reducer reduces the
    # whole vector from the two others and sends it back to both; each client sends and gets it all
    assert allreduce_traffic(900, 3, clients=2) == (1800, 1800)
    assert allreduce_traffic(900, 3, clients=2, client=True) == (900, 900)
    # 4 peers, one client: 3 reducers of 300 bytes each; a reducer sends 600 to the other reducers and
    # its span to 3 others (900), and receives as much
    assert allreduce_traffic(900, 4, clients=1) == (1500, 1500)
    assert allreduce_traffic(900, 1, clients=0, client=True) == (0, 0)
