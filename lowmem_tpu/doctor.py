"""``lowmem-tpu doctor``: the first command to run on a TPU VM, and what to paste into a bug report.

It checks the installation (versions against constraints.txt, torch against torch_xla, libtpu and
tpu-info), the platform (the TPU chips on the PCI bus, a process already holding them, PJRT_DEVICE),
host RAM and the compile cache; then it trains a few steps of a tiny bf16 LoRA model sharded over
every device (``lowmem-tpu sft`` in a subprocess, so a crash in the runtime is a failed check) and
reports compile time, step time, memory per device and MFU, and on a TPU whether a second run's
compile hit the persistent cache. Every check that fails says what to do; the report is written
as JSON either way.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from lowmem_tpu.config.devices import GiB, device_for
from lowmem_tpu.console import size
from lowmem_tpu.machine import host_memory, meminfo, tpu_present

CONSTRAINTS = Path(__file__).resolve().with_name("constraints.txt")  # shipped with the package, any install
CORE = ("torch", "torch_xla", "transformers", "trl", "peft", "datasets", "accelerate", "protobuf", "sentencepiece")
# The embedded tiny recipe, in bf16, on whatever devices are here, without its held-out evaluation.
TRAIN_OVERRIDES = [
    "runtime.device=auto",
    "runtime.target=null",
    "model.dtype=bfloat16",
    "train.logging_steps=2",
    "train.eval_samples=0",
    "data.eval_path=null",
]


@dataclass(frozen=True)
class Check:
    """One line of the report: ``status`` is ok, warn, fail or skip; ``fix`` says what to do."""

    name: str
    status: str
    detail: str
    fix: str = ""


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def pinned_versions(path: Path = CONSTRAINTS) -> dict[str, str]:
    """``name==version`` lines of constraints.txt, by normalized name."""
    if not path.exists():
        return {}
    pins = {}
    for line in path.read_text().splitlines():
        match = re.match(r"^\s*([A-Za-z0-9_.\-]+)==([^\s#;]+)", line)
        if match:
            pins[match.group(1).lower().replace("_", "-")] = match.group(2)
    return pins


def check_versions(pins: dict[str, str]) -> list[Check]:
    """The core stack against constraints.txt, and torch against torch_xla (they must share major.minor)."""
    checks = []
    for package in CORE:
        installed, pinned = _version(package), pins.get(package.replace("_", "-"))
        if installed is None:
            fix = f"pip install -c constraints.txt {package}" if pinned else f"pip install {package}"
            checks.append(Check(package, "fail", "not installed", fix))
        elif pinned and installed != pinned:
            detail = f"{installed}, constraints.txt pins {pinned}"
            checks.append(Check(package, "warn", detail, f"pip install -c constraints.txt {package}=={pinned}"))
        else:
            checks.append(Check(package, "ok", installed + ("" if pinned else " (constraints.txt not found)")))
    torch, xla = _version("torch"), _version("torch_xla")
    if torch and xla and torch.split(".")[:2] != xla.split(".")[:2]:
        fix = f"pip install torch=={'.'.join(xla.split('.')[:2])}.* (torch_xla {xla} needs the same torch release)"
        checks.append(Check("torch / torch_xla", "fail", f"torch {torch} with torch_xla {xla}", fix))
    return checks


# Optional pieces and what needs them: each is checked against constraints.txt when installed.
EXTRAS = {
    "libtpu": "the TPU runtime (on a TPU) and the TPU compiler (`memory --compile`)",
    "jax": "flash attention's Pallas kernel (on a TPU), sharding.scan_layers and `memory --compile`",
    "jaxlib": "jax",
    "torchax": "sharding.scan_layers",
    "tpu-info": "HBM per chip under SPMD (on a TPU)",
}


def check_extras(pins: dict[str, str]) -> list[Check]:
    """The optional packages against their pins: a different version is a warning, a missing one said once."""
    checks = []
    for package, needed_by in EXTRAS.items():
        installed, pinned = _version(package), pins.get(package)
        if installed is None:
            checks.append(Check(package, "skip", f"not installed (needed for {needed_by})"))
        elif pinned and installed != pinned:
            detail = f"{installed}, constraints.txt pins {pinned} (for {needed_by})"
            checks.append(Check(package, "warn", detail, f"pip install -c constraints.txt {package}=={pinned}"))
        else:
            checks.append(Check(package, "ok", installed))
    return checks


def check_tpu_compiler(timeout: float = 300) -> Check:
    """One tiny program compiled for v5e:1x1 by libtpu's compile-only client (`memory --compile` works here)."""
    if _version("jax") is None or _version("libtpu") is None:
        fix = 'pip install -c constraints.txt -e ".[compiler]" (or "lowmem-tpu[compiler]")'
        return Check("TPU compiler", "skip", "not installed: `memory --compile` is unavailable", fix)
    with tempfile.TemporaryDirectory(prefix="lowmem-doctor-probe-") as tmp:
        result = Path(tmp) / "probe.json"
        command = [sys.executable, "-m", "lowmem_tpu.measure.libtpu", "--probe", str(result)]
        from lowmem_tpu.xla.runtime import without_cpu_flags

        flags = without_cpu_flags(os.environ.get("XLA_FLAGS", ""))  # the TPU compiler: the user's flags only
        env = os.environ | {"TF_CPP_MIN_LOG_LEVEL": "3", "XLA_FLAGS": flags}
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return Check("TPU compiler", "warn", f"a tiny compile took over {timeout:.0f} s")
        if not result.exists():
            tail = " | ".join(line for line in done.stderr.splitlines()[-3:] if line.strip())
            return Check(
                "TPU compiler",
                "warn",
                f"a tiny compile failed: {tail}",
                "pip install -c constraints.txt libtpu jax jaxlib",
            )
        probe = json.loads(result.read_text())
    detail = f"libtpu {probe['libtpu']} compiled a program for {probe['kind']} (v5e:1x1) in {probe['seconds']} s"
    return Check("TPU compiler", "ok", detail + ": `lowmem-tpu memory RECIPE --compile` works here")


