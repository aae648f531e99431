"""Reports: loss against tokens per region (a PNG) and a Markdown summary beside it.

Sources (:func:`load_report`):

- a ``worldlm-swarm`` run: ``DIR/summary.json`` (or the directory). Each peer's ``history`` holds
  one point every ``inner_steps`` steps: its cumulative ``tokens`` and the mean ``loss`` of the
  training steps since the previous point. The region's curve (:func:`swarm_curves`) groups the
  points of the region's peers by ``step`` (the peers of a region share ``inner_steps`` and meet at
  every round, so their steps line up): y = the mean train loss of the peers that have a point at
  that step (a peer that crashed, or stopped before the step, is left out of the mean), x = the
  tokens trained by the region = the sum over all its peers of their tokens at their latest point
  at or before that step (a peer that stopped still counts with what it trained, so x never
  decreases). Points where the region's world round increased are marked.
- ``worldlm-simulate`` results JSON files (or a benchmark bundle ``{"results": {name: results}}``
  as ``benchmarks/quality.py`` writes it). The curve (:func:`simulate_curves`) is the held-out
  loss of each evaluation in ``history``, the mean over the region's peers; x = the sum of the
  region's peers' tokens (``centralized``, one model on the pooled data: the region's share of
  the pooled tokens, in proportion to its peers, so that strategies line up at equal compute;
  total tokens when an evaluation has no per-peer entries).

One series per source and strategy (the variant name for a bundle; the file name is added when
two sources have the same strategy). With one series the figure has one axis and one line per
region; with several, one subplot per region and one line per series (:func:`make_figure`).

The library never prints: bad input raises :class:`~worldlm_p2p.errors.DataError` or
:class:`~worldlm_p2p.errors.ConfigError` with a one-line message.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from worldlm_p2p.errors import ConfigError, DataError

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

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
    if strategy == "centralized":
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


# ---------------------------------------------------------------------------------------------- loading


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{path}: no such file or directory") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read: {e}") from None
    try:
        return json.loads(text)
    except ValueError as e:
        raise DataError(f"{path}: not a JSON file ({e})") from None


def _is_swarm(data: Any) -> bool:
    return isinstance(data, Mapping) and isinstance(data.get("peers"), list) and (
        "manifest" in data or "run_id" in data)


def _is_simulate(data: Any) -> bool:
    return isinstance(data, Mapping) and "strategy" in data and "history" in data


def load_source(source: str | os.PathLike) -> tuple[str, list[Series]]:
    """Read one source: a swarm run directory or ``summary.json``, a simulate results file, or a
    bundle of results. Returns the kind and its series (names not yet made unique)."""
    path = Path(source)
    if path.is_dir():
        if not (path / "summary.json").is_file():
            raise DataError(f"{path}: not a worldlm-swarm run directory (no summary.json)")
        path = path / "summary.json"
    elif not path.exists():
        raise DataError(f"{path}: no such file or directory")
    data = _read_json(path)
    try:
        if _is_swarm(data):
            return SWARM, [swarm_series(data, source=str(path))]
        if _is_simulate(data):
            return SIMULATE, [simulate_series(data, source=str(path))]
        bundle = data.get("results") if isinstance(data, Mapping) else None
        if isinstance(bundle, Mapping) and bundle and all(_is_simulate(v) for v in bundle.values()):
            return SIMULATE, [simulate_series(v, source=f"{path} [{k}]", name=str(k)) for k, v in bundle.items()]
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise DataError(f"{path}: malformed {type(e).__name__}: {e}") from None
    raise DataError(f"{path}: neither a worldlm-swarm summary.json nor worldlm-simulate results")


def _unique_names(series: list[tuple[Series, str]]) -> list[Series]:
    """Rename series whose names collide: ``name (file stem)``, else ``name (path)``."""
    counts: dict[str, int] = {}
    for s, _ in series:
        counts[s.name] = counts.get(s.name, 0) + 1
    out = []
    for s, path in series:
        name = s.name
        if counts[name] > 1:
            p = Path(path.split(" [")[0])
            stem = p.parent.name if p.name == "summary.json" else p.stem
            name = f"{name} ({stem})"
        out.append(s)
        if name != s.name:
            out[-1] = _renamed(s, name)
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        out = [_renamed(s, f"{s.name} ({s.source})") if names.count(s.name) > 1 else s for s in out]
    return out


def _renamed(s: Series, name: str) -> Series:
    return dataclasses.replace(s, name=name, curves=tuple(dataclasses.replace(c, strategy=name) for c in s.curves),
                               rows=tuple(dataclasses.replace(r, strategy=name) for r in s.rows))


def load_report(sources: Sequence[str | os.PathLike], *, title: str | None = None) -> Report:
    """A report of one or more sources of the same kind (swarm runs, or simulate results)."""
    if not sources:
        raise ConfigError("no source given: a worldlm-swarm run directory or worldlm-simulate results files")
    kinds, series = set(), []
    for src in sources:
        kind, found = load_source(src)
        kinds.add(kind)
        series += [(s, s.source) for s in found]
    if len(kinds) > 1:
        raise ConfigError("cannot mix a worldlm-swarm run (train loss) with worldlm-simulate results "
                          "(held-out loss) in one report")
    kind = kinds.pop()
    named = _unique_names(series)
    if title is None:
        settings = {s.setting for s in named}
        common = f" ({settings.pop()})" if len(settings) == 1 else ""
        if kind == SWARM and len(named) == 1:
            title = f"WorldLM swarm, {named[0].strategy}: train loss per region{common}"
        elif kind == SWARM:
            title = "WorldLM swarms compared: train loss per region"
        elif len(named) == 1:
            title = f"worldlm-simulate, {named[0].name}: held-out loss per region{common}"
        else:
            title = f"worldlm-simulate, strategies compared: held-out loss per region{common}"
    return Report(kind=kind, title=title, series=tuple(named))


# ---------------------------------------------------------------------------------------------- figure


def make_figure(report: Report) -> "Figure":
    """The figure: one axis with one line per region (one series), or one subplot per region with
    one line per series (several). Uses matplotlib's Agg canvas, no pyplot state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import EngFormatter

    regions = report.regions
    many = len(report.series) > 1
    ncols = min(3, len(regions)) if many else 1
    nrows = math.ceil(len(regions) / ncols) if many else 1
    fig = Figure(figsize=(4.6 * ncols + 0.6 + (1.4 if not many else 0), 3.6 * nrows + 1.4), dpi=110,
                 layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    curves = report.curves
    xs = [x for c in curves for x in c.tokens if x > 0]
    log_x = bool(xs) and max(xs) / min(xs) > 100
    keys = [s.name for s in report.series] if many else regions
    cmap = _colors(len(keys))
    color = {k: cmap[i] for i, k in enumerate(keys)}
    marker = "o" if max((len(c.tokens) for c in curves), default=0) <= 30 else None
    marked = False  # a world-round mark was drawn
    for i, ax in enumerate(axes.flat):
        if i >= (len(regions) if many else 1):
            ax.set_visible(False)
            continue
        shown = [c for c in curves if c.region == regions[i]] if many else curves
        for c in shown:
            key = c.strategy if many else c.region
            ax.plot(c.tokens, c.loss, marker=marker, markersize=3.5, linewidth=1.6, color=color[key],
                    label=key if many else f"{key}{_peers(report, key)}")
            if c.world_rounds:
                ys = [c.loss[c.tokens.index(x)] for x in c.world_rounds]
                # a scatter (not a line): ax.get_lines() stays one line per curve
                ax.scatter(c.world_rounds, ys, marker="D", s=42, facecolors="none", edgecolors=[color[key]],
                           linewidths=1.3, zorder=3, label="_nolegend_")
                marked = True
        if many:
            ax.set_title(f"{regions[i]}{_peers(report, regions[i])}", fontsize=11)
        if log_x:
            ax.set_xscale("log")
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))
        ax.set_xlabel(X_LABEL)
        if i % ncols == 0:
            ax.set_ylabel(Y_LABELS[report.kind])
        ax.grid(True, alpha=0.3)
    handles, labels = [], []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    if marked:
        handles.append(Line2D([], [], linestyle="none", marker="D", markersize=7, markerfacecolor="none",
                              markeredgecolor="0.3", markeredgewidth=1.3))
        labels.append(WORLD_MARK)
    # below the axes: a legend never covers a line
    fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 4), fontsize=9, frameon=False)
    fig.suptitle(report.title, fontsize=12)
    return fig


