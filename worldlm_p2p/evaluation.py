"""Perplexity and bits per byte of any Hugging Face causal LM on a federated corpus.

The model and its tokenizer are loaded only with ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` (local files, no remote code), so this works for a model written
by ``worldlm-export`` and for any other causal LM directory that has a tokenizer.

Method (the same as the peers' ``valid_loss``, :meth:`worldlm_p2p.train.LocalTrainer.evaluate`):

- the documents of a sub-corpus are its non-blank lines (:func:`~worldlm_p2p.train.data.load_texts`;
  without ``valid.txt`` the last 10% of ``train.txt`` is the validation split);
- each document is tokenised without special tokens and followed by the tokenizer's EOS token,
  all concatenated into one stream;
- the stream is cut into non-overlapping windows of ``seq_len + 1`` tokens
  (:func:`~worldlm_p2p.train.data.eval_batches`; at most ``max_tokens`` predicted tokens, 0 = all);
- ``loss`` is the mean cross-entropy in nats per predicted token, ``perplexity = exp(loss)`` and
  ``bits_per_byte = loss * stream_tokens / bytes / ln 2``, where ``bytes`` counts the UTF-8 bytes of
  the documents plus one per line break (for the byte tokenizer ``stream_tokens == bytes``).

A region's values are the **unweighted means over its sub-corpora** (as in ``worldlm-simulate``);
``overall`` weights every predicted token equally (``loss``, ``perplexity``) and every byte equally
(``bits_per_byte``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from worldlm_p2p.errors import ConfigError, DataError
from worldlm_p2p.train.corpus import list_corpus
from worldlm_p2p.train.data import eval_batches, load_texts
from worldlm_p2p.train.model import autocast_context, resolve_device

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_SEQ_LEN", "SPLITS", "EvalConfig", "CorpusScore", "corpus_leaves", "load_model",
           "document_stream", "score_stream", "evaluate"]

#: Default window length (capped by the model's ``max_position_embeddings``): the default
#: ``train.seq_len`` of a run, so that the figures compare with the peers' ``valid_loss``.
DEFAULT_SEQ_LEN = 128
SPLITS = ("valid", "train")
_ENCODE_CHUNK = 1024  # documents per tokenizer call


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalConfig:
    """What to evaluate: ``model`` (a Hugging Face model directory) on ``data`` (a federated
    corpus ``<region>/<sub_corpus>/``, one region directory, or one sub-corpus directory).
    ``seq_len`` 0: :data:`DEFAULT_SEQ_LEN`, at most the model's ``max_position_embeddings``."""

    model: str
    data: str
    split: str = "valid"
    seq_len: int = 0
    batch_size: int = 8
    max_tokens: int = 0
    device: str = "auto"

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ConfigError(f"--split: {self.split!r} is not one of {', '.join(SPLITS)}")
        if self.seq_len < 0:
            raise ConfigError(f"--seq-len must be a positive integer, got {self.seq_len}")
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size must be a positive integer, got {self.batch_size}")
        if self.max_tokens < 0:
            raise ConfigError(f"--max-tokens must be >= 0 (0 = all), got {self.max_tokens}")


@dataclass(frozen=True, kw_only=True, slots=True)
class CorpusScore:
    """One sub-corpus: ``tokens`` predicted tokens scored (``nats`` in all), out of a stream of
    ``stream_tokens`` tokens for ``bytes`` UTF-8 bytes of text (line breaks included)."""

    region: str
    tokens: int
    stream_tokens: int
    bytes: int
    nats: float

    @property
    def loss(self) -> float:
        return self.nats / self.tokens if self.tokens else math.nan

    @property
    def bytes_per_token(self) -> float:
        return self.bytes / self.stream_tokens if self.stream_tokens else math.nan

    def row(self) -> dict[str, Any]:
        loss = self.loss
        return dict(region=self.region, tokens=self.tokens, stream_tokens=self.stream_tokens, bytes=self.bytes,
                    loss=loss, perplexity=_exp(loss), bits_per_byte=loss / (math.log(2) * self.bytes_per_token)
                    if self.tokens else math.nan)


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


# ----------------------------------------------------------------------------------- data


def corpus_leaves(path: str | Path) -> dict[str, tuple[str, Path]]:
    """``"<region>/<sub_corpus>" -> (region, directory)`` for a federated corpus root, one region
    directory (``<sub_corpus>/train.txt``) or one sub-corpus directory (``train.txt``); a region
    or sub-corpus given alone is named after its directory (and its parent's). DataError otherwise."""
    root = Path(path).expanduser()
    if not root.exists():
        raise DataError(f"--data {root} does not exist")
    if not root.is_dir():
        raise DataError(f"--data {root} is not a directory (expected <region>/<sub_corpus>/train.txt)")
    root = root.resolve()
    if (root / "train.txt").is_file():
        region = root.parent.name or "corpus"
        return {f"{region}/{root.name}": (region, root)}
    subs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / "train.txt").is_file())
    if subs:
        return {f"{root.name}/{s.name}": (root.name, s) for s in subs}
    return {f"{region}/{s.name}": (region, s) for region, dirs in list_corpus(root).items() for s in dirs}


def document_stream(tokenizer: Any, documents: list[str]) -> tuple[torch.Tensor, int]:
    """``(stream, bytes)``: every document's token ids (no special tokens) followed by EOS, as one
    ``torch.long`` tensor, and the UTF-8 bytes of the documents plus one per line break."""
    eos = tokenizer.eos_token_id
    if eos is None:
        eos = tokenizer.sep_token_id
    if eos is None:
        raise ConfigError("the model's tokenizer defines no eos_token (nor sep_token) to end documents with")
    flat: list[int] = []
    for start in range(0, len(documents), _ENCODE_CHUNK):
        batch = tokenizer(documents[start:start + _ENCODE_CHUNK], add_special_tokens=False, verbose=False)
        for ids in batch["input_ids"]:
            flat.extend(ids)
            flat.append(int(eos))
    n_bytes = sum(len(d.encode("utf-8")) + 1 for d in documents)
    return torch.tensor(flat, dtype=torch.long), n_bytes


