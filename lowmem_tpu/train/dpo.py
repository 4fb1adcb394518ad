"""TRL's ``DPOTrainer`` on XLA SPMD FSDP: the glue of :mod:`lowmem_tpu.train.trainer`, TRL's loss and metrics.

The rows come ready at a static shape (``lowmem_tpu.data.pairs``: TRL's own tokenization, padded to
``data.max_length``), so TRL's dataset preparation is skipped and the step compiles once (TRL pads each
batch to its longest pair, a new program for every length: trl#2001).

The reference is the same model: with fresh adapters (B = 0) the policy with its adapters switched off,
so the frozen sharded base serves both and no copy is made; starting from a trained adapter
(``model.adapter``), TRL's frozen copy of it (the ``ref`` adapter). Precomputed
(``preference.precompute_ref_log_probs``, full-parameter DPO's way): the model as it is before training, run
once over the pairs; its log-probabilities ride with the rows (TRL's ``ref_chosen_logps`` columns) and no
step runs the reference.

TRL's ``_compute_loss`` runs unchanged on host copies of the forward passes' outputs (trap
``dpo-on-the-host``): the devices run programs of static shape per micro-batch (the policy's forward pass,
the reference's unless precomputed, the backward pass); the host computes TRL's loss and metrics in between.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from trl import DPOTrainer

from lowmem_tpu.console import say
from lowmem_tpu.data.pairs import collate_pairs
from lowmem_tpu.errors import UserError
from lowmem_tpu.train.args import preference_args
from lowmem_tpu.train.trainer import XlaTrainerMixin, trainer_kwargs
from lowmem_tpu.xla import runtime as rt


class XlaDPOTrainer(XlaTrainerMixin, DPOTrainer):
    """DPOTrainer with the XLA glue: static preference batches, TRL's loss and metrics on the host."""

    def __init__(self, *, fresh_adapters: bool = True, **kwargs: Any):
        with _weights_unhashed():  # trap ``dpo-reference-hash``
            super().__init__(data_collator=collate_pairs, **kwargs)
        self.policy = self.model  # the PEFT model (transformers' FSDP path makes self.model the wrapper)
        self.one_program = False  # set where the step is measured, not trained (``measure.child``)
        self.weights_moved = False  # a checkpoint loaded or a step taken: no longer the starting model
        self._built = True
        if fresh_adapters and "ref" in getattr(self.policy, "peft_config", {}):
            self.policy.delete_adapter("ref")  # B = 0: the reference is the base, adapters switched off
        elif self.recipe.lora.enabled and self.recipe.lora.dtype == "model":
            # TRL's ref copy is made in fp32: the policy's dtype, as it was
            from lowmem_tpu.model.lora import in_base_dtype, model_dtype

            in_base_dtype(self.policy, model_dtype(self.recipe))

    base_log = DPOTrainer.log  # TRL's: the rewards, margins and accuracies it averaged
    _built = False  # True once __init__ is done (TRL calls ``_precompute_ref_logps`` inside it)

    def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
        # TRL calls it when the trainer is built (ours waits until training or scoring starts: the measured
        # step's flags are set after that) and from ``evaluate(dataset)``
        return self._with_reference(dataset, name) if self._built else dataset

    def _reference_columns(self) -> None:
        """The training and held-out pairs with their reference's log-probabilities, while the weights are
        still the starting model's."""
        if not self.precompute_ref_logps:
            return
        reads = self.recipe.train.global_batch_size * self.recipe.train.max_steps
        if "ref_chosen_logps" not in self.train_dataset.column_names and len(self.train_dataset) > reads:
            say(
                f"note: the run reads {reads:,} of its {len(self.train_dataset):,} pairs; all of them are scored by "
                f"the reference (data.max_samples={reads} scores only as many)"
            )
        self.train_dataset = self._with_reference(self.train_dataset, "train")
        if self.eval_dataset is not None:
            self.eval_dataset = self._with_reference(self.eval_dataset, "eval")

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        self._reference_columns()  # from the starting weights, before the checkpoint's replace them
        self.weights_moved = True
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        self._reference_columns()
        self.weights_moved = True
        return super().train(*args, **kwargs)

    def evaluate(self, eval_dataset: Any = None, **kwargs: Any) -> dict[str, float]:
        if self.precompute_ref_logps and eval_dataset is None and self.eval_dataset is not None:
            self.eval_dataset = self._with_reference(self.eval_dataset, "eval")
        return super().evaluate(eval_dataset, **kwargs)

    def _with_reference(self, dataset: Any, name: str) -> Any:
        """``dataset`` with the reference's log-probabilities of each pair (TRL's ``ref_chosen_logps`` and
        ``ref_rejected_logps``), computed on the devices by the model as it is now, which must be the
        starting model (TRL's rule); rows that already carry them are kept."""
        if "ref_chosen_logps" in dataset.column_names:
            return dataset
        if self.weights_moved and not self.recipe.lora.enabled:  # LoRA's reference is frozen: any time will do
            raise RuntimeError(f"the {name} pairs' reference is the starting model, whose weights have moved")
        if self.placeholder_weights or self.one_program:  # a step measured, never trained: the values do not matter
            chosen = rejected = [0.0] * len(dataset)
        else:
            chosen, rejected = reference_logps(self, dataset, name)
        return dataset.add_column("ref_chosen_logps", chosen).add_column("ref_rejected_logps", rejected)

    def _prepare_dataset(self, dataset: Any, *args: Any, **kwargs: Any) -> Any:
        return dataset  # rows made by lowmem_tpu.data.pairs

    def _set_signature_columns_if_needed(self) -> None:
        self._signature_columns = ["input_ids", "attention_mask", "completion_mask"]

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False, **kwargs):
        mode = "train" if model.training else "eval"
        self.device_metrics.add(
            mode, tokens=inputs["attention_mask"].sum(), label_tokens=inputs["completion_mask"][:, 1:].sum()
        )
        if self.placeholder_weights or self.one_program:
            return self._one_program_loss(model, inputs)
        host = {key: torch.from_numpy(value) for key, value in inputs["host"].items()}  # trap ``dpo-on-the-host``
        policy = OnDevice(model, inputs, self.runtime)
        reference = None if self.precompute_ref_logps else OnDevice(model, inputs, self.runtime, self.policy)
        wrapper, self.model, self.ref_model = self.model, policy, reference
        accelerator, self.accelerator = self.accelerator, _OnTheHost(self.accelerator)
        try:
            result = DPOTrainer.compute_loss(self, policy, host, return_outputs)
        finally:
            self.model, self.ref_model, self.accelerator = wrapper, None, accelerator
        device = inputs["input_ids"].device  # the Trainer's backward starts on the devices
        return (result[0].to(device), result[1]) if return_outputs else result.to(device)

    def _one_program_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """The step a compiler sizes (``memory --compile``, never a run): the sigmoid DPO loss
        written on the devices, so that the policy's forward pass, the reference's (unless precomputed) and
        the backward pass are one program. A run computes TRL's own loss on the host between those passes
        (trap ``dpo-on-the-host``); the tensors the devices hold are the same."""
        import torch.nn.functional as F

        labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
        batch = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"], "labels": labels}
        policy = model(**batch, use_cache=False, fused_lm_head=True).log_probs.sum(-1)
        if self.precompute_ref_logps:  # read from the rows: no reference pass in the step
            reference = torch.zeros_like(policy).detach()
        else:
            with torch.no_grad(), as_reference(self.policy):
                reference = model(**batch, use_cache=False, fused_lm_head=True).log_probs.sum(-1)
        chosen, rejected = (policy - reference).chunk(2)
        return -F.logsigmoid(self.beta * (chosen - rejected)).mean()


