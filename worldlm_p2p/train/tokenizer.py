"""Tokenizers with one small interface: ``encode``/``decode``/``encode_stream`` and the ids
``vocab_size``, ``bos_id``, ``eos_id``, ``pad_id``.

- :class:`ByteTokenizer`: UTF-8 bytes 0..255 plus BOS=256, EOS=257, PAD=258 (vocab 259). Any
  language, no files. Every text token is exactly one byte, so with one EOS standing for each
  line break, tokens == bytes and bits-per-byte = loss (nats/token) / ln 2.
- :class:`LocalHFTokenizer`: a Hugging Face tokenizer directory on local disk (never the hub).

:func:`load_tokenizer` builds one from a :class:`~worldlm_p2p.config.TokenizerSpec`;
:func:`hf_tokenizer` gives the equivalent standard Hugging Face tokenizer (for export).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from worldlm_p2p.config import TokenizerSpec
from worldlm_p2p.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["Tokenizer", "ByteTokenizer", "LocalHFTokenizer", "load_tokenizer", "hf_tokenizer"]


@runtime_checkable
class Tokenizer(Protocol):
    """What the training layer needs from a tokenizer."""

    vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without special tokens."""
        ...

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special tokens are dropped."""
        ...

    def encode_stream(self, documents: Sequence[str]) -> torch.Tensor:
        """One 1-D ``torch.long`` stream: each document's tokens followed by EOS."""
        ...


class ByteTokenizer:
    """UTF-8 byte tokenizer: ids 0..255 are bytes, then BOS, EOS, PAD."""

    vocab_size: int = 259
    bos_id: int = 256
    eos_id: int = 257
    pad_id: int = 258
    #: Every non-special token is exactly one UTF-8 byte.
    bytes_per_token: float = 1.0

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=259)"

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text`` (no BOS/EOS)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes back to text; special ids are ignored, invalid UTF-8 becomes U+FFFD."""
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def encode_stream(self, documents: Sequence[str]) -> torch.Tensor:
        """Concatenate documents, each followed by EOS, as one ``torch.long`` tensor (vectorised)."""
        encoded = [doc.encode("utf-8") for doc in documents]
        if not encoded:
            return torch.empty(0, dtype=torch.long)
        lengths = torch.tensor([len(e) + 1 for e in encoded], dtype=torch.long)
        total = int(lengths.sum())
        out = torch.empty(total, dtype=torch.long)
        is_eos = torch.zeros(total, dtype=torch.bool)
        is_eos[torch.cumsum(lengths, 0) - 1] = True
        out[is_eos] = self.eos_id
        blob = b"".join(encoded)
        if blob:
            out[~is_eos] = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(torch.long)
        return out


class LocalHFTokenizer:
    """A Hugging Face tokenizer loaded from a local directory (``local_files_only=True``)."""

    def __init__(self, *, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_dir():
            what = "does not exist" if not self.path.exists() else "is not a directory"
            raise ConfigError(f"tokenizer.path {self.path} {what}")
        try:
            from transformers import AutoTokenizer

            self._tok: Any = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        except Exception as e:  # transformers raises OSError, ValueError, KeyError... for bad dirs
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"tokenizer.path {self.path} is not a usable tokenizer directory: {reason}") from None
        eos = self._tok.eos_token_id
        if eos is None:
            eos = self._tok.sep_token_id
        if eos is None:
            raise ConfigError(f"tokenizer.path {self.path}: the tokenizer defines no eos_token (nor sep_token)")
        self.vocab_size: int = len(self._tok)
        self.eos_id: int = int(eos)
        self.bos_id: int | None = self._tok.bos_token_id
        pad = self._tok.pad_token_id
        self.pad_id: int = int(pad) if pad is not None else self.eos_id
        logger.debug("loaded tokenizer from %s (vocab %d, eos %d)", self.path, self.vocab_size, self.eos_id)

    @property
    def hf(self) -> Any:
        """The underlying ``transformers`` tokenizer."""
        return self._tok

    def __repr__(self) -> str:
        return f"LocalHFTokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size})"

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` with special tokens skipped."""
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=True))

    def encode_stream(self, documents: Sequence[str]) -> torch.Tensor:
        """Concatenate documents (batch-encoded), each followed by EOS, as one ``torch.long`` tensor."""
        if not documents:
            return torch.empty(0, dtype=torch.long)
        batch = self._tok(list(documents), add_special_tokens=False)["input_ids"]
        flat: list[int] = []
        for ids in batch:
            flat.extend(ids)
            flat.append(self.eos_id)
        return torch.tensor(flat, dtype=torch.long)


def load_tokenizer(spec: TokenizerSpec) -> ByteTokenizer | LocalHFTokenizer:
    """Build the tokenizer described by ``spec`` (``kind`` is ``"byte"`` or ``"local"``)."""
    if spec.kind == "byte":
        return ByteTokenizer()
    if spec.kind == "local":
        return LocalHFTokenizer(path=spec.path)
    raise ConfigError(f"tokenizer.kind: {spec.kind!r} is not 'byte' or 'local'")


#: Names of the byte tokenizer's special tokens in its Hugging Face form (ids 256, 257, 258).
BYTE_SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 byte values to printable unicode characters (the alphabet
    of the ``tokenizers`` ByteLevel pre-tokenizer and decoder)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]  # '!'..'~', then Latin-1
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _byte_hf_tokenizer(*, model_max_length: int | None) -> Any:
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RustTokenizer
    from transformers import PreTrainedTokenizerFast

    symbols = _bytes_to_unicode()
    # BPE without merges: every byte-level symbol is its own token, with id = the byte's value.
    backend = RustTokenizer(models.BPE(vocab={symbols[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BYTE_SPECIAL_TOKENS])
    bos, eos, pad = BYTE_SPECIAL_TOKENS
    ids = [backend.token_to_id(t) for t in BYTE_SPECIAL_TOKENS]
    if ids != [ByteTokenizer.bos_id, ByteTokenizer.eos_id, ByteTokenizer.pad_id]:  # pragma: no cover - a tokenizers change
        raise RuntimeError(f"byte tokenizer specials got ids {ids}, expected 256, 257, 258")
    kwargs: dict[str, Any] = {}
    if model_max_length:
        kwargs["model_max_length"] = int(model_max_length)
    # split_special_tokens: the text "</s>" is bytes, as for ByteTokenizer, never the EOS id
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos, pad_token=pad,
                                   split_special_tokens=True, clean_up_tokenization_spaces=False, **kwargs)


def hf_tokenizer(tok: ByteTokenizer | LocalHFTokenizer, *, model_max_length: int | None = None) -> Any:
    """A standard ``transformers`` fast tokenizer equivalent to ``tok``, for ``save_pretrained``.

    For :class:`LocalHFTokenizer`, its own Hugging Face tokenizer. For :class:`ByteTokenizer`, a
    byte-level BPE without merges built with ``tokenizers``: ids 0..255 are the UTF-8 bytes, then
    ``<s>`` (256), ``</s>`` (257) and ``<pad>`` (258); no normalizer, no prefix space, no
    post-processor, so ``encode(text, add_special_tokens=False) == ByteTokenizer().encode(text)``
    and decoding with ``skip_special_tokens=True`` equals :meth:`ByteTokenizer.decode`.
    ``model_max_length`` is recorded for the byte tokenizer only.
    """
    if isinstance(tok, LocalHFTokenizer):
        return tok.hf
    if isinstance(tok, ByteTokenizer):
        return _byte_hf_tokenizer(model_max_length=model_max_length)
    raise TypeError(f"hf_tokenizer: unsupported tokenizer {tok!r}")
