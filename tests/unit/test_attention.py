"""Attentive aggregation of key layers against hand-computed values (worldlm.md sections 3, 7)."""

import math

import pytest
import torch

from worldlm_p2p.aggregation import weighted_mean
from worldlm_p2p.attention import (MIN_SCORE, attention_weights, attentive_aggregate, decode_key_layers,
                                   encode_key_layers, layer_scores)

LN2 = math.log(2.0)
T = torch.tensor

# Two layers, three peers. With tau = 1 / ln 2 a distance score is s = -ln2 * ||K - R|| / ||R||, so
# exp(s) = 2 ** -(||K - R|| / ||R||): relative distances 0, 1, 2 give u = 1, 1/2, 1/4 (exact weights).
REF = [T([3.0, 4.0]), T([[2.0, 0.0], [0.0, 0.0]])]  # norms 5 and 2
PEERS = [
    [T([3.0, 4.0]), T([[2.0, 0.0], [0.0, 2.0]])],  # A: layer 0 d=0 (u=1); layer 1 d=2, 2/2=1 (u=1/2)
    [T([6.0, 8.0]), T([[2.0, 0.0], [0.0, 0.0]])],  # B: layer 0 d=5, 5/5=1 (u=1/2); layer 1 d=0 (u=1)
    [T([3.0, -6.0]), T([[2.0, 4.0], [0.0, 0.0]])],  # C: layer 0 d=10, 10/5=2 (u=1/4); layer 1 d=4 (u=1/4)
]
TOKENS = [1.0, 2.0, 4.0]
# layer 0: n*u = [1*1, 2*1/2, 4*1/4] = [1, 1, 1] -> a = [1/3, 1/3, 1/3]
#   step = ([0,0] + [3,4] + [0,-10]) / 3 = [1, -2]
# layer 1: n*u = [1*1/2, 2*1, 4*1/4] = [1/2, 2, 1], sum 7/2 -> a = [1/7, 4/7, 2/7]
#   step = 1/7 [[0,0],[0,2]] + 4/7 * 0 + 2/7 [[0,4],[0,0]] = [[0, 8/7], [0, 2/7]]
A_HAND = T([[1 / 3, 1 / 7], [1 / 3, 4 / 7], [1 / 3, 2 / 7]], dtype=torch.float64)
STEP_HAND = [T([1.0, -2.0]), T([[0.0, 8 / 7], [0.0, 2 / 7]])]


def _close(xs, ys, atol=1e-6):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert torch.allclose(x, y, atol=atol, rtol=1e-5), (x, y)


def _rand_peers(n_peers, seed=0, scale=0.1):
    g = torch.Generator().manual_seed(seed)
    ref = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g)]
    keys = [[r + scale * torch.randn(r.shape, generator=g) for r in ref] for _ in range(n_peers)]
    tokens = [float(t) for t in torch.randint(1, 100, (n_peers,), generator=g)]
    return keys, ref, tokens


def test_distance_scores_hand_computed():
    tau = 1 / LN2
    expected = [[0.0, -LN2], [-LN2, 0.0], [-2 * LN2, -2 * LN2]]
    for peer, exp in zip(PEERS, expected):
        s = layer_scores(peer, REF, form="distance", tau=tau)
        assert s.dtype == torch.float64 and s.shape == (2,)
        assert torch.allclose(s, T(exp, dtype=torch.float64), atol=1e-12)
    # tau = 1: s = -d / ||R|| directly, e.g. peer B layer 0: -5 / 5 = -1
    assert float(layer_scores(PEERS[1], REF, form="distance", tau=1.0)[0]) == pytest.approx(-1.0)
    assert float(layer_scores(PEERS[1], REF, form="distance", tau=0.5)[0]) == pytest.approx(-2.0)


