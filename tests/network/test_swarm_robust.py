"""One malicious member of three, a genuine worldlm-peer process that lies in its payload
(benchmarks/malicious_peer.py): the honest members' agreed backbone moves from their own mean by no
more than the robust rule's bound, their valid loss stays within 5% of a run without the attacker,
and the attacker is named and banned."""

import sys
from pathlib import Path

import pytest
import torch
from swarm_utils import log_tail, start_bootstrap, start_peer, summary, traces

from worldlm_p2p.aggregation import weighted_mean

pytestmark = [pytest.mark.network, pytest.mark.slow]  # several peer processes, two runs

MALICIOUS = Path(__file__).resolve().parents[2] / "benchmarks" / "malicious_peer.py"
HONEST = (("eu-a", "de_news-reviews-wiki"), ("eu-b", "es_blog-news-reviews-wiki"))
STEPS = 40


def _honest_run(procs, tmp, maddrs, *, members: int):
    peers = [start_peer(procs, tmp, maddrs, region="eu", sub=sub, label=label, max_steps=STEPS,
                        extra=["--wait-for-peers", str(members)]) for label, sub in HONEST]
    for p, (label, _) in zip(peers, HONEST):
        try:
            code = p.wait(timeout=400)
        except Exception:
            raise AssertionError(f"{label} did not finish:\n{log_tail(tmp, label)}")
        assert code == 0, f"{label} exited {code}:\n{log_tail(tmp, label)}"
    return {label: summary(tmp, label) for label, _ in HONEST}


@pytest.fixture(scope="module")
def calm(tmp_path_factory):
    """The two honest members' summaries from a run without the attacker (the same start: both wait
    for each other)."""
    from swarm_utils import Procs

    procs, base = Procs(), tmp_path_factory.mktemp("calm")
    try:
        _, maddrs = start_bootstrap(procs, base, run_id="calm", inner_steps=5)
        yield _honest_run(procs, base, maddrs, members=2)
    finally:
        procs.close()


# CI runs the scale attack; the random and nan payloads take the same path through the robust rule and
# the ban, and the all-reduce test (tests/network/test_robust_allreduce.py) checks both in CI
@pytest.mark.parametrize("attack", ["scale", pytest.param("random", marks=pytest.mark.extended),
                                    pytest.param("nan", marks=pytest.mark.extended)])
def test_a_malicious_member_moves_no_model_and_is_banned(procs, tmp_path, attack, calm):

    _, maddrs = start_bootstrap(procs, tmp_path, run_id="hostile", inner_steps=5)
    (tmp_path / "logs").mkdir(exist_ok=True)
    data = Path(__file__).resolve().parents[2] / "worldlm_p2p" / "demo_data" / "eu" / "nl_news"
    procs.start_script([sys.executable, str(MALICIOUS), attack, "--region", "eu", "--data", str(data), "--label",
                        "mallory", "--initial-peers", *maddrs, "--max-steps", str(STEPS), "--threads", "1",
                        "--wait-for-peers", "3"],
                       log=tmp_path / "logs" / "mallory.log")
    hostile = _honest_run(procs, tmp_path, maddrs, members=3)

    for label, _ in HONEST:
        s, c = hostile[label], calm[label]
        assert s["rounds_completed"] >= 3, s
        assert s["valid_loss"] <= c["valid_loss"] * 1.05, (label, s["valid_loss"], c["valid_loss"])
    logs = "".join((tmp_path / "logs" / f"{label}.log").read_text(errors="replace") for label, _ in HONEST)
    caught = [line for line in logs.splitlines() if "the robust rule caught" in line]
    assert caught, logs[-3000:]
    assert all("'mallory'" in line for line in caught), [line for line in caught if "'mallory'" not in line]
    assert "banned" in logs, logs[-3000:]

    # every round with the attacker in the group: the agreed backbone within the rule's bound of the
    # honest members' weighted mean
    from swarm_utils import round_rule

    import tomllib

    from worldlm_p2p.aggregation import max_round_weight

    from worldlm_p2p.rounds import region_payload, sent_backbone

    rule = round_rule()
    train = tomllib.loads((tmp_path / "run.toml").read_text())["train"]
    cap = max_round_weight(inner_steps=5, batch_size=train["batch_size"], seq_len=train["seq_len"])
    ta, tb = traces(tmp_path, "eu-a"), traces(tmp_path, "eu-b")
    checked = 0
    for r in sorted(set(ta) & set(tb)):
        a, b = ta[r], tb[r]
        if not (a["ok"] and b["ok"]) or len(a["gathered"]) != 3 or a["anchor"] is None:
            continue
        weights = [a["weight"], b["weight"]]
        # what the two sent (their changes since the anchor, through the round's codec), on the anchor
        sa, sb = (sent_backbone(rule, region_payload(rule, t["pre"], t["anchor"])) for t in (a, b))
        honest = [x + m for x, m in zip(rule.backbone(a["anchor"]), weighted_mean([sa, sb], weights))]
        spread = [(x - y).abs() for x, y in zip(sa, sb)]
        share = cap / (sum(weights) + cap)
        for got, h, s in zip(rule.backbone(a["agreed"]), honest, spread):
            bound = (rule.config.robust_clip + 1) * s * share + 1e-5
            assert bool(((got - h).abs() <= bound).all()), (r, float(((got - h).abs() - bound).max()))
        checked += 1
    assert checked >= 1, "no round averaged the two honest members with the attacker"
    # nor did its change reach them as half of a backbone pair (the rule caught it: never a partner)
    partners = [t.get("partner") for t in list(ta.values()) + list(tb.values())]
    assert "mallory" not in partners, partners
