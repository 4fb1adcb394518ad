"""``lowmem-tpu doctor`` on this machine: every check, a few real bf16 steps, the JSON report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "lowmem_tpu.cli", "doctor", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=os.environ | (env or {}), timeout=900)


def test_doctor_passes_here_and_writes_its_report(tmp_path):
    out = tmp_path / "report" / "doctor.json"
    done = doctor("--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "all checks passed" in done.stdout and "Traceback" not in done.stderr
    report = json.loads(out.read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert report["ok"] and checks["torch_xla"]["detail"] == "2.9.0"
    assert checks["platform"]["detail"].startswith("no TPU here") and "TPU runtime" not in checks
    # The pinned optional pieces, each against constraints.txt, and the TPU compiler without a TPU.
    assert checks["libtpu"] == {"name": "libtpu", "status": "ok", "detail": "0.0.21", "fix": ""}
    assert checks["jax"]["detail"] == checks["jaxlib"]["detail"] == "0.7.1"
    assert checks["TPU compiler"]["status"] == "ok" and "TPU v5 lite" in checks["TPU compiler"]["detail"]
    assert checks["training"]["status"] == "ok" and "went down" in checks["training"]["detail"]
    assert checks["devices"]["detail"].startswith("4 x cpu")
    training = report["training"]
    assert training["compiles"] > 0 and training["compile_seconds"] > 0 and training["steady_step_time"] > 0
    assert training["memory"]["per_device_gib"]["planned_peak"] > 0  # planned: the CPU backend measures nothing
    assert "allocator statistics" in training["memory"]["not_measured"]
    assert checks["compile cache reuse"]["status"] == "skip"


def test_a_failed_check_says_what_to_do_exits_1_and_still_writes_the_report(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    out = tmp_path / "doctor.json"
    done = doctor("--skip-train", "--out", str(out), env={"XDG_CACHE_HOME": str(blocker)})
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "fail  compile cache" in done.stdout and "fix: set runtime.compile_cache_dir" in done.stdout
    assert "1 failed (compile cache)" in done.stdout
    report = json.loads(out.read_text())
    assert not report["ok"] and "training" not in report
