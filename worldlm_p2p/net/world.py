"""World rounds among region leaders (``shared/design/worldlm.md`` section 3.3).

A region's leader (:mod:`worldlm_p2p.net.leader`) runs a world round every ``world_every`` region
rounds, on a snapshot of its region's agreed model:

1. **backbone**: the leaders all-reduce their region models with hivemind (prefix
   ``<run>__leaders``), weighted by the tokens their region trained since the last world round.
   The result's backbone is the world's B (and, for ``hierfavg``, the whole model); its key layers
   are ``K_world``, the reference of the residuals.
2. **residual embeddings** (``worldlm``): each leader computes its residual ``r_R = K_R - K_world``,
   publishes a compact sketch of it in the DHT (:class:`~worldlm_p2p.net.records.ResidualRecord`)
   and serves the full residual over hivemind's P2P (the averager's state-download RPC, asked of
   one chosen peer). It reads the other leaders' sketches of the same world round, scores them
   (:func:`worldlm_p2p.rounds.residual_fetch_list`) and downloads only the residuals whose weight
   matters, then applies :func:`worldlm_p2p.rounds.residual_update`. With world attention
   (``aggregation.world_target = "attention"``) the residual, its sketch and what is fetched are
   those of the whole model, and the region keeps its own backbone, moved towards the regions
   nearest to it (:func:`worldlm_p2p.residual.region_attention`).

The math is :mod:`worldlm_p2p.rounds`; this module only moves tensors and records. A failure at any
step (no other leader, a timeout, a malformed record) leaves the region's model as it was: the
region simply misses that world round.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from hivemind.utils.timed_storage import get_dht_time

from worldlm_p2p import compression, rounds
from worldlm_p2p.aggregation import allreduce_traffic
from worldlm_p2p.config import AveragingConfig
from worldlm_p2p.net import records
from worldlm_p2p.net.averaging import RegionAverager
from worldlm_p2p.net.keys import LEADERS_GROUP
from worldlm_p2p.net.robust_allreduce import RobustSettings

logger = logging.getLogger(__name__)



@dataclass(frozen=True, slots=True)
class WorldOutcome:
    ok: bool
    world_round: int
    model: list[torch.Tensor] | None = None  # the region's next agreed model
    world: list[torch.Tensor] | None = None  # the leaders' mean (the reference of border deltas)
    regions: tuple[str, ...] = ()  # regions whose leaders took part
    fetched: tuple[str, ...] = ()  # regions whose full residual was downloaded
    weights: dict = field(default_factory=dict)  # region -> per-layer cross-region attention
    error: str = ""
    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0


class WorldExchange:
    """A leader's side of world rounds. Create when a peer first leads; :meth:`shutdown` at exit."""

    def __init__(self, *, dht, validators, dht_lock: threading.Lock, run_id: str, region: str, peer_id: str,
                 fingerprint: str, rule: rounds.RoundRule, averaging: AveragingConfig,
                 template: Sequence[torch.Tensor], record_ttl: float = 60.0) -> None:
        self.dht, self.validators, self.lock = dht, validators, dht_lock
        self.run_id, self.region, self.peer_id, self.fingerprint = run_id, region, peer_id, fingerprint
        self.rule, self.averaging, self.record_ttl = rule, averaging, record_ttl
        # the leaders' all-reduce applies the run's robust rule too; a leader's weight (its region's
        # tokens since the last world round) has no cap a leader could check
        payload = rounds.world_payload(rule, template)
        codecs = rounds.world_codecs(rule, payload)  # (None: float32)
        self.averager = RegionAverager(tensors=payload, dht=dht, run_id=run_id,
                                       region=LEADERS_GROUP, averaging=averaging, fingerprint=fingerprint,
                                       robust=RobustSettings(rule=rule.config.robust, clip=rule.config.robust_clip),
                                       codecs=codecs)
        self._payload_bytes = sum(compression.nominal_bytes(t.numel(), c)
                                  for t, c in zip(payload, codecs or ["none"] * len(payload)))

    def shutdown(self) -> None:
        try:
            self.averager.shutdown()
        except Exception as e:  # pragma: no cover - best effort at exit
            logger.debug("world averager shutdown: %s", e)

    # ------------------------------------------------------------------ one world round
    def run(self, *, world_round: int, region_model: Sequence[torch.Tensor], tokens: float,
            expected_leaders: Callable[[], int], patience: float,
            should_stop: Callable[[], bool] = lambda: False,
            sent: Sequence[torch.Tensor] | None = None) -> WorldOutcome:
        """Run one world round. Regions progress at different speeds, so a leader keeps looking for
        the other leaders (one all-reduce attempt after another) for up to ``patience`` seconds; it
        runs in the background, so the wait costs its region nothing. ``sent``: what goes into the
        leaders' all-reduce instead of the region's model (border DP, :func:`rounds.border_release`);
        the region keeps its own key layers and residual either way."""
        t0 = time.monotonic()
        rule = self.rule
        payload = rounds.world_payload(rule, region_model if sent is None else sent)
        while True:
            try:
                self.averager.set_target_group_size(max(2, expected_leaders()))
            except Exception as e:
                logger.debug("could not set the leaders' target group size: %s", e)
            self.averager.should_stop = should_stop
            result = self.averager.run_round(payload, weight=max(float(tokens), 1e-3),
                                             gather=dict(region=self.region, world_round=int(world_round),
                                                         tokens=float(tokens)))
            if result.ok or should_stop() or time.monotonic() - t0 > patience:
                break
            logger.debug("world round %d: no group yet (%s); still waiting for the other leaders", world_round,
                         result.error)
        for peer, why in sorted({**result.report.caught, **result.report.bad_reducers}.items()):
            logger.warning("world round %d: the robust rule caught leader %s: %s", world_round, peer, why)
        if not result.ok:
            return WorldOutcome(ok=False, world_round=world_round, error=result.error,
                                seconds=time.monotonic() - t0)
        if not all(bool(torch.isfinite(t).all()) for t in result.averaged):
            return WorldOutcome(ok=False, world_round=world_round, error="the leaders' average is not finite",
                                seconds=time.monotonic() - t0)
        members = {}
        for pid, meta in result.gathered.items():
            if isinstance(meta, dict) and isinstance(meta.get("region"), str):
                members[meta["region"]] = (pid, int(meta.get("world_round", world_round)))
        if len({pid for pid, _ in members.values()}) != len(result.gathered):
            logger.warning("world round: two leaders of one region took part (a leadership change in flight)")
        w = max([world_round] + [wr for _, wr in members.values()])  # leaders agree on the latest index
        n_sent, received = allreduce_traffic(self._payload_bytes, result.group_size)
        model, k_world = rounds.world_backbone(rule, result.averaged, region_model)
        outcome = dict(world_round=w, regions=tuple(sorted(members)), bytes_sent=n_sent, bytes_received=received,
                       world=[t.to(torch.float32) for t in result.averaged])
        if not rule.residual_exchange or len(members) < 2:
            return WorldOutcome(ok=True, model=model, seconds=time.monotonic() - t0, **outcome)

        res = rounds.region_residual(rule, region_model, k_world)
        # what the other leaders see of this region is computed from what it sent (border DP)
        served = res if sent is None else rounds.region_residual(rule, sent, k_world)
        self.averager.set_shared_state(round_index=w, tensors=served, region=self.region, world_round=w)
        emb = rounds.embed(rule, served)
        record = records.ResidualRecord.from_tensor(emb, region=self.region, peer_id=self.peer_id, world_round=w,
                                                    fingerprint=self.fingerprint, time=get_dht_time())
        with self.lock:
            records.publish_residual(self.dht, self.validators, self.run_id, record, ttl=self.record_ttl)
        n_sent += len(record.embedding)
        embeddings = self._wait_for_embeddings(w, {r: pid for r, (pid, _) in members.items()}, emb, should_stop)
        weights, need = rounds.residual_fetch_list(rule, embeddings, self.region)
        fetched: dict[str, list[torch.Tensor]] = {}
        for g in need:
            got = self._fetch_residual(members[g][0], region=g, world_round=w, like=res)
            if got is not None:
                fetched[g] = got
                received += sum(t.numel() * 4 for t in got)
        model = rounds.residual_update(rule, model, res, fetched, weights)
        logger.info("world round %d: %d regions; residual embeddings of %s; fetched %s", w, len(members),
                    ", ".join(sorted(embeddings)), ", ".join(sorted(fetched)) or "none")
        return WorldOutcome(ok=True, model=model, fetched=tuple(sorted(fetched)),
                            weights={g: [round(float(x), 6) for x in a] for g, a in weights.items()},
                            seconds=time.monotonic() - t0, **{**outcome, "bytes_sent": n_sent,
                                                              "bytes_received": received})

    def _wait_for_embeddings(self, w: int, members: dict[str, str], own: torch.Tensor,
                             should_stop: Callable[[], bool]) -> dict[str, torch.Tensor]:
        """The sketches of this world round from the leaders that took part (bounded wait)."""
        deadline = time.monotonic() + self.averaging.averaging_timeout
        found = {self.region: own}
        while True:
            with self.lock:
                recs = records.fetch_residuals(self.dht, self.run_id)
            for r in recs:
                if (r.world_round == w and r.fingerprint == self.fingerprint and r.region in members
                        and members[r.region] == r.peer_id and tuple(r.tensor().shape) == tuple(own.shape)):
                    found[r.region] = r.tensor()
            if len(found) == len(members) or time.monotonic() > deadline or should_stop():
                break
            time.sleep(0.25)
        missing = sorted(set(members) - set(found))
        if missing:
            logger.warning("world round %d: no residual embedding from %s in time", w, ", ".join(missing))
        return found

    def _fetch_residual(self, peer_id: str, *, region: str, world_round: int,
                        like: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        loaded = self.averager.download_state_from(peer_id, timeout=self.averaging.averaging_timeout)
        if loaded is None:
            logger.warning("world round %d: could not fetch the residual of %s", world_round, region)
            return None
        meta, tensors = loaded
        if (not isinstance(meta, dict) or meta.get("world_round") != world_round or meta.get("region") != region
                or len(tensors) != len(like) or any(t.shape != x.shape for t, x in zip(tensors, like))
                or not all(bool(torch.isfinite(t).all()) for t in tensors)):
            logger.warning("world round %d: rejected the residual served by %s's leader (stale or malformed)",
                           world_round, region)
            return None
        return [t.to(torch.float32) for t in tensors]