class _OnTheHost:
    """The trainer's accelerator as TRL's loss sees it on the host: the tensors the loss makes on
    ``accelerator.device`` (exo_pair's epsilon) land on the CPU beside the log-probabilities, not on the devices."""

    device = torch.device("cpu")

    def __init__(self, accelerator: Any):
        self._accelerator = accelerator

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)


@contextlib.contextmanager
def _weights_unhashed() -> Iterator[None]:
    """Trap ``dpo-reference-hash``: with ``precompute_ref_log_probs`` TRL's ``DPOTrainer.__init__`` hashes every
    weight on the host (``hash_module``, its key for a cache of the reference's log-probabilities), which would
    bring a sharded model to one host; ours are computed on the devices and never cached, so nothing is hashed."""
    import trl.trainer.dpo_trainer as trl_dpo

    hashed = trl_dpo.hash_module
    trl_dpo.hash_module = lambda module: "not hashed: lowmem-tpu computes the reference on the devices"
    try:
        yield
    finally:
        trl_dpo.hash_module = hashed


class OnDevice(torch.nn.Module):
    """The model as TRL's loss calls it (trap ``dpo-on-the-host``): the forward pass on the devices, on the
    micro-batch they hold; host copies of its outputs back, differentiable.

    ``reference_of`` (the PEFT policy): its reference instead, TRL's way (``as_reference``)."""

    def __init__(
        self, model: torch.nn.Module, inputs: dict[str, Any], runtime: rt.Runtime, reference_of: Any = None
    ) -> None:  # ``reference_of`` a model without adapters: itself, as it is (``as_reference``)
        super().__init__()
        self.train(model.training)
        # Held outside nn.Module's registry: this view owns nothing and lives for one micro-batch.
        vars(self).update(wrapped=model, inputs=inputs, runtime=runtime, reference_of=reference_of)

    def forward(self, *, labels: torch.Tensor, **kwargs: Any) -> Any:
        from lowmem_tpu.xla.sharding import replicate

        device = self.inputs["input_ids"].device
        batch = {key: self.inputs[key] for key in ("input_ids", "attention_mask")}
        with as_reference(self.reference_of) if self.reference_of is not None else contextlib.nullcontext():
            outputs = self.wrapped(**batch, labels=labels.to(device), use_cache=False, fused_lm_head=True)
        for value in outputs.values():
            replicate(value, self.runtime.mesh)  # a replicated tensor comes to the host without a compile
        rt.sync()  # every live tensor device data: the backward pass reads them, nothing is run twice
        return type(outputs)(**{key: value.to("cpu") for key, value in outputs.items()})

    # torch_xla's checkpointing is in the wrapped layers (trap ``gradient-checkpointing``), not the model's own
    is_gradient_checkpointing = False


