"""Silero VAD weights: located in the installed wheel, read from ONNX, cached as safetensors.

Why not import `silero_vad`: its `__init__` imports torch, which Flare does not
need. Why not the wheel's `.jit` or any pickle: we never unpickle. The ONNX
file is the published artefact onnxruntime runs, so converting *its* 16 kHz
constants guarantees we compute what the reference computes. Conversion runs
once; the cache key is the ONNX file's SHA-256 so a new wheel is picked up.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path

import numpy as np

from flare.core.errors import ModelError

ONNX_NAME = "silero_vad.onnx"

# ONNX constant name suffix -> Flare weight name (16 kHz branch only).
_NAMES = {
    "stft.forward_basis_buffer": "stft.basis",            # [258, 1, 256]
    "encoder.0.reparam_conv.weight": "enc0.w", "encoder.0.reparam_conv.bias": "enc0.b",
    "encoder.1.reparam_conv.weight": "enc1.w", "encoder.1.reparam_conv.bias": "enc1.b",
    "encoder.2.reparam_conv.weight": "enc2.w", "encoder.2.reparam_conv.bias": "enc2.b",
    "encoder.3.reparam_conv.weight": "enc3.w", "encoder.3.reparam_conv.bias": "enc3.b",
    "decoder.rnn.weight_ih": "lstm.w_ih", "decoder.rnn.weight_hh": "lstm.w_hh",
    "decoder.rnn.bias_ih": "lstm.b_ih", "decoder.rnn.bias_hh": "lstm.b_hh",
    "decoder.decoder.2.weight": "head.w", "decoder.decoder.2.bias": "head.b",
}
WEIGHT_NAMES: tuple[str, ...] = tuple(_NAMES.values())


def package_dir(package: str) -> Path:
    """Directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        # --no-deps: the wheel declares PyTorch, which Flare never uses (scripts/install-python.sh)
        raise ModelError(f"package {package!r} is not installed "
                         f"(pip install --no-deps {package.replace('_', '-')})")
    return Path(list(spec.submodule_search_locations)[0])


def onnx_path() -> Path:
    """The silero_vad.onnx shipped in the silero-vad wheel."""
    path = package_dir("silero_vad") / "data" / ONNX_NAME
    if not path.is_file():
        raise ModelError(f"{path} is missing from the installed silero-vad package")
    return path


def cache_dir() -> Path:
    """<FLARE_CACHE_DIR or ~/.cache/flare>/silero-vad (created)."""
    from flare.core.cache import cache_dir as flare_cache_dir

    return flare_cache_dir("silero-vad")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def extract_from_onnx(path: Path) -> dict[str, np.ndarray]:
    """Read the 16 kHz branch's constants (the `then` branch of `If(sr == 16000)`)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    branch = None
    for node in model.graph.node:
        if node.op_type == "If":
            for attr in node.attribute:
                if attr.name == "then_branch":
                    branch = attr.g
    if branch is None:
        raise ModelError(f"{path}: no If(sr == 16000) node; not a silero VAD v5+ model")
    found: dict[str, np.ndarray] = {}
    for node in branch.node:
        if node.op_type != "Constant":
            continue
        out = node.output[0]
        for suffix, name in _NAMES.items():
            if out.endswith("__" + suffix):
                found[name] = np.ascontiguousarray(numpy_helper.to_array(node.attribute[0].t), dtype=np.float32)
    missing = sorted(set(WEIGHT_NAMES) - set(found))
    if missing:
        raise ModelError(f"{path}: 16 kHz branch lacks constants {missing}")
    return found


def load_weights(path: Path | None = None) -> dict[str, np.ndarray]:
    """Weights by Flare name, converted once into the cache and then read from it."""
    from safetensors.numpy import load_file, save_file

    path = Path(path) if path is not None else onnx_path()
    digest = file_sha256(path)[:16]
    cached = cache_dir() / f"silero_vad-16k-{digest}.safetensors"
    if cached.is_file():
        try:
            weights = load_file(str(cached))
            if set(weights) == set(WEIGHT_NAMES):
                return weights
        except Exception:  # a torn or foreign file: rebuild it below
            pass
    # reading the ONNX file takes seconds (importing onnx alone): say so, as a silent first run looks hung
    print(f"converting the Silero VAD weights from {path.name} (once, cached in {cached.parent})",
          file=sys.stderr, flush=True)
    weights = extract_from_onnx(path)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".tmp{os.getpid()}")
    save_file(weights, str(tmp), metadata={"source": str(path), "sha256": file_sha256(path)})
    os.replace(tmp, cached)  # atomic: a concurrent reader sees the old or the whole new file
    return weights
