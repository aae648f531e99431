"""Joining a run: the network and the manifest, the checks a region's policy makes, the local
training parts the manifest asks for, and where this peer's model starts when it has no checkpoint
(:mod:`.checkpoints`): the region's current model from a live peer, or the run's common
initialisation."""

from __future__ import annotations

import copy
import dataclasses
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from worldlm_p2p import rounds
from worldlm_p2p.codec import state_digest
from worldlm_p2p.config import PeerConfig, RunManifest, manifest_conflicts, privacy_violations
from worldlm_p2p.errors import ConfigError, DataError, ManifestError
from worldlm_p2p.net import records
from worldlm_p2p.net.admission import Certificate, RegionAdmission, check, peer_id_of, run_key_text
from worldlm_p2p.net.dht import ensure_identity, initial_peer_ids, start_dht, visible_maddrs, write_identity
from worldlm_p2p.net.records import fetch_run_manifest
from worldlm_p2p.split import split_parameters
from worldlm_p2p.strategies import strategy as strategy_of
from worldlm_p2p.strategies import with_border_dp
from worldlm_p2p.train import (LocalTrainer, TokenData, build_model, hold_out_tune, load_tokenizer, peer_data_seed,
                               resolve_device, tokenize_splits)
from worldlm_p2p.train.dp import peer_dp_config

from worldlm_p2p.peer.member import Member
from worldlm_p2p.peer.serving import StateServer
from worldlm_p2p.peer.state import RegionState
from worldlm_p2p.peer.stats import PeerStats

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------- network
@dataclass(frozen=True, slots=True)
class Network:
    dht: Any
    validators: list
    manifest: RunManifest
    peer_id: str
    admission: RegionAdmission
    certificate: dict | None  # this peer's admission to its region (wire form), where the region requires one
    manifest_record: Any = None  # the run key's signed manifest record, which this peer keeps alive in the DHT
    reachability: Any = None  # what the dial-back check found (net.reachability.Reachability; None: not asked)
    outbound: bool = False  # this peer runs outbound-only (a DHT client, never a reducer, donor or leader)

    @property
    def reachability_status(self) -> str:
        """What the swarm is told of this peer: ``outbound``, or the check's ``direct`` /
        ``not-direct`` / ``unknown`` (``""``: not checked, e.g. no bootstrap node to ask)."""
        if self.outbound:
            return "outbound"
        return self.reachability.status if self.reachability is not None else ""


