"""The benchmark scripts refuse bad input before any run: perf.py with one line on stderr and exit
status 2, quality.py with a one-line sys.exit message (exit status 1)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_bench_cli", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("configs", ["tiny:x:10", "tiny:2", "tiny:2:10:3", "tiny:2:-1", "tiny:1:10", "nosuch:2:10"])
def test_perf_refuses_bad_configs(configs, capsys):
    perf = _load("perf")
    assert perf.main(["--configs", configs, "--variants", "sync"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("perf.py: error: ") and "\n" not in err and "Traceback" not in err


@pytest.mark.parametrize("variants", ["nosuch", "overlap+nice20", "overlap+nicex", "overlap+nice", ",", "sync,nosuch+nice3"])
def test_perf_refuses_bad_variants(variants, capsys):
    perf = _load("perf")
    assert perf.main(["--configs", "tiny:2:10", "--variants", variants]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("perf.py: error: ") and "\n" not in err and "Traceback" not in err


def test_perf_variant_names_split_into_settings_and_a_nice_value():
    perf = _load("perf")
    assert perf.split_variant("overlap-tokens") == ("overlap-tokens", 0)
    assert perf.split_variant("overlap-tokens-ev5+nice10") == ("overlap-tokens-ev5", 10)
    assert perf.split_variant("sync+nice0") == ("sync", 0)


@pytest.mark.parametrize("argv", [["--corpora", "nosuch"], ["--ablation-corpora", "nosuch"], ["--ablations", "nosuch"],
                                  ["--baselines", "nosuch"], ["--budgets", "short,middle"], ["--report-only"]])
def test_quality_refuses_bad_input(argv, tmp_path):
    quality = _load("quality")
    workdir = [] if argv == ["--report-only"] else ["--workdir", str(tmp_path)]
    with pytest.raises(SystemExit) as e:  # sys.exit(message): the message on stderr, exit status 1
        quality.main([*argv, *workdir])
    assert isinstance(e.value.code, str) and e.value.code.startswith("quality.py: error: ")
    assert "\n" not in e.value.code
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_quality_report_only_refuses_a_missing_workdir(tmp_path):
    quality = _load("quality")
    missing = tmp_path / "no-such-workdir"
    with pytest.raises(SystemExit) as e:
        quality.main(["--report-only", "--workdir", str(missing), "--corpora", "random", "--budgets", "short"])
    assert isinstance(e.value.code, str) and e.value.code.startswith("quality.py: error: --workdir ")
    assert "\n" not in e.value.code
    assert not missing.exists()  # not created: an empty report would read as "nothing was run"


def test_every_quality_ablation_is_a_valid_simulator_config():
    """Each ablation's flags build a simulator config (a typo would fail every run of it, one by one,
    in the background); the ones the tables read in a particular way say so in their settings."""
    from worldlm_p2p.cli.simulate import build_parser, make_config

    quality = _load("quality")
    configs = {}
    for name, flags in quality.ABLATIONS.items():
        args = build_parser().parse_args(["--rounds", "40", "--strategy", "worldlm", *flags])
        configs[name] = make_config(args)
    assert configs["no-world"].aggregation.world_every > 40  # no world round in the long budget
    assert configs["no-residual"].aggregation.residual is False
    assert configs["mean-backbone"].aggregation.region_backbone == "mean"


@pytest.mark.parametrize("argv", [["--peers", "2"], ["--rounds", "0"], ["--repeats", "-1"], ["--inner-steps", "0"],
                                  ["--swarm-timeout", "0"], ["--rounds", "x"]])
def test_partners_cost_refuses_bad_input(argv, capsys):
    bench = _load("partners_cost")
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("partners_cost.py: error: ") and "Traceback" not in err


def test_restore_workdir_writes_each_run_of_the_raw_results_once_the_newest_winning(tmp_path, capsys):
    """benchmarks/restore_workdir.py: every run of every raw result file becomes ``<name>.json`` in the
    work directory, the file modified last winning a name two files hold; a run already there is
    kept; what is not a run (no regions) and files that are not raw results are skipped."""
    import json
    import os

    restore = _load("restore_workdir")
    src, work = tmp_path / "out", tmp_path / "work"
    (src / "s1").mkdir(parents=True)
    run = lambda v: {"strategy": "worldlm", "regions": {"a": {"perplexity": v}}, "reused": True}  # noqa: E731
    old = src / "old.json"
    old.write_text(json.dumps({"results": {"c.r6.worldlm.d1207.s0": run(1.0), "c.r6.local.s0": run(2.0)}}))
    new = src / "s1" / "new.json"
    new.write_text(json.dumps({"results": {"c.r6.worldlm.d1207.s0": run(3.0), "bad": {"strategy": "x"}}}))
    os.utime(old, (1_000_000, 1_000_000))
    (src / "other.json").write_text(json.dumps([1, 2]))
    (src / "broken.json").write_text("{")
    work.mkdir()
    (work / "c.r6.local.s0.json").write_text(json.dumps(run(9.0)))
    assert restore.main(["--workdir", str(work), "--from", str(src)]) == 0
    assert "1 runs restored" in capsys.readouterr().out
    assert sorted(p.name for p in work.iterdir()) == ["c.r6.local.s0.json", "c.r6.worldlm.d1207.s0.json"]
    got = json.loads((work / "c.r6.worldlm.d1207.s0.json").read_text())
    assert got == {"strategy": "worldlm", "regions": {"a": {"perplexity": 3.0}}}  # the newest; "reused" dropped
    assert json.loads((work / "c.r6.local.s0.json").read_text())["regions"]["a"]["perplexity"] == 9.0


def test_restore_workdir_refuses_a_workdir_it_cannot_write_with_one_line(tmp_path, capsys):
    restore = _load("restore_workdir")
    (tmp_path / "out").mkdir()
    (tmp_path / "afile").write_text("x")
    for argv in (["--workdir", str(tmp_path / "afile")], ["--workdir", str(tmp_path / "w"), "--from", str(tmp_path / "no")]):
        with pytest.raises(SystemExit) as e:
            restore.main(argv + (["--from", str(tmp_path / "out")] if "--from" not in argv else []))
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("restore_workdir.py: error: ") and "Traceback" not in err, err


def test_refusal_refuses_bad_input_before_any_run_with_one_line(tmp_path, capsys):
    refusal = _load("refusal")
    (tmp_path / "afile").write_text("x")
    for argv in (["--repeats", "0"], ["--steps", "-1"], ["--out", str(tmp_path)],
                 ["--out", str(tmp_path / "afile" / "out.json")], ["--out", "/proc/refusal.json"]):
        with pytest.raises(SystemExit) as e:
            refusal.main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("refusal.py: error: ") and "Traceback" not in err, (argv, err)
