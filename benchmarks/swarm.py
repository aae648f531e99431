#!/usr/bin/env python
"""Swarm benchmark: start-up latency, region-round duration and the throughput cost of federation.

Everything is measured in ONE run, with the real CLIs (``worldlm-bootstrap`` + ``worldlm-peer``
subprocesses on 127.0.0.1, started by :class:`worldlm_p2p.swarm.LocalSwarm`), and every speed is
reported next to a baseline measured in the same run, because the machine is shared and noisy:

1. **time to first round** of each peer of a 2-peer region: from the outside (process spawn ->
   the first ``round`` event with outcome ``averaged`` in the peer's event log, ``--events``) and from the inside (``seconds_to_first_round`` of the peer's
   summary, counted from ``Peer`` construction), broken down into spawn -> ``Peer`` constructed
   (interpreter + imports), -> joined the run (DHT + manifest), -> training started (tokenizer,
   data, model, averager, late-join check), -> first round done (H steps + barrier + all-reduce);
2. **region round duration** with 2, 4 and 8 peers of the ``tiny`` model in one region (median of
   the peers' ``round_seconds``, first round excluded) and the all-reduce bytes each peer sent per
   round (``bytes_sent / rounds_completed``; an analytic figure from
   ``aggregation.allreduce_traffic``, not a wire measurement);
3. **cost of federation**: a swarm peer's training tokens/s (``tokens_per_s`` of its summary:
   tokens over the wall time of its training loop, rounds included) over the tokens/s of the same
   ``LocalTrainer`` (same model, batch, seq_len, steps, 1 torch thread) training alone in this
   process with no networking. The alone baseline is run before and after every swarm and the
   swarm is compared with the mean of the two runs that bracket it (the machine is shared). As N
   peers share the machine's cores, the default run also trains N alone processes concurrently,
   which separates CPU sharing from the cost of the protocol; every run samples the CPU time of
   every process of the swarm (training processes, hivemind DHT/averager processes, p2pd daemons).

The default run adds an import probe (what a peer process spends importing), a subprocess
alone run (cross-check of the in-process baseline) and a 2-peer swarm with half the
matchmaking time (whether a round still depends on the matchmaking window: since peers set
hivemind's target group size to the number waiting at the region barrier, it should not).

Usage::

    python benchmarks/swarm.py [--quick] [--out benchmarks/out/swarm.json]

Prints a Markdown table at the end and writes the raw numbers (every peer summary included) to
``--out``. Never used by the test suite; it asserts nothing about timings.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # runnable from a checkout without installing
    sys.path.insert(0, str(REPO))

REGION = "bench"
THREADS = 1



# ----------------------------------------------------------------------------------- helpers


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _quantile(xs, q: float):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    k = min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))
    return xs[k]


def _ratio(a, b):
    return a / b if a is not None and b else None


def _fmt(x, spec: str = ".2f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    t = str(THREADS)
    env.update(OMP_NUM_THREADS=t, MKL_NUM_THREADS=t, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               WORLDLM_LOGLEVEL="INFO")
    return env


def _kill_group(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """Stop ``proc`` and its process group: the library's own helper, as worldlm-swarm uses it."""
    from worldlm_p2p.swarm import stop_process_group

    stop_process_group(proc, grace=grace)


_TICK = os.sysconf("SC_CLK_TCK")


def _read_machine_busy() -> float | None:
    """Busy CPU seconds of the whole machine since boot (``/proc/stat``: all but idle+iowait)."""
    try:
        vals = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return (sum(vals[:8]) - idle) / _TICK


def make_corpus(root: Path, n: int) -> Path:
    """A one-region federated corpus ``root/bench/<sub>`` of ``n`` sub-corpora (symlinks into the
    bundled demo slice, whose largest region has only 7)."""
    from worldlm_p2p.train import demo_data_dir, list_corpus

    subs = sorted((p for paths in list_corpus(demo_data_dir()).values() for p in paths), key=lambda p: p.name)
    if n > len(subs):
        raise SystemExit(f"the demo corpus has only {len(subs)} sub-corpora, cannot run {n} peers")
    region = root / REGION
    region.mkdir(parents=True, exist_ok=True)
    for p in subs[:n]:
        link = region / p.name
        if not link.exists():
            link.symlink_to(p.resolve(), target_is_directory=True)
    return root


def make_manifest(args, run_id: str, matchmaking_time: float | None = None):
    from worldlm_p2p.config import RunManifest

    return RunManifest.from_dict({
        "run_id": run_id,
        "model": {"preset": "tiny"},
        "train": {"inner_steps": args.inner_steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
                  "eval_tokens": 2048},
        "averaging": {"matchmaking_time": matchmaking_time or args.matchmaking_time,
                      "request_timeout": args.request_timeout, "averaging_timeout": args.averaging_timeout,
                      "barrier_timeout": args.barrier_timeout},
    })


# ----------------------------------------------------------------------------------- alone baseline


def _build_trainer(manifest_toml: Path, data: Path, seed: int):
    """The LocalTrainer a peer of this manifest builds on ``data`` (the peer's own construction,
    :func:`worldlm_p2p.peer.joining.build_local`: tune slice, model init, data seed), on the CPU."""
    from worldlm_p2p.config import PeerConfig, RunManifest
    from worldlm_p2p.peer.joining import build_local
    from worldlm_p2p.train import load_texts

    config = PeerConfig(region=REGION, data=str(data), label=f"alone-{seed}", device="cpu")
    return build_local(config, RunManifest.from_toml(manifest_toml), load_texts(data)).trainer


