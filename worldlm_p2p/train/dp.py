"""Sample-level differential privacy at a peer: DP-SGD (Abadi et al. 2016) with Opacus.

:class:`DPSGDConfig` says how much noise to add (a noise multiplier, or a target epsilon that the
noise is calibrated to); :class:`DPSGD` does the work for one :class:`~worldlm_p2p.train.LocalTrainer`
built with ``dp=DPSGDConfig(...)``.

**Privacy unit.** One training window of ``seq_len + 1`` tokens. The training stream of ``n`` tokens
is cut into ``N = (n - 1) // seq_len`` aligned, non-overlapping windows (window ``k`` is tokens
``k*seq_len .. k*seq_len + seq_len``, the layout of :func:`~worldlm_p2p.train.data.eval_batches`).
The guarantee is for adding or removing one window (Opacus's add/remove adjacency); a document
spanning several windows, or text repeated across windows, is protected only by group privacy.

**One step** (the sampled Gaussian mechanism, accounted with Opacus's ``RDPAccountant``):

1. Poisson sampling: every window is in the batch independently with probability
   ``q = batch_size / N`` (so the expected batch is ``batch_size``; the actual size ``B'`` varies).
2. Per-sample gradients (``opacus.GradSampleModule``). The loss is, as without DP, the mean
   cross-entropy over the ``B' * seq_len`` target tokens; Opacus's ``loss_reduction="mean"``
   multiplies each module's backprops by ``B'``, so the per-sample gradient of window ``i`` is
   ``g_i = grad (1/seq_len) sum_t ce(i, t)``: the gradient of that window's mean token loss. That is
   the unit that is clipped. The tied embedding / LM head weight gets the sum of both uses.
3. ``opacus.optimizers.DPOptimizer`` around the trainer's AdamW computes
   ``(sum_i g_i * min(1, C / (||g_i|| + 1e-6)) + N(0, (sigma C)^2 I)) / batch_size``
   (``C = max_grad_norm``; divided by the *expected* batch size, as Poisson sampling requires) and
   AdamW steps on it. Weight decay, momentum and the learning-rate schedule are post-processing.
   The trainer's ``train.grad_clip`` is not applied: per-sample clipping replaces it.
4. The accountant records one step of ``(sigma, q)``; :meth:`DPSGD.epsilon` converts the Renyi-DP
   to ``(epsilon, delta)``.

An empty Poisson batch still makes a noise-only update (exactly what the mechanism releases for
an empty batch); see :meth:`DPSGD.privatize`.

**Randomness.** Sampling and noise come from CPU / device ``torch.Generator`` objects reseeded per
step from ``(seed, step)`` by hashing, so a run is reproducible and a resumed run replays the
same batches and noise, and the global RNG is never touched. This is for experiments: anyone who
knows the seed (the peer's data seed derives from the run seed in the manifest) can recompute the
noise and the batches and remove the protection. In a real deployment set ``secure_rng=True``: the
seed is then drawn from the OS (``secrets``) and never stored, and Opacus's ``secure_mode`` noise
(robust to floating-point attacks) is used. Torch's generator is not a cryptographic RNG either.

**Not covered.** The reported training loss (``StepResult.loss``) and validation loss are computed
from private data without noise; whoever publishes them (the monitor, the history) releases
information outside this guarantee.

``opacus`` is imported on first use (it is slow to import).
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from worldlm_p2p.errors import CheckpointError, ConfigError
from worldlm_p2p.train.dp_sampling import _derived_seed, count_windows, dp_sample_rate, poisson_batch, poisson_windows

if TYPE_CHECKING:
    from opacus.optimizers import DPOptimizer

logger = logging.getLogger(__name__)

__all__ = [
    "DPSGDConfig",
    "DPSGD",
    "peer_dp_config",
    "count_windows",
    "dp_sample_rate",
    "poisson_windows",
    "poisson_batch",
    "calibrate_noise",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class DPSGDConfig:
    """DP-SGD at one peer (see the module docstring). Give exactly one of ``noise_multiplier`` and
    ``target_epsilon``.

    - ``noise_multiplier``: sigma, the noise std in units of ``max_grad_norm`` (0 = no noise and no
      privacy, epsilon infinite: for tests).
    - ``target_epsilon``: calibrate sigma so that ``steps`` steps spend at most this epsilon at
      ``delta`` (Opacus ``get_noise_multiplier``, RDP accountant); needs ``steps``.
    - ``delta``: the delta of the reported ``(epsilon, delta)``; should be well below ``1 / N``.
    - ``max_grad_norm``: C, the L2 norm each window's gradient is clipped to.
    - ``steps``: the number of training steps the peer will run in total (for calibration).
    - ``secure_rng``: draw sampling and noise from a secret OS-random seed instead of the trainer
      seed (not reproducible; required for the guarantee to hold against whoever knows the seed).
    """

    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    delta: float = 1e-5
    max_grad_norm: float = 1.0
    steps: int | None = None
    secure_rng: bool = False

    def __post_init__(self) -> None:
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            got = "both" if self.noise_multiplier is not None else "neither"
            raise ConfigError(f"peer DP needs exactly one of a noise multiplier and a target epsilon, got {got}")
        if self.noise_multiplier is not None and not (
            _is_number(self.noise_multiplier) and math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0
        ):
            raise ConfigError(f"peer DP noise multiplier must be a finite number >= 0, got {self.noise_multiplier!r}")
        if self.target_epsilon is not None:
            if not (_is_number(self.target_epsilon) and math.isfinite(self.target_epsilon)
                    and self.target_epsilon > 0):
                raise ConfigError(f"peer DP target epsilon must be a finite number > 0, got {self.target_epsilon!r}")
            if self.steps is None:
                raise ConfigError(
                    "peer DP with a target epsilon needs the number of steps: give --max-steps or a noise multiplier"
                )
        if not (_is_number(self.delta) and 0 < self.delta < 1):
            raise ConfigError(f"peer DP delta must be in (0, 1), got {self.delta!r}")
        if not (_is_number(self.max_grad_norm) and math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise ConfigError(
                f"peer DP max grad norm (per-window clipping) must be a finite number > 0, got {self.max_grad_norm!r}"
            )
        if self.steps is not None and not (isinstance(self.steps, int) and not isinstance(self.steps, bool)
                                           and self.steps > 0):
            raise ConfigError(f"peer DP steps must be a positive integer, got {self.steps!r}")
        if not isinstance(self.secure_rng, bool):
            raise ConfigError(f"peer DP secure_rng must be true or false, got {self.secure_rng!r}")


def peer_dp_config(
    *, epsilon: float, noise: float, clip: float, delta: float, steps: int | None, secure_rng: bool = False
) -> DPSGDConfig | None:
    """The :class:`DPSGDConfig` of settings where 0 means "not given" (``privacy.peer_epsilon`` /
    ``privacy.peer_noise``): None when both are 0 (DP-SGD off). ``steps``: the run's total number of
    training steps if known (needed with a target epsilon)."""
    if not epsilon and not noise:
        return None
    return DPSGDConfig(noise_multiplier=noise or None, target_epsilon=epsilon or None, delta=delta,
                       max_grad_norm=clip, steps=steps, secure_rng=secure_rng)


def _import_opacus() -> None:
    """Import ``opacus`` without the side effect of its import-time ``logging.basicConfig`` (a stderr
    handler on the root logger of an application that configured none: the library never prints)."""
    if "opacus" in sys.modules:
        return
    root = logging.getLogger()
    guard = None if root.handlers else logging.NullHandler()
    if guard is not None:
        root.addHandler(guard)
    try:
        import opacus  # noqa: F401
    finally:
        if guard is not None:
            root.removeHandler(guard)


@contextlib.contextmanager
def _expected_warnings() -> Iterator[None]:
    """Silence the warnings that DP-SGD triggers by design (the library never prints):
    the embedding's full backward hook fires with no input requiring grad (its input is token ids),
    and the RDP conversion notes when the best order is the largest or the smallest one (very high
    or very low noise; the bound stays valid, only looser)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
        warnings.filterwarnings("ignore", message="Optimal order is the (largest|smallest) alpha", category=UserWarning)
        yield


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ----------------------------------------------------------------------------------- calibration