def test_token_prior_weights_hand_computed():
    scores = torch.stack([layer_scores(p, REF, form="distance", tau=1 / LN2) for p in PEERS])
    a = attention_weights(scores, TOKENS)
    assert torch.allclose(a, A_HAND, atol=1e-12)
    assert torch.allclose(a.sum(0), torch.ones(2, dtype=torch.float64), atol=1e-12)


def test_attention_weights_formula():
    # a_il = n_i exp(s_il) / sum_j n_j exp(s_jl), written out element by element
    s = [[0.0, -1.0], [-0.5, -2.0], [-3.0, 0.0]]
    n = [5.0, 1.0, 2.0]
    a = attention_weights(T(s, dtype=torch.float64), n)
    for l in range(2):
        den = sum(n[j] * math.exp(s[j][l]) for j in range(3))
        for i in range(3):
            assert float(a[i, l]) == pytest.approx(n[i] * math.exp(s[i][l]) / den, rel=1e-12)


def test_distance_aggregate_hand_computed():
    out = attentive_aggregate(PEERS, REF, TOKENS, form="distance", tau=1 / LN2, eps=1.0)
    # REF + step: [3,4] + [1,-2] = [4, 2]; [[2,0],[0,0]] + [[0,8/7],[0,2/7]]
    _close(out, [T([4.0, 2.0]), T([[2.0, 8 / 7], [0.0, 2 / 7]])])
    half = attentive_aggregate(PEERS, REF, TOKENS, form="distance", tau=1 / LN2, eps=0.5)
    _close(half, [T([3.5, 3.0]), T([[2.0, 4 / 7], [0.0, 1 / 7]])])


def test_distance_two_peers_hand_computed():
    # R = [3,4]; A = R (u=1), B = 2R (d/||R|| = 1, u = 1/2); n = [1, 2]:
    # a = [1, 2*1/2] / 2 = [1/2, 1/2]; new = R + 1/2 * (2R - R) = [4.5, 6]
    out = attentive_aggregate([[T([3.0, 4.0])], [T([6.0, 8.0])]], [T([3.0, 4.0])], [1, 2],
                              form="distance", tau=1 / LN2)
    _close(out, [T([4.5, 6.0])])


def test_cosine_form_hand_computed():
    # R = [1, 0]; cos: A=[1,0] -> 1, B=[0,5] -> 0, C=[-1,0] -> -1. tau = 1/ln2: exp(cos/tau) = 2**cos
    # u ~ [2, 1, 1/2]; n = [1, 1, 2] -> n*u = [2, 1, 1] -> a = [1/2, 1/4, 1/4]
    # step = 1/2 * 0 + 1/4 ([0,5] - [1,0]) + 1/4 ([-1,0] - [1,0]) = [-1/4 - 1/2, 5/4] = [-3/4, 5/4]
    ref = [T([1.0, 0.0])]
    peers = [[T([1.0, 0.0])], [T([0.0, 5.0])], [T([-1.0, 0.0])]]
    s = torch.stack([layer_scores(p, ref, form="cosine", tau=1 / LN2) for p in peers])
    # shifted by -1/tau (softmax-invariant): (cos - 1) * ln2 = [0, -ln2, -2 ln2]
    assert torch.allclose(s[:, 0], T([0.0, -LN2, -2 * LN2], dtype=torch.float64), atol=1e-12)
    assert torch.allclose(attention_weights(s, [1, 1, 2])[:, 0], T([0.5, 0.25, 0.25], dtype=torch.float64))
    out = attentive_aggregate(peers, ref, [1, 1, 2], form="cosine", tau=1 / LN2)
    _close(out, [T([1.0 - 0.75, 1.25])])
    # cosine ignores the norm: scaling a peer does not change its score
    assert torch.equal(layer_scores([T([0.0, 500.0])], ref, form="cosine", tau=0.3),
                       layer_scores([T([0.0, 5.0])], ref, form="cosine", tau=0.3))