def _peers(report: Report, region: str) -> str:
    """`` (3 peers)``: the region's peers in the first series that has the region."""
    row = next((r for s in report.series for r in s.rows if r.region == region), None)
    return f" ({row.peers} peer{'s' if row.peers != 1 else ''})" if row and row.peers else ""


def _colors(n: int) -> list:
    from matplotlib import colormaps

    name = "tab10" if n <= 10 else "tab20"
    cmap = colormaps[name]
    return [cmap(i % cmap.N) for i in range(n)]


# ---------------------------------------------------------------------------------------------- markdown


def _f(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf"
    return f"{value:.{digits}f}"


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    v = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if abs(v) < 1000:
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1000
    return f"{v:.1f} TB"


def _span(r: tuple[int, int] | None) -> str:
    if r is None:
        return "-"
    return str(r[0]) if r[0] == r[1] else f"{r[0]}-{r[1]}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    align = ["---"] + ["---:"] * (len(header) - 1)
    return ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |",
            *("| " + " | ".join(r) + " |" for r in rows)]


def _series_table(report: Report, s: Series) -> list[str]:
    if report.kind == SWARM:
        header = ["region", "peers", "tokens", "held-out loss", "perplexity", "train loss", "rounds completed",
                  "world rounds adopted", "bytes sent"]
        rows = [[r.region, f"{r.peers}" + (f" ({r.failed} failed)" if r.failed else ""), f"{r.tokens:,.0f}",
                 _f(r.loss), _f(r.perplexity), _f(r.train_loss), _span(r.rounds_completed),
                 _span(r.world_rounds_adopted), _bytes(r.bytes_sent)] for r in s.rows]
        return _table(header, rows)
    header = ["region", "peers", "tokens", "held-out loss", "perplexity", "bits/byte"]
    rows = [[r.region, str(r.peers), f"{r.tokens:,.0f}", _f(r.loss), _f(r.perplexity), _f(r.bits_per_byte)]
            for r in s.rows]
    if s.world:
        rows.append(["world (mean of regions)", str(sum(r.peers for r in s.rows)),
                     f"{sum(r.tokens for r in s.rows):,.0f}", _f(s.world.get("loss")), _f(s.world.get("perplexity")),
                     _f(s.world.get("bits_per_byte"))])
    return _table(header, rows)


