"""Tokenizers: the byte tokenizer against hand-computed UTF-8, and a local Hugging Face directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from worldlm_p2p.config import TokenizerSpec
from worldlm_p2p.errors import ConfigError
from worldlm_p2p.train.tokenizer import ByteTokenizer, LocalHFTokenizer, Tokenizer, load_tokenizer


def test_byte_tokenizer_ids() -> None:
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (259, 256, 257, 258)
    assert isinstance(tok, Tokenizer)


def test_byte_encode_is_utf8_without_specials() -> None:
    tok = ByteTokenizer()
    # h=0x68, é = U+00E9 = C3 A9, l=0x6C, o=0x6F
    assert tok.encode("hé lo") == [0x68, 0xC3, 0xA9, 0x20, 0x6C, 0x6F]
    # 日 = U+65E5 = E6 97 A5
    assert tok.encode("日") == [0xE6, 0x97, 0xA5]
    assert tok.encode("") == []


def test_byte_decode_ignores_specials_and_replaces_invalid() -> None:
    tok = ByteTokenizer()
    assert tok.decode([256, 0x68, 0x69, 257, 258]) == "hi"
    assert tok.decode([0xFF]) == "\ufffd"
    assert tok.decode(torch.tensor([0xE6, 0x97, 0xA5, 257])) == "日"
    text = "Grüße, 안녕하세요, Tiếng Việt, 中文"
    assert tok.decode(tok.encode(text)) == text


def test_byte_encode_stream_appends_eos_per_document() -> None:
    tok = ByteTokenizer()
    stream = tok.encode_stream(["ab", "é", ""])
    assert stream.dtype == torch.long
    assert stream.tolist() == [97, 98, 257, 0xC3, 0xA9, 257, 257]
    assert tok.encode_stream([]).numel() == 0


def test_load_tokenizer_byte() -> None:
    assert isinstance(load_tokenizer(TokenizerSpec()), ByteTokenizer)


def _make_hf_tokenizer(directory: Path) -> dict[str, int]:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "hello": 2, "world": 3, "peer": 4}
    raw = RawTokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="</s>")
    fast.save_pretrained(str(directory))
    return vocab


def test_local_hf_tokenizer(tmp_path: Path) -> None:
    vocab = _make_hf_tokenizer(tmp_path / "tok")
    tok = load_tokenizer(TokenizerSpec(kind="local", path=str(tmp_path / "tok")))
    assert isinstance(tok, LocalHFTokenizer)
    assert tok.vocab_size == len(vocab)
    assert tok.eos_id == 1
    assert tok.pad_id == 1  # falls back to EOS
    assert tok.encode("hello peer world") == [2, 4, 3]
    assert tok.encode("hello banana") == [2, 0]
    assert tok.decode([2, 1, 3]) == "hello world"
    assert tok.encode_stream(["hello", "world peer"]).tolist() == [2, 1, 3, 4, 1]


def test_local_hf_tokenizer_missing_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match="does not exist") as err:
        load_tokenizer(TokenizerSpec(kind="local", path=str(missing)))
    assert str(missing) in str(err.value)
    assert "\n" not in str(err.value)


def test_local_hf_tokenizer_invalid_directory(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text("{ not json", encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        LocalHFTokenizer(path=bad)
    assert str(bad) in str(err.value)
    assert "\n" not in str(err.value)
    a_file = tmp_path / "file.txt"
    a_file.write_text("x", encoding="utf-8")
    with pytest.raises(ConfigError, match="is not a directory"):
        LocalHFTokenizer(path=a_file)
