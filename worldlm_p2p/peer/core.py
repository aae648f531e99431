"""The peer: the composition root that knows every part, and its run loop.

:meth:`Peer.run` reads top to bottom: join (:mod:`.joining`), build the parts, start from a
checkpoint, the region's current model or the common init, then train; every H inner steps a
region round (:mod:`.region_round`); world rounds when this peer leads its region
(:mod:`.world`); progress records every few seconds; atomic checkpoints (:mod:`worldlm_p2p.codec`);
on stop a final checkpoint, the held-out loss and the summary.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from worldlm_p2p.codec import json_safe
from worldlm_p2p.config import PeerConfig, RunManifest
from worldlm_p2p.errors import CheckpointWriteError
from worldlm_p2p.net import barrier
from worldlm_p2p.net.averaging import RegionAverager
from worldlm_p2p.net.keys import ALL_REGIONS
from worldlm_p2p import compression, rounds
from worldlm_p2p.rounds import region_payload
from worldlm_p2p.train import load_texts, resolve_steps

from worldlm_p2p.peer import checkpoints, joining
from worldlm_p2p.peer.events import EventLog
from worldlm_p2p.peer.member import Member
from worldlm_p2p.peer.progress import Progress
from worldlm_p2p.peer.region_round import RegionRound, gathered_tokens
from worldlm_p2p.peer.relay import robust_settings
from worldlm_p2p.peer.serving import StateServer
from worldlm_p2p.peer.state import RegionState
from worldlm_p2p.peer.stats import PeerStats
from worldlm_p2p.peer.world import WorldRounds

logger = logging.getLogger(__name__)


class _Preload:
    """Imports what building the model imports (:func:`worldlm_p2p.train.build_model`: seconds of
    transformers) in a thread of its own, once; :meth:`join` waits for it."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="preload", daemon=True)
            self._thread.start()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    @staticmethod
    def _run() -> None:
        try:
            import transformers.models.llama.modeling_llama  # noqa: F401
        except Exception as e:  # building the model will say what is wrong
            logger.debug("could not preload the model code: %s", e)


