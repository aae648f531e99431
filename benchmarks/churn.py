#!/usr/bin/env python
"""Churn soak: a swarm whose peers are killed at random and restarted from their checkpoints.

Real `worldlm-bootstrap` and `worldlm-peer` processes on 127.0.0.1: ``--peers`` peers in two regions
(the demo's ``eu`` and ``na``), each with a checkpoint directory and an event log. Every
``--kill-every`` seconds a random ``--fraction`` of the peers (leaders included: the draw does not
look) is SIGKILLed, process group and all, and restarted at once with the same command line. After
``--minutes`` every peer gets SIGTERM. Optionally (``--baseline``) the same swarm runs as long
without churn.

Reported: region rounds averaged per minute (all peers), the share of round attempts that averaged,
the kills, **state lost** per restart (the steps between the last checkpoint a killed peer wrote and
the step it resumed from: the work since its last checkpoint is expected to be lost, anything
beyond, or a resume from an older checkpoint, is lost state), restarts that failed to resume, and
the peers' final valid loss against the baseline's. Mid-run one random peer is SIGSTOPped for
``--stall`` seconds: how long its region mates' rounds were held meanwhile, and whether it averaged
again after SIGCONT.

    python benchmarks/churn.py [--peers 8] [--minutes 10] [--kill-every 60] [--stall 45] [--baseline]

Asserts nothing; prints a Markdown table and writes the raw numbers to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_run import fast_run, peer_env, read_events  # noqa: E402

DEMO = REPO / "worldlm_p2p" / "demo_data"



def _env() -> dict[str, str]:
    return peer_env()


_events = read_events


class Member:
    def __init__(self, tmp: Path, maddrs: list[str], region: str, sub: str) -> None:
        self.label, self.region = f"{region}-{sub}"[:40], region
        self.dir = tmp / self.label
        self.dir.mkdir(parents=True, exist_ok=True)
        self.args = [sys.executable, "-m", "worldlm_p2p.cli.peer", "--region", region, "--data", str(DEMO / region / sub),
                     "--label", self.label, "--initial-peers", *maddrs, "--threads", "1", "--checkpoint-dir",
                     str(self.dir / "ckpt"), "--checkpoint-every", "10", "--events", str(self.dir / "events.jsonl"),
                     "--summary", str(self.dir / "summary.json"), "--identity", str(self.dir / "id.key")]
        self.proc: subprocess.Popen | None = None
        self.kills: list[dict] = []
        self.starts = 0

    def start(self) -> None:
        log = open(self.dir / f"log-{self.starts}.txt", "wb")
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=_env(), start_new_session=True,
                                     cwd=REPO)
        self.starts += 1

    def kill(self) -> None:
        events = _events(self.dir / "events.jsonl")
        ckpts = [e["step"] for e in events if e.get("event") == "checkpoint"]
        steps = [e.get("step", 0) for e in events if e.get("event") == "round"]
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.kills.append(dict(time=time.time(), last_checkpoint=max(ckpts) if ckpts else None,
                               last_round_step=max(steps) if steps else None, n_events=len(events)))

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)

    def wait_stopped(self, deadline: float) -> bool:
        """Whether the peer stopped cleanly by ``deadline`` (else it is SIGKILLed)."""
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            return True
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            return False

    def report(self) -> dict:
        events = _events(self.dir / "events.jsonl")
        rounds = [e for e in events if e.get("event") == "round"]
        trainings = [e for e in events if e.get("event") == "training"]
        resumed = [e for e in trainings[1:]]  # every start after the first
        lost = []
        for k, r in zip(self.kills, resumed):
            if k["last_checkpoint"] is None:
                lost.append(dict(expected=None, resumed=r.get("step"), from_checkpoint=r.get("started_from")))
            else:
                lost.append(dict(expected=k["last_checkpoint"], resumed=r.get("step"),
                                 from_checkpoint=r.get("started_from"),
                                 lost_beyond_last_checkpoint=max(0, k["last_checkpoint"] - int(r.get("step", 0)))))
        try:
            summary = json.loads((self.dir / "summary.json").read_text())
        except (OSError, ValueError):
            summary = {}
        return dict(label=self.label, starts=self.starts, kills=len(self.kills), rounds=len(rounds),
                    averaged=sum(1 for e in rounds if e.get("outcome") == "averaged"),
                    failed=sum(1 for e in rounds if e.get("outcome") == "failed"),
                    restarts=lost, valid_loss=summary.get("valid_loss"), steps=summary.get("steps"))


def stall_report(members: list["Member"], stall: dict) -> dict:
    """What a SIGSTOPped peer cost its region: the longest time between two consecutive rounds of
    its region mates while it was stopped, against their median time between rounds outside the
    stall; and whether it averaged again after SIGCONT (and how soon)."""
    if not stall or "end" not in stall:
        return {}
    start, end = stall["start"], stall["end"]
    during, outside = [], []
    for m in members:
        if m.region != stall["region"] or m.label == stall["label"]:
            continue
        times = sorted(e["time"] for e in _events(m.dir / "events.jsonl") if e.get("event") == "round")
        for a, b in zip(times, times[1:]):
            (during if b > start and a < end else outside).append(b - a)
    stalled = next(m for m in members if m.label == stall["label"])
    after = sorted(e["time"] for e in _events(stalled.dir / "events.jsonl")
                   if e.get("event") == "round" and e.get("outcome") == "averaged" and e["time"] > end)
    outside.sort()
    return dict(label=stall["label"], seconds=round(end - start, 1),
                longest_gap_of_region_mates_during=round(max(during), 1) if during else None,
                median_gap_of_region_mates_outside=round(outside[len(outside) // 2], 1) if outside else None,
                averaged_again_after_s=round(after[0] - end, 1) if after else None)


def run(args, *, churn: bool, tmp: Path) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    run_id = "churn" if churn else "calm"
    (tmp / "run.toml").write_text(fast_run(run_id=run_id, inner_steps=10, barrier_timeout=20.0))
    boot = subprocess.Popen([sys.executable, "-m", "worldlm_p2p.cli.bootstrap", "--run-config", str(tmp / "run.toml"),
                             "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], stdout=subprocess.PIPE,
                            stderr=open(tmp / "bootstrap.log", "wb"), env=_env(), start_new_session=True, cwd=REPO)
    maddrs = [t for t in boot.stdout.readline().decode().split() if "/p2p/" in t]
    subs = {r: sorted(p.name for p in (DEMO / r).iterdir() if p.is_dir()) for r in ("eu", "na")}
    members = [Member(tmp, maddrs, region, subs[region][i // 2]) for i, region in
               zip(range(args.peers), ["eu", "na"] * args.peers)]
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    try:
        for m in members:
            m.start()
        next_kill = t0 + args.kill_every
        stall_at = t0 + args.minutes * 60 / 2 + args.kill_every / 4  # mid-run, between two kills
        stalled, stall = None, {}
        while time.monotonic() - t0 < args.minutes * 60:
            time.sleep(1.0)
            if args.stall > 0 and stalled is None and not stall and time.monotonic() >= stall_at:
                stalled = rng.choice(members)
                os.killpg(stalled.proc.pid, signal.SIGSTOP)
                stall = dict(label=stalled.label, region=stalled.region, start=time.time())
            if stalled is not None and time.time() >= stall["start"] + args.stall:
                os.killpg(stalled.proc.pid, signal.SIGCONT)
                stall["end"], stalled = time.time(), None
            for m in members:  # a peer that exited on its own (an error) is restarted too, and counted
                if m.proc.poll() is not None:
                    m.kills.append(dict(time=time.time(), exited=m.proc.returncode, last_checkpoint=None))
                    m.start()
            if churn and time.monotonic() >= next_kill:
                victims = rng.sample([m for m in members if m is not stalled],
                                     max(1, round(args.fraction * len(members))))
                for m in victims:
                    m.kill()
                for m in victims:
                    m.start()
                next_kill += args.kill_every
        if stalled is not None:
            os.killpg(stalled.proc.pid, signal.SIGCONT)
            stall["end"] = time.time()
        for m in members:  # all at once: a swarm stopping together
            m.terminate()
        deadline = time.monotonic() + args.stop_grace
        clean = sum(m.wait_stopped(deadline) for m in members)
    finally:
        for m in members:
            if m.proc is not None and m.proc.poll() is None:
                os.killpg(m.proc.pid, signal.SIGKILL)
        os.killpg(boot.pid, signal.SIGTERM)
        boot.wait(timeout=30)
    minutes = args.minutes
    reports = [m.report() for m in members]
    averaged = sum(r["averaged"] for r in reports)
    attempts = sum(r["averaged"] + r["failed"] for r in reports)
    restarts = [x for r in reports for x in r["restarts"]]
    losses = [r["valid_loss"] for r in reports if isinstance(r["valid_loss"], (int, float)) and math.isfinite(r["valid_loss"])]
    return dict(churn=churn, minutes=round(minutes, 2), stall=stall_report(members, stall), peers=len(members), kills=sum(r["kills"] for r in reports),
                stopped_cleanly=clean,
                averaged_per_minute=round(averaged / minutes, 2),
                averaged_share=round(averaged / attempts, 3) if attempts else None,
                restarts=len(restarts),
                resumed_from_checkpoint=sum(1 for x in restarts if x.get("from_checkpoint") == "checkpoint"),
                steps_lost_beyond_last_checkpoint=sum(x.get("lost_beyond_last_checkpoint") or 0 for x in restarts),
                mean_valid_loss=sum(losses) / len(losses) if losses else None, peers_reporting=len(losses),
                members=reports)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", type=int, default=8)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--kill-every", type=float, default=60.0)
    p.add_argument("--fraction", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-grace", type=float, default=90.0, help="seconds the peers get to stop on SIGTERM")
    p.add_argument("--stall", type=float, default=45.0,
                   help="mid-run, SIGSTOP one random peer for this many seconds, then SIGCONT (0: no stall)")
    p.add_argument("--baseline", action="store_true", help="also run the same swarm as long without churn")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "churn.json")
    args = p.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="churn-") as d:
        results.append(run(args, churn=True, tmp=Path(d) / "churn"))
        if args.baseline:
            results.append(run(args, churn=False, tmp=Path(d) / "calm"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(args={k: str(v) for k, v in vars(args).items()}, results=results), indent=1))
    print("| run | peers | minutes | kills | rounds averaged / min | averaged share | restarts resumed from "
          "checkpoint | steps lost beyond the last checkpoint | stopped cleanly | mean valid loss (peers) |")
    print("|---|---:|---:|---:|---:|---:|---|---:|---|---:|")
    for r in results:
        loss = f"{r['mean_valid_loss']:.4f}" if r["mean_valid_loss"] is not None else "-"
        print(f"| {'churn' if r['churn'] else 'no churn'} | {r['peers']} | {r['minutes']} | {r['kills']} | "
              f"{r['averaged_per_minute']} | {r['averaged_share']} | {r['resumed_from_checkpoint']}/{r['restarts']} | "
              f"{r['steps_lost_beyond_last_checkpoint']} | {r['stopped_cleanly']}/{r['peers']} | "
              f"{loss} ({r['peers_reporting']}) |")
    for r in results:
        st = r.get("stall") or {}
        if st:
            print(f"\n{'churn' if r['churn'] else 'no churn'}: {st['label']} SIGSTOPped for {st['seconds']} s: its "
                  f"region mates' longest time between rounds meanwhile {st['longest_gap_of_region_mates_during']} s "
                  f"(median outside the stall {st['median_gap_of_region_mates_outside']} s); it averaged again "
                  f"{st['averaged_again_after_s']} s after SIGCONT")
    return 0


if __name__ == "__main__":
    sys.exit(main())
