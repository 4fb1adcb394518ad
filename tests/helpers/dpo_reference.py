"""TRL's DPOTrainer on plain CPU PyTorch (no XLA): the loss and metrics of one batch, as JSON, and the
adapters' gradients as OUT.json.grads.safetensors.

    USE_TORCH_XLA=0 python tests/helpers/dpo_reference.py BASE ADAPTER DATA PAIRS BETA LOSSES OUT.json [START]

The policy is BASE with the LoRA adapter ADAPTER (TRL builds the PEFT model from the adapter's config, the
adapter's weights are then loaded); the reference is BASE with the adapters switched off, TRL's own way.
ADAPTER a model directory instead: full-parameter DPO, TRL's ``precompute_ref_log_probs`` on BASE (the model
before training), the policy then moved to ADAPTER's weights; every weight's gradient is saved.
TRL tokenizes the first PAIRS records of DATA itself and pads them with its own collator.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import datasets
import torch
from peft import LoraConfig, PeftModel, set_peft_model_state_dict
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer

from lowmem_tpu.config import DataSection
from lowmem_tpu.data import set_chat_template


def main(
    base: str, adapter: str, data: str, pairs: str, beta: str, losses: str, out: str, start: str = "", options="{}"
) -> None:
    """``start``: an adapter the run starts from (TRL's frozen ``ref`` copy of it is the reference), the policy
    then moved to ``adapter``'s weights; without it (or empty) the reference is the base, adapters switched off.
    ``options``: more of DPOConfig's fields, as JSON."""
    tokenizer = AutoTokenizer.from_pretrained(base)
    set_chat_template(tokenizer, DataSection(format="preference"))  # the template a run trains with
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.unk_token
    records = datasets.load_dataset("json", data_files=data, split="train").select(range(int(pairs)))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    args = DPOConfig(
        output_dir=f"{out}.trainer", use_cpu=True, report_to=[], beta=float(beta), loss_type=losses.split(","),
        **json.loads(options),
        per_device_train_batch_size=int(pairs), max_length=None,
        bf16=False,  # as a run's DPOConfig (train.args): TRL's default would autocast its reference pass to bf16
    )  # fmt: skip
    full = not Path(adapter, "adapter_config.json").is_file()
    if full:  # the reference's log-probs computed by BASE when the trainer is built, then the policy moves
        args.precompute_ref_log_probs = True
        trainer = DPOTrainer(model=model, args=args, train_dataset=records, processing_class=tokenizer)
        moved = AutoModelForCausalLM.from_pretrained(adapter, dtype=torch.float32).state_dict()
        trainer.model.load_state_dict(moved)
    elif start:  # a PEFT model handed over: TRL copies its adapter into the frozen "ref" one
        model = PeftModel.from_pretrained(model, start, is_trainable=True)
        trainer = DPOTrainer(model=model, args=args, train_dataset=records, processing_class=tokenizer)
    else:
        lora = LoraConfig.from_pretrained(adapter)
        lora.inference_mode = False  # a saved adapter's config says inference: trained here, as the policy
        trainer = DPOTrainer(
            model=model, args=args, train_dataset=records, processing_class=tokenizer, peft_config=lora,
        )  # fmt: skip
    if not full:
        set_peft_model_state_dict(trainer.model, load_file(f"{adapter}/adapter_model.safetensors"))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(int(pairs))])
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = {name: p.grad for name, p in trainer.model.named_parameters() if p.requires_grad}
    save_file({name: g.contiguous() for name, g in grads.items()}, f"{out}.grads.safetensors")
    metrics = {key: values[-1] for key, values in trainer._metrics["train"].items()}
    with open(out, "w") as f:
        json.dump({"loss": loss.item(), **metrics}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
