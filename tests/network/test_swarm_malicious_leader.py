"""A malicious leader, a genuine worldlm-peer process (benchmarks/malicious_peer.py world-random)
that leads its region and serves a world change of random tensors: issue 12's first row, where
both honest members adopted it and their valid loss went 2.5 -> 295. Now each honest member tests
the change on its tune slice, refuses it, counts the leader's lease no more, and trains on."""

import math
import signal
import sys
from pathlib import Path

import pytest
from swarm_utils import log_tail, start_bootstrap, start_peer, summary, wait_for, world_traces

pytestmark = [pytest.mark.network, pytest.mark.slow]  # several peer processes

MALICIOUS = Path(__file__).resolve().parents[2] / "benchmarks" / "malicious_peer.py"
DEMO = Path(__file__).resolve().parents[2] / "worldlm_p2p" / "demo_data"
HONEST = (("eu-a", "de_news-reviews-wiki"), ("eu-b", "es_blog-news-reviews-wiki"))
STEPS = 30  # 6 region rounds of 5 steps
MANY = 100_000  # the single-peer region trains until it is told to stop


def test_a_world_change_of_random_tensors_is_refused_and_its_leader_lease_dropped(procs, tmp_path):
    _, maddrs = start_bootstrap(procs, tmp_path, run_id="wleader", inner_steps=5)
    (tmp_path / "logs").mkdir(exist_ok=True)
    mlog = tmp_path / "logs" / "mallory.log"
    procs.start_script([sys.executable, str(MALICIOUS), "world-random", "--region", "eu", "--data",
                        str(DEMO / "eu" / "nl_news"), "--label", "mallory", "--initial-peers", *maddrs,
                        "--max-steps", str(STEPS), "--threads", "1", "--wait-for-peers", "3"], log=mlog)
    # mallory leads eu: its candidacy is the oldest
    wait_for(lambda: "this peer is now the leader" in mlog.read_text(errors="replace"), 120, "mallory to lead eu")
    mallory = next(line.split(" as ")[1].split()[0] for line in mlog.read_text().splitlines() if "joined run" in line)
    honest = [start_peer(procs, tmp_path, maddrs, region="eu", sub=sub, label=label, max_steps=STEPS,
                         extra=["--wait-for-peers", "3"]) for label, sub in HONEST]
    # na's leader lives until eu is done: a region of one peer trains fast, and had it finished before
    # eu's first region round (the CI failure of e718847), mallory would have had no world round to lead
    na = start_peer(procs, tmp_path, maddrs, region="na", sub="en_email", label="na-a", max_steps=MANY,
                   extra=["--slowdown", "3"])  # it only has to lead na: leave the cores to eu
    for p, label in zip(honest, (label for label, _ in HONEST)):
        try:
            code = p.wait(timeout=400)
        except Exception:
            raise AssertionError(f"{label} did not finish:\n{log_tail(tmp_path, label)}")
        assert code == 0, f"{label} exited {code}:\n{log_tail(tmp_path, label)}"
    na.send_signal(signal.SIGTERM)
    assert na.wait(timeout=90) == 0, f"na-a:\n{log_tail(tmp_path, 'na-a')}"

    assert "worldlm_p2p.net.world: world round" in mlog.read_text(errors="replace"), "mallory never led a world round"
    for label, _ in HONEST:
        log = (tmp_path / "logs" / f"{label}.log").read_text(errors="replace")
        refused = [line for line in log.splitlines() if "refused world round" in line]
        assert refused and all(mallory in line for line in refused), log[-3000:]
        # it adopted no change of mallory's
        adopted = world_traces(tmp_path, label, leader=False)
        assert all(t["leader"] != mallory for t in adopted.values()), {w: t["leader"] for w, t in adopted.items()}
        s = summary(tmp_path, label)
        assert s["rounds_completed"] >= 3, s
        # trained, not wrecked (wrecked: 295 nats; knowing nothing: log 259 = 5.56)
        assert math.isfinite(s["valid_loss"]) and s["valid_loss"] < 0.8 * math.log(259), s
    # with mallory's lease dropped, an honest member leads eu as the honest members see it
    logs = "".join((tmp_path / "logs" / f"{label}.log").read_text(errors="replace") for label, _ in HONEST)
    assert "this peer is now the leader" in logs, logs[-3000:]
