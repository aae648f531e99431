"""The model: a Llama-style causal LM built with ``transformers`` from a
:class:`~worldlm_p2p.config.ModelConfig` (random init, nothing downloaded).

``transformers`` is imported lazily (it takes seconds), so importing this module is cheap.
"""

from __future__ import annotations

import contextlib
import logging
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch

from worldlm_p2p.config import ModelConfig
from worldlm_p2p.errors import ConfigError

if TYPE_CHECKING:
    from transformers import LlamaConfig, LlamaForCausalLM

logger = logging.getLogger(__name__)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "llama_config",
    "build_model",
    "count_parameters",
    "expected_parameters",
    "resolve_device",
    "autocast_context",
]

#: PyTorch's scaled-dot-product attention: works on CPU and CUDA, deterministic on CPU.
ATTN_IMPLEMENTATION = "sdpa"


def _check_vocab(cfg: ModelConfig, vocab_size: int) -> int:
    if vocab_size <= 0:
        raise ConfigError(f"tokenizer vocabulary size must be positive, got {vocab_size}")
    if cfg.vocab_size and cfg.vocab_size != vocab_size:
        raise ConfigError(
            f"model.vocab_size {cfg.vocab_size} does not match the tokenizer's vocabulary size {vocab_size}"
        )
    return vocab_size


def llama_config(cfg: ModelConfig, *, vocab_size: int) -> LlamaConfig:
    """The ``transformers.LlamaConfig`` for ``cfg`` and a tokenizer of ``vocab_size`` ids."""
    from transformers import LlamaConfig

    vocab_size = _check_vocab(cfg, vocab_size)
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        use_cache=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation=ATTN_IMPLEMENTATION,  # type: ignore[call-arg]  # a PreTrainedConfig kwarg
    )


def build_model(cfg: ModelConfig, *, vocab_size: int, seed: int) -> LlamaForCausalLM:
    """A freshly initialised ``LlamaForCausalLM`` (fp32, on CPU, train mode).

    The initial weights are a pure function of ``(cfg, vocab_size, seed)``; the global RNG state
    is left untouched (initialisation runs inside :func:`torch.random.fork_rng`).
    """
    from transformers import LlamaForCausalLM

    config = llama_config(cfg, vocab_size=vocab_size)
    with torch.random.fork_rng():  # torch.manual_seed also seeds CUDA: fork both
        torch.manual_seed(int(seed))
        model = LlamaForCausalLM(config)
    model.train()
    logger.debug("built model %s: %d parameters (seed %d)", cfg.preset, count_parameters(model), seed)
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameter elements (tied weights are counted once)."""
    return sum(p.numel() for p in model.parameters())


def expected_parameters(cfg: ModelConfig, *, vocab_size: int) -> int:
    """Parameter count of the model :func:`build_model` makes, computed analytically (no tensors):
    embeddings (+ an untied LM head), per layer q/k/v/o projections, the SwiGLU MLP and two RMSNorms,
    plus the final RMSNorm. No biases."""
    vocab_size = _check_vocab(cfg, vocab_size)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    head_dim = h // cfg.num_heads
    kv = cfg.num_kv_heads * head_dim
    attention = h * h + 2 * h * kv + h * h
    mlp = 3 * h * inter
    per_layer = attention + mlp + 2 * h
    embeddings = vocab_size * h * (1 if cfg.tie_embeddings else 2)
    return embeddings + cfg.num_layers * per_layer + h


def resolve_device(name: str) -> torch.device:
    """``"auto"`` -> ``cuda`` if available else ``cpu``; ``"cpu"``; ``"cuda"`` / ``"cuda:N"``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device: {name!r} is not 'auto', 'cpu' or 'cuda[:N]'") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ConfigError(f"device: {name!r} is not 'auto', 'cpu' or 'cuda[:N]'")
    if not torch.cuda.is_available():
        raise ConfigError(f"device: {name!r} requested but CUDA is not available on this machine")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"device: {name!r} does not exist ({torch.cuda.device_count()} CUDA device(s))")
    return device


def autocast_context(device: torch.device) -> AbstractContextManager[object]:
    """bf16 autocast on CUDA; a null context on CPU (fp32)."""
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()
