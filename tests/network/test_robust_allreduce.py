"""The robust all-reduce on real hivemind averagers (127.0.0.1): the group's result equals the pure
rule (:func:`worldlm_p2p.robust.robust_mean_of_lists`) on the same inputs, whatever one member
sends, and the member whose payload is scaled or not finite is named by the reducers."""

from __future__ import annotations

import threading
from contextlib import ExitStack

import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey

from swarm_utils import LOOPBACK
from worldlm_p2p import robust
from worldlm_p2p.config import AveragingConfig, NetConfig
from worldlm_p2p.net import records
from worldlm_p2p.net.averaging import RegionAverager
from worldlm_p2p.net.robust_allreduce import RobustSettings

pytestmark = pytest.mark.network

RUN = "robust-net"
SETTINGS = RobustSettings(rule="clip", clip=4.0, max_weight=100.0)


def _payloads(n: int, seed: int) -> list[list[torch.Tensor]]:
    """``n`` members' payloads: a common model plus small honest differences, large enough that
    hivemind cuts every member's span into several pieces."""
    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(300, 400, generator=g) * 0.05, torch.randn(70_000, generator=g) * 0.05]
    return [[b + torch.randn(b.shape, generator=g) * 0.005 for b in base] for _ in range(n)]


def _round(averagers, payloads, weights, attempts=3):
    """One round of all ``averagers`` at once. hivemind's matchmaking can split a group on a busy
    machine (one member finds none, the others average as two: once in CI); what these tests assert
    is the result of a whole round, so a round whose matchmaking split is run again."""
    for _ in range(attempts):
        results = [None] * len(averagers)

        def run(i):
            results[i] = averagers[i].run_round(payloads[i], weight=weights[i], gather=dict(i=i))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(averagers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=90)
        split = any(r is not None and not r.ok and ("could not find a group" in r.error or r.error == "no group")
                    for r in results)
        if not split:
            return results
    return results


def _group(region: str, codecs=None):
    """3 region averagers on 127.0.0.1 (and their bootstrap DHT node), their payload in ``codecs``."""
    from worldlm_p2p.net.dht import start_dht

    n = 3
    with ExitStack() as stack:
        boot = start_dht(NetConfig(host_maddrs=(LOOPBACK,)), record_validators=records.make_validators(RUN, RSAPrivateKey()))
        stack.callback(boot.shutdown)
        maddrs = tuple(str(m) for m in boot.get_visible_maddrs())
        averaging = AveragingConfig(matchmaking_time=3.0, averaging_timeout=20.0, target_group_size=n)
        template = _payloads(1, 0)[0]
        averagers = []
        for _ in range(n):
            dht = start_dht(NetConfig(initial_peers=maddrs, host_maddrs=(LOOPBACK,)),
                            record_validators=records.make_validators(RUN, RSAPrivateKey()))
            stack.callback(dht.shutdown)
            a = RegionAverager(tensors=template, dht=dht, run_id=RUN, region=region, averaging=averaging,
                               fingerprint="fp", robust=SETTINGS, codecs=codecs)
            stack.callback(a.shutdown)
            averagers.append(a)
        for a in averagers:
            a.set_target_group_size(n)
        yield averagers


@pytest.fixture(scope="module")
def group():
    yield from _group("eu")


