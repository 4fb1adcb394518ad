"""A model directory as one GGUF file (llama.cpp, Ollama, LM Studio), written with the ``gguf`` package.

Tensors are read one at a time from the checkpoint, renamed with the ``gguf`` package's own name map for
the architecture, changed where llama.cpp computes differently from transformers (the rotary halves of
Llama's q/k rows interleaved; Gemma's norms stored as 1 + weight), and written as the asked type: 1-D
tensors stay float32; Q8_0 rows whose length is not a multiple of 32 fall back to F16, as llama.cpp's
own converter does. The architecture's hyper-parameters and the tokenizer (``gguf.vocab``) go in the
metadata, with the chat template.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from lowmem_tpu.errors import UserError
from lowmem_tpu.publish.gguf import gemma4, gpt_oss
from lowmem_tpu.publish.gguf.metadata import Family, family_of

SKIPPED_PREFIXES = (
    "model.vision_tower.",
    "vision_tower.",
    "model.multi_modal_projector.",
    "multi_modal_projector.",
    *gemma4.SKIPPED,
)
TYPES = ("f32", "f16", "bf16", "q8_0")


def qtype_of(name: str) -> Any:
    from gguf import GGMLQuantizationType

    return {"f32": GGMLQuantizationType.F32, "f16": GGMLQuantizationType.F16, "bf16": GGMLQuantizationType.BF16}.get(
        name, GGMLQuantizationType.Q8_0
    )


def file_type(name: str) -> int:
    from gguf import LlamaFileType

    return {
        "f32": LlamaFileType.ALL_F32,
        "f16": LlamaFileType.MOSTLY_F16,
        "bf16": LlamaFileType.MOSTLY_BF16,
        "q8_0": LlamaFileType.MOSTLY_Q8_0,
    }[name]


def hf_name(name: str) -> str | None:
    """The text decoder's name of a checkpoint tensor (a multimodal wrapper's text model unwrapped); None: skipped."""
    if name.startswith(SKIPPED_PREFIXES):
        return None
    for wrapped, plain in (("model.language_model.", "model."), ("language_model.model.", "model.")):
        if name.startswith(wrapped):
            return plain + name.removeprefix(wrapped)
    return name.removeprefix("language_model.")


def gguf_tensors(directory: Path, family: Family, text: Any) -> Iterator[tuple[str, np.ndarray]]:
    """``(gguf name, float32 array)`` of every tensor llama.cpp reads, one at a time, in checkpoint order."""
    import gguf

    from lowmem_tpu.model.build import read_tensors, weight_files
    from lowmem_tpu.model.mxfp4 import dequantized

    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == family.arch)
    names = gguf.get_tensor_name_map(arch, text.num_hidden_layers)
    tied = getattr(text, "tie_word_embeddings", False)
    files = weight_files(directory)
    if not files:
        raise UserError(f"{directory} holds no model weights (model.safetensors or pytorch_model.bin)")
    fused = family.arch == gemma4.ARCH  # llama.cpp reads Gemma 4's gate_up stack as it is
    experts = 0 if fused else getattr(text, "num_experts", 0) or 0
    tensors = dequantized(read_tensors(files))  # the Hub's MXFP4 experts (gpt-oss) as the model holds them
    if family.arch == gpt_oss.ARCH:
        tensors, experts = gpt_oss.experts_split(tensors), 0
    for raw, tensor in _experts_stacked(tensors, experts):
        name = hf_name(raw)
        if name is None or (tied and name == "lm_head.weight") or name.endswith("rotary_emb.inv_freq"):
            continue
        mapped = gemma4.tensor_name(name, names) if fused else names.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise UserError(
                f"the tensor {raw} of {directory} has no GGUF name for {family.arch}; "
                "this checkpoint is not the architecture its config names"
            )
        yield mapped, _converted(mapped, tensor.float().numpy(), family, text)


EXPERT_KEY = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _experts_stacked(tensors: Iterator[tuple[str, Any]], experts: int) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors with each projection's experts stacked as llama.cpp reads them
    (``experts.gate_proj.weight`` [experts, inner, hidden]): the Hub's one key per expert gathered, one layer's
    projection at a time, or a stacked ``gate_up_proj`` split into its gate and up halves."""
    import torch

    waiting: dict[str, dict[int, Any]] = {}
    for name, tensor in tensors:
        found = EXPERT_KEY.match(name)
        if found is None:
            if experts and name.endswith(".experts.gate_up_proj"):
                gate, up = tensor.chunk(2, dim=1)
                yield name.removesuffix("gate_up_proj") + "gate_proj.weight", gate
                yield name.removesuffix("gate_up_proj") + "up_proj.weight", up
            elif experts and name.endswith(".experts.down_proj"):
                yield f"{name}.weight", tensor
            else:
                yield name, tensor
            continue
        stack = f"{found.group(1)}.{found.group(3)}.weight"
        waiting.setdefault(stack, {})[int(found.group(2))] = tensor
        if len(waiting[stack]) == experts:
            parts = waiting.pop(stack)
            yield stack, torch.stack([parts[e] for e in range(experts)])
    if waiting:
        stack, parts = next(iter(waiting.items()))
        raise UserError(f"the checkpoint holds {len(parts)} of {experts} experts of {stack}; is it whole?")


