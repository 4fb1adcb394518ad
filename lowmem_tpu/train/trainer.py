"""TRL's SFTTrainer on XLA SPMD FSDP, with the eight traps of this stack handled.

1. transformers creates no optimizer on its XLA FSDP path: we create it from the wrapped model.
2. TRL's fused LM head returns ``logits=None``: our ``shard_output`` shards what is there.
3. torch's gradient checkpointing fails on XLA: it is off, torch_xla's per-layer checkpointing is used.
4. ``adamw_torch_fused`` refuses XLA tensors: ``adamw_torch`` or Adafactor.
5. ``save_model`` loses the adapter: ``export`` saves it from the unwrapped PEFT model.
6. ``fsdp="full_shard"`` strings are deprecated: a list is passed.
7. Resumed from a checkpoint at ``max_steps`` (a run killed while writing final/), transformers 5 trains one
   step more before it checks the step count: nothing is trained (the fault matrix found it).
8. Step 1's program differs from step 2's, which then compiles again: :mod:`lowmem_tpu.train.steady`
   gives step 1 step 2's inputs.

Besides, the loss and its metrics stay on the device between logging steps: TRL's
per-step ``.item()`` calls would cut every step's graph in two and sync the host.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback
from trl import SFTTrainer

from lowmem_tpu import faults, hosts
from lowmem_tpu.config import Recipe
from lowmem_tpu.config.schema import uses_master_weights
from lowmem_tpu.data import collate
from lowmem_tpu.errors import NonFiniteError, UserError
from lowmem_tpu.files import disk_full, fresh_partial, write_json
from lowmem_tpu.model import torch_dtype
from lowmem_tpu.model.attention import packed_inputs
from lowmem_tpu.model.loss import add_chunked_loss
from lowmem_tpu.model.names import ParamNames
from lowmem_tpu.train import checkpoint as ckpt
from lowmem_tpu.train import steady
from lowmem_tpu.train.args import training_args
from lowmem_tpu.train.master import checkpoint_state, masters_of, restore_checkpoint_state, with_master_weights
from lowmem_tpu.xla import runtime as rt
from lowmem_tpu.xla import sharded_state
from lowmem_tpu.xla.sharding import place_like, replicate, wrap_model, zeros_placed
from lowmem_tpu.xla.transfer import to_host


def build_trainer(
    recipe: Recipe,
    runtime: rt.Runtime,
    model: torch.nn.Module,
    train_dataset: Any,
    tokenizer: Any,
    micro_batch: int,
    callbacks: list[TrainerCallback],
    *,
    eval_dataset: Any = None,
    flops_per_token: float | None = None,
    planned_bytes: int | None = None,
    base_reference: str | None = None,
) -> XlaSFTTrainer:
    """The trainer of a run (and of the memory measurement), on a model already placed on the devices."""
    return XlaSFTTrainer(
        recipe=recipe,
        runtime=runtime,
        names=ParamNames(model),
        flops_per_token=flops_per_token,
        planned_bytes=planned_bytes,
        base_reference=base_reference,
        model=model,
        args=training_args(recipe, micro_batch),
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
    )


class XlaSFTTrainer(SFTTrainer):
    """SFTTrainer whose model is wrapped by :func:`lowmem_tpu.xla.sharding.wrap_model`."""

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
        self.flops_per_token = flops_per_token
        self.planned_bytes = planned_bytes  # the planner's peak per device for this run
        self.base_reference = base_reference  # where an adapter's base lives (for exported checkpoints)
        self._fsdp_model: torch.nn.Module | None = None
        self._totals: dict[str, torch.Tensor] = {}
        self._step_inputs_made = False
        self.placeholder_weights = False  # set by the TPU compiler's trace (memory.step)
        self.save_compiles: dict[int, int] = {}  # step -> XLA compilations its checkpoint caused
        self.save_seconds: dict[int, float] = {}  # step -> seconds its checkpoint took
        self._last_log: tuple[float, dict[str, float]] | None = None
        self._device_loaders: list[Any] = []  # the train dataloaders handed out, closed after train()
        super().__init__(data_collator=collate, **kwargs)
        if recipe.train.chunked_loss:
            add_chunked_loss(self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        self._last_log = (time.perf_counter(), {"step": self.state.global_step})
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
        """Stop the threads that feed the device.

        On XLA, accelerate wraps each dataloader in torch_xla's ``MpDeviceLoader``, and each iteration of
        it starts a ``ParallelLoader``: daemon threads that prefetch batches onto the device. A run that
        stops mid-epoch (``max_steps``, a stop request, a refused trace) leaves them blocked on a full
        queue for the life of the process, batches held. ``ParallelLoader.close`` wakes and joins them
        (torch_xla 2.9, ``distributed/parallel_loader.py``).
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
            # One micro-batch per XLA program: traced together, every micro-batch's forward pass
            # ran before any backward pass, so accumulation saved nothing (5.06 -> 22.0
            # MiB for 1 -> 8 micro-batches unrolled; flat with a cut after each backward).
            rt.sync()
        return loss

    def _make_step_inputs(self) -> None:
        """Step 1's inputs as step 2 will have them, so that the step compiles once (``train.steady``)."""
        self._step_inputs_made = True
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate wraps ours
        steady.make_adam_state(optimizer, lambda p: zeros_placed(p, self.runtime, self.recipe.sharding.strategy))
        if not self.placeholder_weights:  # a placeholder can be traced, never run
            steady.update_in_place(p for p in self.names.params.values() if p.requires_grad)
        for key in ("tokens", "label_tokens", "correct"):
            self._totals.setdefault(f"train/{key}", torch.zeros((), device=self.runtime.device))
        # ``_tr_loss``: the Trainer's on-device loss sum (transformers 5.24 trainer.py, _inner_training_loop)
        for tensor in [*self._totals.values(), self._tr_loss]:
            replicate(tensor, self.runtime.mesh)
        rt.sync()

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        steady.no_zero_first_rate(scheduler)
        return scheduler

    def _run_epoch(self, *args: Any, **kwargs: Any) -> None:
        # Trap 7: transformers checks ``max_steps`` only after a step; a run resumed at (or past) it is done.
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
        # On resume the Trainer restores the RNG after fetching the step's batches, but torch_xla's
        # device loader advances the XLA seed once per batch (it cuts a graph per batch): replay
        # those advances so dropout draws exactly what the uninterrupted run drew.
        super()._load_rng_state(checkpoint)
        for _ in range(self._batches_just_fetched if checkpoint else 0):
            rt.sync()

    # Traps 1 and 3: our FSDPv2 wrapping (once, for train and eval), then the optimizer.
    def _wrap_model(self, model: torch.nn.Module, training: bool = True, dataloader: Any = None) -> torch.nn.Module:
        if self._fsdp_model is None:
            self._fsdp_model = wrap_model(model, self.recipe.sharding, self.runtime)
        if training and self.optimizer is None:
            self.create_optimizer(self._fsdp_model)
            if uses_master_weights(self.recipe):
                self.optimizer = with_master_weights(self.optimizer, self._fp32_copy)
        return self._fsdp_model

    def _fp32_copy(self, param: torch.Tensor) -> torch.Tensor:
        # Through the host, one tensor at a time, and placed as the weights were: an fp32 cast made on
        # the devices loses its sharding when a dimension does not divide by the device count (XLA
        # then keeps a replicated copy, measured on 8 CPU devices with a 172-wide projection).
        host = to_host(param.detach()).to(torch.float32)
        return place_like(host, param, self.runtime, self.recipe.sharding.strategy)

    @property
    def fsdp_model(self) -> torch.nn.Module:
        """The wrapped model (wrapping it now if training has not started)."""
        return self._wrap_model(self.model, training=False)

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
            # TRL's chunked LM head: per-token log-probs, never the [batch, length, vocab] logits.
            outputs = model(**inputs, use_cache=False, fused_lm_head=True)
            loss = -outputs.log_probs.sum() / denominator
            correct = outputs.is_top1.sum()
        else:
            outputs = model(**inputs, use_cache=False, num_items_in_batch=denominator)
            loss = outputs.loss
            predicted = outputs.logits[:, :-1].argmax(-1)
            correct = ((predicted == labels) & mask).sum()
        self._accumulate(mode, tokens=tokens, label_tokens=mask.sum(), correct=correct)
        return (loss, outputs) if return_outputs else loss

    def _accumulate(self, mode: str, **values: torch.Tensor) -> None:
        for key, value in values.items():
            name = f"{mode}/{key}"
            value = value.detach().float()
            self._totals[name] = self._totals[name] + value if name in self._totals else value

    def read_totals(self, mode: str) -> dict[str, float]:
        """Host copies of the running device-side sums (a sync: call at logging time only)."""
        names = [name for name in self._totals if name.startswith(f"{mode}/")]
        values = torch.stack([self._totals[n] for n in names]).cpu().tolist() if names else []
        return {n.split("/", 1)[1]: v for n, v in zip(names, values, strict=True)}

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "eval" if any(k.startswith("eval_") for k in logs) else "train"
        totals = self.read_totals(mode)
        if mode == "train":
            logs.update(self._throughput(totals))
            logs.update(self._memory())
        elif totals:
            logs["eval_token_accuracy"] = totals["correct"] / max(totals["label_tokens"], 1)
            for name in [n for n in self._totals if n.startswith("eval/")]:
                del self._totals[name]  # each evaluation reports its own figures
        # Skip SFTTrainer.log: its per-step metric lists are not filled here.
        super(SFTTrainer, self).log(logs, start_time)

    def _throughput(self, totals: dict[str, float]) -> dict[str, float]:
        now, step = time.perf_counter(), self.state.global_step
        if not totals:
            return {}
        previous_time, previous = self._last_log or (now, {"step": step})
        self._last_log = (now, totals | {"step": step})
        steps = step - previous["step"]
        delta = {k: totals[k] - previous.get(k, 0.0) for k in totals}
        out = {"token_accuracy": delta["correct"] / max(delta["label_tokens"], 1)}
        if steps and now > previous_time:
            seconds = now - previous_time
            out |= {
                "step_time": seconds / steps,
                "tokens_per_second": delta["tokens"] / seconds,
                "tokens_per_second_per_device": delta["tokens"] / seconds / self.runtime.num_devices,
            }
            if self.runtime.peak_flops and self.flops_per_token:
                # Padding tokens are computed too: count every position, not only real tokens.
                positions = steps * self.recipe.train.global_batch_size * self.recipe.data.max_length
                achieved = positions * self.flops_per_token / seconds / self.runtime.num_devices
                out["mfu"] = achieved / self.runtime.peak_flops
        return out

    def _memory(self) -> dict[str, float]:
        """Per-device memory for the log line: the plan always, the device's figures where it keeps them."""
        out = {"memory_planned_gib": self.planned_bytes / 2**30} if self.planned_bytes else {}
        devices = self.runtime.memory_per_device()
        if devices:
            out["memory_used_gib"] = max(d["used"] for d in devices) / 2**30
            out["memory_peak_gib"] = max(d["peak"] for d in devices) / 2**30
            out["memory_limit_gib"] = min(d["limit"] for d in devices) / 2**30
        return out

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        raise RuntimeError("trap 5: use lowmem_tpu.publish.export to save, trainer.save_model loses the LoRA adapter")

    # Checkpoints: sharded state in DCP form (every host writes its shards), host 0 writes the rest.
    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        step, compiles, started = self.state.global_step, rt.compile_count(), time.perf_counter()
        trainable = {f"{ckpt.TRAINABLE}{n}": p.detach() for n, p in self.names.params.items() if p.requires_grad}
        optimizer, groups = ckpt.optimizer_entries(checkpoint_state(self.optimizer))
        fetched = sharded_state.fetch(trainable | optimizer)
        bad = [k for k in trainable if not all(torch.isfinite(v).all() for v in sharded_state.host_values(fetched[k]))]
        if not hosts.all_true(not bad):
            where = bad[0].removeprefix(ckpt.TRAINABLE) if bad else "another host's shards"
            raise NonFiniteError(f"step {step}: non-finite values in {where}; no checkpoint written")
        final = ckpt.checkpoints_dir(self.args.output_dir) / f"step-{step}"
        partial = final.with_name(final.name + ".partial")
        need = sum(t.numel() * t.element_size() for v in fetched.values() for t in sharded_state.host_values(v))
        ckpt.check_room(final.parent, need + ckpt.SAVE_MARGIN, f"checkpoint step-{step}")
        if hosts.is_main():
            fresh_partial(final)
        hosts.barrier()  # the directory exists before any host writes into it
        try:
            sharded_state.write(fetched, partial / ckpt.STATE)
        except Exception as err:
            if not disk_full(err):
                raise
            shutil.rmtree(partial, ignore_errors=True)
            raise UserError(
                f"checkpoint step-{step}: the disk of {partial.parent} filled while writing it ({need:,} bytes); "
                "what was written of it is removed and the previous checkpoint is intact: free space there, "
                "choose another output_dir, or lower train.keep_last, then run the same command to resume"
            ) from None
        faults.point("save-state")
        if hosts.is_main():
            torch.save(groups, partial / ckpt.GROUPS)
            torch.save(self.lr_scheduler.state_dict(), partial / ckpt.SCHEDULER)
            self._save_rng_state(str(partial))
            self.state.save_to_json(str(partial / "trainer_state.json"))
            (partial / ckpt.RECIPE).write_text(self.recipe.to_yaml())
            self._save_export_files(partial / ckpt.EXPORT)
            faults.point("save-files")
            ckpt.finish(partial, self.recipe.train.keep_last)
        hosts.barrier()  # every host sees the finished checkpoint
        self.last_checkpoint = final
        self.save_compiles[step] = rt.compile_count() - compiles
        self.save_seconds[step] = round(time.perf_counter() - started, 3)

    def _save_export_files(self, directory: Path) -> None:
        """What ``lowmem-tpu export`` needs besides the weights: the adapter's config and key map, or the model's."""
        directory.mkdir()
        if self.names.adapter_keys:
            config = self.model.peft_config["default"]
            config.base_model_name_or_path = self.base_reference or config.base_model_name_or_path
            config.save_pretrained(str(directory))
            write_json(directory / ckpt.ADAPTER_KEYS, self.names.adapter_keys)
        else:
            self.model.config.save_pretrained(directory)
            if getattr(self.model, "generation_config", None) is not None:
                self.model.generation_config.save_pretrained(directory)
        if self.processing_class is not None:
            from lowmem_tpu.model import save_tokenizer

            save_tokenizer(self.processing_class, directory)
        (directory / ckpt.RECIPE).write_text(self.recipe.to_yaml())  # how generate formats prompts

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        trainable = {f"{ckpt.TRAINABLE}{n}": p for n, p in self.names.params.items() if p.requires_grad}
        sharded_state.load_into(trainable, Path(resume_from_checkpoint) / ckpt.STATE)
        rt.sync()

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The optimizer's state restored straight into tensors placed like their parameters (any device count)."""
        if checkpoint is None:
            return
        path = Path(checkpoint)
        self.optimizer.load_state_dict({"state": {}, "param_groups": torch.load(path / ckpt.GROUPS, weights_only=True)})
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        targets = self._optimizer_targets(ckpt.read_metadata(path), params)
        sharded_state.load_into(targets, path / ckpt.STATE)
        restore_checkpoint_state(self.optimizer, ckpt.optimizer_state_of(targets), params)
        self.lr_scheduler.load_state_dict(torch.load(path / ckpt.SCHEDULER, weights_only=True))
        rt.sync()

    def _optimizer_targets(self, saved: dict[str, Any], params: list[torch.Tensor]) -> dict[str, Any]:
        """Where each saved optimizer entry goes: a parameter-shaped tensor placed like it, else a host one."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        masters = masters_of(self.optimizer)
        strategy, targets = self.recipe.sharding.strategy, {}
        for key, meta in saved.items():
            if key.startswith(ckpt.MASTER):
                targets[key] = masters[int(key.removeprefix(ckpt.MASTER))]
            elif key.startswith(ckpt.OPTIMIZER):
                param = params[int(key.removeprefix(ckpt.OPTIMIZER).split("/")[0])]
                if not isinstance(meta, TensorStorageMetadata):
                    targets[key] = None  # a saved object (Adafactor's step count)
                    continue
                host = torch.zeros(meta.size, dtype=meta.properties.dtype)
                shaped = tuple(meta.size) == tuple(param.shape) and param.device.type == "xla"
                targets[key] = place_like(host, param, self.runtime, strategy) if shaped else host
        return targets
