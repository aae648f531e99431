#!/bin/bash
# The quality study of benchmarks/RESULTS.md (issue 10), in the order it was run: what the targets
# need first, so that a study cut short still answers the main question. Every phase is one
# benchmarks/quality.py invocation on the same --workdir, so each reuses the runs of the others (and
# of an earlier, stopped study); the last one only builds the tables from what is there and lists
# the runs of the full plan that were not made.
#
#   bash benchmarks/quality-study.sh            # about 5 hours on 2 cores (phases 8-10: about 1.3)
#   WORKDIR=/some/dir bash benchmarks/quality-study.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
W=${WORKDIR:-benchmarks/out/quality-runs}
Q="$PY benchmarks/quality.py --workdir $W"
# 1. long budget: worldlm and local, 3 seeds, and fedavg / hierfavg, on the three smaller corpora
$Q --budgets long --corpora scripts,related,mixed --baselines fedavg,hierfavg --ablations "" --out "$W/p1.json"
# 2. long budget: the tune slice in 8 pieces spread over the text instead of its tail, 3 seeds
$Q --budgets long --corpora scripts,related --ablation-corpora scripts,related --ablations tune-spread \
   --baselines "" --out "$W/p2.json"
# 3. short budget: everything (5 corpora, every baseline, the ablations on related and mixed, 3 seeds)
$Q --budgets short --out "$W/p3.json"
# 4. long budget: K attention against a plain mean on related, 3 seeds (no-residual is left out at this
#    budget: at the short one it is the defaults within 0.02%, the residual weights being 1.000
#    on the region itself in every world round)
$Q --budgets long --corpora related --ablation-corpora related --ablations K-mean --baselines "" --out "$W/p4.json"
# 5. a member may take the whole of a world change per round: related (long), scripts (both), 3 seeds
$Q --budgets long --corpora related --ablation-corpora related --ablations world-full --baselines "" \
   --out "$W/p5.json"
$Q --budgets long,short --corpora scripts --ablation-corpora scripts --ablations world-full --baselines "" \
   --out "$W/p5b.json"
# 6. long budget: the two larger corpora, one seed (random with fedavg)
$Q --budgets long --corpora random --seeds 1 --baselines fedavg --ablations "" --out "$W/p6.json"
$Q --budgets long --corpora today --seeds 1 --baselines "" --ablations "" --out "$W/p7.json"
# 8. world attention (the world change towards the regions nearest by residual sketches, whole model)
#    and the significance test of evidence mixing (z = 2), alone and with whole world changes:
#    short budget on every corpus, 3 seeds; long budget where they could gain or hurt
$Q --budgets short --corpora scripts,related,mixed,today,random --ablation-corpora scripts,related,mixed,today,random \
   --ablations world-attn,mix-z2,attn-z2,full-z2,attn-full-z2 --baselines "" --out "$W/p8.json"
$Q --budgets long --corpora scripts,related,mixed --ablation-corpora scripts,related,mixed --ablations world-attn \
   --baselines "" --out "$W/p9.json"
$Q --budgets long --corpora random,today --ablation-corpora random,today --ablations world-attn --seeds 1 \
   --baselines "" --out "$W/p9b.json"
$Q --budgets long --corpora scripts --ablation-corpora scripts --ablations mix-z2 --baselines "" \
   --out "$W/p10.json"
# 11. (2026-12-04) the rest of the long-budget plan: every baseline on every corpus (centralized and
#     fedper for the first time), and the ablations mix-none, no-residual (both corpora) and K-mean
#     (mixed), 3 seeds; the runs made before are reused from the work directory
$Q --budgets long --baselines centralized,fedavg,hierfavg,fedper --ablation-corpora related,mixed \
   --ablations mix-none,K-mean,no-residual,world-attn --seeds 3 --out "$W/p11.json"
$Q --budgets long --corpora scripts,related,mixed,random --baselines centralized,fedper,hierfavg --ablations "" \
   --out "$W/p11b.json"
# 12. (2026-12-04) a tune slice of up to 8192 tokens against the defaults re-run on today's code, long
#     budget, 3 seeds, in a work directory of its own (the local runs copied from the one above)
mkdir -p "$W-1204" && cp "$W"/_subcorpora.r40h25.*.local.s*.json "$W-1204"/
$PY benchmarks/quality.py --workdir "$W-1204" --budgets long --corpora scripts,related,mixed \
   --ablation-corpora scripts,related,mixed --ablations tune-8k --baselines "" --seeds 3 \
   --out benchmarks/out/quality-tune8k.json
