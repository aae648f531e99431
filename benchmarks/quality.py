#!/usr/bin/env python
"""Quality benchmark: WorldLM against its baselines and its own ablations, at two token budgets.

Every variant is one ``worldlm-simulate`` run (same corpus, model, seed, batch and number of local
steps, hence the same token budget; ``centralized`` trains one model on the pooled data for the
same number of tokens). Each run is evaluated after ``--short-rounds`` and after ``--rounds``
region rounds (the short budget is a third of the long one by default): local models overfit
small data as training goes on while federated ones keep improving, so one budget can mislead.

Reported: per-region perplexity (per token; with the default byte tokenizer a token is a UTF-8
byte, so this is per-byte perplexity) and bits per byte, means over each region's peers on their
own held-out text, and the ratios ``X / worldlm`` ("worldlm is r times lower than X").

Variants:
- strategies: worldlm, fedavg, hierfavg, fedper, local, centralized;
- ablations of worldlm: plain mean for K (``attention=mean``), no residual embeddings and a
  residual temperature of 1 (more sharing across regions), other key
  layers (``last30``, ``embed_head``), the other outer optimizer, the personal mix over K only,
  and no personal mix (members adopt the region's agreed model, as in the paper).

Usage::

    python benchmarks/quality.py [--data ../shared/data/corpus] [--jobs 2] [--out benchmarks/out/quality.json]

Prints a Markdown report and writes it next to ``--out`` (``.md``) with the raw results. Each run
uses one torch thread; ``--jobs`` runs go in parallel (this machine has 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SHARED_CORPUS = REPO.parent / "shared" / "data" / "corpus"
STRATEGIES = ["worldlm", "fedavg", "hierfavg", "fedper", "local", "centralized"]


def variants(args) -> list[tuple[str, list[str]]]:
    """(name, extra simulate flags). The worldlm defaults are the run manifest's defaults."""
    v = [(s, ["--strategy", s]) for s in STRATEGIES]
    other_outer = ["--outer", "sgd", "--outer-lr", "1.0"] if args.outer == "nesterov" else [
        "--outer", "nesterov", "--outer-lr", "0.7", "--outer-momentum", "0.9"]
    v += [
        ("worldlm:K-mean", ["--strategy", "worldlm", "--attention", "mean"]),
        ("worldlm:no-residual", ["--strategy", "worldlm", "--no-residual"]),
        ("worldlm:residual-tau-1", ["--strategy", "worldlm", "--residual-tau", "1.0"]),
        ("worldlm:K-last30", ["--strategy", "worldlm", "--key-layers", "last30"]),
        ("worldlm:K-embed_head", ["--strategy", "worldlm", "--key-layers", "embed_head"]),
        (f"worldlm:outer-{'sgd' if args.outer == 'nesterov' else 'nesterov'}", ["--strategy", "worldlm", *other_outer]),
        ("worldlm:personal-K-only", ["--strategy", "worldlm", "--personal-scope", "key"]),
        ("worldlm:no-personal", ["--strategy", "worldlm", "--personal-tau", "0"]),
    ]
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {name for name, _ in v}
        if unknown:
            sys.exit(f"quality.py: error: unknown variant(s) {', '.join(sorted(unknown))}")
        v = [x for x in v if x[0] in wanted]
    return v


def common_flags(args) -> list[str]:
    flags = ["--data", str(args.data), "--model", args.model, "--rounds", str(args.rounds),
             "--local-steps", str(args.local_steps), "--world-every", str(args.world_every), "--seed", str(args.seed),
             "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--lr", str(args.lr),
             "--eval-tokens", str(args.eval_tokens), "--eval-rounds", str(args.short_rounds), "--threads", "1",
             "--device", "cpu"]
    if args.outer == "nesterov":
        flags += ["--outer", "nesterov", "--outer-lr", str(args.outer_lr), "--outer-momentum", str(args.outer_momentum)]
    return flags + list(args.extra)


