"""The peer: the one orchestrator that knows every layer.

Lifecycle of :class:`Peer`:

1. check the data path (before touching the network), join the DHT with bounded retries;
2. fetch the run manifest from the DHT, refuse to start if local settings contradict it;
3. build tokenizer, data and the manifest's model (same seed on every peer: a common init);
4. resume from the latest valid checkpoint, or else load the region's current model from a live
   region peer (late join), or else start from the common init;
5. train; every H inner steps take part in a region round (barrier, then all-reduce weighted by
   the tokens trained since the last round); publish a signed progress record every few seconds;
   checkpoint atomically every ``checkpoint_every`` steps and at exit;
6. on stop (max steps/tokens, SIGINT/SIGTERM): final checkpoint, held-out loss, summary, shutdown.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hivemind.utils.timed_storage import get_dht_time

from worldlm_p2p import aggregation, rounds
from worldlm_p2p.checkpoint import load_latest_checkpoint, save_checkpoint
from worldlm_p2p.config import PeerConfig, RunManifest, manifest_conflicts, privacy_violations
from worldlm_p2p.errors import CheckpointError, ConfigError, DataError, ManifestError
from worldlm_p2p.net import barrier, records
from worldlm_p2p.net.records import fetch_run_manifest
from worldlm_p2p.net.averaging import RegionAverager
from worldlm_p2p.net.dht import ensure_identity, start_dht
from worldlm_p2p.net.leader import LeaderLease, elect
from worldlm_p2p.privacy import BorderAccountant
from worldlm_p2p.split import split_parameters
from worldlm_p2p.train.dp import peer_dp_config
from worldlm_p2p.train import (LocalTrainer, build_model, get_flat_params, hold_out_tune, load_texts,
                               load_tokenizer, peer_data_seed, resolve_device, set_params, tokenize_splits)

logger = logging.getLogger(__name__)

ALL_REGIONS = "_all"  # the group name of world-group strategies (no region can be named so)
WORLD_PATIENCE_ROUNDS = 6  # a leader looks for the other leaders for up to this many all-reduce timeouts


@dataclass
class PeerStats:
    step: int = 0
    tokens: int = 0
    tokens_since_round: int = 0
    round: int = 0  # next region round index
    rounds_completed: int = 0
    rounds_failed: int = 0
    group_sizes: list[int] = field(default_factory=list)
    round_seconds: list[float] = field(default_factory=list)
    first_train_loss: float | None = None
    last_train_loss: float = float("nan")
    bytes_sent: int = 0
    bytes_received: int = 0
    waiting_for_round: int = -1
    seconds_to_first_round: float | None = None
    initial_step: int = 0
    initial_tokens: int = 0
    started_from: str = "init"
    world_rounds_led: int = 0  # world rounds this peer ran as its region's leader
    world_rounds_adopted: int = 0  # world results this peer adopted
    world_round: int = -1  # the last world round adopted
    rounds_since_world: int = 0
    bytes_sent_border: int = 0
    # one point every inner_steps steps: step, tokens, mean train loss of those steps, region and world round
    history: list[dict[str, Any]] = field(default_factory=list)
    mixes: list[dict[str, Any]] = field(default_factory=list)  # evidence mixing: kind, round, step, lam, gain
    span_loss: float = 0.0  # sum of the train losses since the last history point
    span_steps: int = 0


class Peer:
    """A WorldLM peer. Construct, then :meth:`run` (blocking) and always :meth:`shutdown`."""

    def __init__(self, *, config: PeerConfig) -> None:
        self.config = config
        self.stats = PeerStats()
        self._stop = threading.Event()
        self._dht = None
        self._averager: RegionAverager | None = None
        self._publisher: threading.Thread | None = None
        self._dht_lock = threading.Lock()
        self._validators: list = []
        self.manifest: RunManifest | None = None
        self.peer_id = ""
        self.label = config.label or Path(config.data).name or config.region
        self._started = time.monotonic()
        self._train_started: float | None = None
        self._was_alone = False
        self._lease: LeaderLease | None = None
        self._world = None  # a WorldExchange, created when this peer first leads a world round
        self._world_thread: threading.Thread | None = None
        self._world_lock = threading.Lock()
        self._share_lock = threading.Lock()
        # the last world change known: (world round, delta of the region model, region round to apply it at)
        # plus the peer id it came from (this peer's own when it led that world round), and under border
        # DP the world model's shared part (the reference of the region's next border delta)
        self._world_delta: tuple[int, list[torch.Tensor], int, str, list[torch.Tensor] | None] | None = None
        self._region_tokens_since_world = 0.0
        self._world_ref: list[torch.Tensor] | None = None  # border DP: the last world model (see _setup)
        self._border: BorderAccountant | None = None  # border DP: the region's accountant

    # ------------------------------------------------------------------ control
    def stop(self) -> None:
        """Ask :meth:`run` to finish the current step and exit cleanly (signal-safe)."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    # ------------------------------------------------------------------ setup
    def _setup(self) -> None:
        cfg = self.config
        splits = load_texts(cfg.data)  # fail on bad data before touching the network
        key = ensure_identity(cfg.net.identity_path) if cfg.net.identity_path else None
        if key is None:
            from hivemind.utils.crypto import RSAPrivateKey

            key = RSAPrivateKey()
        # the run id is known only after the manifest is fetched; start with the runs schema and
        # add the progress schema once the run is known
        self._validators = records.make_validators(None, key)
        self._dht = start_dht(cfg.net, record_validators=self._validators)
        self.peer_id = str(self._dht.peer_id)
        self.manifest = fetch_run_manifest(self._dht, run_id=cfg.run_id, wait=cfg.manifest_wait,
                                           should_stop=self._stop.is_set)
        conflicts = manifest_conflicts(self.manifest, cfg.local_overrides)
        if conflicts:
            more = f" (and {len(conflicts) - 1} more)" if len(conflicts) > 1 else ""
            raise ManifestError(f"local setting contradicts the run manifest: {conflicts[0]}{more}")
        self._check_privacy()
        run_validators = records.make_validators(self.manifest.run_id, key)
        self._dht.add_validators(run_validators[2:])
        logger.info("joined run %s (manifest %s) as %s in region %s", self.manifest.run_id,
                    self.manifest.fingerprint(), self.peer_id, cfg.region)
        m = self.manifest
        self.tokenizer = load_tokenizer(m.tokenizer)
        self.data = tokenize_splits(splits, self.tokenizer)
        agg = m.aggregation
        if agg.strategy == "worldlm" and agg.mix == "evidence":  # the tune slice: evidence for mixing
            self.data = hold_out_tune(self.data, fraction=agg.tune_fraction, max_tokens=agg.tune_tokens,
                                      seq_len=m.train.seq_len, eos_id=self.tokenizer.eos_id, pieces=agg.tune_pieces)
            if cfg.privacy.peer and self.data.tune.numel():
                logger.warning("DP-SGD covers the training text; the tune slice (%d tokens held apart for "
                               "evidence mixing) is outside its guarantee: the mixing weight chosen on it each "
                               "round is not accounted", self.data.tune.numel())
        if self.data.train.numel() < m.train.seq_len + 1:
            raise DataError(f"data {cfg.data} has {self.data.train.numel()} tokens, fewer than one "
                            f"training window of {m.train.seq_len + 1}")
        self.device = resolve_device(cfg.device)
        self.model = build_model(m.model, vocab_size=self.tokenizer.vocab_size, seed=m.train.seed).to(self.device)
        data_seed = peer_data_seed(m.train.seed, self.label)
        pv = cfg.privacy
        dp = peer_dp_config(epsilon=pv.peer_epsilon, noise=pv.peer_noise, clip=pv.peer_clip, delta=pv.peer_delta,
                            steps=cfg.max_steps, secure_rng=True)
        self.trainer = LocalTrainer(model=self.model, train=m.train, data=self.data, device=self.device,
                                    seed=data_seed, dp=dp)
        self._check_projected_epsilon()
        self._anchor = [p.detach().to("cpu", copy=True) for p in get_flat_params(self.model)]
        # border DP: the region's delta is taken against the last world model (the common init before any)
        self._world_ref: list[torch.Tensor] | None = [t.clone() for t in self._anchor]
        self._border = BorderAccountant(delta=cfg.privacy.border_delta) if cfg.privacy.border else None
        names = [n for n, _ in self.model.named_parameters()]
        try:
            split = split_parameters(names, m.aggregation.key_layers)
        except ValueError as e:
            raise ConfigError(f"aggregation.key_layers: {e}") from None
        self.rule = rounds.RoundRule.from_config(m.aggregation, split, seed=m.train.seed)
        self._momentum: list[torch.Tensor] | None = None
        # fedavg and fedper average in one group of every peer of the run, the others per region
        self.group = ALL_REGIONS if self.rule.world_group else cfg.region
        self._log_strategy()
        template = self._anchor if m.aggregation.strategy == "local" else rounds.region_payload(
            self.rule, self._anchor, self._anchor)
        self._payload_bytes = sum(t.numel() * 4 for t in template)

        resumed = self._maybe_resume()
        self._averager = RegionAverager(tensors=template, dht=self._dht, run_id=m.run_id,
                                        region=self.group, averaging=m.averaging, fingerprint=m.fingerprint())
        if not resumed:
            self._maybe_join_region()
        self._share_state()
        if self.rule.has_world_rounds:
            self._lease = LeaderLease(dht=self._dht, validators=self._validators, run_id=m.run_id, region=cfg.region,
                                      peer_id=self.peer_id, fingerprint=m.fingerprint(), ttl=m.averaging.leader_ttl,
                                      lock=self._dht_lock, world_round=self.stats.world_round)
            if self._border is not None and self._world_ref is None:
                # a late joiner does not know the last world model, the reference of border deltas:
                # it may lead only after it has adopted a world round
                self._lease.eligible = False
            self._lease.start()
        self._publish_progress()
        self._publisher = threading.Thread(target=self._publish_loop, name="progress", daemon=True)
        self._publisher.start()

    def _check_privacy(self) -> None:
        """Refuse to start when this region's privacy settings break the run's policy (the manifest's
        ``[privacy]`` minimums), with the reason."""
        pv, m = self.config.privacy, self.manifest
        violations = privacy_violations(m.privacy, pv)
        if violations:
            more = f" (and {len(violations) - 1} more)" if len(violations) > 1 else ""
            raise ConfigError(f"this region's privacy settings break the run's policy: {violations[0]}{more}")
        if pv.border and m.aggregation.strategy not in ("worldlm", "hierfavg"):
            raise ConfigError(f"privacy.border_clip: border DP is applied by region leaders at world rounds; strategy "
                              f"{m.aggregation.strategy} has none (worldlm and hierfavg do)")

    def _check_projected_epsilon(self) -> None:
        """A peer that gives a noise multiplier is checked against the run's epsilon limit once its
        sampling rate is known (its data size): what it would spend over --max-steps. Without
        --max-steps its spending has no bound, so it is refused."""
        limit, dp = self.manifest.privacy.max_peer_epsilon, self.trainer.dp
        if dp is None or limit <= 0 or self.config.privacy.peer_epsilon > 0:
            return
        if self.config.max_steps is None:
            raise ConfigError(f"privacy.peer_noise: the run limits every peer to epsilon {limit:g}; with a noise "
                              "multiplier the spending is bounded only by --max-steps: give --max-steps")
        spent = dp.projected_epsilon(self.config.max_steps)
        if spent > limit:
            raise ConfigError(f"privacy.peer_noise {dp.noise_multiplier:g} would spend epsilon {spent:.3g} over "
                              f"{self.config.max_steps} steps, more than the run's max_peer_epsilon {limit:g}: "
                              "raise the noise or lower --max-steps")

    def _log_strategy(self) -> None:
        rule, m = self.rule, self.manifest
        agg = m.aggregation
        if agg.strategy == "local":
            logger.info("strategy local: this peer never averages")
        elif agg.strategy == "worldlm":
            logger.info("strategy worldlm: region rounds average the backbone by token-weighted mean (outer %s) and "
                        "the %d key layers (%s) by %s attention (tau %g, eps %g); world rounds every %d region "
                        "rounds", agg.outer, len(rule.split.key), agg.key_layers, agg.attention, agg.tau, agg.eps,
                        agg.world_every)
        else:
            logger.info("strategy %s: %s rounds (outer %s)%s", agg.strategy,
                        "world-group" if rule.world_group else "region", agg.outer,
                        f", the {len(rule.split.key)} key layers ({agg.key_layers}) stay with each peer"
                        if agg.strategy == "fedper" else "")

    def _share_state(self, round_index: int | None = None) -> None:
        """Serve the region's last agreed model (and the outer momentum) to late joiners, and the
        last world change (a leader's members download it from the leader). The main thread and the
        world-round thread both call this: the lock keeps an older state from overwriting a newer one."""
        with self._share_lock:
            self._share_state_locked(round_index)

    def _share_state_locked(self, round_index: int | None) -> None:
        with self._world_lock:
            delta = self._world_delta
        momentum = list(self._momentum) if self._momentum is not None else []
        ref = list(delta[4]) if delta and delta[4] is not None else []
        tensors = list(self._anchor) + momentum + (list(delta[1]) if delta else []) + ref
        self._averager.set_shared_state(round_index=self.stats.round if round_index is None else round_index,
                                        tensors=tensors, n_momentum=len(momentum),
                                        n_delta=len(delta[1]) if delta else 0,
                                        delta_world_round=delta[0] if delta else -1,
                                        delta_apply_round=delta[2] if delta else -1,
                                        delta_source=delta[3] if delta else "",
                                        border_history=self._border.state_dict()["history"] if self._border else [],
                                        n_ref=len(ref),
                                        world_round=self.stats.world_round)

    def _maybe_resume(self) -> bool:
        cfg, m = self.config, self.manifest
        if not cfg.checkpoint_dir:
            return False
        loaded = load_latest_checkpoint(cfg.checkpoint_dir)
        if loaded is None:
            return False
        for path, why in loaded.skipped:
            logger.warning("checkpoint %s is unusable (%s); resumed from %s instead", path, why, loaded.path)
        p = loaded.payload
        if p.get("fingerprint") != m.fingerprint():
            raise CheckpointError(f"checkpoint {loaded.path} belongs to another run manifest "
                                  f"({p.get('run_id')}, {p.get('fingerprint')}); use another --checkpoint-dir")
        try:
            self.model.load_state_dict(p["model"])
            self.trainer.load_state_dict(p["optimizer"])
            self._anchor = [t.to("cpu") for t in p["anchor"]]
            self._momentum = [t.to("cpu") for t in p["momentum"]] if p.get("momentum") is not None else None
        except (KeyError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"checkpoint {loaded.path} does not fit this model: {type(e).__name__}") from None
        s = self.stats
        for k in ("step", "tokens", "round", "rounds_completed", "rounds_failed", "bytes_sent", "bytes_received",
                  "tokens_since_round", "first_train_loss", "last_train_loss", "world_round", "world_rounds_led",
                  "world_rounds_adopted", "rounds_since_world", "bytes_sent_border"):
            if k in p["stats"]:
                setattr(s, k, p["stats"][k])
        s.group_sizes = list(p["stats"].get("group_sizes", []))
        s.history = [dict(h) for h in p["stats"].get("history", [])]
        s.mixes = [dict(h) for h in p["stats"].get("mixes", [])]
        if "world_ref" in p:
            self._world_ref = [t.to("cpu") for t in p["world_ref"]] if p["world_ref"] is not None else None
        if self._border is not None and isinstance(p.get("border"), dict):
            self._adopt_border_history(p["border"].get("history"))
        s.initial_step, s.initial_tokens, s.started_from = s.step, s.tokens, "checkpoint"
        logger.info("resumed from checkpoint %s at step %d (%d tokens, %d rounds)", loaded.path, s.step, s.tokens,
                    s.rounds_completed)
        return True

    def _other_region_records(self) -> list[records.ProgressRecord]:
        with self._dht_lock:
            recs = records.fetch_progress(self._dht, self.manifest.run_id)
        return [r for r in recs if (self.group == ALL_REGIONS or r.region == self.config.region)
                and r.peer_id != self.peer_id and r.fingerprint == self.manifest.fingerprint()]

    def _maybe_join_region(self) -> None:
        others = [r for r in self._other_region_records() if not r.finished]
        if not others:
            logger.info("no live peer in region %s yet: starting from the run's common initialisation",
                        self.config.region)
            return
        if all(r.rounds_completed == 0 and r.round == 0 for r in others):
            logger.info("region %s has not averaged yet: its model is the run's common initialisation",
                        self.config.region)
            return
        logger.info("region %s has %d live peer(s): loading its current model", self.config.region, len(others))
        state = self._download_region_state()
        if state is None:
            return
        meta, self._anchor, momentum = state
        self._momentum = momentum or None
        set_params(self.model, self._anchor)
        self.stats.round = int(meta.get("round", 0))
        if isinstance(meta.get("world_round"), int):
            self.stats.world_round = meta["world_round"]
            if meta["world_round"] >= 0:
                self._world_ref = None
        self._adopt_border_history(meta.get("border_history"))
        self.stats.started_from = "region"
        self._trace("join", dict(meta=meta, tensors=self._anchor))
        logger.info("loaded the region model of round %d from a peer", self.stats.round)

    def _download_region_state(self) -> tuple[dict, list[torch.Tensor], list[torch.Tensor]] | None:
        """``(metadata, the region's agreed model, the outer momentum)`` served by a peer of the region,
        or None (logged) when none arrives in time or it does not match this run's model."""
        loaded = self._averager.download_region_state(timeout=self.config.join_state_timeout)
        if loaded is None:
            logger.warning("could not download the region's model within %.0fs; keeping the model this peer has",
                           self.config.join_state_timeout)
            return None
        meta, tensors = loaded
        n_mom, n_delta = meta.get("n_momentum", 0), meta.get("n_delta", 0)
        n_ref = meta.get("n_ref", 0)
        if isinstance(n_ref, int) and 0 < n_ref <= len(tensors):  # a world reference (border DP): not needed here
            tensors = tensors[:len(tensors) - n_ref]
        if not isinstance(n_delta, int) or n_delta not in (0, len(self._anchor)):
            n_delta = -1
        n_anchor = len(tensors) - n_mom - n_delta if isinstance(n_mom, int) and n_delta >= 0 else -1
        if n_delta > 0:
            tensors = tensors[:len(tensors) - n_delta]
        if meta.get("fingerprint") != self.manifest.fingerprint() or n_anchor != len(self._anchor) or n_mom not in (
                0, len(self.rule.backbone(self._anchor))) or any(
                a.shape != b.shape for a, b in zip(tensors, self._anchor)):
            logger.warning("rejected region state from a peer: it does not match this run's model")
            return None
        tensors = [t.detach().to("cpu", torch.float32).clone() for t in tensors]
        anchor, momentum = tensors[:n_anchor], tensors[n_anchor:]
        if self.rule.strategy == "fedper":  # the key layers are per peer: keep this peer's own
            anchor = self.rule.split.merge(self.rule.split.take_backbone(anchor),
                                           self.rule.split.take_key(get_flat_params(self.model)))
        return meta, anchor, momentum

    def _refresh_joined_anchor(self, missed: int) -> None:
        """A peer that joined from the region's state and then finds the region ahead of it at its
        first barrier (the region's lone peer held region rounds of one while this one started) holds
        a stale anchor; every member of a round must hold the same one (the reference of the K
        attention and of the pure round), so it downloads the region's current agreed model again.
        Its own model, trained meanwhile, is kept: that is its contribution."""
        state = self._download_region_state()
        if state is None:
            return
        meta, anchor, momentum = state
        served = meta.get("round")
        if not isinstance(served, int) or served < self.stats.round:
            return  # not newer than what this peer holds (or a malformed index: keep what it has)
        self._anchor, self._momentum = anchor, momentum or None
        logger.info("the region moved %d round(s) ahead while this peer joined: took its agreed model of "
                    "round %d as the reference", missed, served)

    # ------------------------------------------------------------------ progress records
    def _record(self) -> records.ProgressRecord:
        s = self.stats
        elapsed = time.monotonic() - self._train_started if self._train_started else 0.0
        tps = (s.tokens - s.initial_tokens) / elapsed if elapsed > 0 else 0.0
        loss = s.last_train_loss if math.isfinite(s.last_train_loss) else 0.0
        return records.ProgressRecord(
            region=self.config.region, peer_id=self.peer_id, label=self.label[:256], step=s.step, tokens=s.tokens,
            train_loss=loss, tokens_per_s=tps, rounds_completed=s.rounds_completed,
            last_group_size=s.group_sizes[-1] if s.group_sizes else 0, bytes_sent=s.bytes_sent,
            bytes_received=s.bytes_received, round=s.round, waiting_for_round=s.waiting_for_round,
            fingerprint=self.manifest.fingerprint(), time=time.time(), finished=self._stop.is_set(),
            world_round=s.world_round, leader=bool(self._lease is not None and self._lease.is_leader()),
            loss_trend=tuple(h["loss"] for h in s.history[-records.MAX_LOSS_TREND:]),
            epsilon=self._epsilon(),
            border_epsilon=self._border.epsilon() if self._border is not None else -1.0,
            border_releases=self._border.releases if self._border is not None else -1,
            mix_region=self._recent_mix("region"), mix_world=self._recent_mix("world"))

    def _epsilon(self) -> float:
        """The DP-SGD epsilon this peer has spent (-1: DP-SGD is off)."""
        eps = self.trainer.epsilon() if getattr(self, "trainer", None) is not None else None
        return -1.0 if eps is None else float(eps)

    def _publish_progress(self) -> None:
        try:
            with self._dht_lock:
                records.publish_progress(self._dht, self._validators, self.manifest.run_id, self._record(),
                                         ttl=self.config.progress_ttl)
        except Exception as e:  # the DHT may be shutting down
            logger.debug("could not publish progress: %s", e)

    def _publish_loop(self) -> None:
        while not self._stop.wait(self.config.progress_interval):
            self._publish_progress()

    # ------------------------------------------------------------------ rounds
    def _region_round(self) -> None:
        s, m = self.stats, self.manifest

        def announce(r: int) -> None:
            s.waiting_for_round = r
            self._publish_progress()

        decision = barrier.wait_for_region(my_round=s.round, fetch_others=self._other_region_records,
                                           announce=announce, timeout=m.averaging.barrier_timeout,
                                           should_stop=self._stop.is_set)
        missed, s.round = decision.round - s.round, decision.round
        if (missed > 0 and s.rounds_completed == 0 and s.started_from == "region"
                and decision.action is not barrier.Action.ALONE and not self._stop.is_set()):
            self._refresh_joined_anchor(missed)
        if decision.action is barrier.Action.ALONE or self._stop.is_set():
            if not self._stop.is_set():
                level = logging.DEBUG if self._was_alone else logging.INFO
                logger.log(level, "round %d: no other live peer in region %s, training on locally", s.round,
                           self.config.region)
                if decision.live == 0 and self._lease is not None:
                    self._region_of_one()
            self._was_alone = True
            s.waiting_for_round = -1
            s.round += 1
            return
        self._was_alone = False
        self._maybe_adopt_world()
        pre = [p.detach().to("cpu", copy=True) for p in get_flat_params(self.model)]
        anchor = self._anchor
        weight = aggregation.round_weight(s.tokens_since_round)
        payload = rounds.region_payload(self.rule, pre, anchor)
        try:
            self._averager.set_target_group_size(min(decision.waiting + 1, m.averaging.target_group_size))
        except Exception as e:  # an older or changed hivemind: fall back to the full matchmaking window
            logger.debug("could not set the target group size: %s", e)
        result = self._averager.run_round(payload, weight=weight, gather=dict(
            label=self.label, weight=weight, tokens=s.tokens_since_round, round=s.round, world=s.world_round))
        if result.ok and not all(bool(torch.isfinite(t).all()) for t in result.averaged):
            result = dataclasses.replace(result, ok=False, averaged=None,
                                         error="the group's average is not finite (a peer sent NaN/inf)")
        new = None
        if result.ok:
            try:
                new, agreed, momentum = rounds.region_step(self.rule, result.averaged, params=pre, anchor=anchor,
                                                           momentum=self._momentum)
            except ValueError as e:  # e.g. a non-positive attention denominator from a corrupted part
                result = dataclasses.replace(result, ok=False, averaged=None, error=f"unusable average: {e}")
        mix = None
        if result.ok and self.rule.evidence:
            new, mix = self._mix_safely(lambda: rounds.member_mix(self.rule, own=pre, agreed=agreed,
                                                                  loss_of=self._loss_of()), own=pre)
            self._record_mix("region", s.round, mix)
        if result.ok:
            self._momentum = momentum
            set_params(self.model, new)
            self._anchor = agreed
            s.rounds_completed += 1
            s.group_sizes.append(result.group_size)
            s.round_seconds.append(result.seconds)
            sent, received = aggregation.allreduce_traffic(self._payload_bytes, result.group_size)
            s.bytes_sent += sent
            s.bytes_received += received
            s.tokens_since_round = 0
            if s.seconds_to_first_round is None:
                s.seconds_to_first_round = time.monotonic() - self._started
            self._share_state(round_index=s.round + 1)
            worlds = {g.get("world") for g in result.gathered.values() if isinstance(g, dict)}
            if len(worlds) > 1:
                logger.warning("round %d: members had adopted different world rounds (%s); the group's average "
                               "mixes them", s.round, sorted(w for w in worlds if isinstance(w, int)))
            self._after_region_round(result)
            logger.info("round %d: averaged with %d peers in %.2fs (weight %.0f)", s.round, result.group_size,
                        result.seconds, weight)
        else:
            s.rounds_failed += 1
            logger.warning("round %d: all-reduce failed (%s); keeping the local model", s.round, result.error)
        self._trace(f"round-{s.round:05d}", dict(ok=result.ok, weight=weight, pre=pre, anchor=anchor,
                                                 agreed=self._anchor if result.ok else None,
                                                 mix_lam=mix.lam if mix is not None else None,
                                                 gathered=result.gathered,
                                                 post=[p.detach().to("cpu", copy=True) for p in
                                                       get_flat_params(self.model)]))
        s.round += 1
        s.waiting_for_round = -1
        self._publish_progress()

    # ------------------------------------------------------------------ world rounds
    def _live_leaders(self) -> int:
        lease = self._lease
        if lease is None:
            return 0
        leases = lease.leases()
        now = get_dht_time()
        fp = self.manifest.fingerprint()
        return sum(1 for region in {r.region for r in leases}
                   if elect(leases, region=region, now=now, fingerprint=fp) is not None)

    def _region_of_one(self) -> None:
        """A region whose only live peer is this one still takes part in world rounds: its model is
        this peer's (the region round of one member, as in the simulator: the agreed model is the
        member's own), it adopts world changes by its evidence, and as its leader it runs world
        rounds on schedule."""
        s = self.stats
        self._maybe_adopt_world()
        self._anchor = [p.detach().to("cpu", copy=True) for p in get_flat_params(self.model)]
        tokens, s.tokens_since_round = float(s.tokens_since_round), 0
        self._share_state(round_index=s.round + 1)
        self._count_for_world(tokens)

    def _after_region_round(self, result) -> None:
        """Count the region's tokens towards the next world round (see :meth:`_count_for_world`)."""
        self._count_for_world(sum(float(g.get("tokens", 0)) for g in result.gathered.values()
                                  if isinstance(g, dict)))

    def _count_for_world(self, tokens: float) -> None:
        """Count a region round and its tokens towards the next world round; a leader starts one every
        ``world_every`` region rounds, in the background (training and region rounds go on)."""
        if self._lease is None:
            return
        s, m = self.stats, self.manifest
        s.rounds_since_world += 1
        self._region_tokens_since_world += tokens
        if s.rounds_since_world < m.aggregation.world_every or not self._lease.is_leader():
            return
        if self._live_leaders() < 2:
            logger.debug("no other region has a leader: no world round")
            return
        if self._world_thread is not None and self._world_thread.is_alive():
            logger.info("world round still in progress; the next one waits")
            return
        with self._world_lock:
            last = max(s.world_round, self._world_delta[0] if self._world_delta else -1)
        snapshot = [t.clone() for t in self._anchor]
        if self._world is None:  # hivemind averagers must be created from the main thread
            from worldlm_p2p.net.world import WorldExchange

            m, cfg = self.manifest, self.config
            self._world = WorldExchange(dht=self._dht, validators=self._validators, dht_lock=self._dht_lock,
                                        run_id=m.run_id, region=cfg.region, peer_id=self.peer_id,
                                        fingerprint=m.fingerprint(), rule=self.rule, averaging=m.averaging,
                                        template=snapshot)
        tokens = self._region_tokens_since_world
        s.rounds_since_world, self._region_tokens_since_world = 0, 0.0
        sent, released = self._border_release(snapshot)
        self._world_thread = threading.Thread(target=self._world_round, args=(last + 1, snapshot, tokens, sent, released),
                                              name="world-round", daemon=True)
        self._world_thread.start()

    def _border_release(self, snapshot: list[torch.Tensor]) -> tuple[list[torch.Tensor] | None, dict[str, Any]]:
        """Under border DP (this region's policy), what the leader sends instead of the region's model:
        the last world model plus the clipped, noised change of the backbone. The noise seed is drawn
        from the OS's secure generator and never leaves this process (only the audit trace keeps it)."""
        pv = self.config.privacy
        if self._border is None:
            return None, {}
        seed = secrets.randbits(63)
        sent, rec = rounds.border_release(self.rule, snapshot, self._world_ref, clip=pv.border_clip,
                                          noise_multiplier=pv.border_noise,
                                          generator=torch.Generator().manual_seed(seed))
        self._border.record(pv.border_noise)  # counted when it is first offered to the other leaders
        logger.info("border DP: the region's backbone change (norm %.4g) leaves clipped to %.4g with noise std %.4g; "
                    "region epsilon now %.3g (delta %g)", rec.norm, rec.clipped_norm, rec.noise_std,
                    self._border.epsilon(), self._border.delta)
        return sent, dict(sent=sent, reference=self._world_ref, noise_seed=seed, clip=pv.border_clip,
                          noise=pv.border_noise, norm=rec.norm, clipped_norm=rec.clipped_norm)

    def _adopt_border_history(self, history) -> None:
        """Members keep the region's border accountant too (the leader's, from the shared state), so
        that it survives a change of leader."""
        if self._border is None or not isinstance(history, list):
            return
        try:
            other = BorderAccountant.from_state(dict(delta=self._border.delta, history=history))
        except (TypeError, ValueError, KeyError):
            logger.warning("ignored a malformed border-DP history from the region's state")
            return
        if other.releases > self._border.releases:
            self._border = other

    def _world_round(self, w: int, snapshot: list[torch.Tensor], tokens: float,
                     sent: list[torch.Tensor] | None = None, released: dict[str, Any] | None = None) -> None:
        try:
            lease = self._lease
            out = self._world.run(world_round=w, region_model=snapshot, tokens=tokens, sent=sent,
                                  expected_leaders=self._live_leaders,
                                  patience=WORLD_PATIENCE_ROUNDS * self.manifest.averaging.averaging_timeout,
                                  should_stop=lambda: self._stop.is_set() or not lease.is_leader())
        except Exception as e:  # never kill the peer for a world round
            logger.warning("world round %d failed: %s: %s", w, type(e).__name__, e)
            return
        if not out.ok:
            logger.warning("world round %d failed (%s); the region keeps its model", w, out.error)
            return
        delta = [n.to(torch.float32) - a for n, a in zip(out.model, snapshot)]
        # the region applies it at the same region round: the next but one, so that every member has
        # a whole round to see the leader's record and download the change (the barrier keeps the
        # members' round indices in step)
        with self._world_lock:
            ref = ([out.world[i].to(torch.float32).clone() for i in rounds.border_shared(self.rule)]
                   if self._border is not None else None)
            self._world_delta = (out.world_round, delta, self.stats.round + 1, self.peer_id, ref)
        self.stats.world_rounds_led += 1
        self.stats.bytes_sent_border += out.bytes_sent
        self._share_state()
        self._lease.world_round = out.world_round
        self._lease.renew()  # tell the region now, not at the next renewal
        self._trace(f"world-{out.world_round:05d}-leader", dict(snapshot=snapshot, model=out.model,
                                                                regions=list(out.regions), fetched=list(out.fetched),
                                                                weights=out.weights, tokens=tokens, **(released or {})))
        logger.info("world round %d: with the leaders of %s in %.2fs; the region adopts it at its next round",
                    out.world_round, ", ".join(out.regions), out.seconds)

    def _maybe_adopt_world(self) -> None:
        """Before a region round: fetch the leader's latest world result as soon as it is announced,
        and adopt it at the region round the leader set, the same one for every member (rebase: the
        change the world round made to the region's model is added to this peer's model and anchor,
        so the local progress made meanwhile is kept)."""
        if self._lease is None:
            return
        s = self.stats
        leader = self._lease.leader()
        with self._world_lock:
            known = self._world_delta
        if (leader is not None and leader.peer_id != self.peer_id and leader.world_round > s.world_round
                and (known is None or known[0] < leader.world_round)):
            known = self._download_world_change(leader) or known
        if known is None or known[0] <= s.world_round or s.round < known[2]:
            return
        w, delta, _, source, ref = known
        params = get_flat_params(self.model)
        adopted, mix = self._mix_safely(lambda: rounds.member_world_mix(self.rule, own=params, change=delta,
                                                                        loss_of=self._loss_of()), own=params)
        set_params(self.model, adopted)
        if self.rule.evidence and self.rule.mix_world:
            self._record_mix("world", w, mix)
        self._anchor = [a + d for a, d in zip(self._anchor, delta)]
        if self._border is not None and ref is not None:  # the reference of the region's next border delta
            full = list(self._world_ref or self._anchor)
            for i, t in zip(rounds.border_shared(self.rule), ref):
                full[i] = t
            self._world_ref = full
            self._lease.eligible = True
        s.world_round, s.world_rounds_adopted = w, s.world_rounds_adopted + 1
        self._lease.world_round = max(self._lease.world_round, w)
        self._share_state()
        self._trace(f"world-{w:05d}", dict(delta=delta, world_round=w, anchor=self._anchor, round=s.round,
                                           leader=source, before=params, after=adopted,
                                           mix_lam=mix.lam if mix is not None else None))
        logger.info("adopted world round %d at region round %d", w, s.round)

    def _loss_of(self):
        """This peer's tune-slice loss of a parameter list (None without a slice: no evidence). It
        leaves the parameters tried in the model; the caller sets the one it settles on."""
        if not self.rule.evidence or self.data.tune.numel() < 2:
            return None
        return self.trainer.tune_losses if self.rule.windowed else self.trainer.tune_loss

    def _recent_mix(self, kind: str, last: int = 8) -> float:
        """The mean weight of this peer's last ``last`` mixing choices of ``kind`` (-1: none yet)."""
        lams = [m["lam"] for m in self.stats.mixes if m["kind"] == kind][-last:]
        return sum(lams) / len(lams) if lams else -1.0

    def _mix_safely(self, search, *, own: list[torch.Tensor]):
        """Run a mixing search; if evaluating the tune slice fails (out of memory, say), keep the
        own model (a search leaves trial parameters in the model) and say so, rather than stop."""
        try:
            return search()
        except Exception as e:
            logger.warning("evidence mixing failed (%s: %s): keeping this peer's own model", type(e).__name__, e)
            set_params(self.model, own)
            return [t.detach().clone() for t in own], None

    def _record_mix(self, kind: str, index: int, choice) -> None:
        lam = choice.lam if choice is not None else 0.0
        gain = choice.gain if choice is not None and math.isfinite(choice.gain) else 0.0
        self.stats.mixes.append(dict(kind=kind, round=int(index), step=self.stats.step, lam=lam, gain=gain))
        logger.info("%s round %d: took %.3g of the %s (tune-slice loss %.4f -> %.4f)", kind, index, lam,
                    "region's agreed model" if kind == "region" else "world's change",
                    choice.own_loss if choice is not None else float("nan"),
                    choice.loss if choice is not None else float("nan"))

    def _download_world_change(self, leader) -> tuple[int, list[torch.Tensor], int, str, Any] | None:
        loaded = self._averager.download_state_from(leader.peer_id, timeout=self.manifest.averaging.averaging_timeout)
        if loaded is None:
            logger.warning("could not download world round %d from the leader; retrying at the next round",
                           leader.world_round)
            return None
        meta, tensors = loaded
        n = meta.get("n_delta", 0) if isinstance(meta, dict) else 0
        n_ref = meta.get("n_ref", 0) if isinstance(meta, dict) else 0
        if n_ref not in (0, len(rounds.border_shared(self.rule))) or not isinstance(n_ref, int):
            logger.warning("rejected the world change served by the leader (malformed world reference)")
            return None
        ref_part, tensors = tensors[len(tensors) - n_ref:], tensors[:len(tensors) - n_ref]
        if not (isinstance(n, int) and n == len(self._anchor) and meta.get("delta_world_round") == leader.world_round
                and isinstance(meta.get("delta_apply_round"), int)
                and meta.get("fingerprint") == self.manifest.fingerprint()
                and all(a.shape == b.shape for a, b in zip(tensors[-n:], self._anchor))
                and all(bool(torch.isfinite(t).all()) for t in tensors[-n:])):
            logger.warning("rejected the world change served by the leader (stale or malformed)")
            return None
        source = meta.get("delta_source")  # the leader that computed it (who may have led before this one)
        ref = None
        if self._border is not None and n_ref and all(bool(torch.isfinite(t).all()) for t in ref_part):
            ref = [t.to(torch.float32) for t in ref_part]
        self._adopt_border_history(meta.get("border_history"))
        known = (leader.world_round, [t.to(torch.float32) for t in tensors[-n:]], meta["delta_apply_round"],
                 source if isinstance(source, str) and source else leader.peer_id, ref)
        with self._world_lock:
            self._world_delta = known
        return known

    def _trace(self, name: str, payload: dict[str, Any]) -> None:
        if not self.config.trace_dir:
            return
        path = Path(self.config.trace_dir)
        path.mkdir(parents=True, exist_ok=True)
        tmp = path / f".{self.label}-{name}.tmp"
        torch.save(dict(payload, peer_id=self.peer_id, label=self.label, step=self.stats.step), tmp)
        os.replace(tmp, path / f"{self.label}-{name}.pt")

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint(self) -> None:
        if not self.config.checkpoint_dir:
            return
        s = self.stats
        payload = dict(
            run_id=self.manifest.run_id, fingerprint=self.manifest.fingerprint(), region=self.config.region,
            model={k: v.detach().to("cpu") for k, v in self.model.state_dict().items()},
            optimizer=self.trainer.state_dict(), anchor=self._anchor, momentum=self._momentum,
            stats=dict(step=s.step, tokens=s.tokens, round=s.round, rounds_completed=s.rounds_completed,
                       rounds_failed=s.rounds_failed, bytes_sent=s.bytes_sent, bytes_received=s.bytes_received,
                       tokens_since_round=s.tokens_since_round, first_train_loss=s.first_train_loss,
                       world_round=s.world_round, world_rounds_led=s.world_rounds_led,
                       world_rounds_adopted=s.world_rounds_adopted, rounds_since_world=s.rounds_since_world,
                       bytes_sent_border=s.bytes_sent_border,
                       last_train_loss=s.last_train_loss, group_sizes=list(s.group_sizes),
                       history=list(s.history), mixes=list(s.mixes)),
            manifest=self.manifest.to_dict(), label=self.label, peer_id=self.peer_id,
            world_ref=self._world_ref, border=self._border.state_dict() if self._border is not None else None,
        )
        path = save_checkpoint(self.config.checkpoint_dir, step=s.step, payload=payload,
                               keep=self.config.keep_checkpoints)
        logger.info("checkpoint written: %s", path)

    # ------------------------------------------------------------------ main loop
    def _history_point(self) -> None:
        s = self.stats
        if s.span_steps:
            s.history.append(dict(step=s.step, tokens=s.tokens, loss=s.span_loss / s.span_steps, round=s.round,
                                  world_round=s.world_round, time=time.time()))
        s.span_loss, s.span_steps = 0.0, 0

    def _done(self) -> bool:
        cfg, s = self.config, self.stats
        return (cfg.max_steps is not None and s.step >= cfg.max_steps) or (
            cfg.max_tokens is not None and s.tokens >= cfg.max_tokens)

    def run(self) -> dict[str, Any]:
        """Set up, train until a limit or :meth:`stop`, and return the summary."""
        self._setup()
        cfg, s, m = self.config, self.stats, self.manifest
        H = m.train.inner_steps
        self._train_started = time.monotonic()
        logger.info("training %s on %s: %d train tokens, %d valid tokens, device %s", m.model.preset, cfg.data,
                    self.data.train.numel(), self.data.valid.numel(), self.device)
        last_ckpt = s.step
        while not self._stop.is_set() and not self._done():
            result = self.trainer.train_step(s.step)
            s.step += 1
            s.tokens += result.tokens
            s.tokens_since_round += result.tokens
            if math.isfinite(result.loss):  # (a DP-SGD step on an empty Poisson batch has no loss)
                s.last_train_loss = result.loss
                if s.first_train_loss is None:
                    s.first_train_loss = result.loss
                s.span_loss += result.loss
                s.span_steps += 1
            if s.step % H == 0:
                self._history_point()
            if s.step % H == 0 and m.aggregation.strategy != "local":
                self._region_round()
            if s.step % cfg.checkpoint_every == 0:
                self._checkpoint()
                last_ckpt = s.step
        if s.step != last_ckpt or (cfg.checkpoint_dir and s.step == 0):
            self._checkpoint()
        self._stop.set()
        self._publish_progress()  # finished=True: barriers stop waiting for us
        return self.summary(final_eval=True)

    def summary(self, *, final_eval: bool = False) -> dict[str, Any]:
        s = self.stats
        out = dict(
            region=self.config.region, label=self.label, peer_id=self.peer_id, data=str(self.config.data),
            started_from=s.started_from, initial_step=s.initial_step, steps=s.step, tokens=s.tokens,
            rounds_completed=s.rounds_completed, rounds_failed=s.rounds_failed, group_sizes=list(s.group_sizes),
            round_seconds=[round(x, 4) for x in s.round_seconds], seconds_to_first_round=s.seconds_to_first_round,
            first_train_loss=s.first_train_loss,
            last_train_loss=s.last_train_loss if math.isfinite(s.last_train_loss) else None,
            tokens_per_s=self._record().tokens_per_s if self.manifest else 0.0,
            bytes_sent=s.bytes_sent, bytes_received=s.bytes_received, bytes_sent_border=s.bytes_sent_border,
            world_round=s.world_round, world_rounds_led=s.world_rounds_led, world_rounds_adopted=s.world_rounds_adopted,
            history=list(s.history), inner_steps=self.manifest.train.inner_steps if self.manifest else None,
            mixes=list(s.mixes),
            epsilon=self._epsilon() if self._epsilon() >= 0 else None,
            border_epsilon=self._border.epsilon() if self._border is not None else None,
            strategy=self.manifest.aggregation.strategy if self.manifest else None,
        )
        if final_eval and self.manifest is not None:
            out["valid_loss"] = self.trainer.evaluate()
        if self.config.summary_path:
            path = Path(self.config.summary_path)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps(out, indent=2))
            os.replace(tmp, path)
        return out

    def shutdown(self) -> None:
        """Stop background processes (averager, DHT and its p2p daemon). Safe to call twice."""
        self._stop.set()
        if self._lease is not None:
            try:
                self._lease.stop(withdraw=True, timeout=5)
            except Exception as e:
                logger.debug("lease stop: %s", e)
            self._lease = None
        if self._world_thread is not None:
            self._world_thread.join(timeout=10)
        if self._world is not None:
            self._world.shutdown()
            self._world = None
        if self._publisher is not None:
            self._publisher.join(timeout=5)
        if self._averager is not None:
            try:
                self._averager.shutdown()
            except Exception as e:
                logger.debug("averager shutdown: %s", e)
            self._averager = None
        if self._dht is not None:
            try:
                self._dht.shutdown()
            except Exception as e:
                logger.debug("DHT shutdown: %s", e)
            self._dht = None
