#!/usr/bin/env python
"""Utilisation benchmark: does training wait for the network? (issue 14)

**Utilisation** = a swarm peer's training tokens/s (``tokens_per_s`` of its summary: tokens over the
wall time of its training loop, rounds and barriers included) divided by the tokens/s of the same
number of *alone* processes training at once on this machine (same model, batch, steps, one torch
thread each, no network), both measured in this run, one right after the other (the machine is
shared and noisy: only ratios mean anything).

For each configuration ``model:peers:H`` (one region of that many real ``worldlm-peer`` processes
on 127.0.0.1, started by :class:`worldlm_p2p.swarm.LocalSwarm`) it runs the alone baseline, then one
swarm per *variant*:

- ``sync``: today's default, a round every H steps of each member, training waits for it;
- ``overlap``: ``aggregation.overlap`` (the round runs on a snapshot while the next H steps train);
- ``overlap-tokens``: ``overlap`` plus ``aggregation.schedule = "tokens"`` (rounds due by the
  region's tokens; a round in flight is never waited for).
- ``overlap-ev5``, ``overlap-tokens-ev5``: ``overlap``, ``overlap-tokens`` with
  ``aggregation.evidence_share = 0.05`` (a member's evidence searches take about 5% of its compute;
  in between it takes its last weights again).

A variant may end in ``+niceN`` (``overlap-tokens+nice19``): the same, with every peer's background
work (its round threads, its hivemind and p2pd processes) at nice value N (``worldlm-peer
--background-nice N``, :mod:`worldlm_p2p.net.priority`).

It reports utilisation, round time, the share of rounds with the whole region, the time the
training loop stood still for rounds (``seconds_in_rounds``), bytes on the wire per million training
tokens (the kernel's counters of every process of the peer: ``wire_sent``), against the bytes a
per-step data-parallel ring all-reduce of the same model would send (computed: ``2 (n-1)/n x 4 x
params`` per step), and where the machine's cores went (training processes, hivemind's DHT and
averager processes, p2pd, bootstrap).

``--slow`` adds the mixed-speed scenario: the same region with one member twice as slow
(``worldlm-peer --slowdown 2``): the fast member's utilisation, and the share of its rounds that
the slow one took part in.

Usage::

    python benchmarks/perf.py --quick                      # tiny:2:10, both variants, slow (~6 min)
    python benchmarks/perf.py                              # the issue's grid (tiny/small, 2/4 peers, H 10/50)
    python benchmarks/perf.py --configs tiny:2:10 --variants sync,overlap-tokens --rounds 8

Writes ``--out`` (JSON, every peer summary included) and prints a Markdown table. It asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from swarm import (REGION, THREADS, _CpuSampler, _fmt, _median, _quantile, machine, make_corpus,  # noqa: E402
                   run_alone, versions)

VARIANTS = {
    "sync": {},
    "overlap": {"overlap": True},
    "overlap-tokens": {"overlap": True, "schedule": "tokens"},
    # overlap-tokens, the members' evidence searches held to 5% of their compute (reusing their last
    # weights in between: aggregation.evidence_share)
    "overlap-tokens-ev5": {"overlap": True, "schedule": "tokens", "evidence_share": 0.05},
    "overlap-ev5": {"overlap": True, "evidence_share": 0.05},
    # the same peers with no round ever due (H = 10^6, the steps as the others'): what a swarm peer's
    # own upkeep costs its training (progress records, the lease, the DHT and p2pd processes), rounds apart
    "no-rounds": {},
}
NO_ROUNDS_H = 10**6


def split_variant(name: str) -> tuple[str, int]:
    """``"overlap-tokens+nice19"`` -> ``("overlap-tokens", 19)``; ``ValueError`` for an unknown one."""
    base, plus, nice = name.partition("+nice")
    if base not in VARIANTS or (plus and not (nice.isdigit() and 0 <= int(nice) <= 19)):
        raise ValueError(f"unknown variant {name!r}: choose from {', '.join(VARIANTS)}, each optionally with "
                         "+niceN (N from 0 to 19), e.g. overlap-tokens+nice19")
    return base, int(nice) if plus else 0
#: a run during which processes other than the swarm's took more cores than this is marked as not
#: clean (these machines are shared: a figure taken next to another job is not one of ours)
NOISY_OTHER_CORES = 0.2
FULL_CONFIGS = "tiny:2:10,tiny:2:50,tiny:4:10,tiny:4:50,small:2:10,small:2:50,small:4:50"
QUICK_CONFIGS = "tiny:2:10"


def manifest(args, *, model: str, H: int, run_id: str, aggregation: dict[str, Any]):
    from worldlm_p2p.config import RunManifest

    return RunManifest.from_dict({
        "run_id": run_id,
        "model": {"preset": model},
        "train": {"inner_steps": H, "batch_size": args.batch_size, "seq_len": args.seq_len, "eval_tokens": 2048},
        "averaging": {"averaging_timeout": args.averaging_timeout, "barrier_timeout": args.barrier_timeout,
                      **({"matchmaking_time": args.matchmaking_time} if args.matchmaking_time is not None else {}),
                      **({"request_timeout": args.request_timeout} if args.request_timeout is not None else {})},
        # one model per peer (personal_model "inline"): utilisation measures what the network costs a
        # peer's training; the default's second, personal model doubles the training compute per token
        # whatever the network does (benchmarks/personal_cost.py measures that apart); --set
        # personal_model=separate measures the default
        "aggregation": {"personal_model": "inline", **aggregation, "compress_backbone": args.compress,
                        "compress_key": args.compress, **args.set},
    })


def parameters(model: str) -> int:
    from worldlm_p2p.config import model_preset
    from worldlm_p2p.train import build_model

    return sum(p.numel() for p in build_model(model_preset(model), vocab_size=259, seed=0).parameters())


def regions_corpus(root: Path, sizes: dict[str, int]) -> Path:
    """A federated corpus ``root/<region>/<sub>`` with ``sizes[region]`` sub-corpora each: symlinks into
    the bundled demo slice (18 sub-corpora), dealt out in alphabetical order."""
    from worldlm_p2p.train import demo_data_dir, list_corpus

    subs = sorted((p for paths in list_corpus(demo_data_dir()).values() for p in paths), key=lambda p: p.name)
    if sum(sizes.values()) > len(subs):
        raise SystemExit(f"the demo corpus has only {len(subs)} sub-corpora, not {sum(sizes.values())}")
    it = iter(subs)
    for region, n in sizes.items():
        (root / region).mkdir(parents=True, exist_ok=True)
        for _ in range(n):
            sub = next(it)
            link = root / region / sub.name
            if not link.exists():
                link.symlink_to(sub.resolve(), target_is_directory=True)
    return root


def run_swarm(args, *, model: str, regions: dict[str, int], H: int, variant: str, corpus: Path, tmp: Path,
              slow: str | None = None) -> dict[str, Any]:
    from worldlm_p2p.swarm import LocalSwarm, SwarmConfig

    n = sum(regions.values())
    shape = "+".join(str(k) for k in regions.values())
    tag = f"{model}-{shape}-{H}-{variant}{'-slow' if slow else ''}"
    base, nice = split_variant(variant)
    m = manifest(args, model=model, H=NO_ROUNDS_H if base == "no-rounds" else H,
                 run_id=f"perf-{tag}".replace(".", "_").replace("+", "x"), aggregation=VARIANTS[base])
    labels = {f"{r}-{d.name}": r for r in regions for d in sorted((corpus / r).iterdir())[:regions[r]]}
    config = SwarmConfig(regions=dict(regions), data=corpus, out=tmp / tag, manifest=m, max_steps=H * args.rounds,
                         threads_per_peer=THREADS, checkpoints=False, startup_timeout=120.0, stop_timeout=30.0,
                         # every peer starts training once its region is live (start-up skew is
                         # benchmarks/swarm.py's subject, not this one's)
                         peer_args={label: ("--wait-for-peers", str(regions[r]),
                                            *(("--slowdown", "2") if label == slow else ()),
                                            *(("--background-nice", str(nice)) if nice else ()))
                                    for label, r in labels.items()})
    swarm = LocalSwarm(config=config)
    deadline = time.monotonic() + args.swarm_timeout
    first_exit: list[float] = []

    def stop_waiting() -> bool:
        if not first_exit and len(swarm.running()) < n:
            first_exit.append(time.monotonic())
        return time.monotonic() > deadline

    with swarm:
        t0 = time.monotonic()
        swarm.start()
        sampler = _CpuSampler(swarm)
        try:
            swarm.wait(poll=0.2, should_stop=stop_waiting)
            timed_out = bool(swarm.running())
            t1 = time.monotonic()
            # where the cores went while every peer ran (a process that exited takes its counters
            # with it): from the first sample to the last one before a peer exited
            cpu = sampler.window(sampler.samples[0][0] if sampler.samples else t0,
                                 (first_exit or [t1])[0] - 0.6)
        finally:
            sampler.close()
    peers = swarm.summary()["peers"]
    ok = [p for p in peers if p.get("exit_code") == 0 and p.get("tokens")]
    per_peer = []
    for p in ok:
        groups = p.get("group_sizes") or []
        size = regions.get(p.get("region"), n)
        per_peer.append(dict(
            label=p["label"], region=p.get("region"), slow=p["label"] == slow, steps=p.get("steps"),
            tokens=p["tokens"], tokens_per_s=p.get("tokens_per_s"), rounds_completed=p.get("rounds_completed"),
            rounds_failed=p.get("rounds_failed"), rounds_partial=p.get("rounds_partial"),
            full_group_share=(sum(1 for g in groups if g == size) / len(groups)) if groups else None,
            round_seconds=p.get("round_seconds") or [], seconds_in_rounds=p.get("seconds_in_rounds"),
            world_rounds_led=p.get("world_rounds_led"), world_rounds_adopted=p.get("world_rounds_adopted"),
            wire_sent=p.get("wire_sent"), wire_received=p.get("wire_received"),
            bytes_sent=p.get("bytes_sent"), valid_loss=p.get("valid_loss")))
    rs = [x for q in per_peer for x in q["round_seconds"][1:]]
    fast = [q for q in per_peer if not q["slow"]]
    wire = [q["wire_sent"] / q["tokens"] * 1e6 for q in per_peer if q.get("wire_sent") not in (None, -1)]
    return dict(model=model, peers=n, regions=dict(regions), H=H, variant=variant, slow=slow, timed_out=timed_out,
                wall_s=t1 - t0, failed_peers=len(peers) - len(ok), per_peer=per_peer,
                tokens_per_s_median=_median(q["tokens_per_s"] for q in fast),
                valid_loss_median=_median(q["valid_loss"] for q in per_peer if q.get("valid_loss") is not None),
                round_seconds_median=_median(rs), round_seconds_p90=_quantile(rs, 0.9),
                rounds_completed_median=_median(q["rounds_completed"] for q in fast),
                rounds_failed_total=sum(q["rounds_failed"] or 0 for q in per_peer),
                rounds_partial_total=sum(q["rounds_partial"] or 0 for q in per_peer),
                full_group_share_median=_median(q["full_group_share"] for q in fast),
                seconds_in_rounds_median=_median(q["seconds_in_rounds"] for q in fast),
                world_rounds_led=sum(q["world_rounds_led"] or 0 for q in per_peer),
                world_rounds_adopted_median=_median(q["world_rounds_adopted"] for q in per_peer),
                wire_sent_per_mtok_median=_median(wire), cpu=cpu,
                raw_summaries=peers)


def run_idle(args, *, n: int, seconds: float, corpus: Path, tmp: Path) -> dict[str, Any]:
    """Where a peer's cores go between rounds: ``n`` peers of one region whose rounds are never due
    (H = 10^6) and whose training is slowed 100 times (``--slowdown 100``), sampled for ``seconds``
    after a start-up of 30 s: progress records, the leader lease, the DHT's upkeep, p2pd."""
    from worldlm_p2p.swarm import LocalSwarm, SwarmConfig

    m = manifest(args, model="tiny", H=10**6, run_id="perf-idle", aggregation={})
    labels = [f"{REGION}-{d.name}" for d in sorted((corpus / REGION).iterdir())[:n]]
    config = SwarmConfig(regions={REGION: n}, data=corpus, out=tmp / f"idle-{n}", manifest=m, max_steps=10**6,
                         threads_per_peer=THREADS, checkpoints=False, startup_timeout=120.0, stop_timeout=30.0,
                         peer_args={label: ("--slowdown", "100") for label in labels})
    swarm = LocalSwarm(config=config)
    with swarm:
        swarm.start()
        sampler = _CpuSampler(swarm, period=1.0)
        try:
            time.sleep(30.0)
            t0 = time.monotonic()
            time.sleep(seconds)
            cpu = sampler.window(t0, time.monotonic())
        finally:
            sampler.close()
    return dict(peers=n, seconds=seconds, cpu=cpu)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"configs {QUICK_CONFIGS}, 12 rounds, with --slow")
    p.add_argument("--configs", help=f"model:peers:H,... (default {FULL_CONFIGS})")
    p.add_argument("--variants", default="sync,overlap-tokens", help=f"of {', '.join(VARIANTS)}")
    p.add_argument("--slow", action="store_true", help="also the mixed-speed scenario (a member twice as slow)")
    p.add_argument("--idle", type=float, metavar="SECONDS",
                   help="instead of the configs: where the cores of a region of the first config's peers go "
                        "between rounds (no round due, training slowed 100x), sampled for SECONDS")
    p.add_argument("--scale", metavar="RxN",
                   help="instead of the configs: one swarm of R regions of N peers each (e.g. 4x4), world rounds "
                        "on, the first config's model and H, the last variant given")
    p.add_argument("--rounds", type=int, help="region rounds' worth of steps per peer (default 8, --quick 12)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--compress", default="fp16", choices=("none", "fp16", "int8"), help="the region rounds' codec")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an [aggregation] setting for every variant, e.g. mix=none (the evidence search's cost "
                        "apart) or strategy=fedavg; repeatable")
    # the product's defaults (averaging.matchmaking_time 3 s, request_timeout 1 s) unless told otherwise;
    # until 2026-12-06 this script used 1.5 s and 0.5 s, which split the 16-peer regions (RESULTS.md)
    p.add_argument("--matchmaking-time", type=float, default=None, help="averaging.matchmaking_time (default: the product's)")
    p.add_argument("--request-timeout", type=float, default=None, help="averaging.request_timeout (default: the product's)")
    p.add_argument("--averaging-timeout", type=float, default=30.0)
    p.add_argument("--barrier-timeout", type=float, default=30.0)
    p.add_argument("--swarm-timeout", type=float, default=900.0, help="give up on one swarm after this long")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "perf.json"))
    args = p.parse_args(argv)
    if args.rounds is None:
        args.rounds = 12 if args.quick else 8
    args.slow = args.slow or args.quick
    specs = []
    try:
        import tomllib

        settings = {}
        for item in args.set:
            if "=" not in item:
                raise ValueError(f"--set {item}: expected KEY=VALUE, e.g. mix=none")
            k, v = (x.strip() for x in item.split("=", 1))
            try:
                settings[k] = tomllib.loads(f"v = {v}")["v"]  # numbers, true/false, quoted strings
            except tomllib.TOMLDecodeError:
                settings[k] = v
        args.set = settings
        for item in (args.configs or (QUICK_CONFIGS if args.quick else FULL_CONFIGS)).split(","):
            parts = item.strip().split(":")
            if len(parts) != 3 or not parts[1].strip().isdigit() or not parts[2].strip().isdigit():
                raise ValueError(f"--configs {item.strip()!r}: expected MODEL:PEERS:H with whole numbers, e.g. tiny:2:10")
            specs.append((parts[0].strip(), int(parts[1]), int(parts[2])))
        variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        if not variants:
            raise ValueError(f"--variants: none given; choose from {', '.join(VARIANTS)}")
        for v in variants:
            split_variant(v)
        if any(n < 2 or n > 18 or H < 1 for _, n, H in specs) or args.rounds < 2:
            raise ValueError("peers must be 2..18, H >= 1, --rounds >= 2")
        scale = None
        if args.scale:
            r, _, k = args.scale.partition("x")
            if not (r.isdigit() and k.isdigit() and int(r) >= 1 and int(k) >= 1 and int(r) * int(k) <= 18):
                raise ValueError(f"--scale {args.scale}: expected RxN with R x N <= 18 (the demo corpus), e.g. 4x4")
            scale = {f"r{i + 1}": int(k) for i in range(int(r))}
        from worldlm_p2p.config import model_preset

        for model, _, H in specs:
            model_preset(model)
            for v in variants:
                manifest(args, model=model, H=H, run_id="check", aggregation=VARIANTS[split_variant(v)[0]])
    except Exception as e:
        print(f"perf.py: error: {e}", file=sys.stderr)
        return 2

    def on_term(signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    from worldlm_p2p.logs import setup_logging
    from worldlm_p2p.swarm import manifest_to_toml

    setup_logging("WARNING")
    t_run = time.monotonic()

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - t_run:6.1f}s] {msg}", flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="worldlm-perf-"))
    result: dict[str, Any] = dict(command=" ".join(["python", *sys.argv]), date=time.strftime("%Y-%m-%d %H:%M:%S %z"),
                                  machine=machine(), versions=versions(), settings=vars(args), runs=[])
    out = Path(args.out)
    corpus = make_corpus(tmp / "corpus", max(n for _, n, _ in specs))
    datas = sorted((corpus / REGION).iterdir())
    scenarios = [(spec, v, None) for spec in specs for v in variants]
    if args.slow:
        model, n, H = specs[0]
        scenarios += [((model, n, H), v, f"{REGION}-{datas[n - 1].name}") for v in variants]
    if scale:
        model, _, H = specs[0]
        scenarios = [((model, sum(scale.values()), H), variants[-1], None)]
        corpus = regions_corpus(tmp / "regions", scale)
    alone_cache: dict[tuple[str, int, int], dict[str, Any]] = {}
    if args.idle:
        n = specs[0][1]
        say(f"idle: {n} peers, no round due, sampled for {args.idle:.0f} s after 30 s of start-up")
        result["idle"] = r = run_idle(args, n=n, seconds=args.idle, corpus=corpus, tmp=tmp)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, default=str))
        c = (r["cpu"] or {}).get("per_peer_cores_median", {})
        print(f"between rounds, per peer (median of {n}): training process {_fmt(c.get('trainer'), '.3f')} cores "
              f"(its training slowed 100x), hivemind DHT + averager processes {_fmt(c.get('hivemind_children'), '.3f')}"
              f", p2pd {_fmt(c.get('p2pd'), '.3f')}; bootstrap node "
              f"{_fmt((r['cpu'] or {}).get('cores_by_kind', {}).get('bootstrap'), '.3f')}")
        return 0
    try:
        for (model, n, H), variant, slow in scenarios:
            key = (model, n, H)
            if key not in alone_cache or slow:  # a fresh baseline next to every slow scenario too
                toml = tmp / f"alone-{model}-{H}.toml"
                toml.write_text(manifest_to_toml(manifest(args, model=model, H=H, run_id="alone", aggregation={})))
                say(f"alone: {n} processes at once, {model}, {H * args.rounds} steps")
                alone_cache[key] = run_alone(workers=n, steps=H * args.rounds, manifest_toml=toml, datas=datas,
                                             tmp=tmp, timeout=args.swarm_timeout)
            alone = alone_cache[key]
            say(f"swarm: {model}, {n} peers, H={H}, {variant}{', one member twice as slow' if slow else ''}")
            r = run_swarm(args, model=model, regions=scale or {REGION: n}, H=H, variant=variant, corpus=corpus,
                          tmp=tmp, slow=slow)
            params = parameters(model)
            dp = 2 * (n - 1) / n * 4 * params * (1e6 / (args.batch_size * args.seq_len))
            r.update(alone_tokens_per_s=alone["median_tokens_per_s"], alone=alone, parameters=params,
                     utilisation=(r["tokens_per_s_median"] / alone["median_tokens_per_s"]
                                  if r["tokens_per_s_median"] and alone["median_tokens_per_s"] else None),
                     data_parallel_bytes_per_mtok=dp,
                     fewer_than_data_parallel=(dp / r["wire_sent_per_mtok_median"]
                                               if r["wire_sent_per_mtok_median"] else None))
            result["runs"].append(r)
            say(f"  utilisation {_fmt(r['utilisation'], '.3f')}, rounds {_fmt(r['rounds_completed_median'], '.0f')}, "
                f"round {_fmt(r['round_seconds_median'])} s, stood still {_fmt(r['seconds_in_rounds_median'], '.1f')} s"
                + (f"; NOT CLEAN: other processes took {_others(r):.2f} cores" if _noisy(r) else ""))
    except KeyboardInterrupt:
        say("interrupted: writing what was measured")
    result["wall_s"] = time.monotonic() - t_run
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    md = markdown(result)
    out.with_suffix(".md").write_text(md + "\n")
    print(md)
    return 0


