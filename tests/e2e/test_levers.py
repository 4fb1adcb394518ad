"""Memory levers that change the step's arithmetic: chunked attention equals eager attention, forward and backward;
the chunked loss, the scanned layer's recomputation and packing give what they replace. XLA is started before
any backward here (a CPU backward first breaks XLA backwards in the process); the levers' settings:
unit/test_lever_settings.py."""

from __future__ import annotations

import operator

import pytest
import torch
from attention_models import tiny_llama as _tiny

from lowmem_tpu.model import attention


def _touch_xla() -> None:
    """Start the XLA runtime as every run does (SPMD, 4 CPU devices) before any CPU backward: after one,
    XLA backwards fail in this process; and XLA used without SPMD first makes a later
    SPMD run in the same process crash (measured: a segfault in the next file's training)."""
    from lowmem_tpu.config import RuntimeSection
    from lowmem_tpu.xla.runtime import setup_runtime

    setup_runtime(RuntimeSection(device="cpu", num_cpu_devices=4))


def _run(model, ids, mask, device):
    model = model.to(device)
    labels = ids.masked_fill(mask == 0, -100)
    out = model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device))
    out.loss.backward()
    if device != "cpu":
        import torch_xla

        torch_xla.sync()  # one program for every gradient: .cpu() on each pending one compiles a program each
    grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters()}
    return out.logits.detach().cpu(), out.loss.detach().cpu(), grads


@pytest.fixture
def batch():
    torch.manual_seed(1)
    ids = torch.randint(0, 50, (3, 37))  # 37 keys: blocks of 8, 8, 8, 8 and 5
    mask = torch.ones(3, 37, dtype=torch.long)
    mask[1, 30:] = 0  # right padding, as the data rows have it
    mask[2, 20:] = 0
    return ids, mask


def test_chunked_attention_equals_eager_outputs_and_gradients(batch, monkeypatch):
    _touch_xla()
    monkeypatch.setattr(attention, "BLOCK", 8)
    ids, mask = batch
    (el, eloss, eg), (cl, closs, cg) = (_run(_tiny(impl), ids, mask, "cpu") for impl in ("eager", "chunked"))
    real = mask.bool()
    assert (el - cl)[real].abs().max() < 1e-5 and abs(eloss - closs) < 1e-6
    for name in eg:  # tolerance: fp32 summation order, relative to each gradient's scale
        assert (eg[name] - cg[name]).abs().max() <= 1e-5 * eg[name].abs().max() + 1e-8, name


def test_chunked_attention_on_the_xla_devices_equals_eager_on_the_cpu(batch, monkeypatch):
    import torch_xla

    _touch_xla()
    monkeypatch.setattr(attention, "BLOCK", 32)  # two blocks: one full, one partial
    ids, mask = batch
    el, eloss, eg = _run(_tiny("eager", layers=1), ids, mask, "cpu")
    xl, xloss, xg = _run(_tiny("chunked", layers=1), ids, mask, torch_xla.device())
    assert (el - xl)[mask.bool()].abs().max() < 1e-4 and abs(eloss - xloss) < 1e-5
    assert all((eg[n] - xg[n]).abs().max() <= 1e-4 * eg[n].abs().max() + 1e-7 for n in eg)


def test_a_query_that_sees_nothing_gives_zeros_not_nan():
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    padding = torch.tensor([[0, 0, 1, 1]])  # left padding: the first two queries see no key
    out = attention.ChunkedAttention.apply(q, k, v, padding, 8**-0.5, 2, None, None)  # no window, no soft-cap
    assert torch.isfinite(out).all() and (out[0, :, :2] == 0).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


@pytest.mark.tpu
def test_flash_attention_on_a_tpu_equals_eager():  # pragma: no cover - TPU only
    """The Pallas kernel under SPMD, head size 10 padded to 128 lanes; right padding is exact for real tokens."""
    from lowmem_tpu.config import RuntimeSection
    from lowmem_tpu.xla.runtime import setup_runtime

    runtime = setup_runtime(RuntimeSection(device="tpu"))
    n = runtime.num_devices  # the batch is split over the fsdp axis
    torch.manual_seed(1)
    ids, mask = torch.randint(0, 50, (n, 64)), torch.ones(n, 64, dtype=torch.long)
    mask[0, 40:] = 0
    el, eloss, eg = _run(_tiny("eager", layers=1), ids, mask, "cpu")
    fl, floss, fg = _run(_tiny("flash", layers=1), ids, mask, runtime.device)
    assert (el - fl)[mask.bool()].abs().max() < 2e-2 and abs(eloss - floss) < 1e-2  # the kernel computes in bf16
    assert all((eg[n] - fg[n]).abs().max() <= 5e-2 * eg[n].abs().max() + 1e-5 for n in eg)


