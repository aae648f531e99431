"""Helpers for network tests: real CLI processes on 127.0.0.1, bounded waits, guaranteed cleanup."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from fast_run import fast_run as _fast_run  # noqa: E402
from fast_run import peer_env, stop_all, wait_for  # noqa: E402,F401 (wait_for: the tests import it from here)

DEMO = REPO / "worldlm_p2p" / "demo_data"
LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def env() -> dict[str, str]:
    return peer_env()


class Procs:
    """Tracks started processes; ``close()`` kills their whole process groups (p2pd included)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, args: list[str], log: Path | None = None, **kw) -> subprocess.Popen:
        out = open(log, "wb") if log else subprocess.PIPE
        p = subprocess.Popen([sys.executable, "-m", *args], stdout=out, stderr=subprocess.STDOUT if log else
                             subprocess.PIPE, env=env(), start_new_session=True, cwd=REPO, **kw)
        self.procs.append(p)
        return p

    def start_script(self, argv: list[str], log: Path) -> subprocess.Popen:
        """Start a command line (not a module) the same way, its output to ``log``."""
        p = subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env(), start_new_session=True,
                             cwd=REPO)
        self.procs.append(p)
        return p

    def close(self) -> None:
        stop_all(self.procs)




#: the tests' tune slice: at most this many tokens (the product's 2048 would make the members' evidence
#: searches, several evaluations of the slice per round, most of a test peer's work; what the tests
#: check of them does not depend on the slice's size)
TUNE_TOKENS = 256


def fast_run(run_id: str = "t", inner_steps: int = 5, averaging: str = "", aggregation: str = "") -> str:
    """The loopback manifest of the swarm benchmarks (``benchmarks/fast_run.py``) with the tests'
    barrier timeout, evaluation size and tune slice; ``averaging``/``aggregation``: extra TOML lines."""
    return _fast_run(run_id=run_id, inner_steps=inner_steps, barrier_timeout=30.0, averaging=averaging,
                     aggregation=f"tune_tokens = {TUNE_TOKENS}\n{aggregation}", eval_tokens=2048)


def start_bootstrap(procs: Procs, tmp: Path, *, run_id: str = "t", inner_steps: int = 5,
                    timeout: float = 60, averaging: str = "", aggregation: str = "",
                    tables: str = "", extra: list[str] = ()) -> tuple[subprocess.Popen, list[str]]:
    """``tables``: more TOML tables of the manifest (e.g. ``[admission.regions]``); ``extra``: more
    flags. Its log goes to ``tmp/logs/bootstrap.log``."""
    run = tmp / "run.toml"
    run.write_text(fast_run(run_id, inner_steps, averaging, aggregation) + "\n" + tables)
    p = procs.start(["worldlm_p2p.cli.bootstrap", "--run-config", str(run), "--host-maddrs", LOOPBACK, *extra])
    line = p.stdout.readline().decode()
    maddrs = [t for t in line.split() if "/p2p/" in t]
    assert maddrs, f"bootstrap printed {line!r}"
    import threading

    (tmp / "logs").mkdir(exist_ok=True)
    log = open(tmp / "logs" / "bootstrap.log", "ab", buffering=0)

    def keep_log() -> None:
        with log:
            for raw in iter(p.stdout.readline, b""):
                log.write(raw)

    threading.Thread(target=keep_log, daemon=True).start()
    threading.Thread(target=lambda: [None for _ in iter(p.stderr.readline, b"")], daemon=True).start()
    return p, maddrs


def start_peer(procs: Procs, tmp: Path, maddrs: list[str], *, region: str, sub: str, label: str,
               max_steps: int, extra: list[str] = ()) -> subprocess.Popen:
    """``sub``: a demo sub-corpus as ``<region>/<name>`` or, for the peer's own region, ``<name>``."""
    (tmp / "logs").mkdir(exist_ok=True)
    args = ["worldlm_p2p.cli.peer", "--region", region, "--data", str(DEMO / sub if "/" in sub else DEMO / region / sub), "--label", label,
            "--initial-peers", *maddrs, "--max-steps", str(max_steps), "--threads", "1",
            "--summary", str(tmp / f"{label}.json"), "--trace-dir", str(tmp / "trace"), *extra]
    return procs.start(args, log=tmp / "logs" / f"{label}.log")


