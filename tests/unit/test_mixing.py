"""Evidence mixing (:mod:`worldlm_p2p.mixing`) against hand-computed values: the line search on
losses whose minimum is known, the parabola step, the own model back when nothing helps, weights
over several candidates that sum to one and do not depend on the candidates' order."""

from __future__ import annotations

import math

import pytest
import torch

from worldlm_p2p import mixing

GRID = (1 / 16, 1 / 4, 1.0)


def quadratic(center: float, *, scale: float = 1.0, base: float = 2.0):
    return lambda lam: base + scale * (lam - center) ** 2


def test_own_model_back_when_every_mix_is_worse():
    calls = []
    choice = mixing.line_search(lambda lam: calls.append(lam) or quadratic(-0.5)(lam), grid=GRID)
    assert choice.lam == 0.0 and choice.loss == choice.own_loss == 2.25 and choice.gain == 0.0
    assert calls == [0.0, 1 / 16]  # own first, then the grid until the loss rises; no vertex at a boundary


def test_the_search_stops_once_the_minimum_is_bracketed_and_reuses_a_known_own_loss():
    calls = []
    f = quadratic(0.1)
    choice = mixing.line_search(lambda lam: calls.append(lam) or f(lam), grid=GRID, own_loss=f(0.0))
    # 1/16 better than own, 1/4 worse: bracketed, then the vertex (exact for a parabola), never 1
    assert calls[:2] == [1 / 16, 1 / 4] and len(calls) == 3 and 0.0 not in calls
    assert choice.lam == pytest.approx(0.1) and choice.own_loss == f(0.0)
    assert [x for x, _ in choice.evaluated] == calls


def test_ties_keep_the_own_model():
    choice = mixing.line_search(lambda lam: 3.0, grid=GRID)
    assert choice.lam == 0.0


def test_full_adoption_when_the_candidate_is_best():
    choice = mixing.line_search(quadratic(1.7), grid=GRID)
    assert choice.lam == 1.0
    assert choice.loss == pytest.approx(2.0 + 0.7 ** 2)


def test_parabola_vertex_finds_an_interior_minimum_exactly():
    # grid losses at 0, 1/16, 1/4, 1 of (lam - 0.4)^2: best grid point 1/4, the parabola through
    # 1/16, 1/4, 1 is the loss itself, so its vertex is the true minimiser 0.4
    choice = mixing.line_search(quadratic(0.4), grid=GRID)
    assert choice.lam == pytest.approx(0.4)
    assert choice.loss == pytest.approx(2.0)
    assert len(choice.evaluated) == 5 and choice.evaluated[-1][0] == pytest.approx(0.4)


def test_vertex_that_is_not_better_is_not_taken():
    # |lam - 0.3| is not a parabola: the vertex through (1/16, 1/4, 1) lies below 1/4 and is worse there
    f = lambda lam: 1.0 + abs(lam - 0.25)  # noqa: E731
    choice = mixing.line_search(f, grid=GRID)
    assert choice.lam == 0.25 and choice.loss == 1.0


def test_margin_requires_a_real_gain():
    f = quadratic(0.25, scale=0.01)  # own 2.000625, best 2.0 at 1/4: a gain of 0.000625
    assert mixing.line_search(f, grid=GRID, margin=0.0).lam == 0.25
    assert mixing.line_search(f, grid=GRID, margin=0.001).lam == 0.0


def test_a_diverging_candidate_is_never_taken():
    f = lambda lam: 2.0 if lam == 0 else math.nan  # noqa: E731
    assert mixing.line_search(f, grid=GRID).lam == 0.0
    g = lambda lam: math.inf if lam >= 0.25 else 2.0 - lam  # noqa: E731
    assert mixing.line_search(g, grid=GRID).lam == 1 / 16


@pytest.mark.parametrize("grid", [(), (0.0, 0.5), (0.5, 1.5), (math.nan,)])
def test_bad_grids_are_refused(grid):
    with pytest.raises(ValueError, match="grid"):
        mixing.line_search(quadratic(0.5), grid=grid)


