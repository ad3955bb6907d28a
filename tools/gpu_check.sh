#!/usr/bin/env bash
# GPU bring-up: on a bare CUDA machine, install what is missing, then run in order
#   env     the GPU, driver and package versions, a matmul and copy ceiling
#   tests   pytest -m gpu (fast paths vs the reference, the model on CUDA + NCCL)
#   e2e     the end-to-end tests that run in one process (train, resume, bf16, retrofit,
#           export) on CUDA
#   recipe  the tiny recipe for a few hundred steps in bf16 on the GPU
#   bench   the attention benchmark (tools/bench_attention.py)
#   graphs  the hard path at 4K-32K captured whole (CUDA graphs, torch.compile reduce-overhead)
#           against dense SDPA captured alike: launches and host syncs per call next to the
#           time; targets: >= 1.0x dense at 4K, >= 2x at 16K (K=8, top-1)
#   train   the training step vs dense at 8K-32K: soft gate (triton, flex) and sparse training
#           (hard_gated, flex, top-1 and top-2) (bench_attention.py --train)
#   sparse_train  sparse training (hard_gated, top-1, K=8: triton's sorted path, flex) vs dense
#           fwd+bwd at 16K-1M,
#           with the pair-count ideal (goal: >= 0.7x the ideal from 16K)
#   ring    one ring step, fused (flex, triton) vs blockwise (tools/bench_ring_step.py)
#   mfu     the ~1B recipe and its dense twin (tools/measure_mfu.py)
#   mfu_triton  the ~1B recipe trained through the triton backend (focus.backend=triton)
#   dot     the dot gate form's training step vs dense at 8K-64K: its soft pattern (plain causal
#           attention on q, k widened by K channels: sdpa, flex) and sparse training (the hard
#           pattern, top-1: triton, flex), each checked against the reference (experiment E6)
#   decode  the export's sparse KV decode step vs the dense cache (tools/bench_decode.py), bf16,
#           16 heads x 128, K=8, top-1, at 16K, 64K and 256K, batch 1 and 8 (DECODE_SEQ,
#           DECODE_BATCH): the static cache's compiled step as a CUDA graph (block-sparse vs
#           dense SDPA) and the dynamic cache's eager step (DECODE_CACHES, default both; quick:
#           static); target >= 4x dense at 64K (issue 42)
#   generate  generate() end to end (prefill + GENERATE_TOKENS, default 64, greedy) at
#           GENERATE_SEQ (default 65536), batch 1, plain SDPA vs Focus, dynamic cache (eager) and
#           static cache (transformers compiles the step, CUDA graphs): what a user waits for
#   keys    the keys' rule (key_groups: own_and_previous) through flex against dense at 8K-32K
#           (KEYS_SEQ): hard top-1 and top-2 of K=8 forward, and the training step (soft gate,
#           sparse training top-1); the method's own rule: the train and graphs stages
#   tune    the triton training kernels: checked against the reference, every candidate tile
#           timed (compiled in parallel first), the fastest written to $OUT/triton_tiles.json
#           (copy it over focus_pretrain/focus/triton_tiles.json), the profile (each kernel per
#           ingredient, non-kernel time, dense beside) and the step per length against dense and
#           TUNE_RIVALS (default flex), written to the table as the ranking auto trains by
#           (tools/tune_triton.py)
# and writes every log and JSON to $OUT (default runs/gpu-check). Stages are chosen by name:
#   bash tools/gpu_check.sh                      # all of them
#   bash tools/gpu_check.sh env tests recipe     # some
#   bash tools/gpu_check.sh quick                # one device call of about 9 minutes: env (60 s),
#       the GPU tests on 14 workers (240 s), graphs at 4K/16K (70 s), training rows at 8K/16K
#       (70 s), decode at 64K, batch 1 and 8, static cache (120 s); each stage's limit set so that the summary
#       always comes back (the device call's timeout_s: 570)
#   bash tools/gpu_check.sh long                 # the second call: the longer rows (graphs at
#       32K, training at 32K, sparse training, decode at 16K-256K), about 9 minutes too
# Each stage gets a time limit (TIMEOUT_<stage>, else STAGE_TIMEOUT seconds, default 600); a failed stage is
# recorded in $OUT/summary.tsv and the next one still runs. Wheels the image lacks are installed
# from .whl/ (bash ../shared/gpu/fetch-device-wheels.sh) into /tmp/site when present.
# Sizes are overridable: BENCH_SEQ, BENCH_ARGS, GRAPHS_SEQ, GRAPHS_ARGS, TRAIN_SEQ, SPARSE_TRAIN_SEQ,
# RING_ARGS, MFU_ARGS, RECIPE_STEPS, TUNE_LENGTHS, TUNE_ARGS, DOT_SEQ, DOT_BACKENDS, DOT_ARGS,
# KEYS_SEQ, KEYS_ARGS.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu-check}
LOGS="$OUT/logs"
mkdir -p "$LOGS"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if ! $PY -c "import megatron.core, deepspeed, datasets, pydantic" 2>/dev/null \
    && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
    > "$LOGS/install.log" 2>&1 || { echo "wheel install failed (see $LOGS/install.log)"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch-extensions}
