"""What the separate personal model costs a peer's training (issue 10's default, ``personal_model``).

With ``aggregation.personal_model = "separate"`` (the default) every worldlm member trains two models
on the same batches: the shared one its rounds average and its personal one. This measures, in one
process on one torch thread, the seconds per training step of one model (``"inline"``) and of two,
in alternating blocks so that the machine's noise hits both alike, and reports their ratio (the
median over blocks), with the bytes of parameters and optimizer state each holds. The evidence
searches after each round (a few evaluations of the 2048-token tune slice) are not included: the
quality study's wall times carry them (``benchmarks/RESULTS.md``).

    python benchmarks/personal_cost.py [--models tiny,small] [--steps 20] [--blocks 5] [--out F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _state_bytes(trainer) -> int:
    params = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    moments = sum(t.numel() * t.element_size() for st in trainer.optimizer.state.values() for t in st.values()
                  if hasattr(t, "numel"))
    return params + moments


def demo_trainers(model: str, *, count: int, steps: int, batch_size: int, seq_len: int):
    """``(initial model, train config, count trainers)``: copies of one initial ``model`` on CPU, one
    torch thread, each training on the same demo sub-corpus with the same batch stream (what a
    member's shared and personal models see). Shared with ``step_cost.py``."""
    import copy

    import torch

    from worldlm_p2p.config import TrainConfig, model_preset
    from worldlm_p2p.train import (ByteTokenizer, LocalTrainer, build_model, demo_data_dir, load_texts,
                                   peer_data_seed, tokenize_splits)

    torch.set_num_threads(1)
    sub = demo_data_dir() / "eu" / "nl_news"
    data = tokenize_splits(load_texts(sub), ByteTokenizer())
    train = TrainConfig(batch_size=batch_size, seq_len=seq_len, inner_steps=steps)
    base = build_model(model_preset(model), vocab_size=ByteTokenizer().vocab_size, seed=0)
    return base, train, [LocalTrainer(model=copy.deepcopy(base), train=train, data=data, device=torch.device("cpu"),
                                      seed=peer_data_seed(0, sub.name)) for _ in range(count)]


def measure(model: str, *, steps: int, blocks: int, batch_size: int, seq_len: int) -> dict:
    base, _, (shared, personal) = demo_trainers(model, count=2, steps=steps, batch_size=batch_size, seq_len=seq_len)
    step = 0
    for _ in range(3):  # warm-up: allocations, the optimizer's state
        shared.train_step(step)
        personal.train_step(step)
        step += 1
    one, two = [], []
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(steps):
            shared.train_step(step)
            step += 1
        one.append((time.perf_counter() - t0) / steps)
        t0 = time.perf_counter()
        for _ in range(steps):
            shared.train_step(step)
            personal.train_step(step)
            step += 1
        two.append((time.perf_counter() - t0) / steps)
    return dict(model=model, parameters=sum(p.numel() for p in base.parameters()), steps_per_block=steps,
                blocks=blocks, seconds_per_step_inline=statistics.median(one),
                seconds_per_step_separate=statistics.median(two),
                ratio=statistics.median(b / a for a, b in zip(one, two)),
                state_bytes_inline=_state_bytes(shared), state_bytes_separate=_state_bytes(shared) + _state_bytes(personal))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,small")
    ap.add_argument("--steps", type=int, default=20, help="training steps per block")
    ap.add_argument("--blocks", type=int, default=5, help="alternating blocks of each")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "personal_cost.json")
    args = ap.parse_args()
    if args.steps < 1 or args.blocks < 1:
        sys.exit("personal_cost.py: error: --steps and --blocks must be >= 1")
    from worldlm_p2p.config import MODEL_PRESETS

    unknown = [m.strip() for m in args.models.split(",") if m.strip() and m.strip() not in MODEL_PRESETS]
    if unknown or not args.models.strip():
        sys.exit(f"personal_cost.py: error: --models takes presets of {', '.join(MODEL_PRESETS)}, got {args.models!r}")
    rows = [measure(m.strip(), steps=args.steps, blocks=args.blocks, batch_size=args.batch_size, seq_len=args.seq_len)
            for m in args.models.split(",") if m.strip()]
    print("| model | parameters | s/step, one model | s/step, two models | ratio (median of blocks) | state, one | state, two |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['parameters']:,} | {r['seconds_per_step_inline']:.4f} | "
              f"{r['seconds_per_step_separate']:.4f} | {r['ratio']:.2f}x | {r['state_bytes_inline'] / 2**20:.1f} MiB | "
              f"{r['state_bytes_separate'] / 2**20:.1f} MiB |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(f".{args.out.name}.tmp")
    tmp.write_text(json.dumps(dict(rows=rows, batch_size=args.batch_size, seq_len=args.seq_len), indent=2))
    tmp.replace(args.out)


if __name__ == "__main__":
    main()