def connect(config: PeerConfig, *, stopping: Callable[[], bool], while_starting: Callable[[], None] | None = None,
            before_fork: Callable[[], None] | None = None) -> Network:
    """Join the DHT (bounded retries), fetch the run manifest and refuse to go on when a local
    setting or this region's privacy contradicts it. ``while_starting()`` is called once the
    manifest is accepted, while this peer checks its reachability (the peer imports its model code
    there: a peer that is refused never pays for it, nearly halving the time and CPU of a refusal);
    ``before_fork()`` before an outbound-only restart of the DHT forks, so that no thread of this
    process is inside an import when a child is forked."""
    # one key for the libp2p identity and for the signatures of this peer's DHT records, so that
    # every record's signer can be matched with the peer id it claims: the --identity, or else a
    # key made for this process (its file lives only until the p2p daemon has read it)
    net = config.net
    with tempfile.TemporaryDirectory(prefix="worldlm-identity-") as tmp:
        if not net.identity_path:
            net = dataclasses.replace(net, identity_path=str(Path(tmp) / "identity.key"))
        key = ensure_identity(net.identity_path, announce=bool(config.net.identity_path))
        # the run id is known only after the manifest is fetched; start with the runs schema and add
        # the progress schema once the run is known
        validators = records.make_validators(None, key)
        outbound = net.reachability == "outbound"
        dht = start_dht(net, record_validators=validators, client_mode=outbound)
    try:
        trusted = run_key_text(config.run_key) if config.run_key else None
        record = fetch_run_manifest(dht, run_id=config.run_id, wait=config.manifest_wait, should_stop=stopping,
                                    trusted_key=trusted, anchors=initial_peer_ids(config.net.initial_peers))
        manifest = record.manifest
        try:  # this peer keeps the run's manifest alive too, from now on (Progress renews it)
            records.publish_manifest(dht, validators, record, ttl=records.PEER_MANIFEST_TTL)
        except Exception as e:
            logger.debug("could not store a copy of the run manifest: %s", e)
        conflicts = manifest_conflicts(manifest, config.local_overrides)
        if conflicts:
            more = f" (and {len(conflicts) - 1} more)" if len(conflicts) > 1 else ""
            raise ManifestError(f"local setting contradicts the run manifest: {conflicts[0]}{more}")
        check_privacy(config, manifest)
        admission = RegionAdmission.of(manifest)
        certificate = check_own_certificate(config, admission, peer_id=str(dht.peer_id), key=key)
    except BaseException:
        dht.shutdown()
        raise
    if while_starting is not None:
        while_starting()
    dht.add_validators(records.make_validators(manifest.run_id, key)[2:])
    logger.info("joined run %s (manifest %s, run key %s) as %s in region %s%s", manifest.run_id,
                manifest.fingerprint(), records.run_key_id(record.run_key), dht.peer_id, config.region,
                " (admitted)" if certificate else "")
    own: list[str] = []
    try:
        own = visible_maddrs(dht)
        if not outbound:
            logger.info("others can join through this peer: --initial-peers %s", " ".join(own))
    except Exception as e:  # the daemon may not say yet
        logger.debug("could not read this peer's addresses: %s", e)
    reach = None
    if outbound:
        logger.info("reachability: outbound-only (--reachability outbound): this peer sends its part of every region "
                    "round to a reachable member and gets the average back; it never reduces, serves its model or "
                    "leads its region")
    else:
        reach = check_reachability(dht, config, own)
        if reach is not None and reach.status == "not-direct" and net.reachability == "auto":
            if before_fork is not None:
                before_fork()
            dht = _restart_outbound(dht, config, key, validators + records.make_validators(manifest.run_id, key)[2:],
                                    record)
            outbound = True
    return Network(dht=dht, validators=validators, manifest=manifest, peer_id=str(dht.peer_id), admission=admission,
                   certificate=certificate, manifest_record=record, reachability=reach, outbound=outbound)


def _restart_outbound(dht, config: PeerConfig, key, validators: list, record):
    """Nobody could dial this peer back: start its DHT node again as a client (same identity), so that
    other peers do not put it in their routing tables and its averagers run in client mode (they send
    their part and receive the average over connections this peer opens; hivemind then never makes
    it a reducer, and no group waits on a connection to it)."""
    dht.shutdown()
    with tempfile.TemporaryDirectory(prefix="worldlm-identity-") as tmp:
        net = config.net
        if not net.identity_path:
            path = Path(tmp) / "identity.key"
            write_identity(path, key)
            net = dataclasses.replace(net, identity_path=str(path))
        dht = start_dht(net, record_validators=validators, client_mode=True)
    try:
        records.publish_manifest(dht, validators, record, ttl=records.PEER_MANIFEST_TTL)
    except Exception as e:
        logger.debug("could not store a copy of the run manifest: %s", e)
    logger.info("running outbound-only from now on (as peer %s)", dht.peer_id)
    return dht


def check_reachability(dht, config: PeerConfig, own: list[str]):
    """Serve dial-back requests, then ask this peer's bootstrap nodes to dial it back, and log one
    line: directly reachable (where), or not, and what to do (:mod:`worldlm_p2p.net.reachability`)."""
    from worldlm_p2p.net import reachability

    try:
        dht.run_coroutine(reachability.serve_dialback)
    except Exception as e:
        logger.debug("could not serve dial-back requests: %s: %s", type(e).__name__, e)
    asked = list(dict.fromkeys(initial_peer_ids(config.net.initial_peers)))[:3]
    if not asked:
        return None
    announced = list(config.net.announce_maddrs)
    result = reachability.check(dht, asked, announced + own, timeout=15.0)
    line = reachability.advice(result, announce_given=bool(announced),
                               outbound=config.net.reachability == "auto" and result.status == "not-direct")
    (logger.info if result.status == "direct" else logger.warning)("%s", line)
    return result


