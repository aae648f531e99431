"""World rounds, as this peer takes part in them: the leader's side (lease, border release, the
world round in the background, its typed result) and every member's (download the leader's change
and adopt it at the region round the leader set).

Threads: the world round runs on its own thread over a snapshot of the region's agreed model and
hands back a :class:`~worldlm_p2p.codec.WorldChange` through :attr:`WorldRounds._finished`; the main
thread takes it in :meth:`WorldRounds.collect` (called after every training step), so that the
region's state (:class:`~worldlm_p2p.peer.state.RegionState`) has one writer.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from worldlm_p2p import rounds
from worldlm_p2p.codec import WorldChange
from worldlm_p2p.config import PeerConfig, RunManifest
from worldlm_p2p.net import priority
from worldlm_p2p.net.leader import LeaderLease, elect_live

from worldlm_p2p.peer.events import EventLog
from worldlm_p2p.peer.member import Member
from worldlm_p2p.peer.serving import StateServer
from worldlm_p2p.peer.state import RegionState
from worldlm_p2p.peer.stats import PeerStats

logger = logging.getLogger(__name__)

#: a region's leader and the next candidates in line renew their leases; the other members stand by
#: (:class:`~worldlm_p2p.net.leader.LeaderLease`'s ``standby``): a failover needs one candidate in
#: line, and every renewal is a signed DHT store that its replicas validate
LEASE_CANDIDATES = 3
WORLD_PATIENCE_ROUNDS = 6  # a leader looks for the other leaders for up to this many all-reduce timeouts


@dataclass(frozen=True, slots=True)
class _Finished:
    """What the world-round thread hands back: the change of the region's model, the world model's
    shared part (border DP), and what the leader's trace records."""

    world_round: int
    delta: list[torch.Tensor]
    reference: list[torch.Tensor] | None
    bytes_sent: int
    trace: dict[str, Any]
    regions: tuple[str, ...]
    seconds: float


