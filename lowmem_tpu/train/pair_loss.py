"""The preference losses of TRL 1.16 (DPOTrainer, ORPOTrainer, CPOTrainer, KTOTrainer), written for the devices.

Each takes a micro-batch at its static shape (pairs: every chosen row, then every rejected row; KTO: labelled
rows) as the policy's fused LM head returned it, and gives the loss and TRL's logged figures as device scalars:
no ``.item()``, no boolean indexing, so the policy's forward pass, the reference's and the backward pass are one
program per micro-batch. TRL's own trainers are the tests' oracle (tests/e2e/test_dpo.py); each function names
the TRL method it follows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

Figures = dict[str, Any]  # a device scalar, or (value, present) for a figure a micro-batch may not have


@dataclass(frozen=True)
class Pairs:
    """One micro-batch as the policy scored it: ``[2B, L-1]`` per position (the token after it)."""

    log_probs: torch.Tensor  # the next token's log-probability, 0 where it is not scored
    completion: torch.Tensor  # 1 where the next token is a completion token (TRL's shifted completion_mask)
    lengths: torch.Tensor  # ``[2B]`` each row's completion tokens (the unshifted mask's, as TRL counts them)
    outputs: Any  # the fused head's other fields (entropy, mean_logits, is_top1, log_sum_sq_probs)

    @classmethod
    def of(cls, outputs: Any, completion_mask: torch.Tensor) -> Pairs:
        """``outputs`` scored ``L - 1`` positions (``labels``) or all ``L`` (``every_position``)."""
        dtype, width = outputs.log_probs.dtype, completion_mask.shape[1] - 1
        lengths = completion_mask.sum(dim=1).to(dtype)
        return cls(outputs.log_probs[:, :width], completion_mask[:, 1:].to(dtype), lengths, outputs)


def every_position(input_ids: torch.Tensor) -> torch.Tensor:
    """``shift_labels`` for the fused head that score all ``L`` positions, the last one's label a stand-in:
    ORPO's NLL reads the prompt's tokens too, and TRL's ORPO and CPO average the logits of the padding, CPO's
    of the last position too (``_all_logits``)."""
    return torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1)


def _mean(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``total / count``, 0 where nothing was counted (TRL's ``if total_tokens > 0 else 0.0``)."""
    return torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total))


def sequence_logps(log_probs: torch.Tensor, completion: torch.Tensor, ld_alpha: float | None) -> torch.Tensor:
    """Each row's summed completion log-probability; with ``ld_alpha`` (LD-DPO) the tokens past the shorter
    completion of its pair weighted by it (``DPOTrainer._compute_loss``)."""
    if ld_alpha is None:
        return (log_probs * completion).sum(dim=1)
    position = completion.cumsum(dim=1)
    shared = torch.minimum(*completion.sum(dim=1).chunk(2)).repeat(2).unsqueeze(1)
    head = ((position > 0) & (position <= shared)).to(log_probs.dtype) * completion
    tail = (position > shared).to(log_probs.dtype) * completion
    return (log_probs * head).sum(dim=1) + ld_alpha * (log_probs * tail).sum(dim=1)


def _scores(logratios: torch.Tensor, p: Any) -> torch.Tensor:
    """The f-divergence's derivative at the policy/reference ratio (f-DPO; reverse KL is DPO's)."""
    kind, alpha = p.f_divergence_type, p.f_alpha_divergence_coef
    if kind == "forward_kl":
        return 1 - torch.exp(-logratios)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    if kind == "alpha_divergence" and abs(alpha - 1.0) >= 1e-6:
        t = torch.clamp(((alpha - 1.0) * logratios).float(), max=80.0)
        return (torch.exp(t) - 1.0).to(logratios.dtype) / (alpha - 1.0)
    return logratios


def _smoothed(logits: torch.Tensor, smoothing: float) -> torch.Tensor:
    return -F.logsigmoid(logits) * (1 - smoothing) - F.logsigmoid(-logits) * smoothing


