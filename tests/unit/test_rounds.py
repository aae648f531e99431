"""Region and world rounds for every strategy, against the pure functions they are built from."""

import math

import pytest
import torch

from worldlm_p2p import attention, mixing, residual
from worldlm_p2p.aggregation import weighted_mean
from worldlm_p2p.outer_optim import outer_update
from worldlm_p2p.rounds import (FETCH_MIN_WEIGHT, RoundRule, region_apply, region_payload, region_round,
                                region_round_with_anchor, stale_apply,
                                world_round)
from worldlm_p2p.split import split_parameters

NAMES = ["embed.weight", "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
         "layers.0.mlp.weight"]
SPLIT = split_parameters(NAMES, "kv")  # key = (1, 2), backbone = (0, 3)
SHAPES = [(3,), (2, 2), (2,), (2, 3)]
T = torch.tensor
LN2 = math.log(2.0)


def _model(g, scale=1.0, base=None):
    if base is None:
        return [scale * torch.randn(s, generator=g) for s in SHAPES]
    return [b + scale * torch.randn(s, generator=g) for b, s in zip(base, SHAPES)]


def _region(n_members=3, seed=0, scale=0.2):
    g = torch.Generator().manual_seed(seed)
    anchor = _model(g)
    members = [_model(g, scale, anchor) for _ in range(n_members)]
    tokens = [float(t) for t in torch.randint(1, 1000, (n_members,), generator=g)]
    return anchor, members, tokens


def _exact(**settings) -> RoundRule:
    """A rule of the shipped defaults with ``settings``, its payload on the wire in float32: the
    round's math without the codec (tested apart, below), and one model per member
    (``personal_model="inline"``: the rounds of a member's own model; the separate personal model
    of the default is tested apart, below)."""
    return RoundRule.of(SPLIT, **{"compress_backbone": "none", "compress_key": "none", "compress_world": "none",
                                  "personal_model": "inline", **settings})


def _close(xs, ys, atol=1e-6):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert torch.allclose(x, y, atol=atol, rtol=1e-5), (x, y)


def test_split_of_the_toy_names():
    assert SPLIT.key == (1, 2) and SPLIT.backbone == (0, 3)


@pytest.mark.parametrize("strategy, localises, world_group, world_rounds", [
    ("worldlm", True, False, True),
    ("fedavg", False, True, False),
    ("hierfavg", False, False, True),
    ("fedper", True, True, False),
    ("local", False, False, False),
])
def test_round_rule_properties(strategy, localises, world_group, world_rounds):
    rule = _exact(robust="mean", strategy=strategy)
    assert (rule.localises, rule.world_group, rule.has_world_rounds) == (localises, world_group, world_rounds)
    xs = [torch.full((1,), float(i)) for i in range(4)]
    assert [float(x) for x in rule.backbone(xs)] == ([0.0, 3.0] if localises else [0.0, 1.0, 2.0, 3.0])


def test_round_rule_holds_the_config_and_ships_its_defaults():
    from worldlm_p2p.config import AggregationConfig

    agg = AggregationConfig(strategy="hierfavg", tau=0.5, eps=0.5, outer="nesterov", outer_lr=0.7,
                            residual=False, residual_dim=8, residual_tau=0.2, residual_beta=0.3)
    rule = RoundRule.from_config(agg, SPLIT, seed=5)
    assert rule.config is agg and rule.seed == 5 and rule.split is SPLIT
    assert rule.strategy.name == "hierfavg"
    # one definition per setting: a rule built without settings is the product's defaults
    assert RoundRule.of(SPLIT).config == AggregationConfig()
    assert RoundRule.of(SPLIT, mix="none").config == AggregationConfig(mix="none")


def test_region_payload_raises_for_local():
    anchor, members, _ = _region()
    with pytest.raises(ValueError):
        region_payload(_exact(robust="mean", strategy="local"), members[0], anchor)


def test_region_payload_layout():
    anchor, members, _ = _region()
    p = region_payload(_exact(robust="mean", strategy="fedavg"), members[0], anchor)
    # the change since the anchor (the outer gradient, up to sign), not the model itself
    assert len(p) == 4 and all(torch.equal(a, b - c) for a, b, c in zip(p, members[0], anchor))
    assert all(torch.equal(t, torch.zeros_like(t)) for t in region_payload(
        _exact(robust="mean", strategy="fedavg"), anchor, anchor))  # no change: zeros
    p = region_payload(_exact(robust="mean", strategy="fedper"), members[0], anchor)
    assert len(p) == 2  # B only: fedper never sends K
    p = region_payload(_exact(robust="mean", strategy="worldlm"), members[0], anchor)
    assert len(p) == 2 + 2 + 1  # dB, u_l (K_l - K_ref,l) per key layer, u


@pytest.mark.parametrize("strategy", ["fedavg", "hierfavg"])
def test_region_round_whole_model_mean(strategy):
    anchor, members, tokens = _region(seed=1)
    out, mom = region_round(_exact(robust="mean", strategy=strategy), members, tokens, anchor=anchor, momentum=None)
    mean = weighted_mean(members, tokens)
    assert mom is None and len(out) == 3
    for o in out:
        _close(o, mean)


def test_region_round_hand_computed_fedavg():
    # two members, tokens 1 and 3: (1 x + 3 y) / 4
    rule = _exact(robust="mean", strategy="fedavg")
    x = [T([0.0, 0.0, 4.0]), torch.zeros(2, 2), T([1.0, 1.0]), torch.zeros(2, 3)]
    y = [T([4.0, 8.0, 0.0]), torch.ones(2, 2), T([1.0, 5.0]), torch.full((2, 3), 2.0)]
    out, _ = region_round(rule, [x, y], [1, 3], anchor=x, momentum=None)
    _close(out[0], [T([3.0, 6.0, 1.0]), torch.full((2, 2), 0.75), T([1.0, 4.0]), torch.full((2, 3), 1.5)])


def test_region_round_fedper_keeps_each_members_key():
    anchor, members, tokens = _region(seed=2)
    out, _ = region_round(_exact(robust="mean", strategy="fedper"), members, tokens, anchor=anchor, momentum=None)
    b_mean = weighted_mean([SPLIT.take_backbone(m) for m in members], tokens)
    for o, m in zip(out, members):
        _close(SPLIT.take_backbone(o), b_mean)
        _close(SPLIT.take_key(o), SPLIT.take_key(m))  # K never averaged
    assert not torch.allclose(out[0][1], out[1][1])


@pytest.mark.parametrize("form, tau, eps", [("distance", 0.1, 1.0), ("cosine", 0.05, 1.0),
                                            ("distance", 0.5, 0.5), ("mean", 1.0, 1.0)])
def test_region_round_worldlm(form, tau, eps):
    anchor, members, tokens = _region(seed=3, scale=0.3)
    rule = _exact(robust="mean", strategy="worldlm", attention=form, tau=tau, eps=eps, mix="none")
    out, mom = region_round(rule, members, tokens, anchor=anchor, momentum=None)
    b_mean = weighted_mean([SPLIT.take_backbone(m) for m in members], tokens)
    k_att = attention.attentive_aggregate([SPLIT.take_key(m) for m in members], SPLIT.take_key(anchor), tokens,
                                          form=form, tau=tau, eps=eps)
    assert mom is None
    for o in out:  # mix "none" (the paper's): every member adopts the agreed model
        _close(SPLIT.take_backbone(o), b_mean)
        _close(SPLIT.take_key(o), k_att, atol=1e-5)
    # the shipped mix ("evidence") agrees on the same model; members without a tune slice keep their own
    shipped = _exact(robust="mean", attention=form, tau=tau, eps=eps)
    kept, _, agreed = region_round_with_anchor(shipped, members, tokens, anchor=anchor, momentum=None)
    _close(SPLIT.take_backbone(agreed), b_mean)
    _close(SPLIT.take_key(agreed), k_att, atol=1e-5)
    for k, m in zip(kept, members):
        _close(k, m, atol=0)
    # with the key-only scope they adopt the agreed backbone and keep their own key layers
    keyed = _exact(robust="mean", attention=form, tau=tau, eps=eps, personal_scope="key")
    kept, _, _ = region_round_with_anchor(keyed, members, tokens, anchor=anchor, momentum=None)
    for k, m in zip(kept, members):
        _close(SPLIT.take_backbone(k), SPLIT.take_backbone(agreed), atol=0)
        _close(SPLIT.take_key(k), SPLIT.take_key(m), atol=0)
    # the attention matters here: K is not the plain token-weighted mean (except for the mean form)
    k_mean = weighted_mean([SPLIT.take_key(m) for m in members], tokens)
    assert (form == "mean") == all(torch.allclose(a, b, atol=1e-5) for a, b in zip(k_att, k_mean))


@pytest.mark.parametrize("strategy", ["worldlm", "hierfavg", "fedper"])
def test_region_round_nesterov_outer(strategy):
    rule = _exact(robust="mean", strategy=strategy, outer="nesterov", outer_lr=0.7, outer_momentum=0.9, mix="none")
    anchor, members, tokens = _region(seed=4)
    g = torch.Generator().manual_seed(40)
    ref_b, ref_m = rule.backbone(anchor), None
    momentum = None
    for _ in range(3):  # three rounds, members drift from the new anchor each time
        out, momentum = region_round(rule, members, tokens, anchor=anchor, momentum=momentum)
        avg_b = weighted_mean([rule.backbone(m) for m in members], tokens)
        ref_b, ref_m = outer_update(ref_b, avg_b, ref_m, kind="nesterov", lr=0.7, mu=0.9)
        for o in out:
            _close(rule.backbone(o), ref_b, atol=1e-5)
        _close(momentum, ref_m, atol=1e-5)
        anchor = out[0] if strategy != "fedper" else SPLIT.merge(SPLIT.take_backbone(out[0]), SPLIT.take_key(anchor))
        members = [_model(g, 0.2, o) for o in out]
    # not just the mean: momentum moves the backbone past it
    assert not all(torch.allclose(a, b, atol=1e-4) for a, b in zip(ref_b, avg_b))


def test_region_apply_rejects_short_payload():
    anchor, members, _ = _region()
    rule = _exact(robust="mean", strategy="worldlm")
    with pytest.raises(ValueError):
        region_apply(rule, [torch.zeros(3)], params=members[0], anchor=anchor, momentum=None)


# ------------------------------------------------------------------------------ world rounds