def comparison(report: Report) -> dict[str, dict[str, tuple[float | None, float | None]]]:
    """series -> column (each region, then ``mean``) -> (perplexity, ratio to the best series in
    that column). ``mean`` is the mean of the series' region perplexities."""
    regions = report.regions
    values: dict[str, dict[str, float | None]] = {}
    for s in report.series:
        by = {r.region: r.perplexity for r in s.rows}
        vals = {r: by.get(r) for r in regions}
        vals["mean"] = _mean(vals.values()) if all(v is not None for v in vals.values()) else None
        values[s.name] = vals
    out: dict[str, dict[str, tuple[float | None, float | None]]] = {}
    for col in [*regions, "mean"]:
        present = [v[col] for v in values.values() if v[col] is not None]
        best = min(present) if present else None
        for name, vals in values.items():
            v = vals[col]
            ratio = v / best if v is not None and best else None
            out.setdefault(name, {})[col] = (v, ratio)
    return out


def render_markdown(report: Report, *, png_name: str = "report.png") -> str:
    """The Markdown summary (links the PNG by ``png_name``, a path relative to the Markdown file)."""
    lines = [f"# {report.title}", ""]
    lines += ["Sources:", ""] + [f"- `{s.source}`: {s.about}" for s in report.series] + [""]
    lines += [f"![loss against tokens]({png_name})", ""]
    if report.kind == SWARM:
        lines += ["Curve: the mean train loss of the region's peers over each span of H steps, against the tokens "
                  "trained by the region (the sum over its peers). Table: held-out loss = mean of the peers' final "
                  "`valid_loss`, perplexity = exp of it; train loss = the curve's last point; rounds "
                  "completed and world rounds adopted as min-max over the peers; bytes sent = the peers' estimated "
                  "region and border traffic, summed.", ""]
    else:
        lines += ["Curve: the held-out loss of the region (mean over its peers, each on its own `valid.txt`) at "
                  "every evaluation, against the tokens trained by the region (the sum over its peers; "
                  "`centralized`: its share of the pooled tokens). Table: the last evaluation; perplexity is the "
                  "mean of the peers' perplexities.", ""]
    if len(report.series) > 1:
        cols = [*report.regions, "mean"]
        comp = comparison(report)
        rows = []
        for name, vals in comp.items():
            cells = []
            for col in cols:
                v, ratio = vals[col]
                cell = "-" if v is None else f"{v:.3f} ({ratio:.3f}x)" if ratio is not None else f"{v:.3f}"
                cells.append(f"**{cell}**" if ratio is not None and ratio == 1.0 else cell)
            rows.append([name, *cells])
        lines += ["## Comparison", "",
                  "Held-out perplexity per region (mean over the region's peers) and its ratio to the best "
                  "series in that column (bold: the best); `mean`: the mean over regions.", ""]
        lines += _table(["series", *cols], rows) + [""]
    for s in report.series:
        lines += [f"## {s.name}" if len(report.series) > 1 else "## Regions", ""]
        lines += _series_table(report, s) + [""]
        lines += [f"- {n}" for n in s.notes] + ([""] if s.notes else [])
    return "\n".join(lines).rstrip() + "\n"


# ---------------------------------------------------------------------------------------------- writing


def _replace(tmp: Path, path: Path) -> None:
    try:
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def write_report(report: Report, out_dir: str | os.PathLike, *, stem: str = "report") -> tuple[Path, Path]:
    """Write ``OUT/<stem>.png`` and ``OUT/<stem>.md`` atomically (temp file, then rename)."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot create the directory ({e.strerror or e})") from None
    png, md = out / f"{stem}.png", out / f"{stem}.md"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fig = make_figure(report)
        tmp = out / f".{png.name}.tmp"
        try:
            fig.savefig(tmp, format="png")
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise ConfigError(f"{png}: cannot write ({e.strerror or e})") from None
        _replace(tmp, png)
    for w in caught:
        logger.debug("matplotlib: %s", w.message)
    tmp = out / f".{md.name}.tmp"
    try:
        tmp.write_text(render_markdown(report, png_name=png.name), encoding="utf-8")
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"{md}: cannot write ({e.strerror or e})") from None
    _replace(tmp, md)
    return png, md


def report_sources(sources: Sequence[str | os.PathLike], out_dir: str | os.PathLike, *, title: str | None = None,
                   stem: str = "report") -> tuple[Path, Path]:
    """:func:`load_report` then :func:`write_report`."""
    return write_report(load_report(sources, title=title), out_dir, stem=stem)
