"""The recipe as TRL's ``SFTConfig`` or ``DPOConfig``, for the XLA FSDPv2 path (wrapping and
checkpointing are ours)."""

from __future__ import annotations

from typing import Any

from trl import DPOConfig, SFTConfig

from lowmem_tpu import hosts
from lowmem_tpu.config import Recipe
from lowmem_tpu.config.schema import reference_precomputed

OPTIMIZERS = {"adamw": "adamw_torch", "adafactor": "adafactor"}  # trap ``fused-adamw`` (train.trainer)


def training_args(recipe: Recipe, micro_batch: int) -> SFTConfig:
    """SFTConfig for the XLA FSDPv2 path (checkpointing, wrapping and the loss are ours)."""
    return SFTConfig(
        **_shared(recipe, micro_batch),
        router_aux_loss_coef=recipe.train.router_aux_loss_coef,
        dataset_kwargs={"skip_prepare_dataset": True},
        max_length=recipe.data.max_length,
        packing=False,
    )


def preference_args(recipe: Recipe, micro_batch: int) -> DPOConfig:
    """DPOConfig for the XLA FSDPv2 path, every preference method's (their losses are ``train.pair_loss``'s);
    the rows come ready (``lowmem_tpu.data.pairs``), so TRL's truncation never applies. A method without a
    reference says ``precompute_ref_log_probs`` so that TRL makes no reference copy (trap ``dpo-reference-hash``);
    the trainer then computes none."""
    from lowmem_tpu.config.methods import METHODS

    p = recipe.preference
    return DPOConfig(
        **_shared(recipe, micro_batch),
        beta=p.beta,
        loss_type=list(p.loss_type),
        label_smoothing=p.smoothing,
        loss_weights=p.loss_weights,
        f_divergence_type=p.f_divergence_type,
        f_alpha_divergence_coef=p.f_alpha_divergence_coef,
        use_weighting=p.use_weighting,
        ld_alpha=p.ld_alpha,
        discopop_tau=p.discopop_tau,
        max_length=None,
        disable_dropout=True,
        precompute_ref_log_probs=reference_precomputed(recipe) or not METHODS[recipe.method].reference,
    )


def _shared(recipe: Recipe, micro_batch: int) -> dict[str, Any]:
    t = recipe.train
    return dict(
        output_dir=recipe.output_dir,
        max_steps=t.max_steps,
        per_device_train_batch_size=micro_batch,  # one SPMD process: "per device" is the whole micro-batch
        per_device_eval_batch_size=micro_batch,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        learning_rate=t.learning_rate,
        # transformers' ``constant`` ignores warm-up; ``constant_with_warmup`` is what the recipe says
        lr_scheduler_type="constant_with_warmup" if t.lr_scheduler == "constant" and t.warmup_steps else t.lr_scheduler,
        warmup_steps=t.warmup_steps,
        optim=OPTIMIZERS[t.optimizer],
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        logging_steps=t.logging_steps,
        eval_strategy="steps" if t.eval_steps and (recipe.data.eval_path or recipe.data.eval_fraction) else "no",
        eval_steps=t.eval_steps,
        save_strategy="steps" if t.save_steps else "no",
        save_steps=t.save_steps or 500,
        report_to=t.reporters if hosts.is_main() else [],  # one host reports a pod slice's run
        seed=t.seed,
        data_seed=t.seed,
        bf16=False,  # weights are already in the recipe's dtype; no autocast
        gradient_checkpointing=False,  # trap ``gradient-checkpointing``: torch_xla's, in xla.sharding
        fsdp=["full_shard"],  # trap ``fsdp-string``
        fsdp_config={"xla": True, "xla_fsdp_v2": True, "xla_fsdp_grad_ckpt": False},
        remove_unused_columns=False,
        dataloader_pin_memory=False,  # nothing to pin for XLA; torchax (scan_layers) breaks pinning
        dataloader_drop_last=True,  # a short last batch would be a new shape, hence a recompilation
        disable_tqdm=True,
    )
