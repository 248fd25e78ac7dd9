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
from types import ModuleType
from typing import Any

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


def _onnx_schema() -> ModuleType:
    """onnx's generated protobuf module (`ModelProto` & co.) without running `import onnx`.

    Importing the onnx package costs ~0.75 s of CPU (its `__init__` pulls in ml_dtypes), about a
    sixth of a cold `flare run silero-vad --backends vulkan`; reading a file needs only the
    generated schema, a plain protobuf module with no imports of its own. Loaded from the
    installed onnx by path (the same bytes `import onnx` registers later, which protobuf accepts
    as identical), or onnx's own module when onnx is already imported."""
    loaded = sys.modules.get("onnx.onnx_ml_pb2")
    if loaded is not None:
        return loaded
    spec = importlib.util.find_spec("onnx")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("onnx is not installed (pip install onnx): needed once to read silero_vad.onnx")
    source = Path(list(spec.submodule_search_locations)[0]) / "onnx_ml_pb2.py"
    try:
        schema_spec = importlib.util.spec_from_file_location("_flare_silero_onnx_ml_pb2", source)
        module = importlib.util.module_from_spec(schema_spec)
        schema_spec.loader.exec_module(module)
        return module
    except Exception:  # another onnx layout: the slow, documented way
        from onnx import onnx_ml_pb2

        return onnx_ml_pb2


FLOAT = 1  # TensorProto.FLOAT


def _float_array(tensor: Any) -> np.ndarray:
    """A float32 TensorProto as an array (raw little-endian bytes or `float_data`, as ONNX stores it)."""
    if tensor.data_type != FLOAT or tensor.external_data:
        raise ModelError(f"constant {tensor.name!r}: data type {tensor.data_type}, expected float32 stored inline")
    shape = tuple(int(d) for d in tensor.dims)
    if tensor.raw_data:
        return np.frombuffer(tensor.raw_data, dtype="<f4").astype(np.float32).reshape(shape)
    return np.asarray(tensor.float_data, dtype=np.float32).reshape(shape)


def extract_from_onnx(path: Path) -> dict[str, np.ndarray]:
    """Read the 16 kHz branch's constants (the `then` branch of `If(sr == 16000)`)."""
    model = _onnx_schema().ModelProto()
    try:
        model.ParseFromString(Path(path).read_bytes())
    except Exception as exc:  # protobuf's DecodeError: not an ONNX file
        raise ModelError(f"{path}: not a readable ONNX model ({exc})") from exc
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
                found[name] = np.ascontiguousarray(_float_array(node.attribute[0].t))
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
    # reading the ONNX file takes a moment: say so, as a silent first run looks hung
    print(f"converting the Silero VAD weights from {path.name} (once, cached in {cached.parent})",
          file=sys.stderr, flush=True)
    weights = extract_from_onnx(path)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".tmp{os.getpid()}")
    save_file(weights, str(tmp), metadata={"source": str(path), "sha256": file_sha256(path)})
    os.replace(tmp, cached)  # atomic: a concurrent reader sees the old or the whole new file
    return weights