def exit_ok(proc: subprocess.Popen, tmp: Path, label: str, timeout: float = 240) -> None:
    """``proc`` (the peer ``label``) exits with 0 within ``timeout`` seconds; else its log's tail."""
    try:
        code = proc.wait(timeout=timeout)
    except Exception:
        raise AssertionError(f"{label} did not finish:\n{log_tail(tmp, label)}")
    assert code == 0, f"{label} exited {code}:\n{log_tail(tmp, label)}"


def summary(tmp: Path, label: str) -> dict:
    return json.loads((tmp / f"{label}.json").read_text())


def trace(tmp: Path, label: str, name: str) -> dict:
    return torch.load(tmp / "trace" / f"{label}-{name}.pt", weights_only=False)


def traces(tmp: Path, label: str) -> dict[int, dict]:
    out = {}
    for p in sorted((tmp / "trace").glob(f"{label}-round-*.pt")):
        out[int(p.stem.rsplit("-", 1)[1])] = torch.load(p, weights_only=False)
    return out


def log_tail(tmp: Path, label: str, n: int = 15) -> str:
    try:
        return "\n".join((tmp / "logs" / f"{label}.log").read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def admit(tmp: Path, *, run_id: str, region: str, labels: list[str]) -> tuple[str, dict[str, list[str]]]:
    """A region key for ``region`` and, per label, an identity and a certificate for it: returns the
    manifest's ``[admission.regions]`` table and, per label, the worldlm-peer flags that present them."""
    from hivemind.utils.crypto import RSAPrivateKey

    from worldlm_p2p.net.admission import issue, peer_id_of, public_key_text
    from worldlm_p2p.net.dht import ensure_identity

    region_key = RSAPrivateKey()
    flags = {}
    for label in labels:
        identity = tmp / f"{label}.key"
        key = ensure_identity(identity)
        cert = issue(region_key, run_id=run_id, region=region, peer_id=peer_id_of(key.get_public_key()),
                     expires=time.time() + 3600)
        cert.save(tmp / f"{label}.cert")
        flags[label] = ["--identity", str(identity), "--certificate", str(tmp / f"{label}.cert")]
    return f'[admission.regions]\n{region} = "{public_key_text(region_key)}"\n', flags


def max_abs_diff(xs, ys) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(xs, ys))


def ProgressReader(maddrs: list[str], run_id: str):
    """The library's reader of a run's records (:class:`worldlm_p2p.net.reader.RunReader`), without
    the manifest: ``by_label()``, ``progress()``, ``close()``."""
    from worldlm_p2p.net.reader import RunReader

    return RunReader(initial_peers=maddrs, run_id=run_id, manifest=False)


def group_of(tmp: Path, label: str, r: int) -> list[dict]:
    """The traces of every member of the group that ``label`` averaged with in its round ``r``
    (members are matched by the round index each one sent in its gather metadata)."""
    t = traces(tmp, label)[r]
    return [torch.load(tmp / "trace" / f"{m['label']}-round-{m['round']:05d}.pt", weights_only=False)
            for m in t["gathered"].values()]


def round_rule(strategy: str = "worldlm", **aggregation):
    """The round rule a peer of a fast_run manifest uses (the tiny model's parameter names)."""
    import tomllib

    from worldlm_p2p.config import RunManifest
    from worldlm_p2p.rounds import RoundRule
    from worldlm_p2p.split import split_parameters
    from worldlm_p2p.train import build_model

    data = tomllib.loads(fast_run("x", 5))
    data["aggregation"] = dict(strategy=strategy, **aggregation)
    m = RunManifest.from_dict(data)
    names = [n for n, _ in build_model(m.model, vocab_size=259, seed=0).named_parameters()]
    return RoundRule.from_config(m.aggregation, split_parameters(names, m.aggregation.key_layers), seed=m.train.seed)


