"""Export a model from a peer checkpoint as a standard Hugging Face model directory.

A peer checkpoint (:mod:`worldlm_p2p.checkpoint`, written by ``Peer._checkpoint``) holds two models:

- ``which="region"`` (default): the region's **agreed model**, the result of the region's last
  round (the shared backbone B and the region's key layers K; the ``anchor`` of the payload).
  With ``fedavg`` and ``hierfavg`` it is the whole run's (resp. the region's) mean model; with
  ``fedper``, B with this peer's own K. ``local`` has no region model.
- ``which="peer"``: the peer's own model (its personal mix, plus the local steps made since its
  last round): with a separate personal model (``aggregation.personal_model = "separate"``, the
  default) that personal model, which never left the peer.

:func:`export_model` writes ``model.safetensors`` and ``config.json`` (``save_pretrained``), the
tokenizer (for the byte tokenizer an equivalent ``tokenizers`` fast tokenizer, see
:func:`worldlm_p2p.train.tokenizer.hf_tokenizer`), ``worldlm_export.json`` (where it came from) and a
short ``README.md`` model card. ``AutoModelForCausalLM.from_pretrained(out)`` and
``AutoTokenizer.from_pretrained(out)`` load it without this package.

Nothing is lost on failure: the export is written to a temporary sibling directory and renamed into
place; an existing non-empty ``out`` is replaced only with ``force`` (by an atomic exchange where the
OS supports it).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from worldlm_p2p import __version__
from worldlm_p2p.checkpoint import LoadedCheckpoint, fsync_dir, load_latest_checkpoint, read_checkpoint
from worldlm_p2p.config import RunManifest
from worldlm_p2p.codec import PeerCheckpoint, StateError
from worldlm_p2p.errors import CheckpointError, ConfigError

logger = logging.getLogger(__name__)

__all__ = ["WHICH", "EXPORT_INFO", "ExportConfig", "ExportResult", "find_checkpoint", "checkpoint_manifest",
           "checkpoint_model", "export_model", "quiet_transformers"]

WHICH = ("region", "peer")
#: Name of the provenance file written next to the model.
EXPORT_INFO = "worldlm_export.json"
_MARKERS = ("config.json", EXPORT_INFO)  # an existing --out must hold one of these to be replaced


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportConfig:
    """What to export and where.

    ``checkpoint`` names one checkpoint file (relative names are also looked up in
    ``checkpoint_dir``); without it, the newest valid checkpoint of ``checkpoint_dir`` is used.
    ``run_config`` is the run manifest (TOML) for checkpoints written before manifests were stored
    in them; its fingerprint must equal the checkpoint's.
    """

    out: str
    checkpoint_dir: str | None = None
    checkpoint: str | None = None
    which: str = "region"
    run_config: str | None = None
    force: bool = False

    def __post_init__(self) -> None:
        if self.which not in WHICH:
            raise ConfigError(f"--which: {self.which!r} is not one of {', '.join(WHICH)}")
        if not self.out:
            raise ConfigError("--out: an output directory is required")
        if not self.checkpoint_dir and not self.checkpoint:
            raise ConfigError("give --checkpoint-dir DIR (the newest checkpoint in it) or --checkpoint FILE")


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportResult:
    """The exported directory and the contents of its ``worldlm_export.json``."""

    out: Path
    info: dict[str, Any]


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Switch ``transformers``' progress bars off (they write to stderr), restoring them afterwards."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


# ----------------------------------------------------------------------------------- reading


def find_checkpoint(config: ExportConfig) -> LoadedCheckpoint:
    """The checkpoint ``config`` names: ``checkpoint`` if given, else the newest valid one of
    ``checkpoint_dir``. CheckpointError if there is none or it is corrupt."""
    directory = Path(config.checkpoint_dir).expanduser() if config.checkpoint_dir else None
    if config.checkpoint:
        path = Path(config.checkpoint).expanduser()
        if not path.exists() and directory is not None and not path.is_absolute():
            path = directory / path
        if not path.exists():
            raise CheckpointError(f"checkpoint file {config.checkpoint} does not exist")
        if not path.is_file():
            raise CheckpointError(f"checkpoint {path} is not a file")
        return read_checkpoint(path)
    assert directory is not None
    if not directory.exists():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    loaded = load_latest_checkpoint(directory)
    if loaded is None:
        raise CheckpointError(f"checkpoint directory {directory} holds no checkpoint (ckpt-*.pt)")
    for path, why in loaded.skipped:
        logger.warning("skipped corrupt checkpoint %s (%s); exporting %s", path, why, loaded.path)
    return loaded


def _check_payload(loaded: LoadedCheckpoint) -> PeerCheckpoint:
    try:
        return PeerCheckpoint.from_payload(loaded.payload)
    except StateError as e:
        raise CheckpointError(f"checkpoint {loaded.path} {e}") from None


def checkpoint_manifest(loaded: LoadedCheckpoint, *, run_config: str | None = None) -> RunManifest:
    """The run manifest of a checkpoint: the one stored in it, or (older checkpoints) the one of
    ``run_config``, whose fingerprint must equal the checkpoint's. A given ``run_config`` must
    match a stored manifest too."""
    p = _check_payload(loaded)
    fingerprint = p.fingerprint
    manifest = None
    if p.manifest is not None:
        try:
            manifest = RunManifest.from_dict(p.manifest)
        except ConfigError as e:
            raise CheckpointError(f"checkpoint {loaded.path} holds an invalid run manifest: {e}") from None
        if manifest.fingerprint() != fingerprint:
            raise CheckpointError(f"checkpoint {loaded.path}: its stored manifest has fingerprint "
                                  f"{manifest.fingerprint()}, not the checkpoint's {fingerprint}")
    if run_config:
        given = RunManifest.from_toml(run_config)
        if given.fingerprint() != fingerprint:
            raise ConfigError(f"--run-config {run_config} is not the manifest of checkpoint {loaded.path} "
                              f"(fingerprint {given.fingerprint()}, checkpoint {fingerprint})")
        manifest = manifest or given
    if manifest is None:
        raise ConfigError(f"checkpoint {loaded.path} does not contain its run manifest (an older checkpoint): "
                          "give the run's manifest with --run-config TOML")
    return manifest


def _is_initial(model, anchor) -> bool:
    """Whether ``anchor`` is exactly the parameters ``model`` was built with."""
    import torch

    params = [p.detach() for p in model.parameters()]
    return len(params) == len(anchor) and all(isinstance(a, torch.Tensor) and a.shape == p.shape and torch.equal(a, p)
                                              for a, p in zip(anchor, params))


def checkpoint_model(loaded: LoadedCheckpoint, manifest: RunManifest, *, which: str) -> tuple[Any, Any]:
    """``(model, tokenizer)``: the ``transformers`` model (CPU, eval mode) holding the ``which``
    model of the checkpoint, with the token ids of ``tokenizer`` in its config, and the run's
    tokenizer (:func:`~worldlm_p2p.train.tokenizer.load_tokenizer`)."""
    from worldlm_p2p.strategies import strategy as strategy_of
    from worldlm_p2p.train.model import build_model
    from worldlm_p2p.train.tokenizer import load_tokenizer
    from worldlm_p2p.train.trainer import set_params

    if which not in WHICH:
        raise ConfigError(f"--which: {which!r} is not one of {', '.join(WHICH)}")
    p = _check_payload(loaded)
    strategy = strategy_of(manifest.aggregation.strategy)
    if which == "region" and not strategy.averages:
        raise ConfigError(f"checkpoint {loaded.path} comes from a run with strategy '{strategy.name}', which has no "
                          "region model: export the peer's own model with --which peer")
    tokenizer = load_tokenizer(manifest.tokenizer)
    model = build_model(manifest.model, vocab_size=tokenizer.vocab_size, seed=manifest.train.seed)
    if which == "region" and _is_initial(model, p.anchor):
        logger.warning("checkpoint %s: the region model this peer holds is the run's initial, untrained model (it "
                       "never averaged with its region); export its own model with --which peer", loaded.path)
    try:
        model.load_state_dict(p.personal if which == "peer" and p.personal is not None else p.model)
        if which == "region":
            set_params(model, p.anchor)
    except (RuntimeError, ValueError, TypeError) as e:
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        raise CheckpointError(f"checkpoint {loaded.path} does not fit the model of its manifest: {reason}") from None
    model.eval()
    # token ids for generate(), and its KV cache: neither changes the logits
    settings = dict(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id,
                    use_cache=True)
    for config in (model.config, getattr(model, "generation_config", None)):
        for key, value in settings.items():
            if config is not None:
                setattr(config, key, value)
    return model, tokenizer


# ----------------------------------------------------------------------------------- writing


def _check_out(out: Path, *, force: bool, source: Path) -> None:
    if out.is_symlink():
        raise ConfigError(f"--out {out} is a symbolic link: give the real directory")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a directory")
    src, dst = source.resolve(), out.resolve()
    if dst in src.parents:
        raise ConfigError(f"--out {out} contains the checkpoint {source}: choose another output directory")
    if out.is_dir():
        try:
            empty = not any(out.iterdir())
        except OSError as e:
            raise ConfigError(f"--out {out}: cannot list it: {e.strerror or e}") from None
        if not empty and not force:
            raise ConfigError(f"--out {out} exists and is not empty: use --force to replace it")
        if not empty and not any((out / m).is_file() for m in _MARKERS):
            raise ConfigError(f"--out {out} is not empty and does not look like a model export (no config.json): "
                              "refusing to replace it, even with --force")


def _finish_tree(root: Path) -> None:
    """Give the files and ``root`` the usual modes (mkdtemp makes 0700, some writers 0600) and fsync them."""
    umask = os.umask(0)
    os.umask(umask)
    for path in sorted(root.rglob("*"), reverse=True):
        if path.is_file():
            os.chmod(path, 0o666 & ~umask)
            with path.open("rb") as f:
                os.fsync(f.fileno())
    os.chmod(root, 0o777 & ~umask)
    fsync_dir(root)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False if unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _install(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` to ``out``; an existing ``out`` ends up deleted, never half-replaced."""
    if not out.exists():
        os.rename(tmp, out)
    elif not any(out.iterdir()):
        os.replace(tmp, out)  # POSIX rename replaces an empty directory
    elif _exchange(tmp, out):
        shutil.rmtree(tmp)  # tmp now holds the old export
    else:
        old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
        os.replace(out, old)  # onto the empty placeholder
        try:
            os.rename(tmp, out)
        except BaseException:
            os.replace(old, out)
            raise
        shutil.rmtree(old)
    fsync_dir(out.parent)


