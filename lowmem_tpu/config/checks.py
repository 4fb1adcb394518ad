"""Checks that involve several fields of a recipe (the schema checks each field on its own).

Each problem is (the dotted fields involved, a message naming the fix): ``config.validate`` drops
the ones a bad field would make spurious before it reports. They read the recipe only, never the
machine: what the CPU backend cannot run is a recipe problem when ``runtime.device`` is cpu, and a
question for ``lowmem_tpu.preflight`` when ``auto`` lands on the CPU here. The schema calls these
checks, so they name its types without importing them.
"""

from __future__ import annotations

from typing import Any

from lowmem_tpu.config.assets import BUILTIN, builtin_has_weights, looks_local
from lowmem_tpu.config.devices import DEVICES
from lowmem_tpu.config.methods import CPO_LOSSES, METHODS
from lowmem_tpu.config.rules import batch_split_problem

Problem = tuple[tuple[str, ...], str]
CROSS_FIELDS = "cross_fields"  # pydantic's error type for them: the schema raises them once every field is valid
BATCH = ("train.global_batch_size", "train.gradient_accumulation_steps")
# The DPO losses built on the chosen-rejected reward difference: the only ones TRL takes an f-divergence for.
F_DIVERGENCE_LOSSES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")


def cross_problems(recipe: Any) -> list[Problem]:
    """Problems of a ``Recipe`` that involve several fields, each as (the dotted fields involved, message)."""
    problems: list[Problem] = []
    t = recipe.train
    cpu = recipe.runtime.device == "cpu"  # on a TPU the device count is only known once torch_xla starts
    accumulation = batch_split_problem(t.global_batch_size, t.gradient_accumulation_steps)
    if accumulation:
        problems.append((BATCH, accumulation))
    if cpu and not accumulation and (split := _cpu_split(recipe)):
        problems.append(split)
    problems += _model_problems(recipe)
    problems += _method_problems(recipe)
    if METHODS[recipe.method].preference and recipe.data.format in METHODS[recipe.method].formats:
        problems += _preference_problems(recipe)
    problems += _attention_problems(recipe)
    problems += _sharding_problems(recipe.sharding)
    if recipe.hub.push and not recipe.hub.repo_id:
        problems.append((("hub.push", "hub.repo_id"), "hub.repo_id: required when hub.push is true (OWNER/NAME)"))
    problems += _eval_problems(recipe)
    problems += _data_problems(recipe.data)
    return problems


def _model_problems(recipe: Any) -> list[Problem]:
    """The base model against LoRA, quantization and scanning."""
    problems: list[Problem] = []
    model, lora = recipe.model, recipe.lora
    if model.name_or_path.startswith(BUILTIN) and not model.random_init and not builtin_has_weights(model.name_or_path):
        message = f"must be true for {model.name_or_path}, which ships a config and tokenizer but no weights"
        if "name_or_path" not in model.model_fields_set:
            message += " (it is the default model: set model.name_or_path to a Hub id or directory to use another)"
        problems.append((("model.name_or_path", "model.random_init"), f"model.random_init: {message}"))
    if model.quantize != "none" and not recipe.lora.enabled:
        message = (
            f"model.quantize: {model.quantize} freezes the base in {model.quantize}, but lora.enabled is false "
            "(full fine-tuning trains every base weight, which needs them in full precision); "
            "set lora.enabled: true to train LoRA adapters on the quantized base (QLoRA), or model.quantize: none"
        )
        problems.append((("model.quantize", "lora.enabled"), message))
    if model.adapter and not lora.enabled:
        message = (
            "model.adapter: a LoRA adapter is trained further as LoRA, but lora.enabled is false; "
            "set lora.enabled: true, or merge the adapter first (lowmem-tpu merge) and fine-tune the merged model"
        )
        problems.append((("model.adapter", "lora.enabled"), message))
    if lora.enabled and model.quantize != "none" and lora.use_dora:
        message = (
            f"lora.use_dora: PEFT's DoRA takes each adapted layer's weight as stored to compute its norm, and the "
            f"{model.quantize} base stores packed integers (the norms would be of those); "
            "set lora.use_dora: false or model.quantize: none"
        )
        problems.append((("lora.use_dora", "model.quantize"), message))
    if lora.enabled and model.quantize != "none" and str(lora.init_lora_weights).startswith(("pissa", "olora")):
        message = (
            f"lora.init_lora_weights: {lora.init_lora_weights} rewrites the base weights to the residual of the "
            f"adapters' directions, and the {model.quantize} base is frozen as packed integers; "
            "use lora.init_lora_weights: true (or gaussian), or model.quantize: none"
        )
        problems.append((("lora.init_lora_weights", "model.quantize"), message))
    if model.quantize_double and model.quantize != "nf4":
        message = (
            f"model.quantize_double: double quantization is NF4's (it quantizes NF4's fp32 block maxima), "
            f"and model.quantize is {model.quantize}; set model.quantize: nf4 or remove model.quantize_double"
        )
        problems.append((("model.quantize_double", "model.quantize"), message))
    if model.quantize != "none" and recipe.sharding.scan_layers:
        message = (
            f"model.quantize: an {model.quantize} base is not supported with sharding.scan_layers yet "
            "(the scanned layer is traced functionally, the quantized projections are not); "
            "set sharding.scan_layers: false or model.quantize: none"
        )
        problems.append((("model.quantize", "sharding.scan_layers"), message))
    return problems


