"""Atomic checkpoints: round trip, retention, corruption fallback, leftover temp files."""

from __future__ import annotations

import hashlib
import logging
import os
import struct
from pathlib import Path

import pytest
import torch

import worldlm_p2p.checkpoint as ckpt
from worldlm_p2p.checkpoint import list_checkpoints, load_latest_checkpoint, read_checkpoint, save_checkpoint
from worldlm_p2p.errors import CheckpointError


def _payload(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(4, 3, generator=g), "b": torch.arange(5)},
        "optimizer": {"state": {0: {"exp_avg": torch.ones(2) * step}}, "param_groups": [{"lr": 0.1}]},
        "counters": {"tokens": 1000 * step, "rounds": step // 2},
        "fingerprint": "abc123",
    }


def _assert_same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def test_round_trip(tmp_path: Path) -> None:
    directory = tmp_path / "ckpts" / "nested"  # created on demand
    path = save_checkpoint(directory, step=7, payload=_payload(7), keep=3)
    assert path == directory / "ckpt-000000007.pt"
    loaded = load_latest_checkpoint(directory)
    assert loaded is not None
    assert (loaded.path, loaded.step, loaded.skipped) == (path, 7, [])
    _assert_same(_payload(7), loaded.payload)
    assert loaded.payload["model"]["w"].device.type == "cpu"


def test_file_format_header(tmp_path: Path) -> None:
    raw = save_checkpoint(tmp_path, step=12, payload={"x": 1}, keep=2).read_bytes()
    # 8-byte magic, u32 version, i64 step, u64 length, 32-byte sha256 of the rest, big-endian
    assert raw[:8] == b"WLMCKPT\x00"
    version, step, length = struct.unpack(">IqQ", raw[8:28])
    assert (version, step, length) == (1, 12, len(raw) - 60)
    assert raw[28:60] == hashlib.sha256(raw[60:]).digest()


def test_nothing_to_load(tmp_path: Path) -> None:
    assert load_latest_checkpoint(tmp_path / "missing") is None
    assert load_latest_checkpoint(tmp_path) is None


def test_keep_newest(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40, 50):
        save_checkpoint(tmp_path, step=step, payload={"s": step}, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [40, 50]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000040.pt", "ckpt-000000050.pt"]
    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None and loaded.payload == {"s": 50}


def test_truncated_newest_falls_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    save_checkpoint(tmp_path, step=1, payload=_payload(1), keep=3)
    newest = save_checkpoint(tmp_path, step=2, payload=_payload(2), keep=3)
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])
    with caplog.at_level(logging.WARNING, logger="worldlm_p2p.checkpoint"):
        loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None and loaded.step == 1
    _assert_same(_payload(1), loaded.payload)
    assert len(loaded.skipped) == 1
    assert loaded.skipped[0][0] == newest and "truncated" in loaded.skipped[0][1]
    assert any(
        "ckpt-000000002.pt is corrupt (truncated" in r.getMessage()
        and "falling back to the previous one" in r.getMessage()
        for r in caplog.records
    )


def test_bit_flip_and_garbage_are_detected(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, step=1, payload={"v": 1}, keep=5)
    flipped = save_checkpoint(tmp_path, step=2, payload={"v": torch.zeros(100)}, keep=5)
    data = bytearray(flipped.read_bytes())
    data[-200] ^= 0x01
    flipped.write_bytes(bytes(data))
    garbage = tmp_path / "ckpt-000000003.pt"
    garbage.write_bytes(b"PK\x03\x04 not ours" * 10)
    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None and loaded.payload == {"v": 1}
    assert [p for p, _ in loaded.skipped] == [garbage, flipped]
    assert "bad magic" in loaded.skipped[0][1]
    assert "checksum" in loaded.skipped[1][1]
    with pytest.raises(CheckpointError, match="checksum"):
        read_checkpoint(flipped)


def test_all_corrupt_raises(tmp_path: Path) -> None:
    for step in (1, 2):
        path = save_checkpoint(tmp_path, step=step, payload={"v": step}, keep=5)
        path.write_bytes(path.read_bytes()[:30])
    with pytest.raises(CheckpointError, match="all 2 checkpoint\\(s\\) .* are corrupt") as err:
        load_latest_checkpoint(tmp_path)
    assert str(tmp_path) in str(err.value) and "\n" not in str(err.value)