def check_own_certificate(config: PeerConfig, admission: RegionAdmission, *, peer_id: str, key) -> dict | None:
    """Where the manifest names a key for this peer's region: its certificate must admit it (the
    peer id of its --identity, which also signs its records). Raises ConfigError saying what to do."""
    region = config.region
    if not admission.requires(region):
        if config.certificate_path:
            logger.warning("region %s is open in this run: the certificate %s is not needed", region,
                           config.certificate_path)
        return None
    if not config.net.identity_path:
        raise ConfigError(f"region {region} admits its peers: run with the --identity your certificate was issued "
                          f"for (worldlm-admit peer-id --identity FILE prints its peer id)")
    if not config.certificate_path:
        raise ConfigError(f"region {region} admits its peers: give --certificate (ask the region's institutions "
                          f"to run worldlm-admit issue for peer {peer_id})")
    cert = Certificate.load(config.certificate_path)
    if peer_id_of(key.get_public_key()) != peer_id:
        raise ConfigError("this peer's record key and its libp2p identity differ; give --identity")
    why = check(cert, region_key=admission.key(region), run_id=admission.run_id, region=region, peer_id=peer_id)
    if why is not None:
        raise ConfigError(f"certificate {config.certificate_path} does not admit this peer ({peer_id}) to region "
                          f"{region}: {why}")
    return cert.to_wire()


def check_privacy(config: PeerConfig, manifest: RunManifest) -> None:
    """Refuse to start when this region's privacy settings break the run's policy (the manifest's
    ``[privacy]`` minimums), with the reason."""
    pv = config.privacy
    violations = privacy_violations(manifest.privacy, pv)
    if violations:
        more = f" (and {len(violations) - 1} more)" if len(violations) > 1 else ""
        raise ConfigError(f"this region's privacy settings break the run's policy: {violations[0]}{more}")
    if pv.border and not strategy_of(manifest.aggregation.strategy).border_dp_in("swarm"):
        raise ConfigError(f"privacy.border_clip: border DP is applied by region leaders at world rounds; strategy "
                          f"{manifest.aggregation.strategy} has none ({' and '.join(with_border_dp('swarm'))} do)")


def check_projected_epsilon(config: PeerConfig, manifest: RunManifest, dp: Any) -> None:
    """A peer that gives a noise multiplier is checked against the run's epsilon limit once its
    sampling rate is known (its data size): what it would spend over --max-steps. Without
    --max-steps its spending has no bound, so it is refused. ``dp``: the trainer's DP-SGD (None: off)."""
    limit = manifest.privacy.max_peer_epsilon
    if dp is None or limit <= 0 or config.privacy.peer_epsilon > 0:
        return
    if config.max_steps is None:
        raise ConfigError(f"privacy.peer_noise: the run limits every peer to epsilon {limit:g}; with a noise "
                          "multiplier the spending is bounded only by --max-steps: give --max-steps")
    spent = dp.projected_epsilon(config.max_steps)
    if spent > limit:
        raise ConfigError(f"privacy.peer_noise {dp.noise_multiplier:g} would spend epsilon {spent:.3g} over "
                          f"{config.max_steps} steps, more than the run's max_peer_epsilon {limit:g}: "
                          "raise the noise or lower --max-steps")


# ---------------------------------------------------------------------------------- local parts
@dataclass(frozen=True, slots=True)
class Local:
    tokenizer: Any
    data: TokenData
    device: torch.device
    model: torch.nn.Module
    trainer: LocalTrainer
    rule: rounds.RoundRule
    personal: LocalTrainer | None = None  # personal_model="separate": the personal model's trainer


