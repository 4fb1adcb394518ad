"""The training methods as plain data: what each reads, how many rows and passes a step holds, what it logs.

The planner, the card, eval and the commands read a method here; ``lowmem_tpu.train.methods`` maps each to
the trainer that runs it. Adding a method starts here (docs/architecture.md, "Adding a method").
"""

from __future__ import annotations

from dataclasses import dataclass

# The figures TRL's preference trainers log, each a mean over a micro-batch, averaged over a logging window.
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
LOGPS = ("logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected")


@dataclass(frozen=True)
class Method:
    """One way to train: its data, the shape of its step and what it reports."""

    name: str
    summary: str  # the command's help and the model card's line
    trainer: str  # the TRL trainer whose loss and metrics it reproduces
    formats: tuple[str, ...]  # the data formats it trains on
    rows_per_example: int  # rows of data.max_length tokens per record (a pair: chosen and rejected)
    reference: bool  # a frozen reference's log-probabilities (a pass per micro-batch, or precomputed)
    metrics: tuple[str, ...]  # what its loss logs beside the loss (TRL's names)

    @property
    def pairs(self) -> bool:
        return self.rows_per_example == 2


SFT_FORMATS = ("text", "alpaca", "chat", "prompt_completion", "sharegpt")
METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("sft", "supervised fine-tuning", "SFTTrainer", SFT_FORMATS, 1, False, ()),
        Method(
            "dpo",
            "direct preference optimization against a frozen reference",
            "DPOTrainer",
            ("preference",),
            2,
            True,
            (*REWARDS, *LOGPS, "entropy", "mean_token_accuracy"),
        ),
        Method(
            "orpo",
            "odds-ratio preference optimization: SFT and preference in one stage, no reference",
            "ORPOTrainer",
            ("preference",),
            2,
            False,
            (*REWARDS, *LOGPS, "nll_loss", "log_odds_ratio", "log_odds_chosen"),
        ),
        Method(
            "cpo",
            "contrastive preference optimization: a preference loss plus the chosen answers' NLL, no reference",
            "CPOTrainer",
            ("preference",),
            2,
            False,
            (*REWARDS, *LOGPS, "nll_loss"),
        ),
        Method(
            "simpo",
            "simple preference optimization: length-normalized rewards with a target margin, no reference",
            "CPOTrainer (loss_type simpo)",
            ("preference",),
            2,
            False,
            (*REWARDS, *LOGPS, "nll_loss"),
        ),
    )
}
METHOD_NAMES = tuple(METHODS)
PREFERENCE_METHODS = tuple(name for name, m in METHODS.items() if m.pairs)
CPO_LOSSES = ("sigmoid", "hinge", "ipo")  # CPOTrainer's (simpo is the simpo method)


def method_for_format(fmt: str) -> str:
    """The method a recipe that names none trains with: DPO on preference pairs, else SFT."""
    return "dpo" if fmt == "preference" else "sft"
