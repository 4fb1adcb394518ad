"""TRL's KTOTrainer on plain CPU PyTorch (no XLA): the loss and metrics of one batch of given rows, as JSON, and
the adapters' gradients as OUT.json.grads.safetensors.

    USE_TORCH_XLA=0 python tests/helpers/kto_reference.py BASE ADAPTER ROWS OPTIONS OUT.json

The policy is BASE with the LoRA adapter ADAPTER; the reference is BASE with the adapters switched off, TRL's
own way. ADAPTER a model directory: full-parameter KTO with TRL's precomputed reference (``compute_ref_log_probs``
by BASE, before training, written to OUT as ``ref_logps`` and ``ref_KL_logps``), the policy then ADAPTER's
weights. ROWS (safetensors): the rows as a run holds them, ``input_ids``, ``attention_mask``,
``completion_mask``, ``label`` and the KL rows (``KL_input_ids``, ...), given to TRL's ``_compute_loss`` in its
own batch layout (which they are). OPTIONS: KTOConfig's fields, as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import datasets
import torch
from peft import LoraConfig, set_peft_model_state_dict
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import KTOConfig, KTOTrainer


def main(base: str, adapter: str, rows: str, options: str, out: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.unk_token
    records = [{"prompt": "a", "completion": " b", "label": bool(i % 2)} for i in range(4)]  # unused
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    full = not Path(adapter, "adapter_config.json").is_file()
    batch = load_file(rows)
    args = KTOConfig(
        output_dir=f"{out}.trainer", use_cpu=True, report_to=[], bf16=False,
        per_device_train_batch_size=len(batch["label"]), **json.loads(options),
    )  # fmt: skip
    lora = None if full else LoraConfig.from_pretrained(adapter)
    if lora is not None:
        lora.inference_mode = False
    trainer = KTOTrainer(
        model=model, args=args, train_dataset=datasets.Dataset.from_list(records), processing_class=tokenizer,
        peft_config=lora,
    )  # fmt: skip
    batch["label"] = batch["label"].bool()
    batch = {key: value for key, value in batch.items() if not key.startswith("ref_")}  # TRL's own, below
    reference = {}
    if full:  # TRL's precompute: the model before training scores the rows and the KL rows
        ref, kl = trainer.compute_ref_log_probs(trainer.model, batch)
        batch |= {"ref_logps": ref} | ({} if kl is None else {"ref_KL_logps": kl})
        trainer.precompute_ref_logps = True
        moved = trainer.model.load_state_dict(load_file(f"{adapter}/model.safetensors"), strict=False)
        assert not moved.unexpected_keys, moved.unexpected_keys  # every saved weight is the model's
        reference = {key: batch[key].tolist() for key in ("ref_logps", "ref_KL_logps") if key in batch}
    else:
        set_peft_model_state_dict(trainer.model, load_file(f"{adapter}/adapter_model.safetensors"))
    trainer.model.train()
    loss = trainer._compute_loss(trainer.model, batch, False)
    loss.backward()
    grads = {name: p.grad for name, p in trainer.model.named_parameters() if p.requires_grad}
    save_file({name: g.contiguous() for name, g in grads.items()}, f"{out}.grads.safetensors")
    metrics = {key: values[-1] for key, values in trainer._metrics["train"].items() if key != "num_tokens"}
    with open(out, "w") as f:
        json.dump({"loss": loss.item(), **metrics, **reference}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
