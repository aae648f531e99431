#!/usr/bin/env python
"""What a refused peer costs: seconds and CPU seconds of a ``worldlm-peer`` that joins a run's DHT,
fetches the manifest and is refused (a local setting contradicts it: ``train.inner_steps``), next to
a peer that joins the same run and trains ``--steps`` steps, measured in the same run.

A real swarm on 127.0.0.1: one ``worldlm-bootstrap``, then the peers one at a time (nothing else of
this script runs meanwhile). CPU seconds are the peer process's and its children's (the hivemind DHT
process, the p2p daemon), from ``resource.getrusage(RUSAGE_CHILDREN)`` around each run.

    python benchmarks/refusal.py --repeats 3 --out benchmarks/out/refusal.json

Prints one Markdown table and writes the raw figures to ``--out``. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from fast_run import fast_run, peer_env  # noqa: E402

DATA = REPO / "worldlm_p2p" / "demo_data" / "eu" / "de_news-reviews-wiki"


def _timed(argv: list[str]) -> tuple[int, float, float, str]:
    """(exit code, seconds, CPU seconds of the process and its children, last line of stderr)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.monotonic()
    r = subprocess.run(argv, capture_output=True, text=True, env=peer_env(), cwd=REPO, timeout=300)
    wall = time.monotonic() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    last = (r.stderr.strip().splitlines() or [""])[-1]
    return r.returncode, wall, cpu, last


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="refusal.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="runs of each kind, alternated (default 3)")
    p.add_argument("--steps", type=int, default=10, help="steps of the admitted peer (default 10)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "refusal.json"))
    args = p.parse_args(argv)
    if args.repeats < 1 or args.steps < 1:
        p.error("--repeats and --steps must be >= 1")
    out = Path(args.out)
    try:  # before any run: where the figures go must be writable
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(f"--out {out}: {e.strerror or e}")
    tmp_out = out.with_name(out.name + ".writing")
    try:
        if out.is_dir():
            raise IsADirectoryError(21, "a directory")
        tmp_out.write_text("")
        tmp_out.unlink()
    except OSError as e:
        p.error(f"--out {out}: {e.strerror or e}")
    runs: dict[str, list[dict]] = {"refused": [], "admitted": []}
    with tempfile.TemporaryDirectory(prefix="worldlm-refusal-") as tmp:
        tmp = Path(tmp)
        (tmp / "run.toml").write_text(fast_run(run_id="refusal", inner_steps=5, barrier_timeout=30.0))
        (tmp / "peer.toml").write_text('[train]\ninner_steps = 99\n')
        boot = subprocess.Popen([sys.executable, "-m", "worldlm_p2p.cli.bootstrap", "--run-config", str(tmp / "run.toml"),
                                 "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, env=peer_env(), cwd=REPO, start_new_session=True)
        try:
            maddrs = [t for t in boot.stdout.readline().decode().split() if "/p2p/" in t]
            if not maddrs:
                print("refusal.py: error: the bootstrap node printed no address", file=sys.stderr)
                return 1
            base = [sys.executable, "-m", "worldlm_p2p.cli.peer", "--region", "eu", "--data", str(DATA),
                    "--initial-peers", *maddrs, "--threads", "1"]
            for _ in range(args.repeats):
                for kind, extra in (("refused", ["--config", str(tmp / "peer.toml")]),
                                    ("admitted", ["--max-steps", str(args.steps)])):
                    try:
                        code, wall, cpu, last = _timed(base + extra)
                    except subprocess.TimeoutExpired:
                        print(f"refusal.py: error: a {kind} peer ran for more than 300 s", file=sys.stderr)
                        return 1
                    runs[kind].append({"exit_code": code, "seconds": wall, "cpu_seconds": cpu, "last_line": last})
        finally:
            boot.terminate()
            try:
                boot.wait(timeout=30)
            except subprocess.TimeoutExpired:
                boot.kill()
    try:
        tmp_out.write_text(json.dumps({"steps": args.steps, "runs": runs}, indent=1) + "\n")
        tmp_out.replace(out)
    except OSError as e:
        print(f"refusal.py: error: --out {out}: {e.strerror or e}", file=sys.stderr)
        return 1
    print("| peer | exit codes | seconds (median) | CPU seconds (median) |\n|---|---|---:|---:|")
    for kind, rs in runs.items():
        print(f"| {kind} | {sorted({r['exit_code'] for r in rs})} | {statistics.median(r['seconds'] for r in rs):.1f} | "
              f"{statistics.median(r['cpu_seconds'] for r in rs):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
