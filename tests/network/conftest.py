"""Shared fixtures of the multi-process tests (hivemind processes on 127.0.0.1 only)."""

import pytest
from swarm_utils import Procs


@pytest.fixture
def procs():
    """The processes a test starts; every one of them (and its process group) is stopped at the end."""
    p = Procs()
    yield p
    p.close()
