"""Shared pytest setup."""

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
