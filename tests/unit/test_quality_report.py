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
