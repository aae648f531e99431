#!/usr/bin/env python
"""Cost of DP-SGD at a peer: training tokens/s of a ``LocalTrainer`` with ``dp=DPSGDConfig(...)``
(Opacus per-sample gradients, per-window clipping, noise, Poisson batches) over the same trainer
without DP, on one torch thread, measured in the same run.

Both trainers train the same model (``tiny`` by default) on the bundled demo corpus with batch 4 x
64 tokens. The measurement alternates blocks of plain and DP steps (``--rounds`` blocks of
``--steps`` each, after a warm-up) so that a change in machine load hits both alike; it reports
wall-clock and CPU-time tokens/s and their DP / plain ratios (CPU time is the figure least
affected by other users of the machine). DP batches have a random size (expected 4), so
tokens/s counts the tokens actually trained on.

Usage::

    python benchmarks/dp_sgd_cost.py [--model tiny] [--batch-size 4] [--seq-len 64] [--steps 20] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from worldlm_p2p.config import MODEL_PRESETS, TrainConfig  # noqa: E402
from worldlm_p2p.train import (  # noqa: E402
    ByteTokenizer,
    DPSGDConfig,
    LocalTrainer,
    build_model,
    demo_data_dir,
    load_texts,
    tokenize_splits,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", choices=sorted(MODEL_PRESETS))
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20, help="steps per measured block")
    ap.add_argument("--rounds", type=int, default=5, help="blocks of each kind, alternating")
    ap.add_argument("--warmup", type=int, default=5, help="unmeasured steps of each kind first")
    ap.add_argument("--noise", type=float, default=1.0, help="noise multiplier")
    ap.add_argument("--data", default=str(demo_data_dir() / "na" / "en_email"))
    ap.add_argument("--out", default="", help="also write the raw numbers to this JSON file")
    args = ap.parse_args()

    torch.set_num_threads(1)
    logging.getLogger("worldlm_p2p.train.dp").setLevel(logging.ERROR)  # the secure_rng reminder
    tok = ByteTokenizer()
    data = tokenize_splits(load_texts(args.data), tok, seq_len=args.seq_len)
    cfg = MODEL_PRESETS[args.model]
    train = TrainConfig(batch_size=args.batch_size, seq_len=args.seq_len, warmup_steps=0)

    def trainer(dp: DPSGDConfig | None) -> LocalTrainer:
        model = build_model(cfg, vocab_size=tok.vocab_size, seed=0)
        return LocalTrainer(model=model, train=train, data=data, device=torch.device("cpu"), seed=0, dp=dp)

    kinds = {"plain": trainer(None), "dp": trainer(DPSGDConfig(noise_multiplier=args.noise, max_grad_norm=1.0))}
    step = {k: 0 for k in kinds}

    def block(kind: str, n: int) -> tuple[int, float, float]:
        t = kinds[kind]
        tokens, wall, cpu = 0, time.perf_counter(), time.process_time()
        for _ in range(n):
            tokens += t.train_step(step[kind]).tokens
            step[kind] += 1
        return tokens, time.perf_counter() - wall, time.process_time() - cpu

    for kind in kinds:
        block(kind, args.warmup)
    blocks: dict[str, list[tuple[int, float, float]]] = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for kind in kinds:
            blocks[kind].append(block(kind, args.steps))

    def rates(kind: str) -> tuple[float, float, list[float]]:
        tokens = sum(b[0] for b in blocks[kind])
        wall = sum(b[1] for b in blocks[kind])
        cpu = sum(b[2] for b in blocks[kind])
        return tokens / wall, tokens / cpu, [b[0] / b[1] for b in blocks[kind]]

    plain_wall, plain_cpu, plain_blocks = rates("plain")
    dp_wall, dp_cpu, dp_blocks = rates("dp")
    per_block = [d / p for d, p in zip(dp_blocks, plain_blocks, strict=True)]
    dp_tokens = sum(b[0] for b in blocks["dp"])
    n_dp_steps = args.rounds * args.steps
    print(f"DP-SGD cost: model {args.model}, batch {args.batch_size} x {args.seq_len}, 1 thread, "
          f"{args.rounds} x {args.steps} steps of each kind (DP: noise {args.noise}, clip 1.0, "
          f"mean batch {dp_tokens / n_dp_steps / args.seq_len:.2f} windows, epsilon {kinds['dp'].epsilon():.3g})")
    print()
    print("| | plain | DP-SGD | DP / plain |")
    print("|---|---:|---:|---:|")
    print(f"| tokens/s (wall) | {plain_wall:,.0f} | {dp_wall:,.0f} | {dp_wall / plain_wall:.3f} |")
    print(f"| tokens/s (CPU time) | {plain_cpu:,.0f} | {dp_cpu:,.0f} | {dp_cpu / plain_cpu:.3f} |")
    print(f"| per-block wall ratio, median (min-max) | | | {statistics.median(per_block):.3f} "
          f"({min(per_block):.3f}-{max(per_block):.3f}) |")
    print()
    print(f"DP-SGD trains at {dp_cpu / plain_cpu:.2f}x the CPU-time tokens/s of plain training "
          f"({plain_cpu / dp_cpu:.2f}x slower).")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"args": vars(args), "blocks": blocks, "ratio_wall": dp_wall / plain_wall,
                                   "ratio_cpu": dp_cpu / plain_cpu, "per_block_wall_ratio": per_block}, indent=2))


if __name__ == "__main__":
    main()
