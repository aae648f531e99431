"""A relay: the reducer of regions whose members are all outbound-only.

A peer behind a NAT without a port forward runs outbound-only: its region averager is a hivemind
client, which sends its part of a round and receives the average but cannot be dialled, so it never
reduces. A region whose live members are all such peers has nobody to reduce its rounds, and libp2p
circuit relays do not carry a round's megabytes with the p2p daemon hivemind ships
(``benchmarks/relay_probe.py``). A relay does it one layer up: a reachable node (a bootstrap node,
``worldlm-bootstrap --relay``) joins those regions' all-reduce groups as hivemind's *auxiliary*
member, which reduces the whole vector (its members are clients: nothing is assigned to them) and
sends nothing of its own. Every member's part reaches the relay over the connection the member
opened, and the same encoded average goes back to every member: the round is exactly the one the
members would make among themselves (the run's robust rule included), with one more hop.

The relay holds no model and trains nothing. It follows the progress records of the run: for every
region (the whole run for ``fedavg``/``fedper``) with at least two live members, all of them
outbound-only, it publishes a :class:`~worldlm_p2p.net.records.RelayRecord` naming the region, and
joins each round when the members' barrier lets them go (:func:`worldlm_p2p.net.barrier.relay_due`).
Members take a relay only if the run key endorses it (:func:`worldlm_p2p.net.admission.relay_why_not`):
a relay sees, and could alter, every member's contribution, as any reducer of a span does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from typing import Any

from worldlm_p2p import rounds
from worldlm_p2p.aggregation import max_round_weight
from worldlm_p2p.config import RunManifest
from worldlm_p2p.net import records
from worldlm_p2p.net.admission import RELAY_ENDORSEMENT, RegionAdmission, issue
from worldlm_p2p.net.averaging import RegionAverager
from worldlm_p2p.net.barrier import relay_due
from worldlm_p2p.net.keys import ALL_REGIONS
from worldlm_p2p.net.robust_allreduce import RobustSettings

logger = logging.getLogger(__name__)

#: how long a relay's endorsement lasts; it issues itself a new one long before (it holds the run key)
ENDORSEMENT_SECONDS = 24 * 3600.0


def payload_template(manifest: RunManifest) -> tuple[Any, list, list[str] | None]:
    """``(rule, region payload of zeros, its wire codecs)`` of the run: the tensors' shapes and
    codecs every member's averager holds (the run's model, built from its config on the CPU)."""
    import torch

    from worldlm_p2p.split import split_parameters
    from worldlm_p2p.train import build_model, load_tokenizer

    m = manifest
    tokenizer = load_tokenizer(m.tokenizer)
    model = build_model(m.model, vocab_size=tokenizer.vocab_size, seed=m.train.seed)
    split = split_parameters([n for n, _ in model.named_parameters()], m.aggregation.key_layers)
    rule = rounds.RoundRule.from_config(m.aggregation, split, seed=m.train.seed)
    params = [p.detach().to("cpu", torch.float32).clone() for p in model.parameters()]
    if not rule.strategy.averages:
        return rule, [], None
    template = [torch.zeros_like(t) for t in rounds.region_payload(rule, params, params)]
    return rule, template, rounds.payload_codecs(rule, template)


def robust_settings(manifest: RunManifest) -> RobustSettings:
    """The rule every reducer of the run's region rounds applies (members and relays alike)."""
    m = manifest
    return RobustSettings(rule=m.aggregation.robust, clip=m.aggregation.robust_clip,
                          max_weight=max_round_weight(inner_steps=m.train.inner_steps, batch_size=m.train.batch_size,
                                                      seq_len=m.train.seq_len))


