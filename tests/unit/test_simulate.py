"""``worldlm-simulate`` on a tiny federated corpus (2 regions x 2 sub-corpora, a few hundred lines each).

The results file's promises (fields, perplexity = exp(loss), region = mean of its peers), determinism,
every strategy, the byte accounting, and rounds equal to a from-scratch rebuild with the swarm's own
pieces (LocalTrainer with the peer's batch-stream seed, then :mod:`worldlm_p2p.rounds`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swarm_utils import DEMO, env, max_abs_diff
from worldlm_p2p.aggregation import allreduce_traffic, round_weight
from worldlm_p2p.config import AggregationConfig, PrivacyConfig, TrainConfig, model_preset
from worldlm_p2p.privacy import BorderAccountant
from worldlm_p2p.rounds import (RoundRule, border_release, flat_round_with_border_dp, hand_down, member_world_mix,
                                personal_mix, region_round_with_anchor, stale_apply, world_round)
from worldlm_p2p.simulate import SimConfig, Simulator, simulate
from worldlm_p2p.split import split_parameters
from worldlm_p2p.train import (ByteTokenizer, LocalTrainer, build_model, get_flat_params, hold_out_tune, load_texts,
                               peer_data_seed, set_params, tokenize_splits)

SIM = [sys.executable, "-m", "worldlm_p2p.cli.simulate"]
LAYOUT = {"eu": ("de_news-reviews-wiki", "fi_mixed"), "na": ("en_answers", "en_email")}
STRATEGIES = ("worldlm", "fedavg", "hierfavg", "fedper", "local", "centralized")
B, T, H, ROUNDS, EVAL = 2, 32, 2, 2, 256  # batch size, sequence length, local steps, rounds, eval tokens
#: at most this many tokens in a member's tune slice (the product's 2048 would make each evidence search,
#: the bulk of these runs, several times dearer; the searches' logic does not depend on its size)
TUNE = 256
SIM_FLAGS = ["--batch-size", str(B), "--seq-len", str(T), "--local-steps", str(H), "--rounds", str(ROUNDS),
             "--eval-tokens", str(EVAL), "--tune-tokens", str(TUNE), "--threads", "1", "--device", "cpu"]
METRICS = ("loss", "perplexity", "bits_per_byte")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """``<region>/<sub>/{train,valid}.txt``: the first 200 / 40 lines of four demo sub-corpora."""
    root = tmp_path_factory.mktemp("corpus")
    for region, subs in LAYOUT.items():
        for sub in subs:
            d = root / region / sub
            d.mkdir(parents=True)
            for name, n in (("train.txt", 200), ("valid.txt", 40)):
                lines = (DEMO / region / sub / name).read_text(encoding="utf-8").splitlines()[:n]
                (d / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


def sim_config(corpus: Path, strategy: str = "worldlm", *, seed: int = 0, rounds: int = ROUNDS,
               **aggregation) -> SimConfig:
    return SimConfig(data=str(corpus), model=model_preset("tiny"),
                     train=TrainConfig(batch_size=B, seq_len=T, inner_steps=H, eval_tokens=EVAL, seed=seed),
                     aggregation=AggregationConfig(strategy=strategy, **{"tune_tokens": TUNE, **aggregation}),
                     rounds=rounds, device="cpu")


@pytest.fixture(scope="module")
def run_strategy(corpus):
    """The results of each strategy on the corpus with seed 0 (computed once per module)."""
    return functools.cache(lambda strategy: simulate(sim_config(corpus, strategy)))


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2, (code, err)
    assert len(lines) == 1 and lines[0].startswith("worldlm-simulate: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]


def run_cli(args: list[str], timeout: float = 120) -> tuple[int, str, str]:
    p = subprocess.run(SIM + args, capture_output=True, env=env(), timeout=timeout, cwd=Path(__file__).parents[2])
    return p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")


# ------------------------------------------------------------------------------ the results file


def test_cli_results_json(corpus, tmp_path):
    out = tmp_path / "res" / "results.json"
    code, stdout, err = run_cli(["--data", str(corpus), *SIM_FLAGS, "--eval-rounds", "1", "--out", str(out)])
    assert code == 0, (code, err, stdout[-2000:])
    assert err == "", err  # stderr is reserved for the one-line error
    res = json.loads(out.read_text())
    assert res["strategy"] == "worldlm"
    assert isinstance(res["wall_seconds"], (int, float)) and res["wall_seconds"] > 0
    assert set(res["regions"]) == set(LAYOUT)
    assert set(res["peers"]) == {f"{r}/{s}" for r, subs in LAYOUT.items() for s in subs}
    for key, peer in res["peers"].items():
        assert peer["region"] == key.split("/")[0]
        for field in (*METRICS, "tokens", "bytes_sent_region", "bytes_sent_border"):
            assert field in peer, (key, field)
        assert math.isfinite(peer["loss"]) and 0 < peer["loss"] < 10, peer
        assert math.isclose(peer["perplexity"], math.exp(peer["loss"]), rel_tol=1e-12), peer
        # byte tokenizer: one token per UTF-8 byte, EOS standing for the line end, so bits/byte = nats/token / ln 2
        assert math.isclose(peer["bits_per_byte"], peer["loss"] / math.log(2), rel_tol=1e-9), peer
        assert peer["tokens"] == ROUNDS * H * B * T
        assert peer["bytes_sent_region"] > 0  # worldlm: every round averages in the region
    for region, vals in res["regions"].items():
        mine = [p for p in res["peers"].values() if p["region"] == region]
        assert len(mine) == len(LAYOUT[region])
        for m in METRICS:
            assert math.isclose(vals[m], sum(p[m] for p in mine) / len(mine), rel_tol=1e-12), (region, m)
        assert math.isclose(vals["perplexity"], sum(math.exp(p["loss"]) for p in mine) / len(mine), rel_tol=1e-12)
    for m in METRICS:
        assert math.isclose(res["world"][m], sum(v[m] for v in res["regions"].values()) / len(LAYOUT), rel_tol=1e-12)
    assert res["tokens"] == len(res["peers"]) * ROUNDS * H * B * T
    # --eval-rounds 1 adds an evaluation after round 1; the last one is the final result
    assert [h["round"] for h in res["history"]] == [1, 2]
    assert res["history"][-1]["peers"] == res["peers"]
    assert all(p["tokens"] == H * B * T for p in res["history"][0]["peers"].values())
    # the report beside the results: loss against tokens per region, and its Markdown summary
    assert (out.parent / "results.report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = (out.parent / "results.report.md").read_text()
    assert "![loss against tokens](results.report.png)" in summary
    assert all(f"| {region} | 2 |" in summary for region in LAYOUT)


# ------------------------------------------------------------------------------ determinism


def test_same_seed_same_losses_other_seed_differs(corpus, run_strategy):
    def losses(res):
        return {k: v["loss"] for k, v in res["peers"].items()}

    first = run_strategy("worldlm")
    again = simulate(sim_config(corpus, "worldlm"))
    assert losses(again) == losses(first)
    assert again["regions"] == first["regions"]
    other = simulate(sim_config(corpus, "worldlm", seed=1))
    assert all(losses(other)[k] != v for k, v in losses(first).items()), (losses(first), losses(other))


# ------------------------------------------------------------------------------ strategies


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_runs(run_strategy, strategy):
    res = run_strategy(strategy)
    assert res["strategy"] == strategy
    assert len(res["peers"]) == 4 and set(res["regions"]) == set(LAYOUT)
    assert all(math.isfinite(p["loss"]) and 0 < p["loss"] < 10 for p in res["peers"].values()), res["peers"]
    assert res["tokens"] == 4 * ROUNDS * H * B * T


def test_byte_accounting(run_strategy):
    params = run_strategy("local")["parameters"]
    for strategy in STRATEGIES:
        assert run_strategy(strategy)["parameters"] == params
    # local and centralized never send anything
    for strategy in ("local", "centralized"):
        assert all(p["bytes_sent_region"] == 0 and p["bytes_sent_border"] == 0
                   for p in run_strategy(strategy)["peers"].values()), strategy
    # fedavg: one world group of 4 that averages the whole model every round; each peer sends what the
    # swarm's butterfly all-reduce estimate says (for the payload in the default wire codec, fp16 for every
    # tensor: 2 bytes a value), a third to its region peer and two thirds across the border
    assert AggregationConfig().compress_backbone == "fp16"
    per_round = allreduce_traffic(2 * params, 4)[0]
    for key, p in run_strategy("fedavg")["peers"].items():
        assert p["bytes_sent_border"] > 0, key
        assert p["bytes_sent_region"] + p["bytes_sent_border"] == ROUNDS * per_round, (key, p)
        assert p["bytes_sent_border"] == 2 * p["bytes_sent_region"], (key, p)
    # fedper averages only the backbone (less than fedavg), in the same world group
    for key, p in run_strategy("fedper")["peers"].items():
        assert 0 < p["bytes_sent_border"] < run_strategy("fedavg")["peers"][key]["bytes_sent_border"], key
    # worldlm and hierfavg: regions average apart, only a region's leader (its first sub-corpus) crosses
    # the border, in world rounds
    for strategy in ("worldlm", "hierfavg"):
        for key, p in run_strategy(strategy)["peers"].items():
            region, label = key.split("/")
            leader = label == min(LAYOUT[region])
            assert p["bytes_sent_region"] > 0, (strategy, key)
            assert (p["bytes_sent_border"] > 0) == leader, (strategy, key, p)


def test_centralized_processes_the_same_tokens(run_strategy):
    central = run_strategy("centralized")
    for strategy in ("worldlm", "fedavg", "hierfavg", "fedper", "local"):
        res = run_strategy(strategy)
        assert central["tokens"] == res["tokens"] == sum(p["tokens"] for p in res["peers"].values()), strategy
    # one model, evaluated on every peer's held-out text
    assert len(central["peers"]) == 4


# ------------------------------------------------------------------------------ rounds equal the pure functions


class _Rebuilt:
    """A peer rebuilt from scratch: the run's model init and the batch stream of ``(seed, region, label)``."""

    def __init__(self, config: SimConfig, sub: Path) -> None:
        self.region, self.label, self.config = sub.parent.name, sub.name, config
        self.model = build_model(config.model, vocab_size=ByteTokenizer().vocab_size, seed=config.train.seed)
        data = tokenize_splits(load_texts(sub), ByteTokenizer())
        agg = config.aggregation
        if agg.strategy == "worldlm" and agg.mix == "evidence":
            data = hold_out_tune(data, fraction=agg.tune_fraction, max_tokens=agg.tune_tokens,
                                 seq_len=config.train.seq_len, eos_id=ByteTokenizer().eos_id, pieces=agg.tune_pieces)
            assert data.tune.numel() > 0
        self.trainer = LocalTrainer(model=self.model, train=config.train, data=data, device=torch.device("cpu"),
                                    seed=peer_data_seed(config.train.seed, self.label))
        # personal_model="separate": the personal model, trained on the same batches
        self.personal = LocalTrainer(
            model=build_model(config.model, vocab_size=ByteTokenizer().vocab_size, seed=config.train.seed),
            train=config.train, data=data, device=torch.device("cpu"),
            seed=peer_data_seed(config.train.seed, self.label)) if _rule(config, self.model).separate_personal else None
        self.step = self.tokens = self.tokens_since_world = 0

    def personal_loss_of(self, params):
        rule = _rule(self.config, self.model)
        return self.personal.tune_losses(params) if rule.windowed else self.personal.tune_loss(params)

    def mix_personal(self, rule) -> None:
        """After a round: the personal model towards the shared one (rounds.personal_mix)."""
        if self.personal is not None:
            new, _ = personal_mix(rule, personal=get_flat_params(self.personal.model),
                                  shared=get_flat_params(self.model), loss_of=self.personal_loss_of)
            set_params(self.personal.model, new)

    def loss_of(self, params):
        rule = _rule(self.config, self.model)  # the significance test needs each window's loss
        return self.trainer.tune_losses(params) if rule.windowed else self.trainer.tune_loss(params)

    def train(self, steps: int) -> int:
        tokens = 0
        for _ in range(steps):
            tokens += self.trainer.train_step(self.step).tokens
            if self.personal is not None:
                self.personal.train_step(self.step)
            self.step += 1
        self.tokens += tokens
        self.tokens_since_world += tokens
        return tokens


