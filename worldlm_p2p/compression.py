"""What a round's payload becomes on the wire (pure: imports torch only).

A region round averages each member's *change since the round's anchor* (:func:`worldlm_p2p.rounds.region_payload`),
small numbers that survive 16 or 8 bits far better than the parameters themselves. The run's manifest
picks a codec per tensor role (``aggregation.compress_backbone`` for the backbone's change,
``aggregation.compress_key`` for the key layers' encoded change; the attention denominators always
travel in float32):

- ``none``: float32, 4 bytes a value;
- ``fp16``: IEEE half precision, values clamped to its range, 2 bytes a value (hivemind's
  ``Float16Compression``);
- ``int8``: 256 levels spaced uniformly over 6 standard deviations around the tensor's mean (values
  beyond saturate), each level decoded as the mean of the values that fell into it, 1 byte a value
  plus a 1 KiB codebook (hivemind's ``Uniform8BitQuantization``). Tensors of fewer than
  :data:`INT8_MIN_NUMEL` values, or with no spread, travel in ``fp16`` instead: a codebook would cost
  more than it saves, and a constant tensor has no scale.

A tensor holding NaN or Inf travels in float32 whatever the codec (:func:`travels_as`): fp16 would
turn an Inf into a finite 65504, and the robust rule must see a broken payload for what it is.

The swarm's all-reduce (:mod:`worldlm_p2p.net.robust_allreduce`) encodes every sender's part, the
reducer's own included, aggregates the decoded parts with the robust rule and sends every member the
encoded aggregate itself (not each member's difference to it), so that the members of a round end with
the same model. :func:`roundtrip` is what one encode and decode does to a tensor; the pure round
(:func:`worldlm_p2p.rounds.group_average`) applies it on both sides, as the swarm does. For ``none``
and ``fp16`` (element-wise codecs) the swarm's result equals it exactly; ``int8`` scales each part of
the all-reduce on its own, so there the pure function is the same codec applied per tensor.
"""

from __future__ import annotations

from typing import Sequence

import torch

from worldlm_p2p.kinds import WIRE_CODECS, WireCodec  # noqa: F401 (re-exported)

INT8_MIN_NUMEL = 1024
_FP16_MAX = float(torch.finfo(torch.float16).max)
_INT8_LEVELS = 256
_INT8_RANGE_IN_SIGMAS = 6.0


def effective_codec(codec: str, numel: int) -> str:
    """The codec a tensor of ``numel`` values actually travels in (``int8`` needs enough values)."""
    if codec not in WIRE_CODECS:
        raise ValueError(f"wire codec {codec!r} is not one of {', '.join(WIRE_CODECS)}")
    return "fp16" if codec == "int8" and numel < INT8_MIN_NUMEL else codec


def travels_as(tensor: torch.Tensor, codec: str) -> str:
    """The codec that this very ``tensor`` travels in under ``codec`` (:func:`effective_codec`, and
    float32 for NaN/Inf, fp16 for an ``int8`` tensor with no spread)."""
    c = effective_codec(codec, tensor.numel())
    if c == "none":
        return c
    x = tensor.detach().to(torch.float32).reshape(-1)
    if not bool(torch.isfinite(x).all()):
        return "none"
    if c == "int8" and float((x - x.mean()).norm()) == 0.0:
        return "fp16"
    return c


def bytes_per_value(codec: str) -> float:
    return {"none": 4.0, "fp16": 2.0, "int8": 1.0}[codec]


def nominal_bytes(numel: int, codec: str) -> int:
    """Bytes that a tensor of ``numel`` values takes on the wire in ``codec`` (the payload, not the
    framing), for a tensor that travels as the codec says (finite, with spread)."""
    c = effective_codec(codec, numel)
    return int(numel * bytes_per_value(c)) + (_INT8_LEVELS * 4 + 8 if c == "int8" else 0)


def wire_bytes(tensor: torch.Tensor, codec: str) -> int:
    """Bytes that this very ``tensor`` takes on the wire in ``codec`` (:func:`travels_as`)."""
    return nominal_bytes(tensor.numel(), travels_as(tensor, codec))


def _fp16(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float32).clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16).to(torch.float32)


def int8_encode(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``tensor`` (finite, with spread) as 8-bit indices (uint8, flat) and its 256-level float32 codebook."""
    x = tensor.detach().to(torch.float32).reshape(-1)
    centred = x - x.mean()
    std = float(centred.norm()) / max(x.numel() - 1, 1) ** 0.5
    scale = _INT8_RANGE_IN_SIGMAS * std / _INT8_LEVELS
    if not scale > 0:
        raise ValueError("int8 needs a tensor with spread (travels_as says fp16 for a constant)")
    index = torch.clamp(torch.round(centred / scale) + _INT8_LEVELS // 2, 0, _INT8_LEVELS - 1).long()
    sums = torch.zeros(_INT8_LEVELS).scatter_add_(0, index, x)
    counts = torch.bincount(index, minlength=_INT8_LEVELS).clamp_min(1)
    return index.to(torch.uint8), sums / counts


def int8_decode(index: torch.Tensor, codebook: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """The float32 tensor that ``int8_encode``'s indices and codebook stand for."""
    if codebook.numel() != _INT8_LEVELS or index.numel() != int(torch.Size(shape).numel()):
        raise ValueError(f"an int8 message of {index.numel()} indices and {codebook.numel()} levels "
                         f"cannot be a tensor of shape {tuple(shape)}")
    return codebook.to(torch.float32)[index.long()].reshape(tuple(shape))


def _int8(t: torch.Tensor) -> torch.Tensor:
    return int8_decode(*int8_encode(t), t.shape)


def roundtrip(tensor: torch.Tensor, codec: str) -> torch.Tensor:
    """``tensor`` (as float32) after one encode and decode in ``codec``."""
    c = travels_as(tensor, codec)
    if c == "none":
        return tensor.detach().to(torch.float32).clone()
    return _fp16(tensor) if c == "fp16" else _int8(tensor)


def roundtrip_all(tensors: Sequence[torch.Tensor], codecs: Sequence[str]) -> list[torch.Tensor]:
    if len(tensors) != len(codecs):
        raise ValueError(f"{len(tensors)} tensors but {len(codecs)} codecs")
    return [roundtrip(t, c) for t, c in zip(tensors, codecs)]
