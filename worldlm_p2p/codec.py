"""What a peer serves to others and what it checkpoints: typed records, each with one encoding and
one decoder that checks everything (pure: imports torch only).

- :class:`WorldChange`: a world round's change of a region's model, what the region adopts at
  ``apply_round`` (and, under border DP, the world model's shared part: the reference of the
  region's next border delta).
- :class:`ServedState`: what a peer serves through its averager's state sharing: the region's
  agreed model, the outer momentum, the last world change known and the region's border-DP
  history. Late joiners load the agreed model from it; members download a leader's world change
  from it. On the wire it is a flat tensor list (agreed, momentum, change, reference) described
  by small counts in the metadata; :meth:`ServedState.decode` is the only reader, and refuses
  (:class:`StateError`, one line) anything that does not fit this run's model: wrong counts,
  shapes, fingerprint, types, or a tensor that is not finite.
- :class:`PeerCheckpoint`: what a peer writes at every checkpoint and what ``worldlm-export``
  reads back (the file format, atomic and checksummed, is :mod:`worldlm_p2p.checkpoint`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch


class StateError(ValueError):
    """A served state or checkpoint payload that this peer cannot use, with the reason."""


def _int(meta: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = meta.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise StateError(f"{key} is not an integer")
    return value


def _finite(tensors: Sequence[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _fits(tensors: Sequence[torch.Tensor], template: Sequence[torch.Tensor]) -> bool:
    return len(tensors) == len(template) and all(
        isinstance(t, torch.Tensor) and t.shape == s.shape for t, s in zip(tensors, template))


def _narrow(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp16 when that loses nothing (every value an fp16 number), else as it is; the
    decoder reads every tensor back as float32."""
    if t.dtype == torch.float32:
        half = t.half()
        if torch.equal(half.float(), t):
            return half
    return t


def _cpu(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().to("cpu", torch.float32).clone() for t in tensors]


