#!/usr/bin/env bash
# E7's retrofit matrix: one `focus-pretrain retrofit` per (model, objective, setting), equal
# steps and tokens, then the same trained routers evaluated with other inference settings
# (tools/experiments/e7/evaluate_variants.py). Results: OUT/<run>/report.json, OUT/<run>/variants.json;
# tools/experiments/e7/summarize.py OUT prints the table of docs/experiments.md E7.
# Usage: bash tools/experiments/e7/run_matrix.sh MODELS_DIR CORPUS OUT [STEPS] [RUN ...]
#   MODELS_DIR: fetch_models.sh's DEST (hf/ inside); CORPUS: a text directory or file
#   RUN: name=model:overrides (see RUNS below); default all of RUNS
#   E7_VARIANTS=0: skip evaluate_variants.py (repeats of a row with other seeds need only the
#   report's own soft and hard rows)
set -euo pipefail
MODELS=$1 CORPUS=$2 OUT=$3 STEPS=${4:-15}
shift $(( $# < 4 ? $# : 4 ))
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
# the shared setting: 512-token samples, K=4 groups, window 128, fp32 on a CPU; 8 samples a
# step; 8 validation micro-batches of 4 (16K tokens, the same for every run of a corpus)
COMMON=(--groups 4 --window 128 --report-samples 2 --set data.seq_length=512
  --set data.split=84,16,0 --set train.precision=fp32 --set train.micro_batch_size=4
  --set train.global_batch_size=8 --set train.eval_iters=8 --set train.eval_interval=0
  --set train.warmup_steps=2 --set train.log_interval=1 --set train.save_interval=0
  --set "data.cache_dir=$OUT/cache")
SMOL=smollm2-135m-instruct
RUNS=(
  "smollm2-lm-soft=$SMOL:model.focus.sinks=0"
  "smollm2-lm-soft-sinks4=$SMOL:model.focus.sinks=4"
  "smollm2-distill-soft-sinks4=$SMOL:model.focus.sinks=4,train.objective=distill"
  "gemma3-lm-soft=gemma3-270m:model.focus.sinks=0"
  "smollm2-distill-hard-sinks4=$SMOL:model.focus.sinks=4,train.objective=distill,model.focus.training_mode=hard"
  "smollm2-mix-soft-sinks4=$SMOL:model.focus.sinks=4,train.objective=mix"
)
[ $# -gt 0 ] && RUNS=("$@")
for run in "${RUNS[@]}"; do
  name=${run%%=*} rest=${run#*=}
  model=${rest%%:*} overrides=${rest#*:}
  sets=()
  IFS=, read -ra pairs <<< "$overrides"
  for pair in "${pairs[@]}"; do sets+=(--set "$pair"); done
  echo "== $name ($(date -u +%H:%M:%S))"
  if [ -e "$OUT/$name/report.json" ]; then
    echo "$name: trained already"
  else
    focus-pretrain retrofit "$MODELS/hf/$model" --data "$CORPUS" --steps "$STEPS" \
      --out "$OUT/$name" "${COMMON[@]}" "${sets[@]}" > "$OUT/$name.log" 2>&1 || {
      echo "$name failed: $OUT/$name.log"; continue; }
  fi
  # the variants not evaluated yet (evaluate_variants.py skips the others)
  [ "${E7_VARIANTS:-1}" = 0 ] || python "$HERE/evaluate_variants.py" "$OUT/$name" >> "$OUT/$name.log" 2>&1 ||
    echo "$name: variants failed: $OUT/$name.log"
  tail -n 1 "$OUT/$name.log"
done