@pytest.mark.parametrize("attack", ["none", "x1000", "nan", "weight"])
def test_network_result_equals_the_pure_rule_whatever_one_member_sends(group, attack):
    payloads = _payloads(3, seed=hash(attack) % 1000)
    weights = [60.0, 80.0, 50.0]
    if attack == "x1000":
        payloads[2] = [t * 1000 for t in payloads[2]]
    elif attack == "nan":
        payloads[2][0][7, 9], payloads[2][1][123] = float("nan"), float("inf")  # one in each piece
    elif attack == "weight":
        payloads[2] = [-t for t in payloads[2]]
        weights[2] = 1e9
    results = _round(group, payloads, weights)
    honest = [r for r in results[:2]]
    assert all(r is not None and r.ok and r.group_size == 3 for r in honest), [r and r.error for r in honest]
    expected, agg = robust.robust_mean_of_lists(payloads, weights, rule=SETTINGS.rule, clip=SETTINGS.clip,
                                                max_weight=SETTINGS.max_weight)
    for r in honest:
        for got, want in zip(r.averaged, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # whatever the attacker sent, the honest members' result stays within the rule's bound of their mean
    honest_mean = [(a * weights[0] + b * weights[1]) / (weights[0] + weights[1]) for a, b in zip(*payloads[:2])]
    for got, h, a, b in zip(honest[0].averaged, honest_mean, *payloads[:2]):
        spread = (a - b).abs()
        assert bool(((got - h).abs() <= (SETTINGS.clip + 1) * spread + 1e-6).all())
    attacker = str(group[2].peer_id)
    caught = [r.report.caught for r in honest]
    if attack == "none":
        assert caught == [{}, {}]
    elif attack == "nan":  # only the reducer of the piece that holds the NaN sees it
        assert any("NaN" in c.get(attacker, "") for c in caught), caught
        assert agg.nonfinite[2] > 0 and agg.nonfinite[:2] == (0.0, 0.0)
    else:  # a reducer sees the scaled or flipped payload on its span (hivemind may give a member none)
        assert any(attacker in c for c in caught), caught
        assert all(str(group[i].peer_id) not in c for c in caught for i in range(2)), caught


CODECS = ("fp16", "int8")  # (the first tensor's and the second's: rounds.payload_codecs picks them per role)


@pytest.fixture(scope="module")
def compressed_group():
    yield from _group("eu-compressed", codecs=CODECS)


@pytest.mark.parametrize("attack", ["none", "x1000", "nan"])
def test_compressed_round_gives_every_member_the_same_model_and_the_pure_codec_result(compressed_group, attack):
    """With lossy codecs every member still ends the round with the same tensors, bit for bit (each
    gets the reducer's encoded aggregate, not a delta to add to its own part), and that result is the
    pure round's (:func:`worldlm_p2p.rounds.group_average` with the codecs): exactly so for fp16,
    within two of the aggregate's 8-bit steps for int8 (the swarm scales each part on its own, the
    pure function the whole tensor). A NaN/Inf still reaches the rule as such."""
    from worldlm_p2p import compression

    g = torch.Generator().manual_seed(7)
    base = [torch.randn(300, 400, generator=g) * 0.05, torch.randn(70_000, generator=g) * 0.05]
    payloads = [[torch.randn(b.shape, generator=g) * 0.005 for b in base] for _ in range(3)]  # changes
    weights = [60.0, 80.0, 50.0]
    if attack == "x1000":
        payloads[2] = [t * 1000 for t in payloads[2]]
    elif attack == "nan":
        payloads[2][0][7, 9], payloads[2][1][123] = float("nan"), float("inf")
    results = _round(compressed_group, payloads, weights)
    honest = results[:2]
    assert all(r is not None and r.ok and r.group_size == 3 for r in honest), [r and r.error for r in honest]
    for got_a, got_b in zip(honest[0].averaged, honest[1].averaged):
        assert torch.equal(got_a, got_b)
    sent = [compression.roundtrip_all(p, CODECS) for p in payloads]
    expected, _ = robust.robust_mean_of_lists(sent, weights, rule=SETTINGS.rule, clip=SETTINGS.clip,
                                              max_weight=SETTINGS.max_weight)
    fp16_want = compression.roundtrip(expected[0], "fp16")
    torch.testing.assert_close(honest[0].averaged[0], fp16_want, rtol=0, atol=1e-3 * float(fp16_want.abs().max()))
    mismatch = float((honest[0].averaged[0] != fp16_want).float().mean())
    assert mismatch <= 1e-4  # (measured: 0; a summation order could flip a rounding at a half-way point)
    step = 6 * float(expected[1].std()) / 256
    inside = expected[1].abs() <= 2.5 * float(expected[1].std())  # (beyond, 8 bits saturate, as hivemind's)
    err = (honest[0].averaged[1] - expected[1]).abs()
    assert float(err[inside].max()) <= 2 * step, (float(err[inside].max()), step)
    if attack == "nan":
        attacker = str(compressed_group[2].peer_id)
        assert any("NaN" in r.report.caught.get(attacker, "") for r in honest), [r.report.caught for r in honest]


def test_each_reducer_keeps_what_every_sender_sent_and_a_served_change_is_held_to_it(compressed_group):
    """Backbone partners' spot check on real averagers: what each member's reducer kept of every other
    sender (:attr:`RoundReport.seen`) is that sender's payload as the codecs carried it, at those
    positions of the group's vector (exactly in fp16, within the 8-bit tolerance in int8), so
    :func:`worldlm_p2p.rounds.served_mismatch` passes the change the sender sent and fails another
    member's or a scaled one."""
    from worldlm_p2p import compression
    from worldlm_p2p.rounds import served_mismatch

    g = torch.Generator().manual_seed(11)
    base = [torch.randn(300, 400, generator=g) * 0.05, torch.randn(70_000, generator=g) * 0.05]
    payloads = [[torch.randn(b.shape, generator=g) * 0.005 for b in base] for _ in range(3)]
    results = _round(compressed_group, payloads, [60.0, 80.0, 50.0])
    assert all(r is not None and r.ok and r.group_size == 3 for r in results), [r and r.error for r in results]
    ids = [str(a.peer_id) for a in compressed_group]
    sent = [compression.roundtrip_all(p, CODECS) for p in payloads]
    n0 = payloads[0][0].numel()
    checked = set()
    for i, r in enumerate(results):
        assert ids[i] not in r.report.seen
        for peer, (pos, val) in r.report.seen.items():
            j = ids.index(peer)
            checked.add(j)
            flat = torch.cat([t.reshape(-1) for t in sent[j]])
            fp16 = pos < n0
            assert torch.equal(val[fp16], flat[pos[fp16]])
            assert pos.numel() >= 100 and len(set(pos.tolist())) == pos.numel()
            assert served_mismatch(sent[j], (pos, val), codecs=CODECS) == ""
            assert served_mismatch(sent[(j + 1) % 3], (pos, val), codecs=CODECS) != ""
            assert served_mismatch([3 * t for t in sent[j]], (pos, val), codecs=CODECS) != ""
    assert checked == {0, 1, 2}  # every sender was seen by some reducer


def test_a_served_change_is_held_to_the_rounds_average_and_the_reducers_sample(group):
    """Backbone partners over real averagers (float32): each member serves a change
    (:meth:`RegionAverager.set_contribution`), one of them not the one it sends into the round (1%
    larger). A member that downloads every mate's (:meth:`download_contribution_from`) finds that the
    honest changes give the round's average under the run's rule
    (:func:`worldlm_p2p.rounds.served_average_mismatch`) and the liar's do not; and a reducer that
    holds a sample of the liar's parts finds them different (:func:`worldlm_p2p.rounds.served_mismatch`)."""
    from worldlm_p2p.rounds import RoundRule, served_average_mismatch, served_mismatch
    from worldlm_p2p.split import split_parameters

    rule = RoundRule.of(split_parameters(["a", "b"], "b"), robust=SETTINGS.rule, robust_clip=SETTINGS.clip)
    payloads = _payloads(3, seed=21)
    weights = [60.0, 80.0, 50.0]
    lie = [t * 1.01 for t in payloads[2]]
    for a, served in zip(group, [payloads[0], payloads[1], lie]):
        assert a.set_contribution(round_index=1, anchor="d", tensors=served)
    results = _round(group, payloads, weights)
    assert all(r is not None and r.ok and r.group_size == 3 for r in results), [r and r.error for r in results]
    ids = [str(a.peer_id) for a in group]
    got = {}
    for j in (1, 2):
        meta, tensors = group[0].download_contribution_from(ids[j], timeout=15.0)
        assert meta == {"round": 1, "anchor": "d"}
        got[j] = tensors
    assert all(torch.equal(a, b) for a, b in zip(got[1], payloads[1]))
    codecs = ["none", "none"]
    check = dict(averaged=results[0].averaged, codecs=codecs, max_weight=SETTINGS.max_weight)
    assert served_average_mismatch(rule, [payloads[0], got[1], payloads[2]], weights, **check) == ""
    assert served_average_mismatch(rule, [payloads[0], got[1], got[2]], weights, **check) != ""
    # the honest members' reducers that hold a sample of the liar's parts (hivemind may give one no span)
    verdicts = [served_mismatch(lie, r.report.seen[ids[2]], codecs=codecs) for r in results[:2] if ids[2] in r.report.seen]
    assert verdicts and all(v for v in verdicts), verdicts
    assert all(served_mismatch(payloads[1], r.report.seen[ids[1]], codecs=codecs) == ""
               for r in (results[0], results[2]) if ids[1] in r.report.seen)