def _dpo_term(kind: str, pairs: Pairs, logps: tuple[torch.Tensor, ...], p: Any) -> torch.Tensor:
    """One of TRL's 15 DPO losses per pair: ``logps`` = (chosen, rejected, reference chosen, reference rejected)."""
    chosen, rejected, ref_chosen, ref_rejected = logps
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    chosen_score, rejected_score = _scores(chosen_ratio, p), _scores(rejected_ratio, p)
    beta, delta = p.beta, chosen_score - rejected_score
    lengths = pairs.lengths.clamp(min=1.0).chunk(2)
    if kind == "sigmoid":
        return -F.logsigmoid(beta * delta)
    if kind == "hinge":
        return torch.relu(1 - beta * delta)
    if kind in ("ipo", "sigmoid_norm"):
        normalized = chosen_score / lengths[0] - rejected_score / lengths[1]
        return (normalized - 1 / (2 * beta)) ** 2 if kind == "ipo" else -F.logsigmoid(beta * normalized)
    if kind == "exo_pair":
        eps = p.smoothing
        q_chosen, q_rejected = torch.sigmoid(beta * delta), torch.sigmoid(-beta * delta)
        return q_chosen * (F.logsigmoid(beta * delta) - math.log1p(-eps)) + q_rejected * (
            F.logsigmoid(-beta * delta) - math.log(eps)
        )
    if kind == "nca_pair":
        c, r = beta * chosen_ratio, beta * rejected_ratio
        return -F.logsigmoid(c) - 0.5 * F.logsigmoid(-c) - 0.5 * F.logsigmoid(-r)
    if kind == "robust":
        eps = p.smoothing
        return (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
    if kind == "bco_pair":
        return -F.logsigmoid(beta * chosen_ratio) - F.logsigmoid(-beta * rejected_ratio)
    if kind == "sppo_hard":
        return (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
    if kind == "aot":
        delta = torch.sort(chosen - rejected, dim=0)[0] - torch.sort(ref_chosen - ref_rejected, dim=0)[0]
        return _smoothed(beta * delta, p.smoothing)
    if kind == "aot_unpaired":
        delta = torch.sort(chosen_ratio, dim=0)[0] - torch.sort(rejected_ratio, dim=0)[0]
        return _smoothed(beta * delta, p.smoothing)
    if kind == "apo_zero":
        return 1 - torch.sigmoid(beta * chosen_ratio) + torch.sigmoid(beta * rejected_ratio)
    if kind == "apo_down":
        return torch.sigmoid(beta * chosen_ratio) + 1 - torch.sigmoid(beta * (chosen_ratio - rejected_ratio))
    if kind == "discopop":
        logits = beta * delta
        modulation = torch.sigmoid(logits / p.discopop_tau)
        return -F.logsigmoid(logits) * (1 - modulation) + torch.exp(-logits) * modulation
    if kind == "sft":
        log_probs, mask = pairs.log_probs.chunk(2)[0], pairs.completion.chunk(2)[0]
        return (-_mean((log_probs * mask).sum(), mask.sum())).expand(chosen.shape[0])
    raise ValueError(f"unknown DPO loss {kind!r}")


def _wpo_weights(pairs: Pairs) -> torch.Tensor:
    """WPO's weight of each pair: the product of its rows' length-normalized odds (no gradient)."""
    with torch.no_grad():
        aligned = (pairs.log_probs - pairs.outputs.log_sum_sq_probs) * pairs.completion
    weights = torch.exp(aligned.sum(dim=1) / pairs.completion.sum(dim=1).clamp(min=1))
    chosen, rejected = weights.chunk(2)
    return chosen * rejected


def dpo(pairs: Pairs, reference: torch.Tensor, p: Any) -> tuple[torch.Tensor, Figures]:
    """``DPOTrainer._compute_loss``: ``reference`` the reference's sequence log-probabilities, ``[2B]``."""
    logps = sequence_logps(pairs.log_probs, pairs.completion, p.ld_alpha)
    chosen, rejected = logps.chunk(2)
    ref_chosen, ref_rejected = reference.to(logps.dtype).chunk(2)
    weights = p.loss_weights or [1.0] * len(p.loss_type)
    loss = logps.new_zeros(())
    for kind, weight in zip(p.loss_type, weights, strict=True):
        term = _dpo_term(kind, pairs, (chosen, rejected, ref_chosen, ref_rejected), p)
        if p.use_weighting:
            term = term * _wpo_weights(pairs)
        loss = loss + term.mean() * weight
    return loss, _dpo_figures(pairs, logps, reference.to(logps.dtype), p.beta)


def _dpo_figures(pairs: Pairs, logps: torch.Tensor, reference: torch.Tensor, beta: float) -> Figures:
    out, mask = pairs.outputs, pairs.completion
    chosen_mask, rejected_mask = mask.chunk(2)
    mean_logits = out.mean_logits.detach().chunk(2)
    figures = _rewards(*(beta * (logps - reference).detach()).chunk(2)) | _logps(*logps.detach().chunk(2))
    figures |= {
        "logits/chosen": _mean((mean_logits[0] * chosen_mask).sum(), chosen_mask.sum()),
        "logits/rejected": _mean((mean_logits[1] * rejected_mask).sum(), rejected_mask.sum()),
        "entropy": _mean((out.entropy.detach() * mask).sum(), mask.sum()),
        "mean_token_accuracy": _mean((out.is_top1.chunk(2)[0] * chosen_mask).sum(), chosen_mask.sum()),
    }
    return figures


def _rewards(chosen: torch.Tensor, rejected: torch.Tensor) -> Figures:
    return {
        "rewards/chosen": chosen.mean(),
        "rewards/rejected": rejected.mean(),
        "rewards/accuracies": (chosen > rejected).to(chosen.dtype).mean(),
        "rewards/margins": (chosen - rejected).mean(),
    }


def _logps(chosen: torch.Tensor, rejected: torch.Tensor) -> Figures:
    return {"logps/chosen": chosen.mean(), "logps/rejected": rejected.mean()}


def _all_logits(pairs: Pairs, last: bool) -> Figures:
    """ORPO's and CPO's ``logits/*``: the mean logit over every position of the padded rows (TRL's
    ``logits.mean()``), the last position's too for CPO (``last``)."""
    mean_logits = pairs.outputs.mean_logits.detach()
    chosen, rejected = (mean_logits if last else mean_logits[:, :-1]).chunk(2)
    return {"logits/chosen": chosen.mean(), "logits/rejected": rejected.mean()}


def _average(pairs: Pairs) -> torch.Tensor:
    return (pairs.log_probs * pairs.completion).sum(dim=1) / pairs.completion.sum(dim=1)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, split at -ln 2 (Maechler's note), as TRL's ORPO computes it."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo(pairs: Pairs, attention_mask: torch.Tensor, p: Any) -> tuple[torch.Tensor, Figures]:
    """``ORPOTrainer.get_batch_loss_metrics``: the chosen rows' NLL over prompt and completion, minus beta x
    the log-sigmoid of the log odds ratio of the completions' average log-probabilities."""
    attended = attention_mask[:, 1:].to(pairs.log_probs.dtype).chunk(2)[0]
    nll = -(pairs.log_probs.chunk(2)[0] * attended).sum() / attended.sum()
    chosen, rejected = _average(pairs).float().chunk(2)
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    loss = nll - (p.beta * ratio).mean()
    figures = _rewards(p.beta * chosen.detach(), p.beta * rejected.detach()) | _logps(
        chosen.detach(), rejected.detach()
    )
    figures |= _all_logits(pairs, last=False) | {
        "nll_loss": nll.detach(),
        "log_odds_ratio": ratio.detach().mean(),
        "log_odds_chosen": log_odds.detach().mean(),
    }
    return loss, figures


def cpo(pairs: Pairs, kind: str, p: Any) -> tuple[torch.Tensor, Figures]:
    """``CPOTrainer.get_batch_loss_metrics``: ``kind`` sigmoid, hinge, ipo or simpo (average log-probabilities
    for ipo and simpo), plus cpo_alpha x the chosen completions' NLL; AlphaPO's rewards with alphapo_alpha."""
    alpha_nll = p.cpo_alpha if p.cpo_alpha is not None else (0.0 if kind == "simpo" else 1.0)
    completion = pairs.completion.chunk(2)[0]
    nll = -(pairs.log_probs.chunk(2)[0] * completion).sum() / completion.sum()
    nll = nll if alpha_nll else torch.zeros_like(nll)
    logps = _average(pairs) if kind in ("ipo", "simpo") else (pairs.log_probs * pairs.completion).sum(dim=1)
    chosen, rejected = logps.chunk(2)
    if p.alphapo_alpha:
        chosen_r, rejected_r = ((1 - torch.exp(x).pow(-p.alphapo_alpha)) / p.alphapo_alpha for x in (chosen, rejected))
    else:
        chosen_r, rejected_r = chosen, rejected
    logits = chosen_r - rejected_r
    if kind == "simpo":
        losses = _smoothed(p.beta * (logits - p.simpo_gamma / p.beta), p.smoothing)
    elif kind == "sigmoid":
        losses = _smoothed(p.beta * logits, p.smoothing)
    elif kind == "hinge":
        losses = torch.relu(1 - p.beta * logits)
    else:
        losses = (logits - 1 / (2 * p.beta)) ** 2
    loss = losses.mean() + alpha_nll * nll
    figures = _rewards(p.beta * chosen_r.detach(), p.beta * rejected_r.detach()) | _logps(
        chosen.detach(), rejected.detach()
    )
    return loss, figures | _all_logits(pairs, last=True) | {"nll_loss": nll.detach()}


def kto(
    policy: Any,
    completion_mask: torch.Tensor,
    label: torch.Tensor,
    logps: tuple[torch.Tensor, ...],
    p: Any,
) -> tuple[torch.Tensor, Figures]:
    """``KTOTrainer._compute_loss`` over a micro-batch of labelled rows: ``policy`` the fused head's outputs on
    the rows, ``logps`` = (the rows' reference log-probabilities, the KL rows' policy and reference ones), the
    KL terms ``None`` for apo_zero_unpaired. The split by label is a mask: the loss is a mean over every row.
    Figures TRL logs only when the micro-batch has such rows are ``(value, present)``."""
    reference, kl_policy, kl_reference = logps
    completion = completion_mask[:, 1:].to(policy.log_probs.dtype)
    sums = sequence_logps(policy.log_probs, completion, None)
    chosen = label.to(sums.dtype)
    rejected = 1 - chosen
    # TRL's KL estimate: the mismatched rows' mean log-ratio, never below 0 (apo_zero_unpaired has none)
    kl = sums.new_zeros(()) if kl_policy is None else (kl_policy - kl_reference).mean().detach().clamp(min=0)
    ratio = sums - reference.to(sums.dtype)
    if p.kto_loss == "kto":
        chosen_losses = 1 - torch.sigmoid(p.beta * (ratio - kl))
        rejected_losses = 1 - torch.sigmoid(p.beta * (kl - ratio))
    else:  # apo_zero_unpaired
        chosen_losses, rejected_losses = 1 - torch.sigmoid(p.beta * ratio), torch.sigmoid(p.beta * ratio)
    losses = chosen * p.desirable_weight * chosen_losses + rejected * p.undesirable_weight * rejected_losses
    return losses.mean(), _kto_figures(policy, completion, (chosen, rejected), (p.beta * ratio.detach(), sums), kl)


def _kto_figures(
    policy: Any, completion: torch.Tensor, sides: tuple[torch.Tensor, torch.Tensor], values: tuple, kl: torch.Tensor
) -> Figures:
    rewards, sums = values
    figures: Figures = {"kl": kl, "entropy": _mean((policy.entropy.detach() * completion).sum(), completion.sum())}
    means = {}
    for name, side in zip(("chosen", "rejected"), sides, strict=True):
        tokens = completion * side.unsqueeze(1)
        figures[f"logits/{name}"] = _present(
            _mean((policy.mean_logits.detach() * tokens).sum(), tokens.sum()), tokens.sum()
        )
        count = side.sum()
        means[name] = _mean((rewards * side).sum(), count)
        figures[f"rewards/{name}"] = _present(means[name], count)
        figures[f"logps/{name}"] = _present(_mean((sums.detach() * side).sum(), count), count)
    both = torch.minimum(sides[0].sum(), sides[1].sum())
    figures["rewards/margins"] = _present(means["chosen"] - means["rejected"], both)
    return figures


def _present(value: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A figure TRL logs only when ``count`` > 0: the value and whether it is there."""
    return value, (count > 0).to(value.dtype)