def _converted(name: str, data: np.ndarray, family: Family, text: Any) -> np.ndarray:
    if family.norm_plus_one and name.endswith("norm.weight"):
        return data + 1.0
    if family.interleave_qk and name.endswith(("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias")):
        heads = text.num_attention_heads if "attn_q" in name else text.num_key_value_heads
        return _interleave_rotary_halves(data, heads)
    return data


def _interleave_rotary_halves(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of each head from [first halves, second halves] to pairs (i, i + half) side by side.

    transformers rotates dimension i with i + head_dim/2; llama.cpp's LLAMA rotates 2i with 2i + 1. Reordering
    the output rows of q and k makes one compute what the other does (the dot products are unchanged).
    """
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def stored(name: str, data: np.ndarray, qtype_name: str) -> tuple[np.ndarray, Any]:
    """``data`` as written: 1-D tensors, biases and a MoE router (``ffn_gate_inp``: the experts a token takes
    turn on its exact scores) in float32, as llama.cpp's converter keeps them (its kernels add only float32
    biases); others in the asked type (Q8_0 falls back to F16 off-block)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    qtype = qtype_of(qtype_name)
    exact = name.endswith(("ffn_gate_inp.weight", ".bias"))  # gpt-oss's experts' biases are 2-D
    if data.ndim <= 1 or qtype == GGMLQuantizationType.F32 or exact:
        return data.astype(np.float32), GGMLQuantizationType.F32
    if qtype == GGMLQuantizationType.Q8_0 and data.shape[-1] % GGML_QUANT_SIZES[qtype][0] != 0:
        qtype = GGMLQuantizationType.F16
    if qtype == GGMLQuantizationType.F16:
        return data.astype(np.float16), qtype
    return quantize(data, qtype), qtype


def write_gguf(directory: Path, path: Path, qtype_name: str, tokenizer: Any, name: str) -> dict[str, Any]:
    """Write ``directory``'s model as the GGUF file ``path`` named ``name``; returns what went in (for the report)."""
    import gguf
    from transformers import AutoConfig

    from lowmem_tpu.publish.gguf.metadata import add_hyperparameters, add_tokenizer, check_describable, notes

    config = AutoConfig.from_pretrained(directory)
    check_describable(config)
    family, text = family_of(config)
    writer = gguf.GGUFWriter(str(path), family.arch, use_temp_file=True)
    # The tensors wait in a spool file beside the output (the writer's default is the system temp directory,
    # which may be memory) until the header, whose size they decide, is written.
    spool = tempfile.SpooledTemporaryFile(mode="w+b", max_size=256 * 2**20, dir=path.parent)  # noqa: SIM115
    writer.temp_file = spool  # closed (and so removed) by the writer once its tensors are in the file
    writer.add_name(name)
    writer.add_file_type(file_type(qtype_name))
    extra = add_hyperparameters(writer, family, text)
    vocab = add_tokenizer(writer, directory, tokenizer, config, text)
    types: dict[str, int] = {}
    for name, data in [*gguf_tensors(directory, family, text), *extra]:
        array, qtype = stored(name, data, qtype_name)
        writer.add_tensor(name, array, raw_dtype=qtype)
        types[qtype.name] = types.get(qtype.name, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    return {"architecture": family.arch, "tensor_types": types, "tokenizer": vocab, "notes": notes(family, text)}
