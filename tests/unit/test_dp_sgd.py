"""DP-SGD at a peer (worldlm_p2p.train.dp): per-sample gradients, clipping, noise, Poisson sampling,
accounting, learning, resume and config errors."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from worldlm_p2p.config import MODEL_PRESETS, ModelConfig, TrainConfig
from worldlm_p2p.errors import CheckpointError, ConfigError
from worldlm_p2p.train import DPSGDConfig
from worldlm_p2p.train.corpus import demo_data_dir
from worldlm_p2p.train.data import TokenData, load_texts, tokenize_splits
from worldlm_p2p.train.dp import (
    calibrate_noise,
    count_windows,
    dp_sample_rate,
    peer_dp_config,
    poisson_batch,
    poisson_windows,
)
from worldlm_p2p.train.model import build_model
from worldlm_p2p.train.tokenizer import ByteTokenizer
from worldlm_p2p.train.trainer import LocalTrainer, get_flat_params, set_params

CPU = torch.device("cpu")
TINY = MODEL_PRESETS["tiny"]
SMALL = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=64, max_seq_len=64)
TRAIN = TrainConfig(batch_size=4, seq_len=32, lr=3e-3, warmup_steps=0, eval_tokens=1024)
VOCAB = 259


@pytest.fixture(scope="module")
def demo_tokens() -> TokenData:
    return tokenize_splits(load_texts(demo_data_dir() / "na" / "en_email"), ByteTokenizer(), seq_len=32)


def _trainer(data: TokenData, dp: DPSGDConfig | None, *, cfg: ModelConfig = TINY, seed: int = 0,
             model_seed: int = 0, train: TrainConfig = TRAIN) -> LocalTrainer:
    model = build_model(cfg, vocab_size=VOCAB, seed=model_seed)
    return LocalTrainer(model=model, train=train, data=data, device=CPU, seed=seed, dp=dp)


def _windows(tokens: torch.Tensor, starts: list[int], seq_len: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.stack([tokens[k * seq_len : k * seq_len + seq_len + 1] for k in starts])
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def _mean_token_loss(model: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=x).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    return loss_fn


def _q(data: TokenData) -> float:
    return TRAIN.batch_size / ((data.train.numel() - 1) // TRAIN.seq_len)


# ----------------------------------------------------------------------------- gradients


def test_per_sample_gradients_average_to_the_plain_gradient(demo_tokens: TokenData) -> None:
    trainer = _trainer(demo_tokens, DPSGDConfig(noise_multiplier=0.0, max_grad_norm=1e6))
    plain = build_model(TINY, vocab_size=VOCAB, seed=0)
    x, y = _windows(demo_tokens.train, [0, 17, 301])
    trainer.dp.privatize(x, y, step=0, loss_fn=_mean_token_loss(trainer.model))
    _mean_token_loss(plain)(x, y).backward()

    model = trainer.model
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tied weight is one parameter
    assert not hasattr(model.model.norm, "ft_compute_sample_grad")  # RMSNorm: our closed form, not functorch
    named = list(model.named_parameters())
    assert [n for n, _ in named] == [n for n, _ in plain.named_parameters()]
    for (name, p), q in zip(named, plain.parameters(), strict=True):
        assert p.grad_sample.shape == (3, *p.shape), name
        # grad_sample[i] is the gradient of window i's mean token loss: their mean is the batch gradient
        torch.testing.assert_close(p.grad_sample.mean(0), q.grad, rtol=0, atol=1e-5, msg=name)
        # DPOptimizer divides the (unclipped, noiseless) sum by the expected batch size, 4
        torch.testing.assert_close(p.grad * 4 / 3, q.grad, rtol=0, atol=1e-5, msg=name)
    assert plain.model.embed_tokens.weight.grad.abs().sum() > 0


def test_per_window_clipping(demo_tokens: TokenData) -> None:
    clip = 0.05
    trainer = _trainer(demo_tokens, DPSGDConfig(noise_multiplier=0.0, max_grad_norm=clip))
    starts = [3, 40, 41, 900]
    x, y = _windows(demo_tokens.train, starts)
    trainer.dp.privatize(x, y, step=0, loss_fn=_mean_token_loss(trainer.model))
    params = list(trainer.model.parameters())  # model order (the optimizer's groups are ordered otherwise)

    # Independent per-window gradients: one plain backward per window.
    plain = build_model(TINY, vocab_size=VOCAB, seed=0)
    per_window = []
    for k in starts:
        plain.zero_grad(set_to_none=True)
        _mean_token_loss(plain)(*_windows(demo_tokens.train, [k])).backward()
        per_window.append([q.grad.clone() for q in plain.parameters()])
    for i, grads in enumerate(per_window):
        for p, g in zip(params, grads, strict=True):
            torch.testing.assert_close(p.grad_sample[i], g, rtol=0, atol=1e-5)

    norms = [math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads)) for grads in per_window]
    assert min(norms) > clip  # the clip binds for every window
    clipped = [[g * min(1.0, clip / n) for g in grads] for grads, n in zip(per_window, norms, strict=True)]
    for grads in clipped:
        assert math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads)) <= clip * (1 + 1e-6)
    for j, p in enumerate(params):
        by_hand = sum(c[j] for c in clipped)
        torch.testing.assert_close(p.summed_grad, by_hand, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(p.grad, by_hand / 4, rtol=1e-4, atol=1e-7)


def test_noise_of_an_empty_batch(demo_tokens: TokenData) -> None:
    # The quantity tested: the gradient handed to AdamW (p.grad after DPOptimizer's clip/noise/scale)
    # for an empty batch, i.e. N(0, (sigma C)^2) / expected_batch_size in every coordinate.
    sigma, clip = 2.0, 0.5
    trainer = _trainer(demo_tokens, DPSGDConfig(noise_multiplier=sigma, max_grad_norm=clip))
    empty = torch.empty(0, 32, dtype=torch.long)
    rng = torch.get_rng_state()

    def noise(step: int) -> torch.Tensor:
        loss = trainer.dp.privatize(empty, empty, step=step, loss_fn=_mean_token_loss(trainer.model))
        assert math.isnan(loss)
        return torch.cat([p.grad.flatten() for p in trainer.dp.optimizer.params]).double()

    first = noise(7)
    n = first.numel()
    assert n == sum(p.numel() for p in trainer.model.parameters())
    std = sigma * clip / TRAIN.batch_size
    assert abs(float(first.mean())) < 5 * std / math.sqrt(n)
    assert float(first.std()) == pytest.approx(std, rel=0.01)  # 1 / sqrt(2n) ~ 0.001 relative error
    assert torch.equal(noise(7), first)  # a pure function of (seed, step)
    assert not torch.equal(noise(8), first)
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is not used


def test_secure_rng_draws_unpredictable_batches_and_noise(demo_tokens: TokenData) -> None:
    dp = DPSGDConfig(noise_multiplier=1.0, max_grad_norm=1.0, secure_rng=True)
    a, b = _trainer(demo_tokens, dp, cfg=SMALL), _trainer(demo_tokens, dp, cfg=SMALL)
    assert any(not torch.equal(a.dp.batch(s)[0], b.dp.batch(s)[0]) for s in range(5))
    empty = torch.empty(0, 32, dtype=torch.long)
    noises = []
    for t in (a, b):
        t.dp.privatize(empty, empty, step=0, loss_fn=_mean_token_loss(t.model))
        noises.append(torch.cat([p.grad.flatten() for p in t.dp.optimizer.params]).double())
    assert not torch.equal(noises[0], noises[1])
    for noise in noises:  # Opacus's secure_mode noise has the same std
        assert float(noise.std()) == pytest.approx(1.0 / TRAIN.batch_size, rel=0.05)


def test_an_empty_batch_step_is_a_noise_update_that_counts(demo_tokens: TokenData) -> None:
    trainer = _trainer(demo_tokens, DPSGDConfig(noise_multiplier=1.0), cfg=SMALL)
    n = count_windows(demo_tokens.train.numel(), 32)
    step = next(s for s in range(5000)
                if poisson_windows(n_windows=n, sample_rate=_q(demo_tokens), seed=0, step=s).numel() == 0)
    before = get_flat_params(trainer.model)
    result = trainer.train_step(step)
    assert result.tokens == 0 and math.isnan(result.loss) and not result.skipped
    assert not all(torch.equal(a, b) for a, b in zip(before, get_flat_params(trainer.model), strict=True))
    assert trainer.dp.steps == 1 and trainer.epsilon() > 0


# ----------------------------------------------------------------------------- sampling


def test_poisson_sampling_rate_determinism_and_alignment() -> None:
    n_windows, q, steps = 50, 0.1, 2000
    rng = torch.get_rng_state()
    counts = torch.zeros(n_windows)
    sizes = set()
    for step in range(steps):
        idx = poisson_windows(n_windows=n_windows, sample_rate=q, seed=3, step=step)
        assert torch.equal(idx, idx.sort().values) and idx.unique().numel() == idx.numel()
        counts[idx] += 1
        sizes.add(idx.numel())
    assert torch.equal(torch.get_rng_state(), rng)
    assert float(counts.sum()) / (steps * n_windows) == pytest.approx(q, abs=0.004)  # ~4 standard errors
    assert float((counts / steps - q).abs().max()) < 0.035  # every window, ~5 standard errors
    assert len(sizes) > 5  # the batch size varies
    a = poisson_windows(n_windows=n_windows, sample_rate=q, seed=3, step=11)
    assert torch.equal(a, poisson_windows(n_windows=n_windows, sample_rate=q, seed=3, step=11))
    assert not torch.equal(a, poisson_windows(n_windows=n_windows, sample_rate=q, seed=4, step=11))

    tokens = torch.arange(1000)
    assert count_windows(1000, 32) == 31 and dp_sample_rate(1000, batch_size=4, seq_len=32) == 4 / 31
    seen = 0
    for step in range(20):
        x, y = poisson_batch(tokens, batch_size=4, seq_len=32, step=step, seed=0)
        assert x.shape == y.shape and x.shape[1] == 32
        for row_x, row_y in zip(x, y, strict=True):
            start = int(row_x[0])
            assert start % 32 == 0 and start + 32 <= 999
            assert torch.equal(row_x, torch.arange(start, start + 32)) and torch.equal(row_y, row_x + 1)
        seen += x.shape[0]
    assert 40 <= seen <= 120  # expected 80


# ----------------------------------------------------------------------------- accounting


def test_epsilon_matches_an_independent_accountant(demo_tokens: TokenData) -> None:
    from opacus.accountants import RDPAccountant

    assert _trainer(demo_tokens, None, cfg=SMALL).epsilon() is None
    trainer = _trainer(demo_tokens, DPSGDConfig(noise_multiplier=1.1, delta=1e-5), cfg=SMALL)
    assert trainer.epsilon() == 0.0
    assert trainer.dp.sample_rate == _q(demo_tokens)
    for step in range(3):
        trainer.train_step(step)
    ref = RDPAccountant()
    ref.history = [(1.1, _q(demo_tokens), 3)]
    assert trainer.epsilon() == pytest.approx(ref.get_epsilon(delta=1e-5), rel=1e-12)
    assert trainer.epsilon() == pytest.approx(trainer.dp.projected_epsilon(3), rel=1e-12)


def test_target_epsilon_calibration(demo_tokens: TokenData) -> None:
    from opacus.accountants import RDPAccountant

    steps = 2000
    trainer = _trainer(demo_tokens, DPSGDConfig(target_epsilon=8.0, steps=steps), cfg=SMALL)
    sigma = trainer.dp.noise_multiplier
    ref = RDPAccountant()
    ref.history = [(sigma, _q(demo_tokens), steps)]
    assert 8.0 * 0.9 < ref.get_epsilon(delta=1e-5) <= 8.0
    with pytest.raises(ConfigError, match="cannot be reached"):
        calibrate_noise(DPSGDConfig(target_epsilon=0.01, steps=10), sample_rate=0.01)


# ----------------------------------------------------------------------------- training


def test_dp_trainer_learns(demo_tokens: TokenData) -> None:
    trainer = _trainer(demo_tokens, DPSGDConfig(noise_multiplier=0.5, max_grad_norm=1.0))
    before = trainer.evaluate()
    losses = [trainer.train_step(step).loss for step in range(30)]
    finite = [v for v in losses if math.isfinite(v)]
    assert sum(finite[-5:]) / 5 < finite[0] - 0.3
    assert trainer.evaluate() < before - 0.3


def test_params_evaluation_and_a_skipped_step_under_dp(demo_tokens: TokenData) -> None:
    trainer = _trainer(demo_tokens, DPSGDConfig(noise_multiplier=1.0), cfg=SMALL)
    plain = _trainer(demo_tokens, None, cfg=SMALL)
    assert trainer.evaluate() == plain.evaluate()
    trainer.train_step(0)
    assert all(p.grad is None and p.grad_sample is None and p.summed_grad is None
               for p in trainer.model.parameters())  # nothing kept between steps
    params = get_flat_params(trainer.model)
    assert [t.shape for t in params] == [t.shape for t in get_flat_params(plain.model)]
    set_params(plain.model, params)
    assert trainer.evaluate() == plain.evaluate()  # eval captures no per-sample state
    assert trainer.model.training

    with torch.no_grad():
        trainer.model.model.norm.weight.fill_(float("nan"))
    result = trainer.train_step(1)
    assert result.skipped and math.isnan(result.loss)
    assert trainer.dp.steps == 2  # a skipped step still counts
    set_params(trainer.model, params)  # recover: the next step works (hook state was reset)
    assert math.isfinite(trainer.train_step(2).loss)
    assert all(p.grad_sample is None for p in trainer.model.parameters())


def test_resume_keeps_epsilon_and_replays_the_run(demo_tokens: TokenData) -> None:
    dp = DPSGDConfig(noise_multiplier=0.8)
    a = _trainer(demo_tokens, dp, cfg=SMALL)
    for step in range(3):
        a.train_step(step)
    state = a.state_dict()
    assert set(state) == {"optimizer", "dp"} and state["dp"]["history"] == [[0.8, _q(demo_tokens), 3]]
    model_state = {k: v.clone() for k, v in a.model.state_dict().items()}
    b = _trainer(demo_tokens, dp, cfg=SMALL, model_seed=99)
    b.model.load_state_dict(model_state)
    b.load_state_dict(state)
    assert b.epsilon() == a.epsilon() > 0
    for step in (3, 4):
        la, lb = a.train_step(step).loss, b.train_step(step).loss
        assert la == lb or (math.isnan(la) and math.isnan(lb))  # NaN: an empty batch
    assert all(torch.equal(x, y) for x, y in zip(get_flat_params(a.model), get_flat_params(b.model), strict=True))
    assert b.epsilon() == a.epsilon()

    plain = _trainer(demo_tokens, None, cfg=SMALL)
    assert set(plain.state_dict()) == {"optimizer"}
    plain.load_state_dict(state)  # a DP state loads into a plain trainer (accountant ignored)
    bad = dict(state, dp=dict(state["dp"], mechanism="prv"))
    with pytest.raises(CheckpointError, match="mechanism"):
        b.load_state_dict(bad)


# ----------------------------------------------------------------------------- config errors


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of a noise multiplier and a target epsilon, got neither"),
        ({"noise_multiplier": 1.0, "target_epsilon": 8.0, "steps": 10}, "got both"),
        ({"noise_multiplier": -1.0}, "noise multiplier must be a finite number >= 0"),
        ({"noise_multiplier": math.inf}, "noise multiplier must be a finite number >= 0"),
        ({"target_epsilon": 8.0}, "needs the number of steps: give --max-steps or a noise multiplier"),
        ({"target_epsilon": 0.0, "steps": 10}, "target epsilon must be a finite number > 0"),
        ({"noise_multiplier": 1.0, "delta": 0.0}, "delta must be in"),
        ({"noise_multiplier": 1.0, "delta": 1.0}, "delta must be in"),
        ({"noise_multiplier": 1.0, "max_grad_norm": 0.0}, "max grad norm"),
        ({"noise_multiplier": 1.0, "steps": 0}, "steps must be a positive integer"),
        ({"noise_multiplier": 1.0, "secure_rng": 1}, "secure_rng"),
    ],
)
def test_bad_configs(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DPSGDConfig(**kwargs)  # type: ignore[arg-type]


def test_too_few_windows_for_the_batch() -> None:
    data = TokenData(train=torch.arange(100) % VOCAB, valid=torch.arange(50) % VOCAB, train_bytes=100, valid_bytes=50)
    with pytest.raises(ConfigError, match="at least train.batch_size = 4 training windows"):
        _trainer(data, DPSGDConfig(noise_multiplier=1.0), cfg=SMALL)  # 99 // 32 = 3 windows
    train = dataclasses.replace(TRAIN, batch_size=3)
    assert _trainer(data, DPSGDConfig(noise_multiplier=1.0), cfg=SMALL, train=train).dp.sample_rate == 1.0


def test_peer_dp_config_from_settings_where_zero_is_off() -> None:
    assert peer_dp_config(epsilon=0.0, noise=0.0, clip=1.0, delta=1e-5, steps=None) is None
    by_noise = peer_dp_config(epsilon=0.0, noise=1.2, clip=0.5, delta=1e-6, steps=None)
    assert by_noise == DPSGDConfig(noise_multiplier=1.2, max_grad_norm=0.5, delta=1e-6)
    by_epsilon = peer_dp_config(epsilon=8.0, noise=0.0, clip=1.0, delta=1e-5, steps=100)
    assert by_epsilon == DPSGDConfig(target_epsilon=8.0, steps=100)
    with pytest.raises(ConfigError, match="give --max-steps or a noise multiplier"):
        peer_dp_config(epsilon=8.0, noise=0.0, clip=1.0, delta=1e-5, steps=None)
