"""Atomic, self-verifying checkpoints (torch only).

A checkpoint is one file ``ckpt-{step:09d}.pt`` in a directory::

    header (60 bytes): magic b"WLMCKPT\\0" | format version u32 | step i64 | payload length u64 | sha256 (32 B)
    payload:           torch.save({"step": step, "payload": <caller's dict>})

It is written to a temporary file in the same directory, flushed and fsync'ed, renamed into place
with :func:`os.replace` and the directory is fsync'ed, so a crash leaves either the previous set of
checkpoints or the new one, never a half-written ``ckpt-*.pt``. The checksum catches truncation and
corruption: :func:`load_latest_checkpoint` then falls back to the previous checkpoint.

The checksum protects integrity, not authenticity. The payload is read with torch's
``weights_only`` unpickler (tensors, numbers, strings and plain containers only), so a crafted file
cannot run code when it is loaded: it is refused as corrupt.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import shutil
import re
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

import torch

from worldlm_p2p.errors import CheckpointError, CheckpointWriteError

logger = logging.getLogger(__name__)

__all__ = [
    "FORMAT_VERSION",
    "LoadedCheckpoint",
    "checkpoint_path",
    "list_checkpoints",
    "save_checkpoint",
    "read_checkpoint",
    "load_latest_checkpoint",
]

FORMAT_VERSION = 1
_MAGIC = b"WLMCKPT\x00"
_HEADER = struct.Struct(">8sIqQ32s")  # magic, version, step, payload length, sha256
_NAME_RE = re.compile(r"^ckpt-(\d{9,})\.pt$")
_TMP_PREFIX, _TMP_SUFFIX = ".ckpt-", ".tmp"


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadedCheckpoint:
    """A checkpoint read back: its file, step and the caller's payload, plus the newer files that
    were skipped as corrupt (``(path, reason)``, newest first)."""

    path: Path
    step: int
    payload: dict[str, Any]
    skipped: list[tuple[Path, str]] = field(default_factory=list)


class _Corrupt(Exception):
    """Internal: a checkpoint file failed verification; ``str(e)`` is the reason."""


def checkpoint_path(directory: str | Path, step: int) -> Path:
    """Where the checkpoint of ``step`` lives in ``directory``."""
    return Path(directory) / f"ckpt-{int(step):09d}.pt"


def _check_directory(directory: Path, *, create: bool) -> bool:
    """Raise CheckpointError if ``directory`` is unusable; return whether it exists."""
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} exists but is not a directory")
    if not directory.exists():
        if not create:
            return False
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"cannot create checkpoint directory {directory}: {e.strerror or e}") from None
    if create and not os.access(directory, os.W_OK | os.X_OK):
        raise CheckpointError(f"checkpoint directory {directory} is not writable")
    return True


def list_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of the checkpoint files in ``directory``, oldest first (no verification)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    try:
        for p in directory.iterdir():
            m = _NAME_RE.match(p.name)
            if m and p.is_file():
                found.append((int(m.group(1)), p))
    except OSError as e:
        raise CheckpointError(f"cannot list checkpoint directory {directory}: {e.strerror or e}") from None
    return sorted(found)


class _HashingWriter:
    """File wrapper that hashes and counts what ``torch.save`` writes (no in-memory copy)."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.sha = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None  # what the OS said (torch's zip writer hides it in a RuntimeError)

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        self.sha.update(view)
        self.size += view.nbytes
        try:
            return self._f.write(view)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        try:
            self._f.flush()
        except OSError as e:
            self.error = e
            raise


