"""Text loading, tokenisation and batching.

- :func:`load_texts`: a data path -> :class:`TextSplits` (train / valid documents). Accepted:
  a corpus leaf directory (``train.txt`` [+ ``valid.txt``]), a directory of ``*.txt`` files, a
  ``datasets`` ``save_to_disk`` directory, or one ``.txt`` / ``.jsonl`` / ``.json`` / ``.csv`` /
  ``.parquet`` file (column ``text``).
- :func:`tokenize_splits`: documents -> :class:`TokenData` (1-D token streams, each document
  followed by EOS, plus UTF-8 byte counts for bits-per-byte).
- :func:`sample_batch`: random training windows, a pure function of ``(seed, step)``.
- :func:`eval_batches`: deterministic non-overlapping windows over the validation stream.
- :func:`demo_data_dir`, :func:`list_corpus`: the bundled demo corpus and the federated layout
  ``<region>/<sub_corpus>/{train.txt,valid.txt}``.

``datasets`` is imported only when a file or directory needs it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from worldlm_p2p.errors import ConfigError, DataError
from worldlm_p2p.train.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

__all__ = [
    "VALID_FRACTION",
    "TextSplits",
    "TokenData",
    "load_texts",
    "tokenize_splits",
    "batch_generator",
    "sample_batch",
    "eval_batches",
    "stream_summary",
    "check_stream_length",
    "hold_out_tune",
]

#: Share of documents held out (from the end) when a source has no validation split.
VALID_FRACTION = 0.1

_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
_VALID_SPLITS = ("validation", "valid", "test")


@dataclass(frozen=True, kw_only=True, slots=True)
class TextSplits:
    """Documents (non-blank lines, or rows of a dataset) of the train and validation splits."""

    train: list[str]
    valid: list[str]
    source: str  # how the data was read, e.g. "corpus leaf /data/eu/fi_mixed"


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenData:
    """Token streams (1-D ``torch.long``), each document followed by EOS.

    ``*_bytes`` count the UTF-8 bytes of the documents plus one per document for the line break that
    its EOS stands for; with the byte tokenizer, ``len(train) == train_bytes``.
    """

    train: torch.Tensor
    valid: torch.Tensor
    train_bytes: int
    valid_bytes: int
    #: training text held apart for evidence (never trained on, never the evaluation text): see
    #: :func:`hold_out_tune`; empty when none was taken
    tune: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    @property
    def valid_bytes_per_token(self) -> float:
        """Average UTF-8 bytes per validation token (for converting nats/token to bits/byte)."""
        return self.valid_bytes / max(1, int(self.valid.numel()))


# ----------------------------------------------------------------------------------- loading


def _read_lines(path: Path) -> list[str]:
    """Non-blank lines of a UTF-8 text file (line ends removed, text otherwise verbatim)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"data file {path} is not valid UTF-8 (byte {e.start})") from None
    except OSError as e:
        raise DataError(f"cannot read data file {path}: {e.strerror or e}") from None
    lines = (line.removesuffix("\r") for line in text.split("\n"))
    return [line for line in lines if line.strip()]


def _hold_out(docs: list[str]) -> tuple[list[str], list[str]]:
    """Split off the last :data:`VALID_FRACTION` of documents (at least one if there are two or more)."""
    if len(docs) < 2:
        return docs, []
    n_valid = max(1, int(len(docs) * VALID_FRACTION))
    return docs[:-n_valid], docs[-n_valid:]


def _finish(train: list[str], valid: list[str], *, source: str, path: Path) -> TextSplits:
    if not train:
        raise DataError(f"data path {path} contains no training text (no non-blank lines)")
    if not valid:
        logger.warning("data path %s has no validation text: evaluation will be skipped", path)
    logger.info("loaded %s: %d train / %d valid documents", source, len(train), len(valid))
    return TextSplits(train=train, valid=valid, source=source)