# ----------------------------------------------------------------------------------- model


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return " ".join(text.splitlines()[0].split())[:300] if text else type(e).__name__


def load_model(path: str | Path, *, device: torch.device) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a local Hugging Face model directory (fp32, eval mode, on
    ``device``). ConfigError, naming the directory, if either cannot be loaded."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worldlm_p2p.export import quiet_transformers

    path = Path(path).expanduser()
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is not a directory"
        raise ConfigError(f"--model {path} {what}")
    if not (path / "config.json").is_file():
        raise ConfigError(f"--model {path} is not a Hugging Face model directory (no config.json)")
    with quiet_transformers():
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as e:  # OSError, ValueError, KeyError... for a missing or broken tokenizer
            raise ConfigError(f"--model {path}: cannot load its tokenizer: {_first_line(e)}") from None
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32)
        except Exception as e:
            raise ConfigError(f"--model {path}: cannot load a causal language model: {_first_line(e)}") from None
    model.to(device)
    model.eval()
    return model, tokenizer


@torch.no_grad()
def score_stream(model: Any, tokens: torch.Tensor, *, seq_len: int, batch_size: int, max_tokens: int,
                 device: torch.device) -> tuple[float, int]:
    """``(nats, count)``: summed cross-entropy and number of predicted tokens over the
    :func:`~worldlm_p2p.train.data.eval_batches` windows of ``tokens`` (bf16 autocast on CUDA)."""
    total, count = 0.0, 0
    for x, y in eval_batches(tokens, seq_len=seq_len, batch_size=batch_size, max_tokens=max_tokens):
        x, y = x.to(device), y.to(device)
        with autocast_context(device):
            logits = model(input_ids=x).logits
        total += float(F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum"))
        count += y.numel()
    return total, count


def _mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def evaluate(config: EvalConfig) -> dict[str, Any]:
    """Evaluate ``config.model`` on every sub-corpus of ``config.data``; the result has the keys
    ``model``, ``split``, ``seq_len``, ``batch_size``, ``max_tokens``, ``device``, ``sub_corpora``
    (``"<region>/<sub>" -> {region, tokens, stream_tokens, bytes, loss, perplexity, bits_per_byte}``),
    ``regions`` (``region -> {sub_corpora, tokens, bytes, loss, perplexity, bits_per_byte}``, means
    over its sub-corpora) and ``overall`` (token- and byte-weighted). Values that are not finite
    (a sub-corpus without text in the split) are NaN."""
    leaves = corpus_leaves(config.data)  # bad data fails before the slow model load
    device = resolve_device(config.device)
    model, tokenizer = load_model(config.model, device=device)
    max_pos = getattr(model.config, "max_position_embeddings", None)
    seq_len = config.seq_len or (min(DEFAULT_SEQ_LEN, max_pos) if max_pos else DEFAULT_SEQ_LEN)
    if max_pos and seq_len > max_pos:
        raise ConfigError(f"--seq-len {seq_len} exceeds the model's max_position_embeddings {max_pos}")
    vocab = getattr(model.config, "vocab_size", None)
    scores: dict[str, CorpusScore] = {}
    for key, (region, leaf) in leaves.items():
        splits = load_texts(leaf)
        docs = splits.valid if config.split == "valid" else splits.train
        stream, n_bytes = document_stream(tokenizer, docs)
        if vocab and stream.numel() and int(stream.max()) >= vocab:
            raise ConfigError(f"--model {config.model}: its tokenizer produces id {int(stream.max())}, "
                              f"outside the model's vocabulary of {vocab}")
        nats, count = score_stream(model, stream, seq_len=seq_len, batch_size=config.batch_size,
                                   max_tokens=config.max_tokens, device=device)
        scores[key] = CorpusScore(region=region, tokens=count, stream_tokens=int(stream.numel()), bytes=n_bytes,
                                  nats=nats)
        if not count:
            logger.warning("%s: no %s text to evaluate", key, config.split)
        else:
            logger.info("%s: loss %.4f over %d tokens", key, scores[key].loss, count)
    sub_rows = {k: s.row() for k, s in scores.items()}
    regions: dict[str, dict[str, Any]] = {}
    for region in dict.fromkeys(s.region for s in scores.values()):
        rows = [r for r in sub_rows.values() if r["region"] == region]
        regions[region] = dict(sub_corpora=len(rows), tokens=sum(r["tokens"] for r in rows),
                               bytes=sum(r["bytes"] for r in rows),
                               **{k: _mean([r[k] for r in rows]) for k in ("loss", "perplexity", "bits_per_byte")})
    scored = [s for s in scores.values() if s.tokens]
    tokens = sum(s.tokens for s in scored)
    covered_bytes = sum(s.tokens * s.bytes_per_token for s in scored)
    loss = sum(s.nats for s in scored) / tokens if tokens else math.nan
    overall = dict(sub_corpora=len(scores), tokens=tokens, bytes=sum(s.bytes for s in scores.values()), loss=loss,
                   perplexity=_exp(loss),
                   bits_per_byte=sum(s.nats for s in scored) / (math.log(2) * covered_bytes) if tokens else math.nan)
    return dict(model=str(config.model), data=str(config.data), split=config.split, seq_len=seq_len,
                batch_size=config.batch_size, max_tokens=config.max_tokens, device=str(device),
                sub_corpora=sub_rows, regions=regions, overall=overall)