def _regions(seed=5, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    base = _model(g)
    regions = {r: _model(g, scale, base) for r in ("asia", "eu", "na")}
    tokens = {"asia": 300.0, "eu": 1000.0, "na": 500.0}
    return regions, tokens


def test_world_round_hierfavg_is_the_token_weighted_mean():
    regions, tokens = _regions()
    res = world_round(_exact(robust="mean", strategy="hierfavg"), regions, tokens)
    mean = weighted_mean([regions[r] for r in ("eu", "na", "asia")], [tokens[r] for r in ("eu", "na", "asia")])
    assert set(res.models) == set(regions) and res.weights == {} and res.fetched == {}
    for m in res.models.values():
        _close(m, mean)


def test_world_round_compressed_in_fp16_is_the_mean_of_the_fp16_models_encoded_once_more():
    from worldlm_p2p.rounds import world_codecs

    regions, tokens = _regions(seed=4)
    exact = world_round(_exact(robust="mean", strategy="hierfavg"), regions, tokens)
    rule = _exact(robust="mean", strategy="hierfavg", compress_world="fp16")
    assert RoundRule.of(SPLIT).config.compress_world == "fp16"  # the default
    assert world_codecs(_exact(robust="mean", strategy="hierfavg"), regions["eu"]) is None
    assert world_codecs(rule, regions["eu"]) == ["fp16"] * len(regions["eu"])
    res = world_round(rule, regions, tokens)
    # independent reference: each leader's model as fp16 carries it, the weighted mean, in fp16 again
    names = sorted(regions)
    halves = [[t.half().float() for t in regions[r]] for r in names]
    ref = [t.half().float() for t in weighted_mean(halves, [tokens[r] for r in names])]
    for m in res.models.values():
        _close(m, ref)
    # ... within fp16's relative precision of the float32 round, not equal to it
    diff = max(float((a - b).abs().max()) for a, b in zip(res.models["eu"], exact.models["eu"]))
    scale = max(float(t.abs().max()) for t in exact.models["eu"])
    assert 0 < diff <= 2 * 2 ** -11 * scale


def test_world_round_worldlm_without_residual():
    regions, tokens = _regions()
    res = world_round(_exact(robust="mean", strategy="worldlm", residual=False), regions, tokens)
    b_mean = weighted_mean([SPLIT.take_backbone(regions[r]) for r in regions], [tokens[r] for r in regions])
    for r, m in res.models.items():
        _close(SPLIT.take_backbone(m), b_mean)
        assert all(torch.equal(a, b) for a, b in zip(SPLIT.take_key(m), SPLIT.take_key(regions[r])))
    assert res.weights == {} and res.fetched == {}


def test_world_round_worldlm_residual_hand_computed():
    # Two regions with equal tokens: K_world = mean, so r_na = -r_eu exactly and (the sketch is linear)
    # cos(e_eu, e_na) = -1 on every layer. With residual_tau = 1/ln2: a_eu,na = 2^-1 / (2^1 + 2^-1) = 1/5.
    # K_eu <- K_eu + beta * 1/5 * (r_na - r_eu) = K_eu - 2 beta / 5 * r_eu = K_eu - 0.2 r_eu (beta = 0.5).
    # k_proj: K_eu = [[4,0],[0,0]], K_na = [[0,2],[0,0]] -> K_world = [[2,1],[0,0]], r_eu = [[2,-1],[0,0]]
    #   -> K_eu' = [[4 - 0.4, 0 + 0.2], [0, 0]] = [[3.6, 0.2], [0, 0]], K_na' = [[0.4, 1.8], [0, 0]]
    # v_proj: K_eu = [1, 3], K_na = [3, 3] -> K_world = [2, 3], r_eu = [-1, 0]
    #   -> K_eu' = [1.2, 3], K_na' = [2.8, 3]
    eu = [T([1.0, 2.0, 3.0]), T([[4.0, 0.0], [0.0, 0.0]]), T([1.0, 3.0]), torch.zeros(2, 3)]
    na = [T([3.0, 2.0, 1.0]), T([[0.0, 2.0], [0.0, 0.0]]), T([3.0, 3.0]), torch.ones(2, 3)]
    rule = _exact(robust="mean", strategy="worldlm", residual=True, residual_attention="world", residual_dim=16, residual_tau=1 / LN2,
                     residual_beta=0.5)
    res = world_round(rule, {"eu": eu, "na": na}, {"eu": 10.0, "na": 10.0})
    b_world = [T([2.0, 2.0, 2.0]), torch.full((2, 3), 0.5)]
    _close(SPLIT.take_backbone(res.models["eu"]), b_world)
    _close(SPLIT.take_backbone(res.models["na"]), b_world)
    _close(SPLIT.take_key(res.models["eu"]), [T([[3.6, 0.2], [0.0, 0.0]]), T([1.2, 3.0])], atol=1e-5)
    _close(SPLIT.take_key(res.models["na"]), [T([[0.4, 1.8], [0.0, 0.0]]), T([2.8, 3.0])], atol=1e-5)
    assert res.weights["eu"]["na"] == pytest.approx([0.2, 0.2], abs=1e-6)
    assert res.weights["eu"]["eu"] == pytest.approx([0.8, 0.8], abs=1e-6)
    assert res.fetched == {"eu": ["na"], "na": ["eu"]}

    # a small residual_tau: the opposite region weighs 1 / (1 + e^(2/0.1)) < FETCH_MIN_WEIGHT, so it is
    # not fetched and K stays the region's own
    assert 1 / (1 + math.exp(20)) < FETCH_MIN_WEIGHT
    rule = _exact(robust="mean", strategy="worldlm", residual=True, residual_attention="world", residual_dim=16, residual_tau=0.1)
    res = world_round(rule, {"eu": eu, "na": na}, {"eu": 10.0, "na": 10.0})
    assert res.fetched == {"eu": [], "na": []}
    _close(SPLIT.take_key(res.models["eu"]), SPLIT.take_key(eu))
    _close(SPLIT.take_key(res.models["na"]), SPLIT.take_key(na))


def _two_regions():
    """Two regions' models (the split's backbone and K) of the partners tests below."""
    eu = [T([1.0, 2.0, 3.0]), T([[4.0, 0.0], [0.0, 0.0]]), T([1.0, 3.0]), torch.zeros(2, 3)]
    na = [T([3.0, 2.0, 1.0]), T([[0.0, 2.0], [0.0, 0.0]]), T([3.0, 3.0]), torch.ones(2, 3)]
    return eu, na


def _partners(beta: float) -> RoundRule:
    return _exact(robust="mean", strategy="worldlm", residual=True, residual_dim=16, residual_tau=0.1,
                  residual_beta=beta, residual_attention="partners")


def test_world_round_worldlm_partners_hand_computed():
    # residual_attention = "partners": with two regions each is the other's only partner (weight 1),
    # so K_eu <- K_eu + beta (K_na - K_eu): with beta = 0.5 and equal tokens both meet at K_world
    # (k_proj [[2, 1], [0, 0]], v_proj [2, 3]; the inputs of the test above); with beta = 0.25 eu
    # goes a quarter of the way: k_proj [[3, 0.5], [0, 0]], v_proj [1.5, 3]
    eu, na = _two_regions()
    rule = _partners(0.5)
    res = world_round(rule, {"eu": eu, "na": na}, {"eu": 10.0, "na": 10.0})
    for r in ("eu", "na"):
        _close(SPLIT.take_key(res.models[r]), [T([[2.0, 1.0], [0.0, 0.0]]), T([2.0, 3.0])], atol=1e-6)
        _close(SPLIT.take_backbone(res.models[r]), [T([2.0, 2.0, 2.0]), torch.full((2, 3), 0.5)])
    assert res.weights["eu"] == {"eu": [0.0, 0.0], "na": [1.0, 1.0]} and res.fetched == {"eu": ["na"], "na": ["eu"]}
    rule = _partners(0.25)
    res = world_round(rule, {"eu": eu, "na": na}, {"eu": 10.0, "na": 10.0})
    _close(SPLIT.take_key(res.models["eu"]), [T([[3.0, 0.5], [0.0, 0.0]]), T([1.5, 3.0])], atol=1e-6)
    # a region alone keeps its K (no partner)
    alone = world_round(rule, {"eu": eu}, {"eu": 10.0})
    _close(SPLIT.take_key(alone.models["eu"]), SPLIT.take_key(eu))


def test_leader_residual_step_takes_what_its_tune_slice_supports_hand_computed():
    # partners with beta 0.5: each region's K would move to K_world (the test above): for eu the step
    # d = K_world - K_eu = k_proj [[-2, 1], [0, 0]], v_proj [1, 0]. eu's leader's slice loss is
    # ||K - (K_eu + 0.3 d)||^2, a parabola in the fraction s of the step taken: the line search tries
    # s = 0 (0.09 |d|^2), 1/4 (0.0025 |d|^2), 1/2 (0.04 |d|^2: bracketed) and the parabola's vertex,
    # s = 0.3 exactly: K_eu + 0.3 d = k_proj [[3.4, 0.3], [0, 0]], v_proj [1.3, 3]. na's leader has no
    # slice (None): the whole step. Backbones: the world's mean either way.
    eu, na = _two_regions()
    rule = _partners(0.5)
    assert rule.residual_step_evidence
    target = [T([[3.4, 0.3], [0.0, 0.0]]), T([1.3, 3.0])]
    calls = []

    def eu_loss(params):
        calls.append(1)
        return float(sum(((k - t) ** 2).sum() for k, t in zip(SPLIT.take_key(params), target)))

    res = world_round(rule, {"eu": eu, "na": na}, {"eu": 10.0, "na": 10.0}, leader_loss={"eu": eu_loss, "na": None})
    assert res.steps["eu"] == pytest.approx(0.3, abs=1e-6) and len(calls) == 4  # 0, 1/4, 1/2 and the vertex
    _close(SPLIT.take_key(res.models["eu"]), target, atol=1e-6)
    _close(SPLIT.take_key(res.models["na"]), [T([[2.0, 1.0], [0.0, 0.0]]), T([2.0, 3.0])], atol=1e-6)
    for r in ("eu", "na"):
        _close(SPLIT.take_backbone(res.models[r]), [T([2.0, 2.0, 2.0]), torch.full((2, 3), 0.5)])
    # a leader whose slice refutes any step: the region keeps its K exactly
    res = world_round(rule, {"eu": eu, "na": na}, {"eu": 10.0, "na": 10.0},
                      leader_loss={"eu": lambda p: float(sum(((k - e) ** 2).sum() for k, e in
                                                             zip(SPLIT.take_key(p), SPLIT.take_key(eu))))})
    assert res.steps == {"eu": 0.0}
    assert all(torch.equal(a, b) for a, b in zip(SPLIT.take_key(res.models["eu"]), SPLIT.take_key(eu)))
    # the paper's form ("world") and a rule without evidence mixing take no evidence on the step
    for off in (dict(residual_attention="world"), dict(residual_attention="partners", mix="none")):
        r_off = _exact(robust="mean", strategy="worldlm", residual=True, residual_dim=16, residual_tau=0.1,
                       residual_beta=0.5, **off)
        assert not r_off.residual_step_evidence
        plain = world_round(r_off, {"eu": eu, "na": na}, {"eu": 10.0, "na": 10.0})
        got = world_round(r_off, {"eu": eu, "na": na}, {"eu": 10.0, "na": 10.0}, leader_loss={"eu": eu_loss})
        assert got.steps == {} and all(torch.equal(a, b) for a, b in zip(got.models["eu"], plain.models["eu"]))


def test_world_round_worldlm_residual_matches_the_formula():
    regions, tokens = _regions(seed=6)
    names = sorted(regions)
    rule = _exact(robust="mean", strategy="worldlm", residual=True, residual_attention="world", residual_dim=8, residual_tau=2.0,
                     residual_beta=0.7, seed=3)
    out = world_round(rule, regions, tokens)
    # independent reference: K_world = token-weighted mean of K; r_R = K_R - K_world; embeddings are
    # per-layer count sketches; K_R' = K_R + beta * sum_{G != R} a_RG,l (r_G,l - r_R,l), written per layer
    total = sum(tokens.values())
    keys = {r: SPLIT.take_key(regions[r]) for r in names}
    k_world = [sum(tokens[r] / total * keys[r][l].double() for r in names) for l in range(2)]
    res = {r: [keys[r][l].double() - k_world[l] for l in range(2)] for r in names}
    emb = {r: residual.residual_embedding(res[r], dim=8, seed=3) for r in names}
    b_world = [sum(tokens[r] / total * SPLIT.take_backbone(regions[r])[j].double() for r in names) for j in range(2)]
    for r in names:
        w = residual.cross_region_weights(emb, r, tau=2.0)  # tau 2: every weight is far above the threshold
        assert all(float(w[g].min()) > FETCH_MIN_WEIGHT for g in names)
        want_k = [keys[r][l].double() + 0.7 * sum(w[g][l] * (res[g][l] - res[r][l]) for g in names if g != r)
                  for l in range(2)]
        _close(SPLIT.take_key(out.models[r]), [k.float() for k in want_k], atol=1e-5)
        _close(SPLIT.take_backbone(out.models[r]), [b.float() for b in b_world], atol=1e-5)
        assert out.fetched[r] == [g for g in names if g != r]
        assert set(out.weights[r]) == set(names)
        # the world's K itself is never adopted
        assert not torch.allclose(SPLIT.take_key(out.models[r])[0], k_world[0].float(), atol=1e-3)


def test_world_round_single_region_is_unchanged_for_worldlm():
    regions, tokens = _regions()
    one = {"eu": regions["eu"]}
    res = world_round(_exact(robust="mean", strategy="worldlm"), one, {"eu": tokens["eu"]})
    _close(res.models["eu"], regions["eu"])


@pytest.mark.parametrize("scope", ["key", "all"])
def test_region_round_worldlm_personal_mix(scope):
    from worldlm_p2p.rounds import region_round_with_anchor

    anchor, members, tokens = _region(seed=7, scale=0.3)
    rule = _exact(robust="mean", strategy="worldlm", mix="cosine", personal_tau=0.3, personal_scope=scope)
    plain = _exact(robust="mean", strategy="worldlm", mix="none")
    out, _, agreed = region_round_with_anchor(rule, members, tokens, anchor=anchor, momentum=None)
    ref_out, _ = region_round(plain, members, tokens, anchor=anchor, momentum=None)
    # the region's agreed model is the plain worldlm round's result, whatever the members keep
    _close(agreed, ref_out[0], atol=1e-6)
    for m, o in zip(members, out):
        want_k = attention.personalize(SPLIT.take_key(m), SPLIT.take_key(anchor), SPLIT.take_key(agreed), tau=0.3)
        _close(SPLIT.take_key(o), want_k, atol=1e-6)
        if scope == "key":
            _close(SPLIT.take_backbone(o), SPLIT.take_backbone(agreed))
        else:
            want_b = attention.personalize(SPLIT.take_backbone(m), SPLIT.take_backbone(anchor),
                                           SPLIT.take_backbone(agreed), tau=0.3)
            _close(SPLIT.take_backbone(o), want_b, atol=1e-6)
    # members keep different models
    assert max(float((a - b).abs().max()) for a, b in zip(SPLIT.take_key(out[0]), SPLIT.take_key(out[1]))) > 1e-3


# ------------------------------------------------------------------------------ border DP


def _rule_and_models(strategy="worldlm"):
    from worldlm_p2p.config import AggregationConfig
    from worldlm_p2p.rounds import RoundRule
    from worldlm_p2p.split import split_parameters

    names = ["emb", "layers.0.k_proj.weight", "layers.0.mlp.weight", "head"]
    split = split_parameters(names, "*k_proj*")
    rule = RoundRule.from_config(AggregationConfig(strategy=strategy), split, seed=0)
    g = torch.Generator().manual_seed(0)
    ref = [torch.randn(3, 2, generator=g) for _ in names]
    models = {r: [t + torch.randn(t.shape, generator=g) * s for t in ref] for r, s in (("eu", 1.0), ("na", 0.01))}
    return rule, ref, models


def test_border_release_clips_and_noises_only_the_backbone_change():
    from worldlm_p2p.privacy import gaussian_noise, l2_norm
    from worldlm_p2p.rounds import border_release

    rule, ref, models = _rule_and_models()
    eu = models["eu"]
    sent, rec = border_release(rule, eu, ref, clip=0.5, noise_multiplier=0.0, generator=torch.Generator())
    B, K = rule.split.backbone, rule.split.key
    change = [sent[i] - ref[i] for i in B]
    assert l2_norm(change) == pytest.approx(0.5, rel=1e-6)  # clipped: what leaves is within C
    full = [eu[i] - ref[i] for i in B]
    assert rec.norm == pytest.approx(l2_norm(full)) and rec.norm > 0.5
    scale = 0.5 / rec.norm
    assert all(torch.allclose(c, f * scale, atol=1e-6) for c, f in zip(change, full))  # same direction
    assert all(torch.equal(sent[i], eu[i]) for i in K)  # K leaves unchanged
    # with noise: exactly the clipped change plus noise of std sigma*C from the generator
    noisy, rec = border_release(rule, eu, ref, clip=0.5, noise_multiplier=2.0, generator=torch.Generator().manual_seed(3))
    noise = gaussian_noise([eu[i] for i in B], 1.0, torch.Generator().manual_seed(3))
    assert rec.noise_std == 1.0
    for i, n, c in zip(B, noise, change):
        assert torch.allclose(noisy[i], ref[i] + c + n, atol=1e-6)
    # a small change passes unclipped
    small, rec = border_release(rule, models["na"], ref, clip=10.0, noise_multiplier=0.0, generator=torch.Generator())
    assert all(torch.allclose(small[i], models["na"][i], atol=1e-6) for i in range(len(ref)))
    # hierfavg shares (and so privatises) the whole model
    rule_h, *_ = _rule_and_models("hierfavg")
    sent_h, _ = border_release(rule_h, eu, ref, clip=0.5, noise_multiplier=0.0, generator=torch.Generator())
    assert l2_norm([s - r for s, r in zip(sent_h, ref)]) == pytest.approx(0.5, rel=1e-6)


def test_world_round_averages_what_was_sent_and_keeps_each_region_k():
    from worldlm_p2p.aggregation import weighted_mean
    from worldlm_p2p.rounds import border_release, world_round

    rule, ref, models = _rule_and_models()
    tokens = {"eu": 3.0, "na": 1.0}
    sent = {r: border_release(rule, models[r], ref, clip=0.1, noise_multiplier=0.5,
                              generator=torch.Generator().manual_seed(i))[0] for i, r in enumerate(sorted(models))}
    out = world_round(rule, models, tokens, sent=sent)
    # (world rounds travel in fp16 by default: each released model, and the mean, as fp16 carries them)
    assert rule.config.compress_world == "fp16"
    mean = weighted_mean([[t.half().float() for t in sent[r]] for r in ("eu", "na")], [3.0, 1.0])
    for r in models:
        for i in rule.split.backbone:
            assert torch.allclose(out.models[r][i], mean[i].half().float(), atol=1e-6)
    plain = world_round(rule, models, tokens)
    assert not torch.allclose(plain.models["eu"][0], out.models["eu"][0])


def test_fedavg_round_with_border_dp():
    from worldlm_p2p.config import AggregationConfig
    from worldlm_p2p.privacy import l2_norm
    from worldlm_p2p.rounds import RoundRule, flat_round_with_border_dp, region_round_with_anchor
    from worldlm_p2p.split import split_parameters

    split = split_parameters(["a", "k_proj", "b"], "*k_proj*")
    rule = RoundRule.from_config(AggregationConfig(strategy="fedavg", robust="mean", compress_backbone="none",
                                                 compress_key="none"), split, seed=0)
    g = torch.Generator().manual_seed(1)
    anchor = [torch.randn(2, 3, generator=g) for _ in range(3)]
    eu = [[a + torch.randn(a.shape, generator=g) for a in anchor] for _ in range(2)]
    na = [[a + torch.randn(a.shape, generator=g) for a in anchor]]
    regions = {"eu": (eu, [2.0, 1.0]), "na": (na, [3.0])}
    gens = {r: torch.Generator().manual_seed(i) for i, r in enumerate(regions)}
    # no noise, a clip no delta reaches: the flat token-weighted round of every member (the mean rule:
    # border DP averages the regions' releases by their weighted mean)
    out, _, agreed, rec = flat_round_with_border_dp(rule, regions, anchor=anchor, momentum=None, clip=1e6,
                                                    noise_multiplier=0.0, generators=gens)
    want, _, want_agreed = region_round_with_anchor(rule, eu + na, [2.0, 1.0, 3.0], anchor=anchor, momentum=None)
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(agreed, want_agreed))
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(out["na"][0], want[2]))
    # a tight clip: each region's change is cut to C before the average (by hand: weights 1/2, 1/2)
    out, _, agreed, rec = flat_round_with_border_dp(rule, regions, anchor=anchor, momentum=None, clip=0.1,
                                                    noise_multiplier=0.0, generators=gens)
    assert all(r.clipped_norm == pytest.approx(0.1) for r in rec.values())
    assert l2_norm([x - a for x, a in zip(agreed, anchor)]) <= 0.1 + 1e-6


