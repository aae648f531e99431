"""Shared pytest setup. The tests are laid out by kind: ``unit/`` (one process: the pure math,
training, data, codecs, the simulator, reports), ``network/`` (hivemind processes on 127.0.0.1,
fixtures in its conftest; the multi-process swarm tests are marked ``slow``) and ``cli/`` (the
command-line tools as a user runs them). ``swarm_utils`` holds the helpers they share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> Iterator[None]:
    """The test models are tiny: intra-op threads only add synchronisation overhead, which gets
    severe on small or shared CI machines (and next to peer processes). Results do not depend on it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """For tests that run a CLI's ``main`` in this process: the CLIs route the root logger to a
    stream; undo it afterwards."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
