"""Shared CLI plumbing: one-line errors with exit code 2, signal handling, ``--config`` files."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import time
import typing
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NoReturn, Sequence

from worldlm_p2p.errors import WorldLMError

logger = logging.getLogger(__name__)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error (``prog: error: ...``) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.exit(2)


def fail(prog: str, message: str, code: int = 2) -> NoReturn:
    sys.stderr.write(f"{prog}: error: {message}\n")
    sys.stderr.flush()
    sys.exit(code)


def install_stop_handlers(stop: Callable[[], None]) -> None:
    """SIGINT, SIGTERM and SIGHUP ask for a clean stop; a second signal exits at once."""
    count = {"n": 0}
    owner = os.getpid()

    def handler(signum, _frame):
        if os.getpid() != owner:  # a forked hivemind child inherited this handler: behave as default
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        count["n"] += 1
        if count["n"] > 1:
            os._exit(128 + signum)
        logger.info("received %s: stopping cleanly (send again to force)", signal.Signals(signum).name)
        stop()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: the terminal went away
        signal.signal(sig, handler)


def _set_parent_death_signal() -> None:
    """Linux: have the kernel send SIGTERM to this process when its parent dies (no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _child_after_fork() -> None:
    """In a process this CLI forks (hivemind's DHT and averager): ignore the stop signals and die,
    by SIGKILL, with the parent.

    A stop signal sent to the whole process group (Ctrl-C in a terminal, systemd's SIGTERM to a
    unit) used to kill these children before the parent could use them: the parent then waited
    on an averager that was gone, never finishing its round, its checkpoint or its summary. Now the
    parent alone decides: it shuts its children down in order, and if it dies they die with it."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def reap_children_on_death() -> None:
    """hivemind runs the DHT and the averager in forked processes (which start the p2p daemon).
    Make every process this CLI forks die with it, even if it is killed with SIGKILL, so that a
    crashed or killed peer never leaves orphans behind, and leave stopping them to it."""
    os.register_at_fork(after_in_child=_child_after_fork)
    from worldlm_p2p.net.hivemind_compat import detach_p2p_daemon_from_process_group

    detach_p2p_daemon_from_process_group()


def die_with_parent_if_asked() -> None:
    """Processes started by ``worldlm-swarm`` (``WORLDLM_DIE_WITH_PARENT=1``) stop when the swarm
    process dies, even by SIGKILL. Opt-in: a peer started from a shell with ``nohup`` must survive
    its shell."""
    if os.environ.get("WORLDLM_DIE_WITH_PARENT") != "1":
        return
    _set_parent_death_signal()
    expected = os.environ.get("WORLDLM_PARENT_PID", "")
    if expected.isdigit() and os.getppid() != int(expected):  # the parent died before prctl took effect
        sys.exit(143)


def reap_children(grace: float = 5.0) -> None:
    """Join the processes this CLI forked; kill those still there after ``grace`` seconds.

    They ignore stop signals (see :func:`_child_after_fork`), so a hivemind shutdown that could
    not finish (its p2p daemon gone) would otherwise hold the exit, where multiprocessing joins
    them."""
    import multiprocessing

    deadline = time.monotonic() + grace
    for child in multiprocessing.active_children():
        child.join(max(0.0, deadline - time.monotonic()))
        if child.is_alive():
            logger.debug("killing %s (pid %s): it did not stop in %.0fs", child.name, child.pid, grace)
            child.kill()
            child.join(1.0)


def run_main(prog: str, body: Callable[[], int | None]) -> NoReturn:
    """Run a CLI body; user errors become one line on stderr and exit code 2."""
    die_with_parent_if_asked()
    reap_children_on_death()
    try:
        code = body() or 0
    except WorldLMError as e:
        reap_children()
        fail(prog, str(e), e.exit_code)
    except KeyboardInterrupt:
        code = 130
    except Exception as e:  # a bug, not bad input: still one line unless debugging
        reap_children()
        if os.environ.get("WORLDLM_LOGLEVEL", "").upper() == "DEBUG":
            raise
        fail(prog, f"internal error: {type(e).__name__}: {' '.join(str(e).split())[:300]} "
                   "(rerun with WORLDLM_LOGLEVEL=DEBUG for details)", 1)
    reap_children()
    sys.stdout.flush()
    sys.exit(code)


# ------------------------------------------------------------------------------ flags from config fields
@dataclass(frozen=True, slots=True)
class Flag:
    """A command-line flag for the field ``field`` of the config section ``section``. Its name is
    ``--<field with dashes>`` unless ``flag`` says otherwise; its type and default come from the
    field (a ``Literal`` field gets its values as choices; a bool field that defaults to True becomes
    ``--no-<field>``), and the default is added to ``help``."""

    section: str
    field: str
    help: str
    flag: str | None = None
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return f"{self.section}__{self.field}"


def add_flags(parser, sections: Mapping[str, type], flags: Sequence[Flag]) -> None:
    """Add ``flags`` to ``parser`` (or an argument group); ``sections`` maps a section name to its
    config dataclass."""
    for f in flags:
        cls = sections[f.section]
        default = next(x for x in dataclasses.fields(cls) if x.name == f.field).default
        hints = typing.get_type_hints(cls)
        choices = typing.get_args(hints[f.field]) if typing.get_origin(hints[f.field]) is typing.Literal else None
        if isinstance(default, bool):
            name = f.flag or f"--{'no-' if default else ''}{f.field.replace('_', '-')}"
            parser.add_argument(name, dest=f.dest, action="store_const", const=not default, default=None, help=f.help)
            continue
        name = f.flag or f"--{f.field.replace('_', '-')}"
        shown = f"{default:g}" if isinstance(default, float) else default
        parser.add_argument(name, dest=f.dest, type=type(default), choices=choices, metavar=f.metavar or (None if choices else f.field.upper()),
                            help=f"{f.help} (default {shown})")


def flag_values(args, flags: Sequence[Flag]) -> dict[str, dict[str, Any]]:
    """The flags given on the command line, as config sections: ``{section: {field: value}}``."""
    out: dict[str, dict[str, Any]] = {}
    for f in flags:
        value = getattr(args, f.dest, None)
        if value is not None:
            out.setdefault(f.section, {})[f.field] = value
    return out


#: the differential-privacy flags of worldlm-peer and worldlm-simulate (fields of PrivacyConfig)
PRIVACY_FLAGS = (
    Flag("privacy", "border_noise", "border DP: noise multiplier on a region's clipped delta (needs --region-dp-clip)",
         flag="--region-dp-noise", metavar="SIGMA"),
    Flag("privacy", "border_clip", "border DP, applied by the region's leader: clip the region's backbone delta "
                                   "(simulator, fedavg: its mean change) to L2 norm C; 0: off",
         flag="--region-dp-clip", metavar="C"),
    Flag("privacy", "border_delta", "delta of the border epsilon", flag="--region-dp-delta", metavar="DELTA"),
    Flag("privacy", "peer_epsilon", "DP-SGD on the peer's data with target epsilon E over the run's steps; 0: off",
         flag="--peer-dp-epsilon", metavar="E"),
    Flag("privacy", "peer_noise", "DP-SGD noise multiplier (instead of --peer-dp-epsilon)", flag="--peer-dp-noise",
         metavar="SIGMA"),
    Flag("privacy", "peer_clip", "DP-SGD per-window clipping norm", flag="--peer-dp-clip", metavar="C"),
    Flag("privacy", "peer_delta", "delta of the DP-SGD epsilon", flag="--peer-dp-delta", metavar="DELTA"),
)