def _train_timed(trainer, steps: int) -> dict[str, Any]:
    """Time ``steps`` optimizer steps from the first one, as a peer's ``tokens_per_s`` does."""
    import torch

    step_s, tokens = [], 0
    busy0, cpu0 = _read_machine_busy(), time.process_time()
    t0 = time.perf_counter()
    for step in range(steps):
        t = time.perf_counter()
        tokens += trainer.train_step(step).tokens
        step_s.append(time.perf_counter() - t)
    seconds = time.perf_counter() - t0
    busy1, cpu1 = _read_machine_busy(), time.process_time()
    steady = step_s[2:] or step_s
    # cores the rest of the machine used meanwhile (other users, or the other alone workers)
    others = (busy1 - busy0 - (cpu1 - cpu0)) / seconds if busy0 is not None and busy1 is not None else None
    return dict(steps=steps, tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds,
                median_step_s=statistics.median(step_s), cpu_s=cpu1 - cpu0, other_cores=others,
                steady_tokens_per_s=(tokens / steps) / statistics.median(steady), threads=torch.get_num_threads())


def alone_worker(args) -> None:
    """Subprocess body: train ``--steps`` steps with LocalTrainer alone (1 thread, no network) and
    print one JSON line. With ``--go-file`` it sets up, prints ``READY``, and waits for the file,
    so that several workers train at the same time."""
    t_spawned = time.monotonic()
    import torch

    torch.set_num_threads(THREADS)
    trainer = _build_trainer(Path(args.manifest), Path(args.data), args.seed)
    setup_s = time.monotonic() - t_spawned
    if args.go_file:
        print("READY", flush=True)
        go = Path(args.go_file)
        deadline = time.monotonic() + 600
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    print(json.dumps(dict(_train_timed(trainer, args.steps), setup_s=setup_s)), flush=True)


def import_probe() -> None:
    """Subprocess body: seconds to import what a peer process imports (one JSON line)."""
    t0 = time.monotonic()
    out = {}
    import torch  # noqa: F401

    out["torch"] = time.monotonic() - t0
    t = time.monotonic()
    import hivemind  # noqa: F401

    from worldlm_p2p.peer import Peer  # noqa: F401

    out["hivemind_and_worldlm_peer"] = time.monotonic() - t
    t = time.monotonic()
    from transformers import LlamaForCausalLM  # noqa: F401  (imported lazily by build_model)

    out["transformers_llama"] = time.monotonic() - t
    out["total"] = time.monotonic() - t0
    print(json.dumps(out), flush=True)


def run_import_probe() -> dict[str, float]:
    p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--import-probe"], capture_output=True,
                       text=True, env=_env(), cwd=REPO, timeout=300, start_new_session=True)
    if p.returncode != 0:
        return dict(error=p.stderr.strip()[-300:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def alone_inprocess(*, steps: int, repeats: int, manifest_toml: Path, data: Path) -> dict[str, Any]:
    """The alone baseline in this process (1 torch thread, no networking): ``repeats`` fresh
    trainers of ``steps`` steps each; the median run counts."""
    runs = [_train_timed(_build_trainer(manifest_toml, data, seed=1000 + i), steps) for i in range(repeats)]
    return dict(where="in-process", workers=1, steps=steps, repeats=repeats, runs=runs,
                median_tokens_per_s=_median(r["tokens_per_s"] for r in runs),
                median_steady_tokens_per_s=_median(r["steady_tokens_per_s"] for r in runs),
                median_other_cores=_median(r["other_cores"] for r in runs),
                median_tokens_per_cpu_s=_median(r["tokens"] / r["cpu_s"] for r in runs if r["cpu_s"] > 0),
                loadavg=list(os.getloadavg()))


def run_alone(*, workers: int, steps: int, manifest_toml: Path, datas: list[Path], tmp: Path,
              timeout: float = 300.0) -> dict[str, Any]:
    """``workers`` concurrent alone trainers (1 thread each), synchronised to train together."""
    go = tmp / f"go-{workers}-{time.monotonic_ns()}"
    procs = []
    try:
        for i in range(workers):
            cmd = [sys.executable, str(Path(__file__).resolve()), "--alone-worker", "--manifest", str(manifest_toml),
                   "--data", str(datas[i % len(datas)]), "--steps", str(steps), "--seed", str(1000 + i),
                   "--go-file", str(go)]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(),
                                          cwd=REPO, start_new_session=True, text=True))
        for p in procs:  # wait until every worker has built its model
            line = p.stdout.readline().strip()
            if line != "READY":
                raise RuntimeError(f"alone worker did not start: {line!r} {p.stderr.read()[-500:]}")
        go.touch()
        results = []
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            if p.returncode != 0:
                raise RuntimeError(f"alone worker failed ({p.returncode}): {err.strip()[-500:]}")
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            _kill_group(p, grace=1.0)
        go.unlink(missing_ok=True)
    tps = [r["tokens_per_s"] for r in results]
    return dict(where="subprocess", workers=workers, steps=steps, per_worker=results,
                median_tokens_per_s=_median(tps), loadavg=list(os.getloadavg()),
                total_tokens_per_s=sum(tps), median_steady_tokens_per_s=_median(r["steady_tokens_per_s"]
                                                                                for r in results))


# ----------------------------------------------------------------------------------- swarm