class Peer:
    """A WorldLM peer. Construct, then :meth:`run` (blocking) and always :meth:`shutdown`."""

    def __init__(self, *, config: PeerConfig) -> None:
        self.config, self.stats = config, PeerStats()
        self._checkpoint_failures: set[str] = set()
        self.label = config.label or Path(config.data).name or config.region
        self.manifest: RunManifest | None = None
        self.peer_id = ""
        self._stop = threading.Event()
        self._dht_lock = threading.Lock()
        self._started = time.monotonic()
        self.events = EventLog(config.events_path)
        from worldlm_p2p.net.wire import WireMeter

        self._wire = WireMeter()  # from the start: the sockets of joining count too
        self._net = self._averager = self._world = self._progress = self._member = self._state = None
        self._round: RegionRound | None = None

    def stop(self) -> None:
        """Ask :meth:`run` to finish the current step and exit cleanly (signal-safe)."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    # ------------------------------------------------------------------ setup
    def _setup(self) -> None:
        cfg = self.config
        self.events.emit("started", pid=os.getpid())
        splits = load_texts(cfg.data)  # fail on bad data before touching the network
        # the model's code (transformers: seconds of imports) loads once the run's manifest has
        # accepted this peer, while it checks its reachability; joined before anything else is forked
        preload = _Preload()
        try:
            self._net = net = joining.connect(cfg, stopping=self._stop.is_set, while_starting=preload.start,
                                              before_fork=preload.join)
        finally:
            preload.join()
        self.manifest, self.peer_id, m = net.manifest, net.peer_id, net.manifest
        self.events.emit("joined", peer_id=self.peer_id, run_id=m.run_id, fingerprint=m.fingerprint())
        if net.reachability is not None or net.outbound:
            r = net.reachability
            self.events.emit("reachability", status=r.status if r is not None else "not-checked",
                             mode="outbound" if net.outbound else "direct",
                             reachable=r.reachable if r is not None else [],
                             unreachable=r.unreachable if r is not None else [],
                             asked=r.asked if r is not None else 0, answered=r.answered if r is not None else 0)
        local = joining.build_local(cfg, m, splits)
        self.trainer, self.rule = local.trainer, local.rule
        self._member = Member(model=local.model, trainer=local.trainer, rule=local.rule, stats=self.stats,
                              personal=local.personal)
        self._state = RegionState(anchor=self._member.params(),
                                  border_delta=cfg.privacy.border_delta if cfg.privacy.border else None)
        joining.log_strategy(self.rule)
        template = self._state.anchor if not self.rule.strategy.averages else region_payload(
            self.rule, self._state.anchor, self._state.anchor)
        codecs = rounds.payload_codecs(self.rule, template) if self.rule.strategy.averages else None
        resumed = checkpoints.resume(cfg, m, member=self._member, state=self._state, stats=self.stats)
        self._progress = progress = Progress(
            dht=net.dht, validators=net.validators, dht_lock=self._dht_lock, config=cfg, manifest=m,
            peer_id=self.peer_id, label=self.label, stats=self.stats, state=self._state, epsilon=self._epsilon,
            is_leader=lambda: self._world is not None and self._world.is_leader(), finished=self._stop,
            admission=net.admission, certificate=net.certificate, manifest_record=net.manifest_record,
            reachability=net.reachability_status, wire=self._wire)
        others = lambda: progress.region_records(everyone=self.rule.world_group)  # noqa: E731
        self._averager = RegionAverager(tensors=template, dht=net.dht, run_id=m.run_id,
                                        region=ALL_REGIONS if self.rule.world_group else cfg.region,
                                        averaging=m.averaging, fingerprint=m.fingerprint(),
                                        robust=robust_settings(m),
                                        should_stop=self._stop.is_set, codecs=codecs)
        self._averager.set_admitted(progress.admitted)  # an admitting region: nobody until their records are read
        self._server = StateServer(averager=self._averager, state=self._state, stats=self.stats, rule=self.rule,
                                   fingerprint=m.fingerprint())
        parts = dict(config=cfg, rule=self.rule, member=self._member, state=self._state, stats=self.stats,
                     server=self._server, admitted=lambda: progress.admitted, fetch_others=others)
        live = others()  # (an admitting region: who is admitted, before the lease counts candidacies)
        if not resumed:
            joining.late_join(others=live, trace=self._trace, **parts)
        self._server.publish()
        if self.rule.has_world_rounds:
            self._world = WorldRounds(dht=net.dht, validators=net.validators, dht_lock=self._dht_lock, config=cfg,
                                      manifest=m, peer_id=self.peer_id, rule=self.rule, state=self._state,
                                      stats=self.stats, member=self._member, server=self._server, trace=self._trace,
                                      stopping=self._stop.is_set, events=self.events,
                                      admitted=lambda: progress.admitted, run_admitted=progress.run_admitted,
                                      outbound=net.outbound,
                                      next_round=lambda: self._round.next_round if self._round else self.stats.round)
        world = self._world
        self._round = RegionRound(
            rule=self.rule, averaging=m.averaging, averager=self._averager, state=self._state, stats=self.stats,
            member=self._member, server=self._server, region=cfg.region, label=self.label, started=self._started,
            payload_bytes=sum(compression.nominal_bytes(t.numel(), c)
                              for t, c in zip(template, codecs or ["none"] * len(template))),
            fetch_others=others, publish=progress.publish,
            stopping=self._stop.is_set, trace=self._trace, events=self.events, background_nice=cfg.background_nice,
            before_average=(lambda: world.maybe_adopt(fetch=not m.aggregation.overlap)) if world else lambda: None,
            in_flight_fetch=(lambda: world.prefetch() and None) if world and m.aggregation.overlap else lambda: None,
            on_averaged=(lambda result: (world.heard(result.gathered), world.count(gathered_tokens(result))))
            if world else lambda result: None,
            on_alone=self._region_of_one,
            on_refresh=lambda missed, why: joining.resync_anchor(missed, why, **parts),
            admitted=lambda: progress.admitted, banned=progress.banned, outbound=net.outbound,
            relays=(lambda: progress.relays(ALL_REGIONS if self.rule.world_group else cfg.region))
            if net.outbound else lambda: [])
        progress.start()
        if cfg.background_nice:
            logger.info("round threads run at nice %d (the hivemind and p2pd processes keep this peer's priority)",
                        cfg.background_nice)

    def _region_of_one(self, no_live_peer: bool) -> None:
        """A region whose only live peer is this one still takes part in world rounds: its model is
        this peer's (the region round of one member, as in the simulator: the agreed model is the
        member's own), it adopts world changes by its evidence, and as its leader it runs world
        rounds on schedule."""
        if not no_live_peer or self._world is None:
            return
        s = self.stats
        adopted = s.world_round
        self._world.maybe_adopt()
        if s.world_round != adopted:  # the shared model took a world change
            self._member.mix_personal(s.round)
        self._state.anchor = self._member.params()
        tokens, s.tokens_since_round = float(s.tokens_since_round), 0
        self._server.publish(round_index=s.round + 1)
        self._world.count(tokens)

    # ------------------------------------------------------------------ the run loop
    def run(self) -> dict[str, Any]:
        """Set up, train until a limit or :meth:`stop`, and return the summary."""
        self._setup()
        cfg, s, m = self.config, self.stats, self.manifest
        H = m.train.inner_steps
        if cfg.wait_for_peers > 1:
            self._wait_for_peers(cfg.wait_for_peers)
        self._progress.train_started = time.monotonic()
        logger.info("training %s on %s: %d train tokens, %d valid tokens, device %s", m.model.preset, cfg.data,
                    self.trainer.data.train.numel(), self.trainer.data.valid.numel(), self.trainer.device)
        last_ckpt = s.step
        s.round_entry_tokens = s.tokens
        self.events.emit("training", started_from=s.started_from, step=s.step)
        # on CUDA a step reads nothing back from the device: its loss is read with the others' at
        # every history point (every H steps, or 32 steps), in one round trip
        defer, unread = self.trainer.device.type == "cuda", []
        while not self._stop.is_set() and not self._done():
            began = time.monotonic()
            result = self.trainer.train_step(s.step, defer=defer)
            held = result  # the model the member holds: its loss is the one counted (and monitored)
            if self._member.personal is not None:  # the same batch (a pure function of the step)
                held = self._member.personal.train_step(s.step, defer=defer)
            s.count_step(tokens=result.tokens, loss=held.loss)
            if result.pending is not None or held.pending is not None:
                unread.append((result, held))
            if cfg.slowdown > 1:  # an emulated slower device
                self._stop.wait((cfg.slowdown - 1) * (time.monotonic() - began))
            if self._world is not None:
                self._world.collect()  # a world round this peer led has finished
            if unread and (s.step % H == 0 or len(unread) >= 32):
                self._read_losses(unread)
            if s.step % H == 0:
                s.history_point()
            if self.rule.strategy.averages and self._round_due(H):
                still = time.monotonic()
                # overlapped: the last round is applied and this one runs while training goes on
                self._round.start() if m.aggregation.overlap else self._round.run()
                s.seconds_in_rounds += time.monotonic() - still
            if s.step % cfg.checkpoint_every == 0:
                self._checkpoint()
                last_ckpt = s.step
        self._read_losses(unread)
        if self._round is not None and self._round.in_flight:  # the last overlapped round: applied as it ends
            still = time.monotonic()
            self._round.finish()
            s.seconds_in_rounds += time.monotonic() - still
            last_ckpt = -1
        if s.step != last_ckpt or (cfg.checkpoint_dir and s.step == 0):
            self._checkpoint()
        self._stop.set()
        self._progress.publish()  # finished=True: barriers stop waiting for us
        self.events.emit("finished", step=s.step, tokens=s.tokens)
        return self.summary(final_eval=True)

    def _read_losses(self, unread: list) -> None:
        """Count the losses of deferred steps (read back in one round trip per model), and empty
        ``unread``: pairs ``(shared model's step, held model's step)``, the same object without a
        personal model. The held model's loss is counted; a skipped update of either is logged."""
        if not unread:
            return
        first = self.stats.step - len(unread)
        shared = resolve_steps([u[0] for u in unread])
        held = shared if all(u[0] is u[1] for u in unread) else resolve_steps([u[1] for u in unread])
        for i, (a, b) in enumerate(zip(shared, held)):
            self.stats.count_loss(b.loss)
            for which, r in (("", a), (" (personal model)", b)) if a is not b else (("", a),):
                if r.skipped:
                    logger.warning("step %d%s: loss %s, gradient norm %s: the update was skipped", first + i, which,
                                   r.loss, r.grad_norm)
        unread.clear()

    def _round_due(self, H: int) -> bool:
        """Whether this peer enters its next region round now (``aggregation.schedule``): after every
        H steps, or when the region's live members have trained H steps' worth of tokens each since
        the last round (:func:`worldlm_p2p.net.barrier.round_due`, from records read at most every
        half ``progress_interval``, never waiting for a busy DHT). Under the token schedule an
        overlapped round still in flight is never waited for: training goes on, and the next round
        starts once it has landed (a slow network makes rounds carry more tokens, not stall)."""
        m, s, cfg = self.manifest, self.stats, self.config
        if m.aggregation.schedule == "steps":
            return s.step % H == 0
        if not self._round.landed:
            return False
        mine = s.tokens - s.round_entry_tokens
        per_member = H * m.train.batch_size * m.train.seq_len
        if mine < barrier.MIN_OWN_SHARE * per_member:
            return False
        others = self._progress.region_records(everyone=self.rule.world_group, max_age=cfg.progress_interval / 2,
                                               wait=0.0)
        return barrier.round_due(my_tokens=mine, my_round=self._round.next_round, others=others, now=time.time(),
                                 tokens_per_member=per_member, max_age=2 * cfg.progress_interval)

    def _wait_for_peers(self, n: int) -> None:
        """Wait until ``n`` peers of the region (this one included) are live, or the timeout."""
        deadline = time.monotonic() + self.config.wait_for_peers_timeout
        live = 1
        while not self._stop.is_set() and time.monotonic() < deadline:
            live = 1 + sum(1 for r in self._progress.region_records(everyone=self.rule.world_group) if not r.finished)
            if live >= n:
                logger.info("%d peers of region %s are live; training", live, self.config.region)
                return
            self._progress.publish()
            time.sleep(0.5)
        if not self._stop.is_set():
            logger.warning("only %d of the %d peers awaited in region %s are live after %.0fs; training anyway",
                           live, n, self.config.region, self.config.wait_for_peers_timeout)

    def _done(self) -> bool:
        cfg, s = self.config, self.stats
        return (cfg.max_steps is not None and s.step >= cfg.max_steps) or (
            cfg.max_tokens is not None and s.tokens >= cfg.max_tokens)

    # ------------------------------------------------------------------ traces, epsilon
    def _trace(self, name: str, payload: dict[str, Any]) -> None:
        if not self.config.trace_dir:
            return
        path = Path(self.config.trace_dir)
        path.mkdir(parents=True, exist_ok=True)
        tmp = path / f".{self.label}-{name}.tmp"
        torch.save(dict(payload, peer_id=self.peer_id, label=self.label, step=self.stats.step), tmp)
        os.replace(tmp, path / f"{self.label}-{name}.pt")

    def _epsilon(self) -> float:
        """The DP-SGD epsilon this peer has spent (-1: DP-SGD is off)."""
        eps = self._member.trainer.epsilon() if self._member is not None else None
        return -1.0 if eps is None else float(eps)

    def _checkpoint(self) -> None:
        """Write a checkpoint. One that cannot be written (a full disk, a quota) is logged, once per
        reason, and training goes on: the checkpoints already written stay, and the next one is tried
        at its time."""
        try:
            path = checkpoints.write(self.config, self.manifest, member=self._member, state=self._state,
                                     stats=self.stats, label=self.label, peer_id=self.peer_id)
        except CheckpointWriteError as e:
            reason = str(e).split(":", 1)[-1].split(";")[0].strip()
            level = logging.DEBUG if reason in self._checkpoint_failures else logging.WARNING
            self._checkpoint_failures.add(reason)
            logger.log(level, "%s; training goes on", e)
            self.events.emit("checkpoint_failed", step=self.stats.step, error=str(e))
            return
        if path is not None:
            self.events.emit("checkpoint", step=self.stats.step, path=str(path))

    # ------------------------------------------------------------------ summary and shutdown
    def summary(self, *, final_eval: bool = False) -> dict[str, Any]:
        m, border = self.manifest, self._state.border if self._state else None
        if self._progress is not None:
            self._progress.measure_wire()
        out = dict(self.stats.summary_view(), region=self.config.region, label=self.label, peer_id=self.peer_id,
                   data=str(self.config.data),
                   tokens_per_s=self._progress.record().tokens_per_s if self._progress else 0.0,
                   inner_steps=m.train.inner_steps if m else None,
                   epsilon=self._epsilon() if self._member is not None and self._epsilon() >= 0 else None,
                   border_epsilon=border.epsilon() if border is not None else None,
                   strategy=m.aggregation.strategy if m else None,
                   reachability=(self._net.reachability_status or None) if self._net is not None else None)
        if final_eval and m is not None:
            out["valid_loss"] = self._member.held.evaluate()  # the personal model, if it has one
        if self.config.summary_path:
            path = Path(self.config.summary_path)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps(json_safe(out), indent=2, allow_nan=False))  # strict JSON: NaN -> null
            os.replace(tmp, path)
        return out

    def shutdown(self) -> None:
        """Stop background processes (world rounds, averager, DHT and its p2p daemon). Safe to call twice."""
        self._stop.set()
        if self._round is not None:
            self._round.abandon(timeout=10)  # an overlapped round still in flight (it sees the stop)
        world, self._world = self._world, None
        if world is not None:
            world.shutdown()
        if self._progress is not None:
            self._progress.join(timeout=5)
        averager, self._averager = self._averager, None
        if averager is not None:
            try:
                averager.shutdown()
            except Exception as e:
                logger.debug("averager shutdown: %s", e)
        if self._net is not None:
            try:
                self._net.dht.shutdown()
            except Exception as e:
                logger.debug("DHT shutdown: %s", e)
            self._net = None
        self.events.close()
