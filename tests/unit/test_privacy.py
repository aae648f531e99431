"""Border DP: clipping, Gaussian noise and the accountant, against hand values and Opacus."""

import math

import pytest
import torch

from worldlm_p2p.privacy import (DEFAULT_ORDERS, BorderAccountant, clip_by_l2_norm, gaussian_noise, gaussian_rdp,
                                 l2_norm, privatize, rdp_to_epsilon)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_clip_by_hand_and_zero_safe():
    t = [torch.tensor([3.0]), torch.tensor([[4.0]])]  # joint norm 5
    clipped, norm = clip_by_l2_norm(t, 1.0)
    assert norm == 5.0
    assert torch.allclose(clipped[0], torch.tensor([0.6])) and torch.allclose(clipped[1], torch.tensor([[0.8]]))
    same, _ = clip_by_l2_norm(t, 10.0)
    assert torch.equal(same[0], t[0]) and torch.equal(same[1], t[1])
    zero, n0 = clip_by_l2_norm([torch.zeros(3)], 1.0)
    assert n0 == 0.0 and torch.equal(zero[0], torch.zeros(3))
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            clip_by_l2_norm(t, bad)
    with pytest.raises(ValueError):
        clip_by_l2_norm([torch.tensor([math.nan])], 1.0)


def test_every_update_that_leaves_is_within_the_clip_norm():
    g = _gen(1)
    for scale in (1e-4, 0.1, 1.0, 10.0, 1e4):
        delta = [torch.randn(7, 5, generator=g) * scale, torch.randn(11, generator=g) * scale]
        out = privatize(delta, clip=0.5, noise_multiplier=0.0, generator=_gen())
        assert l2_norm(out.tensors) <= 0.5 * (1 + 1e-6)
        assert out.clipped_norm == pytest.approx(min(l2_norm(delta), 0.5))
        if l2_norm(delta) < 0.5:  # below the norm the delta leaves unchanged
            assert all(torch.allclose(a, b) for a, b in zip(out.tensors, delta))


def test_noise_std_matches_sigma_times_clip():
    clip, sigma = 2.0, 0.5
    out = privatize([torch.zeros(500_000), torch.zeros(500, 1000)], clip=clip, noise_multiplier=sigma,
                    generator=_gen(7))
    x = torch.cat([t.flatten() for t in out.tensors]).double()
    n = x.numel()
    assert out.noise_std == sigma * clip
    # mean within 5 standard errors; the sample std within 5 standard errors of sigma*C (se = s/sqrt(2n))
    assert abs(float(x.mean())) < 5 * sigma * clip / math.sqrt(n)
    assert abs(float(x.std()) - sigma * clip) < 5 * sigma * clip / math.sqrt(2 * n)
    # the same generator state gives the same noise; the global RNG is not touched
    torch.manual_seed(0)
    expected_next = torch.rand(1)
    torch.manual_seed(0)
    a = gaussian_noise([torch.zeros(10)], 1.0, _gen(3))[0]
    assert torch.equal(torch.rand(1), expected_next)  # the global RNG did not move
    b = gaussian_noise([torch.zeros(10)], 1.0, _gen(3))[0]
    assert torch.equal(a, b)


def test_noise_is_added_after_clipping():
    delta = [torch.full((4,), 10.0)]  # norm 20
    out = privatize(delta, clip=1.0, noise_multiplier=0.3, generator=_gen(5))
    noise = gaussian_noise(delta, 0.3, _gen(5))[0]
    assert torch.allclose(out.tensors[0], torch.full((4,), 0.5) + noise)


def test_gaussian_rdp_and_conversion_by_hand():
    assert gaussian_rdp(2.0, 3, [2.0, 4.0]) == [3 * 2 / 8, 3 * 4 / 8]
    assert gaussian_rdp(1.0, 0, [2.0]) == [0.0] and gaussian_rdp(0.0, 1, [2.0]) == [math.inf]
    # one order: eps = rdp + log((a-1)/a) - (log delta + log a)/(a-1)
    eps, order = rdp_to_epsilon([3.0], [0.5], 1e-5)
    assert order == 3.0 and eps == pytest.approx(0.5 + math.log(2 / 3) - (math.log(1e-5) + math.log(3)) / 2)


