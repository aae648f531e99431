"""What ``worldlm-monitor`` sees: a read-only view of a run, built from the DHT's records.

:class:`SwarmMonitor` is a client-mode DHT node: it reads the run's progress records
(``<run>_progress``) and leader candidacies (``<run>_leaders``), never stores a record and never
joins an averaging group. :func:`build_snapshot` (pure) turns those records into one snapshot, a
plain JSON-able dict; this is the schema ``worldlm-monitor --once --json`` prints::

    {
      "run_id": "demo",
      "time": 1764517000.0,                # wall-clock time of the snapshot (s since the epoch)
      "manifest": {"fingerprint": "...", "strategy": "worldlm", "model": "tiny", "inner_steps": 15}
                  | null,                  # null when the run manifest was not found in the DHT
      "regions": {
        "eu": {
          "leader": "Qm..." | null,       # peer id holding the region's leader lease (null: none)
          "leader_label": "eu-de" | null,
          "region_round": 4,               # region rounds the region has run (max over its peers)
          "world_round": 1,                # last world round adopted in the region (-1: none)
          "peers_online": 2,               # peers whose record is live and not finished
          "tokens": 76800,                 # tokens trained by the region's listed peers
          "tokens_per_s": 812.5,           # sum over its online peers
          "train_loss": 2.41,              # mean over its listed peers
          "loss_trend": [3.1, 2.8, 2.6],   # mean train loss of each span of inner_steps steps
          "epsilon": 3.2 | null,           # largest DP-SGD epsilon spent by a peer (null: DP-SGD off)
          "border_epsilon": 9.1 | null,    # what the region spent at its border (null: border DP off)
          "border_releases": 12 | null,    # the border releases it composes (as the best-informed peer knows)
          "relays": ["…d4e5f6"],           # short ids of the run's relays reducing its rounds now (its members
                                           # are all outbound-only; endorsed by the run key), usually []
          "peers": [                       # sorted by label
            {"peer_id": "...", "short_id": "…a1b2c3", "label": "eu-de", "region": "eu",
             "step": 60, "tokens": 38400, "train_loss": 2.4, "tokens_per_s": 410.2,
             "rounds_completed": 4, "rounds_partial": 0, "round": 4, "world_round": 1, "leader": true,
             "reachability": "direct" | "outbound" | "not-direct" | "unknown" | null,
             "seconds_since_heard": 1.3, "finished": false,
             "status": "training",         # or "round N" (in region round N), or "finished"
             "epsilon": null, "border_epsilon": null, "border_releases": null,
             "mix_region": 0.06 | null,    # evidence mixing: mean weight it took of the region's model
             "mix_world": 0.02 | null,     # and of the world's changes, over its last 8 choices
             "bytes_sent": 123456, "bytes_received": 120000,   # the all-reduce estimate
             "wire_sent": 140000 | null, "wire_received": 135000 | null,  # measured (kernel TCP counters)
             "last_group_size": 2, "loss_trend": [3.1, 2.8, 2.6]}
          ]
        }
      },
      "totals": {"regions": 2, "peers": 4, "peers_online": 4, "tokens": 153600,
                 "tokens_per_s": 1625.0, "bytes_sent": 493824, "wire_sent": 560000 | null}
    }

A peer that dies disappears once its progress record expires (the peer's ``progress_ttl``,
15 s by default); a peer that finished cleanly stays listed as ``finished`` until then.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

from hivemind.utils.timed_storage import get_dht_time

from worldlm_p2p.config import RunManifest
from worldlm_p2p.net.leader import elect
from worldlm_p2p.net.reader import RunReader
from worldlm_p2p.net.keys import ALL_REGIONS
from worldlm_p2p.net.records import LeaseRecord, ProgressRecord, RelayRecord

logger = logging.getLogger(__name__)

__all__ = ["build_snapshot", "short_id", "SwarmMonitor"]


def own_records(found: Sequence) -> list:
    """The records signed in the DHT by the key of the peer id they claim: one signed by another key
    speaks for someone else (a copy of another peer's id and label, with a forged step and loss)."""
    return [r for r in found if r.signer is not None and r.signer == r.peer_id]


def short_id(peer_id: str, n: int = 6) -> str:
    """The last ``n`` characters of a peer id (its first ones are a common multihash prefix)."""
    return peer_id if len(peer_id) <= n else "…" + peer_id[-n:]


def _status(r: ProgressRecord) -> str:
    if r.finished:
        return "finished"
    if r.waiting_for_round >= 0:
        return f"round {r.waiting_for_round}"  # at the region's barrier or in its all-reduce
    return "training"


def _mean_trend(trends: Sequence[Sequence[float]]) -> list[float]:
    """Element-wise mean of trends aligned at their ends (the newest points line up)."""
    length = max((len(t) for t in trends), default=0)
    out = []
    for i in range(length, 0, -1):
        vals = [t[-i] for t in trends if len(t) >= i]
        out.append(sum(vals) / len(vals))
    return out


def build_snapshot(progress: Sequence[ProgressRecord], leases: Sequence[LeaseRecord], *, run_id: str,
                   now: float, dht_now: float, manifest: RunManifest | None = None,
                   relays: Sequence[RelayRecord] = ()) -> dict[str, Any]:
    """One snapshot of the run (the schema in this module's docstring). Pure.

    ``now``: wall-clock time (progress records carry their publisher's ``time.time()``);
    ``dht_now``: DHT time, against which lease expiry is checked. With a ``manifest``, records of
    another manifest (a stale run under the same id) are left out. ``relays``: the run's relay
    records (endorsements already checked); one that names :data:`ALL_REGIONS` serves every region.
    """
    fingerprint = manifest.fingerprint() if manifest is not None else None
    if fingerprint is not None:
        progress = [r for r in progress if r.fingerprint == fingerprint]
    latest: dict[str, ProgressRecord] = {}
    for r in progress:  # one entry per peer: its newest record
        if r.peer_id not in latest or r.time > latest[r.peer_id].time:
            latest[r.peer_id] = r
    regions: dict[str, dict[str, Any]] = {}
    for region in sorted({r.region for r in latest.values()}):
        members = sorted((r for r in latest.values() if r.region == region), key=lambda r: (r.label, r.peer_id))
        lease = elect(leases, region=region, now=dht_now, fingerprint=fingerprint)
        leader = lease.peer_id if lease is not None else None
        peers = []
        for r in members:
            peers.append(dict(
                peer_id=r.peer_id, short_id=short_id(r.peer_id), label=r.label, region=r.region, step=r.step,
                tokens=r.tokens, train_loss=r.train_loss, tokens_per_s=0.0 if r.finished else r.tokens_per_s,
                rounds_completed=r.rounds_completed, rounds_partial=r.rounds_partial, round=r.round,
                world_round=r.world_round, reachability=r.reachability or None, leader=r.peer_id == leader, seconds_since_heard=max(0.0, now - r.time), finished=r.finished,
                status=_status(r), epsilon=r.epsilon if r.epsilon >= 0 else None,
                border_epsilon=r.border_epsilon if r.border_epsilon >= 0 else None,
                border_releases=r.border_releases if r.border_epsilon >= 0 and r.border_releases >= 0 else None,
                mix_region=r.mix_region if r.mix_region >= 0 else None,
                mix_world=r.mix_world if r.mix_world >= 0 else None, bytes_sent=r.bytes_sent,
                wire_sent=r.wire_sent if r.wire_sent >= 0 else None,
                wire_received=r.wire_received if r.wire_received >= 0 else None,
                bytes_received=r.bytes_received, last_group_size=r.last_group_size,
                loss_trend=list(r.loss_trend)))
        online = [p for p in peers if not p["finished"]]
        eps = [p["epsilon"] for p in peers if p["epsilon"] is not None]
        # the region's border account: that of the peer that knows of the most releases
        most = max((p for p in peers if p["border_epsilon"] is not None),
                   key=lambda p: (p["border_releases"] or 0, p["border_epsilon"]), default=None)
        regions[region] = dict(
            leader=leader,
            leader_label=next((p["label"] for p in peers if p["peer_id"] == leader), None),
            region_round=max(r.round for r in members),
            world_round=max(r.world_round for r in members),
            peers_online=len(online),
            tokens=sum(p["tokens"] for p in peers),
            tokens_per_s=sum(p["tokens_per_s"] for p in online),
            train_loss=sum(p["train_loss"] for p in peers) / len(peers),
            loss_trend=_mean_trend([p["loss_trend"] for p in peers if p["loss_trend"]]),
            epsilon=max(eps) if eps else None,
            border_epsilon=most["border_epsilon"] if most is not None else None,
            border_releases=most["border_releases"] if most is not None else None,
            relays=sorted(short_id(x.peer_id) for x in relays if region in x.regions or ALL_REGIONS in x.regions),
            peers=peers,
        )
    totals = dict(
        regions=len(regions),
        peers=sum(len(v["peers"]) for v in regions.values()),
        peers_online=sum(v["peers_online"] for v in regions.values()),
        tokens=sum(v["tokens"] for v in regions.values()),
        tokens_per_s=sum(v["tokens_per_s"] for v in regions.values()),
        bytes_sent=sum(p["bytes_sent"] for v in regions.values() for p in v["peers"]),
        wire_sent=sum(p["wire_sent"] for v in regions.values() for p in v["peers"] if p["wire_sent"] is not None)
        if any(p["wire_sent"] is not None for v in regions.values() for p in v["peers"]) else None,
    )
    about = None
    if manifest is not None:
        about = dict(fingerprint=fingerprint, strategy=manifest.aggregation.strategy, model=manifest.model.preset,
                     inner_steps=manifest.train.inner_steps)
    return dict(run_id=run_id, time=now, manifest=about, regions=regions, totals=totals)


class SwarmMonitor(RunReader):
    """A read-only client of a run's DHT records (:class:`~worldlm_p2p.net.reader.RunReader`) that
    builds snapshots. Always :meth:`close` it (it runs hivemind processes).

    ``run_id=None``: the run is found from the manifests that bootstrap nodes publish (an error
    if there are several). Raises NetworkError / ManifestError with one-line messages.
    """

    def __init__(self, *, initial_peers: Sequence[str], run_id: str | None = None,
                 manifest_wait: float = 10.0) -> None:
        super().__init__(initial_peers=initial_peers, run_id=run_id, manifest=True, manifest_wait=manifest_wait)

    def snapshot(self) -> dict[str, Any]:
        """Read the run's records now and build a snapshot."""
        progress = own_records(self.progress())
        leases = own_records(self.leases()) if progress else []
        relays = self.relays() if any(r.reachability == "outbound" for r in progress) else []
        return build_snapshot(progress, leases, run_id=self.run_id, now=time.time(), dht_now=get_dht_time(),
                              manifest=self.manifest, relays=relays)

    def wait_for_peers(self, timeout: float, *, should_stop=lambda: False, poll: float = 1.0) -> dict[str, Any] | None:
        """The first snapshot that lists at least one peer, or None after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            snap = self.snapshot()
            if snap["totals"]["peers"]:
                return snap
            if should_stop() or time.monotonic() >= deadline:
                return None
            time.sleep(min(poll, max(0.0, deadline - time.monotonic())))
