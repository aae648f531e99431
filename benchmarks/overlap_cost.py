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

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality  # noqa: E402  (the run machinery and the tables' helpers of the quality benchmark)
from quality import REPO, Budget, Run, geo, peer_ppl, region_ppl  # noqa: E402

VARIANTS = {"sync": ("--strategy", "worldlm"), "overlap": ("--strategy", "worldlm", "--overlap")}


def main() -> None:
    p = quality.study_parser(__doc__.split("\n\n")[0], out=REPO / "benchmarks" / "out" / "overlap_cost.json")
    args = p.parse_args()
    layouts, workdir, tmp = quality.prepare_study(args, prog="overlap_cost.py")
    budget = Budget("overlap", args.rounds, args.local_steps)
    runs = [Run(c, budget, f"worldlm:{v}", s, flags) for c in args.corpora for v, flags in VARIANTS.items()
            for s in range(args.seeds)]
    t0 = time.monotonic()
    results = quality.run_plan(runs, args, workdir, what="overlap benchmark")
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
    quality.finish_study(args, raw, lines, tmp)


if __name__ == "__main__":
    main()
