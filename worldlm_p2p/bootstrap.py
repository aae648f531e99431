"""A bootstrap node: a DHT-only process that institutions host.

It gives peers a stable address to join (with ``--identity``, the peer id survives restarts), stores
DHT records with the run's validators, and publishes the run manifest, renewing it before it
expires. It holds no model.

It remembers the peers it is connected to (``peers_path``, rewritten every ``remember_every``
seconds): restarted, it dials those that still answer, so that it rejoins the swarm it served
instead of starting a second, empty one that newcomers would join alone (running peers do not dial
a bootstrap node again once they have joined).

With ``relay``, it also reduces the rounds of regions whose live members are all outbound-only
(peers behind NAT that nobody can dial): :mod:`worldlm_p2p.peer.relay`, endorsed by the run key.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
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
    peers_path: str | None = None  # where the node remembers the peers it knew (None: it does not)
    remember_every: float = 30.0  # seconds between two rewrites of peers_path
    relay: bool = False  # reduce the rounds of regions of outbound-only members (needs the manifest)

    def __post_init__(self) -> None:
        from worldlm_p2p.errors import ConfigError

        if self.relay and self.manifest is None:
            raise ConfigError("relay: a relay needs the run manifest it serves (--run-config)")
        if not (math.isfinite(self.manifest_ttl) and 1 < self.manifest_ttl <= 86400):
            raise ConfigError(f"manifest_ttl: must be a finite number of seconds in (1, 86400], got {self.manifest_ttl}")
        if not (math.isfinite(self.remember_every) and self.remember_every > 0):
            raise ConfigError(f"remember_every: must be a finite number of seconds > 0, got {self.remember_every}")
        if self.peers_path is not None:
            path = Path(self.peers_path)
            if path.is_dir() or not path.parent.is_dir():
                raise ConfigError(f"cannot remember peers in {path}: " + (
                    "it is a directory" if path.is_dir() else f"directory {path.parent} does not exist"))


MAX_REMEMBERED = 64  # peers a bootstrap node remembers (and dials when restarted)


def read_remembered(path: str | Path) -> list[str]:
    """The multiaddrs (with /p2p/) a bootstrap node remembered at ``path``; [] if it has none, or
    the file is unreadable or malformed (logged: it is only a hint)."""
    from worldlm_p2p.errors import AddressError
    from worldlm_p2p.net.dht import parse_maddrs

    try:
        raw = Path(path).read_text()
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as e:
        logger.warning("ignoring the peers remembered in %s: %s", path, e)
        return []
    try:
        found = json.loads(raw).get("peers", [])
        if not isinstance(found, list):
            raise ValueError("'peers' is not a list")
    except (ValueError, AttributeError) as e:
        logger.warning("ignoring the peers remembered in %s: not a peers file (%s)", path, e)
        return []
    out = []
    for m in found[:MAX_REMEMBERED]:
        try:
            out.extend(parse_maddrs([str(m)], what=str(path), require_peer_id=True))
        except AddressError as e:
            logger.debug("skipping a remembered address: %s", e)
    return out


def write_remembered(path: str | Path, maddrs: list[str]) -> None:
    """Atomically replace the peers file at ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(dict(peers=list(maddrs)[:MAX_REMEMBERED], time=time.time()), indent=1))
    os.replace(tmp, path)


def _tcp_port_open(maddr: str, timeout: float = 1.0) -> bool:
    parts = maddr.split("/")
    try:
        host, port = parts[2], int(parts[parts.index("tcp") + 1])
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except (ValueError, IndexError, OSError):
        return False


def answering(maddrs: list[str], *, timeout: float = 1.0) -> list[str]:
    """Those of ``maddrs`` whose TCP port accepts a connection within ``timeout`` (checked in
    parallel): the remembered peers worth giving to the DHT, whose start would otherwise wait for
    each dead one."""
    tcp = [m for m in maddrs if m.split("/")[1:2] in (["ip4"], ["ip6"]) and "/tcp/" in m]
    if not tcp:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(tcp))) as pool:
        return [m for m, ok in zip(tcp, pool.map(lambda m: _tcp_port_open(m, timeout), tcp)) if ok]


async def _connected_maddrs(_dht, node) -> list[str]:  # runs in the DHT process
    out = []
    for info in await node.p2p.list_peers():
        for addr in info.addrs:
            text = str(addr)
            if "p2p-circuit" not in text and "/p2p/" not in text:
                out.append(f"{text}/p2p/{info.peer_id}")
    return out


