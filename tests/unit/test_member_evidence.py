"""A swarm member's evidence budget (``aggregation.evidence_share``): its searches are charged one
tune slice per evaluation, and when none is due it takes its last choice of that kind again, which
gives the model :func:`worldlm_p2p.rounds.personal_mix` gives with ``reuse`` (the simulator's rule)."""

import pytest

from worldlm_p2p import mixing, rounds
from worldlm_p2p.config import PeerConfig, RunManifest
from worldlm_p2p.peer import joining
from worldlm_p2p.peer.member import Member
from worldlm_p2p.peer.stats import PeerStats
from worldlm_p2p.train import demo_data_dir, get_flat_params, load_texts


def _member(share: float) -> Member:
    m = RunManifest.from_dict({"run_id": "ev", "model": {"preset": "tiny"}, "train": {"batch_size": 2, "seq_len": 32},
                               "aggregation": {"evidence_share": share}})
    data = demo_data_dir() / "eu" / "nl_news"
    local = joining.build_local(PeerConfig(region="eu", data=str(data)), m, load_texts(data))
    assert local.personal is not None and local.rule.config.evidence_share == share
    return Member(model=local.model, trainer=local.trainer, rule=local.rule, stats=PeerStats(),
                  personal=local.personal)


def test_a_member_reuses_its_last_personal_choice_until_training_pays_for_a_search():
    member = _member(0.05)
    assert member.budget.models == 2  # a personal model apart: two models trained per token
    slice_tokens = member.trainer.data.tune.numel()
    # the shared model moved (as a round would move it): something for the personal model to take
    shared = [t + 0.01 for t in member.params()]
    member.set(shared)
    member.mix_personal(1)
    first = member.stats.mixes[-1]
    spent = member.budget.spent["personal"]
    assert not first.get("reused") and spent > 0 and spent % slice_tokens == 0 and member.budget.total == spent
    personal_before = member.personal_params()
    # no training since: the same weights again, nothing evaluated
    member.set([t + 0.01 for t in shared])
    member.mix_personal(2)
    second = member.stats.mixes[-1]
    assert second["reused"] and (second["lam"], second.get("key_lam")) == (first["lam"], first.get("key_lam"))
    assert member.budget.spent["personal"] == spent
    want, _ = rounds.personal_mix(member.rule, personal=personal_before, shared=member.params(),
                                  loss_of=lambda p: pytest.fail("evaluated"),
                                  reuse=mixing.reused_choice(first["lam"], first.get("key_lam")))
    assert all(float((a - b).abs().max()) == 0 for a, b in zip(member.personal_params(), want))
    # once the member has trained enough tokens (spent <= 0.05 x 3 x 2 x tokens) it searches again
    member.stats.tokens = int(spent / 0.3) + 1
    member.set([t + 0.02 for t in shared])
    member.mix_personal(3)
    assert not member.stats.mixes[-1].get("reused") and member.budget.spent["personal"] > spent


def test_region_and_world_choices_are_kept_apart_and_share_zero_always_searches():
    member = _member(0.05)
    assert member.reuse_for("region") is None  # nothing searched yet
    choice = mixing.MixChoice(lam=0.25, loss=1.0, own_loss=1.1, evaluated=((0.25, 1.0),))
    member.record_mix("region", 1, choice)
    assert member.reuse_for("region") is None  # nothing spent yet: a search is due
    member.budget.charge("region", 10)  # spent > the allowance of no training
    assert member.reuse_for("region") is choice and member.reuse_for("world") is None
    member.budget.charge("world", 10)
    assert member.reuse_for("world") is None  # no world choice to reuse: search
    free = _member(0.0)
    free.record_mix("region", 1, choice)
    free.budget.charge("region", 1e9)
    assert free.reuse_for("region") is None
    # the slice loss functions the rounds use are charged one slice per call
    before = free.budget.spent["region"]
    free.loss_of()(get_flat_params(free.model))
    assert free.budget.spent["region"] == before + free.trainer.data.tune.numel()
    free.loss_of("leader")(get_flat_params(free.model))
    assert free.budget.spent["leader"] == free.trainer.data.tune.numel()


def test_a_bad_share_is_refused_with_the_reason():
    from worldlm_p2p.errors import ConfigError

    for bad in (-1, float("nan"), 11):
        with pytest.raises(ConfigError, match="evidence_share"):
            RunManifest.from_dict({"run_id": "ev", "aggregation": {"evidence_share": bad}})


def test_a_resumed_member_keeps_its_evidence_accounts_and_last_weights(tmp_path, caplog):
    """The checkpoint keeps the budget: a resumed member neither searches at once (its accounts are
    spent) nor forgets the weights it reuses; a damaged budget in a checkpoint starts new accounts
    with a warning, and the rest of the checkpoint resumes."""
    from worldlm_p2p.peer import checkpoints
    from worldlm_p2p.peer.state import RegionState

    member = _member(0.05)
    cfg = PeerConfig(region="eu", data=".", checkpoint_dir=str(tmp_path))
    member.set([t + 0.01 for t in member.params()])
    member.mix_personal(1)
    first = member.stats.mixes[-1]
    spent = dict(member.budget.spent)
    manifest = RunManifest.from_dict({"run_id": "ev", "model": {"preset": "tiny"},
                                      "train": {"batch_size": 2, "seq_len": 32},
                                      "aggregation": {"evidence_share": 0.05}})
    checkpoints.write(cfg, manifest, member=member, state=RegionState(anchor=member.params(), border_delta=None),
                      stats=member.stats, label="x", peer_id="p")

    resumed = _member(0.05)
    assert checkpoints.resume(cfg, manifest, member=resumed,
                              state=RegionState(anchor=resumed.params(), border_delta=None), stats=resumed.stats)
    assert resumed.budget.spent == spent
    again = resumed.reuse_for("personal")
    assert again is not None and (again.lam, again.second_lam) == (first["lam"], first.get("key_lam"))
    resumed.set([t + 0.01 for t in resumed.params()])
    resumed.mix_personal(2)
    assert resumed.stats.mixes[-1]["reused"] and resumed.budget.spent == spent  # nothing evaluated

    # a checkpoint whose budget is damaged: new accounts, a warning, the models still resume
    from worldlm_p2p.checkpoint import load_latest_checkpoint, save_checkpoint
    payload = dict(load_latest_checkpoint(tmp_path).payload)
    payload["evidence"] = {"spent": {"personal": -1.0}, "last": {}}
    damaged = tmp_path / "damaged"
    save_checkpoint(damaged, step=1, payload=payload, keep=2)
    fresh = _member(0.05)
    with caplog.at_level("WARNING"):
        assert checkpoints.resume(PeerConfig(region="eu", data=".", checkpoint_dir=str(damaged)), manifest,
                                  member=fresh, state=RegionState(anchor=fresh.params(), border_delta=None),
                                  stats=fresh.stats)
    assert fresh.budget.spent == {} and "evidence budget is unusable" in caplog.text
