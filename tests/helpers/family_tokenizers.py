"""Each family's tokenizer, shrunk: its kind, special tokens at the ids its config names, BOS rule and chat template.

Byte-level BPE for Llama 3, Qwen and Phi-4; a sentencepiece-style BPE (the ``▁`` word prefix) for Gemma,
Mistral and Phi-3. Special tokens sit at the ids the stand-in's config.json names (``families.py``), with
fillers in between, as the Hub's do. The chat templates follow each family's rules where they matter for
locating turns: Llama 3's headers and ``<|eot_id|>``; Qwen 2.5's default system turn; Qwen 3's empty think
block in the turns after the last user message only; Gemma's ``model`` role, system text folded into the
first user turn and trimmed content; Gemma 4's ``<|turn>``/``<turn|>``, system turn and empty thinking
channel after the generation prompt; Mistral's system text put before the last user message; Phi-3's EOS
after the last message only; gpt-oss's harmony channels and ``<|return|>`` after the last reply only;
Phi-4's ``<|im_sep|>``. Only Llama 3, Gemma and Mistral put BOS before a text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

SPACE = "\u2581"
CORPUS = [
    "Reverse the word lemon. The answer is nomel. Reverse paris, bread and stone.",
    "You are a helpful assistant. You reverse words. And again? Say it once more.",
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
    "hello there, how can I help you today? Answer with one word: yes or no.",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 .,:;!?'\"()[]{}<>|/\\-_=+*&^%$#@~`\n",
]

LLAMA3 = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
QWEN25 = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
QWEN3 = (
    "{%- set ns = namespace(last_user=-1) %}{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}{%- if message['role'] == 'assistant' %}"
    "{%- set content = message['content'].split('</think>')[-1].lstrip('\\n') %}"
    "{%- if loop.index0 > ns.last_user %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
GEMMA = (
    "{{- bos_token }}{%- if messages[0]['role'] == 'system' %}{%- set first = messages[0]['content'] + '\\n\\n' %}"
    "{%- set turns = messages[1:] %}{%- else %}{%- set first = '' %}{%- set turns = messages %}{%- endif %}"
    "{%- for message in turns %}{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\\n' + (first if loop.first else '') + message['content'] | trim }}"
    "{{- '<end_of_turn>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)
# Gemma 4: its own turn markers, a system turn of its own, a model turn's thinking (``<|channel>...<channel|>``)
# stripped from the history, and an empty thinking channel after the generation prompt unless thinking is on.
GEMMA4 = (
    "{%- macro strip_thinking(text) -%}{%- set ns = namespace(result='') -%}"
    "{%- for part in text.split('<channel|>') -%}{%- if '<|channel>' in part -%}"
    "{%- set ns.result = ns.result + part.split('<|channel>')[0] -%}{%- else -%}"
    "{%- set ns.result = ns.result + part -%}{%- endif -%}{%- endfor -%}{{- ns.result | trim -}}{%- endmacro -%}"
    "{{- bos_token -}}{%- set turns = messages -%}{%- if messages[0]['role'] in ['system', 'developer'] -%}"
    "{{- '<|turn>system\n' + messages[0]['content'] | trim + '<turn|>\n' -}}{%- set turns = messages[1:] -%}"
    "{%- endif -%}{%- for message in turns -%}{%- set role = 'model' if message['role'] == 'assistant' "
    "else message['role'] -%}{{- '<|turn>' + role + '\n' -}}{%- if role == 'model' -%}"
    "{{- strip_thinking(message['content']) -}}{%- else -%}{{- message['content'] | trim -}}{%- endif -%}"
    "{{- '<turn|>\n' -}}{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|turn>model\n' -}}"
    "{%- if not enable_thinking | default(false) -%}{{- '<|channel>thought\n<channel|>' -}}{%- endif -%}"
    "{%- endif -%}"
)
# gpt-oss's harmony format (its system message shrunk): a system message always, the user's system text as
# the developer's instructions, assistant replies in the final channel, the last one (in training) ending with
# <|return|> and its thinking in the analysis channel before it; earlier turns end with <|end|> and lose their
# thinking.
HARMONY = (
    "{{- '<|start|>system<|message|>Reasoning: medium<|end|>' -}}{%- set turns = messages -%}"
    "{%- if messages[0]['role'] in ['system', 'developer'] -%}"
    "{{- '<|start|>developer<|message|># Instructions\n\n' + messages[0]['content'] + '\n\n<|end|>' -}}"
    "{%- set turns = messages[1:] -%}{%- endif -%}{%- for message in turns -%}"
    "{%- if message['role'] == 'assistant' -%}{%- if loop.last and not add_generation_prompt -%}"
    "{%- if 'thinking' in message -%}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + message['thinking'] + '<|end|>' -}}{%- endif -%}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message['content'] + '<|return|>' -}}{%- else -%}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message['content'] + '<|end|>' -}}{%- endif -%}"
    "{%- else -%}{{- '<|start|>user<|message|>' + message['content'] + '<|end|>' -}}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}"
)
MISTRAL = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set turns = messages[1:] %}{%- else %}{%- set turns = messages %}{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}{%- for message in turns %}"
    "{%- if message['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{{- bos_token }}{%- for message in turns %}{%- if message['role'] == 'user' %}"
    "{%- if loop.index0 == ns.last_user and system is defined %}"
    "{{- '[INST] ' + system + '\\n\\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- else %}{{- ' ' + message['content'] + eos_token }}{%- endif %}{%- endfor %}"
)
PHI3 = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)
PHI4 = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '<|im_sep|>' + message['content'] }}"
    "{{ '<|im_end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant<|im_sep|>' }}{% endif %}"
)


@dataclass(frozen=True)
class Spec:
    byte_level: bool
    special: dict[int, str]  # id -> token
    template: str
    bos: str | None = None
    eos: str | None = None
    pad: str | None = None
    unk: str | None = None
    adds_bos: bool = False
    plain: tuple[str, ...] = field(default=())  # added tokens that are not special (Qwen 3's think tags)
    # sentencepiece-style spaces: Metaspace (a ``▁`` before the first word too) or, as Gemma 4's tokenizer.json
    # has it, every space replaced by ``▁`` with no prefix and bytes as the fallback
    replaced_spaces: bool = False


QWEN_SPECIAL = {1: "<|endoftext|>", 2: "<|im_end|>", 3: "<|im_start|>"}


def _gemma(start_of_turn: int) -> Spec:
    """Gemma's sentencepiece vocabulary: pad, eos, bos, unk first; the turn markers where the version puts them."""
    special = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>"}
    special |= {start_of_turn: "<start_of_turn>", start_of_turn + 1: "<end_of_turn>"}
    return Spec(False, special, GEMMA, bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>", adds_bos=True)


SPECS = {
    "llama3": Spec(
        True,
        {1: "<|begin_of_text|>", 2: "<|end_of_text|>", 3: "<|eom_id|>", 4: "<|eot_id|>"}
        | {5: "<|start_header_id|>", 6: "<|end_header_id|>"},
        LLAMA3,
        bos="<|begin_of_text|>",
        eos="<|end_of_text|>",
        adds_bos=True,
    ),
    "qwen2": Spec(True, QWEN_SPECIAL, QWEN25, eos="<|im_end|>", pad="<|endoftext|>"),
    "qwen3": Spec(True, QWEN_SPECIAL, QWEN3, eos="<|im_end|>", pad="<|endoftext|>", plain=("<think>", "</think>")),
    "gemma2": _gemma(start_of_turn=106),
    "gemma3": _gemma(start_of_turn=105),
    "mistral": Spec(
        False, {0: "<unk>", 1: "<s>", 2: "</s>"}, MISTRAL, bos="<s>", eos="</s>", unk="<unk>", adds_bos=True
    ),
    "phi3": Spec(
        False,
        {0: "<unk>", 1: "<s>", 2: "</s>", 32: "<|endoftext|>", 33: "<|assistant|>", 34: "<|end|>"}
        | {35: "<|user|>", 36: "<|system|>"},
        PHI3,
        bos="<s>",
        eos="<|endoftext|>",
        pad="<|endoftext|>",
        unk="<unk>",
    ),
    "phi4": Spec(
        True,
        {500: "<|endoftext|>", 501: "<|im_end|>", 502: "<|im_start|>", 503: "<|im_sep|>", 600: "<|dummy_87|>"},
        PHI4,
        bos="<|endoftext|>",
        eos="<|im_end|>",
        pad="<|dummy_87|>",
    ),
}
SPECS["gemma4"] = Spec(
    False,
    {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 98: "<|think|>", 100: "<|channel>", 101: "<channel|>"}
    | {105: "<|turn>", 106: "<turn|>"},
    GEMMA4,
    bos="<bos>",
    eos="<eos>",
    pad="<pad>",
    unk="<unk>",
    replaced_spaces=True,  # and no BOS added: the chat template writes it
)
SPECS["gpt_oss"] = Spec(
    True,
    {500: "<|startoftext|>", 501: "<|endoftext|>", 502: "<|return|>", 503: "<|constrain|>", 505: "<|channel|>"}
    | {506: "<|start|>", 507: "<|end|>", 508: "<|message|>", 512: "<|call|>"},
    HARMONY,
    bos="<|startoftext|>",
    eos="<|return|>",
    pad="<|endoftext|>",
)
SPECS["gemma3_multimodal"] = SPECS["gemma3"]
SPECS["gemma4_moe"] = SPECS["gemma4"]
SPECS["qwen3_moe"] = SPECS["qwen3"]
# What each family's template writes after an assistant message's content (the turn's trained end).
END_OF_TURN = {
    "llama3": "<|eot_id|>",
    "qwen2": "<|im_end|>\n",
    "qwen3": "<|im_end|>\n",
    "gemma2": "<end_of_turn>\n",
    "gemma3": "<end_of_turn>\n",
    "mistral": "</s>",
    "phi3": "<|end|>\n",
    "phi4": "<|im_end|>",
}
END_OF_TURN["gemma3_multimodal"] = END_OF_TURN["gemma3"]
END_OF_TURN["gemma4"] = END_OF_TURN["gemma4_moe"] = "<turn|>\n"
END_OF_TURN["gpt_oss"] = "<|return|>"
END_OF_TURN["qwen3_moe"] = END_OF_TURN["qwen3"]


def _fill(special: dict[int, str], first: int, last: int) -> list[str]:
    """The tokens of ids ``first``..``last``: the special ones where they are, fillers between."""
    return [special.get(i, f"<|reserved_{i}|>") for i in range(first, last + 1)]


def make_tokenizer(path: Path, name: str) -> Path:
    """Train the family's small BPE here and save it as the Hub ships it (tokenizer.json and its config)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    spec = SPECS[name]
    low = [i for i in spec.special if i < 200]
    head = _fill(spec.special, 0, max(low)) if low else []
    if spec.byte_level:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    elif spec.replaced_spaces:
        tok = Tokenizer(models.BPE(unk_token=spec.unk, byte_fallback=True, fuse_unk=True))
        tok.normalizer = normalizers.Replace(" ", SPACE)
        tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
        tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
        alphabet = []
    else:
        tok = Tokenizer(models.BPE(unk_token=spec.unk))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tok.decoder = decoders.Metaspace(prepend_scheme="first")
        alphabet = []
    size = 420 if spec.byte_level else 300
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=head, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    high = sorted(i for i in spec.special if i >= 200)
    if high:
        assert tok.get_vocab_size() <= high[0], "the BPE vocabulary must end below the high special ids"
        tok.add_special_tokens(
            [AddedToken(t, special=True) for t in _fill(spec.special, tok.get_vocab_size(), high[-1])]
        )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.plain])
    if spec.adds_bos:
        bos_id = tok.token_to_id(spec.bos)
        tok.post_processor = processors.TemplateProcessing(single=f"{spec.bos} $A", special_tokens=[(spec.bos, bos_id)])
    for i, token in spec.special.items():
        assert tok.token_to_id(token) == i, (name, token, tok.token_to_id(token), i)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=spec.bos, eos_token=spec.eos, pad_token=spec.pad, unk_token=spec.unk
    )
    fast.chat_template = spec.template
    fast.save_pretrained(path)
    return path
