"""Every strategy over a federated corpus in one process, for experiments (``worldlm-simulate``).

One virtual peer per sub-corpus of ``<region>/<sub_corpus>/{train.txt,valid.txt}``. Each peer is
the swarm's own local-training code (:class:`~worldlm_p2p.train.LocalTrainer`, same model init,
same batch stream for the same ``(seed, region, label)``), and rounds are the swarm's own pure
functions (:mod:`worldlm_p2p.rounds`) with the all-reduce replaced by
:func:`~worldlm_p2p.rounds.group_average` (the robust rule every reducer of the swarm applies).
There is no second implementation of the math.

Schedule: ``rounds`` region rounds of ``H`` local steps; for ``worldlm`` and ``hierfavg`` a world
round among the regions' leaders after every ``world_every``-th region round, whose result every
member adopts before it trains on. With ``aggregation.overlap`` a region round is computed at its
boundary and applied at the next one with the members' progress meanwhile
(:func:`~worldlm_p2p.rounds.stale_apply`), then its world round. ``centralized`` trains one model on the pooled training data
for the same number of tokens (``peers x rounds x H`` steps of the same batch size). Deterministic
for a seed (given the same torch build and thread count).

Evaluation: each peer's model (after the last aggregation) on the peer's own held-out text;
region values are means over the region's peers, world values means over regions.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from worldlm_p2p import attention, compression
from worldlm_p2p.aggregation import allreduce_traffic, max_round_weight, round_weight
from worldlm_p2p.config import AggregationConfig, ModelConfig, PrivacyConfig, TokenizerSpec, TrainConfig, _require
from worldlm_p2p.errors import ConfigError, DataError
from worldlm_p2p.mixing import EvidenceBudget, MixChoice
from worldlm_p2p.privacy import BorderAccountant
from worldlm_p2p.rounds import (RoundRule, border_release, flat_round_with_border_dp, hand_down, member_world_mix,
                               mix_parts_record, payload_codecs, personal_mix, region_payload, region_round_with_anchor,
                               stale_apply, world_round)
from worldlm_p2p.split import split_parameters
from worldlm_p2p.strategies import strategy as strategy_of
from worldlm_p2p.strategies import with_border_dp
from worldlm_p2p.train.dp import peer_dp_config
from worldlm_p2p.train import (LocalTrainer, TokenData, bits_per_byte, build_model, get_flat_params, hold_out_tune,
                               list_corpus, load_texts, load_tokenizer, peer_data_seed, resolve_device, set_params,
                               tokenize_splits)

logger = logging.getLogger(__name__)


#: Strategies whose models cross region borders, where region-level DP applies: worldlm and hierfavg
#: at their world rounds (the backbone; hierfavg the whole model), fedavg at every round (each
#: region's mean change, the standard-FL baseline; :mod:`worldlm_p2p.strategies`).
BORDER_DP_STRATEGIES = with_border_dp("simulator")


@dataclass(frozen=True, kw_only=True, slots=True)
class SimConfig:
    """A simulated run: a corpus, the run's shared settings and the schedule."""

    data: str
    model: ModelConfig
    tokenizer: TokenizerSpec = field(default_factory=TokenizerSpec)
    train: TrainConfig = field(default_factory=TrainConfig)  # train.inner_steps is H, train.seed the seed
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    rounds: int = 10
    eval_rounds: tuple[int, ...] = ()  # extra evaluation points (region-round counts); the last round always
    device: str = "cpu"
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)  # every region's policy (one for all here)

    def __post_init__(self) -> None:
        _require(self.rounds >= 1, "rounds", "must be >= 1")
        _require(not self.privacy.border or self.aggregation.strategy in BORDER_DP_STRATEGIES, "region DP",
                 f"applies where models cross region borders: strategies {', '.join(BORDER_DP_STRATEGIES)}, "
                 f"not {self.aggregation.strategy}")
        _require(all(1 <= r <= self.rounds for r in self.eval_rounds), "eval_rounds",
                 f"must lie in 1..{self.rounds}")
        _require(self.train.seq_len <= self.model.max_seq_len, "train.seq_len",
                 f"{self.train.seq_len} exceeds model.max_seq_len {self.model.max_seq_len}")


