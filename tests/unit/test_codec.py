"""The typed codec of what peers serve and checkpoint: round trips, and every malformed state refused
with its reason."""

import math

import pytest
import torch

from worldlm_p2p.codec import PeerCheckpoint, ServedState, StateError, WorldChange

FP = "fp-1"
TEMPLATE = [torch.zeros(3), torch.zeros(2, 2), torch.zeros(4)]
BACKBONE = [TEMPLATE[0], TEMPLATE[2]]  # the parameters the outer momentum covers
SHARED = BACKBONE  # the parameters a border reference covers


def _t(seed, like):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t.shape, generator=g) for t in like]


def _state(with_change=True, with_ref=True):
    change = WorldChange(world_round=4, delta=_t(2, TEMPLATE), apply_round=9, source="leader",
                         reference=_t(3, SHARED) if with_ref else None) if with_change else None
    return ServedState(round=8, world_round=3, agreed=_t(0, TEMPLATE), momentum=_t(1, BACKBONE), change=change,
                       border_history=[[1.0, 1]])


def _decode(meta, tensors):
    return ServedState.decode(meta, tensors, template=TEMPLATE, backbone=BACKBONE, shared=SHARED, fingerprint=FP)


def _wire(state):
    """What a peer's averager serves: the codec's metadata plus the averager's round and fingerprint."""
    meta, tensors = state.encode()
    return dict(meta, round=state.round, fingerprint=FP), tensors


def _same(a, b):
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("with_change, with_ref", [(True, True), (True, False), (False, False)])
def test_round_trip(with_change, with_ref):
    state = _state(with_change, with_ref)
    meta, tensors = _wire(state)
    # the layout on the wire: agreed, momentum, delta, reference, with the counts in the metadata
    assert len(tensors) == 3 + 2 + (3 if with_change else 0) + (2 if with_ref else 0)
    assert (meta["n_momentum"], meta["n_delta"], meta["n_ref"]) == (2, 3 if with_change else 0, 2 if with_ref else 0)
    back = _decode(meta, tensors)
    assert (back.round, back.world_round, back.border_history) == (8, 3, [[1.0, 1]])
    _same(back.agreed, state.agreed)
    _same(back.momentum, state.momentum)
    if with_change:
        c = back.change
        assert (c.world_round, c.apply_round, c.source) == (4, 9, "leader")
        _same(c.delta, state.change.delta)
        assert (c.reference is None) == (not with_ref)
        if with_ref:
            _same(c.reference, state.change.reference)
    else:
        assert back.change is None


def _broken(what):
    meta, tensors = _wire(_state())
    if what == "fingerprint":
        meta["fingerprint"] = "other"
    elif what == "count":
        meta["n_momentum"] = 1
    elif what == "total":
        tensors = tensors[:-1]
    elif what == "shape":
        tensors[1] = torch.zeros(3, 3)
    elif what == "nan":
        tensors[4] = torch.full_like(tensors[4], math.nan)
    elif what == "inf_delta":
        tensors[6] = torch.full_like(tensors[6], math.inf)
    elif what == "type":
        meta["n_delta"] = "3"
    elif what == "bool":
        meta["delta_world_round"] = True
    elif what == "ref_without_delta":
        meta, tensors = _wire(_state(with_change=False))
        meta["n_ref"], tensors = 2, tensors + _t(5, SHARED)
    elif what == "meta":
        meta = [1, 2]
    elif what == "not_tensor":
        tensors[0] = [0.0, 0.0, 0.0]
    return meta, tensors


def test_a_world_change_in_fp16_numbers_travels_in_fp16_and_comes_back_equal():
    from worldlm_p2p.rounds import RoundRule, hand_down
    from worldlm_p2p.split import split_parameters

    split = split_parameters(["a", "b", "c"], "*b*")
    model, anchor = _t(5, TEMPLATE), _t(6, TEMPLATE)
    exact = hand_down(RoundRule.of(split, compress_world="none"), model, anchor)
    half = hand_down(RoundRule.of(split, compress_world="fp16"), model, anchor)
    for e, h, m, a in zip(exact, half, model, anchor):
        assert torch.equal(e, m - a) and torch.equal(h, (m - a).half().float()) and not torch.equal(h, e)
    for delta, dtype in ((half, torch.float16), (exact, torch.float32)):
        state = ServedState(round=8, world_round=3, agreed=_t(0, TEMPLATE), momentum=[], change=WorldChange(
            world_round=4, delta=delta, apply_round=9, source="leader"))
        meta, tensors = _wire(state)
        assert all(t.dtype == dtype for t in tensors[3:6])  # on the wire: fp16 only where nothing is lost
        assert all(t.dtype == torch.float32 for t in tensors[:3])  # (the agreed model: as it is)
        back = _decode(meta, tensors)
        assert all(t.dtype == torch.float32 for t in back.change.delta)
        _same(back.change.delta, delta)


@pytest.mark.parametrize("what, reason", [
    ("fingerprint", "another run manifest"), ("count", "counts"), ("total", "holds 9 tensors, not the 10"),
    ("shape", "shapes"), ("nan", "not finite"), ("inf_delta", "not finite"), ("type", "n_delta is not an integer"),
    ("bool", "delta_world_round is not an integer"), ("ref_without_delta", "counts"), ("meta", "not a mapping"),
    ("not_tensor", "other than tensors"),
])
def test_malformed_states_are_refused_with_the_reason(what, reason):
    with pytest.raises(StateError, match=reason):
        _decode(*_broken(what))


def test_checkpoint_round_trip_and_refusals():
    ckpt = PeerCheckpoint(fingerprint=FP, region="eu", model={"w": torch.ones(2)}, anchor=_t(0, TEMPLATE),
                          stats={"step": 5}, run_id="r", momentum=None, manifest={"run_id": "r"}, label="a",
                          world_ref=_t(1, TEMPLATE), border={"delta": 1e-5, "history": []})
    back = PeerCheckpoint.from_payload(ckpt.to_payload())
    assert (back.fingerprint, back.region, back.stats, back.label, back.manifest) == (FP, "eu", {"step": 5}, "a",
                                                                                     {"run_id": "r"})
    _same(back.anchor, ckpt.anchor)
    _same(back.world_ref, ckpt.world_ref)
    assert back.has_world_ref and back.momentum is None
    older = {k: v for k, v in ckpt.to_payload().items() if k not in ("world_ref", "manifest")}
    assert not PeerCheckpoint.from_payload(older).has_world_ref
    with pytest.raises(StateError, match=r"is not a peer checkpoint \(no anchor, stats\)"):
        PeerCheckpoint.from_payload({"fingerprint": FP, "region": "eu", "model": {}})
    with pytest.raises(StateError, match="unexpected payload types"):
        PeerCheckpoint.from_payload(dict(ckpt.to_payload(), anchor="x"))
