"""Attentive aggregation of the key layers inside a region (pure: imports torch only).

Per layer ``l`` every member ``i`` of a region round holds the same reference ``K_ref,l`` (the
region's last agreed key layers) and its own ``K_il``. Its score is computed locally:

- ``distance`` (FedAtt-style, Ji et al. 2019, arXiv 1812.07108, with the design doc's sign: a
  distant, possibly off-distribution or poisoned contribution gets *less* weight):
  ``s_il = -||K_il - K_ref,l|| / (tau * ||K_ref,l||)``;
- ``cosine``: ``s_il = cos(K_il, K_ref,l) / tau``;
- ``mean``: ``s_il = 0`` (plain token-weighted mean; the product's default since the quality study
  measured the attentive forms no better on any corpus, ``benchmarks/RESULTS.md``, issue 10).

Weights combine scores with token counts ``n_i``: ``a_il = n_i exp(s_il) / sum_j n_j exp(s_jl)``
(a softmax over peers, per layer, with a token prior), and the update is
``K_l <- K_ref,l + eps * sum_i a_il (K_il - K_ref,l)``.

One all-reduce suffices: hivemind computes ``sum_i w_i x_i / sum_i w_i``. Peer ``i`` sends its
change since the reference, ``x_i = [u_i1 (K_i1 - K_ref,1), ..., u_iL (K_iL - K_ref,L), (u_i1..u_iL)]``
with ``u_il = exp(s_il)`` and weight ``w_i = n_i``; dividing the reduced ``u dK`` parts by the
reduced ``u`` gives ``sum_i a_il (K_il - K_ref,l)`` (:func:`encode_key_layers` /
:func:`decode_key_layers`). Changes, not the layers themselves, so that the payload is small numbers
that compress to 16 or 8 bits without losing the layers' own scale (:mod:`worldlm_p2p.compression`).
Since ``s <= 0`` for ``distance`` and ``s <= 1/tau`` for ``cosine`` (shifted to ``<= 0``), ``u`` never overflows; scores are clamped at
:data:`MIN_SCORE` so that ``u`` never underflows to an all-zero denominator.

Invariants (tested): ``tau -> inf`` gives the token-weighted mean; one peer with ``eps = 1`` gives
that peer's layers; the result does not depend on the order of peers; weights sum to one.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

ATTENTION_FORMS = ("distance", "cosine", "mean")
MIN_SCORE = -60.0  # exp(-60) ~ 1e-26: representable in float32, so a denominator is never zero
_TINY = 1e-12


def layer_scores(key: Sequence[torch.Tensor], reference: Sequence[torch.Tensor], *, form: str,
                 tau: float) -> torch.Tensor:
    """Scores ``s_l`` (float64, one per layer) of one peer's key layers against the reference."""
    if form not in ATTENTION_FORMS:
        raise ValueError(f"attention form {form!r} is not one of {ATTENTION_FORMS}")
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    if len(key) != len(reference):
        raise ValueError(f"{len(key)} key layers but {len(reference)} reference layers")
    for l, (k, r) in enumerate(zip(key, reference)):
        if k.shape != r.shape:  # before flattening: (1, n) vs (n,) would broadcast silently
            raise ValueError(f"layer {l}: shape {tuple(k.shape)} != reference {tuple(r.shape)}")
    out = torch.zeros(len(key), dtype=torch.float64)
    if form == "mean" or math.isinf(tau):
        return out
    for l, (k, r) in enumerate(zip(key, reference)):
        k64, r64 = k.detach().to(torch.float64).flatten(), r.detach().to(torch.float64).flatten()
        if form == "distance":
            s = -float(torch.linalg.vector_norm(k64 - r64)) / (tau * max(float(torch.linalg.vector_norm(r64)), _TINY))
        else:  # cosine, shifted by -1/tau so that s <= 0 (a common shift leaves the softmax unchanged)
            cos = float(k64 @ r64) / max(float(torch.linalg.vector_norm(k64) * torch.linalg.vector_norm(r64)), _TINY)
            s = (cos - 1.0) / tau
        out[l] = max(s, MIN_SCORE)
    return out


def attention_weights(scores: torch.Tensor, tokens: Sequence[float]) -> torch.Tensor:
    """``a[i, l] = n_i exp(s_il) / sum_j n_j exp(s_jl)`` for ``scores`` of shape (peers, layers)."""
    scores = torch.as_tensor(scores, dtype=torch.float64)
    n = torch.as_tensor([float(t) for t in tokens], dtype=torch.float64)
    if scores.dim() != 2 or scores.shape[0] != n.numel() or n.numel() == 0:
        raise ValueError(f"need scores of shape (peers, layers) and one token count per peer, got "
                         f"{tuple(scores.shape)} and {n.numel()}")
    if bool((n < 0).any()) or float(n.sum()) <= 0:
        raise ValueError("token counts must be non-negative with a positive sum")
    logits = scores + torch.log(n.clamp_min(1e-300)).unsqueeze(1)
    return torch.softmax(logits, dim=0)


