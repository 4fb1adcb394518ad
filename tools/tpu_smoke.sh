#!/usr/bin/env bash
# The first thing to run on a TPU VM (Kaggle's v5e-8, Colab's v5e-1, a Cloud TPU), and what to send back;
# run by hand there (README.md, docs/tpu.md), from the repository's root:
#   bash tools/tpu_smoke.sh [OUT_DIR]        (default: tpu-smoke-<date>)
# 1. lowmem-tpu doctor: versions, libtpu, the chips, a few tiny bf16 steps (compile time, MFU, HBM per chip)
# 2. the tiny recipe in bf16 on the TPU (sharded over every chip): metrics.json, metrics.jsonl
# 3. lowmem-tpu compare on it: LoRA vs full, the TPU compiler's figure beside the runtime's HBM peak
# 4. lowmem-tpu memory --compile for step 2's recipe on this TPU: the compile-only figure beside the HBM peak
#    measured in step 2 (compile_vs_run.json): how far the TPU compiler without a TPU is from a real run
#    and the same for one short flash-attention run at 1024 tokens (the Pallas kernel): flash_vs_run.json
# 5. the shipped recipe of this TPU (open_llama_lora on a v5e-8, open_llama_lora_v5e1 on a v5e-1) trained for 20
#    steps by benchmarks/tpu_step.py: the measured time per micro-batch and HBM peak beside the recorded
#    estimate (compute, interconnect, HBM) and the compiler's figure, in one line starting "tpu-step:"
#    (downloads the model and its data)
# 6. lowmem-tpu memory for the recipes of these TPUs (plans only)
# Every JSON and log lands in OUT_DIR, then one tar.gz of it. A step that fails does not stop the others.
set -u
out="${1:-tpu-smoke-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$out"
cli="${LOWMEM_TPU:-lowmem-tpu}"
device="${LOWMEM_SMOKE_DEVICE:-tpu}"  # cpu rehearses the script itself on the CPU backend
status=0

step() {  # step NAME COMMAND...: run, tee its output to OUT/NAME.log, remember a failure
  local name="$1"
  shift
  echo "== $name: $*"
  if "$@" > >(tee "$out/$name.log") 2> >(tee "$out/$name.stderr.log" >&2); then
    echo "== $name: ok"
  else
    echo "== $name: FAILED (exit $?)"
    status=1
  fi
}

step doctor "$cli" doctor --out "$out/doctor.json"
step tiny-bf16 "$cli" sft recipes/tiny_lora_cpu.yaml runtime.device=$device runtime.target=null model.dtype=bfloat16 \
  train.max_steps=60 train.logging_steps=10 "output_dir=$out/tiny" --overwrite
cp "$out/tiny/final/metrics.json" "$out/tiny-metrics.json" 2>/dev/null
cp "$out/tiny/metrics.jsonl" "$out/tiny-metrics.jsonl" 2>/dev/null
step compare "$cli" compare recipes/tiny_lora_cpu.yaml runtime.device=$device runtime.target=null model.dtype=bfloat16 \
  --steps 5 --out "$out/compare"
# This TPU's catalog name, as the doctor found it (v5e-8, v5e-1, ...): what --compile compiles for.
tpu=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['facts'].get('device') or '')" \
  "$out/doctor.json" 2>/dev/null)
compare_to_run() {  # compare_to_run COMPILE_LOG METRICS_JSON RESULT_JSON: the compile-only figure beside the run's
  python3 - "$1" "$2" "$3" <<'PY' || status=1
import json, sys
compiled = json.load(open(sys.argv[1]))
measured = json.load(open(sys.argv[2]))["memory"]["per_device_bytes"].get("measured_peak")
record = {"compile_only_needed": compiled["needed"], "runtime_measured_peak": measured,
          "ratio": measured / compiled["needed"] if measured and compiled["needed"] else None}
json.dump(record, open(sys.argv[3], "w"), indent=2)
print("compile-only vs run, per chip:", record)
PY
}
if [ -n "$tpu" ]; then
  step compile-only "$cli" memory recipes/tiny_lora_cpu.yaml runtime.target=null model.dtype=bfloat16 \
    --compile --target "$tpu" --json
  compare_to_run "$out/compile-only.log" "$out/tiny-metrics.json" "$out/compile_vs_run.json"
  # flash at 1024 tokens: the tiny model with 1024 positions (its assets copied, the config widened).
  python3 - "$out/tiny-1024" <<'PY'
import json, shutil, sys
from pathlib import Path
import lowmem_tpu
target = Path(sys.argv[1])
shutil.copytree(Path(lowmem_tpu.__file__).parent / "assets" / "tiny-llama", target, dirs_exist_ok=True)
config = json.loads((target / "config.json").read_text()) | {"max_position_embeddings": 1024}
(target / "config.json").write_text(json.dumps(config))
PY
  flash=(recipes/tiny_lora_cpu.yaml runtime.target=null model.dtype=bfloat16 "model.name_or_path=$out/tiny-1024"
    model.attn_implementation=flash data.max_length=1024 train.global_batch_size=16)
  step flash-1024 "$cli" sft "${flash[@]}" runtime.device=tpu train.max_steps=5 train.logging_steps=1 \
    train.eval_samples=0 "output_dir=$out/flash" --overwrite
  step flash-compile-only "$cli" memory "${flash[@]}" --compile --target "$tpu" --json
  compare_to_run "$out/flash-compile-only.log" "$out/flash/final/metrics.json" "$out/flash_vs_run.json"
fi
case "$tpu" in
  v5e-8) shipped=open_llama_lora ;;
  v5e-1) shipped=open_llama_lora_v5e1 ;;
  *) shipped="" ;;
esac
if [ -n "$shipped" ] && [ "$device" = tpu ]; then
  step tpu-step python3 benchmarks/tpu_step.py "recipes/$shipped.yaml" --steps 20
  cp "outputs/tpu_step/$shipped.json" "$out/tpu_step.json" 2>/dev/null
  grep "^tpu-step:" "$out/tpu-step.log"
fi
for recipe in open_llama_lora open_llama_lora_v5e1 open_llama_7b_qlora; do
  step "memory-$recipe" "$cli" memory "recipes/$recipe.yaml" --json
done
rm -rf "$out/tiny/final/"*.safetensors "$out/tiny/checkpoints" "$out/flash/final/"*.safetensors "$out/flash/checkpoints"
tar czf "$out.tar.gz" "$out"
echo "wrote $out/ and $out.tar.gz: attach the tar.gz to your report (and paste its tpu-step line, if any)"
exit $status
