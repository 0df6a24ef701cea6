#!/usr/bin/env bash
# Create NVIDIA's kvpress in its own venv (it caps transformers below skipkv's), for the kept-position overlap in
# benchmarks/kvpress_overlap/overlap.py. A benchmark, not a test: CI never installs kvpress.
#
#   bash benchmarks/kvpress_overlap/setup_venv.sh [VENV_DIR]        # default: ~/.cache/skipkv/kvpress-venv
#
# torch is installed first at the pinned version (an unpinned torch pulls CUDA wheels), then kvpress and a
# transformers inside its range (kvpress 0.5.5 wants transformers>=4.56,<5.3). Nothing is downloaded from a model
# hub: the model is built from a config by overlap.py.
set -euo pipefail
VENV="${1:-${SKIPKV_HOME:-$HOME/.cache/skipkv}/kvpress-venv}"
KVPRESS_VERSION="${KVPRESS_VERSION:-0.5.5}"
TRANSFORMERS_VERSION="${TRANSFORMERS_VERSION:-5.2.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "torch==$TORCH_VERSION"
"$VENV/bin/pip" install -q "kvpress==$KVPRESS_VERSION" "transformers==$TRANSFORMERS_VERSION" "torch==$TORCH_VERSION"
"$VENV/bin/python" -c "import kvpress, torch, transformers; from importlib.metadata import version; \
print('kvpress', version('kvpress'), 'torch', torch.__version__, 'transformers', transformers.__version__)"
echo "$VENV"