export OUT LOGS PY
WORK=${WORK:-/tmp/gpu-check}  # run directories (checkpoints): not brought back
export WORK

stage_env() {
  nvidia-smi
  $PY - <<'EOF'
import importlib, json, platform, torch, triton
from triton.testing import do_bench
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
        "sm": torch.cuda.get_device_properties(0).multi_processor_count}
for name in ("megatron.core", "deepspeed", "transformers", "datasets", "flash_attn"):
    try:
        info[name] = importlib.import_module(name).__version__
    except Exception as exc:  # noqa: BLE001 - a report, not a check
        info[name] = f"missing ({type(exc).__name__})"
a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
ms = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
info["matmul_bf16_tflops"] = round(2 * 8192**3 / ms / 1e9, 1)
x = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)
y = torch.empty_like(x)
ms = do_bench(lambda: y.copy_(x), warmup=20, rep=200, return_mode="median")
info["copy_tb_s"] = round(2 * x.numel() * 2 / ms / 1e9, 2)
print(json.dumps(info, indent=1))
EOF
}

stage_tests() {
  local parallel=()  # pytest-xdist when present: each worker compiles its own kernels
  $PY -c "import xdist" 2>/dev/null && parallel=(-n "${PYTEST_WORKERS:-8}")
  # one compile thread per worker: inductor's compile pools kept xdist from exiting
  TORCHINDUCTOR_COMPILE_THREADS=1 $PY -m pytest -m gpu -p no:cacheprovider -v -rA "${parallel[@]}" \
    --junitxml="$OUT/gpu-tests.xml" tests
}

stage_e2e() {
  $PY -m pytest -p no:cacheprovider -q -rA \
    "tests/e2e/test_train.py::test_trains_checkpoints_and_resumes_exactly" \
    "tests/e2e/test_train.py::test_bf16_trains_like_fp32" \
    "tests/e2e/test_train.py::test_retrofit_trains_only_routers" \
    "tests/e2e/test_train.py::test_sigterm_saves_a_checkpoint_and_exits_cleanly" \
    tests/e2e/test_export.py
}

stage_recipe() {
  local run="$WORK/tiny-bf16"
  local rc=0
  $PY launchers/pretrain.py --config configs/tiny.yaml --set train.precision=bf16 \
    --set "train.steps=${RECIPE_STEPS:-300}" --set train.eval_interval=100 \
    --set train.save_interval=0 --set "run.output_dir=$run" \
    --set "data.cache_dir=$WORK/data-cache" || rc=$?
  cp "$run/metrics.jsonl" "$LOGS/tiny-bf16-metrics.jsonl" 2>/dev/null
  return $rc
}

stage_bench() {
  # shellcheck disable=SC2086
  $PY tools/bench_attention.py --seq ${BENCH_SEQ:-4096 16384 65536 262144 1048576} \
    --groups 4 8 --top-k 1 2 --heads 16 --head-dim 128 --dtype bf16 \
    --json "$OUT/bench_attention.json" --markdown "$LOGS/bench_attention.md" ${BENCH_ARGS:-}
}

