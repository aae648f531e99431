"""``worldlm-swarm``: a whole small world on this machine (bootstrap + peers on 127.0.0.1).

With no flags it runs the bundled demo: 7 peers in 3 regions (eu=3, na=2, asia=2) train the
``tiny`` model on a slice of a multilingual Universal Dependencies corpus for a few minutes, and
``DIR/summary.json`` reports each peer's steps, rounds, group sizes and losses.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from pathlib import Path

from worldlm_p2p.cli.common import ArgumentParser, install_stop_handlers, run_main
from worldlm_p2p.config import RunManifest

PROG = "worldlm-swarm"
DEMO_REGIONS = "eu=3,na=2,asia=2"  # of the bundled demo slice
logger = logging.getLogger(PROG)


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog=PROG, description="Run a whole WorldLM world on this machine.")
    p.add_argument("--regions", default=None, help="REGION=PEERS,... (default: eu=3,na=2,asia=2 of the demo slice; with "
                                                   "--data, every region of that corpus with one peer per sub-corpus)")
    p.add_argument("--model", default="tiny", help="model preset: tiny, small, base, large (default tiny)")
    p.add_argument("--max-steps", type=int, default=120, help="local steps per peer (default 120)")
    p.add_argument("--inner-steps", type=int, default=15, help="H: local steps between region rounds (default 15)")
    p.add_argument("--data", help="federated corpus <region>/<sub_corpus>/{train,valid}.txt "
                                  "(default: the bundled demo slice)")
    p.add_argument("--out", default="runs/demo", help="output directory (default runs/demo)")
    p.add_argument("--run-config", metavar="TOML", help="run manifest to use instead of --model/--inner-steps")
    p.add_argument("--run-id", default="demo", help="run id (default demo)")
    p.add_argument("--threads-per-peer", type=int, default=1, help="torch threads per peer process (default 1)")
    p.add_argument("--device", default="cpu", help="every peer's device: cpu, cuda or cuda:N (default cpu; peers "
                                                   "may share one GPU)")
    p.add_argument("--no-live", action="store_true", help="plain log lines instead of the live table")
    p.add_argument("--no-report", action="store_true",
                   help="do not write report.png and report.md (loss against tokens per region) at the end")
    return p


def choose_regions(spec: str | None, data: Path | None) -> dict[str, int]:
    """Region -> peers: ``--regions`` as given; else, with ``--data``, every region of that corpus with
    one peer per sub-corpus (as its layout says); else the demo's :data:`DEMO_REGIONS`."""
    from worldlm_p2p.swarm import parse_regions
    from worldlm_p2p.train import list_corpus

    if spec is not None:
        return parse_regions(spec)
    if data is not None:
        return {region: len(subs) for region, subs in list_corpus(data).items()}
    return parse_regions(DEMO_REGIONS)