def calibrate_noise(config: DPSGDConfig, *, sample_rate: float) -> float:
    """The noise multiplier of ``config``: given, or the smallest (within Opacus's 0.01 epsilon
    tolerance) that keeps ``config.steps`` steps at ``sample_rate`` within ``target_epsilon``."""
    if config.noise_multiplier is not None:
        return float(config.noise_multiplier)
    _import_opacus()
    from opacus.accountants.utils import get_noise_multiplier

    assert config.target_epsilon is not None and config.steps is not None  # DPSGDConfig guarantees it
    try:
        with _expected_warnings():
            return float(get_noise_multiplier(target_epsilon=config.target_epsilon, target_delta=config.delta,
                                              sample_rate=sample_rate, steps=config.steps, accountant="rdp"))
    except ValueError:
        raise ConfigError(
            f"peer DP target epsilon {config.target_epsilon} at delta {config.delta} cannot be reached in "
            f"{config.steps} steps at sampling rate {sample_rate:.4g}: raise it or train fewer steps"
        ) from None


# ----------------------------------------------------------------------------------- the mechanism


def _llama_rms_norm_grad_sample(
    layer: torch.nn.Module, activations: list[torch.Tensor], backprops: torch.Tensor
) -> dict[torch.nn.Parameter, torch.Tensor]:
    """Per-sample gradient of ``LlamaRMSNorm.weight`` (``weight * (x / rms(x))``): the sum over
    positions of backprop times the normalised input, computed as the layer's forward does."""
    x = activations[0]
    h = x.to(torch.float32)
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + layer.variance_epsilon)).to(x.dtype)
    return {layer.weight: torch.einsum("n...i,n...i->ni", backprops, h.to(backprops.dtype))}