def test_mean_form_is_the_token_weighted_mean():
    keys, ref, tokens = _rand_peers(4, seed=1, scale=1.0)
    assert torch.equal(layer_scores(keys[0], ref, form="mean", tau=0.01), torch.zeros(2, dtype=torch.float64))
    _close(attentive_aggregate(keys, ref, tokens, form="mean", tau=0.01), weighted_mean(keys, tokens), atol=1e-5)


@pytest.mark.parametrize("form", ["distance", "cosine"])
@pytest.mark.parametrize("tau", [1e9, math.inf])
def test_large_tau_gives_the_token_weighted_mean(form, tau):
    keys, ref, tokens = _rand_peers(4, seed=2, scale=1.0)
    _close(attentive_aggregate(keys, ref, tokens, form=form, tau=tau), weighted_mean(keys, tokens), atol=1e-5)


@pytest.mark.parametrize("form", ["distance", "cosine", "mean"])
def test_one_peer_with_eps_1_is_the_identity(form):
    keys, ref, _ = _rand_peers(1, seed=3, scale=0.5)
    _close(attentive_aggregate(keys, ref, [7.0], form=form, tau=0.1, eps=1.0), keys[0])
    far = [[r + 1e6 for r in ref]]  # clamped score: still that peer's layers
    _close(attentive_aggregate(far, ref, [7.0], form=form, tau=0.1, eps=1.0), far[0], atol=1e-1)


@pytest.mark.parametrize("form", ["distance", "cosine"])
def test_order_of_peers_does_not_matter(form):
    keys, ref, tokens = _rand_peers(4, seed=4, scale=0.3)
    x = attentive_aggregate(keys, ref, tokens, form=form, tau=0.2)
    for perm in ([3, 2, 1, 0], [1, 3, 0, 2]):
        y = attentive_aggregate([keys[i] for i in perm], ref, [tokens[i] for i in perm], form=form, tau=0.2)
        _close(x, y)


def test_weights_sum_to_one_per_layer():
    keys, ref, tokens = _rand_peers(5, seed=5, scale=0.5)
    for form in ("distance", "cosine", "mean"):
        scores = torch.stack([layer_scores(k, ref, form=form, tau=0.05) for k in keys])
        a = attention_weights(scores, tokens)
        assert a.shape == (5, 2) and bool((a >= 0).all())
        assert torch.allclose(a.sum(0), torch.ones(2, dtype=torch.float64), atol=1e-12)
    # a zero token count gives zero weight, the others still sum to one
    a = attention_weights(torch.zeros(3, 1, dtype=torch.float64), [0.0, 1.0, 3.0])
    assert torch.allclose(a[:, 0], T([0.0, 0.25, 0.75], dtype=torch.float64))


def test_eps_scales_the_step():
    keys, ref, tokens = _rand_peers(3, seed=6, scale=0.5)
    full = attentive_aggregate(keys, ref, tokens, tau=0.3, eps=1.0)
    for eps in (0.0, 0.25, 1.5):
        out = attentive_aggregate(keys, ref, tokens, tau=0.3, eps=eps)
        _close([o - r for o, r in zip(out, ref)], [eps * (f - r) for f, r in zip(full, ref)], atol=1e-5)


def _one_allreduce(keys, ref, tokens, *, form, tau, eps):
    payloads = [encode_key_layers(k, ref, form=form, tau=tau) for k in keys]
    for p in payloads:
        assert len(p) == len(ref) + 1 and all(t.dtype == torch.float32 for t in p)
    return decode_key_layers(weighted_mean(payloads, tokens), ref, eps=eps)


@pytest.mark.parametrize("form", ["distance", "cosine", "mean"])
@pytest.mark.parametrize("eps", [1.0, 0.5])
def test_one_allreduce_equals_attentive_aggregate(form, eps):
    keys, ref, tokens = _rand_peers(4, seed=7, scale=0.3)
    got = _one_allreduce(keys, ref, tokens, form=form, tau=0.1, eps=eps)
    _close(got, attentive_aggregate(keys, ref, tokens, form=form, tau=0.1, eps=eps), atol=1e-5)