def round_lost(group: list[dict]) -> list[str]:
    """Why a round was partial on some member's side (its trace's ``lost``: a sender one of the
    reducers averaged without, a peer that waited and was not in the group): such a round's members
    hold what their reducers computed from what arrived, not the pure round of every member."""
    return [f"{t.get('label', '?')}: {why}" for t in group for why in (t.get("lost") or [])]


def round_diagnosis(group: list[dict]) -> str:
    """Per member, what could make a round differ from the pure one: its anchor's distance to the
    first member's, the world round it had adopted, its mixing choice, what it lost."""
    a0 = group[0]["anchor"]
    rows = []
    for t in group:
        g = next((m for m in t.get("gathered", {}).values() if isinstance(m, dict) and m.get("label") == t.get("label")), {})
        rows.append(f"{t.get('label', '?')}: anchor {max_abs_diff(t['anchor'], a0):.2e} from the first, "
                    f"world {g.get('world')}, mix {t.get('mix_lam')}, lost {t.get('lost')}")
    return "; ".join(rows)


def mixed_by_evidence(rule, pre, target, *, lam, key_lam) -> list:
    """``pre + w (target - pre)`` per tensor, with the weights a member's trace records by the
    rule's personal scope: ``"parts"``, ``lam`` on the backbone and ``key_lam`` on K; ``"key"``, the
    target's backbone and ``lam`` on K; ``"all"``, ``lam`` everywhere (a missing weight: 0)."""
    lam, key_lam = float(lam or 0.0), float(key_lam or 0.0)
    key = set(rule.split.key)
    if rule.mixes_by_part:
        w = [key_lam if i in key else lam for i in range(len(pre))]
    elif rule.personal_key_only:
        w = [lam if i in key else 1.0 for i in range(len(pre))]
    else:
        w = [lam] * len(pre)
    return [(p.double() + x * (q.double() - p.double())).to(p.dtype) for p, q, x in zip(pre, target, w)]


def partner_target_of(rule, t: dict, group: list[dict], agreed: list) -> list:
    """What member ``t`` of a region round's ``group`` (their traces) moved towards: the region's
    agreed model, or with backbone partners (:attr:`worldlm_p2p.rounds.RoundRule.backbone_partners`)
    the candidate its trace names (``partner``), rebuilt by :func:`worldlm_p2p.rounds.partner_candidates`
    from what each member sent (:func:`worldlm_p2p.rounds.sent_backbone` of its pre-round model),
    with the agreed key layers. The choice itself is the simulator equivalence test's subject."""
    from worldlm_p2p.rounds import REGION_CANDIDATE, partner_candidates, region_payload, sent_backbone

    name = t.get("partner")
    if not rule.backbone_partners or name in (None, REGION_CANDIDATE):
        return agreed

    def sent(x: dict) -> list:
        return sent_backbone(rule, region_payload(rule, x["pre"], x["anchor"]))

    mates = {m["label"]: sent(m) for m in group if m["label"] == name and m is not t}
    candidates = partner_candidates(rule, anchor=t["anchor"], own=sent(t), mates=mates, agreed=agreed)
    assert name in candidates, (t["label"], name, sorted(candidates))
    return rule.split.merge(candidates[name], rule.split.take_key(agreed))


