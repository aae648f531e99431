"""User-facing errors.

Every error a user can cause (a bad flag, config, data path, multiaddr, checkpoint, or an
unreachable bootstrap node) is raised as a :class:`WorldLMError` subclass with a one-line message.
The CLIs print that line on stderr and exit with code 2; they never show a traceback for these.
"""

from __future__ import annotations


class WorldLMError(Exception):
    """Base class of errors caused by input the user can fix. ``str(err)`` is one line."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


class ConfigError(WorldLMError):
    """A config file, flag or run manifest is invalid or contradicts another."""


class DataError(WorldLMError):
    """A data path is missing, empty or unreadable."""


class AddressError(WorldLMError):
    """A multiaddr is malformed or a bootstrap peer cannot be reached."""


class CheckpointError(WorldLMError):
    """No usable checkpoint could be read, or the checkpoint directory cannot be used."""


class CheckpointWriteError(CheckpointError):
    """One checkpoint could not be written (a full disk, a quota, an I/O error); the earlier ones
    are intact, and a peer goes on training."""


class ManifestError(WorldLMError):
    """The run manifest is missing from the DHT, ambiguous, or contradicts local settings."""
