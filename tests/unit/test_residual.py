"""Residual embeddings (count sketches) and the cross-region update of a world round."""

import math

import pytest
import torch

from worldlm_p2p.residual import count_sketch, cross_region_update, cross_region_weights, residual_embedding

LN2 = math.log(2.0)
T = torch.tensor
F64 = torch.float64


def _vec(seed, n=50):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def test_count_sketch_is_deterministic_per_seed_and_layer():
    x = _vec(0).reshape(5, 10)
    s = count_sketch(x, dim=16, seed=3, layer=0)
    assert s.shape == (16,) and s.dtype == torch.float32
    assert torch.equal(s, count_sketch(x.clone(), dim=16, seed=3, layer=0))
    assert not torch.equal(s, count_sketch(x, dim=16, seed=4, layer=0))
    assert not torch.equal(s, count_sketch(x, dim=16, seed=3, layer=1))
    assert torch.equal(s, count_sketch(x.flatten(), dim=16, seed=3, layer=0))  # only the size matters


def test_count_sketch_structure():
    # each coordinate lands, with a sign +-1, in exactly one bucket: a one-hot input gives a +-1 one-hot
    for i in range(20):
        e = torch.zeros(20)
        e[i] = 1.0
        s = count_sketch(e, dim=8, seed=1, layer=0)
        assert int((s != 0).sum()) == 1 and float(s.abs().sum()) == 1.0
    # the sum of bucket magnitudes with all-ones input is at most n, and the sketch of zeros is zero
    assert float(count_sketch(torch.ones(20), dim=8, seed=1, layer=0).abs().sum()) <= 20.0
    assert torch.equal(count_sketch(torch.zeros(7), dim=4, seed=0, layer=0), torch.zeros(4))


def test_count_sketch_is_linear():
    a, b = _vec(1), _vec(2)
    sa, sb = (count_sketch(v, dim=12, seed=5, layer=2) for v in (a, b))
    assert torch.allclose(count_sketch(a + b, dim=12, seed=5, layer=2), sa + sb, atol=1e-5)
    assert torch.allclose(count_sketch(-2.5 * a, dim=12, seed=5, layer=2), -2.5 * sa, atol=1e-5)


def test_count_sketch_preserves_inner_products_in_expectation():
    # a, b unit vectors with <a, b> = 0.6. For one seed X = <Sa, Sb> has E[X] = <a, b> and
    # Var[X] = (sum_{i != j} a_i^2 b_j^2 + a_i b_i a_j b_j) / dim <= (|a|^2 |b|^2 + <a,b>^2) / dim
    # = 1.36 / 32 = 0.0425. The mean of N = 400 seeds has standard error <= sqrt(0.0425 / 400) ~ 0.0103:
    # a 5-sigma tolerance is 0.052 (deterministic seeds, so no flakiness either way).
    n, dim, n_seeds = 200, 32, 400
    u, v = _vec(10, n), _vec(11, n)
    u = u / u.norm()
    v = v - (v @ u) * u
    v = v / v.norm()
    a, b = u, 0.6 * u + 0.8 * v
    assert float(a @ b) == pytest.approx(0.6, abs=1e-6)
    xs = [float(count_sketch(a, dim=dim, seed=s, layer=0) @ count_sketch(b, dim=dim, seed=s, layer=0))
          for s in range(n_seeds)]
    mean = sum(xs) / n_seeds
    se = math.sqrt((1.0 + 0.6 ** 2) / dim / n_seeds)
    assert abs(mean - 0.6) < 5 * se
    # and it is a real estimate, not a constant: single seeds do vary
    assert max(xs) - min(xs) > 0.1


def test_residual_embedding_rows_are_per_layer_sketches():
    res = [_vec(20, 12).reshape(3, 4), _vec(21, 5)]
    e = residual_embedding(res, dim=8, seed=7)
    assert e.shape == (2, 8)
    for l, r in enumerate(res):
        assert torch.equal(e[l], count_sketch(r, dim=8, seed=7, layer=l))


# Embeddings of three regions, two layers. tau = 1/ln2, so exp(score) = 2 ** cos, and the region
# itself has score 1/tau, i.e. 2 ** 1 = 2.
EMB = {
    "eu": T([[1.0, 0.0], [1.0, 1.0]]),
    "na": T([[0.0, 3.0], [2.0, 2.0]]),
    "asia": T([[-2.0, 0.0], [1.0, -1.0]]),
}


