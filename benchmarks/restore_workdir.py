"""Rebuild a ``benchmarks/quality.py`` work directory from the committed raw results.

The work directory (every run's own JSON) is not committed; the raw results under
``benchmarks/out/`` are, and each one's ``results`` maps a run's name to that run's JSON. Writing
them back as ``<workdir>/<name>.json`` lets ``quality.py --workdir`` reuse them instead of running
them again: a run's name holds every setting that changes its result, and the worldlm runs name the
product defaults they ran under (``quality.WORLDLM_DEFAULTS``), so only runs of today's defaults
(and the ``local`` runs and the baselines, which do not depend on them) are reused. Where two files
hold the same run, the one modified last wins; a run already in the work directory is left as it
is.

    python benchmarks/restore_workdir.py --workdir benchmarks/out/quality-runs-defaults
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"


def collect(root: Path) -> dict[str, dict]:
    """Every run found in the raw results under ``root``: name -> the run's JSON."""
    runs: dict[str, dict] = {}
    for path in sorted(root.rglob("*.json"), key=lambda p: p.stat().st_mtime):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        results = data.get("results") if isinstance(data, dict) else None
        if not isinstance(results, dict):
            continue
        for name, run in results.items():
            if isinstance(run, dict) and isinstance(run.get("regions"), dict) and "/" not in name:
                run = {k: v for k, v in run.items() if k != "reused"}
                runs[name] = run
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="restore_workdir.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, required=True, help="the quality.py work directory to fill")
    p.add_argument("--from", dest="source", type=Path, default=OUT, help="where the raw results lie (default benchmarks/out)")
    args = p.parse_args(argv)
    if not args.source.is_dir():
        p.error(f"--from {args.source}: not a directory")
    written = kept = 0
    try:
        args.workdir.mkdir(parents=True, exist_ok=True)
        for name, run in collect(args.source).items():
            target = args.workdir / f"{name}.json"
            if target.exists():
                kept += 1
                continue
            tmp = target.with_suffix(".restoring")
            tmp.write_text(json.dumps(run))
            tmp.replace(target)
            written += 1
    except OSError as e:
        p.error(f"--workdir {args.workdir}: {e.strerror or e}")
    print(f"{written} runs restored into {args.workdir} ({kept} already there)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