def _load_text_dir(path: Path) -> TextSplits:
    leaf_train = path / "train.txt"
    if leaf_train.is_file():
        train = _read_lines(leaf_train)
        leaf_valid = path / "valid.txt"
        if leaf_valid.is_file():
            return _finish(train, _read_lines(leaf_valid), source=f"corpus leaf {path}", path=path)
        train, valid = _hold_out(train)
        return _finish(train, valid, source=f"corpus leaf {path} (valid = last 10% of train)", path=path)

    files = sorted(p for p in path.rglob("*.txt") if p.is_file() and not _hidden(p, path))
    if not files:
        raise DataError(
            f"data path {path} has no train.txt, no *.txt files and is not a saved `datasets` directory"
        )
    train, valid = [], []
    for f in files:
        (valid if f.name == "valid.txt" else train).extend(_read_lines(f))
    if valid:
        return _finish(train, valid, source=f"text directory {path} ({len(files)} files)", path=path)
    train, valid = _hold_out(train)
    return _finish(train, valid, source=f"text directory {path} ({len(files)} files, valid = last 10%)", path=path)


def _hidden(p: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in p.relative_to(root).parts)


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[Any]:
    """Import ``datasets`` with its progress bars off, restoring the previous setting afterwards."""
    import datasets

    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield datasets
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def _column_text(ds: Any, *, path: Path, split: str | None) -> list[str]:
    names = list(ds.column_names)
    where = f"data path {path}" + (f" (split {split!r})" if split else "")
    if "text" not in names:
        raise DataError(f"{where} has no 'text' column (columns: {', '.join(names) or 'none'})")
    docs = []
    for i, value in enumerate(ds["text"]):
        if value is None:
            continue
        if not isinstance(value, str):
            raise DataError(f"{where}: row {i} has a non-string 'text' ({type(value).__name__})")
        if value.strip():
            docs.append(value)
    return docs


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    )


def _load_saved_dataset(path: Path) -> TextSplits:
    with _quiet_datasets() as datasets:
        try:
            loaded = datasets.load_from_disk(str(path))
        except Exception as e:  # datasets raises FileNotFoundError, ValueError, pyarrow errors...
            raise DataError(f"cannot read saved dataset {path}: {_first_line(e)}") from None
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise DataError(f"saved dataset {path} has no 'train' split (splits: {', '.join(loaded)})")
            train = _column_text(loaded["train"], path=path, split="train")
            for name in _VALID_SPLITS:
                if name in loaded:
                    valid = _column_text(loaded[name], path=path, split=name)
                    return _finish(train, valid, source=f"saved dataset {path} (train/{name})", path=path)
            train, valid = _hold_out(train)
            return _finish(train, valid, source=f"saved dataset {path} (valid = last 10% of train)", path=path)
        train, valid = _hold_out(_column_text(loaded, path=path, split=None))
        return _finish(train, valid, source=f"saved dataset {path} (valid = last 10%)", path=path)


def _load_table_file(path: Path, builder: str) -> TextSplits:
    import tempfile

    with _quiet_datasets() as datasets, tempfile.TemporaryDirectory(prefix="worldlm-ds-") as cache:
        # A throw-away cache: nothing is left in ~/.cache and a changed file is never served stale.
        try:
            ds = datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache)
        except Exception as e:  # parse errors surface as DatasetGenerationError, ArrowInvalid, ValueError...
            raise DataError(f"cannot read {builder} data file {path}: {_first_line(e)}") from None
        docs = _column_text(ds, path=path, split=None)
        del ds
    train, valid = _hold_out(docs)
    return _finish(train, valid, source=f"{builder} file {path} (valid = last 10%)", path=path)


def _first_line(e: BaseException) -> str:
    """The most specific message of an exception chain, on one line (datasets wraps parse errors)."""
    chain, seen = [], set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    for exc in reversed(chain):
        text = str(exc).strip()
        if text:
            return " ".join(text.splitlines()[0].split())[:300]
    return type(e).__name__


