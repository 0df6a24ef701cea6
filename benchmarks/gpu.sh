#!/usr/bin/env bash
# The prepared device check for one lent H200 (nothing is downloaded there): full == HF greedy on CUDA,
# host syncs per decode step, engine vs transformers' generate, and the throughput benchmark at the paper's
# setting (random:qwen2:7b = R1-Distill-Qwen-7B's shape, bf16, budget 512, synthetic 128x4096 and 128x16384
# under one 9 GiB KV memory cap; full, R-KV, SnapKV, StreamingLLM and SkipKV, each cut after 25 s), then, in the
# time left, benchmarks/gpu_profile.py (wall vs GPU busy time per decode step, into $OUT/profile). Every step
# has a hard stop, the whole within SKIPKV_GPU_LIMIT seconds (default 420); the random 7B weights are drawn on
# the GPU (seconds, not minutes of CPU initialisation).
#
#   OUT=/path/to/dir bash benchmarks/gpu.sh                        # on the device (JSON + PNG into $OUT)
#   SKIPKV_GPU_SIZE=tiny SKIPKV_GPU_DEVICE=cpu bash benchmarks/gpu.sh # the CPU-sized variant of the same script
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/skipkv-gpu}"
SIZE="${SKIPKV_GPU_SIZE:-7b}"
DEVICE="${SKIPKV_GPU_DEVICE:-cuda}"
SECONDS_PER_RUN="${SKIPKV_GPU_SECONDS:-25}"
POLICIES="${SKIPKV_GPU_POLICIES:-full,rkv,snapkv,streaming_llm,skipkv}"
LIMIT="${SKIPKV_GPU_LIMIT:-420}"  # the whole script's wall-clock budget, seconds
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1  # nothing is fetched; output as it happens
start=$(date +%s)
echo "$(date -u +%T) start" | tee "$OUT/progress.txt"
# Every step has a hard stop (-k: SIGKILL 10 s after the SIGTERM, which a CUDA call can leave unanswered), so
# the script ends inside its budget whatever hangs, and what finished is already under $OUT.
timeout -k 10 60 python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', \
  torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '', \
  'transformers', transformers.__version__)" 2>&1 | tee "$OUT/env.txt"
if [ "$DEVICE" = cuda ]; then
  timeout -k 5 20 nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv >> "$OUT/env.txt" || true
fi
echo "$(date -u +%T) environment read" | tee -a "$OUT/progress.txt"
# gpu_run.py writes $OUT/gpu_report.json after every part.
left=$(( LIMIT - ($(date +%s) - start) - 15 ))
timeout -k 10 "$left" python benchmarks/gpu_run.py --size "$SIZE" --device "$DEVICE" --out "$OUT" \
  --seconds "$SECONDS_PER_RUN" --policies "$POLICIES" 2>&1 | tee "$OUT/gpu_run.log" || true
echo "$(date -u +%T) gpu_run done" | tee -a "$OUT/progress.txt"
# Where a decode step's time goes (wall vs GPU busy time, kernels per step; profiler tables) with what is left.
left=$(( LIMIT - ($(date +%s) - start) - 10 ))
if [ "$left" -gt 30 ]; then
  timeout -k 10 "$left" python benchmarks/gpu_profile.py --size "$SIZE" --device "$DEVICE" --out "$OUT/profile" \
    2>&1 | grep -v -E "USDT|[Ww]arn|forward_call" | tee "$OUT/gpu_profile.log" || true
fi
echo "$(date -u +%T) end" | tee -a "$OUT/progress.txt"
