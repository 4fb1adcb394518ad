"""TRL's preference trainers on XLA SPMD FSDP: DPO, ORPO, CPO, SimPO and KTO on the glue of
:mod:`lowmem_tpu.train.trainer`, their losses on the devices (:mod:`lowmem_tpu.train.pair_loss`).

The rows come ready at a static shape (``lowmem_tpu.data.pairs``, KTO's ``data.unpaired``: TRL's own
tokenization, padded to ``data.max_length``), so TRL's dataset preparation is skipped and the step compiles
once (TRL pads each batch to its longest pair, a new program for every length: trl#2001). Every method runs on TRL's
``DPOTrainer`` (its data plumbing and reference handling); the loss is the method's own (``recipe.method``).

DPO's reference is the same model: with fresh adapters (B = 0) the policy with its adapters switched off,
so the frozen sharded base serves both and no copy is made; starting from a trained adapter
(``model.adapter``), TRL's frozen copy of it (the ``ref`` adapter). Precomputed
(``preference.precompute_ref_log_probs``, full-parameter DPO's way): the model as it is before training, run
once over the pairs; its log-probabilities ride with the rows (TRL's ``ref_chosen_logps`` columns) and no
step runs the reference. ORPO, CPO and SimPO have none: one policy pass per micro-batch. KTO's reference is
DPO's, run on the rows and on the KL rows made when a batch is collated; precomputed (full-parameter KTO's
way), on KL rows fixed once per micro-batch block of the dataset, as TRL's KTOTrainer fixes them.

Each micro-batch is one program: the policy's forward pass, the reference's, the loss and the backward pass
(trap ``per-step-item``: TRL's figures stay on the devices, read once per log).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from trl import DPOTrainer

from lowmem_tpu.config.methods import METHODS
from lowmem_tpu.console import say
from lowmem_tpu.data.pairs import collate_pairs
from lowmem_tpu.data.unpaired import KL_COLUMNS, REFERENCE_COLUMNS, collate_unpaired, with_kl_rows
from lowmem_tpu.errors import UserError
from lowmem_tpu.train import pair_loss
from lowmem_tpu.train.trainer import XlaTrainerMixin


class XlaPreferenceTrainer(XlaTrainerMixin, DPOTrainer):
    """DPOTrainer with the XLA glue: static preference batches, the method's loss and figures on the devices."""

    def __init__(self, *, fresh_adapters: bool = True, **kwargs: Any):
        unpaired = METHODS[kwargs["recipe"].method].rows == "unpaired"
        with _weights_unhashed():  # trap ``dpo-reference-hash``
            super().__init__(data_collator=collate_unpaired if unpaired else collate_pairs, **kwargs)
        self.method = METHODS[self.recipe.method]
        self.policy = self.model  # the PEFT model (transformers' FSDP path makes self.model the wrapper)
        self.weights_moved = False  # a checkpoint loaded or a step taken: no longer the starting model
        self._built = True
        if not self.method.reference:
            self.precompute_ref_logps = False  # set only so that TRL makes no reference copy (``train.args``)
        if (fresh_adapters or not self.method.reference) and "ref" in getattr(self.policy, "peft_config", {}):
            self.policy.delete_adapter("ref")  # B = 0: the reference is the base, adapters switched off
        elif self.recipe.lora.enabled and self.recipe.lora.dtype == "model":
            # TRL's ref copy is made in fp32: the policy's dtype, as it was
            from lowmem_tpu.model.lora import in_base_dtype, model_dtype

            in_base_dtype(self.policy, model_dtype(self.recipe))

    base_log = XlaTrainerMixin.base_log  # transformers': TRL's averages lists this trainer never fills

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
        unit = "rows" if self.method.rows == "unpaired" else "pairs"
        unscored = self._reference_keys()[0] not in self.train_dataset.column_names
        if unscored and len(self.train_dataset) > reads:
            say(
                f"note: the run reads {reads:,} of its {len(self.train_dataset):,} {unit}; all of them are scored by "
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
        """``dataset`` with the reference's log-probabilities of each example (TRL's ``ref_chosen_logps`` and
        ``ref_rejected_logps`` of a pair; ``ref_logps`` and ``ref_KL_logps`` of a KTO row and its KL row, the KL
        rows then fixed), computed on the devices by the model as it is now, which must be the starting model
        (TRL's rule); rows that already carry them are kept."""
        columns = self._reference_keys()
        if columns[0] in dataset.column_names:
            return dataset
        if self.weights_moved and not self.recipe.lora.enabled:  # LoRA's reference is frozen: any time will do
            raise RuntimeError(f"the {name} rows' reference is the starting model, whose weights have moved")
        if self.method.rows == "unpaired":
            dataset = with_kl_rows(dataset, self.args.per_device_train_batch_size)
        if self.placeholder_weights:  # a step measured, never trained: the values do not matter
            values = [[0.0] * len(dataset)] * len(columns)
        else:
            values = reference_logps(self, dataset, name)
        for column, value in zip(columns, values, strict=True):
            dataset = dataset.add_column(column, value)
        return dataset

    def _reference_keys(self) -> tuple[str, ...]:
        if self.method.rows != "unpaired":
            return "ref_chosen_logps", "ref_rejected_logps"
        return REFERENCE_COLUMNS if self._with_kl else REFERENCE_COLUMNS[:1]

    @property
    def _with_kl(self) -> bool:
        return self.method.rows == "unpaired" and self.recipe.preference.kto_loss == "kto"

    def _prepare_dataset(self, dataset: Any, *args: Any, **kwargs: Any) -> Any:
        return dataset  # rows made by lowmem_tpu.data.pairs or data.unpaired

    def _set_signature_columns_if_needed(self) -> None:
        self._signature_columns = ["input_ids", "attention_mask", "completion_mask", "label"]

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False, **kwargs):
        mode = "train" if model.training else "eval"
        ids, attention, completion = inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"]
        if self.method.reference:  # DPO scores the completion's tokens
            labels = ids.masked_fill(completion == 0, -100)
            scored = {"labels": labels}
        else:
            scored = {"shift_labels": pair_loss.every_position(ids)}
        outputs = model(input_ids=ids, attention_mask=attention, **scored, use_cache=False, fused_lm_head=True)
        p, name = self.recipe.preference, self.method.name
        pairs = pair_loss.Pairs.of(outputs, completion) if self.method.pairs else None
        if name == "kto":
            logps = self._kto_logps(model, inputs, labels)
            loss, figures = pair_loss.kto(outputs, completion, inputs["label"], logps, p)
        elif name == "dpo":
            loss, figures = pair_loss.dpo(pairs, self._reference(model, inputs, labels), p)
        elif name == "orpo":
            loss, figures = pair_loss.orpo(pairs, attention, p)
        else:
            loss, figures = pair_loss.cpo(pairs, "simpo" if name == "simpo" else p.loss_type[0], p)
        self.device_metrics.add(mode, tokens=attention.sum(), label_tokens=completion[:, 1:].sum())
        self.device_metrics.add_means(mode, figures)
        return (loss, outputs) if return_outputs else loss

    def _kto_logps(self, model: torch.nn.Module, inputs: dict[str, Any], labels: torch.Tensor) -> tuple:
        """KTO's other passes, without gradients: the reference on the rows, the policy and the reference on the
        KL rows (none for apo_zero_unpaired), TRL's order and forms (``KTOTrainer._compute_kl_logps``)."""
        kl_inputs, kl_labels = _kl_rows(inputs)
        with torch.no_grad():
            kl_policy = self._sequence_logps(model, kl_inputs, kl_labels) if self._with_kl else None
        if "ref_logps" in inputs:
            return inputs["ref_logps"], kl_policy, inputs.get("ref_KL_logps")
        reference, kl_reference = self._kto_reference(model, inputs, labels, kl_inputs, kl_labels)
        return reference, kl_policy, kl_reference

    def _kto_reference(self, model: torch.nn.Module, inputs: dict, labels: torch.Tensor, *kl_rows: Any) -> tuple:
        """The reference on a KTO batch's rows and (with the KL term) on its KL rows ``(inputs, labels)``."""
        kl_reference = self._reference(model, *kl_rows) if self._with_kl else None
        return self._reference(model, inputs, labels), kl_reference

    def _sequence_logps(self, model: torch.nn.Module, inputs: dict[str, Any], labels: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=labels,
                    use_cache=False, fused_lm_head=True)  # fmt: skip
        completion = inputs["completion_mask"][:, 1:].to(out.log_probs.dtype)
        return pair_loss.sequence_logps(out.log_probs, completion, self.recipe.preference.ld_alpha)

    def _reference(self, model: torch.nn.Module, inputs: dict[str, Any], labels: torch.Tensor) -> torch.Tensor:
        """The reference's sequence log-probabilities, ``[2B]``: read from the rows when precomputed, else its
        forward pass in the step's own program."""
        if "ref_chosen_logps" in inputs:
            return torch.cat([inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]])
        with torch.no_grad(), as_reference(self.policy):
            return self._sequence_logps(model, inputs, labels)


