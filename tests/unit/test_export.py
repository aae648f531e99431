"""worldlm-export and worldlm-eval: a peer checkpoint -> a Hugging Face directory that transformers
loads without worldlm-p2p (same logits), the byte tokenizer's HF twin, evaluation against the
trainer's own evaluate(), and bad input -> exit code 2 with one line on stderr."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from worldlm_p2p.checkpoint import save_checkpoint
from worldlm_p2p.cli import eval as eval_cli
from worldlm_p2p.cli import export as export_cli
from worldlm_p2p.config import RunManifest, TrainConfig
from worldlm_p2p.train import (LocalTrainer, build_model, demo_data_dir, get_flat_params, load_texts, set_params,
                               tokenize_splits)
from worldlm_p2p.train.tokenizer import ByteTokenizer, hf_tokenizer

DEMO = demo_data_dir()
LEAF = DEMO / "eu" / "fi_mixed"
MANIFEST_TOML = """\
run_id = "exp"
[model]
preset = "tiny"
[train]
batch_size = 4
seq_len = 64
warmup_steps = 0
lr = 0.01
eval_tokens = 2048
seed = {seed}
"""
TEXT = "  Hyvää päivää!\nこんにちは 世界, 你好, 안녕하세요 😀👍🏽 </s> <s>\ttab  end "
MULTILINGUAL = [
    "", " ", "  leading spaces", "trailing  ", "\n\nnewlines\r\n", "你好，世界。", "日本語のテキスト、カタカナ。",
    "한국어 문장입니다.", "Hyvää yötä, äiti ja Öljy", "emoji 😀👍🏽🇫🇮 family 👨‍👩‍👧", "</s><s><pad> literal",
    "mixed\tTabs and \u00a0nbsp and \u200bzero-width", "Ünïcödé ß ø å ŀ", TEXT,
]


def _manifest(seed: int = 0, strategy: str | None = None) -> RunManifest:
    import tomllib

    data = tomllib.loads(MANIFEST_TOML.format(seed=seed))
    if strategy:
        data["aggregation"] = {"strategy": strategy}
    return RunManifest.from_dict(data)


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """The CLIs route the root logger to the (captured) stdout: undo it after each test."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _payload(model: torch.nn.Module, trainer: LocalTrainer, anchor: list[torch.Tensor], manifest: RunManifest,
             *, step: int, old: bool = False) -> dict:
    """Exactly what ``Peer._checkpoint`` writes (``old``: without manifest, label and peer id)."""
    payload = dict(
        run_id=manifest.run_id, fingerprint=manifest.fingerprint(), region="eu",
        model={k: v.detach().to("cpu") for k, v in model.state_dict().items()},
        optimizer=trainer.state_dict(), anchor=anchor, momentum=None,
        stats=dict(step=step, tokens=step * 4 * 64, round=0, rounds_completed=0, rounds_failed=0, bytes_sent=0,
                   bytes_received=0, tokens_since_round=0, first_train_loss=5.5, world_round=-1,
                   world_rounds_led=0, world_rounds_adopted=0, rounds_since_world=0, bytes_sent_border=0,
                   last_train_loss=4.0, group_sizes=[], history=[]),
        manifest=manifest.to_dict(), label="eu-fi_mixed", peer_id="12D3KooWTestPeer",
    )
    if old:
        for key in ("manifest", "label", "peer_id"):
            del payload[key]
    return payload


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A peer that trained 4 steps on a demo sub-corpus; its anchor (region model) is the init."""
    root = tmp_path_factory.mktemp("ckpt")
    manifest = _manifest()
    tok = ByteTokenizer()
    data = tokenize_splits(load_texts(LEAF), tok)
    model = build_model(manifest.model, vocab_size=tok.vocab_size, seed=manifest.train.seed)
    anchor = get_flat_params(model)
    trainer = LocalTrainer(model=model, train=manifest.train, data=data, device=torch.device("cpu"), seed=1)
    for step in range(4):
        trainer.train_step(step)
    save_checkpoint(root / "peer", step=4, payload=_payload(model, trainer, anchor, manifest, step=4), keep=3)
    save_checkpoint(root / "old", step=4, payload=_payload(model, trainer, anchor, manifest, step=4, old=True),
                    keep=3)
    local = _manifest(strategy="local")
    save_checkpoint(root / "local", step=4, payload=_payload(model, trainer, anchor, local, step=4), keep=3)
    (root / "run.toml").write_text(MANIFEST_TOML.format(seed=0))
    (root / "other.toml").write_text(MANIFEST_TOML.format(seed=1))
    return dict(root=root, manifest=manifest, model=model, anchor=anchor, data=data)


def _run(main, argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    return int(exc.value.code or 0)


@pytest.fixture(scope="module")
def exports(ckpt: dict) -> dict[str, Path]:
    root: Path = ckpt["root"]
    out = {}
    for which in ("peer", "region"):
        out[which] = root / "exports" / which
        assert _run(export_cli.main, ["--checkpoint-dir", str(root / "peer"), "--out", str(out[which]),
                                      "--which", which]) == 0
    return out


def _reference_logits(ckpt: dict, ids: list[int], *, which: str) -> torch.Tensor:
    manifest = ckpt["manifest"]
    model = build_model(manifest.model, vocab_size=259, seed=123)
    model.load_state_dict(ckpt["model"].state_dict())
    if which == "region":
        set_params(model, ckpt["anchor"])
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits


# ----------------------------------------------------------------------------------- tokenizer


def test_hf_byte_tokenizer_equals_byte_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from worldlm_p2p.evaluation import document_stream

    tok = ByteTokenizer()
    hf_tokenizer(tok, model_max_length=256).save_pretrained(str(tmp_path))
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert (len(hf), hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (259, 256, 257, 258)
    for text in MULTILINGUAL:
        ids = hf.encode(text, add_special_tokens=False)
        assert ids == tok.encode(text), text
        assert hf(text)["input_ids"] == ids  # no BOS/EOS added by default either
        assert hf.decode(ids, skip_special_tokens=True) == text
        assert hf.decode([256, *ids, 257, 258], skip_special_tokens=True) == tok.decode([256, *ids, 257, 258])
    assert hf.decode([0xE4, 0x68], skip_special_tokens=True) == tok.decode([0xE4, 0x68])  # invalid UTF-8
    docs = [d for d in MULTILINGUAL if d.strip()]
    stream, n_bytes = document_stream(hf, docs)
    assert torch.equal(stream, tok.encode_stream(docs))
    assert n_bytes == stream.numel()


# ----------------------------------------------------------------------------------- export


_LOADER = textwrap.dedent("""
    import importlib.abc, json, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "worldlm_p2p" or name.startswith("worldlm_p2p."):
                raise ImportError("worldlm_p2p is blocked in this test")
            return None

    sys.meta_path.insert(0, Block())
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    text, out = sys.argv[1], sys.argv[2]
    result = {}
    for arg in sys.argv[3:]:
        which, directory = arg.split("=", 1)
        tok = AutoTokenizer.from_pretrained(directory)
        model = AutoModelForCausalLM.from_pretrained(directory).eval()
        ids = tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            result[which] = model(input_ids=torch.tensor([ids])).logits
        result[which + "_ids"] = ids
        result[which + "_decoded"] = tok.decode(ids, skip_special_tokens=True)
        result[which + "_eos"] = model.config.eos_token_id
    assert not any(m.startswith("worldlm_p2p") for m in sys.modules)
    torch.save(result, out)
