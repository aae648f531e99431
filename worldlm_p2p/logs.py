"""Logging setup for the command-line tools (the library itself only creates loggers).

Logs go to stdout; stderr is reserved for the one-line error of a failed command. Level from
``WORLDLM_LOGLEVEL`` (default INFO). hivemind's own handler is switched off so that its records
flow through ours, at WARNING unless ``WORLDLM_LOGLEVEL=DEBUG``; tracebacks from hivemind's
background processes are shortened to one line unless debugging.
"""

from __future__ import annotations

import logging
import os
import sys


class _NoTraceback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            err = record.exc_info[1]
            record.msg = f"{record.getMessage()} ({type(err).__name__}: {' '.join(str(err).split())[:200]})"
            record.args = ()
            record.exc_info = None
            record.exc_text = None
        return True


def setup_logging(level: str | None = None, *, stream=None, hivemind: bool = True) -> None:
    """Route logs to ``stream`` (stdout). ``hivemind=False`` skips hivemind's handler setup (and
    its import) for tools that never start a DHT."""
    level = (level or os.environ.get("WORLDLM_LOGLEVEL", "INFO")).upper()
    handler = logging.StreamHandler(stream or sys.stdout)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    if level != "DEBUG":
        handler.addFilter(_NoTraceback())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("urllib3", "filelock", "datasets", "fsspec", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if not hivemind:
        return
    try:
        from hivemind.utils.logging import use_hivemind_log_handler

        use_hivemind_log_handler("nowhere")
    except Exception:  # pragma: no cover - hivemind missing is reported elsewhere
        pass
    hm = logging.getLogger("hivemind")
    hm.setLevel(logging.DEBUG if level == "DEBUG" else logging.ERROR)
    hm.propagate = True
    # hivemind's background processes leave "Task exception was never retrieved" records about
    # peers that timed out; the round's outcome is logged by the peer itself
    logging.getLogger("asyncio").setLevel(logging.DEBUG if level == "DEBUG" else logging.CRITICAL)