def round_error(group: list[dict], rule=None) -> float:
    """Largest distance between a member's post-round model and what the pure round function
    (:func:`worldlm_p2p.rounds.region_round_with_anchor`) computes centrally from the members'
    pre-round models, weights and common anchor (0 when the all-reduce delivered every part to every
    member); for an overlapped round (``current`` in the trace: the model when the result was
    applied), that result plus the progress made meanwhile (:func:`worldlm_p2p.rounds.stale_apply`). With evidence mixing, a member keeps ``pre + lam (agreed - pre)`` with the weights it
    chose on its own tune slice, per part (:func:`mixed_by_evidence`) (in its trace; the choice itself is the simulator tests' subject),
    and its agreed model must be the central one too."""
    from worldlm_p2p.rounds import region_round_with_anchor, stale_apply

    rule = rule or round_rule()
    refs, _, agreed = region_round_with_anchor(rule, [t["pre"] for t in group], [t["weight"] for t in group],
                                               anchor=group[0]["anchor"], momentum=None)
    errors = []
    for t, ref in zip(group, refs):
        if rule.evidence:
            target = partner_target_of(rule, t, group, agreed)
            ref = mixed_by_evidence(rule, t["pre"], target, lam=t.get("mix_lam"), key_lam=t.get("mix_key_lam"))
            if t.get("agreed") is not None:
                errors.append(max_abs_diff(t["agreed"], agreed))
        if t.get("current") is not None:  # an overlapped round: applied one round stale
            ref = stale_apply(ref, pre=t["pre"], current=t["current"])
        errors.append(max_abs_diff(t["post"], ref))
    return max(errors)


def process_group(pgid: int) -> list[str]:
    """Live processes (not zombies) of a process group, as 'pid command' lines."""
    out = subprocess.run(["ps", "-eo", "pgid=,pid=,stat=,comm="], capture_output=True, text=True).stdout
    rows = [line.split(None, 3) for line in out.splitlines()]
    return [f"{r[1]} {r[3]}" for r in rows if len(r) == 4 and r[0] == str(pgid) and not r[2].startswith("Z")]


def descendants(pid: int) -> dict[int, str]:
    """Every live process below ``pid`` (children, their children, ...: hivemind's DHT and averager
    and the p2p daemon, which runs in a session of its own), as {pid: command}."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,stat=,comm="], capture_output=True, text=True).stdout
    rows = [line.split(None, 3) for line in out.splitlines()]
    live = {int(r[0]): (int(r[1]), r[3]) for r in rows if len(r) == 4 and not r[2].startswith("Z")}
    found, frontier = {}, {pid}
    while frontier:
        frontier = {p for p, (ppid, _) in live.items() if ppid in frontier and p not in found}
        found.update({p: live[p][1] for p in frontier})
    return found


def alive(pids) -> list[int]:
    """Those of ``pids`` that are still live processes (not zombies)."""
    out = subprocess.run(["ps", "-eo", "pid=,stat="], capture_output=True, text=True).stdout
    live = {int(r[0]) for r in (line.split() for line in out.splitlines()) if len(r) == 2 and not r[1].startswith("Z")}
    return sorted(set(pids) & live)


def world_traces(tmp, label: str, *, leader: bool) -> dict[int, dict]:
    """A peer's world-round traces by world round: as the leader that ran it, or as a member adopting it."""
    out = {}
    suffix = "-leader" if leader else ""
    for p in sorted((tmp / "trace").glob(f"{label}-world-*{suffix}.pt")):
        stem = p.stem[len(label) + len("-world-"):]
        if leader != stem.endswith("-leader"):
            continue
        out[int(stem.split("-")[0])] = torch.load(p, weights_only=False)
    return out


def tune_trainer(tmp, argv, rule):
    """A trainer over the tune slice a peer started with ``argv`` holds apart (rebuilt from its data
    file and the run manifest), to recompute its mixing choices."""
    import tomllib

    from worldlm_p2p.config import RunManifest
    from worldlm_p2p.train import (ByteTokenizer, LocalTrainer, build_model, hold_out_tune, load_texts,
                                   tokenize_splits)

    m = RunManifest.from_dict(tomllib.loads((tmp / "run.toml").read_text()))
    agg, tok = m.aggregation, ByteTokenizer()
    data = tokenize_splits(load_texts(argv[argv.index("--data") + 1]), tok)
    data = hold_out_tune(data, fraction=agg.tune_fraction, max_tokens=agg.tune_tokens, seq_len=m.train.seq_len,
                         eos_id=tok.eos_id, pieces=agg.tune_pieces)
    assert rule.evidence and data.tune.numel() > 0
    return LocalTrainer(model=build_model(m.model, vocab_size=tok.vocab_size, seed=m.train.seed), train=m.train,
                        data=data, device=torch.device("cpu"), seed=0)
