"""The swarm and the simulator compute the same thing.

Three real peers of region ``eu`` (CLI processes on 127.0.0.1) each train H steps and hold one region
round; ``worldlm-simulate``'s :class:`~worldlm_p2p.simulate.Simulator`, run in-process on a corpus of
exactly those three sub-corpora with the same manifest and seed, must hold the same models before the
round (same init, same batch streams: ``peer_data_seed(seed, label)``, labels = sub-corpus
names) and after it (the hivemind all-reduce vs. ``weighted_mean``: equal within float rounding,
and each member's evidence mixing on its own tune slice: the same weight).
"""

from __future__ import annotations

import os
import re
import signal
import time
import tomllib

import pytest

from swarm_utils import DEMO, Procs, log_tail, max_abs_diff, round_error, start_bootstrap, start_peer, summary, traces
from worldlm_p2p.config import RunManifest
from worldlm_p2p.simulate import SimConfig, Simulator
from worldlm_p2p.train import get_flat_params

pytestmark = [pytest.mark.network, pytest.mark.slow]  # several peer processes each

REGION = "eu"
SUBS = ("de_news-reviews-wiki", "es_blog-news-reviews-wiki", "fi_mixed")
H = 10
TRAINING = re.compile(r" INFO \S+: training \S+ on ")  # the peer's log line after set-up (progress published)


class _RecordingSimulator(Simulator):
    """The simulator unchanged, plus a copy of every peer's model and of the anchors just before each
    region round (test-only; it overrides the private hook, the computation is the parent's)."""

    def _region_rounds(self, anchors, momenta) -> None:
        self.pre_round = {p.label: get_flat_params(p.model) for p in self.peers}
        self.anchors_before = {k: [t.clone() for t in v] for k, v in anchors.items()}
        super()._region_rounds(anchors, momenta)


def _signal(proc, sig) -> None:
    try:
        os.kill(proc.pid, sig)
    except ProcessLookupError:
        pass


def _start_together(procs: Procs, tmp, maddrs, *, max_steps: int = H, timeout: float = 180) -> dict:
    """Start one peer per sub-corpus and line them up before they train.

    The region barrier waits for every peer whose progress record it sees; a peer whose start-up
    (torch, the DHT, the averager) is slower than the others' H steps would not be seen yet and miss
    the round. So each peer is paused (SIGSTOP) as soon as it logs that it starts training, which it
    does right after publishing its first progress record, and all resume (SIGCONT) together once the
    last one is ready. Only the peer's main process is paused: its DHT process and p2p daemon keep
    answering, so the others' start-up does not wait for timeouts. Bounded: after ``timeout`` they
    resume anyway."""
    peers = {label: start_peer(procs, tmp, maddrs, region=REGION, sub=label, label=label, max_steps=max_steps)
             for label in SUBS}
    paused: set[str] = set()
    deadline = time.monotonic() + timeout
    try:
        while len(paused) < len(peers) and time.monotonic() < deadline:
            for label, proc in peers.items():
                if label in paused:
                    continue
                if proc.poll() is not None:
                    raise AssertionError(f"{label} exited {proc.returncode} during start-up:\n{log_tail(tmp, label)}")
                try:
                    text = (tmp / "logs" / f"{label}.log").read_text(errors="replace")
                except OSError:
                    continue
                if TRAINING.search(text):
                    _signal(proc, signal.SIGSTOP)
                    paused.add(label)
            time.sleep(0.02)
    finally:
        for label in paused:
            _signal(peers[label], signal.SIGCONT)
    if len(paused) < len(peers):
        pytest.fail(f"only {sorted(paused)} of {list(SUBS)} started training within {timeout:.0f}s:\n"
                    + "\n".join(f"--- {label}\n{log_tail(tmp, label)}" for label in SUBS if label not in paused))
    return peers


# (aggregation table, region rounds): the defaults, whose members take backbone partners: each serves
# the backbone change it sent, downloads its two mates', and takes the region's backbone, its pair
# with one mate, or its own half and half with the region's, whichever its tune slice prefers; the
# options that change what a region round computes: partners without the own half, the region's
# backbone for everyone (the defaults until 2026-12-07), the shared model adopting the agreed model
# whole (K included) with K's rows weighted by each member's token counts (counted by the peer from
# its own training text, by the simulator from the same text); and the evidence budget, over two
# rounds: the first searches, the second (its searches over budget) takes the first's weights again,
# in the swarm as in the simulator, with WorldLM's distance attention over K (the default K rule is
# the plain mean)
VARIANTS = {
    "defaults": ("", 1),
    "partners": ("partner_own_half = false", 1),
    "mean-backbone": ('region_backbone = "mean"', 1),
    "agreed-usage": ('shared_model = "agreed"\nusage_rows = true', 1),
    "evidence-budget": ('evidence_share = 0.05\nattention = "distance"', 2),
}


