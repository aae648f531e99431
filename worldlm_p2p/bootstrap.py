"""A bootstrap node: a DHT-only process that institutions host.

It gives peers a stable address to join (with ``--identity``, the peer id survives restarts), stores
DHT records with the run's validators, and publishes the run manifest, renewing it before it
expires. It holds no model.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from worldlm_p2p.config import NetConfig, RunManifest
from worldlm_p2p.net import records
from worldlm_p2p.net.dht import ensure_identity, start_dht, visible_maddrs

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class BootstrapConfig:
    net: NetConfig
    manifest: RunManifest | None = None
    manifest_ttl: float = 120.0  # seconds a published manifest lives without renewal
    run_key_path: str | None = None  # the run key that signs the manifest (default: the node's identity)

    def __post_init__(self) -> None:
        from worldlm_p2p.errors import ConfigError

        if not (math.isfinite(self.manifest_ttl) and 1 < self.manifest_ttl <= 86400):
            raise ConfigError(f"manifest_ttl: must be a finite number of seconds in (1, 86400], got {self.manifest_ttl}")


class BootstrapNode:
    def __init__(self, *, config: BootstrapConfig) -> None:
        self.config = config
        self._stop = threading.Event()
        self._dht = None
        self._validators: list = []

    def start(self) -> list[str]:
        """Start the DHT, publish the manifest; return the multiaddrs peers should use."""
        cfg = self.config
        # one key for the libp2p identity and for the signatures of this node's records (as peers
        # do), so that its manifest record's signer is the peer id in its multiaddrs: the anchor
        # of trust of the peers that join through it. Without --identity: a key made for the process
        # (its file lives only until the p2p daemon has read it)
        net = cfg.net
        with tempfile.TemporaryDirectory(prefix="worldlm-identity-") as tmp:
            if not net.identity_path:
                net = dataclasses.replace(net, identity_path=str(Path(tmp) / "identity.key"))
            key = ensure_identity(net.identity_path, announce=bool(cfg.net.identity_path))
            run_id = cfg.manifest.run_id if cfg.manifest else None
            self._validators = records.make_validators(run_id, key)
            self._dht = start_dht(net, record_validators=self._validators, require_initial_peers=False)
        self.run_key = ensure_identity(cfg.run_key_path) if cfg.run_key_path else key
        if cfg.manifest is not None:
            from hivemind.utils.timed_storage import get_dht_time

            # signed once: the record any peer re-publishes is this one, verbatim
            self._record = records.ManifestRecord.sign(self.run_key, cfg.manifest, time=get_dht_time())
            self._publish()
        return visible_maddrs(self._dht)

    @property
    def run_key_text(self) -> str:
        """The run key's public half (OpenSSH line): what peers give as ``--run-key``."""
        from worldlm_p2p.net.admission import public_key_text

        return public_key_text(self.run_key)

    @property
    def peer_id(self) -> str:
        return str(self._dht.peer_id)

    def _publish(self) -> None:
        ok = records.publish_manifest(self._dht, self._validators, self._record, ttl=self.config.manifest_ttl)
        if ok:
            logger.debug("published run manifest %s", self.config.manifest.fingerprint())
        else:
            logger.warning("could not store the run manifest in the DHT; will retry")

    def serve(self) -> None:
        """Block until :meth:`stop`, renewing the manifest every third of its TTL."""
        period = self.config.manifest_ttl / 3
        while not self._stop.wait(period if self.config.manifest else 3600):
            if self.config.manifest is not None:
                try:
                    self._publish()
                except Exception as e:
                    logger.warning("manifest renewal failed: %s", e)

    def stop(self) -> None:
        self._stop.set()

    def shutdown(self) -> None:
        self._stop.set()
        if self._dht is not None:
            try:
                self._dht.shutdown()
            finally:
                self._dht = None