@pytest.mark.parametrize("strategy", ["worldlm", "hierfavg", "fedper", "fedavg"])
def test_a_group_of_one_is_the_identity(strategy):
    """A group of one member has nothing to average (a swarm peer alone in its region holds no
    round): its model is the agreed model bit for bit, the momentum unchanged, whatever the outer
    optimizer and the attention step."""
    rule = _exact(robust="mean", strategy=strategy, outer="nesterov", outer_lr=0.7, eps=0.5, mix="evidence")
    anchor, members, _ = _region(seed=5)
    momentum = [torch.full_like(t, 0.25) for t in rule.backbone(anchor)]
    choices: list = []
    out, mom, agreed = region_round_with_anchor(rule, members[:1], [7.0], anchor=anchor, momentum=momentum,
                                                loss_of=[lambda p: 0.0], choices=choices)
    assert all(torch.equal(a, b) for a, b in zip(out[0], members[0]))
    assert all(torch.equal(a, b) for a, b in zip(agreed, members[0]))
    assert mom is momentum
    assert choices == ([None] if rule.evidence else [])


def test_world_grid_and_the_largest_world_step() -> None:
    from worldlm_p2p.rounds import WORLD_GRID, member_world_mix, world_grid

    assert world_grid(0.25) == WORLD_GRID == (1 / 16, 1 / 4)
    assert world_grid(1.0) == (1 / 16, 1 / 4, 1.0)
    assert world_grid(0.5) == (1 / 16, 1 / 4, 0.5)
    with pytest.raises(ValueError, match="largest world step"):
        world_grid(0.0)
    # a loss that keeps falling towards the whole change: the member takes the largest step allowed
    own, change = [torch.zeros(3)], [torch.ones(3)]

    def loss_of(params):
        return float((params[0] - 1).pow(2).sum())

    for max_step, expected in ((0.25, 0.25), (1.0, 1.0)):
        rule = _exact(robust="mean", strategy="worldlm", mix="evidence", mix_world_max=max_step, personal_scope="all")
        out, choice = member_world_mix(rule, own=own, change=change, loss_of=loss_of)
        assert choice.lam == expected
        assert torch.allclose(out[0], torch.full((3,), expected))


