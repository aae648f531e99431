"""The wire codecs of a region round (:mod:`worldlm_p2p.compression`), against hand-computed values,
and hivemind's framing of them (:mod:`worldlm_p2p.net.codecs`), which must decode to the pure result."""

import pytest
import torch

from worldlm_p2p import compression as C
from worldlm_p2p import attention
from worldlm_p2p.rounds import (RoundRule, group_average, payload_codecs, region_payload, region_round,
                                region_round_with_anchor)
from worldlm_p2p.split import split_parameters

T = torch.tensor


def test_fp16_rounds_to_half_precision_and_clamps_its_range():
    x = T([1.0, 1.0 + 2 ** -12, 1.0 + 2 ** -10, 70000.0, -1e6, 2 ** -30])
    got = C.roundtrip(x, "fp16")
    # 1 + 2^-12 is half-way below the next half (1 + 2^-10): rounds to even, 1.0; 2^-30 is below fp16's subnormals
    assert got.tolist() == [1.0, 1.0, 1.0 + 2 ** -10, 65504.0, -65504.0, 0.0]
    assert got.dtype == torch.float32


def test_none_is_the_identity_and_a_copy():
    x = torch.randn(5)
    got = C.roundtrip(x, "none")
    assert torch.equal(got, x) and got.data_ptr() != x.data_ptr()


def test_int8_hand_computed_levels():
    # 1024 values: 512 at -1, 512 at +1 -> mean 0, std (unbiased) = sqrt(1024/1023), scale = 6 std / 256
    x = torch.cat([torch.full((512,), -1.0), torch.full((512,), 1.0)])
    index, codebook = C.int8_encode(x)
    scale = 6 * (1024 / 1023) ** 0.5 / 256
    assert index[0] == 128 + round(-1 / scale) and index[-1] == 128 + round(1 / scale)
    assert codebook[int(index[0])] == -1.0 and codebook[int(index[-1])] == 1.0  # each level decodes to its values' mean
    assert torch.equal(C.roundtrip(x, "int8"), x)


def test_int8_error_within_half_a_step_inside_the_range_and_saturated_beyond():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20_000, generator=g) * 0.01 + 0.002
    got = C.roundtrip(x, "int8")
    std = float((x - x.mean()).norm()) / (x.numel() - 1) ** 0.5
    step = 6 * std / 256
    inside = (x - x.mean()).abs() < 2.9 * std
    assert float((got - x)[inside].abs().max()) <= step  # (a level's mean lies within its bin: one step)
    assert float(got.max()) < float(x.max()) and float(got.min()) > float(x.min())  # the tails saturate
    assert abs(float(got.mean() - x.mean())) < 1e-6  # bin means keep the tensor's mean (up to rounding)


@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_nonfinite_tensors_travel_in_float32(codec):
    x = torch.randn(4096)
    x[3], x[9] = float("inf"), float("nan")
    assert C.travels_as(x, codec) == "none"
    got = C.roundtrip(x, codec)
    assert got[3] == float("inf") and torch.isnan(got[9]) and torch.equal(got[:3], x[:3])


def test_int8_falls_back_to_fp16_for_small_or_constant_tensors():
    assert C.effective_codec("int8", C.INT8_MIN_NUMEL - 1) == "fp16"
    assert C.effective_codec("int8", C.INT8_MIN_NUMEL) == "int8"
    assert C.travels_as(torch.full((5000,), 0.25), "int8") == "fp16"
    assert torch.equal(C.roundtrip(torch.full((5000,), 0.25), "int8"), torch.full((5000,), 0.25))
    with pytest.raises(ValueError, match="spread"):
        C.int8_encode(torch.zeros(5000))
    with pytest.raises(ValueError, match="wire codec"):
        C.effective_codec("int4", 10)


def test_wire_bytes():
    assert C.nominal_bytes(1000, "none") == 4000
    assert C.nominal_bytes(1000, "fp16") == 2000
    assert C.nominal_bytes(1000, "int8") == 2000  # (too small: fp16)
    assert C.nominal_bytes(10_000, "int8") == 10_000 + 256 * 4 + 8
    assert C.wire_bytes(torch.zeros(10_000), "int8") == 20_000  # (no spread: fp16)


def test_int8_decode_refuses_a_message_of_the_wrong_size():
    with pytest.raises(ValueError, match="cannot be a tensor"):
        C.int8_decode(torch.zeros(10, dtype=torch.uint8), torch.zeros(256), (11,))


