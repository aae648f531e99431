"""Would members refuse honest world changes? Runs ``worldlm-simulate`` with the given flags and, at
every world round, tests each member's world change the way a swarm member tests the change its
leader hands down (:func:`worldlm_p2p.rounds.world_change_refuted` on its tune slice: refused when
the change undoes more than half of what the model learnt over a uniform one). In the swarm a
refusal also drops the leader's lease for that member, so an honest change that is refused costs
the region its leader.

    python benchmarks/world_refusals.py --data benchmarks/corpora/related.toml --model tiny \
        --rounds 6 --local-steps 10 --seed 0 --threads 1 --device cpu --no-report \
        --strategy worldlm --residual-attention partners --out /tmp/run.json

Prints one line: the world changes tested, how many would be refused, and the largest fraction of
the learnt loss any of them undid. The simulator itself refuses nothing (it mixes by evidence);
this only counts. Tested on a member's own shared model, where the swarm tests the region's agreed
model: close, not equal.
"""

from __future__ import annotations

import math
import sys

import worldlm_p2p.simulate as simulate
from worldlm_p2p.rounds import world_change_refuted

VOCAB = 259  # the byte-level tokenizer's vocabulary (the presets' only tokenizer)


def main(argv: list[str]) -> int:
    tested: list[tuple[float, float, bool]] = []
    original = simulate.member_world_mix

    def scalar(x) -> float:
        return float(sum(x) / len(x)) if isinstance(x, (list, tuple)) else float(x)

    def counting(rule, *, own, change, loss_of, **kw):
        before = scalar(loss_of(own))
        after = scalar(loss_of([o + c for o, c in zip(own, change)]))
        tested.append((before, after, world_change_refuted(before=before, after=after, vocab_size=VOCAB)))
        return original(rule, own=own, change=change, loss_of=loss_of, **kw)

    simulate.member_world_mix = counting
    from worldlm_p2p.cli import simulate as cli

    sys.argv = ["worldlm-simulate", *argv]
    try:
        cli.main()
    except SystemExit as e:
        if e.code not in (0, None):
            return int(e.code) if isinstance(e.code, int) else 1
    refused = sum(r for _, _, r in tested)
    worst = max(((a - b) / max(math.log(VOCAB) - b, 1e-9) for b, a, _ in tested), default=float("nan"))
    print(f"world changes tested {len(tested)}, would be refused {refused}, largest share of the learnt loss undone {worst:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