def test_interpolate_and_shift_by_hand():
    own = [torch.tensor([1.0, 2.0]), torch.tensor([[0.0]])]
    target = [torch.tensor([3.0, -2.0]), torch.tensor([[4.0]])]
    out = mixing.interpolate(own, target, 0.25)
    assert torch.equal(out[0], torch.tensor([1.5, 1.0])) and torch.equal(out[1], torch.tensor([[1.0]]))
    same = mixing.interpolate(own, target, 0.0)
    assert all(torch.equal(a, b) and a is not b for a, b in zip(same, own))
    moved = mixing.shift(own, target, 0.5)
    assert torch.equal(moved[0], torch.tensor([2.5, 1.0])) and torch.equal(moved[1], torch.tensor([[2.0]]))
    with pytest.raises(ValueError, match="shape"):
        mixing.interpolate(own, [target[0], torch.zeros(2)], 0.5)


def _distance_loss(optimum: list[torch.Tensor]):
    """Squared distance to ``optimum``: a slice loss whose best model is known."""
    return lambda params: float(sum(((p.double() - o.double()) ** 2).sum() for p, o in zip(params, optimum)))


def test_mix_toward_moves_to_the_best_point_on_the_line():
    own, target = [torch.zeros(3)], [torch.ones(3)]
    model, choice = mixing.mix_toward(own, target, _distance_loss([torch.full((3,), 0.4)]), grid=GRID)
    assert choice.lam == pytest.approx(0.4)
    assert torch.allclose(model[0], torch.full((3,), 0.4))


def test_mix_change_takes_a_fraction_of_a_change():
    own, change = [torch.tensor([1.0])], [torch.tensor([2.0])]
    model, choice = mixing.mix_change(own, change, _distance_loss([torch.tensor([2.0])]), grid=GRID)
    assert choice.lam == pytest.approx(0.5) and torch.allclose(model[0], torch.tensor([2.0]))


def test_mix_weights_no_useful_partner_gives_the_own_model_back():
    own = [torch.tensor([0.0, 0.0])]
    cands = {"eu": [torch.tensor([5.0, 0.0])], "na": [torch.tensor([0.0, -5.0])]}
    model, w = mixing.mix_weights(own, cands, _distance_loss([torch.tensor([-1.0, 1.0])]), grid=GRID)
    assert w == {"own": 1.0, "eu": 0.0, "na": 0.0}
    assert torch.equal(model[0], own[0])


def test_mix_weights_sum_to_one_and_do_not_depend_on_order():
    own = [torch.tensor([0.0, 0.0])]
    a, b = [torch.tensor([4.0, 0.0])], [torch.tensor([0.0, 4.0])]
    loss = _distance_loss([torch.tensor([1.0, 1.0])])  # halfway between own and both partners
    m1, w1 = mixing.mix_weights(own, {"a": a, "b": b}, loss, grid=GRID)
    m2, w2 = mixing.mix_weights(own, {"b": b, "a": a}, loss, grid=GRID)
    assert w1 == w2 and torch.equal(m1[0], m2[0])
    assert sum(w1.values()) == pytest.approx(1.0) and all(v >= 0 for v in w1.values())
    # the model is the weighted combination of the inputs
    combo = w1["own"] * own[0] + w1["a"] * a[0] + w1["b"] * b[0]
    assert torch.allclose(m1[0], combo)
    # both partners were taken, and the mix is closer to the optimum than the own model
    assert w1["a"] > 0 and w1["b"] > 0 and loss(m1) < loss(own)


def test_mix_weights_rejects_the_reserved_name():
    with pytest.raises(ValueError, match="reserved"):
        mixing.mix_weights([torch.zeros(1)], {"own": [torch.ones(1)]}, lambda p: 0.0)