def _rule(config: SimConfig, model: torch.nn.Module) -> RoundRule:
    names = [n for n, _ in model.named_parameters()]
    agg = config.aggregation
    return RoundRule.from_config(agg, split_parameters(names, agg.key_layers), seed=config.train.seed)


def _sim_models(sim: Simulator) -> dict[tuple[str, str], list[torch.Tensor]]:
    """Every virtual peer's shared model (the one its rounds average)."""
    return {(p.region, p.label): get_flat_params(p.model) for p in sim.peers}


def _sim_personal(sim: Simulator) -> dict[tuple[str, str], list[torch.Tensor]]:
    """Every virtual peer's personal model (personal_model="separate")."""
    return {(p.region, p.label): get_flat_params(p.personal.model) for p in sim.peers if p.personal is not None}


def _part_weights(rule, record) -> tuple[float, float]:
    """(weight of B, weight of K) of a member's mix record, by the rule's personal scope."""
    if rule.mixes_by_part:
        return record["lam"], record["key_lam"]
    if rule.personal_key_only:
        return 1.0, record["lam"]
    return record["lam"], record["lam"]


@pytest.mark.parametrize("mix", ["evidence", "cosine", "none"])
def test_worldlm_region_round_equals_the_pure_round(corpus, mix):
    """One round: every peer H steps alone, then ``rounds.region_round`` per region. With evidence
    mixing each member holds the same tune slice apart and chooses its own weight on it."""
    config = sim_config(corpus, "worldlm", rounds=1, world_every=2,  # no world round after round 1
                        mix=mix)
    sim = Simulator(config)
    results = sim.run()
    got = _sim_models(sim)

    init = get_flat_params(build_model(config.model, vocab_size=259, seed=0))
    for region, subs in LAYOUT.items():
        peers = [_Rebuilt(config, corpus / region / s) for s in subs]
        weights = [round_weight(p.train(H)) for p in peers]
        pre = [get_flat_params(p.model) for p in peers]
        assert max_abs_diff(pre[0], pre[1]) > 1e-4  # they trained apart
        rule = _rule(config, peers[0].model)
        choices: list = []
        want, _, agreed = region_round_with_anchor(rule, pre, weights, anchor=init, momentum=None,
                                                   loss_of=[p.loss_of for p in peers], choices=choices)
        for p, w in zip(peers, want):
            assert max_abs_diff(got[(region, p.label)], w) < 1e-6, (region, p.label)
        if mix == "none":  # the whole region adopts the agreed B and K after a round
            assert max_abs_diff(got[(region, subs[0])], got[(region, subs[1])]) < 1e-6
            assert max_abs_diff(got[(region, subs[0])], agreed) < 1e-6
        elif mix == "cosine":  # each member keeps its personal mix of its own and the region's update
            assert max_abs_diff(got[(region, subs[0])], got[(region, subs[1])]) > 1e-5
        else:  # each member keeps own + lam (agreed - own), lam chosen on its own tune slice, per part:
            # personal_scope "parts" (the default): lam for B and key_lam for K; "key": the agreed B
            # and lam for K; "all": one lam
            for p, before, c in zip(peers, pre, choices):
                rec = results["mixes"][f"{region}/{p.label}"][0]
                assert c.lam == rec["lam"] and 0.0 <= rec["lam"] <= 1.0
                wb, wk = _part_weights(rule, rec)
                key = set(rule.split.key)
                expect = [a + (wk if i in key else wb) * (g - a) for i, (a, g) in enumerate(zip(before, agreed))]
                assert max_abs_diff(got[(region, p.label)], expect) < 1e-6
                assert c.loss <= c.own_loss  # never worse on the slice than its own model
    # regions never average with each other
    assert max_abs_diff(got[("eu", LAYOUT["eu"][0])], got[("na", LAYOUT["na"][0])]) > 1e-4