def make_manifest(args) -> RunManifest:
    if args.run_config:
        return RunManifest.from_toml(args.run_config)
    return RunManifest.from_dict({"run_id": args.run_id, "model": {"preset": args.model},
                                  "train": {"inner_steps": args.inner_steps}})


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    def body() -> int:
        from rich.console import Console
        from rich.live import Live

        from worldlm_p2p.errors import ConfigError
        from worldlm_p2p.logs import setup_logging
        from worldlm_p2p.swarm import LocalSwarm, SwarmConfig
        from worldlm_p2p.train import demo_data_dir

        if args.max_steps < 1:
            raise ConfigError("--max-steps must be a positive integer")
        if args.threads_per_peer < 1:
            raise ConfigError("--threads-per-peer must be a positive integer")
        manifest = make_manifest(args)
        data = Path(args.data) if args.data else demo_data_dir()
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--out {out} exists and is not a directory")
        try:  # before anything starts: an --out that cannot be made fails now, in one line
            out.mkdir(parents=True, exist_ok=True)
            probe = out / ".write-probe"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise ConfigError(f"--out {out}: cannot write there ({e.strerror or e})") from None
        config = SwarmConfig(regions=choose_regions(args.regions, Path(args.data) if args.data else None), data=data,
                             out=out, manifest=manifest,
                             max_steps=args.max_steps, threads_per_peer=args.threads_per_peer, device=args.device)
        swarm = LocalSwarm(config=config)
        swarm.plan()  # validate data and regions before starting anything
        from worldlm_p2p.display import progress_table

        setup_logging()
        if out.is_dir() and any(out.iterdir()):
            old = out.with_name(f"{out.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
            out.rename(old)
            logger.info("moved the previous run in %s to %s", out, old)
        stop = threading.Event()
        install_stop_handlers(stop.set)
        console = Console()
        watcher = None
        try:
            swarm.start()
            watcher = _Watcher(swarm)
            labels = {p.label: p.region for p in swarm.peers}
            render = lambda: progress_table(  # noqa: E731
                watcher.records, labels=labels, max_steps=args.max_steps,
                exited={p.label: p.proc.returncode for p in swarm.peers if p.proc.poll() is not None},
                title=f"WorldLM swarm: run {manifest.run_id}, model {manifest.model.preset}, "
                      f"H={manifest.train.inner_steps}")
            if console.is_terminal and not args.no_live:
                with Live(render(), console=console, refresh_per_second=2) as live:
                    swarm.wait(on_tick=lambda: live.update(render()), should_stop=stop.is_set)
                    live.update(render())
            else:
                last = [0.0]

                def tick() -> None:
                    if time.monotonic() - last[0] > 10:
                        last[0] = time.monotonic()
                        recs = watcher.records
                        logger.info("%d peers running; steps %s", len(swarm.running()),
                                    ", ".join(f"{r.label}={r.step}" for r in sorted(recs, key=lambda r: r.label)))

                swarm.wait(on_tick=tick, should_stop=stop.is_set)
        finally:
            if watcher is not None:
                watcher.close()
            swarm.stop()
            if swarm.peers:
                path = swarm.write_summary()
                logger.info("summary written to %s", path)
        summary = json.loads((out / "summary.json").read_text())
        failed = [p for p in summary["peers"] if p.get("exit_code") not in (0, None)]
        for p in summary["peers"]:
            logger.info("%-28s steps %4s rounds %3s groups %s valid loss %s", p.get("label"), p.get("steps"),
                        p.get("rounds_completed"), p.get("group_sizes"),
                        f"{p['valid_loss']:.3f}" if isinstance(p.get("valid_loss"), float) else "-")
        if not args.no_report:
            write_report_best_effort(out)
        if failed:
            logger.error("%d peer(s) failed; see their logs in %s", len(failed), out / "logs")
            return 1
        return 0

    run_main(PROG, body)


def write_report_best_effort(out: Path) -> None:
    """``OUT/report.png`` and ``OUT/report.md`` from ``OUT/summary.json``; a failure is only logged."""
    from worldlm_p2p.errors import WorldLMError

    try:
        from worldlm_p2p.report import report_sources

        png, md = report_sources([out], out)
        logger.info("report written to %s and %s", png, md)
    except Exception as e:  # the run's results are in summary.json already
        logger.warning("no report written: %s", e if isinstance(e, WorldLMError) else f"{type(e).__name__}: {e}")


class _Watcher:
    """Reads progress records from the DHT as a client node (never joins a group)."""

    def __init__(self, swarm) -> None:
        self.records = []
        self._swarm = swarm
        self._stop = threading.Event()
        self._reader = None
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        from worldlm_p2p.net.reader import RunReader

        try:
            self._reader = RunReader(initial_peers=self._swarm.initial_peers,
                                     run_id=self._swarm.config.manifest.run_id, manifest=False)
            while not self._stop.wait(1.0):
                self.records = self._reader.progress()
        except Exception as e:  # the display is best effort; the swarm keeps running
            logger.warning("live display unavailable: %s", e)
        finally:
            # shut the DHT down from the thread that started it (its process dies with this thread)
            if self._reader is not None:
                self._reader.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


if __name__ == "__main__":
    main(sys.argv[1:])