def test_crash_before_rename_leaves_previous_intact(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, step=1, payload={"v": 1}, keep=3)
    # A process killed between writing the temporary file and renaming it leaves this behind:
    full = save_checkpoint(tmp_path / "scratch", step=2, payload={"v": 2}, keep=3).read_bytes()
    leftover = tmp_path / ".ckpt-k3j4h5.tmp"
    leftover.write_bytes(full[: len(full) // 3])
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None and (loaded.step, loaded.payload, loaded.skipped) == (1, {"v": 1}, [])
    assert not leftover.exists()  # cleaned


def test_failure_during_save_keeps_previous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_checkpoint(tmp_path, step=1, payload={"v": 1}, keep=3)

    def crash(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt.os, "replace", crash)
    from worldlm_p2p.errors import CheckpointWriteError

    with pytest.raises(CheckpointWriteError, match="No space left on device") as err:
        save_checkpoint(tmp_path, step=2, payload={"v": 2}, keep=3)
    monkeypatch.undo()
    # one line naming the directory, the space the last checkpoint took and the space free
    assert f"MiB free in {tmp_path}" in str(err.value) and "needs about" in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000001.pt"]  # temp file removed too
    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None and loaded.step == 1


def test_directory_is_a_file(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x", encoding="utf-8")
    with pytest.raises(CheckpointError, match="not a directory"):
        save_checkpoint(a_file, step=1, payload={}, keep=2)
    with pytest.raises(CheckpointError, match="not a directory"):
        load_latest_checkpoint(a_file)
    with pytest.raises(CheckpointError, match="cannot create checkpoint directory"):
        save_checkpoint(a_file / "sub", step=1, payload={}, keep=2)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root can write anywhere")
def test_directory_not_writable(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(CheckpointError, match="not writable"):
            save_checkpoint(locked, step=1, payload={}, keep=2)
    finally:
        locked.chmod(0o700)


def test_resaving_a_step_replaces_it(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, step=5, payload={"v": "old"}, keep=2)
    save_checkpoint(tmp_path, step=5, payload={"v": "new"}, keep=2)
    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None and loaded.payload == {"v": "new"}
    assert len(list_checkpoints(tmp_path)) == 1


class _Payload:
    """A pickle that runs code when it is loaded (what a crafted checkpoint would carry)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_crafted_checkpoint_runs_no_code(tmp_path: Path) -> None:
    """A checkpoint whose header and checksum are right but whose payload is a pickle of arbitrary
    objects is refused as corrupt (tensors and plain containers only: ``weights_only``), and the
    code in it never runs; the previous checkpoint is used instead."""
    import io

    save_checkpoint(tmp_path, step=1, payload=_payload(1), keep=5)
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save({"step": 2, "payload": {"x": _Payload(marker)}}, buf)
    data = buf.getvalue()
    header = struct.pack(">8sIqQ32s", b"WLMCKPT\x00", ckpt.FORMAT_VERSION, 2, len(data), hashlib.sha256(data).digest())
    crafted = tmp_path / "ckpt-000000002.pt"
    crafted.write_bytes(header + data)
    with pytest.raises(CheckpointError, match="corrupt: cannot unpickle"):
        read_checkpoint(crafted)
    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None and loaded.step == 1 and [p for p, _ in loaded.skipped] == [crafted]
    assert not marker.exists()


def test_a_full_disk_is_one_clear_error_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    """The OS's reason (here a file-size limit, EFBIG, the same path as ENOSPC) reaches the user,
    not torch's zip-writer message; no temporary file is left and the previous checkpoint stays."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import resource, signal, sys, torch
        from worldlm_p2p.checkpoint import save_checkpoint, list_checkpoints
        from worldlm_p2p.errors import CheckpointError
        save_checkpoint({str(tmp_path)!r}, step=1, payload={{"v": 1}}, keep=3)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.RLIM_INFINITY))
        try:
            save_checkpoint({str(tmp_path)!r}, step=2, payload={{"w": torch.zeros(1 << 16)}}, keep=3)
        except CheckpointError as e:
            print(e)
        print([s for s, _ in list_checkpoints({str(tmp_path)!r})])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    message, listed = out.stdout.strip().splitlines()
    assert "cannot write checkpoint" in message and "File too large" in message and "enforce" not in message
    assert listed == "[1]" and not list(tmp_path.glob(".ckpt-*"))