@pytest.mark.tpu
def test_flash_on_a_tpu_equals_a_windowed_models_eager_attention_on_rows_as_long_as_its_window():  # pragma: no cover
    """Mistral's window of 128 keys on rows of 128 tokens: flash (no window) computes the model (config.features)."""
    from transformers import MistralConfig, MistralForCausalLM

    from lowmem_tpu.config import RuntimeSection
    from lowmem_tpu.xla.runtime import setup_runtime

    runtime = setup_runtime(RuntimeSection(device="tpu"))
    n = runtime.num_devices
    models = {}
    for impl in ("eager", "flash"):
        attention.register(impl)
        config = MistralConfig(vocab_size=50, hidden_size=40, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, sliding_window=128,
                               attn_implementation=attention.transformers_name(impl))  # fmt: skip
        torch.manual_seed(0)
        models[impl] = MistralForCausalLM(config)
    ids, mask = torch.randint(0, 50, (n, 128)), torch.ones(n, 128, dtype=torch.long)
    el, eloss, _ = _run(models["eager"], ids, mask, "cpu")
    fl, floss, _ = _run(models["flash"], ids, mask, runtime.device)
    assert (el - fl).abs().max() < 2e-2 and abs(eloss - floss) < 1e-2  # the kernel computes in bf16


# ----------------------------------------------------------------------------- train.chunked_loss