@dataclass(frozen=True, kw_only=True, slots=True)
class WorldChange:
    """The change a world round made to a region's model: ``delta`` (one tensor per parameter),
    adopted by every member at region round ``apply_round``; ``source``: the leader that computed it;
    ``reference``: under border DP the world model's shared part (else None)."""

    world_round: int
    delta: list[torch.Tensor]
    apply_round: int
    source: str
    reference: list[torch.Tensor] | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class ServedState:
    """What a peer serves (see the module docstring). ``round``: the region round the agreed model
    is the start of; ``world_round``: the last world round the server adopted (-1: none)."""

    round: int
    world_round: int
    agreed: list[torch.Tensor]
    momentum: list[torch.Tensor] = field(default_factory=list)
    change: WorldChange | None = None
    border_history: list = field(default_factory=list)

    def encode(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """``(metadata, tensors)``: the metadata's counts describe the flat tensor list."""
        c = self.change
        ref = list(c.reference) if c is not None and c.reference is not None else []
        # a world change whose values are all fp16 numbers (rounds.hand_down) travels in fp16, losslessly
        tensors = list(self.agreed) + list(self.momentum) + ([_narrow(d) for d in c.delta] if c else []) + ref
        meta = dict(n_momentum=len(self.momentum), n_delta=len(c.delta) if c else 0,
                    delta_world_round=c.world_round if c else -1, delta_apply_round=c.apply_round if c else -1,
                    delta_source=c.source if c else "", border_history=list(self.border_history), n_ref=len(ref),
                    world_round=int(self.world_round))
        return meta, tensors

    @classmethod
    def decode(cls, meta: Any, tensors: Sequence[Any], *, template: Sequence[torch.Tensor],
               backbone: Sequence[torch.Tensor], shared: Sequence[torch.Tensor], fingerprint: str) -> "ServedState":
        """The state a peer served, checked against this run: ``template`` is the model's
        parameters, ``backbone`` the parameters the outer momentum covers, ``shared`` those a border
        reference covers; ``fingerprint`` the run manifest's. Raises :class:`StateError`."""
        if not isinstance(meta, Mapping):
            raise StateError("its metadata is not a mapping")
        if meta.get("fingerprint") != fingerprint:
            raise StateError("it belongs to another run manifest")
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            raise StateError("it holds something other than tensors")
        n_mom, n_delta, n_ref = _int(meta, "n_momentum", 0), _int(meta, "n_delta", 0), _int(meta, "n_ref", 0)
        n = len(template)
        if n_mom not in (0, len(backbone)) or n_delta not in (0, n) or n_ref not in (0, len(shared)) or (
                n_ref and not n_delta):
            raise StateError("its tensor counts do not fit this run's model")
        if len(tensors) != n + n_mom + n_delta + n_ref:
            raise StateError(f"it holds {len(tensors)} tensors, not the {n + n_mom + n_delta + n_ref} its counts say")
        agreed, rest = list(tensors[:n]), list(tensors[n:])
        momentum, rest = rest[:n_mom], rest[n_mom:]
        delta, ref = rest[:n_delta], rest[n_delta:]
        if not (_fits(agreed, template) and (not n_mom or _fits(momentum, backbone))
                and (not n_delta or _fits(delta, template)) and (not n_ref or _fits(ref, shared))):
            raise StateError("its tensor shapes do not fit this run's model")
        if not _finite(tensors):
            raise StateError("it holds a value that is not finite")
        change = None
        if n_delta:
            source = meta.get("delta_source")
            change = WorldChange(world_round=_int(meta, "delta_world_round"), delta=_cpu(delta),
                                 apply_round=_int(meta, "delta_apply_round"),
                                 source=source if isinstance(source, str) else "",
                                 reference=_cpu(ref) if n_ref else None)
        history = meta.get("border_history")
        return cls(round=_int(meta, "round", 0), world_round=_int(meta, "world_round", -1), agreed=_cpu(agreed),
                   momentum=_cpu(momentum), change=change, border_history=history if isinstance(history, list) else [])


#: the payload keys every peer checkpoint has (older ones may lack the others)
CHECKPOINT_REQUIRED = ("fingerprint", "region", "model", "anchor", "stats")


@dataclass(frozen=True, kw_only=True, slots=True)
class PeerCheckpoint:
    """A peer's checkpoint payload: its model (``state_dict``), optimizer, the region's agreed model
    (``anchor``) and outer momentum, its stats (:meth:`worldlm_p2p.peer.stats.PeerStats.checkpoint_view`),
    the run manifest (a dict; None in older checkpoints), who wrote it, under border DP the last
    world model and the region's accountant, and with a separate personal model
    (``aggregation.personal_model``) that model (``personal``, a ``state_dict``) and its optimizer;
    ``model`` is then the shared model, the one that takes part in the rounds. ``evidence``: the
    member's evidence budget (``aggregation.evidence_share``; None in older checkpoints)."""

    fingerprint: str
    region: str
    model: dict[str, torch.Tensor]
    anchor: list[torch.Tensor]
    stats: dict[str, Any]
    run_id: str | None = None
    optimizer: dict[str, Any] | None = None
    momentum: list[torch.Tensor] | None = None
    manifest: dict[str, Any] | None = None
    label: str | None = None
    peer_id: str | None = None
    world_ref: list[torch.Tensor] | None = None
    border: dict[str, Any] | None = None
    has_world_ref: bool = True  # False for older checkpoints that did not store it
    personal: dict[str, torch.Tensor] | None = None
    personal_optimizer: dict[str, Any] | None = None
    #: the evidence budget's accounts and last weights (:meth:`worldlm_p2p.mixing.EvidenceBudget.state_dict`)
    evidence: dict[str, Any] | None = None

    def to_payload(self) -> dict[str, Any]:
        return dict(run_id=self.run_id, fingerprint=self.fingerprint, region=self.region, model=self.model,
                    optimizer=self.optimizer, anchor=list(self.anchor), momentum=self.momentum, stats=self.stats,
                    manifest=self.manifest, label=self.label, peer_id=self.peer_id, world_ref=self.world_ref,
                    border=self.border, personal=self.personal, personal_optimizer=self.personal_optimizer,
                    evidence=self.evidence)

    @classmethod
    def from_payload(cls, p: Any) -> "PeerCheckpoint":
        """Raises :class:`StateError` for a payload that is not a peer checkpoint."""
        if not isinstance(p, Mapping):
            raise StateError("is not a peer checkpoint (not a mapping)")
        missing = [k for k in CHECKPOINT_REQUIRED if k not in p]
        if missing:
            raise StateError(f"is not a peer checkpoint (no {', '.join(missing)})")
        if not isinstance(p["model"], dict) or not isinstance(p["anchor"], (list, tuple)) or not isinstance(
                p["stats"], dict):
            raise StateError("is not a peer checkpoint (unexpected payload types)")
        tensors = lambda v: [t for t in v] if isinstance(v, (list, tuple)) else None  # noqa: E731
        return cls(fingerprint=p["fingerprint"], region=p["region"], model=p["model"], anchor=list(p["anchor"]),
                   stats=p["stats"], run_id=p.get("run_id"), optimizer=p.get("optimizer"),
                   momentum=tensors(p.get("momentum")), manifest=p.get("manifest"), label=p.get("label"),
                   peer_id=p.get("peer_id"), world_ref=tensors(p.get("world_ref")),
                   border=p.get("border") if isinstance(p.get("border"), dict) else None,
                   has_world_ref="world_ref" in p,
                   personal=p.get("personal") if isinstance(p.get("personal"), dict) else None,
                   personal_optimizer=p.get("personal_optimizer") if isinstance(p.get("personal_optimizer"), dict)
                   else None,
                   evidence=p.get("evidence") if isinstance(p.get("evidence"), dict) else None)


def state_digest(tensors: Sequence[torch.Tensor]) -> str:
    """A short digest (blake2b, 16 hex digits) of a list of tensors, their dtypes and shapes
    included: members publish the digest of the agreed model they serve, and a joiner accepts a
    download only when the region's members agree on it."""
    import hashlib

    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        c = t.detach().to("cpu").contiguous()
        h.update(f"{c.dtype}{tuple(c.shape)};".encode())
        h.update(c.view(torch.uint8).numpy().tobytes() if c.numel() else b"")
    return h.hexdigest()


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, inf) replaced by None, recursively, so that
    ``json.dumps(..., allow_nan=False)`` writes strict JSON (a bare ``NaN`` is not JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
