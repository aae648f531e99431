"""Splitting a model's parameters into the shared backbone B and the localised key layers K
(pure: imports torch only, works on parameter *names*).

WorldLM (arXiv 2405.14446) localises "key layers" per sub-federation and shares the rest. Which
layers are key is a choice (the paper does not pin it down, see ``shared/reference/papers.md``);
the presets below are the ones the quality benchmark compares:

- ``embed_head``: the token embeddings and the LM head (DEPT, arXiv 2410.05402, localises these);
  the default since the quality study of 2026-12-04 (``benchmarks/RESULTS.md``): with members
  mixing the backbone and K each by evidence (``personal_scope = "parts"``) every peer trains one
  transformer body and keeps token embeddings of its own, at least level with ``kv`` in every
  corpus-budget cell of the study and better beyond the seed noise in three of ten;
- ``kv``: the attention key and value projections of every block (the design doc's default);
- ``last30``: every parameter of the last 30% of the transformer blocks (the reference spec's
  default, rounded up to at least one block).

Custom selections are comma-separated ``fnmatch`` patterns on parameter names, e.g.
``"*.self_attn.k_proj.weight,*.mlp.down_proj.weight"``.
"""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass
from typing import Sequence

import torch

KEY_LAYER_PRESETS = ("kv", "last30", "embed_head")

_BLOCK_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _block_index(name: str) -> int | None:
    m = _BLOCK_RE.search(name)
    return int(m.group(1)) if m else None


def key_layer_patterns(selection: str, names: Sequence[str]) -> list[str]:
    """Expand a preset (or pass through custom patterns) into ``fnmatch`` patterns for ``names``."""
    if selection == "kv":
        return ["*.self_attn.k_proj.*", "*.self_attn.v_proj.*"]
    if selection == "embed_head":
        return ["*embed_tokens.*", "lm_head.*"]
    if selection == "last30":
        blocks = sorted({b for b in map(_block_index, names) if b is not None})
        if not blocks:
            return []
        n_key = max(1, math.ceil(0.3 * len(blocks)))
        return [f"*layers.{b}.*" for b in blocks[-n_key:]]
    patterns = [p.strip() for p in selection.split(",") if p.strip()]
    if not patterns:
        raise ValueError(f"key-layer selection {selection!r} names no pattern")
    return patterns


@dataclass(frozen=True, slots=True)
class ParamSplit:
    """Indices (into the model's parameter list) of the backbone and of the key layers, per layer
    in model order. ``key`` may be empty (then K is empty and every rule reduces to B)."""

    names: tuple[str, ...]
    key: tuple[int, ...]
    backbone: tuple[int, ...]

    @property
    def key_names(self) -> tuple[str, ...]:
        return tuple(self.names[i] for i in self.key)

    def take_key(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [tensors[i] for i in self.key]

    def take_backbone(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [tensors[i] for i in self.backbone]

    def merge(self, backbone: Sequence[torch.Tensor], key: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Inverse of ``take_backbone``/``take_key``: one list in model order."""
        if len(backbone) != len(self.backbone) or len(key) != len(self.key):
            raise ValueError(f"merge: expected {len(self.backbone)} backbone and {len(self.key)} key tensors, "
                             f"got {len(backbone)} and {len(key)}")
        out: list[torch.Tensor | None] = [None] * len(self.names)
        for i, t in zip(self.backbone, backbone):
            out[i] = t
        for i, t in zip(self.key, key):
            out[i] = t
        return out  # type: ignore[return-value]


def split_parameters(names: Sequence[str], selection: str = "kv") -> ParamSplit:
    """Split parameter ``names`` (in model order) into backbone and key layers by ``selection``
    (a preset of :data:`KEY_LAYER_PRESETS` or comma-separated ``fnmatch`` patterns). A selection
    that matches nothing raises ``ValueError``: a silent empty K would turn WorldLM into HierFAVG."""
    names = tuple(names)
    patterns = key_layer_patterns(selection, names)
    key = tuple(i for i, n in enumerate(names) if any(fnmatch.fnmatchcase(n, p) for p in patterns))
    if not key:
        raise ValueError(f"key-layer selection {selection!r} matches no parameter of this model")
    backbone = tuple(i for i in range(len(names)) if i not in set(key))
    return ParamSplit(names=names, key=key, backbone=backbone)
