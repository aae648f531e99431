"""This peer's progress record, published to the DHT every few seconds and at every round (what the
monitor shows and what the region's barrier reads)."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from typing import Callable

from worldlm_p2p.config import PeerConfig, RunManifest
from worldlm_p2p.net import records
from worldlm_p2p.net.admission import RegionAdmission

from worldlm_p2p.peer.state import RegionState
from worldlm_p2p.peer.stats import PeerStats

logger = logging.getLogger(__name__)

MANIFEST_REPUBLISH_EVERY = records.PEER_MANIFEST_TTL / 3
DHT_WAIT = 10.0  # seconds the main thread waits for the DHT lock before it skips a publication
DHT_WAIT_STOPPING = 2.0  # ... once the peer is stopping


REDIAL_EVERY = 15.0  # seconds between re-dials of the bootstrap nodes a peer is no longer connected to
WIRE_EVERY = 10.0  # seconds between readings of the bytes on the wire (and at the summary)
RELAYS_EVERY = 2.0  # seconds an outbound-only peer keeps the relays it read before it reads them again
RELAYS_EVERY_NONE = 0.5  # ... when it knew of none (a relay offers itself once it sees the region need one)

class Progress:
    def __init__(self, *, dht, validators, dht_lock: threading.Lock, config: PeerConfig, manifest: RunManifest,
                 peer_id: str, label: str, stats: PeerStats, state: RegionState, epsilon: Callable[[], float],
                 is_leader: Callable[[], bool], finished: threading.Event, admission: RegionAdmission,
                 certificate: dict | None, manifest_record=None, reachability: str = "", wire=None) -> None:
        self.dht, self.validators, self.dht_lock = dht, validators, dht_lock
        self.config, self.manifest, self.peer_id, self.label = config, manifest, peer_id, label
        self.stats, self.state, self.epsilon, self.is_leader, self.finished = stats, state, epsilon, is_leader, finished
        self.admission, self.certificate = admission, certificate
        self.reachability = reachability  # what this peer tells the swarm of how it is reached (joining.Network)
        self.wire = wire  # a net.wire.WireMeter: the bytes this peer's processes really sent and received
        self.manifest_record = manifest_record  # kept alive in the DHT by this peer too (signed by the run key)
        self._manifest_published = time.monotonic()  # joining.connect stored the first copy
        self.train_started: float | None = None
        self._thread: threading.Thread | None = None
        self._refused: set[str] = set()  # peers whose records were ignored (logged once each)
        self.banned: set[str] = set()  # members caught repeatedly by the robust rule: never waited for again
        self._last_read = -math.inf  # (monotonic) when _last_records were read
        self._last_records: list[records.ProgressRecord] = []
        # the peers this one may average with, from the last records read (None: an open group)
        self.admitted: set[str] | None = set() if self._closed_group(everyone=False) else None
        self._relays: list[str] = []  # endorsed relays serving this peer's group (relays())
        self._relays_read = -math.inf
        self._relays_refused: set[str] = set()

    def record(self) -> records.ProgressRecord:
        s, border = self.stats, self.state.border
        elapsed = time.monotonic() - self.train_started if self.train_started else 0.0
        return records.ProgressRecord(
            region=self.config.region, peer_id=self.peer_id, label=self.label[:256], step=s.step, tokens=s.tokens,
            train_loss=s.last_train_loss if math.isfinite(s.last_train_loss) else 0.0,
            tokens_per_s=(s.tokens - s.initial_tokens) / elapsed if elapsed > 0 else 0.0,
            rounds_completed=s.rounds_completed, last_group_size=s.group_sizes[-1] if s.group_sizes else 0,
            bytes_sent=s.bytes_sent, bytes_received=s.bytes_received, round=s.round,
            waiting_for_round=s.waiting_for_round, fingerprint=self.manifest.fingerprint(), time=time.time(),
            finished=self.finished.is_set(), world_round=s.world_round, leader=self.is_leader(),
            loss_trend=tuple(h["loss"] for h in s.history[-records.MAX_LOSS_TREND:]), epsilon=self.epsilon(),
            border_epsilon=border.epsilon() if border is not None else -1.0,
            border_releases=border.releases if border is not None else -1,
            mix_region=s.recent_mix("region"), mix_world=s.recent_mix("world"), certificate=self.certificate,
            state_round=s.state_round, state_digest=s.state_digest, reachability=self.reachability,
            rounds_partial=s.rounds_partial, wire_sent=s.wire_sent, wire_received=s.wire_received,
            round_tokens=max(0, s.tokens - s.round_entry_tokens))

    @contextlib.contextmanager
    def _dht(self, timeout: float):
        """The DHT lock, waited for at most ``timeout`` seconds (``TimeoutError`` then): a world
        round's DHT call in another thread can take many seconds, and a stopping peer, or its
        barrier, must not wait on it without bound."""
        if not self.dht_lock.acquire(timeout=timeout):
            raise TimeoutError(f"the DHT was busy for {timeout:.0f}s")
        try:
            yield
        finally:
            self.dht_lock.release()

    def publish(self) -> None:
        try:
            with self._dht(DHT_WAIT_STOPPING if self.finished.is_set() else DHT_WAIT):
                records.publish_progress(self.dht, self.validators, self.manifest.run_id, self.record(),
                                         ttl=self.config.progress_ttl)
        except Exception as e:  # the DHT may be shutting down
            logger.debug("could not publish progress: %s", e)
        self._keep_manifest_alive()

    def _keep_manifest_alive(self) -> None:
        """Every peer stores the run key's signed manifest under its own subkey too, so that the run
        outlives its bootstrap nodes (nobody can alter the record: the run key signed it)."""
        if self.manifest_record is None or time.monotonic() - self._manifest_published < MANIFEST_REPUBLISH_EVERY:
            return
        self._manifest_published = time.monotonic()
        try:
            with self._dht(DHT_WAIT_STOPPING if self.finished.is_set() else DHT_WAIT):
                records.publish_manifest(self.dht, self.validators, self.manifest_record, ttl=records.PEER_MANIFEST_TTL)
        except Exception as e:
            logger.debug("could not re-publish the run manifest: %s", e)

    def _closed_group(self, *, everyone: bool) -> bool:
        return self.admission.requires(self.config.region) or (everyone and any(
            self.admission.requires(r) for r, _ in self.manifest.admission.regions))

    def region_records(self, *, everyone: bool, max_age: float = 0.0, wait: float = DHT_WAIT
                       ) -> list[records.ProgressRecord]:
        """The records of the other members of this peer's group (``everyone``: of the whole run)
        that are admitted to the region they claim; the others are ignored (logged once per peer),
        and :attr:`admitted` becomes the peers this one may average with. While the DHT is busy
        (another thread's call, waited for at most ``wait`` seconds), or when the last read is less
        than ``max_age`` seconds old, the records of the last read."""
        recs = self._last_records
        if time.monotonic() - self._last_read >= max_age:
            try:
                with self._dht(wait):
                    recs = records.fetch_progress(self.dht, self.manifest.run_id)
                self._last_records, self._last_read = recs, time.monotonic()
            except TimeoutError:
                pass
        mine = [r for r in recs if (everyone or r.region == self.config.region) and r.peer_id != self.peer_id
                and r.peer_id not in self.banned and r.fingerprint == self.manifest.fingerprint()]
        out = []
        for r in mine:
            why = self.admission.why_not(r)
            if why is None:
                out.append(r)
            elif r.peer_id not in self._refused:
                self._refused.add(r.peer_id)
                logger.warning("ignoring peer %s (%r) of region %s: not admitted (%s)", r.peer_id, r.label[:40],
                               r.region, why)
        if self._closed_group(everyone=everyone):
            self.admitted = {r.peer_id for r in out}
        return out

    def relays(self, group: str, *, wait: float = DHT_WAIT) -> list[str]:
        """The peer ids of the relays that reduce ``group``'s rounds now (its averager group: the
        region, or the whole run), endorsed by the run key (:mod:`worldlm_p2p.peer.relay`); read at
        most every :data:`RELAYS_EVERY` seconds (:data:`RELAYS_EVERY_NONE` while it knows of none). An
        admitting group's :attr:`admitted` gains them."""
        if time.monotonic() - self._relays_read >= (RELAYS_EVERY if self._relays else RELAYS_EVERY_NONE):
            from worldlm_p2p.net.admission import load_public_key, relay_why_not

            found = self._relays
            try:
                with self._dht(wait):
                    recs = records.fetch_relays(self.dht, self.manifest.run_id)
                run_key = load_public_key(self.manifest_record.run_key, what="run key") \
                    if self.manifest_record is not None else None
                found = []
                for r in recs:
                    why = "the run key is unknown" if run_key is None else relay_why_not(
                        r, run_key=run_key, run_id=self.manifest.run_id, fingerprint=self.manifest.fingerprint())
                    if why is None:
                        if group in r.regions:
                            found.append(r.peer_id)
                    elif r.peer_id not in self._relays_refused:
                        self._relays_refused.add(r.peer_id)
                        logger.warning("ignoring relay %s: %s", r.peer_id, why)
                self._relays_read = time.monotonic()
            except TimeoutError:
                pass
            except Exception as e:
                logger.debug("could not read the relays: %s", e)
            self._relays = sorted(found)
        if self.admitted is not None and self._relays:
            self.admitted |= set(self._relays)
        return list(self._relays)

    def run_admitted(self) -> dict[str, str] | None:
        """The peers of the whole run admitted to the regions they claim (a peer of an open region
        always is), peer id -> region, for world rounds between leaders; None when no region of the
        run admits."""
        if not self.manifest.admission.regions:
            return None
        with self.dht_lock:
            recs = records.fetch_progress(self.dht, self.manifest.run_id)
        out = {r.peer_id: r.region for r in recs if r.fingerprint == self.manifest.fingerprint()
               and self.admission.why_not(r) is None}
        out[self.peer_id] = self.config.region
        return out

    def start(self) -> None:
        """Publish now and then every ``progress_interval`` seconds until ``finished`` is set; and
        re-dial the bootstrap nodes every ``REDIAL_EVERY`` seconds (their own thread)."""
        self.publish()
        self._thread = threading.Thread(target=self._loop, name="progress", daemon=True)
        self._thread.start()
        threading.Thread(target=self._redial_loop, name="redial", daemon=True).start()

    def _redial_loop(self) -> None:
        """A bootstrap node that restarted (or was away) knows nobody until someone dials it: every
        peer re-dials the ``--initial-peers`` it is no longer connected to, so that the node, the
        monitor and newcomers through it see the running swarm again."""
        from worldlm_p2p.net.dht import redial

        while not self.finished.wait(REDIAL_EVERY):
            back = redial(self.dht, self.config.net.initial_peers)
            if back:
                logger.info("reconnected to bootstrap node(s) %s", ", ".join(back))

    def measure_wire(self) -> None:
        """Read the kernel's TCP counters of this peer's processes into its stats (no-op without a meter)."""
        if self.wire is None:
            return
        try:
            measured = self.wire.sample()
        except Exception as e:  # never fail the peer for a measurement
            logger.debug("could not measure the bytes on the wire: %s", e)
            measured = None
        if measured is not None:
            self.stats.wire_sent, self.stats.wire_received = measured

    def _loop(self) -> None:
        measured = -math.inf
        while not self.finished.wait(self.config.progress_interval):
            # the kernel's counters are read every WIRE_EVERY seconds only: `ss -p` walks every
            # process's sockets, a cost that grows with the peers on a machine (measured:
            # benchmarks/perf.py --idle)
            if time.monotonic() - measured >= WIRE_EVERY:
                measured = time.monotonic()
                self.measure_wire()
            self.publish()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout=timeout)
