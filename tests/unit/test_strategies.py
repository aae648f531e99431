"""The strategy objects: the table every caller asks, and no strategy name compared outside it."""

import re
from pathlib import Path

import pytest

import worldlm_p2p
from worldlm_p2p.kinds import STRATEGY_NAMES, SWARM_STRATEGIES
from worldlm_p2p.strategies import STRATEGIES, strategy, with_border_dp

PACKAGE = Path(worldlm_p2p.__file__).parent


@pytest.mark.parametrize("name, group, key, world, border, mixes", [
    ("worldlm", "region", "attentive", "residual", "leaders", True),
    ("fedavg", "world", "shared", "none", "flat", False),
    ("hierfavg", "region", "shared", "mean", "leaders", False),
    ("fedper", "world", "personal", "none", "none", False),
    ("local", "none", "shared", "none", "none", False),
    ("centralized", "none", "shared", "none", "none", False),
])
def test_the_table(name, group, key, world, border, mixes):
    s = strategy(name)
    assert (s.group, s.key, s.world, s.border_dp, s.mixes) == (group, key, world, border, mixes)
    assert s.averages == (group != "none") and s.has_world_rounds == (world != "none")
    assert s.in_swarm == (name != "centralized") and s.pooled == (name == "centralized")


def test_names_and_border_dp():
    assert tuple(STRATEGIES) == STRATEGY_NAMES and set(SWARM_STRATEGIES) < set(STRATEGY_NAMES)
    # the swarm applies border DP at leaders only; the simulator also runs fedavg's flat variant
    assert with_border_dp("swarm") == ("worldlm", "hierfavg")
    assert with_border_dp("simulator") == ("worldlm", "fedavg", "hierfavg")
    with pytest.raises(ValueError, match="unknown strategy 'fedprox'.*worldlm"):
        strategy("fedprox")


def test_no_strategy_name_is_compared_outside_the_strategies():
    """Behaviour is asked of the Strategy object: a test of a strategy's name elsewhere in the
    package is a second definition of what it does."""
    names = "|".join(STRATEGY_NAMES)
    pattern = re.compile(rf"""strategy\w*\s*(==|!=|\bin\b|\bnot in\b)\s*[\("']|["']({names})["']\s*(==|!=|in\b)""")
    bad = []
    for path in PACKAGE.rglob("*.py"):
        if path.name in ("strategies.py", "kinds.py"):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line.split("#")[0]):
                bad.append(f"{path.relative_to(PACKAGE)}:{i}: {line.strip()}")
    assert not bad, bad
