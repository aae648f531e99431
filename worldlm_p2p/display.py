"""Rich renderables for the swarm's progress (pure: records in, renderable out; nothing printed)."""

from __future__ import annotations

import time
from typing import Iterable, Mapping

from rich.table import Table
from rich.text import Text

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
