"""State serving: what this peer serves to its region (late joiners, members fetching a world
change) and what it downloads from others, through the averager's state sharing and the one codec
(:class:`worldlm_p2p.codec.ServedState`)."""

from __future__ import annotations

import logging
import time

from worldlm_p2p.codec import ServedState, StateError, state_digest
from worldlm_p2p.net.averaging import RegionAverager
from worldlm_p2p.rounds import RoundRule, border_shared

from worldlm_p2p.peer.state import RegionState
from worldlm_p2p.peer.stats import PeerStats

logger = logging.getLogger(__name__)


class StateServer:
    def __init__(self, *, averager: RegionAverager, state: RegionState, stats: PeerStats, rule: RoundRule,
                 fingerprint: str) -> None:
        self.averager, self.state, self.stats, self.rule, self.fingerprint = averager, state, stats, rule, fingerprint

    def publish(self, round_index: int | None = None) -> None:
        """Serve the region's agreed model of ``round_index`` (default: the next round), the outer
        momentum, the last world change and the border history. Main thread only."""
        served = self.state.served(round_index=self.stats.round if round_index is None else round_index,
                                   world_round=self.stats.world_round)
        meta, tensors = served.encode()
        self.averager.set_shared_state(round_index=served.round, tensors=tensors, **meta)
        self.stats.state_round, self.stats.state_digest = served.round, state_digest(served.agreed)

    def _decode(self, loaded, *, what: str) -> ServedState | None:
        if loaded is None:
            return None
        meta, tensors = loaded
        template = self.state.anchor
        try:
            return ServedState.decode(meta, tensors, template=template, backbone=self.rule.backbone(template),
                                      shared=[template[i] for i in border_shared(self.rule)],
                                      fingerprint=self.fingerprint)
        except StateError as e:
            logger.warning("rejected %s from a peer: %s", what, e)
            return None

    def download_region(self, *, timeout: float, peers: list[str] | None = None) -> ServedState | None:
        """The region's state from whichever live peer serves the most recent one (None, logged,
        when none arrives in time or it does not fit this run). ``peers``: ask only these, in this
        order (an admitting region: its admitted members, never whoever declares the highest
        priority)."""
        if peers is not None:
            deadline = time.monotonic() + timeout
            for peer_id in peers:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                served = self.download_from(peer_id, timeout=min(left, 10.0))
                if served is not None:
                    return served
            logger.warning("could not download the region's model from its admitted members within %.0fs; keeping "
                           "the model this peer has", timeout)
            return None
        loaded = self.averager.download_region_state(timeout=timeout)
        if loaded is None:
            logger.warning("could not download the region's model within %.0fs; keeping the model this peer has",
                           timeout)
            return None
        return self._decode(loaded, what="region state")

    def download_verified(self, *, timeout: float, fetch_others, admitted=lambda: None) -> ServedState | None:
        """The region's agreed model, checked: the (round, digest) that most live members publish is
        the one taken (ties: the later round); it is downloaded from one of the members that publish
        it, and a download whose digest differs is refused and logged (the next supporter is asked).
        A member claiming an absurd round, or serving another model than it claims, moves nothing
        while the region's majority says otherwise. None when nothing verified arrived in time."""
        deadline = time.monotonic() + timeout
        refused: set[str] = set()
        while time.monotonic() < deadline:
            allowed = admitted()
            live = [r for r in fetch_others() if not r.finished and r.state_digest and r.state_round >= 0
                    and r.reachability != "outbound"  # (an outbound-only peer serves nothing)
                    and (allowed is None or r.peer_id in allowed) and r.peer_id not in refused]
            if not live:
                time.sleep(0.5)
                continue
            tally: dict[tuple[int, str], list[str]] = {}
            for r in live:
                tally.setdefault((r.state_round, r.state_digest), []).append(r.peer_id)
            (round_, digest), supporters = max(tally.items(), key=lambda kv: (len(kv[1]), kv[0][0]))
            for peer_id in supporters:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                served = self.download_from(peer_id, timeout=min(left, 10.0))
                if served is None:
                    continue
                got = state_digest(served.agreed)
                if got == digest:
                    logger.info("the region's model of round %d (digest %s) is what %d of %d live members publish",
                                served.round, digest, len(supporters), len(live))
                    return served
                if served.round != round_:  # it moved on since its record: read the records again
                    break
                refused.add(peer_id)
                logger.warning("refused the state served by %s: its digest %s is not the %s it publishes for round "
                               "%d", peer_id, got, digest, round_)
            time.sleep(0.5)
        logger.warning("could not download a verified region model within %.0fs; keeping the model this peer has",
                       timeout)
        return None

    def download_from(self, peer_id: str, *, timeout: float) -> ServedState | None:
        """The state ``peer_id`` serves (None when it does not answer or the state is unusable)."""
        return self._decode(self.averager.download_state_from(peer_id, timeout=timeout), what="the state served")
