"""The data of a report (:mod:`worldlm_p2p.report`): curves and region rows, and how they are read
from a ``worldlm-swarm`` summary and from ``worldlm-simulate`` results (see that module's docstring)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from worldlm_p2p.errors import DataError
from worldlm_p2p.strategies import STRATEGIES

logger = logging.getLogger(__name__)

SWARM, SIMULATE = "swarm", "simulate"
Y_LABELS = {SWARM: "train loss (nats/token)", SIMULATE: "held-out loss (nats/token)"}
X_LABEL = "tokens trained by the region"
WORLD_MARK = "first point after a world round"


@dataclass(frozen=True, kw_only=True, slots=True)
class Curve:
    """Loss against tokens for one region of one series (a strategy or a variant)."""

    region: str
    strategy: str
    tokens: tuple[float, ...]
    loss: tuple[float, ...]
    world_rounds: tuple[float, ...] = ()  # x of the points where the region's world round increased (swarm)


@dataclass(frozen=True, kw_only=True, slots=True)
class RegionRow:
    """One row of the Markdown summary: a region's final values in one series.

    ``loss``/``perplexity``: held-out (simulate: the results' region values, perplexity = mean of
    the peers' perplexities; swarm: the mean of the peers' final ``valid_loss`` and its exp).
    ``train_loss``: swarm only, the last point of the region's curve (the peers' last
    ``last_train_loss`` when the region has no curve)."""

    region: str
    strategy: str
    peers: int
    tokens: float
    loss: float | None
    perplexity: float | None
    bits_per_byte: float | None = None
    train_loss: float | None = None
    failed: int = 0  # swarm: peers that exited with a non-zero code or wrote no summary
    rounds_completed: tuple[int, int] | None = None  # (min, max) over the region's peers
    world_rounds_adopted: tuple[int, int] | None = None
    bytes_sent: int | None = None  # region and border traffic of the region's peers, summed


@dataclass(frozen=True, kw_only=True, slots=True)
class Series:
    """One source's (or one bundle variant's) curves and rows."""

    name: str
    strategy: str
    source: str
    about: str  # one line: what the source is
    setting: str = ""  # short, for a title: "run demo, model tiny, H=15"
    curves: tuple[Curve, ...]
    rows: tuple[RegionRow, ...]
    world: Mapping[str, float | None] = field(default_factory=dict)  # simulate: the world (mean of regions) values
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class Report:
    kind: str  # SWARM or SIMULATE
    title: str
    series: tuple[Series, ...]

    @property
    def curves(self) -> list[Curve]:
        return [c for s in self.series for c in s.curves]

    @property
    def regions(self) -> list[str]:
        seen: dict[str, None] = {}
        for s in self.series:
            for r in s.rows:
                seen.setdefault(r.region)
        return list(seen)


# ---------------------------------------------------------------------------------------------- helpers


def _num(value: Any) -> float | None:
    """A finite number, else None (NaN is written as null by simulate, as NaN by the swarm)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _mean(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _exp(value: float | None) -> float | None:
    if value is None:
        return None
    try:
        return math.exp(value)
    except OverflowError:
        return math.inf


def _region_order(regions: Iterable[str], preferred: Sequence[str] = ()) -> list[str]:
    regions = list(dict.fromkeys(regions))
    first = [r for r in preferred if r in regions]
    return first + sorted(r for r in regions if r not in first)


# ---------------------------------------------------------------------------------------------- swarm


def _history(peer: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    h = peer.get("history")
    if not isinstance(h, list):
        return []
    return [p for p in h if isinstance(p, Mapping) and isinstance(p.get("step"), int)
            and _num(p.get("tokens")) is not None]


def swarm_curves(summary: Mapping[str, Any], *, name: str | None = None) -> list[Curve]:
    """One curve per region of a ``worldlm-swarm`` summary (see the module docstring for the rule).
    Regions whose peers have no history point have no curve."""
    peers = [p for p in summary.get("peers") or [] if isinstance(p, Mapping)]
    strategy = name or _swarm_strategy(summary)
    order = _region_order((str(p.get("region")) for p in peers), list(summary.get("regions") or {}))
    curves = []
    for region in order:
        histories = [_history(p) for p in peers if str(p.get("region")) == region]
        histories = [h for h in histories if h]
        steps = sorted({pt["step"] for h in histories for pt in h})
        tokens, loss, marks = [], [], []
        last_world = None
        for step in steps:
            at = [pt for h in histories for pt in h if pt["step"] == step]
            mean_loss = _mean(_num(pt.get("loss")) for pt in at)
            if mean_loss is None:
                continue
            x = 0.0
            for h in histories:
                before = [pt for pt in h if pt["step"] <= step]
                if before:
                    x += float(before[-1]["tokens"])
            world = max((pt["world_round"] for pt in at if isinstance(pt.get("world_round"), int)), default=None)
            if world is not None and world >= 0 and (last_world is None or world > last_world):
                marks.append(x)
            if world is not None:
                last_world = world if last_world is None else max(last_world, world)
            tokens.append(x)
            loss.append(mean_loss)
        if tokens:
            curves.append(Curve(region=region, strategy=strategy, tokens=tuple(tokens), loss=tuple(loss),
                                world_rounds=tuple(marks)))
    return curves


def _swarm_strategy(summary: Mapping[str, Any]) -> str:
    manifest = summary.get("manifest")
    if isinstance(manifest, Mapping) and isinstance(manifest.get("aggregation"), Mapping):
        s = manifest["aggregation"].get("strategy")
        if isinstance(s, str):
            return s
    for p in summary.get("peers") or []:
        if isinstance(p, Mapping) and isinstance(p.get("strategy"), str):
            return p["strategy"]
    return "worldlm"


def _ints(peers: Sequence[Mapping[str, Any]], key: str) -> list[int]:
    return [p[key] for p in peers if isinstance(p.get(key), int) and not isinstance(p[key], bool)]


def _range(values: list[int]) -> tuple[int, int] | None:
    return (min(values), max(values)) if values else None


def swarm_rows(summary: Mapping[str, Any], *, name: str | None = None) -> list[RegionRow]:
    """The Markdown rows of a ``worldlm-swarm`` summary, one per region (regions without any
    finished peer included, with what is known)."""
    peers = [p for p in summary.get("peers") or [] if isinstance(p, Mapping)]
    strategy = name or _swarm_strategy(summary)
    last_loss = {c.region: c.loss[-1] for c in swarm_curves(summary, name=name)}
    rows = []
    for region in _region_order((str(p.get("region")) for p in peers), list(summary.get("regions") or {})):
        mine = [p for p in peers if str(p.get("region")) == region]
        valid = _mean(_num(p.get("valid_loss")) for p in mine)
        train = last_loss.get(region)
        if train is None:
            train = _mean(_num(p.get("last_train_loss")) for p in mine)
        sent = _ints(mine, "bytes_sent") + _ints(mine, "bytes_sent_border")
        rows.append(RegionRow(
            region=region, strategy=strategy, peers=len(mine), tokens=float(sum(_ints(mine, "tokens"))), loss=valid,
            perplexity=_exp(valid), train_loss=train,
            failed=sum(1 for p in mine if "error" in p or p.get("exit_code") not in (0, None)),
            rounds_completed=_range(_ints(mine, "rounds_completed")),
            world_rounds_adopted=_range(_ints(mine, "world_rounds_adopted")),
            bytes_sent=sum(sent) if sent else None))
    return rows


def swarm_series(summary: Mapping[str, Any], *, source: str, name: str | None = None) -> Series:
    peers = summary.get("peers")
    if not isinstance(peers, list) or not peers:
        raise DataError(f"{source}: the swarm summary lists no peers")
    curves = swarm_curves(summary, name=name)
    if not curves:
        raise DataError(f"{source}: no peer has a loss history (every peer stopped before its first round, "
                        "or the summary predates loss histories)")
    strategy = _swarm_strategy(summary)
    manifest = summary.get("manifest") if isinstance(summary.get("manifest"), Mapping) else {}
    model = (manifest.get("model") or {}).get("preset", "?") if isinstance(manifest.get("model"), Mapping) else "?"
    h = next((p.get("inner_steps") for p in peers if isinstance(p, Mapping) and p.get("inner_steps")), None)
    if h is None and isinstance(manifest.get("train"), Mapping):
        h = manifest["train"].get("inner_steps")
    wall = _num(summary.get("wall_seconds"))
    setting = f"run {summary.get('run_id', '?')}, model {model}, H={h}"
    about = (f"`worldlm-swarm` run `{summary.get('run_id', '?')}`: strategy {strategy}, model {model}, H={h}, "
             f"{len(peers)} peers" + (f", {wall:.0f} s" if wall is not None else ""))
    notes = []
    for p in peers:
        if isinstance(p, Mapping) and ("error" in p or p.get("exit_code") not in (0, None)):
            why = f": {p['error']}" if p.get("error") else ""
            notes.append(f"peer `{p.get('label', '?')}` ({p.get('region', '?')}) exited with code "
                         f"{p.get('exit_code')}{why}")
    return Series(name=name or strategy, strategy=strategy, source=source, about=about, setting=setting,
                  curves=tuple(curves), rows=tuple(swarm_rows(summary, name=name)), notes=tuple(notes))


# ---------------------------------------------------------------------------------------------- simulate


def _sim_tokens(entry: Mapping[str, Any], region: str, strategy: str) -> float:
    peers = entry.get("peers")
    total = float(_num(entry.get("tokens")) or 0.0)
    if not isinstance(peers, Mapping) or not peers:
        return total
    mine = [p for p in peers.values() if isinstance(p, Mapping) and p.get("region") == region]
    if strategy in STRATEGIES and STRATEGIES[strategy].pooled:  # one model's tokens, shared out by peers
        return total * len(mine) / len(peers)
    return float(sum(_num(p.get("tokens")) or 0.0 for p in mine))


def _sim_regions(results: Mapping[str, Any]) -> list[str]:
    regions: list[str] = list(results.get("regions") or {}) if isinstance(results.get("regions"), Mapping) else []
    for entry in results.get("history") or []:
        if isinstance(entry, Mapping) and isinstance(entry.get("regions"), Mapping):
            regions += list(entry["regions"])
    return _region_order(regions)


def simulate_curves(results: Mapping[str, Any], *, name: str | None = None) -> list[Curve]:
    """Held-out loss per region against the region's tokens, one point per evaluation in
    ``history`` (a null loss is skipped)."""
    strategy = str(results.get("strategy") or "?")
    curves = []
    history = [e for e in results.get("history") or [] if isinstance(e, Mapping)]
    for region in _sim_regions(results):
        tokens, loss = [], []
        for entry in history:
            vals = (entry.get("regions") or {}).get(region)
            y = _num(vals.get("loss")) if isinstance(vals, Mapping) else None
            if y is None:
                continue
            tokens.append(_sim_tokens(entry, region, strategy))
            loss.append(y)
        if tokens:
            curves.append(Curve(region=region, strategy=name or strategy, tokens=tuple(tokens), loss=tuple(loss)))
    return curves


def simulate_rows(results: Mapping[str, Any], *, name: str | None = None) -> list[RegionRow]:
    """The final values per region (the results' ``regions``, tokens from the last evaluation)."""
    strategy = str(results.get("strategy") or "?")
    history = [e for e in results.get("history") or [] if isinstance(e, Mapping)]
    final = history[-1] if history else {"tokens": results.get("tokens"), "peers": results.get("peers")}
    regions = results.get("regions") if isinstance(results.get("regions"), Mapping) else {}
    rows = []
    for region in _sim_regions(results):
        v = regions.get(region) if isinstance(regions.get(region), Mapping) else {}
        peers = v.get("peers")
        rows.append(RegionRow(region=region, strategy=name or strategy,
                              peers=peers if isinstance(peers, int) else 0,
                              tokens=_sim_tokens(final, region, strategy), loss=_num(v.get("loss")),
                              perplexity=_num(v.get("perplexity")), bits_per_byte=_num(v.get("bits_per_byte"))))
    return rows


def simulate_series(results: Mapping[str, Any], *, source: str, name: str | None = None) -> Series:
    if not isinstance(results.get("history"), list) or not results["history"]:
        raise DataError(f"{source}: the simulate results have no evaluation history")
    curves = simulate_curves(results, name=name)
    if not curves:
        raise DataError(f"{source}: no evaluation has a finite region loss")
    strategy = str(results.get("strategy") or "?")
    cfg = results.get("config") if isinstance(results.get("config"), Mapping) else {}
    model = cfg.get("model", {}).get("preset", "?") if isinstance(cfg.get("model"), Mapping) else "?"
    h = cfg.get("train", {}).get("inner_steps", "?") if isinstance(cfg.get("train"), Mapping) else "?"
    wall = _num(results.get("wall_seconds"))
    n = len(results["history"])
    setting = f"model {model}, {cfg.get('rounds', '?')} rounds of H={h}"
    about = (f"`worldlm-simulate`: strategy {strategy}, model {model}, {cfg.get('rounds', '?')} rounds of H={h}, "
             f"{n} evaluation{'s' if n != 1 else ''}" + (f", {wall:.0f} s" if wall is not None else ""))
    notes = ()
    if n == 1:
        notes = ("one evaluation only: the curve is a single point (`worldlm-simulate --eval-rounds 1,2,...` "
                 "adds evaluations)",)
    world = results.get("world") if isinstance(results.get("world"), Mapping) else {}
    return Series(name=name or strategy, strategy=strategy, source=source, about=about, setting=setting,
                  curves=tuple(curves), rows=tuple(simulate_rows(results, name=name)),
                  world={k: _num(world.get(k)) for k in ("loss", "perplexity", "bits_per_byte")}, notes=notes)
