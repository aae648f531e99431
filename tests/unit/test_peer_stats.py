"""A peer's counters: the checkpoint and summary views come from one definition."""

import math

from worldlm_p2p.peer.stats import PeerStats

# what a checkpoint held before the views were derived (peer.py of 2026-12-01): resume depends on it
CHECKPOINTED = {"step", "tokens", "round", "rounds_completed", "rounds_failed", "bytes_sent", "bytes_received",
                "tokens_since_round", "first_train_loss", "world_round", "world_rounds_led", "world_rounds_adopted",
                "rounds_since_world", "bytes_sent_border", "last_train_loss", "group_sizes", "history", "mixes",
                "rounds_partial"}  # (rounds_partial: added with the partial-round outcome; absent in older ones)
# what summary.json carried from the stats (readers: worldlm-swarm, benchmarks, report)
SUMMARY = {"started_from", "initial_step", "steps", "tokens", "rounds_completed", "rounds_failed", "group_sizes",
           "round_seconds", "seconds_to_first_round", "first_train_loss", "last_train_loss", "bytes_sent",
           "bytes_received", "bytes_sent_border", "world_round", "world_rounds_led", "world_rounds_adopted",
           "history", "mixes", "rounds_partial", "wire_sent", "wire_received",
           "seconds_in_rounds"}  # (seconds_in_rounds: added with overlapped rounds)


def test_views_name_the_fields_they_always_did():
    s = PeerStats()
    assert set(s.checkpoint_view()) == CHECKPOINTED
    assert set(s.summary_view()) == SUMMARY


def test_restore_round_trip_and_copies():
    s = PeerStats()
    for _ in range(3):
        s.count_step(tokens=10, loss=2.0)
    s.history_point()
    s.count_round(group_size=2, seconds=0.5, sent=100, received=90)
    s.mixes.append(dict(kind="region", round=0, step=3, lam=0.25, gain=0.1))
    saved = s.checkpoint_view()
    r = PeerStats()
    r.restore(saved)
    assert r.checkpoint_view() == saved
    assert (r.step, r.tokens, r.rounds_completed, r.group_sizes, r.bytes_sent) == (3, 30, 1, [2], 100)
    r.history[0]["loss"] = -1.0  # the restored lists are copies, not the checkpoint's
    assert saved["history"][0]["loss"] == 2.0
    assert r.round_seconds == [] and r.started_from == "init"  # not checkpointed


def test_counting():
    s = PeerStats()
    s.count_step(tokens=8, loss=math.nan)  # a DP-SGD step on an empty batch: tokens count, no loss
    s.count_step(tokens=8, loss=3.0)
    s.count_step(tokens=8, loss=1.0)
    assert (s.step, s.tokens, s.tokens_since_round, s.first_train_loss, s.last_train_loss) == (3, 24, 24, 3.0, 1.0)
    s.history_point()
    assert s.history[-1]["loss"] == 2.0 and (s.span_steps, s.span_loss) == (0, 0.0)
    s.count_round(group_size=3, seconds=1.23456, sent=1, received=2)
    assert s.tokens_since_round == 0 and s.summary_view()["round_seconds"] == [1.2346]
    assert PeerStats().summary_view()["last_train_loss"] is None  # NaN is not JSON
    assert s.recent_mix("region") == -1.0
