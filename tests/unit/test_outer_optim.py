"""The outer optimizer of a round: FedAvg and DiLoCo's Nesterov, against hand values and torch.optim."""

import pytest
import torch

from worldlm_p2p.outer_optim import outer_update

T = torch.tensor


def test_sgd_lr_1_adopts_the_average():
    anchor = [T([1.0, -1.0]), T([[5.0]])]
    avg = [T([3.0, 1.0]), T([[-2.0]])]
    new, mom = outer_update(anchor, avg, None, kind="sgd", lr=1.0)
    assert mom is None
    assert all(torch.equal(n, a) for n, a in zip(new, avg, strict=True))
    new[0][0] = 99.0  # a copy, not an alias of the averaged tensors
    assert float(avg[0][0]) == 3.0
    assert outer_update(anchor, avg, None)[0][1].item() == -2.0  # sgd lr 1 is the default


def test_sgd_lr_half_hand_computed():
    anchor = [T([1.0, -1.0]), T([0.0, 2.0])]
    avg = [T([3.0, 1.0]), T([2.0, 4.0])]
    new, mom = outer_update(anchor, avg, None, kind="sgd", lr=0.5)
    # x - lr (x - m): 1 - 0.5 (1 - 3) = 2; -1 - 0.5 (-1 - 1) = 0; 0 - 0.5 (0 - 2) = 1; 2 - 0.5 (2 - 4) = 3
    assert mom is None
    assert torch.allclose(new[0], T([2.0, 0.0])) and torch.allclose(new[1], T([1.0, 3.0]))
    assert torch.equal(anchor[0], T([1.0, -1.0]))  # inputs untouched


def test_sgd_keeps_the_anchor_dtype():
    anchor = [T([1.0, 2.0], dtype=torch.float64)]
    avg = [T([2.0, 2.0], dtype=torch.float32)]
    for lr in (1.0, 0.5):
        assert outer_update(anchor, avg, None, kind="sgd", lr=lr)[0][0].dtype == torch.float64


def test_nesterov_hand_computed_two_steps():
    # lr 0.5, mu 0.5. Step 1: x = 1, m = 0 -> g = 1, buf = 1, x = 1 - 0.5 (1 + 0.5 * 1) = 0.25
    x, buf = outer_update([T([1.0])], [T([0.0])], None, kind="nesterov", lr=0.5, mu=0.5)
    assert torch.allclose(x[0], T([0.25])) and torch.allclose(buf[0], T([1.0]))
    # Step 2: m = 0 -> g = 0.25, buf = 0.5 * 1 + 0.25 = 0.75, x = 0.25 - 0.5 (0.25 + 0.5 * 0.75) = -0.0625
    x, buf = outer_update(x, [T([0.0])], buf, kind="nesterov", lr=0.5, mu=0.5)
    assert torch.allclose(x[0], T([-0.0625])) and torch.allclose(buf[0], T([0.75]))


@pytest.mark.parametrize("lr, mu", [(0.7, 0.9), (1.0, 0.5), (0.3, 0.0)])
def test_nesterov_equals_torch_sgd(lr, mu):
    g = torch.Generator().manual_seed(0)
    ours = [torch.randn(3, 2, generator=g), torch.randn(4, generator=g)]
    ref = [torch.nn.Parameter(p.clone()) for p in ours]
    opt = torch.optim.SGD(ref, lr=lr, momentum=mu, nesterov=True) if mu > 0 else torch.optim.SGD(ref, lr=lr)
    momentum = None
    for _ in range(3):
        averaged = [p - 0.1 * torch.randn(p.shape, generator=g) for p in ours]  # a round's average
        for p, a in zip(ref, averaged):
            p.grad = p.detach() - a  # the pseudo-gradient g = anchor - averaged
        opt.step()
        ours, momentum = outer_update(ours, averaged, momentum, kind="nesterov", lr=lr, mu=mu)
        for o, r in zip(ours, ref):
            assert torch.allclose(o, r.detach(), atol=1e-6)
    if mu > 0:
        for m, r in zip(momentum, ref):
            assert torch.allclose(m, opt.state[r]["momentum_buffer"], atol=1e-6)


def test_nesterov_with_zero_momentum_is_sgd():
    anchor, avg = [T([1.0, -1.0])], [T([3.0, 1.0])]
    a, _ = outer_update(anchor, avg, None, kind="nesterov", lr=0.5, mu=0.0)
    b, _ = outer_update(anchor, avg, None, kind="sgd", lr=0.5)
    assert torch.allclose(a[0], b[0])


def test_bad_inputs_raise():
    x = [torch.zeros(2)]
    with pytest.raises(ValueError):
        outer_update(x, x, None, kind="adam")
    with pytest.raises(ValueError):
        outer_update(x, x + x, None)
    with pytest.raises(ValueError):
        outer_update(x, x, [torch.zeros(2), torch.zeros(2)], kind="nesterov", lr=0.7, mu=0.9)
