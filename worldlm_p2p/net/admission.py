"""Admission per region: region keys, peer certificates, and the check every member makes.

A region's institutions hold an RSA **region key**; the run manifest names its public half
(``[admission.regions] eu = "ssh-rsa AAAA..."``, :class:`worldlm_p2p.config.AdmissionPolicy`). They
issue each peer they admit a **certificate**: ``(run id, region, peer id, expiry)`` signed with the
region key (``worldlm-admit issue``). The peer id is the libp2p id of the peer's own identity key
(``--identity``), so the claim is tied to what libp2p authenticates on every connection and to the
key that signs the peer's DHT records.

:func:`check` is what a member asks of a certificate; :func:`peer_id_of` derives a libp2p peer id
from a public key (the multihash of its protobuf encoding, as libp2p specifies), so that a record's
signer can be matched with the peer id its certificate names. Regions without a key in the
manifest are open (anyone may train in them), as before.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worldlm_p2p.errors import ConfigError

from worldlm_p2p.net.schemas import MAX_CERTIFICATE_BYTES


def public_key_text(private_key) -> str:
    """The public half of a hivemind ``RSAPrivateKey`` as one OpenSSH line (``ssh-rsa AAAA...``),
    the form the run manifest names region keys in."""
    return private_key.get_public_key().to_bytes().decode()


def load_public_key(text: str, *, what: str):
    """A hivemind ``RSAPublicKey`` from its OpenSSH line; ConfigError naming ``what`` otherwise."""
    from hivemind.utils.crypto import RSAPublicKey

    try:
        return RSAPublicKey.from_bytes(text.strip().encode())
    except Exception:
        raise ConfigError(f"{what}: not an RSA public key in OpenSSH form (ssh-rsa AAAA...)") from None


def run_key_text(value: str, *, what: str = "--run-key") -> str:
    """The OpenSSH line of a run key given as the line itself or as a file holding it, checked."""
    text = value.strip()
    if not text.startswith("ssh-"):
        try:
            text = Path(value).expanduser().read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{what} {value!r} is neither an OpenSSH public key line nor a readable file "
                              f"({getattr(e, 'strerror', None) or type(e).__name__})") from None
    load_public_key(text, what=what)
    return text


def peer_id_of(public_key) -> str:
    """The libp2p peer id (base58) of a hivemind ``RSAPublicKey``: the sha2-256 multihash of the
    protobuf ``PublicKey{RSA, DER SubjectPublicKeyInfo}``."""
    import base58
    import multihash
    from hivemind.proto import crypto_pb2

    from worldlm_p2p.net.hivemind_compat import rsa_public_der

    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=rsa_public_der(public_key)).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return base58.b58encode(digest).decode()


@dataclass(frozen=True, kw_only=True, slots=True)
class Certificate:
    """A region's admission of one peer until ``expires`` (seconds since the epoch)."""

    run_id: str
    region: str
    peer_id: str
    expires: float
    signature: str = ""  # base64, over :meth:`body`

    def body(self) -> bytes:
        """The signed bytes: a canonical JSON of every field but the signature."""
        return json.dumps(dict(kind="worldlm-certificate/1", run_id=self.run_id, region=self.region,
                               peer_id=self.peer_id, expires=float(self.expires)), sort_keys=True).encode()

    def to_wire(self) -> dict[str, Any]:
        return dict(run_id=self.run_id, region=self.region, peer_id=self.peer_id, expires=float(self.expires),
                    signature=self.signature)

    @classmethod
    def from_wire(cls, value: Any) -> "Certificate":
        """ValueError for anything that is not a certificate's shape."""
        if not isinstance(value, dict):
            raise ValueError("a certificate is a mapping")
        try:
            cert = cls(run_id=value["run_id"], region=value["region"], peer_id=value["peer_id"],
                       expires=value["expires"], signature=value["signature"])
        except KeyError as e:
            raise ValueError(f"a certificate lacks {e.args[0]}") from None
        if not (all(isinstance(x, str) and 0 < len(x) <= 512 for x in (cert.run_id, cert.region, cert.peer_id))
                and isinstance(cert.signature, str) and len(cert.signature) <= MAX_CERTIFICATE_BYTES
                and isinstance(cert.expires, (int, float)) and not isinstance(cert.expires, bool)):
            raise ValueError("a certificate has fields of the wrong type or size")
        return cert

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_wire(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Certificate":
        """ConfigError (one line) for a missing or malformed file."""
        try:
            return cls.from_wire(json.loads(Path(path).read_text()))
        except OSError as e:
            raise ConfigError(f"certificate {path}: {e.strerror or e}") from None
        except ValueError as e:
            raise ConfigError(f"certificate {path} is not a worldlm certificate ({e})") from None


def issue(region_key, *, run_id: str, region: str, peer_id: str, expires: float) -> Certificate:
    """A certificate signed with ``region_key`` (a hivemind ``RSAPrivateKey``)."""
    unsigned = Certificate(run_id=run_id, region=region, peer_id=peer_id, expires=float(expires))
    return Certificate(run_id=run_id, region=region, peer_id=peer_id, expires=float(expires),
                       signature=region_key.sign(unsigned.body()).decode())


def check(cert: Certificate | None, *, region_key, run_id: str, region: str, peer_id: str,
          now: float | None = None) -> str | None:
    """Why ``cert`` does not admit ``peer_id`` to ``region`` of run ``run_id`` (None: it does).
    ``region_key``: the region's public key (a hivemind ``RSAPublicKey``)."""
    if cert is None:
        return "no certificate"
    if cert.run_id != run_id:
        return f"the certificate is for run {cert.run_id!r}"
    if cert.region != region:
        return f"the certificate is for region {cert.region!r}"
    if cert.peer_id != peer_id:
        return f"the certificate is for peer {cert.peer_id[-8:]}"
    if cert.expires <= (time.time() if now is None else now):
        return "the certificate has expired"
    try:
        base64.b64decode(cert.signature, validate=True)
    except ValueError:
        return "the certificate's signature is not base64"
    if not region_key.verify(cert.body(), cert.signature.encode()):
        return "the certificate is not signed by the region's key"
    return None


#: the "region" of a relay's endorsement: the run key's certificate that a peer may reduce the rounds
#: of regions whose members are all outbound-only (:mod:`worldlm_p2p.peer.relay`)
RELAY_ENDORSEMENT = "*relay*"


def relay_why_not(record, *, run_key, run_id: str, fingerprint: str, now: float | None = None) -> str | None:
    """Why the relay behind a :class:`~worldlm_p2p.net.records.RelayRecord` may not reduce this
    run's rounds (None: it may): signed in the DHT by the key of the peer id it claims, of this
    manifest, and endorsed by the run key (``run_key``: a hivemind ``RSAPublicKey``)."""
    if record.signer is None or record.signer != record.peer_id:
        return "its record is not signed by the key of the peer id it claims"
    if record.fingerprint != fingerprint:
        return f"it relays manifest {record.fingerprint}, not this run's"
    try:
        cert = Certificate.from_wire(record.endorsement)
    except ValueError as e:
        return f"malformed endorsement ({e})"
    why = check(cert, region_key=run_key, run_id=run_id, region=RELAY_ENDORSEMENT, peer_id=record.peer_id, now=now)
    return None if why is None else why.replace("region's key", "run key").replace("the certificate", "its endorsement")


class RegionAdmission:
    """The run's admission rules, as a member applies them to the others' progress records."""

    def __init__(self, *, run_id: str, regions: tuple[tuple[str, str], ...]) -> None:
        self.run_id = run_id
        self._keys = {r: load_public_key(k, what=f"admission.regions.{r}") for r, k in regions}

    @classmethod
    def of(cls, manifest) -> "RegionAdmission":
        return cls(run_id=manifest.run_id, regions=manifest.admission.regions)

    def requires(self, region: str) -> bool:
        return region in self._keys

    def key(self, region: str):
        return self._keys[region]

    def why_not(self, record) -> str | None:
        """Why the peer behind a progress record is not admitted to the region it claims (None: it
        is). Every record must be signed in the DHT by the key of the peer id it claims (a peer signs
        its records with its libp2p identity key), so that nobody speaks for another peer, in open
        regions too; in an admitting region it must also carry a certificate of the region's key
        for that peer id."""
        if record.signer is None or record.signer != record.peer_id:  # (every peer signs with its p2p key)
            return "its record is not signed by the key of the peer id it claims"
        key = self._keys.get(record.region)
        if key is None:
            return None
        try:
            cert = Certificate.from_wire(record.certificate) if record.certificate is not None else None
        except ValueError as e:
            return f"malformed certificate ({e})"
        return check(cert, region_key=key, run_id=self.run_id, region=record.region, peer_id=record.peer_id)
