#!/usr/bin/env python
"""The swarm across a simulated internet: public hosts, and volunteers behind two home NAT routers.

Real ``worldlm-bootstrap`` and ``worldlm-peer`` processes, started with the README's commands
(``--host-maddrs /ip4/0.0.0.0/tcp/PORT``, the bootstrap node's ``--announce-maddrs``), each in its
own Linux network namespace of :mod:`netns_internet` (a bridge for the internet, two routers that
masquerade their LAN and drop unsolicited inbound packets). Scenarios:

- ``public``: two public peers in region eu, one in na (the baseline);
- ``nat``: one public and two NATed peers in eu (behind two different routers), one public peer in na
  (a region of one, which must still take part in world rounds);
- ``forward``: as ``nat``, but the first home router forwards the peer's port and the peer
  announces its public address (``--announce-maddrs``), so that it is directly reachable;
- ``natonly``: region eu holds only the two NATed peers (nobody can reduce their rounds: each trains
  alone), one public peer in na;
- ``relayed``: as ``natonly``, with the bootstrap node started with ``--relay``: it reduces eu's
  rounds (:mod:`worldlm_p2p.peer.relay`).

Reported per scenario: region round time (median, p90) over the rounds that averaged, the share of
region-round attempts that were complete (every member that waited was in the group and no part
was dropped), the time from start to the first averaged round, world rounds, what each peer's
reachability check found, and **bytes on the wire** per peer: the kernel's counters of the
peer's namespace interface (everything its processes, p2pd included, sent and received, headers
included), what the peer measured itself (``wire_sent + wire_received`` of its summary: the TCP
counters of its own processes' sockets, :mod:`worldlm_p2p.net.wire`), and the analytic estimate
it reports (``bytes_sent + bytes_received``: the all-reduce payloads only).

    sudo python benchmarks/internet.py [--scenarios public nat forward] [--steps 60] [--out benchmarks/out/internet.json]

Needs root, iproute2 and iptables; asserts nothing; prints a Markdown table. The netns test
(``tests/network/test_internet.py``) runs :func:`run_scenario` too.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_run import fast_run, peer_env, read_events, stop_all  # noqa: E402
from netns_internet import Internet, unavailable  # noqa: E402

DEMO = REPO / "worldlm_p2p" / "demo_data"
PORT = 31338  # every peer listens on this port of its own host (the README's example)
BOOT_PORT = 31337

# host, region, demo sub-corpus
SCENARIOS: dict[str, list[tuple[str, str, str]]] = {
    "public": [("pub1", "eu", "eu/fi_mixed"), ("pub2", "eu", "eu/de_news-reviews-wiki"), ("late", "na", "na/en_email")],
    "nat": [("pub1", "eu", "eu/fi_mixed"), ("home1", "eu", "eu/de_news-reviews-wiki"), ("home2", "eu", "eu/nl_news"),
            ("pub2", "na", "na/en_email")],
    "forward": [("pub1", "eu", "eu/fi_mixed"), ("home1", "eu", "eu/de_news-reviews-wiki"),
                ("home2", "eu", "eu/nl_news"), ("pub2", "na", "na/en_email")],
    "natonly": [("home1", "eu", "eu/de_news-reviews-wiki"), ("home2", "eu", "eu/nl_news"), ("pub2", "na", "na/en_email")],
    "relayed": [("home1", "eu", "eu/de_news-reviews-wiki"), ("home2", "eu", "eu/nl_news"), ("pub2", "na", "na/en_email")],
}
FORWARDED = {"forward": ["home1"]}  # hosts whose router forwards PORT to them (and that announce it)
RELAYED = {"relayed"}  # scenarios whose bootstrap node relays (worldlm-bootstrap --relay)


def manifest(run_id: str, compress: str | None = None) -> str:
    """The loopback benchmarks' manifest with a longer matchmaking window: on a 2-core machine five
    processes share the cores, and a member that is late by a second would miss the group.
    ``compress``: the region rounds' wire codec for both roles (None: the product's default)."""
    aggregation = f'compress_backbone = "{compress}"\ncompress_key = "{compress}"' if compress else ""
    return fast_run(run_id=run_id, inner_steps=5, barrier_timeout=30.0, eval_tokens=2048,
                    averaging="", aggregation=aggregation).replace("matchmaking_time = 1.5", "matchmaking_time = 3.0")


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def iface_bytes(net: Internet, host: str) -> tuple[int, int]:
    """(sent, received) bytes of the host's eth0, from the kernel's counters of its namespace."""
    out = net.run(net.ns(host), "ip", "-s", "-j", "link", "show", "eth0").stdout
    stats = json.loads(out)[0]["stats64"]
    return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])


events = read_events


def _copy(stream, path: Path) -> None:
    with open(path, "ab", buffering=0) as f:
        for raw in iter(stream.readline, b""):
            f.write(raw)


def _wait_training(workdir: Path, hosts: list[str], *, deadline: float) -> None:
    while time.monotonic() < deadline:
        if all(any(e.get("event") == "training" for e in events(workdir / f"{h}.events")) for h in hosts):
            return
        time.sleep(0.5)


def run_scenario(net: Internet, name: str, workdir: Path, *, steps: int, trace: bool = False,
                 timeout: float = 600.0, compress: str | None = None) -> dict:
    """Start the bootstrap node and the scenario's peers, wait until every peer finished (at most
    ``timeout`` seconds), stop everything, and return what happened (see the module docstring).
    ``trace``: the peers write their round traces to ``workdir/trace`` (the test compares them with
    the pure round function)."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "run.toml").write_text(manifest(f"inet-{name}", compress))
    peers = SCENARIOS[name]
    sizes = {region: sum(1 for _, r, _ in peers if r == region) for _, region, _ in peers}
    for host in FORWARDED.get(name, []):
        net.forward_port(net.router_of(host), PORT)
    procs: list[subprocess.Popen] = []
    env = peer_env()
    before = {host: iface_bytes(net, host) for host, _, _ in peers + [("boot", "", "")]}
    t0 = time.monotonic()
    try:
        boot = net.popen("boot", [_bin("worldlm-bootstrap"), "--run-config", str(workdir / "run.toml"),
                                  "--host-maddrs", f"/ip4/0.0.0.0/tcp/{BOOT_PORT}",
                                  "--announce-maddrs", f"/ip4/{net.address('boot')}/tcp/{BOOT_PORT}",
                                  "--identity", str(workdir / "bootstrap.id")] + (["--relay"] if name in RELAYED else []),
                         stdout=subprocess.PIPE, stderr=open(workdir / "bootstrap.err", "wb"), env=env,
                         start_new_session=True)
        procs.append(boot)
        line = boot.stdout.readline().decode()
        maddrs = [t for t in line.split() if "/p2p/" in t]
        if not maddrs:
            raise RuntimeError(f"the bootstrap node printed {line!r}; see {workdir / 'bootstrap.err'}")
        # its log (after the first line) goes on on stdout: into the log file, never a full pipe
        threading.Thread(target=_copy, args=(boot.stdout, workdir / "bootstrap.log"), daemon=True).start()
        started = {}
        for i, (host, region, sub) in enumerate(peers):
            if i and region != peers[i - 1][1]:
                # a region's peers start once the previous region trains (its peers wait for each
                # other first), so that the regions train at the same time and hold world rounds
                _wait_training(workdir, [h for h, _, _ in peers[:i]], deadline=time.monotonic() + 180)
            # a region of one trains without waiting for anyone (ten times the others' pace on this
            # machine): 4 times the steps let it live through the other regions' run and world rounds
            own_steps = steps * 4 if sizes[region] == 1 and len(sizes) > 1 else steps
            argv = [_bin("worldlm-peer"), "--region", region, "--initial-peers", *maddrs, "--data", str(DEMO / sub),
                    "--host-maddrs", f"/ip4/0.0.0.0/tcp/{PORT}", "--label", host, "--max-steps", str(own_steps),
                    "--threads", "1", "--wait-for-peers", str(sizes[region]),
                    "--summary", str(workdir / f"{host}.json"), "--events", str(workdir / f"{host}.events")]
            if host in FORWARDED.get(name, []):
                argv += ["--announce-maddrs", f"/ip4/{net.public_address(host)}/tcp/{PORT}"]
            if trace:
                argv += ["--trace-dir", str(workdir / "trace")]
            procs.append(net.popen(host, argv, stdout=open(workdir / f"{host}.log", "wb"), stderr=subprocess.STDOUT,
                                   env=env, start_new_session=True))
            started[host] = time.monotonic()
        codes = {}
        deadline = t0 + timeout
        for (host, _, _), p in zip(peers, procs[1:]):
            try:
                codes[host] = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[host] = None
        elapsed = time.monotonic() - t0
        after = {host: iface_bytes(net, host) for host, _, _ in peers + [("boot", "", "")]}
    finally:
        stop_all(procs, grace=15.0)
    out = dict(scenario=name, steps=steps, seconds=round(elapsed, 1), peers={},
               # the bootstrap host's interface: DHT traffic, and with --relay every relayed round
               bootstrap=dict(wire_sent=after["boot"][0] - before["boot"][0],
                              wire_received=after["boot"][1] - before["boot"][1]))
    for host, region, _ in peers:
        try:
            s = json.loads((workdir / f"{host}.json").read_text())
        except (OSError, ValueError):
            s = {}
        ev = events(workdir / f"{host}.events")
        rounds = [e for e in ev if e.get("event") == "round" and e.get("outcome") not in ("alone", "stopped")]
        reach = next((e for e in ev if e.get("event") == "reachability"), {})
        sent, received = (after[host][0] - before[host][0], after[host][1] - before[host][1])
        out["peers"][host] = dict(
            region=region, exit=codes.get(host), reachability=s.get("reachability"), check=reach.get("status"),
            attempts=len(rounds), complete=sum(1 for e in rounds if e.get("outcome") == "averaged"),
            partial=sum(1 for e in rounds if e.get("outcome") == "partial"),
            failed=sum(1 for e in rounds if e.get("outcome") == "failed"),
            alone=sum(1 for e in ev if e.get("event") == "round" and e.get("outcome") == "alone"),
            round_seconds=[e["seconds"] for e in rounds if e.get("outcome") in ("averaged", "partial")],
            group_sizes=s.get("group_sizes", []), seconds_to_first_round=s.get("seconds_to_first_round"),
            world_rounds_led=s.get("world_rounds_led", 0), world_rounds_adopted=s.get("world_rounds_adopted", 0),
            wire_sent=sent, wire_received=received,
            measured_sent=s.get("wire_sent", -1), measured_received=s.get("wire_received", -1),
            estimate=int(s.get("bytes_sent", 0)) + int(s.get("bytes_received", 0)) + int(s.get("bytes_sent_border", 0)),
            tokens=s.get("tokens", 0), valid_loss=s.get("valid_loss"))
    return out


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