@pytest.mark.parametrize("codec", ["none", "fp16", "int8"])
def test_hivemind_framing_decodes_to_the_pure_roundtrip(codec):
    from hivemind.compression import CompressionInfo, deserialize_torch_tensor

    from worldlm_p2p.net.codecs import wire_compression

    g = torch.Generator().manual_seed(3)
    for x in (torch.randn(50_000, generator=g) * 0.01, torch.randn(300, generator=g), torch.full((4096,), 2.0)):
        message = wire_compression([codec]).compress(x, CompressionInfo.from_tensor(x, key=0))
        assert torch.equal(deserialize_torch_tensor(message), C.roundtrip(x, codec))
        assert len(message.buffer) == C.wire_bytes(x, codec)


def test_hivemind_framing_refuses_a_truncated_int8_message():
    from hivemind.compression import CompressionInfo, deserialize_torch_tensor

    from worldlm_p2p.net.codecs import wire_compression

    x = torch.randn(5000)
    message = wire_compression(["int8"]).compress(x, CompressionInfo.from_tensor(x, key=0))
    message.buffer = message.buffer[:-7]
    with pytest.raises(ValueError):
        deserialize_torch_tensor(message)


NAMES = ["embed.weight", "layers.0.self_attn.k_proj.weight", "layers.0.mlp.weight"]
SPLIT = split_parameters(NAMES, "*k_proj*")  # key = (1,), backbone = (0, 2)


