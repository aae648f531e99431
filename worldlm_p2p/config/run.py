"""The run's settings: what every peer of a run must share (the run manifest and its sections),
and the validation helpers every config section uses (imports the standard library only)."""


from __future__ import annotations

import dataclasses
import math
import hashlib
import json
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from worldlm_p2p.errors import ConfigError
from worldlm_p2p.kinds import (ATTENTION_FORMS, MIX_RULES, OUTER_OPTIMIZERS, PERSONAL_MODELS, PERSONAL_SCOPES, REGION_BACKBONES,
                               PARTNER_CHECKS, ROBUST_RULES, PartnerCheck, RegionBackbone,
                               RESIDUAL_ATTENTIONS, ROUND_SCHEDULES, SHARED_MODELS, STRATEGY_NAMES, SWARM_STRATEGIES, WIRE_CODECS, WORLD_TARGETS,
                               AttentionForm, MixRule, OuterOptimizer, PersonalModel, PersonalScope, ResidualAttention, RobustRule, RoundSchedule,
                               SharedModel, StrategyName, WireCodec, WorldTarget)

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
#: The rule ``_NAME_RE`` enforces, as the errors that refuse a name say it.
NAME_RULE = "1-64 ASCII letters, digits, '_' or '-', starting with a letter or digit"


def check_name(kind: str, value: str) -> str:
    """Validate a run id or region tag: ASCII letters, digits, ``_`` and ``-`` only (no dots: hivemind
    prefixes may not contain them), 1 to 64 characters."""
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ConfigError(
            f"invalid {kind} {value!r}: use {NAME_RULE}"
        )
    return value


def _require_finite(section: str, obj: Any, names: tuple[str, ...]) -> None:
    """Every one of these numeric settings must be a finite number (inf and NaN pass ``> 0`` checks
    or fail them silently, then break a run long after it started)."""
    for name in names:
        value = getattr(obj, name)
        _require(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                 f"{section}.{name}", f"must be a finite number, got {value!r}")


def _require(cond: bool, setting: str, why: str) -> None:
    if not cond:
        raise ConfigError(f"{setting}: {why}")


# ----------------------------------------------------------------------------------- model


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """A Llama-style causal LM built with ``transformers`` from this config (random init, no hub).

    ``vocab_size`` is filled from the tokenizer when the model is built if left at 0.
    """

    preset: str = "custom"
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 352
    max_seq_len: int = 256
    vocab_size: int = 0
    tie_embeddings: bool = True
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "max_seq_len"):
            _require(int(getattr(self, name)) > 0, f"model.{name}", "must be a positive integer")
        _require(self.vocab_size >= 0, "model.vocab_size", "must be >= 0 (0 = take it from the tokenizer)")
        _require(self.hidden_size % self.num_heads == 0, "model.hidden_size", "must be divisible by model.num_heads")
        _require_finite("model", self, ("rope_theta",))
        _require(self.rope_theta > 0, "model.rope_theta", "must be > 0")
        _require(self.num_heads % self.num_kv_heads == 0, "model.num_kv_heads", "must divide model.num_heads")


#: Model presets. Parameter counts are for the byte-level tokenizer (vocab 259, tied embeddings).
MODEL_PRESETS: dict[str, ModelConfig] = {
    # ~0.9M parameters: CPU tests and the local demo.
    "tiny": ModelConfig(preset="tiny", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=4,
                        intermediate_size=352, max_seq_len=256),
    # ~21M parameters.
    "small": ModelConfig(preset="small", hidden_size=384, num_layers=12, num_heads=6, num_kv_heads=6,
                         intermediate_size=1024, max_seq_len=512),
    # ~123M parameters (GPT-2-small scale).
    "base": ModelConfig(preset="base", hidden_size=768, num_layers=13, num_heads=12, num_kv_heads=12,
                        intermediate_size=3072, max_seq_len=1024),
    # ~403M parameters: the WorldLM paper's largest scale (arXiv 2405.14446).
    "large": ModelConfig(preset="large", hidden_size=1024, num_layers=24, num_heads=16, num_kv_heads=16,
                         intermediate_size=4096, max_seq_len=1024),
}


def model_preset(name: str) -> ModelConfig:
    if name not in MODEL_PRESETS:
        raise ConfigError(f"unknown model preset {name!r}: choose one of {', '.join(MODEL_PRESETS)}")
    return MODEL_PRESETS[name]


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizerSpec:
    """``kind="byte"``: UTF-8 bytes plus BOS/EOS/PAD (no files, any language).
    ``kind="local"``: a Hugging Face tokenizer directory that exists on every peer at ``path``."""

    kind: str = "byte"
    path: str = ""

    def __post_init__(self) -> None:
        _require(self.kind in ("byte", "local"), "tokenizer.kind", f"{self.kind!r} is not 'byte' or 'local'")
        _require(self.kind != "local" or bool(self.path), "tokenizer.path", "is required when tokenizer.kind = 'local'")


