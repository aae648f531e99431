"""WorldLM's world rounds in a real swarm on 127.0.0.1: region leaders elected by lease, world
rounds among leaders (backbone all-reduce, residual embeddings in the DHT, full residuals fetched
peer to peer), members adopting the result, and a killed leader replaced by another; and
``worldlm-monitor`` watching that swarm (every peer and leader listed, the killed peer gone once its
record expires).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from swarm_utils import (REPO, ProgressReader, env, log_tail, max_abs_diff, round_rule, start_bootstrap,
                         start_peer, summary, tune_trainer, wait_for, world_traces)

pytestmark = [pytest.mark.network, pytest.mark.slow]  # several peer processes each

MANY = 100_000  # peers run until stopped
# ... at half speed: four peers that train flat out until the test has seen what it waits for would
# take the test's own work (monitors, the pure functions it compares with) off two cores
SLOWER = ["--slowdown", "2"]
# the failover test runs the world rounds other than the defaults (which the regions-of-one test
# runs): world attention and the significance test of evidence mixing
WORLD_VARIANT_ARGS = dict(world_target="attention", mix_z=2.0)
WORLD_VARIANT = 'world_target = "attention"\nmix_z = 2.0'


def _leaders(reader: ProgressReader) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for label, r in reader.by_label().items():
        if r.leader and not r.finished:
            out.setdefault(r.region, set()).add(label)
    return out


def _monitor(maddrs, *args):
    return subprocess.run([sys.executable, "-m", "worldlm_p2p.cli.monitor", "--initial-peers", *maddrs, *args],
                          capture_output=True, text=True, env=dict(env(), COLUMNS="160"), cwd=REPO, timeout=120)


def test_leaders_world_rounds_and_leader_failover(procs, tmp_path):
    _, maddrs = start_bootstrap(procs, tmp_path, run_id="world", inner_steps=5, averaging="leader_ttl = 10.0",
                                aggregation=f"world_every = 1\nresidual_tau = 1.0\n{WORLD_VARIANT}")
    # the monitor of a run no peer has joined (the peers below join run "world"): a bounded wait, exit
    # code 1, one line (it runs while the peers start)
    nobody = subprocess.Popen([sys.executable, "-m", "worldlm_p2p.cli.monitor", "--initial-peers", *maddrs, "--run-id",
                               "nobody", "--once", "--json", "--wait", "2"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO,
                              env={k: v for k, v in env().items() if k != "WORLDLM_LOGLEVEL"})  # a user's logs
    # each region its own border-DP policy (the leader clips and noises the backbone change it sends)
    policy = {"eu": (0.5, 0.02), "na": (1.0, 0.005)}  # (clip C, noise multiplier sigma)
    dp = {r: ["--region-dp-clip", str(c), "--region-dp-noise", str(n)] for r, (c, n) in policy.items()}
    eu = {lab: start_peer(procs, tmp_path, maddrs, region="eu", sub=sub, label=lab, max_steps=MANY,
                          extra=dp["eu"] + SLOWER)
          for lab, sub in (("eu-a", "de_news-reviews-wiki"), ("eu-b", "fr_blog-news-reviews-wiki"))}
    # na-b also trains with DP-SGD (Opacus): the monitor shows the epsilon it spends
    na = {lab: start_peer(procs, tmp_path, maddrs, region="na", sub=sub, label=lab, max_steps=MANY,
                          extra=dp["na"] + extra + SLOWER)
          for lab, sub, extra in (("na-a", "en_email", []), ("na-b", "en_reviews", ["--peer-dp-noise", "1.0"]))}
    labels = {**{k: "eu" for k in eu}, **{k: "na" for k in na}}
    out, err = nobody.communicate(timeout=120)
    assert nobody.returncode == 1, (out, err)
    assert err.strip().startswith("worldlm-monitor: error: no peer of run 'nobody' found"), err
    assert len(err.strip().splitlines()) == 1
    reader = ProgressReader(maddrs, "world")
    try:
        # a world round led by one leader per region ...
        def common_world_round():
            by_w: dict[int, list[str]] = {}
            for lab in labels:
                for k in world_traces(tmp_path, lab, leader=True):
                    by_w.setdefault(k, []).append(lab)
            for k in sorted(by_w):
                if sorted(labels[lab] for lab in by_w[k]) == ["eu", "na"]:
                    return k, sorted(by_w[k], key=labels.get)
            return None

        try:
            w, (eu_leader, na_leader) = wait_for(common_world_round, 240, "a world round led by both leaders")
        except AssertionError:
            raise AssertionError("\n".join(f"--- {lab}\n{log_tail(tmp_path, lab, 8)}" for lab in labels))
        # ... the leaders the whole swarm sees in the progress records (peers agree once the
        # candidacy records have spread; at start-up every peer briefly sees only itself)
        wait_for(lambda: _leaders(reader) == {"eu": {eu_leader}, "na": {na_leader}}, 60,
                 f"every peer to see {eu_leader} and {na_leader} as the leaders")
        te, tn = world_traces(tmp_path, eu_leader, leader=True)[w], world_traces(tmp_path, na_leader, leader=True)[w]
        assert te["regions"] == tn["regions"] == ["eu", "na"]
        rule = round_rule("worldlm", world_every=1, residual_tau=1.0, **WORLD_VARIANT_ARGS)
        assert rule.world_attention and rule.windowed
        split = rule.split
        if not rule.world_attention:
            # the shared backbone: both regions leave the world round with the same B ...
            assert max_abs_diff(split.take_backbone(te["model"]), split.take_backbone(tn["model"])) < 1e-5
            # ... and each keeps its own key layers
            assert max_abs_diff(split.take_key(te["model"]), split.take_key(tn["model"])) > 1e-4
        else:  # each region moves residual_beta of the way to what the other sent (its only partner)
            for t, o in ((te, tn), (tn, te)):
                want = [s + rule.config.residual_beta * (x - s) for s, x in zip(t["snapshot"], o["sent"])]
                assert max_abs_diff(t["model"], want) < 1e-4
        # what each leader sent is its region's snapshot with the backbone change since the last world
        # model clipped to its own policy's C and noised with sigma*C (recomputed from the noise seed
        # its audit trace kept): the part that leaves, without the noise, has norm <= C
        from worldlm_p2p.privacy import gaussian_noise, l2_norm
        from worldlm_p2p.rounds import border_release, border_shared, hand_down, world_round

        for region, t in (("eu", te), ("na", tn)):
            clip, sigma = policy[region]
            assert (t["clip"], t["noise"]) == (clip, sigma)
            want, rec = border_release(rule, t["snapshot"], t["reference"], clip=clip, noise_multiplier=sigma,
                                       generator=torch.Generator().manual_seed(t["noise_seed"]))
            assert max_abs_diff(t["sent"], want) == 0.0, region
            shared = border_shared(rule)
            noise = gaussian_noise([t["snapshot"][i] for i in shared], sigma * clip,
                                   torch.Generator().manual_seed(t["noise_seed"]))
            leaving = [t["sent"][i] - t["reference"][i] - n for i, n in zip(shared, noise)]
            assert l2_norm(leaving) <= clip * (1 + 1e-4) and rec.clipped_norm <= clip, (region, l2_norm(leaving))
            assert all(torch.equal(t["sent"][i], t["snapshot"][i].float()) for i in split.key)  # K stays home
        # the network result is the pure world round on what the leaders sent, their snapshots and tokens
        ref = world_round(rule, {"eu": te["snapshot"], "na": tn["snapshot"]}, {"eu": te["tokens"], "na": tn["tokens"]},
                          sent={"eu": te["sent"], "na": tn["sent"]})
        assert max_abs_diff(te["model"], ref.models["eu"]) < 1e-4
        assert max_abs_diff(tn["model"], ref.models["na"]) < 1e-4
        assert te["fetched"] == ref.fetched["eu"] and tn["fetched"] == ref.fetched["na"]

        # members adopt exactly the leader's change of the region model (any eu member, any world
        # round both leaders led)
        # (compared with the world trace of the leader the change came from: during a change of
        # leadership two eu peers may both have led that world round)
        def adopted():
            for member in (lab for lab in eu if lab != eu_leader):
                for k, t in world_traces(tmp_path, member, leader=False).items():
                    for lab in eu:
                        lead = world_traces(tmp_path, lab, leader=True).get(k)
                        if lead is not None and lead["peer_id"] == t["leader"]:
                            return member, k, t, lead
            return None

        member, k, t, lead = wait_for(adopted, 120, "an eu member to adopt a world round of an eu leader")
        # the change as the leader hands it down (rounds.hand_down: in fp16 numbers, the default codec),
        # bit for bit what the member received
        want = hand_down(rule, lead["model"], lead["snapshot"])
        assert max_abs_diff(t["delta"], want) == 0.0, (member, k, lead["label"])
        assert max_abs_diff(want, [m.float() - s for m, s in zip(lead["model"], lead["snapshot"])]) < 1e-4
        # ... and takes of it what the simulator's member would: the same pure function
        # (rounds.member_world_mix) on the same inputs, its model before, the change and its own tune
        # slice (rebuilt here from its data file), gives the same weight and the same model
        from worldlm_p2p.rounds import member_world_mix

        trainer = tune_trainer(tmp_path, dict(eu)[member].args, rule)
        model, choice = member_world_mix(rule, own=t["before"], change=t["delta"],
                                         loss_of=trainer.tune_losses if rule.windowed else trainer.tune_loss)
        assert choice is not None and 0.0 <= choice.lam <= 1.0 and choice.lam == pytest.approx(t["mix_lam"], abs=1e-5)
        assert max_abs_diff(t["after"], model) < 1e-5, (member, k, choice)

        # the monitor lists every peer with its region, and, in each region, a leader that the peers
        # themselves report (leases can move under load, and a peer's progress record says so only at
        # its next publication: the monitor's leader is one the peers named just before or just after)
        seen: list = []

        def led(older_than: float = float("inf")) -> dict[str, list[int]]:
            """The world rounds each peer has led (one trace each, written after its release), of
            those traced before ``older_than`` (wall-clock time)."""
            return {lab: sorted(int(p.name[len(lab) + 7:].split("-")[0])
                                for p in (tmp_path / "trace").glob(f"{lab}-world-*-leader.pt")
                                if p.stat().st_mtime < older_than) for lab in labels}

        def monitor_agrees():
            before = _leaders(reader)
            # releases whose peer has since published a progress record (every 2 s) for sure
            led_before = led(older_than=time.time() - 5.0)
            r = _monitor(maddrs, "--once", "--json")  # the run id is found from the manifest
            assert r.returncode == 0, r.stderr
            snap = json.loads(r.stdout)
            after = _leaders(reader)
            snap["_led"] = (led_before, led())
            leaders = {reg: v["leader_label"] for reg, v in snap["regions"].items()}
            # (and every peer listed: a record published late under load is listed a moment later)
            listed = {reg: {p["label"] for p in v["peers"]} for reg, v in snap["regions"].items()}
            seen.append((before, leaders, after, listed))
            agree = set(leaders) == {"eu", "na"} and all(
                lab is not None and lab in before.get(reg, set()) | after.get(reg, set())
                for reg, lab in leaders.items()) and listed == {"eu": set(eu), "na": set(na)}
            # (and the DP-SGD peer has taken its first step: under load its Opacus start can lag
            # the first world rounds, and a record of no step spends epsilon 0)
            agree = agree and any(p["label"] == "na-b" and (p["epsilon"] or 0) > 0
                                  for p in snap["regions"]["na"]["peers"])
            return snap if agree else None

        try:
            snap = wait_for(monitor_agrees, 120, "the monitor's leaders to match the peers' own view", poll=0)
        except AssertionError as e:  # say what each side saw (peers before, monitor, peers after)
            raise AssertionError(f"{e}: {seen[-4:]}\n" + "\n".join(f"--- {lab}\n{log_tail(tmp_path, lab, 12)}"
                                                                for lab in labels)) from None
        assert snap["run_id"] == "world" and snap["manifest"]["strategy"] == "worldlm"
        assert {reg: {p["label"] for p in v["peers"]} for reg, v in snap["regions"].items()} == \
            {"eu": set(eu), "na": set(na)}
        assert all(p["region"] == reg for reg, v in snap["regions"].items() for p in v["peers"])
        assert all(sum(p["leader"] for p in v["peers"]) == 1 for v in snap["regions"].values())
        assert snap["totals"]["peers"] == 4 and snap["totals"]["regions"] == 2
        eps = {p["label"]: p["epsilon"] for v in snap["regions"].values() for p in v["peers"]}
        assert eps["na-b"] > 0 and all(e is None for lab, e in eps.items() if lab != "na-b"), eps
        assert snap["regions"]["na"]["epsilon"] == eps["na-b"] and snap["regions"]["eu"]["epsilon"] is None
        # each region's border epsilon: its accountant after the releases it reports at its own sigma,
        # exactly; and that count is what happened: at least the world rounds one of the region's peers
        # had led before the monitor ran (each a release), at most one per world round started by the
        # time it finished (a leader's releases are one per world round; members adopt a leader's count)
        from worldlm_p2p.privacy import BorderAccountant

        led_before, led_after = snap.pop("_led")
        for region, (_, sigma) in policy.items():
            reg = snap["regions"][region]
            n = reg["border_releases"]
            acc = BorderAccountant(delta=1e-5)
            acc.record(sigma, n)
            assert reg["border_epsilon"] == pytest.approx(acc.epsilon(), rel=1e-9), (region, reg)
            ours = [lab for lab in labels if labels[lab] == region]
            lo = max(len(led_before[lab]) for lab in ours)
            hi = max((max(led_after[lab]) for lab in ours if led_after[lab]), default=-1) + 2  # + one in flight
            assert n >= 1 and lo <= n <= hi, (region, n, lo, hi)
        eu_leader = snap["regions"]["eu"]["leader_label"]  # the one to kill next

        # kill the eu leader: another eu peer takes the lease and leads later world rounds
        os.kill(eu[eu_leader].pid, signal.SIGKILL)
        new = wait_for(lambda: (lambda ls: next(iter(ls.get("eu", ())), None)
                                if ls.get("eu") and eu_leader not in ls["eu"] else None)(_leaders(reader)),
                       60, "a new eu leader")
        assert new != eu_leader and labels[new] == "eu"
        wait_for(lambda: any(k > w for k in world_traces(tmp_path, new, leader=True)), 240,
                 f"a world round led by the new eu leader {new}")
        assert na_leader in _leaders(reader).get("na", set())
        # the killed leader leaves the monitor once its progress record expires (15 s); the live view
        # renders the others, with the new leader
        wait_for(lambda: eu_leader not in reader.by_label(), 60, f"{eu_leader}'s progress record to expire")
        r = _monitor(maddrs, "--run-id", "world", "--once")
        assert r.returncode == 0, r.stderr
        assert eu_leader not in r.stdout and all(lab in r.stdout for lab in labels if lab != eu_leader), r.stdout
        assert f"leader {new} (" in r.stdout and "3 peers online in 2 regions" in r.stdout, r.stdout
        assert "ε" in r.stdout, r.stdout  # the DP-SGD peer's privacy budget has a column
        # the monitors never joined a group: no region round ever had more members than its region's peers
        assert all(rec.last_group_size <= {"eu": 2, "na": 2}[rec.region] for rec in reader.by_label().values())
    finally:
        reader.close()
    for lab, p in {**eu, **na}.items():
        if lab != eu_leader:
            p.send_signal(signal.SIGTERM)
    for lab, p in {**eu, **na}.items():
        if lab != eu_leader:
            assert p.wait(timeout=90) == 0, f"{lab}:\n{log_tail(tmp_path, lab)}"


@pytest.mark.extended  # in CI: tests/network/test_internet.py's single-peer region leads and adopts world rounds
@pytest.mark.parametrize("world_codec,residual_attention", [("none", "world"), ("fp16", "world"), ("fp16", "partners")])
def test_regions_of_one_peer_take_part_in_world_rounds(procs, tmp_path, world_codec, residual_attention):
    """One peer per region (a region of one is still a region, as in the simulator): each peer is
    its region's leader and its model the region's; they run world rounds together, the network
    result is the pure world round on their models, and each takes of the world's change what its
    own tune slice supports (rounds.member_world_mix on the same inputs). ``fp16``: the leaders'
    models travel in fp16 (``aggregation.compress_world``), and the pure round says so too.
    ``partners``: each leader's only partner is the other region, whose full residual it fetches
    over P2P and moves its K towards."""
    _, maddrs = start_bootstrap(procs, tmp_path, run_id="ones", inner_steps=5,
                                aggregation=f'compress_world = "{world_codec}"\nresidual_attention = "{residual_attention}"')
    peers = {lab: start_peer(procs, tmp_path, maddrs, region=region, sub=sub, label=lab, max_steps=MANY)
             for lab, region, sub in (("eu-a", "eu", "de_news-reviews-wiki"), ("na-a", "na", "na/en_email"))}

    def done():  # a world round both led, adopted by both
        led = [set(world_traces(tmp_path, lab, leader=True)) for lab in peers]
        took = [set(world_traces(tmp_path, lab, leader=False)) for lab in peers]
        common = set.intersection(*led, *took)
        return (min(common),) if common else None  # (a tuple: world round 0 is a valid answer)

    try:
        (w,) = wait_for(done, 180, "a world round led and adopted by both regions of one")
    except AssertionError:
        raise AssertionError("\n".join(f"--- {lab}\n{log_tail(tmp_path, lab, 10)}" for lab in peers))
    from worldlm_p2p.rounds import hand_down, member_world_mix, world_round

    rule = round_rule("worldlm", compress_world=world_codec, residual_attention=residual_attention)
    lead = {lab: world_traces(tmp_path, lab, leader=True)[w] for lab in peers}
    assert all(t["regions"] == ["eu", "na"] for t in lead.values())
    if residual_attention == "partners":  # each fetched the other's residual
        assert lead["eu-a"]["fetched"] == ["na"] and lead["na-a"]["fetched"] == ["eu"], {k: t["fetched"] for k, t in lead.items()}
    trainers = {lab: tune_trainer(tmp_path, proc.args, rule) for lab, proc in peers.items()}
    loss_of = {lab: tr.tune_losses if rule.windowed else tr.tune_loss for lab, tr in trainers.items()}
    # (partners: each leader scales its K's step by its own tune slice, rebuilt here from its data file)
    ref = world_round(rule, {"eu": lead["eu-a"]["snapshot"], "na": lead["na-a"]["snapshot"]},
                      {"eu": lead["eu-a"]["tokens"], "na": lead["na-a"]["tokens"]},
                      leader_loss={"eu": loss_of["eu-a"], "na": loss_of["na-a"]})
    assert max_abs_diff(lead["eu-a"]["model"], ref.models["eu"]) < 1e-4
    assert max_abs_diff(lead["na-a"]["model"], ref.models["na"]) < 1e-4
    if residual_attention == "partners":
        assert {r: lead[lab]["residual_step"] for r, lab in (("eu", "eu-a"), ("na", "na-a"))} == \
            pytest.approx(ref.steps, abs=1e-4)
    else:
        assert ref.steps == {} and all("residual_step" not in t for t in lead.values())
    if world_codec == "fp16":  # the leaders' mean, as it travelled: every value an fp16 number
        backbone = rule.split.take_backbone(lead["eu-a"]["model"])
        assert all(torch.equal(t.float(), t.half().float()) for t in backbone)
    for lab, proc in peers.items():
        t = world_traces(tmp_path, lab, leader=False)[w]
        change = hand_down(rule, lead[lab]["model"], lead[lab]["snapshot"])
        assert max_abs_diff(t["delta"], change) == 0.0, lab  # its own leadership's change, as handed down
        model, choice = member_world_mix(rule, own=t["before"], change=t["delta"], loss_of=loss_of[lab])
        assert choice.lam == pytest.approx(t["mix_lam"], abs=1e-5) and max_abs_diff(t["after"], model) < 1e-5, lab
    for p in peers.values():
        p.send_signal(signal.SIGTERM)
    for lab, p in peers.items():
        assert p.wait(timeout=90) == 0, f"{lab}:\n{log_tail(tmp_path, lab)}"
    # neither ever held a region round: each was alone in its region
    assert all(summary(tmp_path, lab)["rounds_completed"] == 0 for lab in peers)
    assert all(summary(tmp_path, lab)["world_rounds_led"] >= 1 for lab in peers)
