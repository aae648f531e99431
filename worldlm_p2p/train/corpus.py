"""The federated-corpus layout ``<region>/<sub_corpus>/{train.txt,valid.txt}``: listing a corpus,
regrouping its sub-corpora into other regions by a grouping file, and the bundled demo slice
(standard library only)."""

from __future__ import annotations

import logging
from pathlib import Path

from worldlm_p2p.config import NAME_RULE, check_name
from worldlm_p2p.errors import ConfigError, DataError

logger = logging.getLogger(__name__)


def demo_data_dir() -> Path:
    """The demo corpus bundled with the package (``<region>/<sub_corpus>/{train,valid}.txt``)."""
    path = Path(__file__).resolve().parent.parent / "demo_data"
    if not path.is_dir():
        raise DataError(f"bundled demo data {path} is missing: reinstall worldlm-p2p")
    return path


def list_corpus(root: str | Path) -> dict[str, list[Path]]:
    """Map region -> sorted sub-corpus directories of a federated corpus ``root``
    (``<region>/<sub_corpus>/train.txt``). Files at the top level (README, manifest) and hidden
    entries are ignored. ``root`` may also be a grouping file (``.toml``, :func:`read_grouping`)
    that regroups the sub-corpora of a corpus into other regions without copying any text.
    Raises DataError if the layout is wrong."""
    root = Path(root).expanduser()
    if root.is_file() and root.suffix.lower() == ".toml":
        return read_grouping(root)
    if not root.is_dir():
        what = "does not exist" if not root.exists() else "is not a directory"
        raise DataError(f"corpus root {root} {what}")
    layout: dict[str, list[Path]] = {}
    for region_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        try:
            check_name("region", region_dir.name)
        except ConfigError:
            raise DataError(
                f"corpus root {root}: directory {region_dir.name!r} is not a valid region name "
                f"({NAME_RULE})"
            ) from None
        subs = sorted(p for p in region_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
        if not subs:
            raise DataError(f"corpus region {region_dir} has no sub-corpus directories")
        for sub in subs:
            if not (sub / "train.txt").is_file():
                raise DataError(f"corpus sub-corpus {sub} has no train.txt")
        layout[region_dir.name] = subs
    if not layout:
        raise DataError(f"corpus root {root} has no region directories (<region>/<sub_corpus>/train.txt)")
    return layout


def read_grouping(path: str | Path, *, root: str | Path | None = None) -> dict[str, list[Path]]:
    """A grouping file: regions made of sub-corpora of a federated corpus, by reference.

    TOML with ``root`` (the corpus, relative to the file's directory unless absolute; ``root``
    here, or the environment variable ``WORLDLM_CORPUS_ROOT``, overrides it, relative to the working
    directory) and a ``[regions]``
    table mapping each region to a list of sub-corpus directories under the root, e.g.
    ``eu = ["eu/de_news-reviews-wiki", "asia/ja_news-blog"]``. Every sub-corpus must exist
    (``train.txt``) and may appear once. Returns region -> sub-corpus directories, regions in
    sorted order, sub-corpora in the file's order."""
    import os
    import tomllib

    path = Path(path).expanduser()
    try:
        with path.open("rb") as f:
            spec = tomllib.load(f)
    except OSError as e:
        raise DataError(f"cannot read grouping file {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise DataError(f"grouping file {path} is not valid TOML: {e}") from None
    regions = spec.get("regions")
    if not isinstance(regions, dict) or not regions:
        raise DataError(f"grouping file {path} has no [regions] table (region = [\"<region>/<sub_corpus>\", ...])")
    override = root if root is not None else os.environ.get("WORLDLM_CORPUS_ROOT") or None
    base = override if override is not None else spec.get("root")
    if not isinstance(base, (str, Path)) or not str(base):
        raise DataError(f"grouping file {path} names no corpus root (root = \"...\")")
    # the file's own root is relative to the file; an override (argument, environment) to the
    # working directory, like any path given on a command line
    base = Path(base).expanduser()
    base = base.resolve() if override is not None else (path.parent / base).resolve()
    if not base.is_dir():
        raise DataError(f"grouping file {path}: corpus root {base} is not a directory")
    layout: dict[str, list[Path]] = {}
    seen: set[Path] = set()
    for region in sorted(regions):
        try:
            check_name("region", region)
        except ConfigError:
            raise DataError(f"grouping file {path}: {region!r} is not a valid region name "
                            f"({NAME_RULE})") from None
        subs = regions[region]
        if not isinstance(subs, list) or not subs or not all(isinstance(x, str) and x for x in subs):
            raise DataError(f"grouping file {path}: region {region!r} must list one or more sub-corpus paths")
        for rel in subs:
            sub = (base / rel).resolve()
            if not (sub / "train.txt").is_file():
                raise DataError(f"grouping file {path}: region {region!r}: {rel} has no train.txt under {base}")
            if sub in seen:
                raise DataError(f"grouping file {path}: sub-corpus {rel} appears twice")
            seen.add(sub)
            layout.setdefault(region, []).append(sub)
    return layout
