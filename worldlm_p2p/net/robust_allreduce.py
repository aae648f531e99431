"""hivemind's all-reduce with a robust rule in every reducer, and a check of what the reducers sent.

hivemind cuts the group's vector into one span per peer; each peer reduces its span from every
sender's part (``TensorPartReducer``: ``sum w x / sum w``) and streams the result back. Two seams
make that robust (the rule is :func:`worldlm_p2p.robust.robust_mean`, coordinate-wise, so the
swarm's result equals the pure function on the whole vectors, whatever the spans):

- :class:`RobustPartReducer` keeps every sender's part of the current piece, and when all have
  arrived aggregates them with the rule: weights capped, NaN/Inf values left out (the piece goes
  on without them), values clipped around the senders' median. It tallies, per sender, what the rule
  saw (:class:`SenderTally`).
- :class:`RobustAllReduceRunner` installs that reducer and watches what comes back: a reducer that
  failed (its span of the vector was never averaged: the members would end with different models)
  or that sent back a non-finite result fails the round for this member, and is named.

The peer reads the tallies after the round (:meth:`worldlm_p2p.net.averaging.RegionAverager.take_report`)
to name the senders caught and ban the repeat offenders.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Sequence

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer

from worldlm_p2p import robust

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class RobustSettings:
    """The rule every reducer applies (see :mod:`worldlm_p2p.robust`)."""

    rule: robust.RobustRule = "clip"
    clip: float = 4.0
    max_weight: float | None = None  # a sender's weight is capped at this (None: no cap)


@dataclass(slots=True)
class SenderTally:
    """What this reducer saw of one sender over a round: its pieces, how many were not finite, and
    how many of its values were clipped out of how many."""

    pieces: int = 0
    nonfinite: int = 0
    clipped: float = 0.0
    values: int = 0
    weight_capped: bool = False

    def why_caught(self, *, clipped_above: float) -> str:
        if self.nonfinite:
            return f"sent NaN/Inf in {self.nonfinite} of {self.pieces} pieces"
        if self.values and self.clipped / self.values > clipped_above:
            return f"{self.clipped / self.values:.0%} of its values lay beyond the clip"
        return ""


class RobustPartReducer(TensorPartReducer):
    """A ``TensorPartReducer`` that aggregates each piece with :func:`worldlm_p2p.robust.robust_mean`
    once every (live) sender's part of it arrived, instead of a running weighted sum."""

    def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int, *, settings: RobustSettings):
        self.settings = settings
        self.tallies = [SenderTally() for _ in range(num_senders)]
        self._rows: dict[int, tuple[torch.Tensor, float]] = {}
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self):
        self._rows = {}
        super().reset_accumulators()
        self.accumulator = None  # not used: the pieces are kept in _rows

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                              weight: float = 1.0) -> torch.Tensor:
        if not 0 <= sender_index < self.num_senders or not 0 <= part_index < self.num_parts:
            raise AllreduceException(f"invalid sender {sender_index} or part {part_index}")
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:  # the pieces are reduced in order
            finished = asyncio.create_task(self.finished.wait())
            await asyncio.wait({self.current_part_future, finished}, return_when=asyncio.FIRST_COMPLETED)
            finished.cancel()
            if self.finished.is_set():
                raise AllreduceException("a piece arrived after the reducer finished")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was dropped from this round")
        if part_index != self.current_part_index or sender_index in self._rows:
            raise AllreduceException(f"sender {sender_index} sent piece {part_index} twice or out of order")
        if tuple(tensor_part.shape) != tuple(self.part_shapes[part_index]):
            raise AllreduceException(f"sender {sender_index} sent a piece of shape {tuple(tensor_part.shape)}, "
                                     f"expected {tuple(self.part_shapes[part_index])}")
        future = self.current_part_future
        self._rows[sender_index] = (tensor_part, float(weight))
        self.current_part_accumulated_from += 1
        self.check_current_part_finished()
        return await future

    def check_current_part_finished(self):
        if self.current_part_accumulated_from < self.num_current_senders:
            return
        senders = sorted(i for i in self._rows if self.current_part_index < self.sender_failed_after[i])
        future = self.current_part_future
        if not senders:
            future.set_exception(AllreduceException("no sender left for this piece"))
        else:
            rows = torch.stack([self._rows[i][0].reshape(-1) for i in senders])
            weights = [self._rows[i][1] for i in senders]
            s = self.settings
            try:
                agg = robust.robust_mean(rows, weights, rule=s.rule, clip=s.clip, max_weight=s.max_weight)
            except ValueError as e:  # a coordinate where every sender sent NaN/Inf
                for i in senders:
                    self.tallies[i].pieces += 1
                    self.tallies[i].nonfinite += 1
                future.set_exception(AllreduceException(f"no usable sender for this piece: {e}"))
            else:
                for k, i in enumerate(senders):
                    t = self.tallies[i]
                    t.pieces += 1
                    t.nonfinite += int(agg.nonfinite[k] > 0)
                    t.clipped += agg.clipped[k] * rows.shape[1]
                    t.values += rows.shape[1]
                    t.weight_capped |= s.max_weight is not None and weights[k] > s.max_weight
                future.set_result(agg.value.reshape(self.part_shapes[self.current_part_index]))
        self.reset_accumulators()


class RobustAllReduceRunner(AllReduceRunner):
    """hivemind's ``AllReduceRunner`` with a :class:`RobustPartReducer`, failing (and naming) any
    reducer whose span was lost or came back non-finite."""

    def __init__(self, *, robust_settings: RobustSettings, **kwargs):
        super().__init__(**kwargs)
        self.tensor_part_reducer = RobustPartReducer(tuple(p.shape for p in self.parts_for_local_averaging),
                                                     len(self.sender_peer_ids), settings=robust_settings)
        self.bad_reducers: dict[str, str] = {}  # peer id -> why
        container = self.tensor_part_container
        register_processed, register_failed = container.register_processed_part, container.register_failed_reducer

        def processed(peer_index: int, part_index: int, delta: torch.Tensor) -> None:
            if not bool(torch.isfinite(delta).all()):
                self.bad_reducers.setdefault(str(self.ordered_peer_ids[peer_index]), "sent back NaN/Inf")
            register_processed(peer_index, part_index, delta)

        def failed(peer_index: int) -> None:
            self.bad_reducers.setdefault(str(self.ordered_peer_ids[peer_index]),
                                         "did not send back its span of the average")
            register_failed(peer_index)

        container.register_processed_part, container.register_failed_reducer = processed, failed

    def dropped_senders(self) -> list[str]:
        """The senders whose parts this peer's reducer stopped waiting for (hivemind's sender timeout, a
        broken stream): its span of the average was made without them."""
        failed = self.tensor_part_reducer.sender_failed_after
        return [str(pid) for pid, after in zip(self.sender_peer_ids, failed) if after != float("inf")]

    def sender_report(self) -> dict[str, SenderTally]:
        """Peer id -> what this peer's reducer saw of it in this round."""
        return {str(pid): t for pid, t in zip(self.sender_peer_ids, self.tensor_part_reducer.tallies)}


@dataclass(frozen=True, slots=True)
class RoundReport:
    """What the averager process saw in its last all-reduce, for the peer to act on: the senders its
    reducer caught (peer id -> why) and the reducers that failed it (peer id -> why)."""

    caught: dict[str, str] = field(default_factory=dict)
    bad_reducers: dict[str, str] = field(default_factory=dict)
    dropped: tuple[str, ...] = ()  # senders this peer's reducer averaged without (a part was lost)
