"""This peer's own model as a member of its region: its parameters, its tune-slice evidence and
the mixing choices it made (knows nothing of the network). With ``personal_model="separate"`` it
holds two: the shared model that takes part in the rounds (``model``, ``trainer``) and its personal
model (``personal``: a trainer and its model) trained on the same batches, which never leaves the
peer and moves towards the shared one after every round as far as its tune slice supports
(:func:`worldlm_p2p.rounds.personal_mix`)."""

from __future__ import annotations

import logging
import math
from typing import Callable

import torch

from worldlm_p2p import attention, mixing, rounds
from worldlm_p2p.rounds import RoundRule, mix_parts_record
from worldlm_p2p.train import LocalTrainer, SliceEvaluator, get_flat_params, set_params

from worldlm_p2p.peer.stats import PeerStats

logger = logging.getLogger(__name__)


class Member:
    def __init__(self, *, model: torch.nn.Module, trainer: LocalTrainer, rule: RoundRule, stats: PeerStats,
                 personal: LocalTrainer | None = None) -> None:
        self.model, self.trainer, self.rule, self.stats = model, trainer, rule, stats
        self.personal = personal
        self._evaluator: SliceEvaluator | None = None
        # mix="evidence": what its searches may cost and their last choices (aggregation.evidence_share)
        self.budget = mixing.EvidenceBudget(share=rule.config.evidence_share,
                                            models=2 if personal is not None else 1) if rule.evidence else None
        # usage_rows: this peer's token counts over its training text, which weigh its rows of the
        # token-indexed key layers in region rounds (none under DP-SGD: its rows weigh uniformly)
        self.usage: torch.Tensor | None = None
        if rule.usage_rows and trainer.dp is None:
            rows = model.get_input_embeddings().weight.shape[0]
            self.usage = attention.token_usage(trainer.data.train, rows)

    @property
    def held(self) -> LocalTrainer:
        """The trainer of the model this peer holds (evaluates, exports): its personal one, if any."""
        return self.personal if self.personal is not None else self.trainer

    def personal_params(self) -> list[torch.Tensor]:
        """A CPU copy of the personal model's parameters (the shared model's without one)."""
        return get_flat_params(self.held.model)

    def follow_shared(self) -> None:
        """The personal model takes the shared model's parameters (a peer that starts from its
        region's model, or resumes from a checkpoint without a personal model)."""
        if self.personal is not None:
            set_params(self.personal.model, self.params())

    def mix_personal(self, index: int) -> None:
        """After round ``index`` changed the shared model: the personal model moves towards it as far
        as the tune slice supports (:func:`worldlm_p2p.rounds.personal_mix`). A failed search (out of
        memory, say) keeps the personal model as it was and says so."""
        if self.personal is None:
            return
        trainer = self.personal
        loss_of = None if trainer.data.tune.numel() < 2 else (
            trainer.tune_losses if self.rule.windowed else trainer.tune_loss)
        own = get_flat_params(trainer.model)
        try:
            new, choice = rounds.personal_mix(self.rule, personal=own, shared=self.params(),
                                              loss_of=self._counted(loss_of, "personal"),
                                              reuse=self.reuse_for("personal"))
        except Exception as e:
            logger.warning("personal mixing failed (%s: %s): keeping this peer's personal model", type(e).__name__, e)
            new, choice = own, None
        set_params(trainer.model, new)
        self.record_mix("personal", index, choice)

    def params(self) -> list[torch.Tensor]:
        """A CPU copy of the model's parameters."""
        return get_flat_params(self.model)

    def set(self, params: list[torch.Tensor]) -> None:
        set_params(self.model, params)

    def loss_of(self, kind: str = "region") -> Callable | None:
        """This peer's tune-slice loss of a parameter list (None without a slice: no evidence), for a
        search of ``kind`` ("region", "world", "leader": what the evidence budget charges). It
        leaves the parameters tried in the model; the caller sets the one it settles on."""
        if not self.rule.evidence or self.trainer.data.tune.numel() < 2:
            return None
        return self._counted(self.trainer.tune_losses if self.rule.windowed else self.trainer.tune_loss, kind)

    def _counted(self, loss_of: Callable | None, kind: str) -> Callable | None:
        """``loss_of`` charged to ``kind`` in the evidence budget (one tune slice per call)."""
        if self.budget is None or loss_of is None:
            return loss_of
        return self.budget.counting(loss_of, self.trainer.data.tune.numel(), kind)

    def reuse_for(self, kind: str) -> mixing.MixChoice | None:
        """The last ``kind`` choice ("region", "world", "personal") to take again instead of a search,
        when the evidence budget has none due (``aggregation.evidence_share``); None: search."""
        return self.budget.reuse(kind, self.stats.tokens) if self.budget is not None else None

    def background_loss_of(self) -> Callable | None:
        """:meth:`loss_of` on a copy of the model (made once, here: call it from the training thread),
        for a search in another thread while this model trains on; None without evidence, or
        under DP-SGD (the search then runs in the training thread, on the model itself)."""
        if self.loss_of() is None or self.trainer.dp is not None:
            return None
        if self._evaluator is None:
            self._evaluator = SliceEvaluator(self.trainer)
        return self._counted(self._evaluator.tune_losses if self.rule.windowed else self._evaluator.tune_loss, "region")

    def mix_safely(self, search: Callable, *, own: list[torch.Tensor], extra: int = 0):
        """Run a mixing search; if evaluating the tune slice fails (out of memory, say), keep the
        own model (a search leaves trial parameters in the model) and say so, rather than stop.
        ``extra``: what the search returns beyond ``(model, choice)``, None each on a failure."""
        try:
            return search()
        except Exception as e:
            logger.warning("evidence mixing failed (%s: %s): keeping this peer's own model", type(e).__name__, e)
            set_params(self.model, own)
            return ([t.detach().clone() for t in own], None) + (None,) * extra

    def record_mix(self, kind: str, index: int, choice, *, partner: str | None = None) -> None:
        """``partner``: with ``region_backbone = "partners"``, the backbone the member took before
        mixing (``"region"``, ``"own-half"``, or the label of the mate whose pair it took; None: no
        choice)."""
        if self.budget is not None:
            self.budget.remember(kind, choice)
        lam = choice.lam if choice is not None else 0.0
        gain = choice.gain if choice is not None and math.isfinite(choice.gain) else 0.0
        parts = mix_parts_record(self.rule.personal if kind == "personal" else self.rule, choice)
        self.stats.mixes.append(dict(kind=kind, round=int(index), step=self.stats.step, lam=lam, gain=gain, **parts,
                                     **({"reused": True} if choice is not None and choice.reused else {}),
                                     **({"partner": partner} if partner is not None else {})))
        what = {"region": "region's agreed model", "world": "world's change", "personal": "shared model"}[kind]
        if partner is not None and partner != "region":
            what = "region's key layers"
            taken = ("its own backbone half and half with the region's" if partner == rounds.OWN_HALF_CANDIDATE
                     else f"the backbone of its pair with {partner}")
            logger.info("%s round %d: took %s (its tune slice preferred it to the region's)", kind, index, taken)
        if choice is not None and choice.reused:
            logger.info("%s round %d: took %.3g of the %s%s again (no evidence search due)", kind, index, lam, what,
                        f" (backbone; key layers {parts['key_lam']:.3g})" if parts else "")
            return
        if choice is not None and not choice.evaluated:  # adopted without a search
            logger.info("%s round %d: adopted the %s whole", kind, index, what)
            return
        logger.info("%s round %d: took %.3g of the %s%s (tune-slice loss %.4f -> %.4f)", kind, index, lam, what,
                    f" (backbone; key layers {parts['key_lam']:.3g})" if parts else "",
                    choice.own_loss if choice is not None else float("nan"),
                    choice.loss if choice is not None else float("nan"))