def test_one_allreduce_hand_computed():
    _close(_one_allreduce(PEERS, REF, TOKENS, form="distance", tau=1 / LN2, eps=1.0),
           [T([4.0, 2.0]), T([[2.0, 8 / 7], [0.0, 2 / 7]])])


@pytest.mark.parametrize("form", ["distance", "cosine"])
def test_one_allreduce_with_clamped_distant_peers(form):
    keys, ref, tokens = _rand_peers(3, seed=8, scale=0.01)
    # peers 1 and 2 are very far (and opposite for cosine): their scores hit MIN_SCORE
    keys[1] = [-1e4 * r for r in ref]
    keys[2] = [-3e4 * r for r in ref]
    tau = 1e-3
    for k in keys[1:]:
        assert torch.equal(layer_scores(k, ref, form=form, tau=tau), torch.full((2,), MIN_SCORE, dtype=torch.float64))
    ref_out = attentive_aggregate(keys, ref, tokens, form=form, tau=tau)
    got = _one_allreduce(keys, ref, tokens, form=form, tau=tau, eps=1.0)
    assert all(bool(torch.isfinite(x).all()) for x in got + ref_out)
    _close(got, ref_out, atol=1e-4)
    # the close peer takes (almost) all of the weight: a distant one has exp(-60) relative weight
    _close(got, keys[0], atol=1e-4)

    # every peer distant: the weights fall back to the token prior (all scores equal MIN_SCORE)
    far = [[-1e4 * r for r in ref], [-2e4 * r for r in ref], [-5e4 * r for r in ref]]
    got = _one_allreduce(far, ref, tokens, form=form, tau=tau, eps=1.0)
    assert all(bool(torch.isfinite(x).all()) for x in got)
    _close(got, attentive_aggregate(far, ref, tokens, form=form, tau=tau), atol=1e-2)
    _close(got, weighted_mean(far, tokens), atol=1e-2)  # entries ~1e4-1e5: relative 1e-7


def test_zero_reference_is_finite():
    ref = [torch.zeros(2, 2)]
    keys = [[torch.ones(2, 2)], [torch.full((2, 2), 2.0)]]
    for form in ("distance", "cosine"):
        got = _one_allreduce(keys, ref, [1, 1], form=form, tau=0.1, eps=1.0)
        want = attentive_aggregate(keys, ref, [1, 1], form=form, tau=0.1)
        assert bool(torch.isfinite(got[0]).all())
        _close(got, want)
        _close(got, [torch.full((2, 2), 1.5)])  # both scores clamped (or both 0): token prior 1/2, 1/2


