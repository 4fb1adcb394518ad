"""One preference step two ways, for the comparisons with TRL (tests/e2e/test_dpo.py and
test_preference_methods.py): the XLA step on 4 virtual devices (``xla_step``), and TRL's DPOTrainer on plain CPU
PyTorch in a subprocess (``trl_dpo_on_the_cpu``; ``pair_reference.py`` and ``kto_reference.py`` for the others)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from lowmem_tpu.config.assets import ASSETS

PAIRS = ASSETS / "reverse" / "prefer_train.jsonl"
HELPERS = Path(__file__).resolve().parent


def trl_dpo_on_the_cpu(
    base: Path, adapter: Path, pairs: int, beta: float, losses: str, out: Path, start: Path | None = None,
    options: dict | None = None,
) -> dict:  # fmt: skip
    env = {**os.environ, "USE_TORCH_XLA": "0", "PJRT_DEVICE": "", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, str(HELPERS / "dpo_reference.py"), str(base), str(adapter), str(PAIRS)]
    command += [str(pairs), str(beta), losses, str(out), str(start or ""), json.dumps(options or {})]
    subprocess.run(command, env=env, check=True, timeout=300)
    return json.loads(out.read_text())


def xla_step(
    base: Path, adapter: Path, pairs: int, beta: float, losses: str, out: Path, start: Path | None = None,
    options: dict | None = None, method: str = "dpo", picks: list[int] | None = None,
) -> dict:  # fmt: skip
    """One XlaPreferenceTrainer loss on the devices, the policy ``adapter`` on ``base``; the reference the base, or
    with ``start`` the frozen copy of that adapter TRL makes (the policy then moved to ``adapter``'s weights).
    ``adapter`` a model directory: full-parameter DPO or KTO, the reference's log-probs precomputed by ``base``
    (the model before training; KTO's KL rows then fixed), the policy then moved to that model's weights."""
    import torch

    from lowmem_tpu import data
    from lowmem_tpu import model as m
    from lowmem_tpu.config import load_recipe
    from lowmem_tpu.data.pairs import collate_pairs
    from lowmem_tpu.model.names import ParamNames
    from lowmem_tpu.train.args import preference_args
    from lowmem_tpu.train.preference import XlaPreferenceTrainer
    from lowmem_tpu.xla.runtime import configure_environment, setup_runtime, sync
    from lowmem_tpu.xla.sharding import place_parameters

    full = not (adapter / "adapter_config.json").is_file()
    overrides = [f"model.name_or_path={base}", "model.random_init=false"]
    overrides += ["lora.enabled=false"] if full else [f"model.adapter={start or adapter}"]
    overrides += [f"output_dir={out}", f"train.global_batch_size={pairs}", f"preference.beta={beta}"]
    overrides += [f"preference.{key}={json.dumps(value)}" for key, value in (options or {}).items()]
    overrides += ["train.eval_steps=null", "data.eval_path=null", "train.eval_samples=0", f"method={method}"]
    recipe = load_recipe("recipes/tiny_dpo_cpu.yaml", [*overrides, f"preference.loss_type=[{losses}]"])
    configure_environment(recipe.runtime)
    runtime = setup_runtime(recipe.runtime)
    tokenizer = m.load_tokenizer(recipe.model)
    data.set_chat_template(tokenizer, recipe.data)
    kto = method == "kto"
    rows, _ = data.build_dataset(recipe.data, tokenizer, max_samples=pairs, unpaired=kto)
    policy = m.apply_lora(m.build_base_model(recipe.model), recipe)
    place_parameters(policy, runtime, recipe.sharding.strategy)
    trainer = XlaPreferenceTrainer(
        fresh_adapters=start is None,  # the reference: the base, as TRL's with a fresh PEFT model
        recipe=recipe, runtime=runtime, names=ParamNames(policy), model=policy,
        args=preference_args(recipe, pairs), train_dataset=rows, processing_class=tokenizer,
    )  # fmt: skip
    from safetensors.torch import load_file

    if full:  # the reference as TRL computes it at the start, then the policy moves (a trained step's weights)
        rows = trainer._with_reference(rows if kto else rows.select(range(pairs)), "train")
        assert trainer.precompute_ref_logps
        for key, value in load_file(str(adapter / "model.safetensors")).items():
            trainer.names.params[key].data.copy_(value.to(runtime.device))
    elif start:  # the policy moved away from the adapter it started from (and TRL's frozen copy of it)
        for key, value in load_file(str(adapter / "adapter_model.safetensors")).items():
            trainer.names.params[trainer.names.adapter_keys[key]].data.copy_(value.to(runtime.device))
    from lowmem_tpu.data.unpaired import collate_unpaired

    picked = [rows[i] for i in picks or range(pairs)]  # KTO: ``pairs`` records are twice as many rows
    batch = collate_unpaired(picked) if kto else collate_pairs(picked)
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({key: value for key, value in batch.items()}, out / "rows.safetensors")
    batch = {key: value.to(runtime.device) for key, value in batch.items()}
    wrapped = trainer.fsdp_model
    wrapped.train()
    loss = trainer.compute_loss(wrapped, batch)
    assert isinstance(loss, torch.Tensor) and loss.device.type == "xla"
    loss.backward()
    sync()  # one program for every gradient: .cpu() on each pending one would compile a program each
    grads = {name: p.grad.cpu() for name, p in trainer.names.params.items() if p.requires_grad}  # clean names
    return {"loss": loss.item(), **trainer.device_metrics.means("train"), "grads": grads}


def trl_on_given_rows(method: str, base: Path, adapter: Path, rows: Path, options: dict, out: Path) -> dict:
    """TRL's ORPOTrainer, CPOTrainer (cpo, simpo) or KTOTrainer (kto) on plain CPU PyTorch, fed ``rows`` (what
    ``xla_step`` saved): its loss and figures; the adapters' gradients in OUT.grads.safetensors."""
    env = {**os.environ, "USE_TORCH_XLA": "0", "PJRT_DEVICE": "", "HF_HUB_OFFLINE": "1"}
    if method == "kto":
        command = [sys.executable, str(HELPERS / "kto_reference.py"), str(base), str(adapter)]
    else:
        command = [sys.executable, str(HELPERS / "pair_reference.py"), method, str(base), str(adapter)]
    subprocess.run([*command, str(rows), json.dumps(options), str(out)], env=env, check=True, timeout=300)
    return json.loads(out.read_text())
