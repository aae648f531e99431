"""Residual embeddings of key layers and the cross-region update of a world round (pure: imports
torch only, randomness from explicit seeds).

A region ``R``'s key-layer residual is ``r_R = K_R - K_world`` (``K_world``: the leaders'
token-weighted mean of K). A leader publishes a compact, seeded per-layer *sketch* of it instead of
the layers themselves: a count sketch (each coordinate is added, with a random sign, to one of
``dim`` buckets; Charikar et al. 2002), which preserves inner products in expectation, so cosine
similarities between regions' residuals can be estimated from a few hundred numbers. Every region
uses the same seed, so sketches are comparable.

Cross-region attention, per layer ``l``: ``a_RG = softmax_G(cos(e_R,l, e_G,l) / tau)`` over the
other regions *and R itself* (score ``1 / tau``), then
``K_R,l <- K_R,l + beta * sum_{G != R} a_RG,l (r_G,l - r_R,l)``.
Including ``R`` in the softmax is our change to the design doc: with a softmax over the other
regions only, a region with a single other region would always move towards it, however different.
With ``R`` included, a dissimilar region gets little weight and ``R`` keeps its own layers; a twin
region gets up to half of the weight.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

_TINY = 1e-12


def _layer_generator(seed: int, layer: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed((int(seed) * 1_000_003 + int(layer) * 7_919 + 17) % (2 ** 63 - 1))
    return g


def count_sketch(tensor: torch.Tensor, *, dim: int, seed: int, layer: int) -> torch.Tensor:
    """A ``dim``-number count sketch of ``tensor`` (float32), deterministic for ``(seed, layer)``
    and the tensor's size."""
    if dim <= 0:
        raise ValueError(f"sketch dim must be > 0, got {dim}")
    flat = tensor.detach().to(torch.float64).flatten()
    g = _layer_generator(seed, layer)
    buckets = torch.randint(0, dim, (flat.numel(),), generator=g)
    signs = torch.randint(0, 2, (flat.numel(),), generator=g).to(torch.float64) * 2 - 1
    return torch.zeros(dim, dtype=torch.float64).index_add_(0, buckets, signs * flat).to(torch.float32)


def residual_embedding(residual: Sequence[torch.Tensor], *, dim: int = 64, seed: int = 0) -> torch.Tensor:
    """Per-layer sketches of a key-layer residual: shape (layers, dim)."""
    return torch.stack([count_sketch(r, dim=dim, seed=seed, layer=l) for l, r in enumerate(residual)])


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    return float(a64 @ b64) / max(float(torch.linalg.vector_norm(a64) * torch.linalg.vector_norm(b64)), _TINY)


def cross_region_weights(embeddings: Mapping[str, torch.Tensor], region: str, *,
                         tau: float) -> dict[str, torch.Tensor]:
    """``{G: a_RG}`` (one weight per layer, float64) for every region ``G`` in ``embeddings``,
    ``region`` itself included; the weights of each layer sum to one."""
    if region not in embeddings:
        raise ValueError(f"region {region!r} has no embedding")
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    names = sorted(embeddings)  # order-independent
    own = embeddings[region]
    n_layers = own.shape[0]
    scores = torch.empty(len(names), n_layers, dtype=torch.float64)
    for gi, g in enumerate(names):
        e = embeddings[g]
        if e.shape != own.shape:
            raise ValueError(f"region {g!r} embedding has shape {tuple(e.shape)}, expected {tuple(own.shape)}")
        for l in range(n_layers):
            scores[gi, l] = 1.0 / tau if g == region else _cosine(own[l], e[l]) / tau
    a = torch.softmax(scores, dim=0)
    return {g: a[gi] for gi, g in enumerate(names)}


def cross_region_update(key: Sequence[torch.Tensor], residual: Sequence[torch.Tensor],
                        others: Mapping[str, Sequence[torch.Tensor]], weights: Mapping[str, torch.Tensor], *,
                        beta: float) -> list[torch.Tensor]:
    """``K_R,l + beta * sum_G a_RG,l (r_G,l - r_R,l)`` over the regions ``G`` in ``others`` (their
    full residuals, fetched where the weight matters)."""
    out = []
    for l, (k, r) in enumerate(zip(key, residual)):
        k64, r64 = k.detach().to(torch.float64), r.detach().to(torch.float64)
        step = torch.zeros_like(k64)
        for g, res in others.items():
            step += float(weights[g][l]) * (res[l].detach().to(torch.float64) - r64)
        out.append((k64 + beta * step).to(k.dtype))
    return out