class BootstrapNode:
    def __init__(self, *, config: BootstrapConfig) -> None:
        self.config = config
        self._stop = threading.Event()
        self._dht = None
        self._validators: list = []
        self.rejoining: tuple[int, int] | None = None  # (dialled, remembered) peers at start
        self.relay = None  # a worldlm_p2p.peer.relay.RegionRelay with config.relay

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
            if cfg.peers_path:
                remembered = read_remembered(cfg.peers_path)
                known = answering([m for m in remembered if m not in net.initial_peers])
                self.rejoining = (len(known), len(remembered))
                if known:
                    net = dataclasses.replace(net, initial_peers=tuple(net.initial_peers) + tuple(known))
            self._dht = start_dht(net, record_validators=self._validators, require_initial_peers=False)
        self.run_key = ensure_identity(cfg.run_key_path) if cfg.run_key_path else key
        try:  # peers ask the bootstrap nodes they join through whether they can be dialled back
            from worldlm_p2p.net.reachability import serve_dialback

            self._dht.run_coroutine(serve_dialback)
        except Exception as e:
            logger.warning("could not serve dial-back requests (peers will not learn their reachability): %s", e)
        if cfg.manifest is not None:
            from hivemind.utils.timed_storage import get_dht_time

            # signed once: the record any peer re-publishes is this one, verbatim
            self._record = records.ManifestRecord.sign(self.run_key, cfg.manifest, time=get_dht_time())
            self._publish()
        if cfg.relay:
            from worldlm_p2p.peer.relay import RegionRelay

            # ticked by serve(), in the main thread: hivemind forks an averager from there only
            self.relay = RegionRelay(dht=self._dht, validators=self._validators, manifest=cfg.manifest,
                                     run_key=self.run_key)
            if not self.relay.rule.strategy.averages:
                logger.warning("--relay: strategy %s never averages; nothing to relay", self.relay.rule.strategy.name)
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

    def remember(self, *, timeout: float = 30.0) -> int:
        """Write the peers this node is connected to into ``peers_path``; return how many. Keeps
        the file as it is when no peer is connected (a node alone remembers the last swarm)."""
        if not self.config.peers_path or self._dht is None:
            return 0
        try:
            if not self._dht.is_alive():
                return 0
            found = self._dht.run_coroutine(_connected_maddrs, return_future=True).result(timeout=timeout)
        except Exception as e:
            logger.debug("could not list the connected peers: %s: %s", type(e).__name__, e)
            return 0
        found = sorted(set(found))
        if found:
            try:
                write_remembered(self.config.peers_path, found)
            except OSError as e:
                logger.warning("could not remember the peers in %s: %s", self.config.peers_path, e)
                return 0
        return len(found)

    def serve(self) -> None:
        """Block until :meth:`stop`, renewing the manifest every third of its TTL, remembering
        the connected peers every ``remember_every`` seconds and, with ``relay``, looking for the
        regions' rounds to relay every half second."""
        cfg = self.config
        manifest_period = cfg.manifest_ttl / 3 if cfg.manifest else math.inf
        remember_period = cfg.remember_every if cfg.peers_path else math.inf
        # the first rewrites come sooner (5 s, 10 s, 20 s, ...): peers join in the first minute
        step = min(5.0, remember_period)
        next_manifest, next_remember = time.monotonic() + manifest_period, time.monotonic() + step
        next_relay = time.monotonic() if self.relay is not None else math.inf
        while not self._stop.wait(max(0.05, min(next_manifest, next_remember, next_relay, time.monotonic() + 3600)
                                      - time.monotonic())):
            now = time.monotonic()
            if now >= next_relay:
                self.relay.tick_safely()
                next_relay = time.monotonic() + self.relay.next_poll
            if now >= next_manifest:
                next_manifest = now + manifest_period
                try:
                    self._publish()
                except Exception as e:
                    logger.warning("manifest renewal failed: %s", e)
            if now >= next_remember:
                step = min(2 * step, remember_period)
                next_remember = now + step
                self.remember()

    def stop(self) -> None:
        self._stop.set()

    def shutdown(self) -> None:
        self._stop.set()
        if self.relay is not None:
            self.relay.stop()
            self.relay = None
        if self._dht is not None:
            self.remember(timeout=5.0)
            try:
                self._dht.shutdown()
            finally:
                self._dht = None
