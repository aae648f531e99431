"""The local trainer: learning on demo data, determinism, evaluation, resume, parameter access."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from worldlm_p2p.config import MODEL_PRESETS, ModelConfig, TrainConfig
from worldlm_p2p.errors import CheckpointError, DataError
from worldlm_p2p.train.corpus import demo_data_dir
from worldlm_p2p.train.data import TextSplits, TokenData, load_texts, tokenize_splits
from worldlm_p2p.train.model import build_model
from worldlm_p2p.train.tokenizer import ByteTokenizer
from worldlm_p2p.train.trainer import LocalTrainer, bits_per_byte, get_flat_params, lr_at, set_params

CPU = torch.device("cpu")
TRAIN = TrainConfig(batch_size=8, seq_len=64, lr=3e-3, warmup_steps=5, eval_tokens=2048)
SMALL = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=64, max_seq_len=64)


@pytest.fixture(scope="module")
def demo_tokens() -> TokenData:
    return tokenize_splits(load_texts(demo_data_dir() / "na" / "en_email"), ByteTokenizer(), seq_len=64)


def _trainer(data: TokenData, *, cfg: ModelConfig = SMALL, seed: int = 0, model_seed: int = 0,
             train: TrainConfig = TRAIN) -> LocalTrainer:
    model = build_model(cfg, vocab_size=259, seed=model_seed)
    return LocalTrainer(model=model, train=train, data=data, device=CPU, seed=seed)


def test_tiny_model_learns_demo_data(demo_tokens: TokenData) -> None:
    trainer = _trainer(demo_tokens, cfg=MODEL_PRESETS["tiny"])
    before = trainer.evaluate()
    assert abs(before - math.log(259)) < 0.3  # near-uniform at init: ln 259 = 5.557
    losses = [trainer.train_step(step).loss for step in range(30)]
    after = trainer.evaluate()
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0
    assert after < before - 1.0
    # bits per byte of the byte model: tokens == bytes, so it is just nats / ln 2
    assert bits_per_byte(after, bytes_per_token=demo_tokens.valid_bytes_per_token) == pytest.approx(after / math.log(2))


def test_same_seed_same_params(demo_tokens: TokenData) -> None:
    a, b = _trainer(demo_tokens), _trainer(demo_tokens)
    c = _trainer(demo_tokens, seed=1)  # same init, different batches
    for step in range(3):
        ra, rb = a.train_step(step), b.train_step(step)
        c.train_step(step)
        assert ra.loss == rb.loss
        assert ra.tokens == 8 * 64
    pa, pb, pc = get_flat_params(a.model), get_flat_params(b.model), get_flat_params(c.model)
    assert all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))
    assert not all(torch.equal(x, z) for x, z in zip(pa, pc, strict=True))


def test_evaluate_is_deterministic_and_restores_mode(demo_tokens: TokenData) -> None:
    trainer = _trainer(demo_tokens)
    trainer.train_step(0)
    first = trainer.evaluate()
    assert trainer.model.training
    assert trainer.evaluate() == first
    trainer.model.eval()
    assert trainer.evaluate() == first
    assert not trainer.model.training


def test_evaluate_of_a_zero_model_is_ln_vocab(demo_tokens: TokenData) -> None:
    # all-zero weights => zero logits => uniform prediction => cross-entropy exactly ln 259
    trainer = _trainer(demo_tokens)
    set_params(trainer.model, [torch.zeros_like(p) for p in trainer.model.parameters()])
    assert trainer.evaluate() == pytest.approx(math.log(259), abs=1e-5)


def test_evaluate_matches_a_direct_computation() -> None:
    valid = torch.tensor([5, 7, 9, 11, 13, 257] * 20)  # 120 tokens -> 7 windows of 16
    data = TokenData(train=torch.arange(100) % 259, valid=valid, train_bytes=100, valid_bytes=120)
    train = dataclasses.replace(TRAIN, seq_len=16, batch_size=3, eval_tokens=0)
    trainer = _trainer(data, train=train)
    model = trainer.model
    with torch.no_grad():
        nll = []
        for i in range(7):
            window = valid[i * 16 : i * 16 + 17]
            logp = torch.log_softmax(model(input_ids=window[None, :-1]).logits[0].double(), dim=-1)
            nll.extend((-logp[torch.arange(16), window[1:]]).tolist())
    assert trainer.evaluate() == pytest.approx(sum(nll) / len(nll), rel=1e-5)


def test_no_validation_data_gives_nan() -> None:
    empty = torch.empty(0, dtype=torch.long)
    data = TokenData(train=torch.arange(200) % 259, valid=empty, train_bytes=200, valid_bytes=0)
    assert math.isnan(_trainer(data).evaluate())


def test_too_little_training_data() -> None:
    splits = TextSplits(train=["abc"], valid=[], source="test")
    data = tokenize_splits(splits, ByteTokenizer())
    with pytest.raises(DataError, match="fewer than train.seq_len"):
        _trainer(data)


def test_lr_schedule_and_param_groups(demo_tokens: TokenData) -> None:
    assert [lr_at(s, TRAIN) for s in (0, 1, 4, 5, 100)] == pytest.approx([6e-4, 1.2e-3, 3e-3, 3e-3, 3e-3])
    assert lr_at(0, dataclasses.replace(TRAIN, warmup_steps=0)) == 3e-3
    trainer = _trainer(demo_tokens)
    assert trainer.train_step(1).lr == pytest.approx(1.2e-3)
    decay, no_decay = trainer.optimizer.param_groups
    assert decay["weight_decay"] == TRAIN.weight_decay and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"])
    assert len(no_decay["params"]) == 2 * SMALL.num_layers + 1  # two RMSNorms per layer + final norm
    assert trainer.optimizer.defaults["betas"] == (TRAIN.beta1, TRAIN.beta2)


def test_grad_clip_zero_disables_clipping(demo_tokens: TokenData) -> None:
    def step(grad_clip: float) -> tuple[float, list[torch.Tensor]]:
        t = _trainer(demo_tokens, train=dataclasses.replace(TRAIN, grad_clip=grad_clip))
        return t.train_step(0).grad_norm, [p.detach().clone() for p in t.model.parameters()]

    norm, off = step(0.0)
    assert math.isnan(norm)  # no norm is computed when nothing is clipped
    # the same step as with a bound no gradient reaches (clip_grad_norm_ then scales by exactly 1) ...
    big_norm, never = step(1e30)
    assert math.isfinite(big_norm) and big_norm > 0
    assert all(torch.equal(a, b) for a, b in zip(off, never))
    # ... and not the step of a bound that binds (the gradient's norm is far above 1e-3)
    _, tight = step(1e-3)
    assert max((a - b).abs().max().item() for a, b in zip(off, tight)) > 1e-6


def test_resume_from_state_matches_uninterrupted(demo_tokens: TokenData) -> None:
    a = _trainer(demo_tokens)
    for step in range(3):
        a.train_step(step)
    model_state = {k: v.clone() for k, v in a.model.state_dict().items()}
    opt_state = a.state_dict()
    b = _trainer(demo_tokens, model_seed=99)  # different init, overwritten below
    b.model.load_state_dict(model_state)
    b.load_state_dict(opt_state)
    for step in (3, 4):
        assert a.train_step(step).loss == b.train_step(step).loss
    assert all(torch.equal(x, y) for x, y in zip(get_flat_params(a.model), get_flat_params(b.model), strict=True))


def test_load_state_dict_of_another_model(demo_tokens: TokenData) -> None:
    other = _trainer(demo_tokens, cfg=dataclasses.replace(SMALL, num_layers=1))
    other.train_step(0)
    with pytest.raises(CheckpointError, match="optimizer state does not fit"):
        _trainer(demo_tokens).load_state_dict(other.state_dict())


def test_get_and_set_params() -> None:
    model = build_model(SMALL, vocab_size=259, seed=0)
    params = list(model.parameters())
    flat = get_flat_params(model)
    assert len(flat) == len(params)  # tied embedding appears once
    assert [t.shape for t in flat] == [p.shape for p in params]
    with torch.no_grad():
        params[0].add_(1.0)
    assert not torch.equal(flat[0], params[0])  # a snapshot, not a view
    set_params(model, flat)
    assert torch.equal(params[0], flat[0])
    assert model.lm_head.weight is model.model.embed_tokens.weight
    set_params(model, [torch.full_like(t, 0.5, dtype=torch.float64) for t in flat])
    assert all(bool((p == 0.5).all()) and p.dtype == torch.float32 for p in model.parameters())
    with pytest.raises(ValueError, match="tensors for"):
        set_params(model, flat[:-1])
    with pytest.raises(ValueError, match="shape"):
        set_params(model, [torch.zeros(1)] + flat[1:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs CUDA (runs on a GPU machine)")
def test_a_cuda_models_params_travel_through_pinned_host_memory() -> None:
    model = build_model(SMALL, vocab_size=259, seed=0).to("cuda")
    flat = get_flat_params(model)
    assert all(t.device.type == "cpu" and t.is_pinned() for t in flat)
    assert all(torch.equal(t, p.detach().cpu()) for t, p in zip(flat, model.parameters(), strict=True))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert not torch.equal(flat[0], next(model.parameters()).detach().cpu())  # a snapshot, not a view
    set_params(model, flat)  # from pinned memory
    assert all(torch.equal(t, p.detach().cpu()) for t, p in zip(flat, model.parameters(), strict=True))
    pageable = [torch.full_like(t, 0.25, pin_memory=False) for t in flat]
    assert not pageable[0].is_pinned()
    set_params(model, pageable)  # staged through pinned memory, asynchronously, then waited for
    for t in pageable:  # what the caller does with its tensors afterwards does not reach the model
        t.fill_(9.0)
    assert all(bool((p == 0.25).all()) for p in model.parameters())


def test_non_finite_loss_skips_the_update(demo_tokens: TokenData) -> None:
    trainer = _trainer(demo_tokens)
    with torch.no_grad():
        trainer.model.model.norm.weight.fill_(float("nan"))
    before = get_flat_params(trainer.model)
    result = trainer.train_step(0)
    assert result.skipped and math.isnan(result.loss)
    after = get_flat_params(trainer.model)
    torch.testing.assert_close(after, before, rtol=0, atol=0, equal_nan=True)  # bit-identical
    assert not trainer.optimizer.state  # AdamW never stepped


def test_bits_per_byte() -> None:
    assert bits_per_byte(math.log(2), bytes_per_token=1.0) == pytest.approx(1.0)
    assert bits_per_byte(math.log(2) * 3, bytes_per_token=1.5) == pytest.approx(2.0)


def test_tune_losses_are_the_per_window_losses_of_the_tune_slice() -> None:
    tune = torch.tensor([5, 7, 9, 11, 13, 257] * 20)  # 120 tokens -> 7 windows of 16
    data = TokenData(train=torch.arange(100) % 259, valid=tune[:40], train_bytes=100, valid_bytes=40, tune=tune)
    train = dataclasses.replace(TRAIN, seq_len=16, batch_size=3, eval_tokens=0)
    trainer = _trainer(data, train=train)
    with torch.no_grad():
        want = []
        for i in range(7):
            window = tune[i * 16 : i * 16 + 17]
            logp = torch.log_softmax(trainer.model(input_ids=window[None, :-1]).logits[0].double(), dim=-1)
            want.append(float((-logp[torch.arange(16), window[1:]]).mean()))
    got = trainer.tune_losses()
    assert got.dtype == torch.float64 and got.shape == (7,)
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=1e-5)
    assert float(got.mean()) == pytest.approx(trainer.tune_loss(), rel=1e-6)  # equal windows: the same mean
    empty = TokenData(train=torch.arange(100) % 259, valid=tune[:40], train_bytes=100, valid_bytes=40)
    assert _trainer(empty, train=train).tune_losses().numel() == 0


def test_the_slice_evaluator_gives_the_trainers_tune_losses_without_touching_its_model():
    """An overlapped round's evidence search runs on a copy of the model (train.SliceEvaluator) while
    the trainer's model trains on: the same losses, bit for bit, and the trainer's model untouched."""
    import torch

    from worldlm_p2p.config import TrainConfig, model_preset
    from worldlm_p2p.train import (ByteTokenizer, LocalTrainer, SliceEvaluator, build_model, get_flat_params,
                                   hold_out_tune, tokenize_splits)
    from worldlm_p2p.train.data import TextSplits

    tok = ByteTokenizer()
    text = ["the quick brown fox jumps over the lazy dog " * 20] * 30
    data = hold_out_tune(tokenize_splits(TextSplits(train=text, valid=text[:3], source="test"), tok), fraction=0.2, max_tokens=512,
                         seq_len=32, eos_id=tok.eos_id)
    train = TrainConfig(batch_size=2, seq_len=32, inner_steps=2)
    trainer = LocalTrainer(model=build_model(model_preset("tiny"), vocab_size=tok.vocab_size, seed=0), train=train,
                           data=data, device=torch.device("cpu"), seed=0)
    trainer.train_step(0)
    evaluator = SliceEvaluator(trainer)
    own = get_flat_params(trainer.model)
    other = [t + 0.01 for t in own]
    got = evaluator.tune_loss(other)
    assert all(torch.equal(a, b) for a, b in zip(get_flat_params(trainer.model), own))  # untouched
    assert got == trainer.tune_loss(other)
    assert torch.equal(evaluator.tune_losses(own), trainer.tune_losses(own))
    assert evaluator.tune_loss(own) != got


def test_the_fused_adamw_step_is_torchs_reference_adamw_step(demo_tokens: TokenData) -> None:
    """The trainer builds the fused AdamW on CPU (it is cheaper for small models:
    benchmarks/step_cost.py): the same update as the foreach AdamW it replaced, the decayed and
    the undecayed groups alike, up to rounding."""
    trainer = _trainer(demo_tokens)
    assert trainer.optimizer.defaults["fused"] is True
    reference = _trainer(demo_tokens)
    groups = [dict(params=list(g["params"]), weight_decay=g["weight_decay"]) for g in reference.optimizer.param_groups]
    assert {g["weight_decay"] for g in groups} == {0.0, TRAIN.weight_decay} and TRAIN.weight_decay > 0
    d = reference.optimizer.defaults
    reference.optimizer = torch.optim.AdamW(groups, lr=d["lr"], betas=d["betas"], eps=d["eps"], foreach=True)
    start = get_flat_params(trainer.model)
    for step in range(3):
        assert trainer.train_step(step).loss == pytest.approx(reference.train_step(step).loss, rel=1e-5)
    got, want = get_flat_params(trainer.model), get_flat_params(reference.model)
    assert max(float((g - s).abs().max()) for g, s in zip(got, start)) > 1e-4  # the steps moved the model
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


# -- the deferred step (CUDA's: no host-device round trip per step) ----------------------------------
# Its mechanism runs on any device with the fused AdamW (the trainer builds that one on CUDA and on
# CPU; the helper below makes sure of it); here on CPU, against the synchronous step.


def _fused(trainer: LocalTrainer) -> LocalTrainer:
    groups = [dict(params=list(g["params"]), weight_decay=g["weight_decay"]) for g in trainer.optimizer.param_groups]
    d = trainer.optimizer.defaults
    trainer.optimizer = torch.optim.AdamW(groups, lr=d["lr"], betas=d["betas"], eps=d["eps"], fused=True)
    return trainer


def _deferred(trainer: LocalTrainer, step: int):
    from worldlm_p2p.train.data import sample_batch

    cfg = trainer.train_cfg
    x, y = sample_batch(trainer.data.train, batch_size=cfg.batch_size, seq_len=cfg.seq_len, step=step,
                        seed=trainer.seed)
    return trainer._deferred_step(step, x, y)


def test_deferred_steps_equal_synchronous_steps(demo_tokens: TokenData) -> None:
    from worldlm_p2p.train.trainer import resolve_steps

    sync, deferred = _fused(_trainer(demo_tokens)), _fused(_trainer(demo_tokens))
    want = [sync.train_step(step) for step in range(4)]
    got = [_deferred(deferred, step) for step in range(4)]
    assert all(r.pending is not None and math.isnan(r.loss) for r in got)  # nothing read back yet
    got = resolve_steps(got)
    assert [r.loss for r in got] == pytest.approx([r.loss for r in want], abs=1e-6)
    assert [r.grad_norm for r in got] == pytest.approx([r.grad_norm for r in want], rel=1e-5)
    assert not any(r.skipped or r.pending is not None for r in got)
    for a, b in zip(get_flat_params(sync.model), get_flat_params(deferred.model), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_a_deferred_step_with_a_non_finite_loss_is_skipped_on_the_device(demo_tokens: TokenData) -> None:
    from worldlm_p2p.train.trainer import resolve_steps

    trainer = _fused(_trainer(demo_tokens))
    _deferred(trainer, 0)
    params = [t.clone() for t in get_flat_params(trainer.model)]
    state = {k: v.clone() for s in trainer.optimizer.state.values() for k, v in s.items() if k == "step"}
    moments = [s["exp_avg"].clone() for s in trainer.optimizer.state.values()]
    loss = trainer._loss
    trainer._loss = lambda x, y, reduction: loss(x, y, reduction=reduction) * float("nan")
    bad = _deferred(trainer, 1)
    trainer._loss = loss
    assert all(torch.equal(a, b) for a, b in zip(params, get_flat_params(trainer.model), strict=True))
    assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(moments, trainer.optimizer.state.values(), strict=True))
    assert all(float(s["step"]) == float(state["step"]) for s in trainer.optimizer.state.values())
    good = _deferred(trainer, 2)  # the next step trains again
    (bad, good) = resolve_steps([bad, good])
    assert bad.skipped and math.isnan(bad.loss) and not good.skipped and math.isfinite(good.loss)
    assert not all(torch.equal(a, b) for a, b in zip(params, get_flat_params(trainer.model), strict=True))


def test_resolve_steps_reads_pending_values_in_order_and_keeps_the_others() -> None:
    from worldlm_p2p.train.trainer import StepResult, resolve_steps

    plain = StepResult(loss=2.5, tokens=4, grad_norm=1.0)
    a = StepResult(loss=math.nan, tokens=4, pending=(torch.tensor(3.0), torch.tensor(0.5)))
    b = StepResult(loss=math.nan, tokens=4, pending=(torch.tensor(1.5), torch.tensor(float("inf"))))
    out = resolve_steps([a, plain, b])
    assert [(r.loss, r.grad_norm, r.skipped) for r in out] == [(3.0, 0.5, False), (2.5, 1.0, False),
                                                               (1.5, math.inf, True)]
    assert out[1] is plain and resolve_steps([plain]) == [plain]


def test_deferred_steps_without_clipping_equal_synchronous_steps_and_report_the_norm(demo_tokens: TokenData) -> None:
    from worldlm_p2p.train.trainer import resolve_steps

    train = dataclasses.replace(TRAIN, grad_clip=0.0)
    sync, deferred = _fused(_trainer(demo_tokens, train=train)), _fused(_trainer(demo_tokens, train=train))
    want = [sync.train_step(step) for step in range(3)]
    got = resolve_steps([_deferred(deferred, step) for step in range(3)])
    assert [r.loss for r in got] == pytest.approx([r.loss for r in want], abs=1e-6)
    assert all(math.isfinite(r.grad_norm) and r.grad_norm > 0 for r in got)
    for a, b in zip(get_flat_params(sync.model), get_flat_params(deferred.model), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
