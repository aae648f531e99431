"""Reports (``worldlm_p2p.report``, ``worldlm-report``): curves computed by hand from synthetic
swarm summaries and simulate results, the figure's lines, the PNG, the Markdown tables, bad input."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from swarm_utils import REPO, env
from worldlm_p2p.errors import ConfigError, DataError
from worldlm_p2p.report import (WORLD_MARK, load_report, make_figure, render_markdown, simulate_curves, swarm_curves,
                                swarm_rows, write_report)

REPORT = [sys.executable, "-m", "worldlm_p2p.cli.report"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _point(step, tokens, loss, world_round=-1):
    return dict(step=step, tokens=tokens, loss=loss, round=step // 15, world_round=world_round, time=0.0)


def swarm_summary() -> dict:
    """eu: a and b reach step 30, c crashed after step 15; na: one peer that adopts world round 0
    at its second point; asia: a peer that wrote no summary."""
    def peer(label, region, history, **extra):
        return dict(region=region, label=label, steps=history[-1]["step"], tokens=history[-1]["tokens"],
                    history=history, inner_steps=15, strategy="worldlm", rounds_completed=len(history),
                    world_rounds_adopted=0, bytes_sent=1000, bytes_sent_border=0, exit_code=0, **extra)

    return dict(run_id="t", manifest={"run_id": "t", "model": {"preset": "tiny"}, "train": {"inner_steps": 15},
                                      "aggregation": {"strategy": "worldlm"}},
                regions={"eu": 3, "na": 1, "asia": 1}, wall_seconds=12.0, peers=[
                    peer("eu-a", "eu", [_point(15, 15360, 4.0), _point(30, 30720, 3.0)], valid_loss=2.5),
                    peer("eu-b", "eu", [_point(15, 15360, 5.0), _point(30, 30720, 3.5)], valid_loss=2.7),
                    {**peer("eu-c", "eu", [_point(15, 15360, 6.0)]), "exit_code": 1},
                    {**peer("na-a", "na", [_point(15, 15360, 4.2), _point(30, 30720, 3.1, world_round=0)],
                            valid_loss=2.9), "world_rounds_adopted": 1, "bytes_sent_border": 500},
                    dict(region="asia", label="asia-x", error="Killed", exit_code=-9),
                ])


def sim_results(strategy: str, eu_loss=(3.0, 2.5), na_loss=(3.2, None)) -> dict:
    """eu: 2 peers, na: 1 peer, two evaluations after 1000 and 2000 tokens per peer (na's last loss NaN)."""
    history = []
    for i, tok in enumerate((1000, 2000)):
        central = strategy == "centralized"
        peers = {k: dict(region=k.split("/")[0], loss=1.0, perplexity=math.e, bits_per_byte=1.0,
                         tokens=3 * tok if central else tok) for k in ("eu/a", "eu/b", "na/c")}
        regions = {"eu": dict(loss=eu_loss[i], perplexity=math.exp(eu_loss[i]), bits_per_byte=eu_loss[i] / math.log(2),
                              peers=2),
                   "na": dict(loss=na_loss[i], perplexity=None if na_loss[i] is None else math.exp(na_loss[i]),
                              bits_per_byte=None, peers=1)}
        history.append(dict(round=i + 1, tokens=3 * tok, regions=regions, world=dict(loss=1.0, perplexity=2.0,
                                                                                     bits_per_byte=1.5), peers=peers))
    last = history[-1]
    return dict(strategy=strategy, config=dict(rounds=2, model={"preset": "tiny"}, train={"inner_steps": 5}),
                regions=last["regions"], world=last["world"], peers=last["peers"], tokens=last["tokens"],
                history=history, wall_seconds=3.0)


def _write(path: Path, data) -> Path:
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


# ------------------------------------------------------------------------------------------- curves


def test_swarm_curves_by_hand():
    curves = {c.region: c for c in swarm_curves(swarm_summary())}
    assert list(curves) == ["eu", "na"]  # the summary's region order; asia has no history
    eu = curves["eu"]
    # step 15: a, b, c trained 15360 each, losses 4, 5, 6; step 30: a and b at 30720, c still counts
    # its 15360 tokens but has no loss at 30
    assert eu.tokens == (3 * 15360, 30720 + 30720 + 15360)
    assert eu.loss == pytest.approx((5.0, 3.25))
    assert eu.strategy == "worldlm" and eu.world_rounds == ()
    na = curves["na"]
    assert na.tokens == (15360, 30720) and na.loss == pytest.approx((4.2, 3.1))
    assert na.world_rounds == (30720,)  # world round 0 adopted before step 30


def test_swarm_rows_by_hand():
    rows = {r.region: r for r in swarm_rows(swarm_summary())}
    eu, na, asia = rows["eu"], rows["na"], rows["asia"]
    assert (eu.peers, eu.failed, eu.tokens) == (3, 1, 30720 + 30720 + 15360)
    assert eu.loss == pytest.approx(2.6) and eu.perplexity == pytest.approx(math.exp(2.6))
    assert eu.train_loss == pytest.approx(3.25)  # the curve's last point
    assert eu.rounds_completed == (1, 2) and eu.bytes_sent == 3000
    assert na.world_rounds_adopted == (1, 1) and na.bytes_sent == 1500
    assert (asia.peers, asia.failed, asia.loss, asia.tokens) == (1, 1, None, 0)


def test_simulate_curves_by_hand():
    curves = {c.region: c for c in simulate_curves(sim_results("worldlm"))}
    assert curves["eu"].tokens == (2000, 4000) and curves["eu"].loss == (3.0, 2.5)
    assert curves["na"].tokens == (1000,) and curves["na"].loss == (3.2,)  # a null loss is skipped
    # centralized: each peer entry holds the pooled tokens; the region gets its share by peers
    central = {c.region: c for c in simulate_curves(sim_results("centralized"))}
    assert central["eu"].tokens == (2000, 4000) and central["na"].tokens == (1000,)
    # no per-peer entries: the total
    res = sim_results("local")
    for h in res["history"]:
        del h["peers"]
    assert {c.region: c.tokens for c in simulate_curves(res)}["eu"] == (3000, 6000)


# ------------------------------------------------------------------------------------------- figure, files


def _labels(ax) -> list[str]:
    return [line.get_label() for line in ax.get_lines()]


def test_one_series_one_axis_one_line_per_region(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    _write(run / "summary.json", swarm_summary())
    report = load_report([run])
    fig = make_figure(report)
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert len(axes) == 1
    assert _labels(axes[0]) == ["eu (3 peers)", "na (1 peer)"]
    assert axes[0].get_xlabel() == "tokens trained by the region"
    assert axes[0].get_ylabel() == "train loss (nats/token)"
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["eu (3 peers)", "na (1 peer)", WORLD_MARK]
    assert fig.texts[0].get_text() == "WorldLM swarm, worldlm: train loss per region (run t, model tiny, H=15)"

    png, md = write_report(report, run)
    assert (png, md) == (run / "report.png", run / "report.md")
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    from matplotlib.image import imread

    height, width = imread(png).shape[:2]
    assert width > 400 and height > 300
    assert sorted(p.name for p in run.iterdir()) == ["report.md", "report.png", "summary.json"]  # no temp files left
    text = md.read_text()
    assert "![loss against tokens](report.png)" in text
    assert "| eu | 3 (1 failed) | 76,800 | 2.600 | 13.464 | 3.250 | 1-2 | 0 | 3.0 KB |" in text
    assert "| na | 1 | 30,720 | 2.900 | 18.174 | 3.100 | 2 | 1 | 1.5 KB |" in text
    assert "| asia | 1 (1 failed) | 0 | - | - | - |" in text
    assert "`asia-x` (asia) exited with code -9: Killed" in text


def test_several_strategies_one_subplot_per_region(tmp_path):
    a = _write(tmp_path / "worldlm.json", sim_results("worldlm"))
    b = _write(tmp_path / "fedavg.json", sim_results("fedavg", eu_loss=(3.5, 3.0), na_loss=(3.0, 2.9)))
    report = load_report([a, b], title="compared")
    fig = make_figure(report)
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == ["eu (2 peers)", "na (1 peer)"]
    for ax in axes:
        assert _labels(ax) == ["worldlm", "fedavg"]
        assert ax.get_ylabel() in ("held-out loss (nats/token)", "")
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["worldlm", "fedavg"]

    text = render_markdown(report)
    assert text.startswith("# compared\n")
    # eu: worldlm exp(2.5) best, fedavg exp(3.0); na: fedavg exp(2.9) only (worldlm's is null)
    eu_w, eu_f, na_f = math.exp(2.5), math.exp(3.0), math.exp(2.9)
    assert (f"| worldlm | **{eu_w:.3f} (1.000x)** | - | - |") in text
    assert (f"| fedavg | {eu_f:.3f} ({eu_f / eu_w:.3f}x) | **{na_f:.3f} (1.000x)** | "
            f"**{(eu_f + na_f) / 2:.3f} (1.000x)** |") in text
    assert f"| eu | 2 | 4,000 | 2.500 | {eu_w:.3f} | {2.5 / math.log(2):.3f} |" in text
    assert "## worldlm" in text and "## fedavg" in text

    # the same strategy twice: names get the file name
    c = _write(tmp_path / "worldlm-seed1.json", sim_results("worldlm"))
    assert [s.name for s in load_report([a, c]).series] == ["worldlm (worldlm)", "worldlm (worldlm-seed1)"]


def test_cli_writes_report(tmp_path):
    a = _write(tmp_path / "worldlm.json", sim_results("worldlm"))
    p = subprocess.run([*REPORT, str(a), "--out", str(tmp_path / "rep")], capture_output=True, env=env(), cwd=REPO,
                       timeout=120)
    assert p.returncode == 0 and p.stderr == b"", p.stderr.decode()
    assert (tmp_path / "rep" / "report.png").read_bytes()[:8] == PNG_SIGNATURE
    assert "| na | 1 | 2,000 | - | - | - |" in (tmp_path / "rep" / "report.md").read_text()


# ------------------------------------------------------------------------------------------- bad input


def test_bad_sources_raise_one_line_errors(tmp_path):
    no_history = swarm_summary()
    for peer in no_history["peers"]:
        peer.pop("history", None)
    cases = [
        ([tmp_path / "missing.json"], DataError, "no such file"),
        ([tmp_path], DataError, "no summary.json"),
        ([_write(tmp_path / "bad.json", "{not json")], DataError, "not a JSON file"),
        ([_write(tmp_path / "other.json", {"a": 1})], DataError, "neither"),
        ([_write(tmp_path / "old.json", no_history)], DataError, "no peer has a loss history"),
        ([_write(tmp_path / "empty.json", {**sim_results("worldlm"), "history": []})], DataError, "no evaluation"),
        ([tmp_path / "old.json", _write(tmp_path / "w.json", sim_results("worldlm"))], DataError, "loss history"),
        ([_write(tmp_path / "s.json", swarm_summary()), tmp_path / "w.json"], ConfigError, "cannot mix"),
    ]
    for sources, error, needle in cases:
        with pytest.raises(error) as e:
            load_report(sources)
        assert needle in str(e.value) and "\n" not in str(e.value), (sources, str(e.value))


@pytest.mark.parametrize("make_argv, needle", [
    (lambda t: [str(t / "missing.json"), "--out", str(t / "o")], "missing.json: no such file"),
    (lambda t: [str(_write(t / "bad.json", "[1,")), "--out", str(t / "o")], "not a JSON file"),
    (lambda t: [str(_write(t / "w.json", sim_results("worldlm"))), "--out", str(_write(t / "f", "x"))],
     "not a directory"),
    (lambda t: [str(t)], "--out"),
], ids=["missing", "not-json", "out-is-a-file", "no-out"])
def test_cli_bad_input_exits_2_with_one_line(tmp_path, make_argv, needle):
    p = subprocess.run([*REPORT, *make_argv(tmp_path)], capture_output=True, env=env(), cwd=REPO, timeout=60)
    err = p.stderr.decode()
    assert p.returncode == 2, (p.returncode, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("worldlm-report: error: ") and needle in lines[0], err
    assert not (tmp_path / "o").exists()