def test_world_round_attention_two_regions_hand_computed():
    # world_target = "attention": two regions, each other's only partner (weight 1), whole model:
    # theta_eu <- theta_eu + beta (theta_na - theta_eu); beta 0.5 -> the midpoint, B and K alike
    eu = [T([1.0, 2.0, 3.0]), T([[4.0, 0.0], [0.0, 0.0]]), T([1.0, 3.0]), torch.zeros(2, 3)]
    na = [T([3.0, 2.0, 1.0]), T([[0.0, 2.0], [0.0, 0.0]]), T([3.0, 3.0]), torch.ones(2, 3)]
    rule = _exact(robust="mean", strategy="worldlm", residual_dim=16, residual_beta=0.5, world_target="attention")
    assert rule.world_attention
    res = world_round(rule, {"eu": eu, "na": na}, {"eu": 30.0, "na": 10.0})
    mid = [(a + b) / 2 for a, b in zip(eu, na)]
    _close(res.models["eu"], mid)
    _close(res.models["na"], mid)
    assert res.weights == {"eu": {"na": [1.0]}, "na": {"eu": [1.0]}} and res.fetched == {"eu": ["na"], "na": ["eu"]}
    # the world mean is still the token-weighted mean (the reference of border deltas)
    _close(res.world, [(3 * a + b) / 4 for a, b in zip(eu, na)])
    rule = _exact(robust="mean", strategy="worldlm", residual_dim=16, residual_beta=0.2, world_target="attention")
    res = world_round(rule, {"eu": eu, "na": na}, {"eu": 30.0, "na": 10.0})
    _close(res.models["eu"], [a + 0.2 * (b - a) for a, b in zip(eu, na)])
    # without residuals the target is ignored: the world's mean backbone, as with "mean"
    off = _exact(robust="mean", strategy="worldlm", residual=False, world_target="attention")
    assert not off.world_attention
    mean = world_round(_exact(robust="mean", strategy="worldlm", residual=False), {"eu": eu, "na": na},
                       {"eu": 30.0, "na": 10.0})
    out = world_round(off, {"eu": eu, "na": na}, {"eu": 30.0, "na": 10.0})
    for r in ("eu", "na"):
        _close(out.models[r], mean.models[r])


def test_world_round_attention_matches_the_formula():
    regions, tokens = _regions(seed=8)
    names = sorted(regions)
    rule = _exact(robust="mean", strategy="worldlm", residual_dim=8, residual_tau=0.7, residual_beta=0.6, seed=2,
                     world_target="attention")
    out = world_round(rule, regions, tokens)
    # independent reference: theta_world = token-weighted mean of every tensor; sketches of
    # theta_R - theta_world per tensor; a_RG = softmax_{G != R}(-D_RG / mean D / tau), D the squared
    # distance of the summed per-tensor sketches (one sketch of the whole residual);
    # theta_R' = theta_R + beta sum_G a_RG (theta_G - theta_R)
    total = sum(tokens.values())
    world = [sum(tokens[r] / total * regions[r][j].double() for r in names) for j in range(len(SHAPES))]
    res = {r: [regions[r][j].double() - world[j] for j in range(len(SHAPES))] for r in names}
    emb = {r: residual.residual_embedding(res[r], dim=8, seed=2).double().sum(dim=0) for r in names}
    for r in names:
        others = [g for g in names if g != r]
        d = T([float(((emb[r] - emb[g]) ** 2).sum()) for g in others], dtype=torch.float64)
        a = torch.softmax(-d / d.mean() / 0.7, dim=0)
        want = [regions[r][j].double() + 0.6 * sum(a[i] * (regions[g][j].double() - regions[r][j].double())
                                                   for i, g in enumerate(others)) for j in range(len(SHAPES))]
        _close(out.models[r], [w.float() for w in want], atol=1e-5)
        assert out.weights[r] == {g: [pytest.approx(float(a[i]), abs=1e-6)] for i, g in enumerate(others)}
    # order of the regions does not matter
    again = world_round(rule, {r: regions[r] for r in reversed(names)}, tokens)
    for r in names:
        _close(again.models[r], out.models[r], atol=0)


def test_world_round_attention_uses_what_was_sent():
    # border DP: what others take of a region is what it sent (its clipped, noised backbone change)
    rule_mean, ref, models = _rule_and_models()
    from worldlm_p2p.rounds import border_release

    rule = RoundRule.of(rule_mean.split, strategy="worldlm", residual_beta=1.0, world_target="attention")
    tokens = {"eu": 3.0, "na": 1.0}
    sent = {r: border_release(rule, models[r], ref, clip=0.1, noise_multiplier=0.5,
                              generator=torch.Generator().manual_seed(i))[0] for i, r in enumerate(sorted(models))}
    out = world_round(rule, models, tokens, sent=sent)
    # beta 1, one partner: a region's next model is what the other sent
    _close(out.models["eu"], sent["na"], atol=1e-6)
    _close(out.models["na"], sent["eu"], atol=1e-6)


def test_world_attention_publishes_one_sketch_of_the_whole_residual():
    # a DHT record of residual_dim numbers whatever the model's size: the sum of the per-tensor
    # count sketches (itself a count sketch of the concatenated residual: linear in the residual)
    from worldlm_p2p.rounds import embed

    g = torch.Generator().manual_seed(5)
    res = _model(g)
    rule = _exact(robust="mean", strategy="worldlm", residual_dim=16, world_target="attention")
    e = embed(rule, res)
    assert e.shape == (1, 16)
    assert torch.allclose(e[0], residual.residual_embedding(res, dim=16, seed=0).sum(dim=0), atol=1e-6)
    twice = embed(rule, [2 * t for t in res])
    assert torch.allclose(twice, 2 * e, atol=1e-5)
    assert embed(_exact(robust="mean", strategy="worldlm", residual_dim=16), SPLIT.take_key(res)).shape == (2, 16)


# ------------------------------------------------------------------------------ the robust rule in rounds


@pytest.mark.parametrize("strategy", ["fedavg", "worldlm"])
def test_default_region_round_averages_by_the_robust_rule(strategy):
    """The shipped rule (clip) is what the round's all-reduce step computes: the pure robust mean of
    the members' payloads, weights capped; with the plain mean rule, the weighted mean."""
    from worldlm_p2p import robust
    from worldlm_p2p.rounds import group_average

    anchor, members, tokens = _region(n_members=4, seed=3)
    rule = _exact(strategy=strategy, mix="none")
    assert rule.config.robust == "clip"
    payloads = [region_payload(rule, p, anchor) for p in members]
    want, _ = robust.robust_mean_of_lists(payloads, tokens, clip=rule.config.robust_clip, max_weight=500.0)
    _close(group_average(rule, payloads, tokens, max_weight=500.0), want)
    out, _, agreed = region_round_with_anchor(rule, members, tokens, anchor=anchor, momentum=None, max_weight=500.0)
    expect, _ = region_apply(rule, want, params=members[0], anchor=anchor, momentum=None)
    _close(out[0], expect)
    mean_rule = _exact(strategy=strategy, mix="none", robust="mean")
    _close(group_average(mean_rule, payloads, tokens), weighted_mean(payloads, tokens))


def test_a_scaled_member_moves_the_default_round_boundedly_and_the_mean_round_without_bound():
    anchor, members, tokens = _region(n_members=3, seed=4, scale=0.01)
    attacked = members[:2] + [[t * 1000 for t in members[2]]]
    weights = tokens[:2] + [1e9]
    honest = weighted_mean(members[:2], tokens[:2])
    spread = [(a - b).abs() for a, b in zip(*members[:2])]
    clip_rule = _exact(strategy="fedavg")
    (out, *_), _, _ = region_round_with_anchor(clip_rule, attacked, weights, anchor=anchor, momentum=None,
                                               max_weight=max(tokens[:2]))
    share = max(tokens[:2]) / (sum(tokens[:2]) + max(tokens[:2]))
    for o, h, s in zip(out, honest, spread):
        assert bool(((o - h).abs() <= (clip_rule.config.robust_clip + 1) * s * share + 1e-6).all())
    mean_rule = _exact(strategy="fedavg", robust="mean")
    (bad, *_), _, _ = region_round_with_anchor(mean_rule, attacked, weights, anchor=anchor, momentum=None)
    assert max(float((b - h).abs().max()) for b, h in zip(bad, honest)) > 10


def test_a_world_change_is_refuted_when_it_undoes_half_of_what_the_region_learnt():
    """Hand values with vocab 259 (log 259 = 5.5568): a region model at loss 2.5 has learnt 3.0568
    nats over a model that knows nothing; the limit is 2.5 + 0.5 * 3.0568 + 0.02 * 2.5 = 4.0784."""
    import math

    from worldlm_p2p.rounds import world_change_refuted

    limit = 2.5 + 0.5 * (math.log(259) - 2.5) + 0.02 * 2.5
    assert abs(limit - 4.0784) < 1e-4
    assert not world_change_refuted(before=2.5, after=limit - 1e-6, vocab_size=259)
    assert world_change_refuted(before=2.5, after=limit + 1e-6, vocab_size=259)
    assert not world_change_refuted(before=2.5, after=2.2, vocab_size=259)  # a change that helps
    assert world_change_refuted(before=2.5, after=295.0, vocab_size=259)  # random tensors (issue 12's table)
    assert world_change_refuted(before=2.5, after=float("nan"), vocab_size=259)
    assert world_change_refuted(before=2.5, after=float("inf"), vocab_size=259)
    assert not world_change_refuted(before=float("nan"), after=9.0, vocab_size=259)  # no evidence
    # a region that has learnt nothing yet still refuses what is worse than knowing nothing, by 2%
    assert not world_change_refuted(before=6.0, after=6.1, vocab_size=259)
    assert world_change_refuted(before=6.0, after=6.13, vocab_size=259)