def _members(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    anchor = [torch.randn(64, 32, generator=g), torch.randn(32, 32, generator=g), torch.randn(2048, generator=g)]
    return anchor, [[a + 0.01 * torch.randn(a.shape, generator=g) for a in anchor] for _ in range(n)]


def test_payload_codecs_by_role():
    rule = RoundRule.of(SPLIT, strategy="worldlm", compress_backbone="int8", compress_key="fp16", attention="distance")
    anchor, members = _members()
    payload = region_payload(rule, members[0], anchor)
    # backbone: embed (2048 values: int8), mlp (2048: int8); K's attention-weighted change in float32
    # (fp16 would flush small attention weights to zero); the attention denominators in float32
    assert payload_codecs(rule, payload) == ["int8", "int8", "none", "none"]
    # with a plain mean (u = 1, the default) K's change travels in fp16, and int8 scales each tensor to its spread
    assert payload_codecs(RoundRule.of(SPLIT, strategy="worldlm", compress_backbone="int8", compress_key="fp16"),
                          payload) == ["int8", "int8", "fp16", "none"]
    # per-row usage weights: float32 again (a member's prior on a token it never saw underflows fp16)
    assert payload_codecs(RoundRule.of(SPLIT, strategy="worldlm", compress_backbone="int8", compress_key="fp16",
                                       usage_rows=True), payload) == ["int8", "int8", "none", "none"]
    assert payload_codecs(RoundRule.of(SPLIT, strategy="worldlm", compress_backbone="int8", compress_key="int8"),
                          payload)[2] == "int8"
    small = RoundRule.of(SPLIT, strategy="fedavg", compress_backbone="int8")
    assert payload_codecs(small, [torch.zeros(10), torch.zeros(2000), torch.zeros(1)]) == ["fp16", "int8", "fp16"]
    with pytest.raises(ValueError, match="expected"):
        payload_codecs(rule, payload[:-1])


def test_attentive_key_layers_that_moved_far_are_not_flushed_to_zero_by_fp16():
    """Distance attention with tau 0.1 gives a member whose K moved by 3x its norm u = exp(-30), and
    the encoded change u (K - K_ref) is far below fp16's smallest number: in fp16 the region's K
    would stay at its anchor. The round with the default codecs equals the float32 round."""
    kw = dict(strategy="worldlm", robust="mean", attention="distance", tau=0.1)
    rule = RoundRule.of(SPLIT, compress_backbone="fp16", compress_key="fp16", **kw)
    exact = RoundRule.of(SPLIT, compress_backbone="none", compress_key="none", **kw)
    anchor, members = _members()
    g = torch.Generator().manual_seed(1)
    for m in members:  # K moved far from the anchor
        m[1] = anchor[1] + 3.0 * anchor[1].norm() / anchor[1].numel() ** 0.5 * torch.randn(anchor[1].shape, generator=g)
    u = torch.exp(attention.layer_scores([members[0][1]], [anchor[1]], form="distance", tau=0.1))
    assert float(u) < 1e-10  # beyond fp16's range
    _, _, agreed = region_round_with_anchor(rule, members, [1.0, 2.0, 3.0], anchor=anchor, momentum=None)
    _, _, want = region_round_with_anchor(exact, members, [1.0, 2.0, 3.0], anchor=anchor, momentum=None)
    assert float((agreed[1] - anchor[1]).abs().max()) > 0.1  # K moved
    torch.testing.assert_close(agreed[1], want[1], rtol=0, atol=1e-6)  # as in float32


def test_usage_weighted_key_rows_are_not_flushed_to_zero_by_fp16():
    """Per-row weights (a plain mean over peers, rows by token usage): a member that saw ten million
    tokens, all of row 0, has a prior of about 1e-7 on every other row, and its encoded change there
    (prior times a change of 1e-2) is below fp16's smallest subnormal. The round with the default
    codecs equals the float32 round."""
    kw = dict(strategy="worldlm", robust="mean", attention="mean", usage_rows=True)
    rule = RoundRule.of(SPLIT, compress_backbone="fp16", compress_key="fp16", **kw)
    exact = RoundRule.of(SPLIT, compress_backbone="none", compress_key="none", **kw)
    anchor, members = _members()
    rows = anchor[1].shape[0]
    usage = [torch.zeros(rows, dtype=torch.float64) for _ in members]
    for i, u in enumerate(usage):
        u[i] = 1e7  # each member uses one row only
    prior = attention.row_priors([anchor[1]], usage[0])[0]
    assert float(prior[5]) * 1e-2 < 6e-8  # beyond fp16's range
    _, _, agreed = region_round_with_anchor(rule, members, [1.0, 2.0, 3.0], anchor=anchor, momentum=None, usage=usage)
    _, _, want = region_round_with_anchor(exact, members, [1.0, 2.0, 3.0], anchor=anchor, momentum=None, usage=usage)
    assert float((agreed[1][5] - anchor[1][5]).abs().max()) > 1e-3  # the rows nobody uses moved too
    torch.testing.assert_close(agreed[1], want[1], rtol=0, atol=1e-6)  # as in float32
    # row i takes member i's change: its prior there is ~1, the others' ~1e-7
    for i, m in enumerate(members):
        torch.testing.assert_close(agreed[1][i], m[1][i], rtol=0, atol=1e-5)


def test_group_average_with_codecs_encodes_each_payload_and_the_result():
    rule = RoundRule.of(SPLIT, strategy="fedavg", robust="mean", compress_backbone="fp16")
    a = [T([1.0 + 2 ** -11, 0.0]), T([3.0])]
    b = [T([1.0, 2.0]), T([1.0 + 2 ** -9])]
    got = group_average(rule, [a, b], [1.0, 1.0], codecs=["fp16", "none"])
    # a's first value rounds to 1.0 on the wire; the mean of the second tensor is exact in float32
    assert got[0].tolist() == [1.0, 1.0] and got[1].tolist() == [(3.0 + 1.0 + 2 ** -9) / 2]


@pytest.mark.parametrize("codec,mean_bound,max_bound", [("fp16", 5e-6, 1e-4), ("int8", 2e-4, 1e-2)])
def test_a_compressed_round_stays_close_to_the_exact_one(codec, mean_bound, max_bound):
    anchor, members = _members(seed=5)
    # members adopt the agreed model (mix none), so that the whole of it is compared
    exact = RoundRule.of(SPLIT, strategy="worldlm", mix="none", compress_backbone="none", compress_key="none")
    lossy = RoundRule.of(SPLIT, strategy="worldlm", mix="none", compress_backbone=codec, compress_key=codec)
    want, _ = region_round(exact, members, [1.0, 2.0, 3.0], anchor=anchor, momentum=None)
    got, _ = region_round(lossy, members, [1.0, 2.0, 3.0], anchor=anchor, momentum=None)
    for w, o in zip(want, got):
        for x, y in zip(w, o):
            # the codec's error is on the changes (sd 0.01), not on the model: fp16 keeps 11 bits of
            # them; int8 spends 256 levels on 6 standard deviations, so a step is 2.4e-4 and the few
            # values beyond 3 sd are clipped (the largest error, under one sd of the change)
            err = (x - y).abs()
            assert float(err.mean()) <= mean_bound and float(err.max()) <= max_bound
