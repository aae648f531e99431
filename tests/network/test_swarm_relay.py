"""A region whose members are all outbound-only averages through the bootstrap node's relay.

Two peers run ``--reachability outbound`` (a volunteer behind NAT without a port forward: a DHT
client whose averager is in hivemind's client mode); nobody else is in their region. Without a relay
each would train alone. ``worldlm-bootstrap --relay`` joins their rounds as hivemind's auxiliary
member: it reduces the whole vector and sends nothing of its own, so every round must equal the pure
round function of the two members, and neither counts the relay as a member. The simulated internet
(``tests/network/test_internet.py``) runs the same through real NAT routers.
"""

from __future__ import annotations

import time

import pytest

from swarm_utils import (exit_ok, admit, group_of, log_tail, max_abs_diff, round_diagnosis, round_error, start_bootstrap,
                         start_peer, summary, traces, wait_for)

pytestmark = [pytest.mark.network, pytest.mark.slow]  # several peer processes each



# in CI: the admitting region, which takes the same relay and checks its endorsement as well
@pytest.mark.parametrize("region", [pytest.param("open", marks=pytest.mark.extended), "admitting"])
def test_outbound_only_region_averages_through_the_relay(procs, tmp_path, region):
    # "admitting": eu admits only peers with a certificate of its key; the relay has none, and is
    # taken because the run key endorses it (the members add it to the peers they average with)
    table, flags = admit(tmp_path, run_id="relay", region="eu", labels=["eu-a", "eu-b"]) \
        if region == "admitting" else ("", {"eu-a": [], "eu-b": []})
    boot, maddrs = start_bootstrap(procs, tmp_path, run_id="relay", inner_steps=5, extra=["--relay"], tables=table)
    rogue_id = None
    if region == "admitting":
        # a rogue relay: a genuine bootstrap node of the same manifest with --relay, but signing with a
        # key that is not the run's; the members must ignore it and their rounds must not suffer
        rogue = procs.start(["worldlm_p2p.cli.bootstrap", "--run-config", str(tmp_path / "run.toml"), "--host-maddrs",
                             "/ip4/127.0.0.1/tcp/0", "--initial-peers", *maddrs, "--run-key",
                             str(tmp_path / "rogue.key"), "--relay"], log=tmp_path / "logs" / "rogue.log")
        wait_for(lambda: "is serving" in (tmp_path / "logs" / "rogue.log").read_text(errors="replace"), 120,
                 "the rogue relay to serve")
        rogue_id = (tmp_path / "logs" / "rogue.log").read_text().split("bootstrap node ", 1)[1].split()[0]
    # both wait for each other before training, and train as devices 4x slower than this CPU (by
    # sleeping: rounds get wall time), so that the relay has seen them and offered itself before their
    # first round
    out = ["--reachability", "outbound", "--wait-for-peers", "2", "--slowdown", "4"]
    a = start_peer(procs, tmp_path, maddrs, region="eu", sub="de_news-reviews-wiki", label="eu-a", max_steps=40,
                   extra=out + flags["eu-a"])
    b = start_peer(procs, tmp_path, maddrs, region="eu", sub="es_blog-news-reviews-wiki", label="eu-b", max_steps=40,
                   extra=out + flags["eu-b"])
    # the monitor, through the bootstrap node, names the relay of eu
    from worldlm_p2p.net.monitor import SwarmMonitor, short_id

    seen: list = []
    monitor = SwarmMonitor(initial_peers=maddrs, run_id="relay")
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not seen and (a.poll() is None or b.poll() is None):
            seen = monitor.snapshot()["regions"].get("eu", {}).get("relays", [])
            time.sleep(0.5)
    finally:
        monitor.close()
    for p, label in ((a, "eu-a"), (b, "eu-b")):
        exit_ok(p, tmp_path, label)
    boot_id = maddrs[0].rsplit("/p2p/", 1)[1]
    assert seen == [short_id(boot_id)], seen
    sa, sb = summary(tmp_path, "eu-a"), summary(tmp_path, "eu-b")
    assert sa["reachability"] == sb["reachability"] == "outbound"
    # the relay is not a member: groups of the two peers
    assert sa["rounds_completed"] >= 2 and set(sa["group_sizes"]) == {2}, (sa, log_tail(tmp_path, "bootstrap"))
    assert sb["rounds_completed"] >= 2 and set(sb["group_sizes"]) == {2}, sb
    if rogue_id is not None:
        for label in ("eu-a", "eu-b"):
            log = (tmp_path / "logs" / f"{label}.log").read_text(errors="replace")
            assert f"ignoring relay {rogue_id}" in log and "run key" in log, log_tail(tmp_path, label, 40)
    boot_log = (tmp_path / "logs" / "bootstrap.log").read_text(errors="replace")
    assert "every live member of eu is outbound-only" in boot_log and "round" in boot_log, boot_log[-2000:]

    ta = traces(tmp_path, "eu-a")
    rounds = sorted(r for r, t in ta.items() if t["ok"])
    exact = 0
    for r in rounds:
        group = group_of(tmp_path, "eu-a", r)
        assert {t["label"] for t in group} == {"eu-a", "eu-b"}
        assert max_abs_diff(group[0]["pre"], group[1]["pre"]) > 1e-4  # they trained apart
        anchors_apart = max_abs_diff(group[0]["anchor"], group[1]["anchor"])
        err = round_error(group)
        assert err < 0.05 and anchors_apart < 0.05, (r, err, anchors_apart, round_diagnosis(group))
        exact += err < 1e-5 and anchors_apart < 1e-6
    assert exact >= 2, f"only {exact} of {len(rounds)} rounds equal the pure round"
