#!/usr/bin/env bash
# SkipKV vs the baselines in the paper's setting, one command, for a machine with a GPU and hub access:
# an R1-distill model, MATH-500 and AIME24, budgets 768/1024/1536/2048 (the paper's R-KV budgets for
# R1-Qwen-14B / R1-Llama-8B on MATH-500), compression every 128 tokens, 16K new tokens at most, sampled
# pass@1 (temperature 0.6, top-p 0.95, 4 samples), printed as the paper's tables (accuracy and generation
# length per method x budget). Steps:
#   1. a steering vector from the model's own chains on MATH-500 400-499 (never evaluated), unless STEERING
#      names one (skipkv steer build: SEAL's recipe, layer picked by held-out AUC);
#   2. the sweep (full, R-KV, SnapKV, H2O, SkipKV eviction only, SkipKV + steering, SEAL) on MATH-500 0-399
#      and AIME24, written as a sweep file under OUT and run with `skipkv sweep` (re-running resumes);
#   3. benchmarks/paper_tables.py over the run directories.
#
#   bash benchmarks/reproduce_skipkv.sh deepseek-ai/DeepSeek-R1-Distill-Qwen-7B
#   OUT=runs/repro DEVICE=cuda bash benchmarks/reproduce_skipkv.sh deepseek-ai/DeepSeek-R1-Distill-Llama-8B
#
# Every setting is an environment variable (defaults = the paper's setting). The dry run that the tests run
# here, on CPU with a random model, sizes it down to seconds (only the hardware and the model are untested):
#   DEVICE=cpu DTYPE=fp32 BUDGETS=40 INTERVAL=8 WINDOW=4 MAX_NEW=24 SAMPLES=1 TEMPERATURE=0.6 LIMIT=2 \
#     AIME_LIMIT=1 STEERING=v.safetensors OUT=/tmp/repro bash benchmarks/reproduce_skipkv.sh random:qwen2
set -euo pipefail
MODEL="${1:?usage: reproduce_skipkv.sh MODEL (hub id, local folder or random:<family>)}"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-runs/reproduce_skipkv/$(echo "$MODEL" | tr '/:' '__')}"
DEVICE="${DEVICE:-cuda}"
DTYPE="${DTYPE:-bf16}"
BUDGETS="${BUDGETS:-768 1024 1536 2048}"
INTERVAL="${INTERVAL:-128}"
WINDOW="${WINDOW:-8}"
MAX_NEW="${MAX_NEW:-16384}"
SAMPLES="${SAMPLES:-4}"
TEMPERATURE="${TEMPERATURE:-0.6}"
TOP_P="${TOP_P:-0.95}"
LIMIT="${LIMIT:-400}"            # MATH-500 examples 0..LIMIT-1 (400-499 build the steering vector)
AIME_LIMIT="${AIME_LIMIT:-30}"
BATCH="${BATCH:-16}"
TAU="${TAU:-0.95}"
ALPHA0="${ALPHA0:--1.0}"         # the paper's scripts: -1 or -1.25, gamma 0.02
GAMMA="${GAMMA:-0.02}"
STEER_LIMIT="${STEER_LIMIT:-100}"
STEER_MAX_NEW="${STEER_MAX_NEW:-4096}"
mkdir -p "$OUT"

if [ -z "${STEERING:-}" ]; then
  LAYERS="${LAYERS:-$(python -c "
from transformers import AutoConfig
import sys
n = AutoConfig.from_pretrained(sys.argv[1]).num_hidden_layers
print(','.join(str(round(n * f)) for f in (0.5, 0.6, 0.7, 0.8)))" "$MODEL")}"
  STEERING="$OUT/steering.safetensors"
  [ -f "$STEERING" ] || skipkv steer build --model "$MODEL" --dataset math500 --offset 400 --limit "$STEER_LIMIT" \
    --layers "$LAYERS" --max-new-tokens "$STEER_MAX_NEW" --dtype "$DTYPE" --batch-size "$BATCH" \
    --out "$STEERING" | tee "$OUT/steering_build.log"
fi

budgets_yaml="[$(echo $BUDGETS | tr ' ' ',')]"
cat > "$OUT/sweep.yaml" <<YAML
# Written by benchmarks/reproduce_skipkv.sh for $MODEL.
model: $MODEL
out: $(realpath "$OUT")/runs
datasets:
  - {name: math500, limit: $LIMIT}
  - {name: aime24, limit: $AIME_LIMIT}
policies:
  - full
  - {name: rkv, interval: $INTERVAL, window: $WINDOW}
  - {name: snapkv, interval: $INTERVAL, window: $WINDOW}
  - {name: h2o, interval: $INTERVAL, window: $WINDOW}
  - {name: skipkv, interval: $INTERVAL, window: $WINDOW, tau: $TAU}
  - {name: skipkv, label: skipkv-steer, interval: $INTERVAL, window: $WINDOW, tau: $TAU,
     steering: $(realpath "$STEERING"), alpha0: $ALPHA0, gamma: $GAMMA}
  - {name: seal, steering: $(realpath "$STEERING"), alpha0: $ALPHA0}
budgets: $budgets_yaml
max_new_tokens: $MAX_NEW
samples: $SAMPLES
temperature: $TEMPERATURE
options: {top_p: $TOP_P, batch_size: $BATCH, dtype: $DTYPE, device: $DEVICE}
YAML
skipkv sweep "$OUT/sweep.yaml"
python benchmarks/paper_tables.py "$OUT/runs" | tee "$OUT/tables.md"
