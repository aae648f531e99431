"""A peer's counters, and the views derived from their one definition (imports the standard library only).

Each field of :class:`PeerStats` says in its metadata whether it is checkpointed (and so restored
on resume) and under which name it appears in the peer's summary; :meth:`PeerStats.checkpoint_view`,
:meth:`PeerStats.restore` and :meth:`PeerStats.summary_view` are derived from that, so a new
counter is declared once. The progress record (:meth:`worldlm_p2p.peer.core.Peer.record`) maps the
fields to the wire names of :class:`worldlm_p2p.net.records.ProgressRecord`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields
from typing import Any


def _stat(default: Any = 0, *, ckpt: bool = True, summary: str | bool = True, factory=None):
    """A counter: ``ckpt`` (saved in checkpoints and restored on resume), ``summary`` (its name in
    the summary: True for the field's own, False for none)."""
    meta = dict(ckpt=ckpt, summary=summary)
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


@dataclass
class PeerStats:
    step: int = _stat(0, summary="steps")
    tokens: int = _stat(0)
    tokens_since_round: int = _stat(0, summary=False)
    round: int = _stat(0, summary=False)  # next region round index
    rounds_completed: int = _stat(0)
    rounds_failed: int = _stat(0)
    # of rounds_completed, those that lost a part: a member that waited at the barrier was not in the
    # group, or this peer's reducer dropped a sender's part (the group still agrees on its average)
    rounds_partial: int = _stat(0)
    group_sizes: list[int] = _stat(factory=list)
    round_seconds: list[float] = _stat(ckpt=False, factory=list)
    first_train_loss: float | None = _stat(None)
    last_train_loss: float = _stat(float("nan"))
    bytes_sent: int = _stat(0)
    bytes_received: int = _stat(0)
    # measured: the kernel's TCP byte counters of this peer's processes, p2pd included, since it
    # started (worldlm_p2p.net.wire; -1: not measured); bytes_sent/received above are the estimate
    wire_sent: int = _stat(-1, ckpt=False)
    wire_received: int = _stat(-1, ckpt=False)
    waiting_for_round: int = _stat(-1, ckpt=False, summary=False)
    # what this peer serves: the round of its region's agreed model and that model's digest
    # (worldlm_p2p.codec.state_digest), so that a joiner can check a download against the region
    state_round: int = _stat(-1, ckpt=False, summary=False)
    state_digest: str = _stat("", ckpt=False, summary=False)
    seconds_to_first_round: float | None = _stat(None, ckpt=False)
    round_entry_tokens: int = _stat(0, ckpt=False, summary=False)  # tokens when it last entered a round
    # the time the training loop stood still for region rounds (barrier, all-reduce, mixing; with
    # aggregation.overlap only a round slower than H steps, and the conclusion of each round)
    seconds_in_rounds: float = _stat(0.0, ckpt=False)
    initial_step: int = _stat(0, ckpt=False)
    initial_tokens: int = _stat(0, ckpt=False, summary=False)
    started_from: str = _stat("init", ckpt=False)
    world_rounds_led: int = _stat(0)  # world rounds this peer ran as its region's leader
    world_rounds_adopted: int = _stat(0)  # world results this peer adopted
    world_round: int = _stat(-1)  # the last world round adopted
    rounds_since_world: int = _stat(0, summary=False)
    bytes_sent_border: int = _stat(0)
    # one point every inner_steps steps: step, tokens, mean train loss of those steps, region and world round
    history: list[dict[str, Any]] = _stat(factory=list)
    mixes: list[dict[str, Any]] = _stat(factory=list)  # evidence mixing: kind, round, step, lam, gain
    span_loss: float = _stat(0.0, ckpt=False, summary=False)  # sum of the train losses since the last history point
    span_steps: int = _stat(0, ckpt=False, summary=False)

    # -- what happens to the counters ------------------------------------------------------
    def count_step(self, *, tokens: int, loss: float) -> None:
        """A step done; its ``loss`` (NaN: none, or not read back yet: :meth:`count_loss` later)."""
        self.step += 1
        self.tokens += tokens
        self.tokens_since_round += tokens
        self.count_loss(loss)

    def count_loss(self, loss: float) -> None:
        if math.isfinite(loss):  # (a DP-SGD step on an empty Poisson batch has no loss)
            self.last_train_loss = loss
            if self.first_train_loss is None:
                self.first_train_loss = loss
            self.span_loss += loss
            self.span_steps += 1

    def history_point(self) -> None:
        if self.span_steps:
            self.history.append(dict(step=self.step, tokens=self.tokens, loss=self.span_loss / self.span_steps,
                                     round=self.round, world_round=self.world_round, time=time.time()))
        self.span_loss, self.span_steps = 0.0, 0

    def count_round(self, *, group_size: int, seconds: float, sent: int, received: int) -> None:
        self.rounds_completed += 1
        self.group_sizes.append(group_size)
        self.round_seconds.append(seconds)
        self.bytes_sent += sent
        self.bytes_received += received
        self.tokens_since_round = 0

    def recent_mix(self, kind: str, last: int = 8) -> float:
        """The mean weight of this peer's last ``last`` mixing choices of ``kind`` (-1: none yet)."""
        lams = [m["lam"] for m in self.mixes if m["kind"] == kind][-last:]
        return sum(lams) / len(lams) if lams else -1.0

    # -- views ------------------------------------------------------------------------------
    def checkpoint_view(self) -> dict[str, Any]:
        return {f.name: _copy(getattr(self, f.name)) for f in fields(self) if f.metadata["ckpt"]}

    def restore(self, saved: dict[str, Any]) -> None:
        """Set the checkpointed counters from a checkpoint's view (missing ones keep their value)."""
        for f in fields(self):
            if f.metadata["ckpt"] and f.name in saved:
                setattr(self, f.name, _copy(saved[f.name]))

    def summary_view(self) -> dict[str, Any]:
        out = {}
        for f in fields(self):
            name = f.metadata["summary"]
            if name:
                out[f.name if name is True else name] = _copy(getattr(self, f.name))
        out["round_seconds"] = [round(x, 4) for x in self.round_seconds]
        out["last_train_loss"] = _finite_or_none(self.last_train_loss)
        return out


def _copy(value: Any) -> Any:
    if isinstance(value, list):
        return [dict(v) if isinstance(v, dict) else v for v in value]
    return value