@dataclass
class VirtualPeer:
    region: str
    label: str
    data: TokenData
    model: torch.nn.Module
    trainer: LocalTrainer
    step: int = 0
    tokens: int = 0
    tokens_since_round: int = 0
    tokens_since_world: int = 0
    bytes_sent_region: int = 0
    bytes_sent_border: int = 0
    last_train_loss: float = math.nan
    mixes: list = field(default_factory=list)  # evidence: every mixing choice (round, kind, lam, gain)
    tune_loss: float | None = None  # the tune-slice loss of the model it holds, when known
    # personal_model="separate": the personal model's trainer (its model: ``personal.model``),
    # trained on the same batches as the shared ``model``; None: the member holds one model
    personal: LocalTrainer | None = None
    # usage_rows: its token counts over its training text (None: it shares none)
    usage: torch.Tensor | None = None
    # mix="evidence": what its evidence searches may cost, and their last choices (aggregation.evidence_share)
    budget: EvidenceBudget | None = None

    @property
    def held(self) -> LocalTrainer:
        """The trainer of the model the peer holds (is evaluated on): the personal one, if any."""
        return self.personal if self.personal is not None else self.trainer

    @property
    def key(self) -> str:
        return f"{self.region}/{self.label}"


def _perplexity(loss: float) -> float:
    """``exp(loss)``; infinite for a diverged model (written as null in the results)."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def _nbytes(tensors, wire: str = "none") -> int:
    """Bytes of ``tensors`` on the wire in codec ``wire`` (``none``: float32)."""
    return sum(compression.nominal_bytes(t.numel(), wire) for t in tensors)


class Simulator:
    """Build with a :class:`SimConfig`, then :meth:`run`. ``on_progress(done_steps, total_steps)``
    is called after every peer's local steps (for progress bars); ``should_stop()`` is polled
    between steps and makes :meth:`run` raise ``KeyboardInterrupt``."""

    def __init__(self, config: SimConfig, *, on_progress: Callable[[int, int], None] | None = None,
                 should_stop: Callable[[], bool] = lambda: False) -> None:
        self.config = config
        self.on_progress = on_progress or (lambda done, total: None)
        self.should_stop = should_stop
        layout = list_corpus(config.data)
        self.tokenizer = load_tokenizer(config.tokenizer)
        self.device = resolve_device(config.device)
        t = config.train
        base = build_model(config.model, vocab_size=self.tokenizer.vocab_size, seed=t.seed).to(self.device)
        self.names = [n for n, _ in base.named_parameters()]
        self.peers: list[VirtualPeer] = []
        agg = config.aggregation
        kind = strategy_of(agg.strategy)
        evidence = kind.mixes and agg.mix == "evidence"
        if agg.personal_model == "separate" and self._dp_sgd(steps=1) is not None:
            # under DP-SGD a member trains one model (a second would spend its privacy budget twice)
            agg = dataclasses.replace(agg, personal_model="inline")
        separate = evidence and kind.localises and agg.personal_model == "separate"
        for region, subs in layout.items():
            for sub in subs:
                data = tokenize_splits(load_texts(sub), self.tokenizer)
                if data.valid.numel() == 0:  # (a swarm peer without it trains on, unevaluated)
                    raise DataError(f"{sub}: no validation text (valid.txt empty or blank, or too little text to hold "
                                    f"some out): the simulator scores every peer on its own held-out text; add some, "
                                    f"or leave valid.txt out to hold out the last 10% of train.txt")
                if evidence:  # the tune slice: training text held apart for the members' evidence
                    data = hold_out_tune(data, fraction=agg.tune_fraction, max_tokens=agg.tune_tokens,
                                         seq_len=t.seq_len, eos_id=self.tokenizer.eos_id, pieces=agg.tune_pieces)
                if data.train.numel() < t.seq_len + 1:
                    raise DataError(f"{sub}: {data.train.numel()} training tokens, fewer than one window of "
                                    f"{t.seq_len + 1}")
                model = copy.deepcopy(base)
                trainer = LocalTrainer(model=model, train=t, data=data, device=self.device,
                                       seed=peer_data_seed(t.seed, sub.name),
                                       dp=self._dp_sgd(steps=config.rounds * t.inner_steps))
                personal = LocalTrainer(model=copy.deepcopy(base), train=t, data=data, device=self.device,
                                        seed=peer_data_seed(t.seed, sub.name)) if separate else None
                self.peers.append(VirtualPeer(region=region, label=sub.name, data=data, model=model, trainer=trainer,
                                              personal=personal,
                                              budget=EvidenceBudget(share=agg.evidence_share,
                                                                    models=2 if separate else 1) if evidence else None))
        self.regions = sorted({p.region for p in self.peers})
        try:
            split = None if kind.pooled else split_parameters(self.names, agg.key_layers)
        except ValueError as e:
            raise ConfigError(f"aggregation.key_layers: {e}") from None
        self.rule = RoundRule.from_config(agg, split, seed=t.seed) if split is not None else None
        if self.rule is not None and self.rule.usage_rows and self._dp_sgd(steps=1) is None:
            rows = base.get_input_embeddings().weight.shape[0]
            for p in self.peers:
                p.usage = attention.token_usage(p.data.train, rows)
        self.central: LocalTrainer | None = None
        if kind.pooled:
            pooled = TokenData(train=torch.cat([p.data.train for p in self.peers]), valid=self.peers[0].data.valid,
                               train_bytes=sum(p.data.train_bytes for p in self.peers),
                               valid_bytes=self.peers[0].data.valid_bytes)
            self.central_model = copy.deepcopy(base)
            self.central = LocalTrainer(model=self.central_model, train=t, data=pooled, device=self.device,
                                        seed=peer_data_seed(t.seed, "world/centralized"),
                                        dp=self._dp_sgd(steps=config.rounds * t.inner_steps * len(self.peers)))
        self.history: list[dict[str, Any]] = []
        self.world_rounds: list[dict[str, Any]] = []
        pv = config.privacy
        self.border = {r: BorderAccountant(delta=pv.border_delta) for r in self.regions} if pv.border else {}
        # the last world model (the same shared part in every region): the reference of border deltas
        self.world_reference = get_flat_params(base)
        self._flat_rounds = 0  # fedavg rounds run under border DP (numbers their noise draws)
        self._round = 0  # the region round in progress
        # overlap: peer key -> (snapshot, next model) of the region round in flight
        self._pending: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def _dp_sgd(self, *, steps: int):
        """Every peer's DP-SGD settings (None: off); the target epsilon is calibrated over the run's steps."""
        pv = self.config.privacy
        return peer_dp_config(epsilon=pv.peer_epsilon, noise=pv.peer_noise, clip=pv.peer_clip, delta=pv.peer_delta,
                              steps=steps)

    def _loss_of(self, p: VirtualPeer, kind: str):
        """The tune-slice loss of a parameter list for peer ``p`` (None: no slice, no evidence).
        It leaves the last parameters tried in ``p.model``: the caller sets the model it settles on."""
        if not self.rule.evidence or p.data.tune.numel() < 2:
            return None
        return p.budget.counting(p.trainer.tune_losses if self.rule.windowed else p.trainer.tune_loss,
                                 p.data.tune.numel(), kind)

    @staticmethod
    def _reuse(p: VirtualPeer, kind: str) -> MixChoice | None:
        """``p``'s last ``kind`` choice to take again, when its evidence budget has no search due."""
        return p.budget.reuse(kind, p.tokens) if p.budget is not None else None

    @staticmethod
    def _remember(p: VirtualPeer, kind: str, choice: MixChoice | None) -> None:
        if p.budget is not None:
            p.budget.remember(kind, choice)

    # ------------------------------------------------------------------ groups and leaders
    def _groups(self) -> dict[str, list[VirtualPeer]]:
        if self.rule.world_group:
            return {"world": list(self.peers)}
        return {r: [p for p in self.peers if p.region == r] for r in self.regions}

    def _leader(self, region: str) -> VirtualPeer:
        return min((p for p in self.peers if p.region == region), key=lambda p: p.label)

    # ------------------------------------------------------------------ rounds
    def _region_rounds(self, anchors: dict[str, list[torch.Tensor]], momenta: dict[str, Any]) -> None:
        """Every group's region round. Synchronous: each member takes its next model now. With
        ``aggregation.overlap``: the round is computed on the members' current models (the swarm's
        snapshot) and kept in :attr:`_pending`; the members train on from their own models, and
        :meth:`_apply_pending` applies it at the next round with the progress made meanwhile."""
        rule, overlap = self.rule, self.config.aggregation.overlap
        for name, members in self._groups().items():
            params = [get_flat_params(p.model) for p in members]
            weights = [round_weight(p.tokens_since_round) for p in members]
            if rule.strategy.border_dp == "flat" and self.border:
                new, momenta[name], anchors[name] = self._fedavg_round_with_border_dp(
                    members, params, weights, anchors[name], momenta.get(name))
            else:
                choices: list = []
                partners: list = []
                new, momenta[name], anchors[name] = region_round_with_anchor(
                    rule, params, weights, anchor=anchors[name], momentum=momenta.get(name),
                    loss_of=[self._loss_of(p, "region") for p in members], choices=choices, usage=[p.usage for p in members],
                    reuse=[self._reuse(p, "region") for p in members],
                    max_weight=max_round_weight(inner_steps=self.config.train.inner_steps,
                                                batch_size=self.config.train.batch_size,
                                                seq_len=self.config.train.seq_len),
                    names=[p.label for p in members], round_index=self._round, partners=partners)
                for k, (p, c) in enumerate(zip(members, choices)):
                    partner = partners[k] if k < len(partners) else None
                    # the slice loss of the model it keeps (overlapped: it keeps the model plus what
                    # it trains meanwhile, whose loss is not known)
                    p.tune_loss = c.loss if c is not None and not c.reused and not overlap else None
                    self._remember(p, "region", c)
                    if c is not None or (rule.evidence and len(members) > 1):  # no slice: took nothing
                        p.mixes.append(dict(round=self._round, kind="region", lam=c.lam if c else 0.0,
                                            gain=c.gain if c and math.isfinite(c.gain) else 0.0,
                                            **mix_parts_record(rule, c), **_reused(c),
                                            **({"partner": partner} if partner is not None else {})))
            for p, own, tensors in zip(members, params, new):
                if overlap:  # (the mixing search left trial parameters in the model)
                    self._pending[p.key] = (own, tensors)
                    set_params(p.model, own)
                else:
                    set_params(p.model, tensors)
                p.tokens_since_round = 0
            template = region_payload(rule, params[0], params[0])  # (the layout; what it weighs on the wire)
            payload = sum(compression.nominal_bytes(t.numel(), c) for t, c in zip(template, payload_codecs(rule, template)))
            n = len(members)
            for p in members:
                same = sum(1 for q in members if q.region == p.region)
                per_other = 2 * (payload // n) if n > 1 else 0
                p.bytes_sent_region += per_other * (same - 1)
                p.bytes_sent_border += per_other * (n - same)

    def _apply_pending(self) -> bool:
        """Apply the overlapped round computed at the last round boundary, one round stale
        (:func:`~worldlm_p2p.rounds.stale_apply`): every member's next model from its snapshot plus
        what it trained since. False when no round was pending."""
        if not self._pending:
            return False
        for p in self.peers:
            if p.key in self._pending:
                pre, new = self._pending[p.key]
                set_params(p.model, stale_apply(new, pre=pre, current=get_flat_params(p.model)))
        self._pending = {}
        return True

    def _noise(self, region: str, index: int) -> torch.Generator:
        """The border noise of ``region`` at round ``index``: seeded, so that a simulation repeats
        (a real leader draws its noise from a secret seed)."""
        seed = int.from_bytes(hashlib.sha256(f"{self.config.train.seed}/border/{region}/{index}".encode()).digest()[:8],
                              "little") >> 1
        return torch.Generator().manual_seed(seed)

    def _fedavg_round_with_border_dp(self, members, params, weights, anchor, momentum):
        pv = self.config.privacy
        by_region: dict[str, tuple[list, list]] = {}
        order: dict[str, list[int]] = {}
        for i, p in enumerate(members):
            by_region.setdefault(p.region, ([], []))[0].append(params[i])
            by_region[p.region][1].append(weights[i])
            order.setdefault(p.region, []).append(i)
        self._flat_rounds += 1
        out, new_m, agreed, recs = flat_round_with_border_dp(
            self.rule, by_region, anchor=anchor, momentum=momentum, clip=pv.border_clip,
            noise_multiplier=pv.border_noise, generators={r: self._noise(r, self._flat_rounds) for r in by_region})
        new: list = [None] * len(members)
        for r, idx in order.items():
            self.border[r].record(pv.border_noise)
            for i, model in zip(idx, out[r]):
                new[i] = model
        return new, new_m, agreed

    def _world_round(self, index: int, anchors: dict[str, list[torch.Tensor]]) -> None:
        rule = self.rule
        pv = self.config.privacy
        tokens = {r: float(max(1, sum(p.tokens_since_world for p in self.peers if p.region == r))) for r in self.regions}
        sent, released = {}, {}
        if self.border:
            for r in self.regions:
                sent[r], rec = border_release(rule, anchors[r], self.world_reference, clip=pv.border_clip,
                                              noise_multiplier=pv.border_noise, generator=self._noise(r, index))
                self.border[r].record(pv.border_noise)
                released[r] = dict(norm=rec.norm, clipped_norm=rec.clipped_norm, noise_std=rec.noise_std)
        leader_loss, held = None, {}
        if rule.residual_step_evidence:  # each leader scales its K's residual step by its tune slice
            leaders = {r: self._leader(r) for r in self.regions}
            leader_loss = {r: self._loss_of(p, "leader") for r, p in leaders.items()}
            held = {r: get_flat_params(p.model) for r, p in leaders.items()}
        result = world_round(rule, {r: anchors[r] for r in self.regions}, tokens, sent=sent, leader_loss=leader_loss)
        for r, params in held.items():  # (the search leaves trial parameters in the leader's model)
            set_params(self._leader(r).model, params)
        self.world_reference = [t.clone() for t in result.world]
        model_bytes = _nbytes(anchors[self.regions[0]])
        key_bytes = _nbytes(rule.split.take_key(anchors[self.regions[0]])) if rule.split.key else 0
        for r in self.regions:
            leader = self._leader(r)
            members = [p for p in self.peers if p.region == r]
            leader.bytes_sent_border += allreduce_traffic(_nbytes(anchors[r], wire=rule.config.compress_world),
                                                          len(self.regions))[0]
            if rule.residual_exchange and len(self.regions) > 1:
                # the published embedding, and the residual every region that fetched it downloaded
                # (world attention: of the whole model)
                n_res = len(rule.residual_part(anchors[r]))
                res_bytes = model_bytes if rule.world_attention else key_bytes
                leader.bytes_sent_border += n_res * rule.config.residual_dim * 4
                leader.bytes_sent_border += res_bytes * sum(r in need for need in result.fetched.values())
            # members rebase onto the world result: they add its change of the region model, as the leader
            # hands it down, to their own (with personal key layers a member's model is not the region's
            # anchor), and the region's anchor takes it whole
            delta = hand_down(rule, result.models[r], anchors[r])
            leader.bytes_sent_region += _nbytes(delta, wire=rule.config.compress_world) * (len(members) - 1)
            anchors[r] = [a + d for a, d in zip(anchors[r], delta)]
            for p in members:
                model, choice = member_world_mix(rule, own=get_flat_params(p.model), change=delta,
                                                 loss_of=self._loss_of(p, "world"), own_loss=p.tune_loss,
                                                 reuse=self._reuse(p, "world"), region_size=len(members))
                self._remember(p, "world", choice)
                p.tune_loss = None
                set_params(p.model, model)
                if rule.evidence and rule.config.mix_world:
                    p.mixes.append(dict(round=index, kind="world", lam=choice.lam if choice else 0.0,
                                        gain=choice.gain if choice and math.isfinite(choice.gain) else 0.0,
                                        **mix_parts_record(rule, choice), **_reused(choice)))
                p.tokens_since_world = 0
        self.world_rounds.append(dict(round=index, weights=result.weights, fetched=result.fetched,
                                      **(dict(steps=result.steps) if result.steps else {}),
                                      **(dict(released=released) if released else {})))

    def _world_round_due(self, r: int) -> bool:
        """Whether a world round follows region round ``r``: every ``world_every``-th, for a strategy
        with world rounds, when there are other regions to meet (a swarm's leader alone in the run
        holds none: :meth:`worldlm_p2p.peer.world.WorldRounds.count`)."""
        return self.rule.has_world_rounds and len(self.regions) > 1 and r % self.config.aggregation.world_every == 0

    def _overlapped_world_round(self, r: int, anchors: dict[str, list[torch.Tensor]]) -> None:
        """With ``overlap``: apply region round ``r`` (pending since its boundary), then its world
        round when one is due, as a swarm member counts a round towards world rounds once it has
        applied it."""
        if self._apply_pending() and self._world_round_due(r):
            self._world_round(r, anchors)

    def _personal_mixes(self, index: int) -> None:
        """``personal_model="separate"``: after region round ``index`` (and its world round) every
        member's personal model moves towards its shared model as far as its tune slice supports."""
        for p in self.peers:
            if p.personal is None:
                continue
            loss_of = None if p.data.tune.numel() < 2 else p.budget.counting(
                p.personal.tune_losses if self.rule.windowed else p.personal.tune_loss, p.data.tune.numel(), "personal")
            own = get_flat_params(p.personal.model)
            new, choice = personal_mix(self.rule, personal=own, shared=get_flat_params(p.model), loss_of=loss_of,
                                       reuse=self._reuse(p, "personal"))
            self._remember(p, "personal", choice)
            set_params(p.personal.model, new)
            p.mixes.append(dict(round=index, kind="personal", lam=choice.lam if choice else 0.0,
                                gain=choice.gain if choice and math.isfinite(choice.gain) else 0.0,
                                **mix_parts_record(self.rule.personal, choice), **_reused(choice)))

    # ------------------------------------------------------------------ evaluation
    def _evaluate(self, round_index: int) -> dict[str, Any]:
        peers: dict[str, dict[str, Any]] = {}
        for p in self.peers:
            if self.central is not None:
                set_params(p.model, get_flat_params(self.central_model))
            loss = p.held.evaluate()
            trainer = self.central if self.central is not None else p.trainer
            peers[p.key] = dict(region=p.region, loss=loss, perplexity=_perplexity(loss), epsilon=trainer.epsilon(),
                                bits_per_byte=bits_per_byte(loss, bytes_per_token=p.data.valid_bytes_per_token),
                                tokens=self._central_tokens if self.central is not None else p.tokens,
                                bytes_sent_region=p.bytes_sent_region,
                                bytes_sent_border=p.bytes_sent_border, **_mix_summary(p.mixes))
        regions = {}
        for r in self.regions:
            vals = [v for v in peers.values() if v["region"] == r]
            regions[r] = {k: sum(v[k] for v in vals) / len(vals) for k in ("loss", "perplexity", "bits_per_byte")}
            regions[r]["peers"] = len(vals)
            # the privacy the region spent at its border (None: no border DP)
            regions[r]["epsilon"] = self.border[r].epsilon() if r in self.border else None
            # the largest DP-SGD epsilon among its peers (None: no DP-SGD)
            eps = [v["epsilon"] for v in vals if v["epsilon"] is not None]
            regions[r]["peer_epsilon"] = max(eps) if eps else None
            if r in self.border:
                regions[r]["border_releases"] = self.border[r].releases
        world = {k: sum(v[k] for v in regions.values()) / len(regions) for k in ("loss", "perplexity", "bits_per_byte")}
        tokens = self._central_tokens if self.central is not None else sum(p.tokens for p in self.peers)
        snap = dict(round=round_index, tokens=tokens, regions=regions, world=world, peers=peers)
        logger.info("round %d: %d tokens, world perplexity %.3f (%s)", round_index, tokens, world["perplexity"],
                    ", ".join(f"{r} {v['perplexity']:.3f}" for r, v in regions.items()))
        return snap

    # ------------------------------------------------------------------ run
    def run(self) -> dict[str, Any]:
        cfg = self.config
        H = cfg.train.inner_steps
        t0 = time.monotonic()
        evals = set(cfg.eval_rounds) | {cfg.rounds}
        total = cfg.rounds * H * len(self.peers)
        self._central_tokens = 0
        if self.central is not None:
            step = 0
            for r in range(1, cfg.rounds + 1):
                for _ in range(H * len(self.peers)):
                    if self.should_stop():
                        raise KeyboardInterrupt
                    res = self.central.train_step(step)
                    step += 1
                    self._central_tokens += res.tokens
                self.on_progress(r * H * len(self.peers), total)
                if r in evals:
                    self.history.append(self._evaluate(r))
        else:
            anchors: dict[str, list[torch.Tensor]] = {}
            momenta: dict[str, Any] = {}
            if self.rule.strategy.averages:
                init = get_flat_params(self.peers[0].model)
                for name in list(self._groups()) + self.regions:
                    anchors[name] = [t.clone() for t in init]
            for r in range(1, cfg.rounds + 1):
                for i, p in enumerate(self.peers):
                    if self.should_stop():
                        raise KeyboardInterrupt
                    p.tune_loss = None  # it trains on: its slice loss is no longer known
                    for _ in range(H):
                        res = p.trainer.train_step(p.step)
                        p.step += 1
                        p.tokens += res.tokens
                        p.tokens_since_round += res.tokens
                        p.tokens_since_world += res.tokens
                        if p.personal is not None:  # the same batch (a pure function of the step)
                            res = p.personal.train_step(p.step - 1)
                        p.last_train_loss = res.loss  # the held model's, as a swarm peer reports it
                    self.on_progress((r - 1) * H * len(self.peers) + (i + 1) * H, total)
                self._round = r
                if self.rule.strategy.averages and cfg.aggregation.overlap:
                    # the last round's result arrives now; then this round starts on a snapshot (the
                    # last one is applied at once: nothing trains after it)
                    self._overlapped_world_round(r - 1, anchors)
                    self._region_rounds(anchors, momenta)
                    if r == cfg.rounds:
                        self._overlapped_world_round(r, anchors)
                elif self.rule.strategy.averages:
                    self._region_rounds(anchors, momenta)
                    if self._world_round_due(r):
                        self._world_round(r, anchors)
                if self.rule.separate_personal:
                    self._personal_mixes(r)
                if r in evals:
                    self.history.append(self._evaluate(r))
        final = self.history[-1]
        return dict(
            strategy=cfg.aggregation.strategy,
            config=dict(data=str(cfg.data), rounds=cfg.rounds, model=dataclasses.asdict(cfg.model),
                        tokenizer=dataclasses.asdict(cfg.tokenizer), train=dataclasses.asdict(cfg.train),
                        aggregation=dataclasses.asdict(cfg.aggregation), privacy=dataclasses.asdict(cfg.privacy),
                        device=str(self.device)),
            parameters=sum(t.numel() for t in get_flat_params(self.peers[0].model)),
            key_layers=list(self.rule.split.key_names) if self.rule is not None and self.rule.split else [],
            regions=final["regions"], world=final["world"], peers=final["peers"], tokens=final["tokens"],
            history=self.history, world_rounds=self.world_rounds, wall_seconds=time.monotonic() - t0,
            mixes={p.key: p.mixes for p in self.peers if p.mixes},
        )


def _reused(choice: MixChoice | None) -> dict[str, bool]:
    """A mix record's mark when its weights were reused, not searched (aggregation.evidence_share)."""
    return {"reused": True} if choice is not None and choice.reused else {}


def _mix_summary(mixes: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean mixing weight a peer chose in region and world rounds, and how often it took any."""
    out: dict[str, Any] = {}
    for kind in ("region", "world", "personal"):
        lams = [m["lam"] for m in mixes if m["kind"] == kind]
        if lams:
            out[f"mix_{kind}"] = dict(mean_lam=sum(lams) / len(lams), taken=sum(1 for x in lams if x > 0),
                                      rounds=len(lams))
    return out


def simulate(config: SimConfig, *, on_progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Build a :class:`Simulator` and run it; return the results dictionary."""
    return Simulator(config, on_progress=on_progress).run()


def _finite(obj: Any) -> Any:
    """Standard JSON: a NaN or infinite number (e.g. a peer without held-out text) becomes null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_results(results: dict[str, Any], path: str | Path) -> Path:
    """Write ``results`` as JSON atomically (NaN and infinities as null)."""
    import json
    import os

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(_finite(results), indent=2, allow_nan=False))
    os.replace(tmp, path)
    return path
