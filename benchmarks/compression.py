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

import argparse
import json
import math
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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpora", default="related,mixed", help=f"comma-separated, of {', '.join(quality.CORPORA)}")
    p.add_argument("--codecs", default=",".join(CODECS))
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
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "compression.json")
    args = p.parse_args()
    args.corpora = [c for c in args.corpora.split(",") if c]
    args.codecs = [c for c in args.codecs.split(",") if c]
    for c in args.corpora:
        if c not in quality.CORPORA:
            sys.exit(f"compression.py: error: unknown corpus {c!r} (known: {', '.join(quality.CORPORA)})")
    for c in args.codecs:
        if c not in CODECS:
            sys.exit(f"compression.py: error: unknown codec {c!r} (known: {', '.join(CODECS)})")
    if "none" not in args.codecs:
        sys.exit("compression.py: error: the codecs must include none (the baseline)")
    root = (args.corpus_root or SHARED_CORPUS).resolve()
    if not root.is_dir():
        sys.exit(f"compression.py: error: corpus root {root} is not a directory (give --corpus-root)")
    args.corpus_root = root
    os.environ["WORLDLM_CORPUS_ROOT"] = str(root)
    sys.path.insert(0, str(REPO))
    from worldlm_p2p.train.corpus import read_grouping

    layouts = {c: {r: [q.name for q in ps] for r, ps in read_grouping(CORPORA_DIR / f"{c}.toml").items()}
               for c in args.corpora}
    tmp = None
    if args.workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="worldlm-compression-")
        workdir = Path(tmp.name)
    else:
        workdir = args.workdir
        workdir.mkdir(parents=True, exist_ok=True)
    runs = plan(args)
    print(f"compression benchmark: {len(runs)} runs, {args.jobs} at a time, in {workdir}", flush=True)
    t0 = time.monotonic()
    results: dict[Run, dict] = {}
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(run_one, r, args, workdir): r for r in runs}
        for f in as_completed(futures):
            results[futures[f]] = f.result()
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(raw, indent=1))
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if any(not math.isfinite(v) for c in raw.values() for x in c.values() for v in x["ppl"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