def test_a_world_change_whose_key_layers_members_filter_is_held_to_knowing_nothing_its_backbone_to_half():
    """Hand values as above (vocab 259, loss 2.5): the backbone's bound is 4.0784 (half of what was
    learnt undone), the whole change's 2.5 + 3.0568 + 0.05 = 5.6068 (worse than knowing nothing),
    when the member's models take a world change's K by evidence (the defaults); otherwise the whole
    change is held to 4.0784."""
    import math

    from worldlm_p2p.rounds import world_change_refused

    half = 2.5 + 0.5 * (math.log(259) - 2.5) + 0.05
    nothing = 2.5 + 1.0 * (math.log(259) - 2.5) + 0.05
    assert abs(half - 4.0784) < 1e-4 and abs(nothing - 5.6068) < 1e-4
    rule = _exact()  # the defaults: evidence mixing of world changes, the shared model filters K
    assert rule.filters_world_key

    def refused(r, after, backbone):
        return world_change_refused(r, before=2.5, after=after, after_backbone=backbone, vocab_size=259)

    assert not refused(rule, 5.0, 3.0)  # K that does not suit this member (undoes 0.82): taken
    assert not refused(rule, nothing - 1e-6, half - 1e-6)
    assert refused(rule, nothing + 1e-6, 3.0)  # worse than knowing nothing
    assert refused(rule, 3.0, half + 1e-6)  # the backbone's part undoes more than half
    assert refused(rule, 295.0, 295.0) and refused(rule, float("nan"), 3.0) and refused(rule, 3.0, float("inf"))
    assert refused(rule, 5.0, None)  # the backbone's part not evaluated: the whole change, to half
    assert not world_change_refused(rule, before=float("nan"), after=9.0, after_backbone=9.0, vocab_size=259)
    # models that take K whole (the shared model adopting world changes, or no evidence mixing):
    # the whole change to half, the backbone's part aside
    for other in (RoundRule.of(SPLIT, shared_model="agreed"), _exact(mix="none"), _exact(mix_world=False)):
        assert not other.filters_world_key
        assert refused(other, 5.0, 3.0) and not refused(other, half - 1e-6, 3.0)


