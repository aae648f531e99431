"""The wire codecs of a region round, as hivemind compression classes (:mod:`worldlm_p2p.compression`
says what each does to a tensor; this module only frames it).

hivemind picks a codec per tensor (``PerTensorCompression``) and names it in every message, so a
receiver decodes what it was sent. Two of hivemind's own classes are wrapped:

- ``fp16``: hivemind's ``Float16Compression``, except that a part holding NaN/Inf travels in float32
  (fp16 would clamp an Inf to a finite 65504, and the robust rule must see it as what it is);
- ``int8``: our uniform 8-bit codec (:func:`worldlm_p2p.compression.int8_encode`), framed as
  hivemind's ``UNIFORM_8BIT`` message (codebook length, float32 codebook, uint8 indices). hivemind's
  own ``Uniform8BitQuantization`` cannot decode on numpy 2 (it converts a one-element array to
  ``int``) and quantizes through the deprecated ``torch.quantize_per_tensor``, so
  :func:`install` registers ours as the decoder of that message type, in every process that imports
  this module. A part with NaN/Inf travels in float32, one too small or with no spread in fp16
  (:func:`worldlm_p2p.compression.travels_as`).

The pure round (:func:`worldlm_p2p.rounds.group_average`) runs the same functions on each part, so
a test can hold the swarm's all-reduce to it exactly.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from hivemind.compression import CompressionBase, CompressionInfo, Float16Compression, NoCompression
from hivemind.compression import PerTensorCompression
from hivemind.proto import runtime_pb2

from worldlm_p2p import compression


class Float16(Float16Compression):
    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False):
        if compression.travels_as(tensor, "fp16") == "none":
            return NoCompression().compress(tensor, info, allow_inplace=allow_inplace)
        return super().compress(tensor, info, allow_inplace=allow_inplace)


class Uniform8Bit(CompressionBase):
    compression_type = runtime_pb2.UNIFORM_8BIT

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False):
        travels = compression.travels_as(tensor, "int8")
        if travels == "none":
            return NoCompression().compress(tensor, info, allow_inplace=allow_inplace)
        if travels == "fp16":
            return Float16Compression().compress(tensor, info, allow_inplace=allow_inplace)
        if tensor.dtype != torch.float32:
            raise ValueError(f"int8 wire codec carries float32 tensors, not {tensor.dtype}")
        index, codebook = compression.int8_encode(tensor)
        codebook_np = codebook.numpy().astype(np.float32)
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=b"".join((np.int64(codebook_np.size).tobytes(), codebook_np.tobytes(), index.numpy().tobytes())),
            size=tensor.shape, dtype="float32", requires_grad=False)

    def extract(self, serialized: runtime_pb2.Tensor) -> torch.Tensor:
        buffer = serialized.buffer
        if len(buffer) < 8:
            raise ValueError("an int8 message shorter than its header")
        levels = int(np.frombuffer(buffer, count=1, dtype=np.int64)[0])
        if not 0 < levels <= 1 << 16 or len(buffer) < 8 + 4 * levels:
            raise ValueError(f"an int8 message with {levels} levels in {len(buffer)} bytes")
        codebook = torch.from_numpy(np.frombuffer(buffer, offset=8, count=levels, dtype=np.float32).copy())
        index = torch.from_numpy(np.frombuffer(buffer, offset=8 + 4 * levels, dtype=np.uint8).copy())
        return compression.int8_decode(index, codebook, tuple(serialized.size))

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 0.25


def install() -> None:
    """Make :class:`Uniform8Bit` hivemind's decoder of ``UNIFORM_8BIT`` messages (idempotent)."""
    from hivemind.compression import serialization

    if not isinstance(serialization._BASE_COMPRESSION_TYPES.get("UNIFORM_8BIT"), Uniform8Bit):
        serialization._BASE_COMPRESSION_TYPES["UNIFORM_8BIT"] = Uniform8Bit()


install()


def wire_compression(codecs: Sequence[str]) -> PerTensorCompression:
    """hivemind's compression for a region payload whose tensors travel in ``codecs``
    (:func:`worldlm_p2p.rounds.payload_codecs`)."""
    by_name = {"none": NoCompression(), "fp16": Float16(), "int8": Uniform8Bit()}
    unknown = sorted(set(codecs) - set(by_name))
    if unknown:
        raise ValueError(f"unknown wire codecs {unknown}")
    return PerTensorCompression([by_name[c] for c in codecs])