def _peer_events(peers) -> dict[str, dict[str, Any]]:
    """Per peer, from its structured event log (``--events``, :mod:`worldlm_p2p.peer.events`): when
    it was spawned (this process's clock), joined and started training, and every round's outcome,
    with the peer's own ``time.monotonic()`` (one clock for every process on Linux)."""
    from worldlm_p2p.peer.events import read_events

    out = {}
    for p in peers:
        ev: dict[str, Any] = dict(spawned=p.started, rounds=[], alone=0, failed=0)
        for e in read_events(p.events_path) if p.events_path else []:
            kind = e["event"]
            if kind in ("joined", "training") and kind not in ev:
                ev[kind] = e["mono"]
            elif kind == "round" and e.get("outcome") == "averaged":
                ev["rounds"].append(dict(t=e["mono"], round=e["round"], group=e["group_size"], seconds=e["seconds"]))
            elif kind == "round" and e.get("outcome") in ("alone", "failed"):
                ev[e["outcome"]] += 1
        out[p.label] = ev
    return out


class _CpuSampler:
    """Samples, every ``period`` seconds, the CPU time of every process in the swarm's process
    groups (each CLI process leads its own group; hivemind's DHT and averager processes and the
    p2pd daemons stay in it), plus the busy time of the whole machine, so that the CPU of a
    steady-state window can be split into: training processes, hivemind child processes
    (DHT + averager), p2pd daemons, the bootstrap node, this benchmark process (this sampler)
    and everything else on the machine."""

    def __init__(self, swarm, period: float = 0.5) -> None:
        self._swarm = swarm
        self._period = period
        self._stop = threading.Event()
        self._me = os.getpid()
        self.samples: list[tuple[float, float | None, dict[int, tuple[int, str, str, float]]]] = []
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _groups(self) -> dict[int, str]:
        groups = {p.proc.pid: p.label for p in self._swarm.peers}
        if self._swarm.bootstrap is not None:
            groups[self._swarm.bootstrap.pid] = "<bootstrap>"
        return groups

    def sample(self) -> None:
        groups = self._groups()
        now = time.monotonic()
        busy = _read_machine_busy()
        procs: dict[int, tuple[int, str, str, float]] = {}
        stats: dict[int, tuple[str, int, float]] = {}  # pid -> (comm, ppid, cpu seconds)
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                raw = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            rest = raw[raw.rindex(")") + 2:].split()
            stats[int(d)] = (raw[raw.index("(") + 1:raw.rindex(")")], int(rest[1]),
                             (int(rest[11]) + int(rest[12])) / _TICK)
        for pid, (comm, _, cpu) in stats.items():
            if pid == self._me:
                procs[pid] = (pid, "<benchmark>", "benchmark", cpu)
                continue
            # the CLI process it descends from (p2pd runs in a session of its own, so process
            # groups miss it; its parent chain does not)
            leader, hops = pid, 0
            while leader not in groups and leader in stats and hops < 16:
                leader, hops = stats[leader][1], hops + 1
            if leader not in groups:
                continue
            kind = "trainer" if pid == leader else ("p2pd" if comm.startswith("p2pd") else "hivemind_children")
            if groups[leader] == "<bootstrap>":
                kind = "bootstrap"
            procs[pid] = (leader, groups[leader], kind, cpu)
        self.samples.append((now, busy, procs))

    def _loop(self) -> None:
        while not self._stop.wait(self._period):
            try:
                self.sample()
            except Exception:  # a process vanished mid-read: skip this sample
                pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def group_cpu(self, pgid: int, t_a: float, t_b: float) -> dict[str, float] | None:
        """CPU seconds that the processes of group ``pgid`` used in [t_a, t_b], by kind."""
        before = [x for x in self.samples if x[0] <= t_a]
        upto = [x for x in self.samples if x[0] <= t_b]
        if not before or not upto or upto[-1][0] - before[-1][0] < 1.0:
            return None
        pa, pb = before[-1][2], upto[-1][2]
        out = {"trainer": 0.0, "hivemind_children": 0.0, "p2pd": 0.0}
        for pid, (g, _label, kind, cpu) in pb.items():
            if g == pgid and kind in out:
                prev = pa.get(pid)
                out[kind] += cpu - (prev[3] if prev is not None and prev[0] == g else 0.0)
        out["window_s"] = upto[-1][0] - before[-1][0]
        return out

    def window(self, t_a: float, t_b: float) -> dict[str, Any] | None:
        """CPU used in [t_a, t_b], in cores (CPU seconds / wall seconds), by kind of process."""
        before = [s for s in self.samples if s[0] <= t_a]
        upto = [s for s in self.samples if s[0] <= t_b]
        if not before or not upto or upto[-1][0] - before[-1][0] < 1.0:
            return None
        (ta, busy_a, pa), (tb, busy_b, pb) = before[-1], upto[-1]
        wall = tb - ta
        by_kind: dict[str, float] = {}
        by_peer: dict[str, dict[str, float]] = {}
        for pid, (pgid, label, kind, cpu) in pb.items():
            prev = pa.get(pid)
            delta = cpu - (prev[3] if prev is not None and prev[0] == pgid else 0.0)
            by_kind[kind] = by_kind.get(kind, 0.0) + delta
            if kind not in ("bootstrap", "benchmark"):
                by_peer.setdefault(label, {}).setdefault(kind, 0.0)
                by_peer[label][kind] += delta
        ours = sum(by_kind.values())
        machine_busy = (busy_b - busy_a) if busy_a is not None and busy_b is not None else None
        out = dict(window_s=wall, cores_by_kind={k: v / wall for k, v in sorted(by_kind.items())},
                   cores_ours=ours / wall,
                   cores_machine_busy=machine_busy / wall if machine_busy is not None else None,
                   cores_other_users=(machine_busy - ours) / wall if machine_busy is not None else None,
                   per_peer_cores_median={k: _median(v.get(k, 0.0) / wall for v in by_peer.values())
                                          for k in ("trainer", "hivemind_children", "p2pd")})
        tr = out["cores_by_kind"].get("trainer", 0.0)
        out["trainer_share_of_ours"] = tr / out["cores_ours"] if out["cores_ours"] else None
        return out