# in CI: the defaults; the options (backbone partners without the own half, the region's backbone, a
# shared model that adopts with K's rows by usage, the evidence budget) with pytest -m extended: their
# pure rounds are in tests/unit (partners' mates with a fake averager:
# tests/unit/test_backbone_partners.py; the budget's reuse of the last weights in the simulator:
# tests/unit/test_simulate.py)
EXTENDED = ("partners", "mean-backbone", "agreed-usage", "evidence-budget")


@pytest.mark.parametrize("variant", [pytest.param(v, marks=pytest.mark.extended) if v in EXTENDED else v
                                     for v in VARIANTS])
def test_one_region_round_in_the_swarm_equals_the_simulator(procs, tmp_path, variant):
    aggregation, n_rounds = VARIANTS[variant]
    last = n_rounds - 1  # the round compared in full (every earlier one shaped its inputs)
    _, maddrs = start_bootstrap(procs, tmp_path, run_id="simeq", inner_steps=H, aggregation=aggregation)
    peers = _start_together(procs, tmp_path, maddrs, max_steps=n_rounds * H)
    for label, proc in peers.items():
        try:
            code = proc.wait(timeout=240 * n_rounds)
        except Exception:
            raise AssertionError(f"{label} did not finish:\n{log_tail(tmp_path, label)}")
        assert code == 0, f"{label} exited {code}:\n{log_tail(tmp_path, label)}"

    # the simulator on exactly these three sub-corpora, with the manifest the bootstrap node published
    corpus = tmp_path / "corpus" / REGION
    corpus.mkdir(parents=True)
    for label in SUBS:
        (corpus / label).symlink_to(DEMO / REGION / label, target_is_directory=True)
    m = RunManifest.from_dict(tomllib.loads((tmp_path / "run.toml").read_text()))
    assert m.aggregation.strategy == "worldlm" and m.train.inner_steps == H
    assert (m.aggregation.shared_model, m.aggregation.usage_rows) == (
        ("agreed", True) if variant == "agreed-usage" else ("evidence", False))
    assert m.aggregation.attention == ("distance" if variant == "evidence-budget" else "mean")
    sim = _RecordingSimulator(SimConfig(data=str(corpus.parent), model=m.model, tokenizer=m.tokenizer, train=m.train,
                                        aggregation=m.aggregation, rounds=n_rounds, device="cpu"))
    results = sim.run()
    assert sorted(p.label for p in sim.peers) == sorted(SUBS)
    assert all((p.usage is not None) == (variant == "agreed-usage") for p in sim.peers)
    sim_post = {p.label: get_flat_params(p.model) for p in sim.peers}
    # the default: every member also holds a personal model, mixed towards its shared one after the round
    sim_personal = {p.label: get_flat_params(p.personal.model) for p in sim.peers if p.personal is not None}
    assert sorted(sim_personal) == sorted(SUBS)

    sums = {label: summary(tmp_path, label) for label in SUBS}
    rounds = {label: traces(tmp_path, label) for label in SUBS}
    for label in SUBS:
        assert sums[label]["steps"] == n_rounds * H
        assert sums[label]["tokens"] == results["peers"][f"{REGION}/{label}"]["tokens"]

    # before the (last) round: the swarm's peers trained exactly as the simulator's (no grouping
    # involved in the first round; every earlier round's result in the others)
    for label in SUBS:
        if last not in rounds[label]:
            continue  # it found no other live peer: reported below
        t = rounds[label][last]
        assert max_abs_diff(t["anchor"], sim.anchors_before[REGION]) < 1e-7, label  # the common init
        err = max_abs_diff(t["pre"], sim.pre_round[label])
        assert err < 1e-6, (label, err)  # in practice 0: same kernels, one thread
        assert t["weight"] == H * m.train.batch_size * m.train.seq_len

    groups = {label: sums[label]["group_sizes"] for label in SUBS}
    if any(g != [3] * n_rounds for g in groups.values()) or any(
            not rounds[label].get(r, {}).get("ok") for label in SUBS for r in range(n_rounds)):
        pytest.fail(f"hivemind did not form one group of all 3 peers (group sizes per peer: {groups}; an overloaded "
                    "machine?), so the swarm's round is not the simulator's 3-peer round. Pre-round models (where traced) were "
                    "equal.\n" + "\n".join(f"--- {label}\n{log_tail(tmp_path, label, 8)}" for label in SUBS))

    # after the round: the all-reduce gave what the simulator's weighted mean gives
    group = [rounds[label][last] for label in SUBS]
    assert {g["label"] for t in group for g in t["gathered"].values()} == set(SUBS)
    for label, t in zip(SUBS, group):
        err = max_abs_diff(t["post"], sim_post[label])
        # if not, say whether the swarm's round at least equals the pure round of its own inputs
        assert err < 1e-5, (label, err, f"swarm vs rounds.region_round on its own inputs: {round_error(group):.2e}")
        assert max_abs_diff(t["agreed"], t["pre"]) > 1e-4  # the round did change the region's model
        # each member's shared model took the agreed backbone and lam of the agreed key layers, and
        # its personal model pre + lam (shared - pre) per part (the backbone's lam, then the key
        # layers'), each lam chosen on its tune slice as in the simulator
        mixes = results["mixes"][f"{REGION}/{label}"]
        region_mixes = [m for m in mixes if m["kind"] == "region"]
        assert len(region_mixes) == n_rounds, label
        rec = region_mixes[last]
        assert t["mix_lam"] == pytest.approx(rec["lam"], abs=1e-6), label
        # a search, or (the evidence budget spent) the last search's weights again: the same in both
        assert bool(t["mix_reused"]) == bool(rec.get("reused")), label
        if variant == "evidence-budget":
            assert not region_mixes[0].get("reused") and rec.get("reused"), label
            assert not rounds[label][0]["mix_reused"] and t["mix_lam"] == rounds[label][0]["mix_lam"], label
        # the backbone it took: the region's, or its pair with the same mate as in the simulator
        assert t["partner"] == rec.get("partner"), (label, t["partner"], rec.get("partner"))
        # (a round that takes its last search's weights again searches no partner: the region's; nor
        # does a shared model that adopts the agreed model)
        assert (t["partner"] is not None) == (variant not in ("mean-backbone", "agreed-usage")
                                              and not rec.get("reused")), label
        # with partners each member's mates served what they sent: with its own, it gives the round's
        # average (every other member served, fp16: the check could tell, and found them honest)
        assert t["served_average"] == ("" if variant in ("mean-backbone", "agreed-usage") else "agrees"), label
        if variant == "agreed-usage":  # the shared model is the agreed one, K included
            assert rec["lam"] == 1 and max_abs_diff(t["post"], t["agreed"]) < 1e-7, label
        personal = [m for m in mixes if m["kind"] == "personal"][last]
        assert "key_lam" in personal
        assert bool(personal.get("reused")) == (variant == "evidence-budget"), label
        err = max_abs_diff(t["personal"], sim_personal[label])
        assert err < 1e-5, (label, err)
    if variant in ("defaults", "partners"):  # (the candidates were tried: with these texts one member takes one)
        assert any(t["partner"] not in (None, "region") for t in group), [t["partner"] for t in group]
    if variant == "agreed-usage":
        # the counts made a difference: the pure round on the swarm's own inputs gives its agreed model
        # with the members' token counts, and a different one without them
        from worldlm_p2p.rounds import region_round_with_anchor

        usage = {p.label: p.usage for p in sim.peers}
        agreed = {}
        for counts in ("with", "without"):
            _, _, agreed[counts] = region_round_with_anchor(
                sim.rule, [t["pre"] for t in group], [t["weight"] for t in group], anchor=group[0]["anchor"],
                momentum=None, usage=[usage[label] for label in SUBS] if counts == "with" else None)
        assert max_abs_diff(group[0]["agreed"], agreed["with"]) < 1e-5
        assert max_abs_diff(group[0]["agreed"], agreed["without"]) > 1e-4
    # and the held-out loss each peer measured at exit is the simulator's, as is the training loss it
    # reports (the held model's last step)
    sim_train = {p.label: p.last_train_loss for p in sim.peers}
    for label in SUBS:
        assert sums[label]["last_train_loss"] == pytest.approx(sim_train[label], abs=1e-5), label
        swarm, simulated = sums[label]["valid_loss"], results["peers"][f"{REGION}/{label}"]["loss"]
        assert abs(swarm - simulated) < 1e-4 * max(1.0, abs(simulated)), (label, swarm, simulated)
