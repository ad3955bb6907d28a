#!/usr/bin/env bash
# E7's needle test: RULER (lm-evaluation-harness's generator and scoring, offline) on the
# exports of run_matrix.sh's retrofits, all on the same samples. The first run is also scored
# as the original dense model (--focus enabled=false: the baseline), with the window alone
# (window_only=true: the floor) and with top-2; every run with its own settings (hard top-1).
# Results: OUT/<run>.<setting>.json; python tools/experiments/e7/ruler_table.py OUT prints
# the table of docs/experiments.md E7.
# Usage: bash tools/experiments/e7/run_ruler.sh OUT RUN_DIR [RUN_DIR ...]
#   E7_RULER_ARGS: the ruler options (default below: two needle tasks at 1K and 2K tokens)
set -euo pipefail
OUT=$1
shift
ARGS=(${E7_RULER_ARGS:---tasks niah_single_1 niah_multikey_2 --lengths 1024 2048 --samples 20 --max-new-tokens 16})
mkdir -p "$OUT"
score() {  # NAME EXPORT [--focus KEY=VALUE ...]: skipped when OUT/NAME.json exists
  local name=$1 export=$2
  shift 2
  if [ -e "$OUT/$name.json" ]; then
    echo "$name: scored already"
    return
  fi
  echo "== $name ($(date -u +%H:%M:%S))"
  if ! focus-pretrain ruler "$export" "${ARGS[@]}" "$@" --json "$OUT/$name.json" \
    --markdown "$OUT/$name.md" > "$OUT/$name.log" 2>&1; then
    echo "run_ruler: $name failed; its log: $OUT/$name.log" >&2
    tail -n 3 "$OUT/$name.log" >&2
    exit 1
  fi
  cat "$OUT/$name.md"
}
first=$1
for run in "$@"; do
  name=$(basename "$run")
  if [ "$run" = "$first" ]; then
    score "$name.dense" "$run/export" --focus enabled=false
    score "$name.window" "$run/export" --focus window_only=true
    score "$name.top2" "$run/export" --focus top_k=2
  fi
  score "$name.top1" "$run/export"
done
