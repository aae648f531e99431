#!/usr/bin/env python
"""Privacy benchmark: WorldLM and FedAvg with and without differential privacy, same token budget.

Every variant is one ``worldlm-simulate`` run (same corpus, model, seed, batch, number of rounds
and local steps, hence the same training tokens). Variants, for ``worldlm`` and ``fedavg`` each:

- no DP (the baselines);
- region-level (border) DP with noise multipliers 0.1, 0.5 and 1.0 at one clip norm C. For worldlm
  the leader's backbone change since the last world model is clipped to L2 norm C and noised with
  N(0, (sigma C)^2) per coordinate at every world round; for fedavg each region's mean change is
  clipped and noised at every round (the region is the privacy unit);
- peer-level DP-SGD (Opacus) at epsilon 8 (delta 1e-5, per-window clip 1.0), calibrated over the run.

Calibration of C: a first worldlm run with ``--region-dp-clip 1e9 --region-dp-noise 0`` (no clipping,
no noise: the mechanism is the identity, so this run is also the worldlm baseline) records the
unclipped norm of every border release; C is their median (``--region-clip`` overrides it). The
worldlm no-DP baseline is that run; ``--check-baseline`` also runs plain worldlm to verify it.

Reported: region-mean per-byte perplexity (mean over regions of the mean over each region's peers,
on their own held-out text), its ratio to the same strategy without DP, the border epsilon (RDP
accountant, delta 1e-5; every region spends the same) and the peer epsilon (max over peers).

Usage::

    python benchmarks/privacy.py [--data ../shared/data/corpus] [--jobs 2] [--out benchmarks/out/privacy.json]

Writes the raw results to ``--out`` and a Markdown report next to it (``.md``). Each run uses one
torch thread; ``--jobs`` runs go in parallel.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SHARED_CORPUS = REPO.parent / "shared" / "data" / "corpus"
STRATEGIES = ("worldlm", "fedavg")
SIGMAS = (0.1, 0.5, 1.0)
CALIBRATION = "worldlm:calibration"


def common_flags(args) -> list[str]:
    return ["--data", str(args.data), "--model", args.model, "--rounds", str(args.rounds),
            "--local-steps", str(args.local_steps), "--world-every", str(args.world_every), "--seed", str(args.seed),
            "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--lr", str(args.lr),
            "--eval-tokens", str(args.eval_tokens), "--threads", "1", "--device", "cpu", *args.extra]


def run_variant(name: str, flags: list[str], args, workdir: Path) -> dict[str, Any]:
    stem = name.replace(":", "_").replace("=", "")
    out, log = workdir / f"{stem}.json", workdir / f"{stem}.log"
    if out.exists() and args.workdir is not None:  # finished in an earlier invocation: reuse it
        res = json.loads(out.read_text())
        res["variant"], res["process_wall_seconds"], res["reused"] = name, res.get("wall_seconds", float("nan")), True
        res["command"] = res.get("command") or "(reused)"
        print(f"  {name}: reused {out}", flush=True)
        return res
    if args.workdir is not None and log.exists() and "error:" in log.read_text().strip().splitlines()[-1]:
        tail = log.read_text().strip().splitlines()[-3:]  # failed in an earlier invocation: reuse the failure
        raise RuntimeError(f"{name} failed (earlier run, {log.name}): {' | '.join(tail)}")
    if getattr(args, "only_reuse", False):
        raise FileNotFoundError(f"{name}: not in --only and no results in {workdir}")
    cmd = [sys.executable, "-m", "worldlm_p2p.cli.simulate", *common_flags(args), *flags, "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    t0 = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        tail = log.read_text().strip().splitlines()[-3:]
        raise RuntimeError(f"{name} failed (exit {proc.returncode}): {' | '.join(tail)}")
    res = json.loads(out.read_text())
    res["variant"], res["command"], res["process_wall_seconds"] = name, " ".join(cmd[1:]), wall
    out.write_text(json.dumps(res))
    print(f"  {name}: done in {wall:.0f} s", flush=True)
    return res


def region_dp_flags(sigma: float, clip: float) -> list[str]:
    return ["--region-dp-noise", str(sigma), "--region-dp-clip", repr(clip), "--region-dp-delta", str(args_delta)]


args_delta = 1e-5


def border_norms(res: dict[str, Any]) -> list[float]:
    return [rec["norm"] for w in res.get("world_rounds", []) for rec in (w.get("released") or {}).values()]


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def fmt_ppl(x: Any) -> str:
    if not finite(x):
        return "diverged"
    return f"{x:.3f}" if x < 1e4 else f"{x:.3g}"


def fmt_eps(x: Any) -> str:
    if x is None:
        return "-"
    if not finite(x):
        return "inf"
    return f"{x:.2f}" if x < 1e4 else f"{x:.3g}"


def region_mean(res: dict[str, Any]) -> float | None:
    vals = [res["regions"][r]["perplexity"] for r in sorted(res["regions"])]
    if any(not finite(v) for v in vals):
        return None
    return sum(vals) / len(vals)


def shared_coordinates(res: dict[str, Any], model: str) -> int | None:
    """Number of coordinates the border mechanism clips and noises for worldlm (all but K)."""
    try:
        from worldlm_p2p.config import MODEL_PRESETS
        from worldlm_p2p.train import ByteTokenizer, build_model

        m = build_model(MODEL_PRESETS[model], vocab_size=ByteTokenizer().vocab_size, seed=0)
        key = set(res.get("key_layers") or [])
        return sum(p.numel() for n, p in m.named_parameters() if n not in key)
    except Exception:  # noqa: BLE001 - informational only
        return None


def report(results: dict[str, dict[str, Any]], args, clip: float, calib: dict[str, Any], base: dict[str, str],
           total_wall: float) -> str:
    regions = sorted(calib["regions"])
    norms = border_norms(calib)
    n_total = calib.get("parameters")
    n_shared = shared_coordinates(calib, args.model)
    L: list[str] = []
    L += ["| strategy | DP setting | region-mean perplexity | vs same strategy without DP | border epsilon | "
          "peer epsilon (max) | wall s |", "|---|---|---:|---:|---:|---:|---:|"]
    rows = []
    for name, res in results.items():
        if name == CALIBRATION and base["worldlm"] != CALIBRATION:
            continue
        strategy = res["strategy"]
        setting = res.get("_setting", "none")
        if res.get("failed"):
            err = res["failed"].rsplit(":", 2)[-2:]
            rows.append((name, strategy, setting, None, "failed", None, None, None, True))
            L.append(f"| {strategy} | {setting} | diverged (run failed: {':'.join(err).strip()}) | - | - | - | - |")
            continue
        mean = region_mean(res)
        b = region_mean(results[base[strategy]])
        ratio = (f"{mean / b:.3f}x" if mean / b < 1e4 else f"{mean / b:.3g}x") if (mean is not None and b) else ("diverged" if mean is None else "-")
        border = [res["regions"][r].get("epsilon") for r in regions]
        border_eps = max(border, key=lambda e: -1 if e is None else e) if any(e is not None for e in border) else None
        peer = [res["regions"][r].get("peer_epsilon") for r in regions]
        peer_eps = max(e for e in peer if e is not None) if any(e is not None for e in peer) else None
        rows.append((name, strategy, setting, mean, ratio, border_eps, peer_eps, res["process_wall_seconds"],
                     len({e for e in border if e is not None}) <= 1))
        L.append(f"| {strategy} | {setting} | {fmt_ppl(mean)} | {ratio} | {fmt_eps(border_eps)} | "
                 f"{fmt_eps(peer_eps)} | {res['process_wall_seconds']:.0f} |")
    L += ["", "Per-region perplexity (per byte; mean over each region's peers):", "",
          "| strategy | DP setting | " + " | ".join(regions) + " |", "|---|---|" + "---:|" * len(regions)]
    for name, res in results.items():
        if (name == CALIBRATION and base["worldlm"] != CALIBRATION) or res.get("failed"):
            continue
        L.append(f"| {res['strategy']} | {res.get('_setting', 'none')} | "
                 + " | ".join(fmt_ppl(res["regions"][r]["perplexity"]) for r in regions) + " |")
    # notes on C
    L += ["", "Notes:", ""]
    if norms:
        L.append(f"- **Clip norm C = {clip:.4g}**"
                 + (" (set by --region-clip)" if args.region_clip is not None else
                    f" = the median unclipped L2 norm of the {len(norms)} border releases (leader's backbone "
                    f"change since the last world model, {len(norms) // max(1, len(regions))} world rounds x "
                    f"{len(regions)} regions) of the no-noise calibration run")
                 + f"; those norms range {min(norms):.4g}-{max(norms):.4g} (median {statistics.median(norms):.4g}). "
                 "About half of the worldlm releases are therefore clipped; fedavg clips each region's per-round "
                 "mean change to the same C (its norms are not recorded).")
    if n_shared or n_total:
        d = n_shared or n_total
        L.append(f"- The noise is N(0, (sigma C)^2) on every coordinate: {d:,} coordinates for worldlm (the backbone, "
                 f"all but K) and {n_total:,} for fedavg (the whole model). Its expected L2 norm is sigma C sqrt(d) = "
                 + ", ".join(f"{s * clip * math.sqrt(d):.3g} (sigma {s})" for s in SIGMAS)
                 + f" for worldlm, against a clipped signal of norm <= C = {clip:.3g}: sqrt(d) = {math.sqrt(d):.0f}, "
                 "so even sigma 0.1 adds noise ~" + f"{0.1 * math.sqrt(d):.0f}x the size of the update in norm, "
                 f"while per coordinate the noise std sigma C = {0.1 * clip:.3g}..{1.0 * clip:.3g} compares with an "
                 f"RMS update coordinate of about C / sqrt(d) = {clip / math.sqrt(d):.3g}. The world/round mean of the "
                 f"{len(regions)} regions' independent noises divides the noise std by about sqrt({len(regions)}).")
    L.append("- Border epsilon: the RDP accountant over all border releases of a region (worldlm: one per world "
             "round, " + f"{args.rounds // args.world_every} here; fedavg: one per round, {args.rounds} here), "
             f"delta {args_delta:g}; every region spends the same. Peer epsilon: Opacus' accountant for DP-SGD "
             "at each peer (Poisson sampling of windows), max over peers; DP-SGD was calibrated to epsilon 8 over "
             "the run's steps, delta 1e-5, per-window clip 1.0.")
    if base["worldlm"] == CALIBRATION:
        L.append("- The worldlm no-DP row is the calibration run (`--region-dp-clip 1e9 --region-dp-noise 0`: "
                 "nothing is clipped or noised, so its training is that of plain worldlm)"
                 + (": its perplexity equals the plain worldlm run's ("
                    f"{fmt_ppl(region_mean(results['worldlm:none']))})." if "worldlm:none" in results else "."))
    elif CALIBRATION in results:
        a, b = region_mean(results[CALIBRATION]), region_mean(results["worldlm:none"])
        L.append(f"- Check: the calibration run (no clipping, no noise) has region-mean perplexity {fmt_ppl(a)}, "
                 f"plain worldlm {fmt_ppl(b)}" + (" (equal)." if a is not None and b is not None and abs(a - b) < 1e-6 * b
                                                  else f" (not bit-equal: {100 * (a / b - 1):+.2f}%; the release "
                                                  "reference + (x - reference) rounds differently from x in float32, "
                                                  "and training amplifies such differences). The ratios use the "
                                                  "plain worldlm run."))
    tokens = next(iter(results.values())).get("tokens")
    L.append(f"- Same token budget for every run: {args.rounds} region rounds x H={args.local_steps} steps x batch "
             f"{args.batch_size}x{args.seq_len}" + (f" ({tokens:,} training tokens in all without DP-SGD; DP-SGD's "
                                                    "Poisson batches have the same expected size)" if tokens else "")
             + f"; world round every {args.world_every} region rounds; seed {args.seed}; "
             f"{args.jobs} runs at a time, one torch thread each.")
    return "\n".join(L), rows


def main() -> None:
    global args_delta
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=SHARED_CORPUS if SHARED_CORPUS.is_dir() else None,
                   help="federated corpus (default ../shared/data/corpus, else the bundled demo slice)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--world-every", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--region-clip", type=float, help="border clip norm C (default: calibrated, see above)")
    p.add_argument("--region-delta", type=float, default=1e-5)
    p.add_argument("--peer-epsilon", type=float, default=8.0)
    p.add_argument("--check-baseline", action="store_true", help="also run plain worldlm (check of the calibration run)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--workdir", type=Path, help="keep the runs' files here (default: a temporary folder); runs whose "
                   "results are already there are reused, not rerun")
    p.add_argument("--only", help="comma-separated variant names to run (the others are only reused from --workdir)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "privacy.json")
    p.add_argument("extra", nargs="*", help="extra worldlm-simulate flags for every run (after --)")
    args = p.parse_args()
    args_delta = args.region_delta
    if args.data is None:
        from worldlm_p2p.train import demo_data_dir

        args.data = demo_data_dir()
    peer_flags = ["--peer-dp-epsilon", str(args.peer_epsilon), "--peer-dp-delta", "1e-5", "--peer-dp-clip", "1.0"]
    t0 = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    settings: dict[str, str] = {}
    only = set(args.only.split(",")) if args.only else None

    def submit(name, flags):
        if only is not None and name not in only:
            return pool.submit(run_variant, name, flags, argparse.Namespace(**{**vars(args), "only_reuse": True}), work)
        return pool.submit(run_variant, name, flags, args, work)

    with tempfile.TemporaryDirectory(prefix="worldlm-privacy-") as tmp, ThreadPoolExecutor(max_workers=args.jobs) as pool:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        futures = {}
        if args.region_clip is None or not args.check_baseline:
            futures[CALIBRATION] = submit(CALIBRATION, [
                "--strategy", "worldlm", "--region-dp-clip", "1e9", "--region-dp-noise", "0"])
            settings[CALIBRATION] = "none (calibration: clip 1e9, noise 0)"
        independent = [("fedavg:none", ["--strategy", "fedavg"], "none")]
        if args.check_baseline:
            independent.insert(0, ("worldlm:none", ["--strategy", "worldlm"], "none"))
        independent += [(f"{s}:dpsgd", ["--strategy", s, *peer_flags],
                         f"peer DP-SGD eps {args.peer_epsilon:g} (delta 1e-5, clip 1.0)") for s in STRATEGIES]
        print(f"privacy benchmark on {args.data}, {args.jobs} runs at a time", flush=True)
        for name, flags, setting in independent:
            futures[name] = submit(name, flags)
            settings[name] = setting
        if args.region_clip is None:
            calib = futures[CALIBRATION].result()
            norms = border_norms(calib)
            clip = float(statistics.median(norms))
            print(f"  calibrated C = {clip:.6g} (median of {len(norms)} border norms, "
                  f"{min(norms):.4g}-{max(norms):.4g})", flush=True)
        else:
            clip = args.region_clip
        for s in STRATEGIES:
            for sigma in SIGMAS:
                name = f"{s}:region-sigma{sigma:g}"
                futures[name] = submit(name, ["--strategy", s, *region_dp_flags(sigma, clip)])
                settings[name] = f"region sigma {sigma:g}, C {clip:.3g}"
        for name, f in futures.items():
            try:
                results[name] = f.result()
            except FileNotFoundError as e:
                print(f"  {name}: MISSING ({e})", flush=True)
                continue
            except RuntimeError as e:  # a run that crashed (e.g. overflow once the model diverged)
                print(f"  {name}: FAILED ({e})", flush=True)
                results[name] = dict(strategy=name.split(":")[0], failed=str(e), regions={}, process_wall_seconds=None)
            results[name]["_setting"] = settings[name]
    total_wall = time.monotonic() - t0
    # display order: per strategy, none, region sigma 0.1/0.5/1.0, dpsgd
    base = {"worldlm": "worldlm:none" if "worldlm:none" in results else CALIBRATION, "fedavg": "fedavg:none"}
    order = [CALIBRATION] if CALIBRATION in results else []
    order += ["worldlm:none"] if "worldlm:none" in results else []
    order += [f"worldlm:region-sigma{s:g}" for s in SIGMAS] + ["worldlm:dpsgd", "fedavg:none"]
    order += [f"fedavg:region-sigma{s:g}" for s in SIGMAS] + ["fedavg:dpsgd"]
    missing = [n for n in order if n not in results]
    results = {n: results[n] for n in order if n in results}
    if base["worldlm"] == CALIBRATION:
        results[CALIBRATION]["_setting"] = "none (= calibration run: clip 1e9, noise 0)"
    calib = results[CALIBRATION] if CALIBRATION in results else results["worldlm:none"]
    text, rows = report(results, args, clip, calib, base, total_wall)
    if missing:
        text += "\n- NOT FINISHED (no results): " + ", ".join(missing) + "."
    n_reused = sum(bool(r.get("reused")) for r in results.values())
    header = (f"Command: `python benchmarks/privacy.py {' '.join(sys.argv[1:])}`\n\n"
              f"Data {args.data}; model {args.model}; batch {args.batch_size}x{args.seq_len}; H={args.local_steps}; "
              f"{args.rounds} region rounds; world round every {args.world_every} region rounds; seed {args.seed}; "
              f"machine {platform.node()} ({os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, CPU "
              f"only); wall time {total_wall:.0f} s"
              + (f" ({n_reused} of the runs reused from --workdir {args.workdir}; the wall s column gives each run's "
                 "own duration)" if n_reused else "") + ".\n")
    print(header + "\n" + text, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(
        args={k: str(v) for k, v in vars(args).items()}, clip=clip, clip_calibrated=args.region_clip is None,
        calibration_border_norms=border_norms(calib), wall_seconds=total_wall, baselines=base,
        summary=[dict(variant=r[0], strategy=r[1], setting=r[2], region_mean_perplexity=r[3], vs_no_dp=r[4],
                      border_epsilon=r[5], peer_epsilon=r[6], wall_seconds=r[7]) for r in rows],
        results=results), indent=1, allow_nan=True))
    args.out.with_suffix(".md").write_text(header + "\n" + text + "\n")


if __name__ == "__main__":
    main()
