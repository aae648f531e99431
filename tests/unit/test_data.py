"""Data loading (every input format), tokenisation, batching and the bundled demo corpus."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from worldlm_p2p.errors import ConfigError, DataError
from worldlm_p2p.train.corpus import demo_data_dir, list_corpus, read_grouping
from worldlm_p2p.train.data import (
    TextSplits,
    eval_batches,
    hold_out_tune,
    load_texts,
    sample_batch,
    tokenize_splits,
)
from worldlm_p2p.train.tokenizer import ByteTokenizer

REPO = Path(__file__).resolve().parents[2]
DOCS = [f"sentence number {i}" for i in range(10)]


def _one_line_error(err: pytest.ExceptionInfo[DataError], path: Path) -> None:
    assert str(path) in str(err.value)
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------------- formats


def test_corpus_leaf_with_valid(tmp_path: Path) -> None:
    (tmp_path / "train.txt").write_bytes("first line\r\n\n  \nsecond é line\nthird".encode())
    (tmp_path / "valid.txt").write_text("held out\n", encoding="utf-8")
    splits = load_texts(tmp_path)
    assert splits.train == ["first line", "second é line", "third"]
    assert splits.valid == ["held out"]
    assert "corpus leaf" in splits.source


def test_corpus_leaf_without_valid_holds_out_last_tenth(tmp_path: Path) -> None:
    (tmp_path / "train.txt").write_text("\n".join(DOCS) + "\n", encoding="utf-8")
    splits = load_texts(tmp_path)
    assert splits.train == DOCS[:9]
    assert splits.valid == DOCS[9:]


def test_text_directory_recursive(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "a").mkdir()
    (tmp_path / "b" / "two.txt").write_text("\n".join(f"b{i}" for i in range(10)), encoding="utf-8")
    (tmp_path / "a" / "one.txt").write_text("\n".join(f"a{i}" for i in range(10)), encoding="utf-8")
    (tmp_path / "notes.md").write_text("ignored", encoding="utf-8")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "x.txt").write_text("ignored too", encoding="utf-8")
    splits = load_texts(tmp_path)
    everything = [f"a{i}" for i in range(10)] + [f"b{i}" for i in range(10)]
    assert splits.train == everything[:18]
    assert splits.valid == ["b8", "b9"]


def test_text_directory_uses_nested_valid_files(tmp_path: Path) -> None:
    for name in ("x", "y"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.txt").write_text(f"{name} train 1\n{name} train 2\n", encoding="utf-8")
        (tmp_path / name / "valid.txt").write_text(f"{name} valid\n", encoding="utf-8")
    splits = load_texts(tmp_path)
    assert splits.train == ["x train 1", "x train 2", "y train 1", "y train 2"]
    assert splits.valid == ["x valid", "y valid"]


def test_single_txt_file(tmp_path: Path) -> None:
    path = tmp_path / "data.txt"
    path.write_text("\n".join(DOCS), encoding="utf-8")
    splits = load_texts(path)
    assert (splits.train, splits.valid) == (DOCS[:9], DOCS[9:])


def test_saved_dataset_dict(tmp_path: Path) -> None:
    import datasets

    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": ["one", "", "two", None], "id": [1, 2, 3, 4]}),
            "validation": datasets.Dataset.from_dict({"text": ["three"], "id": [5]}),
        }
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    splits = load_texts(tmp_path / "dd")
    assert splits.train == ["one", "two"]
    assert splits.valid == ["three"]
    assert "saved dataset" in splits.source


def test_saved_dataset_dict_test_split_and_single_dataset(tmp_path: Path) -> None:
    import datasets

    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": ["a", "b"]}),
            "test": datasets.Dataset.from_dict({"text": ["c"]}),
        }
    ).save_to_disk(str(tmp_path / "dd"))
    assert load_texts(tmp_path / "dd").valid == ["c"]

    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "ds"))
    splits = load_texts(tmp_path / "ds")
    assert (splits.train, splits.valid) == (DOCS[:9], DOCS[9:])


def test_saved_dataset_without_train_split(tmp_path: Path) -> None:
    import datasets

    datasets.DatasetDict({"validation": datasets.Dataset.from_dict({"text": ["x"]})}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match="no 'train' split") as err:
        load_texts(tmp_path / "dd")
    _one_line_error(err, tmp_path / "dd")


def test_jsonl_file(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    rows = [{"text": d, "meta": i} for i, d in enumerate(DOCS)]
    rows.insert(3, {"text": "   ", "meta": -1})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    splits = load_texts(path)
    assert (splits.train, splits.valid) == (DOCS[:9], DOCS[9:])
    assert "json" in splits.source


def test_json_csv_parquet_files(tmp_path: Path) -> None:
    import pandas as pd

    multi = ["line one\nline two", "plain, with comma", "third"]
    (tmp_path / "d.json").write_text(json.dumps([{"text": t} for t in multi]), encoding="utf-8")
    pd.DataFrame({"text": multi, "n": [1, 2, 3]}).to_csv(tmp_path / "d.csv", index=False)
    pd.DataFrame({"text": multi}).to_parquet(tmp_path / "d.parquet")
    for name in ("d.json", "d.csv", "d.parquet"):
        splits = load_texts(tmp_path / name)
        assert splits.train == multi[:2], name  # a row is one document, inner newlines kept
        assert splits.valid == multi[2:], name


def test_missing_text_column(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text('{"content": "a"}\n{"content": "b"}\n', encoding="utf-8")
    with pytest.raises(DataError, match="has no 'text' column \\(columns: content\\)") as err:
        load_texts(path)
    _one_line_error(err, path)


def test_non_string_text_column(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": 1}\n{"text": 2}\n', encoding="utf-8")
    with pytest.raises(DataError, match="row 0 has a non-string 'text' \\(int\\)") as err:
        load_texts(path)
    _one_line_error(err, path)


def test_malformed_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "a"}\n{"text": oops\n', encoding="utf-8")
    with pytest.raises(DataError, match="cannot read json data file") as err:
        load_texts(path)
    _one_line_error(err, path)


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda p: p, "does not exist"),
        (lambda p: (p.mkdir(), p)[1], "no train.txt"),
        (lambda p: (p.mkdir(), (p / "train.txt").write_text("\n  \n\n"), p)[2], "no training text"),
        (lambda p: ((p.parent / "x.bin").write_bytes(b"abc"), p.parent / "x.bin")[1], "unsupported file type"),
        (lambda p: ((p.parent / "bad.txt").write_bytes(b"ok\n\xff\xfe\n"), p.parent / "bad.txt")[1], "not valid UTF-8"),
    ],
    ids=["missing", "empty-dir", "blank-lines", "unsupported", "bad-utf8"],
)
def test_bad_inputs(tmp_path: Path, setup, message: str) -> None:  # type: ignore[no-untyped-def]
    path = setup(tmp_path / "data")
    with pytest.raises(DataError, match=message) as err:
        load_texts(path)
    _one_line_error(err, path)


# ----------------------------------------------------------------------------------- tokens


def test_tokenize_splits_byte_counts(tmp_path: Path) -> None:
    from worldlm_p2p.train.data import TextSplits

    splits = TextSplits(train=["ab", "é"], valid=["c"], source="test")
    data = tokenize_splits(splits, ByteTokenizer())
    assert data.train.tolist() == [97, 98, 257, 0xC3, 0xA9, 257]
    assert data.valid.tolist() == [99, 257]
    assert (data.train_bytes, data.valid_bytes) == (6, 2)  # "ab\n" + "é\n" (é is 2 bytes)
    assert data.valid_bytes_per_token == 1.0
    with pytest.raises(DataError, match="fewer than train.seq_len \\+ 1 = 7"):
        tokenize_splits(splits, ByteTokenizer(), seq_len=6)
    assert tokenize_splits(splits, ByteTokenizer(), seq_len=5).train.numel() == 6


def test_sample_batch_windows_are_contiguous() -> None:
    tokens = torch.arange(1000)
    x, y = sample_batch(tokens, batch_size=16, seq_len=32, step=3, seed=11)
    assert x.shape == y.shape == (16, 32)
    assert torch.equal(y, x + 1)  # next-token targets
    assert torch.equal(x, x[:, :1] + torch.arange(32))  # each row is one window of the stream
    assert int(x.min()) >= 0 and int(y.max()) <= 999
    # a stream of exactly seq_len + 1 tokens has one possible window
    x1, y1 = sample_batch(torch.arange(9), batch_size=4, seq_len=8, step=0, seed=0)
    assert torch.equal(x1, torch.arange(8).expand(4, 8)) and torch.equal(y1, torch.arange(1, 9).expand(4, 8))
    with pytest.raises(DataError):
        sample_batch(torch.arange(8), batch_size=1, seq_len=8, step=0, seed=0)


def test_sample_batch_is_a_function_of_seed_and_step() -> None:
    tokens = torch.arange(5000)
    kw = dict(batch_size=8, seq_len=16)
    a = sample_batch(tokens, step=5, seed=1, **kw)[0]
    torch.manual_seed(999)
    torch.rand(100)  # disturbing the global RNG changes nothing
    b = sample_batch(tokens, step=5, seed=1, **kw)[0]
    assert torch.equal(a, b)
    assert not torch.equal(a, sample_batch(tokens, step=6, seed=1, **kw)[0])
    assert not torch.equal(a, sample_batch(tokens, step=5, seed=2, **kw)[0])


def test_resume_replays_the_same_batches() -> None:
    tokens = torch.arange(3000)
    kw = dict(batch_size=4, seq_len=8, seed=42)
    uninterrupted = [sample_batch(tokens, step=s, **kw)[0] for s in range(10)]
    # "restart" at step 6: nothing carried over but (seed, step)
    torch.manual_seed(0)
    resumed = [sample_batch(tokens, step=s, **kw)[0] for s in range(6, 10)]
    assert all(torch.equal(u, r) for u, r in zip(uninterrupted[6:], resumed, strict=True))
    assert len({tuple(b[:, 0].tolist()) for b in uninterrupted}) == 10  # batches differ between steps


def test_eval_batches_windows() -> None:
    tokens = torch.arange(23)
    batches = list(eval_batches(tokens, seq_len=5, batch_size=3, max_tokens=0))
    # (23 - 1) // 5 = 4 windows, batched 3 + 1
    assert [x.shape[0] for x, _ in batches] == [3, 1]
    xs = torch.cat([x for x, _ in batches])
    ys = torch.cat([y for _, y in batches])
    assert xs.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14], [15, 16, 17, 18, 19]]
    assert torch.equal(ys, xs + 1)
    limited = list(eval_batches(tokens, seq_len=5, batch_size=3, max_tokens=10))
    assert [x.tolist() for x, _ in limited] == [[[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]]
    tiny = list(eval_batches(tokens, seq_len=5, batch_size=3, max_tokens=3))
    assert [(x.tolist(), y.tolist()) for x, y in tiny] == [([[0, 1, 2]], [[1, 2, 3]])]
    assert sum(y.numel() for _, y in eval_batches(tokens, seq_len=5, batch_size=3, max_tokens=14)) == 10
    short = list(eval_batches(torch.arange(4), seq_len=5, batch_size=2, max_tokens=0))
    assert [(x.tolist(), y.tolist()) for x, y in short] == [([[0, 1, 2]], [[1, 2, 3]])]
    short = list(eval_batches(torch.arange(4), seq_len=5, batch_size=2, max_tokens=2))
    assert [(x.tolist(), y.tolist()) for x, y in short] == [([[0, 1]], [[1, 2]])]
    assert list(eval_batches(torch.arange(1), seq_len=5, batch_size=2, max_tokens=0)) == []
    again = list(eval_batches(tokens, seq_len=5, batch_size=3, max_tokens=0))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again, strict=True))


# ----------------------------------------------------------------------------------- corpus


def _count_lines(path: Path) -> int:
    return sum(1 for line in path.read_text(encoding="utf-8").split("\n") if line.strip())


def test_demo_data_layout_and_size() -> None:
    root = demo_data_dir()
    layout = list_corpus(root)
    assert sorted(layout) == ["asia", "eu", "na"]
    assert [len(layout[r]) for r in ("eu", "na", "asia")] == [6, 7, 5]
    names = {p.name for subs in layout.values() for p in subs}
    assert "ko_news-fiction-academic" in names and "en_news-wiki" in names
    total = 0
    readme = (root / "README.md").read_text(encoding="utf-8")
    for subs in layout.values():
        for sub in subs:
            train, valid = sub / "train.txt", sub / "valid.txt"
            assert 0 < train.stat().st_size <= 120_000
            assert 0 < valid.stat().st_size <= 25_000
            total += train.stat().st_size + valid.stat().st_size
            assert f"`{sub.name}`" in readme
            assert f"| {_count_lines(train)} |" in readme
    assert total < 5_000_000
    assert "CC BY-SA 3.0" in readme and "CC BY-SA 4.0" in readme and "truncated to the first" in readme


def test_demo_leaf_loads() -> None:
    leaf = demo_data_dir() / "eu" / "it_parliament"
    splits = load_texts(leaf)
    assert len(splits.train) == _count_lines(leaf / "train.txt")
    assert len(splits.valid) == _count_lines(leaf / "valid.txt")
    data = tokenize_splits(splits, ByteTokenizer(), seq_len=128)
    assert data.train.numel() == data.train_bytes == (leaf / "train.txt").stat().st_size


def test_list_corpus_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        list_corpus(tmp_path / "none")
    (tmp_path / "README.md").write_text("x", encoding="utf-8")
    with pytest.raises(DataError, match="no region directories"):
        list_corpus(tmp_path)
    (tmp_path / "eu" / "de").mkdir(parents=True)
    with pytest.raises(DataError, match="has no train.txt") as err:
        list_corpus(tmp_path)
    _one_line_error(err, tmp_path / "eu" / "de")
    (tmp_path / "eu" / "de" / "train.txt").write_text("x\n", encoding="utf-8")
    (tmp_path / "eu" / "fr").mkdir()
    (tmp_path / "eu" / "fr" / "train.txt").write_text("y\n", encoding="utf-8")
    assert list_corpus(tmp_path) == {"eu": [tmp_path / "eu" / "de", tmp_path / "eu" / "fr"]}
    (tmp_path / "bad.region").mkdir()
    with pytest.raises(DataError, match="not a valid region name"):
        list_corpus(tmp_path)
    (tmp_path / "bad.region").rmdir()
    # a letter outside ASCII: the message says which letters a region tag may use
    (tmp_path / "région").mkdir()
    with pytest.raises(DataError, match="not a valid region name \\(1-64 ASCII letters") as err:
        list_corpus(tmp_path)
    _one_line_error(err, tmp_path)
    assert "'région'" in str(err.value)


def test_make_demo_data_script(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("make_demo_data", REPO / "scripts" / "make_demo_data.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    corpus = tmp_path / "corpus"
    leaf = corpus / "eu" / "xx_test"
    leaf.mkdir(parents=True)
    line = "x" * 99  # 100 bytes with its newline
    (leaf / "train.txt").write_text("\n".join([line] * 2000) + "\n", encoding="utf-8")
    (leaf / "valid.txt").write_text("short\n", encoding="utf-8")
    entry = {
        "region": "eu", "name": "xx_test", "lang": "Test", "repo": "Org/UD_Test", "url": "https://example.org/UD_Test",
        "commit": "0123456789abcdef", "licence": "CC BY-SA 4.0", "licence_url": "https://creativecommons.org/licenses/by-sa/4.0/",
        "contributors": "Someone", "note": "",
    }
    (corpus / "manifest.json").write_text(json.dumps({"subcorpora": [entry]}), encoding="utf-8")
    assert module.main([str(corpus), str(tmp_path / "out")]) == 0
    out = tmp_path / "out" / "eu" / "xx_test"
    assert (out / "train.txt").read_text(encoding="utf-8") == (line + "\n") * 1200  # 120_000 // 100 lines
    assert (out / "valid.txt").read_text(encoding="utf-8") == "short\n"
    readme = (tmp_path / "out" / "README.md").read_text(encoding="utf-8")
    assert "truncated to the first 1200 lines (of 2000)" in readme and "Org/UD_Test" in readme


# ----------------------------------------------------------------------------------- tune slice


def _stream(docs: list[str]):
    return tokenize_splits(TextSplits(train=docs, valid=["v"], source="test"), ByteTokenizer())


def test_hold_out_tune_takes_the_tail_at_a_document_boundary() -> None:
    docs = [f"document {i:03d} " + "x" * 40 for i in range(100)]  # 53 bytes + EOS each: 5400 tokens
    data = _stream(docs)
    tok = ByteTokenizer()
    out = hold_out_tune(data, fraction=0.05, max_tokens=10_000, seq_len=16, eos_id=tok.eos_id)
    # 5% of 5400 = 270 tokens asked; the slice starts after the first EOS in the first half of the tail
    assert out.train.numel() + out.tune.numel() == data.train.numel()
    assert torch.equal(torch.cat([out.train, out.tune]), data.train)
    assert int(out.train[-1]) == tok.eos_id  # no document is split between the two
    assert out.tune.numel() == 270 - 54  # the 4 last whole documents
    assert out.valid is data.valid and out.train_bytes == data.train_bytes
    # capped by max_tokens, and at least one window
    assert hold_out_tune(data, fraction=0.5, max_tokens=100, seq_len=16, eos_id=tok.eos_id).tune.numel() <= 100
    assert hold_out_tune(data, fraction=0.001, max_tokens=100, seq_len=16, eos_id=tok.eos_id).tune.numel() >= 17 - 8


def test_hold_out_tune_in_pieces_spread_over_the_text() -> None:
    from dataclasses import replace

    data = replace(_stream(["x"]), train=torch.arange(100))
    # 20% of 100 = 20 tokens in 2 pieces of 10: the tail of each half of the stream
    out = hold_out_tune(data, fraction=0.2, max_tokens=1000, seq_len=4, pieces=2)
    assert out.tune.tolist() == list(range(40, 50)) + list(range(90, 100))
    assert out.train.tolist() == list(range(40)) + list(range(50, 90))
    # a piece starts after a document boundary in its first half (42 plays the EOS here)
    out = hold_out_tune(data, fraction=0.2, max_tokens=1000, seq_len=4, pieces=2, eos_id=42)
    assert out.tune.tolist() == list(range(43, 50)) + list(range(90, 100))
    assert out.train.tolist() == list(range(43)) + list(range(50, 90))
    # no more pieces than windows of seq_len + 1 fit in the slice: 20 tokens hold one window of 17
    one = hold_out_tune(data, fraction=0.2, max_tokens=1000, seq_len=16, pieces=8)
    assert one.tune.tolist() == list(range(80, 100))
    # one piece is the tail, as before
    assert torch.equal(hold_out_tune(data, fraction=0.2, max_tokens=1000, seq_len=4, pieces=1).tune, torch.arange(80, 100))


def test_hold_out_tune_leaves_tiny_data_alone(caplog) -> None:
    data = _stream(["short"])
    out = hold_out_tune(data, fraction=0.05, max_tokens=2048, seq_len=16, eos_id=257)
    assert out is data and out.tune.numel() == 0
    assert "too short to hold a tune slice apart" in caplog.text
    with pytest.raises(ConfigError, match="fraction"):
        hold_out_tune(data, fraction=1.5, max_tokens=10, seq_len=16)
    with pytest.raises(ConfigError, match="pieces"):
        hold_out_tune(data, fraction=0.5, max_tokens=10, seq_len=16, pieces=0)


def _grouping(tmp_path: Path, text: str) -> Path:
    for sub in ("eu/de", "na/en", "asia/ja"):
        (tmp_path / "corpus" / sub).mkdir(parents=True, exist_ok=True)
        (tmp_path / "corpus" / sub / "train.txt").write_text("x\n", encoding="utf-8")
    path = tmp_path / "groups" / "g.toml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_grouping_file_regroups_a_corpus_by_reference(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("WORLDLM_CORPUS_ROOT", raising=False)
    path = _grouping(tmp_path, 'root = "../corpus"\n[regions]\nwest = ["na/en", "eu/de"]\neast = ["asia/ja"]\n')
    root = (tmp_path / "corpus").resolve()
    want = {"east": [root / "asia" / "ja"], "west": [root / "na" / "en", root / "eu" / "de"]}
    assert list_corpus(path) == read_grouping(path) == want
    assert list(list_corpus(path)) == ["east", "west"]
    # the corpus root can be moved: the environment or the caller says where it is
    moved = tmp_path / "elsewhere"
    (tmp_path / "corpus").rename(moved)
    with pytest.raises(DataError, match="is not a directory"):
        read_grouping(path)
    monkeypatch.setenv("WORLDLM_CORPUS_ROOT", str(moved))
    assert read_grouping(path)["east"] == [moved.resolve() / "asia" / "ja"]
    assert read_grouping(path, root=moved)["west"][1] == moved.resolve() / "eu" / "de"


@pytest.mark.parametrize("text, message", [
    ('root = "../corpus"\n', "no \\[regions\\] table"),
    ('[regions]\neu = ["eu/de"]\n', "names no corpus root"),
    ('root = "../corpus"\n[regions]\neu = ["eu/fr"]\n', "eu/fr has no train.txt"),
    ('root = "../corpus"\n[regions]\neu = ["eu/de"]\nna = ["eu/de"]\n', "appears twice"),
    ('root = "../corpus"\n[regions]\n"bad.name" = ["eu/de"]\n', "not a valid region name"),
    ('root = "../corpus"\n[regions]\neu = []\n', "one or more sub-corpus paths"),
    ('root = "../corpus\n', "not valid TOML"),
])
def test_grouping_file_errors_say_why(tmp_path: Path, monkeypatch, text: str, message: str) -> None:
    monkeypatch.delenv("WORLDLM_CORPUS_ROOT", raising=False)
    path = _grouping(tmp_path, text)
    with pytest.raises(DataError, match=message) as err:
        list_corpus(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_the_benchmark_groupings_are_valid() -> None:
    corpus = REPO.parent / "shared" / "data" / "corpus"
    if not corpus.is_dir():
        pytest.skip("../shared/data/corpus is not on this machine")
    sizes = {}
    for path in sorted((REPO / "benchmarks" / "corpora").glob("*.toml")):
        layout = read_grouping(path, root=corpus)
        sizes[path.stem] = sorted(len(v) for v in layout.values())
    assert sizes == {"mixed": [1, 1, 1, 4], "random": [2, 3, 4], "related": [1, 2, 2], "scripts": [1, 1, 1, 1],
                     "today": [5, 6, 7], "holdout": [2, 3, 3, 4]}
