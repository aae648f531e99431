"""Pure aggregation math for region rounds (imports torch only).

A hivemind all-reduce computes ``sum_i w_i x_i / sum_i w_i`` over the group; these functions are
the reference the network result is tested against, and the pre/post processing a peer applies
around the all-reduce.
"""

from __future__ import annotations

from typing import Sequence

import torch


def weighted_mean(states: Sequence[Sequence[torch.Tensor]], weights: Sequence[float]) -> list[torch.Tensor]:
    """Token-weighted mean of several peers' tensor lists.

    ``states[i][j]`` is tensor ``j`` of peer ``i``; ``weights[i] >= 0`` with a positive sum.
    Returns ``[sum_i w_i states[i][j] / sum_i w_i for j]`` in float64 accumulation, cast back.
    """
    if len(states) == 0 or len(states) != len(weights):
        raise ValueError(f"need one weight per state, got {len(states)} states and {len(weights)} weights")
    w = torch.as_tensor([float(x) for x in weights], dtype=torch.float64)
    if bool((w < 0).any()) or float(w.sum()) <= 0 or not bool(torch.isfinite(w).all()):
        raise ValueError(f"weights must be finite, non-negative and sum to a positive value, got {weights}")
    w = w / w.sum()
    n_tensors = len(states[0])
    if any(len(s) != n_tensors for s in states):
        raise ValueError("all peers must contribute the same number of tensors")
    out = []
    for j in range(n_tensors):
        ref = states[0][j]
        acc = torch.zeros(ref.shape, dtype=torch.float64)
        for wi, s in zip(w, states):
            if s[j].shape != ref.shape:
                raise ValueError(f"tensor {j} has shape {tuple(s[j].shape)} != {tuple(ref.shape)}")
            acc += wi * s[j].detach().to(torch.float64)
        out.append(acc.to(ref.dtype))
    return out


def round_weight(tokens_since_last_round: int) -> float:
    """A peer's weight in a region round: the tokens it trained on since its last round
    (FedAvg's n_k). A peer with no new tokens still contributes with a tiny weight so that a group
    of fresh joiners never divides by zero."""
    return float(tokens_since_last_round) if tokens_since_last_round > 0 else 1e-3


def max_round_weight(*, inner_steps: int, batch_size: int, seq_len: int) -> float:
    """The largest weight a member may claim in a region round: the tokens of twice the run's H
    steps (a member that missed one round trains two rounds' worth; Poisson sampling under DP
    varies a batch around its mean). A larger claim is capped to this by every reducer
    (:mod:`worldlm_p2p.robust`)."""
    return 2.0 * inner_steps * batch_size * seq_len


def outer_step(anchor: Sequence[torch.Tensor], averaged: Sequence[torch.Tensor], lr: float) -> list[torch.Tensor]:
    """FedAvg-style outer update: ``anchor + lr * (averaged - anchor)``; ``lr = 1`` adopts the mean."""
    if lr == 1.0:
        return [a.detach().clone() for a in averaged]
    return [p + lr * (a - p) for p, a in zip(anchor, averaged)]


def allreduce_traffic(payload_bytes: int, group_size: int, *, clients: int = 0,
                      client: bool = False) -> tuple[int, int]:
    """Bytes one peer sends and receives in a butterfly all-reduce of ``payload_bytes`` over a group
    of ``group_size`` equal-bandwidth peers (hivemind's scheme, no compression), ``clients`` of which
    are outbound-only (hivemind's client mode: they reduce nothing, so the R = n - clients others
    reduce one 1/R span each). A reducer sends the (R-1)/R of its vector that the other reducers
    reduce, then its reduced span back to the n-1 others, and receives the same amounts; a client
    (``client``) sends its whole vector and receives the whole average. Protocol and DHT overhead
    are not counted."""
    if group_size <= 1:
        return 0, 0
    if client:
        return payload_bytes, payload_bytes
    reducers = max(1, group_size - clients)
    part = payload_bytes * (reducers - 1) // reducers + payload_bytes * (group_size - 1) // reducers
    return part, part