def as_reference(peft: Any) -> Any:
    """The policy as its reference, TRL's way: its frozen ``ref`` adapter where it keeps one, else no adapter;
    a model without adapters (full-parameter DPO, before training) as it is."""
    from trl.trainer.utils import use_adapter

    if not hasattr(peft, "peft_config"):
        return contextlib.nullcontext()
    return use_adapter(peft, "ref" if "ref" in peft.peft_config else None)


def reference_logps(trainer: XlaDPOTrainer, dataset: Any, name: str) -> tuple[list[float], list[float]]:
    """The reference's summed log-probabilities of each pair's chosen and rejected completion (TRL's
    ``compute_ref_log_probs``): the forward pass TRL's loss calls (``OnDevice``), one static micro-batch at a
    time, summed on the host as TRL sums the policy's, so that before training the policy equals its reference
    bit for bit. The last micro-batch is filled up with the first pairs (static shapes), their values dropped."""
    import math
    import time

    n, micro = len(dataset), trainer.args.per_device_eval_batch_size
    filled = dataset.select([i % n for i in range(n + (-n) % micro)])
    every = math.ceil(len(filled) // micro / 10)
    model, started, sums = trainer.fsdp_model, time.perf_counter(), []
    say(f"reference log-probabilities of {n:,} {name} pairs: one forward pass before training")
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for index, batch in enumerate(trainer.get_eval_dataloader(filled), 1):
            labels = torch.from_numpy(batch["host"]["input_ids"]).masked_fill(
                torch.from_numpy(batch["host"]["completion_mask"]) == 0, -100
            )
            outputs = OnDevice(model, batch, trainer.runtime, reference_of=trainer.policy)(labels=labels)
            sums.append(outputs.log_probs.sum(dim=1))
            if index % every == 0:
                say(f"  {min(index * micro, n):,}/{n:,} pairs ({time.perf_counter() - started:.0f} s)")
    model.train(was_training)
    chosen, rejected = zip(*(s.chunk(2) for s in sums), strict=True)  # rows: every chosen, then every rejected
    say(f"reference log-probabilities: {n:,} {name} pairs in {time.perf_counter() - started:.1f} s")
    return torch.cat(chosen)[:n].tolist(), torch.cat(rejected)[:n].tolist()


def load_reference(peft: Any, adapter_dir: Path) -> None:
    """The ``ref`` adapter set to the weights in ``adapter_dir``: scoring a run that started from that adapter
    against it (TRL made ``ref`` a copy of the adapter it was given, the trained one)."""
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    if "ref" not in peft.peft_config:
        raise UserError("the DPO reference adapter is missing: the run's adapter was loaded without TRL's ref copy")
    result = set_peft_model_state_dict(peft, load_file(str(adapter_dir / "adapter_model.safetensors")), "ref")
    missing = [key for key in result.missing_keys if ".ref." in key]
    if result.unexpected_keys or missing:
        raise UserError(
            f"model.adapter: {adapter_dir} does not fit this run's adapter ({len(missing)} weights missing, "
            f"{len(result.unexpected_keys)} unexpected); it is not the adapter this run started from"
        )


def build_preference_trainer(
    recipe: Any,
    runtime: rt.Runtime,
    model: torch.nn.Module,
    train_dataset: Any,
    tokenizer: Any,
    micro_batch: int,
    callbacks: list[Any],
    **extra: Any,
) -> XlaDPOTrainer:
    """The DPO trainer of a run, on a model already placed on the devices (``build_trainer``'s twin)."""
    kwargs = trainer_kwargs(recipe, runtime, model, train_dataset, tokenizer, callbacks, **extra)
    args = preference_args(recipe, micro_batch)
    return XlaDPOTrainer(fresh_adapters=recipe.model.adapter is None, args=args, **kwargs)