def _model_card(info: dict[str, Any]) -> str:
    what = (f"the agreed model of region `{info['region']}`" if info["which"] == "region"
            else f"the personal model of peer `{info['label'] or info['peer_id'] or '?'}` (region `{info['region']}`)")
    keys = ", ".join(f"`{n}`" for n in info["key_layer_names"]) or "none"
    return f"""---
library_name: transformers
pipeline_tag: text-generation
tags: [worldlm-p2p, federated-learning]
---

# WorldLM-P2P export: {info['run_id']} / {info['region']} ({info['which']})

This is {what} of the WorldLM-P2P run `{info['run_id']}` (manifest `{info['fingerprint']}`,
strategy `{info['strategy']}`), exported at local step {info['step']} ({info['tokens']} training
tokens of that peer) by worldlm-p2p {info['worldlm_version']}. It is a Llama-style causal LM
(`{info['model_preset']}` preset, {info['parameters']} parameters) with the `{info['tokenizer']}` tokenizer.
Key layers of its region ({info['key_layers']}): {keys}.

Load it with `transformers` alone:

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("path/to/this/dir")
tokenizer = AutoTokenizer.from_pretrained("path/to/this/dir")
ids = tokenizer("Hello", return_tensors="pt").input_ids
print(tokenizer.decode(model.generate(ids, max_new_tokens=40, do_sample=True)[0], skip_special_tokens=True))
```

It was trained on documents (lines), each followed by the EOS token, without BOS.
Evaluate it on a corpus with `worldlm-eval --model path/to/this/dir --data CORPUS_DIR`.
`{EXPORT_INFO}` records where it came from (run manifest, source checkpoint, peer, step).

**Training data and licence.** The checkpoint does not record which text the peer trained on. If
the run used the corpus bundled with worldlm-p2p (the default of `worldlm-swarm` and
`worldlm-simulate`), that text is taken from Universal Dependencies treebanks, redistributed under
CC BY-SA 4.0 (CC BY-SA 3.0 for UD_English-PUD); `worldlm_p2p/demo_data/README.md` lists the
sources, contributors and changes. No licence is stated here for the weights themselves.
"""


