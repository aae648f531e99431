#!/usr/bin/env python
"""Quality benchmark: does collaboration pay, on corpora nobody tuned for? (issue 10)

Every run is one ``worldlm-simulate`` invocation with the product's defaults (nothing here is tuned
per corpus). For each corpus (a grouping file under ``benchmarks/corpora/``: regions made of
sub-corpora of ``../shared/data/corpus``, by reference) and each budget (short: 6 rounds x 10 local
steps; long: 40 rounds x 25 local steps), it runs:

- ``worldlm`` and ``local`` with 3 seeds (mean and spread), ``centralized``, ``fedavg``,
  ``hierfavg`` and ``fedper`` with seed 0;
- on the ablation corpora (``--ablation-corpora``, default ``related`` and ``mixed``: regions of several
peers, where the key layers' attention acts, and several regions), with 3 seeds,
  the ablations of WorldLM's mechanisms: ``mix-none`` (members adopt the region's agreed model: the
  paper's WorldLM, no evidence), ``K-distance`` (WorldLM's distance attention over the key layers
  inside a region instead of the default plain mean: above 1, the plain mean is the better rule)
  and ``no-residual`` (no residual-embedding exchange of key layers between leaders); on request (``--ablations``) also ``mix-cosine`` (the earlier personal mix by update
  cosine), ``no-mix-world`` (world changes taken whole) ``tune-spread`` (the tune slice in 8
  pieces spread over the training text instead of its tail), ``tune-8k`` (a tune slice of up to
  8192 tokens instead of 2048) and ``world-full`` (a member may take up
  to the whole of a world change per round instead of a quarter).

``local`` does not depend on the grouping (a peer's batch stream is a function of the seed and its
sub-corpus only), so it runs once per seed on every sub-corpus the corpora use, and each corpus
reads its peers' results from that run.

Reported per corpus and budget: each strategy's region perplexities and their geometric mean over
regions (the region mean), worldlm against local per region and per peer (mean over seeds, with
the seed spread: the sample standard deviation, and "worse" only where worldlm's mean exceeds
local's by more than the larger of the two spreads), and every ratio against worldlm. Perplexity is
per token; with the default byte tokenizer a token is a UTF-8 byte.

Usage::

    python benchmarks/quality.py                    # the full study (112 runs; hours here: see RESULTS.md)
    python benchmarks/quality.py --quick            # for iteration: 2 corpora, 20 rounds, 2 seeds
    python benchmarks/quality.py --workdir DIR      # keep every run's JSON in DIR and reuse them
    python benchmarks/quality.py --corpora /data/mine --ablation-corpora /data/mine   # a corpus of one's own

A corpus of one's own (``--corpora PATH``: a directory in the federated layout, its regions as they
are, or a grouping file) needs no shared corpus; its ``local`` runs are on it.

Each run uses one torch thread; ``--jobs`` runs go in parallel (this machine has 2 cores).
Writes ``--out`` (raw results) and the tables next to it (``.md``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CORPORA_DIR = REPO / "benchmarks" / "corpora"
SHARED_CORPUS = REPO.parent / "shared" / "data" / "corpus"
CORPORA = ("scripts", "mixed", "related", "today", "random")
#: corpora outside the default plan: `holdout` (f), a regrouping drawn after the defaults were frozen,
#: to check them as the hidden corpus will (ask for it with --corpora)
EXTRA_CORPORA = ("holdout",)
KNOWN_CORPORA = CORPORA + EXTRA_CORPORA


@dataclass(frozen=True)
class Corpus:
    """A corpus of the study: one of :data:`KNOWN_CORPORA` (a grouping file of ``benchmarks/corpora``
    over the shared corpus, ``known``) or a user's own, given by its path: a directory in the
    federated layout ``<region>/<sub_corpus>/{train.txt,valid.txt}`` (its own regions) or a grouping
    file (``.toml``, :func:`worldlm_p2p.train.corpus.read_grouping`). ``name``: what the runs (in a
    work directory) and the tables call it: for a path its last component and a digest of the full
    path, so that two corpora of one name never share runs."""

    name: str
    data: Path  # what worldlm-simulate's --data gets
    known: bool


def resolve_corpus(spec: str, *, prog: str) -> Corpus:
    """A ``--corpora`` entry as a :class:`Corpus` (exit with a one-line error if it is neither)."""
    if spec in KNOWN_CORPORA:
        return Corpus(spec, CORPORA_DIR / f"{spec}.toml", True)
    path = Path(spec).expanduser()
    if not path.exists() or (path.is_file() and path.suffix.lower() != ".toml"):
        what = "does not exist" if not path.exists() else "is a file but not a grouping file (.toml)"
        sys.exit(f"{prog}: error: corpus {spec!r}: not one of {', '.join(KNOWN_CORPORA)}, and as a path it {what} "
                 f"(give a directory <region>/<sub_corpus>/train.txt or a grouping file)")
    full = path.resolve()
    stem = re.sub(r"[^A-Za-z0-9_-]", "_", full.stem)[:40] or "corpus"
    return Corpus(f"{stem}-{hashlib.sha1(str(full).encode()).hexdigest()[:6]}", full, False)


BASELINES = ("centralized", "fedavg", "hierfavg", "fedper")
ABLATIONS = {
    "mix-none": ["--mix", "none"],
    "mix-cosine": ["--mix", "cosine"],
    "no-mix-world": ["--no-mix-world"],
    # no world rounds at all: regions never meet (a world round after every 10^6-th region round),
    # so what the leaders' exchange across borders adds is this run against the defaults
    "no-world": ["--world-every", "1000000"],
    # fewer world rounds: a region trains its own backbone for M region rounds between them
    "world-every-2": ["--world-every", "2"],
    "world-every-3": ["--world-every", "3"],
    # the plain mean for K in a region: the default since 2026-12-06's fifteenth session (before,
    # "distance"), so these runs are the defaults' (kept for the earlier tables)
    "K-mean": ["--attention", "mean"],
    # WorldLM's attentive aggregation of K (tau 0.1): the default until 2026-12-06's fifteenth session
    "K-distance": ["--attention", "distance"],
    "usage-rows": ["--usage-rows"],  # K's rows weighted by the members' token counts
    # attention over K by what each member's text holds: a plain mean over members per layer, each
    # row of the token-indexed key layers weighted by the members' token counts (no distance score)
    "K-usage": ["--attention", "mean", "--usage-rows"],
    "no-residual": ["--no-residual"],
    # the leaders' attention over the other regions, by how alike they departed from the rest (the
    # default since 2026-12-06; before, "world")
    "residual-partners": ["--residual-attention", "partners"],
    # the paper's: over every region and the region itself, residuals from the world's mean
    "residual-world": ["--residual-attention", "world"],
    "tune-spread": ["--tune-pieces", "8"],
    "tune-8k": ["--tune-tokens", "8192"],
    "world-full": ["--mix-world-max", "1"],
    "world-attn": ["--world-target", "attention"],
    # the region's agreed backbone for every member's shared model: the defaults until 2026-12-07
    # (twentieth session), when backbone partners with the own half became the default
    "mean-backbone": ["--region-backbone", "mean"],
    # each member's shared model takes the region's backbone or the mean of its own and one mate's,
    # whichever its tune slice prefers (aggregation.region_backbone = "partners", without the own half)
    "partners": ["--region-backbone", "partners", "--no-partner-own-half"],
    # ... a pair taken only when it also beats the member's own backbone (partner_check = "self")
    "partners-self": ["--region-backbone", "partners", "--no-partner-own-half", "--partner-check", "self"],
    # ... and the member's own backbone half and half with the region's as one more candidate
    # (aggregation.partner_own_half): the defaults since 2026-12-07, so these runs are the defaults'
    # (kept for the earlier tables)
    "partners-own-half": ["--region-backbone", "partners"],
    # ... with at most 2 mates evaluated per round (a window that moves on every round): a third of
    # the downloads of 6 in a region of 7
    "partners-own-half-c2": ["--region-backbone", "partners", "--partner-candidates", "2"],
    "world-fp16": ["--compress-world", "fp16"],  # leaders' models in fp16 in world rounds (issue 14)
    "mix-z2": ["--mix-z", "2"],
    # the defaults before 2026-12-04's study: K = k_proj/v_proj, one mixing weight for the whole model
    "kv-all": ["--key-layers", "kv", "--personal-scope", "all", "--personal-model", "inline"],
    "key-only": ["--personal-model", "inline", "--personal-scope", "key"],  # members adopt the backbone whole, mix K by evidence
    # one model per member, mixed by parts (the defaults until 2026-12-05's seventh session)
    "inline": ["--personal-model", "inline"],
    # the shared backbone takes world changes by evidence in regions of three or more (its first
    # form, in every region, ran as "shared-world-evidence": benchmarks/RESULTS.md, 2026-12-07)
    "shared-world-evidence3": ["--shared-model", "evidence-world"],
    "shared-agreed": ["--shared-model", "agreed"],  # the shared model is WorldLM's member; only the personal one mixes
    "agreed-usage": ["--shared-model", "agreed", "--usage-rows"],
    "agreed-K-mean": ["--shared-model", "agreed", "--attention", "mean"],
    "agreed-no-residual": ["--shared-model", "agreed", "--no-residual"],
    "attn-z2": ["--world-target", "attention", "--mix-z", "2"],
    "full-z2": ["--mix-world-max", "1", "--mix-z", "2"],
    "attn-full-z2": ["--world-target", "attention", "--mix-world-max", "1", "--mix-z", "2"],
    # DiLoCo's outer optimizer (arXiv 2311.08105: Nesterov, lr 0.7, momentum 0.9) on the region's
    # backbone; with two models per member only the shared model follows it, the personal one by evidence
    "outer-nesterov": ["--outer", "nesterov", "--outer-lr", "0.7"],
    # FedAvg's server learning rate above 1 (no momentum): the region's agreed model extrapolates the
    # members' mean change, which a plain mean shrinks where their data differ
    "outer-sgd-1.5": ["--outer", "sgd", "--outer-lr", "1.5"],
    "outer-sgd-2": ["--outer", "sgd", "--outer-lr", "2"],
    # the members' evidence searches held to a share of their compute, their last weights reused in
    # between (aggregation.evidence_share; issue 14: what a peer whose rounds are frequent pays)
    "evidence-5pct": ["--evidence-share", "0.05"],
    "evidence-20pct": ["--evidence-share", "0.2"],
}
DEFAULT_ABLATIONS = ("mix-none", "K-distance", "no-residual")  # the others on request (--ablations)
#: which defaults of the product a worldlm run's name says it ran with (the runs of a --workdir made
#: under other defaults are not reused): "d1207", backbone partners with the own half, since
#: 2026-12-07; the runs before it carry no tag
WORLDLM_DEFAULTS = "d1207"


@dataclass(frozen=True)
class Budget:
    name: str
    rounds: int
    local_steps: int


@dataclass(frozen=True)
class Run:
    corpus: str  # a corpus name, or "_subcorpora" for the local runs
    budget: Budget
    variant: str  # worldlm, local, a baseline, or worldlm:<ablation>
    seed: int
    flags: tuple[str, ...] = field(default=())

    def name(self, args) -> str:
        """Every setting that changes the result is in the name, so a --workdir never serves a run
        made with other settings."""
        shape = f"r{self.budget.rounds}h{self.budget.local_steps}.{args.model}.b{args.batch_size}x{args.seq_len}." \
                f"e{args.eval_tokens}"
        # a worldlm run (an ablation is the defaults and its flags) names the product's defaults it ran
        defaults = f".{WORLDLM_DEFAULTS}" if self.variant.startswith("worldlm") else ""
        return f"{self.corpus}.{shape}.{self.variant.replace(':', '_')}{defaults}.s{self.seed}"


def plan(args) -> list[Run]:
    budgets = args.budgets
    seeds = list(range(args.seeds))
    runs: list[Run] = []
    specs = getattr(args, "corpus_specs", {})
    for b in budgets:
        if any(c not in specs or specs[c].known for c in args.corpora):
            runs += [Run("_subcorpora", b, "local", s, ("--strategy", "local")) for s in seeds]
        for c in args.corpora:
            if c in specs and not specs[c].known:  # a corpus of one's own: its local runs on it
                runs += [Run(c, b, "local", s, ("--strategy", "local")) for s in seeds]
            runs += [Run(c, b, "worldlm", s, ("--strategy", "worldlm")) for s in seeds]
            runs += [Run(c, b, v, 0, ("--strategy", v)) for v in BASELINES if v in args.baselines]
            if c in args.ablation_corpora:
                for a in args.ablations:
                    runs += [Run(c, b, f"worldlm:{a}", s, ("--strategy", "worldlm", *ABLATIONS[a])) for s in seeds]
    # what the targets need first (local and worldlm, then the ablations, then the single-seed
    # baselines), so that a study cut short still answers the main question; within each, the
    # longest first, so that the pool's tail is short
    def priority(r: Run) -> int:
        return 0 if r.variant in ("local", "worldlm") else 1 if r.variant.startswith("worldlm:") else 2

    return sorted(runs, key=lambda r: (priority(r), -r.budget.rounds * r.budget.local_steps * args.peers.get(r.corpus, 1)))


def union_grouping(corpora: list[str], workdir: Path, root: Path) -> Path:
    """Every sub-corpus the corpora use, each its own region (for the local runs)."""
    from worldlm_p2p.train.corpus import read_grouping

    from worldlm_p2p.errors import WorldLMError

    subs: dict[str, Path] = {}
    for c in corpora:
        try:
            groups = read_grouping(CORPORA_DIR / f"{c}.toml", root=root)
        except WorldLMError as e:  # (one local run serves every known corpus: it needs all their sub-corpora)
            sys.exit(f"quality.py: error: the local runs cover every sub-corpus of the known corpora, and {e}")
        for paths in groups.values():
            for p in paths:
                subs[p.name] = p.relative_to(root.resolve())
    lines = [f"root = {json.dumps(str(root.resolve()))}", "", "[regions]"]
    lines += [f'{name} = ["{rel.as_posix()}"]' for name, rel in sorted(subs.items())]
    path = workdir / "_subcorpora.toml"
    # atomically: two quality.py processes on one work directory (quality-defaults.sh) both write it
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return path


def run_one(run: Run, args, workdir: Path) -> dict[str, Any]:
    out = workdir / f"{run.name(args)}.json"
    if out.is_file():
        res = json.loads(out.read_text())
        res["reused"] = True
        return res
    spec = getattr(args, "corpus_specs", {}).get(run.corpus)
    data = workdir / "_subcorpora.toml" if run.corpus == "_subcorpora" else \
        spec.data if spec is not None else CORPORA_DIR / f"{run.corpus}.toml"
    cmd = [sys.executable, "-m", "worldlm_p2p.cli.simulate", "--data", str(data), "--model", args.model,
           "--rounds", str(run.budget.rounds), "--local-steps", str(run.budget.local_steps),
           "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--eval-tokens", str(args.eval_tokens),
           "--seed", str(run.seed), "--threads", "1", "--device", "cpu", "--no-report", *run.flags,
           "--out", str(out.with_suffix(".tmp.json"))]
    if out.with_suffix(".tmp.json").is_file():  # finished after its benchmark process was stopped
        res = json.loads(out.with_suffix(".tmp.json").read_text())
        res["command"] = "worldlm-simulate " + " ".join(cmd[3:-2])
        out.write_text(json.dumps(res))
        out.with_suffix(".tmp.json").unlink()
        return res
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if args.corpus_root and (spec is None or spec.known):  # (a grouping file of one's own names its own root)
        env["WORLDLM_CORPUS_ROOT"] = str(args.corpus_root)
    t0 = time.monotonic()
    log = workdir / f"{run.name(args)}.log"
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    if proc.returncode != 0:
        tail = log.read_text().strip().splitlines()[-3:]
        raise RuntimeError(f"{run.name(args)} failed (exit {proc.returncode}): {' | '.join(tail)}")
    res = json.loads(out.with_suffix(".tmp.json").read_text())
    res["command"] = "worldlm-simulate " + " ".join(cmd[3:-2])
    out.write_text(json.dumps(res))
    out.with_suffix(".tmp.json").unlink()
    print(f"  {run.name(args)}: {time.monotonic() - t0:.0f} s", flush=True)
    return res


# ------------------------------------------------------------------------------ paired studies
# What the studies that compare variants of the defaults with this machinery share
# (benchmarks/compression.py, benchmarks/overlap_cost.py): their arguments, the checks, the corpus
# layouts, the work directory and the pool that runs the plan.


def corpus_layouts(args, *, prog: str) -> dict[str, dict[str, list[str]]]:
    """Resolve ``args.corpora`` (names or paths, :func:`resolve_corpus`; they become the corpora's
    names, their :class:`Corpus` in ``args.corpus_specs``), check the corpus root where a known
    corpus needs it and each corpus's layout (exit with a one-line error), point the known corpora's
    runs at the root (``args.corpus_root``) and return each corpus's layout: region -> sub-corpus
    names."""
    specs = {}
    for c in args.corpora:
        spec = resolve_corpus(c, prog=prog)
        specs[spec.name] = spec
    args.corpus_specs = {**getattr(args, "corpus_specs", {}), **specs}
    args.corpora = list(specs)
    sys.path.insert(0, str(REPO))
    from worldlm_p2p.errors import WorldLMError
    from worldlm_p2p.train.corpus import list_corpus, read_grouping

    root = (args.corpus_root or SHARED_CORPUS).resolve()
    if any(spec.known for spec in specs.values()):
        if not root.is_dir():
            sys.exit(f"{prog}: error: corpus root {root} is not a directory (give --corpus-root)")
        args.corpus_root = root
    layouts = {}
    for name, spec in specs.items():
        try:
            layout = read_grouping(spec.data, root=root) if spec.known else list_corpus(spec.data)
        except WorldLMError as e:
            sys.exit(f"{prog}: error: corpus {name}: {e}")
        layouts[name] = {r: [q.name for q in ps] for r, ps in layout.items()}
    return layouts


def finish_study(args, raw: dict[str, Any], lines: list[str], tmp) -> None:
    """Write a paired study's raw results (``--out``) and its table (``.md`` beside it), print the
    table and remove the temporary work directory (``tmp``, None with ``--workdir``)."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(raw, indent=1))
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if tmp is not None:
        tmp.cleanup()