def test_cross_region_weights_hand_computed():
    w = cross_region_weights(EMB, "eu", tau=1 / LN2)
    assert set(w) == {"eu", "na", "asia"}
    # layer 0: self 2, na cos([1,0],[0,3]) = 0 -> 1, asia cos([1,0],[-2,0]) = -1 -> 1/2; sum 7/2
    #   -> eu 4/7, na 2/7, asia 1/7
    # layer 1: self 2, na cos([1,1],[2,2]) = 1 -> 2, asia cos([1,1],[1,-1]) = 0 -> 1; sum 5
    #   -> eu 2/5, na 2/5, asia 1/5
    expected = {"eu": [4 / 7, 2 / 5], "na": [2 / 7, 2 / 5], "asia": [1 / 7, 1 / 5]}
    for g, a in expected.items():
        assert w[g].dtype == F64
        assert torch.allclose(w[g], T(a, dtype=F64), atol=1e-12), g
    # from na: layer 0: self 2, eu cos = 0 -> 1, asia cos([0,3],[-2,0]) = 0 -> 1 -> 1/2, 1/4, 1/4
    w = cross_region_weights(EMB, "na", tau=1 / LN2)
    assert torch.allclose(torch.stack([w["na"], w["eu"], w["asia"]])[:, 0], T([0.5, 0.25, 0.25], dtype=F64))
    # from na, layer 1: self 2, eu cos = 1 -> 2, asia cos([2,2],[1,-1]) = 0 -> 1 -> 2/5, 2/5, 1/5
    assert torch.allclose(torch.stack([w["na"], w["eu"], w["asia"]])[:, 1], T([0.4, 0.4, 0.2], dtype=F64))


def test_cross_region_weights_properties():
    w = cross_region_weights(EMB, "asia", tau=0.3)
    assert torch.allclose(sum(w.values()), torch.ones(2, dtype=F64), atol=1e-12)
    reordered = {g: EMB[g] for g in ("asia", "na", "eu")}
    w2 = cross_region_weights(reordered, "asia", tau=0.3)
    assert all(torch.allclose(w[g], w2[g], rtol=0, atol=1e-15) for g in w)
    # a twin region gets (up to) half; a zero own embedding still keeps its self score 1/tau
    twins = {"a": T([[1.0, 0.0]]), "b": T([[5.0, 0.0]])}
    assert torch.allclose(cross_region_weights(twins, "a", tau=0.1)["b"], T([0.5], dtype=F64))
    zero = {"a": T([[0.0, 0.0]]), "b": T([[1.0, 0.0]]), "c": T([[0.0, 1.0]])}
    w = cross_region_weights(zero, "a", tau=1 / LN2)  # cos 0 with both others: 2, 1, 1
    assert torch.allclose(torch.stack([w["a"], w["b"], w["c"]])[:, 0], T([0.5, 0.25, 0.25], dtype=F64))
    # an opposite region with a small tau gets almost nothing: 1 / (1 + e^(2/0.1))
    opposite = {"a": T([[1.0, 0.0]]), "b": T([[-1.0, 0.0]])}
    assert float(cross_region_weights(opposite, "a", tau=0.1)["b"][0]) == pytest.approx(1 / (1 + math.exp(20)))


def test_cross_region_weights_bad_inputs():
    with pytest.raises(ValueError):
        cross_region_weights(EMB, "oceania", tau=1.0)
    for tau in (0.0, -1.0):
        with pytest.raises(ValueError):
            cross_region_weights(EMB, "eu", tau=tau)
    with pytest.raises(ValueError):
        cross_region_weights({"eu": torch.zeros(2, 2), "na": torch.zeros(2, 3)}, "eu", tau=1.0)


