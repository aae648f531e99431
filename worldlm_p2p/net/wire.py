"""Bytes on the wire, measured: the kernel's TCP counters of this peer's own sockets.

A peer is several processes: the peer itself, hivemind's DHT and averager processes, and the p2p
daemon (p2pd), which carries all of its libp2p traffic. :class:`WireMeter` sums, over the TCP
sockets that belong to this process or any of its descendants, the kernel's ``bytes_sent`` and
``bytes_received`` (``tcp_info``, read with ``ss -tinp`` from iproute2). TCP payload bytes: the
IP and TCP headers are not counted; an interface's counters (``ip -s link``) are a few percent
higher. A socket that opens and closes between two samples is missed; libp2p keeps one long-lived
connection per pair of peers, so that is rare. Where ``ss`` is missing the meter says ``None``.

Pure parsing (:func:`parse_ss`) is separate from the sampling, for tests.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_USERS = re.compile(r'pid=(\d+),fd=(\d+)')
_SENT = re.compile(r'\bbytes_sent:(\d+)')
_RECEIVED = re.compile(r'\bbytes_received:(\d+)')


@dataclass(frozen=True, slots=True)
class Socket:
    key: tuple[str, str]  # (local address:port, peer address:port)
    pids: frozenset[int]
    sent: int
    received: int


def parse_ss(text: str) -> list[Socket]:
    """The established TCP sockets in ``ss -tinpH`` output: each is a line with the addresses and
    ``users:(("name",pid=N,fd=M),...)``, then an indented line of ``tcp_info`` counters."""
    out: list[Socket] = []
    head: list[str] | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            head = line.split()
            continue
        if head is None or len(head) < 5:
            continue
        pids = frozenset(int(m.group(1)) for m in _USERS.finditer(" ".join(head[5:])))
        sent, received = _SENT.search(line), _RECEIVED.search(line)
        out.append(Socket(key=(head[3], head[4]), pids=pids, sent=int(sent.group(1)) if sent else 0,
                          received=int(received.group(1)) if received else 0))
        head = None
    return out


def descendants(root: int, proc: str = "/proc") -> set[int]:
    """``root`` and every process below it (read from ``/proc/*/stat``)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir(proc)
    except OSError:
        return {root}
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"{proc}/{name}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo.extend(children.get(pid, ()))
    return out


class WireMeter:
    """Cumulative TCP bytes of this process tree since the meter was made: :meth:`sample` returns
    ``(sent, received)``, or ``None`` where the counters cannot be read."""

    def __init__(self, root: int | None = None) -> None:
        self.root = os.getpid() if root is None else root
        self.available = shutil.which("ss") is not None
        self._open: dict[tuple[str, str], tuple[int, int]] = {}
        self._closed = [0, 0]  # what sockets seen before and gone since had carried
        self._warned = False

    def sample(self) -> tuple[int, int] | None:
        if not self.available:
            return None
        try:
            text = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True,
                                  timeout=5).stdout
        except (OSError, subprocess.SubprocessError) as e:
            if not self._warned:
                logger.warning("cannot read the TCP counters (ss -tinp): %s; bytes on the wire are not measured", e)
                self._warned = True
            return None
        return self.update(parse_ss(text), descendants(self.root))

    def update(self, sockets: list[Socket], pids: set[int]) -> tuple[int, int]:
        """Take one reading of the sockets (pure bookkeeping; :meth:`sample` feeds it)."""
        now: dict[tuple[str, str], tuple[int, int]] = {}
        for s in sockets:
            if s.pids & pids:
                old = now.get(s.key, (0, 0))
                now[s.key] = (max(old[0], s.sent), max(old[1], s.received))
        for key, (sent, received) in self._open.items():
            if key not in now:  # closed since the last reading: keep what it carried
                self._closed[0] += sent
                self._closed[1] += received
            else:  # (counters only grow; a reused address pair that restarted from 0 keeps the old ones)
                new = now[key]
                if new[0] < sent or new[1] < received:
                    self._closed[0] += sent
                    self._closed[1] += received
        self._open = now
        return (self._closed[0] + sum(v[0] for v in now.values()),
                self._closed[1] + sum(v[1] for v in now.values()))
