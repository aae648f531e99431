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
