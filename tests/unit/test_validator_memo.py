"""The DHT validators that remember their answers give the answers hivemind's validators give."""

import dataclasses
import pickle

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils.crypto import RSAPrivateKey

from worldlm_p2p.net import schemas


def _signed(key: RSAPrivateKey, value: bytes = b"progress", expiration: float = 100.0) -> tuple[DHTRecord, bytes]:
    plain = RSASignatureValidator(key)
    subkey = plain.local_public_key
    record = DHTRecord(key=b"run_progress", subkey=subkey, value=value, expiration_time=expiration)
    return dataclasses.replace(record, value=plain.sign_value(record)), subkey


def test_the_memo_answers_as_the_validator_and_verifies_a_record_once(monkeypatch):
    key = RSAPrivateKey()
    record, _ = _signed(key)
    tampered = dataclasses.replace(record, value=record.value.replace(b"progress", b"regress!"))
    later = dataclasses.replace(record, expiration_time=101.0)  # the signature covers the expiration
    plain = RSASignatureValidator(key)
    sequence = (record, record, tampered, tampered, later, record)
    expected = [plain.validate(r) for r in sequence]
    assert expected == [True, True, False, False, False, True]
    memo = schemas.MemoSignatureValidator(key, memo=2)
    calls = []
    inner = RSASignatureValidator.validate
    monkeypatch.setattr(RSASignatureValidator, "validate", lambda self, r: calls.append(r) or inner(self, r))
    assert [memo.validate(r) for r in sequence] == expected
    # a memo of 2: record, tampered and later verified once each, and record again once later
    # had pushed it out
    assert [c is record for c in calls] == [True, False, False, True] and calls[1] is tampered


def test_the_memo_is_bounded_and_travels_by_pickle():
    m = schemas._Memo(3)
    seen = []
    for i in range(5):
        r = DHTRecord(key=b"k", subkey=b"s", value=bytes([i]), expiration_time=1.0)
        assert m.check(r, lambda rec: seen.append(rec) or rec.value[0] % 2 == 0) == (i % 2 == 0)
    assert len(m.seen) == 3
    copy = pickle.loads(pickle.dumps(m))
    assert list(copy.seen.values()) == [True, False, True]


def test_a_schema_merged_in_clears_the_memo():
    v = schemas.make_validators(None, RSAPrivateKey())[1]
    r = DHTRecord(key=b"x", subkey=b"y", value=b"z", expiration_time=1.0)
    v._memo.check(r, lambda rec: False)
    assert v._memo.seen
    other = schemas.make_validators("run", RSAPrivateKey())[2]
    assert v.merge_with(other) and not v._memo.seen


def test_the_memo_keeps_digests_not_records_and_tells_every_field_apart():
    m = schemas._Memo(8)
    base = DHTRecord(key=b"k", subkey=b"s", value=b"v" * 100_000, expiration_time=1.0)
    variants = [base, dataclasses.replace(base, key=b"k2"), dataclasses.replace(base, subkey=None),
                dataclasses.replace(base, subkey=b""), dataclasses.replace(base, value=b"v" * 99_999 + b"w"),
                dataclasses.replace(base, expiration_time=1.0 + 1e-9),
                DHTRecord(key=b"ks", subkey=b"", value=base.value, expiration_time=1.0)]  # (no concatenation clash)
    assert len({m.digest(r) for r in variants}) == len(variants)
    for r in variants:
        m.check(r, lambda rec: True)
    assert all(isinstance(k, bytes) and len(k) == 16 for k in m.seen)
