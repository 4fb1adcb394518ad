"""What the code knows about TPUs: the device kind, HBM, peak FLOP/s and MFU, the compiler's refusal.

These cover the shared paths on the CPU, without starting XLA (why torch_xla cannot answer under SPMD, and the
``tpu``-marked tests that run the same functions on a TPU: e2e/test_tpu_runtime.py).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from lowmem_tpu.config.devices import GENERATIONS, GiB, generation_of
from lowmem_tpu.measure.buffers import out_of_memory
from lowmem_tpu.model.architecture import flops_per_token
from lowmem_tpu.xla import tpu


def _pci(root: Path, name: str, vendor: str, device: str, subsystem: str = "0x0000") -> None:
    folder = root / name
    folder.mkdir(parents=True)
    for key, value in (("vendor", vendor), ("device", device), ("subsystem_device", subsystem)):
        (folder / key).write_text(value + "\n")


def test_chips_are_read_from_the_pci_bus(tmp_path, monkeypatch):
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE", raising=False)
    for i in range(8):
        _pci(tmp_path / "v5e", f"0000:00:0{i}.0", "0x1ae0", "0x0063")
    _pci(tmp_path / "v5e", "0000:00:1f.0", "0x8086", "0x0063")  # not Google's: ignored
    chips = tpu.local_chips(str(tmp_path / "v5e"))
    assert (chips.generation.name, chips.count, chips.xla_devices, chips.source) == ("v5e", 8, 8, "pci")
    for i in range(4):
        _pci(tmp_path / "v3", f"0000:00:0{i}.0", "0x1ae0", "0x0027", "0x004f")
    chips = tpu.local_chips(str(tmp_path / "v3"))
    assert (chips.generation.name, chips.count, chips.xla_devices) == ("v3", 4, 8)  # two cores per chip
    assert tpu.local_chips(str(tmp_path / "none")).generation is None


@pytest.mark.parametrize(
    "accelerator, generation, chips",
    [("v5litepod-8", "v5e", 8), ("v5e-1", "v5e", 1), ("v6e-4", "v6e", 4), ("v4-8", "v4", 4), ("v5p-8", "v5p", 4)],
)
def test_accelerator_type_is_the_fallback(tmp_path, monkeypatch, accelerator, generation, chips):
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", accelerator)
    found = tpu.local_chips(str(tmp_path))
    assert (found.generation.name, found.count, found.source) == (generation, chips, "TPU_ACCELERATOR_TYPE")


def test_every_generation_has_a_kind_peak_flops_and_usable_memory():
    for g in GENERATIONS.values():
        assert generation_of(g.kind) is g and generation_of(g.name) is g
        assert g.peak_flops > 1e13 and 0.9 * g.hbm_bytes < g.usable_bytes <= g.hbm_bytes


def test_libtpu_metrics_say_why_they_are_unavailable_here():
    with pytest.raises(tpu.MetricsUnavailable, match="localhost:8431"):
        tpu.hbm_usage(timeout=2)
    monitor = tpu.HbmMonitor(interval=0.05).start()
    assert monitor.per_device() == [] and "8431" in monitor.error
    monitor.stop()
    assert monitor.per_device() == [] and "8431" in monitor.error


def test_a_run_on_another_tpu_than_its_target_warns():
    from lowmem_tpu.xla.runtime import _check_target

    with pytest.warns(UserWarning, match=r"runtime.target is v5e-8 .* but this TPU is 1 x TPU v5 lite"):
        _check_target("v5e-8", "TPU v5 lite", 1)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _check_target("v5e-1", "TPU v5 lite", 1)
        _check_target(None, "TPU v5 lite", 8)


def test_the_compilers_refusal_is_read_into_figures():
    message = (
        "RuntimeError: Bad StatusOr access: RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory "
        "in memory space hbm. Used 31.20G of 15.75G hbm. Exceeded hbm capacity by 15.45G.\n\nTotal hbm usage >= 32G"
    )
    oom = out_of_memory(message)
    assert oom.memory_space == "hbm" and oom.needed_bytes == int(31.2 * GiB) and oom.capacity_bytes == int(15.75 * GiB)
    assert oom.describe() == "does not fit: the compiler asks for 31.20 GiB of 15.75 GiB hbm" and oom.when == "compile"
    small = out_of_memory("Ran out of memory in memory space vmem. Used 32.42M of 16.00M vmem.")
    assert small.memory_space == "vmem" and small.needed_bytes == int(32.42 * 2**20)
    assert "on-chip scratch (VMEM, not HBM)" in small.describe() and "hbm" not in small.describe()
    # At run time (the program compiled, its buffers could not be had): the runtime's figures, as libtpu words them.
    ran = out_of_memory(
        "RuntimeError: Bad StatusOr access: RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to "
        "allocate 129.50M. That was not possible. There are 78.17M free.; (0x0x0_HBM0)"
    )
    assert ran.when == "run" and ran.needed_bytes == int(129.5 * 2**20) and ran.capacity_bytes == int(78.17 * 2**20)
    assert ran.describe().startswith("does not fit: running the step, the TPU could not allocate 0.13 GiB")
    reserve = out_of_memory(
        "RESOURCE_EXHAUSTED: Attempting to reserve 10.51G at the bottom of memory. That was not "
        "possible. There are 8.97G free, 0B reserved, and 8.97G reservable."
    )
    assert reserve.when == "run" and reserve.needed_bytes == int(10.51 * GiB)
    assert out_of_memory("RuntimeError: something else") is None


def test_model_flops_count_attentions_backward_twice():
    config = SimpleNamespace(num_hidden_layers=4, hidden_size=64, vocab_size=100)
    dense, embedding, seq = 50_000, 100 * 64, 32
    attention = 4 * 4 * 64 * seq  # forward: scores and values
    full = flops_per_token(config, dense + embedding, dense + embedding, seq, lora=False)
    assert full == 6 * dense + 3 * attention  # PaLM's 6N + 12 L h s
    lora = flops_per_token(config, dense + embedding, 1000, seq, lora=True)
    assert lora == 4 * dense + 2 * 1000 + 3 * attention
    # A tied embedding (Gemma's) is the LM head's matmul too: counted once in the parameters, it runs as one.
    tied = SimpleNamespace(**vars(config), tie_word_embeddings=True)
    assert flops_per_token(tied, dense + embedding, 1000, seq, lora=True) == lora + 4 * embedding


def test_log_lines_carry_memory_per_device():
    from lowmem_tpu.train.progress import format_log

    cpu = format_log(10, 100, {"loss": 1.0, "memory_planned_gib": 0.004})
    assert cpu.endswith("| memory planned 4.1 MiB/dev")
    tpu_line = format_log(10, 100, {"loss": 1.0, "memory_planned_gib": 11.3, "memory_peak_gib": 10.5})
    assert tpu_line.endswith("| HBM peak 10.50 GiB/dev (planned 11.30 GiB)")


def test_the_first_tpu_run_compares_a_micro_batch_with_the_estimate_of_one():
    """benchmarks/tpu_step.py: the recorded estimate is one program's (a micro-batch's with accumulation); the
    measured step is divided alike, and the HBM peak set beside the compiler's figure, in one line."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "tpu_step.py"
    spec = importlib.util.spec_from_file_location("tpu_step", path)
    tpu_step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tpu_step)
    estimate = {"reported": True, "step_seconds": 0.3, "compute_seconds": 0.3, "ici_seconds": 0.05, "hbm_seconds": 0.2}
    record = {"needed": 9 * GiB, "held": 10 * GiB, "step_estimate": estimate}
    r = tpu_step.compared("open_llama_lora", "v5e-8", 2, 0.9, int(9.9 * GiB), record)
    assert r["measured_micro_batch_seconds"] == 0.45 and r["measured_over_estimate"] == pytest.approx(1.5)
    assert r["measured_peak_over_compiler"] == pytest.approx(1.1)
    line = tpu_step.summary(r)
    assert line.startswith("tpu-step: open_llama_lora on v5e-8: measured 450 ms per micro-batch (2 a step, 900 ms)")
    assert "estimate 300 ms (compute 300, interconnect 50, HBM 200): 1.50x" in line and "(1.10x)" in line
