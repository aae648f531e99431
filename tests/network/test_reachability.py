"""The dial-back reachability check on real hivemind DHTs over 127.0.0.1: the asked peer dials the
asker from a fresh daemon, only at the asker's own IP addresses, and bad requests are refused."""

from __future__ import annotations

import msgpack
import pytest

from worldlm_p2p.net import reachability as R
from worldlm_p2p.net.hivemind_compat import detach_p2p_daemon_from_process_group

pytestmark = pytest.mark.network


@pytest.fixture(scope="module")
def pair():
    from hivemind import DHT

    detach_p2p_daemon_from_process_group()
    boot = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    peer = None
    try:
        boot.run_coroutine(R.serve_dialback)
        peer = DHT(start=True, initial_peers=[str(m) for m in boot.get_visible_maddrs()],
                   host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        yield boot, peer
    finally:
        if peer is not None:
            peer.shutdown()
        boot.shutdown()


def test_dialled_back_where_it_listens_not_at_a_closed_port_nor_at_another_host(pair):
    boot, peer = pair
    own = [str(m) for m in peer.get_visible_maddrs()]
    port = own[0].split("/tcp/")[1].split("/")[0]
    closed = "/ip4/127.0.0.1/tcp/9"  # discard: nobody listens there
    other_host = "/ip4/10.11.12.13/tcp/4000"  # not where the asker's connection came from
    r = R.check(peer, [str(boot.peer_id)], own + [closed, other_host], timeout=20)
    assert (r.asked, r.answered, r.status) == (1, 1, "direct")
    assert r.reachable == [f"/ip4/127.0.0.1/tcp/{port}"]
    assert r.unreachable == [closed]
    assert other_host not in r.dialed  # never dialled: a peer cannot make others probe a third host
    assert "directly reachable at /ip4/127.0.0.1/tcp/" in R.advice(r, announce_given=False)


def test_a_peer_that_serves_no_dial_back_leaves_the_status_unknown(pair):
    boot, peer = pair
    # the peer itself serves nothing: asking it (from the bootstrap) gets no answer
    r = R.check(boot, [str(peer.peer_id)], [], timeout=5)
    assert (r.answered, r.status) == (0, "unknown")
    assert "unknown" in R.advice(r, announce_given=False)


def test_bad_requests_are_refused_before_anything_is_dialled():
    for raw in (b"\xc1", msgpack.packb([1, 2]), msgpack.packb(dict(maddrs="x")), msgpack.packb(dict(maddrs=[7])),
                msgpack.packb(dict(maddrs=["/ip4/1.2.3.4/udp/5"])), msgpack.packb(dict(maddrs=["not a maddr"])),
                b"\x00" * (R.MAX_REQUEST_BYTES + 1)):
        with pytest.raises(Exception):
            R.parse_request(raw)
    many = [f"/ip4/127.0.0.1/tcp/{1000 + i}/p2p/QmaqJesiNcZak8Ns1727tE9RGyDzXE1w7qZxtnr2hcVipv" for i in range(20)]
    assert R.parse_request(msgpack.packb(dict(maddrs=many))) == [m.split("/p2p/")[0] for m in many[:R.MAX_ADDRS]]
    assert R.parse_request(b"") == []


def test_advice_says_what_to_do_when_not_directly_reachable():
    r = R.Reachability(asked=2, answered=2, dialed={"/ip4/192.168.1.5/tcp/31337": False})
    line = R.advice(r, announce_given=False)
    assert r.status == "not-direct" and "NOT directly reachable" in line
    assert "forward TCP port 31337" in line and "--announce-maddrs /ip4/<your public ip>/tcp/31337" in line
    assert "check that the address given with --announce-maddrs" in R.advice(r, announce_given=True)


def test_advice_of_a_peer_that_goes_on_outbound_only():
    r = R.Reachability(asked=1, answered=1, dialed={"/ip4/11.0.0.40/tcp/31338": False})
    line = R.advice(r, announce_given=False, outbound=True)
    assert "forward TCP port 31338" in line and "runs outbound-only" in line and "never reduces" in line
    assert "outbound-only" not in R.advice(r, announce_given=False)  # (--reachability direct: it is not)
