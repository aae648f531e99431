"""The peer: the one orchestrator that knows every layer, as parts (``tests/unit/test_layering.py``
checks that this map names every module).

- ``core``: :class:`Peer`, the composition root, and its run loop (join, start, train, region
  rounds every H steps, checkpoints, summary, shutdown).
- ``joining``: the network and the manifest, the checks of the run's and the region's policy, the
  local training parts, and where a model starts without a checkpoint (the region's state, or the
  common init).
- ``checkpoints``: what a peer checkpoints (one typed payload) and how it resumes.
- ``progress``: the progress record, published every few seconds, and the reader of the region's.
- ``member``: this peer's own model as a member: its parameters, tune-slice evidence, mixing choices.
- ``state``: the region's state as this peer knows it (agreed model, momentum, last world change,
  border-DP reference and accountant), owned by the main thread.
- ``serving``: what this peer serves to its region and downloads from others (one typed codec,
  :mod:`worldlm_p2p.codec`).
- ``region_round``: a region round as a small state machine with named outcomes.
- ``world``: world rounds: the leader's lease, border release and background world round, and
  every member's adoption of the leader's change.
- ``stats``: the counters, with their checkpoint and summary views derived from one definition.
- ``events``: the structured event log (``--events``): phases and every round's outcome, as JSON lines.
- ``relay``: the relay a bootstrap node runs with ``--relay``: the auxiliary reducer of the rounds of
  regions whose members are all outbound-only (it holds no model; the run key endorses it).

Threads: the main thread trains and owns the region's state; the world-round thread works on a
snapshot and hands back a typed change (:mod:`.world`); the progress thread only publishes records.

One region round through the files: ``core`` trains H steps and calls ``region_round``; its barrier
reads the members' records (``progress``); the member's payload and the average become the agreed
model by :func:`worldlm_p2p.rounds.region_step`; ``member`` mixes its own model towards it on its
tune slice; ``state`` takes the agreed model and ``serving`` serves it; ``world`` counts the round.
One world round: the leader's ``world`` starts a thread on a snapshot of ``state`` (border release
first, :func:`worldlm_p2p.rounds.border_release`), :class:`worldlm_p2p.net.world.WorldExchange`
averages with the other leaders and exchanges residuals; the thread hands back the change, the
main thread serves it (``collect``), renews the lease and announces it in its next region round's
gather; each member's ``world`` downloads it through ``serving`` and adopts it at the round the
leader set (:meth:`worldlm_p2p.peer.world.WorldRounds.apply_round`).
"""

from worldlm_p2p.peer.core import Peer
from worldlm_p2p.peer.stats import PeerStats

__all__ = ["Peer", "PeerStats"]