def check_platform() -> tuple[list[Check], dict[str, Any]]:
    """The TPU chips here, who holds them, libtpu and tpu-info, PJRT_DEVICE; and facts for the report."""
    from lowmem_tpu.xla.tpu import chip_owners, local_chips

    chips = local_chips()
    chosen = os.environ.get("PJRT_DEVICE")
    facts: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine()}
    facts |= {
        "pjrt_device": chosen,
        "chips": chips.count,
        "chip_generation": chips.generation.name if chips.generation else None,
    }
    checks: list[Check] = []
    if chips.generation is None and not tpu_present():
        checks.append(Check("platform", "ok", "no TPU here: the CPU backend (virtual XLA devices)"))
        return checks, facts
    vm = device_for(chips.generation.name, chips.xla_devices) if chips.generation else None
    what = f"{chips.count} x TPU {chips.generation.name} chip(s) ({chips.source})" if chips.generation else "a TPU"
    facts["device"] = vm.name if vm else None
    checks.append(Check("platform", "ok", what + (f": {vm.about}" if vm else "")))
    if chosen and chosen.upper() != "TPU":
        checks.append(Check("PJRT_DEVICE", "fail", f"PJRT_DEVICE={chosen} hides the TPU", "unset PJRT_DEVICE"))
    owners = {path: pid for path, pid in chip_owners().items() if pid != os.getpid()}
    if owners:
        pids = sorted(set(owners.values()))
        detail = f"held by process {', '.join(map(str, pids))}: {_command(pids[0])}"
        fix = "stop it (kill PID), or restart the notebook's kernel: one process at a time can use the TPU"
        checks.append(Check("TPU free", "fail", detail, fix))
    libtpu = _version("libtpu") or _version("libtpu-nightly")
    fix = 'pip install -c constraints.txt "torch_xla[tpu]"'
    found = Check("TPU runtime", "ok", f"libtpu {libtpu}")
    checks.append(found if libtpu else Check("TPU runtime", "fail", "libtpu is not installed", fix))
    info = _version("tpu-info")
    detail = "not installed: no HBM figures under SPMD"
    checks.append(Check("tpu-info", "ok", info) if info else Check("tpu-info", "warn", detail, "pip install tpu-info"))
    return checks, facts


