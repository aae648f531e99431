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

The data (curves, rows, how each source is read) is :mod:`worldlm_p2p.report_data`; this module
loads sources and renders them. One series per source and strategy (the variant name for a bundle; the file name is added when
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
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from worldlm_p2p.errors import ConfigError, DataError
from worldlm_p2p.report_data import (SIMULATE, SWARM, WORLD_MARK, X_LABEL, Y_LABELS, Curve, RegionRow,  # noqa: F401
                                     Report, Series, _mean, simulate_curves, simulate_rows, simulate_series,
                                     swarm_curves, swarm_rows, swarm_series)

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

logger = logging.getLogger(__name__)


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