def study_parser(description: str, *, out: Path) -> argparse.ArgumentParser:
    """The arguments every paired study takes (each adds its own)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--corpora", default="related,mixed",
                   help=f"comma-separated, of {', '.join(KNOWN_CORPORA)} or paths (a corpus directory or a grouping file)")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--local-steps", type=int, default=25)
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--eval-tokens", type=int, default=8192)
    p.add_argument("--corpus-root", type=Path, default=None)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--workdir", type=Path, default=None, help="keep (and reuse) every run's results here")
    p.add_argument("--out", type=Path, default=out)
    return p


def prepare_study(args, *, prog: str) -> tuple[dict[str, dict[str, list[str]]], Path, Any]:
    """Check the corpora and the corpus root (exit with a one-line error), point the runs at the
    root, and return the corpora's layouts, the work directory and the temporary directory to clean
    up (None with ``--workdir``). ``args.corpora`` becomes a list."""
    args.corpora = [c for c in args.corpora.split(",") if c]
    layouts = corpus_layouts(args, prog=prog)
    if args.workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix=f"worldlm-{Path(prog).stem}-")
        return layouts, Path(tmp.name), tmp
    args.workdir.mkdir(parents=True, exist_ok=True)
    return layouts, args.workdir, None


def run_plan(runs: list[Run], args, workdir: Path, *, what: str) -> dict[Run, dict[str, Any]]:
    """Every run of ``runs``, ``args.jobs`` at a time (those already in ``workdir`` are reused)."""
    print(f"{what}: {len(runs)} runs, {args.jobs} at a time, in {workdir}", flush=True)
    results: dict[Run, dict[str, Any]] = {}
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(run_one, r, args, workdir): r for r in runs}
        for f in as_completed(futures):
            results[futures[f]] = f.result()
    return results


# ------------------------------------------------------------------------------ tables


def geo(values) -> float:
    values = list(values)
    if any(v is None or not math.isfinite(v) for v in values):
        return math.inf
    return math.exp(sum(math.log(v) for v in values) / len(values))


def mean_sd(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation; (inf, nan) when a value is not finite (a diverged run)."""
    if any(v is None or not math.isfinite(v) for v in values):
        return math.inf, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def peer_ppl(res: dict[str, Any]) -> dict[str, float]:
    return {k: (v["perplexity"] if v["perplexity"] is not None else math.inf) for k, v in res["peers"].items()}


