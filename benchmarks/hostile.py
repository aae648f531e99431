#!/usr/bin/env python
"""Hostile-member benchmark: what a malicious minority of a region does to its honest members.

Every run is a real swarm on 127.0.0.1: ``worldlm-bootstrap`` and ``worldlm-peer`` processes, the
malicious members genuine ``worldlm-peer`` processes that lie in their region rounds
(``benchmarks/malicious_peer.py``: payload x1000, sign-flipped, a random model claiming a weight of
1e9, NaN). One region of related sub-corpora (the demo's ``na``: English of several genres, where
averaging helps), ``tiny`` model, every member waiting for the others before it trains
(``--wait-for-peers``) so that runs are comparable. Two groups: 1 malicious of 3 members and 2 of 5.

For each group it runs: no attack with the plain mean (``aggregation.robust = "mean"``), no attack
with the robust rule (the default), every attack with the robust rule, and the x1000 attack with the
plain mean (what the rule prevents). Reported per run: the honest members' mean valid perplexity
(per byte) and its ratio to the no-attack robust run of the same group; rounds completed; whether
every honest member banned every attacker. The robust rule's cost without attack is the ratio of
the no-attack runs.

Then a malicious leader: region ``na``'s first member leads and serves world changes of random
tensors (``world-random``), against the same run with an honest first member; region ``eu`` has
one peer so that world rounds take place. Reported: the honest members' perplexity, the world
rounds they adopted, and the changes they refused.

    python benchmarks/hostile.py [--steps 60] [--leader-only] [--out benchmarks/out/hostile.json]

Prints a Markdown table and writes the raw numbers (every summary) to ``--out``. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_run import fast_run, peer_env  # noqa: E402

DEMO = REPO / "worldlm_p2p" / "demo_data" / "na"
HONEST = ("en_news-wiki", "en_reviews", "en_weblog")
ATTACKER_DATA = ("en_answers", "en_email")
ATTACKS = ("scale", "flip", "random", "nan")
GROUPS = ((2, 1), (3, 2))  # (honest, malicious)




def _env() -> dict[str, str]:
    return peer_env()


def _stop(proc: subprocess.Popen) -> None:
    from worldlm_p2p.swarm import stop_process_group

    stop_process_group(proc, grace=5.0)


def _start_bootstrap(procs: list[subprocess.Popen], tmp: Path) -> list[str]:
    """Start a bootstrap node for ``tmp/run.toml`` (into ``procs``); return its multiaddrs."""
    boot = subprocess.Popen([sys.executable, "-m", "worldlm_p2p.cli.bootstrap", "--run-config", str(tmp / "run.toml"),
                             "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], stdout=subprocess.PIPE,
                            stderr=open(tmp / "bootstrap.log", "wb"), env=_env(), start_new_session=True, cwd=REPO)
    procs.append(boot)
    return [t for t in boot.stdout.readline().decode().split() if "/p2p/" in t]


def _finish(procs: list[subprocess.Popen], honest_procs: list[subprocess.Popen], tmp: Path,
            subs: tuple[str, ...]) -> tuple[float, list[int], dict, float]:
    """Wait for the honest members, stop every process, and read the honest members' summaries:
    (seconds, exit codes, summaries, geometric-mean perplexity; NaN unless every one has a loss)."""
    try:
        t0 = time.monotonic()
        codes = [p.wait(timeout=900) for p in honest_procs]
        seconds = time.monotonic() - t0
    finally:
        for p in procs:
            _stop(p)
    summaries = {}
    for sub, code in zip(subs, codes):
        try:
            summaries[sub] = json.loads((tmp / f"{sub}.json").read_text())
        except (OSError, ValueError):
            summaries[sub] = dict(exit_code=code)
    losses = [s.get("valid_loss") for s in summaries.values()]
    ok = [x for x in losses if isinstance(x, (int, float)) and math.isfinite(x)]
    ppl = math.exp(sum(ok) / len(ok)) if ok and len(ok) == len(losses) else float("nan")
    return seconds, codes, summaries, ppl


def run_one(*, tmp: Path, honest: int, malicious: int, attack: str | None, robust: str, steps: int,
            inner_steps: int) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    run_id = f"h{honest}m{malicious}{attack or 'none'}{robust}"
    (tmp / "run.toml").write_text(fast_run(run_id=run_id, inner_steps=inner_steps, barrier_timeout=30.0,
                                           aggregation=f'robust = "{robust}"'))
    procs: list[subprocess.Popen] = []
    members = honest + (malicious if attack else 0)
    try:
        maddrs = _start_bootstrap(procs, tmp)
        common = ["--initial-peers", *maddrs, "--max-steps", str(steps), "--threads", "1",
                  "--wait-for-peers", str(members)]
        honest_procs = []
        for sub in HONEST[:honest]:
            args = [sys.executable, "-m", "worldlm_p2p.cli.peer", "--region", "na", "--data", str(DEMO / sub),
                    "--label", sub, "--summary", str(tmp / f"{sub}.json"), *common]
            p = subprocess.Popen(args, stdout=open(tmp / f"{sub}.log", "wb"), stderr=subprocess.STDOUT,
                                 env=_env(), start_new_session=True, cwd=REPO)
            procs.append(p)
            honest_procs.append(p)
        for i in range(malicious if attack else 0):
            args = [sys.executable, str(REPO / "benchmarks" / "malicious_peer.py"), attack, "--region", "na",
                    "--data", str(DEMO / ATTACKER_DATA[i]), "--label", f"mallory-{i}", *common]
            procs.append(subprocess.Popen(args, stdout=open(tmp / f"mallory-{i}.log", "wb"),
                                          stderr=subprocess.STDOUT, env=_env(), start_new_session=True, cwd=REPO))
    except BaseException:
        for p in procs:
            _stop(p)
        raise
    seconds, codes, summaries, ppl = _finish(procs, honest_procs, tmp, HONEST[:honest])
    logs = {sub: (tmp / f"{sub}.log").read_text(errors="replace") for sub in HONEST[:honest]}
    banned = sum(log.count("for the rest of the run") for log in logs.values())
    return dict(honest=honest, malicious=malicious if attack else 0, attack=attack or "none", robust=robust,
                seconds=round(seconds, 1), exit_codes=codes,
                valid_loss=math.log(ppl), ppl=ppl,
                rounds=[s.get("rounds_completed") for s in summaries.values()],
                bans=banned, bans_expected=honest * (malicious if attack else 0), summaries=summaries)


EU = REPO / "worldlm_p2p" / "demo_data" / "eu" / "de_news-reviews-wiki"


def _wait_for_line(path: Path, needle: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and needle in path.read_text(errors="replace"):
            return True
        time.sleep(0.5)
    return False


def run_leader(*, tmp: Path, malicious: bool, steps: int, inner_steps: int) -> dict:
    """Region ``na``: a first member that leads (``malicious``: it serves world changes of random
    tensors, ``malicious_peer.py world-random``; else an honest peer on the same data) and two
    honest members; region ``eu``: one peer, so that world rounds take place."""
    tmp.mkdir(parents=True, exist_ok=True)
    run_id = f"leader{'m' if malicious else 'h'}"
    (tmp / "run.toml").write_text(fast_run(run_id=run_id, inner_steps=inner_steps, barrier_timeout=30.0))
    procs: list[subprocess.Popen] = []
    try:
        maddrs = _start_bootstrap(procs, tmp)
        common = ["--initial-peers", *maddrs, "--max-steps", str(steps), "--threads", "1"]
        first = ([sys.executable, str(REPO / "benchmarks" / "malicious_peer.py"), "world-random"] if malicious
                 else [sys.executable, "-m", "worldlm_p2p.cli.peer"])
        procs.append(subprocess.Popen(first + ["--region", "na", "--data", str(DEMO / ATTACKER_DATA[0]), "--label",
                                               "first", *common, "--wait-for-peers", "3"],
                                      stdout=open(tmp / "first.log", "wb"), stderr=subprocess.STDOUT, env=_env(),
                                      start_new_session=True, cwd=REPO))
        led = _wait_for_line(tmp / "first.log", "this peer is now the leader", 180)
        honest_procs = []
        for sub in HONEST[:2]:
            args = [sys.executable, "-m", "worldlm_p2p.cli.peer", "--region", "na", "--data", str(DEMO / sub),
                    "--label", sub, "--summary", str(tmp / f"{sub}.json"), *common, "--wait-for-peers", "3"]
            p = subprocess.Popen(args, stdout=open(tmp / f"{sub}.log", "wb"), stderr=subprocess.STDOUT,
                                 env=_env(), start_new_session=True, cwd=REPO)
            procs.append(p)
            honest_procs.append(p)
        procs.append(subprocess.Popen([sys.executable, "-m", "worldlm_p2p.cli.peer", "--region", "eu", "--data",
                                       str(EU), "--label", "eu", *common], stdout=open(tmp / "eu.log", "wb"),
                                      stderr=subprocess.STDOUT, env=_env(), start_new_session=True, cwd=REPO))
    except BaseException:
        for p in procs:
            _stop(p)
        raise
    seconds, codes, summaries, ppl = _finish(procs, honest_procs, tmp, HONEST[:2])
    logs = [(tmp / f"{sub}.log").read_text(errors="replace") for sub in HONEST[:2]]
    return dict(leader="malicious (world-random)" if malicious else "honest", first_led=led,
                seconds=round(seconds, 1), exit_codes=codes,
                ppl=ppl, rounds=[s.get("rounds_completed") for s in summaries.values()],
                world_adopted=[s.get("world_rounds_adopted") for s in summaries.values()],
                refused=[log.count("refused world round") for log in logs], summaries=summaries)


def leader_markdown(rows: list[dict]) -> str:
    out = ["| first na member (it leads) | honest ppl | vs honest leader | rounds | world rounds adopted | "
           "world changes refused |", "|---|---:|---:|---|---|---|"]
    base = next((r["ppl"] for r in rows if r["leader"] == "honest"), float("nan"))
    for r in rows:
        out.append(f"| {r['leader']} | {r['ppl']:.3f} | {r['ppl'] / base:.3f}x | {r['rounds']} | "
                   f"{r['world_adopted']} | {r['refused']} |")
    return "\n".join(out)


def markdown(rows: list[dict]) -> str:
    out = ["| members | attack | rule | honest ppl | vs no attack (clip) | rounds | attackers banned |",
           "|---|---|---|---:|---:|---|---|"]
    base = {(r["honest"], r["malicious"] or None): r["ppl"] for r in rows if r["attack"] == "none" and r["robust"] == "clip"}
    for r in rows:
        b = base.get((r["honest"], None))
        group = f"{r['malicious'] or 0} of {r['honest'] + (r['malicious'] or 0)}"
        ratio = r["ppl"] / b if b and math.isfinite(r["ppl"]) else float("nan")
        bans = f"{r['bans']}/{r['bans_expected']}" if r["bans_expected"] else "-"
        out.append(f"| {r['honest']} honest, {group} malicious | {r['attack']} | {r['robust']} | {r['ppl']:.3f} | "
                   f"{ratio:.3f}x | {r['rounds']} | {bans} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60, help="local steps of every member (default 60)")
    p.add_argument("--inner-steps", type=int, default=5, help="H (default 5)")
    p.add_argument("--attacks", default=",".join(ATTACKS))
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "hostile.json")
    p.add_argument("--leader-only", action="store_true", help="only the malicious-leader runs")
    args = p.parse_args(argv)
    rows, leader_rows = [], []
    with tempfile.TemporaryDirectory(prefix="hostile-") as d:
        for malicious in (False, True):
            row = run_leader(tmp=Path(d) / f"leader-{malicious}", malicious=malicious, steps=args.steps,
                             inner_steps=args.inner_steps)
            print(f"leader {row['leader']}: ppl {row['ppl']:.3f} rounds {row['rounds']} world adopted "
                  f"{row['world_adopted']} refused {row['refused']} ({row['seconds']}s)", flush=True)
            leader_rows.append(row)
        for honest, malicious in (() if args.leader_only else GROUPS):
            plan = [(None, "mean"), (None, "clip")] + [(a, "clip") for a in args.attacks.split(",")] + [("scale", "mean")]
            for attack, robust in plan:
                tmp = Path(d) / f"{honest}-{malicious}-{attack}-{robust}"
                row = run_one(tmp=tmp, honest=honest, malicious=malicious, attack=attack, robust=robust,
                              steps=args.steps, inner_steps=args.inner_steps)
                print(f"{honest}+{malicious} {row['attack']:>6} {robust}: ppl {row['ppl']:.3f} rounds {row['rounds']} "
                      f"bans {row['bans']}/{row['bans_expected']} ({row['seconds']}s)", flush=True)
                rows.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(steps=args.steps, inner_steps=args.inner_steps, rows=rows,
                                        leader_rows=leader_rows), indent=1, default=str))
    if rows:
        print(markdown(rows))
    print(leader_markdown(leader_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
