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
region gets up to half of the weight. Measured, that left ``R`` with all the weight nearly always
(residuals from a common mean point away from each other), so the exchange moved nothing.

*Partners* (``aggregation.residual_attention = "partners"``): the softmax is over the other regions
only, scored by the cosine of ``e_R - m`` and ``e_G - m`` with ``m`` the mean of the remaining
regions' embeddings (did ``R`` and ``G`` depart alike from the rest of the world?), and ``R``'s K
moves ``beta`` of the way towards its partners. Whether that helps is then each member's decision,
on its tune slice (the world change is mixed by evidence), so a dissimilar partner costs little.

*World attention* (:func:`region_attention`, ``aggregation.world_target = "attention"``): the same
sketches taken of the whole model's residual ``r_R = theta_R - theta_world`` (backbone and key
layers) weight the *backbone* exchange too. One weight per other region, a softmax over the other
regions of their sketch distance to ``R`` relative to the mean one (the count sketch preserves
inner products, so the whole sketch's distance estimates the models' distance), and
``theta_R <- theta_R + beta * sum_{G != R} a_RG (r_G - r_R)``: each region moves towards the regions
that learned most like it instead of towards the mean of all. ``R`` is left out of the softmax:
*how far* it moves is the members' evidence (:mod:`worldlm_p2p.mixing`), the attention only says
*where to*.
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
                         tau: float, form: str = "world") -> dict[str, torch.Tensor]:
    """``{G: a_RG}`` (one weight per layer, float64) for every region ``G`` in ``embeddings``,
    ``region`` itself included; the weights of each layer sum to one.

    ``form="world"`` (WorldLM's): a softmax over every region, ``R`` itself with score ``1 / tau``
    and each other ``G`` with ``cos(e_R, e_G) / tau``, the cosine of the two residuals from the
    world's mean. Such residuals point away from each other by construction (with two regions
    their cosine is -1), so ``R`` keeps nearly all the weight unless a region is its twin.

    ``form="partners"``: a softmax over the *other* regions only (``R`` gets 0), each scored by
    ``cos(e_R - m, e_G - m) / tau`` with ``m`` the plain mean of the embeddings of the regions other
    than ``R`` and ``G``: whether ``R`` and ``G`` departed alike from the rest of the world (the world
    mean cancels in these differences, and the count sketch is linear, so they are sketches of
    ``K_R - mean_X K_X``). With one other region it gets the whole weight. The update then moves
    ``R``'s key layers ``beta`` of the way towards its partners, and how much of that a member
    takes is its tune slice's decision (:func:`worldlm_p2p.rounds.member_world_mix`)."""
    if region not in embeddings:
        raise ValueError(f"region {region!r} has no embedding")
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    if form not in ("world", "partners"):
        raise ValueError(f"form must be 'world' or 'partners', got {form!r}")
    names = sorted(embeddings)  # order-independent
    own = embeddings[region].to(torch.float64)
    n_layers = own.shape[0]
    for g in names:
        if embeddings[g].shape != own.shape:
            raise ValueError(f"region {g!r} embedding has shape {tuple(embeddings[g].shape)}, expected {tuple(own.shape)}")
    if form == "partners" and len(names) == 1:
        return {region: torch.ones(n_layers, dtype=torch.float64)}
    scores = torch.empty(len(names), n_layers, dtype=torch.float64)
    for gi, g in enumerate(names):
        e = embeddings[g].to(torch.float64)
        if g == region:
            scores[gi] = 1.0 / tau if form == "world" else float("-inf")
            continue
        if form == "world":
            x, y = own, e
        else:
            rest = [embeddings[o].to(torch.float64) for o in names if o not in (region, g)]
            if not rest:  # R and G alone: G is the only partner
                scores[gi] = 0.0
                continue
            m = torch.stack(rest).mean(dim=0)
            x, y = own - m, e - m
        for l in range(n_layers):
            scores[gi, l] = _cosine(x[l], y[l]) / tau
    a = torch.softmax(scores, dim=0)
    return {g: a[gi] for gi, g in enumerate(names)}


def region_attention(embeddings: Mapping[str, torch.Tensor], region: str, *,
                     tau: float) -> dict[str, torch.Tensor]:
    """``{G: a_RG}`` for the regions ``G != region`` in ``embeddings`` (each a one-element float64
    tensor: one weight for every layer), summing to one: the softmax over ``G`` of
    ``-(D_RG / mean_G' D_RG') / tau`` with ``D_RG = ||e_R - e_G||^2``, the squared distance of the
    whole sketches (which estimates ``||theta_R - theta_G||^2``: the world mean cancels). Distances,
    not cosines: residuals from a common mean point away from each other by construction (with two
    regions their cosine is -1), while the distance between them is what they learned apart. The
    scale of the distances drops out, so ``tau`` alone sets how sharply the nearest region is
    preferred. Empty when ``region`` is alone."""
    if region not in embeddings:
        raise ValueError(f"region {region!r} has no embedding")
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    own = embeddings[region].to(torch.float64).flatten()
    others = sorted(g for g in embeddings if g != region)  # order-independent
    if not others:
        return {}
    for g in others:
        if embeddings[g].shape != embeddings[region].shape:
            raise ValueError(f"region {g!r} embedding has shape {tuple(embeddings[g].shape)}, "
                             f"expected {tuple(embeddings[region].shape)}")
    d = torch.stack([torch.sum((own - embeddings[g].to(torch.float64).flatten()) ** 2) for g in others])
    scale = float(d.mean())
    scores = -d / (scale * tau) if scale > _TINY else torch.zeros_like(d)
    a = torch.softmax(scores, dim=0)
    return {g: a[i:i + 1] for i, g in enumerate(others)}


def cross_region_update(key: Sequence[torch.Tensor], residual: Sequence[torch.Tensor],
                        others: Mapping[str, Sequence[torch.Tensor]], weights: Mapping[str, torch.Tensor], *,
                        beta: float) -> list[torch.Tensor]:
    """``K_R,l + beta * sum_G a_RG,l (r_G,l - r_R,l)`` over the regions ``G`` in ``others`` (their
    full residuals, fetched where the weight matters). A one-element weight applies to every layer
    (:func:`region_attention`)."""
    out = []
    for l, (k, r) in enumerate(zip(key, residual)):
        k64, r64 = k.detach().to(torch.float64), r.detach().to(torch.float64)
        step = torch.zeros_like(k64)
        for g, res in others.items():
            a = weights[g]
            step += float(a[l] if len(a) > 1 else a[0]) * (res[l].detach().to(torch.float64) - r64)
        out.append((k64 + beta * step).to(k.dtype))
    return out
