"""Numeric settings that would pass a ``> 0`` check as inf (or skip every check as NaN) and break a
run long after it started are refused up front, naming the setting."""

import math

import pytest

from worldlm_p2p.config import PeerConfig, RunManifest
from worldlm_p2p.errors import ConfigError


@pytest.mark.parametrize("section, key", [("averaging", "leader_ttl"), ("averaging", "barrier_timeout"),
                                          ("averaging", "averaging_timeout"), ("model", "rope_theta"),
                                          ("train", "lr"), ("train", "grad_clip"), ("aggregation", "outer_lr"),
                                          ("aggregation", "robust_clip")])
@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_a_manifest_with_a_non_finite_number_is_refused(section, key, value):
    with pytest.raises(ConfigError, match=f"{section}.{key}"):
        RunManifest.from_dict({"run_id": "x", section: {key: value}})


@pytest.mark.parametrize("key", ["manifest_wait", "join_state_timeout", "progress_interval", "wait_for_peers_timeout"])
def test_peer_settings_must_be_finite(key):
    with pytest.raises(ConfigError, match=key):
        PeerConfig(region="eu", data=".", **{key: math.nan})


def test_robust_settings_are_checked():
    with pytest.raises(ConfigError, match="aggregation.robust"):
        RunManifest.from_dict({"run_id": "x", "aggregation": {"robust": "median"}})
    with pytest.raises(ConfigError, match="aggregation.robust_clip"):
        RunManifest.from_dict({"run_id": "x", "aggregation": {"robust_clip": 0.5}})
    with pytest.raises(ConfigError, match="averaging.ban_after"):
        RunManifest.from_dict({"run_id": "x", "averaging": {"ban_after": 0}})


def test_backbone_partner_settings_are_checked():
    from worldlm_p2p.rounds import RoundRule
    from worldlm_p2p.split import split_parameters

    def agg(**kw):
        return RunManifest.from_dict({"run_id": "x", "aggregation": kw}).aggregation
    # the defaults: partners with the own half
    assert (agg().region_backbone, agg().partner_own_half) == ("partners", True)
    assert agg(partner_own_half=False).partner_own_half is False
    with pytest.raises(ConfigError, match="aggregation.partner_own_half"):
        agg(region_backbone="partners", partner_own_half="yes")
    with pytest.raises(ConfigError, match="aggregation.partner_candidates"):
        agg(region_backbone="partners", partner_candidates=0)
    with pytest.raises(ConfigError, match="aggregation.partner_check"):
        agg(region_backbone="partners", partner_check="mate")
    with pytest.raises(ConfigError, match="aggregation.region_backbone"):
        agg(region_backbone="pairs")
    # partners are chosen by evidence: with another mix (or another strategy), or a shared model that
    # adopts the region's agreed model, a member takes the region's backbone, the default notwithstanding
    split = split_parameters(["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "lm_head.weight"],
                             "embed_head")
    for kw in (dict(mix="none"), dict(mix="cosine"), dict(strategy="fedavg"), dict(strategy="hierfavg"),
               dict(shared_model="agreed")):
        assert agg(**kw).region_backbone == "partners"
        assert not RoundRule(config=agg(**kw), split=split).backbone_partners, kw
    assert RoundRule(config=agg(), split=split).backbone_partners
