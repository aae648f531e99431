"""The quality benchmark's paired comparison (benchmarks/quality.py), against hand-computed values."""

from __future__ import annotations

import importlib.util
import math
import statistics
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("quality_bench", Path(__file__).resolve().parents[2] / "benchmarks" / "quality.py")
quality = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = quality  # dataclasses look their module up
_spec.loader.exec_module(quality)


def test_paired_ratio_by_hand():
    # two regions, three seeds; the variant is 2% lower than the base in every seed (region means
    # are geometric: sqrt(a * b))
    base = {0: {"a": 4.0, "b": 9.0}, 1: {"a": 1.0, "b": 16.0}, 2: {"a": 2.0, "b": 8.0}}  # 6, 4, 4
    var = {0: {"a": 4.0, "b": 9.0 * 0.97}, 1: {"a": 0.99, "b": 16.0 * 0.98}, 2: {"a": 2.0 * 0.98, "b": 8.0 * 0.98},
           3: {"a": 1.0, "b": 1.0}}  # seed 3 has no partner: left out
    m, sd, lower, n, verdict = quality.paired_ratio(var, base)
    ratios = [math.sqrt(0.97), math.sqrt(0.99 * 0.98), 0.98]
    assert n == 3 and lower == 3
    assert m == pytest.approx(statistics.fmean(ratios)) and sd == pytest.approx(statistics.stdev(ratios))
    t = (m - 1) / (sd / math.sqrt(3))
    assert t < -4.303 and verdict == "lower"


def test_paired_ratio_noise_and_too_few_seeds():
    base = {0: {"a": 10.0}, 1: {"a": 10.0}, 2: {"a": 10.0}}
    mixed = {0: {"a": 9.0}, 1: {"a": 11.5}, 2: {"a": 9.8}}  # lower in two seeds, but within the noise
    m, sd, lower, n, verdict = quality.paired_ratio(mixed, base)
    assert (lower, n, verdict) == (2, 3, "level") and m == pytest.approx((0.9 + 1.15 + 0.98) / 3)
    assert quality.paired_ratio({0: {"a": 9.0}}, base) is None  # one common seed: no spread to judge by
    assert quality.paired_ratio({0: {"a": math.inf}, 1: {"a": 9.0}}, base) is None  # a diverged run
    worse = {s: {"a": 10.0 * (1.05 + 0.001 * s)} for s in range(3)}
    assert quality.paired_ratio(worse, base)[4] == "higher"


def _run(peers: dict[str, float]) -> dict:
    """A run's JSON as the simulator writes it, reduced to what the tables read."""
    return {"peers": {k: {"perplexity": v} for k, v in peers.items()}}


def test_ablation_line_against_local_by_hand():
    # one region of two peers; local runs on every sub-corpus (labels under a union region)
    layout = {"r": ["a", "b"]}
    local = {s: _run({"all/a": 10.0, "all/b": 20.0 + s}) for s in range(3)}  # region means 15, 15.5, 16
    worldlm = {s: _run({"r/a": 9.0, "r/b": 19.0 + s}) for s in range(3)}    # 14, 14.5, 15
    ablation = {s: _run({"r/a": 8.0, "r/b": 18.0 + 2 * s}) for s in range(3)}  # 13, 14, 15
    results = {"worldlm": worldlm, "local": local, "worldlm:mix-none": ablation}
    lines, summary = quality.corpus_tables("c", quality.Budget("short", 6, 10), layout, results, None)
    s = summary["worldlm:mix-none"]
    assert s["vs_local"] == pytest.approx(14.0 / 15.5)  # ratio of the means over seeds
    ratios = [13 / 15, 14 / 15.5, 15 / 16]
    p = s["vs_local_paired"]
    assert p["mean"] == pytest.approx(statistics.fmean(ratios)) and p["sd"] == pytest.approx(statistics.stdev(ratios))
    assert (p["seeds_lower"], p["seeds"]) == (3, 3)
    row = [line for line in lines if line.startswith("| worldlm:mix-none |")][-1]  # the "X against worldlm" table
    assert row.endswith(f"| {14.0 / 15.5:.3f}x ({statistics.fmean(ratios):.4f} ± {statistics.stdev(ratios):.4f}) |")
    # the baselines and worldlm itself carry no such cell
    assert "vs_local" not in summary["worldlm"]


