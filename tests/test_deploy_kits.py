"""Deployment material parses and validates: peer profiles, the example run manifest, the unit file."""

import shlex
from pathlib import Path

import pytest

from worldlm_p2p.cli import bootstrap as boot_cli
from worldlm_p2p.cli import peer as peer_cli
from worldlm_p2p.config import PeerConfig, RunManifest, load_toml, manifest_conflicts

REPO = Path(__file__).resolve().parents[1]
DATA = str(REPO / "worldlm_p2p" / "demo_data" / "eu" / "nl_news")
EXAMPLE = REPO / "bootstrap" / "run.example.toml"


@pytest.mark.parametrize("profile", sorted((REPO / "peers").glob("*.toml")), ids=lambda p: p.name)
def test_peer_profiles_validate_and_agree_with_the_example_manifest(profile):
    cfg = peer_cli.make_config(peer_cli.build_parser().parse_args(["--config", str(profile), "--data", DATA]))
    assert isinstance(cfg, PeerConfig) and cfg.region == profile.stem
    assert manifest_conflicts(RunManifest.from_toml(EXAMPLE), cfg.local_overrides) == []


def test_example_run_manifest_validates():
    m = RunManifest.from_toml(EXAMPLE)
    assert m.model.preset == "small"
    assert set(load_toml(EXAMPLE)) <= {"run_id", "model", "tokenizer", "train", "aggregation", "averaging"}


def test_systemd_unit_command_line_is_accepted():
    text = (REPO / "bootstrap" / "worldlm-bootstrap.service").read_text()
    start = text.index("ExecStart=") + len("ExecStart=")
    lines = []
    for line in text[start:].splitlines():
        lines.append(line.rstrip("\\").strip())
        if not line.rstrip().endswith("\\"):
            break
    argv = shlex.split(" ".join(lines))
    assert argv[0].endswith("worldlm-bootstrap")
    args = boot_cli.build_parser().parse_args(argv[1:])
    assert args.identity and args.run_config and args.host_maddrs
