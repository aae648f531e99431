"""Resuming a peer from a checkpoint whose region reference or momentum does not fit the model, or
holds NaN, is refused with one line (instead of resuming as is and failing rounds later)."""

import pytest
import torch

from worldlm_p2p.config import PeerConfig, RunManifest
from worldlm_p2p.errors import CheckpointError
from worldlm_p2p.peer import checkpoints, joining
from worldlm_p2p.peer.member import Member
from worldlm_p2p.peer.state import RegionState
from worldlm_p2p.peer.stats import PeerStats
from worldlm_p2p.train import demo_data_dir, load_texts


@pytest.fixture(scope="module")
def peer_parts():
    m = RunManifest.from_dict({"run_id": "ck", "model": {"preset": "tiny"}, "train": {"batch_size": 2, "seq_len": 32}})
    data = demo_data_dir() / "eu" / "nl_news"
    cfg = PeerConfig(region="eu", data=str(data))
    local = joining.build_local(cfg, m, load_texts(data))
    return m, local


def _parts(local, stats):
    member = Member(model=local.model, trainer=local.trainer, rule=local.rule, stats=stats)
    return member, RegionState(anchor=member.params(), border_delta=None)


@pytest.mark.parametrize("damage", ["none", "shape", "count", "nan", "momentum_nan"])
def test_resume_checks_the_reference_and_momentum(peer_parts, tmp_path, damage):
    m, local = peer_parts
    cfg = PeerConfig(region="eu", data=".", checkpoint_dir=str(tmp_path))
    stats = PeerStats()
    member, state = _parts(local, stats)
    if damage == "shape":
        state.anchor = [t.reshape(-1) for t in state.anchor]
    elif damage == "count":
        state.anchor = state.anchor[:-1]
    elif damage == "nan":
        state.anchor[0] = state.anchor[0].clone().fill_(float("nan"))
    elif damage == "momentum_nan":
        state.momentum = [torch.full((2,), float("inf"))]
    checkpoints.write(cfg, m, member=member, state=state, stats=stats, label="x", peer_id="p")
    member2, state2 = _parts(local, PeerStats())
    if damage == "none":
        assert checkpoints.resume(cfg, m, member=member2, state=state2, stats=PeerStats())
        return
    with pytest.raises(CheckpointError, match="does not fit this model|NaN/Inf"):
        checkpoints.resume(cfg, m, member=member2, state=state2, stats=PeerStats())


def test_the_personal_model_is_checkpointed_resumed_and_exported(peer_parts, tmp_path):
    """The default (``personal_model="separate"``): the checkpoint holds the shared model (``model``)
    and the personal one with its optimizer; a resumed peer gets both back, ``--which peer`` exports
    the personal one, and a checkpoint of one model (an older one) starts the personal model from
    the shared one."""
    from worldlm_p2p.checkpoint import load_latest_checkpoint
    from worldlm_p2p.export import checkpoint_model
    from worldlm_p2p.train import get_flat_params, set_params

    m, local = peer_parts
    assert local.rule.separate_personal and local.personal is not None
    cfg = PeerConfig(region="eu", data=".", checkpoint_dir=str(tmp_path))
    member = Member(model=local.model, trainer=local.trainer, rule=local.rule, stats=PeerStats(),
                    personal=local.personal)
    shared, personal = member.params(), member.personal_params()
    # two different models, one optimizer state each
    personal = [t + 0.01 * (i + 1) for i, t in enumerate(personal)]
    set_params(local.personal.model, personal)
    local.personal.train_step(0)
    personal = member.personal_params()
    assert max(float((a - b).abs().max()) for a, b in zip(shared, personal)) > 1e-3
    checkpoints.write(cfg, m, member=member, state=RegionState(anchor=shared, border_delta=None), stats=PeerStats(),
                      label="x", peer_id="p")
    loaded = load_latest_checkpoint(tmp_path)
    exported, _ = checkpoint_model(loaded, m, which="peer")
    assert all(torch.equal(a, b) for a, b in zip(get_flat_params(exported), personal))
    region, _ = checkpoint_model(loaded, m, which="region")
    assert all(torch.equal(a, b) for a, b in zip(get_flat_params(region), shared))

    fresh = joining.build_local(PeerConfig(region="eu", data=str(demo_data_dir() / "eu" / "nl_news")), m,
                                load_texts(demo_data_dir() / "eu" / "nl_news"))
    member2 = Member(model=fresh.model, trainer=fresh.trainer, rule=fresh.rule, stats=PeerStats(),
                     personal=fresh.personal)
    assert checkpoints.resume(cfg, m, member=member2, state=RegionState(anchor=member2.params(), border_delta=None),
                              stats=PeerStats())
    assert all(torch.equal(a, b) for a, b in zip(member2.params(), shared))
    assert all(torch.equal(a, b) for a, b in zip(member2.personal_params(), personal))
    assert fresh.personal.state_dict()["optimizer"]["state"]  # the personal optimizer's moments came back

    # a checkpoint of one model: the personal model starts from the shared one
    one = tmp_path / "one"
    inline = Member(model=local.model, trainer=local.trainer, rule=local.rule, stats=PeerStats())
    checkpoints.write(PeerConfig(region="eu", data=".", checkpoint_dir=str(one)), m, member=inline,
                      state=RegionState(anchor=shared, border_delta=None), stats=PeerStats(), label="x", peer_id="p")
    set_params(fresh.personal.model, personal)
    assert checkpoints.resume(PeerConfig(region="eu", data=".", checkpoint_dir=str(one)), m, member=member2,
                              state=RegionState(anchor=member2.params(), border_delta=None), stats=PeerStats())
    assert all(torch.equal(a, b) for a, b in zip(member2.personal_params(), member2.params()))


def test_under_dp_sgd_a_peer_trains_one_model(peer_parts):
    """A second model trained on the same text would spend the DP-SGD budget again: under DP-SGD the
    peer holds one model (the rounds of ``personal_model="inline"``), whatever the manifest says."""
    from worldlm_p2p.config import PrivacyConfig

    m, _ = peer_parts
    data = demo_data_dir() / "eu" / "nl_news"
    cfg = PeerConfig(region="eu", data=str(data), privacy=PrivacyConfig(peer_noise=1.0), max_steps=10)
    local = joining.build_local(cfg, m, load_texts(data))
    assert m.aggregation.personal_model == "separate" and local.trainer.dp is not None
    assert local.personal is None and not local.rule.separate_personal and local.rule.mixes_by_part
