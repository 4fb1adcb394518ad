"""TRL's trainers on XLA SPMD FSDP: only the glue. Each override is a few lines that call
:mod:`~lowmem_tpu.train.checkpoint` (the on-disk format, written and read),
:mod:`~lowmem_tpu.train.metrics` (sums kept on the device, throughput, MFU, memory) or
:mod:`~lowmem_tpu.train.steady` (step 1 made the steady step).

:class:`XlaTrainerMixin` is what any TRL trainer needs on this stack (wrapping, the optimizer,
checkpoints, resume, logging); :class:`XlaSFTTrainer` mixes it into ``SFTTrainer`` and adds SFT's
collator and loss; ``train.preference.XlaPreferenceTrainer`` mixes it into ``DPOTrainer``.

The traps of plain TRL on XLA, listed here and nowhere else; code and docs name them (trap ``NAME``):

- ``no-optimizer``: transformers creates no optimizer on its XLA FSDP path: ``_wrap_model`` creates it
  from the wrapped model.
- ``logits-none``: TRL's fused LM head returns ``logits=None``, which transformers' ``shard_output``
  rejects: ours (``xla.sharding.shard_output``) shards the first batch-major tensor there is.
- ``gradient-checkpointing``: torch's gradient checkpointing fails on XLA: it is off (``train.args``), and
  torch_xla's ``checkpoint_module`` wraps each decoder layer (``xla.sharding``; with the embedding output
  requiring grad, or torch_xla skips the first layer).
- ``fused-adamw``: ``adamw_torch_fused`` refuses XLA tensors: ``adamw_torch`` or Adafactor (``train.args``).
- ``save-model``: ``trainer.save_model()`` writes a full model and loses the adapter: it refuses here, and
  ``publish.export`` saves the adapter from the unwrapped PEFT model, names recorded before wrapping, and
  reads it back before reporting success.
- ``fsdp-string``: ``fsdp="full_shard"`` as a string is deprecated: a list is passed (``train.args``).
- ``resume-at-max-steps``: resumed from a checkpoint at ``max_steps`` (a run killed while writing final/),
  transformers 5 trains one step more before it checks the step count: nothing is trained (the fault
  matrix found it).
- ``first-step-program``: step 1's program differs from step 2's, which then compiles again:
  ``train.steady`` gives step 1 step 2's inputs.
- ``per-step-item``: TRL's per-step ``.item()`` calls would cut every step's graph in two and sync the
  host: the loss and its metrics stay on the device between logs (``train.metrics.DeviceMetrics``), and
  the TRL trainer's own ``log``, whose per-step lists are not filled, is skipped.
- ``unrolled-accumulation``: micro-batches traced together run every forward pass before any backward
  pass, so accumulation saves nothing (5.06 -> 22.0 MiB for 1 -> 8 micro-batches unrolled; flat with a
  cut after each backward): one micro-batch per XLA program.
- ``whole-gradients``: a micro-batch's program hands its accumulated gradients to the next one with no
  sharding asked for, and SPMD then outputs them whole on every chip (Open Llama 7B's full fine-tuning on
  v5e-16, 1 row x 2 micro-batches: 27.9 GiB a chip against 7.5 for 2 rows in one program, by the TPU
  compiler): full fine-tuning's gradients are sharded like their weights before the cut. LoRA's are left
  as they are: the adapters' gradients are at most a few hundred MB whole (Llama 3.1 8B, rank 16, fp32).
- ``resume-rng``: on resume the Trainer restores the RNG after fetching the step's batches, but
  torch_xla's device loader advances the XLA seed once per batch (it cuts a graph per batch): those
  advances are replayed, so dropout draws exactly what the uninterrupted run drew.
- ``preference-item``: TRL's preference losses read each metric with ``.item()`` and sum some through
  boolean masks: on XLA each read runs the graph that makes it (the forward pass again) and each masked sum
  has a shape set by the data (a compile per batch). The losses are written for the devices at static shapes
  (``train.pair_loss``), checked against TRL's own: one program per micro-batch, the figures read per log.
- ``dpo-reference-hash``: with ``precompute_ref_log_probs`` TRL's DPOTrainer hashes every weight on the host
  when it is built (its cache key), a sharded model brought to one host; without it and without adapters TRL
  loads a second copy of the model as the reference. The flag is set and the hash skipped: the reference's
  log-probabilities are computed on the devices when training starts (``train.preference``).
- ``loader-threads``: torch_xla's device loader starts prefetching threads at each iteration; a run that
  stops mid-epoch leaves them blocked on a full queue, batches held, for the life of the process: they
  are closed after ``train()``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from trl import SFTTrainer

from lowmem_tpu.config import Recipe
from lowmem_tpu.config.schema import uses_master_weights
from lowmem_tpu.data import collate
from lowmem_tpu.model import torch_dtype
from lowmem_tpu.model.attention import packed_inputs
from lowmem_tpu.model.loss import add_chunked_loss
from lowmem_tpu.model.names import ParamNames
from lowmem_tpu.train import checkpoint as ckpt
from lowmem_tpu.train import steady
from lowmem_tpu.train.master import fp32_copy, with_master_weights
from lowmem_tpu.train.metrics import DeviceMetrics
from lowmem_tpu.xla import runtime as rt
from lowmem_tpu.xla.sharding import wrap_model


def trainer_kwargs(
    recipe: Recipe,
    runtime: rt.Runtime,
    model: torch.nn.Module,
    train_dataset: Any,
    tokenizer: Any,
    callbacks: list[TrainerCallback],
    *,
    eval_dataset: Any = None,
    flops_per_token: float | None = None,
    planned_bytes: int | None = None,
    base_reference: str | None = None,
) -> dict[str, Any]:
    """What every trainer of a run takes besides its TRL config: :class:`XlaTrainerMixin`'s and the Trainer's."""
    return {
        "recipe": recipe,
        "runtime": runtime,
        "names": ParamNames(model),
        "flops_per_token": flops_per_token,
        "planned_bytes": planned_bytes,
        "base_reference": base_reference,
        "model": model,
        "train_dataset": train_dataset,
        "eval_dataset": eval_dataset,
        "processing_class": tokenizer,
        "callbacks": callbacks,
    }


class XlaTrainerMixin:
    """Mixed in before a TRL trainer class: its model is wrapped by :func:`lowmem_tpu.xla.sharding.wrap_model`.

    Six of the overrides are private Trainer methods (transformers 5.24): ``_run_epoch``, ``_load_rng_state``,
    ``_wrap_model``, ``_save_checkpoint``, ``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``.
    """

    def __init__(
        self,
        *,
        recipe: Recipe,
        runtime: rt.Runtime,
        names: Any,
        flops_per_token: float | None = None,
        planned_bytes: int | None = None,
        base_reference: str | None = None,
        **kwargs: Any,
    ):
        self.recipe = recipe
        self.runtime = runtime
        self.names = names  # ParamNames: clean names of the parameters, taken before wrapping
        self.base_reference = base_reference  # where an adapter's base lives (for exported checkpoints)
        self.device_metrics = DeviceMetrics(recipe, runtime, flops_per_token, planned_bytes)
        self._fsdp_model: torch.nn.Module | None = None
        self._step_inputs_made = False
        self.placeholder_weights = False  # set by the TPU compiler's trace (measure.child)
        self.save_compiles: dict[int, int] = {}  # step -> XLA compilations its checkpoint caused
        self.save_seconds: dict[int, float] = {}  # step -> seconds its checkpoint took
        self._device_loaders: list[Any] = []  # the train dataloaders handed out, closed after train()
        super().__init__(**kwargs)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        self.device_metrics.start(self.state.global_step)
        self._batches_just_fetched = 0
        try:
            return super().train(*args, **kwargs)
        finally:
            self._close_device_loaders()

    def get_train_dataloader(self) -> Any:
        loader = super().get_train_dataloader()
        self._device_loaders.append(loader)
        return loader

    def _close_device_loaders(self) -> None:
        """Trap ``loader-threads``: ``ParallelLoader.close`` wakes and joins the threads that feed the device.

        On XLA, accelerate wraps each dataloader in torch_xla's ``MpDeviceLoader``, and each iteration
        of it starts a ``ParallelLoader`` (torch_xla 2.9, ``distributed/parallel_loader.py``).
        """
        for loader in self._device_loaders:
            parallel = getattr(loader, "_parallel_loader", None)
            if parallel is not None:
                parallel.close()
                loader._parallel_loader = None
        self._device_loaders.clear()

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Any:
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.args.gradient_accumulation_steps > 1:
            if not self.recipe.lora.enabled:
                self._shard_gradients()  # trap ``whole-gradients``
            rt.sync()  # trap ``unrolled-accumulation``: one micro-batch per XLA program
        return loss

    def _shard_gradients(self) -> None:
        from lowmem_tpu.xla.sharding import shard_like

        for param in self.names.params.values():
            if param.grad is not None:
                shard_like(param.grad, param, self.runtime, self.recipe.sharding.strategy)

    def _make_step_inputs(self) -> None:
        """Step 1's inputs as step 2 will have them, so that the step compiles once (trap ``first-step-program``)."""
        self._step_inputs_made = True
        trainable = (p for p in self.names.params.values() if p.requires_grad)
        strategy, placeholders = self.recipe.sharding.strategy, self.placeholder_weights
        steady.make_step_state(self.optimizer, trainable, self.runtime, strategy, placeholders=placeholders)
        # ``_tr_loss``: the Trainer's on-device loss sum (transformers 5.24 trainer.py, _inner_training_loop)
        steady.replicate_running([*self.device_metrics.zeros("train"), self._tr_loss], self.runtime)

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        steady.no_zero_first_rate(scheduler)  # trap ``first-step-program``
        return scheduler

    def _run_epoch(self, *args: Any, **kwargs: Any) -> None:
        # Trap ``resume-at-max-steps``: transformers checks ``max_steps`` only after a step.
        if self.state.global_step >= self.state.max_steps:
            self.control.should_training_stop = True
            return
        if not self._step_inputs_made:
            self._make_step_inputs()
        super()._run_epoch(*args, **kwargs)

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._batches_just_fetched = len(batches)
        return batches, num_items

    def _load_rng_state(self, checkpoint: str | None) -> None:
        super()._load_rng_state(checkpoint)
        for _ in range(self._batches_just_fetched if checkpoint else 0):
            rt.sync()  # trap ``resume-rng``: the seed advances of the batches fetched before it, replayed

    # Traps ``no-optimizer`` and ``gradient-checkpointing``: our FSDPv2 wrapping (once, for train and eval),
    # then the optimizer.
    def _wrap_model(self, model: torch.nn.Module, training: bool = True, dataloader: Any = None) -> torch.nn.Module:
        if self._fsdp_model is None:
            self._fsdp_model = wrap_model(model, self.recipe.sharding, self.runtime)
        if training and self.optimizer is None:
            self.create_optimizer(self._fsdp_model)
            if uses_master_weights(self.recipe):
                self.optimizer = with_master_weights(self.optimizer, self._fp32_copy)
        return self._fsdp_model

    def create_optimizer(self, model: Any = None) -> Any:
        """transformers' optimizer, or with ``lora.loraplus_lr_ratio`` PEFT's LoRA+ one (B's rate scaled)."""
        ratio = self.recipe.lora.loraplus_lr_ratio if self.recipe.lora.enabled else None
        if ratio is None or self.optimizer is not None:
            return super().create_optimizer(model)
        from peft.optimizers import create_loraplus_optimizer

        optimizer_cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, model)
        kwargs = {**kwargs, "lr": self.args.learning_rate, "loraplus_weight_decay": self.args.weight_decay}
        self.optimizer = create_loraplus_optimizer(model, optimizer_cls, loraplus_lr_ratio=ratio, **kwargs)
        return self.optimizer

    def _fp32_copy(self, param: torch.Tensor) -> torch.Tensor:
        return fp32_copy(param, self.runtime, self.recipe.sharding.strategy)

    @property
    def fsdp_model(self) -> torch.nn.Module:
        """The wrapped model (wrapping it now if training has not started)."""
        return self._wrap_model(self.model, training=False)

    # The log that receives the device figures: transformers' (not TRL's, which average lists filled by
    # per-step ``.item()`` calls: trap ``per-step-item``).
    base_log = Trainer.log

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "eval" if any(k.startswith("eval_") for k in logs) else "train"
        logs.update(self.device_metrics.figures(mode, self.state.global_step))
        type(self).base_log(self, logs, start_time)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        raise RuntimeError(
            "trap save-model: use lowmem_tpu.publish.export to save, trainer.save_model loses the LoRA adapter"
        )

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        step, compiles, started = self.state.global_step, rt.compile_count(), time.perf_counter()
        self.last_checkpoint = ckpt.save(self)
        self.save_compiles[step] = rt.compile_count() - compiles
        self.save_seconds[step] = round(time.perf_counter() - started, 3)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        ckpt.load_trainable(self.names, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            strategy = self.recipe.sharding.strategy
            ckpt.load_optimizer_and_scheduler(self.optimizer, self.lr_scheduler, checkpoint, self.runtime, strategy)


class XlaSFTTrainer(XlaTrainerMixin, SFTTrainer):
    """SFTTrainer with the XLA glue: our collator (static shapes) and the loss with its on-device counts."""

    def __init__(self, **kwargs: Any):
        super().__init__(data_collator=collate, **kwargs)
        if self.recipe.train.chunked_loss:
            add_chunked_loss(self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model)

    def compute_loss(
        self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch=None
    ):
        mode = "train" if model.training else "eval"
        tokens = inputs["attention_mask"].sum()
        inputs = packed_inputs(inputs, self.recipe.model.attn_implementation, torch_dtype(self.recipe.model.dtype))
        labels = inputs["labels"][:, 1:]
        mask = labels != -100
        denominator = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        if self.recipe.train.chunked_loss:
            outputs = model(**inputs, use_cache=False, chunked_loss=True)
            loss, correct = outputs["loss"] / denominator, outputs["correct"]
            outputs = {"loss": loss}
        elif self.recipe.train.fused_lm_head:
            # TRL's chunked LM head: per-token log-probs, never the [batch, length, vocab] logits (trap
            # ``logits-none``: ``xla.sharding.shard_output`` shards them).
            outputs = model(**inputs, use_cache=False, fused_lm_head=True)
            loss = -outputs.log_probs.sum() / denominator
            correct = outputs.is_top1.sum()
        else:
            outputs = model(**inputs, use_cache=False, num_items_in_batch=denominator)
            loss = outputs.loss
            predicted = outputs.logits[:, :-1].argmax(-1)
            correct = ((predicted == labels) & mask).sum()
        self.device_metrics.add(mode, tokens=tokens, label_tokens=mask.sum(), correct=correct)
        return (loss, outputs) if return_outputs else loss
