"""The loopback run manifest and process environment the swarm benchmarks share (hostile.py,
churn.py): the ``tiny`` model, small batches, averaging timings for 127.0.0.1."""

import os


def fast_run(*, run_id: str, inner_steps: int, barrier_timeout: float, aggregation: str = "", averaging: str = "",
             eval_tokens: int = 4096) -> str:
    """The manifest's TOML; ``averaging``/``aggregation``: extra lines for those tables. The swarm
    tests use it too (``tests/swarm_utils.py``)."""
    return f"""
run_id = "{run_id}"
[model]
preset = "tiny"
[train]
inner_steps = {inner_steps}
batch_size = 4
seq_len = 64
eval_tokens = {eval_tokens}
[averaging]
matchmaking_time = 1.5
request_timeout = 0.5
averaging_timeout = 15.0
barrier_timeout = {barrier_timeout}
{averaging}
[aggregation]
{aggregation}
"""


def peer_env() -> dict[str, str]:
    """One torch thread per peer process (several share the machine's cores), INFO logs."""
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", WORLDLM_LOGLEVEL="INFO")
    return e


def read_events(path) -> list[dict]:
    """A peer's ``--events`` log as a list (lines cut by a SIGKILL skipped; [] if unreadable)."""
    import json
    from pathlib import Path

    out = []
    try:
        for line in Path(path).read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # a line cut by SIGKILL
    except OSError:
        pass
    return out


def stop_all(procs, *, grace: float = 20.0) -> None:
    """SIGTERM every still-running process (each the leader of its own session), wait up to
    ``grace`` seconds in all, then SIGKILL whatever is left of their process groups (p2pd included)."""
    import signal
    import subprocess
    import time

    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def wait_for(cond, timeout: float, what: str, poll: float = 0.5):
    """``cond()``'s first true value, polled every ``poll`` seconds for at most ``timeout``;
    AssertionError (the tests' failure) naming ``what`` when it never came."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