stage_graphs() {
  # shellcheck disable=SC2086
  $PY tools/bench_attention.py --seq ${GRAPHS_SEQ:-4096 8192 16384 32768} --groups 8 \
    --top-k 1 2 --heads 16 --head-dim 128 --dtype bf16 --graphs \
    --json "$OUT/bench_graphs.json" --markdown "$LOGS/bench_graphs.md" ${GRAPHS_ARGS:-}
}

stage_train() {
  # shellcheck disable=SC2086
  $PY tools/bench_attention.py --seq ${TRAIN_SEQ:-8192 16384 32768} --groups 8 --no-hard \
    --heads 16 --head-dim 128 --dtype bf16 --train --backends ${TRAIN_BACKENDS:-triton flex} \
    --json "$OUT/bench_train.json" \
    --markdown "$LOGS/bench_train.md" ${TRAIN_ARGS:-}
}

stage_sparse_train() {
  # shellcheck disable=SC2086
  $PY tools/bench_attention.py --seq ${SPARSE_TRAIN_SEQ:-16384 65536 262144 1048576} --groups 8 \
    --top-k 1 --no-hard --heads 8 --head-dim 128 --dtype bf16 --train --train-modes hard \
    --backends ${SPARSE_TRAIN_BACKENDS:-triton flex} --warmup 1 --repeats 3 \
    --json "$OUT/bench_sparse_train.json" --markdown "$LOGS/bench_sparse_train.md" \
    ${SPARSE_TRAIN_ARGS:-}
}

stage_ring() {
  # shellcheck disable=SC2086
  $PY tools/bench_ring_step.py --json "$OUT/bench_ring.json" --markdown "$LOGS/bench_ring.md" \
    --kernels ${RING_KERNELS:-blockwise flex triton} ${RING_ARGS:-}
}

stage_mfu() {
  # shellcheck disable=SC2086
  $PY tools/measure_mfu.py --json "$OUT/mfu.json" --markdown "$LOGS/mfu.md" ${MFU_ARGS:-}
}

stage_mfu_triton() {
  # the tiles a 'tune' stage of this run measured, if any
  [ -f "$OUT/triton_tiles.json" ] && cp "$OUT/triton_tiles.json" focus_pretrain/focus/triton_tiles.json
  # shellcheck disable=SC2086
  $PY tools/measure_mfu.py --config configs/1b-8k.yaml ${MFU_TRITON_CONFIGS:-} \
    --set model.focus.backend=triton \
    --json "$OUT/mfu_triton.json" --markdown "$LOGS/mfu_triton.md" ${MFU_ARGS:-}
}

stage_dot() {
  # shellcheck disable=SC2086
  $PY tools/bench_attention.py --seq ${DOT_SEQ:-8192 16384 32768 65536} --groups 8 --top-k 1 \
    --no-hard --heads 16 --head-dim 128 --dtype bf16 --train --gate-forms dot \
    --backends ${DOT_BACKENDS:-sdpa flex triton} --warmup 2 --repeats 5 \
    --json "$OUT/bench_dot.json" --markdown "$LOGS/bench_dot.md" ${DOT_ARGS:-}
}

stage_decode() {
  local rc=0
  for batch in ${DECODE_BATCH:-1 8}; do
    # shellcheck disable=SC2086
    $PY tools/bench_decode.py --seq ${DECODE_SEQ:-16384 65536 262144} --batch "$batch" \
      --caches ${DECODE_CACHES:-dynamic static} \
      --groups 8 --top-k 1 --window 128 --layers 2 --heads 16 --head-dim 128 --dtype bf16 \
      --device cuda --json "$OUT/bench_decode_b$batch.json" \
      --markdown "$LOGS/bench_decode_b$batch.md" ${DECODE_ARGS:-} || rc=$?
  done
  return $rc
}

stage_generate() {
  # shellcheck disable=SC2086
  $PY tools/bench_decode.py --seq ${GENERATE_SEQ:-65536} --batch 1 --caches dynamic static \
    --generate ${GENERATE_TOKENS:-64} --steps 2 --warmup 1 \
    --groups 8 --top-k 1 --window 128 --layers 2 --heads 16 --head-dim 128 --dtype bf16 \
    --device cuda --json "$OUT/bench_generate.json" --markdown "$LOGS/bench_generate.md"
}

