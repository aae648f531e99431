"""``worldlm-swarm``: a small world end to end, and its live table."""

import json
import subprocess
import sys

import pytest
from rich.console import Console

from swarm_utils import REPO, env
from worldlm_p2p.display import progress_table
from worldlm_p2p.net.records import ProgressRecord


def _rec(label, region, step, waiting=-1):
    return ProgressRecord(region=region, peer_id=label, label=label, step=step, tokens=step * 100, train_loss=2.5,
                          tokens_per_s=1000.0, rounds_completed=step // 5, last_group_size=2, bytes_sent=0,
                          bytes_received=0, round=step // 5, waiting_for_round=waiting, fingerprint="f", time=100.0)


def test_progress_table_renders_every_peer():
    console = Console(record=True, width=160)
    console.print(progress_table([_rec("eu-a", "eu", 10), _rec("eu-b", "eu", 5, waiting=1)],
                                 labels={"eu-a": "eu", "eu-b": "eu", "na-a": "na"}, max_steps=20, now=101.0))
    text = console.export_text()
    for needle in ("eu-a", "eu-b", "na-a", "starting", "round 1", "2.500", "2 peers online"):
        assert needle in text, text


@pytest.mark.network
@pytest.mark.slow
def test_swarm_runs_a_small_world_writes_summary_and_stops_on_ctrl_c(tmp_path):
    import signal
    import time

    from swarm_utils import wait_for

    out = tmp_path / "world"
    p = subprocess.Popen([sys.executable, "-m", "worldlm_p2p.cli.swarm", "--regions", "eu=2,na=1", "--max-steps",
                          "100000", "--inner-steps", "5", "--out", str(out), "--no-live"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env(), cwd=REPO, start_new_session=True)
    try:
        logs = out / "logs"
        wait_for(lambda: sum("averaged with 2 peers" in f.read_text() for f in logs.glob("eu-*.log")) == 2, 300,
                 "both eu peers to complete a round")
        p.send_signal(signal.SIGINT)  # Ctrl-C
        assert p.wait(timeout=120) == 0, p.stderr.read().decode()[-2000:]
    finally:
        if p.poll() is None:
            p.kill()
    summary = json.loads((out / "summary.json").read_text())
    peers = summary["peers"]
    assert sorted(x["region"] for x in peers) == ["eu", "eu", "na"]
    for x in peers:
        for key in ("region", "steps", "tokens", "rounds_completed", "group_sizes", "first_train_loss",
                    "last_train_loss", "valid_loss"):
            assert key in x, (key, x)
        assert x["exit_code"] == 0 and 0 < x["steps"] < 100000
        assert x["tokens"] == x["steps"] * 8 * 128
        assert x["valid_loss"] > 0
    eu = [x for x in peers if x["region"] == "eu"]
    na = [x for x in peers if x["region"] == "na"]
    assert all(x["rounds_completed"] >= 1 and set(x["group_sizes"]) == {2} for x in eu)
    assert na[0]["rounds_completed"] == 0 and na[0]["group_sizes"] == []
    # every peer's structured event log agrees with its summary: the phases in order, one "round"
    # event per round it took part in, averaged ones with the group sizes of the summary
    from worldlm_p2p.peer.events import read_events

    for x in peers:
        ev = read_events(out / "events" / f"{x['label']}.jsonl")
        kinds = [e["event"] for e in ev]
        assert kinds[:4] == ["started", "joined", "reachability", "training"] and kinds[-1] == "finished", kinds
        assert ev[2]["status"] == "direct" and ev[2]["reachable"], ev[2]
        averaged = [e for e in ev if e["event"] == "round" and e["outcome"] == "averaged"]
        assert [e["group_size"] for e in averaged] == x["group_sizes"]
        assert [e["mono"] for e in ev] == sorted(e["mono"] for e in ev)
        assert ev[-1]["step"] == x["steps"] and ev[-1]["tokens"] == x["tokens"]
        assert any(e["event"] == "checkpoint" and e["step"] == x["steps"] for e in ev)
    assert (out / "logs" / "bootstrap.log").exists() and (out / "run.toml").exists()
    assert list((out / "checkpoints").glob("*/ckpt-*.pt")), "final checkpoints were written"
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "report.md").read_text()
    assert "![loss against tokens](report.png)" in report
    assert "| eu | 2 |" in report and "| na | 1 |" in report, report
    time.sleep(1)
    assert not subprocess.run(["pgrep", "-f", str(out)], capture_output=True).stdout, "processes left behind"
    _export_round_trip(out, [x["label"] for x in eu])


def _export_round_trip(out, eu_labels):
    """A real peer's final checkpoint, exported, loads with AutoModelForCausalLM and gives the logits of
    the peer's own model (its personal one, rebuilt here from the checkpoint, without the exporter); both eu peers export
    the same region model (the agreed model of their last round)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worldlm_p2p.checkpoint import load_latest_checkpoint
    from worldlm_p2p.config import RunManifest
    from worldlm_p2p.export import ExportConfig, export_model
    from worldlm_p2p.train import ByteTokenizer, build_model, set_params

    ckpt_dir = out / "checkpoints" / eu_labels[0]
    r = subprocess.run([sys.executable, "-m", "worldlm_p2p.cli.export", "--checkpoint-dir", str(ckpt_dir), "--out",
                        str(out / "export-peer"), "--which", "peer"], capture_output=True, text=True, env=env(),
                       cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr
    payload = load_latest_checkpoint(ckpt_dir).payload
    manifest = RunManifest.from_dict(payload["manifest"])
    own = build_model(manifest.model, vocab_size=259, seed=0)
    # the default (personal_model "separate"): the peer's own model is its personal one
    assert payload.get("personal") is not None
    own.load_state_dict(payload["personal"])
    own.eval()
    text = "Les régions apprennent ensemble, jede mit ihrem eigenen Modell."
    ids = torch.tensor([ByteTokenizer().encode(text)])
    exported = AutoModelForCausalLM.from_pretrained(out / "export-peer")
    assert AutoTokenizer.from_pretrained(out / "export-peer")(text, add_special_tokens=False)["input_ids"] == ids[0].tolist()
    with torch.no_grad():
        want, got = own(input_ids=ids).logits, exported(input_ids=ids).logits
    assert torch.equal(want, got), float((want - got).abs().max())
    regions = []
    for label in eu_labels:
        export_model(ExportConfig(checkpoint_dir=str(out / "checkpoints" / label), out=str(out / f"export-{label}")))
        regions.append(AutoModelForCausalLM.from_pretrained(out / f"export-{label}"))
    set_params(own, payload["anchor"])
    with torch.no_grad():
        region_logits = [m(input_ids=ids).logits for m in [own, *regions]]
    assert torch.equal(region_logits[0], region_logits[1])
    rounds = {load_latest_checkpoint(out / "checkpoints" / label).payload["stats"]["round"] for label in eu_labels}
    if len(rounds) == 1:  # (a peer stopped by Ctrl-C in the middle of a round keeps the previous agreed model)
        assert float((region_logits[1] - region_logits[2]).abs().max()) < 1e-3


def test_swarm_refuses_an_unknown_device_in_one_line(tmp_path):
    p = subprocess.run([sys.executable, "-m", "worldlm_p2p.cli.swarm", "--device", "gpu0", "--out", str(tmp_path / "w"),
                        "--no-live"], capture_output=True, text=True, env=env(), cwd=REPO, timeout=120)
    assert p.returncode != 0
    assert p.stderr.strip().splitlines()[-1] == "worldlm-swarm: error: --device: 'gpu0' is not cpu, cuda or cuda:N"
    assert "Traceback" not in p.stderr


def test_swarm_config_devices():
    from pathlib import Path

    from worldlm_p2p.config import RunManifest
    from worldlm_p2p.errors import ConfigError
    from worldlm_p2p.swarm import SwarmConfig

    m = RunManifest.from_dict({"run_id": "d"})
    for ok in ("cpu", "cuda", "cuda:1"):
        assert SwarmConfig(regions={"eu": 1}, data=Path("."), out=Path("o"), manifest=m, device=ok).device == ok
    for bad in ("gpu", "cuda:", "cuda:x", ""):
        with pytest.raises(ConfigError, match="is not cpu, cuda or cuda:N"):
            SwarmConfig(regions={"eu": 1}, data=Path("."), out=Path("o"), manifest=m, device=bad)


def test_swarm_regions_default_to_the_corpus_it_is_given(tmp_path):
    """``--data`` without ``--regions``: every region of that corpus, one peer per sub-corpus (the
    demo's eu=3,na=2,asia=2 would name regions a corpus of one's own may not have); ``--regions``
    as given otherwise; a bad layout is the corpus's one-line error."""
    from worldlm_p2p.cli.swarm import choose_regions
    from worldlm_p2p.errors import DataError

    for region, subs in {"north": ["a", "b", "c"], "south-1": ["d"]}.items():
        for sub in subs:
            (tmp_path / "c" / region / sub).mkdir(parents=True)
            (tmp_path / "c" / region / sub / "train.txt").write_text("text\n")
    assert choose_regions(None, tmp_path / "c") == {"north": 3, "south-1": 1}
    assert choose_regions("north=2", tmp_path / "c") == {"north": 2}
    assert choose_regions(None, None) == {"eu": 3, "na": 2, "asia": 2}
    (tmp_path / "c" / "south-1" / "e").mkdir()
    with pytest.raises(DataError, match="has no train.txt"):
        choose_regions(None, tmp_path / "c")
