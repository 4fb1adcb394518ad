"""Compile time of a 26-layer Llama (Open Llama 3B's depth, narrow): unrolled layers vs scan_layers.

    python scripts/scan_compile.py            # runs every case in its own process, prints a table

Each case runs 3 training steps on one CPU XLA device and reports torch_xla's CompileTime.
"fwd+bwd" leaves the optimizer out; "step" adds AdamW over every parameter. Losses are printed
so that scan and unrolled can be seen to compute the same thing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

CASES = [("unrolled", False), ("scan", False), ("unrolled", True), ("scan", True)]


def run_case(mode: str, with_optimizer: bool) -> dict:
    import torch
    import torch_xla
    import torch_xla.debug.metrics as met
    from torch import nn
    from torch_xla.experimental.scan_layers import scan_layers
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        attn_implementation="sdpa",  # causal without a mask tensor, so the carried state is small
        use_cache=False,
    )

    class Carry(nn.Module):
        """One decoder layer as a function of the scanned carry (hidden, cos, sin)."""

        def __init__(self, layer: nn.Module):
            super().__init__()
            self.layer = layer

        def forward(self, hidden, cos, sin):
            return self.layer(hidden, attention_mask=None, position_embeddings=(cos, sin)), cos, sin

    class Scanned(nn.Module):
        """Stands in for the layer list: one XLA computation reused for all 26 layers."""

        def __init__(self, layers: nn.ModuleList):
            super().__init__()
            self.layers = nn.ModuleList(Carry(layer) for layer in layers)

        def forward(self, hidden_states, attention_mask=None, position_embeddings=None, **kwargs):
            return scan_layers(self.layers, (hidden_states, *position_embeddings))[0]

    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if mode == "scan":
        model.model.layers = nn.ModuleList([Scanned(model.model.layers)])
    device = torch_xla.device()
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, config.vocab_size, (4, 64)).to(device)
    losses, started = [], time.perf_counter()
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if with_optimizer:
            optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
        losses.append(round(loss.item(), 5))
    count, total = met.metric_data("CompileTime")[:2]
    return {
        "mode": mode,
        "optimizer": with_optimizer,
        "compiles": count,
        "compile_seconds": round(total / 1e9, 1),
        "wall_seconds": round(time.perf_counter() - started, 1),
        "losses": losses,
    }


def main() -> None:
    if len(sys.argv) == 3:
        print(json.dumps(run_case(sys.argv[1], sys.argv[2] == "opt")))
        return
    env = os.environ | {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    rows = []
    for mode, with_optimizer in CASES:
        args = [sys.executable, __file__, mode, "opt" if with_optimizer else "noopt"]
        proc = subprocess.run(args, capture_output=True, text=True, env=env, check=True)
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print("| layers | graph | compile s | compiles | losses |\n|---|---|---|---|---|")
    for r in rows:
        graph = "step (fwd+bwd+AdamW)" if r["optimizer"] else "fwd+bwd"
        print(f"| {r['mode']} | {graph} | {r['compile_seconds']} | {r['compiles']} | {r['losses']} |")


if __name__ == "__main__":
    main()
