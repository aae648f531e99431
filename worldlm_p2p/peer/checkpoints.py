"""Checkpoints of a peer: what it writes (one typed payload, :class:`worldlm_p2p.codec.PeerCheckpoint`,
in the atomic, checksummed file format of :mod:`worldlm_p2p.checkpoint`) and how it resumes."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from worldlm_p2p.checkpoint import load_latest_checkpoint, save_checkpoint
from worldlm_p2p.codec import PeerCheckpoint, StateError
from worldlm_p2p.config import PeerConfig, RunManifest
from worldlm_p2p.errors import CheckpointError

from worldlm_p2p.peer.member import Member
from worldlm_p2p.peer.state import RegionState
from worldlm_p2p.peer.stats import PeerStats

logger = logging.getLogger(__name__)


def write(config: PeerConfig, manifest: RunManifest, *, member: Member, state: RegionState, stats: PeerStats,
          label: str, peer_id: str) -> Path | None:
    """A checkpoint of this peer now, and its path (nothing without ``config.checkpoint_dir``)."""
    if not config.checkpoint_dir:
        return None
    ckpt = PeerCheckpoint(
        run_id=manifest.run_id, fingerprint=manifest.fingerprint(), region=config.region,
        model={k: v.detach().to("cpu") for k, v in member.model.state_dict().items()},
        optimizer=member.trainer.state_dict(), anchor=state.anchor, momentum=state.momentum,
        stats=stats.checkpoint_view(), manifest=manifest.to_dict(), label=label, peer_id=peer_id,
        world_ref=state.world_ref, border=state.border.state_dict() if state.border is not None else None,
        personal={k: v.detach().to("cpu") for k, v in member.personal.model.state_dict().items()}
        if member.personal is not None else None,
        personal_optimizer=member.personal.state_dict() if member.personal is not None else None,
        evidence=member.budget.state_dict() if member.budget is not None else None)
    path = save_checkpoint(config.checkpoint_dir, step=stats.step, payload=ckpt.to_payload(),
                           keep=config.keep_checkpoints)
    logger.info("checkpoint written: %s", path)
    return path


def resume(config: PeerConfig, manifest: RunManifest, *, member: Member, state: RegionState,
           stats: PeerStats) -> bool:
    """Resume from the latest valid checkpoint of ``config.checkpoint_dir`` (False: none)."""
    if not config.checkpoint_dir:
        return False
    loaded = load_latest_checkpoint(config.checkpoint_dir)
    if loaded is None:
        return False
    for path, why in loaded.skipped:
        logger.warning("checkpoint %s is unusable (%s); resumed from %s instead", path, why, loaded.path)
    try:
        ckpt = PeerCheckpoint.from_payload(loaded.payload)
    except StateError as e:
        raise CheckpointError(f"checkpoint {loaded.path} {e}") from None
    if ckpt.fingerprint != manifest.fingerprint():
        raise CheckpointError(f"checkpoint {loaded.path} belongs to another run manifest "
                              f"({ckpt.run_id}, {ckpt.fingerprint}); use another --checkpoint-dir")
    params = member.params()
    anchor = ckpt.anchor
    if len(anchor) != len(params) or any(not isinstance(a, torch.Tensor) or a.shape != p.shape
                                         for a, p in zip(anchor, params)):
        raise CheckpointError(f"checkpoint {loaded.path} does not fit this model: its region reference has other "
                              f"tensors or shapes")
    for what, tensors in (("region reference", anchor), ("outer momentum", ckpt.momentum or [])):
        if not all(isinstance(t, torch.Tensor) and bool(torch.isfinite(t).all()) for t in tensors):
            raise CheckpointError(f"checkpoint {loaded.path}: its {what} holds NaN/Inf or non-tensors")
    if ckpt.momentum is not None and len(ckpt.momentum) > len(params):
        raise CheckpointError(f"checkpoint {loaded.path} does not fit this model: its outer momentum has "
                              f"{len(ckpt.momentum)} tensors")
    try:
        member.model.load_state_dict(ckpt.model)
        member.trainer.load_state_dict(ckpt.optimizer)
        if member.personal is not None and ckpt.personal is not None:
            member.personal.model.load_state_dict(ckpt.personal)
            if ckpt.personal_optimizer is not None:
                member.personal.load_state_dict(ckpt.personal_optimizer)
        elif member.personal is not None:  # a checkpoint of one model: the personal one starts from it
            logger.warning("checkpoint %s holds no personal model: this peer's personal model starts from its "
                           "shared one", loaded.path)
            member.follow_shared()
        state.anchor = [t.to("cpu") for t in ckpt.anchor]
        state.momentum = [t.to("cpu") for t in ckpt.momentum] if ckpt.momentum is not None else None
    except (KeyError, RuntimeError, ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(f"checkpoint {loaded.path} does not fit this model: {type(e).__name__}") from None
    stats.restore(ckpt.stats)
    if member.budget is not None and ckpt.evidence is not None:
        try:
            member.budget.load_state_dict(ckpt.evidence)
        except ValueError as e:  # the accounts only pace the searches: start new ones, say so
            logger.warning("checkpoint %s: its evidence budget is unusable (%s); this member starts new accounts",
                           loaded.path, e)
    if ckpt.has_world_ref:
        state.world_ref = [t.to("cpu") for t in ckpt.world_ref] if ckpt.world_ref is not None else None
    if state.border is not None and ckpt.border is not None:
        state.adopt_border_history(ckpt.border.get("history"))
    stats.initial_step, stats.initial_tokens, stats.started_from = stats.step, stats.tokens, "checkpoint"
    logger.info("resumed from checkpoint %s at step %d (%d tokens, %d rounds)", loaded.path, stats.step, stats.tokens,
                stats.rounds_completed)
    return True
