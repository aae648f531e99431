"""The region's state as one peer knows it (torch only; owned by the peer's main thread).

:class:`RegionState` holds what the region agreed and what the world changed: the agreed model
(the ``anchor``, the reference of the next region round), the outer momentum, the last world
change known, and under border DP the last world model and the region's accountant. Only the main
thread changes it; the world-round thread gets copies (:meth:`RegionState.snapshot`) and hands its
result back as a :class:`~worldlm_p2p.codec.WorldChange` (see :mod:`worldlm_p2p.peer.world`).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from worldlm_p2p.codec import ServedState, WorldChange
from worldlm_p2p.privacy import BorderAccountant

logger = logging.getLogger(__name__)


class RegionState:
    def __init__(self, *, anchor: Sequence[torch.Tensor], border_delta: float | None) -> None:
        self.anchor: list[torch.Tensor] = [t.detach().to("cpu", copy=True) for t in anchor]
        self.momentum: list[torch.Tensor] | None = None
        self.change: WorldChange | None = None  # the last world change known
        # border DP: the region's delta is taken against the last world model (the common init before
        # any; None: unknown, a late joiner, which may not lead until it has adopted a world round)
        self.world_ref: list[torch.Tensor] | None = [t.clone() for t in self.anchor]
        self.border = BorderAccountant(delta=border_delta) if border_delta is not None else None

    def snapshot(self) -> list[torch.Tensor]:
        """A copy of the agreed model, for another thread."""
        return [t.clone() for t in self.anchor]

    def served(self, *, round_index: int, world_round: int) -> ServedState:
        """What this peer serves: the agreed model of region round ``round_index``."""
        return ServedState(round=round_index, world_round=world_round, agreed=list(self.anchor),
                           momentum=list(self.momentum) if self.momentum is not None else [], change=self.change,
                           border_history=self.border.state_dict()["history"] if self.border else [])

    def rebase(self, delta: Sequence[torch.Tensor]) -> None:
        """The region's agreed model takes a world change whole."""
        self.anchor = [a + d for a, d in zip(self.anchor, delta)]

    def set_world_reference(self, shared: Sequence[int], reference: Sequence[torch.Tensor]) -> None:
        """Border DP: the world model's shared part becomes the reference of the next border delta."""
        full = list(self.world_ref or self.anchor)
        for i, t in zip(shared, reference):
            full[i] = t
        self.world_ref = full

    def adopt_border_history(self, history: Any) -> None:
        """Members keep the region's border accountant too (the leader's, from the shared state), so
        that it survives a change of leader: the longer history wins."""
        if self.border is None or not isinstance(history, list):
            return
        try:
            other = BorderAccountant.from_state(dict(delta=self.border.delta, history=history))
        except (TypeError, ValueError, KeyError):
            logger.warning("ignored a malformed border-DP history from the region's state")
            return
        if other.releases > self.border.releases:
            self.border = other
