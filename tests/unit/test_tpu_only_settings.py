"""The TPU-only paths' settings, checked without tracing: the flash length refused before anything is traced,
libtpu's flags beside the user's (the kernels and steps traced and compiled for a TPU: e2e/test_tpu_only_paths.py).
"""

from __future__ import annotations

from cli_runs import compiler_cli as cli
from markers import needs_compiler

TINY = "recipes/tiny_lora_cpu.yaml"
pytestmark = needs_compiler


def test_flash_at_a_length_its_backward_cannot_tile_is_refused_before_anything_is_traced():
    flash = ["model.attn_implementation=flash", "data.max_length=768"]
    done = cli("memory", TINY, "--compile", "--target", "v5e-8", *flash)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "768 cannot be tiled" in done.stderr and "512 or 1024" in done.stderr


def test_libtpu_flags_are_added_after_the_users_and_never_override_them():
    from lowmem_tpu.xla.runtime import LIBTPU_FLAGS, with_libtpu_flags

    assert with_libtpu_flags("") == " ".join(LIBTPU_FLAGS)
    assert with_libtpu_flags("--a=1") == " ".join(["--a=1", *LIBTPU_FLAGS])
    mine = "--xla_tpu_spmd_rng_bit_generator_unsafe=false"
    assert with_libtpu_flags(mine) == mine


def test_xla_cpu_flags_are_added_after_the_users_and_never_override_them():
    from lowmem_tpu.xla.runtime import CPU_XLA_FLAGS, cpu_xla_flags

    assert cpu_xla_flags("") == " ".join(CPU_XLA_FLAGS)
    assert cpu_xla_flags("--xla_dump_to=/tmp/x") == " ".join(["--xla_dump_to=/tmp/x", *CPU_XLA_FLAGS])
    mine = "--xla_backend_optimization_level=3"
    assert cpu_xla_flags(mine) == mine and cpu_xla_flags(cpu_xla_flags("")) == cpu_xla_flags("")


def test_the_tpu_compiler_gets_the_users_xla_flags_and_the_libtpu_flags_never_the_cpus(monkeypatch, tmp_path):
    from lowmem_tpu.measure.tpu_compile import compiler_env
    from lowmem_tpu.xla.runtime import CPU_XLA_FLAGS, LIBTPU_FLAGS, cpu_xla_flags

    monkeypatch.setenv("XLA_FLAGS", cpu_xla_flags("--xla_mine=1"))  # as a CPU run in this process leaves it
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--libtpu_mine=2")
    env = compiler_env(tmp_path)
    assert env["XLA_FLAGS"].split() == ["--xla_mine=1", f"--xla_dump_to={tmp_path}"]
    assert not set(CPU_XLA_FLAGS) & set(env["XLA_FLAGS"].split())
    assert env["LIBTPU_INIT_ARGS"].split() == ["--libtpu_mine=2", *LIBTPU_FLAGS] and env["JAX_PLATFORMS"] == "cpu"
