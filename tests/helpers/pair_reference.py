"""TRL's ORPOTrainer or CPOTrainer on plain CPU PyTorch (no XLA): the loss and metrics of one batch of given
rows, as JSON, and the adapters' gradients as OUT.json.grads.safetensors.

    USE_TORCH_XLA=0 python tests/helpers/pair_reference.py METHOD BASE ADAPTER ROWS OPTIONS OUT.json

METHOD orpo, cpo or simpo (CPOTrainer with loss_type simpo); the policy is BASE with the LoRA adapter ADAPTER.
ROWS (safetensors): the pairs as a run holds them, ``input_ids``, ``attention_mask`` and ``completion_mask``
``[2B, L]``, every chosen row then every rejected row; they reach TRL's ``get_batch_loss_metrics`` in its own
batch layout (``chosen_input_ids``, ``chosen_labels`` with the prompt at -100, ...). OPTIONS: the config's
fields, as JSON.
"""

from __future__ import annotations

import json
import sys
import warnings

import datasets
import torch
from peft import LoraConfig, set_peft_model_state_dict
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer


def trainer_for(method: str, base: str, adapter: str, options: dict, out: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # trl.experimental says it is experimental
        from trl.experimental.cpo import CPOConfig, CPOTrainer
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer
    config, trainer = (ORPOConfig, ORPOTrainer) if method == "orpo" else (CPOConfig, CPOTrainer)
    if method == "simpo":
        options = {"loss_type": "simpo", "cpo_alpha": 0.0, **options}
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.unk_token
    records = datasets.Dataset.from_list([{"prompt": "a", "chosen": " b", "rejected": " c"}] * 2)  # unused
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = LoraConfig.from_pretrained(adapter)
    lora.inference_mode = False
    args = config(output_dir=f"{out}.trainer", use_cpu=True, report_to=[], bf16=False, **options)
    built = trainer(model=model, args=args, train_dataset=records, processing_class=tokenizer, peft_config=lora)
    set_peft_model_state_dict(built.model, load_file(f"{adapter}/adapter_model.safetensors"))
    return built


def trl_batch(rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our ``[2B, L]`` rows in TRL's ORPO/CPO layout."""
    ids, attention, completion = rows["input_ids"], rows["attention_mask"], rows["completion_mask"]
    labels = ids.masked_fill(completion == 0, -100)
    batch = {}
    for side, part in zip(("chosen", "rejected"), range(2), strict=True):
        pick = slice(part * (len(ids) // 2), (part + 1) * (len(ids) // 2))
        batch |= {f"{side}_input_ids": ids[pick], f"{side}_attention_mask": attention[pick]}
        batch[f"{side}_labels"] = labels[pick]
    return batch


def main(method: str, base: str, adapter: str, rows: str, options: str, out: str) -> None:
    trainer = trainer_for(method, base, adapter, json.loads(options), out)
    trainer.model.train()
    loss, metrics = trainer.get_batch_loss_metrics(trainer.model, trl_batch(load_file(rows)), train_eval="train")
    loss.backward()
    grads = {name: p.grad for name, p in trainer.model.named_parameters() if p.requires_grad}
    save_file({name: g.contiguous() for name, g in grads.items()}, f"{out}.grads.safetensors")
    with open(out, "w") as f:
        json.dump({"loss": loss.item(), **{k: float(v) for k, v in metrics.items()}}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