def load_texts(path: str | Path) -> TextSplits:
    """Read train/valid documents from ``path`` (see the module docstring for accepted layouts).

    Without an explicit validation split, the last 10% of documents are held out. Blank lines/rows
    are dropped. Raises :class:`~worldlm_p2p.errors.DataError` naming ``path`` when it is missing,
    empty, unreadable or lacks a ``text`` column.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise DataError(f"data path {path} does not exist")
    if path.is_dir():
        if _is_saved_dataset(path):
            return _load_saved_dataset(path)
        return _load_text_dir(path)
    suffix = path.suffix.lower()
    if suffix == ".txt":
        train, valid = _hold_out(_read_lines(path))
        return _finish(train, valid, source=f"text file {path} (valid = last 10%)", path=path)
    if suffix in _FILE_BUILDERS:
        return _load_table_file(path, _FILE_BUILDERS[suffix])
    raise DataError(
        f"data path {path}: unsupported file type {suffix or '(none)'!r} "
        "(use .txt, .jsonl, .json, .csv, .parquet or a directory)"
    )


# ----------------------------------------------------------------------------------- tokens


def tokenize_splits(splits: TextSplits, tokenizer: Tokenizer, *, seq_len: int | None = None) -> TokenData:
    """Tokenise both splits into streams (each document followed by EOS).

    With ``seq_len``, a train stream shorter than ``seq_len + 1`` tokens raises DataError.
    """
    train = tokenizer.encode_stream(splits.train)
    valid = tokenizer.encode_stream(splits.valid)
    data = TokenData(
        train=train,
        valid=valid,
        train_bytes=sum(len(d.encode("utf-8")) + 1 for d in splits.train),
        valid_bytes=sum(len(d.encode("utf-8")) + 1 for d in splits.valid),
    )
    if seq_len is not None:
        check_stream_length(train, seq_len, what=f"training data ({splits.source})")
    logger.info("tokenised %s: %d train / %d valid tokens", splits.source, train.numel(), valid.numel())
    return data


def hold_out_tune(data: TokenData, *, fraction: float, max_tokens: int, seq_len: int,
                  eos_id: int | None = None, pieces: int = 1) -> TokenData:
    """Move part of the training stream into ``data.tune``: ``fraction`` of its tokens, at most
    ``max_tokens`` and at least one window of ``seq_len + 1``. With ``pieces = 1`` it is the tail of
    the stream; with more, the stream is cut into ``pieces`` equal shares and the tail of each share
    (an equal part of the slice, at least one window) is taken, so that the slice samples the whole
    text (fewer pieces when the slice cannot hold one window per piece). Each piece starts after a
    document boundary (``eos_id``) when there is one in its first half (with one piece, no document
    is then split between the two; with more, a piece ends where its share does, which may be inside
    a document). The rest, in order, stays the training stream. When the stream is too short to
    leave two windows to train on, nothing is taken (``tune`` stays empty) and a warning says so."""
    if not 0 < fraction < 1 or max_tokens <= 0 or seq_len <= 0 or pieces <= 0:
        raise ConfigError(f"hold_out_tune: fraction {fraction} must lie in (0, 1), max_tokens {max_tokens}, "
                          f"seq_len {seq_len} and pieces {pieces} must be positive")
    n = int(data.train.numel())
    want = max(seq_len + 1, min(int(max_tokens), int(n * fraction)))
    if n - want < 2 * (seq_len + 1):
        logger.warning("training text of %d tokens is too short to hold a tune slice apart (needs %d): without "
                       "evidence this peer keeps its own model and takes nothing from its region or the world", n,
                       want + 2 * (seq_len + 1))
        return data
    pieces = max(1, min(int(pieces), want // (seq_len + 1)))
    length, share = want // pieces, n // pieces
    keep, tune = [], []
    for i in range(pieces):
        lo, end = i * share, (n if i == pieces - 1 else (i + 1) * share)
        start = end - (want if pieces == 1 else length)
        hits = (torch.nonzero(data.train[start:start + (end - start) // 2] == eos_id).flatten() if eos_id is not None
                else torch.zeros(0, dtype=torch.long))
        if hits.numel() and (end - (start + int(hits[0]) + 1)) >= seq_len + 1:
            start += int(hits[0]) + 1
        keep.append(data.train[lo:start])
        tune.append(data.train[start:end])
    return replace(data, train=torch.cat(keep).clone(), tune=torch.cat(tune).clone())


def check_stream_length(tokens: torch.Tensor, seq_len: int, *, what: str) -> None:
    """Raise DataError unless ``tokens`` is a 1-D stream of at least ``seq_len + 1`` tokens."""
    if seq_len <= 0:
        raise ConfigError(f"train.seq_len must be positive, got {seq_len}")
    if tokens.dim() != 1:
        raise DataError(f"{what}: expected a 1-D token stream, got shape {tuple(tokens.shape)}")
    if tokens.numel() < seq_len + 1:
        raise DataError(
            f"{what} has {tokens.numel()} tokens, fewer than train.seq_len + 1 = {seq_len + 1}"
        )


def batch_generator(*, seed: int, step: int) -> torch.Generator:
    """A CPU generator seeded from ``(seed, step)`` by hashing, so distinct pairs get unrelated streams."""
    digest = hashlib.sha256(f"worldlm-batch:{int(seed)}:{int(step)}".encode()).digest()
    g = torch.Generator(device="cpu")
    g.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return g


def peer_data_seed(seed: int, label: str) -> int:
    """The seed of a peer's batch stream: a function of the run seed and the peer's label (its
    sub-corpus name), so the swarm and the simulator draw the same batches for the same peer. The
    region plays no part: a peer trained alone draws the same batches whichever region it is in."""
    return zlib.crc32(f"{seed}/{label}".encode())


def sample_batch(
    tokens: torch.Tensor, *, batch_size: int, seq_len: int, step: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows of ``seq_len + 1`` tokens: inputs ``x`` and next-token targets ``y``
    (both ``[batch_size, seq_len]``, on the device of ``tokens``).

    The batch depends only on ``(tokens, batch_size, seq_len, seed, step)``: resuming at step ``s``
    replays exactly the batches an uninterrupted run would have drawn.
    """
    if batch_size <= 0:
        raise ConfigError(f"train.batch_size must be positive, got {batch_size}")
    check_stream_length(tokens, seq_len, what="training data")
    g = batch_generator(seed=seed, step=step)
    starts = torch.randint(0, tokens.numel() - seq_len, (batch_size,), generator=g)
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    windows = tokens[idx.to(tokens.device)]
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def eval_batches(
    tokens: torch.Tensor, *, seq_len: int, batch_size: int, max_tokens: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic non-overlapping windows over ``tokens`` in order, batched.

    Window ``i`` predicts tokens ``i*seq_len + 1 .. (i+1)*seq_len``; a trailing partial window is
    dropped. At most ``max_tokens`` targets are used (0 = all): whole windows, or one shorter window
    if ``max_tokens < seq_len``. A stream shorter than ``seq_len + 1`` (but of 2+ tokens) gives one
    shorter window over all of it.
    """
    if seq_len <= 0 or batch_size <= 0 or max_tokens < 0:
        raise ConfigError(
            f"eval_batches: seq_len ({seq_len}) and batch_size ({batch_size}) must be positive, "
            f"max_tokens ({max_tokens}) >= 0"
        )
    n = int(tokens.numel())
    if n < 2:
        return
    if n < seq_len + 1 or 0 < max_tokens < seq_len:
        length = min(n - 1, max_tokens or n - 1)
        yield tokens[None, :length].clone(), tokens[None, 1 : length + 1].clone()
        return
    n_windows = (n - 1) // seq_len
    if max_tokens:
        n_windows = min(n_windows, max_tokens // seq_len)
    offsets = torch.arange(seq_len + 1)
    for first in range(0, n_windows, batch_size):
        starts = torch.arange(first, min(first + batch_size, n_windows)) * seq_len
        windows = tokens[(starts[:, None] + offsets[None, :]).to(tokens.device)]
        yield windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def stream_summary(data: TokenData) -> dict[str, int]:
    """Small dict of sizes for logs and run summaries."""
    return {
        "train_tokens": int(data.train.numel()),
        "valid_tokens": int(data.valid.numel()),
        "train_bytes": data.train_bytes,
        "valid_bytes": data.valid_bytes,
    }
