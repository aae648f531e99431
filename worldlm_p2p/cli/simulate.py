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

from worldlm_p2p.cli.common import ArgumentParser, install_stop_handlers, run_main

PROG = "worldlm-simulate"
logger = logging.getLogger(PROG)


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog=PROG, description="Simulate a WorldLM federation (or a baseline) in one process.")
    p.add_argument("--data", help="federated corpus <region>/<sub_corpus>/{train,valid}.txt "
                                  "(default: the bundled demo slice)")
    p.add_argument("--strategy", help="worldlm, fedavg, hierfavg, fedper, local or centralized (default worldlm)")
    p.add_argument("--model", help="model preset: tiny, small, base, large (default tiny)")
    p.add_argument("--rounds", type=int, default=10, help="region rounds (default 10)")
    p.add_argument("--local-steps", type=int, help="H: local steps per round (default 20)")
    p.add_argument("--world-every", type=int, help="M: a world round every M region rounds (default 1)")
    p.add_argument("--seed", type=int, help="seed of the model init and the batch streams (default 0)")
    p.add_argument("--out", default="results.json", help="results JSON (default results.json)")
    p.add_argument("--run-config", metavar="TOML", help="take model/tokenizer/train/aggregation from a run manifest")
    p.add_argument("--batch-size", type=int, help="sequences per step (default 8)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default 128)")
    p.add_argument("--lr", type=float, help="inner AdamW learning rate (default 3e-3)")
    p.add_argument("--eval-tokens", type=int, help="held-out tokens per peer for evaluation (default 16384; 0 = all)")
    p.add_argument("--eval-rounds", default="", help="extra evaluation points, comma-separated round counts")
    p.add_argument("--key-layers", help="kv, last30, embed_head or comma-separated name patterns (default kv)")
    p.add_argument("--attention", help="K rule in a region: distance, cosine or mean (default distance)")
    p.add_argument("--tau", type=float, help="attention temperature (default 0.1)")
    p.add_argument("--eps", type=float, help="attention step size (default 1.0)")
    p.add_argument("--no-residual", action="store_true", help="no residual-embedding exchange in world rounds")
    p.add_argument("--residual-beta", type=float, help="step towards similar regions' key layers (default 0.5)")
    p.add_argument("--residual-tau", type=float, help="temperature of the cross-region attention (default 0.1)")
    p.add_argument("--world-target", help="where a worldlm world round moves a region: mean (the world's mean "
                                          "backbone) or attention (towards the regions whose residual sketches "
                                          "are most like its own, whole model) (default mean)")
    p.add_argument("--mix", help="what a worldlm member keeps after a round: evidence (its own model moved towards "
                                 "the region's and the world's only as far as its tune-slice loss supports), cosine "
                                 "(the personal mix by update cosine) or none (adopt the agreed model) (default evidence)")
    p.add_argument("--no-mix-world", action="store_true",
                   help="with --mix evidence: members take every world change whole (only region rounds are mixed)")
    p.add_argument("--tune-fraction", type=float, help="share of each peer's training tokens held apart as its "
                                                       "tune slice for --mix evidence (default 0.05)")
    p.add_argument("--tune-tokens", type=int, help="at most this many tokens in a tune slice (default 2048)")
    p.add_argument("--mix-world-max", type=float, help="largest fraction of a world change a member tries per "
                                                       "round with --mix evidence (default 0.25)")
    p.add_argument("--mix-z", type=float, help="with --mix evidence: take a mix only when its tune-slice gain "
                                               "exceeds this many standard errors of the per-window gains "
                                               "(default 0: any gain)")
    p.add_argument("--tune-pieces", type=int, help="take the tune slice in this many pieces spread over the "
                                                   "training text (default 1: its tail)")
    p.add_argument("--personal-tau", type=float, help="temperature of --mix cosine (default 0.1)")
    p.add_argument("--personal-scope", help="what --mix cosine covers: key or all (default all)")
    p.add_argument("--outer", help="outer optimizer: sgd or nesterov (default sgd)")
    p.add_argument("--outer-lr", type=float, help="outer learning rate (default 1.0)")
    p.add_argument("--outer-momentum", type=float, help="Nesterov momentum (default 0.9)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    dp = p.add_argument_group("differential privacy (the same policy for every region)")
    dp.add_argument("--region-dp-noise", type=float, metavar="SIGMA",
                    help="border DP: noise multiplier on a region's clipped delta (needs --region-dp-clip)")
    dp.add_argument("--region-dp-clip", type=float, metavar="C",
                    help="border DP: clip a region's backbone delta (fedavg: its mean change) to L2 norm C")
    dp.add_argument("--region-dp-delta", type=float, metavar="DELTA", help="delta of the regions' epsilon (default 1e-5)")
    dp.add_argument("--peer-dp-epsilon", type=float, metavar="E", help="DP-SGD at every peer with target epsilon E")
    dp.add_argument("--peer-dp-noise", type=float, metavar="SIGMA", help="DP-SGD noise multiplier (instead of -epsilon)")
    dp.add_argument("--peer-dp-clip", type=float, metavar="C", help="DP-SGD per-window clipping norm (default 1.0)")
    dp.add_argument("--peer-dp-delta", type=float, metavar="DELTA", help="delta of the peers' epsilon (default 1e-5)")
    p.add_argument("--no-report", action="store_true", help="do not write <out stem>.report.png and "
                                                             ".report.md (loss against tokens per region)")
    return p


def _overrides(args) -> dict[str, dict]:
    """The flags given explicitly, as manifest sections."""
    o: dict[str, dict] = {"train": {}, "aggregation": {}}
    for flag, section, key in (("local_steps", "train", "inner_steps"), ("seed", "train", "seed"),
                               ("batch_size", "train", "batch_size"), ("seq_len", "train", "seq_len"),
                               ("lr", "train", "lr"), ("eval_tokens", "train", "eval_tokens"),
                               ("strategy", "aggregation", "strategy"), ("world_every", "aggregation", "world_every"),
                               ("key_layers", "aggregation", "key_layers"), ("attention", "aggregation", "attention"),
                               ("tau", "aggregation", "tau"), ("eps", "aggregation", "eps"),
                               ("residual_beta", "aggregation", "residual_beta"),
                               ("residual_tau", "aggregation", "residual_tau"), ("outer", "aggregation", "outer"),
                               ("world_target", "aggregation", "world_target"),
                               ("mix", "aggregation", "mix"), ("tune_fraction", "aggregation", "tune_fraction"),
                               ("tune_tokens", "aggregation", "tune_tokens"),
                               ("tune_pieces", "aggregation", "tune_pieces"),
                               ("mix_world_max", "aggregation", "mix_world_max"), ("mix_z", "aggregation", "mix_z"),
                               ("personal_tau", "aggregation", "personal_tau"),
                               ("personal_scope", "aggregation", "personal_scope"),
                               ("outer_lr", "aggregation", "outer_lr"),
                               ("outer_momentum", "aggregation", "outer_momentum")):
        value = getattr(args, flag)
        if value is not None:
            o[section][key] = value
    if args.no_residual:
        o["aggregation"]["residual"] = False
    if args.no_mix_world:
        o["aggregation"]["mix_world"] = False
    return o


def make_config(args):
    from pathlib import Path

    from worldlm_p2p.config import (AggregationConfig, TokenizerSpec, TrainConfig, _build_section, load_toml,
                                    model_preset)
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
    privacy = {}
    for flag, key in (("region_dp_noise", "border_noise"), ("region_dp_clip", "border_clip"),
                      ("region_dp_delta", "border_delta"), ("peer_dp_epsilon", "peer_epsilon"),
                      ("peer_dp_noise", "peer_noise"), ("peer_dp_clip", "peer_clip"), ("peer_dp_delta", "peer_delta")):
        if getattr(args, flag) is not None:
            privacy[key] = getattr(args, flag)
    from worldlm_p2p.config import PrivacyConfig

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
