"""Would members refuse honest world changes? Runs ``worldlm-simulate`` with the given flags and, at
every world round, tests each member's world change the way a swarm member tests the change its
leader hands down (:func:`worldlm_p2p.rounds.world_change_refused` on its tune slice: with the
defaults, refused when the change's backbone part undoes more than half of what the model learnt
over a uniform one, or the whole change leaves it worse than a uniform one; and, for comparison,
the rule before 2026-12-05: the whole change held to half, :func:`~worldlm_p2p.rounds.world_change_refuted`).
In the swarm a refusal also drops the leader's lease for that member, so an honest change that is
refused costs the region its leader.

    python benchmarks/world_refusals.py --data benchmarks/corpora/related.toml --model tiny \
        --rounds 6 --local-steps 10 --seed 0 --threads 1 --device cpu --no-report \
        --strategy worldlm --residual-attention partners --out /tmp/run.json

Prints one line: the world changes tested, how many would be refused (and under the older rule),
and the largest fraction of the learnt loss any of them undid, whole and by its backbone part. The
simulator itself refuses nothing (it mixes by evidence); this only counts. Tested on a member's own
shared model, where the swarm tests the region's agreed model: close, not equal.
"""

from __future__ import annotations

import math
import sys

import worldlm_p2p.simulate as simulate
from worldlm_p2p.rounds import world_change_refused, world_change_refuted

VOCAB = 259  # the byte-level tokenizer's vocabulary (the presets' only tokenizer)


def main(argv: list[str]) -> int:
    tested: list[tuple[float, float, bool]] = []
    whole: list[tuple[float, float, bool]] = []  # the whole change to half (the rule before 2026-12-05)
    backbone: list[tuple[float, float, bool]] = []
    original = simulate.member_world_mix

    def scalar(x) -> float:
        return float(sum(x) / len(x)) if isinstance(x, (list, tuple)) else float(x)

    def counting(rule, *, own, change, loss_of, **kw):
        before = scalar(loss_of(own))
        after = scalar(loss_of([o + c for o, c in zip(own, change)]))
        backbone_step, _ = rule.part_steps(change)  # the backbone's part alone (K's part zero)
        after_b = scalar(loss_of([o + c for o, c in zip(own, backbone_step)]))
        tested.append((before, after, world_change_refused(rule, before=before, after=after, after_backbone=after_b,
                                                           vocab_size=VOCAB)))
        whole.append((before, after, world_change_refuted(before=before, after=after, vocab_size=VOCAB)))
        backbone.append((before, after_b, False))
        return original(rule, own=own, change=change, loss_of=loss_of, **kw)

    simulate.member_world_mix = counting
    from worldlm_p2p.cli import simulate as cli

    sys.argv = ["worldlm-simulate", *argv]
    try:
        cli.main()
    except SystemExit as e:
        if e.code not in (0, None):
            return int(e.code) if isinstance(e.code, int) else 1
    def worst(xs):
        return max(((a - b) / max(math.log(VOCAB) - b, 1e-9) for b, a, _ in xs), default=float("nan"))

    def at_worst(xs):
        if not xs:
            return ""
        i = max(range(len(xs)), key=lambda k: (xs[k][1] - xs[k][0]) / max(math.log(VOCAB) - xs[k][0], 1e-9))
        return f" (test {i + 1} of {len(xs)}: loss {xs[i][0]:.3f} -> {xs[i][1]:.3f})"

    print(f"world changes tested {len(tested)}, would be refused {sum(r for _, _, r in tested)} "
          f"(whole change held to half: {sum(r for _, _, r in whole)}), largest share of the learnt loss undone "
          f"{worst(tested):.3f}{at_worst(tested)}, by the backbone part alone {worst(backbone):.3f}{at_worst(backbone)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