def test_significant_hand_computed():
    significant = mixing.significant

    own = torch.tensor([2.0, 2.0, 2.0, 2.0], dtype=torch.float64)
    # paired gains 0.1, 0.3, 0.1, 0.3: mean 0.2, sample std sqrt(4/3 * 0.01) = 0.11547, SE 0.057735
    other = own - torch.tensor([0.1, 0.3, 0.1, 0.3], dtype=torch.float64)
    assert significant(own, other, z=3.0)  # 0.2 > 3 * 0.0577 = 0.173
    assert not significant(own, other, z=3.5)  # 0.2 < 0.202
    # the same mean gain, noisier: gains -0.2, 0.6, -0.2, 0.6 -> SE 0.2309: not significant at z = 1
    noisy = own - torch.tensor([-0.2, 0.6, -0.2, 0.6], dtype=torch.float64)
    assert significant(own, noisy, z=0.8) and not significant(own, noisy, z=1.0)
    # z = 0, scalars or one window: the mean alone; never a loss, nor a tie
    assert significant(own, noisy, z=0.0) and significant(2.0, 1.9, z=5.0)
    assert significant(own[:1], other[:1], z=5.0)
    assert not significant(own, own, z=0.0) and not significant(own, own + 0.1, z=0.0)
    with pytest.raises(ValueError):
        significant(own, other, z=-1.0)
    with pytest.raises(ValueError):
        significant(own, other[:3], z=1.0)


def test_line_search_with_per_window_losses_declines_a_gain_within_the_noise():
    # the mean loss along the line: 1 - 0.1 lam (every point better), but per window the gain of a
    # mix is +lam on even windows and -0.8 lam on odd ones: mean 0.1 lam, SE large
    def windows(lam):
        w = torch.ones(8, dtype=torch.float64)
        w[0::2] -= lam
        w[1::2] += 0.8 * lam
        return w

    plain = mixing.line_search(windows, grid=(0.25, 1.0))
    assert plain.lam == 1.0 and plain.loss == pytest.approx(0.9)
    gated = mixing.line_search(windows, grid=(0.25, 1.0), z=2.0)
    assert gated.lam == 0.0 and gated.loss == pytest.approx(1.0) and gated.own_loss == pytest.approx(1.0)
    # a consistent gain on every window passes the same test
    steady = mixing.line_search(lambda lam: torch.full((8,), 1.0, dtype=torch.float64) - 0.1 * lam
                         + 0.001 * lam * torch.arange(8, dtype=torch.float64), grid=(0.25, 1.0), z=2.0)
    assert steady.lam == 1.0
    # an own loss given as a mean is evaluated again when the test needs the windows
    calls = []
    mixing.line_search(lambda lam: calls.append(lam) or windows(lam), grid=(0.25,), own_loss=1.0, z=2.0)
    assert calls[0] == 0.0
    calls.clear()
    mixing.line_search(lambda lam: calls.append(lam) or windows(lam), grid=(0.25,), own_loss=1.0, z=0.0)
    assert 0.0 not in calls


def test_mix_parts_takes_each_part_as_far_as_it_helps():
    from worldlm_p2p.mixing import mix_parts

    own = [torch.zeros(2), torch.zeros(3)]
    steps = [[torch.ones(2), torch.zeros(3)], [torch.zeros(2), torch.ones(3)]]  # part 1, then part 2

    def wants_first(params):  # the first part's whole step helps, any of the second hurts
        return float((params[0] - 1).pow(2).sum() + params[1].pow(2).sum())

    out, choice = mix_parts(own, steps, wants_first, grids=((0.25, 1.0), (0.25, 1.0)))
    assert (choice.lam, choice.second_lam) == (1.0, 0.0)
    assert torch.equal(out[0], torch.ones(2)) and torch.equal(out[1], torch.zeros(3))
    assert choice.own_loss == 2.0 and choice.loss == 0.0

    def wants_half_of_the_second(params):
        return float(params[0].pow(2).sum() + (params[1] - 0.5).pow(2).sum())

    out, choice = mix_parts(own, steps, wants_half_of_the_second, grids=((0.25, 1.0), (0.25, 1.0)))
    # part 1 declined; part 2: 0.25 (loss 0.1875) < 1 (0.75) -> vertex of the parabola through
    # (0, 0.75), (0.25, 0.1875), (1, 0.75): exactly 0.5
    assert choice.lam == 0.0 and choice.second_lam == pytest.approx(0.5)
    assert torch.equal(out[0], torch.zeros(2)) and torch.allclose(out[1], torch.full((3,), 0.5))

    # no part helps: the own model back, bit for bit, both weights 0
    out, choice = mix_parts(own, steps, lambda p: float(sum(t.pow(2).sum() for t in p)), grids=((1.0,), (1.0,)))
    assert (choice.lam, choice.second_lam) == (0.0, 0.0) and all(torch.equal(a, b) for a, b in zip(out, own))
    with pytest.raises(ValueError, match="two steps"):
        mix_parts(own, steps[:1], wants_first, grids=((1.0,),))