def test_stale_apply_adds_the_progress_made_while_the_round_was_in_flight():
    # hand-computed: the round turned the snapshot [1, 2] into [3, 3]; meanwhile training went on
    # from the snapshot to [1.5, 1]: the member ends at [3.5, 2]
    pre, new, now = [torch.tensor([1.0, 2.0])], [torch.tensor([3.0, 3.0])], [torch.tensor([1.5, 1.0])]
    assert torch.equal(stale_apply(new, pre=pre, current=now)[0], torch.tensor([3.5, 2.0]))
    # nothing trained meanwhile: the synchronous round's result, bit for bit
    assert torch.equal(stale_apply(new, pre=pre, current=pre)[0], new[0])
    # the model's dtype is kept (the arithmetic is float32)
    half = stale_apply(new, pre=pre, current=[now[0].to(torch.bfloat16)])[0]
    assert half.dtype == torch.bfloat16 and torch.equal(half, torch.tensor([3.5, 2.0], dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="stale_apply"):
        stale_apply(new, pre=pre, current=[])


def test_a_stale_fedavg_round_keeps_each_members_own_progress():
    """Two members, plain FedAvg: the round gives both the mean of their snapshots; each then adds
    what it trained itself while the round was in flight, so they differ by exactly that."""
    rule = _exact(robust="mean", strategy="fedavg")
    x = [T([0.0, 0.0, 4.0]), torch.zeros(2, 2), T([1.0, 1.0]), torch.zeros(2, 3)]
    y = [T([4.0, 8.0, 0.0]), torch.ones(2, 2), T([1.0, 5.0]), torch.full((2, 3), 2.0)]
    new, _ = region_round(rule, [x, y], [1, 1], anchor=x, momentum=None)
    dx = [T([0.5, 0.0, 0.0]), torch.zeros(2, 2), T([0.0, -1.0]), torch.zeros(2, 3)]  # trained meanwhile
    dy = [torch.zeros(3), torch.full((2, 2), 0.25), torch.zeros(2), torch.ones(2, 3)]
    ox = stale_apply(new[0], pre=x, current=[a + d for a, d in zip(x, dx)])
    oy = stale_apply(new[1], pre=y, current=[a + d for a, d in zip(y, dy)])
    mean = [T([2.0, 4.0, 2.0]), torch.full((2, 2), 0.5), T([1.0, 3.0]), torch.ones(2, 3)]  # (x + y) / 2
    _close(ox, [m + d for m, d in zip(mean, dx)])
    _close(oy, [m + d for m, d in zip(mean, dy)])


def test_key_only_evidence_mix_adopts_the_agreed_backbone_and_mixes_only_the_key_layers() -> None:
    from worldlm_p2p.rounds import member_mix

    g = torch.Generator().manual_seed(11)
    own, agreed = _model(g), _model(g)
    rule = _exact(robust="mean", mix="evidence", personal_scope="key")
    assert rule.personal_key_only and not _exact(robust="mean", mix="evidence", personal_scope="all").personal_key_only
    assert not _exact(robust="mean").personal_key_only  # the shipped default: the whole model
    assert not _exact(robust="mean", mix="none", personal_scope="key").personal_key_only
    # a slice that prefers the member's own key layers: it keeps them, and takes the agreed backbone
    own_k = SPLIT.take_key(own)

    def keeps_own_k(params):
        return float(sum((p - k).pow(2).sum() for p, k in zip(SPLIT.take_key(params), own_k)))

    out, choice = member_mix(rule, own=own, agreed=agreed, loss_of=keeps_own_k)
    assert choice.lam == 0.0
    expected = [agreed[0], own[1], own[2], agreed[3]]  # backbone (0, 3) agreed, key (1, 2) own, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(out, expected))
    # a slice that prefers the agreed key layers: the member takes them whole (lam 1)
    agreed_k = SPLIT.take_key(agreed)

    def wants_agreed_k(params):
        return float(sum((p - k).pow(2).sum() for p, k in zip(SPLIT.take_key(params), agreed_k)))

    out, choice = member_mix(rule, own=own, agreed=agreed, loss_of=wants_agreed_k)
    assert choice.lam == 1.0
    _close(out, agreed)
    # no tune slice: no evidence, the own key layers on the agreed backbone
    out, choice = member_mix(rule, own=own, agreed=agreed, loss_of=None)
    assert choice is None and all(torch.equal(a, b) for a, b in zip(out, expected))


def test_key_only_world_mix_takes_the_whole_backbone_change_and_a_searched_share_of_the_key_change() -> None:
    from worldlm_p2p.rounds import member_world_mix

    own = [torch.zeros(s) for s in SHAPES]
    change = [torch.full(s, 2.0) for s in SHAPES]
    rule = _exact(robust="mean", mix="evidence", personal_scope="key")  # mix_world_max 0.25

    def loss_of(params):  # falls all the way towards the whole key change
        return float(sum((p - 2.0).pow(2).sum() for p in SPLIT.take_key(params)))

    out, choice = member_world_mix(rule, own=own, change=change, loss_of=loss_of, own_loss=123.0)
    assert choice.lam == 0.25
    # by hand: backbone 0 + 2 (whole), key layers 0 + 0.25 * 2
    assert torch.equal(out[0], torch.full((3,), 2.0)) and torch.equal(out[3], torch.full((2, 3), 2.0))
    assert torch.allclose(out[1], torch.full((2, 2), 0.5)) and torch.allclose(out[2], torch.full((2,), 0.5))
    # the own loss given was of the model before the backbone change: it was not reused
    assert choice.own_loss == loss_of([torch.zeros(s) for s in SHAPES])
    # no slice: the backbone change only
    out, choice = member_world_mix(rule, own=own, change=change, loss_of=None)
    assert choice is None
    assert torch.equal(out[0], torch.full((3,), 2.0)) and torch.equal(out[1], torch.zeros(2, 2))


def test_parts_scope_mixes_the_backbone_and_the_key_layers_each_by_evidence() -> None:
    from worldlm_p2p.rounds import member_mix, member_world_mix

    g = torch.Generator().manual_seed(12)
    own, agreed = _model(g), _model(g)
    rule = _exact(robust="mean", mix="evidence", personal_scope="parts")
    assert rule.mixes_by_part and not rule.personal_key_only
    own_k, agreed_b = SPLIT.take_key(own), SPLIT.take_backbone(agreed)

    def agreed_b_own_k(params):  # the slice wants the region's backbone with the member's own key layers
        return float(sum((p - t).pow(2).sum() for p, t in zip(SPLIT.take_backbone(params), agreed_b))
                     + sum((p - t).pow(2).sum() for p, t in zip(SPLIT.take_key(params), own_k)))

    out, choice = member_mix(rule, own=own, agreed=agreed, loss_of=agreed_b_own_k)
    assert (choice.lam, choice.second_lam) == (1.0, 0.0)
    _close(SPLIT.take_backbone(out), agreed_b, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(SPLIT.take_key(out), own_k))
    # the order of the parts does not decide: a slice that wants the agreed K and the own B gets them
    own_b, agreed_k = SPLIT.take_backbone(own), SPLIT.take_key(agreed)

    def own_b_agreed_k(params):
        return float(sum((p - t).pow(2).sum() for p, t in zip(SPLIT.take_backbone(params), own_b))
                     + sum((p - t).pow(2).sum() for p, t in zip(SPLIT.take_key(params), agreed_k)))

    out, choice = member_mix(rule, own=own, agreed=agreed, loss_of=own_b_agreed_k)
    assert (choice.lam, choice.second_lam) == (0.0, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(SPLIT.take_backbone(out), own_b))
    _close(SPLIT.take_key(out), agreed_k, atol=1e-6)
    # a world change: the backbone's up to the whole of it, the key layers' at most mix_world_max
    # (0.25), each as far as it helps
    zero = [torch.zeros(s) for s in SHAPES]
    change = [torch.full(s, 2.0) for s in SHAPES]
    out, choice = member_world_mix(rule, own=zero, change=change,
                                   loss_of=lambda p: float(sum((t - 2.0).pow(2).sum() for t in SPLIT.take_backbone(p))
                                                           + sum(t.pow(2).sum() for t in SPLIT.take_key(p))))
    assert (choice.lam, choice.second_lam) == (1.0, 0.0)
    assert torch.equal(out[0], torch.full((3,), 2.0)) and torch.equal(out[1], torch.zeros(2, 2))
    out, choice = member_world_mix(rule, own=zero, change=change, loss_of=lambda p: float(
        sum((t - 2.0).pow(2).sum() for t in p)))  # every part wants the whole change
    assert (choice.lam, choice.second_lam) == (1.0, 0.25)
    assert torch.equal(out[3], torch.full((2, 3), 2.0)) and torch.equal(out[2], torch.full((2,), 0.5))
    assert not _exact(mix="cosine", personal_scope="parts").mixes_by_part  # (cosine mixes per tensor anyway)


def test_separate_personal_model_shared_rounds_are_key_only_and_the_personal_mix_is_by_parts() -> None:
    """The default (``personal_model="separate"``): the shared model's rounds are those of
    ``personal_scope="key"`` (the agreed backbone whole, K by evidence), and the personal model
    mixes towards the member's shared model by parts: the backbone and K each as far as the slice
    supports. A member whose shared model does not help keeps its personal model, bit for bit."""
    from worldlm_p2p.errors import ConfigError
    from worldlm_p2p.rounds import member_mix, member_world_mix, personal_mix

    g = torch.Generator().manual_seed(13)
    personal, shared, agreed = _model(g), _model(g), _model(g)
    rule = RoundRule.of(SPLIT, robust="mean")  # the shipped default
    assert rule.separate_personal and rule.personal_key_only and not rule.mixes_by_part
    assert not rule.personal.separate_personal and rule.personal.mixes_by_part
    assert not _exact(robust="mean").separate_personal  # (inline)
    assert not RoundRule.of(SPLIT, mix="none").separate_personal  # only with evidence mixing
    assert not RoundRule.of(SPLIT, strategy="fedper").separate_personal
    key_only = _exact(robust="mean", personal_scope="key")

    def slice_wants(target):
        return lambda params: float(sum((p - t).pow(2).sum() for p, t in zip(params, target)))

    # the shared model's region and world mixes are the key-only ones, on the same inputs
    for loss_of in (slice_wants(agreed), slice_wants(shared), None):
        a, ca = member_mix(rule, own=shared, agreed=agreed, loss_of=loss_of)
        b, cb = member_mix(key_only, own=shared, agreed=agreed, loss_of=loss_of)
        assert all(torch.equal(x, y) for x, y in zip(a, b)) and (ca is None) == (cb is None)
    change = [torch.full(s, 0.5) for s in SHAPES]
    a, _ = member_world_mix(rule, own=shared, change=change, loss_of=slice_wants(agreed))
    b, _ = member_world_mix(key_only, own=shared, change=change, loss_of=slice_wants(agreed))
    assert all(torch.equal(x, y) for x, y in zip(a, b))

    # no useful partner: the slice prefers the personal model, which comes back bit for bit
    out, choice = personal_mix(rule, personal=personal, shared=shared, loss_of=slice_wants(personal))
    assert (choice.lam, choice.second_lam) == (0.0, 0.0)
    assert all(torch.equal(x, y) for x, y in zip(out, personal))
    # no tune slice: no evidence, the personal model
    out, choice = personal_mix(rule, personal=personal, shared=shared, loss_of=None)
    assert choice is None and all(torch.equal(x, y) for x, y in zip(out, personal))
    # the slice wants the shared model: taken whole (both parts at weight 1)
    out, choice = personal_mix(rule, personal=personal, shared=shared, loss_of=slice_wants(shared))
    assert (choice.lam, choice.second_lam) == (1.0, 1.0)
    _close(out, shared)
    # by hand: the slice wants a quarter of the way on the backbone, its own key layers
    want = [p + 0.25 * (s - p) if i in SPLIT.backbone else p for i, (p, s) in enumerate(zip(personal, shared))]
    out, choice = personal_mix(rule, personal=personal, shared=shared, loss_of=slice_wants(want))
    assert (choice.lam, choice.second_lam) == (0.25, 0.0)
    _close(out, want)
    assert all(torch.equal(out[i], personal[i]) for i in SPLIT.key)
    # one weight for the whole model with personal_scope="all"
    out, choice = personal_mix(RoundRule.of(SPLIT, robust="mean", personal_scope="all"), personal=personal,
                               shared=shared, loss_of=slice_wants(shared))
    assert choice.lam == 1.0 and choice.second_lam is None
    _close(out, shared)
    with pytest.raises(ValueError, match="separate"):
        personal_mix(_exact(robust="mean"), personal=personal, shared=shared, loss_of=None)
    with pytest.raises(ConfigError, match="personal_scope"):
        RoundRule.of(SPLIT, personal_scope="key")  # what the shared model does already


def test_a_shared_model_that_adopts_takes_the_agreed_model_and_every_world_change_whole() -> None:
    """``shared_model="agreed"``: the shared model is WorldLM's member: it takes the region's agreed
    model (the attentive key layers included) and the whole world change, whatever its slice says
    and with or without one, and records a weight of 1 without a search; the personal mix is the
    default's."""
    from worldlm_p2p.errors import ConfigError
    from worldlm_p2p.rounds import ADOPTED, member_mix, member_world_mix, personal_mix

    g = torch.Generator().manual_seed(17)
    personal, shared, agreed = _model(g), _model(g), _model(g)
    rule = RoundRule.of(SPLIT, robust="mean", shared_model="agreed")
    assert rule.shared_adopts and rule.separate_personal and not RoundRule.of(SPLIT, robust="mean").shared_adopts
    assert not RoundRule.of(SPLIT, shared_model="agreed", personal_model="inline").shared_adopts

    def slice_wants(target):
        return lambda params: float(sum((p - t).pow(2).sum() for p, t in zip(params, target)))

    for loss_of in (slice_wants(shared), slice_wants(agreed), None):  # its own model preferred, or no slice
        out, choice = member_mix(rule, own=shared, agreed=agreed, loss_of=loss_of)
        assert choice is ADOPTED and choice.lam == 1.0 and not choice.evaluated
        assert all(torch.equal(x, y) for x, y in zip(out, agreed))
    change = [torch.full(s, 0.5) for s in SHAPES]
    out, choice = member_world_mix(rule, own=shared, change=change, loss_of=slice_wants(shared))
    assert choice is ADOPTED
    assert all(torch.equal(x, s + 0.5) for x, s in zip(out, shared))  # K's part too, not a quarter of it
    # the personal model's mix is the default's (by parts, on its slice)
    a, ca = personal_mix(rule, personal=personal, shared=shared, loss_of=slice_wants(shared))
    b, cb = personal_mix(RoundRule.of(SPLIT, robust="mean"), personal=personal, shared=shared,
                         loss_of=slice_wants(shared))
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and (ca.lam, ca.second_lam) == (cb.lam, cb.second_lam)
    with pytest.raises(ConfigError, match="shared_model"):
        RoundRule.of(SPLIT, shared_model="whole")


@pytest.mark.parametrize("form", ["mean", "distance"])
def test_region_round_with_usage_rows_equals_the_central_rule(form):
    """``usage_rows``: the region's agreed key layers are the per-row attentive aggregate of the
    members' token counts (K here is the ``kv`` pair: the (2, 2) layer has 2 rows, the counts'
    length, so its rows are weighted by them; the (2,) one too), the backbone the plain mean; under
    the default plain mean over members as under distance attention."""
    anchor, members, tokens = _region(seed=5, scale=0.3)
    usage = [T([5.0, 0.0]), T([0.0, 9.0]), None][:len(members)] + [None] * max(0, len(members) - 3)
    rule = _exact(robust="mean", mix="none", usage_rows=True, attention=form, tau=0.1)
    assert rule.usage_rows and not _exact(robust="mean").usage_rows
    assert not _exact(robust="mean", strategy="hierfavg", usage_rows=True).usage_rows  # K is not apart
    out, _, agreed = region_round_with_anchor(rule, members, tokens, anchor=anchor, momentum=None, usage=usage)
    want_k = attention.attentive_aggregate([SPLIT.take_key(m) for m in members], SPLIT.take_key(anchor), tokens,
                                           form=form, tau=0.1, usage=usage)
    _close(SPLIT.take_key(agreed), want_k, atol=1e-5)
    _close(SPLIT.take_backbone(agreed), weighted_mean([SPLIT.take_backbone(m) for m in members], tokens))
    plain, _, _ = region_round_with_anchor(_exact(robust="mean", mix="none", attention=form, tau=0.1), members, tokens,
                                           anchor=anchor, momentum=None)
    assert not torch.allclose(SPLIT.take_key(agreed)[0], SPLIT.take_key(plain[0])[0])  # the counts mattered


def test_reused_choices_give_what_a_search_that_chose_them_gives_without_evaluating() -> None:
    """``aggregation.evidence_share``: a member with no search due takes its last choice's weights
    again. The shared model's region and world mixes, the personal mix and a whole region round
    with ``reuse`` give exactly the model a search that chose those weights gives, and evaluate
    nothing."""
    from worldlm_p2p.rounds import member_mix, member_world_mix, personal_mix

    g = torch.Generator().manual_seed(21)
    personal, shared, agreed = _model(g), _model(g), _model(g)
    rule = RoundRule.of(SPLIT, robust="mean")  # the shipped default: a separate personal model

    def slice_wants(target):
        return lambda params: float(sum((p - t).pow(2).sum() for p, t in zip(params, target)))

    def never(params):
        raise AssertionError("a reused choice evaluated the tune slice")

    halfway = [a + 0.25 * (b - a) for a, b in zip(shared, agreed)]
    searched, choice = member_mix(rule, own=shared, agreed=agreed, loss_of=slice_wants(halfway))
    assert choice.evaluated and 0 < choice.lam < 1
    again, reused = member_mix(rule, own=shared, agreed=agreed, loss_of=never, reuse=choice)
    assert reused.reused and reused.lam == choice.lam
    assert all(torch.equal(x, y) for x, y in zip(again, searched))
    # by hand: the agreed backbone whole, lam of the way to the agreed key layers
    want = [a if i in SPLIT.backbone else s + choice.lam * (a - s) for i, (s, a) in enumerate(zip(shared, agreed))]
    _close(again, want)

    change = [torch.full(s, 0.5) for s in SHAPES]
    searched, choice = member_world_mix(rule, own=shared, change=change, loss_of=slice_wants(agreed))
    again, reused = member_world_mix(rule, own=shared, change=change, loss_of=never, reuse=choice)
    assert reused.reused and all(torch.equal(x, y) for x, y in zip(again, searched))

    target = [p + 0.25 * (s - p) if i in SPLIT.backbone else s for i, (p, s) in enumerate(zip(personal, shared))]
    searched, choice = personal_mix(rule, personal=personal, shared=shared, loss_of=slice_wants(target))
    assert (choice.lam, choice.second_lam) == (0.25, 1.0)
    again, reused = personal_mix(rule, personal=personal, shared=shared, loss_of=never, reuse=choice)
    assert (reused.lam, reused.second_lam, reused.reused) == (0.25, 1.0, True)
    assert all(torch.equal(x, y) for x, y in zip(again, searched))
    # a member without a tune slice keeps its own model, reuse or not
    out, none = personal_mix(rule, personal=personal, shared=shared, loss_of=None, reuse=choice)
    assert none is None and all(torch.equal(x, y) for x, y in zip(out, personal))

    # a whole region round: member 0 searches, member 1 takes an earlier choice again
    anchor, members, tokens = _region(2, seed=5)
    earlier = mixing.reused_choice(0.5)
    choices: list = []
    out, _, agreed_model = region_round_with_anchor(rule, members, tokens, anchor=anchor, momentum=None,
                                                    loss_of=[slice_wants(members[1]), never], choices=choices,
                                                    reuse=[None, earlier])
    want0, c0 = member_mix(rule, own=members[0], agreed=agreed_model, loss_of=slice_wants(members[1]))
    want1, c1 = member_mix(rule, own=members[1], agreed=agreed_model, loss_of=never, reuse=earlier)
    assert all(torch.equal(x, y) for x, y in zip(out[0], want0)) and all(torch.equal(x, y) for x, y in zip(out[1], want1))
    assert choices[0].evaluated and not choices[0].reused and choices[1].reused and choices[1].lam == 0.5


# ------------------------------------------------------------------ backbone partners (region_backbone = "partners")


def test_partner_mates_takes_every_mate_or_a_window_that_moves_on_each_round() -> None:
    from worldlm_p2p.rounds import partner_mates

    assert partner_mates(["c", "a", "b"], cap=6, round_index=3) == ["a", "b", "c"]
    assert partner_mates(["b", "c", "a"], cap=3, round_index=0) == ["a", "b", "c"]  # order given does not matter
    mates = [f"m{i}" for i in range(5)]
    # cap 2 over 5 mates: windows starting at 0, 2, 4, 1, ... by round, wrapping around
    assert partner_mates(mates, cap=2, round_index=0) == ["m0", "m1"]
    assert partner_mates(mates, cap=2, round_index=1) == ["m2", "m3"]
    assert partner_mates(mates, cap=2, round_index=2) == ["m4", "m0"]
    assert partner_mates(list(reversed(mates)), cap=2, round_index=2) == ["m4", "m0"]
    seen = set()
    for r in range(3):  # ceil(5 / 2) rounds try every mate
        seen |= set(partner_mates(mates, cap=2, round_index=r))
    assert seen == set(mates)
    assert partner_mates([], cap=2, round_index=0) == []
    with pytest.raises(ValueError, match="cap"):
        partner_mates(mates, cap=0, round_index=0)


def test_partner_candidates_are_the_region_backbone_and_half_and_half_pairs_hand_computed() -> None:
    from worldlm_p2p.rounds import REGION_CANDIDATE, check_sent_backbone, partner_candidates

    rule = RoundRule.of(SPLIT, region_backbone="partners", partner_own_half=False)
    anchor = [T([1.0, 2.0, 3.0]), torch.zeros(2, 2), torch.zeros(2), torch.ones(2, 3)]
    agreed = [T([9.0, 9.0, 9.0]), torch.ones(2, 2), torch.ones(2), torch.full((2, 3), 7.0)]
    own = [T([0.5, 0.0, -1.0]), torch.full((2, 3), 0.25)]  # the backbone's change it sent: tensors 0 and 3
    mate = [T([1.5, 2.0, 1.0]), torch.full((2, 3), -0.25)]
    out = partner_candidates(rule, anchor=anchor, own=own, mates={"b": mate}, agreed=agreed)
    assert list(out) == [REGION_CANDIDATE, "b"]
    with_self = partner_candidates(RoundRule.of(SPLIT, region_backbone="partners", partner_check="self",
                                                partner_own_half=False),
                                   anchor=anchor, own=own, mates={"b": mate}, agreed=agreed)
    assert torch.equal(with_self["self"][0], T([1.5, 2.0, 2.0])) and torch.equal(with_self["self"][1], torch.full((2, 3), 1.25))
    with pytest.raises(ValueError, match="own candidate"):
        partner_candidates(rule, anchor=anchor, own=own, mates={"self": mate}, agreed=agreed)
    assert torch.equal(out[REGION_CANDIDATE][0], agreed[0]) and torch.equal(out[REGION_CANDIDATE][1], agreed[3])
    # anchor + (own + mate) / 2: [1 + 1, 2 + 1, 3 + 0] and 1 + 0
    assert torch.equal(out["b"][0], T([2.0, 3.0, 3.0])) and torch.equal(out["b"][1], torch.ones(2, 3))
    # what a mate serves is checked: the number of tensors, their shapes, finite values
    assert check_sent_backbone(rule, anchor, mate) == ""
    assert "tensors" in check_sent_backbone(rule, anchor, mate[:1])
    assert "shape" in check_sent_backbone(rule, anchor, [mate[0], torch.zeros(3, 2)])
    assert "finite" in check_sent_backbone(rule, anchor, [T([1.0, math.nan, 0.0]), mate[1]])
    with pytest.raises(ValueError, match="mate c"):
        partner_candidates(rule, anchor=anchor, own=own, mates={"c": [mate[0], torch.full((2, 3), math.inf)]},
                           agreed=agreed)


def test_the_own_half_candidate_is_the_members_change_half_and_half_with_the_regions_hand_computed() -> None:
    from worldlm_p2p.rounds import OWN_HALF_CANDIDATE, REGION_CANDIDATE, choose_backbone, partner_candidates

    rule = RoundRule.of(SPLIT)  # the defaults: partners with the own half
    assert rule.backbone_partners and rule.config.partner_own_half
    anchor = [T([1.0, 2.0, 3.0]), torch.zeros(2, 2), torch.zeros(2), torch.ones(2, 3)]
    agreed = [T([3.0, 2.0, 1.0]), torch.ones(2, 2), torch.ones(2), torch.full((2, 3), 2.0)]  # region's change: [2, 0, -2], 1
    own = [T([0.5, 0.0, -1.0]), torch.full((2, 3), 0.25)]
    mate = [T([1.5, 2.0, 1.0]), torch.full((2, 3), -0.25)]
    out = partner_candidates(rule, anchor=anchor, own=own, mates={"b": mate}, agreed=agreed)
    assert list(out) == [REGION_CANDIDATE, OWN_HALF_CANDIDATE, "b"]
    # anchor + (own + region's change) / 2: [1 + 1.25, 2 + 0, 3 - 1.5] and 1 + 0.625
    assert torch.equal(out[OWN_HALF_CANDIDATE][0], T([2.25, 2.0, 1.5]))
    assert torch.equal(out[OWN_HALF_CANDIDATE][1], torch.full((2, 3), 1.625))
    # a member whose own change is the region's gets the region's backbone back as its own half
    same = partner_candidates(rule, anchor=anchor, own=[T([2.0, 0.0, -2.0]), torch.ones(2, 3)], mates={}, agreed=agreed)
    assert all(torch.equal(x, y) for x, y in zip(same[OWN_HALF_CANDIDATE], same[REGION_CANDIDATE]))
    # it is chosen like a pair: the lowest slice loss; ties go to the region's
    own_model = _model(torch.Generator().manual_seed(4))

    def wants(target):
        return lambda p: float(sum((p[i] - t).pow(2).sum() for i, t in zip(SPLIT.backbone, target)))
    assert choose_backbone(rule, out, own=own_model, loss_of=wants(out[OWN_HALF_CANDIDATE]))[0] == OWN_HALF_CANDIDATE
    assert choose_backbone(rule, out, own=own_model, loss_of=wants(out["b"]))[0] == "b"
    assert choose_backbone(rule, same, own=own_model, loss_of=wants(same[REGION_CANDIDATE]))[0] == REGION_CANDIDATE
    with pytest.raises(ValueError, match="own candidate"):
        partner_candidates(rule, anchor=anchor, own=own, mates={OWN_HALF_CANDIDATE: mate}, agreed=agreed)
    # off: the region's and the pairs only
    assert OWN_HALF_CANDIDATE not in partner_candidates(RoundRule.of(SPLIT, partner_own_half=False), anchor=anchor,
                                                        own=own, mates={"b": mate}, agreed=agreed)


def test_choose_backbone_takes_the_lowest_slice_loss_whatever_the_order_and_the_region_on_ties() -> None:
    from worldlm_p2p.rounds import REGION_CANDIDATE, choose_backbone

    rule = RoundRule.of(SPLIT, region_backbone="partners")
    g = torch.Generator().manual_seed(3)
    own = _model(g)
    cands = {REGION_CANDIDATE: [torch.zeros(3), torch.zeros(2, 3)], "b": [torch.ones(3), torch.ones(2, 3)],
             "a": [torch.full((3,), 2.0), torch.full((2, 3), 2.0)]}

    def wants(level: float, key_seen: list):
        def loss(params):
            key_seen.append([params[i].clone() for i in SPLIT.key])
            return float(sum((params[i] - level).pow(2).sum() for i in SPLIT.backbone))
        return loss

    seen: list = []
    name, losses = choose_backbone(rule, cands, own=own, loss_of=wants(1.9, seen))
    assert name == "a" and losses == pytest.approx({REGION_CANDIDATE: 9 * 1.9 ** 2, "b": 9 * 0.9 ** 2,
                                                     "a": 9 * 0.1 ** 2})
    # every candidate is evaluated with the member's own key layers
    assert len(seen) == 3 and all(torch.equal(k, own[i]) for ks in seen for k, i in zip(ks, SPLIT.key))
    reordered = {k: cands[k] for k in ("a", REGION_CANDIDATE, "b")}
    assert choose_backbone(rule, reordered, own=own, loss_of=wants(1.9, []))[0] == "a"
    # ties go to the region's backbone; so does a slice whose losses are not finite
    assert choose_backbone(rule, cands, own=own, loss_of=lambda p: 1.0)[0] == REGION_CANDIDATE
    assert choose_backbone(rule, cands, own=own, loss_of=lambda p: math.nan)[0] == REGION_CANDIDATE
    with pytest.raises(ValueError, match="region"):
        choose_backbone(rule, {"b": cands["b"]}, own=own, loss_of=lambda p: 1.0)
    # partner_check = "self": a pair must also beat the member's own backbone, which is never taken
    from worldlm_p2p.rounds import SELF_CANDIDATE
    with_self = dict(cands, **{SELF_CANDIDATE: [torch.full((3,), 1.5), torch.full((2, 3), 1.5)]})
    assert choose_backbone(rule, with_self, own=own, loss_of=wants(1.9, []))[0] == "a"  # 0.1 from a, 0.4 from self
    assert choose_backbone(rule, with_self, own=own, loss_of=wants(1.6, []))[0] == REGION_CANDIDATE  # self nearest
    name, losses = choose_backbone(rule, with_self, own=own, loss_of=wants(0.9, []))
    assert name == "b" and set(losses) == {REGION_CANDIDATE, SELF_CANDIDATE, "a", "b"}  # b 0.1 < self 0.6
    assert choose_backbone(rule, with_self, own=own, loss_of=wants(-5.0, []))[0] == REGION_CANDIDATE


def test_a_member_with_no_useful_partner_moves_towards_the_regions_agreed_model() -> None:
    from worldlm_p2p.rounds import REGION_CANDIDATE, partner_target

    rule = RoundRule.of(SPLIT, region_backbone="partners")
    g = torch.Generator().manual_seed(4)
    own, agreed = _model(g), _model(g)
    pair = [torch.randn(3, generator=g), torch.randn(2, 3, generator=g)]
    cands = {REGION_CANDIDATE: rule.split.take_backbone(agreed), "b": pair}

    def slice_wants(target):
        return lambda params: float(sum((p - t).pow(2).sum() for p, t in zip(params, target)))

    out, name = partner_target(rule, agreed=agreed, own=own, candidates=cands, loss_of=slice_wants(agreed))
    assert name == REGION_CANDIDATE and all(torch.equal(x, y) for x, y in zip(out, agreed))
    # a useful partner: its pair's backbone with the region's agreed key layers
    out, name = partner_target(rule, agreed=agreed, own=own, candidates=cands,
                               loss_of=slice_wants(rule.split.merge(pair, rule.split.take_key(own))))
    assert name == "b"
    assert torch.equal(out[0], pair[0]) and torch.equal(out[3], pair[1])
    assert all(torch.equal(out[i], agreed[i]) for i in SPLIT.key)
    # no slice, or no candidates: the agreed model and no choice
    for kw in (dict(candidates=cands, loss_of=None), dict(candidates=None, loss_of=slice_wants(agreed))):
        out, name = partner_target(rule, agreed=agreed, own=own, **kw)
        assert name is None and all(torch.equal(x, y) for x, y in zip(out, agreed))


def test_region_round_with_partners_equals_the_pure_choice_and_does_not_depend_on_member_order() -> None:
    """Three members; member 0's slice wants its pair with member 2, the others want the region's
    backbone. The round's models are what the pure functions give by hand, the agreed model is the
    mean whatever the members choose, and permuting the members permutes the results."""
    from worldlm_p2p.rounds import REGION_CANDIDATE, member_mix, sent_backbone

    rule = RoundRule.of(SPLIT, region_backbone="partners", robust="mean")
    plain = RoundRule.of(SPLIT, robust="mean")
    anchor, members, tokens = _region(3, seed=9)
    payloads = [region_payload(rule, p, anchor) for p in members]
    sent = [sent_backbone(rule, pl) for pl in payloads]
    pair02 = [(a.float() + 0.5 * (x + y)).to(a.dtype) for a, x, y in zip(rule.split.take_backbone(anchor), sent[0], sent[2])]
    _, _, agreed = region_round_with_anchor(plain, members, tokens, anchor=anchor, momentum=None)

    def slice_wants(target):
        return lambda params: float(sum((p - t).pow(2).sum() for p, t in zip(params, target)))

    want0 = rule.split.merge(pair02, rule.split.take_key(members[0]))
    loss_of = [slice_wants(want0), slice_wants(agreed), slice_wants(agreed)]
    names = ["m0", "m1", "m2"]
    partners: list = []
    out, _, agreed_p = region_round_with_anchor(rule, members, tokens, anchor=anchor, momentum=None, loss_of=loss_of,
                                                names=names, partners=partners)
    assert partners == ["m2", REGION_CANDIDATE, REGION_CANDIDATE]
    _close(agreed_p, agreed)  # the region's agreed model is the mean whatever its members chose
    target0 = rule.split.merge(pair02, rule.split.take_key(agreed))
    by_hand, _ = member_mix(rule, own=members[0], agreed=target0, loss_of=loss_of[0])
    _close(out[0], by_hand)
    for i in (1, 2):  # the region's backbone: what the plain rule gives
        plain_out, _ = member_mix(plain, own=members[i], agreed=agreed, loss_of=loss_of[i])
        _close(out[i], plain_out)
    perm = [2, 0, 1]
    partners_p: list = []
    out_p, _, _ = region_round_with_anchor(rule, [members[k] for k in perm], [tokens[k] for k in perm], anchor=anchor,
                                           momentum=None, loss_of=[loss_of[k] for k in perm],
                                           names=[names[k] for k in perm], partners=partners_p)
    assert partners_p == [partners[k] for k in perm]
    for j, k in enumerate(perm):
        _close(out_p[j], out[k])
    # a group of two has nothing to choose (the pair is the region): no search, the plain round
    partners_2: list = []
    out2, _, _ = region_round_with_anchor(rule, members[:2], tokens[:2], anchor=anchor, momentum=None,
                                          loss_of=loss_of[:2], names=names[:2], partners=partners_2)
    plain2, _, _ = region_round_with_anchor(plain, members[:2], tokens[:2], anchor=anchor, momentum=None,
                                            loss_of=loss_of[:2])
    assert partners_2 == [None, None]
    for a, b in zip(out2, plain2):
        _close(a, b)
    with pytest.raises(ValueError, match="distinct name"):
        region_round_with_anchor(rule, members, tokens, anchor=anchor, momentum=None, loss_of=loss_of,
                                 names=["a", "a", "b"])


def test_shared_model_evidence_world_takes_the_world_backbone_only_as_far_as_its_slice_supports() -> None:
    """``shared_model="evidence-world"``: the shared model takes a world change's backbone by its own
    line search (up to the whole change) and the key layers' up to ``mix_world_max``; a slice that
    prefers its own backbone keeps it bit for bit; without a slice, or in a region of fewer than
    three, it takes the backbone whole, as the default shared model does. The default takes the
    backbone whole whatever the slice says."""
    from worldlm_p2p.rounds import member_world_mix

    zero = [torch.zeros(s) for s in SHAPES]
    change = [torch.full(s, 2.0) for s in SHAPES]
    rule = RoundRule.of(SPLIT, robust="mean", shared_model="evidence-world")
    assert rule.shared_world_evidence and rule.separate_personal
    assert not RoundRule.of(SPLIT, robust="mean").shared_world_evidence  # (the default)
    assert not RoundRule.of(SPLIT, robust="mean", shared_model="evidence-world", mix_world=False).shared_world_evidence

    def keeps_own(params):  # the slice wants nothing of the change
        return float(sum(t.pow(2).sum() for t in params))

    out, choice = member_world_mix(rule, own=zero, change=change, loss_of=keeps_own)
    assert (choice.lam, choice.second_lam) == (0.0, 0.0)
    assert all(torch.equal(o, z) for o, z in zip(out, zero))
    # the default shared model: the backbone change whole (by hand: 0 + 2), the key layers kept
    out, _ = member_world_mix(RoundRule.of(SPLIT, robust="mean"), own=zero, change=change, loss_of=keeps_own)
    assert torch.equal(out[0], torch.full((3,), 2.0)) and torch.equal(out[1], torch.zeros(2, 2))

    def wants_all(params):  # every part wants the whole change
        return float(sum((t - 2.0).pow(2).sum() for t in params))

    out, choice = member_world_mix(rule, own=zero, change=change, loss_of=wants_all)
    assert (choice.lam, choice.second_lam) == (1.0, 0.25)
    # by hand: backbone 0 + 1 * 2, key layers 0 + 0.25 * 2
    assert torch.equal(out[0], torch.full((3,), 2.0)) and torch.equal(out[3], torch.full((2, 3), 2.0))
    assert torch.allclose(out[1], torch.full((2, 2), 0.5)) and torch.allclose(out[2], torch.full((2,), 0.5))
    # a quarter of the backbone change is what the slice wants (by hand: 0.5), none of the key layers'
    half = [torch.full(s, 0.5) if i in SPLIT.backbone else torch.zeros(s) for i, s in enumerate(SHAPES)]
    out, choice = member_world_mix(rule, own=zero, change=change,
                                   loss_of=lambda p: float(sum((t - h).pow(2).sum() for t, h in zip(p, half))))
    assert (choice.lam, choice.second_lam) == (0.25, 0.0)
    _close(out, half)
    # no slice: the backbone change whole, the key layers kept
    out, choice = member_world_mix(rule, own=zero, change=change, loss_of=None)
    assert choice is None
    assert torch.equal(out[0], torch.full((3,), 2.0)) and torch.equal(out[1], torch.zeros(2, 2))
    # a region of fewer than SEVERAL (3) members: the backbone change whole, as the default shared
    # model takes it, bit for bit; from three members on, by evidence
    from worldlm_p2p.rounds import SEVERAL
    assert SEVERAL == 3
    default = RoundRule.of(SPLIT, robust="mean")
    for size in (1, 2):
        out, choice = member_world_mix(rule, own=zero, change=change, loss_of=keeps_own, region_size=size)
        want, want_choice = member_world_mix(default, own=zero, change=change, loss_of=keeps_own)
        assert all(torch.equal(a, b) for a, b in zip(out, want)) and choice.lam == want_choice.lam
        assert torch.equal(out[0], torch.full((3,), 2.0))
    out, choice = member_world_mix(rule, own=zero, change=change, loss_of=keeps_own, region_size=3)
    assert (choice.lam, choice.second_lam) == (0.0, 0.0) and all(torch.equal(o, z) for o, z in zip(out, zero))
    # a choice reused across a change of region size (aggregation.evidence_share: no search due) is
    # of the other form, so it is not reused: the weights are searched, as without a choice to reuse
    parts = member_world_mix(rule, own=zero, change=change, loss_of=wants_all, region_size=3)[1]
    assert (parts.lam, parts.second_lam) == (1.0, 0.25)
    out, choice = member_world_mix(rule, own=zero, change=change, loss_of=keeps_own, region_size=2, reuse=parts)
    want, want_choice = member_world_mix(rule, own=zero, change=change, loss_of=keeps_own, region_size=2)
    assert all(torch.equal(a, b) for a, b in zip(out, want)) and (choice.lam, choice.second_lam) == (0.0, None)
    assert not choice.reused and torch.equal(out[1], torch.zeros(2, 2))  # (reused, the key layers would take 1)
    one = member_world_mix(rule, own=zero, change=change, loss_of=wants_all, region_size=2)[1]
    assert (one.lam, one.second_lam) == (0.25, None)
    out, choice = member_world_mix(rule, own=zero, change=change, loss_of=keeps_own, region_size=3, reuse=one)
    assert (choice.lam, choice.second_lam) == (0.0, 0.0) and not choice.reused
    # a choice of the same form is reused as it is (no search: the loss is NaN)
    out, choice = member_world_mix(rule, own=zero, change=change, loss_of=keeps_own, region_size=3, reuse=parts)
    assert (choice.lam, choice.second_lam) == (1.0, 0.25) and choice.reused
    assert torch.equal(out[0], torch.full((3,), 2.0)) and torch.allclose(out[1], torch.full((2, 2), 0.5))