def attentive_aggregate(keys: Sequence[Sequence[torch.Tensor]], reference: Sequence[torch.Tensor],
                        tokens: Sequence[float], *, form: str = "distance", tau: float = 1.0,
                        eps: float = 1.0, usage: Sequence[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
    """The central reference: ``K_ref,l + eps * sum_i a_il (K_il - K_ref,l)`` for every layer.

    ``keys[i][l]`` is layer ``l`` of peer ``i``; ``tokens[i]`` its token count since the last round.
    With ``usage`` (one per peer: its token counts, :func:`row_priors`), the weights are per row:
    ``a_ilr = n_i c_ir exp(s_il) / sum_j n_j c_jr exp(s_jl)``, ``c_ir`` the peer's smoothed
    frequency of token ``r`` on a layer with one row per vocabulary token, the uniform ``1 / rows``
    on any other layer (the per-layer weights)."""
    if len(keys) == 0 or len(keys) != len(tokens):
        raise ValueError(f"need one token count per peer, got {len(keys)} peers and {len(tokens)} counts")
    if usage is not None and len(usage) != len(keys):
        raise ValueError(f"need one usage count per peer, got {len(usage)} for {len(keys)} peers")
    scores = torch.stack([layer_scores(k, reference, form=form, tau=tau) for k in keys])
    out = []
    if usage is None:
        a = attention_weights(scores, tokens)
        for l, ref in enumerate(reference):
            r64 = ref.detach().to(torch.float64)
            step = sum(a[i, l] * (keys[i][l].detach().to(torch.float64) - r64) for i in range(len(keys)))
            out.append((r64 + eps * step).to(ref.dtype))
        return out
    n = torch.as_tensor([float(t) for t in tokens], dtype=torch.float64)
    priors = [row_priors(reference, u) for u in usage]
    for l, ref in enumerate(reference):
        r64 = ref.detach().to(torch.float64)
        w = torch.stack([n[i] * priors[i][l] * math.exp(float(scores[i, l])) for i in range(len(keys))])  # (peers, rows)
        a = w / w.sum(dim=0, keepdim=True)
        step = sum(_rows(a[i], r64) * (keys[i][l].detach().to(torch.float64) - r64) for i in range(len(keys)))
        out.append((r64 + eps * step).to(ref.dtype))
    return out


#: the pseudo-count of every token in a member's usage prior (:func:`row_priors`)
USAGE_PSEUDO_COUNT = 1.0


def token_usage(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """How often each token id occurs in ``tokens`` (float64, length ``vocab_size``): a member's
    usage of the vocabulary, which weighs its rows of the token-indexed key layers
    (``aggregation.usage_rows``)."""
    ids = tokens.detach().flatten().to(torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"token ids outside [0, {vocab_size})")
    return torch.bincount(ids, minlength=vocab_size).to(torch.float64)


def row_priors(reference: Sequence[torch.Tensor], usage: torch.Tensor | None) -> list[torch.Tensor]:
    """One member's prior over the rows of every key layer (float64, length ``shape[0]``, summing
    to one). On a layer with one row per vocabulary token (``shape[0] == len(usage)``: the token
    embeddings, the LM head) it is the member's smoothed frequency of each token,
    ``(count_r + 1) / (total + V)``, so that a row takes its change from the members that use the
    token, and a token nobody uses gets the plain weighted mean. Elsewhere, and for a member
    without ``usage`` (one that keeps its counts to itself: DP-SGD's), the uniform ``1 / rows``,
    which every member shares: the per-layer weights."""
    out = []
    for ref in reference:
        rows = ref.shape[0] if ref.dim() else 1
        if usage is not None and ref.dim() and rows == usage.numel():
            u = usage.detach().to(torch.float64)
            if not bool(torch.isfinite(u).all()) or bool((u < 0).any()):
                raise ValueError("token usage counts must be finite and non-negative")
            out.append((u + USAGE_PSEUDO_COUNT) / (float(u.sum()) + USAGE_PSEUDO_COUNT * rows))
        else:
            out.append(torch.full((rows,), 1.0 / rows, dtype=torch.float64))
    return out


def _rows(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-row vector shaped to broadcast over ``like``'s rows."""
    return x.reshape((-1,) + (1,) * max(like.dim() - 1, 0)) if like.dim() else x.reshape(())


def encode_key_layers(key: Sequence[torch.Tensor], reference: Sequence[torch.Tensor], *, form: str,
                      tau: float, priors: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """One peer's all-reduce payload for its key layers: ``[u_l (K_l - K_ref,l) for l] + [u]``
    (float32), to be averaged with weight ``n_i`` (the peer's tokens) in the same all-reduce as the
    backbone's change. With ``priors`` (:func:`row_priors`) the weights are per row: the payload is
    ``[u_l c_l (K_l - K_ref,l) for l] + [cat(u_l c_l for l)]``, ``c_l`` broadcast over each row."""
    u = torch.exp(layer_scores(key, reference, form=form, tau=tau))
    if priors is None:
        return [(u[l] * (k.detach().to(torch.float64) - r.detach().to(torch.float64))).to(torch.float32)
                for l, (k, r) in enumerate(zip(key, reference))] + [u.to(torch.float32)]
    if len(priors) != len(reference):
        raise ValueError(f"{len(priors)} row priors for {len(reference)} key layers")
    out, dens = [], []
    for l, (k, r, c) in enumerate(zip(key, reference, priors)):
        r64 = r.detach().to(torch.float64)
        rows = r64.shape[0] if r64.dim() else 1
        if c.numel() != rows:
            raise ValueError(f"layer {l}: a prior of {c.numel()} rows for {rows}")
        w = u[l] * c.to(torch.float64)
        out.append((_rows(w, r64) * (k.detach().to(torch.float64) - r64)).to(torch.float32))
        dens.append(w)
    return out + [torch.cat(dens).to(torch.float32)]


def decode_key_layers(averaged: Sequence[torch.Tensor], reference: Sequence[torch.Tensor], *,
                      eps: float, rows: bool = False) -> list[torch.Tensor]:
    """Turn the all-reduced payload of :func:`encode_key_layers` into the new key layers (``rows``:
    encoded with priors, one denominator per row).

    An honest group's denominators lie in ``[exp(MIN_SCORE), 1]`` (times a prior with ``rows``). A
    layer (or row) whose reduced denominator is not positive and finite, or whose mean is not
    finite (what a malicious member's payload can leave after the robust rule,
    :mod:`worldlm_p2p.robust`), keeps its reference: the round still updates every other layer and
    the backbone."""
    if len(averaged) != len(reference) + 1:
        raise ValueError(f"payload has {len(averaged)} tensors, expected {len(reference) + 1}")
    u = averaged[-1].to(torch.float64)
    if rows:
        sizes = [r.shape[0] if r.dim() else 1 for r in reference]
        if u.numel() != sum(sizes):
            raise ValueError(f"payload has {u.numel()} attention denominators, expected {sum(sizes)} (one per row)")
        out = []
        for l, (ref, ul) in enumerate(zip(reference, torch.split(u, sizes))):
            r64 = ref.detach().to(torch.float64)
            ok = torch.isfinite(ul) & (ul > 0)
            change = averaged[l].to(torch.float64) / _rows(torch.where(ok, ul, torch.ones_like(ul)), r64)
            bad = ~ok | ~torch.isfinite(change.reshape(change.shape[0], -1) if change.dim() else change.reshape(1, 1)).all(dim=-1)
            change = torch.where(_rows(bad, r64), torch.zeros_like(change), change)
            out.append((r64 + eps * change).to(ref.dtype))
        return out
    if u.numel() != len(reference):
        raise ValueError(f"payload has {u.numel()} attention denominators, expected {len(reference)}")
    out = []
    for l, ref in enumerate(reference):
        r64 = ref.detach().to(torch.float64)
        ul = float(u[l])
        change = averaged[l].to(torch.float64) / ul if math.isfinite(ul) and ul > 0 else torch.zeros_like(r64)
        if not bool(torch.isfinite(change).all()):
            change = torch.zeros_like(r64)
        out.append((r64 + eps * change).to(ref.dtype))
    return out


def personalize(own: Sequence[torch.Tensor], reference: Sequence[torch.Tensor], aggregate: Sequence[torch.Tensor],
                *, tau: float) -> list[torch.Tensor]:
    """Receiver-specific attention of one member over {its own update, the region's update}.

    Per layer, with ``d_own = K_own - K_ref`` and ``d_reg = K_agg - K_ref``:
    ``a = softmax([1, cos(d_own, d_reg)] / tau)`` and ``K <- K_ref + a_own d_own + a_reg d_reg``.
    A member whose update points where the region's does (similar data) takes a large share of the
    region's update; one whose data differ (another language) keeps mostly its own. The region's
    agreed ``K_agg`` stays the common reference of the next round and the region's exported model;
    this personal mix never leaves the peer. ``tau -> inf`` gives the midpoint of the two.
    Computed locally after the all-reduce: it costs no communication."""
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    out = []
    for l, (k, r, g) in enumerate(zip(own, reference, aggregate, strict=True)):
        if k.shape != r.shape or g.shape != r.shape:
            raise ValueError(f"layer {l}: shapes {tuple(k.shape)}, {tuple(r.shape)}, {tuple(g.shape)} differ")
        r64 = r.detach().to(torch.float64)
        d_own, d_reg = k.detach().to(torch.float64) - r64, g.detach().to(torch.float64) - r64
        denom = float(torch.linalg.vector_norm(d_own) * torch.linalg.vector_norm(d_reg))
        cos = float((d_own.flatten() @ d_reg.flatten())) / denom if denom > _TINY else 1.0
        a = torch.softmax(torch.tensor([1.0, cos], dtype=torch.float64) / tau, dim=0)
        out.append((r64 + a[0] * d_own + a[1] * d_reg).to(k.dtype))
    return out
