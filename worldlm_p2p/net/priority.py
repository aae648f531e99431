"""CPU priority of a peer's background work: its round threads, and the hivemind and p2pd processes.

A peer's rounds overlap with its training (``aggregation.overlap``), but on a machine whose cores
all train (a CPU peer, or several peers on one machine) the round's work (the all-reduce in the
averager process, the DHT and p2pd, the payload's encoding and the evidence search in the round's
thread) takes its CPU from training. With a background nice value ``n > 0`` (``worldlm-peer
--background-nice n``) that work runs at a lower priority than the training thread: the kernel gives
it the cycles training leaves, and a share of about ``w(n) / (w(0) + w(n))`` of a contended core
otherwise (Linux CFS weights: 1024 at nice 0, 110 at 10, 15 at 19), so rounds take longer when the
cores are busy and training keeps its speed. On a GPU peer the cores are mostly free and rounds run
as fast as at nice 0.

On Linux a nice value belongs to a thread (``setpriority(PRIO_PROCESS, tid)``) and new threads and
child processes inherit their creator's, so lowering every thread of a process tree once, right
after it starts, covers the threads and processes it makes later. Raising a nice value needs no
privilege; lowering it again does, so nothing here ever lowers one.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

MAX_NICE = 19
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


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # it ended meanwhile
            continue
        # the command name, in parentheses, may itself hold spaces and parentheses
        fields = text[text.rfind(")") + 2:].split()
        if len(fields) > 1 and fields[1] == str(pid):
            out.append(int(stat.parent.name))
    return out


def lower_process_tree(pid: int, nice: int, *, what: str = "a background process") -> int:
    """Lower every thread of process ``pid`` and of its descendants to nice value ``nice`` (0: do
    nothing); return how many threads were set or already there. A process or thread that ends
    meanwhile is skipped; one this user may not change is logged once and skipped."""
    if nice <= 0:
        return 0
    if not sys.platform.startswith("linux"):  # a nice value per process
        try:
            _lower(pid, nice)
            return 1
        except OSError as e:
            _warn_once(what, e)
            return 0
    done, seen, todo = 0, set(), [pid]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            tids = [int(t.name) for t in Path(f"/proc/{p}/task").iterdir()]
        except OSError:  # the process ended
            continue
        for tid in tids:
            try:
                _lower(tid, nice)
                done += 1
            except ProcessLookupError:
                continue
            except OSError as e:
                _warn_once(what, e)
        todo.extend(_children(p))
    return done


def lower_children(nice: int) -> int:
    """Lower every process this one started (the hivemind DHT and its p2pd, the averagers), with
    their threads and descendants, to nice value ``nice``; return how many threads."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return 0
    return sum(lower_process_tree(child, nice) for child in _children(os.getpid()))
