"""Rich renderables for the swarm's progress (pure: records or snapshots in, renderable out; nothing printed)."""

from __future__ import annotations

import math
import time
from typing import Any, Iterable, Mapping, Sequence

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from worldlm_p2p.net.monitor import short_id
from worldlm_p2p.net.records import ProgressRecord


def _bar(fraction: float, width: int = 16) -> Text:
    fraction = min(max(fraction, 0.0), 1.0)
    full = int(round(fraction * width))
    return Text("█" * full + "░" * (width - full), style="green" if fraction >= 1 else "cyan")


def progress_table(records: Iterable[ProgressRecord], *, labels: Mapping[str, str] | None = None,
                   max_steps: int | None = None, exited: Mapping[str, int | None] | None = None,
                   title: str = "WorldLM swarm", now: float | None = None) -> Table:
    """One row per peer, grouped by region. ``labels``: label -> region of peers expected but not yet
    heard from; ``exited``: label -> exit code of peers whose process ended."""
    now = time.time() if now is None else now
    by_label = {r.label: r for r in records}
    table = Table(title=title, expand=False)
    for col, just in (("region", "left"), ("peer", "left"), ("progress", "left"), ("step", "right"),
                      ("tokens", "right"), ("loss", "right"), ("tok/s", "right"), ("rounds", "right"),
                      ("group", "right"), ("status", "left")):
        table.add_column(col, justify=just)
    expected = dict(labels or {})
    for label in by_label:
        expected.setdefault(label, by_label[label].region)
    exited = exited or {}
    total_tps = 0.0
    for label, region in sorted(expected.items(), key=lambda kv: (kv[1], kv[0])):
        r = by_label.get(label)
        code = exited.get(label)
        if r is None:
            status = "starting" if code is None else f"exited ({code})"
            table.add_row(region, label, _bar(0), "-", "-", "-", "-", "-", "-", status)
            continue
        total_tps += r.tokens_per_s if not r.finished else 0.0
        if code is not None:
            status = "done" if code == 0 else f"exited ({code})"
        elif r.finished:
            status = "finishing"
        elif r.waiting_for_round >= 0:
            status = f"round {r.waiting_for_round}"
        else:
            status = f"training ({now - r.time:.0f}s ago)" if now - r.time > 5 else "training"
        frac = r.step / max_steps if max_steps else 0.0
        table.add_row(region, label, _bar(frac), str(r.step), f"{r.tokens:,}", f"{r.train_loss:.3f}",
                      f"{r.tokens_per_s:,.0f}", str(r.rounds_completed), str(r.last_group_size or "-"), status)
    table.caption = f"{sum(1 for r in by_label.values() if not r.finished)} peers online, {total_tps:,.0f} tokens/s"
    return table


# ----------------------------------------------------------------------------- worldlm-monitor

_SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float]) -> str:
    """``values`` as block characters scaled between their minimum and maximum ("" when empty)."""
    vals = [v for v in values if math.isfinite(v)]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    if hi - lo < 1e-12:
        return _SPARKS[3] * len(vals)
    return "".join(_SPARKS[min(len(_SPARKS) - 1, int((v - lo) / (hi - lo) * len(_SPARKS)))] for v in vals)


def _trend(values: Sequence[float]) -> Text:
    if len(values) < 2 or values[0] <= 0:
        return Text(sparkline(values))
    change = values[-1] / values[0] - 1
    return Text(f"{sparkline(values)} {change:+.0%}", style="green" if change < 0 else "red")


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


_REACH = {"direct": "direct", "outbound": "out", "not-direct": "NAT?", "unknown": "?", None: "-"}


def _rounds(p: Mapping[str, Any]) -> str:
    partial = p.get("rounds_partial") or 0
    return f"{p['rounds_completed']}" + (f" ({partial}~)" if partial else "")


