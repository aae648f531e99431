"""``worldlm-simulate``: every strategy over a federated corpus in one process, for experiments.

    worldlm-simulate --data DIR --strategy worldlm --model tiny --rounds 10 --local-steps 20 \\
        --world-every 2 --seed 0 --out results.json

One virtual peer per ``<region>/<sub_corpus>``; the results JSON maps ``regions`` and ``peers`` to
``loss``, ``perplexity`` and ``bits_per_byte`` (plus tokens and bytes sent per peer) and gives
``wall_seconds``. ``--run-config run.toml`` takes the model, tokenizer, training and aggregation
settings from a run manifest; flags given explicitly override it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path

from worldlm_p2p.cli.common import (PRIVACY_FLAGS, ArgumentParser, Flag, add_flags, flag_values, install_stop_handlers,
                                    run_main)
from worldlm_p2p.config import AggregationConfig, PrivacyConfig, TrainConfig

PROG = "worldlm-simulate"
logger = logging.getLogger(PROG)


#: the flags that set run settings, each derived from its config field (name, type, choices, default)
FLAGS = (
    Flag("train", "inner_steps", "H: local steps per round", flag="--local-steps"),
    Flag("train", "seed", "seed of the model init and the batch streams"),
    Flag("train", "batch_size", "sequences per step"),
    Flag("train", "seq_len", "tokens per sequence"),
    Flag("train", "lr", "inner AdamW learning rate"),
    Flag("train", "eval_tokens", "held-out tokens per peer for evaluation (0 = all)"),
    Flag("aggregation", "strategy", "what to run"),
    Flag("aggregation", "world_every", "M: a world round every M region rounds"),
    Flag("aggregation", "key_layers", "K: kv, last30, embed_head or comma-separated name patterns"),
    Flag("aggregation", "attention", "K rule in a region"),
    Flag("aggregation", "tau", "attention temperature"),
    Flag("aggregation", "eps", "attention step size"),
    Flag("aggregation", "usage_rows", "weigh each member's rows of the token embeddings and the LM head by its "
                                      "token counts, which it then shares with its region"),
    Flag("aggregation", "residual", "no residual-embedding exchange in world rounds"),
    Flag("aggregation", "residual_beta", "step towards similar regions' key layers"),
    Flag("aggregation", "residual_tau", "temperature of the cross-region attention"),
    Flag("aggregation", "residual_attention", "the leaders' attention over key-layer residuals: world (every region "
                                              "and itself, residuals from the world's mean) or partners (the other "
                                              "regions, by how alike they departed from the rest)"),
    Flag("aggregation", "world_target", "where a worldlm world round moves a region: mean (the world's mean "
                                        "backbone) or attention (towards the regions whose residual sketches are "
                                        "most like its own, whole model)"),
    Flag("aggregation", "mix", "what a worldlm member keeps after a round: evidence (its own model moved towards "
                               "the region's and the world's only as far as its tune-slice loss supports), cosine "
                               "(the personal mix by update cosine) or none (adopt the agreed model)"),
    Flag("aggregation", "mix_world", "with --mix evidence: members take every world change whole (only region "
                                     "rounds are mixed)"),
    Flag("aggregation", "tune_fraction", "share of each peer's training tokens held apart as its tune slice for "
                                         "--mix evidence"),
    Flag("aggregation", "tune_tokens", "at most this many tokens in a tune slice"),
    Flag("aggregation", "mix_world_max", "largest fraction of a world change a member tries per round with --mix "
                                         "evidence"),
    Flag("aggregation", "mix_z", "with --mix evidence: take a mix only when its tune-slice gain exceeds this many "
                                 "standard errors of the per-window gains (0: any gain)"),
    Flag("aggregation", "tune_pieces", "take the tune slice in this many pieces spread over the training text "
                                       "(1: its tail)"),
    Flag("aggregation", "personal_tau", "temperature of --mix cosine"),
    Flag("aggregation", "evidence_share", "with --mix evidence: the share of a member's compute its evidence "
                                          "searches may take (0: a search every round; e.g. 0.05: otherwise its "
                                          "last search's weights again)"),
    Flag("aggregation", "personal_scope", "what a member's evidence mix covers: parts (the backbone and K each "
                                          "by its own weight; default), all (one weight) or key (the backbone "
                                          "adopted whole)"),
    Flag("aggregation", "personal_model", "with --mix evidence: separate (each member trains a personal model "
                                          "beside the shared one its rounds average, and mixes it towards that; "
                                          "default) or inline (one model per member)"),
    Flag("aggregation", "shared_model", "with --personal-model separate: what the shared model takes of a round: "
                                        "evidence (the agreed backbone whole, key layers by its tune slice; "
                                        "default), evidence-world (in a region of 3 or more also the world's "
                                        "change of the backbone by its tune slice) or agreed (the agreed "
                                        "model and every world change whole)"),
    Flag("aggregation", "region_backbone", "with --mix evidence: the backbone a member takes after a region round "
                                           "of 3 or more: partners (whichever its tune slice prefers of the "
                                           "region's, its mean with one mate's and, with the own half, its own "
                                           "with the region's) or mean (the region's)"),
    Flag("aggregation", "partner_candidates", "with --region-backbone partners: the most mates a member evaluates "
                                              "per round"),
    Flag("aggregation", "partner_check", "with --region-backbone partners: what a pair must beat on the tune slice: "
                                         "region (the region's backbone; default) or self (also the member's own)"),
    Flag("aggregation", "partner_own_half", "with --region-backbone partners: leave out the candidate of the "
                                            "member's own backbone half and half with the region's"),
    Flag("aggregation", "outer", "outer optimizer"),
    Flag("aggregation", "outer_lr", "outer learning rate"),
    Flag("aggregation", "outer_momentum", "Nesterov momentum"),
    Flag("aggregation", "robust", "how a group's average combines its members (clip: robust to a malicious "
                                  "minority; mean: the plain weighted mean)"),
    Flag("aggregation", "robust_clip", "with --robust clip: clip at this many spreads around the median"),
    Flag("aggregation", "compress_backbone", "how a region round's backbone change travels: none (float32), fp16 "
                                             "or int8"),
    Flag("aggregation", "compress_key", "how a region round's encoded key-layer change travels: none, fp16 or "
                                        "int8"),
    Flag("aggregation", "compress_world", "how a leader's region model travels in a world round: fp16 (default) "
                                          "or none (float32)"),
    Flag("aggregation", "overlap", "overlap each region round with the next H local steps: its result is applied at "
         "the next round, one round stale, with the progress made meanwhile (as an overlapping swarm does)"),
)
SECTIONS = {"train": TrainConfig, "aggregation": AggregationConfig, "privacy": PrivacyConfig}


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog=PROG, description="Simulate a WorldLM federation (or a baseline) in one process.")
    p.add_argument("--data", help="federated corpus <region>/<sub_corpus>/{train,valid}.txt "
                                  "(default: the bundled demo slice)")
    p.add_argument("--model", help="model preset: tiny, small, base, large (default tiny)")
    p.add_argument("--rounds", type=int, default=10, help="region rounds (default 10)")
    p.add_argument("--out", default="results.json", help="results JSON (default results.json)")
    p.add_argument("--run-config", metavar="TOML", help="take model/tokenizer/train/aggregation from a run manifest")
    p.add_argument("--eval-rounds", default="", help="extra evaluation points, comma-separated round counts")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    add_flags(p.add_argument_group("run settings (override --run-config)"), SECTIONS, FLAGS)
    add_flags(p.add_argument_group("differential privacy (the same policy for every region)"), SECTIONS,
              PRIVACY_FLAGS)
    p.add_argument("--no-report", action="store_true", help="do not write <out stem>.report.png and "
                                                             ".report.md (loss against tokens per region)")
    return p


def _overrides(args) -> dict[str, dict]:
    """The flags given explicitly, as manifest sections."""
    o = flag_values(args, FLAGS)
    return {"train": o.get("train", {}), "aggregation": o.get("aggregation", {})}


def make_config(args):
    from pathlib import Path

    from worldlm_p2p.config import TokenizerSpec, _build_section, load_toml, model_preset
    from worldlm_p2p.errors import ConfigError
    from worldlm_p2p.simulate import SimConfig
    from worldlm_p2p.train import demo_data_dir

    base: dict = load_toml(args.run_config) if args.run_config else {}
    for name, values in _overrides(args).items():
        base[name] = {**dict(base.get(name, {}) or {}), **values}
    model = dict(base.get("model", {}) or {})
    if args.model is not None:
        model = {"preset": args.model}
    preset = model.pop("preset", "tiny")
    model_cfg = model_preset(preset) if preset != "custom" else None
    if model_cfg is None or model:
        from worldlm_p2p.config import ModelConfig

        values = dataclasses.asdict(model_cfg) if model_cfg else {}
        values.update(model)
        model_cfg = _build_section(ModelConfig, "model", values)
    try:
        eval_rounds = tuple(sorted({int(x) for x in args.eval_rounds.split(",") if x.strip()}))
    except ValueError:
        raise ConfigError(f"--eval-rounds {args.eval_rounds!r}: expected comma-separated integers") from None
    if any(r < 1 or r > args.rounds for r in eval_rounds):
        raise ConfigError(f"--eval-rounds {args.eval_rounds!r}: every round must lie in 1..{args.rounds} (--rounds)")
    data = Path(args.data) if args.data else demo_data_dir()
    privacy = flag_values(args, PRIVACY_FLAGS).get("privacy", {})
    return SimConfig(
        privacy=_build_section(PrivacyConfig, "privacy", privacy),
        data=str(data), model=model_cfg,
        tokenizer=_build_section(TokenizerSpec, "tokenizer", base.get("tokenizer", {}) or {}),
        train=_build_section(TrainConfig, "train", base.get("train", {}) or {}),
        aggregation=_build_section(AggregationConfig, "aggregation", base.get("aggregation", {}) or {}),
        rounds=args.rounds, eval_rounds=eval_rounds,
        device=args.device)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    def body() -> int:
        from pathlib import Path

        from worldlm_p2p.errors import ConfigError

        if args.rounds < 1:
            raise ConfigError("--rounds must be a positive integer")
        if args.threads < 1:
            raise ConfigError("--threads must be a positive integer")
        out = Path(args.out)
        if out.is_dir():
            raise ConfigError(f"--out {out} is a directory; give a file name such as {out / 'results.json'}")
        config = make_config(args)

        import torch

        from worldlm_p2p.logs import setup_logging
        from worldlm_p2p.simulate import Simulator, write_results

        torch.set_num_threads(args.threads)
        setup_logging(hivemind=False)
        if logging.getLogger().level > logging.DEBUG:
            logging.getLogger("worldlm_p2p.train.data").setLevel(logging.WARNING)  # one line per sub-corpus
        stop = threading.Event()
        install_stop_handlers(stop.set)
        last = {"pct": -10}

        def progress(done: int, total: int) -> None:
            pct = 100 * done // total
            if pct >= last["pct"] + 10:
                last["pct"] = pct - pct % 10
                logger.info("%d%% of %d local steps", last["pct"], total)

        logger.info("%s on %s: model %s, %d rounds of %d local steps", config.aggregation.strategy, config.data,
                    config.model.preset, config.rounds, config.train.inner_steps)
        sim = Simulator(config, should_stop=stop.is_set, on_progress=progress)
        results = sim.run()
        path = write_results(results, out)
        regions = ", ".join(f"{r} {v['perplexity']:.3f}" for r, v in results["regions"].items())
        logger.info("%s: region perplexity %s; world %.3f; %.0f s; results in %s", config.aggregation.strategy,
                    regions, results["world"]["perplexity"], results["wall_seconds"], path)
        if not args.no_report:
            _report(path)
        return 0

    run_main(PROG, body)


def _report(results: Path) -> None:
    """``<stem>.report.png`` and ``<stem>.report.md`` beside the results; a failure is only logged."""
    from worldlm_p2p.errors import WorldLMError
    from worldlm_p2p.report import report_sources

    try:
        png, md = report_sources([results], results.parent, stem=f"{results.stem}.report")
        logger.info("report written to %s and %s", png, md)
    except Exception as e:  # the results file is written already
        logger.warning("no report written: %s", e if isinstance(e, WorldLMError) else f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