def table(results: list[dict]) -> str:
    lines = ["| scenario | peer | region | reachability (check) | round s, median / p90 | complete / attempts "
             "| partial | failed | first round s | world led / adopted | interface MB sent + received "
             "| peer-measured MB | estimate MB | interface / estimate |",
             "|---|---|---|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    for res in results:
        for host, p in res["peers"].items():
            med, p90 = _pct(p["round_seconds"], 0.5), _pct(p["round_seconds"], 0.9)
            wire = p["wire_sent"] + p["wire_received"]
            ratio = f"{wire / p['estimate']:.2f}x" if p["estimate"] else "-"
            first = p["seconds_to_first_round"]
            measured = (f"{(p['measured_sent'] + p['measured_received']) / 1e6:.2f}"
                        if p.get("measured_sent", -1) >= 0 else "-")
            lines.append(
                f"| {res['scenario']} | {host} | {p['region']} | {p['reachability']} ({p['check']}) | "
                + (f"{med:.2f} / {p90:.2f}" if med is not None else "-")
                + f" | {p['complete']} / {p['attempts']} | {p['partial']} | {p['failed']} | "
                + (f"{first:.1f}" if first is not None else "-")
                + f" | {p['world_rounds_led']} / {p['world_rounds_adopted']} | {p['wire_sent'] / 1e6:.2f} + "
                f"{p['wire_received'] / 1e6:.2f} | {measured} | {p['estimate'] / 1e6:.2f} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--steps", type=int, default=60, help="local steps per peer (H = 5: steps / 5 region rounds)")
    ap.add_argument("--compress", choices=["none", "fp16", "int8"], default=None,
                    help="the region rounds' wire codec, backbone and key layers (default: the manifest default)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "internet.json")
    args = ap.parse_args()
    why = unavailable()
    if why:
        sys.exit(f"internet.py: {why}")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="worldlm-internet-"))
    results = []
    for name in args.scenarios:
        with Internet() as net:
            res = run_scenario(net, name, workdir / name, steps=args.steps, compress=args.compress)
        results.append(res)
        b = res["bootstrap"]
        print(f"{name}: {res['seconds']} s; bootstrap host interface {b['wire_sent'] / 1e6:.2f} MB sent + "
              f"{b['wire_received'] / 1e6:.2f} MB received", file=sys.stderr, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), steps=args.steps,
                                        results=results), indent=1))
    print(table(results))
    print(f"\n(raw: {args.out}; logs: {workdir})")


if __name__ == "__main__":
    main()