def _others(run: dict[str, Any]) -> float:
    """Cores that processes other than the swarm's took during ``run`` (0 when not sampled)."""
    return float((run.get("cpu") or {}).get("cores_other_users") or 0.0)


def _noisy(run: dict[str, Any]) -> bool:
    return _others(run) > NOISY_OTHER_CORES


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "| model | peers | H | variant | **utilisation** | tok/s per peer (alone at once) | rounds | full groups | "
        "round s, median (p90) | training stood still s | wire MB sent per 1M tokens | x fewer than per-step DP | "
        "cores: training / hivemind / p2pd / bootstrap | held-out loss, median |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in result["runs"]:
        c = (r.get("cpu") or {}).get("cores_by_kind", {})
        name = r["variant"] + (" (one member 2x slower; fast member)" if r.get("slow") else "")
        shape = r["peers"] if len(r.get("regions") or {}) <= 1 else f"{len(r['regions'])} x {r['peers'] // len(r['regions'])}"
        lines.append(
            f"| {r['model']} | {shape} | {r['H']} | {name} | **{_fmt(r['utilisation'], '.3f')}** | "
            f"{_fmt(r['tokens_per_s_median'], '.0f')} ({_fmt(r['alone_tokens_per_s'], '.0f')}) | "
            f"{_fmt(r['rounds_completed_median'], '.0f')} | {_fmt(r['full_group_share_median'], '.0%')} | "
            f"{_fmt(r['round_seconds_median'])} ({_fmt(r['round_seconds_p90'])}) | "
            f"{_fmt(r['seconds_in_rounds_median'], '.1f')} | "
            f"{_fmt(r['wire_sent_per_mtok_median'] and r['wire_sent_per_mtok_median'] / 1e6, '.1f')} | "
            f"{_fmt(r['fewer_than_data_parallel'], '.0f')} | "
            f"{_fmt(c.get('trainer'))} / {_fmt(c.get('hivemind_children'))} / {_fmt(c.get('p2pd'))} / "
            f"{_fmt(c.get('bootstrap'))} | {_fmt(r.get('valid_loss_median'), '.4f')} |")
    for r in result["runs"]:
        if len(r.get("regions") or {}) > 1:
            lines += ["", f"{len(r['regions'])} regions of {r['peers'] // len(r['regions'])} peers: region rounds "
                          f"failed {r['rounds_failed_total']}, partial {r['rounds_partial_total']}; world rounds led "
                          f"{r['world_rounds_led']}, adopted per peer (median) "
                          f"{_fmt(r['world_rounds_adopted_median'], '.0f')}; "
                          f"machine cores busy {_fmt((r.get('cpu') or {}).get('cores_machine_busy'))}."]
    for r in result["runs"]:
        if _noisy(r):
            lines += ["", f"Not clean: during {r['variant']}{' (slow)' if r.get('slow') else ''} processes other than "
                          f"the swarm's took {_others(r):.2f} cores of the machine; measure it again."]
    slow = [r for r in result["runs"] if r.get("slow")]
    for r in slow:
        both = [q["full_group_share"] for q in r["per_peer"] if not q["slow"]]
        lines.append("")
        lines.append(f"Mixed speeds, {r['variant']}: the fast member's utilisation {_fmt(r['utilisation'], '.3f')}; "
                     f"share of its rounds the slow member took part in: {_fmt(_median(both), '.0%')}.")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
