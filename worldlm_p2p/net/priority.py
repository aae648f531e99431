"""CPU priority of a peer's background work: the threads of its region and world rounds.

A peer's rounds overlap with its training (``aggregation.overlap``), but on a machine whose cores
all train (a CPU peer, or several peers on one machine) the round's work in the peer's own process
(the payload's encoding, the evidence search on the member's tune slice, the stale application's
preparation, the all-reduce's client side) takes its CPU from training. With a background nice
value ``n > 0`` (``worldlm-peer --background-nice n``) the round threads run at a lower priority
than the training thread: the kernel gives them the cycles training leaves, and a share of about
``w(n) / (w(0) + w(n))`` of a contended core otherwise (Linux CFS weights: 1024 at nice 0, 110 at
10, 15 at 19), so rounds take longer when the cores are busy and training keeps its speed. On a GPU
peer the cores are mostly free and rounds run as fast as at nice 0.

The hivemind processes (the DHT and its p2pd, the averagers) keep the peer's priority: they serve
the whole swarm (DHT lookups, matchmaking, the other members' all-reduce parts), and at a low
priority next to busy training processes they answer too late for a group to form. Measured
(``benchmarks/RESULTS.md``, issue 14): with them lowered too, 16 peers in 4 regions on 2 cores held
no whole region in any round, against every group whole with the threads alone lowered, which buy
as much of the training's speed in regions of 2 and 4.

On Linux a nice value belongs to a thread (``setpriority(PRIO_PROCESS, tid)``); raising it needs no
privilege, lowering it again does, so nothing here ever lowers one. Elsewhere a nice value belongs
to the whole process, and nothing is changed (it would slow the training thread too).
"""

from __future__ import annotations

import logging
import os
import sys
import threading

logger = logging.getLogger(__name__)

_warned: set[str] = set()


def _warn_once(what: str, e: OSError) -> None:
    level = logging.DEBUG if what in _warned else logging.WARNING
    _warned.add(what)
    logger.log(level, "could not lower the CPU priority of %s: %s; it runs at the priority it has", what,
               e.strerror or e)


def _lower(tid: int, nice: int) -> None:
    """Set thread (Linux) or process ``tid``'s nice value to ``nice`` unless it is already at least
    that (a raise only: never needs a privilege)."""
    if os.getpriority(os.PRIO_PROCESS, tid) < nice:
        os.setpriority(os.PRIO_PROCESS, tid, nice)


def lower_this_thread(nice: int) -> None:
    """Lower the calling thread's CPU priority to nice value ``nice`` (0: leave it as it is). On
    systems where a nice value belongs to the whole process (not Linux) this does nothing: it would
    slow the training thread too."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        _lower(threading.get_native_id(), nice)
    except OSError as e:
        _warn_once("a round thread", e)


def thread_nice() -> int | None:
    """The calling thread's nice value (None where it cannot be read)."""
    try:
        tid = threading.get_native_id() if sys.platform.startswith("linux") else 0
        return os.getpriority(os.PRIO_PROCESS, tid)
    except OSError:
        return None