def build_local(config: PeerConfig, manifest: RunManifest, splits) -> Local:
    """The tokenizer, data (less the tune slice evidence mixing holds apart), model (the run's
    common init: the same seed on every peer) and trainer the manifest asks for, and the round rule."""
    m, agg = manifest, manifest.aggregation
    tokenizer = load_tokenizer(m.tokenizer)
    data = tokenize_splits(splits, tokenizer)
    if strategy_of(agg.strategy).mixes and agg.mix == "evidence":  # the tune slice: evidence for mixing
        data = hold_out_tune(data, fraction=agg.tune_fraction, max_tokens=agg.tune_tokens, seq_len=m.train.seq_len,
                             eos_id=tokenizer.eos_id, pieces=agg.tune_pieces)
        if config.privacy.peer and data.tune.numel():
            logger.warning("DP-SGD covers the training text; the tune slice (%d tokens held apart for "
                           "evidence mixing) is outside its guarantee: the mixing weight chosen on it each "
                           "round is not accounted", data.tune.numel())
    if data.train.numel() < m.train.seq_len + 1:
        raise DataError(f"data {config.data} has {data.train.numel()} tokens, fewer than one "
                        f"training window of {m.train.seq_len + 1}")
    device = resolve_device(config.device)
    model = build_model(m.model, vocab_size=tokenizer.vocab_size, seed=m.train.seed).to(device)
    pv = config.privacy
    dp = peer_dp_config(epsilon=pv.peer_epsilon, noise=pv.peer_noise, clip=pv.peer_clip, delta=pv.peer_delta,
                        steps=config.max_steps, secure_rng=True)
    label = config.label or Path(config.data).name or config.region
    trainer = LocalTrainer(model=model, train=m.train, data=data, device=device,
                           seed=peer_data_seed(m.train.seed, label), dp=dp)
    check_projected_epsilon(config, manifest, trainer.dp)
    try:
        split = split_parameters([n for n, _ in model.named_parameters()], agg.key_layers)
    except ValueError as e:
        raise ConfigError(f"aggregation.key_layers: {e}") from None
    if trainer.dp is not None and agg.personal_model == "separate":
        # under DP-SGD a member trains one model: a second, trained on the same text, would spend the
        # privacy budget again
        logger.info("DP-SGD: this peer trains one model (aggregation.personal_model \"inline\")")
        agg = dataclasses.replace(agg, personal_model="inline")
    rule = rounds.RoundRule.from_config(agg, split, seed=m.train.seed)
    personal = None
    if rule.separate_personal:  # the same initialisation and batches as the shared model
        personal = LocalTrainer(model=copy.deepcopy(model), train=m.train, data=data, device=device,
                                seed=peer_data_seed(m.train.seed, label))
    return Local(tokenizer=tokenizer, data=data, device=device, model=model, trainer=trainer, rule=rule,
                 personal=personal)


def log_strategy(rule: rounds.RoundRule) -> None:
    kind, agg = rule.strategy, rule.config
    if not kind.averages:
        logger.info("strategy %s: this peer never averages", kind.name)
    elif kind.attentive:
        logger.info("strategy %s: region rounds average the backbone by token-weighted mean (outer %s) and "
                    "the %d key layers (%s) by %s attention (tau %g, eps %g); world rounds every %d region "
                    "rounds", kind.name, agg.outer, len(rule.split.key), agg.key_layers, agg.attention, agg.tau,
                    agg.eps, agg.world_every)
    else:
        logger.info("strategy %s: %s rounds (outer %s)%s", kind.name,
                    "world-group" if rule.world_group else "region", agg.outer,
                    f", the {len(rule.split.key)} key layers ({agg.key_layers}) stay with each peer"
                    if kind.personal_key else "")


# --------------------------------------------------------------------------- where a model starts
def region_model(served, *, rule: rounds.RoundRule, member: Member) -> list[torch.Tensor]:
    """The agreed model of a served state as this peer's start: with per-peer key layers
    (:attr:`~worldlm_p2p.strategies.Strategy.personal_key`) this peer keeps its own."""
    if rule.strategy.personal_key:
        return rule.split.merge(rule.split.take_backbone(served.agreed), rule.split.take_key(member.params()))
    return list(served.agreed)


