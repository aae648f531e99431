#!/usr/bin/env python
"""The prepared GPU check (issue 14): the CUDA path, in one short run (``benchmarks/gpu_check.sh``).

1. **Presets alone.** For each preset (default ``small`` and ``base``) the trainer a peer builds
   (:func:`worldlm_p2p.peer.joining.build_local`: bf16 autocast on CUDA) trains ``--steps`` steps
   on the bundled demo data after ``--warmup`` steps: tokens/s (steady: from the first timed step,
   synchronised), peak GPU memory (``torch.cuda.max_memory_allocated``), the loss before and
   after (it must fall), and how long a copy of the model to the host and back takes, as a round
   makes it (pinned host memory on CUDA) and as plain per-tensor copies.
2. **A 2-peer region on one GPU.** ``worldlm-bootstrap`` and two ``worldlm-peer`` processes
   (:class:`worldlm_p2p.swarm.LocalSwarm`, ``--device`` for both) of ``--swarm-preset`` for
   ``--swarm-steps`` steps with H = ``--inner-steps``: each peer's tokens/s, its rounds and the
   median round time (from its summary).

Prints one Markdown table per part and writes every number to ``--out`` (default
``benchmarks/out/gpu_check.json``). With ``--device cpu`` (and e.g. ``--presets tiny``) the same
script checks itself on a machine without a GPU; its figures then say nothing of a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def manifest(preset: str, *, run_id: str, batch_size: int, seq_len: int, inner_steps: int):
    from worldlm_p2p.config import RunManifest

    return RunManifest.from_dict({
        "run_id": run_id, "model": {"preset": preset},
        "train": {"inner_steps": inner_steps, "batch_size": batch_size, "seq_len": seq_len, "eval_tokens": 4096},
        "averaging": {"matchmaking_time": 2.0, "request_timeout": 1.0, "averaging_timeout": 60.0,
                      "barrier_timeout": 120.0},
    })


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_times(model, repeats: int = 5) -> dict:
    """Seconds (median of ``repeats``) to copy the model's parameters to the host and back as a round
    does (:func:`~worldlm_p2p.train.get_flat_params`, :func:`~worldlm_p2p.train.set_params`: through
    pinned host memory on CUDA, one wait per copy of the model) and as plain per-tensor copies
    through pageable memory (what the product did before)."""
    import torch

    from worldlm_p2p.train import get_flat_params, set_params

    params = list(model.parameters())
    device = params[0].device

    def timed(fn) -> float:
        seconds = []
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            seconds.append(time.perf_counter() - t0)
        return statistics.median(seconds)

    snapshot = get_flat_params(model)
    plain = [p.detach().to("cpu", copy=True) for p in params]

    @torch.no_grad()
    def plain_set() -> None:
        for p, t in zip(params, plain):
            p.copy_(t)

    return dict(to_host_s=timed(lambda: get_flat_params(model)),
                to_host_plain_s=timed(lambda: [p.detach().to("cpu", copy=True) for p in params]),
                to_device_s=timed(lambda: set_params(model, snapshot)), to_device_plain_s=timed(plain_set))


def train_alone(preset: str, args) -> dict:
    """The preset trained alone twice from the same start: steps that read their loss back (the
    synchronous step) and deferred steps (``train_step(defer=True)``, the peer's on CUDA: no
    host-device round trip, the losses read once at the end)."""
    import torch

    from worldlm_p2p.config import PeerConfig
    from worldlm_p2p.peer.joining import build_local
    from worldlm_p2p.train import demo_data_dir, load_texts, resolve_steps
    from worldlm_p2p.train.corpus import list_corpus

    data = sorted(p for ps in list_corpus(demo_data_dir()).values() for p in ps)[0]
    m = manifest(preset, run_id=f"gpu-{preset}", batch_size=args.batch_size, seq_len=args.seq_len, inner_steps=10)
    out: dict = dict(preset=preset)
    for mode, defer in (("sync", False), ("deferred", True)):
        local = build_local(PeerConfig(region="eu", data=str(data), label=f"gpu-{preset}", device=args.device), m,
                            load_texts(data))
        trainer = local.trainer
        device = next(local.model.parameters()).device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        results = [trainer.train_step(step, defer=defer) for step in range(args.warmup)]
        _sync(device)
        t0 = time.perf_counter()
        timed = [trainer.train_step(step, defer=defer) for step in range(args.warmup, args.warmup + args.steps)]
        _sync(device)
        seconds = time.perf_counter() - t0
        results = resolve_steps(results + timed)
        tokens = sum(r.tokens for r in timed)
        out.update(device=str(device), parameters=sum(p.numel() for p in local.model.parameters()), steps=args.steps,
                   tokens=tokens, first_loss=results[0].loss, last_loss=results[-1].loss,
                   skipped=sum(r.skipped for r in results))
        out[mode] = dict(seconds=seconds, tokens_per_s=tokens / seconds,
                         peak_memory_gib=(torch.cuda.max_memory_allocated(device) / 2 ** 30
                                          if device.type == "cuda" else None))
        if defer:
            out["copies"] = copy_times(local.model)
        del local, trainer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out["tokens_per_s"] = out["deferred"]["tokens_per_s"]
    out["peak_memory_gib"] = out["deferred"]["peak_memory_gib"]
    return out


def region_of_two(args, out: Path) -> dict:
    from worldlm_p2p.swarm import LocalSwarm, SwarmConfig
    from worldlm_p2p.train import demo_data_dir

    m = manifest(args.swarm_preset, run_id="gpu-region", batch_size=args.batch_size, seq_len=args.seq_len,
                 inner_steps=args.inner_steps)
    cfg = SwarmConfig(regions={"eu": 2}, data=demo_data_dir(), out=out, manifest=m, max_steps=args.swarm_steps,
                      threads_per_peer=2, device=args.device, checkpoints=False)
    t0 = time.monotonic()
    with LocalSwarm(config=cfg) as swarm:
        swarm.start()
        deadline = time.monotonic() + args.swarm_timeout
        swarm.wait(should_stop=lambda: time.monotonic() > deadline)
    summaries = sorted((out / "peers").glob("*.json"))
    if len(summaries) < 2 or any(not json.loads(p.read_text()).get("rounds_completed") for p in summaries):
        for log in sorted((out / "logs").glob("*.log")):  # say why, before the temporary folder goes
            print(f"--- {log.name} (last 25 lines)\n" + "\n".join(log.read_text(errors="replace").splitlines()[-25:]),
                  file=sys.stderr, flush=True)
    peers = {}
    for path in summaries:
        s = json.loads(path.read_text())
        rs = s.get("round_seconds") or []
        h = s.get("history") or []  # a point every H steps, before the round: between them, H steps and a round
        steady = ((h[-1]["tokens"] - h[0]["tokens"]) / (h[-1]["time"] - h[0]["time"])
                  if len(h) >= 2 and h[-1]["time"] > h[0]["time"] else None)
        peers[path.stem] = dict(tokens_per_s=s.get("tokens_per_s"), steady_tokens_per_s=steady, steps=s.get("steps"),
                                rounds=s.get("rounds_completed"), median_round_s=statistics.median(rs) if rs else None)
    return dict(preset=args.swarm_preset, device=args.device, steps=args.swarm_steps, inner_steps=args.inner_steps,
                wall_s=time.monotonic() - t0, peers=peers)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu to check the script itself")
    p.add_argument("--presets", default="small,base")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--swarm-preset", default="small")
    p.add_argument("--swarm-steps", type=int, default=200)
    p.add_argument("--inner-steps", type=int, default=50)
    p.add_argument("--swarm-timeout", type=float, default=240.0)
    p.add_argument("--no-region", action="store_true", help="the presets alone only (e.g. at another batch size)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "gpu_check.json")
    args = p.parse_args()
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("gpu_check.py: error: no CUDA device here (give --device cpu to check the script itself)")
    result: dict = dict(device=args.device, torch=torch.__version__,
                        gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, alone=[])
    lines = [f"GPU check on {result['gpu'] or 'cpu'} (torch {torch.__version__}), batch {args.batch_size} x "
             f"{args.seq_len}", "",
             "| preset | parameters | tokens/s, deferred steps (synchronous) | deferred / synchronous | peak GPU memory "
             "| loss first -> last | model to host, ms: pinned (plain) | model to device, ms: pinned (plain) |",
             "|---|---:|---:|---:|---:|---|---:|---:|"]
    for preset in [x for x in args.presets.split(",") if x]:
        r = train_alone(preset, args)
        result["alone"].append(r)
        mem = f"{r['peak_memory_gib']:.2f} GiB" if r["peak_memory_gib"] is not None else "-"
        c = r["copies"]
        lines.append(f"| {preset} | {r['parameters'] / 1e6:.1f} M | {r['tokens_per_s']:.0f} "
                     f"({r['sync']['tokens_per_s']:.0f}) | {r['tokens_per_s'] / r['sync']['tokens_per_s']:.2f} | {mem} | "
                     f"{r['first_loss']:.3f} -> {r['last_loss']:.3f} | {c['to_host_s'] * 1e3:.1f} "
                     f"({c['to_host_plain_s'] * 1e3:.1f}) | {c['to_device_s'] * 1e3:.1f} ({c['to_device_plain_s'] * 1e3:.1f}) |")
        print(lines[-1], flush=True)
    if args.no_region:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print("\n".join(lines))
        return
    with tempfile.TemporaryDirectory(prefix="worldlm-gpu-check-") as tmp:
        result["region"] = region = region_of_two(args, Path(tmp))
    lines += ["", f"2-peer region ({region['preset']}, H = {region['inner_steps']}, {region['steps']} steps, "
                  f"{region['wall_s']:.0f} s)", "",
              "| peer | tokens/s between its first and last history points (rounds included) | tokens/s since "
              "training started (waits for the other peer included) | rounds | median round s |",
              "|---|---:|---:|---:|---:|"]
    for label, r in region["peers"].items():
        lines.append(f"| {label} | {r['steady_tokens_per_s'] or 0:.0f} | {r['tokens_per_s'] or 0:.0f} | {r['rounds']} | "
                     f"{r['median_round_s'] or 0:.2f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    from worldlm_p2p.errors import ConfigError, DataError

    try:
        main()
    except (ConfigError, DataError) as e:
        sys.exit(f"gpu_check.py: error: {e}")
