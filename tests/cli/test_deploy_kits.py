"""Deployment material parses and validates: peer profiles, the example run manifest, the unit file."""

import shlex
from pathlib import Path

import pytest

from worldlm_p2p.cli import bootstrap as boot_cli
from worldlm_p2p.cli import peer as peer_cli
from worldlm_p2p.config import PeerConfig, RunManifest, load_toml, manifest_conflicts
from worldlm_p2p.net.dht import parse_maddrs

REPO = Path(__file__).resolve().parents[2]
DATA = str(REPO / "worldlm_p2p" / "demo_data" / "eu" / "nl_news")
EXAMPLE = REPO / "bootstrap" / "run.example.toml"


PROFILES = sorted((REPO / "peers").rglob("*.toml"))


def test_there_are_volunteer_and_institution_profiles_for_every_region():
    names = {str(p.relative_to(REPO / "peers")) for p in PROFILES}
    for region in ("eu", "na", "asia"):
        assert f"{region}.toml" in names and f"institutions/{region}.toml" in names


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: str(p.relative_to(REPO / "peers")))
def test_peer_profiles_validate_and_agree_with_the_example_manifest(profile):
    cfg = peer_cli.make_config(peer_cli.build_parser().parse_args(["--config", str(profile), "--data", DATA]))
    assert isinstance(cfg, PeerConfig) and cfg.region == profile.stem
    assert manifest_conflicts(RunManifest.from_toml(EXAMPLE), cfg.local_overrides) == []
    # every address in the profile is a valid multiaddr (the bootstrap ones with their peer id)
    parse_maddrs(cfg.net.initial_peers, what="initial_peers", require_peer_id=True)
    parse_maddrs(cfg.net.host_maddrs, what="host_maddrs", require_peer_id=False)
    parse_maddrs(cfg.net.announce_maddrs, what="announce_maddrs", require_peer_id=False)
    if profile.parent.name == "institutions":
        assert cfg.net.identity_path and cfg.checkpoint_dir and cfg.net.announce_maddrs and cfg.device == "cuda"


def test_example_run_manifest_validates():
    m = RunManifest.from_toml(EXAMPLE)
    assert m.model.preset == "small"
    assert set(load_toml(EXAMPLE)) <= {"run_id", "model", "tokenizer", "train", "aggregation", "averaging", "privacy"}


def _exec_start(unit: Path) -> list[str]:
    text = unit.read_text()
    start = text.index("ExecStart=") + len("ExecStart=")
    lines = []
    for line in text[start:].splitlines():
        lines.append(line.rstrip("\\").strip())
        if not line.rstrip().endswith("\\"):
            break
    return shlex.split(" ".join(lines))


def test_systemd_unit_command_line_is_accepted():
    argv = _exec_start(REPO / "bootstrap" / "worldlm-bootstrap.service")
    assert argv[0].endswith("worldlm-bootstrap")
    args = boot_cli.build_parser().parse_args(argv[1:])
    assert args.identity and args.run_config and args.host_maddrs


def test_peer_systemd_unit_command_line_is_accepted(tmp_path):
    argv = _exec_start(REPO / "peers" / "worldlm-peer@.service")
    assert argv[0].endswith("worldlm-peer")
    argv = [a.replace("%i", "eu") for a in argv[1:]]
    args = peer_cli.build_parser().parse_args(argv)
    assert args.config == "/etc/worldlm/peer-eu.toml"
    # with the institution profile installed where the unit expects it, the command line makes a valid peer
    installed = tmp_path / "peer-eu.toml"
    installed.write_text((REPO / "peers" / "institutions" / "eu.toml").read_text())
    cfg = peer_cli.make_config(peer_cli.build_parser().parse_args(
        [a.replace("/etc/worldlm/peer-eu.toml", str(installed)) for a in argv] + ["--data", DATA]))
    assert cfg.region == "eu" and cfg.checkpoint_dir.startswith("/var/lib/worldlm/")


def test_the_privacy_block_of_a_profile_parses_when_uncommented(tmp_path):
    lines = (REPO / "peers" / "eu.toml").read_text().splitlines()
    start = lines.index("# [peer.privacy]")
    for i in list(range(start, start + 4)) + list(range(start + 6, start + 9)):
        lines[i] = lines[i].removeprefix("# ")
    profile = tmp_path / "eu.toml"
    profile.write_text("\n".join(lines) + "\n")
    cfg = peer_cli.make_config(peer_cli.build_parser().parse_args(["--config", str(profile), "--data", DATA]))
    assert (cfg.privacy.peer_noise, cfg.privacy.peer_clip, cfg.privacy.peer_delta) == (1.0, 1.0, 1e-5)
    assert (cfg.privacy.border_clip, cfg.privacy.border_noise, cfg.privacy.border_delta) == (1.0, 0.5, 1e-5)
    # a flag wins over the profile
    cfg = peer_cli.make_config(peer_cli.build_parser().parse_args(
        ["--config", str(profile), "--data", DATA, "--peer-dp-noise", "2.0"]))
    assert cfg.privacy.peer_noise == 2.0


def test_peer_privacy_flags_that_cannot_work_fail_before_the_network():
    from worldlm_p2p.errors import ConfigError

    base = ["--region", "eu", "--data", DATA, "--initial-peers",
            "/ip4/127.0.0.1/tcp/1/p2p/QmaqJesiNcZak8Ns1727tE9RGyDzXE1w7qZxtnr2hcVipv"]
    for extra, needle in ((["--peer-dp-epsilon", "8"], "needs --max-steps"),
                          (["--peer-dp-epsilon", "8", "--peer-dp-noise", "1", "--max-steps", "9"], "not both"),
                          (["--region-dp-noise", "0.5"], "needs privacy.border_clip")):
        with pytest.raises(ConfigError, match=needle):
            peer_cli.make_config(peer_cli.build_parser().parse_args(base + extra))
