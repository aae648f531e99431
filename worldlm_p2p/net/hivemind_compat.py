"""Every use of hivemind's private API, in one place, for the pinned version (``hivemind==1.1.12``).

WorldLM extends hivemind at three seams that its public API does not offer:

- **calls into the averager's process** (:func:`call_in_averager`): hivemind runs each
  ``DecentralizedAverager`` in a child process and sends it ``(method name, args, kwargs)`` over its
  private control pipe ``_outer_pipe``; a method of our subclass runs there, as hivemind's own
  ``_load_state_from_peers`` does;
- **the matchmaking group size** (:func:`set_matchmaking_group_size`, inside that process): hivemind
  keeps the target size in its ``Matchmaking`` object and in its ``PotentialLeaders`` bookkeeping;
- **state download from one chosen peer** (:func:`state_stub`): hivemind's ``rpc_download_state``
  asked of a given peer through the averager's private ``_p2p`` handle, instead of its
  ``load_state_from_peers``, which picks the peer with the highest declared priority;
- **admission at the averager's doors** (:class:`worldlm_p2p.net.averaging.RegionAverager`): it
  overrides hivemind's ``rpc_join_group``, ``rpc_aggregate_part`` and ``rpc_download_state`` (public
  RPC handlers) and its private ``_aggregate_with_group`` (where a group's members are first known);
- **a robust all-reduce** (:mod:`worldlm_p2p.net.robust_allreduce`): the averager's private
  ``_run_allreduce_inplace_`` builds our runner, handed to hivemind's ``_running_groups``
  (:func:`register_runner`); the runner replaces its ``TensorPartReducer`` (whose bookkeeping fields
  it reuses) and watches its ``TensorPartContainer``'s ``register_processed_part`` /
  ``register_failed_reducer``, reads its ``_input_parts_by_peer`` and sets ``return_deltas`` off
  (the runner yields averaged values, so that a lossy codec leaves the group equal);
- **the decoder of 8-bit messages** (:func:`worldlm_p2p.net.codecs.install`): hivemind's registry
  ``hivemind.compression.serialization._BASE_COMPRESSION_TYPES`` gets our ``UNIFORM_8BIT`` codec;
- **an RSA key from its DER bytes** (:func:`rsa_key_from_der`): hivemind's ``RSAPrivateKey`` has no
  loader from bytes other than its pickle state; and **a public key's DER form**
  (:func:`rsa_public_der`), which a libp2p peer id hashes.

:func:`check` inspects the installed hivemind for each of them; ``tests/unit/test_hivemind_compat.py``
fails loudly when the pinned version changes or a seam moved. At run time a failure at a seam is
logged as a warning (once per seam) and the caller falls back (a full matchmaking window, a
download that returns nothing), never silently.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

PINNED = "1.1.12"
_warned: set[str] = set()


def warn_once(seam: str, error: BaseException) -> None:
    """Log a failure at a private seam as a warning the first time, at debug level after."""
    level = logging.DEBUG if seam in _warned else logging.WARNING
    _warned.add(seam)
    logger.log(level, "hivemind %s: %s failed (%s: %s); falling back", installed_version(), seam,
               type(error).__name__, error)


def installed_version() -> str:
    import hivemind

    return str(getattr(hivemind, "__version__", "?"))


def call_in_averager(averager: Any, method: str, *args: Any, timeout: float, **kwargs: Any) -> Any:
    """Run ``averager.<method>(*args, future=..., **kwargs)`` in the averager's process (an ``async``
    method that sets the future's result) and return the result, waiting at most ``timeout``."""
    from hivemind.utils.mpfuture import MPFuture

    future = MPFuture()
    averager._outer_pipe.send((method, list(args), dict(kwargs, future=future)))
    return future.result(timeout=timeout)


def set_matchmaking_group_size(averager: Any, size: int, *, minimum: int | None = None) -> None:
    """Inside the averager's process: close the next group as soon as ``size`` peers joined; with
    ``minimum``, a leader whose window ends with fewer disbands the group and looks again."""
    averager._matchmaking.target_group_size = size
    averager._matchmaking.potential_leaders.target_group_size = size
    if minimum is not None:
        averager._matchmaking.min_group_size = minimum


def p2p_of(averager: Any) -> Any:
    """Inside the averager's process: its libp2p handle (what an all-reduce runner talks through)."""
    return averager._p2p


def register_runner(averager: Any, group_id: bytes, runner: Any) -> None:
    """Inside the averager's process: hand the group's all-reduce runner to hivemind's bookkeeping,
    where ``rpc_aggregate_part`` finds it (what hivemind's ``_run_allreduce_inplace_`` does)."""
    running = averager._running_groups
    if group_id not in running:
        raise RuntimeError(f"group {group_id!r} was not registered for an all-reduce")
    running[group_id].set_result(runner)


def state_stub(averager: Any, peer_id: str) -> Any:
    """Inside the averager's process: the RPC stub of ``peer_id``'s averager of the same prefix."""
    from hivemind.p2p import PeerID

    return averager.get_stub(averager._p2p, PeerID.from_base58(peer_id), namespace=averager.prefix)


def rsa_key_from_der(der: bytes) -> Any:
    """A ``hivemind.utils.crypto.RSAPrivateKey`` from the DER bytes of a private key."""
    from hivemind.utils.crypto import RSAPrivateKey

    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": der})
    return key


def rsa_public_der(public_key: Any) -> bytes:
    """The DER SubjectPublicKeyInfo of a hivemind ``RSAPublicKey`` (what a libp2p peer id hashes)."""
    from cryptography.hazmat.primitives import serialization

    return public_key._public_key.public_bytes(encoding=serialization.Encoding.DER,
                                               format=serialization.PublicFormat.SubjectPublicKeyInfo)


