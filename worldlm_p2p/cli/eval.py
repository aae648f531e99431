"""``worldlm-eval``: perplexity and bits per byte of a Hugging Face causal LM (e.g. one written by
``worldlm-export``) per sub-corpus and per region of a federated corpus.

    worldlm-eval --model exports/eu --data worldlm_p2p/demo_data --json eval.json
"""

from __future__ import annotations

import argparse
import logging

from worldlm_p2p.cli.common import ArgumentParser, run_main

PROG = "worldlm-eval"
logger = logging.getLogger(PROG)

EPILOG = """\
Method: each document (a non-blank line) is tokenised without special tokens and followed by EOS;
the stream is cut into non-overlapping windows of --seq-len + 1 tokens (a trailing partial window
is dropped), as for the peers' valid_loss. loss = mean cross-entropy in nats per predicted token,
perplexity = exp(loss), bits_per_byte = loss * stream_tokens / bytes / ln 2 (bytes: UTF-8 bytes of
the documents plus one per line break; for the byte tokenizer tokens == bytes, so it is loss/ln 2).
A region's row is the unweighted mean over its sub-corpora; "overall" weights every token
(loss, perplexity) and every byte (bits_per_byte) equally.

--json PATH writes:
  {"model": str, "data": str, "split": "valid"|"train", "seq_len": int, "batch_size": int,
   "max_tokens": int, "device": str,
   "sub_corpora": {"<region>/<sub>": {"region": str, "tokens": int, "stream_tokens": int,
                   "bytes": int, "loss": float, "perplexity": float, "bits_per_byte": float}},
   "regions": {"<region>": {"sub_corpora": int, "tokens": int, "bytes": int, "loss": float,
               "perplexity": float, "bits_per_byte": float}},
   "overall": {same keys as a region}}
tokens = predicted tokens scored; stream_tokens and bytes describe the whole split. Values that
are not finite (a sub-corpus without text in the split) are null.
"""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keep the epilog's layout."""


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog=PROG, epilog=EPILOG, formatter_class=_Formatter,
                       description="Perplexity and bits per byte of a Hugging Face causal LM per sub-corpus "
                                   "and per region.")
    p.add_argument("--model", required=True, metavar="DIR",
                   help="a model directory with a tokenizer (worldlm-export --out, or any HF causal LM)")
    p.add_argument("--data", required=True, metavar="CORPUS_DIR",
                   help="a federated corpus <region>/<sub_corpus>/{train,valid}.txt, one region directory, "
                        "or one sub-corpus directory")
    p.add_argument("--split", choices=("valid", "train"), default="valid",
                   help="valid.txt (default; without it, the last 10%% of train.txt) or train.txt")
    p.add_argument("--seq-len", type=int, metavar="N",
                   help="tokens per window (default 128, at most the model's max_position_embeddings: "
                        "the runs' default train.seq_len, comparable with the peers' valid_loss)")
    p.add_argument("--batch-size", type=int, default=8, metavar="B", help="windows per forward pass (default 8)")
    p.add_argument("--max-tokens", type=int, default=0, metavar="N",
                   help="at most N predicted tokens per sub-corpus (default 0 = all)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto; bf16 autocast on CUDA)")
    p.add_argument("--threads", type=int, metavar="N", help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON (schema below)")
    return p


def _finite(obj):
    import math

    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    return obj


def _write_json(results: dict, path: str) -> None:
    import json
    import os
    from pathlib import Path

    from worldlm_p2p.errors import ConfigError

    target = Path(path).expanduser()
    tmp = target.with_name(f".{target.name}.tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(_finite(results), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(tmp, target)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"--json {path}: cannot write it: {e.strerror or e}") from None


def _table(results: dict):
    from rich.table import Table

    def fmt(v, spec):
        return "-" if v is None or v != v else format(v, spec)

    t = Table(title=f"{results['model']} on {results['data']} ({results['split']}, seq_len {results['seq_len']})",
              caption="region rows: mean over the region's sub-corpora; overall: token-weighted "
                      "(bits/byte: byte-weighted)")
    for name, justify in (("sub-corpus", "left"), ("tokens", "right"), ("loss", "right"), ("perplexity", "right"),
                          ("bits/byte", "right")):
        t.add_column(name, justify=justify)  # type: ignore[arg-type]
    for region, r in results["regions"].items():
        for key, s in results["sub_corpora"].items():
            if s["region"] == region:
                t.add_row(key, str(s["tokens"]), fmt(s["loss"], ".4f"), fmt(s["perplexity"], ".3f"),
                          fmt(s["bits_per_byte"], ".4f"))
        t.add_row(f"[bold]{region}[/bold] (mean of {r['sub_corpora']})", str(r["tokens"]), fmt(r["loss"], ".4f"),
                  fmt(r["perplexity"], ".3f"), fmt(r["bits_per_byte"], ".4f"), end_section=True)
    o = results["overall"]
    t.add_row("[bold]overall[/bold]", str(o["tokens"]), fmt(o["loss"], ".4f"), fmt(o["perplexity"], ".3f"),
              fmt(o["bits_per_byte"], ".4f"))
    return t


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    def body() -> int:
        from worldlm_p2p.errors import ConfigError

        if args.threads is not None and args.threads < 1:
            raise ConfigError("--threads must be a positive integer")
        if args.seq_len is not None and args.seq_len < 1:
            raise ConfigError("--seq-len must be a positive integer")
        from worldlm_p2p.evaluation import EvalConfig, evaluate

        config = EvalConfig(model=args.model, data=args.data, split=args.split, seq_len=args.seq_len or 0,
                            batch_size=args.batch_size, max_tokens=args.max_tokens, device=args.device)

        import torch
        from rich.console import Console

        from worldlm_p2p.logs import setup_logging

        if args.threads is not None:
            torch.set_num_threads(args.threads)
        setup_logging(hivemind=False)
        if logging.getLogger().level > logging.DEBUG:
            logging.getLogger("worldlm_p2p.train.data").setLevel(logging.WARNING)  # one line per sub-corpus
        results = evaluate(config)
        Console(soft_wrap=False).print(_table(results))
        if args.json:
            _write_json(results, args.json)
            logger.info("results written to %s", args.json)
        return 0

    run_main(PROG, body)


if __name__ == "__main__":
    main()
