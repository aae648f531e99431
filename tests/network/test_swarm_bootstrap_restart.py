"""A bootstrap node restarted mid-run (same identity, same address) rejoins the swarm it served:
it remembered the peers it was connected to and dials those that answer; and without that memory
(a node rebuilt from its identity alone) the running peers re-dial it. Before, it started a
second, empty swarm: a newcomer through it trained alone, and the monitor through it saw no peer
(issue 13)."""

import json
import signal
import socket

import pytest
from swarm_utils import ProgressReader, fast_run, log_tail, start_peer, traces, wait_for

pytestmark = [pytest.mark.network, pytest.mark.slow]  # several peer processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bootstrap(procs, tmp, port: int, n: int):
    p = procs.start(["worldlm_p2p.cli.bootstrap", "--run-config", str(tmp / "run.toml"), "--identity",
                     str(tmp / "boot.id"), "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}"],
                    log=tmp / "logs" / f"bootstrap-{n}.log")
    wait_for(lambda: "/p2p/" in (tmp / "logs" / f"bootstrap-{n}.log").read_text(errors="replace"), 60,
             "the bootstrap's multiaddrs")
    line = next(x for x in (tmp / "logs" / f"bootstrap-{n}.log").read_text().splitlines() if "/p2p/" in x)
    return p, [t for t in line.split() if "/p2p/" in t]


# CI runs the restart without the memory (the peers' re-dial alone must heal the swarm); with the memory
# both mechanisms work at once, and tests/unit/test_bootstrap_memory.py checks the memory in CI
@pytest.mark.parametrize("memory", [pytest.param(True, marks=pytest.mark.extended), False],
                         ids=["remembers-peers", "peers-redial"])
def test_a_restarted_bootstrap_rejoins_its_swarm_and_newcomers_through_it_average(procs, tmp_path, memory):
    (tmp_path / "logs").mkdir()
    (tmp_path / "run.toml").write_text(fast_run("rejoin", inner_steps=5))
    port = _free_port()
    boot, maddrs = _bootstrap(procs, tmp_path, port, 0)
    many, half = 100_000, ["--slowdown", "2"]  # peers run until stopped, at half speed (they wait on events)
    a = start_peer(procs, tmp_path, maddrs, region="eu", sub="de_news-reviews-wiki", label="a",
                   max_steps=many, extra=half)
    b = start_peer(procs, tmp_path, maddrs, region="eu", sub="es_blog-news-reviews-wiki", label="b",
                   max_steps=many, extra=half)
    wait_for(lambda: any(t["ok"] for t in traces(tmp_path, "a").values()), 180, "a first round of a and b")
    peers_file = tmp_path / "boot.id.peers.json"
    wait_for(lambda: peers_file.exists() and len(json.loads(peers_file.read_text())["peers"]) >= 2, 60,
             "the bootstrap to remember a and b")

    boot.send_signal(signal.SIGTERM)
    assert boot.wait(timeout=30) == 0, log_tail(tmp_path, "bootstrap-0")
    if not memory:
        peers_file.unlink()
    boot, again = _bootstrap(procs, tmp_path, port, 1)
    assert again == maddrs  # same identity and address: the peers' --initial-peers still name it
    assert ("rejoining" in (tmp_path / "logs" / "bootstrap-1.log").read_text()) == memory

    # the monitor through the restarted node lists the running peers
    reader = ProgressReader(maddrs, "rejoin")
    try:
        wait_for(lambda: {"a", "b"} <= set(reader.by_label()), 60, "the running peers, through the restarted node")
    finally:
        reader.close()
    if not memory:  # (they re-dial every 15 s)
        assert any("reconnected to bootstrap node" in (tmp_path / "logs" / f"{x}.log").read_text() for x in "ab")
    # a newcomer through it averages with the running peers
    c = start_peer(procs, tmp_path, maddrs, region="eu", sub="nl_news", label="c", max_steps=many, extra=half)
    wait_for(lambda: any(t["ok"] and {"a", "b"} & {g["label"] for g in t["gathered"].values()}
                         for t in traces(tmp_path, "c").values()), 120,
             "a round of the newcomer with the running peers")
    for p in (a, b, c):
        p.send_signal(signal.SIGTERM)
    for p, label in ((a, "a"), (b, "b"), (c, "c")):
        assert p.wait(timeout=60) == 0, log_tail(tmp_path, label)
