"""Signed, schema-validated DHT records: run manifests, peer progress and leader candidacies.

Five DHT keys are used per run (hivemind serialises values with msgpack):

- ``worldlm_runs``: one subkey per publisher (a bootstrap node), value = :class:`ManifestRecord`.
- ``<run_id>_progress``: one subkey per peer, value = :class:`ProgressRecord`.
- ``<run_id>_leaders``: one subkey per peer, value = :class:`LeaseRecord` (a candidacy for its
  region's leader lease; the election itself is in :mod:`worldlm_p2p.net.leader`).
- ``<run_id>_residuals``: one subkey per region leader, value = :class:`ResidualRecord` (its
  region's residual embedding for a world round, :mod:`worldlm_p2p.net.world`).
- ``<run_id>_relays``: one subkey per relay, value = :class:`RelayRecord` (a reachable node, endorsed
  by the run key, that reduces the rounds of regions whose members are all outbound-only:
  :mod:`worldlm_p2p.peer.relay`).

Every subkey carries its owner's public key (``[owner:<rsa key>]``) and every value is signed by
hivemind's ``RSASignatureValidator``, so no peer can write into another's subkey; the pydantic
schemas (``SchemaValidator``, :mod:`worldlm_p2p.net.schemas`) make every DHT node reject records of
the wrong shape before storing them. On the reading side each record is parsed again into a frozen dataclass; a malformed record is
logged and skipped, never trusted.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import pydantic.v1 as pydantic
from hivemind.utils.timed_storage import get_dht_time

from worldlm_p2p.config import RunManifest
from worldlm_p2p.errors import ConfigError, ManifestError
from worldlm_p2p.net.keys import RUNS_KEY, leaders_key, progress_key, relays_key, residuals_key
from worldlm_p2p.net.schemas import (_MAX_STR, MAX_EMBEDDING_BYTES, MAX_LEASE_MADDRS, MAX_LOSS_TREND,  # noqa: F401
                                     MAX_RELAY_REGIONS, _LeaseModel, _ManifestModel, _ProgressModel, _RelayModel,
                                     _ResidualModel, make_validators, owner_peer_id, owner_subkey)

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------- records


def _parse(model, value: Any, what: str):
    """``value`` validated by the pydantic ``model`` of a ``what`` record; ``ValueError`` (one line)
    for anything else."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} record must be a map, got {type(value).__name__}")
    try:
        return model.parse_obj(dict(value))
    except pydantic.ValidationError as e:
        raise ValueError(" ".join(str(e).split())) from None