def _reference_loss(hidden, weight, labels):
    logits = torch.matmul(hidden, weight.t()).float()
    flat, target = logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
    return torch.nn.functional.cross_entropy(flat, target, ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_loss_equals_the_whole_logits_loss_and_gradients(dtype):
    from lowmem_tpu.model.loss import summed_loss

    _touch_xla()
    torch.manual_seed(0)
    hidden = torch.randn(3, 37, 16).to(dtype).requires_grad_()  # 37 positions: blocks of 8, 8, 8, 8 and 5
    weight = torch.randn(50, 16).to(dtype).requires_grad_()
    labels = torch.randint(0, 50, (3, 37))
    labels[1, 30:], labels[0, :5] = -100, -100  # padding and a masked prompt
    ref = _reference_loss(hidden, weight, labels)
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    total, correct = summed_loss(hidden, weight, labels, chunk=8)
    grads = torch.autograd.grad(total, (hidden, weight))
    predicted = torch.matmul(hidden, weight.t()).float()[:, :-1].argmax(-1)
    assert int(correct) == int(((predicted == labels[:, 1:]) & (labels[:, 1:] != -100)).sum())
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: each gradient rounded once to 8 bits of mantissa
    assert abs(total.item() - ref.item()) <= tol * abs(ref.item())
    for mine, theirs in zip(grads, ref_grads, strict=True):
        assert mine.dtype == dtype
        assert (mine.float() - theirs.float()).abs().max() <= tol * theirs.float().abs().max()


def test_chunked_loss_through_the_model_on_the_xla_devices_equals_the_models_loss(batch, monkeypatch):
    import torch_xla

    from lowmem_tpu.model import loss

    _touch_xla()  # 37 positions: blocks of 5 (config.rules.loss_block)
    ids, mask = batch
    labels = ids.masked_fill(mask == 0, -100)
    device = torch_xla.device()
    reference, chunked = _tiny("eager").to(device), _tiny("eager").to(device)
    loss.add_chunked_loss(chunked)
    inputs = {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}
    expected = reference(**inputs).loss
    expected.backward()
    out = chunked(**inputs, chunked_loss=True)
    assert set(out) == {"loss", "correct"}
    items = int((labels[:, 1:] != -100).sum())
    (out["loss"] / items).backward()
    torch_xla.sync()  # one program for both models' gradients, not one per .cpu() below
    assert abs(out["loss"].item() / items - expected.item()) < 1e-5
    theirs = dict(reference.named_parameters())
    for name, param in chunked.named_parameters():
        g, h = param.grad.cpu(), theirs[name].grad.cpu()
        assert (g - h).abs().max() <= 1e-4 * h.abs().max() + 1e-7, name


def _forward_saves(layer, partition, *args: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
    """``layer(*args)`` through AOTAutograd as torch_xla's scan traces it, backward run; what the forward
    graph saves for the backward one, by node kind."""
    from functorch.compile import aot_function, make_boxed_func

    graphs = []

    def keep(graph, _inputs):
        graphs.append(graph)
        return make_boxed_func(graph)

    out = aot_function(layer, fw_compiler=keep, bw_compiler=keep, partition_fn=partition)(*args)
    out.sum().backward()
    outputs = next(n for n in graphs[0].graph.nodes if n.op == "output").args[0]
    source = [n.args[0] if n.target is operator.getitem else n for n in outputs[1:]]
    return out, [n.op if n.op == "placeholder" else str(n.target) for n in source]


def test_a_checkpointed_scanned_layer_saves_its_inputs_only_and_its_dropout_masks():
    """sharding.scan_layers' partition recomputes the layer in backward, as torch.utils.checkpoint does;
    functorch's min-cut alone saves the matmuls' outputs (34 GiB per v5e-8 chip for the 3B LoRA step)."""
    from functorch.compile import min_cut_rematerialization_partition

    from lowmem_tpu.xla.scan import recompute_all_partition

    def layer(x, w1, w2):
        h = torch.nn.functional.silu(x @ w1)
        return torch.softmax(h @ h.T, dim=-1) @ h @ w2

    def args():
        torch.manual_seed(0)
        return [torch.randn(*s, requires_grad=True) for s in ((8, 16), (16, 32), (32, 16))]

    _, minimal = _forward_saves(layer, min_cut_rematerialization_partition, *args())
    assert any(kind != "placeholder" for kind in minimal)  # what the 3B scan refused for
    eager = args()
    layer(*eager).sum().backward()
    remat = args()
    _, saved = _forward_saves(layer, recompute_all_partition, *remat)
    assert saved and set(saved) == {"placeholder"}
    for a, b in zip(eager, remat, strict=True):
        torch.testing.assert_close(a.grad, b.grad)

    x = torch.ones(64, 64, requires_grad=True)
    out, saved = _forward_saves(lambda t: torch.nn.functional.dropout(t * 3.0, 0.5), recompute_all_partition, x)
    assert "aten.native_dropout.default" in saved, saved  # the mask, never redrawn
    assert torch.equal(x.grad != 0, out != 0)


@pytest.mark.tpu
def test_a_tpu_run_partitions_dropouts_bits_over_the_chips(tmp_path_factory):  # pragma: no cover - TPU only
    """libtpu's --xla_tpu_spmd_rng_bit_generator_unsafe (xla/runtime.py) reaches the run: with it each chip
    draws its own sequences' bits (compiled here: tests/e2e/test_tpu_only_paths.py), so dropout trains and its
    HBM peak stays near the run without dropout instead of growing with the whole batch."""
    import math
    import os

    from tiny_models import train_tiny

    quick = ["runtime.device=tpu", "runtime.target=null", "model.dtype=bfloat16", "data.max_length=128"]
    quick += ["train.max_steps=3", "train.logging_steps=1", "train.eval_samples=0", "data.eval_path=null"]
    _, plain = train_tiny(tmp_path_factory, "no-dropout", *quick)
    _, dropped = train_tiny(tmp_path_factory, "dropout", *quick, "lora.dropout=0.1")
    assert "--xla_tpu_spmd_rng_bit_generator_unsafe=true" in os.environ["LIBTPU_INIT_ARGS"].split()
    assert all(math.isfinite(x["loss"]) for x in dropped.metrics["train"]["losses"])
    peaks = [r.metrics["memory"]["per_device_bytes"]["measured_peak"] for r in (plain, dropped)]
    assert peaks[1] < 1.5 * peaks[0], peaks


# ----------------------------------------------------------------------------- packing


def _per_sample_losses(model, inputs, device, segments=None):
    """Summed next-token loss per sample: per row (unpacked) or per segment of each row (packed)."""
    with torch.no_grad():
        out = model(**{k: v.to(device) for k, v in inputs.items() if k != "labels"})
    logits, labels = out.logits[:, :-1].float().cpu(), inputs["labels"][:, 1:].cpu()
    terms = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="none"
    ).view(labels.shape)
    if segments is None:
        return [row.sum().item() for row in terms]
    owner = segments[:, 1:].cpu()  # each term belongs to its target's sample
    return [terms[b][owner[b] == s].sum().item() for b in range(len(terms)) for s in owner[b].unique() if s != 0]


@pytest.mark.parametrize("impl", ["eager", "sdpa", "chunked"])
def test_a_packed_batch_gives_the_per_sample_losses_of_the_samples_unpacked(impl, monkeypatch):
    import numpy as np

    from lowmem_tpu.data.rows import _pack, _pad
    from lowmem_tpu.model.attention import packed_inputs

    _touch_xla()
    monkeypatch.setattr(attention, "BLOCK", 8)
    rng = np.random.default_rng(0)
    samples = []
    for length in (9, 5, 14, 3, 11, 7):
        ids = rng.integers(0, 50, length)
        labels = ids.copy()
        labels[: length // 3] = -100  # a masked prompt
        samples.append((ids, labels))
    import torch_xla

    device = torch_xla.device()  # on the XLA devices, as training runs
    model = _tiny(impl).to(device).eval()
    tensors = {k: torch.as_tensor(v, dtype=torch.long) for k, v in _pad(samples, 16, 0).items()}
    unpacked = _per_sample_losses(model, tensors, device)
    rows = {k: torch.as_tensor(v, dtype=torch.long) for k, v in _pack(samples, 20, 0).items()}
    assert len(rows["input_ids"]) < len(samples)  # really packed: several samples per row
    inputs = packed_inputs({k: v.to(device) for k, v in rows.items()}, impl, torch.float32)
    packed = _per_sample_losses(model, inputs, device, segments=rows["segment_ids"])
    assert packed == pytest.approx(unpacked, rel=1e-5, abs=1e-5)
    naive = {k: v for k, v in rows.items() if k not in ("segment_ids", "position_ids")}  # samples see each other
    assert _per_sample_losses(model, naive, device, segments=rows["segment_ids"]) != pytest.approx(unpacked, rel=1e-3)