def test_a_corpus_of_ones_own_by_its_path(tmp_path):
    """``--corpora`` takes a directory in the federated layout (or a grouping file) besides the known
    names: its regions as they are, its own local runs (a sub-corpus name may repeat across regions,
    or be one of the shared corpus's), no shared corpus needed; a bad path is one line."""
    import argparse

    for region, subs in {"north": ["news", "web"], "south": ["news"]}.items():
        for sub in subs:
            (tmp_path / "c" / region / sub).mkdir(parents=True)
            (tmp_path / "c" / region / sub / "train.txt").write_text("text\n")
    (tmp_path / "c" / "README.md").write_text("a file at the top: ignored\n")
    args = argparse.Namespace(corpora=[str(tmp_path / "c"), "related"], corpus_root=tmp_path / "nowhere")
    with pytest.raises(SystemExit, match="corpus root .*nowhere is not a directory"):  # (related needs it)
        quality.corpus_layouts(args, prog="q")
    args = argparse.Namespace(corpora=[str(tmp_path / "c")], corpus_root=tmp_path / "nowhere")
    layouts = quality.corpus_layouts(args, prog="q")
    (name,) = args.corpora
    assert name.startswith("c-") and layouts == {name: {"north": ["news", "web"], "south": ["news"]}}
    spec = args.corpus_specs[name]
    assert spec.data == (tmp_path / "c").resolve() and not spec.known
    # the same name elsewhere is another corpus: its runs are never shared
    (tmp_path / "other" / "c").mkdir(parents=True)
    assert quality.resolve_corpus(str(tmp_path / "other" / "c"), prog="q").name != name
    # its local runs are on it (none on the shared corpus's sub-corpora), and read by region and sub-corpus
    args.budgets, args.seeds, args.baselines, args.ablations, args.ablation_corpora = \
        [quality.Budget("short", 6, 10)], 2, [], [], []
    args.peers = {name: 3}
    runs = quality.plan(args)
    assert sorted((r.corpus, r.variant, r.seed) for r in runs) == \
        [(name, v, s) for v in ("local", "worldlm") for s in (0, 1)]
    res = {"peers": {"north/news": {"perplexity": 2.0}, "north/web": {"perplexity": 3.0},
                     "south/news": {"perplexity": 5.0}}}
    assert quality.local_for(layouts[name], res) == {"north/news": 2.0, "north/web": 3.0, "south/news": 5.0}
    for bad, why in (("nope", "does not exist"), (str(tmp_path / "c" / "README.md"), "not a grouping file")):
        with pytest.raises(SystemExit, match=why):
            quality.resolve_corpus(bad, prog="q")


def test_a_corpus_root_without_every_known_sub_corpus_is_one_line(tmp_path):
    """One local run serves every known corpus (its runs are reused whichever corpora are asked for),
    so it needs all their sub-corpora under the corpus root: without them, one line, no traceback."""
    (tmp_path / "root" / "eu" / "x").mkdir(parents=True)
    with pytest.raises(SystemExit, match="the local runs cover every sub-corpus of the known corpora, and grouping "
                                         "file .* has no train.txt under"):
        quality.union_grouping(["related"], tmp_path, tmp_path / "root")


def test_an_empty_corpora_list_is_an_error_not_the_whole_study(capsys):
    for empty in ("", " , "):
        with pytest.raises(SystemExit, match="--corpora names no corpus"):
            quality.main(["--corpora", empty])