class WorldRounds:
    def __init__(self, *, dht, validators, dht_lock: threading.Lock, config: PeerConfig, manifest: RunManifest,
                 peer_id: str, rule: rounds.RoundRule, state: RegionState, stats: PeerStats, member: Member,
                 server: StateServer, trace: Callable[[str, dict], None], stopping: Callable[[], bool],
                 events: EventLog, admitted: Callable[[], set[str] | None] = lambda: None,
                 run_admitted: Callable[[], dict[str, str] | None] = lambda: None, outbound: bool = False,
                 next_round: Callable[[], int] | None = None) -> None:
        """``outbound``: this peer is outbound-only and never stands for its region's lease (a leader
        must be reachable by the other leaders and by its region); ``admitted()``: the peers that may
        lead this region (None: an open region); ``next_round()``: the index of the region round this
        peer enters next (default: ``stats.round``; one more while an overlapped round is in flight);
        ``run_admitted()``: the peers of the run that may take part in world rounds, peer id -> the
        region it is admitted to (None: anyone)."""
        self.dht, self.validators, self.dht_lock = dht, validators, dht_lock
        self.config, self.manifest, self.peer_id, self.rule = config, manifest, peer_id, rule
        self.state, self.stats, self.member, self.server, self.trace = state, stats, member, server, trace
        self.stopping, self.events, self.run_admitted = stopping, events, run_admitted
        self.next_round = next_round or (lambda: self.stats.round)
        self._run_admitted: dict[str, str] | None = None  # as read at the last world round's start
        self.tokens_since_world = 0.0
        self._exchange = None  # a WorldExchange, created when this peer first leads a world round
        self._thread: threading.Thread | None = None
        self._finished: _Finished | None = None  # set by the world-round thread, taken by collect()
        self._refuted: set[tuple[str, int]] = set()  # (source, world round) of changes this peer refused
        self._announced = -1  # the newest world round the region's leader announced in a region round's gather
        m = manifest
        self.lease = LeaderLease(dht=dht, validators=validators, run_id=m.run_id, region=config.region,
                                 peer_id=peer_id, fingerprint=m.fingerprint(), ttl=m.averaging.leader_ttl,
                                 lock=dht_lock, world_round=stats.world_round, admitted=admitted,
                                 standby=LEASE_CANDIDATES)
        self.outbound = outbound
        if outbound or (state.border is not None and state.world_ref is None):
            # a late joiner does not know the last world model, the reference of border deltas:
            # it may lead only after it has adopted a world round
            self.lease.eligible = False
        self.lease.start()

    def is_leader(self) -> bool:
        return self.lease.is_leader()

    def live_leaders(self) -> int:
        """The regions with a live leader (where some region admits: leaders admitted to theirs, whose
        lease is signed by their own key), the leaders a world round waits for."""
        admitted = self._run_admitted
        leases = [r for r in self.lease.live() if admitted is None or r.peer_id == self.peer_id
                  or (admitted.get(r.peer_id) == r.region and r.signer == r.peer_id)]
        fp = self.manifest.fingerprint()
        return sum(1 for region in {r.region for r in leases}
                   if elect_live(leases, region=region, fingerprint=fp) is not None)

    # ------------------------------------------------------------------ leader side
    def count(self, tokens: float) -> None:
        """Count a region round and its tokens towards the next world round; a leader starts one every
        ``world_every`` region rounds, in the background (training and region rounds go on)."""
        s, m = self.stats, self.manifest
        self.collect()
        s.rounds_since_world += 1
        self.tokens_since_world += tokens
        if s.rounds_since_world < m.aggregation.world_every or not self.lease.is_leader():
            return
        self._run_admitted = self.run_admitted()
        if self.live_leaders() < 2:
            logger.debug("no other region has a leader: no world round")
            return
        if self._thread is not None and self._thread.is_alive():
            logger.info("world round still in progress; the next one waits")
            return
        pending = self.state.change
        if (pending is not None and pending.source == self.peer_id and pending.world_round > s.world_round
                and (pending.source, pending.world_round) not in self._refuted):
            # this leader's last world round is not adopted yet (the region adopts it at its next
            # round): a newer one would replace it before anyone adopted it, and so on for ever when
            # world rounds are quicker than region rounds. The next one starts once it is adopted.
            logger.debug("world round %d is not adopted yet; the next one waits", pending.world_round)
            return
        last = max(s.world_round, self.state.change.world_round if self.state.change else -1)
        snapshot = self.state.snapshot()
        if self._exchange is None:  # hivemind averagers must be created from the main thread
            from worldlm_p2p.net.world import WorldExchange

            self._exchange = WorldExchange(dht=self.dht, validators=self.validators, dht_lock=self.dht_lock,
                                           run_id=m.run_id, region=self.config.region, peer_id=self.peer_id,
                                           fingerprint=m.fingerprint(), rule=self.rule, averaging=m.averaging,
                                           template=snapshot)
        if self._run_admitted is not None:  # the leaders' group: only peers admitted to their regions
            self._exchange.averager.set_admitted(set(self._run_admitted))
        tokens = self.tokens_since_world
        s.rounds_since_world, self.tokens_since_world = 0, 0.0
        sent, released = self._border_release(snapshot)
        self._thread = threading.Thread(target=self._run, args=(last + 1, snapshot, tokens, sent, released),
                                        name="world-round", daemon=True)
        self._thread.start()

    def _border_release(self, snapshot: list[torch.Tensor]) -> tuple[list[torch.Tensor] | None, dict[str, Any]]:
        """Under border DP (this region's policy), what the leader sends instead of the region's model:
        the last world model plus the clipped, noised change of the backbone. The noise seed is drawn
        from the OS's secure generator and never leaves this process (only the audit trace keeps it)."""
        pv, border = self.config.privacy, self.state.border
        if border is None:
            return None, {}
        seed = secrets.randbits(63)
        sent, rec = rounds.border_release(self.rule, snapshot, self.state.world_ref, clip=pv.border_clip,
                                          noise_multiplier=pv.border_noise,
                                          generator=torch.Generator().manual_seed(seed))
        border.record(pv.border_noise)  # counted when it is first offered to the other leaders
        logger.info("border DP: the region's backbone change (norm %.4g) leaves clipped to %.4g with noise std %.4g; "
                    "region epsilon now %.3g (delta %g)", rec.norm, rec.clipped_norm, rec.noise_std,
                    border.epsilon(), border.delta)
        return sent, dict(sent=sent, reference=self.state.world_ref, noise_seed=seed, clip=pv.border_clip,
                          noise=pv.border_noise, norm=rec.norm, clipped_norm=rec.clipped_norm)

    def _run(self, w: int, snapshot: list[torch.Tensor], tokens: float, sent: list[torch.Tensor] | None,
             released: dict[str, Any]) -> None:
        """The world-round thread: reads only its arguments, writes only :attr:`_finished`."""
        priority.lower_this_thread(self.config.background_nice)
        lease = self.lease
        try:
            out = self._exchange.run(world_round=w, region_model=snapshot, tokens=tokens, sent=sent,
                                     expected_leaders=self.live_leaders,
                                     patience=WORLD_PATIENCE_ROUNDS * self.manifest.averaging.averaging_timeout,
                                     should_stop=lambda: self.stopping() or not lease.is_leader())
        except Exception as e:  # never kill the peer for a world round
            logger.warning("world round %d failed: %s: %s", w, type(e).__name__, e)
            return
        if not out.ok:
            logger.warning("world round %d failed (%s); the region keeps its model", w, out.error)
            return
        delta = rounds.hand_down(self.rule, out.model, snapshot)
        ref = ([out.world[i].to(torch.float32).clone() for i in rounds.border_shared(self.rule)]
               if self.state.border is not None else None)
        self._finished = _Finished(world_round=out.world_round, delta=delta, reference=ref, bytes_sent=out.bytes_sent,
                                   regions=tuple(out.regions), seconds=out.seconds,
                                   trace=dict(snapshot=snapshot, model=out.model, regions=list(out.regions),
                                              fetched=list(out.fetched), weights=out.weights, tokens=tokens,
                                              **(released or {})))

    def collect(self) -> None:
        """Main thread, after every step: take a finished world round into the region's state, serve
        it and tell the region (the leader's lease record carries the world round)."""
        done, self._finished = self._finished, None
        if done is None:
            return
        if self.rule.residual_step_evidence:
            done = self._residual_step(done)
        c = WorldChange(world_round=done.world_round, delta=done.delta, apply_round=self.apply_round(),
                        source=self.peer_id, reference=done.reference)
        self.state.change = c
        self.stats.world_rounds_led += 1
        self.stats.bytes_sent_border += done.bytes_sent
        self.server.publish()
        self.lease.world_round = c.world_round
        self.lease.renew()  # tell the region now, not at the next renewal
        self.trace(f"world-{c.world_round:05d}-leader", done.trace)
        self.events.emit("world_led", world_round=c.world_round, regions=list(done.regions),
                         seconds=round(done.seconds, 4))
        logger.info("world round %d: with the leaders of %s in %.2fs; the region adopts it at its next round",
                    c.world_round, ", ".join(done.regions), done.seconds)

    def _residual_step(self, done: _Finished) -> _Finished:
        """Scale the region's residual step of K by this leader's tune slice
        (:func:`worldlm_p2p.rounds.leader_residual_step`: main thread, the model is this peer's). On
        a failure to evaluate, the region keeps its K (no step)."""
        snapshot, moved = done.trace["snapshot"], done.trace["model"]
        loss_of = self.member.loss_of("leader")
        if loss_of is None:
            return done
        params = self.member.params()
        try:
            model, choice = rounds.leader_residual_step(self.rule, moved, snapshot, loss_of)
            step = choice.lam
        except Exception as e:  # out of memory, say: no step rather than a stopped peer
            logger.warning("world round %d: evaluating the residual step failed (%s: %s); the region keeps its "
                           "key layers", done.world_round, type(e).__name__, e)
            model = self.rule.split.merge(self.rule.split.take_backbone(moved), self.rule.split.take_key(snapshot))
            step = 0.0
        finally:
            self.member.set(params)
        logger.info("world round %d: the region takes %.3g of its residual step (this peer's tune slice)",
                    done.world_round, step)
        return dataclasses.replace(done, delta=rounds.hand_down(self.rule, model, snapshot),
                                   trace=dict(done.trace, model=model, moved=moved, residual_step=step))

    def apply_round(self) -> int:
        """The region round at which every member adopts a change this leader takes now. The leader
        announces it in the gather of the next region round it enters (round n, :meth:`heard`), so
        every member of that round knows of it when the round ends, whenever its lease view was last
        refreshed: a synchronous member downloads it after the barrier of round n + 1 and adopts it
        there; an overlapped one downloads it in round n + 1's thread and adopts it when it starts
        round n + 2. The barrier keeps the members' round indices in step."""
        return self.next_round() + (2 if self.manifest.aggregation.overlap else 1)

    # ------------------------------------------------------------------ member side
    def heard(self, gathered: dict) -> None:
        """After a region round: note the world round that the region's leader (as this peer's
        lease view elects it) announced in its gather. Other members' announcements are ignored: a
        change is only ever downloaded from the elected leader."""
        leader = self.lease.leader()
        if leader is None or leader.peer_id == self.peer_id:
            return
        entry = gathered.get(leader.peer_id)
        w = entry.get("change") if isinstance(entry, dict) else None
        if isinstance(w, int) and not isinstance(w, bool) and w > self._announced:
            self._announced = w

    def prefetch(self) -> WorldChange | None:
        """Download the leader's latest world result as soon as it is announced, in the gather of a
        region round (:meth:`heard`) or in the leader's lease record (a network call: an overlapped
        round makes it in its background thread). The change known."""
        s = self.stats
        leader = self.lease.leader()
        known = self.state.change
        if leader is None or leader.peer_id == self.peer_id:
            return known
        announced = max(leader.world_round, self._announced)
        if announced > s.world_round and (known is None or known.world_round < announced):
            known = self._download(leader, announced) or known
        return known

    def maybe_adopt(self, *, fetch: bool = True) -> None:
        """Before a region round: fetch the leader's latest world result as soon as it is announced
        (``fetch``; False: :meth:`prefetch` does that elsewhere), and adopt it at the region round
        the leader set, the same one for every member (rebase: the change the world round made to
        the region's model is added to this peer's model and anchor, so the local progress made
        meanwhile is kept)."""
        s = self.stats
        self.collect()
        known = self.prefetch() if fetch else self.state.change
        if known is None or known.world_round <= s.world_round or s.round < known.apply_round:
            return
        if (known.source, known.world_round) in self._refuted:
            return
        params = self.member.params()
        if self._refutes(known, params):
            return
        region_size = s.group_sizes[-1] if s.group_sizes else 1  # its last region round's group
        adopted, mix = self.member.mix_safely(lambda: rounds.member_world_mix(
            self.rule, own=params, change=known.delta, loss_of=self.member.loss_of("world"),
            reuse=self.member.reuse_for("world"), region_size=region_size), own=params)
        self.member.set(adopted)
        if self.rule.evidence and self.rule.config.mix_world:
            self.member.record_mix("world", known.world_round, mix)
        self.state.rebase(known.delta)
        if self.state.border is not None and known.reference is not None:
            self.state.set_world_reference(rounds.border_shared(self.rule), known.reference)
            self.lease.eligible = not self.outbound
        s.world_round, s.world_rounds_adopted = known.world_round, s.world_rounds_adopted + 1
        self.lease.world_round = max(self.lease.world_round, known.world_round)
        self.server.publish()
        self.trace(f"world-{known.world_round:05d}", dict(
            delta=known.delta, world_round=known.world_round, anchor=self.state.anchor, round=s.round,
            leader=known.source, before=params, after=adopted, mix_lam=mix.lam if mix is not None else None,
            mix_key_lam=mix.second_lam if mix is not None else None))
        self.events.emit("world_adopted", world_round=known.world_round, round=s.round,
                         lam=mix.lam if mix is not None else None)
        logger.info("adopted world round %d at region round %d", known.world_round, s.round)

    def _refutes(self, change: WorldChange, params: list[torch.Tensor]) -> bool:
        """Test the change on this peer's tune slice, applied to the region's agreed model (which
        would take it whole), and its backbone part alone: refuse it, and its leader's lease, if the
        evidence refutes it (:func:`worldlm_p2p.rounds.world_change_refused`). The model is left as
        ``params``."""
        trainer = self.member.trainer
        if trainer.data.tune.numel() < 2 or self.state.anchor is None:
            return False  # no evidence: the change is taken (as the whole design does without a slice)
        after_backbone = None
        try:
            before = trainer.tune_loss(self.state.anchor)
            after = trainer.tune_loss([a + d.to(a.dtype) for a, d in zip(self.state.anchor, change.delta)])
            if self.rule.filters_world_key:
                backbone_step, _ = self.rule.part_steps(change.delta)
                after_backbone = trainer.tune_loss([a + d.to(a.dtype) for a, d in zip(self.state.anchor, backbone_step)])
        except Exception as e:  # out of memory, a shape the model does not have: refuse, do not stop
            before, after, after_backbone = float("nan"), float("inf"), None
            logger.debug("evaluating world round %d: %s: %s", change.world_round, type(e).__name__, e)
        finally:
            self.member.set(params)
        vocab = int(self.member.model.config.vocab_size)
        if not rounds.world_change_refused(self.rule, before=before, after=after, after_backbone=after_backbone,
                                           vocab_size=vocab):
            return False
        self._refuted.add((change.source, change.world_round))
        logger.warning("refused world round %d from %s: on this peer's tune slice it takes the region's model from "
                       "loss %.4f to %.4f%s (a model that knows nothing: %.4f); no longer counting its lease",
                       change.world_round, change.source, before, after,
                       f", its backbone part alone to {after_backbone:.4f}" if after_backbone is not None else "",
                       math.log(vocab))
        self.events.emit("world_refused", world_round=change.world_round, source=change.source,
                         before=before, after=after)
        if change.source != self.peer_id:
            self.lease.refuse(change.source)
        if self.state.change is change:
            self.state.change = None
        return True

    def _download(self, leader, announced: int) -> WorldChange | None:
        served = self.server.download_from(leader.peer_id, timeout=self.manifest.averaging.averaging_timeout)
        if served is None:
            logger.warning("could not download world round %d from the leader; retrying at the next round",
                           announced)
            return None
        c = served.change
        if c is None or c.world_round < announced:
            # (a change newer than announced is taken: the announcement is read a moment late)
            logger.warning("rejected the world change served by the leader (stale: world round %s, the leader "
                           "announced %d)", c.world_round if c else "none", announced)
            return None
        self.state.adopt_border_history(served.border_history)
        change = WorldChange(world_round=c.world_round, delta=c.delta, apply_round=c.apply_round,
                             source=c.source or leader.peer_id,
                             reference=c.reference if self.state.border is not None else None)
        self.state.change = change
        return change

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        try:
            self.lease.stop(withdraw=True, timeout=5)
        except Exception as e:
            logger.debug("lease stop: %s", e)
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._exchange is not None:
            self._exchange.shutdown()
            self._exchange = None
