"""Every DHT key and averager prefix of a run, in one place (imports the standard library only).

A run id and a region tag are letters, digits, ``_`` and ``-`` (:func:`worldlm_p2p.config.check_name`):
no dots (hivemind's prefixes may not hold them) and never a leading ``_``, so the group names below
that start with ``_`` cannot collide with a region.

==========================  ==========================  =====================================================
key / prefix                 what it holds                who writes it
==========================  ==========================  =====================================================
``worldlm_runs``            the run manifests            bootstrap nodes (subkey: run id, signed)
``<run>_progress``          progress records             every peer (subkey: its signed public key)
``<run>_leaders``           leader leases                 peers that may lead (subkey: signed)
``<run>_residuals``         residual embeddings          region leaders in world rounds (subkey: signed)
``<run>_<region>``          averager prefix              the members of a region (matchmaking, all-reduce,
                                                          state sharing)
``<run>__all``              averager prefix              every peer of a world-group strategy
``<run>__leaders``          averager prefix              the region leaders' world round
==========================  ==========================  =====================================================
"""

from __future__ import annotations

RUNS_PREFIX = "worldlm"
RUNS_KEY = f"{RUNS_PREFIX}_runs"
ALL_REGIONS = "_all"  # the averager group of world-group strategies (fedavg, fedper)
LEADERS_GROUP = "_leaders"  # the averager group of the region leaders


def progress_key(run_id: str) -> str:
    return f"{run_id}_progress"


def leaders_key(run_id: str) -> str:
    return f"{run_id}_leaders"


def residuals_key(run_id: str) -> str:
    return f"{run_id}_residuals"


def relays_key(run_id: str) -> str:
    return f"{run_id}_relays"


def averager_prefix(run_id: str, group: str) -> str:
    """The averager prefix of a region (or of :data:`ALL_REGIONS` / :data:`LEADERS_GROUP`)."""
    return f"{run_id}_{group}"