class RegionRelay:
    """Reduce the rounds of every region of ``manifest`` whose live members are all outbound-only.
    ``run_key``: the run's private key (hivemind ``RSAPrivateKey``), which endorses this node."""

    def __init__(self, *, dht, validators: list, manifest: RunManifest, run_key, poll: float = 0.5,
                 publish_every: float = 5.0, ttl: float = 15.0) -> None:
        self.dht, self.validators, self.manifest = dht, validators, manifest
        self.poll, self.publish_every, self.ttl = poll, publish_every, ttl
        self.peer_id = str(dht.peer_id)
        m = manifest
        self._run_key = run_key
        self.endorsement = self._endorse()
        self.rule, self._template, self._codecs = payload_template(m)
        self.admission = RegionAdmission.of(m)
        self._averagers: dict[str, RegionAverager] = {}
        self._busy: dict[str, threading.Thread] = {}
        self._unstartable: set[str] = set()
        self._done: dict[str, int] = defaultdict(lambda: -1)
        self._first_waiting: dict[str, dict[int, float]] = defaultdict(dict)
        self.served: tuple[str, ...] = ()
        self.rounds = defaultdict(int)  # group -> rounds it reduced
        self.failed = defaultdict(int)
        self._published = 0.0
        self._stop = threading.Event()

    # ------------------------------------------------------------------ what needs a relay
    def groups(self, recs: list[records.ProgressRecord]) -> dict[str, list[records.ProgressRecord]]:
        """The live, admitted members of this run by averaging group (region; the whole run for
        strategies whose rounds span it)."""
        m, out = self.manifest, defaultdict(list)
        for r in recs:
            if r.finished or r.fingerprint != m.fingerprint() or self.admission.why_not(r) is not None:
                continue
            out[ALL_REGIONS if self.rule.world_group else r.region].append(r)
        return dict(out)

    @staticmethod
    def needs_relay(members: list[records.ProgressRecord]) -> bool:
        live = [r for r in members if not r.finished]
        return len(live) >= 2 and all(r.reachability == "outbound" for r in live)

    # ------------------------------------------------------------------ loop
    def stop(self) -> None:
        """Let the rounds in flight end (a few seconds at most) and shut the averagers down."""
        self._stop.set()
        for t in list(self._busy.values()):
            t.join(timeout=RegionAverager.STOP_GRACE + 1.0)
        for a in self._averagers.values():
            try:
                a.shutdown()
            except Exception as e:
                logger.debug("relay averager shutdown: %s", e)
        self._averagers.clear()

    @property
    def next_poll(self) -> float:
        """Seconds until the next look (``poll``: a region's members, once all outbound-only, should
        not go on alone for long before the relay offers itself)."""
        return self.poll

    def tick_safely(self) -> None:
        """:meth:`tick`, logging (never raising) what went wrong: a bad read never stops the relay. The
        owner calls it every :attr:`next_poll` seconds from its main thread (hivemind forks an
        averager's process from the main thread only)."""
        if not self.rule.strategy.averages or self._stop.is_set():
            return
        try:
            self.tick()
        except Exception as e:
            logger.warning("relay: %s: %s", type(e).__name__, e)

    def tick(self, now: float | None = None) -> None:
        """One look at the records: publish what this node relays, join the rounds that are due."""
        recs = records.fetch_progress(self.dht, self.manifest.run_id)
        groups = self.groups(recs)
        served = tuple(sorted(g for g, members in groups.items() if self.needs_relay(members)))
        mono = time.monotonic() if now is None else now
        if served != self.served:
            for g in set(served) - set(self.served):
                logger.info("relay: every live member of %s is outbound-only (%d): reducing its rounds", g,
                            len(groups[g]))
                self._averager(g)  # now, not at its first round: its process takes a moment to start
            for g in set(self.served) - set(served):
                logger.info("relay: %s no longer needs a relay", g)
            self.served = served
            self._published = 0.0
        if mono - self._published >= self.publish_every:
            self.publish()
            self._published = mono
        for g in served:
            busy = self._busy.get(g)
            if busy is not None and busy.is_alive():
                continue
            due = relay_due(members=groups[g], done=self._done[g], first_waiting=self._first_waiting[g], now=mono,
                            timeout=self.manifest.averaging.barrier_timeout)
            if due is None:
                continue
            round_index, members = due
            averager = self._averager(g)
            if averager is None:
                continue
            self._done[g] = round_index
            closed = self.rule.world_group and any(self.admission.requires(r) for r, _ in
                                                    self.manifest.admission.regions) or self.admission.requires(g)
            admitted = [r.peer_id for r in groups[g]] if closed else None
            t = threading.Thread(target=self._join, args=(g, averager, round_index, members, admitted),
                                 name=f"relay-{g}-{round_index}", daemon=True)
            self._busy[g] = t
            t.start()

    def _averager(self, group: str) -> RegionAverager | None:
        a = self._averagers.get(group)
        if a is None:
            m = self.manifest
            try:
                a = RegionAverager(tensors=self._template, dht=self.dht, run_id=m.run_id, region=group,
                                   averaging=m.averaging, fingerprint=m.fingerprint(), robust=robust_settings(m),
                                   should_stop=self._stop.is_set, codecs=self._codecs, auxiliary=True)
            except Exception as e:
                if group not in self._unstartable:
                    self._unstartable.add(group)
                    logger.warning("relay: could not start an averager for %s: %s: %s", group, type(e).__name__, e)
                return None
            self._averagers[group] = a
        return a

    def _join(self, group: str, averager: RegionAverager, round_index: int, members: int,
              admitted: list[str] | None) -> None:
        if admitted is not None:
            averager.set_admitted(admitted)
        averager.set_target_group_size(min(members, self.manifest.averaging.target_group_size) + 1, exact=True)
        result = averager.relay_round(gather=dict(label="relay", round=round_index))
        if result.ok:
            self.rounds[group] += 1
            logger.info("relay: %s round %d reduced for %d members in %.2fs", group, round_index, result.group_size,
                        result.seconds)
        else:
            self.failed[group] += 1
            logger.warning("relay: %s round %d failed: %s", group, round_index, result.error)

    def _endorse(self):
        return issue(self._run_key, run_id=self.manifest.run_id, region=RELAY_ENDORSEMENT, peer_id=self.peer_id,
                     expires=time.time() + ENDORSEMENT_SECONDS)

    def publish(self) -> bool:
        from hivemind.utils.timed_storage import get_dht_time

        if self.endorsement.expires - time.time() < ENDORSEMENT_SECONDS / 2:
            self.endorsement = self._endorse()
        record = records.RelayRecord(peer_id=self.peer_id, fingerprint=self.manifest.fingerprint(),
                                     regions=self.served, endorsement=self.endorsement.to_wire(), time=get_dht_time())
        try:
            return records.publish_relay(self.dht, self.validators, self.manifest.run_id, record, ttl=self.ttl)
        except Exception as e:
            logger.debug("relay: could not publish its record: %s", e)
            return False
