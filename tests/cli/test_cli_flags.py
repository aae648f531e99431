"""CLI flags derived from config fields: name, type, choices and default come from the field."""

import pytest

from worldlm_p2p.cli import simulate as sim_cli
from worldlm_p2p.cli.common import ArgumentParser, Flag, add_flags, flag_values
from worldlm_p2p.config import AggregationConfig, TrainConfig
from worldlm_p2p.kinds import MIX_RULES, STRATEGY_NAMES


def _parser():
    p = ArgumentParser(prog="t")
    add_flags(p, {"aggregation": AggregationConfig, "train": TrainConfig}, (
        Flag("aggregation", "tau", "temperature"), Flag("aggregation", "mix", "mix rule"),
        Flag("aggregation", "residual", "off"), Flag("train", "inner_steps", "H", flag="--local-steps")))
    return p


def test_types_choices_defaults_and_booleans():
    p = _parser()
    flags = (Flag("aggregation", "tau", ""), Flag("aggregation", "mix", ""), Flag("aggregation", "residual", ""),
             Flag("train", "inner_steps", "", flag="--local-steps"))
    assert flag_values(p.parse_args([]), flags) == {}  # nothing given: the config's defaults stand
    args = p.parse_args(["--tau", "0.5", "--mix", "none", "--no-residual", "--local-steps", "7"])
    assert flag_values(args, flags) == {"aggregation": {"tau": 0.5, "mix": "none", "residual": False},
                                        "train": {"inner_steps": 7}}
    text = p.format_help()
    assert "(default 0.1)" in text and "{evidence,cosine,none}" in text and "--no-residual" in text


@pytest.mark.parametrize("argv", [["--mix", "bogus"], ["--tau", "x"]])
def test_bad_values_are_one_line_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error" in err


def test_simulate_takes_its_choices_from_the_literals():
    text = sim_cli.build_parser().format_help()
    assert "{" + ",".join(STRATEGY_NAMES) + "}" in text and "{" + ",".join(MIX_RULES) + "}" in text
    # every flag names a field of its section (a typo fails when the parser is built)
    for f in sim_cli.FLAGS:
        assert f.field in sim_cli.SECTIONS[f.section].__dataclass_fields__