@pytest.mark.parametrize("sigma,rounds", [(0.5, 1), (1.0, 9), (2.0, 50), (4.0, 200)])
def test_accountant_agrees_with_opacus(sigma, rounds):
    from opacus.accountants import RDPAccountant

    acc = BorderAccountant(delta=1e-5)
    for _ in range(rounds):
        acc.record(sigma)
    reference = RDPAccountant()
    reference.history = [(sigma, 1.0, rounds)]  # (noise multiplier, sample rate, steps): no subsampling
    want, _ = reference.get_privacy_spent(delta=1e-5, alphas=list(DEFAULT_ORDERS))
    assert acc.epsilon() == pytest.approx(want, rel=1e-9)
    assert acc.releases == rounds


def test_accountant_composes_changing_noise_and_round_trips():
    from opacus.accountants import RDPAccountant

    acc = BorderAccountant(delta=1e-6)
    assert acc.epsilon() == 0.0
    for sigma in (1.0, 1.0, 2.0, 0.5):
        acc.record(sigma)
    assert acc.history == [(1.0, 2), (2.0, 1), (0.5, 1)]
    reference = RDPAccountant()
    reference.history = [(1.0, 1.0, 2), (2.0, 1.0, 1), (0.5, 1.0, 1)]
    assert acc.epsilon() == pytest.approx(reference.get_privacy_spent(delta=1e-6, alphas=list(DEFAULT_ORDERS))[0],
                                          rel=1e-9)
    assert BorderAccountant.from_state(acc.state_dict()) == acc
    more = BorderAccountant.from_state(acc.state_dict())
    more.record(1.0)
    assert more.epsilon() > acc.epsilon()  # spending only grows
    acc.record(0.0)
    assert acc.epsilon() == math.inf  # a release without noise has no finite guarantee


# ------------------------------------------------------------------------------ settings and policies


def test_privacy_settings_validate_with_reasons():
    from worldlm_p2p.config import PrivacyConfig
    from worldlm_p2p.errors import ConfigError

    assert not PrivacyConfig().border and not PrivacyConfig().peer
    assert PrivacyConfig(border_clip=1.0).border and PrivacyConfig(peer_noise=0.8).peer
    for bad, needle in ((dict(border_noise=0.5), "needs privacy.border_clip"),
                        (dict(peer_epsilon=8.0, peer_noise=1.0), "not both"),
                        (dict(border_delta=0.0), "privacy.border_delta"), (dict(peer_clip=0.0), "privacy.peer_clip"),
                        (dict(border_noise=-1.0, border_clip=1.0), "privacy.border_noise"),
                        (dict(peer_epsilon=float("inf")), "privacy.peer_epsilon")):
        with pytest.raises(ConfigError, match=needle):
            PrivacyConfig(**bad)


def test_region_settings_against_the_run_policy():
    from worldlm_p2p.config import PrivacyConfig, PrivacyPolicy, RunManifest, privacy_violations
    from worldlm_p2p.errors import ConfigError

    m = RunManifest.from_dict({"run_id": "r", "privacy": {"min_border_noise": 0.5, "max_border_clip": 1.0,
                                                          "max_peer_epsilon": 8}})
    policy = m.privacy
    assert policy == PrivacyPolicy(min_border_noise=0.5, max_border_clip=1.0, max_peer_epsilon=8.0)
    ok = PrivacyConfig(border_noise=1.0, border_clip=0.5, peer_epsilon=4.0)
    assert privacy_violations(policy, ok) == []
    cases = [(PrivacyConfig(border_noise=0.1, border_clip=0.5, peer_epsilon=4.0), "border noise >= 0.5"),
             (PrivacyConfig(border_noise=1.0, border_clip=2.0, peer_epsilon=4.0), "border clip norm <= 1"),
             (PrivacyConfig(border_noise=1.0, border_clip=0.5), "requires DP-SGD at every peer"),
             (PrivacyConfig(border_noise=1.0, border_clip=0.5, peer_epsilon=10.0), "exceeds the run's max_peer_epsilon"),
             (PrivacyConfig(border_noise=1.0, border_clip=0.5, peer_epsilon=4.0, peer_delta=1e-3), "peer_delta")]
    for settings, needle in cases:
        found = privacy_violations(policy, settings)
        assert len(found) == 1 and needle in found[0], (settings, found)
    assert privacy_violations(PrivacyPolicy(), PrivacyConfig()) == []  # no policy: anything goes
    with pytest.raises(ConfigError, match="privacy.min_border_noise"):
        RunManifest.from_dict({"run_id": "r", "privacy": {"min_border_noise": -1}})
    with pytest.raises(ConfigError, match="privacy.bogus"):
        RunManifest.from_dict({"run_id": "r", "privacy": {"bogus": 1}})
