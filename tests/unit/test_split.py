"""Backbone / key-layer split on parameter names (worldlm.md section 2)."""

import pytest
import torch

from worldlm_p2p.split import KEY_LAYER_PRESETS, ParamSplit, key_layer_patterns, split_parameters

# The parameter names of MODEL_PRESETS['tiny'] (HF Llama, 4 blocks, tied embeddings so no lm_head),
# in model order; test_tiny_names_are_the_real_model_names checks them against the built model.
_BLOCK = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
          "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
          "input_layernorm.weight", "post_attention_layernorm.weight")
TINY_NAMES = (["model.embed_tokens.weight"]
              + [f"model.layers.{b}.{s}" for b in range(4) for s in _BLOCK]
              + ["model.norm.weight"])
# index of block b's j-th parameter: 1 + 9 b + j
KV = [2, 3, 11, 12, 20, 21, 29, 30]  # k_proj = +1, v_proj = +2 in each block
LAST30 = list(range(19, 37))  # ceil(0.3 * 4) = ceil(1.2) = 2 blocks: 2 (19..27) and 3 (28..36)


def _check_partition(split: ParamSplit, names):
    assert split.names == tuple(names)
    assert sorted(split.key + split.backbone) == list(range(len(names)))  # disjoint, covers all
    assert not set(split.key) & set(split.backbone)
    assert list(split.key) == sorted(split.key) and list(split.backbone) == sorted(split.backbone)


def test_tiny_names_are_the_real_model_names():
    from worldlm_p2p.config import MODEL_PRESETS
    from worldlm_p2p.train import build_model

    model = build_model(MODEL_PRESETS["tiny"], vocab_size=259, seed=0)
    names = [n for n, _ in model.named_parameters()]
    assert names == TINY_NAMES
    for preset, expected in (("kv", KV), ("last30", LAST30), ("embed_head", [0])):
        assert list(split_parameters(names, preset).key) == expected


def test_kv_preset():
    s = split_parameters(TINY_NAMES, "kv")
    _check_partition(s, TINY_NAMES)
    assert list(s.key) == KV
    assert s.key_names == tuple(f"model.layers.{b}.self_attn.{p}_proj.weight" for b in range(4) for p in "kv")
    assert split_parameters(TINY_NAMES) == s  # kv is the default


def test_last30_preset_takes_the_last_two_of_four_blocks():
    s = split_parameters(TINY_NAMES, "last30")
    _check_partition(s, TINY_NAMES)
    assert list(s.key) == LAST30
    assert all(n.startswith(("model.layers.2.", "model.layers.3.")) for n in s.key_names)
    assert "model.norm.weight" not in s.key_names and "model.embed_tokens.weight" not in s.key_names


@pytest.mark.parametrize("n_blocks, expected_blocks", [
    (1, [0]),  # ceil(0.3) = 1: at least one block
    (3, [2]),  # ceil(0.9) = 1
    (10, [7, 8, 9]),  # ceil(3.0) = 3 exactly
    (12, [8, 9, 10, 11]),  # ceil(3.6) = 4
])
def test_last30_block_counts(n_blocks, expected_blocks):
    names = [f"model.layers.{b}.{s}" for b in range(n_blocks) for s in ("a.weight", "b.weight")]
    s = split_parameters(names, "last30")
    got = sorted({int(n.split(".")[2]) for n in s.key_names})
    assert got == expected_blocks
    assert len(s.key) == 2 * len(expected_blocks)  # every parameter of those blocks, none else


def test_last30_patterns_do_not_overmatch():
    # block 11 is chosen; its pattern must not catch block 1 (the dot after the index matters)
    names = ["layers.0.w", "layers.1.w", "x.layers.11.w"]  # 3 blocks: ceil(0.9) = 1 -> block 11
    assert key_layer_patterns("last30", names) == ["*layers.11.*"]
    assert split_parameters(names, "last30").key_names == ("x.layers.11.w",)


def test_embed_head_preset():
    s = split_parameters(TINY_NAMES, "embed_head")  # tied embeddings: no lm_head parameter
    assert s.key_names == ("model.embed_tokens.weight",)
    untied = TINY_NAMES + ["lm_head.weight"]
    s = split_parameters(untied, "embed_head")
    assert s.key_names == ("model.embed_tokens.weight", "lm_head.weight")
    _check_partition(s, untied)


def test_custom_patterns():
    s = split_parameters(TINY_NAMES, "*.mlp.down_proj.weight, model.norm.weight")
    # down_proj = +6 in each block: 7, 16, 25, 34; final norm: 37
    assert list(s.key) == [7, 16, 25, 34, 37]
    _check_partition(s, TINY_NAMES)
    # empty entries and whitespace are ignored; fnmatch is case-sensitive
    assert list(split_parameters(TINY_NAMES, " ,*layers.0.self_attn.q_proj.weight,, ").key) == [1]
    with pytest.raises(ValueError):
        split_parameters(TINY_NAMES, "*.Q_PROJ.*")


@pytest.mark.parametrize("selection", ["*.does_not_exist.*", "", " , ,"])
def test_selection_matching_nothing_raises(selection):
    with pytest.raises(ValueError):
        split_parameters(TINY_NAMES, selection)


def test_presets_matching_nothing_raise():
    with pytest.raises(ValueError):
        split_parameters(["encoder.weight", "decoder.weight"], "last30")  # no blocks at all
    with pytest.raises(ValueError):
        split_parameters(["encoder.weight", "decoder.weight"], "kv")
    assert set(KEY_LAYER_PRESETS) == {"kv", "last30", "embed_head"}


@pytest.mark.parametrize("selection", ["kv", "last30", "embed_head", "*.mlp.*"])
def test_merge_is_the_inverse_of_take(selection):
    s = split_parameters(TINY_NAMES, selection)
    tensors = [torch.full((1,), float(i)) for i in range(len(TINY_NAMES))]
    b, k = s.take_backbone(tensors), s.take_key(tensors)
    assert len(b) + len(k) == len(tensors)
    merged = s.merge(b, k)
    assert all(m is t for m, t in zip(merged, tensors, strict=True))
    # take of a merge gives back the parts
    b2 = [t + 100 for t in b]
    k2 = [t - 100 for t in k]
    merged = s.merge(b2, k2)
    assert all(x is y for x, y in zip(s.take_backbone(merged), b2, strict=True))
    assert all(x is y for x, y in zip(s.take_key(merged), k2, strict=True))


def test_merge_rejects_wrong_counts():
    s = split_parameters(["a", "layers.0.self_attn.k_proj.weight"], "kv")
    x = torch.zeros(1)
    with pytest.raises(ValueError):
        s.merge([x, x], [x])
    with pytest.raises(ValueError):
        s.merge([x], [])
