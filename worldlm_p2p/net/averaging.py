"""Region all-reduce on hivemind's ``DecentralizedAverager``.

One averager per peer, with the prefix ``<run_id>_<region>``: the prefix namespaces matchmaking,
state donors and RPCs, so peers of different regions (or runs) can never meet in a group
(hivemind's group bits are rotated after every round and would mix regions; a prefix does not).

The averager holds a copy of the model's tensors. A region round is: copy the local model in,
``step(weight=...)`` (every reducer applies the run's robust rule, :mod:`worldlm_p2p.robust`, through
:mod:`worldlm_p2p.net.robust_allreduce`, instead of hivemind's ``sum w x / sum w``), copy the result
out. The math applied around it lives in :mod:`worldlm_p2p.aggregation` and :mod:`worldlm_p2p.rounds`.

Late joiners download the region's *last agreed* model (not a donor's in-progress weights) with
``load_state_from_peers``; donors serve it from :meth:`RegionAverager.get_current_state`.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Sequence

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import NoCompression

from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2

from worldlm_p2p.config import AveragingConfig

from worldlm_p2p.net import hivemind_compat
from worldlm_p2p.net.codecs import wire_compression
from worldlm_p2p.net.keys import averager_prefix
from worldlm_p2p.net.robust_allreduce import RobustAllReduceRunner, RobustSettings, RoundReport

logger = logging.getLogger(__name__)




@dataclass(frozen=True, slots=True)
class RoundResult:
    """Outcome of one all-reduce attempt."""

    ok: bool
    group_size: int  # peers in the group, self included (0 if no group was formed)
    gathered: dict  # peer id (str) -> metadata each member sent
    averaged: list[torch.Tensor] | None  # the group's (robust) average, if ok
    error: str = ""
    seconds: float = 0.0
    report: RoundReport = RoundReport()  # the senders this peer's reducer caught, the reducers that failed it
    relays: tuple[str, ...] = ()  # relays in the group (not counted in group_size nor in gathered)


def is_relay_gather(meta: Any) -> bool:
    """Whether what a group member gathered says it is a relay (an auxiliary reducer, no member)."""
    return isinstance(meta, dict) and meta.get("relay") is True


class RegionAverager(DecentralizedAverager):
    """A ``DecentralizedAverager`` that averages a peer's model inside its region and shares the
    region's last agreed model with late joiners. ``should_stop``: the owner is stopping (a round
    in flight then gets ``STOP_GRACE`` seconds to end)."""

    STOP_GRACE = 3.0

    def __init__(self, *, tensors: Sequence[torch.Tensor], dht, run_id: str, region: str,
                 averaging: AveragingConfig, fingerprint: str, robust: RobustSettings = RobustSettings(),
                 clipped_above: float = 0.5, should_stop: Callable[[], bool] = lambda: False,
                 start: bool = True, codecs: Sequence[str] | None = None, auxiliary: bool = False) -> None:
        """``codecs``: how each tensor travels (:func:`worldlm_p2p.rounds.payload_codecs`; None: float32).
        ``auxiliary``: a relay's averager (hivemind's auxiliary mode): it reduces its part of every
        round it joins but sends nothing of its own, receives no average and serves no state
        (:meth:`relay_round`)."""
        self._robust, self._clipped_above = robust, float(clipped_above)
        self.should_stop: Callable[[], bool] = should_stop
        self._shared_lock = threading.Lock()
        self._shared_tensors: list[torch.Tensor] = [t.detach().clone() for t in tensors]
        self._shared_meta: dict[str, Any] = dict(round=0, fingerprint=fingerprint)
        allreduce_timeout = max(averaging.averaging_timeout - averaging.matchmaking_time, 1.0)
        super().__init__(
            averaged_tensors=[t.detach().clone().float() for t in tensors],
            dht=dht,
            start=start,
            prefix=averager_prefix(run_id, region),
            target_group_size=averaging.target_group_size,
            min_group_size=averaging.min_group_size,
            min_matchmaking_time=averaging.matchmaking_time,
            request_timeout=averaging.request_timeout,
            allreduce_timeout=allreduce_timeout,
            # a sender/reducer slower than this is dropped from the round; the others keep going
            next_chunk_timeout=allreduce_timeout / 3,
            sender_timeout=allreduce_timeout / 3,
            reducer_timeout=allreduce_timeout * 2 / 3,
            declare_state_period=5.0,
            # an outbound-only peer's DHT is a client: its averager then runs in client mode (it sends its
            # part and receives the average over connections it opens, never reduces, and serves no state)
            allow_state_sharing=not dht.client_mode and not auxiliary,
            auxiliary=auxiliary,
            shutdown_timeout=3.0,
            compression=wire_compression(codecs) if codecs is not None else NoCompression(),
        )
        self._timeout = averaging.averaging_timeout
        self._min_group_size = averaging.min_group_size

    @property
    def robust(self) -> RobustSettings:
        """The rule this averager's reducer applies."""
        return self._robust

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        """hivemind's, except that the SIGINT handler of this process is kept: hivemind sets it to
        SIG_IGN before it forks the averager (the child should ignore Ctrl-C), which would leave a
        peer deaf to Ctrl-C once its averager runs."""
        previous = signal.getsignal(signal.SIGINT)
        try:
            super().run_in_background(await_ready=await_ready, timeout=timeout)
        finally:
            if threading.current_thread() is threading.main_thread() and previous is not None:
                signal.signal(signal.SIGINT, previous)

    # ------------------------------------------------------------------ admission
    def set_admitted(self, peer_ids: Sequence[str] | None, *, timeout: float = 5.0) -> None:
        """Average, and serve state, only with these peers (None: anyone of the prefix, an open
        region). Matchmaking requests and all-reduce parts of any other peer are refused, a group
        that holds one is left before any tensor moves, and its state downloads get nothing."""
        try:
            hivemind_compat.call_in_averager(self, "_set_admitted", None if peer_ids is None else sorted(peer_ids),
                                             timeout=timeout)
        except Exception as e:
            hivemind_compat.warn_once("setting the admitted peers", e)

    async def _set_admitted(self, peer_ids, future) -> None:  # runs in the averager process
        self._admitted = None if peer_ids is None else frozenset(peer_ids) | {str(self.peer_id)}
        future.set_result(None)

    def set_banned(self, peer_ids: Sequence[str], *, timeout: float = 5.0) -> None:
        """Never average with, nor serve state to, these peers again (senders caught repeatedly)."""
        try:
            hivemind_compat.call_in_averager(self, "_set_banned", sorted(peer_ids), timeout=timeout)
        except Exception as e:
            hivemind_compat.warn_once("banning peers", e)

    async def _set_banned(self, peer_ids, future) -> None:  # runs in the averager process
        self._banned = frozenset(peer_ids) - {str(self.peer_id)}
        future.set_result(None)

    def _refused(self, peer_id) -> bool:  # averager process
        if str(peer_id) in getattr(self, "_banned", ()):
            return True
        admitted = getattr(self, "_admitted", None)
        return admitted is not None and str(peer_id) not in admitted

    # the rpc_* overrides keep hivemind's annotations: its servicer reads them to build the handlers
    async def rpc_join_group(self, request: averaging_pb2.JoinRequest, context: P2PContext
                             ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if self._refused(context.remote_id):
            logger.warning("refused a matchmaking request from %s: not admitted to this region", context.remote_id)
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.AveragingData]:
        if self._refused(context.remote_id):
            logger.warning("refused an all-reduce part from %s: not admitted to this region", context.remote_id)
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_aggregate_part(stream, context):
            yield message

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest, context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.DownloadData]:
        if self._refused(context.remote_id):
            logger.warning("refused a state download by %s: not admitted to this region", context.remote_id)
            return
        async for message in super().rpc_download_state(request, context):
            yield message

    async def rpc_download_contribution(self, request: averaging_pb2.DownloadRequest, context: P2PContext
                                        ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """What this member sent into its last region round (:meth:`set_contribution`), for its
        mates' backbone partners (``aggregation.region_backbone = "partners"``): the metadata
        ``{round, anchor}`` on the first message, then the tensors. Nothing for a peer not admitted
        or banned, or before the first round."""
        if self._refused(context.remote_id):
            logger.warning("refused a contribution download by %s: not admitted to this region", context.remote_id)
            return
        held = getattr(self, "_contribution", None)
        if held is None:
            return
        from hivemind.utils.streaming import split_for_streaming

        metadata, serialized = held
        for tensor in serialized:
            for part in split_for_streaming(tensor):
                yield averaging_pb2.DownloadData(tensor_part=part, metadata=metadata)
                metadata = None

    async def _aggregate_with_group(self, group_info, *args, **kwargs):
        strangers = [str(p) for p in group_info.peer_ids if self._refused(p)]
        if strangers:
            from hivemind.averaging.allreduce import AllreduceException

            raise AllreduceException(f"the group holds peers not admitted to this region or banned: "
                                     f"{', '.join(strangers)}")
        return await super()._aggregate_with_group(group_info, *args, **kwargs)

    # ------------------------------------------------------------------ robust all-reduce (averager process)
    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        """hivemind's, with :class:`~worldlm_p2p.net.robust_allreduce.RobustAllReduceRunner`: every
        reducer applies the robust rule; a round whose spans did not all come back finite fails (and
        the tensors are restored, so that a retry starts from this member's own payload)."""
        from hivemind.averaging.allreduce import AllreduceException, AveragingMode
        from hivemind.utils.asyncio import as_aiter, azip

        group_id = group_info.group_id if group_id is None else group_id
        if "modes" not in kwargs:
            # hivemind 1.1 reads every member's mode from the gathered data but does not hand it to the
            # runner, which then takes an auxiliary member (a relay) for a sender of weight 0: the robust
            # rule's median would count its zeros. Each member's mode, as it declared it
            kwargs["modes"] = tuple(AveragingMode(self.serializer.loads(g)[1]) for g in group_info.gathered)
        before = [t.detach().clone() for t in tensors]
        runner = RobustAllReduceRunner(robust_settings=self._robust, p2p=hivemind_compat.p2p_of(self),
                                       servicer_type=type(self), prefix=self.prefix, tensors=tensors,
                                       group_id=group_id, ordered_peer_ids=group_info.peer_ids, **kwargs)
        hivemind_compat.register_runner(self, group_id, runner)
        self._last_report = RoundReport()
        try:
            if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
                async for _ in runner:
                    raise ValueError("aux peers should not receive averaged tensors")
            else:
                async for tensor, update in azip(as_aiter(*tensors), runner):
                    tensor.copy_(update)  # the averaged value itself (RobustAllReduceRunner)
            if runner.bad_reducers:
                raise AllreduceException("; ".join(f"{p} {why}" for p, why in sorted(runner.bad_reducers.items())))
        except BaseException:
            for t, b in zip(tensors, before):
                t.copy_(b)
            raise
        finally:
            caught = {p: why for p, t in runner.sender_report().items()
                      if p != str(self.peer_id) and (why := t.why_caught(clipped_above=self._clipped_above))}
            seen = {p: v for p, v in runner.sender_samples().items() if p != str(self.peer_id)}
            self._last_report = RoundReport(caught=caught, bad_reducers=dict(runner.bad_reducers),
                                            dropped=tuple(runner.dropped_senders()), seen=seen)

    def take_report(self, *, timeout: float = 5.0) -> RoundReport:
        """What the averager saw in its last all-reduce (an empty report if it cannot say)."""
        try:
            return hivemind_compat.call_in_averager(self, "_take_report", timeout=timeout)
        except Exception as e:
            hivemind_compat.warn_once("reading the round's report", e)
            return RoundReport()

    async def _take_report(self, future) -> None:  # runs in the averager process
        report, self._last_report = getattr(self, "_last_report", RoundReport()), RoundReport()
        future.set_result(report)

    # ------------------------------------------------------------------ state sharing (host side)
    def set_shared_state(self, *, round_index: int, tensors: Sequence[torch.Tensor], **meta: Any) -> None:
        """Publish the region's last agreed model (and whatever else ``tensors`` carries, described
        by the small scalars in ``meta``), served to late joiners."""
        copies = [t.detach().to("cpu", copy=True) for t in tensors]
        with self._shared_lock:
            self._shared_tensors = copies
            self._shared_meta = dict(self._shared_meta, round=int(round_index), **meta)
        if not self.client_mode:
            self.state_sharing_priority = float(round_index)

    def get_current_state(self):
        with self._shared_lock:
            return dict(self._shared_meta), list(self._shared_tensors), None

    # ------------------------------------------------------------------ group size
    def set_target_group_size(self, size: int, *, exact: bool = False, timeout: float = 5.0) -> None:
        """Close the next group as soon as ``size`` peers joined, instead of waiting for the whole
        matchmaking window. The region barrier knows how many peers wait for the round; the
        window remains the bound when one of them does not show up (and when this fails: logged).
        ``exact`` (a relay, the group's only leader): a window that ends with fewer peers disbands
        the group and matchmaking goes on until the averaging timeout (a relay with one member
        would average that member with itself)."""
        size = max(int(size), self._min_group_size)
        try:
            hivemind_compat.call_in_averager(self, "_set_target_group_size", size, size if exact else None,
                                             timeout=timeout)
        except Exception as e:  # an older or changed hivemind: fall back to the full matchmaking window
            hivemind_compat.warn_once("setting the matchmaking group size", e)

    async def _set_target_group_size(self, size: int, minimum, future) -> None:  # runs in the averager process
        hivemind_compat.set_matchmaking_group_size(self, size, minimum=minimum)
        future.set_result(None)

    # ------------------------------------------------------------------ rounds
    def run_round(self, tensors: Sequence[torch.Tensor], *, weight: float, gather: dict[str, Any]) -> RoundResult:
        """All-reduce ``tensors`` with the region's group. Never raises for network failures: a
        failed round returns ``ok=False`` and the caller keeps its local model."""
        t0 = time.monotonic()
        with self.get_tensors() as buffers:
            for buf, t in zip(buffers, tensors):
                buf.copy_(t.detach().to(buf.device, buf.dtype))
        def failed(error: str) -> RoundResult:
            return RoundResult(ok=False, group_size=0, gathered={}, averaged=None, error=error,
                               seconds=time.monotonic() - t0, report=self.take_report())

        if not self.is_alive():  # (hivemind's step would wait for it forever)
            return failed("the averager process is gone")
        try:
            control = self.step(weight=float(weight), gather=gather, timeout=self._timeout, allow_retries=True,
                                wait=False)
            result = self._await_step(control, started=t0)
        except Exception as e:  # AllreduceException, TimeoutError, MatchmakingException ...
            return failed(" ".join(str(e).split())[:200] or type(e).__name__)
        if not result:
            return RoundResult(ok=False, group_size=0, gathered={}, averaged=None, error="no group",
                               seconds=time.monotonic() - t0, report=self.take_report())
        with self.get_tensors() as buffers:
            averaged = [b.detach().clone() for b in buffers]
        gathered = {str(pid): meta for pid, meta in result.items() if not is_relay_gather(meta)}
        relays = tuple(sorted(str(pid) for pid, meta in result.items() if is_relay_gather(meta)))
        return RoundResult(ok=True, group_size=len(gathered), gathered=gathered, averaged=averaged,
                           seconds=time.monotonic() - t0, report=self.take_report(), relays=relays)

    def relay_round(self, *, gather: dict[str, Any]) -> RoundResult:
        """Join one round of the group as its relay (an ``auxiliary`` averager): reduce, send nothing
        of its own. ``gather`` gets ``relay=True`` (members leave the relay out of their counts).
        Never raises for network failures."""
        t0 = time.monotonic()
        try:
            control = self.step(gather=dict(gather, relay=True), timeout=self._timeout, allow_retries=True,
                                wait=False)
            result = self._await_step(control, started=t0)
        except Exception as e:
            return RoundResult(ok=False, group_size=0, gathered={}, averaged=None,
                               error=" ".join(str(e).split())[:200] or type(e).__name__,
                               seconds=time.monotonic() - t0, report=self.take_report())
        if not result:
            return RoundResult(ok=False, group_size=0, gathered={}, averaged=None, error="no group",
                               seconds=time.monotonic() - t0, report=self.take_report())
        gathered = {str(pid): meta for pid, meta in result.items() if not is_relay_gather(meta)}
        return RoundResult(ok=True, group_size=len(gathered), gathered=gathered, averaged=None,
                           seconds=time.monotonic() - t0, report=self.take_report(),
                           relays=tuple(sorted(str(pid) for pid, m in result.items() if is_relay_gather(m))))

    def _await_step(self, control, *, started: float):
        """The step's result, waiting in short slices: a round ends within hivemind's bounds (finding
        a group, then the all-reduce), but not if the averager process died meanwhile; and once
        this peer is stopping, a round in flight gets ``STOP_GRACE`` seconds more, not the whole
        timeout."""
        deadline = started + 2 * self._timeout + 10.0
        while True:
            try:
                return control.result(timeout=0.25)
            except TimeoutError:  # (concurrent.futures.TimeoutError is TimeoutError)
                if control.done():
                    raise
            now = time.monotonic()
            if self.should_stop():
                deadline = min(deadline, now + self.STOP_GRACE)
            if not self.is_alive():
                raise RuntimeError("the averager process is gone")
            if now > deadline:
                control.cancel()
                raise TimeoutError("the round did not end in time" + (" (stopping)" if self.should_stop() else ""))

    # ------------------------------------------------------------------ what a member sent (backbone partners)
    def set_contribution(self, *, round_index: int, anchor: str, tensors: Sequence[torch.Tensor],
                         timeout: float = 10.0) -> bool:
        """Serve ``tensors`` (what this member sends into region round ``round_index``, whose anchor
        has the digest ``anchor``) to the mates that download it (:meth:`download_contribution_from`)
        from now until the next call. Held in the averager process, serialized once; False (logged
        once) when it could not be handed over."""
        # (in shared memory: the control pipe carries handles; a megabyte through it breaks it)
        shared = [t.detach().to("cpu", copy=True).share_memory_() for t in tensors]
        metadata = self.serializer.dumps(dict(round=int(round_index), anchor=str(anchor)))
        try:
            hivemind_compat.call_in_averager(self, "_set_contribution", metadata, shared, timeout=timeout)
            return True
        except Exception as e:
            hivemind_compat.warn_once("serving this member's contribution to the round", e)
            return False

    async def _set_contribution(self, metadata: bytes, tensors: list[torch.Tensor], future) -> None:  # averager process
        from hivemind.compression import serialize_torch_tensor
        from hivemind.proto import runtime_pb2

        try:
            self._contribution = (metadata, [serialize_torch_tensor(t, runtime_pb2.CompressionType.NONE)
                                             for t in tensors])
            future.set_result(None)
        except Exception as e:
            self._contribution = None
            future.set_exception(e)

    def download_contribution_from(self, peer_id: str, *, timeout: float) -> tuple[Any, list[torch.Tensor]] | None:
        """What ``peer_id`` serves of its last round (:meth:`set_contribution`): ``(metadata,
        tensors)``, or None when it does not answer within ``timeout`` or serves nothing."""
        try:
            return hivemind_compat.call_in_averager(self, "_download_state_from", str(peer_id), timeout=timeout + 5.0,
                                                    download_timeout=float(timeout), rpc="rpc_download_contribution")
        except Exception as e:
            logger.debug("contribution download from %s failed: %s", peer_id, e)
            return None

    def download_state_from(self, peer_id: str, *, timeout: float) -> tuple[Any, list[torch.Tensor]] | None:
        """Download the state that one chosen peer of this averager's prefix serves (hivemind's
        ``rpc_download_state``, asked of ``peer_id`` rather than of the highest-priority peer).
        ``None`` if it does not answer within ``timeout`` or serves nothing."""
        try:
            return hivemind_compat.call_in_averager(self, "_download_state_from", str(peer_id), timeout=timeout + 5.0,
                                                    download_timeout=float(timeout))
        except Exception as e:
            logger.debug("state download from %s failed: %s", peer_id, e)
            return None

    async def _download_state_from(self, peer_id: str, download_timeout: float, future,
                                   rpc: str = "rpc_download_state") -> None:  # averager process
        import asyncio

        from hivemind.compression import deserialize_torch_tensor
        from hivemind.proto import averaging_pb2
        from hivemind.utils.streaming import combine_from_streaming

        async def fetch():
            stub = hivemind_compat.state_stub(self, peer_id)
            stream = await getattr(stub, rpc)(averaging_pb2.DownloadRequest())
            metadata, tensors, parts = None, [], []
            async for message in stream:
                if message.metadata:
                    metadata = self.serializer.loads(message.metadata)
                if message.tensor_part.dtype and parts:  # a new tensor starts
                    tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                    parts = []
                parts.append(message.tensor_part)
            if parts:
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
            return metadata, tensors

        try:
            metadata, tensors = await asyncio.wait_for(fetch(), timeout=download_timeout)
            if not future.done():
                future.set_result((metadata, tensors) if metadata is not None else None)
        except Exception as e:
            logger.debug("state download from %s failed: %s", peer_id, e)
            if not future.done():
                future.set_result(None)

    def download_region_state(self, *, timeout: float) -> tuple[dict, list[torch.Tensor]] | None:
        """Load the region's last agreed model from a live peer; ``None`` if none answered in time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                loaded = self.load_state_from_peers(timeout=max(1.0, min(10.0, deadline - time.monotonic())))
            except Exception as e:
                logger.info("state download failed (%s); retrying", type(e).__name__)
                loaded = None
            if loaded is not None:
                meta, tensors = loaded
                if isinstance(meta, dict):
                    return meta, list(tensors)
            time.sleep(0.5)
        return None