def local_for(corpus_layout: dict[str, list[str]], local_res: dict[str, Any]) -> dict[str, float]:
    """The corpus's peers' perplexities read off a local run: on the corpus itself (a corpus of one's
    own: by region and sub-corpus), or on every sub-corpus of the known corpora (by sub-corpus)."""
    peers = peer_ppl(local_res)
    keys = [f"{r}/{label}" for r, labels in corpus_layout.items() for label in labels]
    if all(k in peers for k in keys):
        return {k: peers[k] for k in keys}
    by_label = {k.split("/", 1)[1]: v for k, v in peers.items()}
    return {f"{r}/{label}": by_label[label] for r, labels in corpus_layout.items() for label in labels}


def took(res: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per region, what its members took by evidence mixing (the mean interpolation weight of their
    region and of their world rounds, and the share of world rounds they declined: weight 0) and the
    weight the residual-embedding attention gave the region itself (mean over world rounds and key
    layers)."""
    out: dict[str, dict[str, float]] = {}
    by_region: dict[str, list[dict]] = {}
    for key, mixes in (res.get("mixes") or {}).items():
        by_region.setdefault(key.split("/", 1)[0], []).extend(mixes)
    for region, mixes in by_region.items():
        reg = [m["lam"] for m in mixes if m["kind"] == "region"]
        wor = [m["lam"] for m in mixes if m["kind"] == "world"]
        rounds_w = [wr.get("weights", {}).get(region, {}) for wr in res.get("world_rounds") or []]
        selfw = [w for ws in rounds_w for w in ws.get(region, [])]
        # world attention (the region is not among its own weights): the region it leaned on most
        tops = [max(ws.items(), key=lambda kv: (statistics.fmean(kv[1]), kv[0])) for ws in rounds_w
                if ws and region not in ws]
        top = max(sorted({g for g, _ in tops}), key=lambda g: sum(1 for x, _ in tops if x == g)) if tops else ""
        own = [m["lam"] for m in mixes if m["kind"] == "personal"]
        own_k = [m["key_lam"] for m in mixes if m["kind"] == "personal" and "key_lam" in m]
        reg_k = [m["key_lam"] for m in mixes if m["kind"] == "region" and "key_lam" in m]
        wor_k = [m["key_lam"] for m in mixes if m["kind"] == "world" and "key_lam" in m]
        out[region] = {"region_lam": statistics.fmean(reg) if reg else math.nan,
                       "personal_lam": statistics.fmean(own) if own else math.nan,
                       "personal_key_lam": statistics.fmean(own_k) if own_k else math.nan,
                       "region_key_lam": statistics.fmean(reg_k) if reg_k else math.nan,
                       "world_key_lam": statistics.fmean(wor_k) if wor_k else math.nan,
                       "world_lam": statistics.fmean(wor) if wor else math.nan,
                       "world_declined": (sum(1 for x in wor if x == 0) / len(wor)) if wor else math.nan,
                       "self_weight": statistics.fmean(selfw) if selfw else math.nan,
                       "top_partner": top,
                       "top_weight": statistics.fmean(statistics.fmean(w) for _, w in tops) if tops else math.nan}
    return out


def region_ppl(layout: dict[str, list[str]], peers: dict[str, float]) -> dict[str, float]:
    return {r: statistics.fmean(peers[f"{r}/{label}"] for label in labels) for r, labels in layout.items()}


def fmt(x: float, digits: int = 3) -> str:
    return "diverged" if not math.isfinite(x) else f"{x:.{digits}f}"


# two-sided 95% quantiles of Student's t, by degrees of freedom (standard tables)
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def paired_ratio(variant: dict[int, dict[str, float]], base: dict[int, dict[str, float]]):
    """The per-seed ratio of region means, variant over base, on the seeds both ran: (mean, sd,
    seeds where the variant is lower, seeds, verdict of a paired t-test on the ratios at 5%), or
    None with fewer than two common seeds."""
    seeds = sorted(set(variant) & set(base))
    if len(seeds) < 2 or len(seeds) - 1 not in _T95:
        return None
    ratios = [geo(variant[s].values()) / geo(base[s].values()) for s in seeds]
    if not all(math.isfinite(x) for x in ratios):
        return None
    m, sd = mean_sd(ratios)
    t = (m - 1) / (sd / math.sqrt(len(ratios))) if sd > 0 else (0.0 if m == 1 else math.copysign(math.inf, m - 1))
    verdict = "lower" if t < -_T95[len(ratios) - 1] else "higher" if t > _T95[len(ratios) - 1] else "level"
    return m, sd, sum(x < 1 for x in ratios), len(ratios), verdict


def _worse(variant: dict[int, dict[str, float]], local: dict[int, dict[str, float]], region: str) -> bool:
    """Whether a variant's mean perplexity in ``region`` exceeds local's by more than the larger of
    the two seed spreads (the verdict of the worldlm-against-local table)."""
    w = mean_sd([variant[s][region] for s in variant])
    lo = mean_sd([local[s][region] for s in local])
    if not math.isfinite(w[0]):
        return True
    return math.isfinite(lo[0]) and w[0] - lo[0] > max(w[1], lo[1])


def corpus_tables(corpus: str, budget: Budget, layout, results: dict[str, dict[int, dict]], args) -> tuple[list[str], dict]:
    """Markdown for one corpus and budget, and its summary figures."""
    regions = sorted(layout)
    per_variant: dict[str, dict[int, dict[str, float]]] = {}  # variant -> seed -> region -> ppl
    peers_of: dict[str, dict[int, dict[str, float]]] = {}
    for variant, by_seed in results.items():
        for seed, res in by_seed.items():
            peers = local_for(layout, res) if variant == "local" else peer_ppl(res)
            peers_of.setdefault(variant, {})[seed] = peers
            per_variant.setdefault(variant, {})[seed] = region_ppl(layout, peers)
    lines = [f"#### {corpus}, {budget.name} budget ({budget.rounds} rounds x {budget.local_steps} steps)", "",
             "| variant | seeds | " + " | ".join(regions) + " | region mean (geometric) |",
             "|---|---:|" + "---:|" * (len(regions) + 1)]
    summary: dict[str, Any] = {}
    order = ["worldlm", "local", *BASELINES, *[f"worldlm:{a}" for a in ABLATIONS]]
    for v in [x for x in order if x in per_variant]:
        seeds = sorted(per_variant[v])
        cells = []
        for r in regions:
            m, sd = mean_sd([per_variant[v][s][r] for s in seeds])
            cells.append(fmt(m) + (f" ± {sd:.3f}" if len(seeds) > 1 else ""))
        gm, gsd = mean_sd([geo(per_variant[v][s].values()) for s in seeds])
        summary[v] = dict(region_mean=gm, region_mean_sd=gsd, seeds=len(seeds),
                          regions={r: mean_sd([per_variant[v][s][r] for s in seeds])[0] for r in regions})
        lines.append(f"| {v} | {len(seeds)} | " + " | ".join(cells) + f" | {fmt(gm)}"
                     + (f" ± {gsd:.3f}" if len(seeds) > 1 else "") + " |")
    if "worldlm" in per_variant and "local" in per_variant:
        lines += ["", "worldlm against local (mean over seeds; ratio < 1: worldlm better; 'better' and 'worse' "
                  "only beyond the larger of the two seed spreads):", "", "| region | worldlm | local | ratio | verdict |", "|---|---:|---:|---:|---|"]
        worse, better = [], []
        for r in regions:
            w = mean_sd([per_variant["worldlm"][s][r] for s in per_variant["worldlm"]])
            lo = mean_sd([per_variant["local"][s][r] for s in per_variant["local"]])
            spread = max(w[1], lo[1])
            if not math.isfinite(w[0]) or not math.isfinite(lo[0]):  # a diverged run
                verdict = "worse" if not math.isfinite(w[0]) else "better"
            else:
                verdict = ("worse" if w[0] - lo[0] > spread else "better" if lo[0] - w[0] > spread
                           else "level (within the seed spread)")
            (worse if verdict == "worse" else better if verdict == "better" else []).append(r)
            lines.append(f"| {r} | {w[0]:.3f} ± {w[1]:.3f} | {lo[0]:.3f} ± {lo[1]:.3f} | {w[0] / lo[0]:.3f} | {verdict} |")
        peer_keys = sorted(next(iter(peers_of["worldlm"].values())))
        pw = sum(1 for k in peer_keys if statistics.fmean(peers_of["worldlm"][s][k] for s in peers_of["worldlm"])
                 < statistics.fmean(peers_of["local"][s][k] for s in peers_of["local"]))
        gain = 1 - summary["worldlm"]["region_mean"] / summary["local"]["region_mean"]  # > 0: worldlm lower
        lines += ["", f"Regions better than local beyond the seed spread: {len(better)} of {len(regions)}; worse beyond it: "
                  f"{', '.join(worse) or 'none'}. Peers better than local: {pw} of {len(peer_keys)}. Region mean: "
                  f"worldlm {-gain * 100:+.1f}% against local (target: -5% or lower)."]
        summary["against_local"] = dict(regions_better=len(better), regions=len(regions), regions_worse=worse,
                                        peers_better=pw, peers=len(peer_keys), region_mean_gain=gain)
    took_rows = [(s, results["worldlm"][s].get("took") or took(results["worldlm"][s])) for s in results.get("worldlm", {})]
    if took_rows and any(t for _, t in took_rows):
        lines += ["", "What worldlm's members took (mean over seeds): the interpolation weight chosen on their tune "
                  "slice for the region's model and for the world change, the share of world rounds declined "
                  "(weight 0), the residual attention's weight on the region itself (world target `mean`) or "
                  "the region the world attention leaned on most and its mean weight (`attention`); with "
                  "`personal_scope = \"parts\"` the weights are the backbone's, the key layers' in brackets; with "
                  "a separate personal model (the default) the first two are its shared model's (which takes "
                  "the backbone whole: the weights are the key layers'), and the personal model's weight "
                  "towards its shared model after each round comes last:", "",
                  "| region | from the region | from the world | world rounds declined | residual self-weight "
                  "| nearest region (weight) | personal towards shared |",
                  "|---|---:|---:|---:|---:|---|---:|"]
        for r in regions:
            def avg(k: str, r: str = r) -> str:
                xs = [t[r][k] for _, t in took_rows if r in t and math.isfinite(t[r].get(k, math.nan))]
                return f"{statistics.fmean(xs):.3f}" if xs else "-"
            tops = sorted({t[r]["top_partner"] for _, t in took_rows if r in t and t[r].get("top_partner")})
            near = f"{'/'.join(tops)} ({avg('top_weight')})" if tops else "-"
            def with_key(k: str) -> str:
                key = avg(k.replace("_lam", "_key_lam"))
                return avg(k) + (f" ({key})" if key != "-" else "")
            lines.append(f"| {r} | {with_key('region_lam')} | {with_key('world_lam')} | {avg('world_declined')} "
                         f"| {avg('self_weight')} | {near} | {with_key('personal_lam')} |")
    if "worldlm" in summary:
        w = summary["worldlm"]["region_mean"]
        lines += ["", "X against worldlm: the ratio of the region means, and the same ratio paired by seed (the "
                  "runs of one seed share the initial model and the order of the data, so the per-seed ratio "
                  "removes most of the seed noise; 'lower' / 'higher': a paired t-test at the 5% level):", "",
                  "| X | region mean X / worldlm | paired by seed: mean ± sd | seeds lower | paired verdict "
                  "| regions worse than local beyond the seed spread | X / local: region means (paired by seed) |",
                  "|---|---:|---:|---:|---|---|---:|"]
        for v, s in summary.items():
            if v in ("worldlm", "against_local"):
                continue
            paired = paired_ratio(per_variant[v], per_variant["worldlm"])
            if paired is None:
                cells = "- | - | -"
            else:
                m, sd, lower, n, verdict = paired
                cells = f"{m:.4f} ± {sd:.4f} | {lower} of {n} | {verdict}"
                s["paired"] = dict(mean=m, sd=sd, seeds_lower=lower, seeds=n, verdict=verdict)
            worse = "-"
            if v.startswith("worldlm:") and "local" in per_variant:
                worse_regions = [r for r in regions if _worse(per_variant[v], per_variant["local"], r)]
                s["regions_worse_than_local"] = worse_regions
                worse = ", ".join(worse_regions) or "none"
            vs_local = "-"
            if v.startswith("worldlm:") and "local" in summary:
                s["vs_local"] = s["region_mean"] / summary["local"]["region_mean"]
                vs_local = f"{fmt(s['vs_local'])}x"
                paired_local = paired_ratio(per_variant[v], per_variant["local"])
                if paired_local is not None:
                    s["vs_local_paired"] = dict(zip(("mean", "sd", "seeds_lower", "seeds", "verdict"), paired_local))
                    vs_local += f" ({paired_local[0]:.4f} ± {paired_local[1]:.4f})"
            lines.append(f"| {v} | {fmt(s['region_mean'] / w)}x | {cells} | {worse} | {vs_local} |")
    return lines + [""], summary


def targets_table(summary: dict[str, Any], args) -> list[str]:
    """One line per corpus and budget against issue 10's targets."""
    lines = ["### Against the targets", "",
             "| corpus | budget | worldlm vs local, region mean (negative: lower) | regions worse than local beyond the seed spread | "
             "peers better than local | fedavg / worldlm | hierfavg / worldlm | centralized / worldlm |",
             "|---|---|---:|---|---:|---:|---:|---:|"]
    for key, summ in summary.items():
        corpus, budget = key.split(".")
        al = summ.get("against_local")
        w = summ.get("worldlm", {}).get("region_mean")
        if al is None or w is None:
            continue

        def ratio(v: str) -> str:
            x = summ.get(v, {}).get("region_mean")
            return "-" if x is None else f"{fmt(x / w)}x"

        lines.append(f"| {corpus} | {budget} | {-al['region_mean_gain'] * 100:+.1f}% | "
                     f"{', '.join(al['regions_worse']) or 'none'} (of {al['regions']}) | {al['peers_better']} of "
                     f"{al['peers']} | {ratio('fedavg')} | {ratio('hierfavg')} | {ratio('centralized')} |")
    return lines + ["", "Targets: at least 5% better than local in the region mean and no region worse than local "
                    "beyond the seed spread, on every corpus and at both budgets; fedavg / worldlm >= 1.91x and "
                    "hierfavg / worldlm >= 1.86x; stretch: below centralized in every region.", ""]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="for iteration: 2 corpora (scripts, related), the short budget "
                                                        "and 20 rounds x 25 steps, 2 seeds, baselines fedavg and "
                                                        "hierfavg, the mix-none ablation on related (about 11 min from nothing on 2 cores)")
    p.add_argument("--corpora", default=None,
                   help=f"comma-separated, of {', '.join(KNOWN_CORPORA)} (default: all but {', '.join(EXTRA_CORPORA)}), "
                        "or paths of corpora of one's own: a directory <region>/<sub_corpus>/{train,valid}.txt (its "
                        "regions as they are) or a grouping file (.toml); these need no shared corpus")
    p.add_argument("--ablation-corpora", default=None, help="corpora that get the ablations, names or paths as in --corpora (default related,mixed: both have regions of several peers, where K attention acts, and several regions)")
    p.add_argument("--ablations", default=",".join(DEFAULT_ABLATIONS),
                   help=f"which ablations, of {', '.join(ABLATIONS)} (default {','.join(DEFAULT_ABLATIONS)})")
    p.add_argument("--baselines", default=",".join(BASELINES), help="which single-seed baselines (default all)")
    p.add_argument("--seeds", type=int, default=None, help="seeds of worldlm, local and the ablations (default 3)")
    p.add_argument("--budgets", default="short,long", help="which budgets, of short and long (default both)")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: build the tables from the runs already in --workdir (the others are listed "
                        "as not run)")
    p.add_argument("--long-rounds", type=int, default=None, help="long budget in region rounds (default 40)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--eval-tokens", type=int, default=8192)
    p.add_argument("--corpus-root", type=Path, default=None,
                   help="where the corpus of the grouping files lies (default ../shared/data/corpus)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--workdir", type=Path, default=None, help="keep (and reuse) every run's results here")
    p.add_argument("--out", type=Path, default=None, help="raw results (default benchmarks/out/quality[-quick].json; with corpora of one's own "
                        "quality[-quick]-<their names>.json)")
    args = p.parse_args(argv)
    if args.corpora is not None and not args.corpora.strip(", "):  # (an empty --corpora is no corpus, not all of them)
        sys.exit("quality.py: error: --corpora names no corpus")
    args.corpora = [c for c in (args.corpora or ("scripts,related" if args.quick else ",".join(CORPORA))).split(",") if c]
    args.ablation_corpora = [c for c in (args.ablation_corpora if args.ablation_corpora is not None else
                                         ("related" if args.quick else "related,mixed")).split(",") if c]
    if args.quick and args.ablations == ",".join(DEFAULT_ABLATIONS):
        args.ablations = "mix-none"
    if args.quick and args.baselines == ",".join(BASELINES):
        args.baselines = "fedavg,hierfavg"
    args.ablations = [a for a in args.ablations.split(",") if a]
    args.baselines = [b for b in args.baselines.split(",") if b]
    args.seeds = args.seeds or (2 if args.quick else 3)
    long_rounds = args.long_rounds or (20 if args.quick else 40)
    budgets = {"short": Budget("short", 6, 10), "long": Budget("long", long_rounds, 25)}
    unknown_budgets = sorted(set(args.budgets.split(",")) - set(budgets))
    if unknown_budgets:
        sys.exit(f"quality.py: error: unknown budget {unknown_budgets[0]!r} (known: short, long)")
    args.budgets = [b for name, b in budgets.items() if name in args.budgets.split(",")]
    if args.report_only and args.workdir is None:
        sys.exit("quality.py: error: --report-only needs --workdir")
    if args.report_only and not args.workdir.is_dir():
        sys.exit(f"quality.py: error: --workdir {args.workdir} is not a directory (--report-only builds the tables "
                 "from the runs already made there)")
    unknown = sorted(set(args.ablations) - set(ABLATIONS)) + sorted(set(args.baselines) - set(BASELINES))
    if unknown:
        sys.exit(f"quality.py: error: unknown ablation or baseline {unknown[0]!r}")
    # the ablation corpora by the names their paths resolve to (an entry not in --corpora runs nothing)
    args.ablation_corpora = [resolve_corpus(c, prog="quality.py").name for c in args.ablation_corpora]
    layouts = corpus_layouts(args, prog="quality.py")
    args.peers = {c: sum(len(v) for v in lay.values()) for c, lay in layouts.items()}
    args.peers["_subcorpora"] = len({label for lay in layouts.values() for v in lay.values() for label in v})
    # (a corpus of one's own gets a file of its own: the default ones hold the committed study)
    own = "".join(f"-{c}" for c in args.corpora if not args.corpus_specs[c].known)
    out = args.out or REPO / "benchmarks" / "out" / f"quality{'-quick' if args.quick else ''}{own}.json"
    tmp = None
    if args.workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="worldlm-quality-")
        workdir = Path(tmp.name)
    else:
        workdir = args.workdir
        workdir.mkdir(parents=True, exist_ok=True)
    if any(spec.known for spec in args.corpus_specs.values()):
        union_grouping(list(KNOWN_CORPORA), workdir, args.corpus_root)  # local runs cover every corpus, whichever are asked for
    runs = plan(args)
    not_run = []
    if args.report_only:
        not_run = [r for r in runs if not (workdir / f"{r.name(args)}.json").is_file()]
        runs = [r for r in runs if r not in not_run]
    print(f"quality benchmark: {len(runs)} runs, {args.jobs} at a time, in {workdir}", flush=True)
    t0 = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    failures = []
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(run_one, r, args, workdir): r for r in runs}
        for f in as_completed(futures):
            r = futures[f]
            try:
                results[r.name(args)] = f.result()
            except Exception as e:  # report the others anyway
                failures.append(f"{r.name(args)}: {e}")
                print(f"  FAILED {e}", flush=True)
    wall = time.monotonic() - t0
    lines = [f"Command: `python benchmarks/quality.py {' '.join(sys.argv[1:])}`", "",
             f"Model {args.model}, batch {args.batch_size} x {args.seq_len}, eval {args.eval_tokens} held-out tokens per "
             f"peer; seeds {args.seeds} for worldlm/local/ablations; {len(runs)} runs, wall time {wall / 60:.0f} min "
             f"({args.jobs} at a time).", ""]
    summary: dict[str, Any] = {}
    for b in args.budgets:
        for c in args.corpora:
            by_variant: dict[str, dict[int, dict]] = {}
            for r in runs:
                if r.budget != b or r.name(args) not in results:
                    continue
                if r.corpus == c or (r.corpus == "_subcorpora" and r.variant == "local" and args.corpus_specs[c].known):
                    by_variant.setdefault(r.variant, {})[r.seed] = results[r.name(args)]
            text, summ = corpus_tables(c, b, layouts[c], by_variant, args)
            lines += text
            summary[f"{c}.{b.name}"] = summ
    lines = lines[:4] + targets_table(summary, args) + lines[4:]
    if not_run:
        lines += ["Not run (not in the work directory):", *[f"- {r.name(args)}" for r in not_run], ""]
    if failures:
        lines += ["Failed runs:", *[f"- {x}" for x in failures], ""]
    commands = sorted({res.get("command", "") for res in results.values()} - {""})
    lines += ["<details><summary>every command</summary>", "", *[f"    {c}" for c in commands], "", "</details>", ""]
    text = "\n".join(lines)
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    compact = {name: {**{k: res[k] for k in ("strategy", "regions", "peers", "world", "tokens", "history", "wall_seconds",
                                   "command")
                         if k in res}, "took": res.get("took") or took(res)} for name, res in sorted(results.items())}
    out.write_text(json.dumps(dict(args={k: str(v) for k, v in vars(args).items()}, summary=summary,
                                   results=compact, wall_seconds=wall), indent=1))
    out.with_suffix(".md").write_text(text)
    if tmp is not None:
        tmp.cleanup()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
