"""Admission as a user meets it: worldlm-admit's keys and certificates, and a peer of an admitting
region that starts only with a certificate for its own identity."""

import subprocess
import sys
from pathlib import Path

import pytest
from swarm_utils import DEMO, Procs, admit, env, start_bootstrap

REPO = Path(__file__).resolve().parents[2]
PEER = [sys.executable, "-m", "worldlm_p2p.cli.peer"]
DATA = str(DEMO / "eu" / "nl_news")


def _run(cmd, timeout=180):
    p = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=timeout, cwd=REPO)
    return p.returncode, p.stdout, p.stderr


def _admit(capsys, *argv):
    """worldlm-admit in this process (its start-up is most of a subprocess's cost): (code, stdout, stderr)."""
    from worldlm_p2p.cli import admit

    with pytest.raises(SystemExit) as e:
        admit.main(list(argv))
    out, err = capsys.readouterr()
    return e.value.code, out, err


def test_keys_ids_and_certificates_round_trip(tmp_path, capsys, restore_logging):
    code, out, _ = _admit(capsys, "keygen", "--key", str(tmp_path / "eu.key"), "--region", "eu")
    assert code == 0 and out.startswith('eu = "ssh-rsa ')
    (tmp_path / "run.toml").write_text(f'run_id = "demo"\n[admission.regions]\n{out}')
    code, peer_id, _ = _admit(capsys, "peer-id", "--identity", str(tmp_path / "me.key"))
    peer_id = peer_id.strip()
    assert code == 0 and peer_id.startswith("Qm")
    cert = tmp_path / "me.cert"
    code, _, err = _admit(capsys, "issue", "--key", str(tmp_path / "eu.key"), "--run-id", "demo", "--region", "eu",
                          "--peer-id", peer_id, "--days", "1", "--out", str(cert))
    assert code == 0, err
    code, out, _ = _admit(capsys, "show", "--certificate", str(cert), "--run-config", str(tmp_path / "run.toml"))
    assert code == 0 and f"peer {peer_id}" in out and out.strip().endswith("valid")
    # a certificate of another region key does not hold under this manifest
    _admit(capsys, "keygen", "--key", str(tmp_path / "other.key"))
    _admit(capsys, "issue", "--key", str(tmp_path / "other.key"), "--run-id", "demo", "--region", "eu", "--peer-id",
           peer_id, "--out", str(tmp_path / "forged.cert"))
    code, out, _ = _admit(capsys, "show", "--certificate", str(tmp_path / "forged.cert"), "--run-config",
                          str(tmp_path / "run.toml"))
    assert code == 1 and "not signed by the region's key" in out
    code, _, err = _admit(capsys, "issue", "--key", str(tmp_path / "nope.key"), "--run-id", "demo", "--region", "eu",
                          "--peer-id", peer_id, "--out", str(tmp_path / "x.cert"))
    assert code == 2 and err.count("\n") == 1 and "no such region key" in err
    # the installed command itself, once: only the peer id on stdout
    code, out, _ = _run([sys.executable, "-m", "worldlm_p2p.cli.admit", "peer-id", "--identity", str(tmp_path / "me.key")])
    assert code == 0 and out.strip() == peer_id


@pytest.mark.network
def test_a_peer_of_an_admitting_region_needs_its_certificate(tmp_path):
    procs = Procs()
    try:
        table, flags = admit(tmp_path, run_id="adm", region="eu", labels=["a", "b"])
        _, maddrs = start_bootstrap(procs, tmp_path, run_id="adm", tables=table)
        base = PEER + ["--region", "eu", "--data", DATA, "--initial-peers", *maddrs, "--max-steps", "3",
                       "--manifest-wait", "20"]
        # b's certificate with a's identity admits another peer; a peer of an open region of the same run
        # needs nothing. All at once: each waits on the network more than it computes
        cases = ((base, 2, "--identity"), (base + ["--identity", str(tmp_path / "a.key")], 2, "--certificate"),
                 (base + ["--identity", str(tmp_path / "a.key"), "--certificate", str(tmp_path / "b.cert")], 2,
                  "does not admit this peer"),
                 (PEER + ["--region", "na", "--data", str(DEMO / "na" / "en_email"), "--initial-peers", *maddrs,
                          "--max-steps", "3"], 0, "in region na"))
        started = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=REPO)
                   for cmd, _, _ in cases]
        try:
            for p, (cmd, want, needle) in zip(started, cases):
                out, err = p.communicate(timeout=180)
                assert p.returncode == want and needle in out + err, (cmd[3:], p.returncode, err[-1500:])
                if want == 2:  # a refusal: one line
                    assert err.count("\n") == 1, err
        finally:
            for p in started:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        # a with its own certificate is admitted (after the refusals that used its identity: one process
        # per peer id in the swarm)
        code, out, err = _run(base + flags["a"])
        assert code == 0, err[-1500:]
        assert "in region eu (admitted)" in out + err
    finally:
        procs.close()
