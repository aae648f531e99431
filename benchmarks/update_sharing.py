#!/usr/bin/env python
"""Exploration (issue 10): do members gain by adding their partners' round updates to their own model?

Not a product feature: a measurement of an idea that did not make it into the product, kept so that
its figures in ``benchmarks/RESULTS.md`` can be reproduced. Each member trains its own model (the
simulator's peers: same model init, same batch streams, the same tune slice held apart as in
``worldlm``) and, after every round of H local steps, adds to it what its partners learned in that
round: their *updates* (model after the round's local steps minus model before them), not their
models, so that a member keeps everything it learned itself:

- ``sum1`` / ``sumh``: the token-weighted mean of every other peer's update (the whole world), times
  1 or 0.5; ``-body`` leaves the embeddings and the head out;
- ``delta``: the mean update of the other members of its region, then of the other regions' peers,
  each times a weight chosen by a line search on the member's tune slice
  (:func:`worldlm_p2p.mixing.mix_change`, the product's evidence search);
- ``peer``: every other peer's update in turn, each weighted by its own line search;
- ``local``: nothing (the same peers training alone, tune slice held apart).

The region mean of per-byte perplexities (geometric mean over regions) is printed and written as JSON.

    python benchmarks/update_sharing.py --corpus scripts --rounds 6 --local-steps 10 --variant sum1 --out x.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

VARIANTS = ("local", "sum1", "sumh", "sum1-body", "sumh-body", "delta", "peer")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", required=True, help="a grouping in benchmarks/corpora (scripts, related, ...)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--local-steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variant", required=True, choices=VARIANTS)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    import torch

    from worldlm_p2p import mixing
    from worldlm_p2p.config import AggregationConfig, TrainConfig, model_preset
    from worldlm_p2p.simulate import SimConfig, Simulator
    from worldlm_p2p.train import get_flat_params, set_params
    from worldlm_p2p.train.corpus import read_grouping

    torch.set_num_threads(1)
    groups = read_grouping(REPO / "benchmarks" / "corpora" / f"{a.corpus}.toml")
    data = Path(tempfile.mkdtemp(prefix="worldlm-share-"))
    for region, subs in groups.items():
        (data / region).mkdir()
        for sub in subs:
            os.symlink(sub, data / region / sub.name)
    # strategy worldlm: the same tune slice held apart as the product's evidence mixing holds
    cfg = SimConfig(data=str(data), model=model_preset("tiny"), rounds=a.rounds,
                    train=TrainConfig(inner_steps=a.local_steps, seed=a.seed, batch_size=4, seq_len=64,
                                      eval_tokens=8192, lr=a.lr),
                    aggregation=AggregationConfig(strategy="worldlm"))
    sim = Simulator(cfg)
    peers, names = sim.peers, sim.names
    start = {p.key: get_flat_params(p.model) for p in peers}
    since_world = {p.key: [torch.zeros_like(t) for t in start[p.key]] for p in peers}
    taken: dict[str, list] = {p.key: [] for p in peers}
    t0 = time.time()

    def mean_update(updates, weights, keys):
        total = sum(weights[k] for k in keys)
        return [sum(weights[k] * updates[k][i] for k in keys) / total for i in range(len(names))]

    for r in range(1, a.rounds + 1):
        update, weight = {}, {}
        for p in peers:
            tokens = sum(p.trainer.train_step(p.step + i).tokens for i in range(a.local_steps))
            p.step += a.local_steps
            update[p.key] = [n - s for n, s in zip(get_flat_params(p.model), start[p.key])]
            weight[p.key] = float(tokens)
            for acc, d in zip(since_world[p.key], update[p.key]):
                acc += d
        if a.variant.startswith("sum"):
            lam = 1.0 if a.variant.startswith("sum1") else 0.5
            for p in peers:
                d = mean_update(update, weight, [q.key for q in peers if q is not p])
                if a.variant.endswith("-body"):
                    d = [torch.zeros_like(t) if ("embed" in n or "lm_head" in n) else t for n, t in zip(names, d)]
                set_params(p.model, mixing.shift(get_flat_params(p.model), d, lam))
        elif a.variant == "delta":
            for scope in ("region", "world"):
                for p in peers:
                    others = [q.key for q in peers if q is not p and (q.region == p.region) == (scope == "region")]
                    if not others:
                        continue
                    source = update if scope == "region" else since_world
                    d = mean_update(source, {k: 1.0 for k in others} if scope == "world" else weight, others)
                    new, choice = mixing.mix_change(get_flat_params(p.model), d, p.trainer.tune_loss,
                                                    grid=(0.125, 0.25, 0.5, 1.0))
                    set_params(p.model, new)
                    taken[p.key].append((scope, r, choice.lam))
            since_world = {k: [torch.zeros_like(t) for t in v] for k, v in since_world.items()}
        elif a.variant == "peer":
            for p in peers:
                current = get_flat_params(p.model)
                for q in sorted(peers, key=lambda q: q.key):
                    if q is not p:
                        current, choice = mixing.mix_change(current, update[q.key], p.trainer.tune_loss,
                                                            grid=(0.125, 0.25, 0.5, 1.0))
                        taken[p.key].append((q.key, r, choice.lam))
                set_params(p.model, current)
        for p in peers:
            start[p.key] = get_flat_params(p.model)

    out = {p.key: dict(region=p.region, loss=p.trainer.evaluate()) for p in peers}
    for v in out.values():
        v["perplexity"] = math.exp(v["loss"])
    regions = {}
    for region in sorted({p.region for p in peers}):
        vals = [v["perplexity"] for v in out.values() if v["region"] == region]
        regions[region] = sum(vals) / len(vals)
    mean = math.exp(sum(math.log(v) for v in regions.values()) / len(regions))
    Path(a.out).write_text(json.dumps(dict(args=vars(a), peers=out, regions=regions, region_mean=mean, taken=taken,
                                           seconds=time.time() - t0), indent=1))
    print(a.corpus, a.variant, a.seed, f"{mean:.3f}", {k: round(v, 2) for k, v in regions.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