def _flash_check() -> Check:
    """On a TPU: torch_xla's flash kernel is traced by jax (torch_xla/experimental/custom_kernel.py imports it)."""
    if _version("jax") is None:
        fix = 'pip install -c constraints.txt -e ".[tpu]" (brings jax and jaxlib, torch_xla[pallas]\'s pins)'
        return Check("flash attention", "fail", "jax is not installed: model.attn_implementation=flash cannot run", fix)
    return Check("flash attention", "ok", f"jax {_version('jax')}: torch_xla's Pallas kernels can be traced")


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()[:120] or "?"
    except OSError:
        return "?"


def check_host(platform_name: str) -> list[Check]:
    """Host RAM and whether the compile cache directory is writable."""
    available = meminfo("MemAvailable")
    ram = f"{host_memory() / GiB:.1f} GiB, {available / GiB:.1f} GiB available" if available else "unknown"
    checks = [Check("host RAM", "ok" if not available or available > 4 * GiB else "warn", ram)]
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lowmem-tpu" / f"xla-{platform_name}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root):
            pass
        checks.append(Check("compile cache", "ok", f"{root} is writable"))
    except OSError as err:
        fix = "set runtime.compile_cache_dir to a writable directory, or XDG_CACHE_HOME"
        checks.append(Check("compile cache", "fail", f"{root}: {err.strerror}", fix))
    return checks


# ----------------------------------------------------------------------------- a few real steps


def _sft(out: Path, cache: Path, steps: int, timeout: float) -> tuple[dict[str, Any] | None, str]:
    """``lowmem-tpu sft`` of the tiny recipe in a subprocess: its metrics.json, or None and the error's tail."""
    from lowmem_tpu.config import find_recipe

    overrides = [
        *TRAIN_OVERRIDES,
        f"train.max_steps={steps}",
        f"runtime.compile_cache_dir={cache}",
        f"output_dir={out}",
    ]
    command = [sys.executable, "-m", "lowmem_tpu.cli", "sft", str(find_recipe("tiny_lora_cpu")), *overrides]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env=os.environ | {"HF_HUB_OFFLINE": "1"}
        )
    except subprocess.TimeoutExpired:
        return None, f"did not finish in {timeout:.0f} s"
    metrics = out / "final" / "metrics.json"
    if done.returncode or not metrics.exists():
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip() and "GSPMD" not in line]
        return None, f"exit {done.returncode}: " + " | ".join(lines[-6:])
    return json.loads(metrics.read_text()), ""


def check_training(on_tpu: bool, steps: int = 8, timeout: float = 1200) -> tuple[list[Check], dict[str, Any]]:
    """Train the tiny bf16 LoRA recipe on every device; on a TPU run it again to see the compile cache reused."""
    with tempfile.TemporaryDirectory(prefix="lowmem-doctor-") as tmp:
        cache = Path(tmp) / "xla-cache"
        first, error = _sft(Path(tmp) / "run", cache, steps, timeout)
        if first is None:
            fix = "read the error above; `lowmem-tpu doctor --skip-train` still checks the installation"
            return [Check("training", "fail", error, fix)], {}
        second, second_error = _sft(Path(tmp) / "again", cache, 3, timeout) if on_tpu else (None, "")
    train, compiles, memory = first["train"], first["compiles"], first.get("memory", {})
    losses = [entry["loss"] for entry in train["losses"]]
    facts = {
        "devices": f"{first['num_devices']} x {first['platform']}",
        "losses": losses,
        "compile_seconds": compiles["seconds"],
        "compiles": compiles["total"],
        "steady_step_time": train["steady_step_time"],
        "steady_mfu": train["steady_mfu"],
        "memory": memory,
    }
    kind = first.get("device_kind", first["platform"])
    capacity = memory.get("per_device_bytes", {}).get("device_memory")
    each = f", {size(capacity)} each" if capacity else ""
    checks = [Check("devices", "ok", f"{first['num_devices']} x {kind}{each}, one SPMD mesh"), _loss_check(losses)]
    step = train["steady_step_time"]
    timing = f"{compiles['total']} compiles in {compiles['seconds']:.1f} s; " + (f"{step:.3f} s/step" if step else "")
    checks.append(Check("compile and step time", "ok", timing.rstrip("; ")))
    checks.append(_memory_check(memory, on_tpu))
    if on_tpu:
        mfu = train["steady_mfu"]
        detail = f"{mfu:.1%} (a tiny model: only that it is measured matters)" if mfu else "not computed"
        fix = "" if mfu else "the device kind is unknown: report `lowmem-tpu doctor` output as a bug"
        checks.append(Check("MFU", "ok" if mfu else "fail", detail, fix))
        checks.append(_cache_check(second, second_error))
        facts["second_run_cache"] = second["compiles"]["persistent_cache"] if second else second_error
    else:
        checks.append(Check("compile cache reuse", "skip", "the CPU backend cannot read its cache back (a TPU can)"))
    return checks, facts


