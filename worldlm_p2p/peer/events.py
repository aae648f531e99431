"""The peer's structured event log: one JSON object per line (``--events FILE``), for benchmarks
and operators who want phase timings and round outcomes without parsing log text.

Every line has ``event`` (its kind), ``time`` (wall clock, seconds since the epoch) and
``mono`` (``time.monotonic()``: on Linux one clock for every process of the machine, so a
benchmark can subtract the time it spawned the peer). The kinds and their fields:

=================  ==========================================================================
``started``        the process began setting up (``pid``)
``joined``         joined the DHT and fetched the manifest (``peer_id``, ``run_id``, ``fingerprint``)
``reachability``   what the dial-back check found: ``status`` (direct, not-direct, unknown,
                   not-checked), ``mode`` (direct, outbound), ``reachable``, ``unreachable``
``training``       the first training step is next (``started_from``: init, region or checkpoint)
``round``          a region round ended: ``round``, ``outcome`` (averaged, partial, failed, alone, stopped),
                   ``group_size``, ``expected`` (the peers that waited at the barrier), ``seconds``
                   (all-reduce, matchmaking included), ``step``, ``error`` (failed only),
                   ``dropped`` (partial: senders this peer's reducer averaged without)
``world_led``      a world round this peer led finished (``world_round``, ``regions``, ``seconds``)
``world_adopted``  the peer adopted a world round (``world_round``, ``round``, ``lam``)
``checkpoint``     a checkpoint was written (``step``, ``path``)
``finished``       the run loop ended (``step``, ``tokens``)
=================  ==========================================================================

Writing never fails the peer: an unwritable file is reported once and the log is turned off.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class EventLog:
    def __init__(self, path: str | Path | None) -> None:
        self._path = Path(path) if path else None
        self._lock = threading.Lock()
        self._file = None
        if self._path is not None:
            try:
                self._path.parent.mkdir(parents=True, exist_ok=True)
                self._file = self._path.open("a", buffering=1, encoding="utf-8")  # line-buffered
            except OSError as e:
                logger.warning("event log %s cannot be written (%s); no events are recorded", self._path,
                               e.strerror or e)

    def emit(self, event: str, **fields: Any) -> None:
        if self._file is None:
            return
        line = json.dumps(dict(event=event, time=time.time(), mono=time.monotonic(), **fields), default=str)
        with self._lock:
            try:
                self._file.write(line + "\n")
            except (OSError, ValueError) as e:  # disk full, or closed at shutdown
                logger.warning("event log %s: %s; no more events are recorded", self._path, e)
                self._file = None

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """The events of a log (a line that is not a JSON object, say a last line cut by a crash, is
    skipped)."""
    out = []
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict) and isinstance(item.get("event"), str):
            out.append(item)
    return out