def _attention_problems(recipe: Any) -> list[Problem]:
    """Attention and the loss against the sequence length, packing and scanning."""
    problems: list[Problem] = []
    t, model, data = recipe.train, recipe.model, recipe.data
    if model.attn_implementation == "flash" and not flash_tiles(data.max_length):
        below, above = flash_lengths_near(data.max_length)
        lengths = f"{below} or {above}" if below else str(above)
        message = (
            f"data.max_length: {data.max_length} cannot be tiled by flash attention's backward pass (torch_xla 2.9 "
            "picks blocks of min(1024, L), min(512, L) and min(256, L), which must divide L, in multiples of 128: "
            f"L = 128, 256, 512 or a multiple of 1024); use {lengths}, "
            "or model.attn_implementation: chunked (any length)"
        )
        problems.append((("data.max_length", "model.attn_implementation"), message))
    if data.packing and recipe.sharding.scan_layers and model.attn_implementation in ("chunked", "flash"):
        message = (
            f"data.packing: packed rows reach {model.attn_implementation} attention as segment ids, which the "
            "scanned layer (sharding.scan_layers) does not carry; use model.attn_implementation: sdpa or eager "
            "with scan_layers, or sharding.scan_layers: false"
        )
        problems.append((("data.packing", "sharding.scan_layers", "model.attn_implementation"), message))
    if t.chunked_loss and t.fused_lm_head:
        message = "train.chunked_loss: true and train.fused_lm_head: true are two ways to skip the logits; pick one"
        problems.append((("train.chunked_loss", "train.fused_lm_head"), message))
    return problems


def _eval_problems(recipe: Any) -> list[Problem]:
    """Evaluation settings that need held-out data."""
    problems: list[Problem] = []
    t, data = recipe.train, recipe.data
    held_out = data.eval_path or data.eval_fraction
    if t.eval_samples and not held_out:
        message = "train.eval_samples: needs data.eval_path or data.eval_fraction (held-out prompts to score)"
        problems.append((("train.eval_samples", "data.eval_path", "data.eval_fraction"), message))
    if t.eval_steps and not held_out:
        message = "train.eval_steps: needs data.eval_path or data.eval_fraction (without one nothing is evaluated)"
        problems.append((("train.eval_steps", "data.eval_path", "data.eval_fraction"), message))
    return problems


def flash_tiles(length: int) -> bool:
    """Whether torch_xla 2.9's flash backward tiles this sequence length: 128, 256, 512 or a multiple of 1024.

    ``experimental/custom_kernel.py`` gives the dq kernel blocks of min(1024, L), min(512, L) and
    min(256, L), the dkv kernel min(512, L); JAX's Pallas kernel refuses a block that does not divide L
    and a key block that is not a multiple of 128 lanes (traced for a TPU: tests/e2e/test_tpu_only_paths.py).
    """
    return length % 128 == 0 and all(length % min(block, length) == 0 for block in (1024, 512, 256))


def flash_lengths_near(length: int) -> tuple[int | None, int]:
    """The nearest lengths below and above ``length`` that flash's backward tiles."""
    below = next((n for n in range(length, 0, -1) if flash_tiles(n)), None)
    above = next(n for n in range(length, 4 * length + 1025) if flash_tiles(n))
    return below, above


def cpu_backend_problems(recipe: Any) -> list[Problem]:
    """What the CPU backend cannot run of a recipe: its batch over ``runtime.num_cpu_devices``.

    A recipe problem when ``runtime.device`` is cpu (:func:`cross_problems`); ``preflight`` asks it when
    ``auto`` lands on the CPU of this machine. TPU-only settings are not problems there: a rehearsal runs
    their CPU equivalents (:func:`cpu_equivalents`).
    """
    return [problem for problem in (_cpu_split(recipe),) if problem]