# 13. (2026-12-04, third session) the new defaults: K = the token embeddings and LM head, members mix
#     the backbone and K each by evidence (personal_scope = "parts"), in a work directory of its own:
#     worldlm 3 seeds at both budgets (today at the long one: 1 seed), fedper (whose K is the new
#     default too) 1 seed, the previous defaults (kv-all) and adopting the backbone whole (key-only)
#     as ablations, K attention against a plain mean and the residual exchange on related and mixed;
#     local, centralized, fedavg and hierfavg do not depend on K and are copied from the runs above
#     (the local runs of the long budget from the 2026-12-04 re-run)
D="$W-dept"; mkdir -p "$D"
cp -n "$W"/_subcorpora.toml "$W"/_subcorpora.r6h10.*.local.s*.json "$W-1204"/_subcorpora.r40h25.*.local.s*.json "$D"/
for v in centralized fedavg hierfavg; do cp -n "$W"/*."$v".s0.json "$D"/ 2>/dev/null || true; done
for f in "$W"/*.worldlm.s[0-2].json "$W-1204"/*.worldlm.s[0-2].json; do  # the previous defaults, as kv-all
  b=$(basename "$f"); cp "$f" "$D/${b%.worldlm.s*.json}.worldlm_kv-all.${b##*.worldlm.}"
done
$PY benchmarks/quality.py --workdir "$D" --budgets short --baselines fedper --ablation-corpora scripts,related,mixed,today,random \
   --ablations kv-all,key-only --out "$D/p13.json"
$PY benchmarks/quality.py --workdir "$D" --budgets long --corpora scripts,related,mixed,random --baselines fedper \
   --ablation-corpora scripts,related,mixed,random --ablations kv-all --out "$D/p13b.json"
$PY benchmarks/quality.py --workdir "$D" --budgets long --corpora related,mixed --baselines "" \
   --ablation-corpora related,mixed --ablations K-mean,no-residual --out "$D/p13c.json"
$PY benchmarks/quality.py --workdir "$D" --budgets long --corpora today --seeds 1 --baselines "" --ablations "" \
   --out "$D/p13d.json"
# 14. (fourth session) what phase 13 left out: worldlm on today at the long budget with 3 seeds,
#     hierfavg and fedper there, and world attention with the new defaults (long budget, 3 seeds)
$PY benchmarks/quality.py --workdir "$D" --budgets long --corpora today --baselines hierfavg,fedper --ablations "" \
   --out "$D/p14.json"
$PY benchmarks/quality.py --workdir "$D" --budgets long --corpora scripts,related,mixed --baselines "" \
   --ablation-corpora scripts,related,mixed --ablations world-attn --out "$D/p14b.json"
$PY benchmarks/quality.py --workdir "$D" --report-only --baselines centralized,fedavg,hierfavg,fedper \
   --ablation-corpora scripts,related,mixed,today,random --ablations kv-all,key-only,K-mean,no-residual,world-attn \
   --out benchmarks/out/quality-dept.json
# the tables of everything above (the previous defaults); the runs of the full plan that were not made are listed as not run
$Q --report-only --ablation-corpora scripts,related,mixed,today,random \
   --ablations mix-none,K-mean,no-residual,tune-spread,world-full,world-attn,mix-z2,attn-z2,full-z2,attn-full-z2 \
   --out benchmarks/out/quality.json
# 15. (seventh session) two models per member, the new default (aggregation.personal_model =
#     "separate"): the runs that do not depend on it come from phase 13's directory, its worldlm runs
#     (the previous defaults) become the `inline` ablation; worldlm with 3 seeds everywhere, and the
#     residual exchange ablated at the long budget (seed 0; RESULTS.md)
S="benchmarks/out/quality-runs-sep"
mkdir -p "$S"
for f in "$D"/*; do
  b=$(basename "$f")
  case "$b" in
    *.worldlm.s*.json) ln -f "$f" "$S/${b/.worldlm./.worldlm_inline.}" ;;
    *.local.*|*.centralized.*|*.fedavg.*|*.hierfavg.*|*.fedper.*|*.worldlm_key-only.*|*_subcorpora*) ln -f "$f" "$S/$b" ;;
  esac
done
$PY benchmarks/quality.py --workdir "$S" --baselines centralized,fedavg,hierfavg,fedper \
   --ablation-corpora scripts,related,mixed,today,random --ablations inline --out "$S/p15.json"
$PY benchmarks/quality.py --workdir "$S" --budgets long --corpora related,mixed --seeds 1 --baselines "" \
   --ablation-corpora related,mixed --ablations no-residual --out "$S/p15b.json"
$PY benchmarks/quality.py --workdir "$S" --report-only --baselines centralized,fedavg,hierfavg,fedper \
   --ablation-corpora scripts,related,mixed,today,random --ablations inline,key-only,no-residual \
   --out benchmarks/out/quality-sep.json
# 16. (eighth session) WorldLM's mechanisms under the two-model defaults, and three new forms of them
#     (RESULTS.md, "WorldLM's mechanisms under the two-model defaults"): the short budget with 3 seeds
#     (K-mean with 5), K-mean and no-residual at the long budget, shared-agreed at the long budget on
#     random (2 seeds: stopped there, see RESULTS.md)
$PY benchmarks/quality.py --workdir "$S" --budgets short --baselines "" --ablation-corpora scripts,related,mixed,today,random \
   --ablations world-attn,shared-agreed,usage-rows --out "$S/p16.json"
$PY benchmarks/quality.py --workdir "$S" --budgets short --corpora related,mixed,today,random --baselines "" \
   --ablation-corpora related,mixed,today,random --ablations agreed-usage --out "$S/p16b.json"
$PY benchmarks/quality.py --workdir "$S" --budgets short --seeds 5 --corpora related,mixed,today,random --baselines "" \
   --ablation-corpora related,mixed,today,random --ablations K-mean --out "$S/p16c.json"
$PY benchmarks/quality.py --workdir "$S" --budgets long --corpora related,mixed --baselines "" \
   --ablation-corpora related,mixed --ablations K-mean --out "$S/p16d.json"
$PY benchmarks/quality.py --workdir "$S" --budgets long --corpora mixed --baselines "" \
   --ablation-corpora mixed --ablations no-residual --out "$S/p16e.json"
$PY benchmarks/quality.py --workdir "$S" --budgets long --corpora random --seeds 2 --baselines "" \
   --ablation-corpora random --ablations shared-agreed --out "$S/p16f.json"
$PY benchmarks/quality.py --workdir "$S" --report-only --baselines centralized,fedavg,hierfavg,fedper \
   --ablation-corpora scripts,related,mixed,today,random \
   --ablations inline,key-only,no-residual,K-mean,world-attn,shared-agreed,usage-rows,agreed-usage \
   --out benchmarks/out/quality-sep.json