stage_keys() {
  # shellcheck disable=SC2086
  $PY tools/bench_attention.py --seq ${KEYS_SEQ:-8192 16384 32768} --groups 8 --top-k 1 2 \
    --heads 16 --head-dim 128 --dtype bf16 --train --key-groups own_and_previous \
    --backends flex --warmup 2 --repeats 5 --json "$OUT/bench_keys.json" \
    --markdown "$LOGS/bench_keys.md" ${KEYS_ARGS:-}
}

stage_tune() {
  cp focus_pretrain/focus/triton_tiles.json "$OUT/triton_tiles.json" 2>/dev/null
  # shellcheck disable=SC2086
  $PY tools/tune_triton.py --table "$OUT/triton_tiles.json" --json "$OUT/tune.json" \
    --lengths ${TUNE_LENGTHS:-8192 16384 32768 65536} --rivals ${TUNE_RIVALS:-flex} ${TUNE_ARGS:-}
}

ALL=(env tests e2e recipe bench graphs train sparse_train ring mfu mfu_triton tune dot keys decode generate)
# two sets sized for one device call each (about 9 minutes; each limit overridable)
QUICK=(env tests graphs train decode)
LONG=(graphs train sparse_train decode)
set_sizes() {  # quick|long: the sizes and limits of the set's stages, unless already set
  if [ "$1" = quick ]; then
    : "${TIMEOUT_env:=60}" "${TIMEOUT_tests:=240}" "${TIMEOUT_graphs:=70}" "${TIMEOUT_train:=70}"
    : "${TIMEOUT_decode:=120}" "${PYTEST_WORKERS:=14}" "${GRAPHS_SEQ:=4096 16384}" "${TRAIN_SEQ:=8192 16384}"
    : "${DECODE_SEQ:=65536}" "${DECODE_CACHES:=static}" "${GRAPHS_ARGS:=--top-k 1 --warmup 2 --repeats 5}"
  else
    : "${TIMEOUT_graphs:=120}" "${TIMEOUT_train:=100}" "${TIMEOUT_sparse_train:=180}"
    : "${TIMEOUT_decode:=120}" "${GRAPHS_SEQ:=32768}" "${TRAIN_SEQ:=32768}"
    : "${SPARSE_TRAIN_SEQ:=65536 262144}" "${DECODE_SEQ:=16384 262144}"
  fi
  export PYTEST_WORKERS TIMEOUT_env TIMEOUT_tests TIMEOUT_graphs TIMEOUT_train TIMEOUT_decode TIMEOUT_sparse_train
  export GRAPHS_SEQ GRAPHS_ARGS TRAIN_SEQ SPARSE_TRAIN_SEQ DECODE_SEQ DECODE_CACHES
}
STAGES=()
for name in "$@"; do
  case "$name" in
    quick) set_sizes quick; STAGES+=("${QUICK[@]}") ;;
    long) set_sizes long; STAGES+=("${LONG[@]}") ;;
    *) STAGES+=("$name") ;;
  esac
done
[ ${#STAGES[@]} -eq 0 ] && STAGES=("${ALL[@]}")
printf 'stage\texit\tseconds\n' > "$OUT/summary.tsv"
for stage in "${STAGES[@]}"; do
  if ! declare -F "stage_$stage" >/dev/null; then
    echo "unknown stage '$stage'; stages: ${ALL[*]}" >&2
    exit 2
  fi
  echo "=== $stage ($(date -u +%H:%M:%S))"
  start=$(date +%s)
  # a stage runs in its own process group under timeout: a hang cannot eat the whole lease
  limit_var="TIMEOUT_$stage"  # e.g. TIMEOUT_bench=300 overrides STAGE_TIMEOUT for one stage
  timeout -k 10 "${!limit_var:-${STAGE_TIMEOUT:-600}}" bash -c "$(declare -f "stage_$stage"); stage_$stage" \
    > "$LOGS/$stage.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$stage" "$rc" "$(( $(date +%s) - start ))" >> "$OUT/summary.tsv"
  tail -n 15 "$LOGS/$stage.log"
done
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$LOGS"
echo "=== summary"
column -t "$OUT/summary.tsv" 2>/dev/null || cat "$OUT/summary.tsv"