# -- the evidence budget (aggregation.evidence_share) ----------------------------------------------

def test_reused_weights_build_the_model_a_search_that_chose_them_builds():
    own = [torch.tensor([0.0, 2.0]), torch.tensor([1.0])]
    target = [torch.tensor([4.0, 2.0]), torch.tensor([3.0])]
    calls = []

    def loss_of(params):  # minimum at lam = 0.25 on the line (params[0][0] = 1)
        calls.append(1)
        return float((params[0][0] - 1.0) ** 2)

    searched, choice = mixing.mix_toward(own, target, loss_of, grid=GRID)
    assert choice.lam == 0.25 and choice.evaluated and not choice.reused
    n = len(calls)
    again, reused = mixing.mix_toward(own, target, loss_of, grid=GRID, fixed=choice.lam)
    assert len(calls) == n  # nothing evaluated
    assert reused.reused and reused.lam == 0.25 and reused.evaluated == ()
    assert math.isnan(reused.loss) and math.isnan(reused.own_loss) and math.isnan(reused.gain)
    assert all(torch.equal(a, b) for a, b in zip(again, searched))
    # by hand: own + 0.25 (target - own)
    assert torch.equal(again[0], torch.tensor([1.0, 2.0])) and torch.equal(again[1], torch.tensor([1.5]))
    # a change, and two parts
    out, c = mixing.mix_change(own, [torch.tensor([4.0, 0.0]), torch.tensor([2.0])], loss_of, fixed=0.5)
    assert c.reused and torch.equal(out[0], torch.tensor([2.0, 2.0])) and torch.equal(out[1], torch.tensor([2.0]))
    steps = [[torch.ones(2), torch.zeros(1)], [torch.zeros(2), torch.ones(1)]]
    out, c = mixing.mix_parts(own, steps, loss_of, grids=(GRID, GRID), fixed=(1.0, 0.25))
    assert (c.lam, c.second_lam, c.reused) == (1.0, 0.25, True) and len(calls) == n
    assert torch.equal(out[0], torch.tensor([1.0, 3.0])) and torch.equal(out[1], torch.tensor([1.25]))
    # zero weights: the own model, bit for bit
    out, c = mixing.mix_parts(own, steps, loss_of, grids=(GRID, GRID), fixed=(0.0, 0.0))
    assert all(torch.equal(a, b) for a, b in zip(out, own))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        mixing.mix_toward(own, target, loss_of, fixed=1.5)


def test_evidence_budget_hand_computed():
    b = mixing.EvidenceBudget(share=0.05, models=2)
    # allowance = 0.05 x 3 passes x 2 models x tokens
    assert b.allowance(1000) == pytest.approx(300.0)
    assert b.due("region", 0)  # nothing spent yet
    b.charge("region", 600)  # one search: three evaluations of a 200-token slice
    assert not b.due("region", 1000)  # 600 > 300
    assert not b.due("region", 1999)  # 600 > 599.7
    assert b.due("region", 2000)  # 600 <= 600
    # each kind keeps its own account: the region's searches do not make the personal mix wait
    assert b.due("personal", 1000) and b.spent == {"region": 600.0}
    b.charge("personal", 100)
    assert b.total == 700 and b.due("personal", 1000) and not b.due("personal", 100)
    # with share 0 every search is due, whatever was spent
    free = mixing.EvidenceBudget(share=0.0)
    free.charge("region", 1e9)
    assert free.due("region", 0)
    for bad in (-0.1, math.inf, math.nan):
        with pytest.raises(ValueError, match="share"):
            mixing.EvidenceBudget(share=bad)
    with pytest.raises(ValueError, match="models"):
        mixing.EvidenceBudget(share=0.1, models=0)


