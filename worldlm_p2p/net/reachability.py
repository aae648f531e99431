"""Reachability at start: can other peers open a connection to this one?

A peer asks one or more peers it knows (its bootstrap nodes) to *dial it back*. The asked peer
starts a throw-away p2p daemon with relays off and no connection to anyone, and dials the asker
at the addresses it saw the asker's connection come from and at those the asker announces, each
on its own; it answers which ones accepted. An address behind a NAT that drops unsolicited
packets fails; a forwarded port given with ``--announce-maddrs`` succeeds.

Abuse bounds: a peer dials back only the peer that asks (``context.remote_id``), only at IP
addresses its connection came from, at most :data:`MAX_ADDRS` addresses, one probe at a time,
and a peer's answer is cached for :data:`CACHE_SECONDS`.

Wire: hivemind's ``ExpertRequest``/``ExpertResponse`` protobufs, whose ``metadata`` bytes carry
msgpack (``{"maddrs": [...]}``; ``{"dialed": {maddr: ok}}``). Everything here runs in the DHT's
process through ``DHT.run_coroutine``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass

import msgpack

logger = logging.getLogger(__name__)

HANDLER = "worldlm.dialback"
MAX_ADDRS = 8
MAX_REQUEST_BYTES = 4096
DIAL_TIMEOUT = 5.0
CACHE_SECONDS = 60.0

_state: dict = {}  # in the DHT process: the probe lock and the answer cache


@dataclass(frozen=True, slots=True)
class Reachability:
    """What the asked peers answered: ``dialed`` maps each address tried to whether a fresh
    connection to it succeeded (an address counts as reachable if any asked peer reached it)."""

    asked: int
    answered: int
    dialed: dict[str, bool]

    @property
    def reachable(self) -> list[str]:
        return sorted(m for m, ok in self.dialed.items() if ok)

    @property
    def unreachable(self) -> list[str]:
        return sorted(m for m, ok in self.dialed.items() if not ok)

    @property
    def status(self) -> str:
        """``direct``, ``not-direct`` (every address failed), or ``unknown`` (nobody answered)."""
        if not self.answered or not self.dialed:
            return "unknown"
        return "direct" if self.reachable else "not-direct"


def _host_of(maddr: str) -> str | None:
    parts = str(maddr).split("/")
    return parts[2] if len(parts) > 2 and parts[1] in ("ip4", "ip6") else None


def _strip_peer_id(maddr: str) -> str:
    text = str(maddr)
    return text.split("/p2p/")[0] if "/p2p/" in text else text


def parse_request(raw: bytes) -> list[str]:
    """The addresses a dial-back request names (at most :data:`MAX_ADDRS`, each a multiaddr with an
    IP and a TCP port, without ``/p2p``). Raises ValueError on anything else."""
    from multiaddr import Multiaddr

    if len(raw) > MAX_REQUEST_BYTES:
        raise ValueError(f"request of {len(raw)} bytes")
    body = msgpack.unpackb(raw, raw=False) if raw else {}
    if not isinstance(body, dict) or not isinstance(body.get("maddrs", []), list):
        raise ValueError("not a dial-back request")
    out = []
    for m in body.get("maddrs", [])[:MAX_ADDRS]:
        if not isinstance(m, str) or len(m) > 200:
            raise ValueError("an address is not a short string")
        text = _strip_peer_id(m)
        Multiaddr(text)  # raises on a malformed address
        if _host_of(text) is None or "/tcp/" not in text:
            raise ValueError(f"{text!r} has no ip4/ip6 host and tcp port")
        out.append(text)
    return out


async def serve_dialback(_dht, node) -> None:
    """Register the dial-back handler on this DHT's p2p (run once, through ``run_coroutine``)."""
    from hivemind.p2p import P2P
    from hivemind.proto import runtime_pb2

    p2p = node.p2p
    lock = _state.setdefault("lock", asyncio.Lock())
    cache: dict = _state.setdefault("cache", {})

    async def handler(request, context):
        remote = context.remote_id
        try:
            asked = parse_request(request.metadata)
        except Exception as e:  # msgpack, multiaddr and our own errors: a logged rejection
            logger.debug("refused a dial-back request from %s: %s", remote, e)
            return runtime_pb2.ExpertResponse(metadata=msgpack.packb(dict(error="bad request")))
        key = (remote, tuple(asked))
        hit = cache.get(key)
        if hit is not None and hit[0] > time.monotonic():
            return runtime_pb2.ExpertResponse(metadata=hit[1])
        observed = []
        for info in await p2p.list_peers():
            if info.peer_id == remote:
                observed = [_strip_peer_id(str(a)) for a in info.addrs if "p2p-circuit" not in str(a)]
        hosts = {_host_of(m) for m in observed}
        candidates = list(dict.fromkeys([m for m in observed if "/tcp/" in m]
                                        + [m for m in asked if _host_of(m) in hosts]))[:MAX_ADDRS]
        dialed: dict[str, bool] = {}
        async with lock:
            for maddr in candidates:
                dialed[maddr] = await _dial(P2P, remote, maddr)
        payload = msgpack.packb(dict(dialed=dialed))
        cache[key] = (time.monotonic() + CACHE_SECONDS, payload)
        if len(cache) > 1024:
            cache.clear()
        return runtime_pb2.ExpertResponse(metadata=payload)

    await p2p.add_protobuf_handler(HANDLER, handler, runtime_pb2.ExpertRequest)