def test_cross_region_weights_of_partners_hand_computed():
    emb = {"eu": T([[1.0, 0.0]]), "na": T([[1.0, 1.0]]), "asia": T([[-2.0, -1.0]])}
    w = cross_region_weights(emb, "eu", tau=1 / LN2, form="partners")  # exp(score) = 2 ** cos
    # na against the rest (asia): eu - asia = [3, 1], na - asia = [3, 2], cos = 11 / sqrt(130)
    # asia against the rest (na): eu - na = [0, -1], asia - na = [-3, -2], cos = 2 / sqrt(13)
    scores = {"na": 2 ** (11 / math.sqrt(130)), "asia": 2 ** (2 / math.sqrt(13))}
    total = sum(scores.values())
    assert w["eu"].dtype == F64 and float(w["eu"][0]) == 0.0  # not a partner of itself
    for g, v in scores.items():
        assert w[g].dtype == F64
        assert float(w[g][0]) == pytest.approx(v / total, abs=1e-12), g
    # from na: eu against asia: cos([3, 2], [3, 1]); asia against eu: na - eu = [0, 1],
    # asia - eu = [-3, -1]: cos = -1 / sqrt(10)
    w = cross_region_weights(emb, "na", tau=1 / LN2, form="partners")
    scores = {"eu": 2 ** (11 / math.sqrt(130)), "asia": 2 ** (-1 / math.sqrt(10))}
    total = sum(scores.values())
    assert all(float(w[g][0]) == pytest.approx(v / total, abs=1e-12) for g, v in scores.items())
    # the update moves eu's K beta of the way towards its partners' (r_G - r_R = K_G - K_R)
    key, res = [T([1.0, 2.0])], [T([0.5, 0.0])]
    others = {"na": [T([1.5, 1.0])], "asia": [T([-0.5, 4.0])]}
    weights = {"na": T([0.75], dtype=F64), "asia": T([0.25], dtype=F64)}
    out = cross_region_update(key, res, others, weights, beta=0.5)
    # step = 0.75 * [1, 1] + 0.25 * [-1, 4] = [0.5, 1.75]; K + 0.5 * step = [1.25, 2.875]
    assert torch.allclose(out[0], T([1.25, 2.875]))


def test_cross_region_weights_of_partners_properties():
    g = torch.Generator().manual_seed(3)
    u, v, x, y, z = (torch.randn(2, 40, generator=g, dtype=F64) for _ in range(5))
    # a and b learned alike (u) apart from c and d (which learned other things); residuals from the world's mean
    models = {"a": u + 0.1 * x, "b": u + 0.1 * y, "c": -2 * u + 0.1 * z, "d": 2 * v}
    mean = sum(models.values()) / len(models)
    emb = {r: (m - mean).float() for r, m in models.items()}
    w = cross_region_weights(emb, "a", tau=0.1, form="partners")
    assert torch.allclose(sum(w.values()), torch.ones(2, dtype=F64), atol=1e-12)
    assert bool((w["b"] > 0.9).all()) and bool((w["c"] < 1e-3).all()) and bool((w["a"] == 0).all())
    # the world's mean cancels: shifting every embedding by one vector changes nothing
    shift = torch.randn(2, 40, generator=g)
    w_shift = cross_region_weights({r: e + shift for r, e in emb.items()}, "a", tau=0.1, form="partners")
    assert all(torch.allclose(w[r], w_shift[r], atol=1e-6) for r in w)
    # the order of the regions does not matter
    w_rev = cross_region_weights(dict(reversed(list(emb.items()))), "a", tau=0.1, form="partners")
    assert all(torch.allclose(w[r], w_rev[r], rtol=0, atol=1e-15) for r in w)
    # two regions: the other is the only partner; one region: itself, whole (the update is the identity)
    w2 = cross_region_weights({"a": emb["a"], "b": emb["b"]}, "a", tau=0.1, form="partners")
    assert torch.equal(w2["a"], torch.zeros(2, dtype=F64)) and torch.equal(w2["b"], torch.ones(2, dtype=F64))
    w1 = cross_region_weights({"a": emb["a"]}, "a", tau=0.1, form="partners")
    assert set(w1) == {"a"} and torch.equal(w1["a"], torch.ones(2, dtype=F64))
    key = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g)]
    res = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g)]
    assert all(torch.equal(o, k) for o, k in zip(cross_region_update(key, res, {}, w1, beta=0.5), key))
    with pytest.raises(ValueError):
        cross_region_weights(emb, "a", tau=0.1, form="median")


def test_cross_region_update_hand_computed():
    key = [T([1.0, 1.0]), torch.zeros(2, 2)]
    res = [T([1.0, 0.0]), T([[1.0, 0.0], [0.0, 0.0]])]
    others = {"na": [T([3.0, 0.0]), T([[1.0, 0.0], [0.0, 2.0]])],
              "asia": [T([1.0, 4.0]), torch.zeros(2, 2)]}
    weights = {"eu": T([4 / 7, 2 / 5], dtype=F64), "na": T([2 / 7, 2 / 5], dtype=F64),
               "asia": T([1 / 7, 1 / 5], dtype=F64)}
    out = cross_region_update(key, res, others, weights, beta=0.5)
    # layer 0: step = 2/7 ([3,0] - [1,0]) + 1/7 ([1,4] - [1,0]) = [4/7, 4/7]; K + 0.5 step = [9/7, 9/7]
    # layer 1: step = 2/5 [[0,0],[0,2]] + 1/5 [[-1,0],[0,0]] = [[-1/5, 0], [0, 4/5]]; 0.5 step
    assert torch.allclose(out[0], T([9 / 7, 9 / 7]))
    assert torch.allclose(out[1], T([[-0.1, 0.0], [0.0, 0.4]]))
    assert out[0].dtype == torch.float32
    # the region's own weight does not enter; a region not fetched does not either
    only_na = cross_region_update(key, res, {"na": others["na"]}, weights, beta=1.0)
    assert torch.allclose(only_na[0], T([1.0 + 4 / 7, 1.0]))  # 2/7 * [2, 0]
    # beta = 0 leaves K unchanged
    same = cross_region_update(key, res, others, weights, beta=0.0)
    assert all(torch.equal(a, b) for a, b in zip(same, key))
    # no other region: unchanged too
    assert all(torch.equal(a, b) for a, b in zip(cross_region_update(key, res, {}, weights, beta=0.5), key))