""")


def test_export_loads_without_worldlm(ckpt: dict, exports: dict[str, Path], tmp_path: Path) -> None:
    script = tmp_path / "load.py"
    script.write_text(_LOADER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(script), TEXT, str(tmp_path / "logits.pt"),
                           *(f"{w}={exports[w]}" for w in ("peer", "region"))],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "logits.pt")
    ids = ByteTokenizer().encode(TEXT)
    for which in ("peer", "region"):
        assert got[f"{which}_ids"] == ids
        assert got[f"{which}_decoded"] == TEXT
        assert got[f"{which}_eos"] == 257
        torch.testing.assert_close(got[which], _reference_logits(ckpt, ids, which=which), atol=1e-5, rtol=0)
    assert not torch.allclose(got["peer"], got["region"], atol=1e-3)  # the anchor differs from the model

    info = json.loads((exports["region"] / "worldlm_export.json").read_text())
    assert info["which"] == "region" and info["region"] == "eu" and info["label"] == "eu-fi_mixed"
    assert (info["run_id"], info["fingerprint"], info["step"]) == ("exp", ckpt["manifest"].fingerprint(), 4)
    assert info["strategy"] == "worldlm" and info["peer_id"] == "12D3KooWTestPeer"
    assert info["key_layer_names"] == ["model.embed_tokens.weight"]  # the default K: the embeddings (tied head)
    assert info["source_checkpoint"].endswith("ckpt-000000004.pt")
    assert (exports["region"] / "model.safetensors").is_file()
    assert "Universal Dependencies" in (exports["region"] / "README.md").read_text()


def test_export_old_checkpoint_with_run_config_and_force(ckpt: dict, exports: dict[str, Path]) -> None:
    root: Path = ckpt["root"]
    out = exports["region"]
    before = (out / "model.safetensors").read_bytes()
    argv = ["--checkpoint", "ckpt-000000004.pt", "--checkpoint-dir", str(root / "old"), "--out", str(out),
            "--run-config", str(root / "run.toml"), "--which", "peer", "--force"]
    assert _run(export_cli.main, argv) == 0
    assert json.loads((out / "worldlm_export.json").read_text())["which"] == "peer"
    assert (out / "model.safetensors").read_bytes() != before
    assert sorted(p.name for p in out.parent.iterdir()) == ["peer", "region"]  # no temporary directory left
    # put the region export back for the other tests
    assert _run(export_cli.main, ["--checkpoint-dir", str(root / "peer"), "--out", str(out), "--force"]) == 0
    assert (out / "model.safetensors").read_bytes() == before


def test_export_local_hf_tokenizer(ckpt: dict, tmp_path: Path) -> None:
    """A run with ``tokenizer.kind = "local"``: the export carries that tokenizer."""
    from transformers import AutoTokenizer

    hf_tokenizer(ByteTokenizer()).save_pretrained(str(tmp_path / "tok"))
    manifest = RunManifest.from_dict({**ckpt["manifest"].to_dict(),
                                      "tokenizer": {"kind": "local", "path": str(tmp_path / "tok")}})
    trainer = LocalTrainer(model=ckpt["model"], train=manifest.train, data=ckpt["data"], device=torch.device("cpu"),
                           seed=0)
    save_checkpoint(tmp_path / "ckpt", step=4, keep=1,
                    payload=_payload(ckpt["model"], trainer, ckpt["anchor"], manifest, step=4))
    assert _run(export_cli.main, ["--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]) == 0
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert tok.encode(TEXT, add_special_tokens=False) == ByteTokenizer().encode(TEXT)
    info = json.loads((tmp_path / "out" / "worldlm_export.json").read_text())
    assert info["tokenizer"] == "local" and info["fingerprint"] == manifest.fingerprint()


# ----------------------------------------------------------------------------------- eval


def test_eval_matches_trainer_evaluate(ckpt: dict, exports: dict[str, Path], tmp_path: Path) -> None:
    seq_len, batch, max_tokens = 64, 4, 1024
    path = tmp_path / "eval.json"
    argv = ["--model", str(exports["peer"]), "--data", str(DEMO / "eu"), "--seq-len", str(seq_len), "--batch-size",
            str(batch), "--max-tokens", str(max_tokens), "--device", "cpu", "--threads", "1", "--json", str(path)]
    assert _run(eval_cli.main, argv) == 0
    res = json.loads(path.read_text())
    assert (res["split"], res["seq_len"]) == ("valid", seq_len)
    row = res["sub_corpora"]["eu/fi_mixed"]

    train = TrainConfig(batch_size=batch, seq_len=seq_len, eval_tokens=max_tokens)
    reference = LocalTrainer(model=ckpt["model"], train=train, data=ckpt["data"], device=torch.device("cpu"),
                             seed=0).evaluate()
    assert row["tokens"] == max_tokens and row["region"] == "eu"
    assert row["loss"] == pytest.approx(reference, abs=1e-5)
    assert row["stream_tokens"] == row["bytes"] == ckpt["data"].valid_bytes  # byte tokenizer: tokens == bytes
    assert row["bits_per_byte"] == pytest.approx(row["loss"] / math.log(2), rel=1e-12)
    assert row["perplexity"] == pytest.approx(math.exp(row["loss"]), rel=1e-12)

    subs = [r for r in res["sub_corpora"].values() if r["region"] == "eu"]
    assert len(subs) == len(list((DEMO / "eu").iterdir()))
    region = res["regions"]["eu"]
    assert region["loss"] == pytest.approx(sum(r["loss"] for r in subs) / len(subs))
    assert region["perplexity"] == pytest.approx(sum(r["perplexity"] for r in subs) / len(subs))
    overall = res["overall"]
    assert overall["tokens"] == sum(r["tokens"] for r in subs)
    assert overall["loss"] == pytest.approx(sum(r["loss"] * r["tokens"] for r in subs) / overall["tokens"])
    assert overall["bits_per_byte"] == pytest.approx(overall["loss"] / math.log(2))


# ----------------------------------------------------------------------------------- bad input


def _assert_one_line(capsys: pytest.CaptureFixture[str], prog: str, *needles: str) -> None:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{prog}: error: ") and "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_export_bad_input(ckpt: dict, exports: dict[str, Path], tmp_path: Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    root: Path = ckpt["root"]
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "ckpt-000000001.pt").write_bytes(b"WLMCKPT\x00garbage")
    new = str(tmp_path / "new")
    not_export = tmp_path / "notes"
    not_export.mkdir()
    (not_export / "notes.txt").write_text("keep me")
    cases = [
        (["--checkpoint-dir", str(tmp_path / "missing"), "--out", new], ["does not exist"]),
        (["--checkpoint-dir", str(corrupt), "--out", new], ["corrupt"]),
        (["--checkpoint", str(corrupt / "ckpt-000000001.pt"), "--out", new], ["corrupt", "truncated"]),
        (["--checkpoint-dir", str(root / "peer"), "--out", str(exports["peer"])], ["not empty", "--force"]),
        (["--checkpoint-dir", str(root / "peer"), "--out", str(not_export), "--force"], ["does not look like"]),
        (["--checkpoint-dir", str(root / "peer"), "--out", str(root / "peer"), "--force"], ["contains the checkpoint"]),
        (["--checkpoint-dir", str(root / "local"), "--out", new], ["local", "--which peer"]),
        (["--checkpoint-dir", str(root / "old"), "--out", new], ["--run-config"]),
        (["--checkpoint-dir", str(root / "old"), "--out", new, "--run-config", str(root / "other.toml")],
         ["fingerprint"]),
        (["--out", new], ["--checkpoint-dir"]),
        (["--checkpoint-dir", str(root / "peer"), "--out", new, "--which", "world"], ["--which"]),
    ]
    for argv, needles in cases:
        assert _run(export_cli.main, argv) == 2, argv
        _assert_one_line(capsys, "worldlm-export", *needles)
    assert not (tmp_path / "new").exists()
    assert (not_export / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corrupt", "notes"]  # no temporary directory left


def test_eval_bad_input(exports: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    not_model = tmp_path / "not_model"
    not_model.mkdir()
    (not_model / "config.json").write_text("{}")
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (["--model", str(tmp_path), "--data", str(LEAF)], ["not a Hugging Face model directory"]),
        (["--model", str(not_model), "--data", str(LEAF)], ["cannot load"]),
        (["--model", str(tmp_path / "missing"), "--data", str(LEAF)], ["does not exist"]),
        (["--model", str(exports["peer"]), "--data", str(tmp_path / "nodata")], ["nodata", "does not exist"]),
        (["--model", str(exports["peer"]), "--data", str(empty)], ["no region directories"]),
        (["--model", str(exports["peer"]), "--data", str(LEAF), "--seq-len", "0"], ["--seq-len"]),
        (["--model", str(exports["peer"]), "--data", str(LEAF), "--seq-len", "4096"], ["max_position_embeddings"]),
        (["--model", str(exports["peer"]), "--data", str(LEAF), "--split", "test"], ["--split"]),
    ]
    for argv, needles in cases:
        assert _run(eval_cli.main, argv) == 2, argv
        _assert_one_line(capsys, "worldlm-eval", *needles)


def test_exporting_a_region_model_that_never_trained_warns(ckpt: dict, caplog: pytest.LogCaptureFixture) -> None:
    from worldlm_p2p.checkpoint import load_latest_checkpoint
    from worldlm_p2p.export import checkpoint_model

    loaded = load_latest_checkpoint(ckpt["root"] / "peer")
    with caplog.at_level(logging.WARNING, logger="worldlm_p2p.export"):
        checkpoint_model(loaded, ckpt["manifest"], which="peer")
        assert "initial, untrained model" not in caplog.text  # the peer's own model trained 4 steps
        checkpoint_model(loaded, ckpt["manifest"], which="region")  # its anchor is the init
    assert "initial, untrained model" in caplog.text and "--which peer" in caplog.text