@pytest.mark.parametrize("strategy", ["worldlm", "hierfavg"])
def test_overlapped_rounds_equal_the_stale_pure_rounds(corpus, strategy):
    """``aggregation.overlap``: round 1 is computed on the members' models at its boundary while they
    train H more steps from those models; at round 2's boundary each member takes round 1's result
    plus what it trained meanwhile (rounds.stale_apply), then round 2 runs on that, and the last
    round is applied as the run ends, followed by the world round (world_every = 2)."""
    config = sim_config(corpus, strategy, rounds=2, world_every=2, overlap=True)
    sim = Simulator(config)
    results = sim.run()
    got = _sim_models(sim)
    assert [w["round"] for w in sim.world_rounds] == [2]

    init = get_flat_params(build_model(config.model, vocab_size=259, seed=0))
    peers = {r: [_Rebuilt(config, corpus / r / s) for s in subs] for r, subs in LAYOUT.items()}
    rule = _rule(config, peers["eu"][0].model)
    anchors = {r: init for r in LAYOUT}
    momenta: dict = {r: None for r in LAYOUT}
    pending: dict = {}
    for round_index in (1, 2):
        for r, members in peers.items():
            weights = [round_weight(p.train(H)) for p in members]
            if round_index == 2:  # round 1's result arrives, with the H steps trained meanwhile
                for p in members:
                    pre, new = pending[p.label]
                    now = get_flat_params(p.model)
                    assert max_abs_diff(now, pre) > 1e-4  # it did train on while round 1 was in flight
                    set_params(p.model, stale_apply(new, pre=pre, current=now))
            pre = [get_flat_params(p.model) for p in members]
            new, momenta[r], anchors[r] = region_round_with_anchor(
                rule, pre, weights, anchor=anchors[r], momentum=momenta[r], loss_of=[p.loss_of for p in members])
            for p, own, tensors in zip(members, pre, new):
                pending[p.label] = (own, tensors)
                set_params(p.model, own)  # (the mixing search left trial parameters in it)
    for members in peers.values():  # the last round: applied at once (nothing trained after it)
        for p in members:
            set_params(p.model, pending[p.label][1])
    tokens = {r: float(sum(p.tokens_since_world for p in members)) for r, members in peers.items()}
    result = world_round(rule, anchors, tokens)
    for r, members in peers.items():
        delta = [n - a for n, a in zip(result.models[r], anchors[r])]
        for p in members:
            want, _ = member_world_mix(rule, own=get_flat_params(p.model), change=delta, loss_of=p.loss_of)
            assert max_abs_diff(got[(r, p.label)], want) < 1e-6, (strategy, r, p.label)
    # staleness is not free of effect: the synchronous schedule ends elsewhere
    sync = Simulator(dataclasses.replace(config, aggregation=dataclasses.replace(config.aggregation, overlap=False)))
    sync.run()
    assert max(max_abs_diff(got[k], v) for k, v in _sim_models(sync).items()) > 1e-5
    assert results["tokens"] == sum(p.tokens for members in peers.values() for p in members)


