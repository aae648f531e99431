"""``worldlm-export``: write a region's (or a peer's) model from a peer checkpoint as a Hugging Face
model directory (safetensors + tokenizer) that ``transformers`` loads without worldlm-p2p.

    worldlm-export --checkpoint-dir runs/demo/checkpoints/eu-fi_mixed --out exports/eu
"""

from __future__ import annotations

import logging

from worldlm_p2p.cli.common import ArgumentParser, run_main

PROG = "worldlm-export"
logger = logging.getLogger(PROG)

EPILOG = """\
The output directory holds config.json, model.safetensors, generation_config.json, the tokenizer
(tokenizer.json, tokenizer_config.json), worldlm_export.json (run, manifest, region, peer, step,
source checkpoint) and a README.md model card. Load it with
AutoModelForCausalLM.from_pretrained(OUT) and AutoTokenizer.from_pretrained(OUT).
It is written to a temporary directory next to OUT and renamed into place; an existing non-empty
OUT is replaced only with --force (and only if it holds an earlier export).
"""


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog=PROG, epilog=EPILOG,
                       description="Export a region's or a peer's model from a peer checkpoint for transformers.")
    p.add_argument("--checkpoint-dir", metavar="DIR",
                   help="a peer's checkpoint directory (--checkpoint-dir of worldlm-peer; "
                        "worldlm-swarm: OUT/checkpoints/<label>); its newest valid checkpoint is exported")
    p.add_argument("--checkpoint", metavar="FILE", help="export this checkpoint file instead of the newest")
    p.add_argument("--out", required=True, metavar="OUT", help="output directory (must not exist or be empty)")
    p.add_argument("--which", choices=("region", "peer"), default="region",
                   help="region: the region's agreed model, the result of its last round (default); "
                        "peer: the peer's own (personal) model")
    p.add_argument("--run-config", metavar="TOML",
                   help="the run manifest, for checkpoints that do not contain it (its fingerprint must match)")
    p.add_argument("--force", action="store_true", help="replace an existing non-empty OUT holding an earlier export")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    def body() -> int:
        from worldlm_p2p.export import ExportConfig, export_model
        from worldlm_p2p.logs import setup_logging

        config = ExportConfig(out=args.out, checkpoint_dir=args.checkpoint_dir, checkpoint=args.checkpoint,
                              which=args.which, run_config=args.run_config, force=args.force)
        setup_logging(hivemind=False)
        result = export_model(config)
        info = result.info
        who = info["label"] or info["peer_id"] or "?"
        logger.info("wrote the %s model of run %s, region %s (peer %s, step %d, %d parameters) to %s",
                    info["which"], info["run_id"], info["region"], who, info["step"], info["parameters"], result.out)
        return 0

    run_main(PROG, body)


if __name__ == "__main__":
    main()
