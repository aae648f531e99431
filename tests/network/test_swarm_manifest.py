"""The run manifest is signed by the run's key and kept alive by every peer: a stranger who stores
another manifest for the same run stops nobody, and a new peer joins through a running peer after
the bootstrap node (and its own copy of the manifest) is gone."""

import re
import sys
import time

import pytest
from swarm_utils import log_tail, start_bootstrap, start_peer, summary, wait_for

pytestmark = [pytest.mark.network, pytest.mark.slow]  # peer processes, a dead bootstrap node

FORGER = """
import sys, time
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time
from worldlm_p2p.config import NetConfig, RunManifest
from worldlm_p2p.net import records
from worldlm_p2p.net.dht import start_dht
key = RSAPrivateKey()
vals = records.make_validators(None, key)
dht = start_dht(NetConfig(initial_peers=tuple(sys.argv[1:])), record_validators=vals)
forged = records.ManifestRecord.sign(key, RunManifest.from_dict({"run_id": "signed", "train": {"lr": 9.0}}),
                                     time=get_dht_time() + 3600)
while True:
    records.publish_manifest(dht, vals, forged, ttl=600)
    print("FORGED", flush=True)
    time.sleep(2)
"""


def test_a_forged_manifest_stops_nobody_and_the_run_outlives_its_bootstrap(procs, tmp_path):
    boot, maddrs = start_bootstrap(procs, tmp_path, run_id="signed", inner_steps=5)
    (tmp_path / "logs").mkdir(exist_ok=True)
    procs.start_script([sys.executable, "-c", FORGER, *maddrs], log=tmp_path / "logs" / "forger.log")
    wait_for(lambda: "FORGED" in (tmp_path / "logs" / "forger.log").read_text(errors="replace"), 120,
             "the forged manifest to be stored")
    a = start_peer(procs, tmp_path, maddrs, region="eu", sub="nl_news", label="eu-a", max_steps=100_000)  # until stopped
    log_a = tmp_path / "logs" / "eu-a.log"
    wait_for(lambda: "others can join through this peer" in log_a.read_text(errors="replace"), 120,
             "eu-a to join despite the forged manifest")
    text = log_a.read_text(errors="replace")
    assert "train.lr" not in text and "different run keys" not in text
    a_maddrs = re.search(r"--initial-peers (.+)", text).group(1).split()
    # the bootstrap node goes; its copy of the manifest expires (fast_run's bootstrap uses the default
    # TTL, so the bootstrap's record stays until then: kill it and check that the newcomer's manifest
    # came through eu-a, the only peer it knows, whose stored copy is the run key's)
    boot.kill()
    boot.wait(timeout=30)
    b = start_peer(procs, tmp_path, a_maddrs, region="eu", sub="de_news-reviews-wiki", label="eu-b", max_steps=20)
    assert b.wait(timeout=240) == 0, log_tail(tmp_path, "eu-b", 30)
    log_b = (tmp_path / "logs" / "eu-b.log").read_text(errors="replace")
    run_key = re.search(r"run key (\S+)\)", text).group(1)
    assert f"run key {run_key})" in log_b, log_b[-2000:]
    assert summary(tmp_path, "eu-b")["steps"] == 20
    a.terminate()
    assert a.wait(timeout=60) == 0, log_tail(tmp_path, "eu-a", 30)