def run_variant(name: str, flags: list[str], args, workdir: Path) -> dict[str, Any]:
    out = workdir / (name.replace(":", "_") + ".json")
    log = workdir / (name.replace(":", "_") + ".log")
    cmd = [sys.executable, "-m", "worldlm_p2p.cli.simulate", *common_flags(args), *flags, "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    t0 = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    if proc.returncode != 0:
        tail = log.read_text().strip().splitlines()[-3:]
        raise RuntimeError(f"{name} failed (exit {proc.returncode}): {' | '.join(tail)}")
    res = json.loads(out.read_text())
    res["variant"], res["command"] = name, " ".join(cmd[1:])
    print(f"  {name}: done in {time.monotonic() - t0:.0f} s", flush=True)
    return res


def snapshot(res: dict[str, Any], rounds: int) -> dict[str, Any]:
    return next(h for h in res["history"] if h["round"] == rounds)


def report(results: dict[str, dict[str, Any]], args) -> str:
    regions = sorted(next(iter(results.values()))["regions"])
    lines: list[str] = []
    for budget in (args.short_rounds, args.rounds):
        snaps = {n: snapshot(r, budget) for n, r in results.items()}
        tokens = max(s["tokens"] for s in snaps.values())
        lines += [f"### Budget: {budget} rounds x {args.local_steps} steps ({tokens:,} training tokens in all)", "",
                  "| variant | " + " | ".join(f"{r} ppl" for r in regions) + " | region mean ppl | world bits/byte |",
                  "|---|" + "---:|" * (len(regions) + 2)]
        for n, s in snaps.items():
            mean_ppl = sum(s["regions"][r]["perplexity"] for r in regions) / len(regions)
            lines.append(f"| {n} | " + " | ".join(f"{s['regions'][r]['perplexity']:.3f}" for r in regions)
                         + f" | {mean_ppl:.3f} | {s['world']['bits_per_byte']:.4f} |")
        if "worldlm" in snaps:
            w = snaps["worldlm"]
            w_mean = sum(w["regions"][r]["perplexity"] for r in regions) / len(regions)
            lines += ["", "| worldlm vs | region mean ppl ratio (X / worldlm) | "
                      + " | ".join(f"{r}" for r in regions) + " |", "|---|---:|" + "---:|" * len(regions)]
            for n, s in snaps.items():
                if n == "worldlm":
                    continue
                mean = sum(s["regions"][r]["perplexity"] for r in regions) / len(regions)
                lines.append(f"| {n} | {mean / w_mean:.3f}x | " + " | ".join(
                    f"{s['regions'][r]['perplexity'] / w['regions'][r]['perplexity']:.3f}x" for r in regions) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=SHARED_CORPUS if SHARED_CORPUS.is_dir() else None,
                   help="federated corpus (default ../shared/data/corpus, else the bundled demo slice)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--rounds", type=int, default=18, help="long budget in region rounds (default 18)")
    p.add_argument("--short-rounds", type=int, help="short budget (default rounds // 3)")
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--world-every", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--outer", default="sgd", choices=["sgd", "nesterov"], help="outer optimizer of every variant")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--only", help="comma-separated variant names")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "quality.json")
    p.add_argument("extra", nargs="*", help="extra worldlm-simulate flags for every run (after --)")
    args = p.parse_args()
    if args.data is None:
        from worldlm_p2p.train import demo_data_dir

        args.data = demo_data_dir()
    args.short_rounds = args.short_rounds or max(1, args.rounds // 3)
    todo = variants(args)
    print(f"quality benchmark: {len(todo)} runs on {args.data}, {args.jobs} at a time", flush=True)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="worldlm-quality-") as tmp:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = {name: pool.submit(run_variant, name, flags, args, Path(tmp)) for name, flags in todo}
            results = {name: f.result() for name, f in futures.items()}
    text = report(results, args)
    header = (f"Command: `python benchmarks/quality.py {' '.join(sys.argv[1:])}`\n\n"
              f"Data {args.data}; model {args.model}; batch {args.batch_size}x{args.seq_len}; H={args.local_steps}; "
              f"world round every {args.world_every} region rounds; seed {args.seed}; "
              f"wall time {time.monotonic() - t0:.0f} s.\n")
    print(header + "\n" + text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(args={k: str(v) for k, v in vars(args).items()}, results=results), indent=1))
    args.out.with_suffix(".md").write_text(header + "\n" + text)


if __name__ == "__main__":
    main()
