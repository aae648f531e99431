"""Local, per-peer settings: a region's privacy, how a process joins the DHT, and the peer's own
settings (imports the standard library only)."""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Any, Mapping

from worldlm_p2p.config.run import PrivacyPolicy, _finite, _require, _require_finite, check_name


@dataclass(frozen=True, kw_only=True, slots=True)
class PrivacyConfig:
    """Differential-privacy settings of a region's peers (the ``[peer.privacy]`` table of a region's
    profile, or ``worldlm-peer``/``worldlm-simulate`` flags).

    - Border (region-level) DP, enforced by the region's leader: before the region's backbone delta
      leaves in a world round it is clipped to L2 norm ``border_clip`` and Gaussian noise of std
      ``border_noise * border_clip`` is added (:mod:`worldlm_p2p.privacy`). ``border_clip = 0``: off.
    - Peer (sample-level) DP-SGD with Opacus: per-window gradients clipped to ``peer_clip`` and
      noised; ``peer_epsilon`` (a target, calibrated over the run's steps) or ``peer_noise`` (a noise
      multiplier), not both; both 0: off.
    """

    border_noise: float = 0.0
    border_clip: float = 0.0
    border_delta: float = 1e-5
    peer_epsilon: float = 0.0
    peer_noise: float = 0.0
    peer_clip: float = 1.0
    peer_delta: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("border_noise", "border_clip", "peer_epsilon", "peer_noise"):
            _require(_finite(getattr(self, name)) and getattr(self, name) >= 0, f"privacy.{name}",
                     "must be a finite number >= 0")
        _require(_finite(self.peer_clip) and self.peer_clip > 0, "privacy.peer_clip", "must be > 0")
        for name in ("border_delta", "peer_delta"):
            _require(_finite(getattr(self, name)) and 0 < getattr(self, name) < 1, f"privacy.{name}",
                     "must be in (0, 1), e.g. 1e-5")
        _require(not (self.border_noise > 0 and self.border_clip == 0), "privacy.border_noise",
                 "needs privacy.border_clip > 0 (the noise is border_noise x border_clip)")
        _require(not (self.peer_epsilon > 0 and self.peer_noise > 0), "privacy.peer_epsilon",
                 "give a target epsilon or a noise multiplier (privacy.peer_noise), not both")

    @property
    def border(self) -> bool:
        return self.border_clip > 0

    @property
    def peer(self) -> bool:
        return self.peer_epsilon > 0 or self.peer_noise > 0


def privacy_violations(policy: PrivacyPolicy, settings: PrivacyConfig) -> list[str]:
    """Why ``settings`` (a region's privacy settings) break the run's ``policy``; empty if they meet it."""
    out = []
    if policy.min_border_noise > 0 and settings.border_noise < policy.min_border_noise:
        out.append(f"the run requires border noise >= {policy.min_border_noise:g} at every region's border, "
                   f"this peer's region has {settings.border_noise:g} (privacy.border_noise)")
    if policy.max_border_clip > 0 and not (0 < settings.border_clip <= policy.max_border_clip):
        out.append(f"the run requires a border clip norm <= {policy.max_border_clip:g}, this peer's region has "
                   f"{settings.border_clip:g} (privacy.border_clip; 0 means no clipping)")
    if settings.border and settings.border_delta > policy.max_delta:
        out.append(f"privacy.border_delta {settings.border_delta:g} exceeds the run's max_delta {policy.max_delta:g}")
    if policy.max_peer_epsilon > 0:
        if not settings.peer:
            out.append(f"the run requires DP-SGD at every peer with epsilon <= {policy.max_peer_epsilon:g}; "
                       "set privacy.peer_epsilon (or privacy.peer_noise)")
        elif settings.peer_epsilon > policy.max_peer_epsilon:
            out.append(f"privacy.peer_epsilon {settings.peer_epsilon:g} exceeds the run's max_peer_epsilon "
                       f"{policy.max_peer_epsilon:g}")
    if settings.peer and settings.peer_delta > policy.max_delta:
        out.append(f"privacy.peer_delta {settings.peer_delta:g} exceeds the run's max_delta {policy.max_delta:g}")
    return out


# ----------------------------------------------------------------------------------- peer


REACHABILITY_MODES = ("auto", "direct", "outbound")


@dataclass(frozen=True, kw_only=True, slots=True)
class NetConfig:
    """How a process joins the DHT."""

    initial_peers: tuple[str, ...] = ()
    host_maddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    announce_maddrs: tuple[str, ...] = ()
    identity_path: str | None = None
    connect_retries: int = 3
    connect_backoff: float = 1.0  # seconds before the first retry; doubles each time
    startup_timeout: float = 30.0
    # how this process takes part: "auto" (the dial-back check at start decides), "direct" (others can
    # dial it: it serves the DHT, reduces parts of all-reduces and may lead its region) or "outbound"
    # (behind NAT without a port forward: a DHT client that sends its part of every all-reduce and
    # receives the result over the connections it opened, never a reducer, a state donor or a leader)
    reachability: str = "auto"

    def __post_init__(self) -> None:
        _require(self.connect_retries >= 0, "connect_retries", "must be >= 0")
        _require(self.connect_backoff >= 0, "connect_backoff", "must be >= 0")
        _require(self.startup_timeout > 0, "startup_timeout", "must be > 0")
        _require(len(self.host_maddrs) > 0, "host_maddrs", "needs at least one address to listen on")
        _require(self.reachability in REACHABILITY_MODES, "reachability",
                 f"{self.reachability!r} is not one of {', '.join(REACHABILITY_MODES)}")


