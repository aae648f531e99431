#!/usr/bin/env python
"""The swarm without its bootstrap node: a region trains on for ``--gone-minutes`` (default 10)
after its only bootstrap node is killed, then a newcomer joins through a running peer's address
and the monitor watches the swarm through that peer.

Real ``worldlm-bootstrap``, ``worldlm-peer`` and ``worldlm-monitor`` processes on 127.0.0.1 (the
README's commands; the loopback manifest of ``fast_run.py``). Two peers of region ``eu`` train and
average; the bootstrap node gets SIGKILL (its own copy of the run manifest expires with it, in
``records.PEER_MANIFEST_TTL`` seconds at most); after the outage a third ``eu`` peer starts with
``--initial-peers`` set to what the first peer printed ("others can join through this peer").

Reported: the region rounds the two peers averaged during the outage, whether the newcomer found
the run's signed manifest (the run key it names is the bootstrap's), the seconds from its start to
its first round averaged with both running peers, and the peers ``worldlm-monitor --once --json``
lists through the first peer.

    python benchmarks/bootstrap_outage.py [--gone-minutes 10] [--out benchmarks/out/bootstrap_outage.json]

Asserts nothing; prints the figures and writes them to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_run import fast_run, peer_env, read_events, stop_all, wait_for  # noqa: E402

DEMO = REPO / "worldlm_p2p" / "demo_data"
LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def _start(cmd: list[str], log: Path, *, pipe: bool = False) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", *cmd], env=peer_env(), start_new_session=True,
                            stdout=subprocess.PIPE if pipe else log.open("wb"), stderr=subprocess.STDOUT)


def _averaged(events: Path, *, since: float = 0.0, with_size: int = 2) -> list[dict]:
    return [e for e in read_events(events) if e.get("event") == "round" and e.get("outcome") == "averaged"
            and e.get("group_size", 0) >= with_size and e.get("time", 0.0) >= since]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gone-minutes", type=float, default=10.0, help="how long the bootstrap node stays away")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "bootstrap_outage.json")
    args = ap.parse_args()
    if args.gone_minutes <= 0:
        ap.error("--gone-minutes must be positive")
    tmp = Path(tempfile.mkdtemp(prefix="wlm-outage-"))
    run = tmp / "run.toml"
    run.write_text(fast_run(run_id="outage", inner_steps=10, barrier_timeout=30.0))
    procs: list[subprocess.Popen] = []
    try:  # (a wait that times out raises AssertionError, naming what it waited for)
        boot = _start(["worldlm_p2p.cli.bootstrap", "--run-config", str(run), "--host-maddrs", LOOPBACK],
                      tmp / "boot.log", pipe=True)
        procs.append(boot)
        line = boot.stdout.readline().decode()
        maddrs = [t for t in line.split() if "/p2p/" in t]
        if not maddrs:
            raise SystemExit(f"the bootstrap node printed {line!r}")
        log = (tmp / "boot.log").open("wb")
        threading.Thread(target=lambda: [log.write(b) for b in iter(boot.stdout.readline, b"")], daemon=True).start()

        def peer(label: str, sub: str, initial: list[str]) -> subprocess.Popen:
            p = _start(["worldlm_p2p.cli.peer", "--region", "eu", "--data", str(DEMO / "eu" / sub), "--label", label,
                        "--initial-peers", *initial, "--max-steps", "1000000", "--threads", "1",
                        "--events", str(tmp / f"{label}.events"), "--summary", str(tmp / f"{label}.json")],
                       tmp / f"{label}.log")
            procs.append(p)
            return p

        peer("a", "nl_news", maddrs)
        peer("b", "de_news-reviews-wiki", maddrs)
        wait_for(lambda: _averaged(tmp / "a.events") and _averaged(tmp / "b.events"), 300, "a and b to average")
        text = (tmp / "a.log").read_text(errors="replace")
        a_maddrs = re.search(r"--initial-peers (.+)", text).group(1).split()
        run_key = re.search(r"run key (\S+)\)", text).group(1)
        boot.kill()
        boot.wait(timeout=30)
        killed = time.time()
        print(f"bootstrap node killed; waiting {args.gone_minutes:g} min", flush=True)
        time.sleep(args.gone_minutes * 60)
        during = {label: len(_averaged(tmp / f"{label}.events", since=killed)) for label in ("a", "b")}
        alive = {label: p.poll() is None for label, p in zip(("a", "b"), procs[1:3])}
        joined = time.time()
        c = peer("c", "es_blog-news-reviews-wiki", a_maddrs)
        first = wait_for(lambda: _averaged(tmp / "c.events", with_size=3) or (c.poll() is not None and ["exited"]),
                      300, "the newcomer's first round with both running peers")
        log_c = (tmp / "c.log").read_text(errors="replace")
        mon = subprocess.run([sys.executable, "-m", "worldlm_p2p.cli.monitor", "--initial-peers", *a_maddrs, "--once",
                              "--json"], env=peer_env(), capture_output=True, text=True, timeout=120)
        try:
            snap = json.loads(mon.stdout.strip().splitlines()[-1])
            listed = sorted(p.get("label", "?") for r in snap["regions"].values() for p in r["peers"])
        except (ValueError, IndexError, AttributeError, KeyError, TypeError):
            listed = [f"monitor failed (exit {mon.returncode}): {mon.stderr.strip()[-200:]}"]
        result = dict(
            gone_minutes=args.gone_minutes, rounds_during_outage=during, running_peers_alive=alive,
            newcomer_found_manifest=f"run key {run_key})" in log_c,
            newcomer_first_round_s=(round(first[0]["time"] - joined, 1) if first != ["exited"] else None),
            newcomer_first_group=first[0].get("group_size") if first != ["exited"] else None,
            monitor_through_peer=listed, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    finally:
        stop_all(procs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    sys.exit(main())
