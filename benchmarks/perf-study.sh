#!/bin/bash
# the issue-14 measurements of this session, in order (benchmarks/RESULTS.md, perf section)
set -u
cd "$(dirname "$0")/.."
. .venv/bin/activate
P="python benchmarks/perf.py"
O=benchmarks/out
$P --configs tiny:2:10 --idle 60 --out $O/perf-idle2.json
$P --configs tiny:4:10 --idle 60 --out $O/perf-idle4.json
$P --configs tiny:8:10 --idle 60 --out $O/perf-idle8.json
$P --configs tiny:2:10,tiny:2:50,tiny:4:10,tiny:4:50 --slow --rounds 8 --out $O/perf-tiny.json
$P --configs tiny:2:10 --set mix=none --variants sync,overlap,overlap-tokens --rounds 8 --out $O/perf-tiny-nomix.json
$P --configs small:2:50,small:2:10,small:4:50,small:4:10 --rounds 4 --out $O/perf-small.json
$P --configs tiny:2:500 --compress int8 --variants overlap-tokens --rounds 3 --out $O/perf-bytes-int8.json
$P --configs tiny:16:10 --scale 4x4 --variants overlap-tokens --rounds 8 --out $O/perf-scale.json
$P --configs tiny:16:10 --scale 4x4 --variants overlap-tokens --rounds 20 --swarm-timeout 600 --out $O/perf-scale20.json
$P --configs tiny:16:10 --scale 4x4 --variants sync --rounds 40 --swarm-timeout 600 --out $O/perf-scale-sync.json
python benchmarks/swarm.py --quick --sizes 2 --out $O/swarm-startup.json
python benchmarks/overlap_cost.py --corpora related,mixed --seeds 2 --rounds 20 --local-steps 25
