#!/usr/bin/env bash
# The first thing to run on a TPU VM (Kaggle's v5e-8, Colab's v5e-1, a Cloud TPU), and what to send back:
#   bash scripts/tpu_smoke.sh [OUT_DIR]        (default: tpu-smoke-<date>)
# 1. lowmem-tpu doctor: versions, libtpu, the chips, a few tiny bf16 steps (compile time, MFU, HBM per chip)
# 2. the tiny recipe in bf16 on the TPU (sharded over every chip): metrics.json, metrics.jsonl
# 3. lowmem-tpu compare on it: LoRA vs full, the TPU compiler's figure beside the runtime's HBM peak
# 4. lowmem-tpu memory --compile for step 2's recipe on this TPU: the compile-only figure beside the HBM peak
#    measured in step 2 (compile_vs_run.json): how far the TPU compiler without a TPU is from a real run
# 5. lowmem-tpu memory for the recipe of this TPU (plans only)
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
if [ -n "$tpu" ]; then
  step compile-only "$cli" memory recipes/tiny_lora_cpu.yaml runtime.target=null model.dtype=bfloat16 \
    --compile --device "$tpu" --json
  python3 - "$out" <<'PY' || status=1
import json, sys
out = sys.argv[1]
compiled = json.load(open(f"{out}/compile-only.log"))
measured = json.load(open(f"{out}/tiny-metrics.json"))["memory"]["per_device_bytes"].get("measured_peak")
record = {"compile_only_needed": compiled["needed"], "runtime_measured_peak": measured,
          "ratio": measured / compiled["needed"] if measured and compiled["needed"] else None}
json.dump(record, open(f"{out}/compile_vs_run.json", "w"), indent=2)
print("compile-only vs run, per chip:", record)
PY
fi
for recipe in open_llama_lora open_llama_lora_v5e1 open_llama_7b_qlora; do
  step "memory-$recipe" "$cli" memory "recipes/$recipe.yaml" --json
done
rm -rf "$out/tiny/final/"*.safetensors "$out/tiny/checkpoints"
tar czf "$out.tar.gz" "$out"
echo "wrote $out/ and $out.tar.gz: attach the tar.gz to your report"
exit $status
