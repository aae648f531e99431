"""The one reader of a run's records: a client-mode DHT node that never stores a record and never
joins an averaging group. The monitor (:class:`worldlm_p2p.net.monitor.SwarmMonitor`), the live
view of ``worldlm-swarm`` and the swarm tests read the run through it."""

from __future__ import annotations

import logging
from typing import Sequence

from worldlm_p2p.config import NetConfig, RunManifest
from worldlm_p2p.errors import ManifestError
from worldlm_p2p.net import records
from worldlm_p2p.net.records import LeaseRecord, ProgressRecord

logger = logging.getLogger(__name__)


class RunReader:
    """Reads the records of run ``run_id`` through ``initial_peers``. Always :meth:`close` it (it
    runs hivemind processes). ``run_id=None``: the run is found from the manifests that bootstrap
    nodes publish (an error if there are several). ``manifest``: whether to fetch the run manifest
    (a known run without one in the DHT is read anyway). Raises NetworkError / ManifestError with
    one-line messages."""

    def __init__(self, *, initial_peers: Sequence[str], run_id: str | None = None, manifest: bool = True,
                 manifest_wait: float = 10.0, run_key: str | None = None) -> None:
        from hivemind.utils.crypto import RSAPrivateKey

        from worldlm_p2p.net.dht import start_dht

        if run_id is None and not manifest:
            raise ValueError("a reader without a run id finds the run from its manifest")
        # the key only satisfies the signature validator's constructor: this node never stores a record
        validators = records.make_validators(run_id if not manifest else None, RSAPrivateKey())
        self.dht = start_dht(NetConfig(initial_peers=tuple(initial_peers)), record_validators=validators,
                             client_mode=True)
        self.manifest: RunManifest | None = None
        self.run_key: str | None = None  # the public run key that signed the manifest (OpenSSH line)
        if manifest:
            try:
                from worldlm_p2p.net.dht import initial_peer_ids

                found = records.fetch_run_manifest(
                    self.dht, run_id=run_id, wait=manifest_wait if run_id is None else min(manifest_wait, 2.0),
                    trusted_key=run_key, anchors=initial_peer_ids(initial_peers))
                self.manifest, self.run_key = found.manifest, found.run_key
            except ManifestError:
                if run_id is None:
                    self.close()
                    raise
                logger.info("run %s has no manifest in the DHT; showing its records without it", run_id)
            except BaseException:
                self.close()
                raise
            self.dht.add_validators(records.make_validators(run_id or self.manifest.run_id, RSAPrivateKey())[2:])
        self.run_id: str = run_id or self.manifest.run_id

    def progress(self) -> list[ProgressRecord]:
        return records.fetch_progress(self.dht, self.run_id)

    def by_label(self) -> dict[str, ProgressRecord]:
        """The progress records by peer label (the last one read wins)."""
        return {r.label: r for r in self.progress()}

    def leases(self) -> list[LeaseRecord]:
        return records.fetch_leases(self.dht, self.run_id)

    def relays(self) -> list[records.RelayRecord]:
        """The run's relays that the run key endorses (none without the manifest: nothing to check
        their endorsements against)."""
        if self.manifest is None or not self.run_key:
            return []
        from worldlm_p2p.net.admission import load_public_key, relay_why_not

        key = load_public_key(self.run_key, what="run key")
        return [r for r in records.fetch_relays(self.dht, self.run_id)
                if relay_why_not(r, run_key=key, run_id=self.run_id, fingerprint=self.manifest.fingerprint()) is None]

    @property
    def peer_id(self) -> str:
        return str(self.dht.peer_id)

    def close(self) -> None:
        if self.dht is not None:
            try:
                self.dht.shutdown()
            except Exception as e:  # shutting down twice, or a dead DHT process
                logger.debug("DHT shutdown: %s", e)
            self.dht = None