def _die_by_sigkill_with_parent() -> None:  # runs in the forked child, before exec
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL


def detach_p2p_daemon_from_process_group() -> None:
    """Start hivemind's p2p daemon in a session of its own, killed by the kernel when the process
    that started it (the DHT's) dies.

    A stop signal sent to a peer's whole process group (systemd's SIGTERM, Ctrl-C in a terminal)
    otherwise reaches the Go daemon too, which exits at once: the DHT and the averager then
    lose their transport before the peer has withdrawn its lease, published its last record or
    shut them down. Process-wide; for the CLIs. Linux (prctl); elsewhere the daemon keeps hivemind's
    defaults."""
    import asyncio.subprocess as aio_subprocess
    import sys

    if not sys.platform.startswith("linux") or getattr(aio_subprocess.create_subprocess_exec, "_worldlm", False):
        return
    original = aio_subprocess.create_subprocess_exec

    async def create_subprocess_exec(program, *args, **kwargs):
        if os.path.basename(str(program)) == "p2pd":
            kwargs.setdefault("start_new_session", True)
            kwargs.setdefault("preexec_fn", _die_by_sigkill_with_parent)
        return await original(program, *args, **kwargs)

    create_subprocess_exec._worldlm = True
    aio_subprocess.create_subprocess_exec = create_subprocess_exec


def check() -> list[str]:
    """What does not hold in the installed hivemind (empty: every seam is where we use it)."""
    from hivemind.averaging import DecentralizedAverager, matchmaking
    from hivemind.utils.crypto import RSAPrivateKey

    problems = []
    if installed_version() != PINNED:
        problems.append(f"hivemind {installed_version()} is installed; the seams were checked against {PINNED}")
    averager = inspect.getsource(DecentralizedAverager)
    for needle, what in (("self._inner_pipe, self._outer_pipe = mp.Pipe", "the averager's control pipe"),
                         ("getattr(self, method)(*args, **kwargs)", "the dispatch of pipe messages to methods"),
                         ("self._matchmaking = Matchmaking(", "the averager's Matchmaking object"),
                         ("self._p2p = ", "the averager's p2p handle"),
                         ("async def rpc_download_state(", "rpc_download_state"),
                         ("async def rpc_join_group(", "rpc_join_group"),
                         ("async def rpc_aggregate_part(", "rpc_aggregate_part"),
                         ("async def _aggregate_with_group(self, group_info: GroupInfo", "_aggregate_with_group"),
                         ("self._running_groups[group_id].set_result(runner)", "the running groups' runners"),
                         ("async def _run_allreduce_inplace_(", "_run_allreduce_inplace_"),
                         ("tensor.add_(update, alpha=self._averaging_alpha)", "the in-place update of a round")):
        if needle not in averager:
            problems.append(f"DecentralizedAverager: {what} ({needle!r}) is gone")
    mm = inspect.getsource(matchmaking)
    for needle in ("self.target_group_size, self.min_group_size = target_group_size",
                   "self.potential_leaders = PotentialLeaders(", "        self.target_group_size = target_group_size"):
        if needle not in mm:
            problems.append(f"hivemind.averaging.matchmaking: {needle!r} is gone")
    if "self._private_key = serialization.load_der_private_key(self._private_key" not in inspect.getsource(
            RSAPrivateKey.__setstate__):
        problems.append("RSAPrivateKey.__setstate__ no longer loads '_private_key' from DER bytes")
    from hivemind.utils.crypto import RSAPublicKey

    if "self._public_key = public_key" not in inspect.getsource(RSAPublicKey.__init__):
        problems.append("RSAPublicKey no longer keeps its key in '_public_key'")
    from hivemind.averaging import partition

    reducer = inspect.getsource(partition.TensorPartReducer)
    for needle in ("def reset_accumulators(self)", "def check_current_part_finished(self)",
                   "self.sender_failed_after = ", "self.num_current_senders = ", "self.current_part_future = ",
                   "self.current_part_accumulated_from = 0"):
        if needle not in reducer:
            problems.append(f"TensorPartReducer: {needle!r} is gone")
    container = inspect.getsource(partition.TensorPartContainer)
    for needle in ("def register_processed_part(self, peer_index: int, part_index: int",
                   "def register_failed_reducer(self, peer_index: int)",
                   "self._input_parts_by_peer = [deque() for _ in range(self.group_size)]",
                   "self.return_deltas = return_deltas"):
        if needle not in container:
            problems.append(f"TensorPartContainer: {needle!r} is gone")
    from hivemind.compression import serialization

    if not isinstance(getattr(serialization, "_BASE_COMPRESSION_TYPES", None), dict) or \
            "UNIFORM_8BIT" not in serialization._BASE_COMPRESSION_TYPES:
        problems.append("hivemind.compression.serialization lost its _BASE_COMPRESSION_TYPES registry")
    from hivemind.p2p import p2p_daemon

    if "await asyncio.subprocess.create_subprocess_exec(" not in inspect.getsource(p2p_daemon.P2P.create):
        problems.append("P2P.create no longer starts p2pd with asyncio.subprocess.create_subprocess_exec")
    from hivemind.p2p.p2p_daemon_bindings.p2pclient import Client as P2PClient

    if "no_listen" not in inspect.signature(p2p_daemon.P2P.create).parameters or not hasattr(P2PClient, "connect"):
        problems.append("P2P.create lost no_listen, or the daemon client its connect (the reachability probe)")
    if not hasattr(DecentralizedAverager, "get_stub") or not hasattr(DecentralizedAverager, "serializer"):
        problems.append("DecentralizedAverager lost get_stub or serializer")
    return problems