@dataclass(frozen=True, kw_only=True, slots=True)
class ProgressRecord:
    """What a peer tells the swarm about itself every few seconds."""

    region: str
    peer_id: str
    label: str
    step: int
    tokens: int
    train_loss: float
    tokens_per_s: float
    rounds_completed: int
    last_group_size: int
    bytes_sent: int
    bytes_received: int
    round: int  # index of the next region round this peer will take part in
    waiting_for_round: int  # round index the peer is waiting for at its region barrier, -1 if training
    fingerprint: str  # run manifest fingerprint
    time: float
    finished: bool = False
    world_round: int = -1  # the last world round whose result this peer adopted (-1: none)
    leader: bool = False  # whether this peer holds its region's leader lease
    # mean train loss of each of the last (at most MAX_LOSS_TREND) spans of inner_steps steps, oldest first
    loss_trend: tuple[float, ...] = ()
    epsilon: float = -1.0  # privacy budget spent by the peer's DP-SGD (-1: differential privacy is off)
    border_epsilon: float = -1.0  # what its region has spent at its border, as this peer knows it (-1: off)
    border_releases: int = -1  # the border releases that epsilon composes (-1: border DP off)
    # evidence mixing: the mean weight the peer took of its region's agreed model / of the world's
    # changes in its last few choices (-1: none made)
    mix_region: float = -1.0
    mix_world: float = -1.0
    certificate: dict | None = None  # the region's admission of this peer (net.admission.Certificate wire)
    state_round: int = -1  # the round of the region's agreed model this peer serves (-1: none yet)
    state_digest: str = ""  # that model's digest (worldlm_p2p.codec.state_digest)
    # how others reach it: "direct", "outbound" (it only dials out), "not-direct" (found unreachable but
    # told to act as direct), "unknown", "" (not checked / an older peer: taken as direct)
    reachability: str = ""
    rounds_partial: int = 0  # of rounds_completed, those that lost a part
    wire_sent: int = -1  # measured TCP bytes of the peer's processes since it started (-1: not measured)
    wire_received: int = -1
    # tokens it trained since it last entered a region round (what it brings to the next one; the
    # region's pace when rounds are due by tokens: worldlm_p2p.net.barrier.round_due)
    round_tokens: int = 0
    # not on the wire: the peer id of the key that signed the record in the DHT (set by the reader)
    signer: str | None = field(default=None, compare=False)

    def to_wire(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("signer")  # (certificate stays, None included: the DHT's schema check compares parsed with raw)
        d["world_round"] = max(-1, int(d["world_round"]))
        d["leader"] = bool(d["leader"])
        d["loss_trend"] = [float(x) for x in d["loss_trend"] if math.isfinite(x) and x >= 0][-MAX_LOSS_TREND:]
        for key in ("epsilon", "border_epsilon"):
            eps = float(d[key])
            d[key] = eps if math.isfinite(eps) and eps >= 0 else -1.0
        d["border_releases"] = max(-1, int(d["border_releases"])) if d["border_epsilon"] >= 0 else -1
        for key in ("mix_region", "mix_world"):
            lam = float(d[key])
            d[key] = lam if math.isfinite(lam) and 0 <= lam <= 1 else -1.0
        for k in ("train_loss", "tokens_per_s", "time"):
            v = float(d[k])
            d[k] = v if math.isfinite(v) and v >= 0 else 0.0
        for k in ("step", "tokens", "rounds_completed", "last_group_size", "bytes_sent", "bytes_received", "round"):
            d[k] = int(d[k])
        d["waiting_for_round"] = int(d["waiting_for_round"])
        d["finished"] = bool(d["finished"])
        d["state_round"] = max(-1, int(d["state_round"]))
        d["state_digest"] = str(d["state_digest"])[:64]
        d["reachability"] = str(d["reachability"])[:16]
        d["rounds_partial"] = max(0, int(d["rounds_partial"]))
        d["wire_sent"], d["wire_received"] = max(-1, int(d["wire_sent"])), max(-1, int(d["wire_received"]))
        d["round_tokens"] = max(0, int(d["round_tokens"]))
        return d

    @classmethod
    def from_wire(cls, value: Any) -> "ProgressRecord":
        """Parse and validate; raises ``ValueError`` on anything malformed."""
        parsed = _parse(_ProgressModel, value, "progress")
        d = parsed.dict()
        d["loss_trend"] = tuple(d["loss_trend"])
        return cls(**d)

    def signed_by(self, signer: str | None) -> "ProgressRecord":
        return dataclasses.replace(self, signer=signer)


@dataclass(frozen=True, kw_only=True, slots=True)
class LeaseRecord:
    """A peer's candidacy for its region's leader lease (see :mod:`worldlm_p2p.net.leader`).

    ``since``: DHT time the peer became a candidate (the oldest candidate wins). ``expires``: DHT
    time until which the candidacy holds; the owner renews it before then, and a withdrawing peer
    publishes ``expires = now``. ``world_round``: the world round the peer is at (-1: none yet).
    ``maddrs``: where other peers can reach it (at most :data:`MAX_LEASE_MADDRS`).
    """

    region: str
    peer_id: str
    since: float
    expires: float
    fingerprint: str  # run manifest fingerprint
    world_round: int = -1
    maddrs: tuple[str, ...] = ()
    # not on the wire: the peer id of the key that signed the record in the DHT (set by the reader)
    signer: str | None = field(default=None, compare=False)

    def to_wire(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("signer")
        for k in ("since", "expires"):
            v = float(d[k])
            d[k] = v if math.isfinite(v) and v >= 0 else 0.0
        d["world_round"] = max(-1, int(d["world_round"]))
        # a list, not a tuple (msgpack); addresses beyond the schema's limits are left out
        d["maddrs"] = [str(m) for m in d["maddrs"] if len(str(m)) <= _MAX_STR][:MAX_LEASE_MADDRS]
        return d

    @classmethod
    def from_wire(cls, value: Any) -> "LeaseRecord":
        """Parse and validate; raises ``ValueError`` on anything malformed."""
        parsed = _parse(_LeaseModel, value, "lease")
        d = parsed.dict()
        d["maddrs"] = tuple(d["maddrs"])
        return cls(**d)

    def signed_by(self, signer: str | None) -> "LeaseRecord":
        return dataclasses.replace(self, signer=signer)


@dataclass(frozen=True, kw_only=True, slots=True)
class ResidualRecord:
    """A region leader's residual embedding for one world round: ``layers x dim`` float32 numbers
    (:func:`worldlm_p2p.rounds.embed`), published so that other leaders can score it before they
    fetch the full residual from ``peer_id`` over P2P."""

    region: str
    peer_id: str
    world_round: int
    fingerprint: str
    layers: int
    dim: int
    embedding: bytes
    time: float

    @classmethod
    def from_tensor(cls, embedding, **fields) -> "ResidualRecord":
        import numpy as np

        arr = np.ascontiguousarray(embedding.detach().cpu().numpy(), dtype="<f4")
        layers, dim = arr.shape
        return cls(layers=int(layers), dim=int(dim), embedding=arr.tobytes(), **fields)

    def tensor(self):
        import numpy as np
        import torch

        return torch.from_numpy(np.frombuffer(self.embedding, dtype="<f4").copy().reshape(self.layers, self.dim))

    def to_wire(self) -> dict[str, Any]:
        return dict(region=self.region, peer_id=self.peer_id, world_round=int(self.world_round),
                    fingerprint=self.fingerprint, layers=int(self.layers), dim=int(self.dim),
                    embedding=bytes(self.embedding), time=float(self.time))

    @classmethod
    def from_wire(cls, value: Any) -> "ResidualRecord":
        """Parse and validate (shape and finiteness too); raises ``ValueError`` on anything malformed."""
        import numpy as np

        parsed = _parse(_ResidualModel, value, "residual")
        if len(parsed.embedding) != 4 * parsed.layers * parsed.dim:
            raise ValueError(f"embedding has {len(parsed.embedding)} bytes, expected 4 x {parsed.layers} x {parsed.dim}")
        if not np.isfinite(np.frombuffer(parsed.embedding, dtype="<f4")).all():
            raise ValueError("embedding has non-finite values")
        return cls(**parsed.dict())


@dataclass(frozen=True, kw_only=True, slots=True)
class RelayRecord:
    """A relay's offer: the groups (regions, or :data:`~worldlm_p2p.net.keys.ALL_REGIONS`) whose
    rounds it reduces now, as an auxiliary member of their all-reduce that sends nothing of its own.
    ``endorsement``: a certificate of the run key for this peer id and region
    :data:`~worldlm_p2p.net.admission.RELAY_ENDORSEMENT` (a reducer of a region of outbound-only
    members holds the whole vector, so members take only relays the run's operator named)."""

    peer_id: str
    fingerprint: str
    regions: tuple[str, ...]
    endorsement: dict
    time: float
    # not on the wire: the peer id of the key that signed the record in the DHT (set by the reader)
    signer: str | None = field(default=None, compare=False)

    def to_wire(self) -> dict[str, Any]:
        return dict(peer_id=self.peer_id, fingerprint=self.fingerprint,
                    regions=[str(r) for r in self.regions][:MAX_RELAY_REGIONS], endorsement=dict(self.endorsement),
                    time=float(self.time) if math.isfinite(self.time) and self.time >= 0 else 0.0)

    @classmethod
    def from_wire(cls, value: Any) -> "RelayRecord":
        """Parse and validate; raises ``ValueError`` on anything malformed."""
        parsed = _parse(_RelayModel, value, "relay")
        d = parsed.dict()
        d["regions"] = tuple(d["regions"])
        return cls(**d)

    def signed_by(self, signer: str | None) -> "RelayRecord":
        return dataclasses.replace(self, signer=signer)


@dataclass(frozen=True, kw_only=True, slots=True)
class ManifestRecord:
    """A run manifest signed by the run's key. The signature covers the run id, the fingerprint,
    the manifest's bytes and the time it was signed, so that any peer can keep the record alive in
    the DHT (:func:`publish_manifest`, under its own subkey) and nobody can alter it; which run
    keys a peer trusts is :func:`choose_manifest`'s business."""

    run_id: str
    fingerprint: str
    manifest: RunManifest
    time: float  # when the run key signed it
    run_key: str  # OpenSSH public key of the run key
    signature: str
    wire: dict = field(default_factory=dict, compare=False, repr=False)  # the signed value, verbatim
    signer: str = field(default="", compare=False)  # peer id of the DHT subkey that stored it

    @staticmethod
    def body(*, run_id: str, fingerprint: str, manifest_bytes: bytes, time: float) -> bytes:
        return b"worldlm-manifest/1\0" + json.dumps([run_id, fingerprint, float(time)]).encode() + b"\0" + manifest_bytes

    @classmethod
    def sign(cls, run_key, manifest: RunManifest, *, time: float) -> "ManifestRecord":
        """The manifest signed with ``run_key`` (a hivemind ``RSAPrivateKey``) at ``time``."""
        from hivemind.utils.serializer import MSGPackSerializer

        from worldlm_p2p.net.admission import public_key_text

        blob = MSGPackSerializer.dumps(manifest.to_dict())
        fp = manifest.fingerprint()
        signature = run_key.sign(cls.body(run_id=manifest.run_id, fingerprint=fp, manifest_bytes=blob,
                                          time=time)).decode()
        wire = dict(run_id=manifest.run_id, fingerprint=fp, manifest=blob, time=float(time),
                    run_key=public_key_text(run_key), signature=signature)
        return cls.from_wire(wire)

    def to_wire(self) -> dict[str, Any]:
        return dict(self.wire)

    def signed_by(self, peer_id: str) -> "ManifestRecord":
        return dataclasses.replace(self, signer=peer_id)

    @classmethod
    def from_wire(cls, value: Any) -> "ManifestRecord":
        """Parse and check the run key's signature; ``ValueError`` for anything else."""
        import base64

        from hivemind.utils.serializer import MSGPackSerializer

        from worldlm_p2p.net.admission import load_public_key

        if not isinstance(value, Mapping):
            raise ValueError("manifest record must be a map")
        try:
            parsed = _ManifestModel.parse_obj(dict(value))
            manifest = RunManifest.from_dict(MSGPackSerializer.loads(parsed.manifest))
        except pydantic.ValidationError as e:
            raise ValueError(" ".join(str(e).split())) from None
        except ConfigError as e:
            raise ValueError(f"invalid manifest: {e}") from None
        except Exception as e:  # msgpack errors
            raise ValueError(f"undecodable manifest: {type(e).__name__}") from None
        if manifest.fingerprint() != parsed.fingerprint or manifest.run_id != parsed.run_id:
            raise ValueError("manifest fingerprint or run id does not match its content")
        try:
            key = load_public_key(parsed.run_key, what="run key")
            base64.b64decode(parsed.signature, validate=True)
        except (ConfigError, ValueError):
            raise ValueError("the run key or the signature is malformed") from None
        body = cls.body(run_id=parsed.run_id, fingerprint=parsed.fingerprint, manifest_bytes=parsed.manifest,
                        time=parsed.time)
        if not key.verify(body, parsed.signature.encode()):
            raise ValueError("the run key's signature does not match the manifest")
        return cls(run_id=parsed.run_id, fingerprint=parsed.fingerprint, manifest=manifest, time=parsed.time,
                   run_key=parsed.run_key.strip(), signature=parsed.signature, wire=dict(parsed.dict()))


def run_key_id(run_key: str) -> str:
    """A short printable id of a run key (the last characters of its OpenSSH body)."""
    return run_key.split()[1][-12:] if len(run_key.split()) > 1 else run_key[-12:]


def choose_manifest(found: Sequence[ManifestRecord], *, run_id: str | None, trusted_key: str | None,
                    anchors: Sequence[str] = ()) -> ManifestRecord | None:
    """The run manifest a peer takes from the signed records ``found`` (None: none of them is for
    it). Trust, in order: the run key the peer was given (``trusted_key``: only manifests it signed
    count); else the run keys of the records stored by the peers it joined through (``anchors``,
    the peer ids of its ``--initial-peers``: its bootstrap nodes); else, when neither says, the
    records' only run key. Of the trusted manifests of the run, the latest signed wins (a run key
    holder that changed its manifest). Raises :class:`ManifestError` when several runs or several
    untrusted run keys compete, saying what to give."""
    if trusted_key is not None:
        found = [r for r in found if r.run_key == trusted_key.strip()]
    else:
        anchored = {r.run_key for r in found if r.signer and r.signer in set(anchors)}
        if anchored:
            found = [r for r in found if r.run_key in anchored]
    matching = [r for r in found if run_id is None or r.run_id == run_id]
    if not matching:
        return None
    runs = sorted({r.run_id for r in matching})
    if len(runs) > 1:
        raise ManifestError(f"several runs are published ({', '.join(runs)}); choose one with --run-id")
    keys = sorted({r.run_key for r in matching})
    if len(keys) > 1:
        raise ManifestError(f"run {runs[0]!r} is published under {len(keys)} different run keys "
                            f"({', '.join(run_key_id(k) for k in keys)}): give the run's key with --run-key")
    return max(matching, key=lambda r: r.time)


# ----------------------------------------------------------------------------------- DHT I/O


def _entries(result) -> dict:
    if result is None or not isinstance(result.value, dict):
        return {}
    return result.value


#: seconds a peer's own copy of the run manifest lives in the DHT without renewal
PEER_MANIFEST_TTL = 120.0


def publish_manifest(dht, validators, record: ManifestRecord, *, ttl: float) -> bool:
    """Store a signed manifest record under this process's own subkey (a bootstrap node, or any
    peer that keeps the run's manifest alive), expiring ``ttl`` seconds from now."""
    return _wait(dht.store(RUNS_KEY, record.to_wire(), expiration_time=get_dht_time() + ttl,
                           subkey=owner_subkey(validators), return_future=True), "storing the run manifest", dht)


def fetch_manifests(dht) -> list[ManifestRecord]:
    """All validly signed manifest records currently in the DHT, each with the peer id that stored
    it (invalid ones are logged and skipped)."""
    return _fetch(dht, RUNS_KEY, ManifestRecord.from_wire, "run manifest", with_signer=True)


def fetch_run_manifest(dht, *, run_id: str | None, wait: float, should_stop=lambda: False,
                       trusted_key: str | None = None, anchors: Sequence[str] = ()) -> ManifestRecord:
    """Wait up to ``wait`` seconds for the run manifest in the DHT and return its record
    (:func:`choose_manifest` says which records are trusted).

    Raises :class:`ManifestError` if none appears, if several runs exist and ``run_id`` is not
    given, or if several run keys compete for the run."""
    deadline = time.monotonic() + wait
    seen: list[ManifestRecord] = []
    while True:
        seen = fetch_manifests(dht)
        chosen = choose_manifest(seen, run_id=run_id, trusted_key=trusted_key, anchors=anchors)
        if chosen is not None:
            return chosen
        if should_stop():
            raise KeyboardInterrupt
        if time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    if trusted_key is not None and seen:
        raise ManifestError(f"no run manifest signed by the given --run-key ({run_key_id(trusted_key)}) within "
                            f"{wait:.0f}s (found run keys: {', '.join(sorted({run_key_id(r.run_key) for r in seen}))})")
    if run_id is not None and seen:
        raise ManifestError(f"run {run_id!r} is not published in the DHT (found: "
                            f"{', '.join(sorted({r.run_id for r in seen}))})")
    raise ManifestError(f"no run manifest found in the DHT within {wait:.0f}s; start worldlm-bootstrap "
                        "with --run-config, or check --initial-peers")


#: the longest a DHT call may take: hivemind's DHT runs in a child process, and a call to one that
#: died (a SIGTERM to the whole process group, as systemd sends) would otherwise never return
DHT_CALL_TIMEOUT = 30.0


def _wait(future, what: str, dht=None):
    """The result of a hivemind DHT call, or ``TimeoutError`` after :data:`DHT_CALL_TIMEOUT` (at
    once when the DHT's process is gone)."""
    import concurrent.futures

    if not hasattr(future, "result"):  # a DHT stand-in that answers at once
        return future
    if dht is not None and hasattr(dht, "is_alive") and not dht.is_alive():
        future.cancel()
        raise TimeoutError(f"{what}: the DHT process is gone")
    try:
        return future.result(timeout=DHT_CALL_TIMEOUT)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"{what}: the DHT did not answer within {DHT_CALL_TIMEOUT:.0f}s") from None


def _store(dht, validators, key: str, wire: dict[str, Any], *, ttl: float) -> bool:
    """Store ``wire`` under this process's own signed subkey of ``key``, expiring ``ttl`` s from now."""
    return bool(_wait(dht.store(key, wire, expiration_time=get_dht_time() + ttl, subkey=owner_subkey(validators),
                                return_future=True), f"storing {key}", dht))


def _fetch(dht, key: str, parse, what: str, *, with_signer: bool = False) -> list:
    """Every record under ``key`` that ``parse`` accepts; a malformed one is logged and skipped.
    ``with_signer``: each record learns the peer id of the key that signed it (``signed_by``)."""
    out = []
    for subkey, item in _entries(_wait(dht.get(key, latest=True, return_future=True), f"reading {key}", dht)).items():
        try:
            record = parse(item.value)
        except ValueError as e:
            logger.warning("rejected a %s record from %s: %s", what, _short(subkey), e)
            continue
        out.append(record.signed_by(owner_peer_id(subkey)) if with_signer else record)
    return out


def publish_progress(dht, validators, run_id: str, record: ProgressRecord, *, ttl: float) -> bool:
    return _store(dht, validators, progress_key(run_id), record.to_wire(), ttl=ttl)


def fetch_progress(dht, run_id: str) -> list[ProgressRecord]:
    """Live progress records of a run (expired ones are gone; malformed ones are logged and skipped)."""
    return _fetch(dht, progress_key(run_id), ProgressRecord.from_wire, "progress", with_signer=True)


def publish_lease(dht, validators, run_id: str, record: LeaseRecord, *, ttl: float) -> bool:
    """Store this peer's lease record under its own subkey; the DHT drops it ``ttl`` seconds from now.

    hivemind replaces a subkey's value only by one that expires later, so every publication
    (a withdrawal too, whose ``record.expires`` is now) must use the same ``ttl`` or a longer one.
    """
    return _store(dht, validators, leaders_key(run_id), record.to_wire(), ttl=ttl)


def fetch_leases(dht, run_id: str) -> list[LeaseRecord]:
    """Lease records of a run still held by the DHT (their ``expires`` may have passed: the election
    checks it; malformed records are logged and skipped)."""
    return _fetch(dht, leaders_key(run_id), LeaseRecord.from_wire, "lease", with_signer=True)


def publish_residual(dht, validators, run_id: str, record: ResidualRecord, *, ttl: float) -> bool:
    return _store(dht, validators, residuals_key(run_id), record.to_wire(), ttl=ttl)


def fetch_residuals(dht, run_id: str) -> list[ResidualRecord]:
    """Live residual-embedding records of a run (malformed ones are logged and skipped)."""
    return _fetch(dht, residuals_key(run_id), ResidualRecord.from_wire, "residual")


def publish_relay(dht, validators, run_id: str, record: RelayRecord, *, ttl: float) -> bool:
    return _store(dht, validators, relays_key(run_id), record.to_wire(), ttl=ttl)


def fetch_relays(dht, run_id: str) -> list[RelayRecord]:
    """Live relay records of a run (malformed ones are logged and skipped; endorsements are not
    checked here: :func:`worldlm_p2p.net.admission.relay_why_not`)."""
    return _fetch(dht, relays_key(run_id), RelayRecord.from_wire, "relay", with_signer=True)


def _short(subkey) -> str:
    text = subkey.decode(errors="replace") if isinstance(subkey, bytes) else str(subkey)
    return text[-16:]