def run_swarm(args, *, n: int, corpus: Path, tmp: Path, matchmaking_time: float | None = None,
              tag: str = "") -> dict[str, Any]:
    from worldlm_p2p.swarm import LocalSwarm, SwarmConfig

    manifest = make_manifest(args, run_id=f"bench{n}{tag}", matchmaking_time=matchmaking_time)
    max_steps = args.inner_steps * args.rounds
    config = SwarmConfig(regions={REGION: n}, data=corpus, out=tmp / f"swarm-{n}{tag}", manifest=manifest,
                         max_steps=max_steps, threads_per_peer=THREADS, checkpoints=False,
                         startup_timeout=120.0, stop_timeout=30.0)
    swarm = LocalSwarm(config=config)
    deadline = time.monotonic() + args.swarm_timeout

    timed_out = False
    with swarm:  # __exit__ stops every process (SIGTERM, then SIGKILL of the process groups)
        t_start = time.monotonic()
        swarm.start()
        t_spawned = time.monotonic()
        sampler = _CpuSampler(swarm)
        try:
            swarm.wait(poll=0.2, should_stop=lambda: time.monotonic() > deadline)
            timed_out = bool(swarm.running())
        finally:
            sampler.close()
    t_end = time.monotonic()
    summary = swarm.summary()
    peers = summary["peers"]
    events = _peer_events(swarm.peers)

    pgids = {q.label: q.proc.pid for q in swarm.peers}  # each CLI process leads its own group
    tokens_per_round = args.inner_steps * args.batch_size * args.seq_len
    per_peer = []
    for p in peers:
        ev = events.get(p.get("label"), {})
        spawned = ev.get("spawned")
        rs = p.get("round_seconds") or []
        tps = p.get("tokens_per_s") or None
        elapsed = p["tokens"] / tps if tps and p.get("tokens") else None  # training wall time (worldlm_p2p.peer.progress)
        rounds_done = p.get("rounds_completed") or 0
        first = ev["rounds"][0]["t"] - spawned if ev.get("rounds") else None
        inside = p.get("seconds_to_first_round")
        imports = first - inside if first is not None and inside is not None else None
        joined = ev["joined"] - spawned if "joined" in ev else None
        training = ev["training"] - spawned if "training" in ev else None
        round_times = [r["t"] for r in ev.get("rounds", [])]
        # steady state of this peer: from its first to its last completed round, exactly
        # (rounds - 1) * H steps were trained; CPU of its processes over the same window
        steady = {}
        if len(round_times) >= 2 and p.get("label") in pgids:
            steady_tokens = (len(round_times) - 1) * tokens_per_round
            g = sampler.group_cpu(pgids[p["label"]], round_times[0], round_times[-1])
            steady = dict(steady_tokens=steady_tokens, steady_wall_s=round_times[-1] - round_times[0],
                          steady_tokens_per_s=steady_tokens / (round_times[-1] - round_times[0]))
            if g is not None:
                total = g["trainer"] + g["hivemind_children"] + g["p2pd"]
                steady.update(steady_cpu_s=g, steady_trainer_cores=g["trainer"] / g["window_s"],
                              tokens_per_trainer_cpu_s=steady_tokens / g["trainer"] if g["trainer"] else None,
                              tokens_per_peer_cpu_s=steady_tokens / total if total else None)
        tail = None
        if p.get("exit_code") != 0:
            try:
                tail = Path(p["log"]).read_text(errors="replace").splitlines()[-10:]
            except (OSError, KeyError):
                pass
        per_peer.append(dict(**steady,
            label=p.get("label"), exit_code=p.get("exit_code"), error=p.get("error"), log_tail=tail,
            started_from=p.get("started_from"), steps=p.get("steps"), tokens=p.get("tokens"),
            rounds_completed=rounds_done, rounds_failed=p.get("rounds_failed"),
            # rounds with no other live region peer: the peer logs only the first of a run of them
            rounds_alone=max(0, (p.get("steps") or 0) // args.inner_steps - (rounds_done or 0)
                             - (p.get("rounds_failed") or 0)),
            group_sizes=p.get("group_sizes"), round_seconds=rs,
            tokens_per_s=tps, train_elapsed_s=elapsed,
            tokens_per_s_excl_allreduce=(p["tokens"] / (elapsed - sum(rs)) if elapsed and elapsed > sum(rs)
                                         else None),
            bytes_sent=p.get("bytes_sent"), bytes_received=p.get("bytes_received"),
            bytes_sent_per_round=(p["bytes_sent"] / rounds_done if rounds_done else None),
            seconds_to_first_round=inside,
            outside_first_round_s=first,
            phase_spawn_to_peer_s=imports,
            phase_spawn_to_joined_s=joined,
            phase_spawn_to_training_s=training,
            round_period_s=_median([b - a for a, b in zip(round_times, round_times[1:])]),
        ))
    ok = [q for q in per_peer if q["exit_code"] == 0 and not q["error"]]
    # steady state: from the moment every peer has finished its first round to the moment the
    # first peer finishes its last round (rounds 1..R-1 of every peer are inside)
    firsts = [ev["rounds"][0]["t"] for ev in events.values() if ev["rounds"]]
    lasts = [ev["rounds"][-1]["t"] for ev in events.values() if ev["rounds"]]
    cpu = (sampler.window(max(firsts), min(lasts)) if len(firsts) == n and len(lasts) == n
           and min(lasts) > max(firsts) else None)
    later_rounds = [x for q in ok for x in (q["round_seconds"] or [])[1:]]
    groups = [g for q in ok for g in (q["group_sizes"] or [])]
    return dict(
        peers=n, max_steps=max_steps, timed_out=timed_out, failed_peers=len(per_peer) - len(ok),
        wall_s=t_end - t_start, spawn_s=t_spawned - t_start,
        round_seconds_median=_median(later_rounds), round_seconds_p10=_quantile(later_rounds, 0.1),
        round_seconds_p90=_quantile(later_rounds, 0.9), round_samples=len(later_rounds),
        first_round_seconds_median=_median((q["round_seconds"] or [None])[0] for q in ok),
        round_period_s_median=_median(q["round_period_s"] for q in ok),
        full_group_fraction=(sum(1 for g in groups if g == n) / len(groups)) if groups else None,
        group_size_counts={str(g): groups.count(g) for g in sorted(set(groups))},
        rounds_failed=sum(q["rounds_failed"] or 0 for q in per_peer),
        rounds_alone=sum(q["rounds_alone"] or 0 for q in per_peer),
        bytes_sent_per_round_median=_median(q["bytes_sent_per_round"] for q in ok),
        tokens_per_s_median=_median(q["tokens_per_s"] for q in ok),
        tokens_per_s_excl_allreduce_median=_median(q["tokens_per_s_excl_allreduce"] for q in ok),
        seconds_to_first_round_median=_median(q["seconds_to_first_round"] for q in ok),
        outside_first_round_s_median=_median(q["outside_first_round_s"] for q in ok),
        phase_spawn_to_peer_s_median=_median(q["phase_spawn_to_peer_s"] for q in ok),
        phase_spawn_to_joined_s_median=_median(q["phase_spawn_to_joined_s"] for q in ok),
        phase_spawn_to_training_s_median=_median(q["phase_spawn_to_training_s"] for q in ok),
        steady_tokens_per_s_median=_median(q.get("steady_tokens_per_s") for q in ok),
        steady_trainer_cores_median=_median(q.get("steady_trainer_cores") for q in ok),
        tokens_per_trainer_cpu_s_median=_median(q.get("tokens_per_trainer_cpu_s") for q in ok),
        tokens_per_peer_cpu_s_median=_median(q.get("tokens_per_peer_cpu_s") for q in ok),
        steady_state_cpu=cpu, loadavg_after=list(os.getloadavg()),
        per_peer=per_peer, raw_summaries=peers,
    )


