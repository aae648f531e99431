#!/bin/bash
# The quality study of the product's current defaults (benchmarks/RESULTS.md, "The defaults of
# 2026-12-06 against training alone", issue 10; since 2026-12-07 the defaults' members take backbone
# partners, whose ablation mean-backbone, the region's backbone for everyone, is the defaults of
# 2026-12-06), from nothing: worldlm and local with 3 seeds on the
# five corpora at both budgets, the four baselines at both (one seed), and WorldLM's mechanisms
# ablated at the short budget on every corpus (attention over K (WorldLM's distance form) against the default plain mean, no residual
# exchange, the paper's residual attention instead of partners; 3 seeds, then 5, 10 on mixed) and
# at the long one on related (all three) and random (the paper's residual attention).
# Every phase is one benchmarks/quality.py invocation on the same --workdir (each reuses the runs of
# the others, and of a stopped study); two phases run at once, one run each, so that the long
# phase's tail does not leave a core idle. The last command builds the tables.
#
#   bash benchmarks/quality-defaults.sh          # about 3.5-4 hours on 2 cores
#   WORKDIR=/some/dir CORPUS_ROOT=/path/to/corpus bash benchmarks/quality-defaults.sh
#   (CORPUS_ROOT: where the corpus of benchmarks/corpora/*.toml lies; default ../shared/data/corpus)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
W=${WORKDIR:-benchmarks/out/quality-runs-defaults}
ROOT=${CORPUS_ROOT:+--corpus-root $CORPUS_ROOT}
Q="$PY benchmarks/quality.py --workdir $W --jobs 1 $ROOT"
ALL=scripts,mixed,related,today,random
(
  # the long budget: worldlm and local (3 seeds), the ablations on related and random, then baselines
  $Q --budgets long --baselines "" --ablations "" --out "$W/pA1.json"
  $Q --budgets long --corpora related,random --baselines "" --ablation-corpora related,random \
     --ablations residual-world --out "$W/pA2.json"
  $Q --budgets long --corpora related --baselines "" --ablation-corpora related --ablations K-distance,no-residual \
     --out "$W/pA3.json"
  $Q --budgets long --baselines hierfavg,centralized --ablations "" --out "$W/pA4.json"
) &
(
  # the short budget: worldlm, local and the ablations (3 seeds), the baselines, more seeds; then baselines long
  $Q --budgets short --baselines "" --ablation-corpora $ALL --ablations mean-backbone,K-distance,no-residual,residual-world \
     --out "$W/pB1.json"
  $Q --budgets short --ablations "" --out "$W/pB2.json"
  # more seeds where the mechanisms' ratios are small: 5 on every corpus, 10 on mixed
  $Q --budgets short --seeds 5 --baselines "" --ablation-corpora $ALL --ablations mean-backbone,K-distance,no-residual,residual-world \
     --out "$W/pB3.json"
  $Q --budgets short --seeds 10 --corpora mixed --baselines "" --ablation-corpora mixed \
     --ablations mean-backbone,K-distance,no-residual,residual-world --out "$W/pB4.json"
  $Q --budgets long --baselines fedavg,fedper --ablations "" --out "$W/pB5.json"
) &
wait
$PY benchmarks/quality.py --workdir "$W" $ROOT --report-only --baselines centralized,fedavg,hierfavg,fedper \
   --ablation-corpora $ALL --ablations mean-backbone,K-distance,no-residual,residual-world --out benchmarks/out/quality-defaults.json
