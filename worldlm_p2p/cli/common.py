"""Shared CLI plumbing: one-line errors with exit code 2, signal handling, ``--config`` files."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Callable, NoReturn

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


def reap_children_on_death() -> None:
    """hivemind runs the DHT and the averager in forked processes (which start the p2p daemon).
    Make every process this CLI forks die with it, even if it is killed with SIGKILL, so that a
    crashed or killed peer never leaves orphans behind."""
    os.register_at_fork(after_in_child=_set_parent_death_signal)


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


def run_main(prog: str, body: Callable[[], int | None]) -> NoReturn:
    """Run a CLI body; user errors become one line on stderr and exit code 2."""
    die_with_parent_if_asked()
    reap_children_on_death()
    try:
        code = body() or 0
    except WorldLMError as e:
        fail(prog, str(e), e.exit_code)
    except KeyboardInterrupt:
        code = 130
    except Exception as e:  # a bug, not bad input: still one line unless debugging
        if os.environ.get("WORLDLM_LOGLEVEL", "").upper() == "DEBUG":
            raise
        fail(prog, f"internal error: {type(e).__name__}: {' '.join(str(e).split())[:300]} "
                   "(rerun with WORLDLM_LOGLEVEL=DEBUG for details)", 1)
    sys.stdout.flush()
    sys.exit(code)
