#!/usr/bin/env python
"""What backbone partners cost a swarm (issue 10): bytes on the wire and round time per region round.

With ``aggregation.region_backbone = "partners"`` (the default since 2026-12-07) every member of a
region round of three or more serves the backbone change it sent into the round and downloads what up
to ``partner_candidates`` mates sent, after the all-reduce, then evaluates the candidates on its tune
slice. This script measures that cost with the real CLIs (``worldlm-bootstrap`` + ``worldlm-peer``
processes on 127.0.0.1, :class:`worldlm_p2p.swarm.LocalSwarm`), against the region's plain mean
(``region_backbone = "mean"``, the baseline) measured in the same run, the two settings alternated
(``--repeats`` times each) because the machine is shared and noisy:

- **bytes on the wire per region round** of each peer: ``wire_sent + wire_received`` of its summary
  (the kernel's TCP counters of the peer's own processes, p2pd included: :mod:`worldlm_p2p.net.wire`),
  over its completed rounds; everything counts (DHT, progress records, leader leases), so the
  difference between the two settings is what partners add;
- **all-reduce seconds**: the median of the peers' ``round_seconds`` (the all-reduce alone; the
  mates' downloads and the candidates' evaluations come after it), the first round left out;
- **run seconds**: the whole swarm's wall time, start-up included (the same training in both),
  which holds what the downloads and the evaluations of the candidates on the tune slice add;
- **what members took**: how often a member's shared model took the region's backbone, its own half
  or a pair (the ``partner`` of its region mixes).

Usage::

    python benchmarks/partners_cost.py [--peers 4] [--rounds 8] [--repeats 2] [--out benchmarks/out/partners_cost.json]

Prints a Markdown table and writes the raw numbers to ``--out``. Never used by the tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for p in (str(REPO), str(REPO / "benchmarks")):
    if p not in sys.path:  # runnable from a checkout without installing
        sys.path.insert(0, p)

SETTINGS = {"mean": 'region_backbone = "mean"', "partners": ""}  # "": the product's defaults


def _median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def run_once(args, *, setting: str, repeat: int, tmp: Path, corpus: Path) -> dict[str, Any]:
    import tomllib

    from fast_run import fast_run

    from worldlm_p2p.config import RunManifest
    from worldlm_p2p.swarm import LocalSwarm, SwarmConfig

    text = fast_run(run_id=f"pc-{setting}-{repeat}", inner_steps=args.inner_steps, barrier_timeout=30.0,
                    aggregation=SETTINGS[setting], eval_tokens=2048)
    manifest = RunManifest.from_dict(tomllib.loads(text))
    config = SwarmConfig(regions={"bench": args.peers}, data=corpus, out=tmp / f"{setting}-{repeat}",
                         manifest=manifest, max_steps=args.inner_steps * args.rounds, threads_per_peer=1,
                         checkpoints=False, startup_timeout=120.0, stop_timeout=30.0)
    t0 = time.monotonic()
    with LocalSwarm(config=config) as swarm:
        swarm.start()
        deadline = time.monotonic() + args.swarm_timeout
        swarm.wait(poll=0.2, should_stop=lambda: time.monotonic() > deadline)
        timed_out = bool(swarm.running())
    peers = swarm.summary()["peers"]
    out = []
    for p in peers:
        rounds = p.get("rounds_completed") or 0
        wire = (p.get("wire_sent", -1), p.get("wire_received", -1))
        took: dict[str, int] = {}
        for m in p.get("mixes") or []:
            if m.get("kind") == "region":
                k = m.get("partner") or "region"
                k = k if k in ("region", "own-half") else "pair"
                took[k] = took.get(k, 0) + 1
        out.append(dict(label=p.get("label"), exit_code=p.get("exit_code"), rounds=rounds,
                        group_sizes=p.get("group_sizes"), round_seconds=p.get("round_seconds"),
                        wire_sent=wire[0], wire_received=wire[1],
                        wire_per_round=(sum(wire) / rounds if rounds and min(wire) >= 0 else None),
                        estimate_per_round=((p.get("bytes_sent", 0) + p.get("bytes_received", 0)) / rounds
                                            if rounds else None),
                        took=took))
    return dict(setting=setting, repeat=repeat, timed_out=timed_out, wall_s=time.monotonic() - t0,
                wire_per_round_median=_median(q["wire_per_round"] for q in out),
                round_seconds_median=_median(x for q in out for x in (q["round_seconds"] or [])[1:]),
                full_groups=sum(1 for q in out for g in (q["group_sizes"] or []) if g == args.peers),
                rounds=sum(q["rounds"] for q in out), peers=out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="partners_cost.py", description=__doc__.splitlines()[0])
    p.add_argument("--peers", type=int, default=4, help="peers of the one region (3 or more; default 4)")
    p.add_argument("--rounds", type=int, default=8, help="region rounds per peer (default 8)")
    p.add_argument("--inner-steps", type=int, default=10, help="H (default 10)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each setting, alternated (default 2)")
    p.add_argument("--swarm-timeout", type=float, default=420.0, help="give up on one swarm after this long")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "partners_cost.json"))
    args = p.parse_args(argv)
    if args.peers < 3:
        p.error("--peers: partners need a region round of 3 or more")
    for flag, value in (("--rounds", args.rounds), ("--inner-steps", args.inner_steps), ("--repeats", args.repeats)):
        if value < 1:
            p.error(f"{flag}: must be at least 1, got {value}")
    if not args.swarm_timeout > 0:
        p.error(f"--swarm-timeout: must be positive, got {args.swarm_timeout}")
    from swarm import make_corpus

    runs = []
    with tempfile.TemporaryDirectory(prefix="worldlm-partners-cost-") as d:
        tmp = Path(d)
        corpus = make_corpus(tmp / "corpus", args.peers)
        for r in range(args.repeats):
            for setting in SETTINGS:
                run = run_once(args, setting=setting, repeat=r, tmp=tmp, corpus=corpus)
                print(f"{setting} #{r}: {run['wire_per_round_median'] or 0:,.0f} B/round on the wire, round "
                      f"{run['round_seconds_median'] or 0:.2f} s, {run['full_groups']} full groups, "
                      f"{run['wall_s']:.0f} s", flush=True)
                runs.append(run)
    by = {s: [r for r in runs if r["setting"] == s] for s in SETTINGS}
    agg = {s: dict(wire_per_round=_median(r["wire_per_round_median"] for r in rs),
                   round_seconds=_median(r["round_seconds_median"] for r in rs),
                   wall_s=_median(r["wall_s"] for r in rs),
                   took={k: sum(q["took"].get(k, 0) for r in rs for q in r["peers"])
                         for k in ("region", "own-half", "pair")})
           for s, rs in by.items()}
    base = agg["mean"]
    lines = [f"One region of {args.peers} peers (`tiny`, H = {args.inner_steps}, {args.rounds} rounds, "
             f"{args.repeats} runs each, alternated); medians over peers and runs:", "",
             "| backbone | bytes on the wire per round and peer | / mean | all-reduce seconds | / mean "
             "| run seconds | / mean | took (region / own half / pair) |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]

    def ratio(x, y) -> str:
        return f"{x / y:.2f}x" if x and y else "-"
    for s, a in agg.items():
        w, t, wall = a["wire_per_round"], a["round_seconds"], a["wall_s"]
        lines.append(f"| `{s}` | {w or 0:,.0f} | {ratio(w, base['wire_per_round'])} | {t or 0:.2f} "
                     f"| {ratio(t, base['round_seconds'])} | {wall or 0:.0f} | {ratio(wall, base['wall_s'])} "
                     f"| {a['took']['region']} / {a['took']['own-half']} / {a['took']['pair']} |")
    print("\n".join(lines))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(args=vars(args), summary=agg, runs=runs), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