@pytest.mark.parametrize("strategy", ["worldlm", "worldlm-mix-none", "hierfavg", "worldlm-border-dp",
                                      "worldlm-attn-z2", "worldlm-attn-border-dp", "worldlm-partners"])
def test_two_region_rounds_and_a_world_round_equal_the_pure_functions(corpus, strategy):
    """The schedule: two region rounds (the second from the first's anchor, with the optimizer state
    carried over), then a world round among the regions' leaders that every member adopts: by its
    own evidence (worldlm's default: it adds the fraction of the world's change that its tune slice
    supports) or whole. With border DP, each leader sends its region's clipped and noised backbone
    change (rounds.border_release). ``partners``: the residual exchange over the other regions only
    (each region's K moves residual_beta towards the other's)."""
    dp = PrivacyConfig(border_clip=0.05, border_noise=0.5) if strategy.endswith("-border-dp") else PrivacyConfig()
    mix = "none" if strategy.endswith("-mix-none") else "evidence"
    strategy = strategy.removesuffix("-border-dp").removesuffix("-mix-none")
    extra = dict(mix_z=2.0) if strategy.endswith("-z2") else {}
    strategy = strategy.removesuffix("-z2")
    if strategy.endswith("-partners"):  # the leaders' residual attention over the other regions only
        extra["residual_attention"] = "partners"
    strategy = strategy.removesuffix("-partners")
    if strategy.endswith("-attn"):  # world attention: each region moves towards the other regions' models
        extra["world_target"] = "attention"
    strategy = strategy.removesuffix("-attn")
    config = dataclasses.replace(sim_config(corpus, strategy, rounds=2, world_every=2, mix=mix, **extra), privacy=dp)
    sim = Simulator(config)
    results = sim.run()
    got = _sim_models(sim)
    assert [w["round"] for w in sim.world_rounds] == [2]

    init = get_flat_params(build_model(config.model, vocab_size=259, seed=0))
    peers = {r: [_Rebuilt(config, corpus / r / s) for s in subs] for r, subs in LAYOUT.items()}
    rule = _rule(config, peers["eu"][0].model)
    anchors = {r: init for r in LAYOUT}
    momenta: dict = {r: None for r in LAYOUT}
    for _ in range(2):
        for r, members in peers.items():
            weights = [round_weight(p.train(H)) for p in members]
            new, momenta[r], anchors[r] = region_round_with_anchor(
                rule, [get_flat_params(p.model) for p in members], weights, anchor=anchors[r], momentum=momenta[r],
                loss_of=[p.loss_of for p in members])
            for p, tensors in zip(members, new):
                with torch.no_grad():
                    for param, t in zip(p.model.parameters(), tensors):
                        param.copy_(t)
        if _ == 0:  # (after round 2, the personal models mix after the world round)
            for members in peers.values():
                for p in members:
                    p.mix_personal(rule)
    tokens = {r: float(sum(p.tokens_since_world for p in members)) for r, members in peers.items()}
    sent = {}
    if dp.border:
        for r in LAYOUT:
            sent[r], rec = border_release(rule, anchors[r], init, clip=dp.border_clip, noise_multiplier=dp.border_noise,
                                          generator=sim._noise(r, 2))
            assert rec.norm > dp.border_clip  # the clip bites: what leaves has norm C (plus noise)
            assert sim.world_rounds[0]["released"][r]["norm"] == pytest.approx(rec.norm, rel=1e-5)
            acc = BorderAccountant(delta=dp.border_delta)
            acc.record(dp.border_noise)
            assert results["regions"][r]["epsilon"] == pytest.approx(acc.epsilon())
    else:
        assert all(v["epsilon"] is None for v in results["regions"].values())
    leader_loss, held = None, {}
    if rule.residual_step_evidence:  # partners: each leader (the smallest label) scales K's step by its slice
        leaders = {r: min(members, key=lambda p: p.label) for r, members in peers.items()}
        leader_loss = {r: p.loss_of for r, p in leaders.items()}
        held = {r: get_flat_params(p.model) for r, p in leaders.items()}
    result = world_round(rule, anchors, tokens, sent=sent, leader_loss=leader_loss)
    for r, params in held.items():
        set_params(leaders[r].model, params)
    assert sim.world_rounds[0].get("steps", {}) == result.steps
    lams = []
    for r, members in peers.items():
        # every member rebases onto the world result: its model plus (a fraction of) the change of
        # the region's model, as the leader hands it down (fp16 numbers with the default codec)
        delta = hand_down(rule, result.models[r], anchors[r])
        assert max_abs_diff(delta, [n - a for n, a in zip(result.models[r], anchors[r])]) < 1e-4
        for p in members:
            own = get_flat_params(p.model)
            want, choice = member_world_mix(rule, own=own, change=delta, loss_of=p.loss_of)
            if rule.evidence:
                rec = [m for m in results["mixes"][f"{r}/{p.label}"] if m["kind"] == "world"][-1]
                assert rec["lam"] == choice.lam
                lams.append(choice.lam)
                wb, wk = _part_weights(rule, rec)
                key = set(rule.split.key)
                assert max_abs_diff(want, [t + (wk if i in key else wb) * d
                                           for i, (t, d) in enumerate(zip(own, delta))]) < 1e-6
            else:
                assert max_abs_diff(want, [t + d for t, d in zip(own, delta)]) < 1e-6
            assert max_abs_diff(got[(r, p.label)], want) < 1e-6, (strategy, r, p.label)
            set_params(p.model, want)
            p.mix_personal(rule)
    personal = _sim_personal(sim)
    assert bool(personal) == (mix == "evidence" and strategy == "worldlm")  # the default: a separate personal model
    for r, members in peers.items():
        for p in members:
            if p.personal is not None:
                assert max_abs_diff(personal[(r, p.label)], get_flat_params(p.personal.model)) < 1e-6
                recs = [m for m in results["mixes"][f"{r}/{p.label}"] if m["kind"] == "personal"]
                assert [m["round"] for m in recs] == [1, 2]
    if strategy == "hierfavg":  # the world round gives every region the same model
        assert max_abs_diff(got[("eu", "fi_mixed")], got[("na", "en_email")]) < 1e-6
    elif rule.world_attention:  # two regions: each moves beta of the way to what the other sent
        for r, g in (("eu", "na"), ("na", "eu")):
            other = sent.get(g, anchors[g])
            want = [a + rule.config.residual_beta * (o - a) for a, o in zip(anchors[r], other)]
            assert max_abs_diff(result.models[r], want) < 1e-5
    else:  # worldlm: a common backbone, each region's own key layers
        # (the regions' agreed models; members hold personal mixes of them)
        eu, na = result.models["eu"], result.models["na"]
        assert max_abs_diff(rule.split.take_backbone(eu), rule.split.take_backbone(na)) < 1e-6
        if rule.config.residual_attention == "partners":  # each the other's only partner: K moves towards it,
            # beta times the fraction of that step its leader's tune slice supports
            # (without evidence mixing, the whole step)
            assert set(result.steps) == ({"eu", "na"} if rule.residual_step_evidence else set())
            for r, g in (("eu", "na"), ("na", "eu")):
                k_r, k_g = rule.split.take_key(anchors[r]), rule.split.take_key(anchors[g])
                s = result.steps.get(r, 1.0)
                assert 0.0 <= s <= 1.0
                want = [a + s * rule.config.residual_beta * (o - a) for a, o in zip(k_r, k_g)]
                assert max_abs_diff(rule.split.take_key(result.models[r]), want) < 1e-5
                assert max_abs_diff(k_r, k_g) > 1e-5  # (they differed before)
        else:
            assert max_abs_diff(rule.split.take_key(eu), rule.split.take_key(na)) > 1e-5