def fsync_dir(directory: Path) -> None:
    """fsync a directory (a rename in it is durable once this returns); a no-op where unsupported."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems do not support fsync on directories
    finally:
        os.close(fd)


def save_checkpoint(directory: str | Path, *, step: int, payload: dict[str, Any], keep: int) -> Path:
    """Atomically write ``payload`` as the checkpoint of ``step`` and keep only the newest ``keep``
    checkpoint files. Returns the checkpoint's path. Raises CheckpointError if the directory is a
    file, cannot be created or written."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    directory = Path(directory).expanduser()
    _check_directory(directory, create=True)
    final = checkpoint_path(directory, step)
    try:
        fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=_TMP_PREFIX, suffix=_TMP_SUFFIX)
    except OSError as e:
        raise CheckpointWriteError(f"cannot write in checkpoint directory {directory}: {e.strerror or e}"
                                   f"{_space(directory)}") from None
    tmp = Path(tmp_name)
    writer = None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b"\0" * _HEADER.size)
            writer = _HashingWriter(f)
            torch.save({"step": int(step), "payload": payload}, cast(IO[bytes], writer))
            f.seek(0)
            f.write(_HEADER.pack(_MAGIC, FORMAT_VERSION, int(step), writer.size, writer.sha.digest()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_dir(directory)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        cause = e if isinstance(e, OSError) else writer.error if writer is not None else None
        if cause is not None:  # disk full, quota, I/O error: the OS's reason, not torch's
            raise CheckpointWriteError(f"cannot write checkpoint {final}: {cause.strerror or cause}{_space(directory)} "
                                  "(the previous checkpoints are kept)") from None
        raise
    logger.info("saved checkpoint %s (%d payload bytes)", final, writer.size)
    _prune(directory, keep=keep, protect=final)
    return final


def _space(directory: Path) -> str:
    """``"; needs about N MiB, M MiB free"``: the size of the latest checkpoint there against the
    free space of its file system (empty when neither can be read)."""
    try:
        free = shutil.disk_usage(directory).free
        existing = list_checkpoints(directory)
        need = existing[-1][1].stat().st_size if existing else 0
    except OSError:
        return ""
    mib = 1 << 20
    return (f"; needs about {need / mib:.1f} MiB, {free / mib:.1f} MiB free in {directory}" if need
            else f"; {free / mib:.1f} MiB free in {directory}")


def _prune(directory: Path, *, keep: int, protect: Path) -> None:
    existing = list_checkpoints(directory)
    excess = len(existing) - keep
    for _, path in existing:
        if excess <= 0:
            break
        if path == protect:
            continue
        try:
            path.unlink()
            logger.debug("removed old checkpoint %s", path)
        except OSError as e:
            logger.warning("could not remove old checkpoint %s: %s", path, e.strerror or e)
        excess -= 1


def _read(path: Path) -> tuple[int, dict[str, Any]]:
    """Verify and unpickle one checkpoint file; raise :class:`_Corrupt` with a short reason."""
    try:
        with path.open("rb") as f:
            header = f.read(_HEADER.size)
            if len(header) < _HEADER.size:
                raise _Corrupt(f"truncated header: {len(header)} of {_HEADER.size} bytes")
            magic, version, step, length, digest = _HEADER.unpack(header)
            if magic != _MAGIC:
                raise _Corrupt("not a worldlm checkpoint (bad magic bytes)")
            if version != FORMAT_VERSION:
                raise _Corrupt(f"unsupported checkpoint format version {version} (this build reads {FORMAT_VERSION})")
            data = f.read(length + 1)
    except OSError as e:
        raise _Corrupt(f"unreadable: {e.strerror or e}") from None
    if len(data) < length:
        raise _Corrupt(f"truncated: {len(data)} of {length} payload bytes")
    if len(data) > length:
        raise _Corrupt("unexpected bytes after the payload")
    if hashlib.sha256(data).digest() != digest:
        raise _Corrupt("sha256 checksum mismatch")
    m = _NAME_RE.match(path.name)
    if m and int(m.group(1)) != step:
        raise _Corrupt(f"file name says step {int(m.group(1))} but the header says {step}")
    try:
        # tensors and plain containers only: a crafted pickle cannot run code when it is loaded
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:
        raise _Corrupt(f"cannot unpickle the payload: {_one_line(e)}") from None
    if not isinstance(obj, dict) or obj.get("step") != step or not isinstance(obj.get("payload"), dict):
        raise _Corrupt("payload does not have the checkpoint structure")
    return step, obj["payload"]


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return " ".join(text.splitlines()[0].split()) if text else type(e).__name__


def read_checkpoint(path: str | Path) -> LoadedCheckpoint:
    """Read and verify one checkpoint file; CheckpointError if it is corrupt or unreadable."""
    path = Path(path)
    try:
        step, payload = _read(path)
    except _Corrupt as e:
        raise CheckpointError(f"checkpoint {path} is corrupt: {e}") from None
    return LoadedCheckpoint(path=path, step=step, payload=payload)


def _clean_temp_files(directory: Path) -> None:
    try:
        leftovers = list(directory.glob(f"{_TMP_PREFIX}*{_TMP_SUFFIX}"))
    except OSError as e:
        raise CheckpointError(f"cannot list checkpoint directory {directory}: {e.strerror or e}") from None
    for p in leftovers:
        try:
            p.unlink()
            logger.info("removed leftover temporary checkpoint file %s", p)
        except OSError as e:
            logger.warning("could not remove leftover temporary file %s: %s", p, e.strerror or e)


def load_latest_checkpoint(directory: str | Path) -> LoadedCheckpoint | None:
    """The newest checkpoint in ``directory`` that verifies, or None if there is none at all.

    Corrupt or truncated newer files are skipped with a warning and listed in ``skipped``;
    leftover temporary files of interrupted saves are removed. CheckpointError if ``directory`` is a
    file, or if checkpoint files exist but none of them is readable.
    """
    directory = Path(directory).expanduser()
    if not _check_directory(directory, create=False):
        return None
    _clean_temp_files(directory)
    candidates = list_checkpoints(directory)
    skipped: list[tuple[Path, str]] = []
    for _, path in reversed(candidates):
        try:
            step, payload = _read(path)
        except _Corrupt as e:
            logger.warning("checkpoint %s is corrupt (%s); falling back to the previous one", path, e)
            skipped.append((path, str(e)))
            continue
        logger.info("loaded checkpoint %s (step %d)", path, step)
        return LoadedCheckpoint(path=path, step=step, payload=payload, skipped=skipped)
    if skipped:
        newest, reason = skipped[0]
        raise CheckpointError(
            f"all {len(skipped)} checkpoint(s) in {directory} are corrupt (newest {newest.name}: {reason})"
        )
    return None
