"""worldlm-monitor: the pure snapshot, its rendering and its CLI errors. The monitor against a live
swarm (peers and leaders listed, a killed peer gone after its record expires) is tested in
test_swarm_world.py, on that test's swarm."""

import json
import math

import pytest
from rich.console import Console

from worldlm_p2p.display import monitor_view, sparkline
from worldlm_p2p.net.monitor import build_snapshot, short_id
from worldlm_p2p.net.records import LeaseRecord, ProgressRecord


def _rec(label, region, *, peer_id=None, step=10, tokens=1000, loss=2.0, tps=100.0, t=100.0, finished=False,
         round=2, world_round=-1, trend=(), epsilon=-1.0, fingerprint="f", bytes_sent=10, mix=(-1.0, -1.0),
         border=(-1.0, -1)):
    return ProgressRecord(region=region, peer_id=peer_id or f"Qm{label}", label=label, step=step, tokens=tokens,
                          train_loss=loss, tokens_per_s=tps, rounds_completed=round, last_group_size=2,
                          bytes_sent=bytes_sent, bytes_received=5, round=round, waiting_for_round=-1,
                          fingerprint=fingerprint, time=t, finished=finished, world_round=world_round,
                          loss_trend=tuple(trend), epsilon=epsilon, mix_region=mix[0], mix_world=mix[1],
                          border_epsilon=border[0], border_releases=border[1])


def _lease(peer_id, region, since, expires, fingerprint="f"):
    return LeaseRecord(region=region, peer_id=peer_id, since=since, expires=expires, fingerprint=fingerprint)


def test_snapshot_by_hand():
    progress = [
        _rec("eu-a", "eu", step=20, tokens=2000, loss=2.0, tps=100.0, t=98.0, round=4, world_round=1,
             trend=(3.0, 2.5, 2.0), bytes_sent=100),
        _rec("eu-a", "eu", step=10, tokens=1000, loss=2.9, t=90.0),  # an older record of the same peer
        _rec("eu-b", "eu", step=15, tokens=1500, loss=3.0, tps=50.0, t=99.5, round=3, trend=(2.8, 3.0),
             epsilon=1.5, bytes_sent=200),
        _rec("na-a", "na", step=5, tokens=500, loss=4.0, tps=40.0, t=95.0, finished=True, round=1, bytes_sent=300),
    ]
    leases = [_lease("Qmeu-b", "eu", since=1.0, expires=50.0),  # expired at DHT time 60: not the leader
              _lease("Qmeu-a", "eu", since=2.0, expires=70.0),
              _lease("Qmzz", "na", since=1.0, expires=70.0, fingerprint="other")]  # another manifest's lease
    snap = build_snapshot(progress, leases, run_id="r", now=100.0, dht_now=60.0)
    eu, na = snap["regions"]["eu"], snap["regions"]["na"]
    assert list(snap["regions"]) == ["eu", "na"]
    assert [p["label"] for p in eu["peers"]] == ["eu-a", "eu-b"]
    assert eu["leader"] == "Qmeu-a" and eu["leader_label"] == "eu-a"
    assert [p["leader"] for p in eu["peers"]] == [True, False]
    a = eu["peers"][0]
    assert (a["step"], a["tokens"], a["train_loss"], a["seconds_since_heard"]) == (20, 2000, 2.0, 2.0)
    assert (eu["region_round"], eu["world_round"], eu["peers_online"], eu["tokens"]) == (4, 1, 2, 3500)
    assert eu["tokens_per_s"] == 150.0 and eu["train_loss"] == 2.5
    # trends aligned at their newest points: [3.0, (2.5+2.8)/2, (2.0+3.0)/2]
    assert eu["loss_trend"] == pytest.approx([3.0, 2.65, 2.5])
    assert eu["epsilon"] == 1.5 and a["epsilon"] is None and eu["peers"][1]["epsilon"] == 1.5
    # without a manifest every fingerprint counts, so na's lease of "other" elects Qmzz
    assert na["leader"] == "Qmzz" and na["leader_label"] is None
    assert na["peers_online"] == 0 and na["tokens_per_s"] == 0.0 and na["peers"][0]["status"] == "finished"
    assert snap["totals"] == dict(regions=2, peers=3, peers_online=2, tokens=4000, tokens_per_s=150.0, bytes_sent=600,
                                  wire_sent=None)  # (no peer measured its bytes on the wire)
    json.dumps(snap)  # JSON-able as is
    # measured bytes on the wire: summed over the peers that measured them, next to the estimate
    import dataclasses

    measured = [dataclasses.replace(_rec("eu-a", "eu"), wire_sent=1500, wire_received=1400, reachability="outbound",
                                    rounds_partial=1), _rec("eu-b", "eu")]
    snap = build_snapshot(measured, [], run_id="r", now=100.0, dht_now=100.0)
    a, b = snap["regions"]["eu"]["peers"]
    assert (a["wire_sent"], a["wire_received"], b["wire_sent"]) == (1500, 1400, None)
    assert a["reachability"] == "outbound" and b["reachability"] is None and a["rounds_partial"] == 1
    assert snap["totals"]["wire_sent"] == 1500 and snap["totals"]["bytes_sent"] == 20
    assert short_id("12D3KooWabcdef123456") == "…123456"


