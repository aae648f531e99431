"""A genuine ``worldlm-peer`` process that lies in its region rounds, as a malicious volunteer with
a modified copy of the program would:

    python benchmarks/malicious_peer.py ATTACK [worldlm-peer flags...]

ATTACK: ``scale`` (its payload x1000), ``flip`` (sign-flipped), ``random`` (a random model with a
claimed weight of 1e9), ``nan`` (NaN in every tensor); ``world-random``: an honest member, but as
its region's leader it serves a world change of random tensors (and adopts it itself). Everything
else (joining, records, training, the all-reduce protocol) is the real peer's."""

import dataclasses
import sys

import torch


def main() -> None:
    attack, argv = sys.argv[1], sys.argv[2:]
    from worldlm_p2p import aggregation, rounds
    from worldlm_p2p.cli import peer

    honest_payload, honest_weight = rounds.region_payload, aggregation.round_weight
    g = torch.Generator().manual_seed(7)

    def payload(rule, params, anchor, **kwargs):  # (kwargs: what a genuine peer passes, e.g. its token usage)
        out = honest_payload(rule, params, anchor, **kwargs)
        if attack == "scale":
            return [t * 1000 for t in out]
        if attack == "flip":
            return [-t for t in out]
        if attack == "random":
            return [torch.randn(t.shape, generator=g) for t in out]
        if attack == "nan":
            return [t.clone().view(-1).index_fill_(0, torch.tensor([0]), float("nan")).view(t.shape) for t in out]
        raise SystemExit(f"unknown attack {attack!r}")

    if attack == "world-random":
        from worldlm_p2p.peer import world

        honest_collect = world.WorldRounds.collect

        def collect(self):
            done = self._finished
            if done is not None:
                self._finished = dataclasses.replace(
                    done, delta=[torch.randn(d.shape, generator=g) for d in done.delta])
            return honest_collect(self)

        world.WorldRounds.collect = collect
        world.WorldRounds._residual_step = lambda self, done: done  # (partners: would recompute the delta)
        world.WorldRounds._refutes = lambda self, change, params: False
        print("MALICIOUS", attack, flush=True)
        peer.main(argv)
        return
    rounds.region_payload = payload
    if attack == "random":
        aggregation.round_weight = lambda tokens: 1e9
    print("MALICIOUS", attack, flush=True)
    peer.main(argv)


if __name__ == "__main__":
    main()
