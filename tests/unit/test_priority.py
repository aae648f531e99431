"""CPU priority of a peer's round threads (:mod:`worldlm_p2p.net.priority`), on real threads: only
the thread that asks is lowered, never the others of its process, and never a nice value that is
already lower in priority."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from worldlm_p2p.net import priority

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice values per thread: Linux"),
    # the tests raise nice values by up to 10 above this process's own: they need room below 19
    pytest.mark.skipif(sys.platform.startswith("linux") and os.getpriority(os.PRIO_PROCESS, 0) > 9,
                       reason="this process already runs at a nice value above 9"),
]


def _nice(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def _in_thread(fn):
    out = {}

    def run():
        out["result"] = fn()
        out["tid"] = threading.get_native_id()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out


def test_a_thread_is_lowered_and_the_others_are_not():
    main_before = _nice(threading.get_native_id())

    def lowered():
        priority.lower_this_thread(main_before + 7)
        return priority.thread_nice()

    out = _in_thread(lowered)
    assert out["result"] == main_before + 7
    assert _nice(threading.get_native_id()) == main_before  # the caller's (training) thread is untouched
    assert priority.thread_nice() == main_before


def test_zero_leaves_a_thread_as_it_is_and_a_lower_priority_is_never_raised():
    base = _nice(threading.get_native_id())

    def zero():
        priority.lower_this_thread(0)
        return priority.thread_nice()

    assert _in_thread(zero)["result"] == base

    def already_lower():
        priority.lower_this_thread(base + 10)
        priority.lower_this_thread(base + 3)  # would need a privilege, and would speed it up: never
        return priority.thread_nice()

    assert _in_thread(already_lower)["result"] == base + 10