async def _dial(P2P, remote, maddr: str) -> bool:
    """Whether a fresh p2p daemon, relays off, connects to ``remote`` at ``maddr`` in time."""
    from multiaddr import Multiaddr

    probe = None
    try:
        probe = await P2P.create(no_listen=True, use_relay=False, use_auto_relay=False, auto_nat=False,
                                 nat_port_map=False, dht_mode="client")
        await asyncio.wait_for(probe._client.connect(remote, [Multiaddr(maddr)]), DIAL_TIMEOUT)
        return True
    except Exception as e:
        logger.debug("dial-back to %s at %s failed: %s: %s", remote, maddr, type(e).__name__, e)
        return False
    finally:
        if probe is not None:
            try:
                await probe.shutdown()
            except Exception:
                pass


async def ask_dialback(_dht, node, *, peer_ids: list[str], maddrs: list[str], timeout: float) -> dict:
    """Ask each of ``peer_ids`` to dial this peer back (at ``maddrs`` and where they see it);
    returns ``{"asked", "answered", "dialed"}``."""
    from hivemind.p2p import PeerID
    from hivemind.proto import runtime_pb2

    request = runtime_pb2.ExpertRequest(metadata=msgpack.packb(dict(maddrs=[_strip_peer_id(m) for m in maddrs
                                                                            ][:MAX_ADDRS])))

    async def one(peer: str):
        try:
            response = await asyncio.wait_for(node.p2p.call_protobuf_handler(
                PeerID.from_base58(peer), HANDLER, request, runtime_pb2.ExpertResponse), timeout)
            body = msgpack.unpackb(response.metadata, raw=False)
            dialed = body.get("dialed") if isinstance(body, dict) else None
            if not isinstance(dialed, dict):
                return None
            return {str(k): bool(v) for k, v in list(dialed.items())[:MAX_ADDRS]}
        except Exception as e:
            logger.debug("dial-back request to %s failed: %s: %s", peer, type(e).__name__, e)
            return None

    answers = await asyncio.gather(*(one(p) for p in peer_ids))
    dialed: dict[str, bool] = {}
    for a in answers:
        for m, ok in (a or {}).items():
            dialed[m] = dialed.get(m, False) or ok
    return dict(asked=len(peer_ids), answered=sum(a is not None for a in answers), dialed=dialed)


def check(dht, peer_ids: list[str], maddrs: list[str], *, timeout: float = 30.0) -> Reachability:
    """Run :func:`ask_dialback` in the DHT's process; never raises (``unknown`` on failure)."""
    try:
        ask = functools.partial(ask_dialback, peer_ids=list(peer_ids), maddrs=list(maddrs), timeout=timeout)
        out = dht.run_coroutine(ask, return_future=True).result(timeout=timeout + 10)
        return Reachability(asked=out["asked"], answered=out["answered"], dialed=out["dialed"])
    except Exception as e:
        logger.debug("reachability check failed: %s: %s", type(e).__name__, e)
        return Reachability(asked=len(peer_ids), answered=0, dialed={})


def advice(r: Reachability, *, announce_given: bool, outbound: bool = False) -> str:
    """One line: what this peer is and, when not directly reachable, what to do (``outbound``: the
    peer goes on as an outbound-only member)."""
    if r.status == "unknown":
        return (f"reachability: unknown (none of the {r.asked} peers asked answered a dial-back request); "
                "other peers may not be able to open connections to this one")
    if r.status == "direct":
        line = f"reachability: directly reachable at {', '.join(r.reachable)}"
        if r.unreachable:
            line += f"; not at {', '.join(r.unreachable)}"
        return line
    port = next((m.split("/tcp/")[1].split("/")[0] for m in r.unreachable if "/tcp/" in m), "PORT")
    return (f"reachability: NOT directly reachable (dialled back at {', '.join(r.unreachable)}: no answer); "
            f"forward TCP port {port} of your router to this machine and "
            + ("check that the address given with --announce-maddrs is your public one" if announce_given else
               f"add --announce-maddrs /ip4/<your public ip>/tcp/{port}")
            + ("; until then this peer runs outbound-only: it sends its part of every region round to a reachable "
               "member and gets the average back, but never reduces, serves its model or leads its region"
               if outbound else "; until then only peers this one dials can average with it"))