def test_fedavg_round_under_border_dp_equals_the_pure_function(corpus):
    """fedavg under region-level DP: each region's mean change is clipped and noised at its border
    every round (rounds.flat_round_with_border_dp); every region spends one release per round."""
    dp = PrivacyConfig(border_clip=0.05, border_noise=1.0)
    config = dataclasses.replace(sim_config(corpus, "fedavg", rounds=1), privacy=dp)
    sim = Simulator(config)
    results = sim.run()
    init = get_flat_params(build_model(config.model, vocab_size=259, seed=0))
    peers = {r: [_Rebuilt(config, corpus / r / s) for s in subs] for r, subs in LAYOUT.items()}
    rule = _rule(config, peers["eu"][0].model)
    weights = {r: [round_weight(p.train(H)) for p in members] for r, members in peers.items()}
    groups = {r: ([get_flat_params(p.model) for p in members], weights[r]) for r, members in peers.items()}
    out, _, _, recs = flat_round_with_border_dp(rule, groups, anchor=init, momentum=None, clip=dp.border_clip,
                                                noise_multiplier=dp.border_noise,
                                                generators={r: sim._noise(r, 1) for r in LAYOUT})
    got = _sim_models(sim)
    for r, members in peers.items():
        for p, want in zip(members, out[r]):
            assert max_abs_diff(got[(r, p.label)], want) < 1e-6, (r, p.label)
    acc = BorderAccountant(delta=dp.border_delta)
    acc.record(dp.border_noise)
    assert all(v["epsilon"] == pytest.approx(acc.epsilon()) and v["border_releases"] == 1
               for v in results["regions"].values())
    assert all(rec.norm > dp.border_clip for rec in recs.values())