def cpu_equivalents(recipe: Any) -> list[tuple[str, str, str]]:
    """The recipe's TPU-only settings and what a rehearsal on the CPU backend runs instead, as
    (dotted field, the CPU equivalent, why): the same computation, so the loss is the same."""
    if recipe.model.attn_implementation == "flash":
        why = (
            "flash is torch_xla's Pallas TPU kernel, which the CPU backend cannot run; chunked computes the "
            "same attention block by block"
        )
        return [("model.attn_implementation", "chunked", why)]
    return []


def _cpu_split(recipe: Any) -> Problem | None:
    t, devices = recipe.train, recipe.runtime.num_cpu_devices
    problem = batch_split_problem(t.global_batch_size, t.gradient_accumulation_steps, devices)
    return ((*BATCH, "runtime.num_cpu_devices", "runtime.device"), problem) if problem else None


def target_problem(recipe: Any) -> str | None:
    """Why the batch cannot split over the devices of the recipe's ``runtime.target`` TPU (None: it can).

    Asked by ``preflight`` (``validate``, ``memory``), not at load: a run uses the devices it finds.
    """
    target = DEVICES.get(recipe.runtime.target or "")
    if target is None:
        return None
    t = recipe.train
    problem = batch_split_problem(t.global_batch_size, t.gradient_accumulation_steps, target.devices)
    return f"{problem} (runtime.target: {target.name}, {target.devices} devices)" if problem else None


def _sharding_problems(sharding: Any) -> list[Problem]:
    problems: list[Problem] = []
    if sharding.checkpoint_every > 1 and sharding.scan_layers:
        message = (
            f"sharding.activation_checkpointing: {sharding.activation_checkpointing} checkpoints some layers, but "
            "sharding.scan_layers runs one compiled layer for all of them; use true or false with scan_layers"
        )
        problems.append((("sharding.activation_checkpointing", "sharding.scan_layers"), message))
    return problems


def _data_problems(data: Any) -> list[Problem]:
    problems: list[Problem] = []
    if data.eval_path and data.eval_fraction:
        message = "data.eval_fraction: held-out data is data.eval_path or a fraction of the training data, not both"
        problems.append((("data.eval_path", "data.eval_fraction"), message))
    if data.eval_path == data.path and (data.eval_split or data.split) == data.split:
        message = (
            f"data.eval_path: the same data and split as data.path ({data.split}): evaluation would score the "
            "training records; set data.eval_split to a held-out split, or drop data.eval_path and set "
            "data.eval_fraction"
        )
        problems.append((("data.eval_path", "data.eval_split", "data.path", "data.split"), message))
    if data.subset and (data.path.startswith(BUILTIN) or looks_local(data.path)):
        message = f"data.subset: {data.path} is a file; subsets (configurations) belong to Hub datasets"
        problems.append((("data.subset", "data.path"), message))
    return problems


def _method_problems(recipe: Any) -> list[Problem]:
    """The method against the data it trains on."""
    method = METHODS[recipe.method]
    if recipe.data.format in method.formats:
        return []
    serve = [m.name for m in METHODS.values() if recipe.data.format in m.formats]
    message = (
        f"method: {method.name} trains on {' or '.join(method.formats)} data and data.format is "
        f"{recipe.data.format}; run it with {' or '.join(serve)} (`lowmem-tpu {serve[0]} RECIPE`), or give "
        f"{method.name} {method.formats[0]} data"
    )
    return [(("method", "data.format"), message)]


# The preference fields each reference-free method reads; the others are DPO's.
_READ_BY = {
    "orpo": {"beta"},
    "cpo": {"beta", "loss_type", "label_smoothing", "cpo_alpha", "alphapo_alpha"},
    "simpo": {"beta", "label_smoothing", "cpo_alpha", "simpo_gamma", "alphapo_alpha"},
    "kto": {"beta", "kto_loss", "desirable_weight", "undesirable_weight", "precompute_ref_log_probs"},
}
_DPO_ONLY = {"cpo_alpha", "simpo_gamma", "alphapo_alpha", "kto_loss", "desirable_weight", "undesirable_weight"}