def test_snapshot_with_manifest_drops_other_runs():
    from worldlm_p2p.config import RunManifest

    m = RunManifest.from_dict({"run_id": "r"})
    fp = m.fingerprint()
    progress = [_rec("eu-a", "eu", fingerprint=fp), _rec("eu-old", "eu", fingerprint="stale")]
    leases = [_lease("Qmeu-old", "eu", 1.0, 99.0, fingerprint="stale"), _lease("Qmeu-a", "eu", 2.0, 99.0, fingerprint=fp)]
    snap = build_snapshot(progress, leases, run_id="r", now=100.0, dht_now=60.0, manifest=m)
    assert [p["label"] for p in snap["regions"]["eu"]["peers"]] == ["eu-a"]
    assert snap["regions"]["eu"]["leader"] == "Qmeu-a"
    assert snap["manifest"]["strategy"] == m.aggregation.strategy and snap["manifest"]["fingerprint"] == fp


def test_snapshot_border_account_is_the_best_informed_peers():
    # the leader knows of 3 releases, a member that adopted the region's state earlier of 2, a
    # member of another region has border DP off
    progress = [_rec("eu-a", "eu", border=(1.75, 3)), _rec("eu-b", "eu", border=(1.25, 2)), _rec("na-a", "na")]
    snap = build_snapshot(progress, [], run_id="r", now=100.0, dht_now=60.0)
    eu, na = snap["regions"]["eu"], snap["regions"]["na"]
    assert (eu["border_epsilon"], eu["border_releases"]) == (1.75, 3)
    assert [(p["border_epsilon"], p["border_releases"]) for p in eu["peers"]] == [(1.75, 3), (1.25, 2)]
    assert (na["border_epsilon"], na["border_releases"]) == (None, None) and na["peers"][0]["border_releases"] is None
    console = Console(record=True, width=150)
    console.print(monitor_view(snap))
    assert "border ε 1.75 (3 releases)" in console.export_text()
    # on the wire a release count without an epsilon (border DP off) is dropped
    off = ProgressRecord.from_wire(_rec("x", "eu", border=(-1.0, 4)).to_wire())
    assert (off.border_epsilon, off.border_releases) == (-1.0, -1)


def test_sparkline():
    assert sparkline([]) == ""
    assert sparkline([1.0, 1.0]) == "▄▄"
    assert sparkline([3.0, 2.0, 1.0]) == "█▅▁"
    assert sparkline([1.0, math.nan, 2.0]) == "▁█"


