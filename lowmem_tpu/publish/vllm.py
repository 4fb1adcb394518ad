"""Whether vLLM's LoRA loader accepts an adapter directory, by the rules of vLLM 0.32's own loader.

The rules, as vLLM 0.32.0 states them (read in its source, not imported: vLLM is not a dependency):

- ``vllm/lora/peft_helper.py`` ``PEFTHelper``: ``r`` (> 0), ``lora_alpha`` and ``target_modules`` are
  required; ``validate_legal`` refuses DoRA (``use_dora``), ``lora_bias``, ``bias`` other than "none",
  ``modules_to_save`` other than a classifier head, an ``init_lora_weights`` string other than gaussian, eva,
  orthogonal, mica or lora_ga (PiSSA, OLoRA, LoftQ, CorDA), ``layer_replication``, and a rank above the
  server's ``--max-lora-rank`` (one of 1, 8, 16, 32, 64, 128, 256, 320, 512: ``vllm/config/lora.py``).
- ``vllm/lora/utils.py`` ``parse_fine_tuned_lora_name``: every tensor is ``base_model.model.<module>.lora_A.weight``
  or ``.lora_B.weight`` (``lora_embedding_A``/``_B`` on embeddings); anything else ("... is unsupported LoRA
  weight") fails the load.
- ``vllm/lora/lora_model.py`` ``check_unexpected_modules``: the module's last name must be one the model
  exposes for LoRA: its linear layers (q/k/v/o, gate/up/down, and the fused qkv_proj/gate_up_proj of models
  that have them) and embed_tokens/lm_head. Covering only part of a fused group (q and v alone) is accepted.
"""

from __future__ import annotations

from pathlib import Path

RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")
MODULES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj"}
EMBEDDINGS = {"embed_tokens", "lm_head"}
PREFIX = "base_model.model."
WEIGHTS = (".lora_A.weight", ".lora_B.weight")


def vllm_problems(adapter_dir: Path) -> list[str]:
    """What vLLM's loader would refuse in ``adapter_dir`` (empty: it loads)."""
    from safetensors import safe_open

    from lowmem_tpu.publish.adapter_base import read_adapter_config

    config = read_adapter_config(adapter_dir)  # a directory that is no whole adapter is refused, saying why
    problems = []
    if not isinstance(config.get("r"), int) or config["r"] <= 0 or "lora_alpha" not in config:
        problems.append("adapter_config.json lacks a positive r or lora_alpha")
    if not config.get("target_modules"):
        problems.append("adapter_config.json names no target_modules")
    for key, what in (("use_dora", "DoRA"), ("lora_bias", "LoRA bias")):
        if config.get(key):
            problems.append(f"{what} ({key}: true) is not supported by vLLM")
    if config.get("bias", "none") != "none":
        problems.append(f"bias: {config['bias']} (vLLM loads adapters without biases)")
    if config.get("modules_to_save"):
        problems.append(f"modules_to_save: {config['modules_to_save']} (vLLM loads LoRA weights only)")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in INITS:
        problems.append(f"init_lora_weights: {init} (vLLM refuses {init} adapters; convert them to plain LoRA)")
    if max([config.get("r") or 0, *(config.get("rank_pattern") or {}).values()]) > RANKS[-1]:
        problems.append(f"a rank above vLLM's largest --max-lora-rank, {RANKS[-1]}")
    with safe_open(str(adapter_dir / "adapter_model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    problems += sorted({p for key in keys if (p := _key_problem(key))})
    return problems


def _key_problem(key: str) -> str | None:
    if not key.startswith(PREFIX):
        return f"{key}: not under {PREFIX}"
    name = key.removeprefix(PREFIX)
    for suffix in (*WEIGHTS, ".lora_embedding_A", ".lora_embedding_B"):
        if name.endswith(suffix):
            module = name.removesuffix(suffix).rsplit(".", 1)[-1]
            if module in MODULES or module in EMBEDDINGS:
                return None
            return f"LoRA on {module} (vLLM adapts {', '.join(sorted(MODULES | EMBEDDINGS))})"
    return f"{name.rsplit('.', 1)[0]}...: a tensor that is not a LoRA A/B weight"


def max_lora_rank(adapter_dir: Path) -> int:
    """The smallest ``--max-lora-rank`` that serves this adapter."""
    from lowmem_tpu.publish.adapter_base import read_adapter_config

    config = read_adapter_config(adapter_dir)
    rank = max([config.get("r") or 0, *(config.get("rank_pattern") or {}).values()])
    return next((r for r in RANKS if r >= rank), RANKS[-1])


def vllm_summary(adapter_dir: Path) -> str:
    """One paragraph for ``export``: ready for vLLM (with the serve command), or what stops it."""
    problems = vllm_problems(adapter_dir)
    if problems:
        return "vLLM would refuse the adapter " + str(adapter_dir) + ": " + "; ".join(problems)
    from lowmem_tpu.publish.adapter_base import read_adapter_config, trained_quantization

    base = read_adapter_config(adapter_dir)["base_model_name_or_path"]
    run = adapter_dir.resolve()
    name = run.parent.name if run.name == "final" else run.name
    text = (
        f"vLLM loads the adapter {adapter_dir} as it is (vLLM 0.32's LoRA rules):\n"
        f"  vllm serve {base} --enable-lora --lora-modules {name}={adapter_dir} --max-lora-rank "
        f"{max_lora_rank(adapter_dir)}"
    )
    quantized = trained_quantization(adapter_dir)
    if quantized:
        text += (
            f"\n  it trained on a {quantized['quantize']} base: vLLM applies it to the full-precision base, which "
            "differs by the quantization error; to serve what trained, serve the merged model (lowmem-tpu merge)"
        )
    return text
