"""The CLIs as a user runs them: first output, bad input -> exit code 2 and one line on stderr."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarm_utils import DEMO, LOOPBACK, Procs, alive, env, start_bootstrap, wait_for

PEER = [sys.executable, "-m", "worldlm_p2p.cli.peer"]
BOOT = [sys.executable, "-m", "worldlm_p2p.cli.bootstrap"]
SWARM = [sys.executable, "-m", "worldlm_p2p.cli.swarm"]
MONITOR = [sys.executable, "-m", "worldlm_p2p.cli.monitor"]
REPO_ROOT = Path(__file__).resolve().parents[2]
# a well-formed address where nobody listens
NOBODY = "/ip4/127.0.0.1/tcp/9/p2p/QmaqJesiNcZak8Ns1727tE9RGyDzXE1w7qZxtnr2hcVipv"
DATA = str(DEMO / "eu" / "nl_news")


def run(cmd, timeout=120):
    p = subprocess.run(cmd, capture_output=True, env=env(), timeout=timeout, cwd=Path(__file__).parents[2])
    return p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")


def assert_one_line_error(code, err, *needles):
    lines = err.strip().splitlines()
    assert code == 2, (code, err)
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def boot(tmp_path_factory):
    procs = Procs()
    tmp = tmp_path_factory.mktemp("boot")
    try:
        _, maddrs = start_bootstrap(procs, tmp, run_id="cli", inner_steps=5)
        yield maddrs
    finally:
        procs.close()


@pytest.mark.parametrize("argv, needles", [
    (["--region", "eu", "--data", DATA, "--initial-peers", "not-a-maddr"], ["malformed multiaddr", "not-a-maddr"]),
    (["--region", "eu", "--data", DATA, "--initial-peers", "/ip4/127.0.0.1/tcp/31337"], ["/p2p/"]),
    (["--region", "eu", "--data", "/nonexistent/path", "--initial-peers", NOBODY], ["/nonexistent/path"]),
    (["--region", "e.u", "--data", DATA, "--initial-peers", NOBODY], ["region", "e.u"]),
    (["--data", DATA, "--initial-peers", NOBODY], ["--region"]),
    (["--region", "eu", "--data", DATA, "--initial-peers", NOBODY, "--max-steps", "zero"], ["--max-steps"]),
    (["--region", "eu", "--data", DATA, "--initial-peers", NOBODY, "--device", "tpu"], ["device"]),
    (["--region", "eu", "--data", DATA, "--initial-peers", NOBODY, "--config", "/nonexistent.toml"],
     ["/nonexistent.toml"]),
    (["--region", "eu", "--data", DATA, "--initial-peers", NOBODY, "--reachability", "relay"],
     ["--reachability", "relay"]),
    (["--region", "eu", "--data", DATA, "--initial-peers", NOBODY, "--background-nice", "20"],
     ["background_nice", "0", "19"]),
    (["--region", "eu", "--data", DATA, "--initial-peers", NOBODY, "--background-nice", "low"],
     ["--background-nice", "low"]),
])
def test_peer_bad_input_fails_fast_with_one_line(argv, needles):
    code, _, err = run(PEER + argv)
    assert_one_line_error(code, err, *needles)


def test_peer_empty_data(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "blank.txt").write_text("\n  \n")
    for path in (tmp_path / "empty", tmp_path / "blank.txt"):
        code, _, err = run(PEER + ["--region", "eu", "--data", str(path), "--initial-peers", NOBODY])
        assert_one_line_error(code, err, str(path))


def test_peer_unreachable_bootstrap_retries_then_names_the_address():
    t0 = time.monotonic()
    code, out, err = run(PEER + ["--region", "eu", "--data", DATA, "--initial-peers", NOBODY], timeout=180)
    assert_one_line_error(code, err, "could not reach bootstrap", NOBODY)
    assert "retrying" in out  # bounded retries with backoff were made, and logged
    assert time.monotonic() - t0 < 150


@pytest.mark.network
def test_peer_refuses_settings_that_contradict_the_manifest(boot, tmp_path):
    cfg = tmp_path / "peer.toml"
    cfg.write_text('[peer]\nregion = "eu"\n\n[train]\ninner_steps = 99\n')
    code, _, err = run(PEER + ["--config", str(cfg), "--data", DATA, "--initial-peers", *boot])
    assert_one_line_error(code, err, "train.inner_steps", "99", "5")
    cfg.write_text('[model]\npreset = "small"\n')
    code, _, err = run(PEER + ["--config", str(cfg), "--region", "eu", "--data", DATA, "--initial-peers", *boot])
    assert_one_line_error(code, err, "model.preset", "small", "tiny")


@pytest.mark.network
def test_peer_privacy_settings_against_the_run_policy(tmp_path):
    """A run whose manifest requires DP-SGD at epsilon <= 8: a peer without it, or whose noise would
    spend more over its steps, refuses to start and says why."""
    procs = Procs()
    try:
        (tmp_path / "b").mkdir()
        _, maddrs = start_bootstrap(procs, tmp_path / "b", run_id="dp", inner_steps=5,
                                   averaging="[privacy]\nmax_peer_epsilon = 8.0")
        base = PEER + ["--region", "eu", "--data", DATA, "--initial-peers", *maddrs]
        code, _, err = run(base + ["--max-steps", "10"])
        assert_one_line_error(code, err, "privacy settings break the run's policy", "DP-SGD", "epsilon <= 8")
    finally:
        procs.close()
    # the checks that need the peer's data size (its DP-SGD sampling rate), in-process: the same
    # methods the peer runs once its trainer is built, before it trains (saves two peer start-ups)
    import torch

    from worldlm_p2p.config import PeerConfig, PrivacyConfig, RunManifest
    from worldlm_p2p.errors import ConfigError
    from worldlm_p2p.peer import joining
    from worldlm_p2p.train import ByteTokenizer, LocalTrainer, build_model, load_texts, peer_dp_config, tokenize_splits

    manifest = RunManifest.from_dict({"run_id": "dp", "privacy": {"max_peer_epsilon": 8.0},
                                      "train": {"batch_size": 4, "seq_len": 64}})
    data = tokenize_splits(load_texts(DATA), ByteTokenizer())
    for noise, steps, message in ((0.3, 100_000, "privacy.peer_noise 0.3 would spend epsilon"),
                                  (5.0, None, "give --max-steps")):
        config = PeerConfig(region="eu", data=DATA, privacy=PrivacyConfig(peer_noise=noise), max_steps=steps)
        joining.check_privacy(config, manifest)  # DP-SGD is on: the policy's first check passes
        trainer = LocalTrainer(model=build_model(manifest.model, vocab_size=259, seed=0), train=manifest.train,
                               data=data, device=torch.device("cpu"), seed=0,
                               dp=peer_dp_config(epsilon=0, noise=noise, clip=1.0, delta=1e-5, steps=steps))
        with pytest.raises(ConfigError, match=message) as err:
            joining.check_projected_epsilon(config, manifest, trainer.dp)
        assert "\n" not in str(err.value) and (steps is None or "max_peer_epsilon 8" in str(err.value))


@pytest.mark.network
def test_peer_unknown_run_id(boot):
    code, _, err = run(PEER + ["--region", "eu", "--data", DATA, "--initial-peers", *boot, "--run-id", "other",
                               "--manifest-wait", "2"])
    assert_one_line_error(code, err, "other", "cli")


@pytest.mark.network
def test_peer_all_checkpoints_corrupt(boot, tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "ckpt-000000010.pt").write_bytes(b"garbage" * 10)
    code, _, err = run(PEER + ["--region", "eu", "--data", DATA, "--initial-peers", *boot, "--checkpoint-dir",
                               str(ck), "--max-steps", "3"])
    assert_one_line_error(code, err, "checkpoint")


@pytest.mark.network
@pytest.mark.parametrize("to, sig", [("pid", signal.SIGINT), ("group", signal.SIGINT), ("group", signal.SIGTERM)])
def test_peer_stops_cleanly_on_ctrl_c_while_training(boot, tmp_path, to, sig):
    """hivemind's averager sets SIGINT to SIG_IGN in the process that starts it; the peer keeps its
    own handler, so Ctrl-C during training stops it cleanly (final checkpoint, summary, exit 0).
    The same when the signal goes to the peer's whole process group, as Ctrl-C in a terminal and
    systemd's stop do: hivemind's processes used to die first, and the peer then waited for its
    averager forever. Nothing the peer started outlives it."""
    from swarm_utils import descendants

    from worldlm_p2p.peer.events import read_events

    events, summary = tmp_path / "events.jsonl", tmp_path / "summary.json"
    p = subprocess.Popen(PEER + ["--region", "eu", "--data", DATA, "--initial-peers", *boot, "--max-steps", "100000",
                                 "--events", str(events), "--summary", str(summary), "--checkpoint-dir",
                                 str(tmp_path / "ck")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env(),
                         start_new_session=True)
    try:
        wait_for(lambda: any(e["event"] == "round" for e in read_events(events)), 180, "the peer's first round")
        below = descendants(p.pid)
        assert any("p2pd" in c for c in below.values()), below
        if to == "group":
            os.killpg(p.pid, sig)
        else:
            p.send_signal(sig)
        assert p.wait(timeout=60) == 0, p.stderr.read().decode()[-1500:]
        assert "Traceback" not in p.stderr.read().decode()
        wait_for(lambda: not alive(below), 20, f"the peer's processes {below} to end with it")
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
    kinds = [e["event"] for e in read_events(events)]
    assert kinds[-1] == "finished" and "checkpoint" in kinds[kinds.index("training"):], kinds
    assert summary.exists() and list((tmp_path / "ck").glob("ckpt-*.pt"))


def test_bootstrap_bad_input():
    code, _, err = run(BOOT + ["--host-maddrs", "/ip4/127.0.0.1/tcp/notaport"])
    assert_one_line_error(code, err, "notaport")
    code, _, err = run(BOOT + ["--run-config", "/nonexistent/run.toml"])
    assert_one_line_error(code, err, "/nonexistent/run.toml")


def test_bootstrap_bad_run_config(tmp_path):
    for text, needle in (('run_id = "x"\n[train]\ninner_steps = 0\n', "train.inner_steps"),
                         ('run_id = "x"\n[train]\nlearning_rate = 1\n', "train.learning_rate"),
                         ('run_id = "a.b"\n', "a.b"), ("run_id = [", "TOML"),
                         ('run_id = "x"\n[model]\npreset = "huge"\n', "huge"),
                         ('run_id = "x"\n[admission.regions]\neu = "ssh-rsa garbage"\n', "admission.regions.eu")):
        path = tmp_path / "run.toml"
        path.write_text(text)
        code, _, err = run(BOOT + ["--run-config", str(path), "--host-maddrs", LOOPBACK])
        assert_one_line_error(code, err, needle)


def _p2pd_children(pid: int) -> list[int]:
    """The p2p daemons below ``pid`` (the daemon runs in a session of its own)."""
    from swarm_utils import descendants

    return [p for p, command in descendants(pid).items() if "p2pd" in command]


@pytest.mark.network
def test_bootstrap_prints_maddrs_keeps_identity_and_stops_cleanly(tmp_path):
    ident = tmp_path / "boot.id"
    ids = []
    for _ in range(2):
        p = subprocess.Popen(BOOT + ["--host-maddrs", LOOPBACK, "--identity", str(ident)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env(), start_new_session=True)
        try:
            first = p.stdout.readline().decode()
            maddrs = [t for t in first.split() if t.startswith("/ip4/127.0.0.1/tcp/")]
            assert maddrs and all("/p2p/" in m for m in maddrs), first
            ids.append(maddrs[0].rsplit("/p2p/", 1)[1])
            daemons = _p2pd_children(p.pid)
            assert daemons, "bootstrap should run a p2p daemon"
            p.send_signal(signal.SIGTERM)
            assert p.wait(timeout=30) == 0
            assert p.stderr.read() == b""
            wait_for(lambda: not alive(daemons), 10, "the bootstrap's p2p daemon to stop with it")
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert stat.S_IMODE(ident.stat().st_mode) == 0o600
    assert ids[0] == ids[1], "the peer id must survive a restart with the same identity"


def test_bootstrap_corrupt_identity(tmp_path):
    ident = tmp_path / "bad.id"
    ident.write_bytes(b"not a key")
    code, _, err = run(BOOT + ["--host-maddrs", LOOPBACK, "--identity", str(ident)])
    assert_one_line_error(code, err, str(ident))


@pytest.mark.parametrize("argv, needles", [
    (["--regions", "eu"], ["REGION=COUNT"]),
    (["--regions", "eu=0"], ["at least one"]),
    (["--regions", "eu=7"], ["sub-corpora"]),
    (["--regions", "mars=1"], ["mars"]),
    (["--data", "/nonexistent/corpus"], ["/nonexistent/corpus"]),
    (["--model", "huge"], ["huge"]),
])
def test_swarm_bad_input(argv, needles, tmp_path):
    code, _, err = run(SWARM + argv + ["--out", str(tmp_path / "out")])
    assert_one_line_error(code, err, *needles)


def test_bad_inputs_found_by_trying_them_get_one_line_before_anything_starts(tmp_path):
    """Issue 12's list: each of these used to hang, crash after the start, or exit 1 with a traceback."""
    binary = tmp_path / "binary.toml"
    binary.write_bytes(bytes(range(256)) * 4)
    fifo = tmp_path / "text.txt"
    os.mkfifo(fifo)
    long_pattern = tmp_path / "long.toml"
    long_pattern.write_text('run_id = "x"\n[aggregation]\nkey_layers = "' + "*k_proj*," * 8000 + '"\n')
    cases = [
        (PEER + ["--region", "eu", "--data", DATA, "--initial-peers", NOBODY, "--config", str(binary)],
         ["not UTF-8"]),
        (PEER + ["--region", "eu", "--data", str(fifo), "--initial-peers", NOBODY], ["not a regular file"]),
        (PEER + ["--region", "eu", "--data", DATA, "--initial-peers", NOBODY, "--manifest-wait", "nan"],
         ["manifest_wait", "finite"]),
        (PEER + ["--region", "eu", "--data", DATA, "--initial-peers", NOBODY, "--summary",
                 str(tmp_path / "file.txt" / "s.json")], ["--summary", "cannot write"]),
        (BOOT + ["--run-config", str(binary), "--host-maddrs", LOOPBACK], ["not UTF-8"]),
        (BOOT + ["--run-config", str(long_pattern), "--host-maddrs", LOOPBACK], ["aggregation.key_layers", "4096"]),
        (MONITOR + ["--initial-peers", NOBODY, "--interval", "inf"], ["--interval", "finite"]),
    ]
    (tmp_path / "file.txt").write_text("a file where a directory is expected")
    for ttl in ("nan", "inf"):
        cases.append((BOOT + ["--run-config", str(REPO_ROOT / "bootstrap" / "run.example.toml"), "--manifest-ttl", ttl,
                              "--host-maddrs", LOOPBACK], ["manifest_ttl", "finite"]))
    for argv, needles in cases:
        code, _, err = run(argv, timeout=60)
        assert_one_line_error(code, err, *needles)
    code, _, err = run(SWARM + ["--out", str(tmp_path / "file.txt" / "out")])
    assert_one_line_error(code, err, "--out", "cannot write")


def test_a_listen_address_in_use_or_not_of_this_machine_gets_one_line(tmp_path):
    """A second bootstrap on a port in use used to start and share the address with the first (libp2p
    binds with SO_REUSEPORT); an address that is not this machine's was reported as an unreachable
    bootstrap after 30 s of retries."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        in_use = f"/ip4/127.0.0.1/tcp/{port}"
        # 192.0.2.1 (TEST-NET-1, RFC 5737) is no interface's address
        for argv, needles in (
                (BOOT + ["--host-maddrs", in_use], ["already in use", str(port)]),
                (PEER + ["--region", "eu", "--data", DATA, "--initial-peers", NOBODY, "--host-maddrs", in_use],
                 ["already in use", str(port)]),
                (BOOT + ["--host-maddrs", "/ip4/192.0.2.1/tcp/0"], ["192.0.2.1", "not an address of this machine"]),
                (PEER + ["--region", "eu", "--data", DATA, "--initial-peers", NOBODY, "--host-maddrs",
                         "/ip4/192.0.2.1/tcp/0"], ["not an address of this machine", "--announce-maddrs"])):
            code, _, err = run(argv, timeout=60)
            assert_one_line_error(code, err, *needles)
            assert "could not reach" not in err
    finally:
        taken.close()