def monitor_view(snapshot: Mapping[str, Any]) -> RenderableType:
    """The live view of ``worldlm-monitor``: one table per region, then the swarm's totals.
    ``snapshot``: :func:`worldlm_p2p.net.monitor.build_snapshot`'s dict."""
    about = snapshot.get("manifest")
    title = f"WorldLM swarm · run {snapshot['run_id']}"
    if about:
        title += f" · {about['strategy']} · model {about['model']} · H={about['inner_steps']}"
    parts: list[RenderableType] = [Text(title, style="bold")]
    for region, reg in snapshot["regions"].items():
        leader = f"{reg['leader_label']} ({short_id(reg['leader'])})" if reg["leader"] else "none"
        head = Text.assemble((f"{region}", "bold cyan"), f"  leader {leader} · region round {reg['region_round']}"
                             f" · world round {reg['world_round'] if reg['world_round'] >= 0 else '-'}"
                             f" · loss {reg['train_loss']:.3f} ", _trend(reg["loss_trend"]))
        if reg.get("relays"):
            head.append(f" · relayed by {', '.join(reg['relays'])}")
        if reg.get("epsilon") is not None:
            head.append(f" · ε {reg['epsilon']:.2f}")
        if reg.get("border_epsilon") is not None:
            n = reg.get("border_releases")
            head.append(f" · border ε {reg['border_epsilon']:.3g}" + (f" ({n} release{'' if n == 1 else 's'})" if n is not None else ""))
        dp = any(p["epsilon"] is not None for p in reg["peers"])
        mixing = any(p.get("mix_region") is not None or p.get("mix_world") is not None for p in reg["peers"])
        table = Table(title=head, title_justify="left", expand=False)
        # rounds: completed (of which partial, "+N~"); reach: how other peers reach it (direct, out: outbound-only)
        cols = [("id", "left"), ("peer", "left"), ("step", "right"), ("tokens", "right"), ("loss", "right"),
                ("trend", "left"), ("tok/s", "right"), ("rounds", "right"), ("world", "right"), ("reach", "left"),
                ("heard", "right")]  # heard: seconds since the peer's last record
        if dp:
            cols.append(("ε", "right"))
        if mixing:  # evidence mixing: what the peer took of its region's model and of the world's changes
            cols.append(("took r/w", "right"))
        cols.append(("status", "left"))
        for name, just in cols:
            # long labels are cut with an ellipsis rather than squeezing the numbers onto two lines
            table.add_column(name, justify=just, no_wrap=True,  # type: ignore[arg-type]
                             max_width=22 if name == "peer" else None, min_width=None if name == "peer" else len(name),
                             overflow="ellipsis")
        for p in reg["peers"]:
            row = [p["short_id"], ("★ " if p["leader"] else "") + p["label"], str(p["step"]), f"{p['tokens']:,}",
                   f"{p['train_loss']:.3f}", sparkline(p["loss_trend"][-8:]), f"{p['tokens_per_s']:,.0f}",
                   _rounds(p), str(p["world_round"]) if p["world_round"] >= 0 else "-",
                   _REACH.get(p.get("reachability"), "?"), f"{p['seconds_since_heard']:.0f}s"]
            if dp:
                row.append(f"{p['epsilon']:.2f}" if p["epsilon"] is not None else "-")
            if mixing:
                row.append("/".join(f"{p[k]:.2f}" if p.get(k) is not None else "-" for k in ("mix_region", "mix_world")))
            row.append(p["status"])
            table.add_row(*row)
        parts.append(table)
    t = snapshot["totals"]
    if not t["peers"]:
        parts.append(Text("no peer of this run is online", style="yellow"))
    parts.append(Text(f"{t['peers_online']} peers online in {t['regions']} regions · {t['tokens_per_s']:,.0f} tokens/s · "
                      f"{t['tokens']:,} tokens trained · {_bytes(t['bytes_sent'])} sent (all-reduce estimate)"
                      + (f" · {_bytes(t['wire_sent'])} on the wire (measured)" if t.get("wire_sent") is not None else ""),
                      style="bold"))
    return Group(*parts)
