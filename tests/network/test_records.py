"""Signed, schema-validated DHT records on real hivemind DHT nodes (127.0.0.1)."""

import dataclasses

import pytest
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from worldlm_p2p.net import keys
from worldlm_p2p.config import NetConfig, RunManifest
from worldlm_p2p.net import records
from worldlm_p2p.net.dht import start_dht


def _rec(**kw):
    base = dict(region="eu", peer_id="p1", label="a", step=3, tokens=300, train_loss=2.5, tokens_per_s=10.0,
                rounds_completed=1, last_group_size=2, bytes_sent=10, bytes_received=10, round=2,
                waiting_for_round=-1, fingerprint="abc", time=1.0)
    base.update(kw)
    return records.ProgressRecord(**base)


def test_progress_wire_round_trip_and_rejections():
    r = _rec()
    assert records.ProgressRecord.from_wire(r.to_wire()) == r
    for bad in (dict(step=-1), dict(step=1.5), dict(label=3), dict(extra=1)):
        wire = dict(r.to_wire(), **bad)
        with pytest.raises(ValueError):
            records.ProgressRecord.from_wire(wire)
    with pytest.raises(ValueError):
        records.ProgressRecord.from_wire([1, 2])
    # non-finite losses never go on the wire
    assert records.ProgressRecord.from_wire(_rec(train_loss=float("nan")).to_wire()).train_loss == 0.0


def test_manifest_record_detects_tampering():
    key = RSAPrivateKey()
    m = RunManifest.from_dict({"run_id": "r1"})
    rec = records.ManifestRecord.sign(key, m, time=1.0)
    assert records.ManifestRecord.from_wire(rec.to_wire()).manifest == m
    other = RunManifest.from_dict({"run_id": "r1", "train": {"lr": 0.5}})
    forged = records.ManifestRecord.sign(RSAPrivateKey(), other, time=2.0)
    # another manifest under the signature of the run key: the fingerprint no longer matches
    with pytest.raises(ValueError, match="fingerprint"):
        records.ManifestRecord.from_wire(dict(rec.to_wire(), manifest=forged.to_wire()["manifest"]))
    # ... and with a matching fingerprint, the signature does not
    with pytest.raises(ValueError, match="signature"):
        records.ManifestRecord.from_wire(dict(forged.to_wire(), run_key=rec.run_key))
    # a later time than the run key signed (to win as the newest)
    with pytest.raises(ValueError, match="signature"):
        records.ManifestRecord.from_wire(dict(rec.to_wire(), time=99.0))
    with pytest.raises(ValueError):
        records.ManifestRecord.from_wire(dict(rec.to_wire(), signature="not base64!"))


def test_choose_manifest_trusts_the_given_key_then_the_bootstrap_nodes_keys():
    from worldlm_p2p.errors import ManifestError

    run_key, forger = RSAPrivateKey(), RSAPrivateKey()
    m = RunManifest.from_dict({"run_id": "r1"})
    honest = records.ManifestRecord.sign(run_key, m, time=10.0).signed_by("boot")
    newer = records.ManifestRecord.sign(run_key, RunManifest.from_dict({"run_id": "r1", "train": {"lr": 0.01}}),
                                        time=20.0).signed_by("peer-b")
    copy = dataclasses.replace(honest, signer="peer-a")  # a peer keeping the run's manifest alive
    fake = records.ManifestRecord.sign(forger, RunManifest.from_dict({"run_id": "r1", "train": {"lr": 9.0}}),
                                       time=99.0).signed_by("mallory")
    other_run = records.ManifestRecord.sign(forger, RunManifest.from_dict({"run_id": "r2"}), time=5.0).signed_by("mallory")
    found = [honest, copy, fake, other_run]
    # through the bootstrap node: its run key wins over the forger's, whatever the forger claims
    assert records.choose_manifest(found, run_id=None, trusted_key=None, anchors=["boot"]).manifest == m
    # a pinned run key: only its manifests, from whoever stored them (the bootstrap node is gone)
    pinned = records.choose_manifest([copy, fake, other_run], run_id="r1", trusted_key=honest.run_key)
    assert pinned.manifest == m and pinned.signer == "peer-a"
    # of one run key's manifests, the latest signed
    assert records.choose_manifest([honest, newer, fake], run_id="r1", trusted_key=None, anchors=["boot"]) == newer
    # neither a pinned key nor a bootstrap record: two keys compete, and the error says what to give
    with pytest.raises(ManifestError, match="--run-key"):
        records.choose_manifest([copy, fake], run_id="r1", trusted_key=None, anchors=["boot"])
    with pytest.raises(ManifestError, match="--run-id"):
        records.choose_manifest([copy, other_run], run_id=None, trusted_key=None)
    assert records.choose_manifest([fake], run_id="r1", trusted_key=honest.run_key) is None