@dataclass(frozen=True, kw_only=True, slots=True)
class PeerConfig:
    """Local settings of one peer. Everything shared with the run comes from the manifest."""

    region: str
    data: str
    net: NetConfig = field(default_factory=NetConfig)
    run_id: str | None = None
    label: str = ""
    max_steps: int | None = None
    max_tokens: int | None = None
    device: str = "auto"
    checkpoint_dir: str | None = None
    checkpoint_every: int = 50  # steps; also written at every clean shutdown
    keep_checkpoints: int = 3
    progress_interval: float = 2.0  # seconds between progress records
    progress_ttl: float = 15.0  # seconds a progress record stays valid without renewal
    torch_threads: int | None = None
    manifest_wait: float = 30.0  # seconds to wait for the run manifest to appear in the DHT
    join_state_timeout: float = 30.0  # seconds to wait for the region's current model when joining
    # before training, wait until this many peers of the region (this one included) are live, for at
    # most wait_for_peers_timeout seconds (0: start at once; experiments that compare runs use it)
    wait_for_peers: int = 0
    # the run key the manifest must be signed by (OpenSSH public line, or a file holding it); None: the
    # run key of the bootstrap nodes joined through (see worldlm_p2p.net.records.choose_manifest)
    run_key: str | None = None
    wait_for_peers_timeout: float = 300.0
    local_overrides: Mapping[str, Any] = field(default_factory=dict)  # manifest-shaped, must agree
    summary_path: str | None = None  # JSON written at exit (used by worldlm-swarm)
    trace_dir: str | None = None  # audit trail: pre/post tensors of every region round
    certificate_path: str | None = None  # the region's admission of this peer (worldlm-admit issue)
    events_path: str | None = None  # structured event log, one JSON object per line (worldlm_p2p.peer.events)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)  # the region's policy ([peer.privacy])
    # emulate a device this many times slower (experiments with peers of different speeds): after
    # each step the peer sleeps (slowdown - 1) times the step's duration; 1: full speed
    slowdown: float = 1.0
    # CPU priority (a nice value, 0-19) of the peer's round threads (worldlm_p2p.net.priority; the
    # hivemind and p2pd processes keep the peer's own); 0: the training's own priority
    background_nice: int = 0

    def __post_init__(self) -> None:
        check_name("region", self.region)
        _require(not isinstance(self.background_nice, bool) and isinstance(self.background_nice, int)
                 and 0 <= self.background_nice <= 19, "background_nice",
                 "must be an integer from 0 (the training's priority) to 19 (the lowest)")
        _require(isinstance(self.slowdown, (int, float)) and not isinstance(self.slowdown, bool)
                 and math.isfinite(self.slowdown) and 1 <= self.slowdown <= 100, "slowdown",
                 "must be a number from 1 (full speed) to 100")
        if self.run_id is not None:
            check_name("run id", self.run_id)
        _require(self.max_steps is None or self.max_steps > 0, "max_steps", "must be a positive integer")
        _require(self.max_tokens is None or self.max_tokens > 0, "max_tokens", "must be a positive integer")
        _require(self.device in ("auto", "cpu") or self.device.startswith("cuda"), "device",
                 f"{self.device!r} is not 'auto', 'cpu' or 'cuda[:N]'")
        _require(self.checkpoint_every > 0, "checkpoint_every", "must be a positive integer")
        _require(self.keep_checkpoints >= 2, "keep_checkpoints", "must be >= 2 so a corrupt latest one has a fallback")
        _require_finite("peer", self, ("progress_interval", "progress_ttl", "manifest_wait", "join_state_timeout"))
        _require(self.manifest_wait >= 0, "manifest_wait", "must be >= 0 seconds")
        _require(self.progress_interval > 0, "progress_interval", "must be > 0")
        _require(self.progress_ttl > self.progress_interval, "progress_ttl", "must exceed progress_interval")
        _require(self.torch_threads is None or self.torch_threads > 0, "torch_threads", "must be a positive integer")
        _require(self.wait_for_peers >= 0, "wait_for_peers", "must be a non-negative integer (peers)")
        _require(math.isfinite(self.wait_for_peers_timeout) and self.wait_for_peers_timeout > 0,
                 "wait_for_peers_timeout", "must be a finite number of seconds > 0")
        _require(not (self.privacy.peer_epsilon > 0 and self.max_steps is None), "privacy.peer_epsilon",
                 "DP-SGD with a target epsilon needs --max-steps (the noise is calibrated over the run's steps), "
                 "or give privacy.peer_noise instead")
