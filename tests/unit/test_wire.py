"""Bytes on the wire from the kernel's TCP counters: parsing ``ss -tinp`` and the bookkeeping."""

import os
import socket
import time

from worldlm_p2p.net.wire import Socket, WireMeter, descendants, parse_ss

SS = """ESTAB 0      0      127.0.0.1:44880 127.0.0.1:36927 users:(("p2pd",pid=101,fd=4))
\t bbr wscale:10,10 rto:204 bytes_sent:100000 bytes_acked:100001 segs_out:5 bytes_received:20 segs_in:3
ESTAB 0      0      127.0.0.1:36927 127.0.0.1:44880 users:(("python3",pid=7,fd=5),("python3",pid=8,fd=5))
\t bbr wscale:10,10 rto:200 bytes_received:100000 segs_out:2
ESTAB 0      0      10.0.0.1:5 10.0.0.2:6 users:(("other",pid=999,fd=3))
\t cubic bytes_sent:5 bytes_received:6
"""


def test_parse_ss_reads_addresses_owners_and_counters():
    socks = parse_ss(SS)
    assert [s.key for s in socks] == [("127.0.0.1:44880", "127.0.0.1:36927"), ("127.0.0.1:36927", "127.0.0.1:44880"),
                                      ("10.0.0.1:5", "10.0.0.2:6")]
    assert socks[0] == Socket(key=socks[0].key, pids=frozenset({101}), sent=100000, received=20)
    assert socks[1].pids == {7, 8} and socks[1].sent == 0 and socks[1].received == 100000
    assert parse_ss("") == [] and parse_ss("garbage\n\tbytes_sent:x\n") == []


def test_the_meter_counts_only_its_process_tree_and_keeps_closed_sockets():
    m = WireMeter(root=1)
    a, b, other = (("l", "1"), ("l", "2"), ("l", "3"))
    assert m.update([Socket(a, frozenset({10}), 100, 50), Socket(other, frozenset({99}), 7, 7)], {1, 10}) == (100, 50)
    # a grows, b opens; then a closes: what it carried stays counted
    assert m.update([Socket(a, frozenset({10}), 300, 60), Socket(b, frozenset({11}), 5, 5)], {1, 10, 11}) == (305, 65)
    assert m.update([Socket(b, frozenset({11}), 9, 8)], {1, 10, 11}) == (309, 68)
    # the same address pair reused by a new connection (counters restart): the old one's bytes are kept
    assert m.update([Socket(b, frozenset({11}), 2, 1)], {1, 11}) == (311, 69)


def test_descendants_include_the_root_and_its_children():
    pid = os.getpid()
    assert pid in descendants(pid)
    assert descendants(pid, proc="/nonexistent") == {pid}


def test_the_meter_reads_this_process_sockets_where_ss_exists():
    m = WireMeter()
    if not m.available:
        assert m.sample() is None
        return
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    try:
        client.sendall(b"x" * 50000)
        got = 0
        while got < 50000:
            got += len(conn.recv(65536))
        time.sleep(0.05)
        sent, received = m.sample()
        # both ends are this process's: it sent and received the 50000 bytes
        assert sent >= 50000 and received >= 50000
    finally:
        client.close()
        conn.close()
        server.close()
