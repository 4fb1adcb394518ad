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
    summary: str  # the model card's line
    trainer: str  # the TRL trainer whose loss and metrics it reproduces
    formats: tuple[str, ...]  # the data formats it trains on
    rows: str  # what a batch holds: "samples", "pairs" (chosen and rejected rows) or "unpaired" (labelled rows)
    passes: int  # forward passes over a micro-batch's rows in a step (reference and KL rows included)
    reference_passes: int  # of those, the frozen reference's (none when its log-probabilities are precomputed)
    metrics: tuple[str, ...]  # what its loss logs beside the loss (TRL's names)
    kl_passes: int = 0  # of the passes, those over KTO's KL rows (each prompt with another row's completion)

    @property
    def pairs(self) -> bool:
        return self.rows == "pairs"

    @property
    def preference(self) -> bool:
        """Trained on preferences (TRL's preference losses, on pairs or labelled rows), not samples."""
        return self.rows != "samples"

    @property
    def reference(self) -> bool:
        return self.reference_passes > 0

    @property
    def rows_per_example(self) -> int:
        """Rows of data.max_length tokens per example the global batch counts (a pair: chosen and rejected)."""
        return 2 if self.pairs else 1

    def forward_passes(self, precomputed: bool) -> int:
        """Forward passes per micro-batch, the reference's left out where precomputed."""
        return self.passes - (self.reference_passes if precomputed else 0)


SFT_FORMATS = ("text", "alpaca", "chat", "prompt_completion", "sharegpt")
METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("sft", "supervised fine-tuning", "SFTTrainer", SFT_FORMATS, "samples", 1, 0, ()),
        Method(
            "dpo",
            "direct preference optimization against a frozen reference",
            "DPOTrainer",
            ("preference",),
            "pairs",
            2,
            1,
            (*REWARDS, *LOGPS, "entropy", "mean_token_accuracy"),
        ),
        Method(
            "orpo",
            "odds-ratio preference optimization: SFT and preference in one stage, no reference",
            "ORPOTrainer",
            ("preference",),
            "pairs",
            1,
            0,
            (*REWARDS, *LOGPS, "nll_loss", "log_odds_ratio", "log_odds_chosen"),
        ),
        Method(
            "cpo",
            "contrastive preference optimization: a preference loss plus the chosen answers' NLL, no reference",
            "CPOTrainer",
            ("preference",),
            "pairs",
            1,
            0,
            (*REWARDS, *LOGPS, "nll_loss"),
        ),
        Method(
            "simpo",
            "simple preference optimization: length-normalized rewards with a target margin, no reference",
            "CPOTrainer (loss_type simpo)",
            ("preference",),
            "pairs",
            1,
            0,
            (*REWARDS, *LOGPS, "nll_loss"),
        ),
        Method(
            "kto",
            "Kahneman-Tversky optimization: desirable and undesirable answers, unpaired, against a frozen reference",
            "KTOTrainer",
            ("unpaired", "preference"),
            "unpaired",
            4,  # the policy and the reference, each on the rows and on the KL rows (another row's completion)
            2,
            ("kl", "entropy", "logits/chosen", "logits/rejected", *REWARDS[:2], "rewards/margins", *LOGPS[:2]),
            kl_passes=2,
        ),
    )
}
METHOD_NAMES = tuple(METHODS)
CPO_LOSSES = ("sigmoid", "hinge", "ipo")  # CPOTrainer's (simpo is the simpo method)


def method_for_format(fmt: str) -> str:
    """The method a recipe that names none trains with: DPO on preference pairs, else SFT."""
    return "dpo" if fmt == "preference" else "sft"