def _kl_rows(inputs: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor]:
    """A KTO batch's KL rows as model inputs, and their labels (the completion's tokens scored)."""
    kl_inputs = {name.removeprefix("KL_"): inputs[name] for name in KL_COLUMNS}
    return kl_inputs, kl_inputs["input_ids"].masked_fill(kl_inputs["completion_mask"] == 0, -100)


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


def as_reference(peft: Any) -> Any:
    """The policy as its reference, TRL's way: its frozen ``ref`` adapter where it keeps one, else no adapter;
    a model without adapters (full-parameter DPO, before training) as it is."""
    from trl.trainer.utils import use_adapter

    if not hasattr(peft, "peft_config"):
        return contextlib.nullcontext()
    return use_adapter(peft, "ref" if "ref" in peft.peft_config else None)


def reference_logps(trainer: XlaPreferenceTrainer, dataset: Any, name: str) -> list[list[float]]:
    """The reference's summed log-probabilities of each example, one list per reference column (TRL's
    ``compute_ref_log_probs``: a pair's chosen and rejected completion; a KTO row and its KL row): the reference
    pass a step would run, one static micro-batch at a time, so that before training the policy equals its
    reference. The last micro-batch is filled up with the first examples (static shapes), their values dropped."""
    import math
    import time

    n, micro = len(dataset), trainer.args.per_device_eval_batch_size
    unit = "rows" if trainer.method.rows == "unpaired" else "pairs"
    filled = dataset.select([i % n for i in range(n + (-n) % micro)])
    every = math.ceil(len(filled) // micro / 10)
    model, started, sums = trainer.fsdp_model, time.perf_counter(), []
    say(f"reference log-probabilities of {n:,} {name} {unit}: one forward pass before training")
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for index, batch in enumerate(trainer.get_eval_dataloader(filled), 1):
            labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
            if trainer.method.rows == "unpaired":
                sums_of = trainer._kto_reference(model, batch, labels, *_kl_rows(batch))
                columns = [column for column in sums_of if column is not None]
            else:  # the rows: every chosen, then every rejected
                columns = trainer._reference(model, batch, labels).chunk(2)
            sums.append(torch.stack(columns).cpu())
            if index % every == 0:
                say(f"  {min(index * micro, n):,}/{n:,} {name} {unit} ({time.perf_counter() - started:.0f} s)")
    model.train(was_training)
    say(f"reference log-probabilities: {n:,} {name} {unit} in {time.perf_counter() - started:.1f} s")
    return torch.cat(sums, dim=1)[:, :n].tolist()


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