def test_bad_inputs_raise():
    keys, ref, tokens = _rand_peers(2, seed=9)
    with pytest.raises(ValueError):
        attentive_aggregate(keys, ref, tokens, form="bogus")
    with pytest.raises(ValueError):
        encode_key_layers(keys[0], ref, form="bogus", tau=1.0)
    for tau in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError):
            attentive_aggregate(keys, ref, tokens, tau=tau)
        with pytest.raises(ValueError):
            layer_scores(keys[0], ref, form="mean", tau=tau)
    with pytest.raises(ValueError):  # different number of elements
        layer_scores([torch.zeros(5)], [torch.zeros(6)], form="distance", tau=1.0)
    for form in ("distance", "cosine", "mean"):
        with pytest.raises(ValueError):  # same number of elements, different shape (would broadcast)
            attentive_aggregate([[torch.ones(1, 4)]], [torch.ones(4)], [1.0], form=form)
        with pytest.raises(ValueError):
            encode_key_layers([torch.ones(3)], [torch.ones(4)], form=form, tau=1.0)
    with pytest.raises(ValueError):  # layer count mismatch
        layer_scores(keys[0][:1], ref, form="distance", tau=1.0)
    with pytest.raises(ValueError):  # token count mismatch
        attentive_aggregate(keys, ref, tokens[:1])
    with pytest.raises(ValueError):
        attentive_aggregate([], ref, [])
    with pytest.raises(ValueError):
        attention_weights(torch.zeros(2, 1), [1.0, -1.0])
    with pytest.raises(ValueError):
        attention_weights(torch.zeros(2, 1), [0.0, 0.0])
    payload = encode_key_layers(keys[0], ref, form="distance", tau=1.0)
    with pytest.raises(ValueError):
        decode_key_layers(payload[:-1], ref, eps=1.0)
    with pytest.raises(ValueError):
        decode_key_layers(payload[:-1] + [torch.ones(len(ref) + 1)], ref, eps=1.0)
    # a layer whose reduced denominator is not positive (or whose mean is not finite) keeps its reference
    bad_u = payload[-1].clone()
    bad_u[0] = -0.5
    got = decode_key_layers(payload[:-1] + [bad_u], ref, eps=1.0)
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1], decode_key_layers(payload, ref, eps=1.0)[1])
    nan_k = [payload[0].clone().fill_(float("inf"))] + payload[1:]
    assert torch.equal(decode_key_layers(nan_k, ref, eps=1.0)[0], ref[0])


# ----------------------------------------------------------------------------------- personal mix


def test_personalize_hand_computed():
    # reference 0; own update d_own = (1, 0); region update d_reg = (1, 1): cos = 1/sqrt(2)
    from worldlm_p2p.attention import personalize

    ref, own, agg = [torch.zeros(2)], [torch.tensor([1.0, 0.0])], [torch.tensor([1.0, 1.0])]
    tau = 0.5
    c = 1 / math.sqrt(2)
    a_own = math.exp(1 / tau) / (math.exp(1 / tau) + math.exp(c / tau))  # softmax([1, c] / tau)[0]
    want = torch.tensor([a_own * 1 + (1 - a_own) * 1, (1 - a_own) * 1])
    got = personalize(own, ref, agg, tau=tau)[0]
    assert torch.allclose(got, want, atol=1e-7)


def test_personalize_limits_and_errors():
    from worldlm_p2p.attention import personalize

    g = torch.Generator().manual_seed(0)
    ref = [torch.randn(3, 2, generator=g)]
    own = [ref[0] + torch.randn(3, 2, generator=g)]
    agg = [ref[0] + torch.randn(3, 2, generator=g)]
    # a very large temperature gives the midpoint of the two updates
    mid = personalize(own, ref, agg, tau=1e9)[0]
    assert torch.allclose(mid, (own[0] + agg[0]) / 2, atol=1e-6)
    # a tiny temperature keeps the member's own layers (its update is never less similar to itself)
    assert torch.allclose(personalize(own, ref, agg, tau=1e-3)[0], own[0], atol=1e-6)
    # identical updates: the result is that update, whatever the temperature
    assert torch.allclose(personalize(own, ref, own, tau=0.2)[0], own[0], atol=1e-6)
    # a member that did not move takes half of the region's update at most (cos undefined -> 1)
    assert torch.allclose(personalize(ref, ref, agg, tau=0.2)[0], ref[0] + (agg[0] - ref[0]) / 2, atol=1e-6)
    with pytest.raises(ValueError):
        personalize(own, ref, agg, tau=0.0)
    with pytest.raises(ValueError):
        personalize([torch.zeros(3)], [torch.zeros(2)], [torch.zeros(2)], tau=1.0)


# ------------------------------------------------------------ rows weighted by the members' token usage


