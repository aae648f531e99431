"""CPU priority of a peer's background work (:mod:`worldlm_p2p.net.priority`), on real threads and
processes: only the threads and processes it is pointed at are lowered, with everything they start,
and never a nice value that is already lower in priority."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
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


_TREE = textwrap.dedent("""
    import os, subprocess, sys, threading, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    print(child.pid, flush=True)
    time.sleep(60)
""")


def _tasks(pid: int) -> list[int]:
    return [int(t) for t in os.listdir(f"/proc/{pid}/task")]


def test_a_process_tree_is_lowered_whole_threads_and_descendants():
    base = _nice(threading.get_native_id())
    proc = subprocess.Popen([sys.executable, "-c", _TREE], stdout=subprocess.PIPE, text=True)
    grandchild = None
    try:
        grandchild = int(proc.stdout.readline())
        tids = _tasks(proc.pid) + _tasks(grandchild)
        assert len(_tasks(proc.pid)) >= 2  # its main thread and the sleeping one
        n = priority.lower_process_tree(proc.pid, base + 5)
        assert n == len(tids)
        assert [_nice(t) for t in tids] == [base + 5] * len(tids)
        assert _nice(threading.get_native_id()) == base  # this process is not in that tree
        assert priority.lower_process_tree(proc.pid, 0) == 0
    finally:
        for pid in (grandchild, proc.pid):  # the grandchild would outlive its killed parent
            if pid is not None:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
        proc.wait()
    # a process that is gone is skipped, not an error
    assert priority.lower_process_tree(proc.pid, base + 5) == 0


def test_lower_children_lowers_every_child_process_and_not_the_caller():
    script = textwrap.dedent("""
        import os, subprocess, sys, threading
        from worldlm_p2p.net import priority
        kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
        try:
            before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            n = priority.lower_children(before + 4)
            print(n, before, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
                  *[os.getpriority(os.PRIO_PROCESS, k.pid) for k in kids])
        finally:
            for k in kids:
                k.kill()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    n, before, me, *kids = map(int, out.stdout.split())
    assert n >= 2 and me == before and kids == [before + 4, before + 4]
