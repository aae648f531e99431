"""What a region round and a world round compute, for every strategy (pure: imports torch only).

The swarm and the simulator share these functions; only the averaging differs (a hivemind
all-reduce in the swarm, :func:`group_average` in the simulator and in tests: the same robust rule,
:mod:`worldlm_p2p.robust`, that every reducer of the swarm's all-reduce applies). A round is three
steps:

1. :func:`region_payload`: what a member puts into the all-reduce (weight: its tokens);
2. the all-reduce: the run's robust rule over the group (``aggregation.robust``: by default the
   weighted mean of the values clipped around the members' median; ``"mean"``:
   ``sum_i w_i x_i / sum_i w_i``);
3. :func:`region_step`: turn the averaged payload into the region's agreed model and the member's
   next model; with ``worldlm``'s evidence mixing, :func:`member_mix` then moves the member's own
   model towards the agreed one as far as its tune slice supports (and :func:`member_world_mix`
   takes a world round's change the same way). With ``aggregation.overlap`` the round is computed
   on a snapshot while training goes on, and :func:`stale_apply` adds the progress made meanwhile.

What each strategy averages, where, and what crosses borders is a
:class:`~worldlm_p2p.strategies.Strategy` (the table is in :mod:`worldlm_p2p.strategies`); the
functions below ask it, never a strategy's name. The settings are the run's
:class:`~worldlm_p2p.config.AggregationConfig`, held by :class:`RoundRule`.

World rounds (``worldlm`` and ``hierfavg``, every ``world_every`` region rounds, leaders only):
:func:`world_payload` / :func:`world_apply` (the leaders' all-reduce of B, and K for the world
reference) and, for ``worldlm``, the residual-embedding exchange (:mod:`.residual`): of K, with the
world's mean backbone adopted (``world_target = "mean"``), or of the whole model, each region moving
towards the regions nearest to it (``"attention"``, :func:`worldlm_p2p.residual.region_attention`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from worldlm_p2p import attention, compression, mixing, privacy, residual, robust
from worldlm_p2p.aggregation import weighted_mean
from worldlm_p2p.config import AggregationConfig
from worldlm_p2p.outer_optim import outer_update
from worldlm_p2p.split import ParamSplit
from worldlm_p2p.strategies import Strategy
from worldlm_p2p.strategies import strategy as strategy_of

FETCH_MIN_WEIGHT = 1e-3  # a leader fetches another region's full residual only above this weight
EVIDENCE_GRID = mixing.DEFAULT_GRID  # the mixing weights a member tries on its tune slice
#: the smallest region round in which a member's tune slice chooses its shared model's backbone:
#: among its pairs with mates (``region_backbone = "partners"``) and, with ``shared_model =
#: "evidence-world"``, how much of a world change it takes. In a smaller round a member has at most
#: one mate, whose pair is the region's mean, and the region no backbone of its own beside the world's.
SEVERAL = 3
#: ... and for a world round's change: by default at most a quarter of it per world round
#: (``aggregation.mix_world_max``). The world's model is usually far from a member's (other
#: languages); a large jump chosen on one round's evidence (say while the member's own loss spikes)
#: derails the member's training for many steps (measured: zh_wiki of the scripts corpus, 54 against
#: 35 at the short budget), while repeated quarter steps still close the gap to a world that helps.
WORLD_GRID = (1 / 16, 1 / 4)


def world_grid(max_step: float) -> tuple[float, ...]:
    """The points of :data:`EVIDENCE_GRID` up to ``max_step``, and ``max_step`` itself: the fractions
    of a world change a member tries (0.25 gives :data:`WORLD_GRID`, 1.0 the region's grid)."""
    if not 0 < max_step <= 1:
        raise ValueError(f"the largest world step must lie in (0, 1], got {max_step}")
    return tuple(sorted({x for x in EVIDENCE_GRID if x <= max_step} | {float(max_step)}))

#: the choice of a shared model that adopts a round whole (:attr:`RoundRule.shared_adopts`): no search
ADOPTED = mixing.MixChoice(lam=1.0, loss=math.nan, own_loss=math.nan, evaluated=())

#: a member's tune-slice loss of a parameter list (nats per token; per window with ``mix_z > 0``,
#: :data:`worldlm_p2p.mixing.Loss`)
LossOf = Callable[[list[torch.Tensor]], "mixing.Loss"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RoundRule:
    """What a round needs: the run's aggregation settings (their one definition,
    :class:`~worldlm_p2p.config.AggregationConfig`, with its defaults: the ones that ship), the split
    of the model's parameters into B and K, and the seed of the residual sketches."""

    config: AggregationConfig
    split: ParamSplit
    seed: int = 0

    @classmethod
    def of(cls, split: ParamSplit, *, seed: int = 0, **settings) -> "RoundRule":
        """A rule of the shipped defaults with ``settings`` (fields of :class:`AggregationConfig`) changed."""
        return cls(config=AggregationConfig(**settings), split=split, seed=seed)

    @classmethod
    def from_config(cls, agg: AggregationConfig, split: ParamSplit, *, seed: int) -> "RoundRule":
        return cls(config=agg, split=split, seed=seed)

    @property
    def strategy(self) -> Strategy:
        return strategy_of(self.config.strategy)

    @property
    def localises(self) -> bool:
        """True when K is handled apart from B."""
        return self.strategy.localises

    @property
    def evidence(self) -> bool:
        """True when members mix by evidence on a tune slice (:mod:`worldlm_p2p.mixing`)."""
        return self.strategy.mixes and self.config.mix == "evidence"

    @property
    def backbone_partners(self) -> bool:
        """True when a member's model after a region round of three or more members takes the
        backbone its tune slice prefers among the region's and pairs with its mates
        (``region_backbone = "partners"``: :func:`partner_target`). Not for a shared model that
        adopts the region's agreed model whole (:attr:`shared_adopts`)."""
        return (self.evidence and self.localises and self.config.region_backbone == "partners"
                and not self.shared_adopts)

    @property
    def personal_key_only(self) -> bool:
        """True when a member's evidence mix covers only the key layers (``personal_scope="key"``):
        it adopts the backbone its region agreed on (and the world's change of it) whole, so that
        every member of the run trains one backbone, and keeps of the agreed key layers only what its
        tune slice supports (DEPT's localised embeddings, arXiv 2410.05402, with ``key_layers =
        "embed_head"``)."""
        return self.evidence and self.localises and (self.config.personal_scope == "key" or self.separate_personal)

    @property
    def separate_personal(self) -> bool:
        """True when every member trains a personal model apart from the shared one that takes part
        in the rounds (``personal_model="separate"``): the shared model then follows the rounds of
        :attr:`personal_key_only`, and the personal model mixes towards it by :func:`personal_mix`."""
        return self.evidence and self.localises and self.config.personal_model == "separate"

    @property
    def shared_adopts(self) -> bool:
        """True when a separate personal model's shared model adopts the region's agreed model and
        every world change whole, key layers included (``shared_model="agreed"``): WorldLM's member,
        on which the region's attentive key layers and the leaders' residual exchange act unfiltered;
        only the personal model mixes by evidence."""
        return self.separate_personal and self.config.shared_model == "agreed"

    @property
    def shared_world_evidence(self) -> bool:
        """True when a separate personal model's shared model, in a region of :data:`SEVERAL`
        members or more, takes a world change's backbone only as far as its tune slice supports, up
        to the whole change (``shared_model="evidence-world"``), as it takes the key layers' (up to
        ``mix_world_max``): the region's next round then averages what its members took, a
        region-level step towards the world made of its members' evidence
        (:func:`member_world_mix`)."""
        return self.separate_personal and self.config.shared_model == "evidence-world" and self.config.mix_world

    @property
    def filters_world_key(self) -> bool:
        """True when a member's models take a world change's key layers only as far as its tune slice
        supports (:func:`member_world_mix`: evidence mixing of world changes, and a shared model
        that does not adopt them whole), so that an honest change of K that does not suit this
        member costs it nothing (:func:`world_change_refused`)."""
        return self.evidence and self.config.mix_world and not self.shared_adopts

    @property
    def personal(self) -> "RoundRule":
        """The rule of a separate personal model's mix: this rule with one model per member
        (``personal_model="inline"``), so that :func:`member_mix` mixes by ``personal_scope``."""
        return RoundRule(config=dataclasses.replace(self.config, personal_model="inline"), split=self.split,
                         seed=self.seed)

    @property
    def mixes_by_part(self) -> bool:
        """True when a member's evidence mix takes the backbone and the key layers each by its own
        line search (``personal_scope="parts"``; :func:`worldlm_p2p.mixing.mix_parts`): the backbone
        first, then the key layers, so that a member can take its region's (and the world's)
        backbone while it keeps key layers of its own, or the reverse. Of a world change the
        backbone's may be taken whole (the region's grid: the backbone is what every region shares,
        and members that keep one backbone average coherent updates), the key layers' at most
        ``mix_world_max`` (:func:`world_grid`)."""
        return (self.evidence and self.localises and self.config.personal_scope == "parts"
                and not self.separate_personal)

    def part_steps(self, change: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        """``change`` as two steps of disjoint parts: the backbone's (zeros on K), the key layers'
        (zeros on B)."""
        zero_b = [torch.zeros_like(d) for d in self.split.take_backbone(change)]
        zero_k = [torch.zeros_like(d) for d in self.split.take_key(change)]
        return [self.split.merge(list(self.split.take_backbone(change)), zero_k),
                self.split.merge(zero_b, list(self.split.take_key(change)))]

    @property
    def windowed(self) -> bool:
        """True when the evidence is per-window losses (``mix_z > 0``: the significance test);
        a member's loss function is then the trainer's ``tune_losses``, otherwise ``tune_loss``."""
        return self.evidence and self.config.mix_z > 0

    @property
    def world_group(self) -> bool:
        """True when region rounds span every peer of the run (one world group)."""
        return self.strategy.world_group

    @property
    def has_world_rounds(self) -> bool:
        return self.strategy.has_world_rounds

    @property
    def residual_exchange(self) -> bool:
        """True when world rounds exchange residual embeddings (the strategy's and ``residual`` on)."""
        return self.strategy.residual_exchange and self.config.residual

    @property
    def world_attention(self) -> bool:
        """True when a world round moves each region towards the regions whose residual sketches are
        most like its own (:func:`worldlm_p2p.residual.region_attention`), over the whole model,
        instead of adopting the world's mean backbone and exchanging only K's residuals."""
        return self.residual_exchange and self.config.world_target == "attention"

    @property
    def residual_step_evidence(self) -> bool:
        """True when a region's leader scales its K's residual step by its own tune slice
        (:func:`leader_residual_step`): the ``partners`` form of the residual exchange with
        evidence mixing, whose step towards other regions can be large."""
        return (self.residual_exchange and not self.world_attention and self.evidence
                and self.config.residual_attention == "partners")

    @property
    def usage_rows(self) -> bool:
        """True when the attentive key layers are weighted per row by the members' token usage
        (``usage_rows``; :func:`worldlm_p2p.attention.row_priors`)."""
        return self.strategy.attentive and self.config.usage_rows

    def residual_part(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors whose residual a world round exchanges: K, or the whole model with
        :attr:`world_attention`."""
        return list(tensors) if self.world_attention else self.split.take_key(tensors)

    def backbone(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return self.split.take_backbone(tensors) if self.localises else list(tensors)


# ------------------------------------------------------------------------------ region rounds


def payload_codecs(rule: RoundRule, payload: Sequence[torch.Tensor]) -> list[str]:
    """The wire codec of each tensor of a region payload (:func:`region_payload`'s layout), as it
    travels (:func:`worldlm_p2p.compression.effective_codec`): the backbone's change in
    ``compress_backbone``; for an attentive strategy the key layers' encoded change in
    ``compress_key`` and the attention denominators, last, in float32.

    With attention (any form but ``"mean"``) the key layers' encoded change is ``u (K - K_ref)``, and
    ``u = exp(score)`` spans ``[exp(MIN_SCORE), 1]``: in fp16, whose smallest normal number is 6e-5,
    a member whose key layers moved by more than about ten times ``tau`` of their norm would send zeros
    (and the group's numerator would round to zero while its float32 denominator did not, freezing
    the region's K at its anchor), so ``compress_key = "fp16"`` carries that change in float32. The
    same holds for per-row weights (``usage_rows``): a member's prior on a token it never saw is
    ``1 / (total + V)``, about 1e-6 for a million tokens of text, which times a change of 1e-2 is
    below fp16's smallest subnormal. The 8-bit codec scales each tensor to its own spread and keeps
    it."""
    n_b = len(rule.split.backbone) if rule.localises else len(rule.split.names)
    codecs = [rule.config.compress_backbone] * n_b
    if rule.strategy.attentive:
        key_codec = rule.config.compress_key
        if key_codec == "fp16" and (rule.config.attention != "mean" or rule.usage_rows):
            key_codec = "none"
        codecs += [key_codec] * len(rule.split.key) + ["none"]
    if len(codecs) != len(payload):
        raise ValueError(f"a payload of {len(payload)} tensors, expected {len(codecs)}")
    return [compression.effective_codec(c, t.numel()) for c, t in zip(codecs, payload)]


def group_average(rule: RoundRule, payloads: Sequence[Sequence[torch.Tensor]], weights: Sequence[float], *,
                  max_weight: float | None = None, codecs: Sequence[str] | None = None) -> list[torch.Tensor]:
    """What the group's all-reduce computes from its members' ``payloads``: the run's robust rule
    (:func:`worldlm_p2p.robust.robust_mean_of_lists`), weights capped at ``max_weight``. With
    ``codecs`` (a region round's: :func:`payload_codecs`), each payload as it arrives
    (:func:`worldlm_p2p.compression.roundtrip`) and the aggregate as every member receives it
    (encoded once more)."""
    sent = [compression.roundtrip_all(p, codecs) for p in payloads] if codecs is not None else payloads
    out, _ = robust.robust_mean_of_lists(sent, weights, rule=rule.config.robust, clip=rule.config.robust_clip,
                                         max_weight=max_weight)
    return compression.roundtrip_all(out, codecs) if codecs is not None else out


def region_average(rule: RoundRule, payloads: Sequence[Sequence[torch.Tensor]], weights: Sequence[float], *,
                   max_weight: float | None = None) -> list[torch.Tensor]:
    """A region round's all-reduce: :func:`group_average` with the run's wire codecs."""
    return group_average(rule, payloads, weights, max_weight=max_weight,
                         codecs=payload_codecs(rule, payloads[0]) if payloads else None)


def region_payload(rule: RoundRule, params: Sequence[torch.Tensor], anchor: Sequence[torch.Tensor], *,
                   usage: torch.Tensor | None = None) -> list[torch.Tensor]:
    """A member's all-reduce payload: its change since the round's ``anchor`` (the outer gradient,
    up to sign) of B (or the whole model), then the encoded change of K for ``worldlm``
    (:func:`worldlm_p2p.attention.encode_key_layers`). Every member of a round holds the same anchor,
    so the average of the changes plus the anchor is the average of the models; changes are small
    numbers that the wire can carry in 16 or 8 bits (:mod:`worldlm_p2p.compression`).
    With :attr:`RoundRule.usage_rows`, ``usage`` is the member's token counts
    (:func:`worldlm_p2p.attention.token_usage`; None: it shares none) and K's weights are per row."""
    if not rule.strategy.averages:
        raise ValueError(f"strategy {rule.strategy.name} never averages")
    out = [p.detach().to(torch.float32) - a.detach().to(torch.float32)
           for p, a in zip(rule.backbone(params), rule.backbone(anchor))]
    if rule.strategy.attentive:
        key_anchor = rule.split.take_key(anchor)
        priors = attention.row_priors(key_anchor, usage) if rule.usage_rows else None
        out += attention.encode_key_layers(rule.split.take_key(params), key_anchor, form=rule.config.attention,
                                           tau=rule.config.tau, priors=priors)
    return out


def region_step(rule: RoundRule, averaged: Sequence[torch.Tensor], *, params: Sequence[torch.Tensor],
                anchor: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor] | None
                ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None]:
    """``(member's next model, region's next agreed model, outer momentum)`` from the averaged
    payload. The agreed model is the next round's common reference, what late joiners download and
    what the region exports. The member's model equals it, except for ``fedper``'s own K and, for
    worldlm, with ``mix="cosine"`` the member's personal mix of K (``personal_scope="key"``) or of
    the whole model (``"all"``), and with ``mix="evidence"`` the member's own model ``params``
    (unchanged: the caller mixes it towards the agreed model with :func:`member_mix`)."""
    n_b = len(rule.backbone(anchor))
    if len(averaged) < n_b:
        raise ValueError(f"averaged payload has {len(averaged)} tensors, fewer than the {n_b} of the backbone")
    mean_b = [a.detach().to(torch.float32) + d for a, d in zip(rule.backbone(anchor), averaged[:n_b])]
    new_b, new_m = outer_update(rule.backbone(anchor), mean_b, momentum, kind=rule.config.outer,
                                lr=rule.config.outer_lr, mu=rule.config.outer_momentum)
    new_b = [b.to(a.dtype) for b, a in zip(new_b, rule.backbone(anchor))]
    if not rule.localises:
        return new_b, [t.clone() for t in new_b], new_m
    if rule.strategy.personal_key:
        model = rule.split.merge(new_b, [p.detach().clone() for p in rule.split.take_key(params)])
        return model, [t.clone() for t in model], new_m
    agreed_k = attention.decode_key_layers(averaged[n_b:], rule.split.take_key(anchor), eps=rule.config.eps,
                                           rows=rule.usage_rows)
    agreed = rule.split.merge(new_b, agreed_k)
    if rule.evidence:
        return [p.detach().clone() for p in params], agreed, new_m
    if rule.config.mix != "cosine":
        return [t.clone() for t in agreed], agreed, new_m
    own_k = attention.personalize(rule.split.take_key(params), rule.split.take_key(anchor), agreed_k,
                                  tau=rule.config.personal_tau)
    own_b = new_b if rule.config.personal_scope == "key" else attention.personalize(
        rule.split.take_backbone(params), rule.split.take_backbone(anchor), new_b, tau=rule.config.personal_tau)
    return rule.split.merge(own_b, own_k), agreed, new_m


def region_apply(rule: RoundRule, averaged: Sequence[torch.Tensor], *, params: Sequence[torch.Tensor],
                 anchor: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor] | None
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """The member's next model and the outer momentum (:func:`region_step` without the agreed model)."""
    model, _, new_m = region_step(rule, averaged, params=params, anchor=anchor, momentum=momentum)
    return model, new_m


def stale_apply(new: Sequence[torch.Tensor], *, pre: Sequence[torch.Tensor], current: Sequence[torch.Tensor]
                ) -> list[torch.Tensor]:
    """An overlapped round's result, applied one round stale (``aggregation.overlap``): the member's
    next model ``new``, computed from its snapshot ``pre`` while training went on to ``current``,
    plus the local progress ``current - pre`` made meanwhile, in float32 and then in the model's
    dtype. With nothing trained meanwhile (``current == pre``) it is ``new``, the synchronous round."""
    if not (len(new) == len(pre) == len(current)):
        raise ValueError(f"stale_apply: {len(new)} new, {len(pre)} snapshot and {len(current)} current tensors")
    return [(n.detach().to(torch.float32) + (c.detach().to(torch.float32) - p.detach().to(torch.float32))).to(c.dtype)
            for n, p, c in zip(new, pre, current)]


def member_mix(rule: RoundRule, *, own: Sequence[torch.Tensor], agreed: Sequence[torch.Tensor],
               loss_of: LossOf | None, own_loss: float | None = None, reuse: mixing.MixChoice | None = None
               ) -> tuple[list[torch.Tensor], mixing.MixChoice | None]:
    """With ``mix="evidence"``: the member's next model after a region round, its own model moved
    towards the region's agreed model as far as its tune-slice loss ``loss_of`` supports
    (:func:`worldlm_p2p.mixing.mix_toward`), and the choice. By ``personal_scope``: one weight for
    the whole model (``"all"``), one for the backbone and then one for the key layers (``"parts"``,
    the default; :func:`worldlm_p2p.mixing.mix_parts`), or the agreed backbone whole and a weight
    for the key layers (``"key"``). A member without a tune slice (``loss_of`` None) has no evidence
    and keeps its own model (with ``"key"``: its own key layers on the agreed backbone).
    ``own_loss``: the slice loss of ``own`` when already known. ``reuse``: an earlier search's
    choice whose weights are taken again without a search (:class:`worldlm_p2p.mixing.EvidenceBudget`),
    the model built exactly as a search that chose them builds it."""
    if not rule.evidence:
        raise ValueError(f"member_mix is the evidence rule; this rule mixes by {rule.config.mix!r}")
    if rule.shared_adopts:  # the shared model is the region's agreed model
        return [t.detach().clone() for t in agreed], ADOPTED
    if rule.personal_key_only:  # the member adopts the region's backbone and mixes its own key layers
        own = rule.split.merge([t.detach().clone() for t in rule.split.take_backbone(agreed)],
                               [t.detach().clone() for t in rule.split.take_key(own)])
        own_loss = None
    if loss_of is None:
        return [t.detach().clone() for t in own], None
    if rule.mixes_by_part:
        change = [a.detach().to(torch.float32) - o.detach().to(torch.float32) for a, o in zip(agreed, own)]
        return mixing.mix_parts(own, rule.part_steps(change), loss_of, grids=(EVIDENCE_GRID, EVIDENCE_GRID),
                                own_loss=own_loss, z=rule.config.mix_z, fixed=_fixed_parts(reuse))
    return mixing.mix_toward(own, agreed, loss_of, grid=EVIDENCE_GRID, own_loss=own_loss, z=rule.config.mix_z,
                             fixed=None if reuse is None else reuse.lam)


def _fixed_parts(reuse: mixing.MixChoice | None) -> tuple[float, float] | None:
    """A reused choice's two weights for :func:`worldlm_p2p.mixing.mix_parts` (None: search)."""
    if reuse is None:
        return None
    return reuse.lam, reuse.second_lam if reuse.second_lam is not None else 0.0


def personal_mix(rule: RoundRule, *, personal: Sequence[torch.Tensor], shared: Sequence[torch.Tensor],
                 loss_of: LossOf | None, own_loss: float | None = None, reuse: mixing.MixChoice | None = None
                 ) -> tuple[list[torch.Tensor], mixing.MixChoice | None]:
    """A member's personal model after a round (``personal_model="separate"``): its ``personal``
    model moved towards its ``shared`` model (the one that takes part in the rounds, after the
    round) as far as its tune-slice loss ``loss_of`` supports, by ``personal_scope``: the backbone
    and then the key layers each by its own line search (``"parts"``), or one weight (``"all"``).
    The shared model is the member's own: trained on the same batches as the personal one, averaged
    with its region (and the world) every round. A member whose shared model does not help it keeps
    its personal model, which is then its model trained alone; without a slice (``loss_of`` None)
    it always keeps it. ``reuse``: as in :func:`member_mix`."""
    if not rule.separate_personal:
        raise ValueError("personal_mix is the rule of a separate personal model (personal_model=\"separate\")")
    return member_mix(rule.personal, own=personal, agreed=shared, loss_of=loss_of, own_loss=own_loss, reuse=reuse)


def mix_parts_record(rule: RoundRule, choice: mixing.MixChoice | None) -> dict[str, float]:
    """What a mix record adds with ``personal_scope="parts"``: ``key_lam``, the key layers' weight
    (``lam`` is then the backbone's); nothing otherwise."""
    if not rule.mixes_by_part:
        return {}
    return {"key_lam": float(choice.second_lam) if choice is not None and choice.second_lam is not None else 0.0}


def member_world_mix(rule: RoundRule, *, own: Sequence[torch.Tensor], change: Sequence[torch.Tensor],
                     loss_of: LossOf | None, own_loss: float | None = None, reuse: mixing.MixChoice | None = None,
                     region_size: int | None = None) -> tuple[list[torch.Tensor], mixing.MixChoice | None]:
    """A member's model after its region adopts a world round's ``change`` of the region's model
    (the region's agreed model always takes the whole change). With ``mix="evidence"`` and
    ``mix_world`` the member adds ``lam * change``, ``lam`` from its tune slice (no slice: 0);
    otherwise the whole change (rebasing: the local progress made meanwhile is kept). The evidence
    search tries at most ``mix_world_max`` of the change (:func:`world_grid`; by default a
    quarter, :data:`WORLD_GRID`); with ``personal_scope="parts"`` that bounds the key layers' part,
    and the backbone's may be taken whole; with ``"key"`` the backbone's part is added whole. A
    shared model that adopts (:attr:`RoundRule.shared_adopts`) adds the whole change. With
    :attr:`RoundRule.shared_world_evidence` and ``region_size`` (the members of its last region
    round; None: as many as it takes) of :data:`SEVERAL` or more, the backbone's part too by
    evidence, up to the whole change (a smaller region has no backbone of its own to keep: its
    shared model takes the world's whole, as by default). ``reuse``: as in :func:`member_mix`; a
    choice of the other form (two weights by parts where this call makes one, or the reverse: the
    region's size crossed :data:`SEVERAL` since) is not reused, the weights are searched."""
    if rule.shared_adopts:
        return [t + d.to(t.dtype) for t, d in zip(own, change)], ADOPTED
    world_evidence = rule.shared_world_evidence and loss_of is not None and (region_size is None or
                                                                              region_size >= SEVERAL)
    if reuse is not None and (reuse.second_lam is not None) != (world_evidence or rule.mixes_by_part):
        reuse = None
    if world_evidence:
        # the backbone up to the whole change, the key layers up to mix_world_max
        return mixing.mix_parts(own, rule.part_steps(change), loss_of,
                                grids=(EVIDENCE_GRID, world_grid(rule.config.mix_world_max)), own_loss=own_loss,
                                z=rule.config.mix_z, fixed=_fixed_parts(reuse))
    if rule.evidence and rule.config.mix_world:
        if rule.personal_key_only:  # the whole change of the backbone, the key layers' by evidence
            backbone_step, change = rule.part_steps(change)
            own, own_loss = mixing.shift(own, backbone_step, 1.0), None
        if loss_of is None:
            return [t.detach().clone() for t in own], None
        if rule.mixes_by_part:  # the shared backbone up to the whole change, the key layers up to mix_world_max
            return mixing.mix_parts(own, rule.part_steps(change), loss_of,
                                    grids=(EVIDENCE_GRID, world_grid(rule.config.mix_world_max)), own_loss=own_loss,
                                    z=rule.config.mix_z, fixed=_fixed_parts(reuse))
        return mixing.mix_change(own, change, loss_of, grid=world_grid(rule.config.mix_world_max), own_loss=own_loss,
                                 z=rule.config.mix_z, fixed=None if reuse is None else reuse.lam)
    return [t + d.to(t.dtype) for t, d in zip(own, change)], None


#: the name of the region's agreed backbone among a member's candidates (:func:`partner_candidates`)
REGION_CANDIDATE = "region"
#: the name of the member's own backbone (the one it sent) among its candidates, with
#: ``partner_check = "self"``: a yardstick, never taken (:func:`choose_backbone`)
SELF_CANDIDATE = "self"
#: the name of the member's own backbone half and half with the region's among its candidates, with
#: ``partner_own_half`` (:func:`partner_candidates`)
OWN_HALF_CANDIDATE = "own-half"


def sent_backbone(rule: RoundRule, payload: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The backbone part of a member's region payload (:func:`region_payload`) as it travels: its
    change of the backbone since the round's anchor after one encode and decode in the round's
    codec (float32). With ``region_backbone = "partners"`` a member serves this to its mates, and
    its own pair candidates use it, so a pair's mean is made of what the all-reduce averaged."""
    n_b = len(rule.split.backbone) if rule.localises else len(rule.split.names)
    codecs = payload_codecs(rule, payload)[:n_b]
    return compression.roundtrip_all(list(payload[:n_b]), codecs)


def partner_mates(mates: Sequence[str], *, cap: int, round_index: int) -> list[str]:
    """Which of a member's region ``mates`` it evaluates as partners this round: all of them when
    there are at most ``cap``; otherwise ``cap`` consecutive ones of the mates sorted by name, the
    window moving on by ``cap`` every round (wrapping around), so that every mate is tried within
    ``ceil(len(mates) / cap)`` rounds. The order the mates are given in does not matter."""
    if cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    ordered = sorted(set(mates))
    if len(ordered) <= cap:
        return ordered
    start = (int(round_index) * cap) % len(ordered)
    return [ordered[(start + k) % len(ordered)] for k in range(cap)]


def partner_candidates(rule: RoundRule, *, anchor: Sequence[torch.Tensor], own: Sequence[torch.Tensor],
                       mates: Mapping[str, Sequence[torch.Tensor]], agreed: Sequence[torch.Tensor]
                       ) -> dict[str, list[torch.Tensor]]:
    """A member's candidate backbones after a region round (``region_backbone = "partners"``):
    :data:`REGION_CANDIDATE`, the region's agreed backbone (taken from the agreed model ``agreed``),
    and for each mate ``j`` of ``mates`` the pair ``anchor + (own + sent_j) / 2``, where ``own`` and
    ``sent_j`` are the backbone changes the member and the mate sent into the round
    (:func:`sent_backbone`), in float32 and then in the anchor's dtype; with ``partner_check =
    "self"`` also :data:`SELF_CANDIDATE`, ``anchor + own``; with ``partner_own_half`` also
    :data:`OWN_HALF_CANDIDATE`, ``anchor + (own + (region - anchor)) / 2``. Half and half, whatever
    the tokens either claims: a pair is a candidate that the member's tune slice judges, and a mate
    cannot weigh itself in. A mate whose change does not fit the backbone (another number or shape
    of tensors, or values that are not finite) raises ValueError: check with
    :func:`check_sent_backbone` first."""
    base = rule.backbone(anchor)
    if len(own) != len(base):
        raise ValueError(f"the member's own change has {len(own)} tensors, the backbone {len(base)}")
    out = {REGION_CANDIDATE: [t.detach().clone() for t in rule.backbone(agreed)]}
    if rule.config.partner_check == "self":
        out[SELF_CANDIDATE] = [(a.detach().to(torch.float32) + o.detach().to(torch.float32)).to(a.dtype)
                               for a, o in zip(base, own)]
    if rule.config.partner_own_half:
        out[OWN_HALF_CANDIDATE] = [(a.detach().to(torch.float32) + 0.5 * (o.detach().to(torch.float32) + (
            g.detach().to(torch.float32) - a.detach().to(torch.float32)))).to(a.dtype)
                                   for a, o, g in zip(base, own, out[REGION_CANDIDATE])]
    for name in sorted(mates):
        if name in (REGION_CANDIDATE, SELF_CANDIDATE, OWN_HALF_CANDIDATE):
            raise ValueError(f"{name!r} names a member's own candidate, not a mate")
        problem = check_sent_backbone(rule, anchor, mates[name])
        if problem:
            raise ValueError(f"mate {name}: {problem}")
        out[name] = [(a.detach().to(torch.float32) + 0.5 * (o.detach().to(torch.float32) + m.detach().to(torch.float32))
                      ).to(a.dtype) for a, o, m in zip(base, own, mates[name])]
    return out


def check_sent_backbone(rule: RoundRule, anchor: Sequence[torch.Tensor], sent: Sequence[torch.Tensor]) -> str:
    """Why a backbone change a mate served cannot be used ('' when it can): the number of tensors,
    a shape, or a value that is not finite."""
    base = rule.backbone(anchor)
    if len(sent) != len(base):
        return f"{len(sent)} tensors, the backbone has {len(base)}"
    for i, (t, a) in enumerate(zip(sent, base)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(a.shape):
            return f"tensor {i} has shape {tuple(getattr(t, 'shape', ()))}, the backbone's is {tuple(a.shape)}"
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            return f"tensor {i} is not finite floating-point numbers"
    return ""


#: how far what a mate serves may lie from what this peer's reducer saw it send, per codec of the
#: backbone's tensors: element-wise codecs (``none``, ``fp16``) decode the same values on both sides;
#: ``int8`` scales each part of the all-reduce on its own and the served tensor whole, so the two
#: decodings differ by a quantisation step, and where a part saturates by more (relative
#: root-mean-square difference: about 0.02 for Gaussian changes, up to 0.15 with heavy tails): under
#: ``int8`` the check catches another change or a scaled one, not a small edit
SERVED_TOLERANCE = {"none": 1e-6, "fp16": 1e-6, "int8": 0.5}


def served_mismatch(served: Sequence[torch.Tensor], seen: tuple[torch.Tensor, torch.Tensor], *,
                    codecs: Sequence[str]) -> str:
    """Why the backbone change a mate served (``served``: :func:`sent_backbone`'s layout) is not the
    one it sent into the round's all-reduce ('' when it is, or when nothing can be compared).
    ``seen`` is what this peer's reducer kept of the mate's parts: positions in the round's payload
    flattened in order (:func:`region_payload`; the backbone comes first) and the values it decoded
    there. Only positions inside the backbone are compared, each tensor's by the tolerance of its
    ``codecs`` entry (:data:`SERVED_TOLERANCE`: the relative root-mean-square difference of the
    compared values). A mate can serve one change and send another; this spot check holds it to what
    it sent on the span this peer reduced, at positions it cannot know."""
    positions, values = seen
    positions = positions.reshape(-1).to(torch.int64)
    values = values.reshape(-1).to(torch.float32)
    if positions.numel() != values.numel():
        raise ValueError(f"{positions.numel()} positions for {values.numel()} values")
    sizes = [t.numel() for t in served]
    if len(codecs) < len(sizes):
        raise ValueError(f"{len(codecs)} codecs for {len(sizes)} backbone tensors")
    ends = torch.tensor(sizes, dtype=torch.int64).cumsum(0)
    inside = (positions >= 0) & (positions < (int(ends[-1]) if sizes else 0))
    positions, values = positions[inside], values[inside]
    if not positions.numel():
        return ""
    flat = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in served])
    which = torch.bucketize(positions, ends, right=True)
    for i in sorted(set(which.tolist())):
        at = which == i
        got, want = flat[positions[at]], values[at]
        tol = SERVED_TOLERANCE.get(codecs[i], 0.0)
        scale = float(want.square().mean().sqrt())
        diff = float((got - want).square().mean().sqrt())
        if not math.isfinite(diff) or diff > tol * scale + 1e-12:
            return (f"what it served differs from what it sent into the round at {int(at.sum())} positions of "
                    f"backbone tensor {i} (relative difference {diff / scale if scale else math.inf:.3g}, "
                    f"tolerance {tol:g})")
    return ""


#: the largest relative root-mean-square difference between a round's average and the one the
#: members' served changes give (:func:`served_average_mismatch`): in practice 0, as both apply the
#: same rule to the same values; a rounding may flip where a sum lands half-way between two fp16
#: numbers
AVERAGE_TOLERANCE = 1e-3


def served_average_mismatch(rule: RoundRule, served: Sequence[Sequence[torch.Tensor]], weights: Sequence[float], *,
                            averaged: Sequence[torch.Tensor], codecs: Sequence[str], max_weight: float | None
                            ) -> str:
    """Why the backbone changes that every member of a round served (``served[i]``, as
    :func:`sent_backbone` gives them: this member's own as it sent it, each mate's as it downloaded
    it; ``weights[i]`` its round weight) do not give the backbone of the round's average
    (``averaged``, as every member received it), '' when they do. The run's robust rule is applied
    to them as the all-reduce applied it to what was sent (:func:`group_average`), so a member that
    served another change than it sent, anywhere in the vector, moves the result. Compared where the
    backbone's ``codecs`` are element-wise (``none``, ``fp16``); with ``int8``, which the all-reduce
    applies part by part, nothing is compared ('')."""
    if len(served) != len(weights) or not served:
        raise ValueError(f"{len(served)} served changes for {len(weights)} weights")
    n_b = len(served[0])
    codecs = list(codecs)[:n_b]
    if len(codecs) != n_b or len(averaged) < n_b:
        raise ValueError(f"a backbone of {n_b} tensors, {len(codecs)} codecs and {len(averaged)} averaged tensors")
    if any(c not in ("none", "fp16") for c in codecs):
        return ""
    out, _ = robust.robust_mean_of_lists([[t.to(torch.float32) for t in s] for s in served], weights,
                                         rule=rule.config.robust, clip=rule.config.robust_clip, max_weight=max_weight)
    expected = compression.roundtrip_all(out, codecs)
    for i, (want, got) in enumerate(zip(expected, averaged)):
        want, got = want.to(torch.float32), got.detach().to(torch.float32)
        scale = float(want.square().mean().sqrt())
        diff = float((got - want).square().mean().sqrt())
        if not math.isfinite(diff) or diff > AVERAGE_TOLERANCE * scale + 1e-12:
            return (f"backbone tensor {i} of the round's average differs from the served changes' by "
                    f"{diff / scale if scale else math.inf:.3g} (relative), tolerance {AVERAGE_TOLERANCE:g}")
    return ""


def choose_backbone(rule: RoundRule, candidates: Mapping[str, Sequence[torch.Tensor]], *,
                    own: Sequence[torch.Tensor], loss_of: LossOf) -> tuple[str, dict[str, float]]:
    """The candidate backbone (:func:`partner_candidates`) with the lowest tune-slice loss, each
    evaluated with the member's own key layers (those of ``own``, its model before the round), and
    every candidate's loss. Ties, and losses that are not finite, go to :data:`REGION_CANDIDATE`,
    then to the first name in sorted order, so the choice does not depend on the order the
    candidates are given in. :data:`SELF_CANDIDATE`, when given, is never chosen: a pair is taken
    only when its loss is also below the member's own backbone's (and a member whose own backbone
    has no finite loss takes the region's). Like every search it leaves the last parameters tried
    wherever ``loss_of`` loads them."""
    if REGION_CANDIDATE not in candidates:
        raise ValueError(f"the candidates must include the region's ({REGION_CANDIDATE!r})")
    own_key = rule.split.take_key(own)
    names = [REGION_CANDIDATE] + sorted(n for n in candidates if n != REGION_CANDIDATE)
    losses = {}
    for name in names:
        model = rule.split.merge([t.detach().clone() for t in candidates[name]], [t.detach().clone() for t in own_key])
        losses[name] = mixing.mean_loss(loss_of(model))
    def rank(n: str) -> tuple[float, int]:
        return losses[n] if math.isfinite(losses[n]) else math.inf, names.index(n)

    eligible = [n for n in names if n != SELF_CANDIDATE]
    if SELF_CANDIDATE in losses:  # a pair must beat the member's own backbone as well
        bar = losses[SELF_CANDIDATE] if math.isfinite(losses[SELF_CANDIDATE]) else -math.inf
        eligible = [n for n in eligible if n == REGION_CANDIDATE or losses[n] < bar]
    return min(eligible, key=rank), losses


def partner_target(rule: RoundRule, *, agreed: Sequence[torch.Tensor], own: Sequence[torch.Tensor],
                   candidates: Mapping[str, Sequence[torch.Tensor]] | None, loss_of: LossOf | None
                   ) -> tuple[list[torch.Tensor], str | None]:
    """What a member's model moves towards after a region round (:func:`member_mix`'s ``agreed``)
    and the partner it chose: with ``region_backbone = "partners"``, candidates and a tune slice,
    the chosen backbone (:func:`choose_backbone`) with the region's agreed key layers, and the
    chosen name (:data:`REGION_CANDIDATE` or a mate's); otherwise ``agreed`` and None."""
    if candidates is None or loss_of is None or len(candidates) < 2:
        return [t.detach().clone() for t in agreed], None
    name, _ = choose_backbone(rule, candidates, own=own, loss_of=loss_of)
    if name == REGION_CANDIDATE:
        return [t.detach().clone() for t in agreed], name
    return rule.split.merge([t.detach().clone() for t in candidates[name]],
                            [t.detach().clone() for t in rule.split.take_key(agreed)]), name


def region_round(rule: RoundRule, members: Sequence[Sequence[torch.Tensor]], weights: Sequence[float], *,
                 anchor: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor] | None,
                 loss_of: Sequence[LossOf | None] | None = None
                 ) -> tuple[list[list[torch.Tensor]], list[torch.Tensor] | None]:
    """The central reference of a whole region round: every member's next model, and the momentum.

    This is exactly what the swarm computes, with the all-reduce replaced by :func:`group_average`."""
    out, new_m, _ = region_round_with_anchor(rule, members, weights, anchor=anchor, momentum=momentum,
                                             loss_of=loss_of)
    return out, new_m


def region_round_with_anchor(rule: RoundRule, members: Sequence[Sequence[torch.Tensor]], weights: Sequence[float], *,
                             anchor: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor] | None,
                             loss_of: Sequence[LossOf | None] | None = None,
                             choices: list | None = None, max_weight: float | None = None,
                             usage: Sequence[torch.Tensor | None] | None = None,
                             reuse: Sequence[mixing.MixChoice | None] | None = None,
                             names: Sequence[str] | None = None, round_index: int = 0,
                             partners: list | None = None
                             ) -> tuple[list[list[torch.Tensor]], list[torch.Tensor] | None, list[torch.Tensor]]:
    """:func:`region_round` plus the region's new agreed model (see :func:`region_step`). With
    ``mix="evidence"``, ``loss_of[i]`` is member ``i``'s tune-slice loss (None: no slice) and each
    member's :class:`~worldlm_p2p.mixing.MixChoice` is appended to ``choices`` when given.
    ``max_weight``: the cap on a member's weight (:func:`worldlm_p2p.aggregation.max_round_weight`).
    ``reuse[i]``: member ``i``'s earlier choice to take again instead of a search (:func:`member_mix`).
    With :attr:`RoundRule.backbone_partners` and three or more members, member ``i`` (named
    ``names[i]``, default its index) first chooses the backbone it moves towards among the region's
    and its pairs with the mates :func:`partner_mates` gives for ``round_index``
    (:func:`partner_target`; a member that reuses an earlier choice takes the region's), and its
    choice (a mate's name, :data:`REGION_CANDIDATE`, or None without a search) is appended to
    ``partners`` when given.

    A group of one member has nothing to average, as a swarm peer alone in its region holds no
    region round (:meth:`worldlm_p2p.peer.core.Peer._region_of_one`): its model is the group's agreed
    model, bit for bit, the outer momentum stays as it was, and there is no mixing choice (None)."""
    if len(members) == 1:
        own = [t.detach().clone() for t in members[0]]
        if choices is not None and rule.evidence:
            choices.append(None)
        return [own], momentum, [t.clone() for t in own]
    usage = list(usage) if usage is not None else [None] * len(members)
    payloads = [region_payload(rule, p, anchor, usage=u) for p, u in zip(members, usage)]
    averaged = region_average(rule, payloads, weights, max_weight=max_weight)
    out, new_m, agreed = [], momentum, None
    names = [str(i) for i in range(len(members))] if names is None else [str(n) for n in names]
    if len(names) != len(members) or len(set(names)) != len(names):
        raise ValueError(f"need one distinct name per member, got {names!r} for {len(members)} members")
    sent = ([sent_backbone(rule, pl) for pl in payloads] if rule.backbone_partners and len(members) >= SEVERAL
            else None)
    for i, p in enumerate(members):
        new, agreed, new_m = region_step(rule, averaged, params=p, anchor=anchor, momentum=momentum)
        if rule.evidence:
            f = loss_of[i] if loss_of else None
            r = reuse[i] if reuse else None
            target, partner = agreed, None
            if sent is not None and f is not None and r is None:
                mates = partner_mates([n for j, n in enumerate(names) if j != i], cap=rule.config.partner_candidates,
                                      round_index=round_index)
                candidates = partner_candidates(rule, anchor=anchor, own=sent[i], agreed=agreed,
                                                mates={n: sent[names.index(n)] for n in mates})
                target, partner = partner_target(rule, agreed=agreed, own=p, candidates=candidates, loss_of=f)
            if partners is not None:
                partners.append(partner)
            new, choice = member_mix(rule, own=p, agreed=target, loss_of=f, reuse=r)
            if choices is not None:
                choices.append(choice)
        out.append(new)
    return out, new_m, agreed


def flat_round_with_border_dp(rule: RoundRule, regions: Mapping[str, tuple[Sequence[Sequence[torch.Tensor]],
                                                                           Sequence[float]]], *,
                              anchor: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor] | None,
                              clip: float, noise_multiplier: float, generators: Mapping[str, torch.Generator]
                              ) -> tuple[dict[str, list[list[torch.Tensor]]], list[torch.Tensor] | None,
                                         list[torch.Tensor], dict[str, privacy.Privatized]]:
    """A ``fedavg`` round of one world group under region-level DP (the standard-FL baseline of the
    privacy study): each region's token-weighted mean payload leaves its border as
    ``anchor + privatize(mean - anchor)`` and the group averages those, weighted by region tokens.
    ``regions``: region -> (its members' models, their weights). Returns (region -> members' next
    models, momentum, agreed model, region -> mechanism record). With ``clip`` large and no noise
    it equals :func:`region_round_with_anchor` on all members."""
    if rule.strategy.border_dp != "flat" or not rule.world_group:
        raise ValueError(f"flat_round_with_border_dp is the flat world group's round (fedavg's), not "
                         f"{rule.strategy.name}'s")
    names = sorted(regions)
    sent, weights, records = [], [], {}
    for r in names:
        members, w = regions[r]
        delta = weighted_mean([region_payload(rule, p, anchor) for p in members], w)  # (changes since the anchor)
        records[r] = privacy.privatize(delta, clip=clip, noise_multiplier=noise_multiplier, generator=generators[r])
        sent.append(list(records[r].tensors))
        weights.append(float(sum(w)))
    averaged = weighted_mean(sent, weights)
    out: dict[str, list[list[torch.Tensor]]] = {}
    new_m, agreed = momentum, list(anchor)
    for r in names:
        out[r] = []
        for p in regions[r][0]:
            new, agreed, new_m = region_step(rule, averaged, params=p, anchor=anchor, momentum=momentum)
            out[r].append(new)
    return out, new_m, agreed, records


# ------------------------------------------------------------------------------ world rounds


def world_payload(rule: RoundRule, region_params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A leader's payload in the leaders' all-reduce (weight: the region's tokens since the last
    world round): the whole region model. For ``worldlm`` its K part gives ``K_world``, the
    reference of the residuals; it is not adopted."""
    return [p.detach().to(torch.float32) for p in region_params]


def world_codecs(rule: RoundRule, payload: Sequence[torch.Tensor]) -> list[str] | None:
    """The wire codec of each tensor of a leader's world payload (``aggregation.compress_world``, as
    it travels: :func:`worldlm_p2p.compression.effective_codec`); None for float32."""
    if rule.config.compress_world == "none":
        return None
    return [compression.effective_codec(rule.config.compress_world, t.numel()) for t in payload]


def hand_down(rule: RoundRule, model: Sequence[torch.Tensor], anchor: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The world change a leader hands down to its region: ``model - anchor``, the world round's
    change of the region's agreed model, which every member (the leader too) adds to its anchor.
    With ``compress_world = "fp16"`` its values are rounded to fp16 numbers: every member applies the
    same ones, and they travel in half the bytes (a change is small: fp16 keeps about 5e-4 of it)."""
    delta = [m.detach().to(torch.float32) - a.detach().to(torch.float32) for m, a in zip(model, anchor)]
    if rule.config.compress_world == "fp16":
        delta = [d.half().float() for d in delta]
    return delta


def border_shared(rule: RoundRule) -> tuple[int, ...]:
    """Indices of the parameters whose change a region shares at the border in a world round: the
    backbone B (``hierfavg``: the whole model, which it averages across regions)."""
    return tuple(range(len(rule.split.names))) if rule.strategy.world == "mean" else rule.split.backbone


def border_release(rule: RoundRule, region_params: Sequence[torch.Tensor], reference: Sequence[torch.Tensor], *,
                   clip: float, noise_multiplier: float, generator: torch.Generator
                   ) -> tuple[list[torch.Tensor], privacy.Privatized]:
    """What a region's leader sends in a world round under border DP, and the mechanism's record.

    The change of the shared part since ``reference`` (the last world model, the same in every
    region) is clipped to L2 norm ``clip`` and noised with std ``noise_multiplier * clip``
    (:func:`worldlm_p2p.privacy.privatize`); the payload is ``reference + that``. The key layers
    leave as they are (they only set the reference of the residual exchange)."""
    shared = border_shared(rule)
    delta = [region_params[i].detach().float() - reference[i].float() for i in shared]
    out = privacy.privatize(delta, clip=clip, noise_multiplier=noise_multiplier, generator=generator)
    sent = [t.detach().to(torch.float32).clone() for t in region_params]
    for i, d in zip(shared, out.tensors):
        sent[i] = reference[i].float() + d
    return sent, out


def world_backbone(rule: RoundRule, averaged: Sequence[torch.Tensor], region_params: Sequence[torch.Tensor]
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(model with the world's B and, for hierfavg, the world's K; the residuals' reference)``
    from the leaders' averaged payload: ``K_world`` for ``worldlm``, whose region keeps its own K
    until :func:`residual_update`. With :attr:`RoundRule.world_attention` the region keeps its whole
    model and the reference is the whole world mean (the update moves B as well)."""
    averaged = [a.to(p.dtype) for a, p in zip(averaged, region_params)]
    if rule.strategy.world == "mean":
        return list(averaged), []
    if rule.world_attention:
        return [p.detach().clone() for p in region_params], list(averaged)
    k_world = rule.split.take_key(averaged)
    merged = rule.split.merge(rule.split.take_backbone(averaged),
                              [p.detach().clone() for p in rule.split.take_key(region_params)])
    return merged, k_world


def region_residual(rule: RoundRule, region_params: Sequence[torch.Tensor], reference: Sequence[torch.Tensor]
                    ) -> list[torch.Tensor]:
    """``r_R = K_R - K_world`` (with :attr:`RoundRule.world_attention`: ``theta_R - theta_world``,
    the whole model); ``reference`` is the second element of :func:`world_backbone`."""
    part = rule.residual_part(region_params)
    if len(part) != len(reference):
        raise ValueError(f"residual: {len(part)} tensors against a reference of {len(reference)}")
    return [k.detach() - w.to(k.dtype) for k, w in zip(part, reference)]


def embed(rule: RoundRule, res: Sequence[torch.Tensor]) -> torch.Tensor:
    """The residual embedding a leader publishes: shape (key layers, residual_dim), one sketch per
    key layer; with :attr:`RoundRule.world_attention` shape (1, residual_dim), the sum of the
    per-tensor sketches, which is a count sketch of the whole residual (every coordinate in one
    bucket with a random sign), so the record stays ``residual_dim`` numbers whatever the model's
    size (a sketch per tensor of a whole model overflows what one hivemind DHT message carries)."""
    emb = residual.residual_embedding(res, dim=rule.config.residual_dim, seed=rule.seed)
    return emb.sum(dim=0, keepdim=True) if rule.world_attention else emb


def residual_fetch_list(rule: RoundRule, embeddings: Mapping[str, torch.Tensor], region: str
                        ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Cross-region weights of ``region`` and the other regions whose full residual it needs (with
    :attr:`RoundRule.world_attention`: one weight per other region, :func:`residual.region_attention`)."""
    if rule.world_attention:
        weights = residual.region_attention(embeddings, region, tau=rule.config.residual_tau)
    else:
        weights = residual.cross_region_weights(embeddings, region, tau=rule.config.residual_tau,
                                                form=rule.config.residual_attention)
    need = sorted(g for g, a in weights.items() if g != region and float(a.max()) >= FETCH_MIN_WEIGHT)
    return weights, need


def residual_update(rule: RoundRule, region_params: Sequence[torch.Tensor], res: Sequence[torch.Tensor],
                    fetched: Mapping[str, Sequence[torch.Tensor]], weights: Mapping[str, torch.Tensor]
                    ) -> list[torch.Tensor]:
    """The region's model with ``K_R <- K_R + beta * sum_G a_RG (r_G - r_R)`` over the fetched ``G``
    (with :attr:`RoundRule.world_attention`: the whole model, ``theta_R <- theta_R + ...``)."""
    new = residual.cross_region_update(rule.residual_part(region_params), res, fetched, weights,
                                       beta=rule.config.residual_beta)
    if rule.world_attention:
        return new
    return rule.split.merge(rule.split.take_backbone(region_params), new)


#: the fractions of its residual step a leader tries on its tune slice (:func:`leader_residual_step`)
RESIDUAL_STEP_GRID = (1 / 4, 1 / 2, 1.0)


def leader_residual_step(rule: RoundRule, moved: Sequence[torch.Tensor], region_params: Sequence[torch.Tensor],
                         loss_of: LossOf | None) -> tuple[list[torch.Tensor], mixing.MixChoice | None]:
    """The leader's evidence on its region's residual step (:attr:`RoundRule.residual_step_evidence`):
    ``moved`` is the region's model after the world round with the whole step of its key layers
    (:func:`residual_update`), ``region_params`` the region's model before the world round. The
    model returned keeps ``moved``'s backbone and takes ``K_R + s (K_moved - K_R)``, with ``s`` in
    ``[0, 1]`` the fraction of the step that minimises the leader's tune-slice loss
    (:func:`worldlm_p2p.mixing.line_search` over :data:`RESIDUAL_STEP_GRID`; ``s = 0``: the region
    keeps its K). The whole region's agreed model takes this change, and a member's defence against a
    malicious leader tests it (:func:`world_change_refused`): a step towards unrelated
    regions' key layers that the leader's own text refutes is not taken. Without a slice
    (``loss_of`` None) or without the property: ``moved`` and no choice."""
    if loss_of is None or not rule.residual_step_evidence:
        return list(moved), None
    base = rule.split.merge(rule.split.take_backbone(moved), rule.split.take_key(region_params))
    base = [b.to(m.dtype) for b, m in zip(base, moved)]
    choice = mixing.line_search(lambda s: loss_of(mixing.interpolate(base, moved, s)), grid=RESIDUAL_STEP_GRID)
    return mixing.interpolate(base, moved, choice.lam), choice


@dataclass(frozen=True, slots=True)
class WorldRoundResult:
    models: dict[str, list[torch.Tensor]]  # region -> its next model
    world: list[torch.Tensor]  # the leaders' token-weighted mean (the reference of border deltas)
    weights: dict[str, dict[str, list[float]]]  # region -> {G: per-layer attention}, worldlm only
    fetched: dict[str, list[str]]  # region -> the regions whose residual it fetched
    #: region -> the fraction of its residual step its leader took (:func:`leader_residual_step`)
    steps: dict[str, float] = dataclasses.field(default_factory=dict)


def world_round(rule: RoundRule, regions: Mapping[str, Sequence[torch.Tensor]],
                tokens: Mapping[str, float], *, sent: Mapping[str, Sequence[torch.Tensor]] | None = None,
                leader_loss: Mapping[str, LossOf | None] | None = None) -> WorldRoundResult:
    """The central reference of a world round among the leaders of ``regions``. ``sent``: what a
    region's leader put into the leaders' all-reduce when it differs from its model (border DP,
    :func:`border_release`); each region keeps its own key layers and residual either way, and what
    other regions fetch of it (its served residual and sketch) is computed from what it sent.
    ``leader_loss``: each region's leader's tune-slice loss, for :func:`leader_residual_step`
    (it leaves trial parameters in the leader's model: the caller restores it)."""
    names = sorted(regions)
    sent = sent or {}
    payloads = [world_payload(rule, sent.get(r, regions[r])) for r in names]
    averaged = group_average(rule, payloads, [tokens[r] for r in names], codecs=world_codecs(rule, payloads[0]))
    models, ks, weights_out, fetched_out = {}, {}, {}, {}
    for r in names:
        models[r], ks[r] = world_backbone(rule, averaged, regions[r])
    if not rule.residual_exchange or len(names) < 2:
        return WorldRoundResult(models=models, world=averaged, weights={}, fetched={})
    res = {r: region_residual(rule, regions[r], ks[r]) for r in names}
    served = {r: region_residual(rule, sent.get(r, regions[r]), ks[r]) for r in names}
    emb = {r: embed(rule, served[r]) for r in names}
    steps = {}
    for r in names:
        w, need = residual_fetch_list(rule, emb, r)
        models[r] = residual_update(rule, models[r], res[r], {g: served[g] for g in need}, w)
        models[r], choice = leader_residual_step(rule, models[r], regions[r], (leader_loss or {}).get(r))
        if choice is not None:
            steps[r] = choice.lam
        weights_out[r] = {g: [round(float(x), 6) for x in a] for g, a in w.items()}
        fetched_out[r] = need
    return WorldRoundResult(models=models, world=averaged, weights=weights_out, fetched=fetched_out, steps=steps)


# A world change a member's evidence refutes (see :func:`world_change_refuted`)
WORLD_CHANGE_MAX_UNDO = 0.5
WORLD_CHANGE_SLACK = 0.02
#: ... and the bound on a whole change whose key layers a member filters by evidence
#: (:func:`world_change_refused`): worse than a model that knows nothing
WORLD_KEY_MAX_UNDO = 1.0


def world_change_refuted(*, before: float, after: float, vocab_size: int, max_undo: float = WORLD_CHANGE_MAX_UNDO,
                         slack: float = WORLD_CHANGE_SLACK) -> bool:
    """Whether a member's tune slice refutes a world round's change of its region's agreed model:
    ``before``/``after``, the slice's loss (nats/token) of the agreed model without and with the
    change. Refuted: a non-finite ``after``, or one that undoes more than ``max_undo`` of what the
    region's model has learnt over a model that knows nothing (the uniform next-token distribution,
    ``log(vocab_size)`` nats, about a random initialisation's loss), plus ``slack`` of ``before``
    for evaluation noise. A change made by averaging with other regions' trained models never comes
    near that; a leader (or a leaders' group) that serves random tensors, a sign-flipped model or
    a scaled one does. Without a finite ``before`` nothing is refuted (no evidence)."""
    if not math.isfinite(after):
        return True
    if not math.isfinite(before):
        return False
    learnt = max(math.log(vocab_size) - before, 0.0)
    return after > before + max_undo * learnt + slack * abs(before)


def world_change_refused(rule: RoundRule, *, before: float, after: float, after_backbone: float | None,
                         vocab_size: int) -> bool:
    """Whether a member refuses a world round's change of its region's agreed model (and its
    leader's lease), from its tune slice: ``before``, the slice's loss of the agreed model;
    ``after``, with the whole change; ``after_backbone``, with the change's backbone part alone.

    When the member's models take the change's key layers only as far as their evidence supports
    (:attr:`RoundRule.filters_world_key`), a change of K that does not suit this member's text is
    no sign of malice (the residual exchange moves a region's K towards other regions' on purpose,
    and measured honest changes of K undid up to 0.8 of what a member's model had learnt, issue 10)
    and costs it nothing. Then the backbone's part, which the models take whole, is held to
    :func:`world_change_refuted`'s bound (honest changes measured at most 0.41, on `mixed` in a first world round), and the whole change
    only to :data:`WORLD_KEY_MAX_UNDO` (refused when it makes the model worse than one that knows
    nothing: random tensors, a scaled or sign-flipped model). Otherwise (or without
    ``after_backbone``) the whole change is held to the bound."""
    whole = world_change_refuted(before=before, after=after, vocab_size=vocab_size)
    if not rule.filters_world_key or after_backbone is None:
        return whole
    return (world_change_refuted(before=before, after=after_backbone, vocab_size=vocab_size)
            or world_change_refuted(before=before, after=after, vocab_size=vocab_size, max_undo=WORLD_KEY_MAX_UNDO))