def late_join(config: PeerConfig, *, others: list, rule: rounds.RoundRule, member: Member, state: RegionState,
              stats: PeerStats, server: StateServer, trace: Callable[[str, dict], None],
              admitted: Callable[[], set[str] | None] = lambda: None,
              fetch_others: Callable[[], list] | None = None) -> None:
    """Load the region's current model from a live peer when the region has averaged already."""
    live = [r for r in others if not r.finished]
    if not live:
        logger.info("no live peer in region %s yet: starting from the run's common initialisation", config.region)
        return
    if all(r.rounds_completed == 0 and r.round == 0 for r in live):
        logger.info("region %s has not averaged yet: its model is the run's common initialisation", config.region)
        return
    allowed = admitted()
    if not any(r.state_digest and r.reachability != "outbound" and (allowed is None or r.peer_id in allowed)
               for r in live):
        # (outbound-only peers serve nothing, and a peer that has served no state yet has none)
        logger.info("no live peer of region %s serves its model yet: starting from the run's common "
                    "initialisation", config.region)
        return
    logger.info("region %s has %d live peer(s): loading its current model", config.region, len(live))
    served = server.download_verified(timeout=config.join_state_timeout, fetch_others=fetch_others or (lambda: live),
                                      admitted=admitted)
    if served is None:
        return
    state.anchor, state.momentum = region_model(served, rule=rule, member=member), served.momentum or None
    member.set(state.anchor)
    member.follow_shared()
    stats.round = served.round
    stats.world_round = served.world_round
    if served.world_round >= 0:
        state.world_ref = None
    state.adopt_border_history(served.border_history)
    stats.started_from = "region"
    trace("join", dict(meta=served.encode()[0] | dict(round=served.round), tensors=state.anchor))
    logger.info("loaded the region model of round %d from a peer", stats.round)


RESYNC_TIMEOUT = 10.0  # seconds a stale member waits for the region's agreed model before its round


def resync_anchor(missed: int, why: str, *, config: PeerConfig, rule: rounds.RoundRule, member: Member,
                  state: RegionState, stats: PeerStats, server: StateServer,
                  admitted: Callable[[], set[str] | None] = lambda: None,
                  fetch_others: Callable[[], list] | None = None) -> bool:
    """Take the region's current agreed model (and outer momentum) as this peer's anchor again.

    Every member of a round must hold the same anchor: the reference of the K attention and of
    the outer step, and the model the region serves to late joiners. A peer holds a stale one when
    the region went ahead of it (it joined while the region's lone peer held rounds of one, or it
    missed rounds), or when its last round failed on its side only (a reducer timed out for it)
    while the others took theirs. Its own model, trained meanwhile, is kept: that is its
    contribution. True when a newer anchor was taken (a state served for a round before this
    peer's own is not newer: when every member failed the round, they all still hold the old one)."""
    if fetch_others is not None:
        allowed = admitted()
        newer = [r for r in fetch_others() if not r.finished and r.state_digest and r.state_round >= stats.round
                 and r.reachability != "outbound" and (allowed is None or r.peer_id in allowed)]
        if not newer:  # nobody serves a newer state: no download (and no wait for one)
            logger.debug("round %d: no region state newer than this peer's anchor (%s)", stats.round, why)
            return False
        if missed == 0 and all(r.state_digest == state_digest(state.anchor) for r in newer):
            return False  # the region's agreed model is this peer's anchor already
        # (on the round's path: a short wait; the next round tries again)
        served = server.download_verified(timeout=min(config.join_state_timeout, RESYNC_TIMEOUT),
                                          fetch_others=fetch_others, admitted=admitted)
    else:
        peers = admitted()
        served = server.download_region(timeout=min(config.join_state_timeout, RESYNC_TIMEOUT),
                                        peers=sorted(peers) if peers is not None else None)
    if served is None or served.round < stats.round:
        logger.debug("round %d: no region state newer than this peer's anchor (%s)", stats.round, why)
        return False
    state.anchor, state.momentum = region_model(served, rule=rule, member=member), served.momentum or None
    if served.world_round > stats.world_round:
        # the served agreed model has adopted world changes this peer has not: they are in the anchor
        # now, and adopting one again would add its delta twice (the anchor would then be nobody's,
        # and a region of two would drop every later round: found when a joiner's resync took a
        # state of the round where its region mate adopted a world change)
        stats.world_round = served.world_round
        state.adopt_border_history(served.border_history)
    if missed > 0:
        logger.info("the region moved %d round(s) ahead of this peer: took its agreed model of round %d as "
                    "the reference", missed, served.round)
    else:
        logger.info("round %d: %s; took the region's agreed model of round %d as the reference", stats.round, why,
                    served.round)
    return True
