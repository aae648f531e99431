"""The enum-like settings, typed as literals, in one place (imports the standard library only).

Each ``Literal`` is the type of a config field; its tuple (``get_args``) is what validation and
the CLIs' ``choices`` accept. What each value *does* is documented where it acts: the strategies in
:mod:`worldlm_p2p.strategies`, the other rules in :class:`worldlm_p2p.config.AggregationConfig`.
"""

from __future__ import annotations

from typing import Literal, get_args

#: what a swarm runs; ``centralized`` (one model on the pooled text) exists only in the simulator
SwarmStrategy = Literal["worldlm", "fedavg", "hierfavg", "fedper", "local"]
StrategyName = Literal["worldlm", "fedavg", "hierfavg", "fedper", "local", "centralized"]
#: the key-layer rule inside a region (:mod:`worldlm_p2p.attention`)
AttentionForm = Literal["distance", "cosine", "mean"]
#: what a worldlm member keeps after a round (:mod:`worldlm_p2p.mixing`, :func:`~worldlm_p2p.attention.personalize`)
MixRule = Literal["evidence", "cosine", "none"]
#: where a worldlm world round moves a region
WorldTarget = Literal["mean", "attention"]
#: the leaders' cross-region attention over key-layer residuals (:func:`worldlm_p2p.residual.cross_region_weights`)
ResidualAttention = Literal["world", "partners"]
#: what the cosine personal mix covers
PersonalScope = Literal["key", "all", "parts"]
#: whether a worldlm member's personal model is a second model or the one it averages
PersonalModel = Literal["separate", "inline"]
#: what a separate personal model's shared model takes of a round
SharedModel = Literal["evidence", "evidence-world", "agreed"]
#: which backbone a worldlm member's shared model takes after a region round (:func:`worldlm_p2p.rounds.partner_target`)
RegionBackbone = Literal["mean", "partners"]
#: what a backbone partner's pair must beat on the member's tune slice (:func:`worldlm_p2p.rounds.choose_backbone`)
PartnerCheck = Literal["region", "self"]
#: the outer optimizer of region rounds (:mod:`worldlm_p2p.outer_optim`)
OuterOptimizer = Literal["sgd", "nesterov"]
#: how a region's (and the leaders') all-reduce combines its members' payloads (:mod:`worldlm_p2p.robust`)
RobustRule = Literal["clip", "mean"]
#: how a region round's payload travels (:mod:`worldlm_p2p.compression`)
WireCodec = Literal["none", "fp16", "int8"]
#: when a region round is due (:func:`worldlm_p2p.net.barrier.round_due`)
RoundSchedule = Literal["steps", "tokens"]

SWARM_STRATEGIES: tuple[str, ...] = get_args(SwarmStrategy)
STRATEGY_NAMES: tuple[str, ...] = get_args(StrategyName)
ATTENTION_FORMS: tuple[str, ...] = get_args(AttentionForm)
MIX_RULES: tuple[str, ...] = get_args(MixRule)
WORLD_TARGETS: tuple[str, ...] = get_args(WorldTarget)
RESIDUAL_ATTENTIONS: tuple[str, ...] = get_args(ResidualAttention)
PERSONAL_SCOPES: tuple[str, ...] = get_args(PersonalScope)
PERSONAL_MODELS: tuple[str, ...] = get_args(PersonalModel)
SHARED_MODELS: tuple[str, ...] = get_args(SharedModel)
REGION_BACKBONES: tuple[str, ...] = get_args(RegionBackbone)
PARTNER_CHECKS: tuple[str, ...] = get_args(PartnerCheck)
OUTER_OPTIMIZERS: tuple[str, ...] = get_args(OuterOptimizer)
ROBUST_RULES: tuple[str, ...] = get_args(RobustRule)
WIRE_CODECS: tuple[str, ...] = get_args(WireCodec)
ROUND_SCHEDULES: tuple[str, ...] = get_args(RoundSchedule)
