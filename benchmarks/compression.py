#!/usr/bin/env python
"""Compression benchmark: what 16 and 8 bits on the wire cost in perplexity, and what they save (issue 14).

A region round averages each member's change since the round's anchor (the outer gradient), encoded
per tensor role (``aggregation.compress_backbone`` / ``compress_key``: none = float32, fp16, int8;
:mod:`worldlm_p2p.compression`). This script runs ``worldlm-simulate`` (the same pure round functions
the swarm's all-reduce is tested against, codecs included) with the product's defaults and each codec
on both roles, for each corpus (a grouping file under ``benchmarks/corpora/``) and seed, all at equal
tokens, and reports:

- the region mean perplexity (geometric mean over regions of the members' mean) per codec, mean and
  spread over seeds, and its ratio to ``none`` paired by seed (the issue's target: within 1%);
- bytes a peer sends per million training tokens, from the simulator's traffic account (ring
  all-reduce of the payload as it travels, world rounds included), against per-step data-parallel
  training of the same model (computed: a ring all-reduce of the float32 gradient after every
  step, ``2 (n-1)/n * 4 * parameters`` bytes per peer per step of ``batch x seq_len`` tokens, with
  ``n`` the peers of the run) and against the float32 rounds of the same run.

Usage::

    python benchmarks/compression.py                              # related and mixed, 20 x 25, 2 seeds
    python benchmarks/compression.py --corpora related --seeds 1 --rounds 6 --local-steps 10

Needs ``../shared/data/corpus`` (or ``--corpus-root``). Writes ``--out`` (raw) and a ``.md`` table.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality  # noqa: E402  (the run machinery and the tables' helpers of the quality benchmark)
from quality import REPO, Budget, Run, geo, peer_ppl, region_ppl  # noqa: E402

CODECS = ("none", "fp16", "int8")


def plan(args) -> list[Run]:
    budget = Budget("compress", args.rounds, args.local_steps)
    return [Run(c, budget, f"worldlm:{codec}", s, ("--strategy", "worldlm", "--compress-backbone", codec,
                                                    "--compress-key", codec))
            for c in args.corpora for codec in args.codecs for s in range(args.seeds)]


def bytes_per_mtok(res: dict) -> float:
    """Bytes a peer sends per million training tokens (mean over the run's peers)."""
    peers = res["peers"].values()
    return statistics.fmean(1e6 * (p["bytes_sent_region"] + p["bytes_sent_border"]) / max(p["tokens"], 1)
                            for p in peers)


def data_parallel_bytes_per_mtok(res: dict, args) -> float:
    n = len(res["peers"])
    per_step = 2 * (n - 1) / n * 4 * res["parameters"]
    return per_step * 1e6 / (args.batch_size * args.seq_len)


def main() -> None:
    p = quality.study_parser(__doc__.split("\n\n")[0], out=REPO / "benchmarks" / "out" / "compression.json")
    p.add_argument("--codecs", default=",".join(CODECS))
    args = p.parse_args()
    args.codecs = [c for c in args.codecs.split(",") if c]
    for c in args.codecs:
        if c not in CODECS:
            sys.exit(f"compression.py: error: unknown codec {c!r} (known: {', '.join(CODECS)})")
    if "none" not in args.codecs:
        sys.exit("compression.py: error: the codecs must include none (the baseline)")
    layouts, workdir, tmp = quality.prepare_study(args, prog="compression.py")
    t0 = time.monotonic()
    results = quality.run_plan(plan(args), args, workdir, what="compression benchmark")
    lines = [f"Compression benchmark: `python benchmarks/compression.py --corpora {','.join(args.corpora)} "
             f"--seeds {args.seeds} --rounds {args.rounds} --local-steps {args.local_steps}` (model {args.model}, "
             f"batch {args.batch_size} x {args.seq_len}; {time.monotonic() - t0:.0f} s)", ""]
    raw: dict = {}
    for c in args.corpora:
        lines += [f"### {c}", "", "| codec | region mean ppl (seeds) | against none (paired) | bytes/peer/1M tokens "
                  "| fewer than per-step DP | fewer than fp32 rounds |", "|---|---:|---:|---:|---:|---:|"]
        base = {r.seed: res for r, res in results.items() if r.corpus == c and r.variant == "worldlm:none"}
        for codec in args.codecs:
            mine = {r.seed: res for r, res in results.items() if r.corpus == c and r.variant == f"worldlm:{codec}"}
            ppl = {s: geo(region_ppl(layouts[c], peer_ppl(res)).values()) for s, res in mine.items()}
            ratios = [ppl[s] / geo(region_ppl(layouts[c], peer_ppl(base[s])).values()) for s in mine]
            b = statistics.fmean(bytes_per_mtok(res) for res in mine.values())
            b_none = statistics.fmean(bytes_per_mtok(res) for res in base.values())
            dp = statistics.fmean(data_parallel_bytes_per_mtok(res, args) for res in mine.values())
            sd = statistics.stdev(ppl.values()) if len(ppl) > 1 else 0.0
            rsd = statistics.stdev(ratios) if len(ratios) > 1 else 0.0
            lines.append(f"| {codec} | {statistics.fmean(ppl.values()):.4f} ± {sd:.4f} | "
                         f"{statistics.fmean(ratios):.4f} ± {rsd:.4f} | {b / 1e6:.1f} MB | {dp / b:.0f}x | "
                         f"{b_none / b:.2f}x |")
            raw.setdefault(c, {})[codec] = dict(ppl=ppl, ratio_to_none=ratios, bytes_per_mtok=b,
                                                data_parallel_bytes_per_mtok=dp)
        lines.append("")
    quality.finish_study(args, raw, lines, tmp)
    if any(not math.isfinite(v) for c in raw.values() for x in c.values() for v in x["ppl"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
