"""Region leaders: a deterministic election over expiring candidacy records, i.e. an expiring lease.

Every eligible peer of a region publishes a :class:`~worldlm_p2p.net.records.LeaseRecord` under its
own signed subkey of ``<run_id>_leaders``: its region, its peer id, ``since`` (when it became a
candidate) and ``expires`` (now + TTL), and renews it every ``renew_every`` seconds (TTL/3 by
default). Any peer can then compute the region's leader with the pure rule :func:`elect`: among the
unexpired records of the region (and of the run's manifest fingerprint), the one with the smallest
``since`` (the longest-standing candidate), ties broken by peer id. The rule reads only the records,
never the order in which the DHT returned them, so every peer that sees the same records elects the
same leader; no vote and no extra round trip is needed.

That rule over records that expire unless renewed *is* an expiring lease:

- a leader stays leader for as long as it renews its record: a newcomer has a larger ``since`` and
  never takes over from a live leader, so the leadership does not flap;
- a leader that dies (or is cut off from the DHT) stops renewing; its record expires at most one TTL
  after its last renewal, and within one more refresh period every peer elects the next-oldest
  candidate. A leader that can no longer renew sees its own record expire at the same moment
  (:meth:`LeaderLease.is_leader` evaluates expiry when called), so two peers do not both act as
  leader for long;
- a candidate whose record ran out before it renewed (a busy machine, a DHT that did not answer)
  comes back with ``since`` = now, behind the candidates that kept theirs: the next in line, which
  took over meanwhile, keeps the lease (with its old ``since`` it would take it back, and the
  leadership would flap);
- a peer that leaves on purpose calls :meth:`LeaderLease.withdraw`, which publishes a record that
  has already expired (``expires = now``): the others re-elect at their next refresh instead of
  waiting for the TTL;
- a region without a leader (all candidates gone, or records not yet propagated) keeps training and
  holding region rounds; it only misses the world rounds, which need a leader.

With ``standby = k`` a peer publishes its candidacy only while fewer than ``k`` live candidates of
its region rank before it (as :func:`elect` ranks them): the leader and the next ``k - 1`` in line
renew, the others stand by and read. Every candidacy is a signed DHT store that each of its replicas
validates, so a region of ``n`` peers that all renew costs ``n`` stores per period where ``k`` do
(measured: ``benchmarks/perf.py --idle``); the election is the same, since the peers that stand by
rank after the ``k`` that renew. When a candidate dies, every peer that stood by sees fewer than
``k`` ahead of it at its next renewal and publishes; those that find themselves beyond ``k`` again
at the renewal after stop renewing, and their records expire.

Consistency is eventual: for a moment after a change two peers may disagree (one has not refreshed
yet); callers must treat leadership as a hint that holds for about one TTL, not as a lock. Expiry is
judged with each peer's own DHT clock (``get_dht_time``), so clocks should agree to well within a
TTL. ``since`` is self-reported: a signed record proves who wrote it, not that its ``since`` is true.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
from typing import Callable, Sequence

from hivemind.utils.timed_storage import get_dht_time

from worldlm_p2p.net.records import LeaseRecord, fetch_leases, publish_lease

logger = logging.getLogger(__name__)


def _rank(record: LeaseRecord) -> tuple:
    # since, then peer id; the remaining fields only make the order total (records that a broken or
    # restarted peer published twice with the same since and peer id)
    return (record.since, record.peer_id, -record.expires, record.world_round, record.fingerprint,
            tuple(record.maddrs))


def elect_live(live: Sequence[LeaseRecord], *, region: str, fingerprint: str | None = None) -> LeaseRecord | None:
    """:func:`elect` among records already judged live (:meth:`LeaderLease.live`)."""
    return elect(live, region=region, now=-math.inf, fingerprint=fingerprint)


def elect(candidates: Sequence[LeaseRecord], *, region: str, now: float,
          fingerprint: str | None = None) -> LeaseRecord | None:
    """Pure election rule: the unexpired (``expires > now``) candidate of ``region`` (and of
    ``fingerprint``, if given) with the smallest ``since``, ties broken by the lexicographically
    smallest ``peer_id``. ``None`` if there is none. The result does not depend on the order of
    ``candidates``."""
    valid = [c for c in candidates
             if c.region == region and (fingerprint is None or c.fingerprint == fingerprint)
             and math.isfinite(c.since) and math.isfinite(c.expires) and c.expires > now]
    return min(valid, key=_rank) if valid else None


class LeaderLease:
    """Runs this peer's candidacy for its region's leader lease and keeps a view of the election.

    ``start()`` launches a daemon thread that, every ``renew_every`` seconds, publishes this peer's
    candidacy (``expires = now + ttl``) and re-reads the region's lease records. ``lock``, if given,
    is held around every DHT call (to serialise them with other threads that use the same DHT).
    DHT errors are logged at debug level and retried at the next period; the thread never raises.
    """

    def __init__(self, *, dht, validators, run_id: str, region: str, peer_id: str, fingerprint: str,
                 ttl: float = 6.0, renew_every: float | None = None, lock: threading.Lock | None = None,
                 since: float | None = None, maddrs: Sequence[str] = (), world_round: int = -1,
                 admitted: Callable[[], set[str] | None] = lambda: None, standby: int | None = None) -> None:
        """``admitted()``: the peers of the region that may lead it (None: any, an open region); an
        admitting region's members count only the candidacies of admitted peers, signed in the
        DHT by the key of the peer id they name. ``standby``: publish only while fewer than this many
        live candidates of the region rank before this peer (None: always; see the module's
        docstring)."""
        if not (math.isfinite(ttl) and ttl > 0):
            raise ValueError(f"lease ttl must be a positive number of seconds, got {ttl}")
        renew_every = ttl / 3 if renew_every is None else renew_every
        if not (0 < renew_every < ttl):
            raise ValueError(f"renew_every must be in (0, ttl={ttl}), got {renew_every}: a lease renewed "
                             "less often than it expires lapses between renewals")
        if standby is not None and not (isinstance(standby, int) and standby >= 1):
            raise ValueError(f"standby must be a whole number >= 1, got {standby!r}")
        self._standby = standby
        self._stood_by = False  # whether the last renewal stood by (its record left to run out)
        self._dht = dht
        self._validators = validators
        self.run_id = run_id
        self.region = region
        self.peer_id = peer_id
        self.fingerprint = fingerprint
        self.ttl = float(ttl)
        self.renew_every = float(renew_every)
        self._dht_lock = lock if lock is not None else contextlib.nullcontext()
        self._since = since  # None: the time of start()
        self._maddrs = tuple(maddrs)
        self._world_round = int(world_round)
        self._admitted = admitted
        self._refused: set[str] = set()  # candidacies this peer no longer counts (see refuse())

        self._publish_lock = threading.Lock()  # one publication at a time: a withdrawal is never overtaken
        self._state_lock = threading.Lock()
        self._eligible = True
        self._withdrawal_pending = False
        self._published: LeaseRecord | None = None  # own record in the view: last one stored, or a withdrawal
        self._last_expiration = 0.0  # DHT expiration time of the last publication
        self._others: tuple[LeaseRecord, ...] = ()  # other peers' records from the last refresh
        # when this peer first read each (peer, since) candidacy: a candidacy that appears later than
        # it claims to have begun is aged from when it was first seen, less a tolerance of a few
        # lease periods (honest newcomers' records reach the others within one renewal)
        self._first_seen: dict[tuple[str, float], float] = {}
        self._age_tolerance = 3 * self.ttl
        self._refreshed_once = False
        self._refreshed_at = -math.inf  # DHT time at which the last successful refresh began
        self._last_leader: str | None = None  # peer id of the leader at the last refresh (for logging)
        self._stop = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------ control

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("LeaderLease.start() was already called")
        if self._since is None:
            self._since = get_dht_time()
        self._thread = threading.Thread(target=self._loop, name=f"leader-lease-{self.region}", daemon=True)
        self._thread.start()

    def stop(self, *, withdraw: bool = False, timeout: float | None = None) -> None:
        """Stop renewing. By default nothing more is published and this peer's record simply expires
        (as if it had died); with ``withdraw=True`` a withdrawal is published so others re-elect at once.
        Waits up to ``timeout`` (default: ``ttl``) for a DHT call in progress to return."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.ttl if timeout is None else timeout)
            if self._thread.is_alive():
                logger.warning("the leader lease thread of region %s did not stop in time (DHT call hanging?)",
                               self.region)
        if withdraw:
            self.withdraw()
        self._stopped = True

    @property
    def eligible(self) -> bool:
        """Whether this peer is a candidate. Setting ``False`` withdraws at the next renewal (see
        :meth:`withdraw` to do it now); setting ``True`` makes it a candidate again with ``since`` =
        now, so a returning peer queues behind the current candidates instead of taking over."""
        return self._eligible

    @eligible.setter
    def eligible(self, value: bool) -> None:
        with self._publish_lock:
            value = bool(value)
            if value and not self._eligible:
                self._since = get_dht_time()
                self._withdrawal_pending = False
            elif not value and self._eligible:
                self._withdrawal_pending = True
            self._eligible = value

    def refuse(self, peer_id: str) -> None:
        """Count ``peer_id``'s candidacy no more (a leader that served a world change this peer's
        evidence refuted): from the next refresh the region's next candidate leads, as this peer sees
        it. This peer's own candidacy cannot be refused."""
        if peer_id != self.peer_id:
            self._refused.add(str(peer_id))
            with self._state_lock:
                self._others = tuple(r for r in self._others if r.peer_id not in self._refused)

    def withdraw(self) -> bool:
        """Stop being a candidate now: publish a record that has already expired, so the region
        re-elects at its next refresh instead of after the TTL. Returns whether the DHT accepted it
        (if not, and the thread still runs, it retries at the next renewal)."""
        with self._publish_lock:
            self._eligible = False
            self._withdrawal_pending = True
            now = get_dht_time()
            record = self._record(expires=now)
            ok = self._publish(record)
            if ok:
                self._withdrawal_pending = False
            with self._state_lock:
                self._published = record  # locally the candidacy ends now, whether or not the DHT took it
        if ok:
            logger.info("region %s: this peer withdrew its leader candidacy", self.region)
        self._note(self.leader())
        return ok

    @property
    def world_round(self) -> int:
        """The world round this peer announces in its record; a new value goes out with the next renewal."""
        return self._world_round

    @world_round.setter
    def world_round(self, value: int) -> None:
        self._world_round = int(value)

    # ------------------------------------------------------------------------------ view

    def leases(self) -> list[LeaseRecord]:
        """The records of the last refresh (this peer's own as last published), expired ones included."""
        with self._state_lock:
            own = (self._published,) if self._published is not None else ()
            return list(self._others + own)

    def live(self) -> list[LeaseRecord]:
        """The candidacies this peer counts as live now: its own while its record has not run out
        (judged now), the others' as the last refresh found them, unexpired at that refresh (or a
        TTL ago, when no refresh has succeeded since). A record that runs out after a refresh is
        given up at the next refresh, when the DHT confirms it was not renewed: judged by the clock
        alone, a leader whose renewal was a second late on a busy machine looked dead to the members
        that had read it a period earlier, and each of them took the lease for a moment (measured
        with 16 peers on 2 cores: leaders flapping every few seconds)."""
        now = get_dht_time()
        with self._state_lock:
            others, own, at = self._others, self._published, self._refreshed_at
        judged = max(at, now - self.ttl)
        out = [r for r in others if r.expires > judged]
        if own is not None and own.expires > now:
            out.append(own)
        return out

    def leader(self) -> LeaseRecord | None:
        """The region's leader among :meth:`live` candidacies: a leader whose own record ran out is
        no longer leader at once, in its own view; the others see the next candidate lead from
        their first refresh after that."""
        return elect_live(self.live(), region=self.region, fingerprint=self.fingerprint)

    def is_leader(self) -> bool:
        """Whether this peer holds the lease now (never after :meth:`stop`, nor once its own record
        has expired because renewals failed)."""
        if self._stopped or self._stop.is_set():
            return False
        current = self.leader()
        return current is not None and current.peer_id == self.peer_id

    # ------------------------------------------------------------------------------ renewal

    def renew(self) -> LeaseRecord | None:
        """One period, done synchronously: publish this peer's candidacy (or a pending withdrawal),
        re-read the region's records and return the elected leader. Never raises on DHT errors."""
        with self._publish_lock:
            record = None
            standing_by = self._eligible and self.standing_by()
            if self._eligible and not standing_by:
                self._queue_behind_if_lapsed()
                record = self._record(expires=get_dht_time() + self.ttl)
            elif self._withdrawal_pending:
                record = self._record(expires=get_dht_time())
            if record is not None and self._publish(record):
                if not self._eligible:
                    self._withdrawal_pending = False
                with self._state_lock:
                    self._published = record
            self._stood_by = standing_by
        try:
            started = get_dht_time()  # (the records the DHT returns were live then)
            with self._dht_lock:
                fetched = fetch_leases(self._dht, self.run_id)
        except Exception as e:  # hivemind raises many kinds on a failing or shut-down DHT
            logger.debug("region %s: could not read lease records: %s: %s", self.region, type(e).__name__, e)
        else:
            admitted = self._admitted()
            now = get_dht_time()
            others = [self._aged(r, now) for r in fetched if r.peer_id != self.peer_id and r.peer_id not in self._refused and (
                admitted is None or r.region != self.region or (r.peer_id in admitted and r.signer == r.peer_id))]
            with self._state_lock:
                self._others, self._refreshed_at = tuple(others), started
            self._refreshed_once = True
        current = self.leader()
        self._note(current)
        return current

    def _queue_behind_if_lapsed(self) -> None:
        """A candidacy whose last record ran out before this renewal (renewals late: a busy machine,
        a DHT that did not answer) starts again with ``since`` = now, behind the candidates that
        kept theirs: the next in line has taken over in the meantime, and a leader that came back
        with its old ``since`` would take the lease back from it (measured: leases flapping every
        10-20 s with 16 peers on 2 cores). A record left to run out on purpose (standing by) keeps
        its ``since``."""
        own, now = self._published, get_dht_time()
        if own is None or self._stood_by or own.since != self._since or own.expires > now:
            return
        logger.info("region %s: this peer's leader candidacy ran out %.1fs before its renewal; it queues behind "
                    "the other candidates", self.region, now - own.expires)
        self._since = now

    def standing_by(self) -> bool:
        """Whether this candidate skips its renewal: ``standby`` live candidates of its region rank
        before it in the last refresh (never before the first refresh: a peer that knows nobody
        publishes)."""
        if self._standby is None or not self._refreshed_once or self._since is None:
            return False
        me = (self._since, self.peer_id)
        ahead = sum(1 for r in self.live() if r.peer_id != self.peer_id and r.region == self.region
                    and r.fingerprint == self.fingerprint and math.isfinite(r.since) and (r.since, r.peer_id) < me)
        return ahead >= self._standby

    def _aged(self, record: LeaseRecord, now: float) -> LeaseRecord:
        """``record`` with its ``since`` bounded by what this peer observed: no earlier than when it
        first read this candidacy, less :attr:`_age_tolerance` (a candidacy present at this peer's
        first refresh is taken as it claims: this peer cannot know better). A record that claims
        ``since = 0`` to take an established lease at once is aged as the newcomer it is."""
        key = (record.peer_id, float(record.since))
        first = self._first_seen.get(key)
        if first is None:
            first = self._first_seen[key] = now if self._refreshed_once else -math.inf
            if len(self._first_seen) > 4096:  # bounded memory against a flood of candidacies
                self._first_seen = dict(list(self._first_seen.items())[-2048:])
        bound = first - self._age_tolerance
        return record if record.since >= bound else dataclasses.replace(record, since=bound)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.renew()
            except Exception:  # never let the thread die: the next period retries
                logger.debug("region %s: leader lease renewal failed", self.region, exc_info=True)
            self._stop.wait(self.renew_every)

    def _record(self, *, expires: float) -> LeaseRecord:
        since = self._since if self._since is not None else get_dht_time()
        return LeaseRecord(region=self.region, peer_id=self.peer_id, since=since, expires=expires,
                           fingerprint=self.fingerprint, world_round=self._world_round, maddrs=self._maddrs)

    def _publish(self, record: LeaseRecord) -> bool:
        # hivemind keeps a subkey's value unless the new one expires strictly later: never reuse an
        # expiration time (a withdrawal within the same clock tick as a renewal would be dropped)
        now = get_dht_time()
        ttl = max(self.ttl, self._last_expiration + 1e-3 - now)
        self._last_expiration = now + ttl
        try:
            with self._dht_lock:
                ok = publish_lease(self._dht, self._validators, self.run_id, record, ttl=ttl)
        except Exception as e:
            logger.debug("region %s: could not publish the lease record: %s: %s", self.region, type(e).__name__, e)
            return False
        if not ok:
            logger.debug("region %s: the DHT did not store the lease record", self.region)
        return ok

    def _note(self, current: LeaseRecord | None) -> None:
        """Log changes of the region's leader as this peer sees them."""
        new = current.peer_id if current is not None else None
        with self._state_lock:
            old, self._last_leader = self._last_leader, new
        if new == old:
            return
        me = self.peer_id
        if new == me:
            logger.info("region %s: this peer is now the leader (was %s)", self.region, old or "none")
        elif old == me:
            logger.info("region %s: this peer is no longer the leader (now %s)", self.region, new or "none")
        elif new is None:
            logger.info("region %s: no leader (was %s)", self.region, old)
        else:
            logger.info("region %s: the leader is now %s (was %s)", self.region, new, old or "none")