def test_region_attention_hand_computed():
    from worldlm_p2p.residual import region_attention

    # e_eu = 0; na at squared distance 1, asia at 4: mean 5/2, scores -(1 / 2.5) / tau, -(4 / 2.5) / tau.
    # tau = 1.2 / ln 2: scores -ln2 / 3, -4 ln2 / 3, i.e. weights 2^(-1/3) : 2^(-4/3) = 2 : 1 -> 2/3, 1/3
    emb = {"eu": T([[0.0, 0.0], [0.0, 0.0]]), "na": T([[1.0, 0.0], [0.0, 0.0]]), "asia": T([[0.0, 2.0], [0.0, 0.0]])}
    w = region_attention(emb, "eu", tau=1.2 / LN2)
    assert set(w) == {"na", "asia"} and all(a.dtype == F64 and a.shape == (1,) for a in w.values())
    assert float(w["na"][0]) == pytest.approx(2 / 3, abs=1e-12)
    assert float(w["asia"][0]) == pytest.approx(1 / 3, abs=1e-12)
    # the distance spans every layer: na's row 1 moved by 1 as well -> D = 2 and 4, mean 3
    emb2 = dict(emb, na=T([[1.0, 0.0], [1.0, 0.0]]))
    w2 = region_attention(emb2, "eu", tau=1.0)
    assert float(w2["na"][0]) == pytest.approx(1 / (1 + math.exp(-2 / 3)), abs=1e-12)


def test_region_attention_properties():
    from worldlm_p2p.residual import region_attention

    g = torch.Generator().manual_seed(4)
    emb = {r: torch.randn(3, 8, generator=g) for r in ("a", "b", "c", "d")}
    for r in emb:
        w = region_attention(emb, r, tau=0.3)
        assert r not in w and float(sum(a[0] for a in w.values())) == pytest.approx(1.0, abs=1e-12)
        w2 = region_attention({k: emb[k] for k in reversed(list(emb))}, r, tau=0.3)
        assert all(torch.equal(w[k], w2[k]) for k in w)
    # the scale of the model does not matter (only distances relative to each other)
    scaled = {k: 1000.0 * v for k, v in emb.items()}
    w, ws = region_attention(emb, "a", tau=0.3), region_attention(scaled, "a", tau=0.3)
    assert all(torch.allclose(w[k], ws[k], atol=1e-9) for k in w)
    # the nearest region gets most; one other region gets everything; alone: nothing
    near = dict(emb, b=emb["a"] + 1e-3)
    assert max(region_attention(near, "a", tau=0.1).items(), key=lambda kv: float(kv[1][0]))[0] == "b"
    assert float(region_attention({"a": emb["a"], "b": emb["b"]}, "a", tau=0.1)["b"][0]) == 1.0
    assert region_attention({"a": emb["a"]}, "a", tau=0.1) == {}
    # every other region at the same place as this one: uniform
    same = {k: emb["a"].clone() for k in ("a", "b", "c")}
    assert all(float(a[0]) == pytest.approx(0.5) for a in region_attention(same, "a", tau=0.1).values())
    with pytest.raises(ValueError):
        region_attention(emb, "z", tau=0.1)
    with pytest.raises(ValueError):
        region_attention(emb, "a", tau=0.0)
    with pytest.raises(ValueError):
        region_attention({"a": torch.zeros(2, 2), "b": torch.zeros(2, 3)}, "a", tau=1.0)


def test_cross_region_update_one_weight_for_every_layer():
    key = [T([1.0, 1.0]), T([0.0])]
    res = [T([0.0, 0.0]), T([0.0])]
    out = cross_region_update(key, res, {"na": [T([2.0, 0.0]), T([4.0])]}, {"na": T([0.5], dtype=F64)}, beta=1.0)
    assert torch.allclose(out[0], T([2.0, 1.0])) and torch.allclose(out[1], T([2.0]))
