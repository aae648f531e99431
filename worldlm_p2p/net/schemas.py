"""The wire schemas of the DHT records (pydantic models that every DHT node checks before it stores
a value) and the validators a node runs: signatures, and the schema of each key
(:mod:`worldlm_p2p.net.records` has the records themselves)."""

from __future__ import annotations

import collections
import hashlib
import struct
from typing import Callable, Optional

import pydantic.v1 as pydantic
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator

from worldlm_p2p.net.keys import RUNS_PREFIX

MAX_CERTIFICATE_BYTES = 2048  # a certificate's signature: a 2048-bit RSA signature is 344 in base64

_MAX_STR = 256
MAX_EMBEDDING_BYTES = 1 << 20  # 1 MiB: 4096 layers x 64 numbers, far above any preset
_Str = pydantic.constr(strict=True, max_length=_MAX_STR)
_Count = pydantic.conint(strict=True, ge=0)
_Float = pydantic.confloat(strict=True, allow_inf_nan=False)
_NonNegFloat = pydantic.confloat(strict=True, ge=0, allow_inf_nan=False)
MAX_LEASE_MADDRS = 8  # multiaddrs a lease record may carry (each at most _MAX_STR characters)
MAX_LOSS_TREND = 16  # recent loss points a progress record carries


class _CertificateModel(pydantic.BaseModel):
    run_id: _Str
    region: _Str
    peer_id: _Str
    expires: _NonNegFloat
    signature: pydantic.constr(strict=True, max_length=MAX_CERTIFICATE_BYTES)

    class Config:
        extra = pydantic.Extra.forbid


class _ProgressModel(pydantic.BaseModel):
    region: _Str
    peer_id: _Str
    label: _Str
    step: _Count
    tokens: _Count
    train_loss: _NonNegFloat
    tokens_per_s: _NonNegFloat
    rounds_completed: _Count
    last_group_size: _Count
    bytes_sent: _Count
    bytes_received: _Count
    round: _Count
    waiting_for_round: pydantic.conint(strict=True, ge=-1)
    fingerprint: _Str
    time: _NonNegFloat
    finished: pydantic.StrictBool
    world_round: pydantic.conint(strict=True, ge=-1) = -1
    leader: pydantic.StrictBool = False
    loss_trend: pydantic.conlist(_NonNegFloat, max_items=MAX_LOSS_TREND) = []
    epsilon: pydantic.confloat(strict=True, ge=-1, allow_inf_nan=False) = -1.0
    border_epsilon: pydantic.confloat(strict=True, ge=-1, allow_inf_nan=False) = -1.0
    border_releases: pydantic.conint(strict=True, ge=-1) = -1
    mix_region: pydantic.confloat(strict=True, ge=-1, le=1, allow_inf_nan=False) = -1.0
    mix_world: pydantic.confloat(strict=True, ge=-1, le=1, allow_inf_nan=False) = -1.0
    certificate: Optional[_CertificateModel] = None  # the region's admission of this peer
    state_round: pydantic.conint(strict=True, ge=-1) = -1  # the round of the agreed model it serves
    state_digest: pydantic.constr(strict=True, max_length=64) = ""  # its digest (codec.state_digest)
    reachability: pydantic.constr(strict=True, max_length=16) = ""  # direct / outbound / not-direct / unknown
    rounds_partial: _Count = 0
    wire_sent: pydantic.conint(strict=True, ge=-1) = -1  # measured bytes on the wire (-1: not measured)
    wire_received: pydantic.conint(strict=True, ge=-1) = -1
    round_tokens: _Count = 0  # tokens trained since it last entered a region round

    class Config:
        extra = pydantic.Extra.forbid


class _LeaseModel(pydantic.BaseModel):
    region: _Str
    peer_id: _Str
    since: _NonNegFloat
    expires: _NonNegFloat
    fingerprint: _Str
    world_round: pydantic.conint(strict=True, ge=-1)
    maddrs: pydantic.conlist(_Str, max_items=MAX_LEASE_MADDRS)

    class Config:
        extra = pydantic.Extra.forbid


class _ManifestModel(pydantic.BaseModel):
    run_id: _Str
    fingerprint: _Str
    manifest: pydantic.conbytes(strict=True, max_length=65536)  # msgpack of RunManifest.to_dict()
    time: _NonNegFloat
    run_key: pydantic.constr(strict=True, max_length=4096)  # the run key's public half, ssh-rsa AAAA...
    signature: pydantic.constr(strict=True, max_length=4096)  # base64, by the run key, over the fields above

    class Config:
        extra = pydantic.Extra.forbid


class _ResidualModel(pydantic.BaseModel):
    region: _Str
    peer_id: _Str
    world_round: _Count
    fingerprint: _Str
    layers: pydantic.conint(strict=True, ge=1, le=4096)
    dim: pydantic.conint(strict=True, ge=1, le=4096)
    embedding: pydantic.conbytes(strict=True, max_length=MAX_EMBEDDING_BYTES)  # float32, little endian
    time: _NonNegFloat

    class Config:
        extra = pydantic.Extra.forbid


MAX_RELAY_REGIONS = 64  # regions one relay record may name


class _RelayModel(pydantic.BaseModel):
    peer_id: _Str
    fingerprint: _Str
    regions: pydantic.conlist(_Str, max_items=MAX_RELAY_REGIONS)  # the groups it reduces rounds for now
    endorsement: _CertificateModel  # by the run key: this peer may relay the run's rounds
    time: _NonNegFloat

    class Config:
        extra = pydantic.Extra.forbid


