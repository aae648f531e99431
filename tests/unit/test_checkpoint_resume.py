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
