"""What the optimizer costs a training step on CPU: the fused AdamW the trainer uses against the
foreach AdamW it used before (issue 10's study cost, issue 14's tokens/s).

For small models on CPU a training step is dominated by per-operator overhead, and the foreach
AdamW (several kernels per parameter group and moment) was about 15% of a `tiny` step. This
measures, in one process on one torch thread, the seconds per step of the product's
:class:`~worldlm_p2p.train.LocalTrainer` (fused AdamW on CPU and CUDA, without DP-SGD) and of the
same trainer with its optimizer rebuilt as the foreach AdamW, in alternating blocks so that the
machine's noise hits both alike; it reports the median ratio over blocks, and how far the two
models' parameters lie apart after one step (the two optimizers round differently) and after all the
steps (training amplifies that rounding, as it does any).

    python benchmarks/step_cost.py [--models tiny,small] [--steps 20] [--blocks 5] [--out F]
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
sys.path.insert(0, str(REPO / "benchmarks"))  # personal_cost's demo trainers


def measure(model: str, *, steps: int, blocks: int, batch_size: int, seq_len: int) -> dict:
    import torch

    from personal_cost import demo_trainers
    from worldlm_p2p.train import trainer as trainer_module

    base, train, (fused, foreach) = demo_trainers(model, count=2, steps=steps, batch_size=batch_size, seq_len=seq_len)
    if not fused.optimizer.defaults.get("fused"):
        raise SystemExit("step_cost.py: error: the trainer's AdamW is not the fused one on this device")
    foreach.optimizer = torch.optim.AdamW(trainer_module._param_groups(foreach.model, train.weight_decay),
                                          lr=fused.optimizer.param_groups[0]["lr"], betas=(train.beta1, train.beta2),
                                          eps=1e-8, foreach=True)
    times: dict[str, list[float]] = {"fused": [], "foreach": []}
    step = {"fused": 0, "foreach": 0}
    trainers = {"fused": fused, "foreach": foreach}

    def apart() -> float:
        return max(float((a.detach() - b.detach()).abs().max()) for a, b in zip(fused.model.parameters(),
                                                                               foreach.model.parameters()))

    first = None
    for _ in range(3):  # warm-up: allocations, the optimizer's state
        for name, t in trainers.items():
            t.train_step(step[name])
            step[name] += 1
        first = apart() if first is None else first  # after one step: the two optimizers' rounding
    for _ in range(blocks):
        for name, t in trainers.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                t.train_step(step[name])
                step[name] += 1
            times[name].append((time.perf_counter() - t0) / steps)
    diff = apart()  # after all the steps: that rounding, amplified by training (a chaotic map)
    return dict(model=model, parameters=sum(p.numel() for p in base.parameters()), steps_per_block=steps,
                blocks=blocks, seconds_per_step_fused=statistics.median(times["fused"]),
                seconds_per_step_foreach=statistics.median(times["foreach"]),
                ratio=statistics.median(a / b for a, b in zip(times["fused"], times["foreach"])),
                steps_each=step["fused"], max_param_diff_first_step=first, max_param_diff=diff)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,small")
    ap.add_argument("--steps", type=int, default=20, help="training steps per block")
    ap.add_argument("--blocks", type=int, default=5, help="alternating blocks of each")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "step_cost.json")
    args = ap.parse_args()
    if args.steps < 1 or args.blocks < 1:
        sys.exit("step_cost.py: error: --steps and --blocks must be >= 1")
    from worldlm_p2p.config import MODEL_PRESETS

    unknown = [m.strip() for m in args.models.split(",") if m.strip() and m.strip() not in MODEL_PRESETS]
    if unknown or not args.models.strip():
        sys.exit(f"step_cost.py: error: --models takes presets of {', '.join(MODEL_PRESETS)}, got {args.models!r}")
    rows = [measure(m.strip(), steps=args.steps, blocks=args.blocks, batch_size=args.batch_size, seq_len=args.seq_len)
            for m in args.models.split(",") if m.strip()]
    print("| model | parameters | s/step, fused AdamW | s/step, foreach AdamW | fused / foreach (median of blocks) "
          "| largest parameter difference after one step | after all steps |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['parameters']:,} | {r['seconds_per_step_fused']:.4f} | "
              f"{r['seconds_per_step_foreach']:.4f} | {r['ratio']:.3f} | {r['max_param_diff_first_step']:.1e} | "
              f"{r['max_param_diff']:.1e} "
              f"({r['steps_each']} steps) |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(f".{args.out.name}.tmp")
    tmp.write_text(json.dumps(dict(rows=rows, batch_size=args.batch_size, seq_len=args.seq_len), indent=2))
    tmp.replace(args.out)


if __name__ == "__main__":
    main()
