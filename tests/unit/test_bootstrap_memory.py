"""What a bootstrap node remembers of the peers it served (to rejoin them when restarted)."""

import json
import socket

import pytest

from worldlm_p2p.bootstrap import MAX_REMEMBERED, BootstrapConfig, answering, read_remembered, write_remembered
from worldlm_p2p.config import NetConfig
from worldlm_p2p.errors import ConfigError

PID = "QmaqJesiNcZak8Ns1727tE9RGyDzXE1w7qZxtnr2hcVipv"


def test_remembered_peers_round_trip_and_bad_files_are_only_ignored(tmp_path, caplog):
    path = tmp_path / "boot.id.peers.json"
    assert read_remembered(path) == []  # nothing remembered yet
    maddrs = [f"/ip4/127.0.0.1/tcp/{4000 + i}/p2p/{PID}" for i in range(3)]
    write_remembered(path, maddrs)
    assert read_remembered(path) == maddrs and not list(tmp_path.glob(".*tmp*"))
    path.write_text(json.dumps(dict(peers=["not-a-maddr", "/ip4/127.0.0.1/tcp/1", maddrs[0]])))
    assert read_remembered(path) == [maddrs[0]]  # malformed or id-less addresses are skipped
    for junk in (b"\xff\xfe binary", b"{not json", b'{"peers": 7}', b"[1, 2]"):
        path.write_bytes(junk)
        assert read_remembered(path) == []
    assert "ignoring the peers remembered" in caplog.text
    write_remembered(path, [f"/ip4/127.0.0.1/tcp/{4000 + i}/p2p/{PID}" for i in range(200)])
    assert len(read_remembered(path)) == MAX_REMEMBERED


def test_only_remembered_peers_that_answer_are_dialled():
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
    try:
        up = f"/ip4/127.0.0.1/tcp/{listening.getsockname()[1]}/p2p/{PID}"
        down = f"/ip4/127.0.0.1/tcp/{closed.getsockname()[1]}/p2p/{PID}"
        assert answering([down, up, f"/dns4/example.invalid/tcp/1/p2p/{PID}"]) == [up]
        assert answering([]) == []
    finally:
        listening.close()
        closed.close()


def test_a_peers_file_where_it_cannot_be_written_is_a_config_error(tmp_path):
    net = NetConfig(initial_peers=(), host_maddrs=("/ip4/127.0.0.1/tcp/0",))
    with pytest.raises(ConfigError, match="does not exist"):
        BootstrapConfig(net=net, peers_path=str(tmp_path / "missing" / "p.json"))
    with pytest.raises(ConfigError, match="directory"):
        BootstrapConfig(net=net, peers_path=str(tmp_path))
    with pytest.raises(ConfigError, match="remember_every"):
        BootstrapConfig(net=net, remember_every=float("nan"))