def test_usage_rows_hand_computed():
    """Two members of equal tokens, a token-indexed layer of 3 rows (vocabulary 3) and another
    layer. A uses token 0 ten times, B token 1: smoothed priors (count + 1) / (10 + 3), so row 0
    weighs A 11/12 and B 1/12, row 1 the reverse, row 2 (nobody's token) 1/2 each; the other layer
    keeps the per-layer weights (``mean``: 1/2 each)."""
    from worldlm_p2p.attention import row_priors, token_usage

    ref = [torch.zeros(3, 1), torch.zeros(2, 2)]
    keys = [[torch.ones(3, 1), torch.full((2, 2), 2.0)], [-torch.ones(3, 1), torch.zeros(2, 2)]]
    usage = [token_usage(T([0] * 10), 3), token_usage(T([1] * 10), 3)]
    assert usage[0].tolist() == [10.0, 0.0, 0.0]
    pa = row_priors(ref, usage[0])
    assert torch.allclose(pa[0], T([11 / 13, 1 / 13, 1 / 13], dtype=torch.float64))
    assert torch.allclose(pa[1], T([0.5, 0.5], dtype=torch.float64))  # not token-indexed: uniform
    want = [T([[5 / 6], [-5 / 6], [0.0]]), torch.ones(2, 2)]
    out = attentive_aggregate(keys, ref, [1.0, 1.0], form="mean", tau=1.0, usage=usage)
    _close(out, want)
    # one all-reduce (what the swarm runs) gives the same
    payloads = [encode_key_layers(k, ref, form="mean", tau=1.0, priors=row_priors(ref, u)) for k, u in zip(keys, usage)]
    assert payloads[0][-1].numel() == 3 + 2  # one denominator per row
    _close(decode_key_layers(weighted_mean(payloads, [1.0, 1.0]), ref, eps=1.0, rows=True), want)
    # the order of the members does not matter
    _close(attentive_aggregate(keys[::-1], ref, [1.0, 1.0], form="mean", tau=1.0, usage=usage[::-1]), want)


@pytest.mark.parametrize("form", ["distance", "cosine", "mean"])
def test_usage_rows_allreduce_equals_the_central_rule_and_without_counts_is_per_layer(form):
    from worldlm_p2p.attention import row_priors

    keys, ref, tokens = _rand_peers(4, seed=11, scale=0.3)
    vocab = ref[0].shape[0]
    g = torch.Generator().manual_seed(3)
    usage = [torch.randint(0, 50, (vocab,), generator=g).double() for _ in keys[:-1]] + [None]  # one keeps its counts
    central = attentive_aggregate(keys, ref, tokens, form=form, tau=0.2, usage=usage)
    payloads = [encode_key_layers(k, ref, form=form, tau=0.2, priors=row_priors(ref, u)) for k, u in zip(keys, usage)]
    _close(decode_key_layers(weighted_mean(payloads, tokens), ref, eps=1.0, rows=True), central, atol=1e-5)
    for p in (row_priors(ref, u) for u in usage):  # every prior is a distribution over its layer's rows
        assert all(abs(float(c.sum()) - 1.0) < 1e-12 for c in p)
    # nobody's counts: each row weighs every member as the per-layer rule does
    _close(attentive_aggregate(keys, ref, tokens, form=form, tau=0.2, usage=[None] * len(keys)),
           attentive_aggregate(keys, ref, tokens, form=form, tau=0.2), atol=1e-6)
    with pytest.raises(ValueError, match="non-negative"):
        row_priors(ref, -torch.ones(vocab))


def test_usage_rows_a_row_with_a_bad_denominator_keeps_its_reference():
    ref = [torch.zeros(3, 2)]
    averaged = [torch.ones(3, 2), T([0.5, 0.0, float("nan")])]
    out = decode_key_layers(averaged, ref, eps=1.0, rows=True)[0]
    assert torch.equal(out, T([[2.0, 2.0], [0.0, 0.0], [0.0, 0.0]]))
    with pytest.raises(ValueError, match="one per row"):
        decode_key_layers([torch.ones(3, 2), T([1.0])], ref, eps=1.0, rows=True)
