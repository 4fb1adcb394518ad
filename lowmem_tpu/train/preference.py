"""TRL's ``DPOTrainer`` on XLA SPMD FSDP: the glue of :mod:`lowmem_tpu.train.trainer`, TRL's loss and metrics.

The rows come ready at a static shape (``lowmem_tpu.data.preference``: TRL's own tokenization, padded to
``data.max_length``), so TRL's dataset preparation is skipped and the step compiles once (TRL pads each
batch to its longest pair, a new program for every length: trl#2001).

The reference is the same model: with fresh adapters (B = 0) the policy with its adapters switched off,
so the frozen sharded base serves both and no copy is made; starting from a trained adapter
(``model.adapter``), TRL's frozen copy of it (the ``ref`` adapter).

Trap ``dpo-metrics``: TRL reads each metric with ``.item()`` inside the loss. On XLA each read runs the
graph that makes that value, and without a cut that graph is the whole forward pass, again for every
metric. The model's outputs are made device data as the forward pass ends (a sync: one program for the
forward passes, a few tiny ones that read the metrics, one for the backward pass and the update), so
each read moves a scalar. Every one of those programs has a static shape: none compiles after warm-up.
"""

from __future__ import annotations

from typing import Any

import torch
from trl import DPOTrainer

from lowmem_tpu.data.preference import collate_pairs
from lowmem_tpu.model.names import ParamNames
from lowmem_tpu.train.args import preference_args
from lowmem_tpu.train.trainer import XlaTrainerMixin
from lowmem_tpu.xla import runtime as rt


class XlaDPOTrainer(XlaTrainerMixin, DPOTrainer):
    """DPOTrainer with the XLA glue: static preference batches, TRL's loss, metrics read after a cut."""

    def __init__(self, *, fresh_adapters: bool = True, **kwargs: Any):
        super().__init__(data_collator=collate_pairs, **kwargs)
        self.policy = self.model  # the PEFT model (transformers' FSDP path makes self.model the wrapper)
        if fresh_adapters and "ref" in getattr(self.policy, "peft_config", {}):
            self.policy.delete_adapter("ref")  # B = 0: the reference is the base, adapters switched off
        self.policy.register_forward_hook(_made_device_data)

    def _prepare_dataset(self, dataset: Any, *args: Any, **kwargs: Any) -> Any:
        return dataset  # rows made by lowmem_tpu.data.preference

    def _set_signature_columns_if_needed(self) -> None:
        self._signature_columns = ["input_ids", "attention_mask", "completion_mask"]

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False, **kwargs):
        mode = "train" if model.training else "eval"
        completions = inputs["completion_mask"][:, 1:]
        self.device_metrics.add(mode, tokens=inputs["attention_mask"].sum(), label_tokens=completions.sum())
        wrapper, self.model = self.model, self.policy  # TRL finds the adapters to switch off on self.model
        try:
            return DPOTrainer.compute_loss(self, model, inputs, return_outputs)
        finally:
            self.model = wrapper

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "eval" if any(k.startswith("eval_") for k in logs) else "train"
        logs.update(self.device_metrics.figures(mode, self.state.global_step))
        DPOTrainer.log(self, logs, start_time)  # TRL's: the rewards, margins and accuracies it averaged


def _made_device_data(module: torch.nn.Module, args: Any, output: Any) -> Any:
    rt.sync()  # trap ``dpo-metrics``
    return output


def build_preference_trainer(
    recipe: Any,
    runtime: rt.Runtime,
    model: torch.nn.Module,
    train_dataset: Any,
    tokenizer: Any,
    micro_batch: int,
    callbacks: list[Any],
    *,
    eval_dataset: Any = None,
    flops_per_token: float | None = None,
    planned_bytes: int | None = None,
    base_reference: str | None = None,
) -> XlaDPOTrainer:
    """The DPO trainer of a run, on a model already placed on the devices (``build_trainer``'s twin)."""
    return XlaDPOTrainer(
        fresh_adapters=recipe.model.adapter is None,
        recipe=recipe,
        runtime=runtime,
        names=ParamNames(model),
        flops_per_token=flops_per_token,
        planned_bytes=planned_bytes,
        base_reference=base_reference,
        model=model,
        args=preference_args(recipe, micro_batch),
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
    )