def test_monitor_view_renders_regions_leaders_totals_and_epsilon():
    progress = [_rec("eu-a", "eu", trend=(3.0, 2.0), round=4, world_round=1, mix=(0.0625, 0.25)),
                _rec("eu-b", "eu", epsilon=2.25, mix=(0.0, -1.0)), _rec("na-a", "na", tokens=500)]
    snap = build_snapshot(progress, [_lease("Qmeu-a", "eu", 1.0, 99.0)], run_id="demo", now=101.0, dht_now=60.0)
    console = Console(record=True, width=150)
    console.print(monitor_view(snap))
    text = console.export_text()
    for needle in ("WorldLM swarm · run demo", "leader eu-a (Qmeu-a)", "region round 4", "world round 1",
                   "★ eu-a", "eu-b", "na-a", "leader none", "ε 2.25", "2.25", "3 peers online in 2 regions",
                   "2,500 tokens trained", "-33%", "1s ", "took r/w", "0.06/0.25", "0.00/-"):
        assert needle in text, f"{needle!r} not in\n{text}"
    assert snap["regions"]["eu"]["peers"][0]["mix_region"] == 0.0625 and snap["regions"]["na"]["peers"][0]["mix_world"] is None
    assert "took r/w" not in text.split("na  leader")[1]  # a region without evidence mixing has no such column
    empty = build_snapshot([], [], run_id="demo", now=1.0, dht_now=1.0)
    console = Console(record=True, width=150)
    console.print(monitor_view(empty))
    assert "no peer of this run is online" in console.export_text()


def test_snapshot_and_view_name_the_relays_of_each_region():
    from worldlm_p2p.net.keys import ALL_REGIONS
    from worldlm_p2p.net.records import RelayRecord

    progress = [_rec("eu-a", "eu"), _rec("eu-b", "eu"), _rec("na-a", "na")]
    relays = [RelayRecord(peer_id="QmRelayOne111", fingerprint="f", regions=("eu",), endorsement={}, time=1.0),
              RelayRecord(peer_id="QmRelayAll222", fingerprint="f", regions=(ALL_REGIONS,), endorsement={}, time=1.0)]
    snap = build_snapshot(progress, [], run_id="r", now=100.0, dht_now=60.0, relays=relays)
    assert snap["regions"]["eu"]["relays"] == ["…All222", "…One111"]
    assert snap["regions"]["na"]["relays"] == ["…All222"]
    assert build_snapshot(progress, [], run_id="r", now=100.0, dht_now=60.0)["regions"]["eu"]["relays"] == []
    console = Console(record=True, width=150)
    console.print(monitor_view(snap))
    assert "relayed by …All222, …One111" in console.export_text()


def test_monitor_bad_input_is_one_line(capsys):
    from worldlm_p2p.cli.monitor import main

    for args in (["--initial-peers", "not-a-maddr", "--once"], ["--initial-peers", "/ip4/127.0.0.1/tcp/1", "--once"],
                 ["--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmaqJesiNcZak8Ns1727tE9RGyDzXE1w7qZxtnr2hcVipv",
                  "--run-id", "bad id!"],
                 ["--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmaqJesiNcZak8Ns1727tE9RGyDzXE1w7qZxtnr2hcVipv",
                  "--interval", "0"]):
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 2, args
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("worldlm-monitor: error:"), lines


def test_a_record_that_copies_another_peers_id_and_label_is_not_shown():
    """Issue 12's row: a record that copied another peer's id and label made the monitor show the
    forged step, loss and status. Only records signed by the key of the peer id they claim count."""
    from worldlm_p2p.net.monitor import own_records

    honest = _rec("eu-a", "eu", step=20, loss=2.0, t=99.0).signed_by("Qmeu-a")
    forged = _rec("eu-a", "eu", step=10 ** 9, loss=0.01, t=99.9, finished=True).signed_by("Qmmallory")
    unsigned = _rec("eu-b", "eu", step=5).signed_by(None)
    lease = _lease("Qmeu-a", "eu", 1.0, 99.0).signed_by("Qmeu-a")
    forged_lease = _lease("Qmeu-a", "eu", 0.0, 99.0).signed_by("Qmmallory")
    assert own_records([honest, forged, unsigned]) == [honest]
    assert own_records([lease, forged_lease]) == [lease]
    snap = build_snapshot(own_records([honest, forged, unsigned]), own_records([lease, forged_lease]), run_id="r",
                          now=100.0, dht_now=60.0)
    (a,) = snap["regions"]["eu"]["peers"]
    assert (a["step"], a["train_loss"], a["status"] != "finished") == (20, 2.0, True)