def test_peer_dp_sgd_reports_each_peers_epsilon(corpus):
    """DP-SGD at every peer: each peer's epsilon in the results is its own accountant's (Opacus RDP,
    its Poisson sampling rate and noise multiplier, one entry per local step); the region's
    peer_epsilon is the largest of its peers'."""
    from opacus.accountants import RDPAccountant

    dp = PrivacyConfig(peer_noise=1.0, peer_clip=1.0)
    config = dataclasses.replace(sim_config(corpus, "worldlm", rounds=1), privacy=dp)
    sim = Simulator(config)
    results = sim.run()
    for p in sim.peers:
        ref = RDPAccountant()
        ref.history = [(1.0, p.trainer.dp.sample_rate, H)]
        want = ref.get_privacy_spent(delta=dp.peer_delta)[0]
        assert results["peers"][p.key]["epsilon"] == pytest.approx(want, rel=1e-6)
    for r, v in results["regions"].items():
        assert v["peer_epsilon"] == max(results["peers"][f"{r}/{s}"]["epsilon"] for s in LAYOUT[r])
        assert v["epsilon"] is None  # no border DP


# ------------------------------------------------------------------------------ bad input

# Runs the CLI's main() once per case in a forked child of one Python process (stderr -> a file, stdout
# -> /dev/null): real exit codes and real stderr as a user sees them, without paying torch's import
# (seconds) once per case.
_FORKED_MAIN = r"""
import json, os, sys, tempfile
import worldlm_p2p.simulate  # the heavy imports, once
from worldlm_p2p.cli.simulate import main
out = {}
for name, argv in json.loads(sys.argv[1]).items():
    with tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            os.dup2(err.fileno(), 2)
            code = 1
            try:
                main(argv)
                code = 0
            except SystemExit as e:
                code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        err.seek(0)
        out[name] = [os.waitstatus_to_exitcode(status), err.read().decode(errors="replace")]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def bad_input(corpus, tmp_path_factory) -> dict[str, tuple[list[str], int, str, Path]]:
    """case -> (needles, exit code, stderr, the --out path that must not appear)."""
    tmp = tmp_path_factory.mktemp("bad")
    (tmp / "bad" / "eu" / "de").mkdir(parents=True)  # a sub-corpus without train.txt
    (tmp / "bad" / "eu" / "de" / "text.txt").write_text("Hallo Welt\n")
    (tmp / "run.toml").write_text("run_id = [\n[model\n")
    # a peer whose valid.txt holds only blank lines: nothing to score it on (refused before training)
    (tmp / "novalid" / "eu" / "de").mkdir(parents=True)
    (tmp / "novalid" / "eu" / "de" / "train.txt").write_text((DEMO / "eu" / "de_news-reviews-wiki" / "train.txt")
                                                            .read_text(encoding="utf-8")[:20000], encoding="utf-8")
    (tmp / "novalid" / "eu" / "de" / "valid.txt").write_text("\n  \n")
    (tmp / "outdir").mkdir()
    out = tmp / "r.json"
    cases = {
        "no-data": (["--data", str(tmp / "nonexistent")], [str(tmp / "nonexistent"), "does not exist"]),
        "bad-layout": (["--data", str(tmp / "bad")], [str(tmp / "bad" / "eu" / "de"), "train.txt"]),
        "no-valid-text": (["--data", str(tmp / "novalid")], [str(tmp / "novalid" / "eu" / "de"), "no validation text"]),
        "rounds-0": (["--rounds", "0"], ["--rounds"]),
        "bogus-strategy": (["--strategy", "bogus"], ["bogus", "strategy"]),
        "out-is-dir": (["--out", str(tmp / "outdir")], [str(tmp / "outdir"), "directory"]),
        "eval-rounds-abc": (["--eval-rounds", "abc"], ["--eval-rounds", "abc"]),
        "run-config-not-toml": (["--run-config", str(tmp / "run.toml")], [str(tmp / "run.toml"), "TOML"]),
    }
    argvs = {name: ["--data", str(corpus), *SIM_FLAGS, "--out", str(out), *extra]  # later flags win
             for name, (extra, _) in cases.items()}
    p = subprocess.run([sys.executable, "-c", _FORKED_MAIN, json.dumps(argvs)], capture_output=True, env=env(),
                       timeout=180, cwd=Path(__file__).parents[2])
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    results = json.loads(p.stdout)
    return {name: (needles, *results[name], out) for name, (_, needles) in cases.items()}


@pytest.mark.parametrize("case", ["no-data", "bad-layout", "no-valid-text", "rounds-0", "bogus-strategy", "out-is-dir",
                                  "eval-rounds-abc", "run-config-not-toml"])
def test_bad_input_fails_with_one_line(bad_input, case):
    needles, code, err, out = bad_input[case]
    assert_one_line_error(code, err, *needles)
    assert not out.exists()


def test_bad_input_in_a_real_process(tmp_path):
    """The same promise without the fork: an error found before the heavy imports."""
    code, _, err = run_cli(["--rounds", "0", "--out", str(tmp_path / "r.json")])
    assert_one_line_error(code, err, "--rounds")


def test_a_diverged_model_has_infinite_perplexity_not_a_crash():
    from worldlm_p2p.simulate import _perplexity, _finite
    from worldlm_p2p.train import bits_per_byte

    # 2 nats/token at 2 bytes/token: 2 / (2 ln 2) bits per byte; no validation bytes: NaN, not a ZeroDivisionError
    assert bits_per_byte(2.0, bytes_per_token=2.0) == pytest.approx(1 / math.log(2))
    assert math.isnan(bits_per_byte(2.0, bytes_per_token=0.0))

    assert _perplexity(1.0) == pytest.approx(math.e)
    assert _perplexity(1e4) == math.inf and _finite({"p": _perplexity(1e4)}) == {"p": None}


def test_evidence_share_reuses_the_last_choices_when_no_search_is_due(corpus):
    """``aggregation.evidence_share``: with a share far below what one round's searches cost, every
    member searches in round 1 (region, world and personal mixes) and takes those choices again in
    rounds 2 and 3 without evaluating its slice; the models then differ from the default's, whose
    every round searches."""
    # the product's tune slice: on TUNE tokens the searches of rounds 2 and 3 choose what round 1 chose,
    # so the models could not tell reuse from searching
    config = sim_config(corpus, rounds=3, world_every=1, evidence_share=1e-4, tune_tokens=2048)
    sim = Simulator(config)
    results = sim.run()
    spent = {p.key: dict(p.budget.spent) for p in sim.peers}
    for key, recs in results["mixes"].items():
        p = next(q for q in sim.peers if q.key == key)
        # what round 1 cost each kind: one tune slice per evaluation (leaders: their residual steps too)
        assert {"region", "world", "personal"} <= set(spent[key])
        assert all(v > 0 and v % p.data.tune.numel() == 0 for v in spent[key].values())
        by_kind: dict = {}
        for m in recs:
            by_kind.setdefault(m["kind"], []).append(m)
        assert set(by_kind) == {"region", "world", "personal"}
        for kind, ms in by_kind.items():
            assert [m["round"] for m in ms] == [1, 2, 3], (key, kind)
            assert not ms[0].get("reused") and all(m.get("reused") for m in ms[1:]), (key, kind)
            for m in ms[1:]:  # the same weights again
                assert m["lam"] == ms[0]["lam"] and m.get("key_lam") == ms[0].get("key_lam")
    default = Simulator(sim_config(corpus, rounds=3, world_every=1, tune_tokens=2048))
    default.run()
    assert all(not m.get("reused") for p in default.peers for m in p.mixes)
    assert all(p.budget.spent[k] > v for p in default.peers for k, v in spent[p.key].items() if k != "leader")
    assert any(max_abs_diff(get_flat_params(a.model), get_flat_params(b.model)) > 0
               for a, b in zip(sim.peers, default.peers))
