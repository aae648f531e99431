"""Model construction: preset sizes, seeded init, vocab checks, devices."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from worldlm_p2p.config import MODEL_PRESETS, ModelConfig
from worldlm_p2p.errors import ConfigError
from worldlm_p2p.train.model import (
    autocast_context,
    build_model,
    count_parameters,
    expected_parameters,
    resolve_device,
)

BYTE_VOCAB = 259

# Hand-computed for vocab 259, tied embeddings, no biases:
#   V*h + L * (4*h*h + 3*h*I + 2*h) + h     (all presets use num_kv_heads == num_heads)
HAND_COUNTS = {
    "tiny": 259 * 128 + 4 * (4 * 128 * 128 + 3 * 128 * 352 + 2 * 128) + 128,  # 837_120
    "small": 259 * 384 + 12 * (4 * 384 * 384 + 3 * 384 * 1024 + 2 * 384) + 384,  # 21_342_720
    "base": 259 * 768 + 13 * (4 * 768 * 768 + 3 * 768 * 3072 + 2 * 768) + 768,  # 122_903_040
    "large": 259 * 1024 + 24 * (4 * 1024 * 1024 + 3 * 1024 * 4096 + 2 * 1024) + 1024,  # 402_968_576
}
NOMINAL = {"tiny": 1e6, "small": 20e6, "base": 125e6, "large": 400e6}


@pytest.mark.parametrize("preset", ["tiny", "small", "base", "large"])
def test_preset_sizes(preset: str) -> None:
    cfg = MODEL_PRESETS[preset]
    assert expected_parameters(cfg, vocab_size=BYTE_VOCAB) == HAND_COUNTS[preset]
    with torch.device("meta"):
        model = build_model(cfg, vocab_size=BYTE_VOCAB, seed=0)
    n = count_parameters(model)
    assert n == HAND_COUNTS[preset]
    assert abs(n - NOMINAL[preset]) / NOMINAL[preset] < 0.2  # the preset is the size its name promises


def test_untied_embeddings_add_a_head() -> None:
    cfg = dataclasses.replace(MODEL_PRESETS["tiny"], tie_embeddings=False)
    with torch.device("meta"):
        model = build_model(cfg, vocab_size=BYTE_VOCAB, seed=0)
    assert count_parameters(model) == HAND_COUNTS["tiny"] + 259 * 128
    assert expected_parameters(cfg, vocab_size=BYTE_VOCAB) == HAND_COUNTS["tiny"] + 259 * 128


def test_grouped_query_attention_count() -> None:
    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96)
    # head_dim 16, kv width 32: q,o = 64*64 each, k,v = 64*32 each
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 96 + 2 * 64
    expected = 259 * 64 + 2 * per_layer + 64
    model = build_model(cfg, vocab_size=BYTE_VOCAB, seed=0)
    assert count_parameters(model) == expected == expected_parameters(cfg, vocab_size=BYTE_VOCAB)


def _small_cfg() -> ModelConfig:
    return ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=64, max_seq_len=32)


def test_seeded_init_is_deterministic_and_keeps_global_rng() -> None:
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    a = build_model(_small_cfg(), vocab_size=BYTE_VOCAB, seed=7)
    b = build_model(_small_cfg(), vocab_size=BYTE_VOCAB, seed=7)
    c = build_model(_small_cfg(), vocab_size=BYTE_VOCAB, seed=8)
    assert torch.equal(torch.get_rng_state(), before)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])
    assert a.training


def test_forward_shape_and_initial_loss() -> None:
    model = build_model(_small_cfg(), vocab_size=BYTE_VOCAB, seed=0)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, BYTE_VOCAB, (3, 16), generator=g)
    y = torch.randint(0, BYTE_VOCAB, (3, 16), generator=g)  # unrelated to x
    with torch.no_grad():
        logits = model(input_ids=x).logits
    assert logits.shape == (3, 16, BYTE_VOCAB)
    # small init => nearly uniform predictions: loss on unrelated targets close to ln(259) = 5.5568
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, BYTE_VOCAB), y.reshape(-1))
    assert abs(float(loss) - math.log(259)) < 0.3


def test_vocab_mismatch() -> None:
    cfg = dataclasses.replace(_small_cfg(), vocab_size=300)
    with pytest.raises(ConfigError, match="model.vocab_size 300 does not match .* 259"):
        build_model(cfg, vocab_size=BYTE_VOCAB, seed=0)
    ok = dataclasses.replace(_small_cfg(), vocab_size=BYTE_VOCAB)
    assert build_model(ok, vocab_size=BYTE_VOCAB, seed=0).config.vocab_size == BYTE_VOCAB


def test_resolve_device() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    expected_auto = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected_auto
    with pytest.raises(ConfigError, match="device"):
        resolve_device("banana")
    with pytest.raises(ConfigError, match="device"):
        resolve_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            resolve_device("cuda:0")


def test_autocast_context_cpu_is_fp32() -> None:
    a = torch.ones(4, 4)
    with autocast_context(torch.device("cpu")):
        assert (a @ a).dtype == torch.float32