class _RunsSchema(pydantic.BaseModel):
    runs: dict[BytesWithPublicKey, _ManifestModel]


class _ProgressSchema(pydantic.BaseModel):
    progress: dict[BytesWithPublicKey, _ProgressModel]


class _LeadersSchema(pydantic.BaseModel):
    leaders: dict[BytesWithPublicKey, _LeaseModel]


class _ResidualsSchema(pydantic.BaseModel):
    residuals: dict[BytesWithPublicKey, _ResidualModel]


class _RelaysSchema(pydantic.BaseModel):
    relays: dict[BytesWithPublicKey, _RelayModel]


#: records whose validation a DHT node remembers (each memo holds at most this many digests)
VALIDATION_MEMO = 2048


class _Memo:
    """What ``validate`` said of the last :data:`VALIDATION_MEMO` records, by a digest of the
    record's whole content (key, subkey, value with its signature, expiration time). A DHT node receives the same
    record many times: a read gathers it from several of the nodes that store it, and every read
    until its owner renews it gets it again; with 16 peers, validating those copies (an RSA
    signature and a pydantic model each) took about half of a peer's DHT process (py-spy,
    ``benchmarks/perf.py --scale``). A validator is a pure function of the record, so the answer for
    the same bytes is the same. Plain data: the validators travel to the DHT's process by pickling."""

    def __init__(self, size: int = VALIDATION_MEMO) -> None:
        self.size = size
        self.seen: collections.OrderedDict = collections.OrderedDict()

    @staticmethod
    def digest(record) -> bytes | None:
        """A collision-resistant digest of the record's whole content (the memo keeps 16 bytes per
        record, never the record: a value may be up to a MiB); None for a field that is not bytes
        or a number (never from the wire: such a record is validated as it is)."""
        h = hashlib.blake2b(digest_size=16)
        try:
            for part in (record.key, record.subkey, record.value):
                if part is None:
                    h.update(b"\x00")
                    continue
                part = bytes(part)
                h.update(b"\x01" + len(part).to_bytes(8, "little") + part)
            h.update(struct.pack("<d", float(record.expiration_time)))
        except (TypeError, ValueError, OverflowError):
            return None
        return h.digest()

    def check(self, record, validate: Callable) -> bool:
        key = self.digest(record)
        if key is None:
            return bool(validate(record))
        hit = self.seen.get(key)
        if hit is not None:
            self.seen.move_to_end(key)
            return hit
        ok = bool(validate(record))
        self.seen[key] = ok
        if len(self.seen) > self.size:
            self.seen.popitem(last=False)
        return ok

    def clear(self) -> None:
        self.seen.clear()


class MemoSignatureValidator(RSASignatureValidator):
    """hivemind's signature validator, remembering its answers (:class:`_Memo`)."""

    def __init__(self, private_key=None, *, memo: int = VALIDATION_MEMO) -> None:
        super().__init__(private_key)
        self._memo = _Memo(memo)

    def validate(self, record) -> bool:
        return self._memo.check(record, super().validate)


class MemoSchemaValidator(SchemaValidator):
    """hivemind's schema validator, remembering its answers (:class:`_Memo`); forgotten when
    another schema merges into it (the answers may change)."""

    def __init__(self, schema, *, memo: int = VALIDATION_MEMO, **kwargs) -> None:
        super().__init__(schema, **kwargs)
        self._memo = _Memo(memo)

    def validate(self, record) -> bool:
        return self._memo.check(record, super().validate)

    def merge_with(self, other) -> bool:
        merged = super().merge_with(other)
        if merged:
            self._memo.clear()
        return merged


def make_validators(run_id: str | None, private_key) -> list:
    """Validators every DHT node of the run must use (also bootstrap nodes, which store records).

    ``private_key``: the identity's RSA key, so a restarted process keeps its records' ownership.
    The first two validators (signature, run manifests) do not depend on ``run_id``; the run's own
    schemas follow them, so a node that learns the run id later adds ``make_validators(...)[2:]``.
    """
    validators: list = [MemoSignatureValidator(private_key), MemoSchemaValidator(_RunsSchema, prefix=RUNS_PREFIX)]
    if run_id is not None:
        validators.append(MemoSchemaValidator(_ProgressSchema, prefix=run_id))
        validators.append(MemoSchemaValidator(_LeadersSchema, prefix=run_id))
        validators.append(MemoSchemaValidator(_ResidualsSchema, prefix=run_id))
        validators.append(MemoSchemaValidator(_RelaysSchema, prefix=run_id))
    return validators


def owner_peer_id(subkey: bytes) -> str | None:
    """The libp2p peer id of the key that owns (and signed) a DHT subkey ``[owner:ssh-rsa ...]``;
    None for a subkey without an owner."""
    from hivemind.utils.crypto import RSAPublicKey

    from worldlm_p2p.net.admission import peer_id_of

    m = RSASignatureValidator._PUBLIC_KEY_RE.search(subkey) if isinstance(subkey, bytes) else None
    if m is None:
        return None
    try:
        return peer_id_of(RSAPublicKey.from_bytes(m.group(1)))
    except Exception:
        return None


def owner_subkey(validators) -> bytes:
    for v in validators:
        if isinstance(v, RSASignatureValidator):
            return v.local_public_key
    raise ValueError("no RSASignatureValidator among the validators")
