"""Regenerate the bundled demo corpus (``worldlm_p2p/demo_data``) from the full corpus.

Usage::

    python scripts/make_demo_data.py /path/to/corpus worldlm_p2p/demo_data

Keeps every ``<region>/<sub_corpus>/`` of the corpus, cutting ``train.txt`` to its first whole
lines within ~120 KB and ``valid.txt`` within ~25 KB, and writes ``README.md`` with the
attribution of each sub-corpus (read from the corpus ``manifest.json``). Standard library only;
the output is byte-for-byte reproducible.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger("make_demo_data")

TRAIN_BUDGET = 120_000  # bytes, whole lines
VALID_BUDGET = 25_000
REGION_ORDER = ("eu", "na", "asia")


def first_lines(path: Path, budget: int) -> tuple[bytes, int, int]:
    """The first whole lines of ``path`` whose total size (newlines included) fits ``budget``.
    Returns (data, lines kept, lines in the file)."""
    lines = path.read_bytes().split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    kept, size = [], 0
    for line in lines:
        if size + len(line) + 1 > budget:
            break
        kept.append(line)
        size += len(line) + 1
    return b"".join(line + b"\n" for line in kept), len(kept), len(lines)


def change_note(kept: int, total: int) -> str:
    return f"truncated to the first {kept} lines (of {total})" if kept < total else f"unchanged ({total} lines)"


def build(corpus: Path, out: Path) -> None:
    manifest = json.loads((corpus / "manifest.json").read_text(encoding="utf-8"))
    entries = sorted(
        manifest["subcorpora"],
        key=lambda s: (REGION_ORDER.index(s["region"]) if s["region"] in REGION_ORDER else 99, s["region"]),
    )
    if out.exists():
        for child in out.iterdir():
            if child.is_dir():
                shutil.rmtree(child)
            elif child.name == "README.md":
                child.unlink()
    rows: list[str] = []
    treebanks: dict[str, dict[str, Any]] = {}
    total = 0
    for s in entries:
        src = corpus / s["region"] / s["name"]
        dst = out / s["region"] / s["name"]
        dst.mkdir(parents=True, exist_ok=True)
        notes = []
        for split, budget in (("train", TRAIN_BUDGET), ("valid", VALID_BUDGET)):
            data, kept, n = first_lines(src / f"{split}.txt", budget)
            (dst / f"{split}.txt").write_bytes(data)
            total += len(data)
            notes.append((kept, n, len(data)))
        (tk, tn, tb), (vk, vn, vb) = notes
        rows.append(
            f"| {s['region']} | `{s['name']}` | {s['lang']} | [{s['repo']}]({s['url']}) @ `{s['commit'][:12]}` "
            f"| [{s['licence']}]({s['licence_url']}) | {tk} | {tb} | {vk} | {vb} "
            f"| train.txt {change_note(tk, tn)}; valid.txt {change_note(vk, vn)} |"
        )
        tb_entry = treebanks.setdefault(s["repo"], {"s": s, "dirs": []})
        tb_entry["dirs"].append(f"`{s['region']}/{s['name']}`")
        logger.info("%s/%s: train %d/%d lines, valid %d/%d lines", s["region"], s["name"], tk, tn, vk, vn)

    attributions = []
    for repo, info in treebanks.items():
        s = info["s"]
        note = f" Note: {s['note']}" if s.get("note") else ""
        attributions.append(
            f"- **{repo.split('/')[-1]}** ({s['lang']}) -> {', '.join(info['dirs'])}. "
            f"Licence: [{s['licence']}]({s['licence_url']}). Contributors: {s['contributors']}. "
            f"Source: {s['url']} @ {s['commit']}.{note}"
        )
    readme = README_TEMPLATE.format(
        train_budget=TRAIN_BUDGET,
        valid_budget=VALID_BUDGET,
        rows="\n".join(rows),
        attributions="\n".join(attributions),
        total=total,
        n=len(entries),
    )
    (out / "README.md").write_text(readme, encoding="utf-8")
    logger.info("wrote %d sub-corpora, %d bytes of text, to %s", len(entries), total, out)


README_TEMPLATE = """\
# Demo corpus (bundled slice)

A compact slice of the public multilingual, region-grouped corpus used by WorldLM-P2P, small
enough to ship with the package and train the `tiny` model on a laptop. Same layout as the full
corpus: `<region>/<sub_corpus>/{{train.txt,valid.txt}}`, UTF-8, one sentence per line.
All {n} sub-corpora are kept; each `train.txt` is cut to its first whole lines within
{train_budget} bytes and each `valid.txt` to its first whole lines within {valid_budget} bytes
({total} bytes of text in all). Regenerate with
`python scripts/make_demo_data.py /path/to/corpus worldlm_p2p/demo_data`.

Every line is a sentence taken verbatim from a Universal Dependencies treebank (the `# text =`
lines; annotation removed, Unicode NFC, deduplicated; see the full corpus README for how it was
built). Each sub-corpus is a derivative of the treebank named below and is redistributed under
that treebank's licence (ShareAlike). Changes made for this slice: the files were truncated as
stated in the last column; nothing else was altered.

| region | sub-corpus | language | source treebank @ commit | licence \
| train lines | train bytes | valid lines | valid bytes | changes |
|---|---|---|---|---|---:|---:|---:|---:|---|
{rows}

## Licences and attribution

{attributions}

Please also cite the treebank papers listed in each treebank's README and Universal Dependencies
(de Marneffe, Manning, Nivre & Zeman 2021, Computational Linguistics 47(2)).
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus", type=Path, help="the full corpus (with manifest.json)")
    parser.add_argument("out", type=Path, help="output directory, e.g. worldlm_p2p/demo_data")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not (args.corpus / "manifest.json").is_file():
        logger.error("%s has no manifest.json: not a corpus directory", args.corpus)
        return 2
    build(args.corpus, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
