"""``lowmem-tpu generate`` and ``lowmem-tpu chat``: a trained model, prompts formatted as its run trained it.

On the XLA devices (the TPU, or the CPU backend) the weights are placed as training places them
(FSDP over every device) and decoding compiles a bounded number of graphs (see ``decode``);
``device="cpu"`` runs plain PyTorch on the host instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowmem_tpu.data.chat import reply_text
from lowmem_tpu.errors import UserError
from lowmem_tpu.infer.decode import Decoder, Generation

DEFAULT_NEW_TOKENS = 128


@dataclass(frozen=True)
class Options:
    """How to decode: the CLI's flags."""

    max_new_tokens: int | None = None  # None: up to 128, within the model's positions
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    raw: bool = False  # the prompt as it is, whatever the model was trained on
    device: str = "xla"  # xla: the TPU or the CPU backend; cpu: plain PyTorch
    base: str | None = None  # an adapter's base, when not the recorded one


class Session:
    """A loaded model and its decoder; ``history`` is the conversation ``chat`` keeps."""

    def __init__(self, directory: Path, options: Options):
        if options.device not in ("xla", "cpu"):
            raise UserError(f"--device {options.device}: choose xla (the TPU or the CPU backend) or cpu")
        if options.temperature < 0 or not 0 < options.top_p <= 1:
            raise UserError("--temperature must be >= 0 and --top-p in (0, 1]")
        if options.max_new_tokens is not None and options.max_new_tokens < 1:
            raise UserError("--max-new-tokens must be at least 1")
        from lowmem_tpu.console import quiet_python_warnings

        quiet_python_warnings()
        from lowmem_tpu.infer.load import kind_of, load_trained

        kind_of(Path(directory))  # a wrong directory fails before anything starts
        self.options = options
        self.compiles: Callable[[], int] = lambda: 0
        device, sync = self._start(options.device)

        self.trained = load_trained(directory, base=options.base, force=options.base is not None)
        model = self.trained.model
        if options.device == "xla":
            from lowmem_tpu.xla.sharding import place_parameters

            place_parameters(model, self.runtime, "fsdp")
        tokenizer = self.trained.tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        from lowmem_tpu.data.chat import ending

        self.ending = ending(tokenizer, model)
        self.decoder = Decoder(model, device, sync, self.ending.ids, pad or 0, self.trained.max_positions)
        self.history: list[dict[str, str]] = []
        self.compiles_at_start = self.compiles()

    def _start(self, device: str) -> tuple[Any, Callable[[], None]]:
        import torch

        if device == "cpu":
            os.environ.setdefault("PJRT_DEVICE", "CPU")  # transformers imports torch_xla: keep it off the TPU
            return torch.device("cpu"), lambda: None
        from lowmem_tpu.config import RuntimeSection
        from lowmem_tpu.xla import runtime as rt

        self.runtime = rt.setup_runtime(RuntimeSection(device="auto", num_cpu_devices=1))
        self.compiles = rt.compile_count
        return self.runtime.device, rt.sync

    @property
    def prompt_format(self) -> str | None:
        """chat, alpaca or None (raw)."""
        from lowmem_tpu.data.formats import prompt_style

        return None if self.options.raw else prompt_style(self.trained.data_format)

    def _ids(self, messages: list[dict[str, str]]) -> list[int]:
        from lowmem_tpu.data import generation_prompt

        return generation_prompt(self.trained.tokenizer, self.prompt_format, messages)

    def _decode(self, ids: list[int]) -> tuple[str, Generation]:
        o = self.options
        room = self.decoder.positions - len(ids)
        new = o.max_new_tokens or (min(DEFAULT_NEW_TOKENS, room) if room > 0 else DEFAULT_NEW_TOKENS)
        result = self.decoder.generate(ids, new, temperature=o.temperature, top_p=o.top_p, seed=o.seed)
        return self.ending.clean(reply_text(self.trained.tokenizer, result.ids)), result

    def complete(self, prompt: str) -> tuple[str, Generation]:
        """The completion of one prompt (no history)."""
        return self._decode(self._ids([{"role": "user", "content": prompt}]))

    def reply(self, message: str) -> tuple[str, Generation]:
        """One chat turn: the whole conversation goes to a chat model; others see only this message."""
        turn = [*self.history, {"role": "user", "content": message}]
        text, result = self._decode(self._ids(turn if self.prompt_format == "chat" else turn[-1:]))
        self.history = [*turn, {"role": "assistant", "content": text}]
        return text, result

    def reset(self) -> None:
        self.history = []

    @property
    def graphs(self) -> int:
        """XLA graphs compiled for decoding so far (0 on plain CPU PyTorch)."""
        return self.compiles() - self.compiles_at_start