def _write(tmp: Path, model: Any, tokenizer: Any, info: dict[str, Any]) -> None:
    from worldlm_p2p.train.tokenizer import ByteTokenizer, hf_tokenizer

    model.save_pretrained(str(tmp))
    hf = hf_tokenizer(tokenizer, model_max_length=info["manifest"]["model"]["max_seq_len"])
    hf.save_pretrained(str(tmp))
    if isinstance(tokenizer, ByteTokenizer):
        # the class name every transformers version resolves (v5 alias of its TokenizersBackend)
        config_path = tmp / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (tmp / "README.md").write_text(_model_card(info), encoding="utf-8")


def export_model(config: ExportConfig) -> ExportResult:
    """Export the ``config.which`` model of a peer checkpoint to ``config.out`` (see the module
    docstring). Raises CheckpointError / ConfigError (one line) on bad input; ``out`` is left as it
    was on any failure."""
    from worldlm_p2p.split import split_parameters
    from worldlm_p2p.train.model import count_parameters

    out = Path(config.out).expanduser()
    loaded = find_checkpoint(config)
    _check_out(out, force=config.force, source=loaded.path)  # before the slow part, and again below
    manifest = checkpoint_manifest(loaded, run_config=config.run_config)
    model, tokenizer = checkpoint_model(loaded, manifest, which=config.which)
    p = _check_payload(loaded)
    stats = p.stats
    names = [n for n, _ in model.named_parameters()]
    try:
        key_names = list(split_parameters(names, manifest.aggregation.key_layers).key_names)
    except ValueError:
        key_names = []
    info: dict[str, Any] = dict(
        format=1, worldlm_version=__version__, which=config.which, run_id=manifest.run_id,
        fingerprint=manifest.fingerprint(), region=p.region, label=p.label, peer_id=p.peer_id,
        strategy=manifest.aggregation.strategy, step=int(stats.get("step", loaded.step)),
        tokens=int(stats.get("tokens", 0)), rounds_completed=stats.get("rounds_completed"),
        world_round=stats.get("world_round"), model_preset=manifest.model.preset,
        parameters=count_parameters(model), tokenizer=manifest.tokenizer.kind,
        key_layers=manifest.aggregation.key_layers, key_layer_names=key_names,
        train_seq_len=manifest.train.seq_len, source_checkpoint=str(loaded.path.resolve()),
        manifest=manifest.to_dict(),
    )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.export-"))
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot create a directory next to it: {e.strerror or e}") from None
    try:
        with torch.no_grad(), quiet_transformers():
            _write(tmp, model, tokenizer, info)
        _finish_tree(tmp)
        _check_out(out, force=config.force, source=loaded.path)
        _install(tmp, out)
    except OSError as e:
        raise ConfigError(f"cannot write the export to {out}: {e.strerror or e}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("exported the %s model of %s (step %d) to %s", config.which, loaded.path, info["step"], out)
    return ExportResult(out=out, info=info)