def _loss_check(losses: list[float]) -> Check:
    if not losses or any(loss != loss or abs(loss) == float("inf") for loss in losses):
        return Check("training", "fail", f"losses {losses}", "a non-finite loss on a tiny model: report it as a bug")
    went = "went down" if losses[-1] < losses[0] else "did not go down"
    detail = f"bf16 LoRA, loss {losses[0]:.3f} -> {losses[-1]:.3f} ({went})"
    return Check("training", "ok" if losses[-1] < losses[0] else "warn", detail)


def _memory_check(memory: dict[str, Any], on_tpu: bool) -> Check:
    figures = memory.get("per_device_bytes", {})
    planned = f"planned {size(figures['planned_peak'])}" if "planned_peak" in figures else "not planned"
    if "measured_peak" in figures:
        return Check("memory per device", "ok", f"measured peak {size(figures['measured_peak'])}, {planned}")
    if on_tpu:
        fix = "pip install tpu-info (libtpu's runtime metrics give HBM per chip)"
        return Check("memory per device", "fail", f"{planned}; not measured: {memory.get('not_measured')}", fix)
    return Check("memory per device", "ok", f"{planned} (measured figures need a TPU)")


def _cache_check(second: dict[str, Any] | None, error: str) -> Check:
    if second is None:
        return Check("compile cache reuse", "fail", f"the second run failed: {error}")
    cache = second["compiles"]["persistent_cache"]
    if cache["hits"]:
        return Check("compile cache reuse", "ok", f"{cache['hits']} programs read back, {cache['misses']} compiled")
    fix = "check that the cache directory is on a local disk and not full"
    return Check("compile cache reuse", "warn", f"a second run read nothing back ({cache})", fix)


# ----------------------------------------------------------------------------- the report


def _slice_check(on_tpu: bool) -> Check | None:
    """On one host of a pod slice the training check cannot run alone: say so instead of hanging."""
    from lowmem_tpu.xla.runtime import slice_hosts

    count = slice_hosts("tpu") if on_tpu else 1
    if count == 1:
        return None
    detail = f"this VM is one of {count} hosts: the training check (a one-host TPU program) would wait for the others"
    fix = "train the tiny recipe on every host at once (see docs/pods.md), or run doctor on a single-host VM"
    return Check("pod slice", "warn", detail, fix)


def run_doctor(out: Path, train: bool = True, echo: Any = print) -> dict[str, Any]:
    """Run every check, printing each as it comes; write the report to ``out`` (JSON) and return it."""
    from lowmem_tpu import __version__

    report: dict[str, Any] = {"lowmem_tpu": __version__, "checks": [], "facts": {}}

    def add(checks: list[Check]) -> None:
        for check in checks:
            report["checks"].append(asdict(check))
            fix = f"\n      fix: {check.fix}" if check.fix and check.status in ("fail", "warn") else ""
            echo(f"  {check.status:<5} {check.name:<24}{check.detail}{fix}")

    echo("installation")
    pins = pinned_versions()
    add(check_versions(pins))
    add(check_extras(pins))
    echo("platform")
    checks, facts = check_platform()
    report["facts"] |= facts
    add(checks)
    on_tpu = facts.get("chip_generation") is not None or tpu_present()
    add(check_host("tpu" if on_tpu else "cpu"))
    add([check_tpu_compiler()] if not on_tpu else [_flash_check()])
    hosts = _slice_check(on_tpu)
    if hosts:
        add([hosts])
        train = False
    if train:
        echo(f"training a tiny bf16 LoRA model on every {'TPU' if on_tpu else 'CPU-backend'} device (about a minute)")
        checks, facts = check_training(on_tpu)
        report["training"] = facts
        add(checks)
    report["ok"] = not any(c["status"] == "fail" for c in report["checks"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return report
