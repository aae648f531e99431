"""The local (inner) training loop of one peer: AdamW, linear warmup then constant LR, gradient
clipping, bf16 autocast on CUDA. It knows nothing about peers; the network layer reads and writes
the parameters through :func:`get_flat_params` / :func:`set_params` to average them.

With ``dp=DPSGDConfig(...)`` the trainer runs DP-SGD instead (:mod:`worldlm_p2p.train.dp`: Poisson
batches of aligned windows, per-window clipping, Gaussian noise, an RDP accountant).

The library never calls ``torch.set_num_threads``: the caller (CLI, tests) decides.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Iterable, Sequence
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from worldlm_p2p.config import TrainConfig
from worldlm_p2p.errors import CheckpointError
from worldlm_p2p.train.data import TokenData, check_stream_length, eval_batches, sample_batch
from worldlm_p2p.train.dp import DPSGD, DPSGDConfig
from worldlm_p2p.train.model import autocast_context

logger = logging.getLogger(__name__)

__all__ = ["StepResult", "resolve_steps", "LocalTrainer", "get_flat_params", "set_params", "bits_per_byte", "lr_at"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    """Outcome of one optimizer step. ``loss`` is the batch's mean cross-entropy (nats/token); NaN
    (with ``tokens == 0``) for an empty DP-SGD batch, whose update is noise only.

    A *deferred* step (``train_step(step, defer=True)`` on CUDA) has not read its loss back from the
    device: ``pending`` holds the loss and the gradient norm as device tensors, ``loss`` and
    ``grad_norm`` are NaN and ``skipped`` is unknown (False) until :func:`resolve_steps` reads them,
    many steps in one host-device round trip."""

    loss: float
    tokens: int
    lr: float = 0.0
    grad_norm: float = math.nan  # before clipping; NaN when not computed (always under DP-SGD)
    skipped: bool = False  # True when the loss was not finite and no update was made
    pending: tuple[torch.Tensor, torch.Tensor] | None = None  # (loss, grad norm) on the device, not read yet


def resolve_steps(results: Sequence[StepResult]) -> list[StepResult]:
    """``results`` with every deferred step's loss and gradient norm read back, in one host-device
    round trip for all of them (a step whose loss or norm was not finite was skipped on the device)."""
    pending = [r for r in results if r.pending is not None]
    if not pending:
        return list(results)
    values = iter(torch.stack([t.detach().float().reshape(()) for r in pending for t in r.pending]).tolist())
    out = []
    for r in results:
        if r.pending is None:
            out.append(r)
            continue
        loss, norm = next(values), next(values)
        out.append(dataclasses.replace(r, loss=loss, grad_norm=norm, pending=None,
                                       skipped=not (math.isfinite(loss) and math.isfinite(norm))))
    return out


def lr_at(step: int, train: TrainConfig) -> float:
    """Learning rate of ``step`` (0-based): linear warmup over ``warmup_steps``, then constant."""
    if train.warmup_steps > 0 and step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    return train.lr


def bits_per_byte(nats_per_token: float, *, bytes_per_token: float) -> float:
    """Convert a cross-entropy in nats/token to bits per UTF-8 byte (NaN without validation bytes)."""
    if not bytes_per_token > 0:
        return math.nan
    return nats_per_token / (math.log(2) * bytes_per_token)


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Matrices (linear weights, embeddings) decay; vectors (norm scales, biases) do not."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


class LocalTrainer:
    """Runs optimizer steps of ``model`` on ``data`` (the model is moved to ``device``).

    ``dp``: run DP-SGD (see :mod:`worldlm_p2p.train.dp`); then :attr:`optimizer` is Opacus's
    ``DPOptimizer`` around the AdamW, :attr:`dp` holds the mechanism (sampling rate, calibrated
    noise multiplier, accountant) and :meth:`epsilon` reports the privacy spent. ConfigError when
    the data has fewer than ``train.batch_size`` windows or the target epsilon cannot be reached.
    A model can be wrapped by one DP trainer only.
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        train: TrainConfig,
        data: TokenData,
        device: torch.device,
        seed: int,
        dp: DPSGDConfig | None = None,
    ) -> None:
        check_stream_length(data.train, train.seq_len, what="training data")
        self.model = model.to(device)
        self.model.train()
        self.train_cfg = train
        self.data = data
        self.device = device
        self.seed = int(seed)
        # the fused AdamW: one kernel for all parameters. On CUDA it skips a step on the device when
        # told (``found_inf``), which lets a step with a non-finite loss be skipped without reading the
        # loss back (train_step's ``defer``); on CPU it is what makes the optimizer step cheap for small
        # models (a quarter of the foreach step's time for `tiny`: benchmarks/step_cost.py). Opacus's
        # DPOptimizer wraps the plain one.
        self.optimizer = torch.optim.AdamW(
            _param_groups(self.model, train.weight_decay),
            lr=lr_at(0, train),
            betas=(train.beta1, train.beta2),
            eps=1e-8,
            **({"fused": True} if device.type in ("cuda", "cpu") and dp is None else {}),
        )
        self._warned_no_valid = False
        self.dp: DPSGD | None = None
        if dp is not None:
            self.dp = DPSGD(config=dp, model=self.model, optimizer=self.optimizer, tokens=data.train,
                            batch_size=train.batch_size, seq_len=train.seq_len, seed=self.seed, device=device)
            self.optimizer = self.dp.optimizer  # a DPOptimizer: param_groups/state/state_dict are the AdamW's

    # -- training ------------------------------------------------------------------------------
    def _loss(self, x: torch.Tensor, y: torch.Tensor, *, reduction: str) -> torch.Tensor:
        with autocast_context(self.device):
            logits = self.model(input_ids=x).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1), reduction=reduction)

    def train_step(self, step: int, *, defer: bool = False) -> StepResult:
        """One optimizer step on the batch of ``step`` (a pure function of ``(seed, step)``; under DP-SGD
        the Poisson batch of :meth:`DPSGD.batch`).

        ``defer`` (CUDA, without DP-SGD): no host-device round trip in the step. The batch goes up
        from pinned memory, the loss and gradient norm stay on the device (the result's ``pending``,
        read by :func:`resolve_steps`), and a step whose loss or gradient norm is not finite is
        skipped by the fused optimizer on the device, as the synchronous step skips it on the host.
        Elsewhere it is the synchronous step."""
        if self.dp is not None:
            return self._dp_train_step(step, self.dp)
        cfg = self.train_cfg
        x, y = sample_batch(self.data.train, batch_size=cfg.batch_size, seq_len=cfg.seq_len, step=step, seed=self.seed)
        if defer and self.device.type == "cuda":
            return self._deferred_step(step, x, y)
        x, y, lr = self._begin_step(step, x, y)
        loss = self._loss(x, y, reduction="mean")
        loss_value = float(loss.detach())
        if not math.isfinite(loss_value):
            logger.warning("step %d: loss is %s; skipping the update", step, loss_value)
            self.optimizer.zero_grad(set_to_none=True)
            return StepResult(loss=loss_value, tokens=x.numel(), lr=lr, skipped=True)
        loss.backward()
        grad_norm = math.nan
        if cfg.grad_clip > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip))
        self.optimizer.step()
        return StepResult(loss=loss_value, tokens=x.numel(), lr=lr, grad_norm=grad_norm)

    def _begin_step(self, step: int, x: torch.Tensor, y: torch.Tensor, *, pin: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, float]:
        """The batch on the device (from pinned memory with ``pin``), the step's learning rate set,
        the model in training mode with no gradients."""
        if pin:
            x, y = x.pin_memory(), y.pin_memory()
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        lr = lr_at(step, self.train_cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        return x, y, lr

    def _deferred_step(self, step: int, x: torch.Tensor, y: torch.Tensor) -> StepResult:
        cfg = self.train_cfg
        # (on CUDA a copy from pageable memory would wait for the stream)
        x, y, lr = self._begin_step(step, x, y, pin=self.device.type == "cuda")
        loss = self._loss(x, y, reduction="mean")
        loss.backward()
        params = [p for p in self.model.parameters() if p.grad is not None]
        if cfg.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        found_inf = (~(torch.isfinite(loss) & torch.isfinite(norm))).float()
        self.optimizer.found_inf = found_inf  # the fused AdamW skips the step on the device when it is 1
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf
        return StepResult(loss=math.nan, tokens=x.numel(), lr=lr, pending=(loss.detach(), norm.detach()))

    def _dp_train_step(self, step: int, dp: DPSGD) -> StepResult:
        """One DP-SGD step on the Poisson batch of ``step``; every call is one accountant step."""
        x, y = dp.batch(step)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        lr = lr_at(step, self.train_cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        loss_value = dp.privatize(x, y, step=step, loss_fn=lambda a, b: self._loss(a, b, reduction="mean"))
        # Counted even when the update is skipped below: that can only overstate epsilon. (A skip is a
        # visible, data-dependent event outside the accounting; it takes a diverged model.)
        dp.account()
        if x.size(0) > 0 and not math.isfinite(loss_value):
            logger.warning("step %d: loss is %s; skipping the update", step, loss_value)
            return StepResult(loss=loss_value, tokens=x.numel(), lr=lr, skipped=True)
        dp.optimizer.original_optimizer.step()
        dp.clear()  # per-sample grads are [B', *shape] per parameter: free them now
        return StepResult(loss=loss_value, tokens=x.numel(), lr=lr)

    def epsilon(self) -> float | None:
        """Privacy spent so far under DP-SGD: epsilon at ``dp.delta`` (0.0 before the first step,
        inf with a zero noise multiplier); None when the trainer does not run DP-SGD."""
        return None if self.dp is None else self.dp.epsilon()

    # -- evaluation ----------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean cross-entropy (nats/token) on the validation windows (at most ``train.eval_tokens``
        targets; 0 = all). NaN, with a warning, when there is no validation data."""
        cfg = self.train_cfg
        was_training = self.model.training
        self.model.eval()
        total, count = 0.0, 0
        try:
            for x, y in eval_batches(self.data.valid, seq_len=cfg.seq_len, batch_size=cfg.batch_size,
                                     max_tokens=cfg.eval_tokens):
                x, y = x.to(self.device), y.to(self.device)
                total += float(self._loss(x, y, reduction="sum"))
                count += y.numel()
        finally:
            self.model.train(was_training)
        if count == 0:
            if not self._warned_no_valid:
                logger.warning("no validation tokens: evaluate() returns NaN")
                self._warned_no_valid = True
            return math.nan
        return total / count

    @torch.no_grad()
    def tune_losses(self, params: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """Per-window mean cross-entropy on the tune slice (float64, one value per evaluation window,
        in order; empty without a tune slice), for the significance test of evidence mixing
        (:func:`worldlm_p2p.mixing.significant`). ``params`` as in :meth:`tune_loss`."""
        if params is not None:
            set_params(self.model, params)
        if self.data.tune.numel() < 2:
            return torch.zeros(0, dtype=torch.float64)
        cfg = self.train_cfg
        was_training = self.model.training
        self.model.eval()
        out = []
        try:
            windows = max(cfg.batch_size, min(32, 8192 // cfg.seq_len))
            for x, y in eval_batches(self.data.tune, seq_len=cfg.seq_len, batch_size=windows, max_tokens=0):
                x, y = x.to(self.device), y.to(self.device)
                loss = self._loss(x, y, reduction="none").reshape(y.shape)
                out.append(loss.double().mean(dim=1).cpu())
        finally:
            self.model.train(was_training)
        return torch.cat(out)

    @torch.no_grad()
    def tune_loss(self, params: Sequence[torch.Tensor] | None = None) -> float:
        """Mean cross-entropy (nats/token) on the tune slice (``data.tune``, training text held apart
        for evidence: see :func:`~worldlm_p2p.train.data.hold_out_tune`), of the model as it is or,
        with ``params``, of those parameters (loaded into the model, which keeps them: the caller
        sets the model it settles on). NaN when there is no tune slice. Deterministic: the same
        windows every time."""
        if params is not None:
            set_params(self.model, params)
        if self.data.tune.numel() < 2:
            return math.nan
        cfg = self.train_cfg
        was_training = self.model.training
        self.model.eval()
        total, count = 0.0, 0
        try:
            # batches of at most max(batch_size x seq_len, 8192) tokens: few forward passes for small
            # models, no more memory than a training batch for long sequences
            windows = max(cfg.batch_size, min(32, 8192 // cfg.seq_len))
            for x, y in eval_batches(self.data.tune, seq_len=cfg.seq_len, batch_size=windows, max_tokens=0):
                x, y = x.to(self.device), y.to(self.device)
                total += float(self._loss(x, y, reduction="sum"))
                count += y.numel()
        finally:
            self.model.train(was_training)
        return total / count if count else math.nan

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """A snapshot of the optimizer state as CPU copies (model parameters are saved by the caller).

        ``torch.optim.Optimizer.state_dict`` returns live references that later steps mutate; this
        returns copies, so the snapshot stays valid while training continues. Under DP-SGD it also
        holds the privacy accountant (key ``"dp"``), so a resumed trainer keeps counting."""
        state: dict[str, Any] = {"optimizer": _cpu_copy(self.optimizer.state_dict())}
        if self.dp is not None:
            state["dp"] = self.dp.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (copied: ``state`` is not aliased). A state of
        another model raises CheckpointError."""
        try:
            self.optimizer.load_state_dict(_cpu_copy(state["optimizer"]))
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            reason = " ".join(str(e).split()) or type(e).__name__
            raise CheckpointError(f"optimizer state does not fit this model: {reason}") from None
        if self.dp is not None:
            if state.get("dp") is not None:
                self.dp.load_state_dict(state["dp"])
            else:
                logger.warning("resuming DP-SGD from a state without a privacy accountant: the steps before "
                               "it were not private and are not counted")
        elif state.get("dp") is not None:
            logger.warning("the resumed state was trained with DP-SGD; this trainer continues without it")


class SliceEvaluator:
    """The tune-slice losses of a :class:`LocalTrainer` (the same windows, the same code) on a copy of
    its model, so that another thread can search mixes while the trainer's model trains on: an
    overlapped round's evidence search (:meth:`worldlm_p2p.peer.region_round.RegionRound.start`).
    Costs one more copy of the parameters (no gradients, no optimizer state)."""

    def __init__(self, trainer: LocalTrainer) -> None:
        self.model = copy.deepcopy(trainer.model)
        for p in self.model.parameters():
            p.grad = None
            p.requires_grad_(False)
        self.data, self.train_cfg, self.device = trainer.data, trainer.train_cfg, trainer.device

    _loss = LocalTrainer._loss
    tune_loss = LocalTrainer.tune_loss
    tune_losses = LocalTrainer.tune_losses


def _cpu_copy(obj: Any) -> Any:
    """Recursively copy tensors of a (nested) state dict to fresh CPU tensors."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cpu_copy(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_cpu_copy(v) for v in obj)
    return obj


def get_flat_params(model: torch.nn.Module) -> list[torch.Tensor]:
    """Detached CPU copies of ``model.parameters()`` in order (one tensor per parameter, original
    shapes; tied weights appear once).

    From a CUDA model the copies land in pinned (page-locked) host memory, taken from PyTorch's
    caching host allocator, which reuses the blocks of earlier snapshots: every tensor is copied
    asynchronously and the stream is waited on once, instead of one blocking copy through a
    staging buffer per tensor (the copies a round's snapshot, evidence search and state serving
    make)."""
    params = [p.detach() for p in model.parameters()]
    if params and params[0].is_cuda:
        out = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in params]
        for o, p in zip(out, params):
            o.copy_(p, non_blocking=True)
        torch.cuda.current_stream(params[0].device).synchronize()
        return out
    return [p.to("cpu", copy=True) for p in params]


@torch.no_grad()
def set_params(model: torch.nn.Module, tensors: Sequence[torch.Tensor] | Iterable[torch.Tensor]) -> None:
    """Copy ``tensors`` into ``model.parameters()`` in place (same order and shapes as
    :func:`get_flat_params`); dtype and device are converted. Raises ValueError on a mismatch."""
    params = list(model.parameters())
    tensors = list(tensors)
    if len(tensors) != len(params):
        raise ValueError(f"set_params: got {len(tensors)} tensors for {len(params)} parameters")
    for i, (p, t) in enumerate(zip(params, tensors, strict=True)):
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"set_params: tensor {i} has shape {tuple(t.shape)}, parameter has {tuple(p.shape)}")
    cuda = bool(params) and params[0].is_cuda
    for p, t in zip(params, tensors, strict=True):
        if cuda and t.device.type == "cpu":  # through pinned memory: asynchronous, one wait below
            p.copy_(t if t.is_pinned() else t.pin_memory(), non_blocking=True)
        else:
            p.copy_(t)
    if cuda:  # (the host tensors may change once this returns)
        torch.cuda.current_stream(params[0].device).synchronize()
