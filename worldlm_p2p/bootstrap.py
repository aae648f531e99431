"""A bootstrap node: a DHT-only process that institutions host.

It gives peers a stable address to join (with ``--identity``, the peer id survives restarts), stores
DHT records with the run's validators, and publishes the run manifest, renewing it before it
expires. It holds no model.
"""

from __future__ import annotations

import math

import logging
import threading
from dataclasses import dataclass

from worldlm_p2p.config import NetConfig, RunManifest
from worldlm_p2p.net import records
from worldlm_p2p.net.dht import ensure_identity, start_dht, visible_maddrs

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class BootstrapConfig:
    net: NetConfig
    manifest: RunManifest | None = None
    manifest_ttl: float = 120.0  # seconds a published manifest lives without renewal

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
        if cfg.net.identity_path:
            key = ensure_identity(cfg.net.identity_path)
        else:
            from hivemind.utils.crypto import RSAPrivateKey

            key = RSAPrivateKey()
        run_id = cfg.manifest.run_id if cfg.manifest else None
        self._validators = records.make_validators(run_id, key)
        self._dht = start_dht(cfg.net, record_validators=self._validators, require_initial_peers=False)
        if cfg.manifest is not None:
            self._publish()
        return visible_maddrs(self._dht)

    @property
    def peer_id(self) -> str:
        return str(self._dht.peer_id)

    def _publish(self) -> None:
        ok = records.publish_manifest(self._dht, self._validators, self.config.manifest, ttl=self.config.manifest_ttl)
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