# ----------------------------------------------------------------------------------- report


def run_swarm_retrying(args, say, **kw) -> dict[str, Any]:
    """:func:`run_swarm`, once more if a peer failed (on a shared machine, other people's cleanups
    can kill processes); the failed attempt stays in the result."""
    failed = []
    while True:
        r = run_swarm(args, **kw)
        if (r["failed_peers"] == 0 and not r["timed_out"]) or failed:
            break
        say(f"  {r['failed_peers']} peer(s) failed (exit codes "
            f"{sorted({str(q['exit_code']) for q in r['per_peer']})}); running this swarm once more")
        failed.append({k: v for k, v in r.items() if k != "raw_summaries"})
        kw["tag"] = kw.get("tag", "") + "-retry"  # a fresh run id and directory
    r["failed_attempts"] = failed
    return r


def versions() -> dict[str, str]:
    import hivemind
    import torch
    import transformers

    return dict(python=platform.python_version(), torch=torch.__version__, hivemind=hivemind.__version__,
                transformers=transformers.__version__)


def machine() -> dict[str, Any]:
    cpu = ""
    try:
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), "")
    except OSError:
        pass
    return dict(cpus=os.cpu_count(), cpu_model=cpu, platform=platform.platform(),
                loadavg_at_start=list(os.getloadavg()))