@pytest.mark.network
def test_records_are_signed_and_validated_in_the_dht():
    run = "sig"
    rsa = [RSAPrivateKey() for _ in range(3)]
    vals = [records.make_validators(run, k) for k in rsa]
    boot = start_dht(NetConfig(), record_validators=vals[0])
    try:
        maddrs = tuple(str(m) for m in boot.get_visible_maddrs())
        alice = start_dht(NetConfig(initial_peers=maddrs), record_validators=vals[1])
        mallory = start_dht(NetConfig(initial_peers=maddrs), record_validators=vals[2])
        try:
            assert records.publish_progress(alice, vals[1], run, _rec(label="alice"), ttl=30)
            got = records.fetch_progress(mallory, run)
            assert [r.label for r in got] == ["alice"]
            # the reader learns who signed it: the peer id of alice's record key
            from worldlm_p2p.net.admission import peer_id_of

            assert got[0].signer == peer_id_of(rsa[1].get_public_key()) != peer_id_of(rsa[2].get_public_key())

            # mallory cannot write into alice's subkey: her signature does not match alice's key
            forged = _rec(label="alice", step=999).to_wire()
            ok = mallory.store(keys.progress_key(run), forged, expiration_time=get_dht_time() + 30,
                               subkey=records.owner_subkey(vals[1]))
            assert not ok
            assert [(r.label, r.step) for r in records.fetch_progress(boot, run)] == [("alice", 3)]

            # a record that breaks the schema is refused by every node
            bad = dict(_rec(label="mallory").to_wire(), step=-5)
            assert not mallory.store(keys.progress_key(run), bad, expiration_time=get_dht_time() + 30,
                                     subkey=records.owner_subkey(vals[2]))
            # mallory's own, well-formed record is accepted next to alice's
            assert records.publish_progress(mallory, vals[2], run, _rec(label="mallory"), ttl=30)
            assert sorted(r.label for r in records.fetch_progress(boot, run)) == ["alice", "mallory"]

            # manifests: published by the bootstrap, fetched and verified by peers
            m = RunManifest.from_dict({"run_id": run})
            assert records.publish_manifest(boot, vals[0], records.ManifestRecord.sign(rsa[0], m, time=1.0), ttl=30)
            fetched = records.fetch_manifests(alice)
            assert [f.manifest for f in fetched] == [m]
            assert fetched[0].signer == peer_id_of(rsa[0].get_public_key())
            # any peer may keep the signed record alive under its own subkey, verbatim; an altered one
            # is refused by the readers
            assert records.publish_manifest(alice, vals[1], fetched[0], ttl=30)
            altered = dict(fetched[0].to_wire(), time=2.0)
            assert not mallory.store(keys.RUNS_KEY, altered, expiration_time=get_dht_time() + 30,
                                     subkey=records.owner_subkey(vals[2])) or len(records.fetch_manifests(boot)) == 2
            assert sorted(f.signer for f in records.fetch_manifests(boot)) == sorted(
                peer_id_of(k.get_public_key()) for k in rsa[:2])
        finally:
            alice.shutdown()
            mallory.shutdown()
    finally:
        boot.shutdown()


def test_residual_record_round_trip_and_rejections():
    import numpy as np
    import torch

    emb = torch.arange(6, dtype=torch.float32).reshape(2, 3) / 7
    r = records.ResidualRecord.from_tensor(emb, region="eu", peer_id="p1", world_round=4, fingerprint="abc", time=1.0)
    assert (r.layers, r.dim) == (2, 3)
    back = records.ResidualRecord.from_wire(r.to_wire())
    assert back == r and torch.equal(back.tensor(), emb)
    for bad in (dict(layers=3), dict(embedding=r.embedding[:-4]), dict(world_round=-1), dict(extra=1),
                dict(embedding=np.array([np.nan] * 6, dtype="<f4").tobytes())):
        with pytest.raises(ValueError):
            records.ResidualRecord.from_wire(dict(r.to_wire(), **bad))
    # older progress records (without the world fields) still parse, with their defaults
    wire = _rec().to_wire()
    wire.pop("world_round"), wire.pop("leader")
    parsed = records.ProgressRecord.from_wire(wire)
    assert parsed.world_round == -1 and parsed.leader is False