# ----------------------------------------------------------------------------------- training


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Local (inner) training hyper-parameters, shared by every peer of the run."""

    batch_size: int = 8
    seq_len: int = 128
    lr: float = 3e-3
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    warmup_steps: int = 20
    grad_clip: float = 1.0
    inner_steps: int = 20  # H: local steps between region rounds
    seed: int = 0
    eval_tokens: int = 16384  # held-out tokens used for valid loss (0 = all)

    def __post_init__(self) -> None:
        for name in ("batch_size", "seq_len", "inner_steps"):
            _require(int(getattr(self, name)) > 0, f"train.{name}", "must be a positive integer")
        _require_finite("train", self, ("lr", "weight_decay", "beta1", "beta2", "grad_clip"))
        _require(self.lr > 0, "train.lr", "must be > 0")
        _require(self.weight_decay >= 0, "train.weight_decay", "must be >= 0")
        _require(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "train.beta1/beta2", "must be in [0, 1)")
        _require(self.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
        _require(self.grad_clip >= 0, "train.grad_clip", "must be >= 0 (0 disables clipping)")
        _require(self.eval_tokens >= 0, "train.eval_tokens", "must be >= 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class AggregationConfig:
    """How rounds combine models (``shared/design/worldlm.md`` sections 2-5).

    - ``strategy``: ``worldlm`` (region B mean + attentive K, world rounds via leaders with
      residual embeddings), ``fedavg`` (one world group, whole model), ``hierfavg`` (region mean,
      then world mean of everything), ``fedper`` (world mean of B, K per peer), ``local``;
      ``centralized`` exists only in the simulator.
    - ``key_layers``: which parameters are K: a preset of :data:`worldlm_p2p.split.KEY_LAYER_PRESETS`
      (``embed_head``, the default: the token embeddings and the LM head, as DEPT localises them,
      arXiv 2410.05402; ``kv``; ``last30``) or comma-separated ``fnmatch`` patterns.
    - ``attention`` / ``tau`` / ``eps``: the K rule inside a region (:mod:`worldlm_p2p.attention`).
      ``"mean"`` (the default since 2026-12-06's fifteenth session): the token-weighted mean, which
      every corpus and budget of the quality study measured level with or better than WorldLM's
      attentive ``"distance"`` form (the default before; better beyond the seed noise on the
      held-out ``holdout`` corpus at the long budget, ``benchmarks/RESULTS.md``, issue 10), and
      which lets K travel in fp16. ``"distance"`` and ``"cosine"`` remain options (``tau`` is
      their temperature); ``eps`` scales the step of every form.
    - ``usage_rows``: weigh each member's rows of the token-indexed key layers (the token
      embeddings and the LM head) by how often the token occurs in its training text, so that a
      token's row takes its change from the members that use it instead of a mean diluted by those
      that never see it (:func:`worldlm_p2p.attention.row_priors`). Each member then shares its
      token counts (a unigram histogram of its text, inside the all-reduce); under DP-SGD it
      shares none and weighs its rows uniformly. Off by default: measured level with the per-layer
      weights (``benchmarks/RESULTS.md``, issue 10, eighth session).
    - ``world_every``: a world round after every M-th region round (``worldlm`` and ``hierfavg``).
    - ``residual`` / ``residual_dim`` / ``residual_tau`` / ``residual_beta``: cross-region sharing of
      K by residual embeddings (:mod:`worldlm_p2p.residual`).
    - ``residual_attention``: the leaders' attention over key-layer residuals. ``"world"``
      (WorldLM's): over every region and the region itself, by the cosine of the residuals from the
      world's mean (such residuals point away from each other by construction, so a region keeps
      nearly all the weight itself); ``"partners"`` (the default): over the other regions only, by the cosine of
      their departures from the rest of the world (did two regions learn alike, apart from the
      others?), the region's K moved up to ``residual_beta`` towards them, as far as the leader's
      own tune slice supports (:func:`worldlm_p2p.rounds.leader_residual_step`), and each member
      takes of that only what its tune slice supports
      (:func:`worldlm_p2p.residual.cross_region_weights`).
    - ``world_target``: where a ``worldlm`` world round moves a region. ``"mean"``: to the world's
      token-weighted mean backbone, K by residual embeddings (the paper's); ``"attention"``: towards
      the other regions whose residual sketches (of the whole model) are most like its own, backbone
      and K alike, by ``residual_beta`` of the attention-weighted difference
      (:func:`worldlm_p2p.residual.region_attention`; without ``residual``, the mean).
    - ``mix``: what a ``worldlm`` member keeps after a round. ``"evidence"`` (the default): its own
      model moved towards the region's agreed model, and by the world's change of it, only as far
      as that lowers its loss on a tune slice of its own training text (:mod:`worldlm_p2p.mixing`);
      ``"cosine"``: the personal mix of its own and the region's update by their cosine
      (:func:`worldlm_p2p.attention.personalize`, ``personal_tau`` / ``personal_scope``);
      ``"none"``: it adopts the agreed model (the paper's behaviour). The region's agreed model
      (B + the region's K) is the same in every case.
    - ``mix_world``: with ``mix = "evidence"``, a member also takes a world round's change only as far
      as its evidence supports (False: every member adds the whole change, as the region does);
      ``mix_world_max``: the largest fraction of a world change it tries in one round (0.25).
      ``mix_z``: a member takes a mix only when its gain on the tune slice is significant: the mean
      of the paired per-window gains above ``mix_z`` standard errors (0: any gain;
      :func:`worldlm_p2p.mixing.significant`).
    - ``tune_fraction`` / ``tune_tokens``: the tune slice, held apart from each member's training
      text for ``mix = "evidence"``: this fraction of its training tokens, at most ``tune_tokens``.
    - ``tune_pieces``: the tune slice is taken in this many equal pieces spread evenly over the
      training text (each at the end of its share of the stream), so that it samples more than the
      text's last document or two (1: one piece, the tail).
    - ``personal_scope``: what a member's personal mix covers. ``"parts"`` (the default): the
      backbone and the key layers each by its own line search on the tune slice, the backbone first
      (:func:`worldlm_p2p.mixing.mix_parts`), so that a member can take the backbone every member
      trains while it keeps key layers of its own; of a world change the backbone's part up to the
      whole, the key layers' up to ``mix_world_max``. ``"all"``: one weight for the whole model.
      ``"key"``: only the key layers, the member adopting the backbone its region agreed on and
      every world change of it whole (:attr:`worldlm_p2p.rounds.RoundRule.personal_key_only`). With
      ``mix = "cosine"``, whose mix is per tensor, ``"parts"`` is ``"all"``.
    - ``personal_model``: with ``mix = "evidence"``, where a member's personal model lives.
      ``"separate"`` (the default): every member trains two models on the same batches, the
      *shared* one that takes part in the rounds (it adopts the agreed backbone and every world
      change of it whole, and takes of the agreed key layers what its tune slice supports: the
      rounds of ``personal_scope = "key"``), and its *personal* one, which never leaves the peer:
      after every round it moves towards the member's shared model as far as its tune slice
      supports, by ``personal_scope`` (:func:`worldlm_p2p.rounds.personal_mix`). The personal
      model is the one the member holds, is evaluated on and exports (Ditto's two models, arXiv
      2012.04221, with a line search on held-apart text instead of a proximal term). The region
      then trains one coherent backbone from the first round, which is what pays over a long run,
      while no member has to take it before its evidence shows it helps. It costs a second
      forward-backward pass per step and a second copy of the model and optimizer state; the bytes
      on the wire are the same. ``"inline"``: one model per member, both averaged and personal
      (the members' own models are what the region averages).
    - ``shared_model``: with ``personal_model = "separate"``, what the shared model takes of a round.
      ``"evidence"`` (the default): the agreed backbone and every world change of it whole, of the
      agreed key layers (and of the world's change of them, up to ``mix_world_max``) what its tune
      slice supports. ``"agreed"``: the region's agreed model and every world change whole, key
      layers included (WorldLM's member: the region's attentive key layers and the residual
      exchange of the leaders reach it unfiltered); only the personal model then mixes by evidence.
      Measured: better where a region's members write related languages at the short budget, worse
      at the long one and where a region mixes unrelated ones (``benchmarks/RESULTS.md``, issue 10).
      ``"evidence-world"``: as ``"evidence"``, and in a region round of three or more members
      (:data:`worldlm_p2p.rounds.SEVERAL`) the world change of the backbone too only as far as the
      member's tune slice supports, up to the whole of it (the region's next round then averages
      what its members took: a region-level step towards the world made of their evidence); a
      smaller region takes it whole. Measured at the short budget (``benchmarks/RESULTS.md``,
      issue 10): 3.9% lower on ``today`` (3 seeds, every one), level on ``random`` (0.981, 8
      seeds), ``holdout`` (0.994, 8) and ``mixed``, the same runs on ``related`` and ``scripts`` (no
      region of three); at the long budget level (0.997 over five runs: ``today`` 0.980, ``mixed``
      0.984, ``random`` 1.024 and 0.988, ``holdout`` 1.012, whose region of four it helped at the
      short budget ending 3.9% higher), hence not the default. Without the size rule it
      was 6-7% worse on ``related`` and ``mixed``: their members declined world changes that pay
      only after the next rounds' training.
    - ``region_backbone``: with ``mix = "evidence"`` (``worldlm``), which backbone a member's shared
      model takes after a region round of three or more members (ignored otherwise: the other
      strategies and mixes, and a shared model that adopts, ``shared_model = "agreed"``, take the
      region's). ``"partners"`` (the default since 2026-12-07):
      whichever does best on its tune slice (with its own key layers) of the region's agreed
      backbone, for each of up to ``partner_candidates`` region mates the mean of the backbone it
      sent into the round and the one that mate sent, half and half (a sub-federation of two formed
      by evidence, round by round, which a member leaves as soon as another candidate does
      better), and with ``partner_own_half`` its own backbone half and half with the region's.
      Each member serves what it sent, and downloads what its mates sent, after the all-reduce:
      one backbone per candidate mate and round, in the round's backbone codec
      (:meth:`worldlm_p2p.net.averaging.RegionAverager.download_contribution_from`); a mate that
      does not serve it in time, or serves something that does not fit, is left out. The region's
      agreed model, which late joiners download and the leader carries, stays the mean.
      ``"mean"``: the region's agreed backbone (the default until 2026-12-07; no downloads).
      Measured, partners with the own half against the mean, 8 seeds at the short budget: 3.4%
      lower region perplexity where regions hold related languages (``today``), 2.5% and 3.7% on
      two corpora of mostly unrelated ones (``benchmarks/RESULTS.md``, issue 10).
    - ``partner_candidates``: with ``region_backbone = "partners"``, the most region mates a member
      evaluates per round (and downloads the backbone of); in a larger group it takes a window of
      its mates (sorted by id) that moves on by this many every round
      (:func:`worldlm_p2p.rounds.partner_mates`).
    - ``partner_check``: with ``region_backbone = "partners"``, what a pair must beat on the
      member's tune slice to be taken. ``"region"``: the region's backbone. ``"self"``: the
      region's and the member's own backbone (the one it sent), one more evaluation, so that a
      pair is taken only where the mate adds to what the member learnt itself (a pair holds half
      of the member's own backbone, which its own slice tends to prefer whoever the mate is).
    - ``partner_own_half``: with ``region_backbone = "partners"``, one more candidate (on by
      default): the mean of the backbone the member sent and the region's, half and half
      (``"own-half"``), so that a pair is taken only where the mate does better as the other half
      than the region does, and a member whose mates are unrelated can still keep half of what it
      learnt. No traffic: it is made of what the member sent and the region's agreed backbone.
    - ``personal_tau``: the temperature of ``mix = "cosine"``.
    - ``evidence_share``: with ``mix = "evidence"``, the share of a member's compute its evidence
      searches may take, in forward passes (0, the default: a search at every round). Above 0 a
      member makes each kind of search (its region, world and personal mixes) only while the
      tune-slice tokens that kind evaluated so far are at most this share of the forward passes of
      its training so far, and otherwise takes that kind's last weights again
      (:class:`worldlm_p2p.mixing.EvidenceBudget`). For peers whose rounds come often against what
      they train between them (a small H, a CPU shared with the round's work): e.g. 0.05. Its cost in
      perplexity is measured in ``benchmarks/RESULTS.md`` (issue 14).
    - ``outer`` / ``outer_lr`` / ``outer_momentum``: the outer optimizer applied to the backbone at
      region rounds (:mod:`worldlm_p2p.outer_optim`); ``sgd`` with lr 1 is FedAvg.
    - ``robust`` / ``robust_clip``: how a region's all-reduce (and the leaders') combines what its
      members send (:mod:`worldlm_p2p.robust`). ``"clip"`` (the default): every value clipped to
      ``robust_clip`` spreads around the members' coordinate-wise median, weights capped at the
      tokens of one round, NaN/Inf left out, so that a malicious minority moves the agreed model by
      a bounded amount; ``"mean"``: hivemind's weighted mean (the weight cap and the NaN/Inf rule
      still hold).
    - ``compress_backbone`` / ``compress_key``: how a region round's payload travels, per tensor
      role: the backbone's change since the anchor, and the key layers' encoded change (``none``:
      float32; ``fp16``, the default; ``int8``: uniform 8-bit; :mod:`worldlm_p2p.compression`).
      With attention over K (not ``"mean"``), ``compress_key = "fp16"`` sends the key layers'
      attention-weighted change in float32: its weights span ``exp(-60)`` to 1, beyond fp16's range
      (:func:`worldlm_p2p.rounds.payload_codecs`).
    - ``compress_world``: how a leader's region model travels in the leaders' all-reduce of a world
      round (``fp16``, the default; ``none``: float32). Unlike a region round's payload it is the
      model itself, not a change since a common anchor (leaders may hold different world rounds), so
      fp16 moves each value of the world mean by up to about 5e-4 of it; measured level with float32
      in perplexity (``benchmarks/RESULTS.md``, issue 14), at half the leaders' bytes. The world
      change handed down to the members goes in the same codec (:func:`worldlm_p2p.rounds.hand_down`).
    - ``overlap``: a region round runs in the background on a snapshot of the member's model while
      the next H inner steps train; its result is applied at the next round, one round stale, with
      the local progress made meanwhile kept (:func:`worldlm_p2p.rounds.stale_apply`; as in
      Streaming DiLoCo, arXiv 2501.18512, and DiLoCoX's one-step delay, arXiv 2506.21263). Training
      waits only for a round slower than H inner steps. False: every peer waits for its round.
    - ``schedule``: when a region round is due. ``"steps"`` (the default): after every H inner steps
      of each member (peers of different speeds meet at the barrier, where the fast ones wait for
      the slowest). ``"tokens"``: when the region's live members have together trained H steps'
      worth of tokens each since the last round (``H x batch_size x seq_len`` times the members),
      as their progress records tell (:func:`worldlm_p2p.net.barrier.round_due`, the pace that
      hivemind's ``target_batch_size`` sets); every member then contributes what it trained,
      weighted by its tokens, so a slow member neither stalls the others nor is left out. With
      equal speeds both schedules are the same (the simulator runs equal speeds).
    """

    strategy: StrategyName = "worldlm"
    key_layers: str = "embed_head"
    attention: AttentionForm = "mean"
    tau: float = 0.1
    eps: float = 1.0
    usage_rows: bool = False
    world_every: int = 1
    residual: bool = True
    residual_dim: int = 256
    residual_tau: float = 0.1
    residual_beta: float = 0.5
    residual_attention: ResidualAttention = "partners"
    world_target: WorldTarget = "mean"
    mix: MixRule = "evidence"
    mix_world: bool = True
    mix_world_max: float = 0.25
    mix_z: float = 0.0
    tune_fraction: float = 0.05
    tune_tokens: int = 2048
    tune_pieces: int = 1
    personal_tau: float = 0.1
    evidence_share: float = 0.0
    personal_scope: PersonalScope = "parts"
    personal_model: PersonalModel = "separate"
    shared_model: SharedModel = "evidence"
    region_backbone: RegionBackbone = "partners"
    partner_candidates: int = 6
    partner_check: PartnerCheck = "region"
    partner_own_half: bool = True
    outer: OuterOptimizer = "sgd"
    outer_lr: float = 1.0  # 1.0 with sgd = plain FedAvg: adopt the averaged model
    outer_momentum: float = 0.9  # nesterov only
    robust: RobustRule = "clip"
    robust_clip: float = 4.0
    compress_backbone: WireCodec = "fp16"
    compress_key: WireCodec = "fp16"
    compress_world: WireCodec = "fp16"
    overlap: bool = False
    schedule: RoundSchedule = "steps"

    def __post_init__(self) -> None:
        _require_finite("aggregation", self, ("eps", "residual_tau", "residual_beta", "mix_world_max", "tune_fraction",
                                              "personal_tau", "outer_lr", "outer_momentum"))
        _require(self.strategy in STRATEGY_NAMES, "aggregation.strategy",
                 f"{self.strategy!r} is not one of {', '.join(STRATEGY_NAMES)}")
        _require(bool(self.key_layers.strip()), "aggregation.key_layers", "must name a preset or patterns")
        _require(len(self.key_layers) <= 4096, "aggregation.key_layers",
                 f"is {len(self.key_layers)} characters long: at most 4096 (a preset or a few name patterns)")
        _require(self.attention in ATTENTION_FORMS, "aggregation.attention",
                 f"{self.attention!r} is not one of {', '.join(ATTENTION_FORMS)}")
        _require(self.tau > 0, "aggregation.tau", "must be > 0")
        _require(0 < self.eps <= 2, "aggregation.eps", "must be in (0, 2]")
        _require(self.world_every >= 1, "aggregation.world_every", "must be >= 1")
        _require(self.residual_dim >= 1, "aggregation.residual_dim", "must be >= 1")
        _require(self.residual_tau > 0, "aggregation.residual_tau", "must be > 0")
        _require(0 <= self.residual_beta <= 1, "aggregation.residual_beta", "must be in [0, 1]")
        _require(self.residual_attention in RESIDUAL_ATTENTIONS, "aggregation.residual_attention",
                 f"{self.residual_attention!r} is not one of {', '.join(RESIDUAL_ATTENTIONS)}")
        _require(self.world_target in WORLD_TARGETS, "aggregation.world_target",
                 f"{self.world_target!r} is not one of {', '.join(WORLD_TARGETS)}")
        _require(self.mix in MIX_RULES, "aggregation.mix", f"{self.mix!r} is not one of {', '.join(MIX_RULES)}")
        _require(0 < self.mix_world_max <= 1, "aggregation.mix_world_max", "must be in (0, 1], e.g. 0.25")
        _require(math.isfinite(self.mix_z) and self.mix_z >= 0, "aggregation.mix_z", "must be >= 0, e.g. 2")
        _require(0 < self.tune_fraction < 1, "aggregation.tune_fraction", "must be in (0, 1), e.g. 0.05")
        _require(self.tune_tokens >= 1, "aggregation.tune_tokens", "must be a positive integer")
        _require(self.tune_pieces >= 1, "aggregation.tune_pieces", "must be a positive integer")
        _require(math.isfinite(self.evidence_share) and 0 <= self.evidence_share <= 10, "aggregation.evidence_share",
                 "must be in [0, 10] (0: a search every round), e.g. 0.05")
        _require(self.personal_tau > 0 or self.mix != "cosine", "aggregation.personal_tau",
                 "must be > 0 with mix = \"cosine\" (use mix = \"none\" to make members adopt the agreed model)")
        _require(self.personal_tau >= 0, "aggregation.personal_tau", "must be >= 0")
        _require(self.personal_scope in PERSONAL_SCOPES, "aggregation.personal_scope",
                 f"{self.personal_scope!r} is not one of {', '.join(PERSONAL_SCOPES)}")
        _require(self.personal_model in PERSONAL_MODELS, "aggregation.personal_model",
                 f"{self.personal_model!r} is not one of {', '.join(PERSONAL_MODELS)}")
        _require(self.shared_model in SHARED_MODELS, "aggregation.shared_model",
                 f"{self.shared_model!r} is not one of {', '.join(SHARED_MODELS)}")
        _require(self.region_backbone in REGION_BACKBONES, "aggregation.region_backbone",
                 f"{self.region_backbone!r} is not one of {', '.join(REGION_BACKBONES)}")
        _require(self.partner_check in PARTNER_CHECKS, "aggregation.partner_check",
                 f"{self.partner_check!r} is not one of {', '.join(PARTNER_CHECKS)}")
        _require(isinstance(self.partner_own_half, bool), "aggregation.partner_own_half", "must be true or false")
        _require(isinstance(self.partner_candidates, int) and not isinstance(self.partner_candidates, bool)
                 and 1 <= self.partner_candidates <= 64, "aggregation.partner_candidates",
                 "must be an integer in [1, 64], e.g. 6")
        _require(not (self.personal_model == "separate" and self.mix == "evidence" and self.personal_scope == "key"),
                 "aggregation.personal_scope", "\"key\" is what a separate personal model's shared model does "
                 "already; with personal_model = \"separate\" (the default) the personal model mixes by \"parts\" or "
                 "\"all\" (personal_model = \"inline\" with \"key\": one model per member on the agreed backbone)")
        _require(self.outer in OUTER_OPTIMIZERS, "aggregation.outer",
                 f"{self.outer!r} is not one of {', '.join(OUTER_OPTIMIZERS)}")
        _require(0 < self.outer_lr <= 2, "aggregation.outer_lr", "must be in (0, 2]")
        _require(0 <= self.outer_momentum < 1, "aggregation.outer_momentum", "must be in [0, 1)")
        _require(self.robust in ROBUST_RULES, "aggregation.robust",
                 f"{self.robust!r} is not one of {', '.join(ROBUST_RULES)}")
        _require(math.isfinite(self.robust_clip) and self.robust_clip >= 1, "aggregation.robust_clip",
                 "must be a finite number >= 1, e.g. 4")
        _require(isinstance(self.overlap, bool), "aggregation.overlap", "must be true or false")
        _require(self.schedule in ROUND_SCHEDULES, "aggregation.schedule",
                 f"{self.schedule!r} is not one of {', '.join(ROUND_SCHEDULES)}")
        for name in ("compress_backbone", "compress_key"):
            _require(getattr(self, name) in WIRE_CODECS, f"aggregation.{name}",
                     f"{getattr(self, name)!r} is not one of {', '.join(WIRE_CODECS)}")
        # (a world payload is a model, not a change: 8 bits over its range would lose it)
        _require(self.compress_world in ("none", "fp16"), "aggregation.compress_world",
                 f"{self.compress_world!r} is not one of none, fp16")


@dataclass(frozen=True, kw_only=True, slots=True)
class AveragingConfig:
    """Timings of a region round (seconds). Loopback defaults; raise them across the internet."""

    matchmaking_time: float = 3.0  # how long a round's leader waits for peers to join its group
    averaging_timeout: float = 30.0  # bound on one whole all-reduce (matchmaking included)
    barrier_timeout: float = 60.0  # how long a peer waits for its region's live peers to be ready
    request_timeout: float = 1.0
    min_group_size: int = 2
    target_group_size: int = 64
    leader_ttl: float = 10.0  # a region leader's lease; a dead leader is replaced within about this long
    ban_after: int = 2  # a member caught by the robust rule in this many rounds is never averaged with again

    def __post_init__(self) -> None:
        _require_finite("averaging", self, ("matchmaking_time", "averaging_timeout", "barrier_timeout",
                                            "request_timeout", "leader_ttl"))
        _require(self.matchmaking_time > 0, "averaging.matchmaking_time", "must be > 0")
        _require(self.request_timeout > 0, "averaging.request_timeout", "must be > 0")
        _require(self.request_timeout < self.matchmaking_time, "averaging.request_timeout",
                 "must be smaller than averaging.matchmaking_time (hivemind breaks matchmaking deadlocks with it)")
        _require(self.averaging_timeout > self.matchmaking_time, "averaging.averaging_timeout",
                 "must exceed averaging.matchmaking_time")
        _require(self.barrier_timeout >= 0, "averaging.barrier_timeout", "must be >= 0")
        _require(self.min_group_size >= 2, "averaging.min_group_size", "must be >= 2")
        _require(self.target_group_size >= self.min_group_size, "averaging.target_group_size",
                 "must be >= averaging.min_group_size")
        _require(self.leader_ttl >= 1.0, "averaging.leader_ttl", "must be >= 1 second")
        _require(self.ban_after >= 1, "averaging.ban_after", "must be a positive integer (rounds)")


# ----------------------------------------------------------------------------------- privacy


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and x == x and x not in (float("inf"), float("-inf"))


@dataclass(frozen=True, kw_only=True, slots=True)
class PrivacyPolicy:
    """What every region must at least meet (the run manifest's ``[privacy]`` table; 0 = no requirement).

    - ``min_border_noise``: every region adds at least this noise multiplier at its border.
    - ``max_border_clip``: and clips its delta to at most this norm.
    - ``max_peer_epsilon``: every peer runs DP-SGD spending at most this epsilon (a target epsilon;
      a peer that gives a noise multiplier instead is checked once its epsilon is known).
    - ``max_delta``: the delta of every guarantee is at most this.
    """

    min_border_noise: float = 0.0
    max_border_clip: float = 0.0
    max_peer_epsilon: float = 0.0
    max_delta: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("min_border_noise", "max_border_clip", "max_peer_epsilon"):
            _require(_finite(getattr(self, name)) and getattr(self, name) >= 0, f"privacy.{name}",
                     "must be a finite number >= 0 (0: no requirement)")
        _require(_finite(self.max_delta) and 0 < self.max_delta < 1, "privacy.max_delta", "must be in (0, 1)")


@dataclass(frozen=True, kw_only=True, slots=True)
class AdmissionPolicy:
    """Which regions admit their peers (the run manifest's ``[admission.regions]`` table): region ->
    the public half of its institutions' region key, one OpenSSH line (``worldlm-admit keygen``
    prints it). A peer may train in such a region only with a certificate signed by that key
    (:mod:`worldlm_p2p.net.admission`); regions not listed are open."""

    regions: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        seen = set()
        for pair in self.regions:
            _require(isinstance(pair, tuple) and len(pair) == 2, "admission.regions", "must map a region to a key")
            region, key = pair
            check_name("region", region)
            _require(region not in seen, f"admission.regions.{region}", "is listed twice")
            seen.add(region)
            _require(isinstance(key, str) and key.startswith("ssh-rsa ") and len(key) < 4096,
                     f"admission.regions.{region}", "must be an RSA public key line: ssh-rsa AAAA...")

    def key_of(self, region: str) -> str | None:
        """The public key line of ``region``, or None when the region is open."""
        return dict(self.regions).get(region)

    @classmethod
    def from_mapping(cls, values: Any) -> "AdmissionPolicy":
        if not isinstance(values, Mapping):
            raise ConfigError(f"[admission] must be a table, got {type(values).__name__}")
        unknown = sorted(set(values) - {"regions"})
        if unknown:
            raise ConfigError(f"admission.{unknown[0]}: unknown setting (known: regions)")
        regions = values.get("regions", {}) or {}
        if isinstance(regions, (list, tuple)):  # the wire form: pairs
            regions = {str(p[0]): p[1] for p in regions if isinstance(p, (list, tuple)) and len(p) == 2}
        if not isinstance(regions, Mapping):
            raise ConfigError("admission.regions must be a table of region = \"ssh-rsa ...\"")
        return cls(regions=tuple(sorted((str(r), k) for r, k in regions.items())))


# ----------------------------------------------------------------------------------- manifest


_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "tokenizer": TokenizerSpec,
    "train": TrainConfig,
    "aggregation": AggregationConfig,
    "averaging": AveragingConfig,
    "privacy": PrivacyPolicy,
}


def _build_section(cls: type, name: str, values: Any) -> Any:
    if not isinstance(values, Mapping):
        raise ConfigError(f"[{name}] must be a table, got {type(values).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"{name}.{unknown[0]}: unknown setting (known: {', '.join(sorted(known))})")
    kwargs = {}
    for key, value in values.items():
        expected = type(getattr(cls(), key)) if key != "path" else str
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise ConfigError(f"{name}.{key}: expected {expected.__name__}, got {value!r}")
        kwargs[key] = value
    return cls(**kwargs)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunManifest:
    """Everything the peers of one run must share. Published in the DHT by bootstrap nodes."""

    run_id: str
    model: ModelConfig = field(default_factory=lambda: MODEL_PRESETS["tiny"])
    tokenizer: TokenizerSpec = field(default_factory=TokenizerSpec)
    train: TrainConfig = field(default_factory=TrainConfig)
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    privacy: PrivacyPolicy = field(default_factory=PrivacyPolicy)
    admission: AdmissionPolicy = field(default_factory=AdmissionPolicy)

    def __post_init__(self) -> None:
        check_name("run id", self.run_id)
        _require(self.aggregation.strategy in SWARM_STRATEGIES, "aggregation.strategy",
                 f"{self.aggregation.strategy!r} is a single-process baseline: run it with worldlm-simulate")
        _require(self.train.seq_len <= self.model.max_seq_len, "train.seq_len",
                 f"{self.train.seq_len} exceeds model.max_seq_len {self.model.max_seq_len}")

    # -- (de)serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The manifest as plain values. ``admission`` appears only when a region admits its peers,
        so that the fingerprints of manifests without it are what they always were."""
        out = dataclasses.asdict(self)
        admission = out.pop("admission")
        if admission["regions"]:
            out["admission"] = {"regions": {r: k for r, k in admission["regions"]}}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RunManifest":
        """Build from a nested mapping (TOML or wire). ``[model] preset = "tiny"`` expands the preset;
        other keys of ``[model]`` override it."""
        if not isinstance(data, Mapping):
            raise ConfigError("run manifest must be a table")
        unknown = sorted(set(data) - {"run_id", "admission", *_SECTIONS})
        if unknown:
            raise ConfigError(f"{unknown[0]}: unknown section or setting in the run manifest")
        if "run_id" not in data:
            raise ConfigError("run_id: missing from the run manifest")
        kwargs: dict[str, Any] = {"run_id": data["run_id"]}
        for name, section_cls in _SECTIONS.items():
            values = dict(data.get(name, {}) or {})
            if name == "model":
                preset = values.get("preset", "tiny")
                if not isinstance(preset, str):
                    raise ConfigError(f"model.preset: expected str, got {preset!r}")
                if preset != "custom":
                    base = dataclasses.asdict(model_preset(preset))
                    base.update(values)
                    values = base
            kwargs[name] = _build_section(section_cls, name, values)
        kwargs["admission"] = AdmissionPolicy.from_mapping(data.get("admission", {}) or {})
        if not isinstance(kwargs["run_id"], str):
            raise ConfigError(f"run_id: expected str, got {kwargs['run_id']!r}")
        return cls(**kwargs)

    @classmethod
    def from_toml(cls, path: str | Path) -> "RunManifest":
        return cls.from_dict(load_toml(path))

    def fingerprint(self) -> str:
        """A short stable hash of the manifest; peers log it and compare it."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


#: a settings file larger than this is not a settings file (a manifest is a few hundred bytes)
MAX_TOML_BYTES = 1 << 20


def load_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        if path.exists() and not path.is_file() and not path.is_dir():
            raise ConfigError(f"config file {path} is not a regular file (a FIFO or a device?)")
        with path.open("rb") as f:
            blob = f.read(MAX_TOML_BYTES + 1)
        if len(blob) > MAX_TOML_BYTES:
            raise ConfigError(f"config file {path} is larger than {MAX_TOML_BYTES >> 20} MiB: not a settings file")
        return tomllib.loads(blob.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text (a binary file?)") from None
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None


def manifest_conflicts(manifest: RunManifest, local: Mapping[str, Any]) -> list[str]:
    """Compare local settings (a nested mapping shaped like the manifest, e.g. from a peer's
    ``--config`` file) with the manifest; return one message per contradicting setting."""
    messages: list[str] = []
    ref = manifest.to_dict()
    for section, values in local.items():
        if section == "run_id":
            if values != manifest.run_id:
                messages.append(f"run_id: local {values!r} != run manifest {manifest.run_id!r}")
            continue
        if section not in _SECTIONS:
            messages.append(f"{section}: unknown section")
            continue
        if not isinstance(values, Mapping):
            messages.append(f"[{section}] must be a table")
            continue
        if section == "model" and "preset" in values and values["preset"] != "custom":
            try:
                expanded = dataclasses.asdict(model_preset(values["preset"]))
            except ConfigError as e:
                messages.append(str(e))
                continue
            expanded.update(values)
            values = {k: v for k, v in expanded.items() if k != "vocab_size" or "vocab_size" in values}
        for key, value in values.items():
            if key not in ref[section]:
                messages.append(f"{section}.{key}: unknown setting")
            elif ref[section][key] != value:
                messages.append(f"{section}.{key}: local {value!r} != run manifest {ref[section][key]!r}")
    return messages
