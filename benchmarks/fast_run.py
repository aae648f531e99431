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
