"""``worldlm-monitor``: watch a WorldLM swarm live from any machine that can reach a bootstrap node.

It is a read-only DHT client: it reads the peers' progress records and the leader leases, never
stores a record and never joins an averaging group. ``--once --json`` prints one snapshot (schema:
:mod:`worldlm_p2p.net.monitor`) and exits 0; exit code 1 if no peer of the run shows up within
``--wait`` seconds; 2 for bad input (a malformed multiaddr, an unreachable bootstrap node).
"""

from __future__ import annotations

import math

import json
import logging
import os
import sys
import threading

from worldlm_p2p.cli.common import ArgumentParser, fail, install_stop_handlers, run_main

PROG = "worldlm-monitor"
logger = logging.getLogger(PROG)

EPILOG = """\
JSON (--json): one snapshot object per line, {"run_id", "time", "manifest", "regions", "totals"};
"regions" maps each region to {"leader", "leader_label", "region_round", "world_round",
"peers_online", "tokens", "tokens_per_s", "train_loss", "loss_trend", "epsilon", "border_epsilon",
"border_releases", "peers": [{"peer_id",
"short_id", "label", "region", "step", "tokens", "train_loss", "tokens_per_s", "rounds_completed",
"round", "world_round", "leader", "seconds_since_heard", "finished", "status", "epsilon", "border_epsilon",
"border_releases", "mix_region", "mix_world", "bytes_sent", "bytes_received", "last_group_size", "loss_trend"}]}; "totals" has
"regions", "peers", "peers_online", "tokens", "tokens_per_s", "bytes_sent". "epsilon" is null where
differential privacy is off (epsilon: DP-SGD at the peers; border_epsilon: the region's border);
"mix_region" / "mix_world" (the live view's "took r/w") are the mean weights a peer took of its
region's agreed model and of the world's changes in its last 8 evidence-mixing choices, null before
any. Exit codes: 0 ok, 1 no peer of the run found within --wait, 2 bad input."""


def build_parser() -> ArgumentParser:
    import argparse

    p = ArgumentParser(prog=PROG, description="Watch a WorldLM swarm live (a read-only DHT client).",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR",
                   help="bootstrap multiaddrs (with /p2p/<id>), as given to worldlm-peer")
    p.add_argument("--run-id", help="run to watch (default: the only run published in the DHT)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--json", action="store_true", help="print JSON (one snapshot per line) instead of tables")
    p.add_argument("--wait", type=float, default=30.0,
                   help="seconds to wait for the first peer of the run before giving up with exit code 1 (default 30)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    def body() -> int:
        from worldlm_p2p.config import check_name
        from worldlm_p2p.errors import ConfigError
        from worldlm_p2p.logs import setup_logging

        if not (math.isfinite(args.interval) and args.interval > 0):
            raise ConfigError(f"--interval must be a finite number of seconds > 0, got {args.interval}")
        if not (math.isfinite(args.wait) and args.wait >= 0):
            raise ConfigError(f"--wait must be a finite number of seconds >= 0, got {args.wait}")
        if args.run_id is not None:
            check_name("run id", args.run_id)
        # stdout carries the view (or the JSON); logs go to stderr, warnings only unless asked for
        setup_logging(os.environ.get("WORLDLM_LOGLEVEL", "WARNING"), stream=sys.stderr)
        from rich.console import Console
        from rich.live import Live

        from worldlm_p2p.display import monitor_view
        from worldlm_p2p.net.dht import parse_maddrs
        from worldlm_p2p.net.monitor import SwarmMonitor

        parse_maddrs(args.initial_peers, what="--initial-peers", require_peer_id=True)  # fail before starting
        stop = threading.Event()
        install_stop_handlers(stop.set)
        console = Console()
        monitor = SwarmMonitor(initial_peers=args.initial_peers, run_id=args.run_id,
                               manifest_wait=min(args.wait, 10.0))
        try:
            snap = monitor.wait_for_peers(args.wait, should_stop=stop.is_set)
            if snap is None:
                if stop.is_set():
                    return 130
                fail(PROG, f"no peer of run {monitor.run_id!r} found in the DHT within {args.wait:.0f}s "
                           "(are peers running with the same --initial-peers?)", 1)

            def show(s: dict) -> None:
                if args.json:
                    sys.stdout.write(json.dumps(s) + "\n")
                    sys.stdout.flush()
                else:
                    console.print(monitor_view(s))

            if args.once:
                show(snap)
                return 0
            if args.json or not console.is_terminal:
                show(snap)
                while not stop.wait(args.interval):
                    show(monitor.snapshot())
                return 0
            with Live(monitor_view(snap), console=console, refresh_per_second=4, screen=False) as live:
                while not stop.wait(args.interval):
                    live.update(monitor_view(monitor.snapshot()))
            return 0
        finally:
            monitor.close()

    run_main(PROG, body)


if __name__ == "__main__":
    main(sys.argv[1:])