def _register_grad_samplers() -> None:
    """Give Opacus a closed-form per-sample gradient for ``LlamaRMSNorm`` (it would otherwise redo the
    layer with functorch's vmap: ~15% of a DP step of the tiny model). Checked against a plain
    backward by the tests."""
    from opacus.grad_sample import GradSampleModule
    from opacus.grad_sample.utils import register_grad_sampler
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    if LlamaRMSNorm not in GradSampleModule.GRAD_SAMPLERS:
        register_grad_sampler(LlamaRMSNorm)(_llama_rms_norm_grad_sample)


class DPSGD:
    """DP-SGD state of one trainer: the ``GradSampleModule`` hooks on ``model``, the
    ``DPOptimizer`` around ``optimizer`` (use :attr:`optimizer` from now on), the accountant and the
    sampling of ``tokens``.

    ``model`` keeps its identity and parameters (Opacus attaches hooks and ``grad_sample``
    attributes to the same parameter objects), so ``get_flat_params`` / ``set_params`` / the model's
    ``state_dict`` work unchanged. Per-sample activations are captured only in train mode with
    grad enabled; evaluation under ``no_grad`` is unaffected. A model can be wrapped once.
    """

    def __init__(
        self,
        *,
        config: DPSGDConfig,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        tokens: torch.Tensor,
        batch_size: int,
        seq_len: int,
        seed: int,
        device: torch.device,
    ) -> None:
        _import_opacus()
        from opacus import GradSampleModule
        from opacus.accountants import RDPAccountant
        from opacus.optimizers import DPOptimizer

        if hasattr(model, "autograd_grad_sample_hooks"):
            raise ValueError("DPSGD: the model already has Opacus hooks (another DP trainer wraps it)")
        self.config = config
        self.model = model
        self.tokens = tokens
        self.batch_size = int(batch_size)
        self.seq_len = int(seq_len)
        self.n_windows = count_windows(int(tokens.numel()), self.seq_len)
        self.sample_rate = dp_sample_rate(int(tokens.numel()), batch_size=self.batch_size, seq_len=self.seq_len)
        self.noise_multiplier = calibrate_noise(config, sample_rate=self.sample_rate)
        # The seed of sampling and noise: the trainer's (reproducible) or a secret one (never stored).
        self._seed = secrets.randbits(63) if config.secure_rng else int(seed)
        _register_grad_samplers()
        self.module = GradSampleModule(model, batch_first=True, loss_reduction="mean", strict=True)
        self.generator = torch.Generator(device=device)
        self.optimizer: DPOptimizer = DPOptimizer(
            optimizer,
            noise_multiplier=self.noise_multiplier,
            max_grad_norm=config.max_grad_norm,
            expected_batch_size=self.batch_size,
            loss_reduction="mean",
            generator=self.generator,
            secure_mode=config.secure_rng,
        )
        self.accountant = RDPAccountant()
        if config.delta >= 1 / self.n_windows:
            logger.warning("peer DP delta %g is not below 1 / N = 1 / %d windows: the guarantee is weak",
                           config.delta, self.n_windows)
        if not config.secure_rng:
            logger.warning("peer DP-SGD draws its batches and noise from the trainer seed (reproducible): the "
                           "guarantee holds only against whoever does not know that seed; use secure_rng in "
                           "real deployments")
        projected = ""
        if config.steps is not None:
            projected = f", epsilon after {config.steps} steps {self.projected_epsilon(config.steps):.3g}"
        logger.info("peer DP-SGD: %d windows, sample rate %.4g, noise multiplier %.4g, clip %g, delta %g%s",
                    self.n_windows, self.sample_rate, self.noise_multiplier, config.max_grad_norm, config.delta,
                    projected)

    # -- batches and gradients -----------------------------------------------------------------
    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The Poisson batch of ``step`` (``[B', seq_len]`` inputs and targets; ``B'`` may be 0)."""
        return poisson_batch(self.tokens, batch_size=self.batch_size, seq_len=self.seq_len, step=step, seed=self._seed)

    def privatize(
        self, x: torch.Tensor, y: torch.Tensor, *, step: int, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ) -> float:
        """Leave the privatized gradient of batch ``(x, y)`` in every ``p.grad`` (clipped per-window
        gradients summed, noise of ``step`` added, divided by ``batch_size``) and return the batch's
        mean loss (NaN for an empty batch). ``loss_fn(x, y)`` is the mean token loss of a forward
        pass of the model in train mode. Does not step the optimizer nor the accountant.

        When the loss is not finite, nothing is computed (no backward) and the grads are cleared:
        the caller skips the update. The per-sample gradients stay in ``p.grad_sample`` (and the
        clipped sum in ``p.summed_grad``) until :meth:`clear`.
        """
        self.clear()
        if x.size(0) == 0:
            # An empty Poisson batch: the mechanism's output is pure noise (the clipped sum over no
            # windows is 0), so the update is N(0, (sigma C)^2) / batch_size. Skipping the step instead
            # would make "the batch was empty" observable, an event whose probability depends on
            # whether a window is in the data and that the accountant does not cover.
            for p in self.optimizer.params:
                p.grad_sample = torch.zeros((0, *p.shape), device=p.device, dtype=p.dtype)
            loss_value = math.nan
        else:
            loss = loss_fn(x, y)
            loss_value = float(loss.detach())
            if not math.isfinite(loss_value):
                self._reset_hooks()
                self.clear()
                return loss_value
            with _expected_warnings():
                loss.backward()
            for p in self.optimizer.params:
                # Under bf16 autocast the per-sample grads of linear layers are bf16: Opacus would take
                # their norms in bf16 (0.4% error, so a clipped norm could exceed C). Clip in fp32.
                if isinstance(p.grad_sample, torch.Tensor) and p.grad_sample.dtype != p.dtype:
                    p.grad_sample = p.grad_sample.to(p.dtype)
        self.generator.manual_seed(_derived_seed("noise", self._seed, step))
        self.optimizer.pre_step()  # clip per sample, sum, add noise, divide by the expected batch size
        return loss_value

    def clear(self) -> None:
        """Drop grads, per-sample grads and clipped sums (frees their memory)."""
        self.optimizer.zero_grad(set_to_none=True)

    def _reset_hooks(self) -> None:
        """Forget the activations a forward captured when no backward follows (a skipped step)."""
        for m in self.model.modules():
            acts = m.__dict__.get("activations")
            if isinstance(acts, list):
                acts.clear()
            m.__dict__.pop("max_batch_len", None)
        for p in self.model.parameters():
            p._forward_counter = 0  # type: ignore[attr-defined]
            if hasattr(p, "_current_grad_sample"):
                del p._current_grad_sample

    # -- accounting ------------------------------------------------------------------------------
    def account(self) -> None:
        """Record one step of the sampled Gaussian mechanism ``(noise_multiplier, sample_rate)``."""
        self.accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate)

    @property
    def steps(self) -> int:
        """Steps recorded by the accountant (including those restored from a state)."""
        return sum(int(n) for _, _, n in self.accountant.history)

    def epsilon(self) -> float:
        """Epsilon spent so far at ``config.delta`` (0.0 before the first step; inf with no noise)."""
        if not self.accountant.history:
            return 0.0
        with _expected_warnings():
            return float(self.accountant.get_epsilon(delta=self.config.delta))

    def projected_epsilon(self, steps: int) -> float:
        """Epsilon at ``config.delta`` after ``steps`` steps at this noise and sampling rate."""
        _import_opacus()
        from opacus.accountants import RDPAccountant

        acc = RDPAccountant()
        acc.history = [(self.noise_multiplier, self.sample_rate, int(steps))]
        with _expected_warnings():
            return float(acc.get_epsilon(delta=self.config.delta))

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The accountant history (plain lists) and the mechanism's parameters, for resuming."""
        return {
            "mechanism": self.accountant.mechanism(),
            "history": [[float(s), float(q), int(n)] for s, q, n in self.accountant.history],
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "max_grad_norm": self.config.max_grad_norm,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the accountant history of :meth:`state_dict` (CheckpointError if unusable)."""
        try:
            mechanism = state["mechanism"]
            history = [(float(s), float(q), int(n)) for s, q, n in state["history"]]
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"peer DP accountant state is unreadable: {type(e).__name__}: {e}") from None
        if mechanism != self.accountant.mechanism():
            raise CheckpointError(f"peer DP accountant state is of mechanism {mechanism!r}, expected "
                                  f"{self.accountant.mechanism()!r}")
        if history and (history[-1][0], history[-1][1]) != (self.noise_multiplier, self.sample_rate):
            logger.warning("peer DP: the resumed accountant last used noise %.4g / sample rate %.4g, now %.4g / %.4g",
                           history[-1][0], history[-1][1], self.noise_multiplier, self.sample_rate)
        self.accountant.history = history
