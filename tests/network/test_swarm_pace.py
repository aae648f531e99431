"""Peers of different speeds (``aggregation.schedule = "tokens"``), real processes on 127.0.0.1.

A region round is due when the region has trained H steps' worth of tokens per member, whatever
each member's speed: a member twice as slow neither stalls the fast one nor is left out of rounds,
and each contributes what it trained, weighted by its tokens. The slow member runs its rounds'
threads at a lower CPU priority (``--background-nice``), never its training thread nor the hivemind
and p2pd processes that serve the swarm.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from swarm_utils import log_tail, start_bootstrap, start_peer, summary, traces, wait_for

# extended (outside .ci/run, whose slow set ran past its 15 minutes): the pace rule itself is
# tests/unit/test_barrier.py's (round_due), the thread priorities tests/unit/test_priority.py's
pytestmark = [pytest.mark.network, pytest.mark.slow, pytest.mark.extended]


def _tree_nice(pid: int) -> dict[int, int]:
    """The nice value of every thread of ``pid``'s descendants (not of ``pid`` itself)."""
    kids = [int(d.parent.name) for d in Path("/proc").glob("[0-9]*/stat")
            if (t := _read(d)) and t[t.rfind(")") + 2:].split()[1] == str(pid)]
    out = {}
    for k in kids:
        for t in Path(f"/proc/{k}/task").glob("*"):
            try:
                out[int(t.name)] = os.getpriority(os.PRIO_PROCESS, int(t.name))
            except OSError:
                pass
        out.update(_tree_nice(k))
    return out


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def test_a_peer_twice_as_slow_neither_stalls_the_other_nor_is_left_out(procs, tmp_path):
    _, maddrs = start_bootstrap(procs, tmp_path, run_id="pace", inner_steps=5,
                                aggregation='schedule = "tokens"\noverlap = true')
    # both emulate slower devices (sleeping, so a loaded machine's CPU time is not the limit): a step of
    # the tiny model takes milliseconds, a round on a busy CI machine up to a second or two, and at full
    # speed the fast peer could finish its 60 steps within two rounds
    fast = start_peer(procs, tmp_path, maddrs, region="eu", sub="de_news-reviews-wiki", label="fast", max_steps=60,
                      extra=["--wait-for-peers", "2", "--slowdown", "4"])
    slow = start_peer(procs, tmp_path, maddrs, region="eu", sub="es_blog-news-reviews-wiki", label="slow",
                      max_steps=60, extra=["--wait-for-peers", "2", "--slowdown", "8", "--background-nice", "7"])
    base = os.getpriority(os.PRIO_PROCESS, 0)
    background = max(base, 7)  # (an absolute nice value; one already lower in priority stays)
    wait_for(lambda: slow.poll() is not None or "run at nice 7" in (tmp_path / "logs" / "slow.log").read_text(),
             120, "the slow peer to set up its rounds' priority")
    assert slow.poll() is None, log_tail(tmp_path, "slow")
    # its training thread keeps its priority, and so does every thread of the processes it started
    # (the DHT and its p2pd, the averager), which answer the swarm's lookups and matchmaking
    assert os.getpriority(os.PRIO_PROCESS, slow.pid) == base
    kept = _tree_nice(slow.pid)
    assert len(kept) >= 3 and set(kept.values()) == {base}, kept
    for p, label in ((fast, "fast"), (slow, "slow")):
        wait_for(lambda p=p: p.poll() is not None, 300, f"{label} to finish")
        assert p.returncode == 0, f"{label} exited {p.returncode}:\n{log_tail(tmp_path, label)}"

    # the rounds the two held together: both took part, each weighted by the tokens it trained
    pairs = [t for t in traces(tmp_path, "fast").values() if t["ok"] and len(t["gathered"]) == 2]
    assert len(pairs) >= 3, (len(pairs), log_tail(tmp_path, "fast"))
    ratios = []
    for t in pairs:
        g = {m["label"]: m for m in t["gathered"].values()}
        assert set(g) == {"fast", "slow"} and g["slow"]["tokens"] > 0
        assert all(g[x]["weight"] == g[x]["tokens"] for x in g)  # (aggregation.round_weight: the tokens)
        ratios.append(g["fast"]["tokens"] / g["slow"]["tokens"])
    # about twice the tokens per round (the slow one's steps take twice as long); never the same
    # H steps each, which is what the step schedule would have made of them
    ratios.sort()
    assert ratios[len(ratios) // 2] > 1.3, ratios
    # the fast peer was not held to the slow one's pace: it finished its 60 steps while the slow one,
    # at about half its speed, had made far fewer (it then trained on alone)
    s_fast, s_slow = summary(tmp_path, "fast"), summary(tmp_path, "slow")
    assert s_fast["steps"] == 60 and s_slow["steps"] == 60
    slow_at_fast_end = max(t["step"] for t in traces(tmp_path, "slow").values()
                           if any(m["label"] == "fast" for m in t["gathered"].values()))
    assert slow_at_fast_end < 49, slow_at_fast_end  # (held to its pace: about 60)
    assert s_fast["rounds_completed"] >= 3 and s_slow["rounds_completed"] >= 3
    # the rounds' network parts ran in threads at the slow member's background priority, and at the
    # training's own in the fast one
    assert {t["nice"] for t in traces(tmp_path, "slow").values()} == {background}
    assert {t["nice"] for t in traces(tmp_path, "fast").values()} == {base}
