"""Poisson sampling of training windows for DP-SGD (torch only): every aligned window is in a step's
batch independently with probability ``q = batch_size / N``, a pure function of the seed and the
step (the sampling the RDP accountant of :mod:`worldlm_p2p.train.dp` assumes)."""

from __future__ import annotations

import hashlib

import torch

from worldlm_p2p.errors import ConfigError

def count_windows(n_tokens: int, seq_len: int) -> int:
    """Number of aligned non-overlapping windows of ``seq_len + 1`` tokens (sharing their end
    token with the next window's start) in a stream of ``n_tokens``: ``(n_tokens - 1) // seq_len``."""
    return max(0, (int(n_tokens) - 1) // int(seq_len))


def dp_sample_rate(n_tokens: int, *, batch_size: int, seq_len: int) -> float:
    """Poisson sampling rate ``q = batch_size / N`` of a stream of ``n_tokens``; ConfigError when the
    stream has fewer than ``batch_size`` windows."""
    n = count_windows(n_tokens, seq_len)
    if n < batch_size:
        raise ConfigError(
            f"peer DP needs at least train.batch_size = {batch_size} training windows of "
            f"train.seq_len + 1 = {seq_len + 1} tokens; the data has {n}"
        )
    return batch_size / n


def _derived_seed(kind: str, seed: int, step: int) -> int:
    digest = hashlib.sha256(f"worldlm-dp-{kind}:{int(seed)}:{int(step)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def poisson_windows(*, n_windows: int, sample_rate: float, seed: int, step: int) -> torch.Tensor:
    """Indices (sorted, ``torch.long``, CPU) of the windows in the batch of ``step``: each of the
    ``n_windows`` is included independently with probability ``sample_rate``. A pure function of
    ``(n_windows, sample_rate, seed, step)``; the global RNG is not used. May be empty."""
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
    g = torch.Generator(device="cpu")
    g.manual_seed(_derived_seed("sample", seed, step))
    keep = torch.rand(n_windows, generator=g, dtype=torch.float64) < sample_rate
    return keep.nonzero().flatten()


def poisson_batch(
    tokens: torch.Tensor, *, batch_size: int, seq_len: int, step: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Poisson batch of ``step``: inputs ``x`` and targets ``y``, both ``[B', seq_len]`` (on the
    device of ``tokens``), from the aligned windows :func:`poisson_windows` picks with
    ``q = batch_size / N``. ``B'`` varies around ``batch_size`` and may be 0."""
    q = dp_sample_rate(int(tokens.numel()), batch_size=batch_size, seq_len=seq_len)
    idx = poisson_windows(n_windows=count_windows(int(tokens.numel()), seq_len), sample_rate=q, seed=seed, step=step)
    positions = idx[:, None] * seq_len + torch.arange(seq_len + 1)[None, :]
    windows = tokens[positions.to(tokens.device)]
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