def test_progress_loss_trend_and_epsilon_on_the_wire():
    r = _rec(loss_trend=(3.0, 2.5), epsilon=1.25)
    assert records.ProgressRecord.from_wire(r.to_wire()) == r
    assert _rec().to_wire()["epsilon"] == -1.0  # -1: differential privacy is off
    # only the newest MAX_LOSS_TREND finite points travel; a non-finite epsilon means "off"
    long = _rec(loss_trend=tuple(float(i) for i in range(40)) + (float("nan"),), epsilon=float("inf"))
    back = records.ProgressRecord.from_wire(long.to_wire())
    assert back.loss_trend == tuple(float(i) for i in range(40 - records.MAX_LOSS_TREND, 40)) and back.epsilon == -1.0
    for bad in (dict(loss_trend=[1.0] * (records.MAX_LOSS_TREND + 1)), dict(loss_trend=[-1.0]),
                dict(epsilon=-2.0), dict(epsilon="1")):
        with pytest.raises(ValueError):
            records.ProgressRecord.from_wire(dict(r.to_wire(), **bad))


def test_progress_mixing_weights_on_the_wire():
    r = _rec(mix_region=0.0625, mix_world=0.0)
    assert records.ProgressRecord.from_wire(r.to_wire()) == r
    assert _rec().to_wire()["mix_region"] == -1.0 and _rec().to_wire()["mix_world"] == -1.0  # -1: none yet
    # a weight outside [0, 1] or not finite travels as "none"; the receiver refuses out-of-range values
    assert _rec(mix_region=float("nan"), mix_world=1.5).to_wire()["mix_world"] == -1.0
    for bad in (dict(mix_region=1.5), dict(mix_world=-2.0), dict(mix_region="0.1")):
        with pytest.raises(ValueError):
            records.ProgressRecord.from_wire(dict(r.to_wire(), **bad))


def test_relay_record_round_trip_and_endorsement():
    from worldlm_p2p.net.admission import RELAY_ENDORSEMENT, issue, peer_id_of, relay_why_not

    run_key, stranger = RSAPrivateKey(), RSAPrivateKey()
    relay_key = RSAPrivateKey()
    relay_id = peer_id_of(relay_key.get_public_key())
    cert = issue(run_key, run_id="r", region=RELAY_ENDORSEMENT, peer_id=relay_id, expires=get_dht_time() + 60)
    rec = records.RelayRecord(peer_id=relay_id, fingerprint="abc", regions=("eu", "asia"), endorsement=cert.to_wire(),
                              time=1.0)
    back = records.RelayRecord.from_wire(rec.to_wire())
    assert back == rec
    for bad in (dict(regions=["x"] * 65), dict(endorsement={}), dict(extra=1), dict(time=-1.0)):
        with pytest.raises(ValueError):
            records.RelayRecord.from_wire(dict(rec.to_wire(), **bad))

    def why(record, key=run_key, **kw):
        return relay_why_not(record, run_key=key.get_public_key(), run_id="r", fingerprint="abc", **kw)

    assert why(back.signed_by(relay_id)) is None
    assert "not signed by the key" in why(back.signed_by("someone-else"))
    assert "not signed by the run key" in why(back.signed_by(relay_id), key=stranger)
    assert "relays manifest" in why(dataclasses.replace(back, fingerprint="other").signed_by(relay_id))
    assert "expired" in why(back.signed_by(relay_id), now=get_dht_time() + 120)
    # an endorsement of another peer, or of a region admission rather than a relay, does not do
    other = issue(run_key, run_id="r", region=RELAY_ENDORSEMENT, peer_id="QmOther", expires=get_dht_time() + 60)
    assert "for peer" in why(dataclasses.replace(back, endorsement=other.to_wire()).signed_by(relay_id))
    region = issue(run_key, run_id="r", region="eu", peer_id=relay_id, expires=get_dht_time() + 60)
    assert "for region" in why(dataclasses.replace(back, endorsement=region.to_wire()).signed_by(relay_id))
