"""The ``preference`` section: every preference method's fields (DPO's losses and options, ORPO's, CPO's and
SimPO's, KTO's), each described; ``config.checks`` says which fields each method reads."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from lowmem_tpu.config.section import Section

# TRL's DPO losses (DPOConfig.loss_type, trl 1.16), each computed by TRL's DPOTrainer.
DPO_LOSSES = (
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
    "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm",
)  # fmt: skip
EXO_EPSILON = 1e-3  # the EXO paper's (arXiv 2402.00856) label smoothing, where a recipe gives none
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")


class PreferenceSection(Section):
    """Preference tuning (method dpo, orpo, cpo or simpo on data.format: preference): TRL's losses.

    ``beta`` is each method's own (DPO's KL weight, ORPO's odds-ratio weight lambda, CPO's and SimPO's
    temperature), as in TRL's configs.

    The reference is the policy with its adapters switched off (LoRA from fresh adapters: one model, no copy),
    a frozen copy of the adapter it starts from (``model.adapter``), or, precomputed, the model as it is before
    training, run once over the pairs (full-parameter DPO: no frozen copy of the model is made)."""

    beta: float = Field(0.1, gt=0, description="How far from the reference the policy may move (TRL's beta).")
    loss_type: list[Literal[DPO_LOSSES]] = Field(  # type: ignore[valid-type]
        default_factory=lambda: ["sigmoid"],
        min_length=1,
        description="TRL's DPO loss(es): sigmoid (DPO), ipo, hinge, robust, apo_zero, sft (with sigmoid: RPO) ...",
    )
    label_smoothing: float | None = Field(
        None,
        ge=0,
        lt=0.5,
        description="Label smoothing (DPO's robust, exo_pair, aot losses; CPO's and SimPO's sigmoid). null: 0, or "
        "with exo_pair the EXO paper's 1e-3 (its epsilon must be above 0).",
    )
    loss_weights: list[float] | None = Field(
        None, description="One weight per loss in loss_type, their weighted sum trained (TRL's; null: 1 each)."
    )
    f_divergence_type: Literal[F_DIVERGENCES] = Field(  # type: ignore[valid-type]
        "reverse_kl",
        description="The f-divergence between policy and reference (f-DPO): reverse_kl is DPO's; the others with "
        "the losses built on the reward difference only (sigmoid, sigmoid_norm, hinge, ipo, exo_pair, robust, "
        "discopop, sft).",
    )
    f_alpha_divergence_coef: float = Field(0.5, gt=0, description="alpha of f_divergence_type: alpha_divergence.")
    use_weighting: bool = Field(False, description="WPO: each pair weighted by the policy's length-normalized odds.")
    ld_alpha: float | None = Field(
        None, ge=0, le=1, description="LD-DPO: the weight of tokens past the shorter completion's length (null: 1)."
    )
    discopop_tau: float = Field(0.05, gt=0, description="The DiscoPOP loss's temperature (loss_type: discopop).")
    cpo_alpha: float | None = Field(
        None,
        ge=0,
        description="CPO and SimPO: the weight of the chosen answers' NLL beside the preference loss (TRL's "
        "cpo_alpha; null: full weight for cpo, none for simpo)",
    )
    simpo_gamma: float = Field(0.5, ge=0, description="SimPO: the target reward margin (TRL's simpo_gamma).")
    kto_loss: Literal["kto", "apo_zero_unpaired"] = Field(
        "kto", description="KTO: its loss (TRL's KTOConfig.loss_type): kto, or apo_zero_unpaired (no KL term)."
    )
    desirable_weight: float = Field(
        1.0, gt=0, description="KTO: the weight of the desirable rows' losses (raise it when they are the fewer)."
    )
    undesirable_weight: float = Field(1.0, gt=0, description="KTO: the weight of the undesirable rows' losses.")
    alphapo_alpha: float = Field(
        0.0, description="CPO and SimPO: AlphaPO's reward shape (TRL's alpha; 0: log-probabilities as rewards)."
    )
    precompute_ref_log_probs: bool | None = Field(
        None,
        description="The reference's log-probabilities computed in one pass over the pairs before training (TRL's "
        "precompute_ref_log_probs), so no step runs the reference: full-parameter DPO needs it (no frozen copy of "
        "the model is made). null: on exactly when lora.enabled is false.",
    )

    @property
    def smoothing(self) -> float:
        """``label_smoothing`` as the losses read it."""
        if self.label_smoothing is not None:
            return self.label_smoothing
        return EXO_EPSILON if "exo_pair" in self.loss_type else 0.0

    @field_validator("loss_type", mode="before")
    @classmethod
    def _one_or_more(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value
