#!/usr/bin/env python
"""What overlapped rounds cost in perplexity (issue 14).

An overlapped region round (``aggregation.overlap``) runs on a snapshot while the next H inner steps
train, and its result is applied one round stale with the progress made meanwhile kept
(:func:`worldlm_p2p.rounds.stale_apply`). This script runs ``worldlm-simulate`` (the same pure round
functions the swarm is tested against) with the product's defaults, synchronous and with
``--overlap``, for each corpus (a grouping file under ``benchmarks/corpora/``) and seed, at equal
tokens, and reports the region mean perplexity (geometric mean over regions of the members' mean)
of each, mean and spread over seeds, and the overlapped run's ratio to the synchronous one paired by
seed.

Usage::

    python benchmarks/overlap_cost.py                              # related and mixed, 20 x 25, 2 seeds
    python benchmarks/overlap_cost.py --corpora related --seeds 1 --rounds 6 --local-steps 10

Needs ``../shared/data/corpus`` (or ``--corpus-root``). Writes ``--out`` (raw) and a ``.md`` table.
Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality  # noqa: E402  (the run machinery and the tables' helpers of the quality benchmark)
from quality import CORPORA_DIR, REPO, SHARED_CORPUS, Budget, Run, geo, peer_ppl, region_ppl, run_one  # noqa: E402

VARIANTS = {"sync": ("--strategy", "worldlm"), "overlap": ("--strategy", "worldlm", "--overlap")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpora", default="related,mixed", help=f"comma-separated, of {', '.join(quality.CORPORA)}")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--local-steps", type=int, default=25)
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--eval-tokens", type=int, default=8192)
    p.add_argument("--corpus-root", type=Path, default=None)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--workdir", type=Path, default=None, help="keep (and reuse) every run's results here")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "overlap_cost.json")
    args = p.parse_args()
    args.corpora = [c for c in args.corpora.split(",") if c]
    for c in args.corpora:
        if c not in quality.CORPORA:
            sys.exit(f"overlap_cost.py: error: unknown corpus {c!r} (known: {', '.join(quality.CORPORA)})")
    root = (args.corpus_root or SHARED_CORPUS).resolve()
    if not root.is_dir():
        sys.exit(f"overlap_cost.py: error: corpus root {root} is not a directory (give --corpus-root)")
    os.environ["WORLDLM_CORPUS_ROOT"] = str(root)
    sys.path.insert(0, str(REPO))
    from worldlm_p2p.train.corpus import read_grouping

    layouts = {c: {r: [q.name for q in ps] for r, ps in read_grouping(CORPORA_DIR / f"{c}.toml").items()}
               for c in args.corpora}
    tmp = None
    if args.workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="worldlm-overlap-")
        workdir = Path(tmp.name)
    else:
        workdir = args.workdir
        workdir.mkdir(parents=True, exist_ok=True)
    budget = Budget("overlap", args.rounds, args.local_steps)
    runs = [Run(c, budget, f"worldlm:{v}", s, flags) for c in args.corpora for v, flags in VARIANTS.items()
            for s in range(args.seeds)]
    print(f"overlap benchmark: {len(runs)} runs, {args.jobs} at a time, in {workdir}", flush=True)
    t0 = time.monotonic()
    results: dict[Run, dict] = {}
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(run_one, r, args, workdir): r for r in runs}
        for f in as_completed(futures):
            results[futures[f]] = f.result()
    lines = [f"Overlap benchmark: `python benchmarks/overlap_cost.py --corpora {','.join(args.corpora)} "
             f"--seeds {args.seeds} --rounds {args.rounds} --local-steps {args.local_steps}` (model {args.model}, "
             f"batch {args.batch_size} x {args.seq_len}; {time.monotonic() - t0:.0f} s)", "",
             "| corpus | sync: region mean ppl | overlap: region mean ppl | overlap / sync (paired by seed) |",
             "|---|---:|---:|---:|"]
    raw: dict = {}
    for c in args.corpora:
        ppl = {v: {r.seed: geo(region_ppl(layouts[c], peer_ppl(res)).values())
                   for r, res in results.items() if r.corpus == c and r.variant == f"worldlm:{v}"} for v in VARIANTS}
        ratios = [ppl["overlap"][s] / ppl["sync"][s] for s in ppl["sync"] if s in ppl["overlap"]]

        def cell(values: list[float]) -> str:
            sd = statistics.stdev(values) if len(values) > 1 else 0.0
            return f"{statistics.fmean(values):.4f} ± {sd:.4f}"

        lines.append(f"| {c} | {cell(list(ppl['sync'].values()))} | {cell(list(ppl['overlap'].values()))} | "
                     f"{cell(ratios)} |")
        raw[c] = dict(ppl=ppl, ratio=ratios)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(raw, indent=1))
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
