"""The outer optimizer of a round (pure: imports torch only; state in, state out).

A round turns the anchor ``x`` (the last agreed model) and the group's average ``m`` into the next
agreed model. The pseudo-gradient is ``g = x - m`` (DiLoCo, arXiv 2311.08105; Photon, arXiv
2405.10853):

- ``sgd`` with ``lr = 1`` is FedAvg (adopt the average);
- ``nesterov`` is SGD with Nesterov momentum on ``g``, the DiLoCo recipe (lr 0.7, momentum 0.9):
  ``buf <- mu * buf + g``, ``x <- x - lr * (g + mu * buf)``; the same update as
  ``torch.optim.SGD(nesterov=True)`` (tested against it).

Every member of a group applies the same step to the same inputs, so members stay identical
without exchanging the momentum buffer; a late joiner receives it with the region state.
"""

from __future__ import annotations

from typing import Sequence

import torch

OUTER_OPTIMIZERS = ("sgd", "nesterov")


def outer_update(anchor: Sequence[torch.Tensor], averaged: Sequence[torch.Tensor],
                 momentum: Sequence[torch.Tensor] | None, *, kind: str = "sgd", lr: float = 1.0,
                 mu: float = 0.0) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Return ``(new_params, new_momentum)``. ``momentum`` is ``None`` before the first step (a
    zero buffer); for ``sgd`` the returned momentum is ``None``."""
    if kind not in OUTER_OPTIMIZERS:
        raise ValueError(f"outer optimizer {kind!r} is not one of {OUTER_OPTIMIZERS}")
    if len(anchor) != len(averaged):
        raise ValueError(f"{len(anchor)} anchor tensors but {len(averaged)} averaged ones")
    if kind == "sgd":
        if lr == 1.0:
            return [a.detach().clone().to(p.dtype) for p, a in zip(anchor, averaged)], None
        return [(p.detach() - lr * (p.detach() - a.to(p.dtype))) for p, a in zip(anchor, averaged)], None
    if momentum is not None and len(momentum) != len(anchor):
        raise ValueError(f"{len(momentum)} momentum buffers for {len(anchor)} tensors")
    new_params, new_buf = [], []
    for j, (p, a) in enumerate(zip(anchor, averaged)):
        g = p.detach() - a.detach().to(p.dtype)
        buf = g.clone() if momentum is None else mu * momentum[j] + g
        new_buf.append(buf)
        new_params.append(p.detach() - lr * (g + mu * buf))
    return new_params, new_buf
