"""The peer's structured event log: one JSON object per line, never failing the peer."""


from worldlm_p2p.peer.events import EventLog, read_events


def test_events_round_trip_in_order(tmp_path):
    path = tmp_path / "sub" / "peer.jsonl"
    log = EventLog(path)
    log.emit("joined", peer_id="p")
    log.emit("round", round=0, outcome="averaged", group_size=2, seconds=0.5)
    log.close()
    log.emit("late")  # after close: ignored, not an error
    ev = read_events(path)
    assert [e["event"] for e in ev] == ["joined", "round"]
    assert ev[1]["group_size"] == 2 and ev[0]["mono"] <= ev[1]["mono"] and ev[0]["time"] > 1.7e9
    # a line cut by a crash, or junk, is skipped
    with path.open("a") as f:
        f.write('{"event": "round", "rou')
    assert len(read_events(path)) == 2
    assert read_events(tmp_path / "missing.jsonl") == []


def test_no_path_records_nothing_and_an_unwritable_one_is_reported(tmp_path, caplog):
    EventLog(None).emit("x")  # off
    blocker = tmp_path / "file"
    blocker.write_text("")
    log = EventLog(blocker / "peer.jsonl")  # its parent is a file: cannot be created
    log.emit("x")
    assert "cannot be written" in caplog.text
