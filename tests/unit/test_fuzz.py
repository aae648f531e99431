"""Fuzzing every record kind and message a peer accepts (hypothesis): whatever arrives, the decoder
returns a record or raises ``ValueError`` (the caller logs the rejection and skips it), never another
exception, and the robust rule never crashes or lets a non-finite value through."""

from __future__ import annotations

import math

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from worldlm_p2p import robust  # noqa: E402
from worldlm_p2p.codec import ServedState, StateError  # noqa: E402
from worldlm_p2p.config import RunManifest  # noqa: E402
from worldlm_p2p.net import records  # noqa: E402
from worldlm_p2p.net.admission import Certificate  # noqa: E402

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# what msgpack can carry: the values a DHT record may hold
scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2 ** 70, max_value=2 ** 70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40), st.binary(max_size=64))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                      st.dictionaries(st.text(max_size=12), inner, max_size=5)),
                      max_leaves=20)


def _valid_wires():
    from hivemind.utils.crypto import RSAPrivateKey

    progress = records.ProgressRecord(region="eu", peer_id="p1", label="a", step=3, tokens=300, train_loss=2.5,
                                      tokens_per_s=10.0, rounds_completed=1, last_group_size=2, bytes_sent=10,
                                      bytes_received=10, round=2, waiting_for_round=-1, fingerprint="abc", time=1.0)
    lease = records.LeaseRecord(region="eu", peer_id="p1", since=1.0, expires=2.0, fingerprint="abc",
                                maddrs=("/ip4/127.0.0.1/tcp/1",))
    residual = records.ResidualRecord(region="eu", peer_id="p1", world_round=1, fingerprint="abc", layers=1, dim=2,
                                      embedding=b"\0" * 8, time=1.0)
    manifest = records.ManifestRecord.sign(RSAPrivateKey(), RunManifest.from_dict({"run_id": "fz"}), time=1.0)
    return {records.ProgressRecord: progress.to_wire(), records.LeaseRecord: lease.to_wire(),
            records.ResidualRecord: residual.to_wire(), records.ManifestRecord: manifest.to_wire()}


WIRES = _valid_wires()
KINDS = list(WIRES)


def _decode(kind, value):
    try:
        kind.from_wire(value)
    except ValueError:
        pass  # a logged rejection


@FUZZ
@given(kind=st.sampled_from(KINDS), value=values)
def test_any_value_is_a_record_or_a_rejection(kind, value):
    _decode(kind, value)


@FUZZ
@given(kind=st.sampled_from(KINDS), data=st.data())
def test_a_valid_record_with_any_field_replaced_is_a_record_or_a_rejection(kind, data):
    wire = dict(WIRES[kind])
    for key in data.draw(st.lists(st.sampled_from(sorted(wire)), min_size=1, max_size=3, unique=True)):
        wire[key] = data.draw(values)
    if data.draw(st.booleans()):
        wire[data.draw(st.text(max_size=8))] = data.draw(values)
    _decode(kind, wire)


@FUZZ
@given(value=values)
def test_any_certificate_is_one_or_a_rejection(value):
    try:
        Certificate.from_wire(value)
    except ValueError:
        pass


tensors = st.lists(st.one_of(st.builds(lambda n: torch.zeros(n), st.integers(0, 4)),
                             st.builds(lambda: torch.tensor([math.nan])), values), max_size=6)


@FUZZ
@given(meta=values, served=tensors)
def test_any_served_state_is_checked(meta, served):
    template = [torch.zeros(2), torch.zeros(3)]
    try:
        ServedState.decode(meta, served, template=template, backbone=template[:1], shared=template[:1],
                           fingerprint="abc")
    except StateError:
        pass


@FUZZ
@given(rows=st.lists(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=3, max_size=3),
                     min_size=1, max_size=6),
       weights=st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=6, max_size=6),
       rule=st.sampled_from(["clip", "mean"]))
def test_the_robust_rule_never_crashes_and_never_lets_nan_through(rows, weights, rule):
    x = torch.tensor(rows, dtype=torch.float32)
    try:
        agg = robust.robust_mean(x, weights[:len(rows)], rule=rule, max_weight=1e6)
    except ValueError:  # a coordinate with no finite value from anyone
        return
    assert bool(torch.isfinite(agg.value).all()) or not bool(torch.isfinite(x).any(dim=0).all())