def test_evidence_budget_reuses_the_last_search_of_each_kind_until_one_is_due():
    b = mixing.EvidenceBudget(share=0.1)

    def counted_loss(params):
        return float((params[0][0] - 1.0) ** 2)

    loss_of = b.counting(counted_loss, 100, "region")
    assert b.counting(None, 100, "region") is None
    own, target = [torch.tensor([0.0])], [torch.tensor([4.0])]
    assert b.reuse("region", trained_tokens=0) is None  # no search yet: search
    _, first = mixing.mix_toward(own, target, loss_of, grid=GRID)
    b.remember("region", first)
    spent = b.spent["region"]
    assert spent == 100 * len(first.evaluated) == 400  # each evaluation (the own model's included) charged one slice
    # trained little since: not due, the region choice comes back; no choice of another kind yet
    assert b.reuse("region", trained_tokens=10) is first
    assert b.reuse("world", trained_tokens=10) is None
    # a reused choice is not remembered in place of the searched one, nor is a choice without a search
    b.remember("region", mixing.reused_choice(0.9))
    b.remember("region", mixing.MixChoice(lam=1.0, loss=math.nan, own_loss=math.nan, evaluated=()))
    b.remember("region", None)
    assert b.reuse("region", trained_tokens=10) is first
    # once training has paid for what was spent (spent <= 0.1 x 3 x tokens) a search is due again
    enough = math.ceil(spent / 0.3)
    assert b.reuse("region", trained_tokens=enough - 1) is first
    assert b.reuse("region", trained_tokens=enough) is None


def test_evidence_budget_state_round_trips_and_rejects_damage():
    b = mixing.EvidenceBudget(share=0.1, models=2)
    b.charge("region", 300)
    b.charge("personal", 50)
    b.remember("region", mixing.MixChoice(lam=0.25, loss=1.0, own_loss=1.1, evaluated=((0.25, 1.0),)))
    b.remember("personal", mixing.MixChoice(lam=0.5, loss=1.0, own_loss=1.1, evaluated=((0.5, 1.0),),
                                            second_lam=0.125))
    state = b.state_dict()
    assert state == {"spent": {"region": 300.0, "personal": 50.0},
                     "last": {"region": [0.25, None], "personal": [0.5, 0.125]}}
    c = mixing.EvidenceBudget(share=0.1, models=2)
    c.load_state_dict(state)
    assert c.spent == b.spent and c.total == 350.0
    # the same decisions as the original: 300 <= 0.1 x 3 x 2 x tokens from 500 tokens on
    for tokens in (499, 500):
        for kind in ("region", "personal", "world"):
            got, want = c.reuse(kind, tokens), b.reuse(kind, tokens)
            assert (got is None) == (want is None)
            if got is not None:
                assert (got.lam, got.second_lam) == (want.lam, want.second_lam)
    for bad in (None, [], {"spent": {}}, {"spent": {"region": -1}, "last": {}},
                {"spent": {"region": math.nan}, "last": {}}, {"spent": {"region": True}, "last": {}},
                {"spent": {}, "last": {"region": [1.5, None]}}, {"spent": {}, "last": {"region": [0.5]}},
                {"spent": {}, "last": {"region": "0.5"}}):
        with pytest.raises(ValueError, match="evidence budget"):
            c.load_state_dict(bad)
        assert c.spent == b.spent  # unchanged