def _spelled(value: Any) -> str:
    """A value as an override writes it."""
    if isinstance(value, list):
        return f"[{','.join(map(str, value))}]"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _preference_problems(recipe: Any) -> list[Problem]:
    """A preference recipe's settings that would give it a wrong reference or a loss TRL refuses."""
    problems: list[Problem] = []
    data, p = recipe.data, recipe.preference
    # set away from its default (a run's saved recipe.yaml spells every default out)
    given = {
        name
        for name, field in type(p).model_fields.items()
        if getattr(p, name) != field.get_default(call_default_factory=True)
    }
    read = _READ_BY.get(recipe.method, set(type(p).model_fields) - _DPO_ONLY)
    unread = sorted(given - read)
    if unread:
        defaults = {name: type(p).model_fields[name].get_default(call_default_factory=True) for name in unread}
        reset = " ".join(f"preference.{name}={_spelled(value)}" for name, value in defaults.items())
        message = (
            f"{', '.join(f'preference.{name}' for name in unread)}: not read by method {recipe.method}, which reads "
            f"{', '.join(sorted(read))}; remove {'it' if len(unread) == 1 else 'them'} from the recipe (or override: "
            f"{reset}), or choose the method that reads {'it' if len(unread) == 1 else 'them'}"
        )
        problems.append(((*(f"preference.{name}" for name in unread), "method"), message))
    if recipe.method == "cpo" and (len(p.loss_type) != 1 or p.loss_type[0] not in CPO_LOSSES):
        message = (
            f"preference.loss_type: method cpo takes one of {', '.join(CPO_LOSSES)} (CPOTrainer's), not "
            f"{', '.join(p.loss_type)}; for SimPO use method: simpo"
        )
        problems.append((("preference.loss_type", "method"), message))
    if data.packing:
        message = (
            "data.packing: preference pairs are not packed (each pair is two rows of data.max_length, chosen "
            "and rejected, compared whole); set data.packing: false"
        )
        problems.append((("data.packing", "data.format"), message))
    if recipe.train.chunked_loss:
        message = (
            f"train.chunked_loss: a {recipe.method} run always computes its log-probabilities with TRL's LM head; "
            "set train.chunked_loss: false"
        )
        problems.append((("train.chunked_loss", "method"), message))
    if recipe.method == "kto" and recipe.train.global_batch_size // recipe.train.gradient_accumulation_steps < 2:
        message = (
            "train.global_batch_size: KTO's KL term pairs each row with another row's completion in the same "
            "micro-batch, which needs at least 2 rows; raise train.global_batch_size or lower the accumulation"
        )
        problems.append((BATCH, message))
    return problems + (_reference_problems(recipe) if METHODS[recipe.method].reference else [])


def _reference_problems(recipe: Any) -> list[Problem]:
    """A DPO recipe's settings that would give it a wrong reference or a loss TRL refuses."""
    problems: list[Problem] = []
    init = str(recipe.lora.init_lora_weights)
    if recipe.lora.enabled and not recipe.model.adapter and (init.startswith(("pissa", "olora")) or init == "False"):
        message = (
            f"lora.init_lora_weights: {init} starts the adapters away from zero (PiSSA/OLoRA also rewrite the base "
            "to a residual), and a DPO run's reference is the base with the adapters switched off: it would not be "
            "the model training starts from; use true or gaussian (B = 0)"
        )
        problems.append((("lora.init_lora_weights", "method"), message))
    p = recipe.preference
    if not recipe.lora.enabled and p.precompute_ref_log_probs is False:
        message = (
            "preference.precompute_ref_log_probs: false with lora.enabled: false asks for a frozen copy of the whole "
            "model as the reference, which lowmem-tpu does not make (twice the weights on every chip); set it to "
            "true (or leave it out): the reference's log-probabilities are computed once, before training"
        )
        problems.append((("preference.precompute_ref_log_probs", "lora.enabled"), message))
    if "exo_pair" in p.loss_type and p.smoothing == 0:
        message = "preference.label_smoothing: loss exo_pair needs it above 0 (leave it out: the EXO paper's 1e-3)"
        problems.append((("preference.label_smoothing", "preference.loss_type"), message))
    if p.loss_weights is not None and len(p.loss_weights) != len(p.loss_type):
        message = (
            f"preference.loss_weights: {len(p.loss_weights)} weight(s) for {len(p.loss_type)} losses "
            f"({', '.join(p.loss_type)}); give one weight per loss, in loss_type's order"
        )
        problems.append((("preference.loss_weights", "preference.loss_type"), message))
    others = [loss for loss in p.loss_type if loss not in F_DIVERGENCE_LOSSES]
    if p.f_divergence_type != "reverse_kl" and others:
        message = (
            f"preference.f_divergence_type: {p.f_divergence_type} has no form for the loss {', '.join(others)}; "
            f"use it with {', '.join(F_DIVERGENCE_LOSSES)}, or keep reverse_kl"
        )
        problems.append((("preference.f_divergence_type", "preference.loss_type"), message))
    unweighted = [loss for loss in p.loss_type if loss in ("aot", "aot_unpaired", "hinge")]
    if p.use_weighting and unweighted:
        message = (
            f"preference.use_weighting: WPO's weights do not work with the loss {', '.join(unweighted)} (TRL refuses "
            "the aot losses; with hinge its backward fails, trl 1.16); drop one or the other"
        )
        problems.append((("preference.use_weighting", "preference.loss_type"), message))
    return problems