def finalize(result: dict[str, Any]) -> None:
    """Ratios against the alone baseline of the whole run, and the headline.

    Wall-clock: a swarm peer's tokens/s over the median of every alone run of the benchmark (the
    range uses the fastest and slowest alone run: the machine's noise). CPU: tokens per CPU second
    of a peer's processes over tokens per CPU second alone; CPU time is far less sensitive than
    wall time to other users of the machine, so this ratio is the noise-robust one."""
    runs = [r for a in result.get("alone_solo", []) for r in a["runs"]]
    tps = [r["tokens_per_s"] for r in runs]
    per_cpu = [r["tokens"] / r["cpu_s"] for r in runs if r["cpu_s"] > 0]
    alone = dict(runs=len(runs), median_tokens_per_s=_median(tps), min_tokens_per_s=min(tps, default=None),
                 max_tokens_per_s=max(tps, default=None), median_tokens_per_cpu_s=_median(per_cpu),
                 median_other_cores=_median(r["other_cores"] for r in runs))
    result["alone"] = alone
    swarms = list(result["swarms"].values())
    mm = result.get("matchmaking_sensitivity")
    if mm:
        swarms.append(mm["swarm"])
    for r in swarms:
        t = r["tokens_per_s_median"]
        r.update(alone_tokens_per_s=alone["median_tokens_per_s"],
                 ratio_vs_alone=_ratio(t, alone["median_tokens_per_s"]),
                 ratio_vs_alone_range=[_ratio(t, alone["max_tokens_per_s"]), _ratio(t, alone["min_tokens_per_s"])],
                 ratio_excl_allreduce_vs_alone=_ratio(r["tokens_per_s_excl_allreduce_median"],
                                                      alone["median_tokens_per_s"]),
                 ratio_steady_vs_alone=_ratio(r.get("steady_tokens_per_s_median"), alone["median_tokens_per_s"]),
                 cpu_ratio_trainer=_ratio(r.get("tokens_per_trainer_cpu_s_median"),
                                          alone["median_tokens_per_cpu_s"]),
                 cpu_ratio_peer=_ratio(r.get("tokens_per_peer_cpu_s_median"), alone["median_tokens_per_cpu_s"]))
    if mm:
        mm.update(ratio_a=result["swarms"]["2"]["ratio_vs_alone"], ratio_b=mm["swarm"]["ratio_vs_alone"])
    two = result["swarms"].get("2", {})
    result["headline"] = dict(
        ratio_2_peers=two.get("ratio_vs_alone"), ratio_2_peers_range=two.get("ratio_vs_alone_range"),
        ratio_2_peers_bracket=two.get("ratio_vs_alone_bracket"), cpu_ratio_2_peers=two.get("cpu_ratio_peer"),
        cpu_ratio_trainer_2_peers=two.get("cpu_ratio_trainer"),
        seconds_to_first_round_2_peers=two.get("seconds_to_first_round_median"),
        outside_first_round_s_2_peers=two.get("outside_first_round_s_median"),
        round_seconds_by_size={n: r["round_seconds_median"] for n, r in result["swarms"].items()})


