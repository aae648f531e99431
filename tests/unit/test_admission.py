"""Admission per region: certificates, the libp2p peer id of a key, the manifest's region keys, and
the check a member makes of another peer's progress record."""

import dataclasses
import time

import pytest
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

from worldlm_p2p.config import RunManifest
from worldlm_p2p.errors import ConfigError
from worldlm_p2p.net.admission import (Certificate, RegionAdmission, check, issue, load_public_key, peer_id_of,
                                       public_key_text)
from worldlm_p2p.net.records import ProgressRecord

REGION_KEY, OTHER_KEY, PEER_KEY = RSAPrivateKey(), RSAPrivateKey(), RSAPrivateKey()
PUB = load_public_key(public_key_text(REGION_KEY), what="test")
PEER = peer_id_of(PEER_KEY.get_public_key())
LATER = time.time() + 3600


def test_peer_id_of_a_key_is_libp2ps():
    """The id libp2p (hivemind's PeerID.from_identity) gives the identity file of the same key."""
    blob = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=PEER_KEY.to_bytes()).SerializeToString()
    assert PEER == PeerID.from_identity(blob).to_base58()
    assert peer_id_of(OTHER_KEY.get_public_key()) != PEER


def test_a_certificate_admits_exactly_what_it_says():
    cert = issue(REGION_KEY, run_id="r", region="eu", peer_id=PEER, expires=LATER)
    ok = dict(region_key=PUB, run_id="r", region="eu", peer_id=PEER)
    assert check(cert, **ok) is None
    assert check(Certificate.from_wire(cert.to_wire()), **ok) is None  # the wire form round-trips
    assert check(None, **ok) == "no certificate"
    assert "run 'r'" in check(cert, **dict(ok, run_id="other"))
    assert "region 'eu'" in check(cert, **dict(ok, region="na"))
    assert "for peer" in check(cert, **dict(ok, peer_id="QmSomeoneElse"))
    assert check(cert, **ok, now=LATER + 1) == "the certificate has expired"
    # a field changed after signing, or a certificate signed by another key, does not verify
    assert "not signed" in check(dataclasses.replace(cert, expires=LATER + 86400), **ok)
    forged = issue(OTHER_KEY, run_id="r", region="eu", peer_id=PEER, expires=LATER)
    assert "not signed" in check(forged, **ok)
    assert "not base64" in check(dataclasses.replace(cert, signature="%%%"), **ok)


@pytest.mark.parametrize("wire, reason", [
    ([1, 2], "mapping"), ({"run_id": "r"}, "lacks region"),
    ({"run_id": "r", "region": "eu", "peer_id": "p", "expires": "soon", "signature": ""}, "wrong type"),
    ({"run_id": "r", "region": "eu", "peer_id": "p", "expires": 1.0, "signature": "x" * 5000}, "wrong type or size"),
])
def test_malformed_certificates(wire, reason):
    with pytest.raises(ValueError, match=reason):
        Certificate.from_wire(wire)


def test_certificate_files(tmp_path):
    cert = issue(REGION_KEY, run_id="r", region="eu", peer_id=PEER, expires=LATER)
    cert.save(tmp_path / "c.json")
    assert Certificate.load(tmp_path / "c.json") == cert
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a worldlm certificate"):
        Certificate.load(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="No such file"):
        Certificate.load(tmp_path / "missing.json")


def test_the_manifest_names_region_keys_without_changing_other_fingerprints():
    plain = RunManifest.from_dict({"run_id": "r"})
    assert "admission" not in plain.to_dict()
    line = public_key_text(REGION_KEY)
    m = RunManifest.from_dict({"run_id": "r", "admission": {"regions": {"eu": line}}})
    assert m.admission.key_of("eu") == line and m.admission.key_of("na") is None
    assert m.fingerprint() != plain.fingerprint()
    assert RunManifest.from_dict(m.to_dict()) == m  # the wire form round-trips
    for bad, needle in (({"regions": {"eu": "rsa AAAA"}}, "ssh-rsa"), ({"regions": {"e.u": line}}, "region"),
                        ({"keys": {}}, "unknown setting")):
        with pytest.raises(ConfigError, match=needle):
            RunManifest.from_dict({"run_id": "r", "admission": bad})


def _record(**kw) -> ProgressRecord:
    base = dict(region="eu", peer_id=PEER, label="a", step=1, tokens=1, train_loss=1.0, tokens_per_s=1.0,
                rounds_completed=0, last_group_size=0, bytes_sent=0, bytes_received=0, round=0,
                waiting_for_round=-1, fingerprint="f", time=1.0, signer=PEER,
                certificate=issue(REGION_KEY, run_id="r", region="eu", peer_id=PEER, expires=LATER).to_wire())
    return ProgressRecord(**{**base, **kw})


def test_what_a_member_checks_of_a_record():
    rules = RegionAdmission(run_id="r", regions=(("eu", public_key_text(REGION_KEY)),))
    assert rules.requires("eu") and not rules.requires("na")
    assert rules.why_not(_record()) is None
    assert rules.why_not(_record(region="na", certificate=None)) is None  # an open region
    # ... where, too, nobody speaks for another peer: the record must be signed by its own key
    assert "not signed by the key" in rules.why_not(_record(region="na", certificate=None, signer="QmOther"))
    assert "not signed by the key" in rules.why_not(_record(signer=peer_id_of(OTHER_KEY.get_public_key())))
    assert "not signed by the key" in rules.why_not(_record(signer=None))
    assert rules.why_not(_record(certificate=None)) == "no certificate"
    assert "malformed" in rules.why_not(_record(certificate={"run_id": "r"}))
    # a record that copies an admitted peer's id and certificate, signed by its own key: refused
    assert "not signed by the key" in rules.why_not(_record(signer="QmMallory"))
    # the certificate of another admitted peer does not admit this one
    other = peer_id_of(OTHER_KEY.get_public_key())
    assert "for peer" in rules.why_not(_record(peer_id=other, signer=other))
