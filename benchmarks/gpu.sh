#!/usr/bin/env bash
# The prepared device check for one lent H200 (nothing is downloaded there): full == HF greedy on CUDA,
# host syncs per decode step, engine vs transformers' generate, and the throughput benchmark at the paper's
# setting (random:qwen2:7b = R1-Distill-Qwen-7B's shape, bf16, budget 512, synthetic 128x4096 and 128x16384
# under one 9 GiB KV memory cap; full, R-KV, SnapKV, StreamingLLM and SkipKV, each cut after 25 s). Budgeted
# to finish within 8 minutes.
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
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), \
  torch.cuda.get_device_name(0) if torch.cuda.is_available() else '', 'transformers', transformers.__version__)" \
  | tee "$OUT/env.txt"
if [ "$DEVICE" = cuda ]; then nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv >> "$OUT/env.txt" || true; fi
# 470 s hard stop: whatever finished is already in $OUT/gpu_report.json (written after every part).
timeout 470 python benchmarks/gpu_run.py --size "$SIZE" --device "$DEVICE" --out "$OUT" \
  --seconds "$SECONDS_PER_RUN" --policies "$POLICIES" 2>&1 | tee "$OUT/gpu_run.log"