def markdown(result: dict[str, Any]) -> str:
    s = result["settings"]
    sw = result["swarms"]
    sizes = list(sw)
    alone = result.get("alone", {})
    cpus = result["machine"]["cpus"]
    lines = []
    if sizes:
        lines += [
            "**Time to first region round** (median over the peers of the region; seconds from process spawn)",
            "",
            "| phase | " + " | ".join(f"{n} peers" for n in sizes) + " |",
            "|---|" + "---:|" * len(sizes),
        ]
        rows = [
            ("interpreter + imports (spawn -> `Peer` built)", "phase_spawn_to_peer_s_median"),
            ("-> joined the run (DHT up, manifest fetched)", "phase_spawn_to_joined_s_median"),
            ("-> training started (tokenizer, data, model, averager, join)", "phase_spawn_to_training_s_median"),
            ("-> **first round done** (outside: event log)", "outside_first_round_s_median"),
            ("`seconds_to_first_round` (peer summary, from `Peer` built)", "seconds_to_first_round_median"),
        ]
        for name, key in rows:
            lines.append(f"| {name} | " + " | ".join(_fmt(sw[n][key], ".1f") for n in sizes) + " |")
        probe = result.get("import_probe")
        if probe and "total" in probe:
            lines += ["", f"Imports of one process on its own: torch {probe['torch']:.1f} s, hivemind + worldlm "
                          f"{probe['hivemind_and_worldlm_peer']:.1f} s, transformers Llama "
                          f"{probe['transformers_llama']:.1f} s (total {probe['total']:.1f} s)."]
        lines.append("")
    lines += [
        f"**Region rounds** (tiny, batch {s['batch_size']} x seq {s['seq_len']}, H={s['inner_steps']}, "
        f"{s['rounds']} rounds per peer, matchmaking_time {s['matchmaking_time']} s, request_timeout "
        f"{s['request_timeout']} s, averaging_timeout {s['averaging_timeout']} s, 1 torch thread per process, "
        f"{cpus} cores shared by all processes)",
        "",
        "| peers | round s, median (p10-p90), 1st round excluded | round period s (round + H steps + barrier) | "
        "groups of full size | all-reduce sent per peer per round |",
        "|---:|---:|---:|---:|---:|",
    ]
    for n, r in sw.items():
        sent = r["bytes_sent_per_round_median"]
        lines.append(f"| {n} | {_fmt(r['round_seconds_median'])} ({_fmt(r['round_seconds_p10'])}-"
                     f"{_fmt(r['round_seconds_p90'])}) | {_fmt(r['round_period_s_median'])} | "
                     f"{_fmt(r['full_group_fraction'], '.0%')} | {_fmt(sent and sent / 2**20, '.2f')} MiB |")
    lines += [
        "",
        f"**Cost of federation: wall clock** (alone = same LocalTrainer, 1 thread, no network; median of "
        f"{alone.get('runs')} alone runs spread over the benchmark: "
        f"{_fmt(alone.get('median_tokens_per_s'), '.0f')} tok/s, range "
        f"{_fmt(alone.get('min_tokens_per_s'), '.0f')}-{_fmt(alone.get('max_tokens_per_s'), '.0f')})",
        "",
        "| peers | swarm tok/s per peer | **swarm / alone** (range over alone runs) | swarm / alone, neighbouring "
        "alone runs | steady-state swarm / alone | N alone processes at once: tok/s each | swarm / N-alone |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, r in sw.items():
        conc = r.get("concurrent_alone") or {}
        lo, hi = r.get("ratio_vs_alone_range") or (None, None)
        lines.append(f"| {n} | {_fmt(r['tokens_per_s_median'], '.0f')} | "
                     f"**{_fmt(r.get('ratio_vs_alone'), '.3f')}** ({_fmt(lo, '.3f')}-{_fmt(hi, '.3f')}) | "
                     f"{_fmt(r.get('ratio_vs_alone_bracket'), '.3f')} | {_fmt(r.get('ratio_steady_vs_alone'), '.3f')} | "
                     f"{_fmt(conc.get('median_tokens_per_s'), '.0f')} | "
                     f"{_fmt(r.get('ratio_vs_concurrent_alone'), '.3f')} |")
    lines += [
        "",
        "**Cost of federation: CPU** (steady state, per peer; alone: "
        f"{_fmt(alone.get('median_tokens_per_cpu_s'), '.0f')} tokens per CPU second)",
        "",
        "| peers | cores a training process got | tokens per CPU-s of the training process | "
        "tokens per CPU-s of all the peer's processes (+ DHT, averager, p2pd) | **CPU efficiency** (all / alone) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for n, r in sw.items():
        lines.append(f"| {n} | {_fmt(r.get('steady_trainer_cores_median'))} | "
                     f"{_fmt(r.get('tokens_per_trainer_cpu_s_median'), '.0f')} "
                     f"({_fmt(r.get('cpu_ratio_trainer'), '.2f')} of alone) | "
                     f"{_fmt(r.get('tokens_per_peer_cpu_s_median'), '.0f')} | "
                     f"**{_fmt(r.get('cpu_ratio_peer'), '.3f')}** |")
    cpu_rows = [(n, r["steady_state_cpu"]) for n, r in sw.items() if r.get("steady_state_cpu")]
    if cpu_rows:
        lines += [
            "",
            f"**Where the machine's {cpus} cores went in steady state** (cores, between every peer's first round and "
            "the first peer's last round)",
            "",
            "| peers | training processes | hivemind DHT + averager processes | p2pd daemons | bootstrap node | "
            "benchmark | other users of the machine | idle |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for n, c in cpu_rows:
            k = c["cores_by_kind"]
            busy = c.get("cores_machine_busy")
            idle = cpus - busy if busy is not None else None
            lines.append(f"| {n} | {_fmt(k.get('trainer'))} | {_fmt(k.get('hivemind_children'))} | "
                         f"{_fmt(k.get('p2pd'))} | {_fmt(k.get('bootstrap'))} | {_fmt(k.get('benchmark'))} | "
                         f"{_fmt(c.get('cores_other_users'))} | {_fmt(idle)} |")
    mm = result.get("matchmaking_sensitivity")
    if mm:
        lines += ["", f"Matchmaking sensitivity (2 peers): matchmaking_time {mm['matchmaking_time_a']} s -> round "
                      f"{_fmt(mm['round_seconds_a'])} s, swarm/alone {_fmt(mm.get('ratio_a'), '.3f')}; "
                      f"{mm['matchmaking_time_b']} s -> round {_fmt(mm['round_seconds_b'])} s, swarm/alone "
                      f"{_fmt(mm.get('ratio_b'), '.3f')}."]
    h = result.get("headline", {})
    rng = h.get("ratio_2_peers_range") or (None, None)
    solos = result.get("alone_solo", [])
    lines += [
        "",
        f"Headline (2 peers, about one core each): swarm/alone tokens/s = **{_fmt(h.get('ratio_2_peers'), '.3f')}** "
        f"(range {_fmt(rng[0], '.3f')}-{_fmt(rng[1], '.3f')}); CPU efficiency "
        f"{_fmt(h.get('cpu_ratio_2_peers'), '.3f')}; "
        f"first round {_fmt(h.get('outside_first_round_s_2_peers'), '.1f')} s after process spawn "
        f"({_fmt(h.get('seconds_to_first_round_2_peers'), '.1f')} s after `Peer` construction). Other processes "
        f"used {', '.join(_fmt(a.get('median_other_cores')) for a in solos)} of the {cpus} cores during the "
        f"alone runs.",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="2 and 4 peers, 3 rounds, 2 alone runs per bracket, no concurrent-alone, import-probe or "
                        "matchmaking extras (3-4 min)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "swarm.json"), help="JSON output path")
    p.add_argument("--sizes", help="region sizes to run (default 2,4,8; --quick 2,4)")
    p.add_argument("--rounds", type=int, help="region rounds per peer (default 8, --quick 3)")
    p.add_argument("--inner-steps", type=int, default=10, help="H (default 10)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--matchmaking-time", type=float, default=1.5)
    p.add_argument("--request-timeout", type=float, default=0.5)
    p.add_argument("--averaging-timeout", type=float, default=15.0)
    p.add_argument("--barrier-timeout", type=float, default=30.0)
    p.add_argument("--alone-repeats", type=int, help="alone runs per bracket, median counts (default 3, --quick 2)")
    p.add_argument("--swarm-timeout", type=float, default=420.0, help="give up on one swarm after this long")
    p.add_argument("--keep", action="store_true", help="keep the run directories (logs, summaries)")
    # internal: subprocess bodies
    p.add_argument("--alone-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--import-probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--manifest", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--go-file", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.alone_worker:
        alone_worker(args)
        return 0
    if args.import_probe:
        import_probe()
        return 0
    if args.rounds is None:
        args.rounds = 3 if args.quick else 8
    if args.alone_repeats is None:
        args.alone_repeats = 2 if args.quick else 3
    if args.sizes is None:
        args.sizes = "2,4" if args.quick else "2,4,8"
    if args.rounds < 2:
        raise SystemExit("--rounds must be >= 2 (the first round is excluded from round durations)")
    sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    steps = args.inner_steps * args.rounds  # the alone baseline trains as many steps as one peer

    def on_term(signum, _frame):  # SIGTERM takes the KeyboardInterrupt path: the with-blocks clean up
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    import torch

    torch.set_num_threads(THREADS)  # the in-process alone baseline: 1 thread, like every peer
    from worldlm_p2p.logs import setup_logging
    from worldlm_p2p.swarm import manifest_to_toml

    setup_logging("WARNING")
    t_run = time.monotonic()

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - t_run:6.1f}s] {msg}", flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="worldlm-bench-"))
    say(f"work dir {tmp}")
    settings = dict(model="tiny", batch_size=args.batch_size, seq_len=args.seq_len, inner_steps=args.inner_steps,
                    rounds=args.rounds, max_steps_per_peer=steps, alone_steps=steps,
                    alone_repeats=args.alone_repeats, matchmaking_time=args.matchmaking_time,
                    request_timeout=args.request_timeout, averaging_timeout=args.averaging_timeout,
                    barrier_timeout=args.barrier_timeout, threads_per_process=THREADS, checkpoints=False,
                    eval_tokens=2048, sizes=sizes, quick=args.quick)
    result: dict[str, Any] = dict(command=" ".join(["python", *sys.argv]),
                                  date=time.strftime("%Y-%m-%d %H:%M:%S %z"), machine=machine(),
                                  versions=versions(), settings=settings, alone_solo=[], swarms={})
    out = Path(args.out)
    try:
        corpus = make_corpus(tmp / "corpus", max(sizes))
        datas = sorted((corpus / REGION).iterdir())
        manifest_toml = tmp / "alone.toml"
        manifest_toml.write_text(manifest_to_toml(make_manifest(args, run_id="alone")))

        def solo(label: str) -> dict[str, Any]:
            say(f"alone baseline in-process ({args.alone_repeats} x {steps} steps) [{label}]")
            r = alone_inprocess(steps=steps, repeats=args.alone_repeats, manifest_toml=manifest_toml,
                                data=datas[0])
            r.update(label=label, t=time.monotonic() - t_run)
            result["alone_solo"].append(r)
            return r

        if not args.quick:
            say("import probe (one fresh process)")
            result["import_probe"] = run_import_probe()
        prev = solo("start")
        if not args.quick:
            say("alone baseline in a subprocess (cross-check of the in-process one)")
            result["alone_subprocess_check"] = run_alone(workers=1, steps=steps, manifest_toml=manifest_toml,
                                                         datas=datas, tmp=tmp)
        for n in sizes:
            conc = None
            if not args.quick:
                say(f"alone baseline: {n} concurrent processes")
                conc = run_alone(workers=n, steps=steps, manifest_toml=manifest_toml, datas=datas, tmp=tmp)
            say(f"swarm of {n} peers ({args.rounds} rounds of H={args.inner_steps})")
            r = run_swarm_retrying(args, say, n=n, corpus=corpus, tmp=tmp)
            after = solo(f"after {n}")
            # the swarm's baseline: the mean of the alone runs that bracket it in time
            base = statistics.mean([prev["median_tokens_per_s"], after["median_tokens_per_s"]])
            r.update(concurrent_alone=conc, alone_bracket_tokens_per_s=base,
                     alone_bracket=[prev["median_tokens_per_s"], after["median_tokens_per_s"]],
                     ratio_vs_alone_bracket=_ratio(r["tokens_per_s_median"], base),
                     ratio_vs_concurrent_alone=_ratio(r["tokens_per_s_median"],
                                                      conc and conc["median_tokens_per_s"]))
            result["swarms"][str(n)] = r
            say(f"  {n} peers: round {_fmt(r['round_seconds_median'])} s, first round "
                f"{_fmt(r['outside_first_round_s_median'], '.1f')} s, {_fmt(r['tokens_per_s_median'], '.0f')} "
                f"tok/s/peer vs alone {base:.0f} (bracket) -> {_fmt(r['ratio_vs_alone_bracket'], '.3f')}; groups "
                f"{r['group_size_counts']}; failed peers {r['failed_peers']}")
            prev = after
        if not args.quick and 2 in sizes:
            mm_b = args.matchmaking_time / 2
            if mm_b > args.request_timeout:
                say(f"swarm of 2 peers with matchmaking_time {mm_b} s (sensitivity)")
                r = run_swarm_retrying(args, say, n=2, corpus=corpus, tmp=tmp, matchmaking_time=mm_b,
                                       tag="-mmhalf")
                after = solo("after matchmaking sensitivity")
                base = statistics.mean([prev["median_tokens_per_s"], after["median_tokens_per_s"]])
                r.update(alone_bracket_tokens_per_s=base,
                         alone_bracket=[prev["median_tokens_per_s"], after["median_tokens_per_s"]],
                         ratio_vs_alone_bracket=_ratio(r["tokens_per_s_median"], base))
                result["matchmaking_sensitivity"] = dict(
                    matchmaking_time_a=args.matchmaking_time, matchmaking_time_b=mm_b,
                    round_seconds_a=result["swarms"]["2"]["round_seconds_median"],
                    round_seconds_b=r["round_seconds_median"], swarm=r)
    finally:
        result["total_seconds"] = time.monotonic() - t_run
        result["machine"]["loadavg_at_end"] = list(os.getloadavg())
        finalize(result)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        if args.keep:
            print(f"kept run directories in {tmp}")
        else:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(markdown(result))
    print(f"\nraw numbers: {out} (total {result['total_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
