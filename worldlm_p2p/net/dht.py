"""Joining the hivemind DHT: multiaddr validation, identity files, bounded retries.

Pitfalls handled here (see hivemind issues): the default host address is loopback only, the p2p
daemon can take long to start, and an unreachable bootstrap node must produce one clear error that
names the address instead of a traceback from the daemon.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Iterable, Sequence

from multiaddr import Multiaddr

from worldlm_p2p.config import NetConfig
from worldlm_p2p.errors import AddressError, ConfigError
from worldlm_p2p.net import hivemind_compat

logger = logging.getLogger(__name__)


def parse_maddrs(values: Iterable[str], *, what: str, require_peer_id: bool) -> tuple[str, ...]:
    """Validate multiaddrs; return them as canonical strings.

    ``require_peer_id``: initial peers must end with ``/p2p/<peer id>`` so that the DHT knows whom
    it dials. Raises :class:`AddressError` with the offending address.
    """
    out = []
    for value in values:
        text = str(value).strip()
        try:
            maddr = Multiaddr(text)
        except Exception as e:  # multiaddr raises several exception types for bad input
            raise AddressError(f"malformed multiaddr {text!r} in {what}: {e}") from None
        protocols = [p.name for p in maddr.protocols()]
        if not any(p in protocols for p in ("ip4", "ip6", "dns", "dns4", "dns6")):
            raise AddressError(f"multiaddr {text!r} in {what} has no ip4/ip6/dns part")
        if not any(p in protocols for p in ("tcp", "udp")):
            raise AddressError(f"multiaddr {text!r} in {what} has no tcp/udp port")
        if require_peer_id and "p2p" not in protocols:
            raise AddressError(f"multiaddr {text!r} in {what} lacks the /p2p/<peer id> part; copy the full "
                               "address that worldlm-bootstrap printed")
        out.append(str(maddr))
    return tuple(out)


def check_listen_addrs(values: Iterable[str], *, what: str) -> None:
    """Fail fast, with one line, when this process cannot listen where ``values`` say.

    libp2p binds with ``SO_REUSEPORT``: a second node on a port in use would start and share the
    address with the first (two peer ids, one port), and an address that is not this machine's
    shows up only as "could not reach bootstrap" after the retries. Binding a plain socket first
    names the cause. DNS names are not checked.
    """
    import errno
    import socket

    for text in values:
        maddr = Multiaddr(str(text))
        values_of = {p.name: maddr.value_for_protocol(p.code) for p in maddr.protocols()}
        host = values_of.get("ip4") or values_of.get("ip6")
        kind = "tcp" if "tcp" in values_of else "udp" if "udp" in values_of else None
        if host is None or kind is None:
            continue
        port = int(values_of[kind])  # (port 0 binds any free port: that still checks the address)
        family = socket.AF_INET6 if "ip6" in values_of else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM if kind == "tcp" else socket.SOCK_DGRAM)
        if kind == "tcp":  # a restarted node's old connections in TIME_WAIT do not count; a listener does
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise AddressError(f"{what} {text}: {kind} port {port} is already in use on {host} (another "
                                   "worldlm-bootstrap or peer?); choose another port, or port 0 for any") from None
            if e.errno == errno.EADDRNOTAVAIL:
                raise AddressError(f"{what} {text}: {host} is not an address of this machine; listen on "
                                   "0.0.0.0 (or ::) and give the public address with --announce-maddrs") from None
            if e.errno == errno.EACCES:
                raise AddressError(f"{what} {text}: no permission to listen on {kind} port {port} "
                                   "(ports below 1024 need privileges)") from None
            raise AddressError(f"{what} {text}: cannot listen there: {e.strerror or e}") from None
        finally:
            sock.close()


def initial_peer_ids(maddrs: Iterable[str]) -> tuple[str, ...]:
    """The peer ids named by ``/p2p/<id>`` in these multiaddrs (the bootstrap nodes a process joins
    through: the run keys of the manifests they stored are the ones it trusts by default)."""
    out = []
    for m in maddrs:
        parts = str(m).split("/")
        for i, part in enumerate(parts[:-1]):
            if part == "p2p":
                out.append(parts[i + 1])
    return tuple(out)


def write_identity(path: str | Path, key) -> None:
    """Write ``key`` (an ``RSAPrivateKey``) as a libp2p key file at ``path``, mode 0600, atomically."""
    from hivemind.proto import crypto_pb2

    path = Path(path)
    blob = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=key.to_bytes()).SerializeToString()
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, blob)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def ensure_identity(path: str | Path, *, announce: bool = True):
    """Load the libp2p identity at ``path`` or create it (mode 0600) if missing.

    The same RSA key signs this process's DHT records, so a restarted peer keeps both its peer id
    and the right to update its own records. Returns a ``hivemind.utils.crypto.RSAPrivateKey``.
    """
    from hivemind.proto import crypto_pb2
    from hivemind.utils.crypto import RSAPrivateKey

    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"identity {path} is a directory, expected a key file")
    if not path.exists():
        if not path.parent.is_dir():
            raise ConfigError(f"cannot create identity {path}: directory {path.parent} does not exist")
        key = RSAPrivateKey()
        write_identity(path, key)
        if announce:
            logger.info("created a new identity at %s (mode 0600); keep it private and back it up", path)
        return key
    try:
        blob = path.read_bytes()
        proto = crypto_pb2.PrivateKey.FromString(blob)
        if proto.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError("not an RSA key")
        key = hivemind_compat.rsa_key_from_der(proto.data)
    except PermissionError:
        raise ConfigError(f"cannot read identity {path}: permission denied") from None
    except Exception as e:
        raise ConfigError(f"identity {path} is not a valid libp2p RSA key file ({type(e).__name__})") from None
    if os.stat(path).st_mode & 0o077:
        logger.warning("identity %s is readable by other users; run: chmod 600 %s", path, path)
    return key


def start_dht(net: NetConfig, *, record_validators: Sequence = (), client_mode: bool = False,
              require_initial_peers: bool = True):
    """Start a hivemind DHT node that joins ``net.initial_peers``.

    Retries ``net.connect_retries`` times with exponential backoff; then raises
    :class:`AddressError` naming the bootstrap addresses it could not reach. With
    ``require_initial_peers=False`` (bootstrap nodes that list each other for redundancy) it starts
    alone instead, with a warning, so that a cold start of the whole set of nodes works.
    """
    from hivemind import DHT

    initial = parse_maddrs(net.initial_peers, what="--initial-peers", require_peer_id=True)
    host = parse_maddrs(net.host_maddrs, what="--host-maddrs", require_peer_id=False)
    announce = parse_maddrs(net.announce_maddrs, what="--announce-maddrs", require_peer_id=False)
    check_listen_addrs(host, what="--host-maddrs")
    kwargs = dict(
        initial_peers=list(initial),
        host_maddrs=list(host),
        record_validators=list(record_validators),
        client_mode=client_mode,
        startup_timeout=net.startup_timeout,
        # a bootstrap we cannot reach is an error, not a lonely swarm
        ensure_bootstrap_success=bool(initial),
    )
    if announce:
        kwargs["announce_maddrs"] = list(announce)
    if net.identity_path:
        if not Path(net.identity_path).exists():
            ensure_identity(net.identity_path)
        kwargs["identity_path"] = str(net.identity_path)
        kwargs["check_if_identity_free"] = False  # slow; peer ids collide only if a key file is copied
    delay = net.connect_backoff
    last_error = ""
    for attempt in range(net.connect_retries + 1):
        try:
            return DHT(start=True, **kwargs)
        except Exception as e:  # hivemind raises P2PDaemonError, TimeoutError, ...
            last_error = " ".join(str(e).split())[:200] or type(e).__name__
            if not initial:
                raise AddressError(f"could not start the DHT on {', '.join(host)}: {last_error}") from None
            if attempt < net.connect_retries:
                logger.warning("could not join the DHT via %s (attempt %d/%d): %s; retrying in %.1fs",
                               ", ".join(initial), attempt + 1, net.connect_retries + 1, last_error, delay)
                time.sleep(delay)
                delay *= 2
    if not require_initial_peers:
        logger.warning("none of %s answered; starting alone (they can join this node later)", ", ".join(initial))
        kwargs.update(initial_peers=[], ensure_bootstrap_success=False)
        try:
            return DHT(start=True, **kwargs)
        except Exception as e:
            last_error = " ".join(str(e).split())[:200] or type(e).__name__
            raise AddressError(f"could not start the DHT on {', '.join(host)}: {last_error}") from None
    raise AddressError(f"could not reach bootstrap peer(s) {', '.join(initial)} after "
                       f"{net.connect_retries + 1} attempts: {last_error}")


def visible_maddrs(dht) -> list[str]:
    """The full multiaddrs (with /p2p/<peer id>) that other processes can use as initial peers."""
    return [str(m) for m in dht.get_visible_maddrs(latest=True)]


async def _redial(_dht, node, *, maddrs: list[str], timeout: float) -> list[str]:  # runs in the DHT process
    """Connect to and ping each of ``maddrs`` (full, with ``/p2p/<id>``) whose peer this node has no
    connection to; returns the ones that answered. The ping makes the other side's DHT node learn
    this one again (a server-mode node only: a client stays out of routing tables)."""
    import asyncio

    from hivemind.p2p import PeerID

    connected = {str(info.peer_id) for info in await node.p2p.list_peers()}
    wanted: dict[str, list[str]] = {}
    for m in maddrs:
        addr, _, pid = str(m).rpartition("/p2p/")
        if pid and pid != str(node.peer_id) and pid not in connected:
            wanted.setdefault(pid, []).append(addr)

    async def one(pid: str, addrs: list[str]) -> bool:
        try:
            peer = PeerID.from_base58(pid)
            await asyncio.wait_for(node.p2p._client.connect(peer, [Multiaddr(a) for a in addrs]), timeout)
            return await asyncio.wait_for(node.protocol.call_ping(peer), timeout) is not None
        except Exception as e:
            logger.debug("re-dialling %s failed: %s: %s", pid, type(e).__name__, e)
            return False

    results = await asyncio.gather(*(one(pid, addrs) for pid, addrs in wanted.items()))
    return [f"{addrs[0]}/p2p/{pid}" for (pid, addrs), ok in zip(wanted.items(), results) if ok]


def redial(dht, maddrs: Sequence[str], *, timeout: float = 5.0) -> list[str]:
    """Re-dial the bootstrap nodes this process was given and is no longer connected to (a node that
    restarted, or came back after an outage), so that it finds the swarm again even when it kept no
    memory of its peers. Returns the ones reached again; never raises."""
    import functools

    if not maddrs:
        return []
    try:
        call = functools.partial(_redial, maddrs=list(maddrs), timeout=timeout)
        return dht.run_coroutine(call, return_future=True).result(timeout=3 * timeout)
    except Exception as e:
        logger.debug("re-dialling the bootstrap nodes failed: %s: %s", type(e).__name__, e)
        return []
