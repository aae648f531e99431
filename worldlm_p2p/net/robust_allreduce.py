"""hivemind's all-reduce with a robust rule in every reducer, and a check of what the reducers sent.

hivemind cuts the group's vector into one span per peer; each peer reduces its span from every
sender's part (``TensorPartReducer``: ``sum w x / sum w``) and streams the result back. Two seams
make that robust (the rule is :func:`worldlm_p2p.robust.robust_mean`, coordinate-wise, so the
swarm's result equals the pure function on the whole vectors, whatever the spans):

- :class:`RobustPartReducer` keeps every sender's part of the current piece, and when all have
  arrived aggregates them with the rule: weights capped, NaN/Inf values left out (the piece goes
  on without them), values clipped around the senders' median. It tallies, per sender, what the rule
  saw (:class:`SenderTally`).
- :class:`RobustAllReduceRunner` installs that reducer, sends every sender the encoded aggregate
  itself (with the run's wire codec, :mod:`worldlm_p2p.compression`, the group still ends with one
  model) and watches what comes back: a reducer that
  failed (its span of the vector was never averaged: the members would end with different models)
  or that sent back a non-finite result fails the round for this member, and is named.

The peer reads the tallies after the round (:meth:`worldlm_p2p.net.averaging.RegionAverager.take_report`)
to name the senders caught and ban the repeat offenders. The reducer also keeps a sample of what
each sender sent, at positions it draws from a private generator (:data:`SEEN_SAMPLES` values per
sender, spread over its span): what a mate later serves as its contribution (backbone partners)
must agree with it there (:func:`worldlm_p2p.rounds.served_mismatch`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Sequence

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer
from hivemind.compression import deserialize_torch_tensor
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import amap_in_executor

from worldlm_p2p import robust

logger = logging.getLogger(__name__)

#: how many values of each sender's part a reducer keeps, at positions spread over its span
SEEN_SAMPLES = 1024


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

    def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int, *, settings: RobustSettings,
                 part_offsets: Sequence[int] | None = None, samples: int = SEEN_SAMPLES):
        """``part_offsets``: where each piece starts in the group's vector (the tensors flattened in
        order); with them the reducer keeps up to about ``samples`` values of every sender's pieces
        (:meth:`seen`), at positions drawn from a private generator (a sender cannot know them)."""
        self.settings = settings
        self.tallies = [SenderTally() for _ in range(num_senders)]
        self._rows: dict[int, tuple[torch.Tensor, float]] = {}
        self._offsets = list(part_offsets) if part_offsets is not None else None
        if self._offsets is not None and len(self._offsets) != len(part_shapes):
            raise ValueError(f"{len(self._offsets)} offsets for {len(part_shapes)} pieces")
        span = sum(math.prod(s) for s in part_shapes)
        self._rate = min(1.0, samples / span) if span and samples > 0 else 0.0
        self._draw = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        self._seen: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(num_senders)]
        super().__init__(part_shapes, num_senders)

    def seen(self, sender_index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The positions (in the group's vector) and values of ``sender_index``'s pieces that this
        reducer kept, as it aggregated them (decoded); None when it kept none."""
        kept = self._seen[sender_index]
        if not kept:
            return None
        return torch.cat([p for p, _ in kept]), torch.cat([v for _, v in kept])

    def _keep_sample(self, senders: Sequence[int], rows: torch.Tensor) -> None:
        if self._offsets is None or not self._rate:
            return
        n = rows.shape[1]
        m = min(n, max(1, math.ceil(n * self._rate)))
        at = torch.randperm(n, generator=self._draw)[:m].sort().values
        start = self._offsets[self.current_part_index]
        for k, i in enumerate(senders):
            self._seen[i].append((at + start, rows[k, at].to(torch.float32).clone()))

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
            self._keep_sample(senders, rows)
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
        container = self.tensor_part_container
        own = self.ordered_peer_ids.index(self.peer_id)
        # where this peer's span starts in the group's vector: the parts are dealt out in order
        start = sum(part.numel() for k in range(own) for part, _ in container._input_parts_by_peer[k])
        sizes = [p.numel() for p in self.parts_for_local_averaging]
        offsets = [start + sum(sizes[:k]) for k in range(len(sizes))]
        self.tensor_part_reducer = RobustPartReducer(tuple(p.shape for p in self.parts_for_local_averaging),
                                                     len(self.sender_peer_ids), settings=robust_settings,
                                                     part_offsets=offsets)
        self.bad_reducers: dict[str, str] = {}  # peer id -> why
        # the runner yields each tensor's averaged value, not hivemind's delta to it: a member applies
        # the encoded aggregate itself, bit for bit what every other member applies (a lost span
        # yields the local part, and fails the round)
        container.return_deltas = False
        register_processed, register_failed = container.register_processed_part, container.register_failed_reducer
        self._infos = [[info for _, info in parts] for parts in container._input_parts_by_peer]
        self._own_aggregates: dict[int, torch.Tensor] = {}
        own_sender = self.sender_peer_ids.index(self.peer_id) if self.peer_id in self.sender_peer_ids else None
        accumulate = self.tensor_part_reducer.accumulate_part

        async def accumulate_as_sent(sender_index: int, part_index: int, tensor_part: torch.Tensor,
                                     weight: float = 1.0) -> torch.Tensor:
            own_part = sender_index == own_sender and 0 <= part_index < len(self._infos[own])
            if own_part:  # the reducer's own part, as the others' arrive: encoded and decoded
                tensor_part = self._roundtrip(tensor_part, self._infos[own][part_index])
            aggregate = await accumulate(sender_index, part_index, tensor_part, weight=weight)
            if own_part:
                self._own_aggregates[part_index] = aggregate
            return aggregate

        self.tensor_part_reducer.accumulate_part = accumulate_as_sent
        lost: set[int] = set()

        def processed(peer_index: int, part_index: int, value: torch.Tensor) -> None:
            if not 0 <= part_index < len(self._infos[peer_index]):
                raise AllreduceException(f"peer {self.ordered_peer_ids[peer_index]} sent back part {part_index} of "
                                         f"{len(self._infos[peer_index])}")
            local = container._input_parts_by_peer[peer_index][part_index][0]
            if peer_index == own and peer_index not in lost:  # this member's span: the aggregate, as sent
                value = self._roundtrip(self._own_aggregates.pop(part_index), self._infos[own][part_index])
            if tuple(value.shape) != tuple(local.shape):
                raise AllreduceException(f"peer {self.ordered_peer_ids[peer_index]} sent back a part of shape "
                                         f"{tuple(value.shape)}, expected {tuple(local.shape)}")
            if not bool(torch.isfinite(value).all()):
                self.bad_reducers.setdefault(str(self.ordered_peer_ids[peer_index]), "sent back NaN/Inf")
            register_processed(peer_index, part_index, value.to(local.dtype))

        def failed(peer_index: int) -> None:
            self.bad_reducers.setdefault(str(self.ordered_peer_ids[peer_index]),
                                         "did not send back its span of the average")
            lost.add(peer_index)
            register_failed(peer_index)  # registers this member's own parts for the span (through processed)

        container.register_processed_part, container.register_failed_reducer = processed, failed

    def _roundtrip(self, tensor: torch.Tensor, info) -> torch.Tensor:
        """``tensor`` encoded and decoded as the all-reduce carries it (the run's codec for its tensor)."""
        return deserialize_torch_tensor(self.tensor_part_container.compression.compress(tensor, info))

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        """hivemind's reducer loop, except that every sender gets back the encoded aggregate of its part
        (hivemind sends the difference between the aggregate and the sender's decoded part, which the
        sender adds to its own, undecoded part: with a lossy codec each member would end the round
        with its own model). The same bytes go to every sender and this member decodes the same, so
        that the group agrees exactly."""
        part_index = 0
        loop = asyncio.get_event_loop()
        compress = self.tensor_part_container.compression.compress
        own = self.ordered_peer_ids.index(self.peer_id)
        try:
            async for tensor_part, weight in amap_in_executor(
                    lambda msg: (deserialize_torch_tensor(msg.tensor_part), msg.weight),
                    stream, max_prefetch=self.tensor_part_container.prefetch):
                try:
                    aggregate = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, tensor_part,
                                                                               weight=weight)
                    info = self._infos[own][part_index]
                    part_index += 1
                except BannedException:
                    break  # this sender was dropped from the round
                encoded = await loop.run_in_executor(None, lambda: compress(aggregate, info))
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=encoded)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])

    def dropped_senders(self) -> list[str]:
        """The senders whose parts this peer's reducer stopped waiting for (hivemind's sender timeout, a
        broken stream): its span of the average was made without them."""
        failed = self.tensor_part_reducer.sender_failed_after
        return [str(pid) for pid, after in zip(self.sender_peer_ids, failed) if after != float("inf")]

    def sender_samples(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Peer id -> the positions and values of its parts that this peer's reducer kept
        (:meth:`RobustPartReducer.seen`); senders it kept nothing of are left out."""
        out = {}
        for i, pid in enumerate(self.sender_peer_ids):
            seen = self.tensor_part_reducer.seen(i)
            if seen is not None:
                out[str(pid)] = seen
        return out

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
    # peer id -> (positions, values): a sample of what each other sender sent, as this peer's reducer saw it
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
